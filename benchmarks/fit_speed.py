"""How long `grpo-plus fit` takes, against the fit before it was made fast, and that both give the same answers.

    .venv/bin/python benchmarks/fit_speed.py [--configs NAME ...] [--old-rev REV] [--no-groups] [--json PATH]

For each text recipe config, and `qwen2.5-1.5b_lora+gspo_kl` (the 1.5B recipe with a non-default objective: BNPO
over GSPO's sequence ratio with the KL term, which the count runs through the configured loss), the whole report
`grpo-plus fit` prints (both sides' worst step at the config's settings, the settings that would fit, the longest
completion and the largest G with every memory option) is counted twice, each in a fresh process on one thread, one
after the other: by the library as it is, and by the library at `--old-rev` (its `grpo_plus/` exported from git into a
temporary folder and put first on the path; everything else installed is shared); then `grpo-plus fit --config` runs
as a new user runs it (the installed command, default threads, wall clock from start to report). Printed per config:
the count's seconds at both revisions, their ratio, the user's wait, and whether every answer is the same (the per-part
bytes of the worst step on both sides, the fixes, the longest completion, the largest G). A differing answer exits 1.
`--configs qwen2.5-vl-3b_qlora` times the VLM recipe (minutes: its counts run the vision tower).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness.flags import arguments
from harness.report import ROOT, markdown_table, write_report

from grpo_plus.fit import CARD_RESERVE_GIB

RECIPES = ROOT / "recipes" / "configs"
TEXT_CONFIGS = ("demo_cpu", "qwen2.5-0.5b_lora", "qwen2.5-1.5b_lora", "qwen2.5-7b_qlora", "qwen2.5-1.5b_lora+gspo_kl")
CONFIGS = (*TEXT_CONFIGS, "qwen2.5-vl-3b_qlora")  # the VLM recipe's counts run its vision tower: minutes
# A recipe config with settings changed: name -> (recipe config, the settings written over it).
VARIANTS = {
    "qwen2.5-1.5b_lora+gspo_kl": (
        "qwen2.5-1.5b_lora",
        {"loss_type": "bnpo", "importance_sampling_level": "sequence", "beta": 0.04},
    ),
}
# main before the tiled MLP's tiles and the packing's index operators were counted on what binds (issue 42 part 5),
# with the counter that matches real bytes and the configured objective counted: the same answers are expected.
OLD_REV = "fb81d2c"  # the count before the tiled MLP became one autograd function (ff38b21 before the fast count)
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
    folder.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "grpo_plus"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    return folder


def config_path(config: str, folder: Path) -> Path:
    """The YAML of `config`: a recipe config, or a variant's written into `folder`."""
    if config not in VARIANTS:
        return RECIPES / f"{config}.yaml"
    import yaml

    base, changes = VARIANTS[config]
    settings = {**yaml.safe_load((RECIPES / f"{base}.yaml").read_text()), **changes}
    path = folder / f"{config}.yaml"
    path.write_text(yaml.safe_dump(settings))
    return path


def run(config: str, library_root: Path, groups: bool, folder: Path) -> dict:
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
        [sys.executable, "-c", DRIVER, str(config_path(config, folder)), "1" if groups else "0", str(BUDGET_GIB)],
        capture_output=True, text=True, env=env, cwd=tempfile.gettempdir(), check=False,
    )  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"{config} under {library_root}: {result.stderr[-3000:]}")
    out = json.loads(result.stdout.strip().splitlines()[-1])
    out["wall_seconds"] = time.perf_counter() - started
    assert Path(out["file"]).is_relative_to(library_root), (out["file"], library_root)  # timed the intended library
    return out


def as_a_user_runs_it(config: str, folder: Path) -> float:
    """Wall seconds of `grpo-plus fit --config <yaml>` as a new user runs it: the installed command, the machine's
    default thread count, from the start of the process to its report."""
    command = Path(sys.executable).with_name("grpo-plus")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"}
    env.pop("OMP_NUM_THREADS", None)
    started = time.perf_counter()
    subprocess.run([str(command), "fit", "--config", str(config_path(config, folder))], check=True,
                   capture_output=True, env=env, cwd=tempfile.gettempdir())  # fmt: skip
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__, json=None)
    parser.add_argument("--configs", nargs="+", default=list(TEXT_CONFIGS), choices=CONFIGS)
    parser.add_argument("--old-rev", default=OLD_REV)
    parser.add_argument("--no-groups", action="store_true", help="skip the largest-G searches on both sides")
    args = parser.parse_args(argv)
    rows, results, same_everywhere = [], {}, True
    with tempfile.TemporaryDirectory(prefix="grpo-plus-fit-old-") as folder:
        old_root = export_old(args.old_rev, Path(folder) / "old")
        for config in args.configs:
            old = run(config, old_root, not args.no_groups, Path(folder))
            new = run(config, ROOT, not args.no_groups, Path(folder))
            new["user_wall_seconds"] = as_a_user_runs_it(config, Path(folder))
            same = old["answers"] == new["answers"]
            same_everywhere &= same
            results[config] = {"old": old, "new": new, "same_answers": same}
            longest, group = new["answers"]["longest"], new["answers"]["largest_group"]
            rows.append([
                f"`{config}.yaml`", f"{old['count_seconds']:.0f}", f"{new['count_seconds']:.0f}",
                f"{old['count_seconds'] / new['count_seconds']:.1f}x", f"{new['user_wall_seconds']:.0f}",
                "yes" if same else "**no**",
                f"{longest['trl']} / {longest['grpo_plus']}", f"{group['trl']} / {group['grpo_plus']}",
            ])  # fmt: skip
            print(f"{config}: old {old['count_seconds']:.1f} s, new {new['count_seconds']:.1f} s (process "
                  f"{old['process_seconds']:.1f} / {new['process_seconds']:.1f} s; grpo-plus fit as a user runs it "
                  f"{new['user_wall_seconds']:.1f} s), same answers: {same}", flush=True)  # fmt: skip
            if not same:
                print(json.dumps({"old": old["answers"], "new": new["answers"]}, indent=1))
    header = ["recipe config", f"count at {args.old_rev} (s)", "count now (s)", "speed-up",
              "`grpo-plus fit` now, as a user runs it (s)", "same answers",
              "longest completion TRL / grpo_plus", "largest G TRL / grpo_plus"]  # fmt: skip
    print()
    print(markdown_table(header, rows))
    print(f"load average at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")
    if args.json:
        write_report({"old_rev": args.old_rev, "configs": results}, args.json, markdown=markdown_table(header, rows))
    return 0 if same_everywhere else 1


if __name__ == "__main__":
    sys.exit(main())
