"""The suite's own rules, each checked on generated test files run by pytest in a subprocess, with a negative control:
a test that hangs fails at its timeout, also where the alarm cannot reach it (tests/helpers/suite.py); the order is
random, modules kept whole, its seed printed; a test that leaves process-wide state changed fails, and the next test
gets the state as before (tests/helpers/global_state.py)."""

from __future__ import annotations

import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import trl.trainer.utils

from grpo_plus.compat.lm_head import FUSED_LM_HEAD_COLUMNS

TESTS = Path(__file__).resolve().parent
PATH = f"import sys\nsys.path.insert(0, {str(TESTS)!r})\n"
SUITE_HOOKS = PATH + "from helpers.suite import *  # noqa: F401, F403\n"
GUARD = PATH + "from helpers.global_state import global_state_kept, process_at_session_start  # noqa: F401\n"


def run_pytest(folder: Path, *flags: str, timeout: float = 300) -> tuple[subprocess.CompletedProcess, float]:
    """pytest on `folder` (its own rootdir: none of pyproject.toml's settings), and how long it took."""
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *flags, str(folder)],
        cwd=folder, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    return done, time.monotonic() - began


def outcomes(junit: Path) -> dict[str, tuple[str, str]]:
    """{test name: (passed | failure | error, message)}; a test with a teardown error is listed under both."""
    found: dict[str, tuple[str, str]] = {}
    for case in ET.parse(junit).iter("testcase"):
        kind = next((child for child in case if child.tag in ("failure", "error")), None)
        found[case.get("name")] = ("passed", "") if kind is None else (kind.tag, kind.get("message", ""))
    return found


def generated(tmp_path: Path, conftest: str, **modules: str) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "conftest.py").write_text(conftest)
    for name, text in modules.items():
        (tmp_path / f"{name}.py").write_text(text)
    return tmp_path


# ---- the per-test timeout --------------------------------------------------------------------------------------------

HANGS = """
import time

import pytest


@pytest.mark.timeout(2)
def test_hangs():
    time.sleep(120)


def test_after_it():
    pass
"""

# math-verify's parser does this in the main thread: signal.alarm(n), then signal.alarm(0), which cancels pytest-timeout's
# alarm as well; the test then sleeps past its timeout with nothing to stop it but the backstop.
TAKES_THE_ALARM = """
import signal
import time

import pytest


@pytest.mark.timeout(1)
def test_takes_the_alarm():
    signal.alarm(0)
    time.sleep({seconds})
"""


def test_a_test_that_hangs_fails_at_its_timeout_and_the_run_goes_on(tmp_path):
    folder = generated(tmp_path, SUITE_HOOKS, test_generated=HANGS)
    done, seconds = run_pytest(folder, "-p", "no:randomly", f"--junitxml={folder / 'junit.xml'}")
    found = outcomes(folder / "junit.xml")
    assert found["test_hangs"] == ("failure", "Failed: Timeout (>2.0s) from pytest-timeout."), done.stdout[-3000:]
    assert found["test_after_it"] == ("passed", "")
    assert seconds < 60, seconds  # not the 120 s sleep


@pytest.mark.engine  # its work is in child processes it starts (pytest runs, 9 s): make test-engines
def test_a_hang_the_alarm_cannot_reach_ends_the_run_at_the_backstop(tmp_path):
    """The backstop at 1.25x the timeout ends the run. The negative control: pytest-timeout's alarm alone (the hooks not
    loaded) lets the same test sleep on to its end and pass."""
    folder = generated(tmp_path / "backstop", SUITE_HOOKS, test_generated=TAKES_THE_ALARM.format(seconds=120))
    done, seconds = run_pytest(folder, "-p", "no:randomly")
    assert done.returncode != 0 and seconds < 60, (done.returncode, seconds)
    printed = done.stdout + done.stderr  # the message goes to the test's captured stderr, which the backstop prints
    assert "test_generated.py::test_takes_the_alarm still runs 1.25 s after it started" in printed, printed[-3000:]
    assert "+ Timeout +" in printed

    alone = generated(tmp_path / "alone", "", test_generated=TAKES_THE_ALARM.format(seconds=6))
    done, seconds = run_pytest(alone, "-p", "no:randomly")
    assert done.returncode == 0 and seconds >= 6, (done.stdout[-2000:], seconds)


# ---- the random order ------------------------------------------------------------------------------------------------

ORDERED_MODULE = """
from pathlib import Path

import pytest

LOG = Path(__file__).parent / "order.log"


@pytest.fixture(scope="module")
def expensive():
    with LOG.open("a") as log:
        log.write("setup {name}\\n")


@pytest.mark.parametrize("n", range(4))
def test_step(expensive, n):
    with LOG.open("a") as log:
        log.write(f"{name} {{n}}\\n")
"""


