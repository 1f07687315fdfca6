"""The package layout: the library (grpo_plus.*) never imports the app kit (grpo_plus.app), and the app modules' old
paths still import, as the very same module objects."""

import ast
import importlib
import importlib.resources
import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import grpo_plus

PACKAGE = Path(grpo_plus.__file__).parent
# Old path -> new path of the app modules users import (the README's grpo_plus.tasks, the recipes' grpo_plus.recipe,
# grpo_plus.hub's public push / merge / card helpers).
OLD_PATHS = {
    "grpo_plus.tasks": "grpo_plus.app.tasks",
    "grpo_plus.recipe": "grpo_plus.app.recipe",
    "grpo_plus.hub": "grpo_plus.app.hub",
}
ALIAS_FILES = {f"{old.rsplit('.', 1)[1]}.py" for old in OLD_PATHS}


def imported_modules(path: Path) -> set[str]:
    """Absolute names of the grpo_plus modules a top-level module of the package imports (relative imports
    resolved)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = "grpo_plus" if node.level == 1 else "" if node.level == 0 else None
            assert base is not None, f"{path.name}: a top-level module cannot import {'.' * node.level}"
            module = ".".join(part for part in (base, node.module) if part)
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return {name for name in names if name == "grpo_plus" or name.startswith("grpo_plus.")}


def test_the_library_never_imports_the_app():
    offenders = {
        path.name: sorted(name for name in imported_modules(path) if name.startswith("grpo_plus.app"))
        for path in sorted(PACKAGE.glob("*.py"))
        if path.name not in ALIAS_FILES
    }
    assert {name: found for name, found in offenders.items() if found} == {}


def test_import_grpo_plus_loads_no_app_module():
    code = "import grpo_plus, sys; print(sorted(m for m in sys.modules if m.startswith('grpo_plus.app')))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize(("old", "new"), OLD_PATHS.items())
def test_an_old_app_path_is_the_moved_module(old, new):
    moved = importlib.import_module(new)
    assert importlib.import_module(old) is moved
    parent, name = old.rsplit(".", 1)
    assert getattr(importlib.import_module(parent), name) is moved  # `from grpo_plus import tasks` too


def test_old_paths_import_first_in_a_fresh_process():
    """Before anything imported grpo_plus.app (a user's script on the old path): the old path alone loads it."""
    code = (
        "from grpo_plus.hub import push_adapter\n"
        "from grpo_plus import tasks\n"
        "import grpo_plus.app.hub, grpo_plus.app.tasks\n"
        "assert tasks is grpo_plus.app.tasks and push_adapter is grpo_plus.app.hub.push_adapter\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.skipif(
    importlib.util.find_spec("pip") is None or importlib.util.find_spec("setuptools") is None,
    reason="building a wheel needs pip and setuptools in this environment (uv-made matrix environments have neither)",
)
def test_the_wheel_ships_the_model_card_template(tmp_path):
    """A wheel built from pyproject.toml holds templates/model_card.md (setuptools leaves non-Python files out unless
    they are declared package data), and the installed package reads it through importlib.resources."""
    source = tmp_path / "source"
    shutil.copytree(PACKAGE, source / "grpo_plus", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(PACKAGE.parent / name, source / name)
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path)]
    subprocess.run([*build, str(source)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("grpo_plus-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        shipped = archive.read("grpo_plus/app/templates/model_card.md")
    template = importlib.resources.files("grpo_plus.app") / "templates" / "model_card.md"
    assert shipped == template.read_bytes()


def test_the_objective_core_imports_only_torch_and_the_registry():
    """grpo_plus.objective (estimators, policy losses, KL, aggregation, importance sampling) and the registry it shares
    import torch and the standard library only: any training loop can use them without TRL."""
    outside = {}
    for path in sorted([*(PACKAGE / "objective").glob("*.py"), PACKAGE / "registry.py"]):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.level:
                target = f"{'.' * node.level}{node.module or ''}"
                allowed = node.level == 1 or (node.level == 2 and node.module == "registry")
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module]
                target = ", ".join(names)
                allowed = all(name.split(".")[0] in (*sys.stdlib_module_names, "torch") for name in names)
            else:
                continue
            if not allowed:
                outside.setdefault(path.name, []).append(target)
    assert outside == {}


def test_the_old_core_paths_give_the_objective_packages_objects():
    import grpo_plus.advantages
    import grpo_plus.losses
    import grpo_plus.objective as objective

    for name in grpo_plus.losses.__all__:
        assert getattr(grpo_plus.losses, name) is getattr(objective, name), name
    for name in ("ADVANTAGE_NORMALIZERS", "compute_advantages", "register_advantage_normalizer", "combine_rewards"):
        assert getattr(grpo_plus.advantages, name) is getattr(objective, name), name
