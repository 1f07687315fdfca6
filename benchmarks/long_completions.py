"""Long completions, timed: whole GRPO steps of stock TRL against grpo_plus in one run, at 256 and 512 tokens.

    .venv/bin/python benchmarks/long_completions.py [--lengths 256 512] [--steps 2 | --steps 2 1] [--threads 1]
        [--level word-mixed] [--reward correctness|demo] [--gradient-checkpointing on|off]
        [--lm-head-columns 4096] [--smoke] [--json F]

Every other speed figure of the project is on the demo's completions of <= 20 tokens. Here the embedded
SmolLM2-135M-Instruct + LoRA, as the demo trains it (recipes/configs/demo_cpu.yaml: r=16 all-linear, float32, dapo +
clip-higher, temperature 0.7, 2 prompts x G = 8 completions per optimizer step, lr 3e-4), is asked to reason step by
step before answering (REASONING_INSTRUCTION), so it writes the long, ragged replies reasoning RL trains on, and
trains with `max_completion_length` 256, then 512 (seed = that length: each its own prompts and draws). The reward is
the task's verifiable one (`--reward correctness`: 1 when the last number of the reply is the answer, as R1-Zero /
DAPO-style runs score; `demo` adds the demo's 0.5 x format reward, whose partial credit leaves few groups dead).
Whatever lengths the model writes and whatever share of groups ends up dead (every completion of a prompt scored
alike) is what is measured: both are reported, not chosen. Two settings differ from the demo's, for memory: TRL's
default gradient checkpointing (the demo turns it off), and LM-head tiles of 4096 vocabulary columns
(`lm_head_columns`); both apply to both sides.

Per length, stock trl.GRPOTrainer and grpo_plus.GRPOTrainer (all its defaults: zero-waste training pass and
generation) train in one process in lock-step (harness/lockstep.py: TRL's step 1, ours, TRL's step 2, ...),
each with its own random state, so machine load hits both alike and, in float32, they sample the same completions
(checked per step and reported). Per optimizer step and side, by two clocks (CLOCKS: wall time, and the trainer
thread's CPU time, which does not count the time other processes hold the cores):
  step                on_step_begin -> on_step_end
  generation          `_generate_single_turn` (the generate call with TRL's padding around it), split into prefill,
                      decode steps (for TRL also the share of each decode step spent on rows that had already
                      ended) and the rest (logits processing, sampling, padding, cache copies); harness/timing.py
  scoring             the rest of `_prepare_inputs`: decoding text, rewards, advantages
  training pass       `training_step` (TRL's `step_time`) minus `_prepare_inputs` (harness/trainers.py)
  optimizer + rest    step minus `training_step`: optimizer step, scheduler, callbacks
  positions           token positions through the model: in generation, and in the forwards carrying gradient
Also per step: completion lengths (mean, max, share truncated at `max_completion_length`), the dead-group share
(TRL's `frac_reward_zero_std`) and the machine's load average. Summaries add the steps up (both sides computed the
same completions, so sums are paired) and divide: ratio = grpo_plus / TRL. JSON and Markdown (beside it) are written
after every length.

`--smoke`: a tiny random Llama (grpo_plus.app.testing) at 8 and 16 tokens, 2 steps, a reward that kills the groups
of odd answers, run by tests/test_long_completions_benchmark.py (seconds).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

from harness.flags import arguments
from harness.report import ROOT, markdown_table, start_report, write_report
from harness.timing import ForwardTimer, instrument_generation, wrap_timed
from harness.trainers import SIDES, demo_settings, demo_trainer, model_path, run_in_lockstep, step_logs
from transformers import TrainerCallback

from grpo_plus.compat.lm_head import fused_lm_head_columns, fused_lm_head_columns_default, has_fused_lm_head
from grpo_plus.compat.model import completion_eos_token_ids

LENGTHS = (256, 512)
SMOKE_LENGTHS = (8, 16)
REASONING_INSTRUCTION = (
    'Think step by step: explain your reasoning in detail, then end your reply with "The answer is <number>."'
)
REWARDS = ("correctness", "demo")
GENERATION_PARTS = ("prefill", "decode", "finished_rows", "other")
STEP_PARTS = ("generation", "scoring", "train_pass", "optimizer")
# Wall time, and the trainer thread's CPU time: with torch on one intra-op thread every forward, backward and
# sampling step runs on the trainer's thread, so its CPU time is the work done, whatever else the machine runs.
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def reasoning_dataset(level: str, seed: int = 0):
    """The task's training problems of `level`, each asked with REASONING_INSTRUCTION instead of the demo's."""
    from grpo_plus.app import tasks

    dataset = tasks.make_dataset("train", level, seed=seed)
    return dataset.map(
        lambda row: {"prompt": [{"role": "user", "content": f"{row['question']}\n{REASONING_INSTRUCTION}"}]}
    )


def smoke_reward(completions, answer, **kwargs) -> list[float]:
    """--smoke only: 1 for every completion of an odd answer (a dead group), 0/1 alternating by row otherwise."""
    return [1.0 if value % 2 else float(row % 2) for row, value in enumerate(answer)]


def reward_functions(reward: str, smoke: bool) -> tuple[list, list[float] | None]:
    """(reward functions, reward weights) for `--reward`."""
    from grpo_plus.app import tasks

    if smoke:
        return [smoke_reward], None
    if reward == "demo":
        return [tasks.correctness_reward, tasks.format_reward], [1.0, 0.5]
    return [tasks.correctness_reward], None


def run_settings(
    max_completion_length: int, steps: int, reward_weights, output_dir: Path, gradient_checkpointing: bool = True
) -> dict:
    """The demo config's GRPOConfig fields (harness.trainers.demo_settings), at `max_completion_length`, `steps` steps,
    with TRL's default gradient checkpointing (the demo turns it off: at 20 tokens it only costs time)."""
    settings = demo_settings(steps)
    settings.update(
        max_completion_length=max_completion_length,
        reward_weights=reward_weights,
        gradient_checkpointing=gradient_checkpointing,
        # each length its own prompts and draws: with one seed, the 512-token run would replay the 256-token run's
        # first steps token for token (same prompts, same random numbers) wherever no reply passed 256 tokens
        seed=max_completion_length,
        output_dir=str(output_dir / f"long-{max_completion_length}"),
    )
    return settings


