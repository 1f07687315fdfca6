"""Importance sampling (`importance_sampling_level`): log_ratio (B, T) = logp - old_logp -> log importance weights,
(B, T) per token or (B, 1) per sequence (pure torch)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..registry import Registry
from .common import PAPER, ZERO_ADVANTAGE_ROWS_CONTRIBUTE_NOTHING, sequence_mean

ImportanceSampler = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
IMPORTANCE_SAMPLERS: Registry[ImportanceSampler] = Registry("importance sampling", "importance_sampling_level")


def register_importance_sampling(
    name: str,
    *,
    aliases: tuple[str, ...] = (),
    override: bool = False,
    zero_advantage_rows_contribute_nothing: bool = False,
    paper: str = "",
):
    """Decorator: register `fn(log_ratio (B, T), mask (B, T)) -> log weights (B, T) or (B, 1)` under `name`.

    Declare `zero_advantage_rows_contribute_nothing=True` when each row's weights depend on that row alone (no
    batch-wide normalization): the trainer may then leave zero-advantage rows out of the training forward.
    """
    return IMPORTANCE_SAMPLERS.register(
        name,
        aliases=aliases,
        override=override,
        traits={ZERO_ADVANTAGE_ROWS_CONTRIBUTE_NOTHING: zero_advantage_rows_contribute_nothing, PAPER: paper},
    )


def available_importance_sampling_levels(with_aliases: bool = False) -> list[str]:
    """Names accepted by `importance_sampling_level`."""
    return IMPORTANCE_SAMPLERS.names(with_aliases)


@register_importance_sampling(
    "token", zero_advantage_rows_contribute_nothing=True, paper="https://arxiv.org/abs/1707.06347"
)
def token_level_log_weights(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log w[i,t] = logp[i,t] - old_logp[i,t]  (PPO / GRPO)."""
    return log_ratio


@register_importance_sampling(
    "sequence", zero_advantage_rows_contribute_nothing=True, paper="https://arxiv.org/abs/2507.18071"
)
def sequence_level_log_weights(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log w[i] = sum_t m*(logp - old_logp) / sum_t m, shape (B, 1)  (GSPO)."""
    return sequence_mean(log_ratio, mask)


@register_importance_sampling(
    "sequence_token", zero_advantage_rows_contribute_nothing=True, paper="https://arxiv.org/abs/2507.18071"
)
def sequence_token_log_weights(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log w[i,t] = sg(log w[i]) + logp[i,t] - sg(logp[i,t]): GSPO's value, each token's own gradient (GSPO-token)."""
    return sequence_mean(log_ratio, mask).detach() + (log_ratio - log_ratio.detach())
