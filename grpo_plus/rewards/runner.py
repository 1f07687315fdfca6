"""The reward runner: the user's reward functions called with a deadline, in worker processes, each failure narrowed
down to the completions that caused it.

TRL calls every reward function in the trainer's process, one after the other, with no timeout: a verifier that
stalls on one completion hangs the run, one that segfaults or calls `os._exit` ends it. With `reward_workers=N`
each call TRL makes (`reward_func(prompts=..., completions=..., ...)`) is split into N pieces of consecutive
completions, scored at once by N worker processes; the rewards come back in order, as TRL's call would return them.
A piece that raises (with `reward_on_error="none"`) or ends its process is split in halves and scored again until
the completions that fail are alone; a piece still running long after its siblings finished is stopped and split the
same way, so one stalled completion is found while the deadline (`reward_timeout`, for the whole call) runs. What is
not back by the deadline gets None, as does every completion that failed: TRL's "no reward for this row", so the
other reward functions still count for it.

Splitting assumes what TRL's contract already says: a reward function returns one reward per completion, computed
from that completion and its own row (prompt, dataset columns). A function that scores a completion against the
others of its batch is named in `reward_whole_batch`: it is called on the whole batch in one worker, and a failure
gives every completion of the call None.

How the worker processes start and end with the trainer, and what a reward function that runs in one may not do:
grpo_plus.rewards.workers, the processes under this scheduling (one piece run, the zygote, the pool).
"""

from __future__ import annotations

import asyncio
import logging
import math
import pickle
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

import torch

from ..compat.rewards import TRL_SHARED_REWARD_KWARGS, is_async_callable, reward_call_problem
from ..compat.versions import TRLCompatibilityError
from ..run.state import StatefulPart
from ..run.validation import GuardedReward, RewardFunctionError
from ..settings import ConfigError
from .settings import RewardRunnerSettings
from .workers import Pool, RewardWorkerError, Worker, awaited, describe_status, run_piece

__all__ = ["RewardRunner", "RewardWorkerError"]

logger = logging.getLogger(__name__)

_LOGGERS = ("log_extra", "log_metric")  # TRL's logging functions: recorded in a worker, called here


# ---- one call: its arguments, and what is known of each completion ---------------------------------------------------


@dataclass
class _Call:
    """TRL's keyword arguments for one reward call, split into those with one item per completion and the rest."""

    n: int
    rows: dict[str, list]
    shared: dict[str, Any]
    loggers: dict[str, Callable]  # TRL's log_extra / log_metric: called in this process with what pieces recorded

    @classmethod
    def of(cls, kwargs: dict[str, Any]) -> _Call:
        n = len(kwargs["completions"])
        rows, shared, loggers = {}, {}, {}
        for key, value in kwargs.items():
            if key in _LOGGERS:
                loggers[key] = value
            elif key not in TRL_SHARED_REWARD_KWARGS and isinstance(value, (list, tuple)) and len(value) == n:
                rows[key] = list(value)
            else:
                shared[key] = value
        return cls(n, rows, shared, loggers)

    def piece(self, rows: Sequence[int]) -> dict[str, Any]:
        """The keyword arguments of a call on `rows` only (without the loggers)."""
        return {**self.shared, **{key: [values[i] for i in rows] for key, values in self.rows.items()}}


@dataclass
class _Outcome:
    """Per completion: its reward (or None) and what happened ('ok', 'timeout', 'error', 'crash'); the logging calls of
    the pieces that succeeded; the first failure of each kind, for the warning."""

    values: list
    status: list
    logs: list = field(default_factory=list)  # (rows, extra, metrics) per successful piece
    first: dict = field(default_factory=dict)  # kind -> (row, detail)

    @classmethod
    def empty(cls, n: int) -> _Outcome:
        return cls([None] * n, [None] * n)

    def succeed(self, rows: Sequence[int], values: list, extra: list, metrics: list) -> None:
        for row, value in zip(rows, values, strict=True):
            self.values[row], self.status[row] = value, "ok"
        self.logs.append((tuple(rows), extra, metrics))

    def fail(self, rows: Sequence[int], kind: str, detail: str) -> None:
        for row in rows:
            self.status[row] = kind
        self.first.setdefault(kind, (rows[0], detail))

    def count(self, *kinds: str) -> int:
        return sum(status in kinds for status in self.status)


