"""LoRA weight syncs into colocated vLLM: TRL's in-place merge against grpo_plus's out-of-place merge, one run.

    make bench-vllm-lora   (.venvs/vllm/bin/python benchmarks/vllm_lora_sync.py [--syncs 8] [--threads 1]
                            [--skip-vllm-lora])

SmolLM2-135M-Instruct (embedded) + LoRA r=16 all-linear (the demo config's adapter), on vLLM's CPU build in colocate
mode (the demo's engine settings: `make test-vllm`'s environment), one engine for every trainer.

Part 1, the sync, per base (float32: the demo's; bfloat16; 4-bit nf4): stock trl.GRPOTrainer's sync (TRL's stream:
merge_adapter, every weight, unmerge_adapter) and grpo_plus's (each LoRA layer merged in a new tensor; after the
first sync only what can change), both through vLLM's layerwise reload (`grpo_plus.engine`; stock TRL's own sync
cannot load on the CPU build). Before each pair of syncs both adapters get the same new weights (as after a training
step); the syncs alternate. Printed per sync, medians after the first: seconds (the stream, vLLM's loading and its
processing of every layer), bytes streamed; the first (full) sync apart; how far the frozen base moved over the run;
the engine's mean |log-prob difference| with the trainer's model on a fixed text after the last sync. Stock TRL cannot
start an engine for a 4-bit base on vLLM 0.31 (it asks for bitsandbytes), so nf4 has grpo_plus's side only.

Part 2, vLLM's own LoRA (`enable_lora=True`, the adapter loaded from disk at each sync, every request naming it): the
other way to keep the base apart. Its engine generates the demo's batch (2 prompts x 8 completions of 20 tokens) with
the adapter, against the merged engine of part 1 on the same batch; and its adapter load per sync (save_pretrained to
/dev/shm + add_lora, load_inplace).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from harness.flags import arguments  # noqa: E402
from harness.report import ROOT, write_report  # noqa: E402
from harness.trainers import VLLM_SETTINGS, build_trainers, demo_lora, demo_settings  # noqa: E402

PROBE = "What is 7 + 5? The answer is 12, because seven plus five makes twelve."
BASES = ("float32", "bfloat16", "nf4")


def build(path, tokenizer, base: str, settings: dict, sides) -> dict:
    """The `sides`' trainers (harness.trainers) on the embedded model with a `base` of that precision, each syncing
    through vLLM's reload; name -> trainer."""
    from grpo_plus.app import tasks
    from grpo_plus.app.testing import load_with_base
    from grpo_plus.engine import reload_on_sync

    def make(name, package, callbacks):
        trainer = package.GRPOTrainer(
            model=load_with_base(path, base),
            reward_funcs=[tasks.correctness_reward, tasks.format_reward],
            args=package.GRPOConfig(**settings),
            train_dataset=tasks.make_dataset("train", "add-1d", seed=0),
            processing_class=tokenizer,
            peft_config=demo_lora(),
            callbacks=callbacks,
        )
        reload_on_sync(trainer.vllm_generation, lora_merge_in_place=True)  # stock TRL: its stream; ours has its own
        return trainer

    return {name: side["trainer"] for name, side in build_trainers(make, sides).items()}


def new_adapter(models, seed: int) -> None:
    """The same new LoRA weights in every model (what a training step leaves): B drawn, A kept."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    draws = {}
    with torch.no_grad():
        for model in models:
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    if name not in draws:
                        draws[name] = torch.randn(param.shape, generator=generator) * 2e-3
                    param.copy_(draws[name].to(param.dtype))


def frozen(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" not in k}


def largest_move(before: dict, model) -> float:
    after = frozen(model)
    return max((before[k].float() - after[k].float()).abs().max().item() for k in before)


def logp_gap(trainer, tokenizer) -> float:
    """Mean |engine log-prob - model log-prob| over the tokens of PROBE, after the last sync."""
    import torch
    from vllm import SamplingParams

    ids = tokenizer(PROBE)["input_ids"]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    out = trainer.vllm_generation.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    engine = torch.tensor([lp[t].logprob for t, lp in zip(ids[1:], out.prompt_logprobs[1:], strict=True)])
    with torch.no_grad():
        logits = trainer.model(torch.tensor([ids])).logits[0, :-1].float()
    model = logits.log_softmax(-1).gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    return (engine - model).abs().mean().item()


def part_syncs(path, tokenizer, settings: dict, syncs: int) -> dict:
    results = {}
    for base in BASES:
        sides = build(path, tokenizer, base, settings, ("ours",) if base == "nf4" else ("ours", "trl"))
        before = {name: frozen(trainer.model) for name, trainer in sides.items()}
        for index in range(syncs):
            new_adapter([trainer.model for trainer in sides.values()], seed=index)
            for trainer in sides.values():
                trainer.vllm_generation.sync_weights()
        results[base] = {}
        for name, trainer in sides.items():
            log = trainer.vllm_generation.sync_log
            results[base][name] = dict(
                first_seconds=log.seconds[0], first_bytes=log.bytes[0],
                seconds=statistics.median(log.seconds[1:]), bytes=statistics.median(log.bytes[1:]),
                base_moved=largest_move(before[name], trainer.model), logp_gap=logp_gap(trainer, tokenizer),
            )  # fmt: skip
        print(f"  {base}: " + json.dumps(results[base]), flush=True)
        del sides
    return results


def demo_batch(tokenizer) -> list[dict]:
    from grpo_plus.app import tasks

    rows = tasks.make_dataset("train", "add-1d", seed=0).select(range(2))
    prompts = [tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True) for row in rows]
    prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
    return [{"prompt_token_ids": p} for p in prompts for _ in range(8)]


def timed_generations(llm, batch, lora_request=None, repeats: int = 5) -> float:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=20, temperature=0.7, ignore_eos=True, logprobs=0)
    llm.generate(batch, params, use_tqdm=False, lora_request=lora_request)  # warm-up
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False, lora_request=lora_request)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def part_vllm_lora(path, tokenizer, settings: dict, merged_llm) -> dict:
    """vLLM's own LoRA against the merged engine: generation of the demo batch and the adapter load per sync."""
    import torch
    from peft import get_peft_model
    from vllm import LLM
    from vllm.lora.request import LoRARequest

    from grpo_plus.app.testing import load_with_base

    batch = demo_batch(tokenizer)
    merged = timed_generations(merged_llm, batch)
    merged_llm.llm_engine.engine_core.shutdown()
    kwargs = dict(
        model=str(path), gpu_memory_utilization=0.3, max_num_seqs=settings["per_device_train_batch_size"],
        max_num_batched_tokens=4096, logprobs_mode="processed_logprobs", enable_lora=True, max_lora_rank=16,
        max_loras=1, seed=0,
    )  # fmt: skip
    started = time.perf_counter()
    llm = LLM(**kwargs)
    start_seconds = time.perf_counter() - started
    model = get_peft_model(load_with_base(path, "float32"), demo_lora())
    new_adapter([model], seed=0)
    folder = tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    loads = []
    for index in range(5):
        new_adapter([model], seed=index)
        started = time.perf_counter()
        model.save_pretrained(folder)
        request = LoRARequest("policy", 1, folder, load_inplace=True)
        llm.llm_engine.add_lora(request)
        loads.append(time.perf_counter() - started)
    with_lora = timed_generations(llm, batch, lora_request=request)
    llm.llm_engine.engine_core.shutdown()
    del torch
    return dict(
        merged_generation=merged, vllm_lora_generation=with_lora, vllm_lora_adapter_load=statistics.median(loads[1:]),
        vllm_lora_engine_start=start_seconds,
    )  # fmt: skip


