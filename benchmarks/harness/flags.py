"""The flags benchmarks share: each benchmark names the ones it takes, with its defaults, and adds its own."""

from __future__ import annotations

import argparse
from pathlib import Path

# flag -> (type, help); a benchmark passes the default of each one it takes
SHARED = {
    "steps": (int, "optimizer steps of each trainer"),
    "warmup": (int, "first steps left out of the medians"),
    "repeats": (int, "timed repeats per case"),
    "threads": (int, "torch intra-op threads (1: stable on a shared box, where more threads than free cores stall)"),
    "json": (Path, "where the results JSON goes (a Markdown table, where written, beside it)"),
}


def arguments(doc: str, smoke: str | None = None, quick: str | None = None, **defaults) -> argparse.ArgumentParser:
    """A parser with the script's docstring as its help and the shared flags named in `defaults` (flag name ->
    default; None is a default too); `smoke` / `quick`: the help of a --smoke / --quick flag, where the script has
    one (its cheapest run: the tests run it)."""
    unknown = set(defaults) - set(SHARED)
    if unknown:
        raise ValueError(f"not a shared flag: {sorted(unknown)} (shared: {sorted(SHARED)})")
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in defaults.items():
        kind, help_text = SHARED[name]
        parser.add_argument(f"--{name}", type=kind, default=default, help=help_text)
    for name, help_text in (("smoke", smoke), ("quick", quick)):
        if help_text is not None:
            parser.add_argument(f"--{name}", action="store_true", help=help_text)
    return parser
