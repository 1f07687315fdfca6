"""Step time and peak memory of one GRPO training config: stock trl.GRPOTrainer vs grpo_plus.GRPOTrainer.

Run from the repo root:  .venv/bin/python benchmarks/step_overhead.py [--quick] [--repeats N] [--skip-smollm]
                         [--calibrate] [--threads N]

Both trainers get the same model, data, config and seed, so they do identical work; the script checks that every
training logs the same completion lengths and losses and ends with the same trainable-weight checksums, and says so.
Cases:
  tiny     the random 2-layer Llama of tests/helpers/models.py: batch 8, 4 generations, 32 tokens, 2 accumulation steps
  smollm2  SmolLM2-135M-Instruct (grpo_plus.app.embedded.resolve_model) + LoRA r=16 all-linear, batch 8,
           8 generations, 16 tokens; skipped with a message when the embedded model is unavailable

Step time is measured with the two trainers alternating step by step in one process (the median of per-round
ratios; --calibrate for an A/A run), peak memory in separate subprocesses under a pinned glibc malloc; why, and
what each column means: docs/notes.md. Targets (issue 3): step time <= 1.02x, peak memory <= 1.01x. grpo_plus runs
with zero_waste_pass=False here, so both trainers do the same work; benchmarks/train_pass.py measures what the
zero-waste pass saves.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

from harness.flags import arguments
from harness.process import PINNED_MALLOC, child_result, launch_child, reset_peak_rss, status_kib
from harness.report import ROOT
from harness.trainers import embedded_model_or_none, model_path

TRAINERS = ("trl", "ours")
TIMES = ("step_time", "wall", "cpu")
MIB = 1024 * 1024

# Per case: GRPOConfig overrides (on top of grpo_plus.app.testing.tiny_run_kwargs: seed 0, use_cpu, bf16=False, no saving),
# the warm-up steps excluded from the timings, and the optimizer steps of a memory run.
CASES = {
    "tiny": dict(
        config=dict(
            per_device_train_batch_size=8,
            num_generations=4,
            max_completion_length=32,
            gradient_accumulation_steps=2,
            max_steps=40,
            learning_rate=0.01,
            lr_scheduler_type="constant",  # so a shorter (memory) run repeats the first steps of a timing run
            loss_type="dapo",
        ),
        warmup=5,
        rounds=12,
        rounds_per_child=4,
        # The tiny model's training RSS climbs by a one-off ~5 MiB (native, inside the model forward) somewhere between
        # steps ~30 and ~150, at a step that depends on allocation history: measure past it, at the plateau.
        memory_steps=200,
        prompts=64,
    ),
    "smollm2": dict(
        config=dict(
            per_device_train_batch_size=8,
            num_generations=8,
            max_completion_length=16,
            gradient_accumulation_steps=1,
            max_steps=4,
            learning_rate=3e-4,
            lr_scheduler_type="constant",
            temperature=0.7,
            loss_type="dapo",
        ),
        warmup=1,
        rounds=3,
        rounds_per_child=3,
        memory_steps=3,
        prompts=64,
    ),
}


# ---- child: training runs ---------------------------------------------------------------------------------------


# Methods whose CPU time is recorded per trainer (inclusive), to isolate the code where the two trainers differ:
# the loss side is `_compute_loss` minus the model forward inside it, the scoring side is
# `_generate_and_score_completions` (grpo_plus wraps TRL's to recompute the advantages) minus generation.
ATTRIBUTED = ("_compute_loss", "_get_per_token_logps_and_entropies", "_generate_and_score_completions", "_generate")


def attribute_time(trainer) -> dict[str, float]:
    """Wrap ATTRIBUTED methods on this trainer instance; return the dict they add their thread CPU seconds to
    (key "forward_in_loss" for the model forward called from inside `_compute_loss`)."""
    totals = dict.fromkeys((*ATTRIBUTED, "forward_in_loss"), 0.0)
    inside_loss = [False]
    running = dict.fromkeys(ATTRIBUTED, False)

    def wrap(name, method):
        def timed(*args, **kwargs):
            if running[name]:  # inside a timed call of the same name (grpo_plus's forward calls its pass's): once
                return method(*args, **kwargs)
            entered = name == "_compute_loss" and not inside_loss[0]
            if entered:
                inside_loss[0] = True
            running[name] = True
            start = time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                seconds = time.thread_time() - start
                running[name] = False
                totals[name] += seconds
                if name == "_get_per_token_logps_and_entropies" and inside_loss[0]:
                    totals["forward_in_loss"] += seconds
                if entered:
                    inside_loss[0] = False

        return timed

    for name in ATTRIBUTED:
        setattr(trainer, name, wrap(name, getattr(trainer, name)))
    zero_waste = getattr(trainer, "_zero_waste", None)
    if zero_waste is not None:  # grpo_plus's training forward calls its zero-waste pass, not the trainer's method
        name = "_get_per_token_logps_and_entropies"
        zero_waste.logps_and_entropies = wrap(name, zero_waste.logps_and_entropies)
    return totals


def run_child(spec: dict) -> None:
    """Train as `spec` says and hand back (harness.process.child_result) a list of rounds, each {trainer: results}.

    One trainer: a single round that also measures memory. Several: `rounds` lock-step rounds, each building every
    trainer afresh (so each round samples a new memory layout), the one that moves first rotating every round.
    `spec["classes"]` maps each trainer name to "trl" or "ours" (the A/A calibration runs two stock TRL trainers).
    """
    import gc

    import torch
    from harness.lockstep import Baton, RngStates, train_in_lockstep
    from harness.timing import StepTimer

    torch.set_num_threads(spec["threads"])
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

    import grpo_plus
    from grpo_plus.app.testing import digit_reward, length_reward, make_tokenizer, prompt_dataset, tiny_run_kwargs

    case, device = CASES[spec["case"]], spec["device"]
    classes = {"trl": (trl.GRPOConfig, trl.GRPOTrainer), "ours": (grpo_plus.GRPOConfig, grpo_plus.GRPOTrainer)}
    rng = RngStates(cuda=device == "cuda")
    sync = torch.cuda.synchronize if device == "cuda" else None

    def build(name, baton):
        set_seed(0)  # LoRA init draws random numbers: the same state for every trainer, in-process or not
        config_cls, trainer_cls = classes[spec["classes"][name]]
        overrides = dict(case["config"], max_steps=spec["max_steps"])
        if spec["classes"][name] == "ours":  # the same work as TRL: this measures grpo_plus's own overhead
            overrides["zero_waste_pass"] = False  # (benchmarks/train_pass.py measures what the zero-waste pass saves)
        if device == "cuda":
            overrides.update(use_cpu=False, bf16=torch.cuda.is_bf16_supported())
        args = config_cls(**tiny_run_kwargs(Path(spec["output_dir"]) / name, **overrides))
        model = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=torch.float32)
        peft_config = None
        if spec["case"] == "smollm2":
            from peft import LoraConfig

            tokenizer = AutoTokenizer.from_pretrained(spec["model_path"])
            peft_config = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
            dataset = prompt_dataset(case["prompts"], conversational=True)
        else:
            tokenizer = make_tokenizer()
            dataset = prompt_dataset(case["prompts"])
        timer = StepTimer(name, baton, rng, sync)  # in lock-step mode, hands the baton on after each step
        trainer = trainer_cls(
            model=model,
            reward_funcs=[length_reward, digit_reward],
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=peft_config,
            callbacks=[timer],
        )
        timer.own = attribute_time(trainer)
        return trainer, timer

    def collect(built):
        results = {}
        for name, (trainer, timer) in built.items():
            results[name] = dict(wall=timer.step, cpu=timer.cpu, own=dict(timer.own))
            logs = [entry for entry in trainer.state.log_history if "step_time" in entry]
            for key in ("step_time", "loss", "completions/mean_length"):
                results[name][key] = [entry.get(key) for entry in logs]
            with torch.no_grad():
                params = [p.detach().double() for p in trainer.model.parameters() if p.requires_grad]
                checksum = [float(sum(p.sum() for p in params)), float(sum(p.abs().sum() for p in params))]
            results[name]["weight_checksum"] = checksum
        return results

    names, rounds = spec["trainers"], []
    if len(names) == 1:  # one trainer: measure its memory too
        (name,) = names
        built = {name: build(name, None)}
        rss_before = status_kib("VmRSS")
        hwm_reset = reset_peak_rss() and rss_before is not None
        if device == "cuda":
            sync()
            torch.cuda.reset_peak_memory_stats()
            cuda_before = torch.cuda.memory_allocated()
        set_seed(0)
        built[name][0].train()
        memory = {}  # read before collect() allocates
        if device == "cuda":
            peak, increase = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_allocated() - cuda_before
            memory = dict(peak_mib=peak / MIB, increase_mib=increase / MIB)
        elif hwm_reset:
            peak = status_kib("VmHWM")
            memory = dict(peak_mib=peak / 1024, increase_mib=(peak - rss_before) / 1024)
        results = collect(built)
        results[name].update(memory)
        rounds.append(results)
    else:
        for r in range(spec["rounds"]):
            order = names[r % len(names) :] + names[: r % len(names)]
            baton = Baton(order)
            built = {name: build(name, baton) for name in order}
            train_in_lockstep({name: trainer for name, (trainer, _) in built.items()}, baton)
            rounds.append(dict(collect(built), order=order))
            del built
            gc.collect()
    child_result(rounds)


# ---- parent: orchestration and report -----------------------------------------------------------------------------


def launch(spec: dict, pinned_malloc: bool) -> list[dict]:
    """Run one child; return its rounds ({trainer: results}). Raises with the child's output tail on failure."""
    threads = str(spec["threads"])
    env = dict(
        os.environ,
        OMP_NUM_THREADS=threads,
        MKL_NUM_THREADS=threads,
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TRANSFORMERS_VERBOSITY="error",
        PYTHONWARNINGS="ignore",
    )
    for name in PINNED_MALLOC:
        env.pop(name, None)
    if pinned_malloc:
        env.update(PINNED_MALLOC)
    return launch_child(Path(__file__).resolve(), spec, env, cwd=ROOT)


