"""verl's rollout correction in a GRPOTrainer (`rollout_is`, `rollout_rs`, `rollout_correction`, ...; its settings and
presets: `algorithms.settings`): where the old log-probs come from, and the IS weights and rejection mask handed to the
loss.

The formulas are the core's (`grpo_plus.objective.rollout_corr`); `trainer.py` wires this in. The sampler must report
the log-probs of the tokens it sampled: TRL's `sampling_per_token_logps` (vLLM, or a `rollout_func` returning
"logprobs"). Two modes, verl's:

- decoupled (three policies: the sampler's, the old one, the current one; the default): at generation, over the whole
  generation batch of every process, the correction compares the trainer's old log-probs (TRL's `old_per_token_logps`,
  computed by a no-grad pass over every row where TRL computed none) with the sampler's. The generation batch then
  holds the IS weights (`rollout_is_weights`, (B, T)) and the mask after rejection (`rollout_response_mask`, the
  completion mask times TRL's tool mask times the rejection), with `num_items_in_batch` recounted over it, as verl
  counts its token-mean over the mask after rejection. The loss multiplies the policy term by the weights and
  aggregates over that mask. The metrics are logged once per generation batch. On-policy (no optimizer step between
  generation and the loss) without rejection or batch normalization, the old log-probs are the training forward's and
  no pass runs: each micro-batch's weights come from its forward (`OnPolicyCorrection`, which does the same for TRL's
  own vLLM correction).
- bypass (`rollout_bypass_mode`, verl's `bypass_mode`; two policies): the sampler's log-probs are the old policy, so no
  old-log-prob pass runs. In each micro-batch the correction compares the training forward's log-probs (detached)
  with the sampler's: the mask after rejection goes to the loss (`num_items_in_batch` keeps its count, as verl's);
  the IS weights multiply the policy term of `policy_loss="gpg"` (verl's REINFORCE, `loss_type="reinforce"`), a loss
  with a ratio being corrected by its ratio pi_theta / pi_rollout (verl's `loss_type="ppo_clip"`). The metrics are
  logged per micro-batch, averaged over processes; where the zero-waste pass may leave zero-advantage rows out of the
  forward they cover the rows it computed and are logged as `rollout_corr/trained_rows/<name>`.

A sampler log-prob that is NaN (vLLM could not score the token; TRL keeps it as NaN) counts as equal to the trainer's
there: ratio 1, never rejected, as TRL's own correction treats it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..compat.loss import (
    SAMPLER_LOGPS_KEY,
    TRL_SAMPLER_METRICS,
    TRLSamplerCorrection,
    trl_sampler_metric_values,
    trl_sampler_ratio,
)
from ..objective.rollout_corr import (
    METRIC_PREFIX,
    rollout_correction,
)
from .settings import POLICY_GRADIENT, RolloutCorrectionSettings

TRAINED_ROWS_PREFIX = METRIC_PREFIX + "trained_rows/"
# Generation-batch keys this module adds (per row, (B, T)).
WEIGHTS_KEY, MASK_KEY = "rollout_is_weights", "rollout_response_mask"


# ---- the correction in a run -------------------------------------------------------------------------------------


@dataclass
class LossInputs:
    """What one micro-batch's loss takes from the correction: the old log-probs, the IS weights multiplying the policy
    term (None: none) and the mask to aggregate over."""

    old_logps: torch.Tensor
    weights: torch.Tensor | None
    mask: torch.Tensor


def sampler_logps(inputs: Mapping[str, Any]) -> torch.Tensor:
    """TRL's `sampling_per_token_logps`, or a clear error where the sampler reported none."""
    logps = inputs.get(SAMPLER_LOGPS_KEY)
    if logps is None:
        raise ValueError(
            "The rollout correction needs the sampler's log-probs of the tokens it sampled, and this generation "
            "batch has none (TRL's `sampling_per_token_logps`): generate with vLLM (use_vllm=True) or with a "
            "`rollout_func` that returns them under 'logprobs'."
        )
    return logps


def sampler_blocker(use_vllm: bool, has_rollout_func: bool) -> str | None:
    """Why this run's sampler reports no per-token log-probs for the correction to compare, or None."""
    if use_vllm or has_rollout_func:
        return None
    return (
        "the rollout correction compares the sampler's per-token log-probs with the trainer's, and transformers' "
        "generation reports none (it samples from the trainer's own weights): generate with vLLM (use_vllm=True) or "
        "with a `rollout_func` that returns 'logprobs'"
    )