# ---- the runner -------------------------------------------------------------------------------------------------------


def runnable_reward_funcs(reward_funcs: Any) -> list[Callable | None]:
    """The reward functions as given to the trainer, in TRL's order: each plain callable (sync or async), None for a
    reward model (a model id or an nn.Module), which TRL scores itself."""
    funcs = [] if reward_funcs is None else reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
    return [f if callable(f) and not isinstance(f, (str, torch.nn.Module)) else None for f in funcs]


class RewardRunner:
    """Scores the user's reward functions as `RewardRunnerSettings` say (grpo_plus/rewards/runner.py's doc).

    Built with the reward functions as passed to the trainer, before TRL loads the model (the worker processes fork
    from a small process); `wrap` then replaces those functions in TRL's list with callables TRL calls as before.
    Environment-owned rewards and reward models stay TRL's. Not thread-safe across calls: calls are serialized."""

    def __init__(self, settings: RewardRunnerSettings, reward_funcs: Any):
        self.settings = settings
        self.funcs = runnable_reward_funcs(reward_funcs) if settings.enabled else []
        self._pool = None
        if settings.workers and any(f is not None for f in self.funcs):
            if (problem := reward_call_problem()) is not None:
                raise TRLCompatibilityError(f"reward_workers cannot be used: {problem}.")
            self._pool = Pool(self.funcs, settings.workers)
            self._pool.replenish(wait_for_all=True)
        self._close = weakref.finalize(self, Pool.close, self._pool) if self._pool else (lambda: None)
        self._lock = threading.Lock()
        self._stats: dict[str, list[float]] = {}  # name -> [timeouts, errors, seconds] since the last take_metrics
        self._warned: set[tuple[str, str]] = set()

    def wrap(self, reward_funcs: list, names: Sequence[str]) -> list:
        """TRL's list of reward functions with the user's replaced by their runner-scored stand-ins."""
        unknown = sorted(set(self.settings.whole_batch) - set(names))
        if unknown:
            raise ConfigError(
                f"reward_whole_batch names {unknown}, which are not reward functions of this trainer: {list(names)}."
            )
        wrapped = list(reward_funcs)
        for index, func in enumerate(self.funcs):
            if func is None:
                continue
            if self._pool is not None and isinstance(func, StatefulPart):
                raise ConfigError(
                    f"reward_workers={self.settings.workers}: reward function {names[index]!r} keeps training state "
                    "that checkpoints save (a grpo_plus StatefulPart); in a worker process a copy of it would score, "
                    "and its state would never reach the checkpoint. Set reward_workers=0."
                )
            stand_in = AsyncRunnerReward if is_async_callable(func) else RunnerReward
            wrapped[index] = stand_in(self, index, func, names[index])
        return wrapped

    # ---- scoring ------------------------------------------------------------------------------------------------

    def score(self, reward: RunnerReward, kwargs: dict[str, Any], loop: asyncio.AbstractEventLoop | None = None):
        """What `reward`'s function returns for TRL's call with `kwargs`, None for the completions it failed on."""
        with self._lock:
            start = time.monotonic()
            call = _Call.of(kwargs)
            if self._pool is not None:
                outcome = self._score_in_pool(reward, call)
            else:
                outcome = self._score_here(reward, call, loop)
            self._record(reward.__name__, call, outcome, time.monotonic() - start)
        return reward.guard.check_output(outcome.values, kwargs["completions"])

    def _pieces(self, reward: RunnerReward, n: int, count: int) -> list[tuple[int, ...]]:
        """`count` runs of consecutive completions (one for a whole-batch function), as even as can be."""
        count = 1 if reward.__name__ in self.settings.whole_batch else max(1, min(count, n))
        bounds = [round(i * n / count) for i in range(count + 1)]
        return [tuple(range(a, b)) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]

    def _settle(self, reward: RunnerReward, call: _Call, rows: tuple, result: tuple, out: _Outcome) -> list[tuple]:
        """Record a piece's result; the pieces to score next (its halves, when it failed on more than one)."""
        kind = result[0]
        if kind == "ok":
            out.succeed(rows, result[1], result[2], result[3])
            return []
        if kind in ("raised", "output") and self.settings.on_error == "raise":
            raise self._error_to_raise(reward, call, rows, result)
        splittable = len(rows) > 1 and reward.__name__ not in self.settings.whole_batch
        if splittable:
            half = len(rows) // 2
            return [rows[:half], rows[half:]]
        detail = result[1] if kind == "crash" else f"{type(result[1]).__name__}: {result[1]}"  # a crash: its pid
        out.fail(rows, "crash" if kind == "crash" else "error", detail)
        return []

    def _error_to_raise(self, reward: RunnerReward, call: _Call, rows: tuple, result: tuple) -> Exception:
        """What the call raises for reward_on_error='raise': the function's own exception, as GuardedReward raises
        it (its type and RewardFunctionError, a note naming the piece's first completion), with the worker's
        traceback as a further note."""
        kind, error, text = result
        if kind == "output":
            return error
        error = reward.guard.failure(error, call.piece(rows))
        if text and self._pool is not None:
            error.add_note(f"In the reward worker process:\n{text.rstrip()}")
        return error

    def _score_here(self, reward: RunnerReward, call: _Call, loop: asyncio.AbstractEventLoop | None) -> _Outcome:
        """reward_workers=0 (reward_on_error='none'): the call as TRL makes it, in this process; on an exception,
        halves called again until the completions that raise are alone. An async function runs on TRL's loop."""
        if loop is None:
            run_coroutine = lambda c: asyncio.run(awaited(c))  # noqa: E731
        else:
            run_coroutine = lambda c: asyncio.run_coroutine_threadsafe(awaited(c), loop).result()  # noqa: E731
        out, stack = _Outcome.empty(call.n), [tuple(range(call.n))]
        loggers = tuple(call.loggers)
        while stack:
            rows = stack.pop()
            result = run_piece(reward.func, reward.__name__, call.piece(rows), loggers, run_coroutine)
            stack.extend(reversed(self._settle(reward, call, rows, result, out)))
        return out

    def _score_in_pool(self, reward: RunnerReward, call: _Call) -> _Outcome:
        """The call split across the workers under one deadline; failed and stalled pieces narrowed down in halves
        (see the module doc)."""
        pool, settings = self._pool, self.settings
        out = _Outcome.empty(call.n)
        try:
            shared_blob = pickle.dumps(call.shared)
        except Exception as error:
            raise _unsendable(reward, "its arguments", error) from error
        queue = deque(self._pieces(reward, call.n, settings.workers))
        deadline = None if settings.timeout is None else time.monotonic() + settings.timeout
        narrow_stalls = deadline is not None and reward.__name__ not in settings.whole_batch
        running: dict[Worker, list] = {}  # worker -> [rows, when it acknowledged the piece (None before)]
        preempted: set[tuple] = set()  # single completions stopped once to let waiting pieces run
        try:
            while queue or running:
                pool.replenish()
                if deadline is not None and time.monotonic() >= deadline:
                    break
                for worker in [w for w in pool.workers if w not in running]:
                    if not queue:
                        break
                    rows = queue.popleft()
                    if self._send(reward, call, shared_blob, worker, rows):
                        running[worker] = [rows, None]
                    else:
                        queue.appendleft(rows)
                waits = [] if deadline is None else [deadline]
                if narrow_stalls:
                    waits += [
                        _stall_time(rows, began, deadline)
                        for rows, began in running.values()
                        if began and (len(rows) > 1 or (queue and rows not in preempted))
                    ]
                timeout = None if not waits else max(0.0, min(waits) - time.monotonic())
                watched = [w.connection for w in running] + ([pool.zygote.control] if pool.forking else [])
                ready = wait(watched, timeout)
                for worker in [w for w in running if w.connection in ready]:
                    try:
                        reply = worker.connection.recv_bytes()
                    except (EOFError, OSError):  # the worker ended: os._exit, a signal, out of memory
                        rows, _ = running.pop(worker)
                        pool.retire(worker)
                        result = ("crash", worker.pid, "")
                    else:
                        if not reply:  # the acknowledgement: the worker began the piece
                            running[worker][1] = time.monotonic()
                            continue
                        rows, _ = running.pop(worker)
                        result = pickle.loads(reply)
                    queue.extendleft(reversed(self._settle(reward, call, rows, result, out)))
                if narrow_stalls:
                    self._stop_stalled(running, queue, preempted, deadline)
        except BaseException:
            for worker in running:  # an exception to raise (or Ctrl-C): leave no worker busy with this call
                pool.retire(worker)
            raise
        for worker, (rows, _) in running.items():  # the deadline: what is still running timed out
            pool.retire(worker)
            out.fail(rows, "timeout", f"{settings.timeout:g} s")
        for rows in queue:
            out.fail(rows, "timeout", f"{settings.timeout:g} s")
        pool.replenish()
        return out

    def _stop_stalled(self, running: dict, queue: deque, preempted: set, deadline: float) -> None:
        """Stop the pieces past their share of the time left (`_stall_time`): a piece of several completions is split
        in halves, scored next; a single completion, when pieces wait for a worker and none is being forked, goes
        to the back of the queue, once (so that a few stalled completions cannot hold every worker while the others
        wait; run again, it may take until the deadline)."""
        now = time.monotonic()
        for worker, (rows, began) in list(running.items()):
            if not began or now < _stall_time(rows, began, deadline):
                continue
            if len(rows) > 1:
                half = len(rows) // 2
                queue.extendleft([rows[half:], rows[:half]])
            elif queue and not self._pool.forking and rows not in preempted:
                preempted.add(rows)
                queue.append(rows)
            else:
                continue
            del running[worker]
            self._pool.retire(worker)

    def _send(self, reward: RunnerReward, call: _Call, shared_blob: bytes, worker: Worker, rows: tuple) -> bool:
        """Send a piece to an idle worker; False (the worker retired) if it had ended meanwhile."""
        try:
            message = pickle.dumps((reward.index, reward.__name__, shared_blob, call.piece(rows), tuple(call.loggers)))
        except Exception as error:
            raise _unsendable(reward, "its per-completion arguments", error) from error
        try:
            worker.connection.send_bytes(message)
            return True
        except OSError:
            self._pool.retire(worker)
            return False

    # ---- what a call leaves: TRL's logging calls, the metrics, the warnings -------------------------------------

    def _record(self, name: str, call: _Call, out: _Outcome, seconds: float) -> None:
        extra: dict[str, list] = {}
        for rows, columns, metrics in out.logs:
            for column, values in columns:
                filled = extra.setdefault(column, [None] * call.n)
                for row, value in zip(rows, values, strict=False):  # a short list fills what it has
                    filled[row] = value
            if "log_metric" in call.loggers:
                for metric, value in metrics:
                    call.loggers["log_metric"](metric, value)
        if "log_extra" in call.loggers:
            for column, values in extra.items():
                call.loggers["log_extra"](column, values)
        stats = self._stats.setdefault(name, [0.0, 0.0, 0.0])
        stats[0] += out.count("timeout")
        stats[1] += out.count("error", "crash")
        stats[2] += seconds
        for kind, (row, detail) in out.first.items():
            if (name, kind) not in self._warned:
                self._warned.add((name, kind))
                if kind == "crash":  # how the worker ended, as the zygote reaped it
                    detail = describe_status(self._pool.zygote.status(detail, timeout=1.0))
                logger.warning(_warning(name, kind, detail, call, row, out.count(kind)))

    def take_metrics(self) -> dict[str, float]:
        """`rewards/<name>/timeouts` and `/errors` (completions given None, per function) and `/seconds` (time in the
        function's calls) since the last take."""
        metrics = {}
        for name, (timeouts, errors, seconds) in self._stats.items():
            metrics[f"rewards/{name}/timeouts"] = timeouts
            metrics[f"rewards/{name}/errors"] = errors
            metrics[f"rewards/{name}/seconds"] = seconds
        self._stats.clear()
        return metrics

    def log_metrics(self, sink: dict[str, list], gather: Callable, device: torch.device) -> None:
        """Append `take_metrics` of every process (`gathered_metrics`) to TRL's metric lists `sink`."""
        for key, value in gathered_metrics(self.take_metrics(), gather, device).items():
            sink[key].append(value)

    def stop_workers(self) -> None:
        """End the worker processes (at the end of training); a later call forks new ones from the zygote."""
        if self._pool is not None:
            with self._lock:
                self._pool.stop_workers()

    def close(self) -> None:
        """End every process of the runner (also done when the runner is garbage-collected or Python exits)."""
        self._close()

    @property
    def worker_pids(self) -> list[int]:
        """The worker processes' ids, and the zygote's last (for tests and tools that watch processes)."""
        return [] if self._pool is None else [w.pid for w in self._pool.workers] + [self._pool.zygote.pid]


