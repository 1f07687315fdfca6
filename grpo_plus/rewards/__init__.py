"""Rewards: the reward runner (timeouts, worker processes, failures narrowed down to the completions that caused
them; `grpo_plus.rewards.runner`) and reward functions with TRL's signature (`completions` plus dataset columns as
keywords; `grpo_plus.rewards.verifiers`).

Verifiers: `accuracy_reward` (TRL's math-verify reward, its timeouts working in any thread), `gsm8k_accuracy_reward`
(the number after GSM8K's "####"), `reasoning_gym_reward` (a reasoning-gym task's own scorer), and format rewards:
`think_format_reward` (TRL's), `think_answer_format_reward`, `answer_format_reward`, `gsm8k_format_reward`,
`boxed_format_reward`. `accuracy_reward` needs math-verify and `reasoning_gym_reward` reasoning-gym:
`pip install "grpo-plus[tasks]"`.
"""

from .runner import RewardRunner, RewardWorkerError
from .settings import REWARD_ON_ERROR, RewardRunnerSettings
from .verifiers import (
    accuracy_reward,
    answer_format_reward,
    boxed_format_reward,
    gsm8k_accuracy_reward,
    gsm8k_format_reward,
    reasoning_gym_reward,
    think_answer_format_reward,
    think_format_reward,
)

__all__ = [
    "REWARD_ON_ERROR",
    "RewardRunner",
    "RewardRunnerSettings",
    "RewardWorkerError",
    "accuracy_reward",
    "answer_format_reward",
    "boxed_format_reward",
    "gsm8k_accuracy_reward",
    "gsm8k_format_reward",
    "reasoning_gym_reward",
    "think_answer_format_reward",
    "think_format_reward",
]