@pytest.mark.engine  # its work is in child processes it starts (pytest runs, 13 s): make test-engines
def test_the_order_is_random_per_seed_with_modules_whole_and_the_seed_printed(tmp_path):
    orders = {}
    for seed in (1, 2):
        folder = generated(
            tmp_path / f"seed{seed}", SUITE_HOOKS,
            test_a=ORDERED_MODULE.format(name="a"), test_b=ORDERED_MODULE.format(name="b"),
        )  # fmt: skip
        done, _ = run_pytest(folder, "-p", "randomly", f"--randomly-seed={seed}")
        assert done.returncode == 0, done.stdout[-3000:]
        assert f"Using --randomly-seed={seed}" in done.stdout  # under -q too (make test)
        assert f"Test order: -p randomly --randomly-seed={seed} runs this order again." in done.stdout
        lines = (folder / "order.log").read_text().split("\n")[:-1]
        setups = [line for line in lines if line.startswith("setup")]
        assert sorted(setups) == ["setup a", "setup b"], lines  # one module-scoped setup each: modules kept whole
        modules = [line.split()[-1] if line.startswith("setup") else line.split()[0] for line in lines]
        assert modules == sorted(modules) or modules == sorted(modules, reverse=True), lines
        orders[seed] = lines
    assert orders[1] != orders[2]
    same_seed = generated(
        tmp_path / "again", SUITE_HOOKS, test_a=ORDERED_MODULE.format(name="a"), test_b=ORDERED_MODULE.format(name="b")
    )
    run_pytest(same_seed, "-p", "randomly", "--randomly-seed=1")
    assert (same_seed / "order.log").read_text().split("\n")[:-1] == orders[1]  # a seed replays its order


# ---- process-wide state ----------------------------------------------------------------------------------------------

LEAKS = """
import logging

import torch
import trl.trainer.utils
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from grpo_plus.compat.lm_head import FUSED_LM_HEAD_COLUMNS
from grpo_plus.objective.common import WARNED_ONCE

THREADS = torch.get_num_threads()
TILE = getattr(trl.trainer.utils, FUSED_LM_HEAD_COLUMNS, None)  # None: TRL 1.14, no fused LM head
LEVEL = logging.getLogger("transformers").level


def test_1_leaves_the_thread_count_changed():
    torch.set_num_threads(THREADS + 1)


def test_2_gets_the_thread_count_as_before():
    assert torch.get_num_threads() == THREADS


def test_3_leaves_trls_tile_and_a_log_level_changed():
    if TILE is not None:
        setattr(trl.trainer.utils, FUSED_LM_HEAD_COLUMNS, 4096)
    logging.getLogger("transformers").setLevel(LEVEL + 10)


def test_4_gets_them_as_before():
    assert getattr(trl.trainer.utils, FUSED_LM_HEAD_COLUMNS, None) == TILE
    assert logging.getLogger("transformers").level == LEVEL


def test_5_undoes_what_it_changes(monkeypatch):
    monkeypatch.setattr(trl.trainer.utils, FUSED_LM_HEAD_COLUMNS, 4096, raising=False)
    monkeypatch.setattr(logging.getLogger("transformers"), "level", LEVEL + 10)


def test_6_warns_once():
    WARNED_ONCE.add("said once per process")


def test_7_starts_as_the_session_did():
    assert "said once per process" not in WARNED_ONCE


ACCELERATOR = Accelerator(cpu=True)  # as a trainer built by a module-scoped fixture holds one


def test_8_resets_accelerate_as_building_a_config_does():
    AcceleratorState._reset_state(reset_partial_state=True)  # TrainingArguments' device set-up


def test_9_the_accelerator_built_before_still_works():
    with ACCELERATOR.autocast():
        pass
"""


@pytest.mark.engine  # its work is in child processes it starts (pytest runs, 21 s): make test-engines
def test_a_test_that_leaves_state_changed_fails_and_the_next_gets_it_as_before(tmp_path):
    """The guard on the generated tests: the leaking ones error at teardown naming what they changed, and the tests after
    them see the state as before. The negative control: without the guard the leaks reach the next tests."""
    guarded = generated(tmp_path / "guarded", GUARD, test_generated=LEAKS)
    run_pytest(guarded, "-p", "no:randomly", f"--junitxml={guarded / 'junit.xml'}")
    found = outcomes(guarded / "junit.xml")
    kind, message = found["test_1_leaves_the_thread_count_changed"]
    assert kind == "error" and "left process-wide state changed" in message and "torch.get_num_threads()" in message
    kind, message = found["test_3_leaves_trls_tile_and_a_log_level_changed"]
    assert kind == "error" and "logging: (level, propagate, disabled) of each logger: {'transformers': (" in message
    tile = getattr(trl.trainer.utils, FUSED_LM_HEAD_COLUMNS, None)  # None: TRL 1.14, no fused LM head
    assert tile is None or f"trl.trainer.utils.{FUSED_LM_HEAD_COLUMNS}: {tile} -> 4096" in message, message
    for name in ("test_2_gets_the_thread_count_as_before", "test_4_gets_them_as_before",
                 "test_5_undoes_what_it_changes", "test_6_warns_once", "test_7_starts_as_the_session_did",
                 "test_8_resets_accelerate_as_building_a_config_does",
                 "test_9_the_accelerator_built_before_still_works"):  # fmt: skip
        assert found[name] == ("passed", ""), (name, found[name])

    unguarded = generated(tmp_path / "unguarded", "", test_generated=LEAKS)
    run_pytest(unguarded, "-p", "no:randomly", f"--junitxml={unguarded / 'junit.xml'}")
    found = outcomes(unguarded / "junit.xml")
    for name in ("test_2_gets_the_thread_count_as_before", "test_4_gets_them_as_before",
                 "test_7_starts_as_the_session_did", "test_9_the_accelerator_built_before_still_works"):  # fmt: skip
        assert found[name][0] == "failure", (name, found[name])
