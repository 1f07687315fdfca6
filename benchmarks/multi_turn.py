"""Multi-turn tool calling against stock TRL: generation time, prefill and generation positions, whole step, one run.

    .venv/bin/python benchmarks/multi_turn.py [--steps 6] [--warmup 1] [--threads 1] [--json out.json]
    .venv/bin/python benchmarks/multi_turn.py --smoke [--model-dir DIR]     # seconds: the test suite runs this
    .venv/bin/python benchmarks/multi_turn.py --exactness                   # part 3 only

Model: a Qwen3 (hidden 128, 2 layers, 0.5M parameters; `--smoke`: hidden 64) with TRL's Qwen3 chat template and a
character tokenizer, trained here to answer a number with `increment` tool calls (grpo_plus.app.tool_model;
built once into outputs/bench-multi-turn/, ~1-2 min on a loaded 2-core machine). The full run puts a ~290-token
prompt before each question: a system prompt (agents carry long instructions) plus the tool schema TRL renders.
TRL's tool loop runs `tools=[increment]`: a row that calls the tool gets the tool's answer and generates again, up to
three turns per row here (one or two calls, then the answer).

Stock trl.GRPOTrainer, grpo_plus.GRPOTrainer and grpo_plus with its tool turns re-prefilling whole histories (as TRL
does; its other savings on) train in lock-step in one process (harness/lockstep.py: TRL's step 1, ours, ours
re-prefilling, TRL's step 2, ...), each with its own random state, so they sample the same completions and log the
same losses (both checked). Per optimizer step after the warm-up steps, medians:
  generation          wall time of all `_generate_single_turn` calls of the step (TRL's first turn + tool turns)
  prefill positions   token positions of the prefills (the first forward of every call: rows x padded width)
  positions           token positions of every forward inside those calls (prefills + decode steps)
  step                on_step_begin -> on_step_end: generation, tools, scoring, training pass, optimizer
Full run: 2 prompts x 8 completions per step, at most 128 completion tokens, temperature 1, float32, SGD.

Part 2, one tool turn on a real-size model: SmolLM2-135M-Instruct (embedded; it does not call tools, so the turn is
built as TRL's tool loop builds it): 2 prompts x 8 rows of `--sweep-prompt` lengths (a system prompt of worked tool
calls), a first turn of up to 24 sampled tokens, then each row's prompt + completion + a tool-response block
(~25 tokens), left-padded. The second turn (up to 16 new tokens, TRL's sampling) is timed: TRL's `model.generate`
(the whole history prefilled) against grpo_plus's `generate` continuing the first turn's kept caches, same seed (same
ids, checked), alternated, median of `--repeats`.

Part 3 (`--exactness`), how far a continued cache is from a fresh prefill: grpo_plus.app.tool_model's two-turn setup
(3 prompts x 4 rows of a tiny random model; the second turn continues 6 rows with 2-4 'tool' tokens each) for several
model families: the largest logit difference over every step of the second turn, teacher-forced on model.generate's
tokens (10 seeds), and how many of 40 sampled second turns differ in any token.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from harness.flags import arguments
from harness.report import ROOT, markdown_table, start_report, write_report
from harness.timing import alternating
from harness.trainers import run_in_lockstep

# "ours_reprefill": grpo_plus with its tool turns prefilling whole histories as TRL does (everything else on): the
# difference to "ours" is what keeping the caches across turns saves.
SIDES = ("trl", "ours", "ours_reprefill")
SYSTEM_PROMPT = ("You are a careful assistant. Use the tools when they help. " * 5).strip()
FULL_MODEL = dict(
    steps=120,
    learning_rate=3e-3,
    system=SYSTEM_PROMPT,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=2048,
)


def model_dir(smoke: bool, given: str | None) -> Path:
    """The tool model to use: `given`, or the benchmark's own (built and cached on first use)."""
    from grpo_plus.app.tool_model import save_tool_model

    if given is not None:
        return Path(given)
    name = "tiny" if smoke else "h128-system"
    path = ROOT / "outputs" / "bench-multi-turn" / name
    if not (path / "config.json").exists():
        print(f"building the tool model in {path} ...", flush=True)
        with tempfile.TemporaryDirectory(dir=path.parent if path.parent.exists() else None) as tmp:
            built = save_tool_model(Path(tmp) / name, **({} if smoke else FULL_MODEL))
            path.parent.mkdir(parents=True, exist_ok=True)
            built.rename(path)
    return path


