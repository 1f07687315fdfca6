"""Inputs for the pure-torch policy loss (grpo_plus.objective.compute_policy_loss): ragged masks, log-prob drift and
advantage signs chosen per test, the rest drawn from a seeded generator."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from grpo_plus.objective import compute_policy_loss


class PolicyLossInputs(NamedTuple):
    logps: torch.Tensor  # (B, T)
    old_logps: torch.Tensor  # (B, T)
    ref_logps: torch.Tensor  # (B, T)
    advantages: torch.Tensor  # (B,), or (B, T) per token
    mask: torch.Tensor  # (B, T), 0/1 (long)


def policy_loss_inputs(
    lengths: Sequence[int],
    width: int,
    seed: int = 0,
    *,
    logps_scale: float = 3.0,
    drift: float | Sequence[float] = 0.0,
    drift_noise: float = 0.3,
    ref_noise: float = 0.3,
    advantage_signs: Sequence[float] | None = None,
    advantage_floor: float = 0.0,
    per_token_advantages: bool = False,
    dtype: torch.dtype = torch.float64,
) -> PolicyLossInputs:
    """len(lengths) rows of `width` positions, the first lengths[i] of row i unmasked.

    logps ~ U(-logps_scale, 0); logps - old_logps = drift (one number, or one per row: it sets how far each row's
    ratio leaves 1) + drift_noise * N(0, 1) per token; ref_logps = logps + ref_noise * N(0, 1). One advantage per row,
    N(0, 1), or with `advantage_signs` that sign times advantage_floor + |N(0, 1)|. `per_token_advantages` scales each
    row's advantage per token by U(0.5, 1.5) and flips the sign of every third token from the second on."""
    generator = torch.Generator().manual_seed(seed)
    rows = len(lengths)

    def normal(*shape):
        return torch.randn(*shape, generator=generator, dtype=dtype)

    logps = -logps_scale * torch.rand(rows, width, generator=generator, dtype=dtype)
    row_drift = torch.as_tensor(drift, dtype=dtype).reshape(-1, 1)
    old_logps = logps - row_drift - drift_noise * normal(rows, width)
    ref_logps = logps + ref_noise * normal(rows, width)
    advantages = normal(rows)
    if advantage_signs is not None:
        advantages = torch.tensor(advantage_signs, dtype=dtype) * (advantage_floor + advantages.abs())
    if per_token_advantages:
        advantages = advantages.unsqueeze(1) * (0.5 + torch.rand(rows, width, generator=generator, dtype=dtype))
        advantages[:, 1::3] *= -1
    mask = (torch.arange(width).unsqueeze(0) < torch.as_tensor(lengths).unsqueeze(1)).long()
    return PolicyLossInputs(logps, old_logps, ref_logps, advantages, mask)


def policy_loss_and_grad(logps, old_logps, advantages, mask, **settings):
    """compute_policy_loss(logps, ...) and its backward: (the loss output, d loss / d logps)."""
    leaf = logps.detach().clone().requires_grad_()
    out = compute_policy_loss(leaf, old_logps, advantages, mask, **settings)
    out.loss.backward()
    return out, leaf.grad
