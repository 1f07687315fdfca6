"""The rule that tests skip only below documented floors (tests/helpers/floors.py), checked on a generated test file
run by pytest in a subprocess, with its own floor table: above its floor a skip errors, naming the floor; below it,
the test skips; a skip that names no floor fails. And every floor is stated in the docs."""

from __future__ import annotations

import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from helpers.floors import FLOORS, ROOT, floor_row

from grpo_plus.compat.versions import VERSION_FLOORS

TESTS = Path(__file__).resolve().parent

# The floors of the generated run: "met" (the docs promise the thing here), "unmet" (they say it is not), "broken"
# (promised, but its detector finds it missing: a release that dropped it).
CONFTEST = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
from helpers import floors
from helpers.floors import (
    pytest_configure, pytest_make_collect_report, pytest_runtest_makereport, pytest_runtest_setup,
)

floors.FLOORS.clear()
floors.FLOORS.update(
    met=floors.Floor("met", "docs/page.md", lambda: None),
    unmet=floors.Floor("unmet", "docs/page.md", lambda: "somelib 1.0 < 2.0: it came in 2.0"),
    broken=floors.Floor("broken", "docs/page.md", lambda: None, lambda: "somelib 2.1 lost it"),
)
"""

TESTS_FILE = """
import pytest
from helpers.floors import skip_below_floor


@pytest.mark.floor("met")
def test_marker_met():
    pass


@pytest.mark.floor("unmet")
def test_marker_unmet():
    raise AssertionError("ran below its floor")


@pytest.mark.floor("broken")
def test_marker_detected_missing_above_the_floor():
    raise AssertionError("ran although the capability is missing")


def test_body_observes_it_missing_above_the_floor():
    skip_below_floor("met", missing="the run printed nothing")


def test_body_observes_it_missing_below_the_floor():
    skip_below_floor("unmet", missing="the run printed nothing")


def test_body_observes_it_there():
    skip_below_floor("met", missing=None)


def test_bare_skip():
    pytest.skip("no GPU here")


@pytest.mark.skipif(True, reason="TRL 1.14 has no fused LM head")
def test_skipif_by_detection():
    pass


def test_skip_naming_a_floor_that_is_met():
    pytest.skip("documented floor `met` not met (docs/page.md): stale")


@pytest.mark.xfail(reason="a known failure is not a skip", strict=True)
def test_xfail():
    raise AssertionError
"""

EXPECTED = {
    "test_marker_met": ("passed", ""),
    "test_marker_unmet": ("skipped", "documented floor `unmet` not met (docs/page.md): somelib 1.0 < 2.0"),
    "test_marker_detected_missing_above_the_floor": ("error", "floor `broken` (docs/page.md) is met here, so this "
                                                     "must work, but: somelib 2.1 lost it"),
    "test_body_observes_it_missing_above_the_floor": ("failure", "floor `met` (docs/page.md) is met here, so this "
                                                      "must work, but: the run printed nothing"),
    "test_body_observes_it_missing_below_the_floor": ("skipped", "documented floor `unmet` not met"),
    "test_body_observes_it_there": ("passed", ""),
    "test_bare_skip": ("failure", "skipped without a documented floor ('no GPU here')"),
    "test_skipif_by_detection": ("error", "skipped without a documented floor ('TRL 1.14 has no fused LM head')"),
    "test_skip_naming_a_floor_that_is_met": ("failure", "skipped by the documented floor `met`, which this "
                                             "environment meets"),
    "test_xfail": ("skipped", ""),  # junit's word for xfailed: left alone
}  # fmt: skip


def outcomes(junit: Path) -> dict[str, tuple[str, str]]:
    """{test name: (passed | skipped | failure | error, message)} from a junit XML report."""
    found = {}
    for case in ET.parse(junit).iter("testcase"):
        kind = next((child for child in case if child.tag in ("skipped", "failure", "error")), None)
        found[case.get("name")] = (
            ("passed", "") if kind is None else (kind.tag, kind.get("message", "") + (kind.text or ""))
        )
    return found


def run_pytest(folder: Path) -> dict[str, tuple[str, str]]:
    junit = folder / "junit.xml"
    subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--continue-on-collection-errors",
         f"--junitxml={junit}", str(folder)],
        cwd=folder, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    return outcomes(junit)


@pytest.fixture(scope="module")
def generated_run(tmp_path_factory) -> dict[str, tuple[str, str]]:
    folder = tmp_path_factory.mktemp("floors")
    (folder / "conftest.py").write_text(CONFTEST)
    (folder / "test_generated.py").write_text(TESTS_FILE)
    (folder / "test_skipped_module.py").write_text('import pytest\n\npytest.importorskip("no_such_module_here")\n')
    return run_pytest(folder)


@pytest.mark.engine  # its work is in a child process (moved out of make test: its 10-minute budget)
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_skip_fires_only_below_its_documented_floor(generated_run, name):
    kind, fragment = EXPECTED[name]
    got_kind, message = generated_run[name]
    assert got_kind == kind, f"{name}: {got_kind} ({message})"
    assert fragment in message, message


@pytest.mark.engine  # its work is in a child process (moved out of make test: its 10-minute budget)
def test_a_module_skipped_at_collection_without_a_floor_fails(generated_run):
    collected = [message for name, (kind, message) in generated_run.items() if "skipped_module" in name]
    assert collected and "skipped without a documented floor" in collected[0], generated_run


def test_the_versions_page_names_no_version_floor_the_code_does_not_have():
    page = (ROOT / "docs" / "guide" / "versions.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| \w+ (?:< [\d.]+ or )?>= [\d.]+ \|", page, re.MULTILINE)
    assert sorted(rows) == sorted(VERSION_FLOORS)


@pytest.mark.parametrize("name", sorted(FLOORS))
def test_every_floor_is_stated_on_its_page(name):
    floor = FLOORS[name]
    page = (ROOT / floor.documented).read_text()
    expected = floor_row(VERSION_FLOORS[name]) if name in VERSION_FLOORS else f"| `{name}` |"
    assert expected in page, f"{floor.documented} does not state the floor {name!r} ({expected!r})"
