"""The reward runner's cost and gain (grpo_plus.rewards.runner), against stock TRL in the same run.

    .venv/bin/python benchmarks/reward_runner.py [--json docs/guide/results/reward_runner.json] [--steps 6]
        [--timeout 2] [--cpu-ms 50]

Every run trains the random tiny Llama of grpo_plus.app.testing (CPU, float32, 8 completions per step: 2 prompts x 4)
from the same seed; the runs go one after the other in this process.
- stalled: a reward that sleeps forever on the completions whose text hashes to 0 mod 4, scored by grpo_plus with
  reward_workers=2, reward_timeout=T; stock TRL scores its twin (None exactly there) in its own process. The rewards
  are checked bit-identical step by step, so both runs generate the same completions and their steps compare one by
  one. Reported for each step that met a stall: (grpo_plus's step time - stock TRL's) / T (the target: at most
  1.05), and grpo_plus's reward call seconds / T.
- cpu: a pure-Python reward burning about cpu_ms of CPU per completion, grpo_plus with reward_workers=2 against stock
  TRL calling it in process: the reward seconds per step and the step times, grpo_plus / stock TRL (the target: at
  most 0.6 for the reward), medians over the steps after the first.
- fast: a trivial reward (digit_reward) with reward_workers=2: what the runner itself costs per call, against TRL's
  in-process call (milliseconds).
The load average before and after is recorded: on a shared machine other work inflates every time.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
import time
import zlib

import torch
import trl
from harness.flags import arguments
from harness.report import write_report

import grpo_plus
from grpo_plus.app.testing import digit_reward, make_model, make_tokenizer, prompt_dataset, tiny_run_kwargs

STALL = 4  # a completion stalls when crc32(text) % STALL == 0
BURN = {"iterations_per_ms": 1000}  # set by calibrate() before any trainer forks its workers


def stalls(text: str) -> bool:
    return zlib.crc32(text.encode()) % STALL == 0


def stalled_reward(completions, **kwargs):
    """Sleeps forever on some completions, the length of the others."""
    if any(stalls(text) for text in completions):
        time.sleep(3600)
    return [float(len(text)) for text in completions]


def twin_reward(completions, **kwargs):
    """What stalled_reward gives where it returns: None where it stalls."""
    return [None if stalls(text) else float(len(text)) for text in completions]


twin_reward.__name__ = "stalled_reward"


def burn(text: str, milliseconds: float) -> float:
    """About `milliseconds` of pure-Python CPU work, its result a function of `text` alone."""
    x = zlib.crc32(text.encode())
    for _ in range(int(BURN["iterations_per_ms"] * milliseconds)):
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF
    return (x % 1000) / 1000


def cpu_reward(completions, **kwargs):
    return [burn(text, BURN["ms"]) for text in completions]


def calibrate(milliseconds: float) -> None:
    start, count = time.process_time(), 2_000_000
    x = 1
    for _ in range(count):
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF
    BURN.update(iterations_per_ms=count / ((time.process_time() - start) * 1000), ms=milliseconds)


def train(package, rewards, steps: int, output_dir: str, **settings) -> dict:
    """Train `steps` steps; per step the seconds in `_calculate_rewards`, its rewards, TRL's step_time, the log."""
    tokenizer = make_tokenizer()
    config = tiny_run_kwargs(output_dir, max_steps=steps, per_device_train_batch_size=8, **settings)
    trainer = package.GRPOTrainer(
        model=make_model(tokenizer), processing_class=tokenizer, reward_funcs=rewards,
        args=package.GRPOConfig(**config), train_dataset=prompt_dataset(16),
    )  # fmt: skip
    seconds, rewards_per_step, calculate = [], [], trainer._calculate_rewards

    def timed(*args):
        start = time.perf_counter()
        out = calculate(*args)
        seconds.append(time.perf_counter() - start)
        rewards_per_step.append(out.clone())
        return out

    trainer._calculate_rewards = timed
    trainer.train()
    runner = getattr(trainer, "_reward_runner", None)
    if runner is not None:
        runner.close()
    log = [entry for entry in trainer.state.log_history if "step_time" in entry]
    return dict(seconds=seconds, rewards=rewards_per_step, step_time=[e["step_time"] for e in log], log=log)


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.isnan().equal(y.isnan()) and x.nan_to_num().equal(y.nan_to_num()) for x, y in zip(a, b, strict=True)
    )


