"""Asynchronous generation against TRL's synchronous loop, both grpo_plus in server mode on one server, in one run.

    make bench-async    (.venvs/vllm/bin/python benchmarks/async_generation.py [--steps 30] [--seeds 3]
                         [--eval-every 10] [--eval-size 48] [--json docs/guide/results/async_generation.json])

The layout issue 51 asks for on this 2-core machine: `grpo-plus vllm-serve` (the embedded SmolLM2-135M-Instruct,
float32) pinned to core 0, the trainer pinned to core 1, torch on one thread in each. The run: the demo config
(recipes/configs/demo_cpu.yaml: LoRA r=16 all-linear, 2 prompts x 8 completions of <= 20 tokens per optimizer step,
lr 3e-4, dapo + clip-higher) on reasoning-gym chain_sum (the recipe's correctness + 0.5 x format rewards), with
`use_vllm=True, vllm_mode="server"` and TRL's default importance-sampling correction. Two sides per seed, trained one
after the other against the same server (each first sync loads its own weights), the first side alternating from seed
to seed: "sync", TRL's loop (grpo_plus's defaults), and "async", `async_generation=True, max_staleness=1`.

Per optimizer step, after --warmup steps, medians:
  step         on_step_begin -> on_step_end (the sync side: sync, generation, scoring, training; the async side: the
               same, generation overlapped with the previous step's training)
  generation   the sync side's `VLLMGeneration.generate` (the request to the server, every prompt)
  sync         the sync side's `VLLMGeneration.sync_weights` (stream, the server's reload)
  training     the sync side's step less generation and sync: scoring, old log-probs, forward + backward, optimizer
The physical limit of the overlap: the async step cannot be shorter than max(generation, training + sync); the issue's
target is async step <= 1.15x that limit. Learning: greedy held-out accuracy every --eval-every steps (--eval-size
questions, not counted in the steps' time), against each side's summed step time; the target is >= 1.5x the held-out
accuracy per training minute, accuracy per step within the seeds' spread. Sampling is seeded per request (the run's seed; --no-seeded-sampling
leaves it to the server), so each step's completion ids of the two sides can be compared (equal at step 0, then apart:
the async side samples from weights one step old), and so are the final weights. TRL's sampler/trainer mismatch
metrics (`sampling/*`) are kept per step: what staleness costs. Writes --json (and the Markdown table beside it) and
--png: held-out accuracy against each side's training minutes and against the step, every seed (`--plot-from JSON`
draws it again from a report this script wrote, without training).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

from harness.flags import arguments  # noqa: E402
from harness.report import ROOT, markdown_table, start_report, write_report  # noqa: E402
from harness.timing import StepTimer  # noqa: E402
from harness.trainers import demo_lora, demo_settings, model_path  # noqa: E402

SIDES = ("sync", "async")
LABELS = {"sync": "TRL's loop", "async": "asynchronous"}
SERVER_CORE, TRAINER_CORE = 0, 1
EVAL_MAX_NEW_TOKENS = 24  # the demo config's
# What staleness costs: TRL's sampler/trainer mismatch metrics, per step (the sampler's log-probs against the trainer's)
MISMATCH = (
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
)


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(model_dir: str, log: Path) -> tuple[subprocess.Popen, str]:
    """`grpo-plus vllm-serve` on core 0 (taskset), one torch thread; returns the process and its URL once healthy."""
    import requests

    port = free_port()
    command = [
        "taskset", "-c", str(SERVER_CORE), sys.executable, "-c",
        "import sys; from grpo_plus.app.cli import main; sys.exit(main())",
        "vllm-serve", "--model", model_dir, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--max_model_len", "512", "--enforce_eager",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = open(log, "w")  # noqa: SIM115  (the server writes to it until it is stopped)
    process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while True:
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start:\n{log.read_text()[-3000:]}")
        try:
            if requests.get(f"{url}/health", timeout=5).status_code == 200:
                return process, url
        except requests.ConnectionError:
            pass
        time.sleep(2)


def timed(owner, name: str, seconds: list[float]) -> None:
    """Wrap `owner.name` (an instance attribute from then on) to append each call's wall time to `seconds`."""
    method = getattr(owner, name)

    def timed_call(*args, **kwargs):
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - started)

    setattr(owner, name, timed_call)


