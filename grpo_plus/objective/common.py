"""What the axes of the objective share: the traits their registrars declare, masked and NaN-aware reductions."""

from __future__ import annotations

import warnings

import torch

# Trait of policy losses, loss types and importance samplers: a row whose advantage is 0 adds nothing to the loss or its
# gradient, so the trainer may leave such rows out of the training forward (grpo_plus.zero_waste.rows).
ZERO_ADVANTAGE_ROWS_CONTRIBUTE_NOTHING = "zero_advantage_rows_contribute_nothing"
# Trait of policy losses: splitting a batch into micro-batches and/or processes leaves the summed gradient unchanged
# (each row's loss depends on that row alone). Aggregation decides the rest (bnpo is not split-invariant).
SPLIT_INVARIANT = "split_invariant"
# Trait of every built-in: the paper (or note) the formula comes from, shown by `grpo-plus list`.
PAPER = "paper"

# Messages already warned about in this process: the loss runs every micro-batch, its warnings are shown once.
WARNED_ONCE: set[str] = set()


def warn_once(message: str, stacklevel: int = 2) -> None:
    """`warnings.warn(message)` the first time this process sees `message`."""
    if message not in WARNED_ONCE:
        WARNED_ONCE.add(message)
        warnings.warn(message, UserWarning, stacklevel=stacklevel + 1)


def sequence_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked mean over the last dim, (B, T) -> (B, 1); an all-masked row gives 0."""
    return ((x * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `x` over the positions where `mask` is 1 (0 when there are none)."""
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def exact_if_constant(values: torch.Tensor, mean: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """`mean` (some mean of `values` along `dim`, keepdim), replaced by the common value where every non-NaN entry is
    equal: so a group of equal rewards gets advantage exactly 0, not float noise."""
    scorable = ~torch.isnan(values)
    dims = tuple(range(values.dim())) if dim is None else dim
    highest = torch.where(scorable, values, float("-inf")).amax(dim=dims, keepdim=True)
    lowest = torch.where(scorable, values, float("inf")).amin(dim=dims, keepdim=True)
    return torch.where(highest == lowest, highest, mean)


def exact_nanmean(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """NaN-aware mean (keepdim=True) that is exactly the common value where all non-NaN values are equal.

    The plain mean of equal values is not always that value: in float32 the mean of seven 1000.1s is off by an
    ulp, and TRL 1.16 divides that by std + 1e-4, giving a zero-variance group advantages near -0.37.
    """
    return exact_if_constant(x, torch.nanmean(x, dim=dim, keepdim=True), dim)


def nanstd(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Bessel-corrected standard deviation ignoring NaN; NaN where fewer than two values remain (TRL's nanstd)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(x), dim=dim, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(count, float("nan"), dtype=x.dtype))
    std = torch.sqrt(variance * correction)
    return std if keepdim else (std.squeeze(dim) if dim is not None else std.reshape(()))
