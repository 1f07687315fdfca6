"""Partial rollouts against stock TRL and grpo_plus's synchronous generation, on one device, in one run.

    .venv/bin/python benchmarks/partial_rollouts.py [--steps 30] [--seeds 3] [--max-completion-length 256]
                                                   [--chunk 64] [--eval-size 48] [--smoke] [--json out.json]
    .venvs/vllm/bin/python benchmarks/partial_rollouts.py --vllm --sides ours,partial ...    (make bench-partial-vllm)

Issue 51 part 5's case: a long-tailed length distribution (max_completion_length raised), generation seconds per step
at most 0.7x the synchronous run's, accuracy per step within the seeds' spread. The run: the demo config
(recipes/configs/demo_cpu.yaml: LoRA r=16 all-linear, 2 prompts x 8 completions, lr 3e-4, dapo + clip-higher) on
reasoning-gym chain_sum (the recipe's correctness + 0.5 x format rewards; the demo's one-digit sums where reasoning_gym
is missing), with --max-completion-length, the embedded SmolLM2-135M-Instruct in float32 (--smoke: the random tiny
model, a few steps; the numbers then mean nothing). Three sides per seed, trained one after the other from the same
seed, the order rotating from seed to seed: "trl", stock TRL's trainer; "ours", grpo_plus's defaults (its generator,
synchronous); "partial", grpo_plus with `partial_rollout_tokens=--chunk` and `rollout_correction="decoupled_token_is"`.

Per optimizer step, after --warmup steps, medians: `step` (on_step_begin -> on_step_end) and `generation` (the
generator's calls: TRL's `_generate_single_turn` on the first two sides, the pool's chunks on the third). Ratios
against both other sides, in the same run. Learning: the rewards of each step, and greedy held-out accuracy after the last step
(--eval-size questions, not timed). The partial side's `partial_rollouts/*` metrics (the share of trained tokens
sampled by older weights and their age) are kept per step. Writes --json (and the Markdown table beside it).
--vllm: both grpo_plus sides generate with vLLM in colocate mode, on one engine for the run
(grpo_plus.app.testing.shared_vllm_engine; each trainer's first sync loads its own weights), the partial side's chunks
as one request per row; stock TRL's side is not offered there (its in-place LoRA sync would need the engine reloaded).
Timings on a busy machine mean little: run it alone.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from harness.flags import arguments  # noqa: E402
from harness.report import ROOT, markdown_table, start_report, write_report  # noqa: E402
from harness.timing import StepTimer  # noqa: E402
from harness.trainers import VLLM_SETTINGS, demo_lora, demo_settings, model_path, package  # noqa: E402

from grpo_plus.engine.precision import VLLM_DTYPES  # noqa: E402

SIDES = ("trl", "ours", "partial")
EVAL_MAX_NEW_TOKENS = 64
STALENESS = (
    "partial_rollouts/stale_token_frac",
    "partial_rollouts/stale_token_age_mean",
    "partial_rollouts/stale_token_age_max",
    "partial_rollouts/carried_groups",
)


def task_data(smoke: bool, train_size: int, eval_size: int):
    """(train, held-out, (correctness, format) rewards): reasoning-gym chain_sum, or the demo's sums without it."""
    from grpo_plus.app import real_tasks, tasks

    try:
        train, held_out = real_tasks.reasoning_gym_datasets(
            "reasoning-gym:chain_sum", "min_terms=2,max_terms=3,max_digits=2", train_size, eval_size, seed=0
        )
        return train, held_out, real_tasks.task_rewards(train)
    except ImportError as error:
        print(f"chain_sum unavailable ({error}): the demo's one-digit sums instead")
        train = tasks.make_dataset("train", "add-1d", seed=0)
        held_out = tasks.make_dataset("test", "add-1d", seed=0).select(range(eval_size))
        return train, held_out, (tasks.correctness_reward, tasks.format_reward)


def timed(owner, name: str, record) -> None:
    """Wrap `owner.name` (an instance attribute from then on) to hand each call's wall time to `record`."""
    method = getattr(owner, name)

    def timed_call(*args, **kwargs):
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            record(time.perf_counter() - started)

    setattr(owner, name, timed_call)


