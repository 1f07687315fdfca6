"""Speculative rollouts against grpo_plus's generator without them: generation seconds and tokens per row forward.

    .venv/bin/python benchmarks/speculative_rollouts.py [--new-tokens 256 1024] [--generations 8] [--prompts 2]
                                                       [--repeats 3] [--threads 1] [--max-draft 4]
                                                       [--temperature 0.7] [--tasks demo chain_sum gsm8k]
                                                       [--smoke] [--json out.json]

Model: the embedded SmolLM2-135M-Instruct, float32, no adapter (--smoke: the random tiny model; the numbers then mean
nothing). Tasks: the demo's word problems (grpo_plus.app.tasks, level word-mixed, chat template and its system
prompt), reasoning-gym's chain_sum (where reasoning_gym is installed) and `gsm8k`: grade-school word problems in
GSM8K's format (benchmarks/data/gsm8k_format.jsonl: 16 problems written for this benchmark, `question` and an `answer`
whose worked steps carry GSM8K's `<<a*b=c>>` calculator notes and end in `#### N`; no download). Each case: `--prompts` prompts x G =
`--generations` completions of at most `--new-tokens` tokens, sampled as TRL samples (temperature, top_p 1, top_k 0),
`grpo_plus.zero_waste.generation.generate` with and without `speculation=SpeculativeDecoder(...)`, alternated, the
same seed per repeat, median of `--repeats`. Reported per case: seconds, new tokens per second, mean completion length
(the two sides sample different completions from the same distribution), tokens per row forward and the acceptance
rate, and token positions through the model (drafted positions included). Target (issue 52): at least 1.5x faster generation at 256+ tokens on this CPU.

    .venv/bin/python benchmarks/speculative_rollouts.py --part accuracy [--seeds 3] [--steps 16] [--eval-every 4]
                                                       [--eval-size 32] [--max-completion-length 256] [--smoke]

`--part accuracy`: held-out accuracy per step over seeds, with and without `speculative_rollouts` (issue 52: within
the spread of 3 seeds). Per seed, two grpo_plus trainers in lock-step from that seed (harness.trainers: the same
LoRA initialization, the same prompts): the demo config (recipes/configs/demo_cpu.yaml: LoRA r=16 all-linear, 2
prompts x 8 completions, lr 3e-4, dapo + clip-higher, temperature 0.7) on reasoning-gym chain_sum (--task-config;
the recipe's correctness + 0.5 x format rewards) with --max-completion-length, "plain" with its defaults and
"speculative" with `speculative_rollouts=True`; greedy held-out accuracy (--eval-size questions, --eval-max-new-tokens)
before training and every --eval-every steps (harness.evaluation, untimed). The two sides sample different
completions from the same distribution, so their curves part like two seeds' do. Reported per evaluated step: each
side's accuracy per seed, its mean and range, and whether each side's mean lies within the other side's range of
seeds; per step the rewards and the speculative side's acceptance. Step seconds are kept in the JSON as measured
(under whatever load the machine had: not figures to quote).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from harness.flags import arguments
from harness.process import child_result
from harness.report import ROOT, markdown_table, start_report, write_report
from harness.timing import alternating
from harness.trainers import model_path

SIDES = ("plain", "speculative")
GSM8K_FILE = ROOT / "benchmarks" / "data" / "gsm8k_format.jsonl"


def gsm8k_problems(path=GSM8K_FILE) -> list[dict]:
    """The GSM8K-format file's rows: {"question": ..., "answer": "<worked steps>\\n#### <number>"}."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def task_prompts(tokenizer, task: str, count: int) -> list[str]:
    """`count` chat-formatted prompts of `task` ("demo": word-mixed sums; "gsm8k": the GSM8K-format file's first
    `count` questions; "chain_sum" or another reasoning-gym task: reasoning-gym's)."""
    from grpo_plus.app import tasks

    if task == "demo":
        problems = tasks.generate_problems(tasks.BENCHMARK_LEVEL, "test", size=count, seed=0)
        messages = [tasks.format_prompt(problem.question) for problem in problems]
    elif task == "gsm8k":
        problems = gsm8k_problems()[:count]
        messages = [[{"role": "user", "content": row["question"] + " Think step by step."}] for row in problems]
    else:
        import reasoning_gym

        dataset = reasoning_gym.create_dataset(task, size=count, seed=0)
        messages = [[{"role": "user", "content": entry["question"] + " Think step by step."}] for entry in dataset]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def batch(tokenizer, texts: list[str], generations: int):
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    finally:
        tokenizer.padding_side = side
    ids = encoded["input_ids"].repeat_interleave(generations, dim=0)
    return ids, encoded["attention_mask"].repeat_interleave(generations, dim=0)


