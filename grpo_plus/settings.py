"""What grpo_plus's settings groups share: the error a bad value raises, and how it is worded.

Each group of grpo_plus fields (dynamic sampling, selective rollout, ...) is a small frozen dataclass next to the
code that uses it, built once from the config and validating itself, in the style of PEFT's per-method configs.
"""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A GRPOConfig field has a value that is not allowed."""


def not_allowed(name: str, value: Any, allowed: str) -> ConfigError:
    """ "name=value is not allowed: name must be <allowed>."""
    return ConfigError(f"{name}={value!r} is not allowed: {name} must be {allowed}.")
