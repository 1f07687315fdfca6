"""Runs under colocated vLLM across several weight syncs: how far grpo_plus is from stock TRL, and how far stock TRL is
from itself, step by step, one engine precision per run.

    make bench-vllm-divergence   (.venvs/vllm/bin/python benchmarks/vllm_divergence.py --engine-dtype bfloat16|float32
                                  [--steps 4] [--threads 1])

The setting of issue 39: the embedded SmolLM2-135M-Instruct (its LM head tied to its input embedding), fully fine-tuned
for `--steps` steps, 4 prompts x 4 completions of at most 16 tokens per step (one generation and one sync per step),
AdamW at lr 1e-5, float32 trainer, dapo, TRL's default importance-sampling correction, one engine for every run (each
run's first sync loads its own weights). Stock TRL gets grpo_plus's reload around its own stream (its own sync cannot
load on vLLM's CPU build). The runs:

  stock TRL                       the reference
  stock TRL, 8 x 2 accumulation   the same batch and loss as per_device_train_batch_size 8 and 2 accumulation steps:
                                  the same math, another float layout (TRL's own noise floor)
  grpo_plus                       its defaults (zero-waste pass, sync check)
  grpo_plus, zero-waste off       the pass off: TRL's layout
  stock TRL, head not reprocessed the reload as it was before issue 39 (a tied head left as vLLM's reload leaves it)

Per step: loss, importance-sampling ratio (mean, max), the mean |sampler - trainer| log-prob of the sampled tokens,
whether the completions are the reference's, and the largest weight difference from the reference after the step.
The JSON goes beside the docs' table (docs/guide/results/vllm_divergence_<dtype>.json).
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from harness.flags import arguments  # noqa: E402
from harness.report import ROOT, write_report  # noqa: E402

RUNS = {  # in this order: the first run finds the engine as vLLM started it (its head packed from the checkpoint)
    "stock TRL, head not reprocessed": dict(package="trl", stale_head=True),
    "stock TRL": dict(package="trl"),
    "stock TRL, 8 x 2 accumulation": dict(package="trl", per_device_train_batch_size=8, gradient_accumulation_steps=2),
    "grpo_plus": dict(package="grpo_plus"),
    "grpo_plus, zero-waste off": dict(package="grpo_plus", zero_waste_pass=False),
}
REFERENCE = "stock TRL"


def settings(steps: int) -> dict:
    return dict(
        output_dir=str(ROOT / "outputs" / "bench-vllm-divergence"), use_cpu=True, bf16=False, max_steps=steps,
        learning_rate=1e-5, per_device_train_batch_size=16, num_generations=4, max_completion_length=16,
        temperature=0.7, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, seed=0,
        use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3, loss_type="dapo", disable_dropout=True,
    )  # fmt: skip


def run(name: str, spec: dict, steps: int, engine_dtype: str, reference: dict | None) -> dict:
    """One run's log, completions per step and, after each step, its largest weight difference from `reference`'s
    weights after that step (`reference` None: this run is the reference, its weights are kept)."""
    import types

    import torch
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback, set_seed

    import grpo_plus
    import grpo_plus.engine.reload as reload
    from grpo_plus.app import tasks
    from grpo_plus.app.embedded import resolve_model
    from grpo_plus.engine import reload_on_sync
    from grpo_plus.engine.precision import engine_precision

    spec = dict(spec)
    package = grpo_plus if spec.pop("package") == "grpo_plus" else trl
    stale_head = spec.pop("stale_head", False)
    config = {**settings(steps), **spec}
    if package is grpo_plus:
        config["vllm_dtype"] = engine_dtype
    path = resolve_model("smollm2-135m-instruct")
    set_seed(0)
    fields = types.SimpleNamespace(use_vllm=True, vllm_mode="colocate")
    with engine_precision(fields, "auto", engine_dtype):  # stock TRL's engine: the same precision
        trainer = package.GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
            reward_funcs=[tasks.correctness_reward, tasks.format_reward],
            args=package.GRPOConfig(**config),
            train_dataset=tasks.make_dataset("train", "add-1d", seed=0),
            processing_class=AutoTokenizer.from_pretrained(path),
        )
    reload_on_sync(trainer.vllm_generation, lora_merge_in_place=True)  # stock TRL: its own stream, reloaded
    completions, weights, differences = [], [], []
    generate = trainer._generate_and_score_completions

    def recording(inputs):
        output = generate(inputs)
        completions.append(output["completion_ids"].cpu().clone())
        return output

    trainer._generate_and_score_completions = recording

    class AfterStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            now = dict(trainer.model.named_parameters())
            if reference is None:
                weights.append({k: v.detach().clone() for k, v in now.items()})
            else:
                step = reference["weights"][state.global_step - 1]
                differences.append(max((now[k].detach() - step[k]).abs().max().item() for k in step))

    trainer.add_callback(AfterStep())
    reprocess = reload.reprocess_tied_layer
    if stale_head:
        reload.reprocess_tied_layer = lambda name, layer: None
    try:
        trainer.train()
    finally:
        reload.reprocess_tied_layer = reprocess
        trainer.vllm_generation.sync_weights()  # the engine whole again (its head processed) for the next run
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    print(f"  {name}: " + " | ".join(f"loss {e['loss']:.6f}" for e in logs), flush=True)
    return dict(logs=logs, completions=completions, weights=weights, differences=differences or [0.0] * len(logs))


def main() -> None:
    import time

    import torch

    from grpo_plus.app.testing import shared_vllm_engine

    parser = arguments(__doc__, steps=4, threads=1, json=None)
    parser.add_argument("--engine-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    runs = {}
    with shared_vllm_engine():
        first, *rest = RUNS
        stale = run(first, RUNS[first], args.steps, args.engine_dtype, reference=None)  # compared after the reference
        runs[REFERENCE] = run(REFERENCE, RUNS[REFERENCE], args.steps, args.engine_dtype, reference=None)
        stale["differences"] = [
            max((w[k] - r[k]).abs().max().item() for k in r)
            for w, r in zip(stale.pop("weights"), runs[REFERENCE]["weights"], strict=True)
        ]
        runs[first] = stale
        for name in rest:
            if name != REFERENCE:
                runs[name] = run(name, RUNS[name], args.steps, args.engine_dtype, reference=runs[REFERENCE])
    reference = runs[REFERENCE]
    table, report = [], {"engine_dtype": args.engine_dtype, "steps": args.steps, "runs": {}}
    for name, result in runs.items():
        rows = []
        for step, entry in enumerate(result["logs"]):
            same = torch.equal(result["completions"][step], reference["completions"][step]) if (
                result["completions"][step].shape == reference["completions"][step].shape
            ) else False  # fmt: skip
            moved = result["differences"][step]
            rows.append(dict(
                step=step + 1, loss=entry["loss"], is_mean=entry["sampling/importance_sampling_ratio/mean"],
                is_max=entry["sampling/importance_sampling_ratio/max"],
                sampler_trainer=entry["sampling/sampling_logp_difference/mean"], same_completions=same,
                weights_from_reference=moved,
            ))  # fmt: skip
        report["runs"][name] = rows
        for row in rows:
            table.append(
                f"| {name} | {row['step']} | {row['loss']:.6f} | {row['is_mean']:.4f} / {row['is_max']:.4f} | "
                f"{row['sampler_trainer']:.2e} | {'yes' if row['same_completions'] else 'no'} | "
                f"{row['weights_from_reference']:.1e} |"
            )
    markdown = (
        f"{args.engine_dtype} engine, SmolLM2-135M full model, AdamW lr 1e-5, {args.steps} steps\n"
        "| run | step | loss | IS ratio mean / max | sampler-trainer mean | stock TRL's completions | max weight diff |\n"
        "|---|---|---|---|---|---|---|\n" + "\n".join(table)
    )
    print("\n" + markdown, flush=True)
    path = args.json or ROOT / "docs" / "guide" / "results" / f"vllm_divergence_{args.engine_dtype}.json"
    write_report(report, path, markdown=markdown, started=started)


if __name__ == "__main__":
    main()
