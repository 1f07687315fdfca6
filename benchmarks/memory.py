"""Memory without a GPU: stock TRL vs grpo_plus, counted on fake tensors with the library's own count (grpo_plus.fit).

    .venv/bin/python benchmarks/memory.py [--quick] [--configs NAME ...] [--json outputs/bench-memory/memory.json]

What is counted (grpo_plus/fit/: memory.py, count.py): TRL's and grpo_plus's real `_compute_loss`, forward and
backward, on a fake accelerator (FakeTensors: shapes, dtypes and devices, no data), with every storage an operator
allocates counted from its creation until it is freed, per device; generation as its prefill and one decode step with
every row's KV cache at full length; weights, LoRA, gradients and AdamW from the shapes. Every completion full length,
every group with signal: the worst step. Sections:

  1. validation: the fake count against real compute on this CPU (tiny Qwen2, eager attention, checkpointing off and
     on, both trainers) must agree to the byte; the real count against the CPU allocator's own record (torch.profiler
     memory events); the extrapolation from 1 and 2 decoder layers against the full depth (Qwen2.5-0.5B shape).
  2. the training pass's peak at long completions (Qwen2.5-1.5B shape, 8 rows, checkpointing on): TRL, grpo_plus,
     grpo_plus + activation offloading, + tiled MLP, and what is alive at the peak (the binding term).
  3. the 24 GB fit (22 GiB of tensors: a 24 GiB card less the CUDA context, cuBLAS workspaces and allocator slack):
     per recipe config, the worst step at its settings and the longest completion (multiples of 128) with every
     memory option each side has (TRL: gradient checkpointing + an offloaded KV cache; grpo_plus: also activation
     offloading + a tiled MLP), at the config's batch and at one row per micro-batch (and, for a config with LoRA
     dropout, at dropout 0: the tiled MLP stands aside under dropout). Prompts of different lengths (left padding),
     the worst case of most datasets; `--equal-prompts` counts prompts of one length.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import torch
from harness.flags import arguments
from harness.report import ROOT, markdown_table, start_report, write_report

from grpo_plus import fit
from grpo_plus.app.cli import fit_spec_from_yaml
from grpo_plus.fit import GIB

RECIPES = ROOT / "recipes" / "configs"
FIT_RECIPES = ("demo_cpu", "qwen2.5-0.5b_lora", "qwen2.5-1.5b_lora", "qwen2.5-7b_qlora")
PROMPT_TOKENS = {"demo_cpu": 56}  # the demo's chat-templated prompts (DESIGN.md); 128 for the Qwen recipes
BUDGET = int((24 - fit.CARD_RESERVE_GIB) * GIB)  # a 24 GiB card less what tensors cannot use


def gib(value: float) -> str:
    return f"{value / GIB:.2f}"


EQUAL_PROMPTS = False  # --equal-prompts: count prompts of one length (no padding), as the counts before this one did


def recipe_spec(name: str) -> fit.FitSpec:
    return fit_spec_from_yaml(RECIPES / f"{name}.yaml", PROMPT_TOKENS.get(name, 128), equal_prompts=EQUAL_PROMPTS)


# ---- 1. validation ----------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def profiler_peak(result: dict):
    """Within the block, record the CPU allocator's memory events (torch.profiler); afterwards result["peak"] is the
    most bytes it held at once above what it held when the block began."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    result["peak"] = peak


