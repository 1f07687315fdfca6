"""Process-wide state one test could change and every later test in the same pytest process would inherit. The suite
runs in a random order (pytest-randomly), so such a change makes another test's outcome depend on the order; the
autouse fixture `global_state_kept` in tests/conftest.py applies what is here around every test.

Three kinds:
- KNOBS: settings a test may change for itself only, undoing the change (monkeypatch, try/finally). A test that leaves
  one changed fails, naming it, and the knob is put back, so the tests after it run as before.
- ONCE_ONLY: what grpo_plus remembers having said or done once per process (warnings shown once, entry points
  loaded). Running the code adds to them, so no test is asked to undo that: each test starts from the session's
  start instead, as it would in a fresh process.
- ACCELERATE's state: one per process (PartialState, AcceleratorState, GradientState, class-level dicts every instance
  shares), which building any TrainingArguments (a GRPOConfig) clears. A trainer a module-scoped fixture built earlier
  then fails in `accelerator.autocast()` ("Please make sure to properly initialize your accelerator") after any test
  that built only a config. Building configs is what tests do, so each test ends with the state it started with.
The registries are conftest's `restore_registries`, the environment variables its `restore_environment`.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch


@dataclass(frozen=True)
class Knob:
    name: str
    get: Callable[[], Any]
    put: Callable[[Any], None]


def _module_attribute(module_name: str, attribute: str) -> Knob | None:
    module = importlib.import_module(module_name)
    if not hasattr(module, attribute):  # e.g. TRL 1.14 has no fused LM head, so no tile width
        return None
    return Knob(
        f"{module_name}.{attribute}", lambda: getattr(module, attribute), lambda v: setattr(module, attribute, v)
    )


def _deterministic() -> tuple[bool, bool]:
    return torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()


def _put_deterministic(value: tuple[bool, bool]) -> None:
    torch.use_deterministic_algorithms(value[0], warn_only=value[1])


def _loggers() -> dict[str, tuple[int, bool, bool]]:
    """Level, propagate and disabled of every logger that exists (transformers' verbosity is its logger's level)."""
    loggers = {"": logging.getLogger()}
    loggers.update((n, lg) for n, lg in logging.Logger.manager.loggerDict.items() if isinstance(lg, logging.Logger))
    return {name: (lg.level, lg.propagate, lg.disabled) for name, lg in loggers.items()}


def _put_loggers(states: dict[str, tuple[int, bool, bool]]) -> None:
    for name, (level, propagate, disabled) in states.items():
        lg = logging.getLogger(name or None)
        lg.setLevel(level)
        lg.propagate, lg.disabled = propagate, disabled


def _put_default_device(device: torch.device) -> None:
    # None, not "cpu": setting any device installs a function mode every later torch call goes through
    torch.set_default_device(None if device == torch.device("cpu") else device)


def _put_list(target: list) -> Callable[[list], None]:
    def put(value: list) -> None:
        target[:] = value

    return put


def _signal_knob(number: signal.Signals) -> Knob:
    return Knob(
        f"signal handler of {number.name}", lambda: signal.getsignal(number), lambda v: signal.signal(number, v)
    )


def knobs() -> list[Knob]:
    """The settings no test may leave changed. Loggers that did not exist before a test (a library imported for the
    first time) are not compared: only the ones that did."""
    from grpo_plus.compat.lm_head import FUSED_LM_HEAD_COLUMNS

    found = [
        # TRL's LM-head tile width, a module global read at each call (tests/test_memory_real.py once left it at 4,096)
        _module_attribute("trl.trainer.utils", FUSED_LM_HEAD_COLUMNS),
        Knob("torch.get_num_threads()", torch.get_num_threads, torch.set_num_threads),
        Knob("torch.get_default_dtype()", torch.get_default_dtype, torch.set_default_dtype),
        Knob("torch's deterministic algorithms (enabled, warn only)", _deterministic, _put_deterministic),
        Knob("torch.is_grad_enabled()", torch.is_grad_enabled, torch.set_grad_enabled),
        Knob("torch.is_anomaly_enabled()", torch.is_anomaly_enabled, torch.set_anomaly_enabled),
        Knob(
            "torch.get_float32_matmul_precision()",
            torch.get_float32_matmul_precision,
            torch.set_float32_matmul_precision,
        ),
        Knob("logging: (level, propagate, disabled) of each logger", _loggers, _put_loggers),
        Knob("logging.disable()", lambda: logging.root.manager.disable, logging.disable),
        Knob("sys.path", lambda: list(sys.path), _put_list(sys.path)),
        Knob("the working directory", os.getcwd, os.chdir),
        _signal_knob(signal.SIGINT),
        _signal_knob(signal.SIGTERM),
    ]
    if hasattr(torch, "get_default_device"):  # torch >= 2.3
        found.append(Knob("torch.get_default_device()", torch.get_default_device, _put_default_device))
    return [knob for knob in found if knob is not None]


def snapshot(kept: list[Knob]) -> dict[str, Any]:
    return {knob.name: knob.get() for knob in kept}


def _differs(name: str, before: Any, now: Any) -> bool:
    if name.startswith("logging: "):  # only loggers that existed before
        return any(now.get(logger) != state for logger, state in before.items())
    return now != before


def put_back(kept: list[Knob], before: dict[str, Any]) -> list[str]:
    """Put every knob changed since `before` back; what each was changed to, one line per knob."""
    changed = []
    for knob in kept:
        now = knob.get()
        if _differs(knob.name, before[knob.name], now):
            if knob.name.startswith("logging: "):
                now = {name: now.get(name) for name, state in before[knob.name].items() if now.get(name) != state}
                was = {name: before[knob.name][name] for name in now}
            else:
                was = before[knob.name]
            changed.append(f"{knob.name}: {was!r} -> {now!r}")
            knob.put(before[knob.name])
    return changed


# ---- once per process ------------------------------------------------------------------------------------------------

ONCE_ONLY = (
    ("grpo_plus.objective.common", "WARNED_ONCE"),  # the loss's warnings
    ("grpo_plus.compat.versions", "_warned_versions"),  # "TRL x.y is not a tested version"
    ("grpo_plus.run.state", "_warned"),
    ("grpo_plus.long_completions.tiled_mlp", "_noted"),  # why an MLP runs whole
    ("grpo_plus.long_completions.lm_head_tiles", "_noted"),  # the 'auto' tile width
    ("grpo_plus.plugins", "_loaded_entry_points"),  # their modes are restored with the registries (conftest)
)


def once_only_sets() -> dict[str, set]:
    return {f"{module}.{name}": getattr(importlib.import_module(module), name) for module, name in ONCE_ONLY}


def reset_once_only(at_start: dict[str, set]) -> None:
    """Each once-only set as it was at the session's start (the same set objects: code holds references to them)."""
    for name, current in once_only_sets().items():
        current.clear()
        current.update(at_start[name])


