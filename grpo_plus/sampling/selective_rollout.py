"""Selective rollout (GRESO, arXiv 2506.02177): skip prompts predicted to teach nothing, before generating for them.

A prompt whose recent groups were all right or all wrong (zero reward variance, so zero advantage) is likely to
be dead again. `SelectiveRollout` keeps, per dataset row, the kind and length of its current dead streak and draws
generation batches from an endless shuffled stream of rows: a row with a dead streak of z is drawn with
probability max(p**z, MIN_KEEP_PROBABILITY) and otherwise skipped in favour of the next row, so the batch stays
full. p is the exploration probability of its kind (all right / all wrong), nudged after every generation batch
so the share of dead groups generated tracks a target.

Pure logic: no TRL, no processes. Every random number is a function of (seed, pass, position), so processes with
the same history make the same decisions, and the state is a handful of numbers that a checkpoint can hold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from .dynamic_sampling import informative_groups
from .settings import SelectiveRolloutSettings

SOLVED, UNSOLVED = "solved", "unsolved"
KINDS = (SOLVED, UNSOLVED)
# GRESO's floor: a predicted-dead prompt is still drawn at least this often, however long its streak.
MIN_KEEP_PROBABILITY = 0.01
# GRESO splits the dead-group target one third all-right, two thirds all-wrong: a learning model is more likely to
# start solving a hard prompt than to start failing an easy one, so all-wrong prompts are explored more.
TARGET_SHARE = {SOLVED: 1 / 3, UNSOLVED: 2 / 3}
STATE_VERSION = 1
_SEED_MIX = 0x9E3779B97F4A7C15  # spreads (seed, pass) pairs over the generator's seed space


@dataclass
class Draw:
    """One draw of prompts for a generation round: dataset rows in order, which were predicted dead, which skipped."""

    indices: list[int]
    predicted_dead: list[bool]
    skipped: list[int]

    def rows(self, num_generations: int) -> list[int]:
        """Dataset row of every completion: each prompt repeated `num_generations` times (TRL's layout)."""
        return [index for index in self.indices for _ in range(num_generations)]


@dataclass
class _Tally:
    """Counts over one generation batch (one draw plus any dynamic-sampling refills)."""

    rounds: int = 0
    skipped: int = 0
    examined: int = 0
    generated: int = 0
    informative: int = 0
    dead: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    explored: int = 0
    explored_dead: int = 0


class SelectiveRollout:
    """Per-prompt dead-streak history and GRESO's probabilistic skipping over a dataset of `dataset_size` rows.
    A stateful part (grpo_plus.run.state): checkpoints hold its `state_dict`."""

    checkpoint_name = "selective_rollout"

    @classmethod
    def for_dataset(cls, settings: SelectiveRolloutSettings, dataset: Any, seed: int,
                    shuffle: bool) -> SelectiveRollout | None:  # fmt: skip
        """The trainer's selective rollout over `dataset` (rows addressed by index), or None when it is off."""
        from datasets import IterableDataset

        if not settings.enabled:
            return None
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
            raise ValueError("selective_rollout=True needs a map-style train_dataset (rows addressed by index).")
        return cls(len(dataset), settings, seed=seed, shuffle=shuffle)

    def __init__(self, dataset_size: int, settings: SelectiveRolloutSettings, seed: int, shuffle: bool = True):
        if dataset_size < 1:
            raise ValueError("selective_rollout needs a non-empty train_dataset.")
        self.dataset_size, self.settings, self.seed, self.shuffle = dataset_size, settings, seed, shuffle
        self.pass_index = 0  # how many times the stream has gone round the dataset
        self.position = 0  # next row of the current pass
        self.streaks: dict[int, tuple[str, int]] = {}  # row -> (kind, consecutive dead groups); live rows absent
        self.explore = {SOLVED: settings.explore_solved, UNSOLVED: settings.explore_unsolved}
        self.reward_range: tuple[float, float] | None = None
        self._tally = _Tally()
        self._pass_cache: tuple[int, list[int], list[float]] | None = None

    # ---- decisions ----------------------------------------------------------------------------------------------

    def keep_probability(self, index: int) -> float:
        """Probability that row `index` is generated for when it comes up: 1 unless it is on a dead streak."""
        if index not in self.streaks:
            return 1.0
        kind, streak = self.streaks[index]
        return max(self.explore[kind] ** streak, MIN_KEEP_PROBABILITY)

    def draw(self, num_prompts: int) -> Draw:
        """The next `num_prompts` rows of the stream, skipping predicted-dead rows with their skip probability.

        At most one pass's worth of rows is skipped per draw, so a dataset where everything looks dead still
        yields a batch (the rows after that are drawn, i.e. explored).
        """
        indices, predicted, skipped = [], [], []
        while len(indices) < num_prompts:
            index, uniform = self._next_candidate()
            self._tally.examined += 1
            keep = self.keep_probability(index)
            if uniform >= keep and len(skipped) < self.dataset_size:
                skipped.append(index)
                continue
            indices.append(index)
            predicted.append(keep < 1.0)
        self._tally.skipped += len(skipped)
        return Draw(indices, predicted, skipped)

    def _next_candidate(self) -> tuple[int, float]:
        if self.position == self.dataset_size:  # wrap lazily: a batch that ends a pass still belongs to it
            self.pass_index, self.position = self.pass_index + 1, 0
        order, uniforms = self._pass_order()
        index, uniform = order[self.position], uniforms[self.position]
        self.position += 1
        return index, uniform

    def _pass_order(self) -> tuple[list[int], list[float]]:
        """Row order and one uniform number per position for the current pass, a pure function of (seed, pass)."""
        if self._pass_cache is None or self._pass_cache[0] != self.pass_index:
            generator = torch.Generator().manual_seed((self.seed * _SEED_MIX + self.pass_index) % 2**63)
            if self.shuffle:
                order = torch.randperm(self.dataset_size, generator=generator).tolist()
            else:
                order = list(range(self.dataset_size))
            uniforms = torch.rand(self.dataset_size, generator=generator, dtype=torch.float64).tolist()
            self._pass_cache = (self.pass_index, order, uniforms)
        return self._pass_cache[1], self._pass_cache[2]

    # ---- history ------------------------------------------------------------------------------------------------

    def record(self, draw: Draw, rewards: torch.Tensor, num_generations: int) -> None:
        """Update the history from the rewards of every completion of `draw` (all processes, TRL's row order)."""
        rewards = rewards.detach().float().cpu()
        if rewards.numel() != len(draw.indices) * num_generations:
            raise ValueError(
                f"selective_rollout got {rewards.numel()} rewards for {len(draw.indices)} prompts x "
                f"{num_generations} generations."
            )
        live = informative_groups(rewards, num_generations, self.settings.min_std).tolist()
        means = torch.nanmean(rewards.view(-1, num_generations), dim=1).tolist()
        self._widen_reward_range(rewards)
        tally = self._tally
        tally.rounds += 1
        for index, was_predicted, is_live, mean in zip(draw.indices, draw.predicted_dead, live, means, strict=True):
            tally.generated += 1
            tally.explored += was_predicted
            if is_live:
                tally.informative += 1
                self.streaks.pop(index, None)
                continue
            tally.explored_dead += was_predicted
            kind = self._dead_kind(mean)
            tally.dead[kind] += 1
            previous_kind, streak = self.streaks.get(index, (kind, 0))
            streak = streak + 1 if previous_kind == kind else 1
            self.streaks[index] = (kind, min(streak, self.settings.history))

    def _widen_reward_range(self, rewards: torch.Tensor) -> None:
        finite = rewards[torch.isfinite(rewards)]
        if finite.numel() == 0:
            return
        low, high = finite.min().item(), finite.max().item()
        if self.reward_range is not None:
            low, high = min(low, self.reward_range[0]), max(high, self.reward_range[1])
        self.reward_range = (low, high)

    def _dead_kind(self, mean_reward: float) -> str:
        """All right (solved) or all wrong (unsolved): the group's reward against `solved_reward`, by default the
        midpoint of the lowest and highest reward seen so far (0.5 for a 0/1 reward). Until two different rewards
        have been seen there is no midpoint: a positive reward counts as right, 0 or less as wrong. Unscorable is
        unsolved."""
        threshold = self.settings.solved_reward
        if threshold is not None:
            return SOLVED if mean_reward >= threshold else UNSOLVED
        low, high = self.reward_range if self.reward_range is not None else (0.0, 0.0)
        if low == high:
            return SOLVED if mean_reward > 0 else UNSOLVED
        return SOLVED if mean_reward >= (low + high) / 2 else UNSOLVED

    # ---- adaptation and metrics ---------------------------------------------------------------------------------

    def end_batch(self) -> dict[str, float]:
        """Close a generation batch: adapt the exploration probabilities, return its metrics, reset the counts."""
        tally, self._tally = self._tally, _Tally()
        if self.pass_index >= 1 and tally.generated:  # GRESO adapts from the second epoch on, once history exists
            for kind in KINDS:
                share = tally.dead[kind] / tally.generated
                step = -self.settings.explore_step if share >= self.target(kind) else self.settings.explore_step
                self.explore[kind] = min(
                    max(self.explore[kind] + step, self.settings.explore_min), self.settings.explore_max
                )
        metrics = {
            "skipped": float(tally.skipped),
            "skipped_frac": tally.skipped / max(tally.examined, 1),
            "generation_calls": float(tally.rounds),
            "informative_frac": tally.informative / max(tally.generated, 1),
            "explored_predicted_dead": float(tally.explored),
            "explored_were_dead": float(tally.explored_dead),
            "explore_solved": self.explore[SOLVED],
            "explore_unsolved": self.explore[UNSOLVED],
            "predicted_dead_prompts": float(len(self.streaks)),
        }
        if tally.explored:
            metrics["precision"] = tally.explored_dead / tally.explored
        return metrics

    def target(self, kind: str) -> float:
        """This kind's share of the dead-group target."""
        return self.settings.target_dead_frac * TARGET_SHARE[kind]

    # ---- checkpoint state ---------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything the next decisions depend on, JSON-serializable (taken between generation batches)."""
        return {
            "version": STATE_VERSION,
            "dataset_size": self.dataset_size,
            "seed": self.seed,
            "pass_index": self.pass_index,
            "position": self.position,
            "streaks": [[index, kind, streak] for index, (kind, streak) in sorted(self.streaks.items())],
            "explore": dict(self.explore),
            "reward_range": list(self.reward_range) if self.reward_range is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        problem = state_problem(state)
        if problem is not None:
            raise ValueError(problem)
        if state["dataset_size"] != self.dataset_size:
            raise ValueError(
                f"its history is for a train_dataset of {state['dataset_size']} rows; this run's has "
                f"{self.dataset_size}. Resume with the same dataset."
            )
        self.seed, self.pass_index, self.position = state["seed"], state["pass_index"], state["position"]
        self.streaks = {index: (kind, min(streak, self.settings.history)) for index, kind, streak in state["streaks"]}
        self.explore = {kind: float(state["explore"][kind]) for kind in KINDS}
        self.reward_range = tuple(state["reward_range"]) if state["reward_range"] is not None else None
        self._tally, self._pass_cache = _Tally(), None


def state_problem(state: Any) -> str | None:
    """What is wrong with a saved selective-rollout state (a dict from `state_dict`), or None."""
    if not isinstance(state, dict):
        return f"expected a JSON object, found {type(state).__name__}"
    if state.get("version") != STATE_VERSION:
        return f"unknown state version {state.get('version')!r} (this grpo_plus writes {STATE_VERSION})"
    missing = {"dataset_size", "seed", "pass_index", "position", "streaks", "explore", "reward_range"} - set(state)
    if missing:
        return f"fields missing: {', '.join(sorted(missing))}"
    size = state["dataset_size"]
    checks = [
        (_is_int(size) and size >= 1, "dataset_size must be an integer >= 1"),
        (_is_int(state["seed"]), "seed must be an integer"),
        (_is_int(state["pass_index"]) and state["pass_index"] >= 0, "pass_index must be an integer >= 0"),
        (_is_int(state["position"]) and 0 <= state["position"] <= size, f"position must be in [0, {size}]"),
        (
            isinstance(state["explore"], dict)
            and all(_is_number(state["explore"].get(kind)) and 0 <= state["explore"][kind] <= 1 for kind in KINDS),
            f"explore must give a probability in [0, 1] for {' and '.join(KINDS)}",
        ),
        (
            state["reward_range"] is None
            or (
                isinstance(state["reward_range"], list)
                and len(state["reward_range"]) == 2
                and all(_is_number(v) and math.isfinite(v) for v in state["reward_range"])
                and state["reward_range"][0] <= state["reward_range"][1]
            ),
            "reward_range must be null or [low, high] with finite low <= high",
        ),
        (
            isinstance(state["streaks"], list)
            and all(
                isinstance(entry, list)
                and len(entry) == 3
                and _is_int(entry[0])
                and 0 <= entry[0] < size
                and entry[1] in KINDS
                and _is_int(entry[2])
                and entry[2] >= 1
                for entry in state["streaks"]
            ),
            f"every streak must be [row in [0, {size}), kind in {list(KINDS)}, length >= 1]",
        ),
    ]
    failed = [message for ok, message in checks if not ok]
    return f"out-of-range values: {'; '.join(failed)}" if failed else None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