def run_case(model, tokenizer, ids, mask, config, decoder, repeats: int) -> dict:
    import torch

    from grpo_plus.zero_waste.generation import generate

    measured = {name: [] for name in SIDES}
    for repeat, name in alternating(SIDES, repeats):
        torch.manual_seed(repeat)
        start = time.perf_counter()
        with torch.no_grad():
            sequences, stats = generate(
                model, input_ids=ids, attention_mask=mask, generation_config=config,
                speculation=decoder if name == "speculative" else None,
            )  # fmt: skip
        seconds = time.perf_counter() - start
        completions = sequences[:, ids.shape[1] :]
        lengths = (completions != tokenizer.pad_token_id).sum(1).float()
        counts = stats.speculation
        measured[name].append(
            dict(
                seconds=seconds,
                tokens=float(lengths.sum()),
                mean_length=float(lengths.mean()),
                tokens_per_row_forward=counts.tokens_per_row_forward if counts else 1.0,
                acceptance_rate=counts.acceptance_rate if counts else 0.0,
                forwards=counts.forwards if counts else completions.shape[1] - 1,
                positions=stats.positions,  # token positions through the model (what a compute-bound CPU pays for)
                fallback=(counts.fallback if counts else None) or stats.fallback,
            )
        )
    result = {}
    for name, runs in measured.items():
        result[name] = {key: statistics.median([run[key] for run in runs]) for key in runs[0] if key != "fallback"}
        result[name]["tokens_per_second"] = statistics.median([run["tokens"] / run["seconds"] for run in runs])
        result[name]["fallback"] = runs[0]["fallback"]
    result["speedup_tokens_per_second"] = (
        result["speculative"]["tokens_per_second"] / result["plain"]["tokens_per_second"]
    )
    return result


ACCURACY_SIDES = ("plain", "speculative")
SPECULATIVE_LOGS = ("speculative/acceptance_rate", "speculative/tokens_per_row_forward")


def accuracy_run(seed: int, args, data, model_dir: str, output_dir) -> dict:
    """One seed: the plain and the speculative trainer in lock-step, held-out accuracy every --eval-every steps."""
    from harness.evaluation import HeldOutEval
    from harness.trainers import demo_settings, demo_trainer, run_in_lockstep
    from transformers import PrinterCallback

    train, held_out, rewards = data
    settings = demo_settings(args.steps)
    settings.update(output_dir=str(output_dir), seed=seed, max_completion_length=args.max_completion_length)
    side_settings = {"speculative": dict(speculative_rollouts=True, speculative_max_draft_tokens=args.max_draft)}

    def add_evaluations(built: dict) -> None:
        for name, side in built.items():
            trainer = side["trainer"]
            side["evals"] = HeldOutEval(
                name, side["timer"], held_out, trainer.processing_class, args.eval_every, rewards,
                max_new_tokens=args.eval_max_new_tokens, label=f"seed {seed} {name}",
            )  # fmt: skip
            trainer.add_callback(side["evals"])  # after the StepTimer: outside the timed step
            trainer.remove_callback(PrinterCallback)

    make = demo_trainer(settings, dataset=train, reward_funcs=list(rewards), model_dir=model_dir,
                        side_settings=side_settings)  # fmt: skip
    built = run_in_lockstep(make, ACCURACY_SIDES, prepare=add_evaluations, seed=seed)
    run = {}
    for name, side in built.items():
        logs = [entry for entry in side["trainer"].state.log_history if "loss" in entry]
        run[name] = {
            "evals": side["evals"].points,
            "rewards": [entry.get("reward") for entry in logs],
            "mean_length": [entry.get("completions/mean_length") for entry in logs],
            "step_seconds_under_load": side["timer"].step,
            **{key.split("/")[1]: [entry.get(key) for entry in logs] for key in SPECULATIVE_LOGS if name != "plain"},
        }
    return run


def within(value: float, values: list[float]) -> bool:
    return min(values) - 1e-12 <= value <= max(values) + 1e-12