def lm_head_columns(columns: int):
    """The vocabulary columns per tile of TRL's chunked log-prob LM head, which both sides run, set to `columns` inside
    the block (grpo_plus.compat.lm_head; TRL >= 1.15; 0: TRL's own); (TRL's default or None without it, the block).

    Without Triton (CPU) TRL runs that kernel's torch fallback on [4096 tokens x 32768 columns] tiles, whose temporaries
    take ~4 GB; at 4096 columns ~0.8 GB in the same time (measured here: 3664 tokens x SmolLM2's 49152-word head,
    forward + backward ~52 s either way). One process holding both trainers at the default peaked at 11.6 GB and was
    killed by the kernel's OOM killer on this shared 23 GB machine."""
    default = fused_lm_head_columns_default() if has_fused_lm_head() else None
    if default is None or not columns:
        return default, contextlib.nullcontext()
    return default, fused_lm_head_columns(columns)


def run_length(
    length: int, steps: int, dataset, rewards, model_dir, output_dir: Path, gradient_checkpointing: bool
) -> dict:
    """Both trainers in lock-step at `max_completion_length` = `length`; per-step records and their summary."""
    reward_funcs, reward_weights = rewards
    settings = run_settings(length, steps, reward_weights, output_dir, gradient_checkpointing)
    built = run_in_lockstep(demo_trainer(settings, dataset, reward_funcs, model_dir), prepare=instrument)
    result = {"max_completion_length": length, "steps": {name: step_records(built[name]) for name in SIDES}}
    result.update(compare_sides(result["steps"]))
    return result


def instrument(built: dict) -> None:
    """Beside what harness.trainers records by the wall clock (the step, `_prepare_inputs`) and its StepTimer's CPU time
    of each step: generation by both clocks, `_prepare_inputs` and `training_step` by the CPU clock, and per step the
    training positions and the machine's load."""
    for side in built.values():
        trainer = side["trainer"]
        side.update(train_positions=[], loads=[], generations={clock: [] for clock in CLOCKS})
        side["cpu"] = {"prepare": [], "training_step": []}
        for clock, read in CLOCKS.items():
            timer = ForwardTimer(trainer.model, read)
            instrument_generation(trainer, timer, set(completion_eos_token_ids(trainer)), side["generations"][clock])
        wrap_timed(trainer, "_prepare_inputs", side["cpu"]["prepare"], time.thread_time)
        wrap_timed(trainer, "training_step", side["cpu"]["training_step"], time.thread_time)
        trainer.add_callback(StepProbe(side["forwards"], side["train_positions"], side["loads"]))


