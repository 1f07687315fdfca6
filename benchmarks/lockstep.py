"""Lock-step alternation of trainers in one process, for benchmarks that compare them step by step.

Each trainer trains in its own thread; a Baton lets one run at a time and hands over after every optimizer step, so
both see the same machine load within a step of each other. RngStates swaps each thread's random state in and out,
so every trainer draws the random numbers it would draw alone (same seed, same completions). The command line and
the report file of those benchmarks (`lockstep_arguments`, `start_report`, `write_report`) are shared here too.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import threading
import time
from pathlib import Path

import numpy as np
import torch
from transformers import TrainerCallback


class Baton:
    """Lets one named thread run at a time, handing over in a fixed rotation; finished threads drop out."""

    def __init__(self, order):
        self.order, self.active, self.turn = list(order), set(order), order[0]
        self.cond = threading.Condition()

    def wait(self, name: str) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.turn == name)

    def pass_on(self, name: str, finished: bool = False) -> None:
        with self.cond:
            if finished:
                self.active.discard(name)
            i = self.order.index(name)
            rotation = self.order[i + 1 :] + self.order[: i + 1]
            self.turn = next((n for n in rotation if n in self.active), None)
            self.cond.notify_all()


class RngStates:
    """Per-name snapshots of torch (CPU and CUDA), Python and NumPy random states."""

    def __init__(self, cuda: bool = False):
        self.cuda, self.states = cuda, {}

    def save(self, name: str) -> None:
        cuda = torch.cuda.get_rng_state_all() if self.cuda else None
        self.states[name] = (torch.get_rng_state(), random.getstate(), np.random.get_state(), cuda)

    def restore(self, name: str) -> None:
        cpu, python, numpy_state, cuda = self.states[name]
        torch.set_rng_state(cpu)
        random.setstate(python)
        np.random.set_state(numpy_state)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


class StepTimer(TrainerCallback):
    """Times each optimizer step of trainer `name` (on_step_begin -> on_step_end, into `step`), then hands the baton
    on, its random state saved and restored when its turn comes back."""

    def __init__(self, name: str, baton: Baton, rng: RngStates):
        self.name, self.baton, self.rng, self.step, self.start = name, baton, rng, [], 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.step.append(time.perf_counter() - self.start)
        self.rng.save(self.name)
        self.baton.pass_on(self.name)
        self.baton.wait(self.name)
        self.rng.restore(self.name)


def run_threads(targets: dict) -> None:
    """Run each callable of `targets` (name -> callable) in its own thread; re-raise the first error here."""
    errors: list[BaseException] = []

    def guarded(target):
        try:
            target()
        except BaseException as error:  # re-raised from the calling thread
            errors.append(error)

    threads = [threading.Thread(target=guarded, args=(target,)) for target in targets.values()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def train_in_lockstep(trainers: dict, baton: Baton, seed: int = 0) -> None:
    """Train each trainer (name -> trainer) in its own thread, from `seed`, one at a time in `baton`'s rotation (its
    trainers' callbacks pass the baton on after every optimizer step)."""
    from transformers import set_seed

    def train(name):
        try:
            baton.wait(name)
            set_seed(seed)
            trainers[name].train()
        finally:
            baton.pass_on(name, finished=True)

    run_threads({name: functools.partial(train, name) for name in trainers})


def lockstep_arguments(description: str, steps: int, repeats: int, json_path: Path) -> argparse.ArgumentParser:
    """The options of a benchmark whose part 1 trains in lock-step and whose later parts repeat timed cases."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=steps, help="optimizer steps of each trainer in part 1")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    parser.add_argument("--repeats", type=int, default=repeats, help="timed repeats per case after part 1")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: stable on a shared box)")
    parser.add_argument("--skip-steps", action="store_true", help="one step in part 1, not reported (fresh trainers)")
    parser.add_argument("--skip-sweep", action="store_true")
    parser.add_argument("--json", default=str(json_path))
    return parser


def start_report(args: argparse.Namespace) -> tuple[dict, float]:
    """Set the intra-op threads and quiet transformers; (the report with the versions, the perf_counter start)."""
    import transformers

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    report = {"threads": args.threads, "torch": torch.__version__, "transformers": transformers.__version__}
    return report, time.perf_counter()


def write_report(report: dict, started: float, path: str) -> None:
    """Add the wall time since `started` (perf_counter) to `report`, write it as JSON to `path`, say where."""
    report["wall_minutes"] = (time.perf_counter() - started) / 60
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=1))
    print(f"\nwall time {report['wall_minutes']:.1f} min; results in {path}")
