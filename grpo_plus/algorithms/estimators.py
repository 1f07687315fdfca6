"""The published algorithms in a GRPOTrainer (their settings: `algorithms.settings`): the adaptive KL coefficient
over training steps (saved in checkpoints), a round's advantages from every process's rewards (with what the
estimator reads besides them), and ReMax's greedy generation.

The formulas are the core's (`grpo_plus.objective`); this module holds what the trainer needs around them, and
`trainer.py` wires it in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..objective import (
    AdaptiveKLController,
    PolicyLossOutput,
    combine_rewards,
    compute_advantages,
)
from .settings import AlgorithmSettings

# ---- the adaptive KL coefficient over training steps --------------------------------------------------------------


class KLCoefficient:
    """beta for each micro-batch: fixed, or PPO's adaptive controller updated once per optimizer step from the KL
    measured over that step's micro-batches on every process (the logged `kl`: token mean of the KL term)."""

    def __init__(self, beta: float, settings: AlgorithmSettings):
        self.beta = beta
        self.controller = None
        if settings.adaptive_kl:
            self.controller = AdaptiveKLController(beta, settings.adaptive_kl_target, settings.adaptive_kl_horizon)
        self._window: torch.Tensor | None = None  # [KL sum, KL tokens, completions] of this step's micro-batches

    @property
    def value(self) -> float:
        return self.beta if self.controller is None else self.controller.value

    def record(self, out: PolicyLossOutput) -> None:
        """Add one training micro-batch's KL and completions to the step's window."""
        if self.controller is None or out.per_token_kl is None:
            return
        kl_total = out.total(out.per_token_kl)
        stats = torch.cat([kl_total, kl_total.new_tensor([float(out.mask.shape[0])])]).detach()
        self._window = stats if self._window is None else self._window + stats

    def end_step(self, reduce_sum: Callable[[torch.Tensor], torch.Tensor], metrics: dict[str, list]) -> None:
        """After an optimizer step: move beta toward the target from the step's KL over all processes, log it."""
        if self.controller is None or self._window is None:
            return
        kl_sum, kl_tokens, completions = reduce_sum(self._window).tolist()
        self._window = None
        self.controller.update(kl_sum / max(kl_tokens, 1.0), int(completions))
        metrics["beta"].append(self.controller.value)

    # The stateful-part protocol (grpo_plus.run.state): the adaptive coefficient is saved in checkpoints and
    # restored on resume; a fixed beta has no state (checkpoint_name None opts out).
    @property
    def checkpoint_name(self) -> str | None:
        return None if self.controller is None else self.controller.checkpoint_name

    def state_dict(self) -> dict[str, Any]:
        return {} if self.controller is None else self.controller.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._window = None
        if self.controller is not None:
            self.controller.load_state_dict(state)


# ---- the advantages of a round --------------------------------------------------------------------------------------


def local_advantages(
    rewards: torch.Tensor,
    num_generations: int,
    scale_rewards: str,
    estimator: str,
    logged: list,
    rows: slice,
    width: int,
    **estimator_inputs: torch.Tensor,
) -> torch.Tensor:
    """The advantages of every process's completions (from the gathered `rewards`), this process's `rows` of them
    (per-token ones cut or padded to its `width` completion columns: every process pads to its own); `logged` (the
    completions log's advantages) gets every row's, as TRL logs them."""
    advantages = compute_advantages(rewards, num_generations, scale_rewards, estimator=estimator, **estimator_inputs)
    for _ in range(min(len(advantages), len(logged))):
        logged.pop()
    logged.extend((advantages if advantages.dim() == 1 else advantages.mean(dim=1)).tolist())
    local = advantages[rows]
    if local.dim() == 2:
        local = torch.nn.functional.pad(local[:, :width], (0, max(width - local.shape[1], 0)))
    return local


def estimator_inputs(
    settings: AlgorithmSettings,
    output: dict[str, Any],
    gather: Callable[[torch.Tensor], torch.Tensor],
    greedy_rewards: Callable[[], torch.Tensor],
) -> dict[str, torch.Tensor]:
    """What the estimator reads besides the rewards, over every process's completions: their masks (rebuilt from the
    gathered lengths) and ReMax's greedy baselines (`greedy_rewards()`), as it declared (`requires`)."""
    needed = {}
    if settings.needs("completion_mask"):
        lengths = (output["completion_mask"] * output.get("tool_mask", 1)).sum(dim=1)
        needed["completion_mask"] = mask_from_lengths(gather(lengths))
    if settings.needs("reward_baselines"):
        needed["reward_baselines"] = greedy_rewards()
    return needed


def greedy_rewards(
    inputs: list[dict[str, Any]],
    num_generations: int,
    generate: Callable[[list[Any]], tuple[list, list]],
    calculate_rewards: Callable[..., torch.Tensor],
    reward_weights: torch.Tensor,
    metrics: dict[str, list],
    state: Any,
) -> torch.Tensor:
    """ReMax's baseline: the reward of one greedy completion per prompt of this process's groups, generated by
    `generate(prompts)` -> (completion ids, completions) (TRL's own generation with sampling off, zero-waste generation
    included: `compat.model.greedy_completions`) and scored by `calculate_rewards` (TRL's, gathered: every process's
    prompts in order) with `reward_weights`; logged as `remax/greedy_reward`. What generation logs to `metrics` and
    counts in the trainer's `state` is undone: the baseline is no training sample."""
    firsts = first_of_each_group(inputs, num_generations)
    prompts = [row["prompt"] for row in firsts]
    with unlogged(metrics, state):
        completion_ids, completions = generate(prompts)
    rewards = combine_rewards(calculate_rewards(firsts, prompts, completions, completion_ids), reward_weights)
    metrics["remax/greedy_reward"].append(torch.nanmean(rewards).item())
    return rewards


# ---- what the estimators read besides rewards --------------------------------------------------------------------


def mask_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """(N, max length) 0/1 mask with lengths[i] leading ones: the completion masks of every process, rebuilt from their
    gathered lengths (each process pads its completions to its own width)."""
    width = max(int(lengths.max()) if lengths.numel() else 0, 1)
    return (torch.arange(width, device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)).long()


def first_of_each_group(inputs: list[dict[str, Any]], num_generations: int) -> list[dict[str, Any]]:
    """One row per prompt of a process's rows (TRL's sampler repeats each prompt num_generations times in a row)."""
    if len(inputs) % num_generations:
        raise ValueError(
            f"The greedy baseline needs whole groups on each process: {len(inputs)} rows is not a multiple of "
            f"num_generations={num_generations}."
        )
    firsts = inputs[::num_generations]
    for group, first in enumerate(firsts):
        rows = inputs[group * num_generations : (group + 1) * num_generations]
        if any(row["prompt"] != first["prompt"] for row in rows):
            raise ValueError(f"Rows {group * num_generations}..{(group + 1) * num_generations - 1} are not one group.")
    return firsts


@contextmanager
def unlogged(metrics: dict[str, list], state: Any) -> Iterator[None]:
    """Undo what a generation call logs (`metrics`' values) and counts (`state.num_input_tokens_seen`) on exit."""
    saved, tokens_seen = {name: list(values) for name, values in metrics.items()}, state.num_input_tokens_seen
    try:
        yield
    finally:
        metrics.clear()
        metrics.update(saved)
        state.num_input_tokens_seen = tokens_seen