def accuracy_summary(runs: list[dict]) -> dict:
    """Per evaluated step: each side's accuracy per seed, mean, range; each side's mean within the other's range."""
    steps = [point["step"] for point in runs[0]["plain"]["evals"]]
    per_step = []
    for index, step in enumerate(steps):
        row = {"step": step}
        for name in ACCURACY_SIDES:
            seeds = [run[name]["evals"][index]["accuracy"] for run in runs]
            row[name] = {"per_seed": seeds, "mean": statistics.fmean(seeds), "min": min(seeds), "max": max(seeds)}
        row["speculative_mean_within_plain_seeds"] = within(row["speculative"]["mean"], row["plain"]["per_seed"])
        row["plain_mean_within_speculative_seeds"] = within(row["plain"]["mean"], row["speculative"]["per_seed"])
        per_step.append(row)
    speculative = [value for run in runs for value in run["speculative"]["acceptance_rate"] if value is not None]
    forwards = [value for run in runs for value in run["speculative"]["tokens_per_row_forward"] if value is not None]
    return {
        "per_step": per_step,
        "speculative_within_plain_at_every_step": all(r["speculative_mean_within_plain_seeds"] for r in per_step),
        "plain_within_speculative_at_every_step": all(r["plain_mean_within_speculative_seeds"] for r in per_step),
        "mean_reward": {name: statistics.fmean(v for run in runs for v in run[name]["rewards"]) for name in ACCURACY_SIDES},
        "speculative_acceptance_rate": statistics.fmean(speculative) if speculative else None,
        "speculative_tokens_per_row_forward": statistics.fmean(forwards) if forwards else None,
    }  # fmt: skip


def accuracy_table(summary: dict) -> str:
    rows = [
        [row["step"],
         *(" / ".join(f"{a:.3f}" for a in row[name]["per_seed"]) for name in ACCURACY_SIDES),
         *(f"{row[name]['mean']:.3f}" for name in ACCURACY_SIDES),
         "yes" if row["speculative_mean_within_plain_seeds"] else "**no**",
         "yes" if row["plain_mean_within_speculative_seeds"] else "**no**"]
        for row in summary["per_step"]
    ]  # fmt: skip
    header = ["step", "plain (per seed)", "speculative (per seed)", "plain mean", "speculative mean",
              "spec. mean within plain's seeds", "plain mean within spec.'s seeds"]  # fmt: skip
    return markdown_table(header, rows)


def seeds_in_parallel(args, argv: list[str]) -> list[dict]:
    """Each seed's run in its own process (`--child`, harness.process), all at once: accuracy per step does not depend
    on what else runs (each process trains on one thread, from its seed), only the seconds do."""
    import os
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    from harness.process import launch_child

    given = [argument for argument in argv if argument != "--parallel"]

    def one(seed: int) -> dict:
        return {"seed": seed, **launch_child(Path(__file__), {"seed": seed, "argv": given}, dict(os.environ))}

    with ThreadPoolExecutor(max_workers=args.seeds) as pool:
        return list(pool.map(one, range(args.seeds)))