def where_known(sampled: torch.Tensor, trainer_logps: torch.Tensor) -> torch.Tensor:
    """The sampler's log-probs, the trainer's where the sampler's are NaN (unscored: ratio 1 there, as TRL's)."""
    return torch.where(torch.isnan(sampled), trainer_logps, sampled)


class RolloutCorrector:
    """One run's rollout correction. `settings` after validation; `policy_loss` the run's (bypass applies the IS
    weights to 'gpg' only); `trained_rows_only`: the zero-waste pass may leave zero-advantage rows out of the training
    forward (bypass metrics then cover the computed rows, under `rollout_corr/trained_rows/`)."""

    def __init__(self, settings: RolloutCorrectionSettings, policy_loss: str, trained_rows_only: bool = False):
        self.settings = settings
        self.options = settings.options()
        self.weights_in_loss = settings.decoupled or policy_loss == POLICY_GRADIENT
        self.prefix = TRAINED_ROWS_PREFIX if settings.bypass and trained_rows_only else METRIC_PREFIX
        # The names the correction reports with these settings (they depend on nothing else): bypass logs them from
        # every process in the same order, NaN where a process had nothing to judge.
        one = torch.zeros(1, 1)
        self.metric_names = tuple(rollout_correction(one, one, torch.ones(1, 1), **self.options).metrics)

    @property
    def active(self) -> bool:
        return self.settings.active

    @property
    def bypass(self) -> bool:
        return self.settings.bypass

    @property
    def decoupled(self) -> bool:
        return self.settings.decoupled

    # ---- decoupled: once per generation batch ---------------------------------------------------------------------

    def correct_generation_batch(
        self,
        output: dict[str, Any],
        old_logps_pass: Callable[[], torch.Tensor],
        gather_rows: Callable[[torch.Tensor], torch.Tensor],
        process_index: int,
        count_tokens: Callable[[torch.Tensor], torch.Tensor],
        metrics: dict[str, list],
    ) -> dict[str, Any]:
        """Decoupled mode: the generation batch with the old log-probs (TRL's, else `old_logps_pass()`), the IS
        weights and the mask after rejection, computed over every process's rows (`gather_rows` pads a (B, T) tensor
        across processes and stacks them; this process's rows follow `process_index`); the metrics appended to
        `metrics`. `count_tokens(mask)` is TRL's `num_items_in_batch` for a loss mask."""
        sampled = sampler_logps(output)
        old = output.get("old_per_token_logps")
        old = old_logps_pass() if old is None else old
        mask = output["completion_mask"] * output.get("tool_mask", 1)
        rollout = where_known(sampled, old)
        every_old, every_rollout, every_mask = gather_rows(old), gather_rows(rollout), gather_rows(mask)
        output = {**output, "old_per_token_logps": old}
        if not bool(every_mask.any()):  # no completion token anywhere: nothing to correct or measure
            return output
        result = rollout_correction(every_old, every_rollout, every_mask, **self.options)
        rows, width = slice(process_index * mask.shape[0], (process_index + 1) * mask.shape[0]), mask.shape[1]
        if result.weights is not None:
            output[WEIGHTS_KEY] = result.weights[rows, :width]
        if self.settings.rollout_rs is not None:
            corrected = result.response_mask[rows, :width]
            output[MASK_KEY] = corrected
            output["num_items_in_batch"] = count_tokens(corrected)
        for name, value in result.metrics.items():
            metrics[name].append(value)
        return output

    def log_metrics(
        self, old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, metrics: dict[str, list], prefix: str
    ) -> None:
        """verl's metrics of every process's rows (`old`, `rollout`, `mask`: (B, T)) under `prefix`; none without a
        token."""
        if bool(mask.any()):
            for name, value in rollout_correction(old, rollout, mask, **self.options).metrics.items():
                metrics[prefix + name.removeprefix(METRIC_PREFIX)].append(value)

    # ---- in the loss: every micro-batch -------------------------------------------------------------------------

    def loss_inputs(
        self,
        logps: torch.Tensor,
        inputs: Mapping[str, Any],
        mask: torch.Tensor,
        computed_rows: torch.Tensor | None,
        reduce_sum: Callable[[torch.Tensor], torch.Tensor],
        metrics: dict[str, list],
    ) -> LossInputs:
        """The micro-batch's old log-probs, IS weights and loss mask. Decoupled: read from the generation batch.
        Bypass: the sampler's log-probs are the old ones; the correction compares them with `logps` (detached) over
        the `computed_rows` (None: every row), its mask replacing theirs, its weights applied to 'gpg'; metrics
        averaged over processes with `reduce_sum` (called the same number of times on every process)."""
        if self.decoupled:
            old = inputs.get("old_per_token_logps")
            old = logps.detach() if old is None else old
            return LossInputs(old, inputs.get(WEIGHTS_KEY), inputs.get(MASK_KEY, mask))
        current = logps.detach()
        old = where_known(sampler_logps(inputs), current)
        judged = mask if computed_rows is None else mask * computed_rows.unsqueeze(1).to(mask.dtype)
        normalize = self.settings.rollout_is_batch_normalize and self.settings.rollout_is is not None
        if not bool(judged.any()):  # nothing to judge here; other processes may still reduce (kept in step)
            if normalize:
                zero = torch.zeros((), device=logps.device)
                reduce_sum(zero), reduce_sum(zero)
            self._log_mean(dict.fromkeys(self.metric_names, math.nan), reduce_sum, metrics, logps.device)
            return LossInputs(old, None, mask)
        result = rollout_correction(
            current, old, judged, **self.options, all_reduce_sum=reduce_sum if normalize else None
        )
        corrected, measured = result.response_mask, result.metrics
        if computed_rows is not None:  # rows left out of the forward keep their mask (their advantage is 0)
            corrected = torch.where(computed_rows.unsqueeze(1), corrected, mask)
            # and stay out of the per-row metrics (perplexities, sequence weights), which would count them as empty rows
            rows = computed_rows
            measured = rollout_correction(current[rows], old[rows], judged[rows], **self.options).metrics
        self._log_mean(measured, reduce_sum, metrics, logps.device)
        return LossInputs(old, result.weights if self.weights_in_loss else None, corrected)

    def _log_mean(
        self, values: dict[str, float], reduce_sum: Callable, metrics: dict[str, list], device: torch.device
    ) -> None:
        """Append each value's mean over the processes that know it (NaN: unknown here) under this run's prefix."""
        names = self.metric_names
        known = torch.tensor([values[name] for name in names], dtype=torch.float32)
        totals = torch.stack([torch.nan_to_num(known, nan=0.0), (~torch.isnan(known)).to(known.dtype)])
        total, count = reduce_sum(totals.to(device)).tolist()
        for name, value, weight in zip(names, total, count, strict=True):
            metrics[self.prefix + name.removeprefix(METRIC_PREFIX)].append(value / weight if weight else math.nan)


