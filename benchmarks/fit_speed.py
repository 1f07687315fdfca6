"""How long `grpo-plus fit` takes, against the fit before it was made fast, and that both give the same answers.

    .venv/bin/python benchmarks/fit_speed.py [--configs NAME ...] [--old-rev REV] [--no-groups] [--json PATH]

For each recipe config, the whole report `grpo-plus fit` prints (both sides' worst step at the config's settings, the
settings that would fit, the longest completion and the largest G with every memory option) is counted twice, each in
a fresh process on this machine, one after the other: by the library as it is, and by the library at `--old-rev` (its
`grpo_plus/` exported from git into a temporary folder and put first on the path; everything else installed is
shared). Printed per config: both wall times, their ratio, and whether every answer is the same (the per-part bytes of
the worst step on both sides, the fixes, the longest completion, the largest G). A differing answer exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shapes import markdown_table  # benchmarks/shapes.py

from grpo_plus.fit import CARD_RESERVE_GIB

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes" / "configs"
CONFIGS = ("demo_cpu", "qwen2.5-0.5b_lora", "qwen2.5-1.5b_lora", "qwen2.5-7b_qlora")
# main before the fit was made fast (the code the issue timed at 276 s for the 1.5B config, 451 s for the 7B).
OLD_REV = "2fe1ce4"
BUDGET_GIB = 24 - CARD_RESERVE_GIB  # a 24 GiB card, as `grpo-plus fit` counts by default

# Run in a fresh process with the library to time first on the path: the report and its answers, as JSON.
DRIVER = """
import json, sys, time
from pathlib import Path
started = time.perf_counter()
import grpo_plus.fit as fit
from grpo_plus.app.cli import fit_spec_from_yaml
path, groups, budget = sys.argv[1], sys.argv[2] == "1", int(float(sys.argv[3]) * 2**30)
spec = fit_spec_from_yaml(Path(path), 128)
counting = time.perf_counter()
report = fit.fit_report(spec, budget, groups=groups)
done = time.perf_counter()
answers = {
    "parts": {side: report.at_settings[side].parts() for side in fit.SIDES},
    "fixes": report.fixes, "longest": report.longest, "largest_group": report.largest_group,
}
print(json.dumps({"count_seconds": done - counting, "process_seconds": done - started, "answers": answers,
                  "file": fit.__file__}))
"""


def export_old(rev: str, folder: Path) -> Path:
    """`grpo_plus/` as it was at `rev`, written into `folder`."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "grpo_plus"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    return folder


def run(config: str, library_root: Path, groups: bool) -> dict:
    """The fit of `config` in a fresh process whose `grpo_plus` is the one under `library_root`."""
    env = {
        **os.environ,
        "PYTHONPATH": str(library_root),
        "CUDA_VISIBLE_DEVICES": "",
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",  # one intra-op thread, as every benchmark here (docs/guide/benchmarks.md)
    }
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-c", DRIVER, str(RECIPES / f"{config}.yaml"), "1" if groups else "0", str(BUDGET_GIB)],
        capture_output=True, text=True, env=env, cwd=tempfile.gettempdir(), check=False,
    )  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"{config} under {library_root}: {result.stderr[-3000:]}")
    out = json.loads(result.stdout.strip().splitlines()[-1])
    out["wall_seconds"] = time.perf_counter() - started
    assert Path(out["file"]).is_relative_to(library_root), (out["file"], library_root)  # timed the intended library
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--old-rev", default=OLD_REV)
    parser.add_argument("--no-groups", action="store_true", help="skip the largest-G searches on both sides")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rows, results, same_everywhere = [], {}, True
    with tempfile.TemporaryDirectory(prefix="grpo-plus-fit-old-") as folder:
        old_root = export_old(args.old_rev, Path(folder))
        for config in args.configs:
            old = run(config, old_root, not args.no_groups)
            new = run(config, ROOT, not args.no_groups)
            same = old["answers"] == new["answers"]
            same_everywhere &= same
            results[config] = {"old": old, "new": new, "same_answers": same}
            longest, group = new["answers"]["longest"], new["answers"]["largest_group"]
            rows.append([
                f"`{config}.yaml`", f"{old['count_seconds']:.0f}", f"{new['count_seconds']:.0f}",
                f"{old['count_seconds'] / new['count_seconds']:.1f}x", "yes" if same else "**no**",
                f"{longest['trl']} / {longest['grpo_plus']}", f"{group['trl']} / {group['grpo_plus']}",
            ])  # fmt: skip
            print(f"{config}: old {old['count_seconds']:.1f} s, new {new['count_seconds']:.1f} s (process "
                  f"{old['process_seconds']:.1f} / {new['process_seconds']:.1f} s), same answers: {same}", flush=True)  # fmt: skip
            if not same:
                print(json.dumps({"old": old["answers"], "new": new["answers"]}, indent=1))
    header = ["recipe config", f"fit at {args.old_rev} (s)", "fit now (s)", "speed-up", "same answers",
              "longest completion TRL / grpo_plus", "largest G TRL / grpo_plus"]  # fmt: skip
    print()
    print(markdown_table(header, rows))
    print(f"load average at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"old_rev": args.old_rev, "configs": results}, indent=1))
    return 0 if same_everywhere else 1


if __name__ == "__main__":
    sys.exit(main())