def _stall_time(rows: tuple, began: float, deadline: float) -> float:
    """When a piece of `rows` that its worker began at `began` counts as stalled: after its share of the time left,
    one share per halving still needed to reach single completions plus one for the last piece, so that narrowing
    one stalled completion down ends by the deadline (when each piece takes less than its share); a single
    completion's share is half the time left: began + (deadline - began) / max(2, ceil(log2(len(rows))) + 1)."""
    return began + (deadline - began) / max(2, math.ceil(math.log2(len(rows))) + 1)


def gathered_metrics(metrics: dict[str, float], gather: Callable, device: torch.device) -> dict[str, float]:
    """`RewardRunner.take_metrics` of every process (`gather`: the accelerator's; every process calls the same reward
    functions, so each holds the same keys): completions counted over all processes, seconds the slowest one's."""
    if not metrics:
        return {}
    local = torch.tensor([list(metrics.values())], dtype=torch.float32, device=device)
    every = gather(local).view(-1, len(metrics))
    return {
        key: (every[:, i].max() if key.endswith("/seconds") else every[:, i].sum()).item()
        for i, key in enumerate(metrics)
    }


def _unsendable(reward: RunnerReward, what: str, error: Exception) -> RewardFunctionError:
    return RewardFunctionError(
        f"Reward function {reward.__name__!r}: {what} cannot be sent to a reward worker process ({error}). "
        "Pass picklable values (dataset columns, environments), or set reward_workers=0."
    )