def validation_spec(gradient_checkpointing: bool) -> fit.FitSpec:
    config = fit.known_config("tiny-qwen2")
    return fit.FitSpec(
        model_config=config.to_dict(), weights_dtype="float32", rows=8, num_generations=4, generation_rows=8,
        prompt_tokens=16, completion_tokens=32, mixed_precision="no", attn_implementation="eager",
        gradient_checkpointing=gradient_checkpointing, loss={"loss_type": "dapo", "epsilon_high": 0.28},
        lora=dict(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear"),
    )  # fmt: skip


def validate_counting(checkpointing=(False, True)) -> list[dict]:
    rows = []
    for gc in checkpointing:
        spec = validation_spec(gc)
        for side in fit.SIDES:
            allocator: dict = {}
            real = fit.measure_pass(spec, side, 2, real=True, lm_head="cpu",
                                    around=lambda a=allocator: profiler_peak(a))  # fmt: skip
            fake = fit.measure_pass(spec, side, 2, lm_head="cpu")
            same = (fake.saved, fake.after_forward, fake.forward_peak, fake.peak) == (
                real.saved, real.after_forward, real.forward_peak, real.peak,
            )  # fmt: skip
            rows.append(dict(gradient_checkpointing=gc, side=side, real_peak=real.peak, fake_peak=fake.peak,
                             real_saved=real.saved, fake_saved=fake.saved, allocator_peak=allocator["peak"], agree=same))  # fmt: skip
    return rows


def validate_depth() -> list[dict]:
    spec = recipe_spec("qwen2.5-0.5b_lora").replace(
        lora={**recipe_spec("qwen2.5-0.5b_lora").lora, "lora_dropout": 0.0}
    )
    rows = []
    for side in fit.SIDES:
        full = fit.measure_pass(spec, side, spec.layers)
        extrapolated = fit.training_pass(spec, side)
        rows.append(dict(side=side, full_peak=full.peak, extrapolated_peak=extrapolated.peak,
                         agree=dataclasses.asdict(full) == dataclasses.asdict(extrapolated)))  # fmt: skip
    return rows


# ---- 2. what binds at long completions --------------------------------------------------------------------------------


def binding_terms(spec: fit.FitSpec, side: str, top: int = 6) -> list[tuple[str, int]]:
    """What is alive on the accelerator at the peak of a one-decoder-layer count (the layer that repeats), summed by
    the operator and shape that made it."""
    at_peak: list = []
    fit.measure_pass(spec, side, layers=1, at_peak=at_peak)
    totals: dict[str, int] = {}
    for nbytes, text in at_peak:
        totals[text] = totals.get(text, 0) + nbytes
    return sorted(totals.items(), key=lambda item: -item[1])[:top]


LONG_LENGTHS = (4096, 8192, 16384)
LONG_VARIANTS = {
    "TRL": ("trl", {}),
    "grpo_plus": ("grpo_plus", {}),
    "+ activation_offloading": ("grpo_plus", {"activation_offloading": True}),
    "+ tiled_mlp_tokens=4096": ("grpo_plus", {"activation_offloading": True, "tiled_mlp_tokens": 4096}),
}


def long_table() -> tuple[list[dict], dict]:
    base = recipe_spec("qwen2.5-1.5b_lora")
    base = base.replace(lora={**base.lora, "lora_dropout": 0.0}, gradient_checkpointing=True)
    rows, binding = [], {}
    for length in LONG_LENGTHS:
        row = {"completion": length}
        for label, (side, changes) in LONG_VARIANTS.items():
            row[label] = fit.training_pass(base.replace(completion_tokens=length, **changes), side).peak
            print(f"  {length:6d} tokens, {label:26s}: training pass {gib(row[label])} GiB", flush=True)
        rows.append(row)
    for label, (side, changes) in LONG_VARIANTS.items():
        binding[label] = binding_terms(base.replace(completion_tokens=LONG_LENGTHS[-1], **changes), side)
    return rows, binding


# ---- 3. the 24 GB fit --------------------------------------------------------------------------------------------------


def fit_rows(names: list[str]) -> list[dict]:
    rows = []
    for name in names:
        shipped = recipe_spec(name)
        variants = [("its batch", shipped)]
        if shipped.lora and shipped.lora.get("lora_dropout"):
            variants.append(("its batch, lora_dropout 0", shipped.replace(lora={**shipped.lora, "lora_dropout": 0.0})))
        no_dropout = variants[-1][1]
        variants.append(("1 row per micro-batch" + (", lora_dropout 0" if no_dropout is not shipped else ""),
                         no_dropout.replace(rows=1)))  # fmt: skip
        for label, spec in variants:
            began = time.perf_counter()
            row = {"config": name, "batch": label, "rows": spec.rows}
            for side in fit.SIDES:
                at = fit.estimate(spec, side)
                best = fit.with_memory_options(spec, side)
                longest = fit.longest_completion(best, side, BUDGET)
                at_longest = fit.estimate(best.replace(completion_tokens=max(longest, fit.LENGTH_STEP)), side)
                row[side] = {"at_settings": at.total, "longest": longest, "binding": at_longest.binding,
                             "parts_at_longest": at_longest.parts()}  # fmt: skip
            limit = (shipped.context_window - shipped.prompt_tokens) // fit.LENGTH_STEP * fit.LENGTH_STEP
            row["context_limit"] = limit
            row["seconds"] = time.perf_counter() - began
            rows.append(row)
            print(f"  {name}, {label}: at its settings TRL {gib(row['trl']['at_settings'])} / grpo_plus "
                  f"{gib(row['grpo_plus']['at_settings'])} GiB; longest completion TRL {row['trl']['longest']} "
                  f"({row['trl']['binding']}), grpo_plus {row['grpo_plus']['longest']} "
                  f"({row['grpo_plus']['binding']}); context limit {limit} ({row['seconds']:.0f} s)", flush=True)  # fmt: skip
    return rows


def fit_table(rows: list[dict]) -> str:
    header = ["recipe config", "micro-batch", "worst step at its settings: TRL / grpo_plus (GiB)",
              "longest completion (22 GiB): TRL", "grpo_plus", "ratio", "binds at grpo_plus's longest"]  # fmt: skip
    cells = []
    for row in rows:
        trl, ours = row["trl"]["longest"], row["grpo_plus"]["longest"]
        binds = "context window" if ours >= row["context_limit"] else row["grpo_plus"]["binding"]
        cells.append([f"`{row['config']}.yaml`", row["batch"],
                      f"{gib(row['trl']['at_settings'])} / {gib(row['grpo_plus']['at_settings'])}", trl, ours,
                      f"{ours / trl:.2f}x" if trl else "—", binds])  # fmt: skip
    return markdown_table(header, cells)


def long_markdown(rows: list[dict]) -> str:
    header = ["completion tokens", *(f"{label} (GiB)" for label in LONG_VARIANTS)]
    return markdown_table(header, [[row["completion"], *(gib(row[label]) for label in LONG_VARIANTS)] for row in rows])


def main() -> None:
    json_path = ROOT / "outputs" / "bench-memory" / "memory.json"
    parser = arguments(__doc__, json=json_path, quick="the fit table only (no validation, no long table)")
    parser.add_argument("--configs", nargs="+", choices=FIT_RECIPES, default=list(FIT_RECIPES))
    parser.add_argument("--equal-prompts", action="store_true",
                        help="prompts of one length (no padding); default: prompts of different lengths")  # fmt: skip
    args = parser.parse_args()
    global EQUAL_PROMPTS
    EQUAL_PROMPTS = args.equal_prompts

    torch.set_num_threads(1)
    report, started = start_report(args, versions=("torch",))
    report.update(budget_bytes=BUDGET, equal_prompts=EQUAL_PROMPTS)
    markdown = []
    if not args.quick:
        print("1. Validation: fake count vs real compute vs the CPU allocator (tiny Qwen2, eager attention) ...")
        report["validate_counting"] = validate_counting()
        for row in report["validate_counting"]:
            print(f"  gc={row['gradient_checkpointing']!s:5} {row['side']:9}: peak {row['real_peak']} / "
                  f"{row['fake_peak']} B (real / fake), saved {row['real_saved']} / {row['fake_saved']} B, allocator "
                  f"{row['allocator_peak']} B; agree: {row['agree']}", flush=True)  # fmt: skip
        print("   depth: 1-2-layer extrapolation vs the full 24 layers (Qwen2.5-0.5B shape, 512 tokens) ...")
        report["validate_depth"] = validate_depth()
        for row in report["validate_depth"]:
            print(f"  {row['side']:9}: peak {row['full_peak']} / {row['extrapolated_peak']} B (full / extrapolated);"
                  f" agree: {row['agree']}", flush=True)  # fmt: skip
        print("2. The training pass at long completions (Qwen2.5-1.5B shape, 8 rows, checkpointing on) ...")
        rows, binding = long_table()
        report["long"], report["binding_at_16k"] = rows, binding
        markdown.append(long_markdown(rows))
        for label, terms in binding.items():
            print(f"  alive at the peak, {label}, one layer, 16384 tokens: " +
                  "; ".join(f"{gib(b)} GiB {t}" for t, b in terms))  # fmt: skip
    print("3. The 24 GB fit (22 GiB of tensors) ...", flush=True)
    report["fit"] = fit_rows(args.configs)
    markdown.append(fit_table(report["fit"]))
    print("\n" + "\n\n".join(markdown))
    write_report(report, args.json, markdown="\n\n".join(markdown), started=started)


if __name__ == "__main__":
    main()