def timing_rounds(case: str, rounds: int, common: dict, calibrate: bool = False) -> list[dict]:
    """`rounds` lock-step rounds over as few children as CASES allows; each round is {trainer: results, "order"}.

    With calibrate=True both slots run stock TRL (an A/A test: the ratio such a run shows by chance)."""
    config, warmup, per_child = CASES[case]["config"], CASES[case]["warmup"], CASES[case]["rounds_per_child"]
    classes = {"trl": "trl", "ours": "trl" if calibrate else "ours"}
    label = "A/A calibration" if calibrate else "timing"
    results: list[dict] = []
    child = 0
    while len(results) < rounds:
        spec = dict(
            case=case,
            trainers=TRAINERS if child % 2 == 0 else TRAINERS[::-1],
            rounds=min(per_child, rounds - len(results)),
            classes=classes,
            max_steps=config["max_steps"],
            output_dir=str(Path(common["tmp"]) / f"{case}-{label.split()[0]}-{child}"),
            **common["spec"],
        )
        for result in launch(spec, pinned_malloc=False):
            results.append(result)
            medians = {name: _median(result[name]["step_time"][warmup:]) for name in TRAINERS}
            second = "trl'" if calibrate else "ours"
            first = second if result["order"][0] == "ours" else "trl"
            print(
                f"  {label} round {len(results) - 1} (child {child}, {first} first): median step_time "
                f"trl {medians['trl']:.4f} s, {second} {medians['ours']:.4f} s, ratio {medians['ours'] / medians['trl']:.3f}",
                flush=True,
            )
        child += 1
    return results


