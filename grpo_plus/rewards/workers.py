"""The reward runner's processes (grpo_plus.rewards.runner schedules the calls): one piece of a call run in a worker
process (or in the trainer's), the zygote every worker is forked from, the pool of workers.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from ..run.validation import GuardedReward, RewardFunctionError, RewardOutputError

__all__ = ["Pool", "RewardWorkerError", "Worker", "awaited", "describe_status", "run_piece"]

logger = logging.getLogger(__name__)


class RewardWorkerError(RewardFunctionError):
    """What a reward function raised in a worker process, where that exception cannot be sent back as it is."""


# ---- running one piece (in a worker, or in this process) --------------------------------------------------------------


class _Recorder:
    """TRL's `log_extra` / `log_metric` inside a piece's call: the calls are kept and made in the trainer's process."""

    def __init__(self):
        self.extra, self.metrics = [], []

    def log_extra(self, column: str, values: list) -> None:
        self.extra.append((column, list(values)))

    def log_metric(self, name: str, value: float) -> None:
        self.metrics.append((name, value))


def run_piece(
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


async def awaited(awaitable):
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
    run_coroutine = lambda awaitable: asyncio.run(awaited(awaitable))  # noqa: E731  (the worker's own loop)
    result = run_piece(funcs[index], name, {**shared_cache["value"], **rows}, loggers, run_coroutine)
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
class Worker:
    """A worker process forked from the zygote: its pid, and the trainer's end of its connection."""

    pid: int
    connection: Connection


class Pool:
    """`size` worker processes forked from one zygote; a worker that ends or is stopped is replaced. Forks are asked
    for without waiting (under load a fork of a large process can take seconds): `workers` holds those that arrived."""

    def __init__(self, funcs: Sequence[Callable | None], size: int):
        self.funcs, self.size, self.owner = funcs, size, os.getpid()
        self.zygote = _Zygote(funcs)
        self.workers: list[Worker] = []
        self.forking = 0  # forks asked for and not yet received

    def replenish(self, wait_for_all: bool = False) -> None:
        """Ask for the workers missing and take those that arrived (with `wait_for_all`, wait until all have)."""
        try:
            if missing := self.size - len(self.workers) - self.forking:
                self.zygote.request(missing)
                self.forking += missing
            while self.forking and (wait_for_all or select.select([self.zygote.control], [], [], 0)[0]):
                self.workers.append(Worker(*self.zygote.receive()))
                self.forking -= 1
        except (OSError, EOFError):  # the zygote itself ended (out of memory, killed): start another
            logger.warning("The reward runner's zygote process ended; forking a new one from the trainer.")
            self.zygote.close()
            self.zygote, self.forking = _Zygote(self.funcs), 0
            self.replenish(wait_for_all)

    def retire(self, worker: Worker) -> None:
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


def describe_status(status: int | None) -> str:
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
