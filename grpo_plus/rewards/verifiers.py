"""Verifiers as TRL reward functions: math-verify's accuracy with timeouts in any thread, GSM8K's final number,
reasoning-gym's own scorers, and the format rewards that go with them.

Every function takes TRL's reward-function arguments (`completions` plus dataset columns as keywords) and returns one
float per completion, or None where the row cannot be scored (TRL's "no reward for this row"). A completion is a
string or, for conversational prompts, a list of messages whose first one's "content" is the reply (TRL's layout).
Nothing here imports the trainer: the functions run in any process, including a reward runner's workers.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import pickle
import re
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from pathlib import Path
from typing import Any

from ..compat.rewards import TRL_ACCURACY_REWARD, think_format_reward
from . import _main_thread_worker as protocol

__all__ = [
    "NUMBER",
    "accuracy_reward",
    "answer_format_reward",
    "boxed_format_reward",
    "completion_content",
    "final_number",
    "gsm8k_accuracy_reward",
    "gsm8k_format_reward",
    "reasoning_gym_reward",
    "think_answer_format_reward",
    "think_format_reward",
]

logger = logging.getLogger(__name__)

# TRL's accuracy_reward gives math-verify 10 s per parse and 5 s per comparison (on a main thread). A row makes two
# parses and at most four comparisons (each side parses to at most [sympy, string]); past this many seconds the
# helper process is past every timeout of its own and is killed (a hang signals cannot interrupt: a C-level loop).
PARSING_TIMEOUT_SECONDS, VERIFY_TIMEOUT_SECONDS = 10, 5
ROW_DEADLINE_SECONDS = 2 * PARSING_TIMEOUT_SECONDS + 4 * VERIFY_TIMEOUT_SECONDS + 5
HELPER_SCRIPT = Path(__file__).with_name("_main_thread_worker.py")
HELPER_START_SECONDS = 120  # importing math-verify and TRL's rewards: ~1 s alone, far more on a loaded machine

# A number as written in a reply: a sign only where it is not a binary minus ("9-4" is 9 and 4), thousands commas,
# decimals. A sentence's final period is not a decimal point.
NUMBER = re.compile(r"(?:(?<![\w.-])-)?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")
_GSM8K_MARK = "####"
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ENDS_WITH_ANSWER_TAG = re.compile(r"<answer>\s*\S.*?</answer>\s*$", re.DOTALL)
_THINK_THEN_ANSWER = re.compile(r"^\s*<think>(?!.*<think>).*?</think>\s*<answer>\s*\S.*?</answer>\s*$", re.DOTALL)
_ENDS_WITH_MARKED_NUMBER = re.compile(r"####\s*\$?\s*" + NUMBER.pattern + r"\s*\.?\s*$")
_ENDS_WITH_NUMBER = re.compile(NUMBER.pattern + r"\s*[.!]?\s*$")
_BOXED = re.compile(r"\\boxed\s*\{\s*[^\s}]")


# ---- reading replies -------------------------------------------------------------------------------------------------


def completion_content(completion: Any) -> str:
    """The reply's text: a string as is; a list of messages -> the first message's "content" (TRL's
    `completion[0]["content"]`), its text parts joined when the content is a list of parts."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Sequence) and completion and isinstance(completion[0], dict):
        content = completion[0].get("content")
        if isinstance(content, list):  # content parts [{"type": "text", "text": ...}]
            return "".join(part.get("text", "") for part in content if isinstance(part, dict))
        return content if isinstance(content, str) else ""
    return ""


def _number(text: str) -> Fraction | None:
    """A number's exact value ("1,234.50" -> 2469/2); None if `text` is not one number."""
    cleaned = text.strip().replace(",", "").lstrip("$").rstrip(".").strip()
    try:
        return Fraction(Decimal(cleaned))
    except (InvalidOperation, ValueError):
        return None