def train_side(side: str, seed: int, model_dir: str, data, args, output_dir: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, set_seed

    from grpo_plus.app import tasks

    train, held_out, rewards = data
    settings = demo_settings(args.steps)
    settings.update(output_dir=str(output_dir), seed=seed, max_completion_length=args.max_completion_length)
    if side == "partial":
        settings.update(partial_rollout_tokens=args.chunk, rollout_correction="decoupled_token_is")
    if args.vllm:
        settings.update(VLLM_SETTINGS, vllm_dtype=args.vllm_dtype, vllm_block_size=args.vllm_block_size)
    set_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    library = package(side)
    trainer = library.GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), reward_funcs=list(rewards),
        args=library.GRPOConfig(**settings), train_dataset=train, processing_class=tokenizer,
        peft_config=demo_lora(),
    )  # fmt: skip
    trainer.remove_callback(PrinterCallback)
    timer = StepTimer(side)
    trainer.add_callback(timer)
    generation: dict[int, float] = {}  # optimizer step -> seconds in the generator

    def record(seconds: float) -> None:
        step = trainer.state.global_step
        generation[step] = generation.get(step, 0.0) + seconds

    if side == "partial":  # the pool's chunks (its replay of the handoff through TRL's generation costs nothing)
        timed(trainer._partial_rollouts, "_decode_chunk", record)
    else:
        timed(trainer, "_generate_single_turn", record)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    correctness, format_reward = rewards
    rng = torch.random.get_rng_state()
    accuracy = tasks.evaluate(trainer.model, tokenizer, held_out, max_new_tokens=EVAL_MAX_NEW_TOKENS, progress=False,
                              correctness=correctness, format=format_reward)["accuracy"]  # fmt: skip
    torch.random.set_rng_state(rng)
    print(f"  seed {seed} {side:7s} {sum(timer.step) / 60:5.2f} min  held-out accuracy {accuracy:.3f}", flush=True)
    return {
        "step_seconds": timer.step,
        "generation_seconds": [generation.get(step, 0.0) for step in range(len(timer.step))],
        "rewards": [entry.get("reward") for entry in logs],
        "mean_length": [entry.get("completions/mean_length") for entry in logs],
        "staleness": {key: [entry.get(key) for entry in logs] for key in STALENESS} if side == "partial" else None,
        "held_out_accuracy": accuracy,
    }


def summarize(runs: list[dict], warmup: int, sides: tuple[str, ...]) -> dict:
    summary = {}
    for run in runs:
        medians = {
            side: {
                kind: statistics.median(run[side][f"{kind}_seconds"][warmup:] or run[side][f"{kind}_seconds"])
                for kind in ("step", "generation")
            }
            for side in sides
        }
        entry = {"medians": medians, "held_out_accuracy": {side: run[side]["held_out_accuracy"] for side in sides}}
        for other in (side for side in sides if side != "partial"):
            for kind in ("generation", "step"):
                entry[f"{kind}_ratio_vs_{other}"] = medians["partial"][kind] / medians[other][kind]
        summary[run["seed"]] = entry
    return summary


def learning(runs: list[dict], sides: tuple[str, ...]) -> dict:
    """Per side, each step's reward over the seeds (mean, lowest, highest) and the held-out accuracies; then, for
    the partial side against each other, the share of steps whose seed-mean reward lies within the other's seed
    range (lowest to highest), and whether the mean held-out accuracy does."""
    per_side = {}
    for side in sides:
        curves = [run[side]["rewards"] for run in runs]
        steps = min(len(curve) for curve in curves)
        by_step = [[curve[step] for curve in curves] for step in range(steps)]
        accuracies = [run[side]["held_out_accuracy"] for run in runs]
        per_side[side] = {
            "reward_mean": [statistics.fmean(values) for values in by_step],
            "reward_low": [min(values) for values in by_step],
            "reward_high": [max(values) for values in by_step],
            "held_out_accuracy": accuracies,
            "held_out_accuracy_mean": statistics.fmean(accuracies),
        }
    comparisons = {}
    for other in (side for side in sides if side != "partial"):
        mine, theirs = per_side["partial"], per_side[other]
        inside = [low <= mean <= high for mean, low, high in
                  zip(mine["reward_mean"], theirs["reward_low"], theirs["reward_high"], strict=False)]  # fmt: skip
        comparisons[other] = {
            "steps_within_spread": sum(inside) / len(inside),
            "held_out_within_spread": min(theirs["held_out_accuracy"])
            <= mine["held_out_accuracy_mean"]
            <= max(theirs["held_out_accuracy"]),
        }
    return {"sides": per_side, "partial_against": comparisons}