class StepProbe(TrainerCallback):
    """At each step's end: the training positions a ForwardLog (grpo_plus.app.testing) has counted since the run began
    (the step records take differences), and the machine's 1-minute load average."""

    def __init__(self, forwards, totals: list[int], loads: list[float]):
        self.forwards, self.totals, self.loads = forwards, totals, loads

    def on_step_end(self, args, state, control, **kwargs):
        self.totals.append(self.forwards.training_positions)
        self.loads.append(os.getloadavg()[0])


def phase_times(step: float, training_step: float, prepare: float, generation: dict) -> dict:
    """A step's time split into its phases (one clock): generation (and its parts), scoring, training pass, rest."""
    return dict(
        step=step,
        generation=generation["seconds"],
        scoring=prepare - generation["seconds"],
        train_pass=training_step - prepare,
        optimizer=step - training_step,
        **{part: generation[part] for part in GENERATION_PARTS},
    )


def step_records(side: dict) -> list[dict]:
    """One dict per optimizer step of one trainer: times by both clocks, positions, lengths, dead groups, ids."""
    logs = step_logs(side)
    totals, cpu = side["train_positions"], side["cpu"]
    records = []
    for index, log in enumerate(logs):
        generation = side["generations"]["wall"][index]
        records.append(
            dict(
                # TRL's `step_time` is its training_step's wall time
                wall=phase_times(side["timer"].step[index], log["step_time"], side["prepare"][index], generation),
                cpu=phase_times(
                    side["timer"].cpu[index],
                    cpu["training_step"][index],
                    cpu["prepare"][index],
                    side["generations"]["cpu"][index],
                ),
                decode_steps=generation["steps"],
                generation_positions=generation["positions"],
                prefill_positions=generation["prefill_positions"],
                rows=len(generation["completion_ids"]),
                train_positions=totals[index] - (totals[index - 1] if index else 0),
                # TRL's own log (one step per log): a completion without EOS counts as truncated ("clipped")
                mean_length=log["completions/mean_length"],
                max_length=int(log["completions/max_length"]),
                truncated=log["completions/clipped_ratio"],
                dead_groups=log["frac_reward_zero_std"],
                reward=log["reward"],
                loss=log["loss"],
                load_average=side["loads"][index],
                completion_ids=generation["completion_ids"],
            )
        )
    return records


def compare_sides(steps: dict) -> dict:
    """Sameness of the two sides' completions and losses, and the summed figures with their ratios (ours / TRL)."""
    trl_steps, our_steps = steps["trl"], steps["ours"]
    pairs = list(zip(trl_steps, our_steps, strict=True))
    same = [a.pop("completion_ids") == b.pop("completion_ids") for a, b in pairs]
    summed = {name: summed_figures(steps[name]) for name in SIDES}

    def ratio(trl_value, our_value):
        return our_value / trl_value if trl_value else None

    ratios = {
        clock: {key: ratio(summed["trl"][clock][key], summed["ours"][clock][key]) for key in ("step", *STEP_PARTS)}
        for clock in CLOCKS
    }
    ratios["positions"] = {
        key: ratio(summed["trl"][key], summed["ours"][key]) for key in ("generation_positions", "train_positions")
    }
    return dict(
        same_completions=all(same),
        same_completions_per_step=same,
        max_loss_difference=max(abs(a["loss"] - b["loss"]) for a, b in pairs),
        summed=summed,
        ratios=ratios,
        step_ratios={clock: [b[clock]["step"] / a[clock]["step"] for a, b in pairs] for clock in CLOCKS},
    )


def summed_figures(records: list[dict]) -> dict:
    """Times (both clocks) and positions added up over the steps; lengths and dead groups averaged over them."""
    totals = {clock: {key: sum(r[clock][key] for r in records) for key in records[0][clock]} for clock in CLOCKS}
    totals.update({key: sum(r[key] for r in records) for key in ("generation_positions", "train_positions")})
    totals.update(
        {key: statistics.fmean(r[key] for r in records) for key in ("mean_length", "truncated", "dead_groups")}
    )
    totals["max_length"] = max(r["max_length"] for r in records)
    return totals


def load_range(run: dict) -> tuple[float, float]:
    """Lowest and highest 1-minute load average at either side's step ends."""
    loads = [step["load_average"] for name in SIDES for step in run["steps"][name]]
    return min(loads), max(loads)


