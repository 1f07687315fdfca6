"""Tool environments for TRL's `environment_factory` (the tool-calling model itself is `grpo_plus.app.tool_model`'s,
re-exported here)."""

from __future__ import annotations

import itertools

from grpo_plus.app.tool_model import (  # noqa: F401  (re-exported: the tests import them from here)
    TurnRecorder,
    completion_length_reward,
    conversation,
    increment,
    left_pad,
    load_tool_model,
    make_tool_tokenizer,
    number_prompts,
    save_tool_model,
    tool_model_config,
    tool_run_settings,
    tool_trainer,
    train_tool_model,
    two_turns,
)


class CounterEnv:
    """An environment owning its data and its reward: `reset` hands out a number (from `seed` and how often it was
    reset), `increment` counts up, and the reward is the number of increments."""

    def __init__(self, seed: int = 0):
        self.seed, self.resets, self.calls = seed, 0, 0

    def reset(self, **kwargs) -> str:
        self.resets += 1
        self.calls = 0
        return str((self.seed + 3 * self.resets) % 10)

    def increment(self, n: int) -> int:
        """Add one to a number.

        Args:
            n: The number.

        Returns:
            The number plus one.
        """
        self.calls += 1
        return n + 1

    def get_reward(self) -> float:
        return float(self.calls)


def counter_factory():
    """A fresh `environment_factory` for CounterEnv: its instances get seeds 0, 1, 2, ... (the same in every run)."""
    seeds = itertools.count()
    return lambda: CounterEnv(next(seeds))


class EchoEnv:
    """An environment whose tool repeats its argument; it does not own a reward."""

    def reset(self, **kwargs) -> str:
        return "5"

    def echo(self, text: str) -> str:
        """Repeat a text.

        Args:
            text: The text.

        Returns:
            The text.
        """
        return text