def accelerate_states() -> list[dict]:
    """accelerate's process-wide state: the dicts its Borg classes share (`_reset_state` clears them in place)."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    return [PartialState._shared_state, AcceleratorState._shared_state, GradientState._shared_state]


def put_back_in_place(states: list[dict], saved: list[dict]) -> None:
    for state, before in zip(states, saved, strict=True):
        state.clear()
        state.update(before)


# ---- the fixture (tests/conftest.py imports it) ----------------------------------------------------------------------


@pytest.fixture(scope="session")
def process_at_session_start() -> tuple[list[Knob], dict[str, set]]:
    return knobs(), {name: set(values) for name, values in once_only_sets().items()}


@pytest.fixture(autouse=True)
def global_state_kept(request, process_at_session_start):
    """Every test starts with grpo_plus's once-only notes as at the session's start, ends with accelerate's state as it
    began, and fails if it leaves a knob changed (after putting it back). Function-scoped fixtures (monkeypatch,
    caplog) have undone theirs by then."""
    kept, notes_at_start = process_at_session_start
    reset_once_only(notes_at_start)
    before, accelerate_before = snapshot(kept), [dict(state) for state in accelerate_states()]
    yield
    put_back_in_place(accelerate_states(), accelerate_before)
    changed = put_back(kept, before)
    if changed:
        pytest.fail(
            f"{request.node.nodeid} left process-wide state changed, which every later test would inherit (put back "
            "now; undo it in the test: monkeypatch, or try/finally):\n  " + "\n  ".join(changed),
            pytrace=False,
        )
