"""GRPOConfig's sampling fields: DAPO dynamic sampling (`dynamic_sampling`, `dynamic_sampling_min_std`,
`max_sampling_rounds`) and selective rollout (`selective_rollout`, `selective_rollout_*`), declared and checked."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..settings import ConfigError, SettingsGroup, not_allowed, setting


@dataclass(frozen=True)
class DynamicSamplingSettings(SettingsGroup):
    """DAPO dynamic sampling (grpo_plus.sampling.dynamic_sampling)."""

    prefix = "dynamic_sampling_"

    enabled: bool = setting(
        False,
        "DAPO dynamic sampling: drop prompt groups whose rewards are all equal (zero advantage), generate "
        "more prompts until the generation batch is full again or `max_sampling_rounds` is reached. Needs "
        "`per_device_train_batch_size` to be a multiple of `num_generations` so every micro-batch holds whole "
        "groups.",
        field="dynamic_sampling",
    )
    min_std: float = setting(
        1e-4,
        "A group counts as informative when the std of its rewards exceeds this (absolute, in reward "
        "units); the default tolerates float noise in continuous rewards.",
    )
    max_rounds: int = setting(
        4,
        "Most generation rounds per generation batch with dynamic sampling (1 = filter only, no refill). "
        "When the batch is still short, training uses the informative groups found (logged).",
        field="max_sampling_rounds",
    )

    def __post_init__(self) -> None:
        if self.min_std < 0:
            raise not_allowed("dynamic_sampling_min_std", self.min_std, ">= 0")
        if self.max_rounds < 1:
            raise not_allowed("max_sampling_rounds", self.max_rounds, ">= 1 (1 filters without refilling)")

    def check_batch(self, per_device_train_batch_size: int, num_generations: int) -> None:
        """Raise ConfigError where TRL's batch (its `per_device_train_batch_size`, `num_generations`) would split a
        group across processes or micro-batches while dynamic sampling is on."""
        if self.enabled and per_device_train_batch_size % num_generations:
            raise ConfigError(
                f"dynamic_sampling=True needs per_device_train_batch_size ({per_device_train_batch_size}) to be a "
                f"multiple of num_generations ({num_generations}), so that groups are never split across processes "
                "or micro-batches."
            )


@dataclass(frozen=True)
class SelectiveRolloutSettings(SettingsGroup):
    """Selective rollout (GRESO, grpo_plus.sampling.selective_rollout): the `selective_rollout*` fields of
    GRPOConfig, plus the dead-group threshold shared with dynamic sampling (`min_std`: `dynamic_sampling_min_std`).
    Every value is checked whether or not it is on, so a typo in a YAML file surfaces."""

    prefix = "selective_rollout_"

    enabled: bool = setting(
        False,
        "Selective rollout (GRESO): before generating, skip prompts whose recent groups all had equal "
        "rewards (all right or all wrong) with a probability that grows with the streak, and draw other prompts "
        "instead, so every generation batch stays full. Helps when training passes over a fixed prompt set "
        "several times. Needs a map-style train_dataset; the per-prompt history is saved in checkpoints.",
        field="selective_rollout",
    )
    explore_solved: float = setting(
        0.5,
        "Initial exploration probability p for prompts whose last z groups were all right: such a prompt "
        "is generated for with probability max(p**z, 0.01) when it comes up, else skipped. Adapted during "
        "training between selective_rollout_explore_min and selective_rollout_explore_max.",
    )
    explore_unsolved: float = setting(
        0.5, "Initial exploration probability p for prompts whose last z groups were all wrong."
    )
    explore_min: float = setting(0.05, "Lowest value the adapted exploration probabilities may reach.")
    explore_max: float = setting(0.95, "Highest value the adapted exploration probabilities may reach.")
    explore_step: float = setting(
        0.01,
        "After every generation batch (from the second pass over the data on), each exploration "
        "probability moves down by this step when its kind of dead group made up at least its target share of "
        "the generated groups, up otherwise. 0 keeps them fixed.",
    )
    target_dead_frac: float = setting(
        0.25,
        "Target share of dead (zero-variance) groups among the generated ones, split one third to "
        "all-right and two thirds to all-wrong prompts (GRESO's split: all-wrong prompts are explored more).",
    )
    history: int = setting(4, "Longest dead streak z that counts toward a prompt's skip probability 1 - p**z.")
    solved_reward: float | None = setting(
        None,
        "A dead group whose reward is at least this counts as all right, below as all wrong. None: the "
        "midpoint of the lowest and highest reward seen so far (0.5 for a 0/1 reward). A group counts as dead "
        "when its reward std is at most dynamic_sampling_min_std.",
    )
    # Not a field of its own: dynamic sampling's `dynamic_sampling_min_std`, the std at or below which a group is dead.
    min_std: float = DynamicSamplingSettings.min_std

    @classmethod
    def from_config(cls, config: Any, **given: Any) -> SelectiveRolloutSettings:
        """The group from `config`; `min_std` is dynamic sampling's (read from `config` unless given)."""
        if "min_std" not in given:
            given["min_std"] = DynamicSamplingSettings.from_config(config).min_std
        return super().from_config(config, **given)

    def __post_init__(self) -> None:
        def fail(name: str, allowed: str) -> None:
            raise not_allowed(f"selective_rollout_{name}", getattr(self, name), allowed)

        low, high = self.explore_min, self.explore_max
        if not 0 < low <= 1:
            fail("explore_min", "in (0, 1] (the lowest exploration probability)")
        if not low <= high <= 1:
            fail("explore_max", f"in [selective_rollout_explore_min={low}, 1]")
        for name in ("explore_solved", "explore_unsolved"):
            if not low <= getattr(self, name) <= high:
                fail(name, f"in [selective_rollout_explore_min={low}, selective_rollout_explore_max={high}]")
        if not 0 <= self.explore_step <= 1:
            fail("explore_step", "in [0, 1] (0 keeps the exploration probabilities fixed)")
        if not 0 <= self.target_dead_frac <= 1:
            fail("target_dead_frac", "in [0, 1]")
        if self.history < 1:
            fail("history", ">= 1 (the longest dead streak that counts)")
