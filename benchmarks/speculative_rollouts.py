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
"""

from __future__ import annotations

import statistics
import time

from harness.flags import arguments
from harness.report import ROOT, markdown_table, start_report, write_report
from harness.timing import alternating
from harness.trainers import model_path

SIDES = ("plain", "speculative")
GSM8K_FILE = ROOT / "benchmarks" / "data" / "gsm8k_format.jsonl"


def gsm8k_problems(path=GSM8K_FILE) -> list[dict]:
    """The GSM8K-format file's rows: {"question": ..., "answer": "<worked steps>\\n#### <number>"}."""
    import json

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


def main(argv: list[str] | None = None) -> None:
    parser = arguments(
        __doc__, smoke="the random tiny model, 16 new tokens, one repeat", repeats=3, threads=1, json=None
    )
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--max-draft", type=int, default=4)
    parser.add_argument("--ngram-min", type=int, default=1)
    parser.add_argument("--ngram-max", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--tasks", nargs="+", default=["demo", "chain_sum", "gsm8k"])
    args = parser.parse_args(argv)
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
