"""Timing shared by the benchmarks: each optimizer step (and, in lock-step, the hand-over after it), a trainer's
methods, the forwards inside generation, and timed repeats in alternating order."""

from __future__ import annotations

import math
import time

from transformers import TrainerCallback


class StepTimer(TrainerCallback):
    """Times each optimizer step of a trainer, on_step_begin -> on_step_end, by the wall clock (`step`) and by the
    calling thread's CPU time (`cpu`: the work its thread did, whatever else holds the cores; with torch on one
    intra-op thread that is all of a step's compute); `sync` (e.g. torch.cuda.synchronize) runs before each reading.
    In lock-step (a harness.lockstep Baton and RngStates), it then hands the baton on, its trainer's random state
    saved, and restores that state when the trainer's turn comes back."""

    def __init__(self, name: str | None = None, baton=None, rng=None, sync=None):
        self.name, self.baton, self.rng, self.sync = name, baton, rng, sync
        self.step: list[float] = []
        self.cpu: list[float] = []
        self._started = (0.0, 0.0)

    def on_step_begin(self, args, state, control, **kwargs):
        if self.sync is not None:
            self.sync()
        self._started = (time.perf_counter(), time.thread_time())

    def on_step_end(self, args, state, control, **kwargs):
        if self.sync is not None:
            self.sync()
        wall, cpu = self._started
        self.step.append(time.perf_counter() - wall)
        self.cpu.append(time.thread_time() - cpu)
        if self.baton is not None:
            self.rng.save(self.name)
            self.baton.pass_on(self.name)
            self.baton.wait(self.name)
            self.rng.restore(self.name)


def alternating(names, repeats: int):
    """(repeat, name) for `repeats` rounds over `names`, every second round in reverse order, so that drift in the
    machine's load hits every contestant alike."""
    names = tuple(names)
    for repeat in range(repeats):
        for name in names if repeat % 2 == 0 else names[::-1]:
            yield repeat, name


def wrap_timed(trainer, method: str, seconds: list[float], clock=time.perf_counter) -> None:
    """Record the time of every call of `trainer.<method>` by `clock` (wall time by default; `time.thread_time`: the
    calling thread's CPU time). `_prepare_inputs`: generation and scoring, when a batch is generated."""
    original = getattr(trainer, method)

    def timed(*args, **kwargs):
        start = clock()
        try:
            return original(*args, **kwargs)
        finally:
            seconds.append(clock() - start)

    setattr(trainer, method, timed)


class ForwardTimer:
    """Times every forward of a causal LM (its base model under PEFT): (input shape, seconds) per call, by `clock`
    (wall time by default; `time.thread_time`: the calling thread's CPU time)."""

    def __init__(self, model, clock=time.perf_counter):
        self.calls: list[tuple[tuple[int, ...], float]] = []
        self.clock = clock
        self.model = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.handles = [
            self.model.register_forward_pre_hook(self._start, with_kwargs=True),
            self.model.register_forward_hook(self._stop, with_kwargs=True),
        ]

    def _start(self, module, args, kwargs):
        self.shape = tuple(kwargs.get("input_ids", args[0] if args else None).shape)
        self.started = self.clock()

    def _stop(self, module, args, kwargs, output):
        self.calls.append((self.shape, self.clock() - self.started))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def instrument_generation(trainer, timer: ForwardTimer, eos_token_ids, record: list[dict]) -> None:
    """Record every `_generate_single_turn` call: its time, its model forwards (prefill, decode steps) and their
    positions, the completion ids, and the decode time spent on rows that had already ended (times by `timer.clock`)."""
    original = trainer._generate_single_turn

    def timed(prompt_ids, *args, **kwargs):
        calls_before = len(timer.calls)
        start = timer.clock()
        completion_ids, logprobs = original(prompt_ids, *args, **kwargs)
        seconds = timer.clock() - start
        (prefill_shape, prefill), *decode = timer.calls[calls_before:]
        lengths = [next((i + 1 for i, t in enumerate(ids) if t in eos_token_ids), len(ids)) for ids in completion_ids]
        rows = len(completion_ids)
        record.append(
            dict(
                seconds=seconds,
                positions=math.prod(prefill_shape) + sum(math.prod(shape) for shape, _ in decode),
                completion_ids=completion_ids,
                prefill=prefill,
                prefill_positions=math.prod(prefill_shape),
                decode=sum(step_seconds for _, step_seconds in decode),
                decode_positions=sum(math.prod(shape) for shape, _ in decode),
                # a decode step's time shared out over the rows TRL computes: the share of rows that had ended
                finished_rows=sum(
                    step_seconds * sum(length <= step for length in lengths) / rows
                    for step, (shape, step_seconds) in enumerate(decode, start=1)
                    if shape[0] == rows
                ),
                other=seconds - prefill - sum(step_seconds for _, step_seconds in decode),
                steps=len(decode),
            )
        )
        return completion_ids, logprobs

    trainer._generate_single_turn = timed
