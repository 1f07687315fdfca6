"""The helper process behind `grpo_plus.rewards.accuracy_reward` off the main thread: it calls TRL's `accuracy_reward`
one row at a time on its own main thread, where math-verify's signal-based timeouts work.

Run by path (`python _main_thread_worker.py module:function`), not as part of the package: importing grpo_plus would
import torch and TRL's trainer, seconds this process does not need. Protocol on stdin / stdout: a 4-byte big-endian
length, then a pickle. First ("ready",) once the verifier is imported; then per request (content, solution) a reply
("ok", reward, gold_parsed, answer_parsed) or ("error", exception). EOF on stdin ends it: its parent closed the pipe or died (after the row in hand, which
math-verify's own timeouts bound; no PR_SET_PDEATHSIG: Linux sends it when the parent *thread* ends, and the
thread that started this process may end long before the process that uses it).
"""

from __future__ import annotations

import importlib
import os
import pickle
import struct
import sys

HEADER = struct.Struct(">I")


def read_message(stream):
    """One length-prefixed pickle from a binary stream; None at EOF."""
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    return pickle.loads(stream.read(HEADER.unpack(header)[0]))


def write_message(stream, message) -> None:
    """One length-prefixed pickle to a binary stream, flushed."""
    payload = pickle.dumps(message)
    stream.write(HEADER.pack(len(payload)) + payload)
    stream.flush()


def _first_value_into(logged: dict[str, object]):
    """A `log_extra` callback keeping each column's one value (one row per request)."""
    return lambda column, values: logged.__setitem__(column, values[0])


def serve(path: str) -> None:
    """Answer requests until EOF: TRL's reward on one row, with the strings it logs through `log_extra`."""
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything the verifier prints goes to stderr, never into the replies
    module, _, name = path.partition(":")
    reward_func = getattr(importlib.import_module(module), name)
    write_message(replies, ("ready",))  # imports done: the rows' deadlines start counting from here
    requests = sys.stdin.buffer
    while (request := read_message(requests)) is not None:
        content, solution = request
        logged: dict[str, object] = {}
        try:
            (reward,) = reward_func(
                [[{"role": "assistant", "content": content}]], [solution], log_extra=_first_value_into(logged)
            )
            reply = ("ok", reward, logged.get("gold_parsed"), logged.get("answer_parsed"))
        except Exception as error:  # the caller raises it, as an in-process call would
            reply = ("error", error)
        try:
            write_message(replies, reply)
        except (pickle.PicklingError, TypeError, AttributeError):
            write_message(replies, ("error", RuntimeError(f"{type(reply[1]).__name__}: {reply[1]}")))


if __name__ == "__main__":
    sys.path.pop(0)  # this file's folder: its module names must not shadow anything the verifier imports
    serve(sys.argv[1])
