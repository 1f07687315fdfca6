"""Zero-waste generation against stock TRL: generation time, step time and token positions, in one run.

    .venv/bin/python benchmarks/generation.py [--steps 10] [--warmup 2] [--repeats 3] [--threads 1]
                                              [--skip-steps] [--skip-sweep] [--json out.json]

Model and data: the demo config (recipes/configs/demo_cpu.yaml): SmolLM2-135M-Instruct (embedded) + LoRA r=16
all-linear, one-digit sums, 2 prompts x 8 completions of <= 20 tokens (temperature 0.7), seed 0.

Part 1, the demo config: stock trl.GRPOTrainer and grpo_plus.GRPOTrainer train in lock-step in one process
(harness/lockstep.py: TRL's step 1, ours, TRL's step 2, ...), each with its own random state, so they sample the
same completions and log the same losses (both checked). Per optimizer step after the warm-up steps, medians:
  generation   wall time of `_generate_single_turn` (the `model.generate` call with TRL's padding around it)
  step         on_step_begin -> on_step_end: generation, scoring, training pass, optimizer
  positions    token positions the model computed inside `_generate_single_turn`
and where the generation time goes, from the same steps' model forwards: the prefill (the first forward), the
decode steps, the share of TRL's decode spent on rows that had already ended (each step's time x the share of rows
that had emitted EOS before it), and the rest (logits processors, sampling, TRL's padding, cache copies).
Part 2, the sweep: TRL's `model.generate` against `grpo_plus.zero_waste.generation.generate` on 2 prompts x G completions,
prompt length 56 / 256 / 1024 tokens (worked examples in a system prompt lengthen the demo prompt) x G = 4 / 8 / 16,
TRL's GenerationConfig and the weights after part 1, same seed for both (same ids, checked), alternated, median of
`--repeats`.
Targets (issue 20), demo config: generation <= 0.6x TRL's time, whole step <= 0.3x TRL's.
"""

from __future__ import annotations

import statistics
import time

from harness.flags import arguments
from harness.report import ROOT, markdown_table, side_by_side, start_report, write_report
from harness.timing import ForwardTimer, alternating, instrument_generation
from harness.trainers import SIDES, demo_settings, demo_trainer, run_in_lockstep, step_logs

from grpo_plus.compat.model import completion_eos_token_ids

PROMPT_LENGTHS = (56, 256, 1024)
GENERATIONS = (4, 8, 16)


def instrument(built: dict) -> None:
    """Record every generation call of each side (harness.timing.instrument_generation) into its `generations`."""
    for side in built.values():
        side["generations"] = []
        trainer = side["trainer"]
        eos_token_ids = set(completion_eos_token_ids(trainer))
        instrument_generation(trainer, ForwardTimer(trainer.model), eos_token_ids, side["generations"])


def run_steps(steps: int, warmup: int) -> dict:
    """Part 1: both trainers in lock-step on the demo config; per-step medians, ratios and the sameness checks."""
    built = run_in_lockstep(demo_trainer(demo_settings(steps)), prepare=instrument)
    result = {}
    measured = slice(warmup, None)
    for name in SIDES:
        side = built[name]
        logs = step_logs(side)
        generations = side["generations"]
        parts = ("prefill", "prefill_positions", "decode", "decode_positions", "finished_rows", "other", "steps")
        result[name] = dict(
            step=statistics.median(side["timer"].step[measured]),
            generation=statistics.median([g["seconds"] for g in generations][measured]),
            generation_positions=statistics.median([g["positions"] for g in generations][measured]),
            breakdown={part: statistics.median([g[part] for g in generations][measured]) for part in parts},
            losses=[entry["loss"] for entry in logs],
            completions=[g["completion_ids"] for g in generations],
            mean_length=statistics.fmean(entry["completions/mean_length"] for entry in logs),
        )
    trl_side, ours = result["trl"], result["ours"]
    result["max_loss_difference"] = max(abs(a - b) for a, b in zip(trl_side["losses"], ours["losses"], strict=True))
    result["same_completions"] = trl_side.pop("completions") == ours.pop("completions")
    result["trainers"] = {name: built[name]["trainer"] for name in SIDES}
    return result


