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
import yaml

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


def test_the_vllm_servers_processes_import_no_trainer():
    """`grpo-plus vllm-serve` on a CPU is four processes in turn (the command, then vLLM's API server, engine core and
    worker), each importing grpo_plus.engine (the gloo transport is a vLLM plugin every vLLM process loads): TRL's
    and transformers' trainers there cost ~15 s of imports per process (the embedded model's server started in 110 s
    with them, 78 s without, on this 2-core machine)."""
    trainers = ("grpo_plus.compat.versions", "grpo_plus.trainer", "trl.trainer.grpo_trainer", "transformers.trainer")
    code = (
        "import sys, grpo_plus.app.cli, grpo_plus.engine.gloo_transport, grpo_plus.engine.server; "
        f"print(sorted(m for m in {trainers!r} if m in sys.modules))"
    )
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
        "fit", "app", "async_generation", "speculative", "routing", "partial_rollouts",
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


# ---- the trainer is wiring; TRL's private names live in compat/ ------------------------------------------------------

TRAINER_MAX_LINES = 450


def test_the_trainer_stays_wiring():
    """grpo_plus/trainer.py holds the overrides and their wiring, each a few lines calling the concern folder that holds
    the capability: a capability written into the trainer instead pushes it past the limit."""
    lines = len((PACKAGE / "trainer.py").read_text().splitlines())
    assert lines <= TRAINER_MAX_LINES, f"grpo_plus/trainer.py has {lines} lines (at most {TRAINER_MAX_LINES})"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_trl_reads(source: str) -> list[str]:
    """Where `source` reaches a private name of TRL: `from trl... import _name`, `<name bound to a TRL import>._name`
    (`trl.trainer.utils._x`, `chunked_logprob._x`, `GRPOTrainer._method`), or getattr / setattr / hasattr / delattr on a
    name bound to a TRL import (how a private name is reached by a string)."""
    tree = ast.parse(source)
    bound, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "trl":
                    bound.add(alias.asname or "trl")
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "trl":
            for alias in node.names:
                bound.add(alias.asname or alias.name)
                if _private(alias.name):
                    found.append(f"line {node.lineno}: from {node.module} import {alias.name}")

    def root(node: ast.AST) -> str | None:
        while isinstance(node, ast.Attribute):
            node = node.value
        return node.id if isinstance(node, ast.Name) else None

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and root(node.value) in bound:
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and node.args
            and root(node.args[0]) in bound
        ):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_only_compat_reaches_trls_private_names():
    """TRL may change a private name in any release: every read of one (its fused LM head's tile width and forward,
    its kernels, its private methods) lives in grpo_plus/compat/, one module per seam, so that a TRL release is one
    edit there."""
    outside = {
        str(path.relative_to(PACKAGE)): private_trl_reads(path.read_text())
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).parts[0] != "compat"
    }
    assert {path: reads for path, reads in outside.items() if reads} == {}


def test_the_private_name_check_finds_each_way_in():
    """Negative control: each way of reaching a private TRL name is found, a public one is not, and the check finds
    what compat/ itself reads (it is not blind on the real code)."""
    reaches = {
        "from trl.trainer.utils import _ChunkedLogProbFunction": 1,
        "import trl.trainer.utils as u\nu._CHUNKED_LOGPROB_CHUNK_SIZE = 4096": 1,
        "import trl\nx = trl.trainer.utils._use_triton": 1,
        "from trl.kernels import chunked_logprob\nchunked_logprob._use_triton('cpu')": 1,
        "from trl import GRPOTrainer\nGRPOTrainer._compute_loss(t, m, i)": 1,
        "import trl.trainer.utils as u\ngetattr(u, '_ChunkedLogProbFunction')": 1,
        "from trl import GRPOTrainer, GRPOConfig\nGRPOConfig(output_dir='x')\nGRPOTrainer.__init__": 0,
        "import trl\nprint(trl.__version__)\nclass T(trl.GRPOTrainer):\n    def f(self): return super()._x()": 0,
        "import torch\ntorch._C._log_api_usage_once('x')": 0,
    }
    assert {source: len(private_trl_reads(source)) for source in reaches} == reaches
    in_compat = sum(
        len(private_trl_reads((PACKAGE / "compat" / name).read_text())) for name in ("lm_head.py", "loss.py")
    )
    assert in_compat >= 3  # the tile width, `_use_triton`, TRL's own log-prob method


# ---- the API reference: one page per concern, each module documented once, on its folder's page --------------------

REFERENCE = PACKAGE.parent / "docs" / "reference"
# The page of the modules at grpo_plus/'s top (the public face and the base); a folder's page is named after the folder
# (zero_waste/ -> zero-waste.md). index.md is the reference's overview and documents no module.
TOP_LEVEL_PAGE = "public.md"
MODULE_BLOCK = re.compile(r"^::: (\S+)[ \t]*$", re.M)  # mkdocstrings' `::: identifier` line (options may follow)


def is_private(path: Path) -> bool:
    """A private helper (a part of its path with one leading underscore, e.g. rewards/_main_thread_worker.py, run by
    path as its own process): the reference leaves it out. __init__ and __main__ are documented."""
    return any(part.startswith("_") and not part.startswith("__") for part in path.parts)


def documented_modules(package: Path) -> dict[str, str]:
    """Every public module of the package (its dotted name) -> the reference page that must document it."""
    pages = {}
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package.parent).with_suffix("")
        if is_private(relative):
            continue
        parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
        folder = relative.parts[1] if len(relative.parts) > 2 else None  # grpo_plus/<folder>/<module>
        pages[".".join(parts)] = f"{folder.replace('_', '-')}.md" if folder else TOP_LEVEL_PAGE
    return pages


