"""Sample efficiency on the embedded task: stock TRL's objective vs grpo_plus, same CPU budget, 3 seeds.

    .venv/bin/python benchmarks/sample_efficiency.py [--setting fresh|multi-epoch] [--budget-minutes 6] [--seeds 0 1 2]

Every side trains SmolLM2-135M-Instruct + LoRA with the same batch, learning rate, sampling and token budget
(grpo_plus.app.compare.BASE_SETTINGS); they differ in the objective and in how prompts are sampled:
  trl_defaults        trl.GRPOTrainer with TRL 1.16's default objective: loss_type dapo, epsilon 0.2 (symmetric),
                      scale_rewards group, every sampled group trained on.
  dynamic_sampling    grpo_plus.GRPOTrainer, dapo + clip-higher (epsilon_high 0.28) + DAPO dynamic sampling.
  selective_rollout   grpo_plus.GRPOTrainer, dapo + clip-higher + selective rollout (GRESO).
  selective+dynamic   grpo_plus.GRPOTrainer, dapo + clip-higher + both.
Settings:
  fresh        the level's whole training split (prompts rarely repeat within the budget); trl_defaults vs
               dynamic_sampling, rewards correctness + 0.5 x format, 3 CPU-minutes.
  multi-epoch  a training set of --train-size prompts (default 8), small enough that the budget passes over it
               several times, so selective rollout has history to act on; all four sides, binary correctness
               reward, 6 CPU-minutes.
Each run stops when its training CPU time (process time, held-out evaluations excluded) reaches the budget.
Reported per side, mean over seeds (± sample std over seeds):
  acc0 / acc          held-out greedy accuracy before training and at the end of the budget
  gain/CPU-min        (acc - acc0) / training CPU minutes; `vs TRL` is its ratio to trl_defaults' mean
  trained informative fraction of trained groups with non-zero advantage
  generated informative  fraction of generated groups with non-zero advantage (what generation was not wasted on)
  generation calls    generation rounds (1 per generation batch, more with dynamic-sampling refills)
  passes              prompts generated for / training-set size
  skipped, precision  prompts skipped by selective rollout; share of explored predicted-dead prompts that were dead
Writes <output-dir>/results.json (every run and the summary) and <output-dir>/results.md (the table).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

from harness.flags import arguments
from harness.report import markdown_table, write_json, write_report

from grpo_plus.app import tasks
from grpo_plus.app.compare import BASE_SETTINGS, run_configuration

_GRPO_PLUS = dict(loss_type="dapo", epsilon_high=0.28)
SIDES = {
    "trl_defaults": dict(stock_trl=True, overrides=dict(loss_type="dapo")),
    "dynamic_sampling": dict(stock_trl=False, overrides=dict(_GRPO_PLUS, dynamic_sampling=True)),
    "selective_rollout": dict(stock_trl=False, overrides=dict(_GRPO_PLUS, selective_rollout=True)),
    "selective+dynamic": dict(stock_trl=False, overrides=dict(_GRPO_PLUS, selective_rollout=True, dynamic_sampling=True)),
}  # fmt: skip
SETTINGS = {
    "fresh": dict(train_size=None, sides=["trl_defaults", "dynamic_sampling"], rewards=["correctness", "format"],
                  budget_minutes=3.0),
    "multi-epoch": dict(train_size=8, sides=list(SIDES), rewards=["correctness"], budget_minutes=6.0),
}  # fmt: skip
PROMPTS_PER_GENERATION = BASE_SETTINGS["per_device_train_batch_size"] // BASE_SETTINGS["num_generations"]


def per_step(log_history: list[dict], key: str) -> list[float]:
    return [entry[key] for entry in log_history if key in entry]


def run_row(log_history: list[dict], dynamic: bool, train_size: int) -> dict[str, float]:
    """Sampling figures of one run from its per-step log (logging_steps=1, one generation batch per step)."""
    zero_std = per_step(log_history, "frac_reward_zero_std")  # TRL's: mean over the step's generation rounds
    rounds = per_step(log_history, "dynamic_sampling/rounds") if dynamic else [1.0] * len(zero_std)
    calls = sum(rounds)
    if dynamic:
        trained_informative = statistics.fmean(per_step(log_history, "dynamic_sampling/trained_informative_frac"))
    else:
        trained_informative = 1.0 - statistics.fmean(zero_std)
    explored = sum(per_step(log_history, "selective_rollout/explored_predicted_dead"))
    were_dead = sum(per_step(log_history, "selective_rollout/explored_were_dead"))
    return {
        "trained_informative": trained_informative,
        "generated_informative": sum((1 - z) * r for z, r in zip(zero_std, rounds, strict=True)) / calls,
        "generation_calls": calls,
        "passes": calls * PROMPTS_PER_GENERATION / train_size,
        "skipped": sum(per_step(log_history, "selective_rollout/skipped")),
        "precision": were_dead / explored if explored else math.nan,
    }


def mean_and_spread(values: list[float]) -> tuple[float, float]:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summarize(rows: dict[str, list[dict]]) -> list[dict]:
    """One row per side: means over seeds, the spread of accuracy and gain, gain relative to trl_defaults."""
    keys = ["steps", "trained_informative", "generated_informative", "generation_calls", "passes", "skipped"]
    baseline = (
        statistics.fmean(r["gain_per_cpu_min"] for r in rows["trl_defaults"]) if "trl_defaults" in rows else None
    )
    summary = []
    for side, side_rows in rows.items():
        acc, acc_spread = mean_and_spread([r["acc"] for r in side_rows])
        gain, gain_spread = mean_and_spread([r["gain_per_cpu_min"] for r in side_rows])
        row = {
            "side": side,
            "seeds": len(side_rows),
            **{k: mean_and_spread([r[k] for r in side_rows])[0] for k in keys},
        }
        row.update(
            precision=mean_and_spread([r["precision"] for r in side_rows])[0],
            acc0=statistics.fmean(r["acc0"] for r in side_rows),
            acc_per_seed=[r["acc"] for r in side_rows],
            acc=acc,
            acc_spread=acc_spread,
            gain_per_cpu_min=gain,
            gain_spread=gain_spread,
            gain_vs_trl=gain / baseline if baseline else math.nan,
        )
        summary.append(row)
    return summary


def markdown(summary: list[dict]) -> str:
    headers = ["side", "steps", "generation calls", "passes over train set", "skipped", "precision",
               "informative (generated)", "informative (trained)", "held-out acc at budget (per seed)", "mean acc",
               "acc gain per CPU-min", "vs TRL"]  # fmt: skip
    rows = []
    for r in summary:
        rows.append(
            [
                r["side"],
                f"{r['steps']:.1f}",
                f"{r['generation_calls']:.1f}",
                f"{r['passes']:.1f}",
                f"{r['skipped']:.1f}",
                "—" if math.isnan(r["precision"]) else f"{r['precision']:.2f}",
                f"{r['generated_informative']:.3f}",
                f"{r['trained_informative']:.3f}",
                " / ".join(f"{a:.3f}" for a in r["acc_per_seed"]),
                f"{r['acc']:.3f} ± {r['acc_spread']:.3f}",
                f"{r['gain_per_cpu_min']:+.4f} ± {r['gain_spread']:.4f}",
                "—" if math.isnan(r["gain_vs_trl"]) else f"{r['gain_vs_trl']:.2f}x",
            ]
        )
    return markdown_table(headers, rows)


def without_nan(value):
    """NaN (no figure, e.g. no precision without selective rollout) as JSON null."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: without_nan(v) for k, v in value.items()}
    if isinstance(value, list):
        return [without_nan(v) for v in value]
    return value