def train_side(side: str, seed: int, url: str, model_dir: str, train, held_out, rewards, args, output_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback

    import grpo_plus
    from grpo_plus.app import tasks

    settings = demo_settings(args.steps)
    settings.update(
        output_dir=str(output_dir), seed=seed, use_vllm=True, vllm_mode="server", vllm_server_base_url=url,
        vllm_group_port=free_port(), async_generation=side == "async", max_staleness=1,
    )  # fmt: skip
    if args.seeded_sampling:  # one seed per request: the same weights draw the same completions on both sides
        settings["generation_kwargs"] = {"seed": seed}
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trainer = grpo_plus.GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        reward_funcs=list(rewards), args=grpo_plus.GRPOConfig(**settings), train_dataset=train,
        processing_class=tokenizer, peft_config=demo_lora(),
    )  # fmt: skip
    trainer.remove_callback(PrinterCallback)
    timer = StepTimer(side)
    trainer.add_callback(timer)
    generation, sync, completions, points = [], [], [], []
    if side == "sync":
        timed(trainer.vllm_generation, "generate", generation)
        timed(trainer.vllm_generation, "sync_weights", sync)
    score = trainer._generate_and_score_completions

    def recorded(inputs):
        output = score(inputs)
        completions.append(output["completion_ids"].tolist())
        return output

    trainer._generate_and_score_completions = recorded
    correctness, format_reward = rewards

    class Evaluate(TrainerCallback):  # after the timer: outside the timed step
        def evaluate(self, model, step):
            rng = torch.random.get_rng_state()
            result = tasks.evaluate(model, tokenizer, held_out, max_new_tokens=EVAL_MAX_NEW_TOKENS, progress=False,
                                    correctness=correctness, format=format_reward)  # fmt: skip
            torch.random.set_rng_state(rng)
            points.append({"step": step, "train_seconds": sum(timer.step), "accuracy": result["accuracy"]})
            print(f"  seed {seed} {side:5s} step {step:3d}  {sum(timer.step) / 60:5.2f} min  "
                  f"accuracy {result['accuracy']:.3f}", flush=True)  # fmt: skip

        def on_train_begin(self, args_, state, control, model=None, **kwargs):
            self.evaluate(model, 0)

        def on_step_end(self, args_, state, control, model=None, **kwargs):
            if state.global_step % args.eval_every == 0 or state.global_step >= state.max_steps:
                self.evaluate(model, state.global_step)

    trainer.add_callback(Evaluate())
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    return {
        "step_seconds": timer.step,
        "generation_seconds": generation,
        "sync_seconds": sync,  # one per step, before its generation (the first loads the initial weights)
        "evals": points,
        "staleness": [entry.get("async/staleness") for entry in logs],
        "trainer_wait_seconds": [entry.get("async/trainer_wait_seconds") for entry in logs],
        "engine_wait_seconds": [entry.get("async/engine_wait_seconds") for entry in logs],
        "rewards": [entry["reward"] for entry in logs],
        # with the zero-waste pass grpo_plus logs them over the trained rows, as sampling/trained_rows/*
        "mismatch": {
            key: [entry.get(key, entry.get(key.replace("sampling/", "sampling/trained_rows/", 1))) for entry in logs]
            for key in MISMATCH
        },  # fmt: skip
        "completions": completions,
    }, weights


def summarize(runs: list[dict], warmup: int) -> dict:
    def median_after_warmup(values):
        return statistics.median(values[warmup:]) if len(values) > warmup else None

    summary = {}
    for seed_run in runs:
        sync, asynchronous = seed_run["sync"], seed_run["async"]
        step_sync = median_after_warmup(sync["step_seconds"])
        generation = median_after_warmup(sync["generation_seconds"])
        weight_sync = median_after_warmup(sync["sync_seconds"])
        training = step_sync - generation - weight_sync
        limit = max(generation, training + weight_sync)
        step_async = median_after_warmup(asynchronous["step_seconds"])
        final = {side: seed_run[side]["evals"][-1] for side in SIDES}
        per_minute = {side: final[side]["accuracy"] / (final[side]["train_seconds"] / 60) for side in SIDES}
        summary[seed_run["seed"]] = {
            "sync_step": step_sync, "generation": generation, "sync": weight_sync, "training": training,
            "overlap_limit": limit, "async_step": step_async, "async_over_limit": step_async / limit,
            "async_over_sync_step": step_async / step_sync,
            "accuracy": {side: final[side]["accuracy"] for side in SIDES},
            "accuracy_per_minute": per_minute,
            "accuracy_per_minute_ratio": per_minute["async"] / per_minute["sync"] if per_minute["sync"] else None,
            "same_completions_steps": seed_run["same_completions_steps"],
            "final_weights_max_difference": seed_run["final_weights_max_difference"],
            "mismatch": {side: {key: median_after_warmup([v for v in seed_run[side]["mismatch"][key] if v is not None])
                                for key in MISMATCH} for side in SIDES},
        }  # fmt: skip
    return summary


