"""Aggregation (`loss_type`): masked per-token loss (B, T) + context -> this micro-batch's share of the window
objective (pure torch).

B = sequences in the micro-batch, S = gradient-accumulation steps, P = processes, L = `max_completion_length`,
N = loss tokens in the whole accumulation window over all processes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..registry import Registry
from .common import PAPER, ZERO_ADVANTAGE_ROWS_CONTRIBUTE_NOTHING


@dataclass(frozen=True)
class AggregationContext:
    """What an aggregation may normalize by.

    mask: (B, T) token mask. B: sequences in this micro-batch. S: gradient-accumulation steps in the window.
    P: processes. L: max_completion_length. N: loss tokens in the whole window over all processes.
    """

    mask: torch.Tensor
    num_sequences: int
    gradient_accumulation_steps: int
    num_processes: int
    max_completion_length: int | None
    num_items_in_batch: torch.Tensor | float | None

    @property
    def B(self) -> int:  # noqa: N802 - the paper's symbol
        return self.num_sequences

    @property
    def S(self) -> int:  # noqa: N802
        return self.gradient_accumulation_steps

    @property
    def P(self) -> int:  # noqa: N802
        return self.num_processes

    @property
    def L(self) -> int | None:  # noqa: N802
        return self.max_completion_length

    @property
    def N(self) -> torch.Tensor | float | None:  # noqa: N802
        return self.num_items_in_batch


LossAggregator = Callable[[torch.Tensor, AggregationContext], torch.Tensor]
LOSS_TYPES: Registry[LossAggregator] = Registry("loss type", "loss_type")
CONTEXT_FIELDS = ("max_completion_length", "num_items_in_batch")


def register_loss_type(
    name: str,
    *,
    aliases: tuple[str, ...] = (),
    requires: tuple[str, ...] = (),
    override: bool = False,
    zero_advantage_rows_contribute_nothing: bool = False,
    paper: str = "",
):
    """Decorator: register `fn(masked_per_token_loss (B, T), ctx: AggregationContext) -> scalar` under `name`.

    `requires` names context fields that must not be None (`max_completion_length`, `num_items_in_batch`).
    The scalar is this micro-batch's contribution to the window objective: summing it over the S micro-batches
    of a window and averaging over the P processes (DDP) gives the loss whose gradient is applied.
    Declare `zero_advantage_rows_contribute_nothing=True` when rows whose masked loss is 0 (zero advantage) add
    nothing to the result's gradient: the trainer may then leave them out of the training forward (their per-token
    loss still arrives, as zeros, and `ctx` still describes the whole micro-batch).
    """
    unknown = set(requires) - set(CONTEXT_FIELDS)
    if unknown:
        raise ValueError(
            f"requires= names unknown context fields {sorted(unknown)}; allowed: {sorted(CONTEXT_FIELDS)}."
        )
    return LOSS_TYPES.register(
        name,
        aliases=aliases,
        requires=requires,
        override=override,
        traits={ZERO_ADVANTAGE_ROWS_CONTRIBUTE_NOTHING: zero_advantage_rows_contribute_nothing, PAPER: paper},
    )


def available_loss_types(with_aliases: bool = False) -> list[str]:
    """Names accepted by `loss_type` (the aggregations grpo_plus computes itself)."""
    return LOSS_TYPES.names(with_aliases)


@register_loss_type("grpo", zero_advantage_rows_contribute_nothing=True, paper="https://arxiv.org/abs/2402.03300")
def sequence_mean_token_mean(masked_loss: torch.Tensor, ctx: AggregationContext) -> torch.Tensor:
    """(1/B) sum_i [sum_t m*l / max(1, sum_t m)] / S  (GRPO, DeepSeekMath; length-biased)."""
    per_sequence = masked_loss.sum(-1) / ctx.mask.sum(-1).clamp(min=1.0)
    return per_sequence.mean() / ctx.S


@register_loss_type("bnpo", zero_advantage_rows_contribute_nothing=True, paper="https://arxiv.org/abs/2506.02864")
def local_token_mean(masked_loss: torch.Tensor, ctx: AggregationContext) -> torch.Tensor:
    """sum m*l / max(1, sum m) over the local micro-batch, / S.

    Not invariant to how a batch is split: each micro-batch (and process) is normalized by its own token
    count, so the same effective batch gives a different gradient for different micro-batch sizes unless
    all micro-batches hold the same number of tokens.
    """
    return masked_loss.sum() / ctx.mask.sum().clamp(min=1.0) / ctx.S


@register_loss_type(
    "dr_grpo",
    requires=("max_completion_length",),
    zero_advantage_rows_contribute_nothing=True,
    paper="https://arxiv.org/abs/2503.20783",
)
def constant_normalizer(masked_loss: torch.Tensor, ctx: AggregationContext) -> torch.Tensor:
    """sum m*l / (B*L) / S  (Dr. GRPO: a constant normalizer, no length bias)."""
    return masked_loss.sum() / (ctx.B * ctx.L) / ctx.S


@register_loss_type(
    "dapo",
    requires=("num_items_in_batch",),
    zero_advantage_rows_contribute_nothing=True,
    paper="https://arxiv.org/abs/2503.14476",
)
def window_token_mean(masked_loss: torch.Tensor, ctx: AggregationContext) -> torch.Tensor:
    """sum m*l / (N/P): token mean over the whole accumulation window and all processes (DAPO)."""
    num_items = ctx.N.clamp(min=1.0) if isinstance(ctx.N, torch.Tensor) else max(float(ctx.N), 1.0)
    return masked_loss.sum() / (num_items / ctx.P)
