"""The package layout: the library (grpo_plus.*) never imports the app kit (grpo_plus.app), and each app module has one
path (the aliases kept for the old paths grpo_plus.tasks / recipe / hub are gone: no released user had them)."""

import ast
import importlib
import importlib.resources
import importlib.util
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import grpo_plus

PACKAGE = Path(grpo_plus.__file__).parent
BENCHMARKS = PACKAGE.parent / "benchmarks"
# The app modules' paths before they moved into grpo_plus.app; nothing may answer to them now.
OLD_PATHS = ("grpo_plus.tasks", "grpo_plus.recipe", "grpo_plus.hub")
# The flat modules before the house's round 4 (a folder per concern), and where each went: none answers any more.
MOVED_MODULES = {
    "grpo_plus.trl_compat": "grpo_plus.compat",
    "grpo_plus.quantization": "grpo_plus.compat.bitsandbytes",
    "grpo_plus.sampler_mismatch": "grpo_plus.algorithms.rollout_correction",
    "grpo_plus.loss_metrics": "grpo_plus.algorithms.loss_metrics",
    "grpo_plus.selective_rollout": "grpo_plus.sampling.selective_rollout",
    "grpo_plus.train_pass": "grpo_plus.zero_waste.rows",
    "grpo_plus.generation": "grpo_plus.zero_waste.generation",
    "grpo_plus.multi_turn": "grpo_plus.zero_waste.multi_turn",
    "grpo_plus.multimodal": "grpo_plus.zero_waste.images",
    "grpo_plus.tiled_mlp": "grpo_plus.long_completions.tiled_mlp",
    "grpo_plus.lm_head_tiles": "grpo_plus.long_completions.lm_head_tiles",
    "grpo_plus.offloading": "grpo_plus.long_completions.offloading",
    "grpo_plus.training_state": "grpo_plus.run.state",
    "grpo_plus.checkpoints": "grpo_plus.run.checkpoints",
    "grpo_plus.faults": "grpo_plus.run.faults",
    "grpo_plus.health": "grpo_plus.run.health",
    "grpo_plus.validation": "grpo_plus.run.validation",
    "grpo_plus.distributed": "grpo_plus.run.distributed",
}
# Modules whose name is now a folder: what they held moved into it, and the folder does not re-export it.
MODULES_NOW_FOLDERS = {
    "grpo_plus.algorithms": ("AlgorithmSettings", "KLCoefficient", "local_advantages"),
    "grpo_plus.sampling": ("DynamicSampling", "DynamicSamplingSettings", "shuffle_groups"),
    "grpo_plus.zero_waste": ("ZeroWastePass", "PolicyForward"),
}
# The public face (__init__, config, trainer) and the base (registry, settings, plugins): nothing else at the top.
TOP_LEVEL_MODULES = {"__init__.py", "config.py", "trainer.py", "registry.py", "settings.py", "plugins.py"}


def imported_modules(path: Path) -> set[str]:
    """Absolute names of the grpo_plus modules a module of the package imports (relative imports resolved)."""
    package = ["grpo_plus", *path.parent.relative_to(PACKAGE).parts]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level <= len(package), f"{path}: an import above the package"
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return {name for name in names if name == "grpo_plus" or name.startswith("grpo_plus.")}


def test_the_library_never_imports_the_app():
    library = [path for path in sorted(PACKAGE.rglob("*.py")) if path.relative_to(PACKAGE).parts[0] != "app"]
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(
            name for name in imported_modules(path) if name.startswith("grpo_plus.app")
        )
        for path in library
    }
    assert {name: found for name, found in offenders.items() if found} == {}


def test_import_grpo_plus_loads_no_app_module():
    code = "import grpo_plus, sys; print(sorted(m for m in sys.modules if m.startswith('grpo_plus.app')))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("old", OLD_PATHS)
def test_an_app_module_has_one_path(old):
    """A newcomer should not wonder which of two modules is the real one."""
    name = old.rsplit(".", 1)[1]
    assert not (PACKAGE / f"{name}.py").exists() and not (PACKAGE / name).exists()
    assert not hasattr(grpo_plus, name)


