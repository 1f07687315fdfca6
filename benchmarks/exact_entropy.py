"""What `zero_waste_exact_entropy=True` costs: the training pass with TRL's `entropy` logged exactly, against stock TRL
and the default zero-waste pass (which logs `entropy` only where no row was skipped).

    .venv/bin/python benchmarks/exact_entropy.py [--repeats 5] [--threads 1] [--group-size 8] [--smoke] [--json out.json]

The training pass alone (`_compute_loss`, forward + backward) on synthetic micro-batches of 4 groups x 8 completions
(`--group-size`; demo lengths: 56-token prompts, ragged completions of <= 20 tokens) with 0/25/50/75% of the groups dead, on the
embedded SmolLM2-135M-Instruct + LoRA r=16 all-linear (`--smoke`: the tiny test model, 1 repeat). Stock TRL's
trainer, grpo_plus's and grpo_plus's with exact entropy run on the same weights, alternated, median of `--repeats`.
Checked on every case: the three losses equal, exact entropy equal to TRL's `entropy`.
"""

from __future__ import annotations

import math
import statistics
import tempfile

from harness.flags import arguments
from harness.report import ROOT, markdown_table, start_report, write_report
from harness.shapes import synthetic_micro_batch
from harness.trainers import build_trainers, demo_lora, model_path, on_the_same_weights, time_training_pass

SIDES = ("trl", "ours", "exact")
DEAD_SHARES = (0.0, 0.25, 0.5, 0.75)


def build_sides(smoke: bool, output_dir: str) -> dict:
    """Stock TRL's and grpo_plus's sides (harness.trainers) on the same model weights, ready to time the training
    pass alone; grpo_plus's trainer serves "ours" and "exact"."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_path(smoke, output_dir)
    tokenizer = AutoTokenizer.from_pretrained(path)
    dataset = Dataset.from_list([{"prompt": "1+1="}] * 8)
    settings = dict(
        output_dir=output_dir, per_device_train_batch_size=8, num_generations=8, max_completion_length=20,
        loss_type="dapo", epsilon_high=0.28, use_cpu=True, bf16=False, report_to="none", save_strategy="no",
    )  # fmt: skip

    def make(name, package, callbacks):
        return package.GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
            reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
            args=package.GRPOConfig(**settings),
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=demo_lora(),
            callbacks=callbacks,
        )

    sides = build_trainers(make, ("trl", "ours"))
    on_the_same_weights({name: side["trainer"] for name, side in sides.items()})
    return sides


def with_exact_entropy(trainer, exact: bool) -> None:
    """Set the run's `zero_waste_exact_entropy` (settings are read once at construction: the pass is wired again)."""
    trainer._wire_training_pass(enabled=True, shared_prompt=True, exact_entropy=exact)


def run_cases(sides: dict, repeats: int, group_size: int = 8) -> list[dict]:
    vocab = len(sides["trl"]["trainer"].processing_class)
    trainers = {name: sides["trl" if name == "trl" else "ours"]["trainer"] for name in SIDES}
    forwards = {name: sides["trl" if name == "trl" else "ours"]["forwards"] for name in SIDES}
    rows = []
    for case, dead_share in enumerate(DEAD_SHARES):
        rows_per_batch = 4 * group_size
        inputs = synthetic_micro_batch(
            rows_per_batch, group_size, 56, 20, vocab, dead_share, seed=case, ragged=True, first_token=10
        )
        losses, entropy, positions = {}, {}, {}

        def before(name, trainer):
            if name != "trl":
                with_exact_entropy(trainer, exact=name == "exact")
            trainer._metrics["train"].clear()

        def after(name, trainer, loss, losses=losses, entropy=entropy, positions=positions):
            losses[name], entropy[name] = loss.item(), trainer._metrics["train"]["entropy"][-1]
            log = forwards[name]
            positions[name] = (log.training_positions, log.positions - log.training_positions)

        seconds = time_training_pass(trainers, inputs, repeats, forwards, before=before, after=after)
        row = {"dead_share": dead_share, **{f"{name}_seconds": statistics.median(seconds[name]) for name in SIDES}}
        for name in SIDES:  # token positions the model computed with gradient, and without (exact entropy's)
            row[f"{name}_positions"], row[f"{name}_no_grad_positions"] = positions[name]
        row["max_loss_difference"] = max(abs(losses[name] - losses["trl"]) for name in SIDES)
        row["exact_entropy_difference"] = abs(entropy["exact"] - entropy["trl"])
        row["default_entropy_logged"] = not math.isnan(entropy["ours"])
        for name in ("ours", "exact"):
            row[f"{name}_ratio"] = row[f"{name}_seconds"] / row["trl_seconds"]
        rows.append(row)
        print(
            f"  dead {dead_share:4.0%}: TRL {row['trl_seconds']:.3f} s, grpo_plus {row['ours_ratio']:.2f}x, "
            f"exact entropy {row['exact_ratio']:.2f}x; positions with gradient TRL {row['trl_positions']}, "
            f"grpo_plus {row['ours_positions']}, + no-grad for exact entropy {row['exact_no_grad_positions']}; |loss diff| {row['max_loss_difference']:.1e}, "
            f"|entropy - TRL's| {row['exact_entropy_difference']:.1e}",
            flush=True,
        )
    return rows


def table(rows: list[dict]) -> str:
    header = ["dead groups", "TRL (s)", "grpo_plus (s)", "ratio", "with exact entropy (s)", "ratio", "positions: TRL"]
    header += ["grpo_plus", "exact entropy's no-grad forward"]
    cells = [
        [f"{row['dead_share']:.0%}", f"{row['trl_seconds']:.3f}", f"{row['ours_seconds']:.3f}",
         f"{row['ours_ratio']:.2f}", f"{row['exact_seconds']:.3f}", f"{row['exact_ratio']:.2f}",
         row["trl_positions"], row["ours_positions"], row["exact_no_grad_positions"]]
        for row in rows
    ]  # fmt: skip
    return markdown_table(header, cells)


def main() -> None:
    json_path = ROOT / "outputs" / "bench-exact-entropy" / "exact_entropy.json"
    parser = arguments(
        __doc__, repeats=5, threads=1, json=json_path, smoke="the tiny test model, 1 repeat: checks the script runs"
    )
    parser.add_argument("--group-size", type=int, default=8, help="completions per group (4 groups per micro-batch)")
    args = parser.parse_args()
    report, started = start_report(args, versions=("torch",))
    with tempfile.TemporaryDirectory() as output_dir:
        sides = build_sides(args.smoke, output_dir)
        rows = run_cases(sides, 1 if args.smoke else args.repeats, args.group_size)
    print("\n" + table(rows))
    report.update(smoke=args.smoke, group_size=args.group_size, cases=rows)
    write_report(report, args.json, markdown=table(rows), started=started)


if __name__ == "__main__":
    main()
