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

Worker processes and how they start. TRL scripts often define their reward functions in a `__main__` script without
an `if __name__ == "__main__"` guard: multiprocessing's "spawn" and "forkserver" start a worker by importing that
script again (which would start a second training run in it), and need every function to pickle (no lambdas, no
closures). "fork" does neither, but forking the trainer mid-run copies a large process with threads (TRL's event
loop, tokenizers, loggers) whose locks may be held at that moment. So the runner forks once, when the trainer is
built (before TRL loads the model), a small "zygote" process that never runs anything else, and every worker, the
first ones and each replacement, is forked from that single-threaded zygote. Workers reach the reward functions as
they were in memory at that moment, by index; only the call's arguments and the rewards travel (pickled). A forked
child of a process that already ran torch's OpenMP hangs in its first parallel torch op, so a worker sets torch to one
thread before running any reward (measured here: the same child without it hangs). Workers die with the zygote
(Linux's parent-death signal, else a watchdog thread) and the zygote with the trainer (end of its socket, or its
parent gone): no process outlives the run. A reward that runs in a worker must not need the trainer's CUDA context
(a forked child cannot use it) and sees a copy of the script's state: what it changes there stays there.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import inspect
import logging
import math
import os
import pickle
import select
import signal
import socket
import struct
import sys
import threading
import time
import traceback
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from ..compat.rewards import TRL_SHARED_REWARD_KWARGS, is_async_callable, reward_call_problem
from ..compat.versions import TRLCompatibilityError
from ..run.state import StatefulPart
from ..run.validation import GuardedReward, RewardFunctionError, RewardOutputError
from ..settings import ConfigError
from .settings import RewardRunnerSettings

__all__ = ["RewardRunner", "RewardWorkerError"]

logger = logging.getLogger(__name__)

_LOGGERS = ("log_extra", "log_metric")  # TRL's logging functions: recorded in a worker, called here


class RewardWorkerError(RewardFunctionError):
    """What a reward function raised in a worker process, where that exception cannot be sent back as it is."""


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


# ---- running one piece (in a worker, or in this process) --------------------------------------------------------------


class _Recorder:
    """TRL's `log_extra` / `log_metric` inside a piece's call: the calls are kept and made in the trainer's process."""

    def __init__(self):
        self.extra, self.metrics = [], []

    def log_extra(self, column: str, values: list) -> None:
        self.extra.append((column, list(values)))

    def log_metric(self, name: str, value: float) -> None:
        self.metrics.append((name, value))


def _run_piece(
    func: Callable, name: str, kwargs: dict[str, Any], loggers: Sequence[str], run_coroutine: Callable
) -> tuple:
    """One call of `func` on a piece: ('ok', rewards, extra, metrics), ('raised', error, traceback text) or
    ('output', RewardOutputError) for an output TRL could not read (GuardedReward's check)."""
    recorder = _Recorder()
    kwargs = {**kwargs, **{key: getattr(recorder, key) for key in loggers}}
    try:
        rewards = func(**kwargs)
        if inspect.isawaitable(rewards):
            rewards = run_coroutine(rewards)
    except Exception as error:
        return "raised", error, traceback.format_exc()
    try:
        rewards = GuardedReward(func, name, warn_non_finite=False).check_output(rewards, kwargs["completions"])
    except RewardOutputError as error:
        return "output", error, ""
    if isinstance(rewards, torch.Tensor) or hasattr(rewards, "tolist"):  # a tensor or array: plain numbers
        rewards = rewards.tolist()
    return "ok", list(rewards), recorder.extra, recorder.metrics


async def _awaited(awaitable):
    return await awaitable


def _portable(error: BaseException) -> BaseException:
    """`error` if it survives pickling as itself, else a RewardWorkerError with its type and message."""
    try:
        back = pickle.loads(pickle.dumps(error))
        if type(back) is type(error) and str(back) == str(error):
            return error
    except Exception:
        pass
    return RewardWorkerError(f"{type(error).__qualname__}: {error}")


