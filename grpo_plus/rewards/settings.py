"""GRPOConfig's `reward_*` fields: how the reward runner (grpo_plus.rewards.runner) calls the reward functions,
declared and checked."""

from __future__ import annotations

import math
import numbers
import os
import socket
import sys
from dataclasses import dataclass

from ..settings import ConfigError, SettingsGroup, not_allowed, setting

REWARD_ON_ERROR = ("raise", "none")
_CAN_FORK = hasattr(os, "fork") and hasattr(socket, "send_fds")


@dataclass(frozen=True)
class RewardRunnerSettings(SettingsGroup):
    """GRPOConfig's reward-runner fields: `reward_timeout`, `reward_workers`, `reward_on_error`,
    `reward_whole_batch`. The defaults are TRL's behaviour (in-process calls, no timeout, an exception raised)."""

    prefix = "reward_"

    timeout: float | None = setting(
        None,
        "Seconds a reward function's call (one per reward function per generation batch) may take, in "
        "worker processes (needs reward_workers >= 1). The completions not scored by then, narrowed down to "
        "those the function stalled on, get None (no reward; the other reward functions still count) and are "
        "counted in rewards/<name>/timeouts. None: no timeout (TRL's behaviour).",
    )
    workers: int = setting(
        0,
        "0: reward functions are called in the trainer's process (TRL's behaviour). N > 0: each call is "
        "split into N pieces of consecutive completions scored at once by N worker processes, so a reward that "
        "stalls, raises or ends its process never takes the trainer with it (a dead worker is replaced). The "
        "rewards are those of one in-process call, for functions that score each completion on its own "
        "(reward_whole_batch names the others). Reward models and environment-owned rewards stay TRL's.",
    )
    on_error: str = setting(
        "raise",
        "What a reward function's exception does: 'raise' (TRL's behaviour) or 'none': the call is narrowed "
        "down to the completions that raise, which get None, counted in rewards/<name>/errors, with a warning the "
        "first time. A worker that ends (os._exit, a segfault) gives its completions None either way.",
        choices=REWARD_ON_ERROR,
    )
    # A tuple here (one name given as a string is one name); GRPOConfig's field is the list TRL's parser fills.
    whole_batch: tuple[str, ...] = setting(
        None,
        "Names of reward functions that score a completion against the others of its batch: the reward "
        "runner calls them on the whole batch (never split across workers, never narrowed down: a failure gives "
        "every completion of the call None).",
        config_type=list[str] | None,
    )

    @property
    def enabled(self) -> bool:
        """False where TRL's own in-process calls are what the settings ask for (then the runner stands aside)."""
        return self.workers > 0 or self.on_error != "raise"

    def __post_init__(self) -> None:
        whole = self.whole_batch
        self._set("whole_batch", (whole,) if isinstance(whole, str) else tuple(whole or ()))
        if isinstance(self.workers, bool) or not isinstance(self.workers, numbers.Integral) or self.workers < 0:
            raise not_allowed("reward_workers", self.workers, "0 (TRL's calls in the trainer's process) or more")
        timeout = self.timeout
        if timeout is not None and not (isinstance(timeout, numbers.Real) and math.isfinite(timeout) and timeout > 0):
            raise not_allowed("reward_timeout", timeout, "a number of seconds > 0, or None (no timeout)")
        if self.on_error not in REWARD_ON_ERROR:
            raise not_allowed("reward_on_error", self.on_error, f"one of {', '.join(map(repr, REWARD_ON_ERROR))}")
        if timeout is not None and self.workers == 0:
            raise ConfigError(
                f"reward_timeout={timeout!r} needs reward_workers >= 1: a reward function called in the trainer's own "
                "process cannot be stopped once it stalls (a thread cannot be killed), so a timeout is kept only by "
                "worker processes. Set reward_workers (e.g. 2), or reward_timeout=None."
            )
        if self.workers and not _CAN_FORK:
            raise ConfigError(
                f"reward_workers={self.workers} needs os.fork and socket.send_fds (Linux, macOS), which this Python "
                f"on {sys.platform} does not have. Set reward_workers=0."
            )
        if not all(isinstance(name, str) for name in self.whole_batch):
            raise not_allowed("reward_whole_batch", list(self.whole_batch), "a list of reward function names")