def final_number(text: str) -> Fraction | None:
    """The reply's answer as a number: the one after its last "####" (GSM8K's convention) if it has one, else its last
    number (how small models answer: "3 + 4 = 7"). None if there is none."""
    if not isinstance(text, str):
        return None
    if _GSM8K_MARK in text:
        matches = NUMBER.findall(text.rsplit(_GSM8K_MARK, 1)[1])[:1]
    else:
        matches = NUMBER.findall(text)[-1:]
    return _number(matches[0]) if matches else None


# ---- math-verify ----------------------------------------------------------------------------------------------------


def accuracy_reward(
    completions: list[Any],
    solution: list[str],
    log_extra: Callable[[str, list], None] | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """TRL's `trl.rewards.accuracy_reward` (math-verify: 1.0 when the reply's answer, \\boxed{} first, equals the
    solution's, None when the solution does not parse), with its timeouts in every thread.

    TRL's function sets math-verify's signal-based timeouts (10 s per parse, 5 s per comparison) only on the main
    thread and runs without any elsewhere, where one pathological answer hangs the call forever. Here a main-thread
    call is TRL's own; any other thread sends each row to a helper process that runs TRL's function on its main
    thread, and kills and replaces it if a row outlives ROW_DEADLINE_SECONDS (that row scores 0.0, as a timed-out
    comparison does). Completions may also be plain strings."""
    contents = [completion_content(completion) for completion in completions]
    solutions = list(solution)
    if len(contents) != len(solutions):
        raise ValueError(f"accuracy_reward: {len(contents)} completions but {len(solutions)} solutions.")
    if threading.current_thread() is threading.main_thread():
        rows = _score_here(contents, solutions)
    else:
        rows = _helper().score(contents, solutions, ROW_DEADLINE_SECONDS)
    if log_extra is not None:
        log_extra("solution", solutions)
        log_extra("gold_parsed", [row[1] for row in rows])
        log_extra("answer_parsed", [row[2] for row in rows])
    return [row[0] for row in rows]


def _trl_accuracy_reward() -> Callable[..., list[float | None]]:
    """TRL's function, imported on first use (it imports math-verify)."""
    import importlib

    module, _, name = TRL_ACCURACY_REWARD.partition(":")
    return getattr(importlib.import_module(module), name)


def _score_here(contents: list[str], solutions: list[str]) -> list[tuple[float | None, str, str]]:
    """(reward, gold_parsed, answer_parsed) per row from TRL's function in this thread (the main one)."""
    logged: dict[str, list] = {}
    rewards = _trl_accuracy_reward()(
        [[{"role": "assistant", "content": content}] for content in contents],
        solutions,
        log_extra=lambda column, values: logged.__setitem__(column, list(values)),
    )
    golds = logged.get("gold_parsed", [None] * len(rewards))
    answers = logged.get("answer_parsed", [None] * len(rewards))
    return list(zip(rewards, golds, answers, strict=True))


class _MainThreadHelper:
    """A helper process (started on first use, one per process) that scores rows on its main thread; callers from
    several threads take turns."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.process: subprocess.Popen | None = None
        self.pid = os.getpid()  # a forked child must not share its parent's pipes
        self.restarts = 0

    def score(self, contents: list[str], solutions: list[str], deadline: float) -> list[tuple]:
        """(reward, gold_parsed, answer_parsed) per row, each row within `deadline` seconds or 0.0."""
        with self.lock:
            return [
                self._score_row(content, solution, deadline)
                for content, solution in zip(contents, solutions, strict=True)
            ]

    def _score_row(self, content: str, solution: str, deadline: float) -> tuple:
        process = self._running()
        try:
            protocol.write_message(process.stdin, (content, solution))
        except BrokenPipeError:  # it ended since the last row (killed from outside): a new one takes this row
            self.stop()
            process = self._running()
            protocol.write_message(process.stdin, (content, solution))
        reply = _read_reply(process, deadline)
        if reply is None:  # past the deadline, or the process died on this row: this row alone scores 0.0
            died = process.poll() is not None
            self.stop()
            self.restarts += 1
            what = f"ended (exit status {process.returncode})" if died else f"ran past {deadline:g} s"
            logger.warning(
                "accuracy_reward: math-verify %s on the completion %r; it scores 0.0 and a new helper process "
                "takes the next rows.",
                what,
                content[:200],
            )
            marker = "[crashed]" if died else "[timeout]"
            return 0.0, marker, marker
        if reply[0] == "error":
            raise reply[1]
        return reply[1], reply[2], reply[3]

    def _running(self) -> subprocess.Popen:
        if self.pid != os.getpid():
            self.process, self.pid = None, os.getpid()
        if self.process is None or self.process.poll() is not None:
            self.process = subprocess.Popen(
                [sys.executable, str(HELPER_SCRIPT), TRL_ACCURACY_REWARD],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                start_new_session=True,  # a Ctrl-C meant for the trainer reaches it, not this helper mid-row
            )
            if _read_reply(self.process, HELPER_START_SECONDS) != ("ready",):
                self.stop()
                raise RuntimeError(
                    f"accuracy_reward: its helper process ({HELPER_SCRIPT.name}) did not start within "
                    f"{HELPER_START_SECONDS} s (its error, if any, is on stderr above)."
                )
        return self.process

    def stop(self) -> None:
        """Kill the helper process (a new one starts on the next call)."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None and self.pid == os.getpid():
            process.kill()
            process.wait()


def _read_reply(process: subprocess.Popen, seconds: float):
    """The helper's next reply, or None if it does not come within `seconds` or the process ends first."""
    end = time.monotonic() + seconds
    fd = process.stdout.fileno()
    data = b""
    needed = protocol.HEADER.size
    header_read = False
    while len(data) < needed:
        remaining = end - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            return None
        chunk = os.read(fd, needed - len(data))
        if not chunk:
            return None
        data += chunk
        if not header_read and len(data) == needed:
            needed += protocol.HEADER.unpack(data[: protocol.HEADER.size])[0]
            header_read = True
    return pickle.loads(data[protocol.HEADER.size :])


_HELPER: _MainThreadHelper | None = None
_HELPER_LOCK = threading.Lock()


def _helper() -> _MainThreadHelper:
    global _HELPER
    with _HELPER_LOCK:
        if _HELPER is None:
            _HELPER = _MainThreadHelper()
            atexit.register(_HELPER.stop)
        return _HELPER


# ---- GSM8K ---------------------------------------------------------------------------------------------------------


def gsm8k_accuracy_reward(completions: list[Any], answer: Iterable[Any], **kwargs: Any) -> list[float | None]:
    """1.0 when the reply's final number equals GSM8K's answer, the number after "####" in the `answer` column (a bare
    number is read as is), else 0.0; None where the answer holds no number. The reply's final number is the one after
    its last "####", else its last number (`final_number`)."""
    rewards: list[float | None] = []
    for completion, gold in zip(completions, answer, strict=True):
        expected = _number(str(gold).rsplit(_GSM8K_MARK, 1)[-1]) if gold is not None else None
        if expected is None:
            rewards.append(None)
            continue
        rewards.append(float(final_number(completion_content(completion)) == expected))
    return rewards


def gsm8k_format_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """1.0 when the reply ends with "#### <number>" (GSM8K's convention), 0.5 when it ends with a number, else 0.0."""
    rewards = []
    for completion in completions:
        text = completion_content(completion)
        rewards.append(
            1.0 if _ENDS_WITH_MARKED_NUMBER.search(text) else 0.5 if _ENDS_WITH_NUMBER.search(text) else 0.0
        )
    return rewards


# ---- format rewards ---------------------------------------------------------------------------------------------------


def answer_format_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """1.0 when the reply ends with a non-empty <answer>...</answer> (reasoning-gym's convention), 0.5 when it holds
    one with text after it, else 0.0."""
    rewards = []
    for completion in completions:
        text = completion_content(completion)
        has_tag = any(match.strip() for match in _ANSWER_TAG.findall(text))
        rewards.append(1.0 if _ENDS_WITH_ANSWER_TAG.search(text) else 0.5 if has_tag else 0.0)
    return rewards


def think_answer_format_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """1.0 for "<think>...</think> <answer>...</answer>" and nothing else (DeepSeek-R1's format: one think block
    opening the reply, the answer closing it), 0.5 when only the answer part is right (`answer_format_reward` 1.0),
    else 0.0. TRL's `think_format_reward` checks the think part alone."""
    answer_scores = answer_format_reward(completions)
    return [
        1.0 if _THINK_THEN_ANSWER.match(completion_content(completion)) else 0.5 if score == 1.0 else 0.0
        for completion, score in zip(completions, answer_scores, strict=True)
    ]


def boxed_format_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """1.0 when the reply puts an answer in \\boxed{...} (where MATH's solutions and `accuracy_reward` look first),
    else 0.0."""
    return [1.0 if _BOXED.search(completion_content(completion)) else 0.0 for completion in completions]


# ---- reasoning-gym ------------------------------------------------------------------------------------------------


def reasoning_gym_reward(completions: list[Any], reasoning_gym: Iterable[str], **kwargs: Any) -> list[float]:
    """The task's own `score_answer(answer, entry)` (reasoning-gym), between 0.0 and 1.0.

    `reasoning_gym` (a dataset column) names each row's entry as JSON {"task", "config", "index"}: the entry is
    generated again from them (exact, and cheap to send to a worker process). The answer is the reply's last
    <answer>...</answer> (reasoning-gym's `extract_answer`); a reply without one is read by its final number when the
    task's answer is a number (`final_number`: small models answer "3 + 4 = 7"), else scores as no answer."""
    from reasoning_gym.utils import extract_answer

    rewards = []
    for completion, source in zip(completions, reasoning_gym, strict=True):
        dataset, entry = reasoning_gym_entry(source)
        text = completion_content(completion)
        answer = extract_answer(text)
        if answer is None and _number(str(entry["answer"])) is not None:
            value = final_number(text)
            answer = None if value is None else _plain(value)
        rewards.append(float(dataset.score_answer(answer, entry)))
    return rewards


def _plain(value: Fraction) -> str:
    """A number as reasoning-gym writes answers: an integer without a decimal point, else its decimal expansion."""
    if value.denominator == 1:
        return str(value.numerator)
    return str(Decimal(value.numerator) / Decimal(value.denominator))


def reasoning_gym_entry(source: str) -> tuple[Any, dict[str, Any]]:
    """(the task's dataset, the entry) a `reasoning_gym` column value names."""
    spec = json.loads(source)
    task, config = spec["task"], json.dumps(spec["config"], sort_keys=True)
    return _reasoning_gym_dataset(task, config), _reasoning_gym_item(task, config, int(spec["index"]))


@functools.lru_cache(maxsize=16)
def _reasoning_gym_dataset(task: str, config_json: str):
    """reasoning-gym's dataset of `task` built from its config fields (lists back to tuples where the field's default
    is a tuple, as JSON has none)."""
    import dataclasses

    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    config = json.loads(config_json)
    defaults = {field.name: field.default for field in dataclasses.fields(DATASETS[task][1])}
    config = {
        key: tuple(value) if isinstance(value, list) and isinstance(defaults.get(key), tuple) else value
        for key, value in config.items()
    }
    return reasoning_gym.create_dataset(task, **config)


@functools.lru_cache(maxsize=65536)
def _reasoning_gym_item(task: str, config_json: str, index: int) -> dict[str, Any]:
    return _reasoning_gym_dataset(task, config_json)[index]