def _worker_reply(funcs: Sequence[Callable | None], message: bytes, shared_cache: dict) -> bytes:
    index, name, shared_blob, rows, loggers = pickle.loads(message)
    if shared_cache.get("blob") != shared_blob:  # the pieces of one call share it: unpickled once
        shared_cache.update(blob=shared_blob, value=pickle.loads(shared_blob))
    run_coroutine = lambda awaitable: asyncio.run(_awaited(awaitable))  # noqa: E731  (the worker's own loop)
    result = _run_piece(funcs[index], name, {**shared_cache["value"], **rows}, loggers, run_coroutine)
    if result[0] != "ok":
        result = (result[0], _portable(result[1]), result[2])
    try:
        return pickle.dumps(result)
    except Exception as error:  # e.g. rewards of a type that does not pickle
        message = f"Reward function {name!r} returned rewards that cannot be sent back from its worker: {error}"
        return pickle.dumps(("output", RewardOutputError(message), ""))


# ---- processes: the zygote and the workers forked from it -------------------------------------------------------------


def _fork() -> int:
    """os.fork, with buffered output flushed first (else the child would write it again)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with warnings.catch_warnings():  # Python 3.12+ warns about forking a process with threads: see the module doc
        warnings.simplefilter("ignore", DeprecationWarning)
        return os.fork()


def _child_signals() -> None:
    """Ctrl-C in a terminal reaches every process of its group: the trainer stops the workers itself."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _die_with_parent(parent: int) -> None:
    """End this process when `parent` ends, even while a reward function runs: Linux's parent-death signal (the
    zygote is single-threaded, so its forking thread lives as long as it does), elsewhere a watchdog thread."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
            if os.getppid() != parent:  # it ended before the signal was armed
                os._exit(0)
            return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


def _worker_main(sock: socket.socket, funcs: Sequence[Callable | None], zygote: int) -> None:
    """A worker: score the pieces it is sent until the trainer closes its connection; each piece is acknowledged
    when it arrives (an empty message: the trainer's stall clock starts then) and answered when scored. Never
    returns."""
    try:
        _child_signals()
        _die_with_parent(zygote)
        torch.set_num_threads(1)  # see the module doc: OpenMP after fork
        connection, shared_cache = Connection(sock.detach()), {}
        while True:
            try:
                message = connection.recv_bytes()
            except (EOFError, OSError):
                break
            connection.send_bytes(b"")
            connection.send_bytes(_worker_reply(funcs, message, shared_cache))
    finally:
        os._exit(0)


def _zygote_main(
    control: socket.socket, statuses: socket.socket, funcs: Sequence[Callable | None], trainer: int
) -> None:
    """The zygote: fork a worker for each b'F' it reads (answering its pid and connection), reap every worker that
    ends (its wait status sent on `statuses`, dropped when nobody reads them), end with the trainer. Never returns."""
    try:
        _child_signals()
        zygote = os.getpid()
        statuses.setblocking(False)
        while True:
            readable, _, _ = select.select([control], [], [], 0.2)
            if os.getppid() != trainer:
                break
            with contextlib.suppress(ChildProcessError):
                while (reaped := os.waitpid(-1, os.WNOHANG))[0]:
                    with contextlib.suppress(OSError):
                        statuses.send(struct.pack("qq", *reaped))
            if not readable:
                continue
            requests = control.recv(64)
            if not requests or requests.strip(b"F"):  # the trainer closed the socket (or garbage)
                break
            for _ in requests:
                ours, theirs = socket.socketpair()
                pid = _fork()
                if pid == 0:
                    control.close()
                    statuses.close()
                    ours.close()
                    _worker_main(theirs, funcs, zygote)
                theirs.close()
                socket.send_fds(control, [struct.pack("q", pid)], [ours.fileno()])
                ours.close()
    finally:
        os._exit(0)


class _Zygote:
    """The trainer's end of the zygote process: fork requests and their answers, the statuses of ended workers."""

    def __init__(self, funcs: Sequence[Callable | None]):
        control, control_child = socket.socketpair()
        statuses, statuses_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        trainer = os.getpid()
        pid = _fork()
        if pid == 0:
            control.close()
            statuses.close()
            _zygote_main(control_child, statuses_child, funcs, trainer)
        control_child.close()
        statuses_child.close()
        self.pid, self.control, self.statuses = pid, control, statuses
        self.ended: dict[int, int] = {}  # pid -> wait status (the last 1000)

    def request(self, count: int) -> None:
        """Ask for `count` more workers (answered by `receive`)."""
        self.control.sendall(b"F" * count)

    def receive(self) -> tuple[int, Connection]:
        """The next forked worker: its pid and connection (blocks until the zygote answers)."""
        data, fds, _, _ = socket.recv_fds(self.control, 8, 1)
        if len(data) != 8 or len(fds) != 1:
            raise EOFError("the reward runner's zygote process ended")
        return struct.unpack("q", data)[0], Connection(fds[0])

    def status(self, pid: int, timeout: float) -> int | None:
        """The wait status of worker `pid`, which has ended, if the zygote reports it within `timeout` seconds."""
        end = time.monotonic() + timeout
        while pid not in self.ended:
            left = end - time.monotonic()
            if left <= 0 or not select.select([self.statuses], [], [], left)[0]:
                return None
            with contextlib.suppress(OSError):
                reaped, status = struct.unpack("qq", self.statuses.recv(16))
                self.ended[reaped] = status
                if len(self.ended) > 1000:
                    del self.ended[next(iter(self.ended))]
        return self.ended.pop(pid)

    def close(self) -> None:
        for sock in (self.control, self.statuses):
            with contextlib.suppress(OSError):
                sock.close()  # the zygote reads the end of its socket and exits; its workers die with it
        for _ in range(50):
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(self.pid, os.WNOHANG)[0] != 0:
                    return
            time.sleep(0.01)
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)