def parse_args() -> argparse.Namespace:
    parser = arguments(__doc__)
    parser.add_argument("--setting", choices=list(SETTINGS), default="fresh")
    parser.add_argument("--budget-minutes", type=float, default=None, help="training CPU minutes per run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--level", default=tasks.BENCHMARK_LEVEL, choices=list(tasks.LEVELS))
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--eval-size", type=int, default=48)
    parser.add_argument("--output-dir", default=None, help="default: outputs/sample_efficiency/<setting>")
    parser.add_argument("--train-size", type=int, default=None, help="training prompts (default: the setting's)")
    parser.add_argument(
        "--rewards",
        nargs="+",
        default=None,
        help="reward functions (default: the setting's); 'correctness' alone is binary, so many groups are all right "
        "or all wrong",
    )
    parser.add_argument("--sides", nargs="+", default=None, choices=list(SIDES), help="default: the setting's")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="reuse every run whose <output-dir>/<side>-seed<N>/row.json exists (a run is ~10 minutes; an "
        "interrupted benchmark picks up where it stopped)",
    )
    args = parser.parse_args()
    setting = SETTINGS[args.setting]
    args.train_size = args.train_size if args.train_size is not None else setting["train_size"]
    args.rewards = args.rewards or setting["rewards"]
    args.sides = args.sides or setting["sides"]
    args.budget_minutes = args.budget_minutes or setting["budget_minutes"]
    args.output_dir = Path(args.output_dir or f"outputs/sample_efficiency/{args.setting}")
    return args


