"""GRPOConfig's `fit_check`: whether the trainer counts the worst step's memory before step 1, declared and checked."""

from __future__ import annotations

from dataclasses import dataclass

from ..settings import SettingsGroup, not_allowed, setting

FIT_CHECK_MODES = ("warn", "error", "auto", "off")


@dataclass(frozen=True)
class FitSettings(SettingsGroup):
    """The fit check before step 1 (grpo_plus.fit.check)."""

    prefix = "fit_"

    check: str = setting(
        "warn",
        "Before step 1, on a CUDA device: count the worst step's peak memory (every completion at "
        "max_completion_length) and compare it with the device's free memory. 'warn' logs a warning naming "
        "settings that would fit, 'error' raises instead of training, 'auto' turns on what makes it fit among "
        "tiled_mlp_tokens=4096 and activation_offloading (same gradient up to float rounding), says so, and "
        "raises with the numbers when neither nor both do, 'off' skips the count.",
        choices=FIT_CHECK_MODES,
    )

    def __post_init__(self) -> None:
        if self.check not in FIT_CHECK_MODES:
            raise not_allowed("fit_check", self.check, f"one of {', '.join(map(repr, FIT_CHECK_MODES))}")