def tool_trainers(path: Path, smoke: bool, steps: int):
    """A `make` for harness.trainers: the side's trainer with tools on the tool model; "ours_reprefill" re-prefills
    whole histories at every tool turn."""
    import contextlib

    from datasets import Dataset

    from grpo_plus.app.tool_model import increment, number_prompts, tool_trainer

    rows = number_prompts(10)
    if not smoke:
        for row in rows:
            row["prompt"] = [{"role": "system", "content": SYSTEM_PROMPT}, *row["prompt"]]
    settings = dict(max_steps=steps, learning_rate=0.01)
    if not smoke:
        settings.update(per_device_train_batch_size=16, num_generations=8)

    def make(name, package, callbacks):
        trainer = tool_trainer(
            package, path, ROOT / "outputs" / "bench-multi-turn" / "run", train_dataset=Dataset.from_list(rows),
            tools=[increment], callbacks=callbacks, **settings,
        )  # fmt: skip
        if name == "ours_reprefill":  # no TurnCache for the rounds: every tool turn prefills whole histories
            trainer._tool_turns = contextlib.nullcontext
        return trainer

    return make


def record_turns(built: dict) -> None:
    """Each side records its generation calls (grpo_plus.app.tool_model's TurnRecorder) into `turns`."""
    from grpo_plus.app.tool_model import TurnRecorder

    for side in built.values():
        side["turns"] = TurnRecorder(side["trainer"])


def summarize(side: dict, warmup: int) -> dict:
    """Per-step medians over the steps after `warmup` (one generation round per step here)."""
    trainer, rounds = side["trainer"], side["turns"].rounds
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    measured = slice(warmup, None)

    def per_step(value) -> float:
        return statistics.median([sum(value(call) for call in calls) for calls in rounds][measured])

    return dict(
        step=statistics.median(side["timer"].step[measured]),
        generation=per_step(lambda call: call["seconds"]),
        prefill_positions=per_step(lambda call: call["forwards"][0][0] * call["forwards"][0][1]),
        positions=per_step(lambda call: sum(rows * columns for rows, columns in call["forwards"])),
        turns=statistics.fmean(len(calls) for calls in rounds),
        tool_calls_per_row=statistics.fmean(entry["tools/call_frequency"] for entry in logs),
        losses=[entry["loss"] for entry in logs],
        completions=[[call["completion_ids"] for call in calls] for calls in rounds],
    )


def run(path: Path, smoke: bool, steps: int, warmup: int) -> dict:
    built = run_in_lockstep(tool_trainers(path, smoke, steps), SIDES, prepare=record_turns)
    result = {name: summarize(built[name], warmup) for name in SIDES}
    theirs = result["trl"]
    completions = [result[name].pop("completions") for name in SIDES]
    result["same_completions"] = all(c == completions[0] for c in completions)
    result["max_loss_difference"] = max(
        abs(a - b) for name in SIDES[1:] for a, b in zip(theirs["losses"], result[name]["losses"], strict=True)
    )
    for key in ("generation", "prefill_positions", "positions", "step"):
        result[f"{key}_ratio"] = result["ours"][key] / theirs[key]
        result[f"{key}_ratio_reprefill"] = result["ours_reprefill"][key] / theirs[key]
    return result


def result_table(result: dict) -> str:
    theirs, ours, reprefill = result["trl"], result["ours"], result["ours_reprefill"]
    rows = [
        ("generation, all turns (s)", "generation", ".3f"),
        ("prefill positions", "prefill_positions", ".0f"),
        ("positions in generation", "positions", ".0f"),
        ("whole step (s)", "step", ".3f"),
    ]
    header = ["multi-turn tools (median per step)", "stock TRL", "grpo_plus, histories re-prefilled", "grpo_plus"]
    cells = [
        [label, format(theirs[key], spec), f"{reprefill[key]:{spec}} ({result[key + '_ratio_reprefill']:.2f}x)",
         format(ours[key], spec), f"**{result[key + '_ratio']:.2f}**"]
        for label, key, spec in rows
    ]  # fmt: skip
    return (
        markdown_table([*header, "ratio"], cells)
        + f"\n\nsame completions: {result['same_completions']}; max |loss difference| over {len(ours['losses'])} "
        f"steps: {result['max_loss_difference']:.2e}; generation calls (turns) per step {ours['turns']:.1f}; tool "
        f"calls per row {ours['tool_calls_per_row']:.2f}"
    )