def main() -> None:
    args = parse_args()
    train_size = args.train_size or len(tasks.make_dataset("train", args.level))
    rows = {side: [] for side in args.sides}
    started = time.perf_counter()
    for seed in args.seeds:
        for side in args.sides:  # alternate sides within a seed so machine load drifts hit all alike
            spec = SIDES[side]
            run_dir = args.output_dir / f"{side}-seed{seed}"
            saved_row = run_dir / "row.json"
            if args.resume and saved_row.exists():
                rows[side].append(json.loads(saved_row.read_text()))
                print(f"{side:17s} seed {seed}: reused {saved_row}")
                continue
            result = run_configuration(
                side,
                spec["overrides"],
                seed=seed,
                output_dir=run_dir,
                model=args.model,
                task_level=args.level,
                max_steps=10_000,
                eval_every=args.eval_every,
                eval_size=args.eval_size,
                max_cpu_minutes=args.budget_minutes,
                stock_trl=spec["stock_trl"],
                reward_funcs=args.rewards,
                train_size=args.train_size,
            )
            evals = result.evals()
            row = {
                "seed": seed,
                "steps": max(e.get("step", 0) for e in result.log_history),
                "acc0": evals[0]["eval_accuracy"],
                "acc": evals[-1]["eval_accuracy"],
                "cpu_min": result.train_cpu_minutes,
                **run_row(result.log_history, spec["overrides"].get("dynamic_sampling", False), train_size),
            }
            row["gain_per_cpu_min"] = (row["acc"] - row["acc0"]) / row["cpu_min"]
            rows[side].append(row)
            write_json(saved_row, row)
            print(f"{side:17s} seed {seed}: " + ", ".join(f"{k}={v:.3f}" for k, v in row.items() if k != "seed"))

    summary = summarize(rows)
    table = markdown(summary)
    wall_minutes = (time.perf_counter() - started) / 60
    header = (
        f"setting {args.setting}: level {args.level}, {train_size} training prompts, rewards {args.rewards}, "
        f"budget {args.budget_minutes} training CPU-minutes per run, seeds {args.seeds}, wall {wall_minutes:.1f} min"
    )
    print(f"\n{header}\n\n{table}")
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    results = {"settings": settings, "train_size": train_size, "wall_minutes": wall_minutes, "runs": rows}
    write_report(
        without_nan({**results, "summary": summary}), args.output_dir / "results.json", f"{header}\n\n{table}"
    )


if __name__ == "__main__":
    main()
