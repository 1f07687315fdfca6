"""A benchmark's report: the thread count and versions it ran with, its results JSON and the Markdown table beside it.

The JSON files under docs/guide/results/ are these reports, quoted by the docs; the Markdown of a report that goes
there is written under outputs/ instead (mkdocs builds every page under docs/, and the tables are in the pages).
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def start_report(args: argparse.Namespace, versions=("torch", "transformers")) -> tuple[dict, float]:
    """Set torch's intra-op threads to `args.threads` (where the benchmark has the flag and it is set) and quiet
    transformers' warnings; (the report so far: the threads and the `versions` of those packages, the start time)."""
    import torch
    import transformers

    report = {}
    threads = getattr(args, "threads", None)
    if threads:
        torch.set_num_threads(threads)
        report["threads"] = threads
    transformers.logging.set_verbosity_error()
    report.update({name: importlib.import_module(name).__version__ for name in versions})
    return report, time.perf_counter()


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A Markdown table: one header row, then `rows` (cells are str()-ed)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def side_by_side(title: str, rows, trl: dict, ours: dict, ratio_format: str = ".2f") -> str:
    """A Markdown table of stock TRL's figures beside grpo_plus's and their ratio, one row per (label, key, format,
    bold) of `rows`: the figures `trl[key]` and `ours[key]` in `format`, the ratio ours / TRL (NaN where TRL's is 0)
    in bold where `bold`."""
    cells = []
    for label, key, spec, bold in rows:
        ratio = format(ours[key] / trl[key] if trl[key] else float("nan"), ratio_format)
        cells.append([label, format(trl[key], spec), format(ours[key], spec), f"**{ratio}**" if bold else ratio])
    return markdown_table([title, "stock TRL", "grpo_plus", "ratio"], cells)


def markdown_path(json_path: Path) -> Path:
    """Where the Markdown of a report written to `json_path` goes: beside it (same name, .md), or for a report under
    docs/, outputs/bench-<its name>/ (a page under docs/ that is in no menu fails the docs build)."""
    json_path = Path(json_path).resolve()
    if not json_path.is_relative_to(DOCS):
        return json_path.with_suffix(".md")
    return ROOT / "outputs" / f"bench-{json_path.stem.replace('_', '-')}" / f"{json_path.stem}.md"


def write_json(path: Path, data) -> None:
    """`data` as JSON (one-space indent; anything JSON has no type for as its str()), its folder made."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str))


def write_report(report, path: Path, markdown: str | None = None, started: float | None = None) -> None:
    """Write `report` as JSON to `path` and, given, the `markdown` tables to `markdown_path(path)`; with `started`
    (perf_counter), the wall minutes since then go into the report first. Says what it wrote."""
    done = f"results in {path}"
    if started is not None:
        report["wall_minutes"] = (time.perf_counter() - started) / 60
        done = f"wall time {report['wall_minutes']:.1f} min; {done}"
    write_json(path, report)
    if markdown is not None:
        tables = markdown_path(path)
        tables.parent.mkdir(parents=True, exist_ok=True)
        tables.write_text(markdown.rstrip("\n") + "\n")
        done += f" and {tables}"
    print(f"\n{done}", flush=True)
