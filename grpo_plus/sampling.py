"""DAPO dynamic sampling helpers: find informative groups, stitch rounds of generations, shuffle by group."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .advantages import nanstd

# Generation-batch keys by how they pad when rounds of different lengths are concatenated.
_LEFT_PADDED = {"prompt_ids": "pad", "prompt_mask": 0}
_RIGHT_PADDED = {
    "completion_ids": "pad",
    "completion_mask": 0,
    "old_per_token_logps": 0.0,
    "ref_per_token_logps": 0.0,
    "sampling_per_token_logps": 0.0,
    "importance_sampling_ratio": 0.0,
    "tool_mask": 1,
}
_PER_ROW = {"advantages"}
_RECOMPUTED = {"num_items_in_batch"}


def informative_groups(rewards: torch.Tensor, num_generations: int, min_std: float) -> torch.Tensor:
    """(num_groups,) bool: True where the group's reward std exceeds `min_std` (NaN rewards ignored).

    A group with fewer than two scorable rewards has no std and counts as uninformative.
    """
    std = nanstd(rewards.view(-1, num_generations), dim=1)
    return torch.nan_to_num(std, nan=0.0) > min_std


def group_rows(group_mask: torch.Tensor, num_generations: int) -> torch.Tensor:
    """Row indices of the groups selected by `group_mask`."""
    return group_mask.repeat_interleave(num_generations).nonzero().squeeze(1)


def _check_keys(batch: dict[str, Any]) -> None:
    unknown = set(batch) - set(_LEFT_PADDED) - set(_RIGHT_PADDED) - _PER_ROW - _RECOMPUTED
    if unknown:
        raise NotImplementedError(
            f"dynamic_sampling supports text-only generation batches; it cannot stitch {sorted(unknown)}."
        )


def select_rows(batch: dict[str, Any], rows: torch.Tensor) -> dict[str, Any]:
    """The given rows of every per-row tensor; scalars are dropped (they are recomputed after stitching)."""
    _check_keys(batch)
    return {k: v[rows.to(v.device)] for k, v in batch.items() if k not in _RECOMPUTED and v is not None}


def _pad_to(tensor: torch.Tensor, length: int, value: float, left: bool) -> torch.Tensor:
    missing = length - tensor.shape[1]
    if missing <= 0:
        return tensor
    padding = tensor.new_full((tensor.shape[0], missing), value)
    return torch.cat([padding, tensor] if left else [tensor, padding], dim=1)


def concat_rows(batches: Sequence[dict[str, Any]], pad_token_id: int) -> dict[str, Any]:
    """Concatenate generation batches row-wise, padding prompts on the left and completions on the right."""
    batches = [b for b in batches if b]
    pad_values = {**_LEFT_PADDED, **_RIGHT_PADDED}
    merged: dict[str, Any] = {}
    for key in batches[0]:
        tensors = [b[key] for b in batches]
        # Per-token tensors are padded; per-sequence ones, e.g. a (B, 1) sequence-level ratio, are not.
        per_token = key in _LEFT_PADDED or all(
            t.dim() == 2 and t.shape[1] == b["completion_ids"].shape[1] for t, b in zip(tensors, batches, strict=True)
        )
        if key in pad_values and per_token:
            value = pad_token_id if pad_values[key] == "pad" else pad_values[key]
            length = max(t.shape[1] for t in tensors)
            tensors = [_pad_to(t, length, value, left=key in _LEFT_PADDED) for t in tensors]
        merged[key] = torch.cat(tensors, dim=0)
    return merged


def shuffle_groups(batch: dict[str, Any], num_generations: int) -> dict[str, Any]:
    """Permute whole groups (not rows), so splitting into micro-batches never cuts a group."""
    num_rows = batch["completion_ids"].shape[0]
    order = torch.randperm(num_rows // num_generations)
    rows = (order.unsqueeze(1) * num_generations + torch.arange(num_generations)).reshape(-1)
    return {k: (v[rows.to(v.device)] if isinstance(v, torch.Tensor) and v.dim() > 0 else v) for k, v in batch.items()}


def refill_prompts(dataset, num_generations: int, prompts_per_draw: int, seed: int) -> Iterator[list[int]]:
    """Endless draws of dataset indices, each prompt repeated `num_generations` times, reshuffled every pass.

    Every process iterates the same sequence (same seed) and takes its own slice of each draw.
    """
    generator = torch.Generator().manual_seed(seed)
    pending: list[int] = []
    while True:
        while len(pending) < prompts_per_draw:
            pending += torch.randperm(len(dataset), generator=generator).tolist()
        draw, pending = pending[:prompts_per_draw], pending[prompts_per_draw:]
        yield [index for index in draw for _ in range(num_generations)]