def tool_turn_inputs(tokenizer, first_turn, prompt_ids, prompt_mask):
    """The second turn's rows as TRL's tool loop builds them: prompt + completion (cut after EOS) + tool block."""
    import torch

    tool_block = tokenizer(
        "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False,
    )["input_ids"]
    rows = []
    completions = first_turn[:, prompt_ids.shape[1] :].tolist()
    for prompt, real, sequence in zip(prompt_ids, prompt_mask.bool(), completions, strict=True):
        end = sequence.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in sequence else len(sequence)
        rows.append(prompt[real].tolist() + sequence[:end] + tool_block)
    width = max(len(row) for row in rows)
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(row)) + row for row in rows])
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows])
    return ids, mask


def sweep(prompt_lengths: list[int], repeats: int) -> list[dict]:
    """Part 2: one tool turn of SmolLM2-135M, TRL's generate against grpo_plus's continuing the kept caches."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from grpo_plus.app.embedded import resolve_model
    from grpo_plus.zero_waste.generation import generate
    from grpo_plus.zero_waste.multi_turn import TurnCache

    path = resolve_model("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    settings = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=tokenizer.pad_token_id)
    settings.update(eos_token_id=tokenizer.eos_token_id, disable_compile=True)
    example = (
        'Example: the user asks 3, you call <tool_call>{"name": "increment", "arguments": {"n": 3}}</tool_call>. '
    )
    rows = []
    for prompt_length in prompt_lengths:
        system = example * max(1, prompt_length // len(tokenizer(example)["input_ids"]))
        prompts = [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in ("3", "8")]
        texts = tokenizer.apply_chat_template(prompts, add_generation_prompt=True, tokenize=False)
        encoded = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
        ids, mask = encoded["input_ids"].repeat_interleave(8, 0), encoded["attention_mask"].repeat_interleave(8, 0)
        turns = TurnCache()
        torch.manual_seed(0)
        with torch.no_grad():
            first, _ = generate(model, turns=turns, input_ids=ids, attention_mask=mask,
                                generation_config=GenerationConfig(max_new_tokens=24, **settings))  # fmt: skip
        kept = list(turns._current)
        second_ids, second_mask = tool_turn_inputs(tokenizer, first, ids, mask)
        config = GenerationConfig(max_new_tokens=16, **settings)
        seconds, outputs, stats = {"trl": [], "ours": []}, {}, None
        for repeat, side in alternating(("trl", "ours"), repeats):
            torch.manual_seed(repeat)
            start = time.perf_counter()
            with torch.no_grad():
                if side == "trl":
                    outputs[side] = model.generate(
                        input_ids=second_ids, attention_mask=second_mask, generation_config=config
                    )
                else:
                    turns._current = list(kept)
                    outputs[side], stats = generate(
                        model, turns=turns, input_ids=second_ids, attention_mask=second_mask,
                        generation_config=config,
                    )  # fmt: skip
            seconds[side].append(time.perf_counter() - start)
        same = torch.equal(outputs["trl"], outputs["ours"])  # the last repeat's
        row = dict(
            prompt=int(ids.shape[1]),
            history=int(second_ids.shape[1]),
            trl_seconds=statistics.median(seconds["trl"]),
            ours_seconds=statistics.median(seconds["ours"]),
            prefill_positions_ratio=stats.prefill_positions_frac,
            positions_ratio=stats.positions_frac,
            same_ids=same,
        )
        row["time_ratio"] = row["ours_seconds"] / row["trl_seconds"]
        rows.append(row)
        print(
            f"  prompt {row['prompt']}, history {row['history']}: TRL {row['trl_seconds']:.2f} s, ours "
            f"{row['ours_seconds']:.2f} s ({row['time_ratio']:.2f}x), prefill positions "
            f"{row['prefill_positions_ratio']:.3f}x, same ids: {same}",
            flush=True,
        )
    return rows


def sweep_table(rows: list[dict]) -> str:
    header = ["prompt tokens", "history tokens (turn 2)", "TRL (s)", "grpo_plus (s)", "time ratio"]
    header += ["prefill positions ratio", "positions ratio", "same ids"]
    cells = [
        [row["prompt"], row["history"], f"{row['trl_seconds']:.2f}", f"{row['ours_seconds']:.2f}",
         f"{row['time_ratio']:.2f}", f"{row['prefill_positions_ratio']:.3f}", f"{row['positions_ratio']:.2f}",
         row["same_ids"]]
        for row in rows
    ]  # fmt: skip
    return markdown_table(header, cells)


class ForcedTokens:
    """A logits processor that records every step's logits and forces `tokens[:, step]` (teacher forcing)."""

    def __init__(self, tokens):
        self.tokens, self.logits = tokens, []

    def __call__(self, input_ids, scores):
        import torch

        self.logits.append(scores.clone())
        step = len(self.logits) - 1
        return torch.full_like(scores, float("-inf")).scatter(1, self.tokens[:, step : step + 1], 0.0)