def memory_runs(case: str, repeats: int, common: dict, pinned_malloc: bool) -> dict[str, list[dict]]:
    """`repeats` single-trainer children per trainer, alternating (order flipped every repeat); name -> results."""
    runs: dict[str, list[dict]] = {name: [] for name in TRAINERS}
    for rep in range(repeats):
        for name in TRAINERS if rep % 2 == 0 else TRAINERS[::-1]:
            spec = dict(
                case=case,
                trainers=[name],
                classes={name: name},
                max_steps=CASES[case]["memory_steps"],
                output_dir=str(Path(common["tmp"]) / f"{case}-memory-{rep}"),
                **common["spec"],
            )
            (result,) = launch(spec, pinned_malloc)
            runs[name].append(result[name])
            print(
                f"  memory run {rep} {name:4}: peak {result[name].get('peak_mib', float('nan')):.1f} MiB, train + "
                f"{result[name].get('increase_mib', float('nan')):.1f} MiB",
                flush=True,
            )
    return runs


def _median(values) -> float:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}x" if b and a == a and b == b else "n/a"


def bootstrap_median_interval(values: list[float], draws: int = 2000) -> tuple[float, float]:
    """95% bootstrap interval of the median of `values` (rough with few values)."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


def check_same_work(case: str, runs: list[dict]) -> bool:
    """Print whether all runs logged the same completion lengths and losses (and, with equal step counts, final
    weights); return True if so. Shorter runs are compared on their steps."""
    reference = max(runs, key=lambda r: len(r["loss"]))
    lengths_equal, loss_diff, checksum_diff = True, 0.0, 0.0
    for run in runs:
        steps = len(run["loss"])
        lengths_equal &= run["completions/mean_length"] == reference["completions/mean_length"][:steps]
        pairs = zip(run["loss"], reference["loss"][:steps], strict=True)
        loss_diff = max([loss_diff] + [abs(a - b) for a, b in pairs])
        if steps == len(reference["loss"]):
            for a, b in zip(run["weight_checksum"], reference["weight_checksum"], strict=True):
                checksum_diff = max(checksum_diff, abs(a - b) / max(abs(b), 1e-12))
    same = lengths_equal and loss_diff <= 1e-4 and checksum_diff <= 1e-5
    print(
        f"{case}: same work in all {len(runs)} trainings: {'YES' if same else 'NO'} (completions/mean_length "
        f"identical: {lengths_equal}; max |loss diff| {loss_diff:.2e}; max rel. weight-checksum diff "
        f"{checksum_diff:.2e}; last step: loss {reference['loss'][-1]:.6g}, mean_length "
        f"{reference['completions/mean_length'][-1]:.4g})"
    )
    return same


def ratio_line(label: str, rounds: list[dict], warmup: int) -> str:
    """Median over rounds of ours / trl (each a ratio of the round's median step times), with its spread."""
    ratios = [_median(r["ours"]["step_time"][warmup:]) / _median(r["trl"]["step_time"][warmup:]) for r in rounds if r]
    low, high = bootstrap_median_interval(ratios)
    return (
        f"{'':8} {label}: median of {len(ratios)} per-round ratios {_median(ratios):.3f}, 95% interval "
        f"[{low:.3f}, {high:.3f}], range {min(ratios):.3f}-{max(ratios):.3f}"
    )


def attributed_line(rounds: list[dict], trl_step: float) -> str:
    """CPU ms per optimizer step in the code where the trainers differ, and what the difference is of a TRL step."""
    per_step = {}
    for name in TRAINERS:
        steps = sum(len(r[name]["step_time"]) for r in rounds)
        own = [r[name]["own"] for r in rounds]
        loss = sum(o["_compute_loss"] - o["forward_in_loss"] for o in own) / steps * 1e3
        scoring = sum(o["_generate_and_score_completions"] - o["_generate"] for o in own) / steps * 1e3
        per_step[name] = (loss, scoring)
    (t_loss, t_scoring), (o_loss, o_scoring) = per_step["trl"], per_step["ours"]
    extra = o_loss + o_scoring - t_loss - t_scoring
    return (
        f"{'':8} CPU ms per step outside model forward/generation: loss side trl {t_loss:.3f}, ours {o_loss:.3f}; "
        f"scoring side trl {t_scoring:.3f}, ours {o_scoring:.3f}; ours extra {extra:+.3f} ms = "
        f"{extra / (trl_step * 1e3):+.2%} of a trl step"
    )


def summarize(case: str, rounds: list[dict], memory: dict[str, list[dict]], warmup: int, calibration) -> list[str]:
    """Table rows for one case: one per trainer, the ratio row, then the per-round ratio (and A/A) lines."""
    stats = {}
    for name in TRAINERS:
        s = stats[name] = {key: [t for r in rounds for t in r[name][key][warmup:]] for key in TIMES}
        s["peak"] = _median([run.get("peak_mib") for run in memory[name]])
        s["increase"] = _median([run.get("increase_mib") for run in memory[name]])
    rows = []
    for name in TRAINERS:
        s = stats[name]
        rows.append(
            f"{case:8} {name:8} {len(rounds):>6} {len(s['step_time']):>5} | "
            + " ".join(f"{_median(s[key]):9.4f}" for key in TIMES)
            + f" | {len(memory[name]):>4} {s['peak']:9.1f} {s['increase']:9.1f}"
        )
    t, o = stats["trl"], stats["ours"]
    rows.append(
        f"{case:8} {'ours/trl':8} {'':>6} {'':>5} | "
        + " ".join(f"{_ratio(_median(o[key]), _median(t[key])):>9}" for key in TIMES)
        + f" | {'':>4} {_ratio(o['peak'], t['peak']):>9} {_ratio(o['increase'], t['increase']):>9}"
    )
    rows.append(ratio_line("step_time ours/trl", rounds, warmup))
    rows.append(attributed_line(rounds, _median(t["step_time"])))
    if calibration:
        rows.append(ratio_line("A/A trl'/trl (noise)", calibration, warmup))
    return rows


def main() -> None:
    parser = arguments(
        __doc__, repeats=None, threads=1, quick="tiny model only, 4 lock-step rounds"
    )  # --repeats: lock-step rounds per case (default: tiny 12, smollm2 3)
    parser.add_argument(
        "--memory-runs",
        type=int,
        default=1,
        help="memory runs per trainer and case (default 1: they are deterministic)",
    )
    parser.add_argument("--skip-smollm", action="store_true", help="tiny model only")
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="also run the same rounds with stock TRL in both slots (A/A): the ratio that noise alone produces",
    )
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_child(json.loads(args.child))
        return

    import torch
    import transformers
    import trl

    import grpo_plus

    started = time.perf_counter()
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    cases = ["tiny"] if args.quick or args.skip_smollm else ["tiny", "smollm2"]
    print(
        f"python {platform.python_version()}, torch {torch.__version__}, trl {trl.__version__}, transformers "
        f"{transformers.__version__}, grpo_plus {grpo_plus.__version__}"
    )
    print(f"device {device}, intra-op threads {args.threads} per run, {os.cpu_count()} CPUs, load average {_load()}")
    if device == "cuda":
        print(f"cuda {torch.version.cuda}, {torch.cuda.get_device_name()}")

    rows = []
    with tempfile.TemporaryDirectory(prefix="step_overhead-") as tmp:
        for case in cases:
            transformers.utils.logging.disable_progress_bar()
            model = embedded_model_or_none() if case == "smollm2" else model_path(True, tmp)
            if model is None:
                continue
            config, warmup = CASES[case]["config"], CASES[case]["warmup"]
            rounds = args.repeats or (4 if args.quick else CASES[case]["rounds"])
            common = dict(tmp=tmp, spec=dict(model_path=model, threads=args.threads, device=device))
            print(
                f"{case}: {rounds} lock-step rounds, {config['max_steps']} optimizer steps per trainer each, the "
                f"first {warmup} excluded; {json.dumps(config)}"
            )
            timing = timing_rounds(case, rounds, common)
            calibration = timing_rounds(case, rounds, common, calibrate=True) if args.calibrate else None
            print(
                f"{case}: {args.memory_runs} memory run(s) per trainer, {CASES[case]['memory_steps']} steps"
                + (", pinned malloc" if device == "cpu" else "")
            )
            memory = memory_runs(case, args.memory_runs, common, pinned_malloc=device == "cpu")
            trainings = [r[name] for r in timing + (calibration or []) for name in TRAINERS]
            check_same_work(case, trainings + [run for name in TRAINERS for run in memory[name]])
            rows += summarize(case, timing, memory, warmup, calibration)

    peak = "cuda peak" if device == "cuda" else "RSS peak"
    header = (
        f"{'case':8} {'trainer':8} {'rounds':>6} {'steps':>5} | {'step_time':>9} {'wall':>9} {'cpu':>9} | "
        f"{'runs':>4} {peak:>9} {'train +':>9}"
    )
    print()
    print("Time: seconds per optimizer step, medians of the steps after warm-up pooled over the lock-step rounds.")
    print(
        "Memory: MiB, medians over the memory runs: "
        + (
            "torch.cuda.max_memory_allocated over train() and its increase over the allocation before train()."
            if device == "cuda"
            else "peak RSS over train() (pinned malloc) and its increase over the RSS before train()."
        )
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        print(row)
    print("targets: step time <= 1.02x, peak memory <= 1.01x")
    print(f"total {time.perf_counter() - started:.0f} s; load average at the end {_load()}")


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"


if __name__ == "__main__":
    main()
