"""constraints.txt, the versions `make install` pins (issue 32): inside the package's own ranges, covering every
dependency, and what .venv really holds."""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "constraints.txt"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
INSTALLED_SEPARATELY = {"torch"}  # TORCH_SPEC: the machine's own build


def locked() -> dict[str, str]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, pinned = line.partition("==")
            assert pinned, f"constraints.txt: {line!r} is not an exact pin (name==version)"
            pins[canonicalize_name(name)] = pinned.strip()
    return pins


def requirements() -> list[Requirement]:
    """The runtime requirements and those of every extra `make install` asks for."""
    project = PYPROJECT["project"]
    extras = [req for group in project["optional-dependencies"].values() for req in group]
    return [Requirement(text) for text in [*project["dependencies"], *extras]]


def test_every_requirement_is_pinned_inside_its_range():
    pins = locked()
    for requirement in requirements():
        name = canonicalize_name(requirement.name)
        if name in INSTALLED_SEPARATELY or name == "grpo-plus":
            continue
        assert name in pins, f"{requirement} is not pinned in constraints.txt"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"constraints.txt pins {name}=={pins[name]}, outside pyproject.toml's {requirement}"
        )
    assert "torch" not in pins, "torch is the machine's own build (TORCH_SPEC), not the lock's"


@pytest.mark.skipif(Path(sys.prefix).resolve() != (ROOT / ".venv").resolve(), reason="runs in make install's .venv")
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
