"""Reward functions for the tiny runs, and which prompts they make dead (every completion scored alike).

Recipes load them by name (`--reward_funcs helpers.rewards:length_reward`) with tests/ on the Python path."""

from __future__ import annotations

from grpo_plus.app.testing import digit_reward, length_reward, text_of  # noqa: F401  (shared with the benchmarks)


def starts_odd(prompt) -> bool:
    """The prompts the dead-group rewards below make constant: those starting with an odd digit."""
    return int(text_of(prompt)[0]) % 2 == 1


def odd_prompts_constant_reward(completions, prompts, **kwargs) -> list[float]:
    """Constant reward for prompts starting with an odd digit (dead groups), length reward otherwise."""
    return [1.0 if starts_odd(p) else float(len(text_of(c))) for p, c in zip(prompts, completions, strict=True)]


def half_dead_reward(completions, prompts, **kwargs) -> list[float]:
    """1 for prompts starting with an odd digit (dead groups), the digit fraction otherwise (rarely tied)."""
    return [1.0 if starts_odd(p) else d for p, d in zip(prompts, digit_reward(completions), strict=True)]


def half_dead_or_none_reward(completions, prompts, answer, **kwargs) -> list[float | None]:
    """`half_dead_reward`, but None (unscorable: advantage 0, the row skipped) for the last completion of each group
    of a live prompt whose answer is even."""
    rewards = half_dead_reward(completions, prompts)
    rows = enumerate(zip(prompts, answer, rewards, strict=True))
    return [None if row % 4 == 3 and a % 2 == 0 and not starts_odd(p) else r for row, (p, a, r) in rows]


def constant_reward(completions, **kwargs) -> list[float]:
    """Every group is dead."""
    return [1.0] * len(completions)


def odd_prompts_dead_reward(completions, prompts, **kwargs) -> list[float]:
    """1.0 for every completion of a prompt starting with an odd digit (always dead, "solved"); 0/1 alternating by
    row otherwise, so those groups (consecutive rows) are always informative whatever the model writes."""
    return [1.0 if starts_odd(p) else float(row % 2) for row, p in enumerate(prompts)]


def alternating_reward(completions, **kwargs) -> list[float]:
    """0/1 alternating by row: every group (of an even size) is informative whatever the model writes."""
    return [float(row % 2) for row in range(len(completions))]


def dead_rows(dataset) -> set[int]:
    """Rows of `prompt_dataset` that `odd_prompts_dead_reward` makes dead."""
    return {i for i, row in enumerate(dataset) if starts_odd(row["prompt"])}


def explode_at_step_3(completions, trainer_state=None, **kwargs) -> list[float]:
    """Scores like `length_reward` for two optimizer steps, then raises: a crash in the middle of training."""
    if trainer_state is not None and trainer_state.global_step >= 2:
        return [1 / 0 for _ in completions]
    return length_reward(completions)