def table(summary: dict, sides: tuple[str, ...]) -> str:
    others = [side for side in sides if side != "partial"]
    names = {"trl": "TRL", "ours": "grpo_plus", "partial": "partial"}
    rows = [
        [seed, *(f"{s['medians'][side]['generation']:.2f}" for side in sides),
         " / ".join(f"{s[f'generation_ratio_vs_{other}']:.2f}x" for other in others),
         *(f"{s['medians'][side]['step']:.2f}" for side in sides),
         " / ".join(f"{s[f'step_ratio_vs_{other}']:.2f}x" for other in others),
         " / ".join(f"{s['held_out_accuracy'][side]:.3f}" for side in sides)]
        for seed, s in summary.items()
    ]  # fmt: skip
    against = " / ".join(names[other] for other in others)
    header = [f"generation {names[side]} (s)" for side in sides] + [f"partial / {against}"]
    header += [f"step {names[side]} (s)" for side in sides] + [f"step partial / {against}"]
    header += ["held-out accuracy " + " / ".join(names[side] for side in sides)]
    return markdown_table(["seed", *header], rows)


def main(argv: list[str] | None = None) -> int:
    import torch

    from grpo_plus.app.testing import shared_vllm_engine

    parser = arguments(
        __doc__, smoke="the random tiny model, 3 steps, one seed", steps=30, warmup=2, threads=1,
        json=ROOT / "outputs" / "bench-partial-rollouts" / "partial_rollouts.json",
    )  # fmt: skip
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--max-completion-length", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=64, help="partial_rollout_tokens of the partial side")
    parser.add_argument("--train-size", type=int, default=512)
    parser.add_argument("--eval-size", type=int, default=48)
    parser.add_argument("--sides", default=",".join(SIDES), help="which of trl,ours,partial to train (partial always)")
    parser.add_argument("--vllm", action="store_true", help="generate with colocated vLLM (sides ours,partial)")
    parser.add_argument(
        "--vllm-dtype", default="float32", choices=VLLM_DTYPES,
        help="the engine's dtype (vllm_dtype): the trainer's float32 by default; vLLM's 'auto' serves a float32 "
        "checkpoint in bfloat16, which a CPU without AVX512-BF16 computes several times slower per row",
    )  # fmt: skip
    parser.add_argument(
        "--vllm-block-size", type=int, default=32,
        help="the engine's KV-cache block size (vllm_block_size): vLLM's CPU build takes 128 by default, and its "
        "prefix cache reuses whole blocks only (each chunk re-sends every row)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    sides = tuple(side for side in SIDES if side in args.sides.split(","))
    if "partial" not in sides or len(sides) < 2 or set(args.sides.split(",")) - set(SIDES):
        parser.error(f"--sides: partial and at least one of trl, ours (comma-separated), not {args.sides!r}")
    if args.vllm and "trl" in sides:
        parser.error(
            "--vllm: the sides are ours,partial (stock TRL's in-place LoRA sync is not offered on one engine)"
        )
    if args.smoke:
        args.steps, args.seeds, args.warmup, args.eval_size, args.train_size = 3, 1, 0, 4, 32
        args.max_completion_length, args.chunk = 16, 4
    torch.set_num_threads(args.threads)
    report, started = start_report(args, versions=("torch", "transformers", "trl"))
    folder = Path(tempfile.mkdtemp(prefix="bench-partial-"))
    model_dir = model_path(args.smoke, folder, **(dict(hidden_size=128) if args.vllm else {}))
    data = task_data(args.smoke, args.train_size, args.eval_size)
    runs = []
    engine = None  # with --vllm: the engine's dtype and KV-cache block size, as vLLM built it
    with shared_vllm_engine() if args.vllm else contextlib.nullcontext() as shared:
        for seed in range(args.seeds):
            order = sides[seed % len(sides) :] + sides[: seed % len(sides)]
            seed_run = {"seed": seed, "order": list(order)}
            for side in order:
                seed_run[side] = train_side(side, seed, model_dir, data, args, folder / f"{side}-{seed}")
            runs.append(seed_run)
        if shared is not None:
            built = shared.llm.llm_engine.vllm_config
            engine = {"dtype": str(built.model_config.dtype), "block_size": built.cache_config.block_size}
    summary = summarize(runs, args.warmup, sides)
    markdown = table(summary, sides)
    print(markdown)
    write_report({**report, "settings": {k: str(v) for k, v in vars(args).items()}, "engine": engine, "runs": runs,
                  "summary": summary, "learning": learning(runs, sides)}, args.json, markdown, started=started)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
