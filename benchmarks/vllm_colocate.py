"""Whole GRPO steps with vLLM generating (colocate mode): stock TRL + vLLM against grpo_plus + vLLM, in one run.

    make bench-vllm     (.venvs/vllm/bin/python benchmarks/vllm_colocate.py [--steps 10] [--warmup 2] [--threads 1])

The demo config (recipes/configs/demo_cpu.yaml: SmolLM2-135M-Instruct + LoRA r=16 all-linear, one-digit sums,
2 prompts x 8 completions of <= 20 tokens per optimizer step, dapo + clip-higher, correctness + 0.5 x format rewards)
with `use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3` and TRL's default importance-sampling
correction, on vLLM's CPU build (`make test-vllm`'s environment). Both trainers generate with one engine
(`grpo_plus.app.testing.shared_vllm_engine`); each loads its own weights into it at each of its steps through vLLM's
reload (`grpo_plus.engine`, which stock TRL gets too: its own sync cannot load on the CPU build), stock TRL with its
own stream (the adapter merged into the base in place), grpo_plus with its out-of-place one. They train in
lock-step (harness/lockstep.py: TRL's step 1, ours, TRL's step 2, ...) with their own random state, so they sample
the same completions from the same weights: the first step's completion ids are checked equal (the script stops
otherwise); later steps part where the two runs' weights, 1e-7 apart, round to different bfloat16 values in the engine
(TRL leaves vLLM's dtype on "auto"), so their mean completion lengths are printed to show the work stayed alike.
grpo_plus runs with its defaults, the sync check after every sync included. Per optimizer step, after the warm-up
steps:
  step            on_step_begin -> on_step_end: weight sync, vLLM generation, scoring, old log-probs, training pass
  generation      `_prepare_inputs` when it generates: sync, vLLM, scoring and TRL's no-grad old log-prob pass (for its
                  importance-sampling correction; grpo_plus, on-policy here, takes the old log-probs from the training
                  forward and runs none)
  training pass   the rest of TRL's `step_time`: forward + backward of every micro-batch
  sync            each side's weight sync (stream, vLLM's loading and processing), from its sync log
  sync check      what grpo_plus's check adds to a sync: after the run, 8 syncs with it and 8 without, alternating
                  (its share of grpo_plus's step is printed)
  no-grad positions  token positions of each side's forwards without gradient per step, grpo_plus's sync-check probes
                  left out: TRL's old-log-prob pass
The JSON goes beside the docs' table (docs/guide/results/vllm.json). Target (issue 41): whole step <= 0.25x stock TRL
+ vLLM.
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from harness.flags import arguments  # noqa: E402
from harness.report import ROOT, start_report, write_report  # noqa: E402
from harness.trainers import SIDES, VLLM_SETTINGS, demo_settings, run_demo_steps  # noqa: E402


def check_cost(trainer, repeats: int = 8) -> dict:
    """What grpo_plus's sync check adds to a sync, on the trained run: syncs with the check and without, alternating
    (the trainer's side of the check runs beside the stream, so its cost is the sync's time with it minus without)."""
    import statistics
    import time

    checker, sync = trainer.vllm_generation.sync_log.checker, trainer.vllm_generation.sync_weights
    seconds = {"every": [], "off": []}
    for _ in range(repeats):
        for mode in seconds:
            checker.mode = mode
            started = time.perf_counter()
            sync()
            seconds[mode].append(time.perf_counter() - started)
    checker.mode = "every"
    checked, unchecked = statistics.median(seconds["every"]), statistics.median(seconds["off"])
    return dict(checked=checked, unchecked=unchecked, cost=checked - unchecked, repeats=repeats)


def main() -> None:
    import statistics
    import time

    import torch

    from grpo_plus.app.testing import shared_vllm_engine
    from grpo_plus.engine import reload_on_sync

    json_path = ROOT / "docs" / "guide" / "results" / "vllm.json"
    args = arguments(__doc__, steps=10, warmup=2, threads=1, json=json_path).parse_args()
    report, started = start_report(args)
    settings = {**demo_settings(args.steps), **VLLM_SETTINGS, "output_dir": str(ROOT / "outputs" / "bench-vllm")}

    generated = {name: [] for name in ("trl", "ours")}

    def prepare(built: dict) -> None:
        reload_on_sync(built["trl"]["trainer"].vllm_generation, lora_merge_in_place=True)  # TRL's own stream, reloaded
        for name, side in built.items():  # each generation batch's completion ids, to compare step 1's
            trainer = side["trainer"]
            generate = trainer._generate_and_score_completions

            def recording(inputs, generate=generate, name=name):
                output = generate(inputs)
                generated[name].append(output["completion_ids"].cpu().clone())
                return output

            trainer._generate_and_score_completions = recording

    print(f"demo config + colocated vLLM, {args.steps} lock-step optimizer steps per trainer ...", flush=True)
    with shared_vllm_engine() as engine:
        built = time.perf_counter()
        result = run_demo_steps(args.steps, args.warmup, settings=settings, prepare=prepare)
        trainers = result.pop("trainers")
        probes = {  # the sync checks' forwards during training (the cost measurement below adds its own)
            name: sum(r.trainer_positions for r in trainers[name].vllm_generation.sync_log.receipts) for name in SIDES
        }
        cost = check_cost(trainers["ours"])  # while the engine runs
        report["engine_start_seconds"] = engine.start_seconds
        report["total_train_seconds"] = time.perf_counter() - built
    lengths = {name: result[name]["completion_lengths"] for name in SIDES}
    first_loss_difference = abs(result["trl"]["losses"][0] - result["ours"]["losses"][0])
    if not torch.equal(generated["trl"][0], generated["ours"][0]):
        raise SystemExit(
            "step 1: stock TRL and grpo_plus sampled other completions; the comparison is not on the same work"
        )
    logs = {name: trainers[name].vllm_generation.sync_log for name in SIDES}
    measured = slice(args.warmup, None)
    sync_seconds = {name: statistics.median(logs[name].seconds[measured]) for name in SIDES}
    check_seconds = statistics.median([r.seconds for r in logs["ours"].receipts[measured]])
    report["step1_same_completion_ids"] = True
    report["sync_seconds"] = sync_seconds
    report["sync_check_seconds"] = check_seconds  # the check after each sync (its trainer side ran beside the stream)
    report["sync_check_cost"] = cost
    report["sync_check_share_of_step"] = cost["cost"] / result["ours"]["step"]
    report["sync_check_receipts"] = [
        dict(mean=r.mean_abs_difference, max=r.max_abs_difference, bound=r.bound, seconds=r.seconds)
        for r in logs["ours"].receipts
    ]
    for name in SIDES:
        side = result[name]
        side["no_grad_positions"] -= probes[name] / len(side["losses"])
    report["demo_vllm"] = result
    trl_side, ours = result["trl"], result["ours"]
    # grpo_plus's over the rows its training forward computed where it left dead rows out (on-policy: no pass); a
    # step whose rows were all dead has none (None in the log)
    keys = ("sampling/sampling_logp_difference/mean", "sampling/trained_rows/sampling_logp_difference/mean")
    logged = (entry.get(key) for entry in trainers["ours"].state.log_history for key in keys)
    mismatch = [value for value in logged if value is not None and not math.isnan(value)]
    report["sampling_logp_difference_mean"] = mismatch
    table = (
        "| demo config, colocated vLLM (median per step) | stock TRL + vLLM | grpo_plus + vLLM | ratio |\n"
        "|---|---|---|---|\n"
        f"| whole step (s) | {trl_side['step']:.2f} | {ours['step']:.2f} | **{ours['step'] / trl_side['step']:.2f}** |\n"
        f"| generation + scoring + old log-probs (s) | {trl_side['generation']:.2f} | {ours['generation']:.2f} | "
        f"{ours['generation'] / trl_side['generation']:.2f} |\n"
        f"| token positions without gradient (old log-probs) | {trl_side['no_grad_positions']:.0f} | "
        f"{ours['no_grad_positions']:.0f} | |\n"
        f"| training pass (s) | {trl_side['train_pass']:.2f} | {ours['train_pass']:.2f} | "
        f"{ours['train_pass'] / trl_side['train_pass']:.2f} |\n"
        f"| token positions in the training forward | {trl_side['positions']:.0f} | {ours['positions']:.0f} | "
        f"{ours['positions'] / trl_side['positions']:.2f} |\n"
        f"| weight sync (s) | {sync_seconds['trl']:.3f} | {sync_seconds['ours']:.3f} | "
        f"{sync_seconds['ours'] / sync_seconds['trl']:.2f} |\n"
        f"| sync check (s, share of the step) | - | {cost['cost']:.3f} ({100 * cost['cost'] / ours['step']:.1f}%) | |\n"
        f"\nengine start {engine.start_seconds:.0f} s (once, shared); first step: the same completion ids "
        f"(mean length {lengths['trl'][0]:.2f}), |loss difference| {first_loss_difference:.1e}; "
        f"over all {len(lengths['trl'])} steps mean completion length TRL {statistics.fmean(lengths['trl']):.2f}, "
        f"grpo_plus {statistics.fmean(lengths['ours']):.2f}; dead-group share {trl_side['dead_groups']:.2f}; "
        f"sampler/trainer log-prob difference (mean per step) {min(mismatch):.3f}-{max(mismatch):.3f}"
    )
    print("\n" + table, flush=True)
    write_report(report, args.json, markdown=table, started=started)


if __name__ == "__main__":
    main()
