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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SIDES = ("trl", "ours", "exact")
DEAD_SHARES = (0.0, 0.25, 0.5, 0.75)


def build_trainers(smoke: bool, output_dir: str) -> dict:
    """Stock TRL's and grpo_plus's trainer on the same model weights (grpo_plus's serves "ours" and "exact")."""
    import torch
    import trl
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

    import grpo_plus

    if smoke:
        from grpo_plus.app.testing import save_tiny_model

        path = save_tiny_model(Path(output_dir) / "tiny")
    else:
        from grpo_plus.app.embedded import resolve_model

        path = resolve_model("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(path)
    dataset = Dataset.from_list([{"prompt": "1+1="}] * 8)
    settings = dict(
        output_dir=output_dir, per_device_train_batch_size=8, num_generations=8, max_completion_length=20,
        loss_type="dapo", epsilon_high=0.28, use_cpu=True, bf16=False, report_to="none", save_strategy="no",
    )  # fmt: skip
    trainers = {}
    for name, package in (("trl", trl), ("ours", grpo_plus)):
        set_seed(0)  # the LoRA init draws random numbers: the same for both
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        trainers[name] = package.GRPOTrainer(
            model=model,
            reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
            args=package.GRPOConfig(**settings),
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"),
        )
    trainers["ours"].model.load_state_dict(trainers["trl"].model.state_dict())
    for trainer in trainers.values():
        trainer.current_gradient_accumulation_steps = 1
        trainer.model.train()
    return trainers


def with_exact_entropy(trainer, exact: bool) -> None:
    """Set the run's `zero_waste_exact_entropy` (settings are read once at construction: the pass is wired again)."""
    trainer._wire_training_pass(enabled=True, shared_prompt=True, exact_entropy=exact)


def run_cases(trainers: dict, repeats: int, group_size: int = 8) -> list[dict]:
    from shapes import synthetic_micro_batch

    from grpo_plus.app.testing import ForwardLog

    vocab = len(trainers["trl"].processing_class)
    sides = {"trl": trainers["trl"], "ours": trainers["ours"], "exact": trainers["ours"]}
    forwards = {name: ForwardLog(trainer.model) for name, trainer in trainers.items()}
    rows = []
    for case, dead_share in enumerate(DEAD_SHARES):
        rows_per_batch = 4 * group_size
        inputs = synthetic_micro_batch(
            rows_per_batch, group_size, 56, 20, vocab, dead_share, seed=case, ragged=True, first_token=10
        )
        seconds = {name: [] for name in SIDES}
        losses, entropy, positions = {}, {}, {}
        for repeat in range(repeats):
            for name in SIDES if repeat % 2 == 0 else SIDES[::-1]:
                trainer = sides[name]
                if name != "trl":
                    with_exact_entropy(trainer, exact=name == "exact")
                trainer._metrics["train"].clear()
                trainer.model.zero_grad(set_to_none=True)
                log = forwards["trl" if name == "trl" else "ours"]
                log.clear()
                start = time.perf_counter()
                loss = trainer._compute_loss(trainer.model, dict(inputs))
                loss.backward()
                seconds[name].append(time.perf_counter() - start)
                losses[name], entropy[name] = loss.item(), trainer._metrics["train"]["entropy"][-1]
                positions[name] = (log.training_positions, log.positions - log.training_positions)
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


def main() -> None:
    import argparse
    import json

    import torch
    import transformers

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--group-size", type=int, default=8, help="completions per group (4 groups per micro-batch)")
    parser.add_argument("--smoke", action="store_true", help="the tiny test model, 1 repeat: checks the script runs")
    parser.add_argument("--json", default=str(ROOT / "outputs" / "bench-exact-entropy" / "exact_entropy.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as output_dir:
        trainers = build_trainers(args.smoke, output_dir)
        rows = run_cases(trainers, 1 if args.smoke else args.repeats, args.group_size)
    print(
        "\n| dead groups | TRL (s) | grpo_plus (s) | ratio | with exact entropy (s) | ratio | positions: TRL | "
        "grpo_plus | exact entropy's no-grad forward |\n|---|---|---|---|---|---|---|---|---|"
    )
    for row in rows:
        print(
            f"| {row['dead_share']:.0%} | {row['trl_seconds']:.3f} | {row['ours_seconds']:.3f} | {row['ours_ratio']:.2f} "
            f"| {row['exact_seconds']:.3f} | {row['exact_ratio']:.2f} | {row['trl_positions']} | "
            f"{row['ours_positions']} | {row['exact_no_grad_positions']} |"
        )
    report = {
        "threads": args.threads,
        "smoke": args.smoke,
        "group_size": args.group_size,
        "torch": torch.__version__,
        "cases": rows,
    }
    report["wall_minutes"] = (time.perf_counter() - started) / 60
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"\nwall time {report['wall_minutes']:.1f} min; results in {args.json}")


if __name__ == "__main__":
    main()
