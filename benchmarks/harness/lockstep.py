"""Lock-step alternation of trainers in one process, for benchmarks that compare them step by step.

Each trainer trains in its own thread; a Baton lets one run at a time and hands over after every optimizer step, so
both see the same machine load within a step of each other. RngStates swaps each thread's random state in and out,
so every trainer draws the random numbers it would draw alone (same seed, same completions). The trainers' step
timers (harness.timing.StepTimer) pass the baton on after every optimizer step.
"""

from __future__ import annotations

import functools
import random
import threading

import numpy as np
import torch


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