# ---- on-policy: the correction from the training forward ------------------------------------------------------------


class GenerationBatchRows:
    """One generation batch's values as its `parts` micro-batches reach the loss: `add` keeps each micro-batch's tensors
    (first dimension: rows or values) and returns them concatenated once the last part is in. Later calls (the batch's
    further iterations with `num_iterations > 1`, at the same weights, so the same values) return None: counted once."""

    def __init__(self, parts: int):
        self.parts = parts
        self._kept: list[dict[str, torch.Tensor]] = []

    def add(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        if len(self._kept) >= self.parts:
            return None
        self._kept.append({key: value.detach() for key, value in tensors.items()})
        if len(self._kept) < self.parts:
            return None
        return {key: torch.cat([part[key] for part in self._kept]) for key in self._kept[0]}


class OnPolicyCorrection:
    """The sampler correction of a generation batch from the training forward, where training is on-policy (no
    optimizer step between generation and the loss, so the old log-probs are the training forward's, detached): the
    no-grad old-log-prob pass at generation does not run. Either TRL's vLLM correction (`trl`: its ratio in its four
    modes, handed to the loss as TRL's `importance_sampling_ratio`, and its `sampling/*` metrics) or the decoupled
    rollout correction of `corrector` (its IS weights; not with rejection or batch normalization, which need every row
    before the first micro-batch's loss: `RolloutCorrectionSettings.in_loss_blocker`).

    Both weights are per row (token or sequence), so each micro-batch's equal the pass's. The metrics summarize the
    whole generation batch: its values are kept micro-batch by micro-batch and the metrics computed once the last is in
    (`start(parts)`), over every process as TRL and the decoupled pass compute them. With `trained_rows_only` (the
    zero-waste pass may leave zero-advantage rows out of the forward) they cover the rows it computed and say so:
    `sampling/trained_rows/...`, `rollout_corr/trained_rows/...`; a left-out row's ratio is 1 (its loss is 0)."""

    def __init__(self, corrector: RolloutCorrector, trl: TRLSamplerCorrection, trained_rows_only: bool):
        self.corrector, self.trl, self.trained_rows_only = corrector, trl, trained_rows_only
        self.rows: GenerationBatchRows | None = None

    @property
    def active(self) -> bool:
        """Whether the current generation batch is corrected in the loss."""
        return self.rows is not None

    def start(self, parts: int | None) -> None:
        """A new generation batch: corrected in the loss over its `parts` micro-batches, or (None) at generation."""
        self.rows = None if parts is None else GenerationBatchRows(parts)

    def loss_inputs(
        self,
        logps: torch.Tensor,
        inputs: Mapping[str, Any],
        mask: torch.Tensor,
        computed_rows: torch.Tensor | None,
        gather: Callable[[torch.Tensor], torch.Tensor],
        gather_rows: Callable[[torch.Tensor], torch.Tensor],
        metrics: dict[str, list],
    ) -> tuple[dict[str, Any], LossInputs]:
        """(the micro-batch, TRL's ratio added for TRL's correction; its old log-probs, IS weights and loss mask).
        `computed_rows` as in `RolloutCorrector.loss_inputs`; `gather` stacks a scalar of every process, `gather_rows`
        pads a (B, T) tensor across processes and stacks them (called on every process at the same micro-batch)."""
        current = logps.detach()
        if self.corrector.decoupled:
            weights = self._rollout_weights(current, inputs, mask, computed_rows, gather_rows, metrics)
            return dict(inputs), LossInputs(current, weights, mask)
        ratio = self._trl_ratio(current, inputs, mask, computed_rows, gather, metrics)
        return {**inputs, "importance_sampling_ratio": ratio}, LossInputs(current, None, mask)

    def _trl_ratio(self, current, inputs, mask, computed_rows, gather, metrics) -> torch.Tensor:
        sampled, trl = sampler_logps(inputs), self.trl
        ratio = trl_sampler_ratio(current, sampled, mask, trl.mode, trl.clip_min, trl.clip_max)
        if computed_rows is not None:  # left out of the forward: zero advantage, nothing to correct
            ratio = torch.where(computed_rows.unsqueeze(1), ratio, torch.ones_like(ratio))
        batch = self.rows.add(trl_sampler_metric_values(current, sampled, mask, ratio, trl.mode, computed_rows))
        if batch is not None:
            unknown = math.nan if self.trained_rows_only else 0.0  # TRL's 0 where a process has no token
            for name, key, statistic, reduction in TRL_SAMPLER_METRICS:
                values = batch[key]
                value = statistic(values) if values.numel() else values.new_tensor(unknown)
                if self.trained_rows_only:
                    name = name.replace("sampling/", "sampling/trained_rows/", 1)
                metrics[name].append(reduction(gather(value)).item())
        return ratio

    def _rollout_weights(self, current, inputs, mask, computed_rows, gather_rows, metrics) -> torch.Tensor | None:
        corrector = self.corrector
        rollout = where_known(sampler_logps(inputs), current)
        judged = mask if computed_rows is None else mask * computed_rows.unsqueeze(1).to(mask.dtype)
        weights = None
        if corrector.settings.rollout_is is not None and bool(judged.any()):
            weights = rollout_correction(current, rollout, judged, **corrector.options).weights
        computed = torch.ones_like(mask[:, :1]) if computed_rows is None else computed_rows.unsqueeze(1).to(mask.dtype)
        batch = self.rows.add({"old": current, "rollout": rollout, "mask": judged, "computed": computed})
        if batch is not None:  # the rows the forward computed, of every process (a row left out is no empty row)
            every = {key: gather_rows(value) for key, value in batch.items()}
            rows = every["computed"][:, 0].bool()
            prefix = TRAINED_ROWS_PREFIX if self.trained_rows_only else METRIC_PREFIX
            corrector.log_metrics(every["old"][rows], every["rollout"][rows], every["mask"][rows], metrics, prefix)
        return weights
