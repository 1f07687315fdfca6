"""Sample efficiency on the embedded task: stock TRL's objective vs grpo_plus's best, same CPU budget, 3 seeds.

    .venv/bin/python benchmarks/sample_efficiency.py [--budget-minutes 3] [--seeds 0 1 2] [--level word-mixed]

Both sides train SmolLM2-135M-Instruct + LoRA with the same batch, learning rate, sampling and token budget
(grpo_plus.compare.BASE_SETTINGS); they differ only in the objective:
  trl_defaults   trl.GRPOTrainer with TRL 1.16's default objective: loss_type dapo, epsilon 0.2 (symmetric),
                 scale_rewards group, every sampled group trained on.
  grpo_plus      grpo_plus.GRPOTrainer with dapo + clip-higher (epsilon_high 0.28) + dynamic sampling.
Each run stops when its training CPU time (process time, held-out evaluations excluded) reaches the budget.
Reported per side, mean over seeds:
  informative    fraction of trained groups with non-zero advantage (TRL: 1 - frac_reward_zero_std of each
                 trained batch; grpo_plus: dynamic_sampling/trained_informative_frac)
  acc0 / acc     held-out greedy accuracy before training and at the end of the budget
  gain/CPU-min   (acc - acc0) / training CPU minutes
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grpo_plus import tasks  # noqa: E402
from grpo_plus.compare import run_configuration  # noqa: E402

SIDES = {
    "trl_defaults": dict(stock_trl=True, overrides=dict(loss_type="dapo")),
    "grpo_plus": dict(stock_trl=False, overrides=dict(loss_type="dapo", epsilon_high=0.28, dynamic_sampling=True)),
}


def informative_fraction(log_history: list[dict], dynamic: bool) -> float:
    key = "dynamic_sampling/trained_informative_frac" if dynamic else "frac_reward_zero_std"
    values = [entry[key] for entry in log_history if key in entry]
    mean = statistics.fmean(values)
    return mean if dynamic else 1.0 - mean


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-minutes", type=float, default=3.0, help="training CPU minutes per run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--level", default=tasks.BENCHMARK_LEVEL, choices=list(tasks.LEVELS))
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--eval-size", type=int, default=48)
    parser.add_argument("--output-dir", default="outputs/sample_efficiency")
    parser.add_argument(
        "--rewards",
        nargs="+",
        default=["correctness", "format"],
        help="reward functions; 'correctness' alone is binary, so many groups are all right or all wrong",
    )
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=list(SIDES))
    args = parser.parse_args()

    rows = {side: [] for side in args.sides}
    started = time.perf_counter()
    for seed in args.seeds:
        for side in args.sides:  # alternate sides within a seed so machine load drifts hit both alike
            spec = SIDES[side]
            result = run_configuration(
                side,
                spec["overrides"],
                seed=seed,
                output_dir=Path(args.output_dir) / f"{side}-seed{seed}",
                model=args.model,
                task_level=args.level,
                max_steps=10_000,
                eval_every=args.eval_every,
                eval_size=args.eval_size,
                max_cpu_minutes=args.budget_minutes,
                stock_trl=spec["stock_trl"],
                reward_funcs=args.rewards,
            )
            evals = result.evals()
            row = {
                "seed": seed,
                "steps": max(e.get("step", 0) for e in result.log_history),
                "informative": informative_fraction(result.log_history, dynamic=not spec["stock_trl"]),
                "acc0": evals[0]["eval_accuracy"],
                "acc": evals[-1]["eval_accuracy"],
                "cpu_min": result.train_cpu_minutes,
            }
            row["gain_per_cpu_min"] = (row["acc"] - row["acc0"]) / row["cpu_min"]
            rows[side].append(row)
            result_file = Path(args.output_dir) / f"{side}-seed{seed}" / "result.json"
            result_file.parent.mkdir(parents=True, exist_ok=True)
            result_file.write_text(json.dumps(row, indent=1))
            print(f"{side:13s} seed {seed}: " + ", ".join(f"{k}={v:.3f}" for k, v in row.items() if k != "seed"))

    print(
        f"\nlevel {args.level}, rewards {args.rewards}, budget {args.budget_minutes} training CPU-minutes per run, "
        f"seeds {args.seeds}"
    )
    header = f"{'side':13s} {'steps':>6s} {'informative':>11s} {'acc0':>6s} {'acc':>6s} {'gain/CPU-min':>12s}"
    print(header + "\n" + "-" * len(header))
    for side, side_rows in rows.items():

        def mean(key, side_rows=side_rows):
            return statistics.fmean(r[key] for r in side_rows)

        def spread(key, side_rows=side_rows):
            return statistics.stdev(r[key] for r in side_rows) if len(side_rows) > 1 else 0.0

        print(
            f"{side:13s} {mean('steps'):6.1f} {mean('informative'):11.3f} {mean('acc0'):6.3f} "
            f"{mean('acc'):6.3f}±{spread('acc'):.3f} {mean('gain_per_cpu_min'):+8.4f}±{spread('gain_per_cpu_min'):.4f}"
        )
    print(f"\nwall time {(time.perf_counter() - started) / 60:.1f} min")


if __name__ == "__main__":
    main()
