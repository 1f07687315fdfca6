"""The zero-waste training pass against stock TRL: training-pass time, step time and token positions, one run.

    .venv/bin/python benchmarks/train_pass.py [--steps 12] [--warmup 2] [--repeats 5] [--threads 1]
                                              [--skip-steps] [--skip-sweep] [--json out.json]

Part 1, the demo config (recipes/configs/demo_cpu.yaml): SmolLM2-135M-Instruct (embedded) + LoRA r=16 all-linear,
one-digit sums, 2 prompts x 8 completions of <= 20 tokens per optimizer step, dapo + clip-higher, correctness +
0.5 x format rewards, seed 0. Stock trl.GRPOTrainer and grpo_plus.GRPOTrainer train in one process in lock-step
(TRL's step 1, ours, TRL's step 2, ...; harness/lockstep.py), each with its own random state, so they sample
the same completions and must log the same losses (checked). Per optimizer step, after the warm-up steps:
  step        on_step_begin -> on_step_end: generation, scoring, training pass, optimizer
  train pass  TRL's `step_time` (its training_step) minus `_prepare_inputs` (generation and scoring)
  positions   token positions of the model forwards that carried gradient: the hardware-independent figure
Part 2, the sweep: the training pass alone (`_compute_loss`, forward + backward) on synthetic micro-batches of 4
groups x 8 completions, stock TRL's trainer against grpo_plus's on the same weights, alternated, median of
`--repeats`: the dead-group share (0/25/50/75%, demo lengths) and the prompt/completion length ratio (no dead
group) vary. Completion lengths are ragged (uniform between a quarter of the longest and the longest).
Targets (issue 9): training pass <= 0.5x TRL's time on the demo config, whole step <= 0.75x, identical losses.
"""

from __future__ import annotations

import statistics

from harness.flags import arguments
from harness.report import ROOT, markdown_table, side_by_side, start_report, write_report
from harness.shapes import synthetic_micro_batch
from harness.trainers import SIDES, on_the_same_weights, run_demo_steps, time_training_pass


def run_sweep(trainers: dict, repeats: int) -> list[dict]:
    """Part 2: `_compute_loss` forward + backward, TRL vs ours on the same weights, alternated; medians."""
    from grpo_plus.app.testing import ForwardLog

    on_the_same_weights(trainers)
    forwards = {name: ForwardLog(trainer.model) for name, trainer in trainers.items()}
    tokenizer = trainers["ours"].processing_class
    cases = [(56, 20, share) for share in (0.0, 0.25, 0.5, 0.75)]
    cases += [(38, 38, 0.0), (19, 57, 0.0), (8, 128, 0.0)]
    rows = []
    for prompt_length, completion_length, dead_share in cases:
        inputs = synthetic_micro_batch(  # 4 groups x 8 rows, ragged completions
            32,
            8,
            prompt_length,
            completion_length,
            len(tokenizer),
            dead_share,
            seed=len(rows),
            ragged=True,
            first_token=10,
        )
        losses = {}

        def keep_loss(name, trainer, loss, losses=losses):
            losses[name] = loss.item()

        seconds = time_training_pass(trainers, inputs, repeats, forwards, after=keep_loss)
        row = dict(
            prompt=prompt_length,
            completion=completion_length,
            dead_share=dead_share,
            **{f"{name}_seconds": statistics.median(seconds[name]) for name in SIDES},
            **{f"{name}_positions": forwards[name].training_positions for name in SIDES},
            loss_difference=abs(losses["trl"] - losses["ours"]),
        )
        row["time_ratio"] = row["ours_seconds"] / row["trl_seconds"]
        row["positions_ratio"] = row["ours_positions"] / row["trl_positions"]
        rows.append(row)
        print(
            f"  P={prompt_length:3d} C<={completion_length:3d} dead {dead_share:4.0%}: TRL {row['trl_seconds']:.3f} s, "
            f"ours {row['ours_seconds']:.3f} s ({row['time_ratio']:.2f}x), positions {row['trl_positions']} -> "
            f"{row['ours_positions']} ({row['positions_ratio']:.2f}x), |loss diff| {row['loss_difference']:.1e}",
            flush=True,
        )
    return rows


def demo_table(part1: dict) -> str:
    rows = [
        ("training pass (s)", "train_pass", ".2f", True),
        ("whole step (s)", "step", ".2f", True),
        ("generation + scoring (s)", "generation", ".2f", False),
        ("token positions in the training forward", "positions", ".0f", True),
    ]
    trl_side, ours = part1["trl"], part1["ours"]
    return (
        side_by_side("demo config (median per step)", rows, trl_side, ours)
        + f"\n\ndead-group share {trl_side['dead_groups']:.2f}; same completions: {part1['same_completions']}; "
        f"max |loss difference| over {len(trl_side['losses'])} steps: {part1['max_loss_difference']:.2e}"
    )


def sweep_table(rows: list[dict]) -> str:
    header = ["prompt", "completion (max)", "dead groups", "TRL (s)", "grpo_plus (s)", "time ratio", "positions ratio"]
    cells = [
        [row["prompt"], row["completion"], f"{row['dead_share']:.0%}", f"{row['trl_seconds']:.3f}",
         f"{row['ours_seconds']:.3f}", f"{row['time_ratio']:.2f}", f"{row['positions_ratio']:.2f}"]
        for row in rows
    ]  # fmt: skip
    return markdown_table(header, cells)


def main() -> None:
    parser = arguments(
        __doc__,
        steps=12,
        warmup=2,
        repeats=5,
        threads=1,
        json=ROOT / "outputs" / "bench-train-pass" / "train_pass.json",
    )
    parser.add_argument("--skip-steps", action="store_true", help="one step in part 1, not reported (fresh trainers)")
    parser.add_argument("--skip-sweep", action="store_true")
    args = parser.parse_args()

    report, started = start_report(args)
    tables = []
    steps = 1 if args.skip_steps else args.steps
    print(f"Part 1: demo config, {steps} lock-step optimizer steps per trainer ...", flush=True)
    part1 = run_demo_steps(steps, 0 if args.skip_steps else args.warmup)
    trainers = part1.pop("trainers")
    if not args.skip_steps:
        report["demo"] = part1
        tables.append(demo_table(part1))
        print("\n" + tables[-1], flush=True)
    if not args.skip_sweep:
        print(f"\nPart 2: training pass alone, {args.repeats} repeats per case ...", flush=True)
        report["sweep"] = run_sweep(trainers, args.repeats)
        tables.append(sweep_table(report["sweep"]))
        print("\n" + tables[-1])
    write_report(report, args.json, markdown="\n\n".join(tables), started=started)


if __name__ == "__main__":
    main()
