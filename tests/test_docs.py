"""The documentation's Python examples run, so the documentation cannot rot.

Every ```python fenced block in docs/**/*.md and README.md is executed: page by page, the blocks of a page in order
in one namespace, in a fresh temporary working directory, offline, on CPU. A block that cannot run here (GPU, Hub,
long runs) is fenced as ```text / ```bash / ```yaml, or preceded by the line `<!-- docs-test: skip -->`: such a
block is only compiled, and reported as a skipped test (the documented condition `docs_example_offline` of
tests/helpers/floors.py). A block preceded by `<!-- docs-test: floor NAME ... -->` needs those documented floors: its
page runs where the installed versions meet them all, and skips below one. Modes an example registers are
unregistered after its page, so pages cannot change what the rest of the suite sees.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers.floors import FLOORS, SKIP_PREFIX, Floor, skip_below_floor

ROOT = Path(__file__).resolve().parents[1]
SKIP_MARKER = "<!-- docs-test: skip -->"
FLOOR_MARKER = re.compile(r"^<!-- docs-test: floor (?P<names>\w+(?: \w+)*) -->$")
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^\s`]*)[^`]*$")
PYTHON_INFO = {"python", "py", "python3"}


@dataclass(frozen=True)
class CodeBlock:
    page: Path
    line: int  # 1-based line of the opening fence
    code: str
    skipped: bool
    floors: tuple[str, ...] = ()  # documented floors (tests/helpers/floors.py) the block needs

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page}:{self.line}"


def python_blocks(page: Path) -> list[CodeBlock]:
    """The ```python blocks of a Markdown page, in order, with whether a skip marker precedes each and the floors a
    floor marker names."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent, fence, info = opening["indent"], opening["fence"], opening["info"].lower()
        end = i + 1
        while end < len(lines) and not re.match(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$", lines[end]):
            end += 1
        if info in PYTHON_INFO:
            before = next((line.strip() for line in reversed(lines[:i]) if line.strip()), "")
            body = [line[len(indent) :] if line.startswith(indent) else line.lstrip() for line in lines[i + 1 : end]]
            floors = FLOOR_MARKER.match(before)
            blocks.append(
                CodeBlock(
                    page, i + 1, "\n".join(body) + "\n", skipped=before == SKIP_MARKER,
                    floors=tuple(floors["names"].split()) if floors else (),
                )
            )  # fmt: skip
        i = end + 1
    return blocks


def run_page(blocks: list[CodeBlock]) -> dict:
    """Execute a page's blocks in order in one namespace (the caller sets the working directory); return it."""
    namespace: dict = {"__name__": "__docs__"}
    for block in blocks:
        if not block.skipped:
            exec(compile(block.code, f"{block.where} (```python block)", "exec"), namespace)  # noqa: S102
    return namespace


PAGES = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
RUNNABLE = [page for page in PAGES if any(not block.skipped for block in python_blocks(page))]
SKIPPED = [block for page in PAGES for block in python_blocks(page) if block.skipped]


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """A fresh working directory, offline, no GPU; sys.path and new modules restored afterwards (the registries by
    conftest's restore_registries, as for every test)."""
    monkeypatch.chdir(tmp_path)
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(sys, "path", list(sys.path))
    modules = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - modules:
        if str(tmp_path) in str(getattr(sys.modules[name], "__file__", "") or ""):
            del sys.modules[name]  # a module an example wrote into its working directory


@pytest.mark.parametrize("page", RUNNABLE, ids=lambda page: str(page.relative_to(ROOT)))
def test_documented_python_examples_run(page, isolated):
    blocks = python_blocks(page)
    for name in dict.fromkeys(name for block in blocks for name in block.floors):
        skip_below_floor(name)  # a page's blocks share one namespace: a block below its floor skips the page
    run_page(blocks)


@pytest.mark.parametrize("block", SKIPPED, ids=lambda block: block.where)
def test_skipped_examples_compile_and_are_reported(block):
    """A block that cannot run here still has to be Python a reader can paste: it compiles (a syntax error fails
    here), then it is reported as skipped, naming its page and line."""
    compile(block.code, f"{block.where} (```python block)", "exec")
    floor = FLOORS["docs_example_offline"]
    pytest.skip(f"{block.where}: {SKIP_PREFIX.format(name=floor.name)} ({floor.documented}): {floor.unmet()}")


# ---- the runner itself: a broken example fails, a skipped one does not run --------------------------------------


def write_page(folder: Path, text: str) -> Path:
    page = folder / "page.md"
    page.write_text(text, encoding="utf-8")
    return page


def test_a_broken_example_fails_naming_its_page_and_line(isolated):
    page = write_page(
        isolated,
        "# A page\n\n```python\nfrom grpo_plus import compute_advantages\n```\n\nText.\n\n"
        "```python\ncompute_advantages(rewards, num_generations=8)\n```\n",
    )
    with pytest.raises(NameError, match="rewards") as error:
        run_page(python_blocks(page))
    assert error.traceback[-1].frame.code.path == f"{page}:9 (```python block)"


def test_a_skipped_example_that_does_not_compile_fails(isolated):
    page = write_page(isolated, f"# A page\n\n{SKIP_MARKER}\n```python\ntrainer.train(\n```\n")
    (block,) = python_blocks(page)
    assert block.skipped
    with pytest.raises(SyntaxError):
        test_skipped_examples_compile_and_are_reported(block)


def test_a_page_needing_a_floor_skips_below_it_and_runs_above_it(isolated, monkeypatch):
    page = write_page(
        isolated, "<!-- docs-test: floor fake -->\n```python\nimport pathlib\npathlib.Path('ran').touch()\n```\n"
    )
    (block,) = python_blocks(page)
    assert block.floors == ("fake",) and not block.skipped
    monkeypatch.setitem(FLOORS, "fake", Floor("fake", "docs/page.md", lambda: "fake 1.0 < 2.0: not there yet"))
    with pytest.raises(pytest.skip.Exception, match="documented floor `fake` not met .*fake 1.0 < 2.0"):
        test_documented_python_examples_run(page, isolated)
    assert not (isolated / "ran").exists()
    monkeypatch.setitem(FLOORS, "fake", Floor("fake", "docs/page.md", lambda: None))
    test_documented_python_examples_run(page, isolated)
    assert (isolated / "ran").exists()


def test_blocks_share_a_namespace_in_order_and_skips_and_other_fences_do_not_run(isolated):
    page = write_page(
        isolated,
        "```python\nx = 1\n```\n\n<!-- docs-test: skip -->\n```python\nraise SystemExit('not run')\n```\n\n"
        "```bash\nexit 1\n```\n\n```text\nraise SystemExit\n```\n\n"
        "- in a list:\n\n    ```python\n    x += 1\n    ```\n\n~~~py\nimport pathlib\n"
        "pathlib.Path('written.txt').write_text(str(x))\n~~~\n",
    )
    blocks = python_blocks(page)
    assert [(block.line, block.skipped) for block in blocks] == [(1, False), (6, True), (20, False), (24, False)]
    namespace = run_page(blocks)
    assert namespace["x"] == 2 and (isolated / "written.txt").read_text() == "2"
