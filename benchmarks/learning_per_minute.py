"""Learning per minute on a real task: stock TRL and grpo_plus train the same reasoning-gym task from the same seed
for the same steps; held-out accuracy is plotted against each trainer's own training time.

    .venv/bin/python benchmarks/learning_per_minute.py [--steps 30] [--eval-every 5] [--eval-size 48]
        [--task chain_sum] [--task-config min_terms=2,max_terms=2,max_digits=1] [--precision float32|bf16]
        [--threads 1] [--json docs/guide/results/learning_per_minute.json] [--png ...] [--smoke]

The run: the embedded SmolLM2-135M-Instruct + LoRA r=16 all-linear on the demo config (recipes/configs/demo_cpu.yaml:
2 prompts x 8 completions of <= 20 tokens per optimizer step, lr 3e-4, dapo + clip-higher, seed 0) with the recipe's
rewards for a reasoning-gym task (correctness = the task's own scorer + 0.5 x the <answer>-tag format reward) on
--train-size generated questions. The two trainers differ only in the import (trl.GRPOTrainer against
grpo_plus.GRPOTrainer with its defaults: zero-waste generation and training pass).

Wall-clock accounting. Both trainers live in one process and alternate step by step (TRL's step 1, grpo_plus's step 1,
TRL's step 2, ...; harness/lockstep.py), one at a time, each with its own random state: both see the same load of
this shared machine within a step of each other, and both draw the numbers they would draw alone. A trainer's
training time is the sum of its own optimizer steps (on_step_begin -> on_step_end: generation, scoring, training
pass, optimizer), timed by the wall clock while the other trainer waits. Held-out evaluations (greedy replies to
--eval-size held-out questions every --eval-every steps, the recipe's verifier, the same code for both) run between
steps and are counted for neither; model loading and trainer set-up are counted for neither.

Exactness: in float32 (the default, as in the demo config) grpo_plus trains the same numbers as stock TRL (losses
to float rounding, the same completions), so the curves against the step coincide and the curves against minutes
show what the faster step is worth. With --precision bf16 (TRL's GRPOConfig default) they part, by bf16 rounding.

Reported: each side's accuracy at every evaluation with its training minutes; both sides' accuracy at equal
wall-clock (at the training time of the side that finished first, each side's last evaluation up to then); the
minutes each side took to first reach the best accuracy both reached; the per-step check (losses, completion lengths,
evaluations). Writes --json and --png (accuracy against minutes, and against the step).
--smoke: the random tiny model of grpo_plus.app.testing, 2 steps on 8 questions (checks the script runs; the numbers
mean nothing), into a temporary folder unless --json / --png say.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

from harness.evaluation import HeldOutEval
from harness.flags import arguments
from harness.report import ROOT, start_report, write_report
from harness.trainers import SIDES, demo_settings, demo_trainer, model_path, run_in_lockstep
from transformers import PrinterCallback

RESULTS = ROOT / "docs" / "guide" / "results"
LABELS = {"trl": "stock TRL", "ours": "grpo_plus"}
PRECISIONS = ("float32", "bf16")
EVAL_MAX_NEW_TOKENS = 24  # the demo config's eval_max_new_tokens


def accuracy_at(points: list[dict], seconds: float) -> dict:
    """The last evaluation of a side whose training time is at most `seconds` (accuracy held since it was measured)."""
    return [point for point in points if point["train_seconds"] <= seconds + 1e-9][-1]


def minutes_to_reach(points: list[dict], accuracy: float) -> float | None:
    """Training minutes at the first evaluation reaching `accuracy` (None: never reached)."""
    return next((p["train_seconds"] / 60 for p in points if p["accuracy"] >= accuracy - 1e-12), None)


def summarize(sides: dict[str, dict]) -> dict:
    """Equal wall-clock figures, time to the best accuracy both reached, and the per-step check."""
    points = {name: side["evals"] for name, side in sides.items()}
    totals = {name: sum(side["step_seconds"]) for name, side in sides.items()}
    first = min(totals, key=totals.get)
    equal = totals[first]
    at_equal = {name: accuracy_at(points[name], equal) for name in SIDES}
    steps_by_equal = {
        name: sum(1 for t in _cumulative(sides[name]["step_seconds"]) if t <= equal + 1e-9) for name in SIDES
    }
    target = min(max(p["accuracy"] for p in points[name]) for name in SIDES)
    reach = {name: minutes_to_reach(points[name], target) for name in SIDES}
    medians = {name: statistics.median(sides[name]["step_seconds"]) for name in SIDES}
    losses = [sides[name]["losses"] for name in SIDES]
    return {
        "training_minutes": {name: totals[name] / 60 for name in SIDES},
        "median_step_seconds": medians,
        "step_time_ratio": medians["ours"] / medians["trl"],
        "training_time_ratio": totals["ours"] / totals["trl"],
        "equal_wall_clock": {
            "minutes": equal / 60,
            "set_by": first,
            "accuracy": {name: at_equal[name]["accuracy"] for name in SIDES},
            "evaluated_at_step": {name: at_equal[name]["step"] for name in SIDES},
            "steps_done": steps_by_equal,
        },
        "accuracy_before": {name: points[name][0]["accuracy"] for name in SIDES},
        "accuracy_after": {name: points[name][-1]["accuracy"] for name in SIDES},
        "best_accuracy_both_reached": target,
        "minutes_to_reach_it": reach,
        "per_step_check": {
            "max_abs_loss_difference": max(abs(a - b) for a, b in zip(*losses, strict=True)),
            "same_completion_lengths": sides["trl"]["completion_lengths"] == sides["ours"]["completion_lengths"],
            "same_rewards": sides["trl"]["rewards"] == sides["ours"]["rewards"],
            "same_evaluations": [p["accuracy"] for p in points["trl"]] == [p["accuracy"] for p in points["ours"]],
        },
        "eval_minutes": {name: sum(p["eval_seconds"] for p in points[name]) / 60 for name in SIDES},
    }


def _cumulative(values: list[float]) -> list[float]:
    total, out = 0.0, []
    for value in values:
        total += value
        out.append(total)
    return out


def plot(report: dict, path: Path) -> None:
    """Two panels: held-out accuracy against each side's training minutes (equal wall-clock marked), and against the
    optimizer step."""
    from harness.plots import accuracy_panels

    from grpo_plus.app.plotting import series

    summary = report["summary"]
    fig, by_minutes, by_step = accuracy_panels(
        report["settings"]["eval_size"], "training minutes (each trainer's own steps summed; evaluation excluded)"
    )
    styles = {"trl": dict(color="C1", marker="o", linestyle="-"), "ours": dict(color="C0", marker="x", linestyle="--")}
    for name in SIDES:
        history = [dict(p, train_minutes=p["train_seconds"] / 60) for p in report["sides"][name]["evals"]]
        xs, ys = series(history, "accuracy", x="train_minutes")
        label = f"{LABELS[name]} ({summary['training_minutes'][name]:.1f} min for {report['settings']['steps']} steps)"
        by_minutes.plot(xs, ys, label=label, **styles[name])
        xs, ys = series(history, "accuracy", x="step")
        by_step.plot(xs, ys, label=LABELS[name], **styles[name])
    equal = summary["equal_wall_clock"]
    by_minutes.axvline(equal["minutes"], color="0.5", linestyle=":", linewidth=1)
    by_minutes.annotate(
        f"at {equal['minutes']:.1f} min: "
        + ", ".join(f"{LABELS[n]} {equal['accuracy'][n]:.2f}" for n in reversed(SIDES)),
        xy=(equal["minutes"], 0.02),
        xytext=(6, 0),
        textcoords="offset points",
        fontsize="small",
        color="0.3",
    )
    settings = report["settings"]
    for ax in (by_minutes, by_step):
        ax.legend(fontsize="small", loc="upper left")  # the bottom holds the equal-wall-clock note
    fig.suptitle(
        f"reasoning-gym {settings['task']} ({settings['task_config']}), {report['model']} + LoRA,\n"
        f"{settings['precision']}, {report['threads']} thread(s) of a shared 2-core CPU",
        fontsize="medium",
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, format="png")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = arguments(
        __doc__, steps=30, threads=1, json=None, smoke="the tiny random model, 2 steps (the script runs)"
    )  # --json's default: docs/guide/results/learning_per_minute.json
    parser.add_argument("--eval-every", type=int, default=5, help="steps between held-out evaluations")
    parser.add_argument("--eval-size", type=int, default=48, help="held-out questions (greedy)")
    parser.add_argument("--train-size", type=int, default=256, help="generated training questions")
    parser.add_argument("--task", default="chain_sum", help="a reasoning-gym task")
    parser.add_argument("--task-config", default="min_terms=2,max_terms=2,max_digits=1", help="its config fields")
    parser.add_argument("--precision", choices=PRECISIONS, default="float32", help="float32: the curves coincide")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--png", type=Path, default=None, help="default: the JSON's path with .png")
    parser.add_argument("--output-dir", type=Path, default=ROOT / "outputs" / "bench-learning-per-minute")
    args = parser.parse_args(argv)
    for name in ("steps", "eval_every", "eval_size", "train_size", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.smoke:
        args.steps, args.eval_every, args.eval_size, args.train_size = 2, 1, 4, 8
        args.output_dir = Path(tempfile.mkdtemp())
        args.json = args.json or args.output_dir / "learning_per_minute.json"
    args.json = args.json or RESULTS / "learning_per_minute.json"
    args.png = args.png or args.json.with_suffix(".png")
    return args


def main(argv: list[str] | None = None) -> int:
    from grpo_plus.app import real_tasks

    args = parse_args(argv)
    report, started = start_report(args, versions=("torch", "transformers", "trl"))
    load_before = os.getloadavg()

    train, held_out = real_tasks.reasoning_gym_datasets(
        f"reasoning-gym:{args.task}", args.task_config, args.train_size, args.eval_size, seed=0
    )
    rewards = real_tasks.task_rewards(train)  # the recipe's "correctness" and "format"
    model = model_path(args.smoke, args.output_dir, args.model)
    settings = demo_settings(args.steps)
    settings.update(output_dir=str(args.output_dir), bf16=args.precision == "bf16")

    def add_evaluations(built: dict) -> None:
        for name, side in built.items():
            trainer = side["trainer"]
            side["evals"] = HeldOutEval(
                name, side["timer"], held_out, trainer.processing_class, args.eval_every, rewards,
                max_new_tokens=EVAL_MAX_NEW_TOKENS, label=LABELS[name],
            )  # fmt: skip
            trainer.add_callback(side["evals"])  # after the StepTimer: outside the timed step
            trainer.remove_callback(PrinterCallback)  # every step's log dict, twice over: the JSON has what matters

    print(
        f"{args.task} ({args.task_config}), {len(train)} training / {len(held_out)} held-out questions, "
        f"{args.steps} lock-step steps per trainer, {args.precision} ...",
        flush=True,
    )
    make = demo_trainer(settings, dataset=train, reward_funcs=list(rewards), model_dir=model)
    built = run_in_lockstep(make, prepare=add_evaluations)

    sides = {}
    for name, side in built.items():
        logs = [entry for entry in side["trainer"].state.log_history if "loss" in entry]
        sides[name] = {
            "evals": side["evals"].points,
            "step_seconds": side["timer"].step,
            "losses": [entry["loss"] for entry in logs],
            "rewards": [entry["reward"] for entry in logs],
            "completion_lengths": [entry["completions/mean_length"] for entry in logs],
        }
    report = {
        "model": "tiny (smoke)" if args.smoke else args.model,
        "settings": {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()},
        "grpo_config": {key: settings[key] for key in sorted(settings) if key != "output_dir"},
        "train_size": len(train),
        **report,  # threads and versions
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "sides": sides,
        "summary": summarize(sides),
    }
    plot(report, args.png)
    print_summary(report)
    write_report(report, args.json, started=started)
    print(f"plot in {args.png}")
    return 0


def print_summary(report: dict) -> None:
    summary = report["summary"]
    equal, check = summary["equal_wall_clock"], summary["per_step_check"]
    print("\n| | stock TRL | grpo_plus |\n|---|---|---|")
    rows = [
        ("training minutes", summary["training_minutes"], "{:.2f}"),
        ("median step (s)", summary["median_step_seconds"], "{:.2f}"),
        ("held-out accuracy before", summary["accuracy_before"], "{:.3f}"),
        ("held-out accuracy after all steps", summary["accuracy_after"], "{:.3f}"),
        (f"held-out accuracy at {equal['minutes']:.2f} min", equal["accuracy"], "{:.3f}"),
        (f"steps done by {equal['minutes']:.2f} min", equal["steps_done"], "{}"),
        (f"minutes to reach {summary['best_accuracy_both_reached']:.3f}", summary["minutes_to_reach_it"], "{:.2f}"),
    ]
    for label, values, fmt in rows:
        cells = ["—" if values[name] is None else fmt.format(values[name]) for name in SIDES]
        print(f"| {label} | {cells[0]} | {cells[1]} |")
    print(
        f"\nstep time ratio (medians) {summary['step_time_ratio']:.2f}x, training time ratio "
        f"{summary['training_time_ratio']:.2f}x; per step: max |loss difference| {check['max_abs_loss_difference']:.2e}, "
        f"same completion lengths {check['same_completion_lengths']}, same rewards {check['same_rewards']}, same "
        f"evaluations {check['same_evaluations']}; load average {report['load_average_before'][0]:.2f} before, "
        f"{report['load_average_after'][0]:.2f} after"
    )


if __name__ == "__main__":
    sys.exit(main())