def seconds(value: float) -> str:
    """Seconds to three significant digits, whole seconds from 100 on (minutes-long steps, the smoke's milliseconds)."""
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def markdown(report: dict) -> str:
    """The report's tables: per length, where each side's time goes and the ratios; generation's parts; the
    completions (lengths, dead groups, sameness); step by step."""

    def ratio_cell(value, bold=False):
        text = "-" if value is None else f"{value:.2f}"
        return f"**{text}**" if bold else text

    out = [f"# Long completions: stock TRL vs grpo_plus, whole steps ({report['conditions']})", ""]
    rows = []
    for run in report["runs"]:
        length, ratios = run["max_completion_length"], run["ratios"]
        for name, label in (("trl", "stock TRL"), ("ours", "grpo_plus")):
            values = run["summed"][name]
            cpu = values["cpu"]
            rows.append(
                [length, label, seconds(cpu["step"])]
                + [f"{seconds(cpu[key])} ({cpu[key] / cpu['step']:.0%})" for key in STEP_PARTS]
                + [seconds(values["wall"]["step"]), values["generation_positions"], values["train_positions"]]
            )
        rows.append(
            [length, "**ratio**", ratio_cell(ratios["cpu"]["step"], bold=True)]
            + [ratio_cell(ratios["cpu"][key]) for key in STEP_PARTS]
            + [ratio_cell(ratios["wall"]["step"], bold=True)]
            + [ratio_cell(ratios["positions"][key]) for key in ("generation_positions", "train_positions")]
        )
    header = ["max completion", "side", "steps, CPU s", "generation (CPU s, share)", "scoring", "training pass"]
    header += ["optimizer + rest", "steps, wall s", "generation positions", "training positions"]
    out += [
        "Summed over the steps (both sides computed the same completions); CPU s = the trainer thread's CPU time, "
        "wall s = elapsed time; ratio = grpo_plus / TRL.",
        "",
        markdown_table(header, rows),
        "",
    ]

    rows = []
    for run in report["runs"]:
        for name, label in (("trl", "stock TRL"), ("ours", "grpo_plus")):
            cpu = run["summed"][name]["cpu"]
            rows.append([run["max_completion_length"], label] + [seconds(cpu[part]) for part in GENERATION_PARTS])
    header = ["max completion", "side", "prefill", "decode", "of it: rows already ended", "other"]
    out += ["Where generation goes (CPU s, summed over the steps):", "", markdown_table(header, rows), ""]

    rows = []
    for run in report["runs"]:
        values = run["summed"]["trl"]
        rows.append(
            [
                run["max_completion_length"],
                len(run["steps"]["trl"]),
                f"{values['mean_length']:.0f}",
                values["max_length"],
                f"{values['truncated']:.0%}",
                f"{values['dead_groups']:.0%}",
                run["same_completions"],
                f"{run['max_loss_difference']:.1e}",
                "{:.1f}-{:.1f}".format(*load_range(run)),
            ]
        )
    header = ["max completion", "steps", "mean length", "longest", "truncated", "dead groups", "same completions"]
    header += ["max loss diff", "machine load (1-min average at step ends)"]
    out += ["Completions the model wrote (means over the steps):", "", markdown_table(header, rows), ""]

    rows = []
    for run in report["runs"]:
        for index, (trl_step, our_step) in enumerate(zip(run["steps"]["trl"], run["steps"]["ours"], strict=True)):
            trl_cpu, our_cpu = trl_step["cpu"], our_step["cpu"]
            rows.append(
                [
                    run["max_completion_length"],
                    index + 1,
                    f"{trl_step['mean_length']:.0f} / {trl_step['max_length']}",
                    f"{trl_step['truncated']:.0%}",
                    f"{trl_step['dead_groups']:.0%}",
                    seconds(trl_cpu["step"]),
                    seconds(our_cpu["step"]),
                    ratio_cell(our_cpu["step"] / trl_cpu["step"], bold=True),
                    ratio_cell(our_step["wall"]["step"] / trl_step["wall"]["step"]),
                    ratio_cell(our_cpu["generation"] / trl_cpu["generation"]),
                    ratio_cell(our_cpu["train_pass"] / trl_cpu["train_pass"]),
                    ratio_cell(our_step["train_positions"] / trl_step["train_positions"]),
                ]
            )
    header = ["max completion", "step", "mean / longest", "truncated", "dead groups", "TRL step (CPU s)"]
    header += ["grpo_plus step (CPU s)", "step ratio", "wall ratio", "generation ratio", "training-pass ratio"]
    header += ["training positions ratio"]
    out += ["Step by step (ratios of CPU time unless named):", "", markdown_table(header, rows), ""]
    out += [f"Peak resident memory of the process (both trainers): {report['peak_rss_gib']:.1f} GiB."]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    json_path = ROOT / "outputs" / "bench-long-completions" / "long_completions.json"
    parser = arguments(__doc__, threads=1, json=json_path, smoke="tiny random model, 8 and 16 tokens, 2 steps")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS), help="max_completion_length values")
    parser.add_argument(
        "--steps",
        type=int,
        nargs="+",
        default=[2],
        help="optimizer steps of each trainer: one value, or one per length",
    )
    parser.add_argument("--level", default="word-mixed", help="task level (grpo_plus.app.tasks.LEVELS)")
    parser.add_argument("--reward", choices=REWARDS, default="correctness")
    parser.add_argument(
        "--gradient-checkpointing",
        choices=("on", "off"),
        default="on",
        help="on: TRL's GRPOConfig default; off (the demo's): one 512-token step of one side alone needs > 12 GB",
    )
    parser.add_argument(
        "--lm-head-columns",
        type=int,
        default=4096,
        help="vocabulary columns per tile of TRL's chunked log-prob LM head, both sides (0: TRL's 32768; see "
        "lm_head_columns: memory, not time)",
    )
    args = parser.parse_args(argv)

    report, started = start_report(args)
    lengths, steps = (SMOKE_LENGTHS, [2]) if args.smoke else (tuple(args.lengths), args.steps)
    if len(steps) not in (1, len(lengths)):
        parser.error(f"--steps takes one value or one per length ({len(lengths)}), got {len(steps)}")
    steps = dict(zip(lengths, steps * len(lengths) if len(steps) == 1 else steps, strict=True))
    report["command"] = " ".join(sys.argv if argv is None else ["long_completions.py", *argv])
    trl_columns, columns = lm_head_columns(args.lm_head_columns)
    report["lm_head_columns"] = {"trl_default": trl_columns, "used": args.lm_head_columns or trl_columns}
    with columns:  # restored afterwards: main() may run inside another process (the smoke test)
        run_lengths(args, report, started, lengths, steps)
    print("\n" + markdown(report))


