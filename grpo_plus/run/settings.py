"""GRPOConfig's `health_*` fields: the training-health guard (grpo_plus.run.health), declared and checked."""

from __future__ import annotations

from dataclasses import dataclass

from ..settings import SettingsGroup, not_allowed, setting

HEALTH_CHECK_MODES = ("warn", "stop", "off")


@dataclass(frozen=True)
class HealthSettings(SettingsGroup):
    """The `health_*` fields of GRPOConfig. A threshold of None turns its check off."""

    prefix = "health_"

    check: str = setting(
        "warn",
        "Training-health guard (grpo_plus.run.health), reading only what the run logs: 'warn' logs one "
        "warning per problem (every group zero-variance, most completions truncated, gradient norm 0 or "
        "non-finite, loss or rewards NaN, entropy collapse), saying what it saw and what to change; 'stop' "
        "ends the run at that step instead, saving its checkpoint and raising TrainingHealthError; 'off'.",
    )
    patience_steps: int = setting(
        5,
        "How many consecutive optimizer steps a condition (zero variance, truncation, zero gradient, "
        "entropy collapse) must hold before the guard reports it. Non-finite values and unscorable rewards are "
        "reported at once (non-finite gradients under fp16 after this many steps: the loss scaler skips some).",
    )
    zero_std_frac: float | None = setting(
        1.0,
        "Report when frac_reward_zero_std (the share of groups whose rewards were all equal, so their "
        "advantages 0) is at least this. 1.0: every group. None turns the check off.",
    )
    truncated_frac: float | None = setting(
        0.9,
        "Report when completions/clipped_ratio (the share of completions cut off at "
        "max_completion_length) is at least this. None turns the check off.",
    )
    entropy_collapse_frac: float | None = setting(
        0.1,
        "Report entropy collapse when the logged mean token entropy falls below this fraction of its first "
        "logged value. None turns the check off.",
    )

    def __post_init__(self) -> None:
        def fail(name: str, allowed: str) -> None:
            raise not_allowed(f"health_{name}", getattr(self, name), allowed)

        if self.check not in HEALTH_CHECK_MODES:
            fail("check", "one of 'warn' (one warning per problem), 'stop' (save and raise), 'off'")
        if self.patience_steps < 1:
            fail("patience_steps", ">= 1 (how many steps a condition must hold before it is reported)")
        for name in ("zero_std_frac", "truncated_frac"):
            value = getattr(self, name)
            if value is not None and not 0 < value <= 1:
                fail(name, "in (0, 1], or None to turn this check off")
        if self.entropy_collapse_frac is not None and not 0 < self.entropy_collapse_frac < 1:
            fail("entropy_collapse_frac", "in (0, 1) (a fraction of the starting entropy), or None to turn it off")
