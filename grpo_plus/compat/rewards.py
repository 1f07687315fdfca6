"""How TRL calls reward functions (`_calculate_rewards`), and the reward helpers of `trl.rewards` grpo_plus uses."""

from __future__ import annotations

import ast
import functools

import trl
from trl.rewards import get_soft_overlong_punishment, think_format_reward
from trl.trainer.utils import is_async_callable

from .common import method_tree

__all__ = [
    "TRL_ACCURACY_REWARD",
    "TRL_SHARED_REWARD_KWARGS",
    "get_soft_overlong_punishment",
    "is_async_callable",
    "reward_call_problem",
    "think_format_reward",
]


# How TRL 1.14-1.16's `_calculate_rewards` calls a reward function, which the reward runner splits by completion: by
# keyword, `prompts`, `completions`, `completion_ids` and every other key of its `reward_kwargs` a list with one item
# per completion (the dataset columns, and `environments` with an environment_factory), except these, which it sets
# once for the call: the trainer state, and the two logging functions (`log_extra(column, values)` with one value
# per completion, `log_metric(name, value)` with one value for the call), which the runner calls in the trainer's
# process with what a worker recorded.
TRL_SHARED_REWARD_KWARGS = ("trainer_state", "log_extra", "log_metric")


_TRL_PER_COMPLETION_REWARD_KWARGS = ("environments",)


@functools.cache
def reward_call_problem() -> str | None:
    """Why the reward runner cannot split this TRL's reward calls by completion, or None: every key that
    `_calculate_rewards` sets in its `reward_kwargs` (besides the dataset columns) must be one it knows, shared by the
    call (TRL_SHARED_REWARD_KWARGS) or one item per completion (`environments`), read from TRL's own source."""
    tree = method_tree(trl.GRPOTrainer._calculate_rewards)
    keys = {
        target.slice.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Subscript)
        and isinstance(target.value, ast.Name)
        and target.value.id == "reward_kwargs"
        and isinstance(target.slice, ast.Constant)
    }
    unknown = sorted(keys - {*TRL_SHARED_REWARD_KWARGS, *_TRL_PER_COMPLETION_REWARD_KWARGS})
    if unknown:
        return (
            f"TRL {trl.__version__}'s _calculate_rewards passes reward functions {', '.join(unknown)}, which the reward "
            "runner does not know how to split by completion"
        )
    return None


# ---- reward functions (`trl.rewards`, the same in 1.14.0-1.16.0) ----------------------------------------------------
# `accuracy_reward(completions, solution, log_extra=None, **kwargs)` gives math-verify its signal-based timeouts
# (10 s per parse, 5 s per comparison) only on the main thread; on any other it runs with none (a pathological answer
# hangs the call). grpo_plus.rewards.accuracy_reward calls it where they work: the caller's main thread, or a helper
# process's, which imports it by this path (importing grpo_plus there would cost seconds). It logs "solution",
# "gold_parsed" and "answer_parsed" through `log_extra`.
TRL_ACCURACY_REWARD = "trl.rewards:accuracy_reward"