def _warning(name: str, kind: str, detail: str, call: _Call, row: int, count: int) -> str:
    completion = call.rows["completions"][row]
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        completion = completion[-1].get("content", completion)
    text = str(completion)
    text = repr(text[:120] + ("..." if len(text) > 120 else ""))
    what = {
        "timeout": f"did not return within reward_timeout={detail}",
        "error": f"raised {detail}",
        "crash": f"ended its worker process ({detail})",
    }[kind]
    metric = "timeouts" if kind == "timeout" else "errors"
    return (
        f"Reward function {name!r} {what} on completion {text} (row {row} of {call.n}; {count} completion(s) of this "
        f"call): they get no reward (None), the other reward functions still count. rewards/{name}/{metric} counts "
        "them; said once per function."
    )


class RunnerReward:
    """A user reward function as TRL sees it under the runner: called like the function, scored by the runner. A call
    that is not TRL's scoring call (no `completions` keyword) runs the function in this process, as GuardedReward."""

    def __init__(self, runner: RewardRunner, index: int, func: Callable, name: str):
        self.runner, self.index, self.func, self.__wrapped__, self.__name__ = runner, index, func, func, name
        self.guard = GuardedReward(func, name)  # the trainer's output check and error notes, in this process

    def __call__(self, *args, **kwargs):
        if args or "completions" not in kwargs:
            return self.guard(*args, **kwargs)
        return self.runner.score(self, kwargs)


class AsyncRunnerReward(RunnerReward):
    """An async reward function under the runner: TRL awaits it on its event loop, where it waits for the runner in a
    thread (the loop keeps running); in a worker the coroutine runs on the worker's own loop."""

    async def __call__(self, *args, **kwargs):
        if args or "completions" not in kwargs:
            return await self.func(*args, **kwargs)
        return await asyncio.to_thread(self.runner.score, self, kwargs, asyncio.get_running_loop())