@pytest.mark.floor("wheel_tools")
def test_the_wheel_ships_the_model_card_template(tmp_path):
    """A wheel built from pyproject.toml holds templates/model_card.md (setuptools leaves non-Python files out unless
    they are declared package data), and the installed package reads it through importlib.resources; the build warns
    about nothing in pyproject.toml."""
    source = tmp_path / "source"
    shutil.copytree(PACKAGE, source / "grpo_plus", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(PACKAGE.parent / name, source / name)
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v", "-w", str(tmp_path)]
    result = subprocess.run([*build, str(source)], check=True, capture_output=True, text=True)
    assert "deprecated" not in result.stdout + result.stderr  # e.g. setuptools on `project.license` as a table
    (wheel,) = tmp_path.glob("grpo_plus-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        shipped = archive.read("grpo_plus/app/templates/model_card.md")
    template = importlib.resources.files("grpo_plus.app") / "templates" / "model_card.md"
    assert shipped == template.read_bytes()


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_a_moved_module_has_one_path(old):
    """Each module has one path: the flat module it was is gone, its new home imports."""
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)
    importlib.import_module(MOVED_MODULES[old])


@pytest.mark.parametrize("folder", sorted(MODULES_NOW_FOLDERS))
def test_a_module_that_became_a_folder_re_exports_nothing(folder):
    module = importlib.import_module(folder)
    assert hasattr(module, "__path__")  # a package now
    assert [name for name in MODULES_NOW_FOLDERS[folder] if hasattr(module, name)] == []


def test_the_top_level_shows_the_concerns():
    """At most the public face and the base sit at grpo_plus/'s top; every other module lives in its concern's folder,
    and each folder is a package."""
    assert {path.name for path in PACKAGE.glob("*.py")} == TOP_LEVEL_MODULES
    folders = {path.name for path in PACKAGE.iterdir() if path.is_dir() and path.name != "__pycache__"}
    assert folders == {
        "objective", "algorithms", "sampling", "zero_waste", "long_completions", "run", "compat", "engine", "rewards",
        "fit", "app",
    }  # fmt: skip
    assert all((PACKAGE / folder / "__init__.py").exists() for folder in folders)


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


@pytest.mark.parametrize("old", ["grpo_plus.losses", "grpo_plus.advantages"])
def test_the_objective_has_one_path(old):
    """The objective's parts live in grpo_plus.objective alone: the old re-export modules are gone (the package was
    never released under them)."""
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)


def test_the_layout_page_names_every_module():
    """docs/guide/layout.md lists the library and the app kit module by module: a module added (or renamed) without
    a line there fails here, so the page cannot fall behind the code."""
    page = (PACKAGE.parent / "docs" / "guide" / "layout.md").read_text()
    named = set(re.findall(r"^  ((?:\w+/)*\w+\.py) ", page, re.M))  # a module line: two spaces, its path
    modules = {path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py")}
    assert modules - named == set(), "modules docs/guide/layout.md does not name"
    assert named - modules == set(), "docs/guide/layout.md names modules that do not exist"


def test_benchmarks_reach_shared_code_without_editing_sys_path():
    """What the benchmarks share with the tests (tiny models, rewards, the forward-position counter, TRL's loss on a
    stand-in) lives in grpo_plus.app.testing; a script that edited sys.path to reach tests/ would break when run from
    anywhere else."""
    scripts = sorted(BENCHMARKS.rglob("*.py"))  # the harness's modules too
    assert scripts and any(path.parent.name == "harness" for path in scripts)
    edits = [path.name for path in scripts if "sys.path" in path.read_text()]
    reaching_into_tests = [
        path.name for path in scripts if re.search(r"^\s*from (helpers|trl_oracle)\b", path.read_text(), re.M)
    ]
    assert (edits, reaching_into_tests) == ([], [])


def absolute_imports(source: str) -> list[str]:
    """Every module a Python source imports by absolute name, at any depth (inside functions too)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append(node.module)
    return found


def benchmark_imports(source: str, benchmarks: set[str]) -> tuple[list[str], bool, bool]:
    """What a benchmark's source imports of `benchmarks` (the scripts' names), whether it imports the harness, and
    whether it builds its own command line (argparse.ArgumentParser) instead of harness.flags'."""
    modules = absolute_imports(source)
    siblings = [name for name in modules if name.split(".")[0] in benchmarks]
    return siblings, any(name.split(".")[0] == "harness" for name in modules), "ArgumentParser(" in source


def test_every_benchmark_uses_the_harness_and_none_imports_another():
    """benchmarks/harness/ is what the benchmarks share (building both trainers, timing, flags, the report); a benchmark
    that imported another benchmark script would make that script a second, hidden harness."""
    scripts = sorted(BENCHMARKS.glob("*.py"))
    names = {path.stem for path in scripts}
    assert {"train_pass", "generation", "gpu"} <= names and "harness" not in names
    # negative controls: an import of a sibling is found wherever it stands and however it is written; a script
    # without the harness, or with its own parser, is told apart
    source = "import os\ndef f():\n    from train_pass import demo_settings\n    import generation.sub, json\n"
    assert benchmark_imports(source, names) == (["train_pass", "generation.sub"], False, False)
    source = "import argparse\nfrom harness.report import write_report\nparser = argparse.ArgumentParser()\n"
    assert benchmark_imports(source, names) == ([], True, True)

    found = {path.relative_to(BENCHMARKS).as_posix(): benchmark_imports(path.read_text(), names) for path in scripts}
    assert {script: siblings for script, (siblings, _, _) in found.items() if siblings} == {}
    assert [script for script, (_, harness, _) in found.items() if not harness] == []
    assert [script for script, (_, _, own_parser) in found.items() if own_parser] == []
    harness = {path.name: benchmark_imports(path.read_text(), names)[0] for path in BENCHMARKS.glob("harness/*.py")}
    assert {module: siblings for module, siblings in harness.items() if siblings} == {}