def plot(report: dict, path: Path) -> None:
    """Two panels: held-out accuracy against each side's summed step time, and against the optimizer step; one line
    per side and seed (TRL's loop solid, asynchronous dashed, a marker per seed)."""
    from harness.plots import accuracy_panels

    from grpo_plus.app.plotting import series

    fig, by_minutes, by_step = accuracy_panels(
        report["settings"]["eval_size"], "training minutes (each side's steps summed; evaluation excluded)"
    )
    colors, lines, markers = {"sync": "C1", "async": "C0"}, {"sync": "-", "async": "--"}, "oxs^dv"
    for run in report["runs"]:
        seed = run["seed"]
        for side in SIDES:
            history = [dict(point, train_minutes=point["train_seconds"] / 60) for point in run[side]["evals"]]
            style = dict(color=colors[side], linestyle=lines[side], marker=markers[seed % len(markers)])
            by_minutes.plot(*series(history, "accuracy", x="train_minutes"), label=f"{LABELS[side]}, seed {seed}",
                            **style)  # fmt: skip
            by_step.plot(*series(history, "accuracy", x="step"), **style)
    by_minutes.legend(fontsize="small", loc="lower right", ncols=2)
    fig.suptitle(
        "reasoning-gym chain_sum, the embedded SmolLM2-135M-Instruct + LoRA, float32; a vLLM server on one core, the "
        "trainer on the other",
        fontsize="medium",
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, format="png")
    print(f"plot in {path}")


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.2g}"


def table(summary: dict) -> str:
    rows = [
        [seed, f"{s['sync_step']:.2f}", f"{s['generation']:.2f}", f"{s['sync']:.2f}", f"{s['training']:.2f}",
         f"{s['overlap_limit']:.2f}", f"{s['async_step']:.2f}", f"{s['async_over_limit']:.2f}x",
         f"{s['accuracy']['sync']:.3f} / {s['accuracy']['async']:.3f}",
         "-" if s["accuracy_per_minute_ratio"] is None else f"{s['accuracy_per_minute_ratio']:.2f}x",
         " / ".join(_number(s["mismatch"][side][MISMATCH[0]]) for side in SIDES), s["same_completions_steps"]]
        for seed, s in summary.items()
    ]  # fmt: skip
    header = ["seed", "sync step (s)", "generation", "weight sync", "training", "limit", "async step",
              "async / limit", "held-out accuracy sync / async", "accuracy per minute async / sync",
              "sampler-trainer log-prob gap sync / async", "steps with equal completions"]  # fmt: skip
    return markdown_table(header, rows)


def main(argv: list[str] | None = None) -> int:
    import torch

    from grpo_plus.app import real_tasks

    parser = arguments(__doc__, steps=30, warmup=2, json=ROOT / "docs" / "guide" / "results" / "async_generation.json")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--eval-size", type=int, default=48)
    parser.add_argument("--train-size", type=int, default=512)
    parser.add_argument(
        "--seeded-sampling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Seed every request (generation_kwargs seed = the run's seed): the two sides draw the same completions "
        "from the same weights, so each step's completion ids can be compared (--no-seeded-sampling: the server's "
        "own random state).",
    )
    parser.add_argument("--png", type=Path, default=None, help="the plot (default: --json with .png)")
    parser.add_argument("--plot-from", type=Path, default=None, help="draw --png from this report; train nothing")
    args = parser.parse_args(argv)
    if args.plot_from is not None:
        plot(json.loads(args.plot_from.read_text()), args.png or args.plot_from.with_suffix(".png"))
        return 0
    os.sched_setaffinity(0, {TRAINER_CORE})
    torch.set_num_threads(1)
    report, started = start_report(args, versions=("torch", "transformers", "trl", "vllm"))
    model_dir = model_path(False, None)
    train, held_out = real_tasks.reasoning_gym_datasets(
        "reasoning-gym:chain_sum", "min_terms=2,max_terms=2,max_digits=1", args.train_size, args.eval_size, seed=0
    )
    rewards = real_tasks.task_rewards(train)
    folder = Path(tempfile.mkdtemp(prefix="bench-async-"))
    server, url = start_server(model_dir, folder / "server.log")
    runs = []
    try:
        for seed in range(args.seeds):
            order = SIDES if seed % 2 == 0 else tuple(reversed(SIDES))
            seed_run, weights = {"seed": seed, "order": list(order)}, {}
            for side in order:
                seed_run[side], weights[side] = train_side(
                    side, seed, url, model_dir, train, held_out, rewards, args, folder / f"{side}-{seed}"
                )
            same = [
                a == b for a, b in zip(seed_run["sync"]["completions"], seed_run["async"]["completions"], strict=True)
            ]
            seed_run["same_completions_steps"] = sum(same)
            seed_run["final_weights_max_difference"] = max(
                (weights["sync"][n] - weights["async"][n]).abs().max().item() for n in weights["sync"]
            )
            for side in SIDES:
                del seed_run[side]["completions"]
            runs.append(seed_run)
    finally:
        os.killpg(server.pid, 15)
    summary = summarize(runs, args.warmup)
    markdown = table(summary)
    print(markdown)
    write_report({**report, "settings": {k: str(v) for k, v in vars(args).items()}, "runs": runs,
                  "summary": summary}, args.json, markdown, started=started)  # fmt: skip
    plot(json.loads(Path(args.json).read_text()), args.png or Path(args.json).with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