def main() -> None:
    json_path = ROOT / "docs" / "guide" / "results" / "vllm_lora_sync.json"
    parser = arguments(__doc__, threads=1, json=json_path)
    parser.add_argument("--syncs", type=int, default=8, help="syncs per trainer and base (the first is full)")
    parser.add_argument("--skip-vllm-lora", action="store_true", help="skip part 2 (vLLM's own LoRA)")
    args = parser.parse_args()

    import torch
    import transformers
    from transformers import AutoTokenizer

    from grpo_plus.app.embedded import resolve_model
    from grpo_plus.app.testing import shared_vllm_engine

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    path = resolve_model("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(path)
    settings = {**demo_settings(1), **VLLM_SETTINGS, "output_dir": str(ROOT / "outputs" / "bench-vllm")}
    report = {"threads": args.threads, "syncs": args.syncs}
    print(f"SmolLM2-135M + LoRA r=16 all-linear, colocated vLLM (CPU build): {args.syncs} syncs per side ...")
    with shared_vllm_engine() as engine:
        report["syncs"] = part_syncs(path, tokenizer, settings, args.syncs)
        if not args.skip_vllm_lora:
            print("vLLM's own LoRA (enable_lora) ...", flush=True)
            report["vllm_lora"] = part_vllm_lora(path, tokenizer, settings, engine.llm)
            engine.llm = None  # shut down above

    lines = [
        "\n| LoRA sync, SmolLM2-135M r=16 all-linear | TRL (merge in place) | grpo_plus (out of place) | ratio |",
        "|---|---|---|---|",
    ]
    for base, sides in report["syncs"].items():
        ours, trl_side = sides["ours"], sides.get("trl")

        def row(label, key, scale, unit, fmt, ours=ours, trl_side=trl_side, base=base):
            theirs = f"{trl_side[key] / scale:{fmt}}" if trl_side else "cannot start (bitsandbytes)"
            ratio = f"**{ours[key] / trl_side[key]:.2f}**" if trl_side and trl_side[key] else "-"
            return f"| {base}: {label} ({unit}) | {theirs} | {ours[key] / scale:{fmt}} | {ratio} |"

        lines += [
            row("sync, median after the first", "seconds", 1, "s", ".3f"),
            row("bytes per sync, after the first", "bytes", 2**20, "MiB", ".0f"),
            row("first sync", "first_seconds", 1, "s", ".3f"),
            row("first sync bytes", "first_bytes", 2**20, "MiB", ".0f"),
            f"| {base}: frozen base moved, largest abs change after {args.syncs} syncs | "
            + (f"{trl_side['base_moved']:.2e}" if trl_side else "-")
            + f" | {ours['base_moved']:.2e} | |",
            f"| {base}: engine vs trainer, mean abs log-prob difference | "
            + (f"{trl_side['logp_gap']:.4f}" if trl_side else "-")
            + f" | {ours['logp_gap']:.4f} | |",
        ]
    if "vllm_lora" in report:
        lora = report["vllm_lora"]
        lines += [
            "",
            "| demo batch (16 x 20 tokens), CPU build | merged weights (either sync) | vLLM's LoRA (enable_lora) | ratio |",
            "|---|---|---|---|",
            f"| generation (s) | {lora['merged_generation']:.2f} | {lora['vllm_lora_generation']:.2f} | "
            f"**{lora['vllm_lora_generation'] / lora['merged_generation']:.2f}** |",
            f"| adapter load per sync (s) | (sync above) | {lora['vllm_lora_adapter_load']:.3f} | |",
        ]
    print("\n".join(lines), flush=True)
    write_report(report, args.json, markdown="\n".join(lines))


if __name__ == "__main__":
    main()