def nav_pages(mkdocs_yml: str) -> set[str]:
    """The pages mkdocs.yml's nav lists, relative to docs/."""

    def walk(entry):
        if isinstance(entry, str):
            yield entry
        elif isinstance(entry, dict):
            for value in entry.values():
                yield from walk(value)
        elif isinstance(entry, list):
            for value in entry:
                yield from walk(value)

    return set(walk(yaml.safe_load(mkdocs_yml)["nav"]))


def reference_problems(modules: dict[str, str], pages: dict[str, str], nav: set[str]) -> list[str]:
    """What is wrong with the reference: `modules` maps each module to its page (documented_modules), `pages` each
    reference page's name to its text, `nav` the pages in mkdocs.yml's nav. Empty when every module has exactly one
    `:::` block, on its own page, and every page is in the nav."""
    found: dict[str, list[str]] = {}
    for page, text in sorted(pages.items()):
        for module in MODULE_BLOCK.findall(text):
            found.setdefault(module, []).append(page)
    problems = [
        f"{module} has no `:::` block (its page: {page})" for module, page in modules.items() if module not in found
    ]
    for module, where in sorted(found.items()):
        if module not in modules:
            problems.append(f"`::: {module}` on {', '.join(where)} names no public module of grpo_plus")
        elif len(where) > 1:
            problems.append(f"{module} is documented {len(where)} times: {', '.join(where)}")
        elif where != [modules[module]]:
            problems.append(f"{module} is documented on {where[0]}, its folder's page is {modules[module]}")
    problems += [
        f"reference/{page} is not in mkdocs.yml's nav" for page in sorted(pages) if f"reference/{page}" not in nav
    ]
    return problems


def reference_pages() -> dict[str, str]:
    return {path.name: path.read_text() for path in sorted(REFERENCE.glob("*.md"))}


def test_the_reference_documents_every_module_once_on_its_folders_page():
    """docs/reference/ has a page per concern folder (and one for the top level): a module added without its `:::`
    line on its folder's page, documented twice or on another folder's page, or a page left out of the nav, fails
    here. A new module needs only its `:::` line on its folder's page."""
    modules = documented_modules(PACKAGE)
    assert "grpo_plus.rewards._main_thread_worker" not in modules and "grpo_plus.fit.__main__" in modules
    nav = nav_pages((PACKAGE.parent / "mkdocs.yml").read_text())
    assert reference_problems(modules, reference_pages(), nav) == []
    assert set(modules.values()) == set(reference_pages()) - {"index.md"}  # no page without a concern


def test_the_reference_check_finds_what_it_guards():
    """Negative controls for the check above, on the real pages: each defect is reported, and a new module is one
    `:::` line on its folder's page."""
    modules = documented_modules(PACKAGE)
    pages = reference_pages()
    nav = nav_pages((PACKAGE.parent / "mkdocs.yml").read_text())
    assert reference_problems(modules, pages, nav) == []

    without = {**pages, "run.md": pages["run.md"].replace("::: grpo_plus.run.faults\n", "")}
    assert reference_problems(modules, without, nav) == ["grpo_plus.run.faults has no `:::` block (its page: run.md)"]

    twice = {**pages, "run.md": pages["run.md"] + "\n::: grpo_plus.run.faults\n"}
    assert reference_problems(modules, twice, nav) == ["grpo_plus.run.faults is documented 2 times: run.md, run.md"]

    elsewhere = {**without, "app.md": pages["app.md"] + "\n::: grpo_plus.run.faults\n"}
    assert reference_problems(modules, elsewhere, nav) == [
        "grpo_plus.run.faults is documented on app.md, its folder's page is run.md"
    ]

    gone = {**pages, "run.md": pages["run.md"] + "\n::: grpo_plus.run.gone\n"}
    assert reference_problems(modules, gone, nav) == [
        "`::: grpo_plus.run.gone` on run.md names no public module of grpo_plus"
    ]

    assert reference_problems(modules, pages, nav - {"reference/sampling.md"}) == [
        "reference/sampling.md is not in mkdocs.yml's nav"
    ]

    added = {**modules, "grpo_plus.zero_waste.new_saving": "zero-waste.md"}
    assert reference_problems(added, pages, nav) == [
        "grpo_plus.zero_waste.new_saving has no `:::` block (its page: zero-waste.md)"
    ]
    with_line = {**pages, "zero-waste.md": pages["zero-waste.md"] + "\n::: grpo_plus.zero_waste.new_saving\n"}
    assert reference_problems(added, with_line, nav) == []


def test_documented_modules_maps_each_module_to_its_folders_page(tmp_path):
    """The mapping the reference check relies on, on a made-up package: top-level modules and the package itself go to
    the top-level page, a folder's modules (its __init__ and __main__ too) to the folder's page, private helpers
    nowhere."""
    package = tmp_path / "grpo_plus"
    for name in ("__init__.py", "config.py", "zero_waste/__init__.py", "zero_waste/rows.py", "fit/__main__.py",
                 "rewards/_helper.py", "_private/thing.py"):  # fmt: skip
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).touch()
    assert documented_modules(package) == {
        "grpo_plus": TOP_LEVEL_PAGE,
        "grpo_plus.config": TOP_LEVEL_PAGE,
        "grpo_plus.zero_waste": "zero-waste.md",
        "grpo_plus.zero_waste.rows": "zero-waste.md",
        "grpo_plus.fit.__main__": "fit.md",
    }


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