def accuracy_part(args, report: dict, started: float, argv: list[str], child_seed: int | None = None) -> None:
    """The accuracy part: every seed's run (one after the other, or with --parallel each in its own process), the
    summary and its table; in a child (`child_seed`), that seed's run handed back to the parent."""
    import tempfile
    from pathlib import Path

    from grpo_plus.app import real_tasks

    folder = Path(tempfile.mkdtemp(prefix="bench-speculative-accuracy-"))
    model_dir = model_path(args.smoke, folder)
    train, held_out = real_tasks.reasoning_gym_datasets(
        "reasoning-gym:chain_sum", args.task_config, args.train_size, args.eval_size, seed=0
    )
    data = (train, held_out, real_tasks.task_rewards(train))
    if child_seed is not None:  # one seed of a --parallel run, in its own process
        child_result(accuracy_run(child_seed, args, data, model_dir, folder / f"seed-{child_seed}"))
        return
    if args.parallel:
        runs = seeds_in_parallel(args, argv)
    else:
        runs = [
            {"seed": seed, **accuracy_run(seed, args, data, model_dir, folder / f"seed-{seed}")}
            for seed in range(args.seeds)
        ]
    summary = accuracy_summary(runs)
    table = accuracy_table(summary)
    print(table)
    settings = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
    write_report(
        {**report, "settings": settings, "runs": runs, "summary": summary},
        args.json or ROOT / "outputs" / "bench-speculative" / "speculative_accuracy.json", table, started,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = arguments(
        __doc__, smoke="the random tiny model, 16 new tokens, one repeat (accuracy: 2 steps, one seed)", repeats=3,
        threads=1, json=None, steps=16,
    )  # fmt: skip
    parser.add_argument("--part", choices=("generation", "accuracy"), default="generation")
    parser.add_argument("--seeds", type=int, default=3, help="accuracy: seeds 0 .. N-1")
    parser.add_argument("--eval-every", type=int, default=4, help="accuracy: steps between held-out evaluations")
    parser.add_argument("--eval-size", type=int, default=32, help="accuracy: held-out questions (greedy)")
    parser.add_argument("--eval-max-new-tokens", type=int, default=64, help="accuracy: reply length when evaluating")
    parser.add_argument("--train-size", type=int, default=512, help="accuracy: generated training questions")
    parser.add_argument("--max-completion-length", type=int, default=256, help="accuracy: the trainers' completions")
    parser.add_argument("--task-config", default="min_terms=2,max_terms=3,max_digits=2", help="accuracy: chain_sum's")
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--max-draft", type=int, default=4)
    parser.add_argument("--ngram-min", type=int, default=1)
    parser.add_argument("--ngram-max", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--tasks", nargs="+", default=["demo", "chain_sum", "gsm8k"])
    parser.add_argument("--parallel", action="store_true", help="accuracy: each seed in its own process, at once")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # a --parallel run's seed job (JSON)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    child_seed = None
    if args.child is not None:
        job = json.loads(args.child)
        argv, child_seed = job["argv"], job["seed"]
        args = parser.parse_args(argv)
    if args.part == "accuracy":
        if args.smoke:
            args.steps, args.seeds, args.eval_every, args.eval_size, args.train_size = 2, 1, 1, 4, 16
            args.max_completion_length, args.eval_max_new_tokens = 16, 8
        report, started = start_report(args, versions=("torch", "transformers", "trl"))
        accuracy_part(args, report, started, argv, child_seed)
        return
    report, started = start_report(args)
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from grpo_plus.speculative import SpeculativeDecoder, SpeculativeSettings

    if args.smoke:
        args.new_tokens, args.repeats = [16], 1
    folder = tempfile.mkdtemp()
    path = model_path(args.smoke, folder)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    settings = SpeculativeSettings(
        enabled=True, max_draft_tokens=args.max_draft, ngram_min=args.ngram_min, ngram_max=args.ngram_max
    )
    decoder = SpeculativeDecoder(settings)
    eos = model.generation_config.eos_token_id
    report.update(vars(args) | {"json": str(args.json) if args.json else None, "cases": []})
    rows = []
    for task in args.tasks:
        try:
            texts = task_prompts(tokenizer, task, args.prompts)
        except ImportError as error:
            print(f"{task} skipped: {error}")
            continue
        ids, mask = batch(tokenizer, texts, args.generations)
        for new_tokens in args.new_tokens:
            config = GenerationConfig(
                max_new_tokens=new_tokens, do_sample=True, temperature=args.temperature, top_p=1.0, top_k=0,
                pad_token_id=tokenizer.pad_token_id, eos_token_id=eos if isinstance(eos, list) else [eos],
                disable_compile=True,
            )  # fmt: skip
            case = run_case(model, tokenizer, ids, mask, config, decoder, args.repeats)
            case.update(task=task, new_tokens=new_tokens, prompt_tokens=int(ids.shape[1]), rows=int(ids.shape[0]))
            report["cases"].append(case)
            plain, ours = case["plain"], case["speculative"]
            rows.append([
                task, new_tokens, f"{plain['seconds']:.1f}", f"{ours['seconds']:.1f}",
                f"{plain['mean_length']:.0f} / {ours['mean_length']:.0f}", f"{ours['tokens_per_row_forward']:.2f}",
                f"{ours['acceptance_rate']:.2f}", f"**{case['speedup_tokens_per_second']:.2f}**",
            ])  # fmt: skip
            print(rows[-1], flush=True)
    header = ["task", "new tokens", "plain (s)", "speculative (s)", "mean length (plain / spec.)",
              "tokens per row forward", "acceptance", "tokens/s ratio"]  # fmt: skip
    table = markdown_table(header, rows)
    print(table)
    write_report(
        report, args.json or ROOT / "outputs" / "bench-speculative" / "speculative_rollouts.json", table, started
    )


if __name__ == "__main__":
    main()
