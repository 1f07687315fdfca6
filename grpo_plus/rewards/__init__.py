"""Rewards: the reward runner (timeouts, worker processes, failures narrowed down to the completions that caused
them; `grpo_plus.rewards.runner`)."""

from .runner import REWARD_ON_ERROR, RewardRunner, RewardRunnerSettings, RewardWorkerError

__all__ = ["REWARD_ON_ERROR", "RewardRunner", "RewardRunnerSettings", "RewardWorkerError"]