def exactness(seeds: int = 40, forced_seeds: int = 10) -> list[dict]:
    """Part 3: continued caches against model.generate's fresh prefill of the whole history."""
    import torch
    from transformers import GenerationConfig, LogitsProcessorList

    from grpo_plus.app.tool_model import two_turns
    from grpo_plus.zero_waste.generation import generate

    rows = []
    for family, lora in (("llama", False), ("qwen3", True), ("qwen2", True), ("mistral", False), ("gpt2", False)):
        model, config, turns, (ids, mask) = two_turns(family, lora)
        kept, worst, differing = list(turns._current), 0.0, 0
        eos = config.eos_token_id[0]
        for seed in range(seeds):
            turns._current = list(kept)
            torch.manual_seed(seed)
            reference = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
            torch.manual_seed(seed)
            ours, _ = generate(model, turns=turns, input_ids=ids, attention_mask=mask, generation_config=config)
            differing += int(not torch.equal(reference, ours))
            if seed >= forced_seeds:
                continue
            tokens = reference[:, ids.shape[1] :]
            greedy = GenerationConfig(**{**config.to_dict(), "do_sample": False, "temperature": None})
            greedy.sequence_bias = None
            recorders = ForcedTokens(tokens), ForcedTokens(tokens)
            kwargs = dict(input_ids=ids, attention_mask=mask, generation_config=greedy)
            model.generate(**kwargs, logits_processor=LogitsProcessorList([recorders[0]]))
            turns._current = list(kept)
            generate(model, turns=turns, **kwargs, logits_processor=LogitsProcessorList([recorders[1]]))
            for step, (theirs, mine) in enumerate(zip(*(r.logits for r in recorders), strict=True)):
                unfinished = ~(tokens[:, :step] == eos).any(dim=1)  # rows still generating at this step
                if unfinished.any():
                    worst = max(worst, (theirs[unfinished] - mine[unfinished]).abs().max().item())
        rows.append(dict(model=family + (" + LoRA" if lora else ""), max_logit_diff=worst, differing=differing))
        print(f"  {rows[-1]['model']}: max |logit diff| {worst:.1e}, sampled runs with another token: "
              f"{differing}/{seeds}", flush=True)  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> dict:
    json_path = ROOT / "outputs" / "bench-multi-turn" / "multi_turn.json"
    parser = arguments(
        __doc__, steps=6, warmup=1, repeats=3, threads=1, json=json_path, smoke="the tiny model, 1 step, no warm-up"
    )
    parser.add_argument("--model-dir", default=None, help="a tool model saved by grpo_plus.app.tool_model")
    parser.add_argument("--skip-sweep", action="store_true", help="no part 2 (always skipped with --smoke)")
    parser.add_argument("--sweep-prompt", type=int, nargs="+", default=[256, 1024], help="part 2 prompt lengths")
    parser.add_argument("--exactness", action="store_true", help="part 3 only: continued caches against fresh ones")
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.warmup = 1, 0

    report, started = start_report(args)
    if args.exactness:
        print("Part 3: a continued cache against a fresh prefill of the whole history", flush=True)
        report["exactness"] = exactness()
        write_report(report, args.json, started=started)
        return report
    path = model_dir(args.smoke, args.model_dir)
    print("Part 1: training with tools, stock TRL against grpo_plus", flush=True)
    print(f"{args.steps} lock-step optimizer steps per trainer, tools on {path.name} ...", flush=True)
    report["multi_turn"] = run(path, args.smoke, args.steps, args.warmup)
    tables = [result_table(report["multi_turn"])]
    print("\n" + tables[-1], flush=True)
    if not (args.smoke or args.skip_sweep):
        print(f"\nPart 2: one tool turn of SmolLM2-135M, 2 prompts x 8 rows, {args.repeats} repeats ...", flush=True)
        report["tool_turn"] = sweep(args.sweep_prompt, args.repeats)
        tables.append(sweep_table(report["tool_turn"]))
        print("\n" + tables[-1])
    write_report(report, args.json, markdown="\n\n".join(tables), started=started)
    return report


if __name__ == "__main__":
    main()