def stalled_case(steps: int, timeout: float, folder: str) -> dict:
    theirs = train(trl, [twin_reward, digit_reward], steps, f"{folder}/stall-trl")
    ours = train(
        grpo_plus, [stalled_reward, digit_reward], steps, f"{folder}/stall-ours",
        reward_workers=2, reward_timeout=timeout,
    )  # fmt: skip
    rows = []
    for step, (a, b, seconds, rewards) in enumerate(
        zip(theirs["step_time"], ours["step_time"], ours["seconds"], ours["rewards"], strict=True)
    ):
        stalled = int(rewards[:, 0].isnan().sum())
        rows.append(dict(
            step=step + 1, stalled_completions=stalled, step_time_trl=a, step_time_ours=b, reward_seconds_ours=seconds,
            overhead_over_timeout=(b - a) / timeout, reward_seconds_over_timeout=seconds / timeout,
        ))  # fmt: skip
    met = [row for row in rows if row["stalled_completions"]]
    return dict(
        timeout=timeout, steps=rows, rewards_equal=same(theirs["rewards"], ours["rewards"]),
        max_overhead_over_timeout=max((r["overhead_over_timeout"] for r in met), default=None),
        median_overhead_over_timeout=statistics.median(r["overhead_over_timeout"] for r in met) if met else None,
        max_reward_seconds_over_timeout=max((r["reward_seconds_over_timeout"] for r in met), default=None),
    )  # fmt: skip


def ratio_case(reward, steps: int, folder: str, name: str) -> dict:
    theirs = train(trl, [reward], steps, f"{folder}/{name}-trl")
    ours = train(grpo_plus, [reward], steps, f"{folder}/{name}-ours", reward_workers=2)
    after_first = slice(1, None)
    reward_trl = statistics.median(theirs["seconds"][after_first])
    reward_ours = statistics.median(ours["seconds"][after_first])
    step_trl = statistics.median(theirs["step_time"][after_first])
    step_ours = statistics.median(ours["step_time"][after_first])
    return dict(
        reward_seconds_trl=theirs["seconds"], reward_seconds_ours=ours["seconds"],
        step_time_trl=theirs["step_time"], step_time_ours=ours["step_time"],
        median_reward_seconds_trl=reward_trl, median_reward_seconds_ours=reward_ours,
        reward_ratio=reward_ours / reward_trl, step_ratio=step_ours / step_trl,
        rewards_equal=same(theirs["rewards"], ours["rewards"]),
    )  # fmt: skip


def main() -> None:
    parser = arguments(__doc__, steps=6, json=None)
    parser.add_argument("--timeout", type=float, default=2.0, help="reward_timeout of the stalled case (seconds)")
    parser.add_argument("--cpu-ms", type=float, default=50.0, help="CPU milliseconds per completion of the cpu case")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    calibrate(args.cpu_ms)
    report = dict(
        machine=dict(cpus=os.cpu_count(), loadavg_before=os.getloadavg(), python=platform.python_version(),
                     torch=torch.__version__, trl=trl.__version__),
        settings=dict(steps=args.steps, completions_per_step=8, stall_fraction=f"1/{STALL}", cpu_ms=args.cpu_ms),
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        report["stalled"] = stalled_case(args.steps, args.timeout, folder)
        print("stalled:", json.dumps({k: v for k, v in report["stalled"].items() if k != "steps"}), flush=True)
        report["cpu"] = ratio_case(cpu_reward, args.steps, folder, "cpu")
        print("cpu:", json.dumps({k: report["cpu"][k] for k in ("reward_ratio", "step_ratio", "rewards_equal")}))
        fast = ratio_case(digit_reward, args.steps, folder, "fast")
        report["fast"] = dict(
            median_ms_trl=1000 * fast["median_reward_seconds_trl"], median_ms_ours=1000 * fast["median_reward_seconds_ours"],
            rewards_equal=fast["rewards_equal"],
        )  # fmt: skip
        print("fast:", json.dumps(report["fast"]), flush=True)
    report["machine"]["loadavg_after"] = os.getloadavg()
    if args.json:
        write_report(report, args.json)
    if not (report["stalled"]["rewards_equal"] and report["cpu"]["rewards_equal"] and fast["rewards_equal"]):
        sys.exit("the runner's rewards differ from stock TRL's")


if __name__ == "__main__":
    main()