@dataclass(eq=False)
class _Worker:
    pid: int
    connection: Connection


class _Pool:
    """`size` worker processes forked from one zygote; a worker that ends or is stopped is replaced. Forks are asked
    for without waiting (under load a fork of a large process can take seconds): `workers` holds those that arrived."""

    def __init__(self, funcs: Sequence[Callable | None], size: int):
        self.funcs, self.size, self.owner = funcs, size, os.getpid()
        self.zygote = _Zygote(funcs)
        self.workers: list[_Worker] = []
        self.forking = 0  # forks asked for and not yet received

    def replenish(self, wait_for_all: bool = False) -> None:
        """Ask for the workers missing and take those that arrived (with `wait_for_all`, wait until all have)."""
        try:
            if missing := self.size - len(self.workers) - self.forking:
                self.zygote.request(missing)
                self.forking += missing
            while self.forking and (wait_for_all or select.select([self.zygote.control], [], [], 0)[0]):
                self.workers.append(_Worker(*self.zygote.receive()))
                self.forking -= 1
        except (OSError, EOFError):  # the zygote itself ended (out of memory, killed): start another
            logger.warning("The reward runner's zygote process ended; forking a new one from the trainer.")
            self.zygote.close()
            self.zygote, self.forking = _Zygote(self.funcs), 0
            self.replenish(wait_for_all)

    def retire(self, worker: _Worker) -> None:
        """Remove `worker`, killing it if it still runs (the zygote reaps it)."""
        self.workers.remove(worker)
        with contextlib.suppress(OSError):
            worker.connection.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker.pid, signal.SIGKILL)

    def stop_workers(self) -> None:
        for worker in list(self.workers):
            self.retire(worker)

    def close(self) -> None:
        if os.getpid() != self.owner:  # a forked copy of the trainer exiting (it inherited the finalizer): not ours
            return
        self.stop_workers()
        self.zygote.close()


def _describe_status(status: int | None) -> str:
    if status is None or status < 0:
        return "ended"
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        with contextlib.suppress(ValueError):
            return f"killed by signal {number} ({signal.Signals(number).name})"
        return f"killed by signal {number}"
    if os.WIFEXITED(status):
        return f"exit status {os.WEXITSTATUS(status)}"
    return "ended"


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
            self._pool = _Pool(self.funcs, settings.workers)
            self._pool.replenish(wait_for_all=True)
        self._close = weakref.finalize(self, _Pool.close, self._pool) if self._pool else (lambda: None)
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
            run_coroutine = lambda c: asyncio.run(_awaited(c))  # noqa: E731
        else:
            run_coroutine = lambda c: asyncio.run_coroutine_threadsafe(_awaited(c), loop).result()  # noqa: E731
        out, stack = _Outcome.empty(call.n), [tuple(range(call.n))]
        loggers = tuple(call.loggers)
        while stack:
            rows = stack.pop()
            result = _run_piece(reward.func, reward.__name__, call.piece(rows), loggers, run_coroutine)
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
        running: dict[_Worker, list] = {}  # worker -> [rows, when it acknowledged the piece (None before)]
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

    def _send(self, reward: RunnerReward, call: _Call, shared_blob: bytes, worker: _Worker, rows: tuple) -> bool:
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
                    detail = _describe_status(self._pool.zygote.status(detail, timeout=1.0))
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
