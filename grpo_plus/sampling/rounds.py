"""A training generation batch's rounds in a GRPOTrainer: which prompts each round generates from (selective rollout's
draw, GRESO), the refill rounds that keep dynamic sampling's batch full of informative groups (DAPO), and TRL's buffer
of micro-batches refilled with whole groups.

Every process holds the same selective-rollout history (it learns from the rewards TRL gathers from all processes) and
iterates the same refill stream, draws the same global batch, then takes its slice (`local_rows`). The trainer hands in
TRL's generation and scoring of a round (`score_round`), the gathered rewards of the round just scored
(`round_rewards`) and its accelerator (the collectives); nothing here reads the trainer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..compat.loss import split_tensor_dict
from .dynamic_sampling import DynamicSampling, shuffle_groups
from .selective_rollout import Draw, SelectiveRollout


@dataclass(frozen=True)
class BatchLayout:
    """How a generation batch is laid out: `num_generations` completions per prompt, split into `steps_per_generation`
    micro-batches, each used `num_iterations` times; `pad_token_id` pads the rounds stitched together."""

    num_generations: int
    steps_per_generation: int
    num_iterations: int
    pad_token_id: int | None


def local_rows(dataset: Sequence, rows: list[int], num_rows: int, process_index: int) -> list[dict[str, Any]]:
    """This process's `num_rows` dataset rows of a draw that spans all processes."""
    start = process_index * num_rows
    return [dataset[i] for i in rows[start : start + num_rows]]


def buffered_by_group(
    step: int, buffered: list[dict] | None, generate: Callable[[], dict[str, Any]], layout: BatchLayout
) -> list[dict[str, Any]]:
    """TRL's buffer of micro-batches (`_buffered_inputs` at micro-step `step`), refilled when TRL refills it but shuffling
    whole groups, so that no micro-batch holds part of a group (dynamic sampling drops and refills whole groups)."""
    if step % (layout.steps_per_generation * layout.num_iterations) == 0 or buffered is None:
        batch = shuffle_groups(generate(), layout.num_generations)
        buffered = split_tensor_dict(batch, layout.steps_per_generation)
    return buffered


def generation_batch(
    inputs: list[dict[str, Any]],
    score_round: Callable[[list[dict[str, Any]]], dict[str, Any]],
    round_rewards: Callable[[], torch.Tensor],
    dataset: Sequence,
    layout: BatchLayout,
    dynamic: DynamicSampling | None,
    selective: SelectiveRollout | None,
    accelerator: Any,
    accumulation_steps: int,
    metrics: dict[str, list],
) -> dict[str, Any]:
    """One training generation batch of `len(inputs)` rows on this process: its prompts drawn by selective rollout (the
    dataset row index is the prompt's identity, so reward functions see the rows unchanged), generated and scored
    (`score_round(rows)`: TRL's round, this process's rows), the history updated from each round's rewards; with
    dynamic sampling, zero-variance groups dropped and refill rounds generated until the batch is full or the round
    limit hits. Their metrics go to `metrics` (`accumulation_steps`: the trainer's current ones)."""
    num_rows, num_generations = len(inputs), layout.num_generations
    process_index, num_processes = accelerator.process_index, accelerator.num_processes

    def selective_prompts() -> tuple[list[dict[str, Any]], Draw]:
        """A selective draw (predicted-dead prompts skipped, the round kept full), this process's rows of it."""
        draw = selective.draw(num_rows * num_processes // num_generations)
        return local_rows(dataset, draw.rows(num_generations), num_rows, process_index), draw

    def refill_prompts() -> tuple[list[dict[str, Any]], Draw | None]:
        if selective is not None:
            return selective_prompts()
        prompts_per_draw = num_rows // num_generations * num_processes
        return local_rows(dataset, dynamic.refill_rows(prompts_per_draw), num_rows, process_index), None

    def scored(rows: list[dict[str, Any]], draw: Draw | None) -> dict[str, Any]:
        output = score_round(rows)
        if draw is not None:  # the history learns from every round
            selective.record(draw, round_rewards(), num_generations)
        return output

    output = scored(*selective_prompts()) if selective is not None else scored(inputs, None)
    if dynamic is not None:
        device = accelerator.device
        output, stats = dynamic.collect(
            output,
            wanted=num_rows // num_generations,
            process_index=process_index,
            round_rewards=round_rewards,
            next_round=lambda: scored(*refill_prompts()),
            fewest_across_processes=lambda n: int(accelerator.gather(torch.tensor([n], device=device)).min()),
            loss_tokens_across_processes=lambda mask: accelerator.gather(mask.sum()).sum(),
            pad_token_id=layout.pad_token_id,
            micro_batches=layout.steps_per_generation,
        )
        per_step = layout.steps_per_generation * layout.num_iterations / accumulation_steps
        dynamic.log(stats, metrics, per_step, num_processes)
    if selective is not None:
        for name, value in selective.end_batch().items():
            metrics[f"selective_rollout/{name}"].append(value)
    return output
