"""DAPO dynamic sampling: find informative groups, generate refill rounds, stitch them, shuffle by group."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..objective.common import nanstd
from ..settings import ConfigError
from .settings import DynamicSamplingSettings

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
    "routes": -1,  # routing replay's records (rows, completion columns, layers, k): -1, no record
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


def image_columns(dataset: Any) -> list[str]:
    """The columns of `dataset` TRL reads pictures from ("image", "images"), as its `_generate_and_score_completions`
    looks them up in each row."""
    columns = getattr(dataset, "column_names", None) or []
    return [name for name in ("image", "images") if name in columns]


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
    padding = tensor.new_full((tensor.shape[0], missing, *tensor.shape[2:]), value)
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
            t.dim() >= 2 and t.shape[1] == b["completion_ids"].shape[1] for t, b in zip(tensors, batches, strict=True)
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


def refill_prompts(dataset_size: int, num_generations: int, prompts_per_draw: int, seed: int) -> Iterator[list[int]]:
    """Endless draws of dataset indices, each prompt repeated `num_generations` times, reshuffled every pass.

    Every process iterates the same sequence (same seed) and takes its own slice of each draw.
    """
    generator = torch.Generator().manual_seed(seed)
    pending: list[int] = []
    while True:
        while len(pending) < prompts_per_draw:
            pending += torch.randperm(dataset_size, generator=generator).tolist()
        draw, pending = pending[:prompts_per_draw], pending[prompts_per_draw:]
        yield [index for index in draw for _ in range(num_generations)]


class DynamicSampling:
    """Fills one generation batch with informative groups: keeps each round's informative groups, asks for refill
    rounds until every process holds enough (or `max_rounds`), and stitches what it kept.

    The trainer supplies the rounds (TRL's generation and scoring) and the collectives; this class holds the refill
    stream, which every process iterates alike (same seed) taking its own slice, and whose position is training
    state (`refill_draws_made`, checkpointed through the stateful-part protocol of grpo_plus.run.state, so a
    resumed run continues the stream).
    """

    checkpoint_name = "dynamic_sampling"
    version = 1

    @classmethod
    def for_dataset(cls, settings: DynamicSamplingSettings, dataset: Any, num_generations: int,
                    seed: int) -> DynamicSampling | None:  # fmt: skip
        """The trainer's dynamic sampling over `dataset` (its refill prompts), or None when the settings leave it off."""
        from datasets import IterableDataset

        if not settings.enabled:
            return None
        if isinstance(dataset, IterableDataset):
            raise ValueError("dynamic_sampling=True needs a map-style train_dataset to draw refill prompts from.")
        pictures = image_columns(dataset)
        if pictures:  # fail here, not at the first step's stitching (`_check_keys`)
            raise ConfigError(
                f"dynamic_sampling=True does not support image prompts yet: the train_dataset's "
                f"{' and '.join(repr(c) for c in pictures)} column{'s' if len(pictures) > 1 else ''} give the "
                "generation batches pixel values and image grids, which refill rounds are not stitched with. Set "
                "dynamic_sampling=False (zero-variance groups then add no gradient, and grpo_plus's zero-waste pass "
                "skips their rows), or train on prompts without images."
            )
        return cls(settings, len(dataset), num_generations, seed=seed)

    @staticmethod
    def log(stats: dict[str, float], metrics: dict[str, list], per_step: float, num_processes: int) -> None:
        """A generation batch's `collect` statistics as the trainer logs them: generation calls per optimizer step
        (`per_step` generation batches to a step), groups trained over every process."""
        metrics["dynamic_sampling/generation_calls_per_step"].append(stats["rounds"] / per_step)
        stats = {**stats, "trained_groups": stats["trained_groups_per_process"] * num_processes}
        del stats["trained_groups_per_process"]
        for name, value in stats.items():
            metrics[f"dynamic_sampling/{name}"].append(value)

    def __init__(self, settings: DynamicSamplingSettings, dataset_size: int, num_generations: int, seed: int):
        self.settings, self.dataset_size, self.num_generations, self.seed = (
            settings,
            dataset_size,
            num_generations,
            seed,
        )
        self.refill_draws_made = 0
        self._draws: Iterator[list[int]] | None = None

    def state_dict(self) -> dict[str, Any]:
        """Where the refill stream stands (the stream itself is a function of the seed)."""
        return {"version": self.version, "refill_draws": self.refill_draws_made}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the refill stream where a checkpointed run stood."""
        if state.get("version") != self.version:
            raise ValueError(
                f"unknown dynamic-sampling state version {state.get('version')!r} (this grpo_plus reads 1)"
            )
        refill_draws = state.get("refill_draws")
        if not isinstance(refill_draws, int) or isinstance(refill_draws, bool) or refill_draws < 0:
            raise ValueError(f"refill_draws must be an integer >= 0, found {refill_draws!r}")
        self._draws, self.refill_draws_made = None, refill_draws

    def refill_rows(self, prompts_per_draw: int) -> list[int]:
        """Dataset rows of the next refill draw over all processes, each prompt `num_generations` times."""
        if self._draws is None:
            self._draws = refill_prompts(self.dataset_size, self.num_generations, prompts_per_draw, self.seed)
            for _ in range(self.refill_draws_made):
                next(self._draws)
        self.refill_draws_made += 1
        return next(self._draws)

    def collect(
        self,
        first_round: dict[str, Any],
        wanted: int,
        process_index: int,
        round_rewards: Callable[[], torch.Tensor],
        next_round: Callable[[], dict[str, Any]],
        fewest_across_processes: Callable[[int], int],
        loss_tokens_across_processes: Callable[[torch.Tensor], torch.Tensor],
        pad_token_id: int,
        micro_batches: int,
    ) -> tuple[dict[str, Any], dict[str, float]]:
        """(this process's generation batch, metrics). `wanted` groups per process; `round_rewards()` are the
        gathered rewards (all processes) of the round just scored; every process trains the same number of whole
        groups, a multiple of `micro_batches`. With nothing informative enough, the first round trains, as in TRL."""
        num_generations = self.num_generations
        kept, kept_groups, filtered, seen, rounds, batch = [], 0, 0, 0, 0, first_round
        while True:
            rounds += 1
            informative = informative_groups(round_rewards(), num_generations, self.settings.min_std)
            local = informative[process_index * wanted : (process_index + 1) * wanted]
            if rounds == 1:
                first_round_informative = informative.float().mean().item()
            kept.append(select_rows(batch, group_rows(local, num_generations)))
            kept_groups += int(local.sum())
            filtered, seen = filtered + int((~informative).sum()), seen + informative.numel()
            fewest = fewest_across_processes(kept_groups)  # collective: every process runs the same rounds
            if fewest >= wanted or rounds >= self.settings.max_rounds:
                break
            batch = next_round()

        usable = min(fewest, wanted)
        usable -= usable % micro_batches
        if usable == 0:
            output, trained_informative = first_round, first_round_informative
        else:
            output = concat_rows(kept, pad_token_id)
            output = {k: v[: usable * num_generations] for k, v in output.items()}
            output["num_items_in_batch"] = loss_tokens_across_processes(
                output["completion_mask"] * output.get("tool_mask", 1)
            )
            trained_informative = 1.0
        metrics = {
            "rounds": rounds,
            "groups_filtered": filtered,
            "filtered_frac": filtered / seen,
            "trained_groups_per_process": usable,
            "short_batch": float(usable < wanted),
            "trained_informative_frac": trained_informative,
        }
        return output, metrics