def run_lengths(args: argparse.Namespace, report: dict, started: float, lengths: tuple, steps: dict) -> None:
    """Every length in turn, the report saved after each."""
    level = "add-1d" if args.smoke else args.level  # short questions: the tiny model's positions stay small
    report.update(level=level, reward="smoke" if args.smoke else args.reward)
    report["conditions"] = f"{'tiny random Llama' if args.smoke else 'SmolLM2-135M-Instruct + LoRA'}, {level}, "
    report["conditions"] += f"reward {report['reward']}, G = 8, gradient checkpointing {args.gradient_checkpointing}, "
    report["conditions"] += f"steps {'/'.join(str(steps[length]) for length in lengths)}, {args.threads} thread(s), "
    report["conditions"] += f"LM-head tiles of {report['lm_head_columns']['used']} vocabulary columns"
    dataset, rewards = reasoning_dataset(level), reward_functions(args.reward, args.smoke)
    report["runs"] = []
    with tempfile.TemporaryDirectory() as scratch:
        model = model_path(True, scratch) if args.smoke else None  # None: the demo's model
        for length in lengths:
            print(f"max_completion_length {length}: {steps[length]} lock-step steps per trainer ...", flush=True)
            begun = time.perf_counter()
            checkpointing = args.gradient_checkpointing == "on"
            run = run_length(length, steps[length], dataset, rewards, model, Path(scratch), checkpointing)
            run["wall_minutes"] = (time.perf_counter() - begun) / 60
            report["runs"].append(run)
            ratios = run["ratios"]
            print(
                f"  whole-step ratio {ratios['cpu']['step']:.2f} (CPU time), {ratios['wall']['step']:.2f} (wall); "
                f"same completions {run['same_completions']}",
                flush=True,
            )
            save(report, started, args.json)  # after every length: a run stopped later keeps what it measured
            release_memory()  # the next length's trainers start from a smaller process


def release_memory() -> None:
    """Free the finished trainers (their hooks make reference cycles) and hand freed heap back to the system."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the memory stays with the process, nothing else changes
        pass


def save(report: dict, started: float, json_path: Path) -> None:
    """Write the report as JSON and its tables as Markdown beside it."""
    # the whole process's peak resident memory (both trainers, their models and the allocator's reserve)
    report["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    write_report(report, json_path, markdown=markdown(report), started=started)


if __name__ == "__main__":
    main()