def generation_inputs(tokenizer, questions, prompt_length: int, num_generations: int):
    """Left-padded chat prompts for `questions`, about `prompt_length` tokens each (worked examples in the system
    prompt lengthen them), each repeated `num_generations` times."""
    from grpo_plus.app import tasks

    def encode(examples: int):
        system = "".join(
            f"Example: What is {i % 9 + 1} + {(3 * i) % 9 + 1}? {i % 9 + 1} + {(3 * i) % 9 + 1} = "
            f"{i % 9 + (3 * i) % 9 + 2}. {tasks.ANSWER_PREFIX} {i % 9 + (3 * i) % 9 + 2}.\n"
            for i in range(examples)
        )
        prompts = [tasks.format_prompt(q, system_prompt=system or None) for q in questions]
        texts = tokenizer.apply_chat_template(prompts, add_generation_prompt=True, tokenize=False)
        padding_side, tokenizer.padding_side = tokenizer.padding_side, "left"
        try:
            return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        finally:
            tokenizer.padding_side = padding_side

    examples = 0
    encoded = encode(0)
    while encoded["input_ids"].shape[1] < prompt_length - 10:
        examples += max(1, (prompt_length - encoded["input_ids"].shape[1]) // 30)
        encoded = encode(examples)
    ids = encoded["input_ids"].repeat_interleave(num_generations, dim=0)
    mask = encoded["attention_mask"].repeat_interleave(num_generations, dim=0)
    return ids, mask


def generate_once(side: str, model, ids, mask, generation_config, seed: int):
    """One generation batch by TRL's `model.generate` or grpo_plus's; (sequences, seconds, grpo_plus's stats)."""
    import torch

    from grpo_plus.zero_waste.generation import generate

    torch.manual_seed(seed)
    start = time.perf_counter()
    with torch.no_grad():
        if side == "trl":
            sequences, stats = (
                model.generate(input_ids=ids, attention_mask=mask, generation_config=generation_config),
                None,
            )
        else:
            sequences, stats = generate(model, input_ids=ids, attention_mask=mask, generation_config=generation_config)
    return sequences, time.perf_counter() - start, stats


def sweep(trainer, repeats: int) -> list[dict]:
    """Part 2: TRL's generate against grpo_plus's over prompt length x G; medians of alternated repeats."""
    import torch

    tokenizer = trainer.processing_class
    questions = trainer.train_dataset["question"][2:4]
    model, config = trainer.model, trainer.generation_config
    rows = []
    for prompt_length in PROMPT_LENGTHS:
        for generations in GENERATIONS:
            ids, mask = generation_inputs(tokenizer, questions, prompt_length, generations)
            seconds = {name: [] for name in SIDES}
            same, stats = True, None
            outputs = {}
            for repeat, name in alternating(SIDES, repeats):
                sequences, elapsed, side_stats = generate_once(name, model, ids, mask, config, seed=repeat)
                seconds[name].append(elapsed)
                outputs[name] = sequences
                stats = side_stats or stats
                if len(outputs) == len(SIDES):  # both sides of this repeat
                    same = same and torch.equal(outputs.pop("trl"), outputs.pop("ours"))
            row = dict(
                prompt=int(ids.shape[1]),
                generations=generations,
                trl_seconds=statistics.median(seconds["trl"]),
                ours_seconds=statistics.median(seconds["ours"]),
                positions_ratio=stats.positions_frac,
                same_ids=same,
            )
            row["time_ratio"] = row["ours_seconds"] / row["trl_seconds"]
            rows.append(row)
            print(
                f"  P={row['prompt']:4d} G={generations:2d}: TRL {row['trl_seconds']:.2f} s, ours "
                f"{row['ours_seconds']:.2f} s ({row['time_ratio']:.2f}x), positions {row['positions_ratio']:.2f}x, "
                f"same ids: {same}",
                flush=True,
            )
    return rows


def demo_table(part1: dict) -> str:
    rows = [
        ("generation (s)", "generation", ".2f", True),
        ("whole step (s)", "step", ".2f", True),
        ("token positions in generation", "generation_positions", ".0f", True),
    ]
    trl_side = part1["trl"]
    return (
        side_by_side("demo config (median per step)", rows, trl_side, part1["ours"])
        + f"\n\nsame completions: {part1['same_completions']}; max |loss difference| over {len(trl_side['losses'])} "
        f"steps: {part1['max_loss_difference']:.2e}; mean completion length {trl_side['mean_length']:.1f}"
    )


def breakdown_table(part1: dict) -> str:
    trl_side, ours = part1["trl"]["breakdown"], part1["ours"]["breakdown"]
    rows = [
        ["prefill", f"{trl_side['prefill']:.2f} ({trl_side['prefill_positions']:.0f} positions)",
         f"{ours['prefill']:.2f} ({ours['prefill_positions']:.0f} positions)"],
        [f"decode, {trl_side['steps']:.0f} steps", f"{trl_side['decode']:.2f} ({trl_side['decode_positions']:.0f} "
         "positions)", f"{ours['decode']:.2f} ({ours['decode_positions']:.0f} positions)"],
        ["of which rows that had ended (their share of each step)", f"{trl_side['finished_rows']:.2f}", "0"],
        ["logits processing, sampling, padding, cache copies", f"{trl_side['other']:.2f}", f"{ours['other']:.2f}"],
    ]  # fmt: skip
    return markdown_table(["where generation time goes (median per step)", "stock TRL (s)", "grpo_plus (s)"], rows)


def sweep_table(rows: list[dict]) -> str:
    header = ["prompt tokens", "G", "TRL (s)", "grpo_plus (s)", "time ratio", "positions ratio", "same ids"]
    cells = [
        [row["prompt"], row["generations"], f"{row['trl_seconds']:.2f}", f"{row['ours_seconds']:.2f}",
         f"{row['time_ratio']:.2f}", f"{row['positions_ratio']:.2f}", row["same_ids"]]
        for row in rows
    ]  # fmt: skip
    return markdown_table(header, cells)


def main() -> None:
    json_path = ROOT / "outputs" / "bench-generation" / "generation.json"
    parser = arguments(__doc__, steps=10, warmup=2, repeats=3, threads=1, json=json_path)
    parser.add_argument("--skip-steps", action="store_true", help="one step in part 1, not reported (fresh trainers)")
    parser.add_argument("--skip-sweep", action="store_true")
    args = parser.parse_args()

    report, started = start_report(args)
    tables = []
    if args.skip_steps:  # the later parts only need TRL's trainer (its model, data and GenerationConfig)
        trl_trainer = run_steps(1, warmup=0)["trainers"]["trl"]
    else:
        print(f"Part 1: demo config, {args.steps} lock-step optimizer steps per trainer ...", flush=True)
        report["demo"] = run_steps(args.steps, args.warmup)
        trl_trainer = report["demo"].pop("trainers")["trl"]
        tables += [demo_table(report["demo"]), breakdown_table(report["demo"])]
        print("\n" + "\n\n".join(tables), flush=True)
    if not args.skip_sweep:
        print(f"\nPart 2: 2 prompts x G completions, {args.repeats} repeats per case ...", flush=True)
        report["sweep"] = sweep(trl_trainer, args.repeats)
        tables.append(sweep_table(report["sweep"]))
        print("\n" + tables[-1])
    write_report(report, args.json, markdown="\n\n".join(tables), started=started)


if __name__ == "__main__":
    main()
