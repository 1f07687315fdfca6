"""The policy objective composed from its axes: importance weights, policy loss, KL, aggregation (pure torch).

Shapes: B sequences, T completion positions. `mask` is 1 on tokens that count, 0 elsewhere.
With the defaults (policy_loss="ppo_clip", kl_estimator="k3") the parts reproduce TRL 1.16's
`GRPOTrainer._compute_loss` number for number.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType

import torch

from .aggregation import LOSS_TYPES, AggregationContext
from .common import warn_once
from .importance_sampling import IMPORTANCE_SAMPLERS
from .kl import KL_ESTIMATORS
from .policy_losses import (
    IMPORTANCE_SAMPLING_LEVELS,
    OPTIONS,
    POLICY_LOSSES,
    TAKES,
    ClipInputs,
    PolicyLossContext,
)


@dataclass
class PolicyLossOutput:
    """Loss, per-token loss and the detached tensors the metrics are computed from."""

    loss: torch.Tensor
    per_token_loss: torch.Tensor
    mask: torch.Tensor
    importance_weights: torch.Tensor  # (B, T) or (B, 1): exp(log w) before the two-sided bound
    is_dual_clipped: torch.Tensor | None
    per_token_kl: torch.Tensor | None  # (B, T), as added to the loss (times w when bias-corrected)
    # What the clip flags are computed from, on first use (a loss-only caller never pays for them); None for a policy
    # loss that clips no ratio (its clip_ratio/* metrics are not logged, as TRL logs none for cispo / sapo).
    clip_inputs: ClipInputs | None = field(repr=False, default=None)
    # The policy loss's own metrics: name -> detached values (B, T) or (B, 1), averaged over the mask.
    extra_metrics: Mapping[str, torch.Tensor] = field(repr=False, default_factory=lambda: MappingProxyType({}))

    @cached_property
    def is_low_clipped(self) -> torch.Tensor:
        """w below the clip range where A < 0: (B, T), or (B, 1) for per-sequence weights with per-sequence
        advantages."""
        clip = self.clip_inputs
        return (clip.bounded_weights < clip.low_bound) & (clip.advantages < 0)

    @cached_property
    def is_high_clipped(self) -> torch.Tensor:
        """w above the clip range where A > 0, shaped like `is_low_clipped`."""
        clip = self.clip_inputs
        return (clip.bounded_weights > clip.high_bound) & (clip.advantages > 0)

    def metric_totals(self) -> dict[str, torch.Tensor]:
        """name -> tensor([sum, count]); sum the tensors over processes, then divide, for a global mean.

        Per-sequence tensors (B, 1) count sequences, per-token tensors count mask tokens (TRL's convention).
        """
        totals = {}
        if self.clip_inputs is not None:
            totals["clip_ratio/low_mean"] = self.total(self.is_low_clipped)
            totals["clip_ratio/high_mean"] = self.total(self.is_high_clipped)
            totals["clip_ratio/region_mean"] = self.total(self.is_low_clipped | self.is_high_clipped)
        totals["ratio/mean"] = self.total(self.importance_weights)
        if self.is_dual_clipped is not None:
            totals["clip_ratio/dual_mean"] = self.total(self.is_dual_clipped)
        if self.per_token_kl is not None:
            totals["kl"] = self.total(self.per_token_kl)
        for name, values in self.extra_metrics.items():
            totals[name] = self.total(values)
        return totals

    def total(self, x: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """tensor([sum, count]) of per-sequence (B, 1) or per-token (B, T) values over the mask; `rows` (B,) bool
        restricts both to those rows (the rows the zero-waste pass computed)."""
        x = x.detach().to(self.per_token_loss.dtype)
        if x.shape[-1] == 1:  # one value per sequence (sequence-level weights)
            if rows is None:
                return torch.stack([x.sum(), x.new_tensor(float(x.shape[0]))])
            kept = rows.to(x.dtype).unsqueeze(1)
            return torch.stack([(x * kept).sum(), kept.sum()])
        mask = self.mask if rows is None else self.mask * rows.unsqueeze(1).to(self.mask.dtype)
        return torch.stack([(x * mask).sum(), mask.sum().to(x.dtype)])

    def sequence_clip_fractions(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Per-sequence fraction of low- and high-clipped tokens, shape (B,) each (NaN for all-masked rows); None for a
        policy loss that clips no ratio."""
        if self.clip_inputs is None:
            return None

        def per_sequence(x: torch.Tensor) -> torch.Tensor:
            x = x.to(self.per_token_loss.dtype)
            if x.shape[-1] == 1:
                return x.squeeze(-1)
            return (x * self.mask).sum(-1) / self.mask.sum(-1)

        return per_sequence(self.is_low_clipped), per_sequence(self.is_high_clipped)

    @cached_property
    def metrics(self) -> dict[str, float]:
        """Local (this process) means, under TRL's metric names where TRL has them."""
        return {name: (t[0] / t[1].clamp(min=1.0)).item() for name, t in self.metric_totals().items()}


def _broadcasts_to(shape: torch.Size, target: torch.Size) -> bool:
    try:  # torch.broadcast_shapes raises RuntimeError for shapes that do not broadcast at all
        return torch.broadcast_shapes(shape, target) == target
    except RuntimeError:
        return False


def _check_inputs(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logps: torch.Tensor | None,
    beta: float,
    policy_weights: torch.Tensor | None,
) -> None:
    if logps.dim() != 2:
        raise ValueError(f"logps must have shape (B, T), got {tuple(logps.shape)}.")
    for name, tensor in (("old_logps", old_logps), ("mask", mask)):
        if tensor.shape != logps.shape:
            raise ValueError(f"{name} must have the shape of logps {tuple(logps.shape)}, got {tuple(tensor.shape)}.")
    allowed = [(logps.shape[0],), (logps.shape[0], 1), tuple(logps.shape)]
    if tuple(advantages.shape) not in allowed:
        raise ValueError(
            f"advantages must have shape (B,), (B, 1) or (B, T) = one of {allowed}, got {tuple(advantages.shape)}."
        )
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError(f"ref_logps is required when beta != 0 (beta={beta}).")
        if ref_logps.shape != logps.shape:
            raise ValueError(
                f"ref_logps must have the shape of logps {tuple(logps.shape)}, got {tuple(ref_logps.shape)}."
            )
    if policy_weights is not None and not _broadcasts_to(policy_weights.shape, logps.shape):
        raise ValueError(f"policy_weights must broadcast to {tuple(logps.shape)}, got {tuple(policy_weights.shape)}.")
    if not _is_binary(mask):
        raise ValueError("mask must contain only 0 and 1 (1 on completion tokens that count).")


def _is_binary(mask: torch.Tensor) -> bool:
    """All entries 0 or 1. Integer masks (TRL's completion_mask is int64) take one min/max pass, not three."""
    if mask.dtype == torch.bool or mask.numel() == 0:
        return True
    if not mask.is_floating_point() and not mask.is_complex():
        low, high = torch.aminmax(mask)
        return bool((low >= 0) & (high <= 1))  # one device sync
    return bool(((mask == 0) | (mask == 1)).all())


TRL_ACCEPTS = "TRL accepts this; training goes on."


def unusual_settings(epsilon: float, epsilon_high: float | None, delta: float | None, beta: float) -> list[str]:
    """Why each of these TRL settings is unusual (most likely a mistake), one message each; TRL trains with all of
    them, so grpo_plus warns rather than refuses (its config, once per config; `compute_policy_loss`, once per
    process). `epsilon_high` as given (None: epsilon)."""
    high = epsilon if epsilon_high is None else epsilon_high
    low_bound, high_bound = 1 - epsilon, 1 + high
    messages = []
    if epsilon < 0:
        messages.append(
            f"epsilon={epsilon} is negative: the lower clip bound 1 - epsilon = {low_bound:g} is above 1, so the clip "
            f"range [1 - epsilon, 1 + epsilon_high] = [{low_bound:g}, {high_bound:g}] no longer holds the unchanged "
            f"policy's ratio 1. The usual value is 0.2 (GSPO: 3e-4). {TRL_ACCEPTS}"
        )
    elif epsilon >= 1:
        messages.append(
            f"epsilon={epsilon} is >= 1: the lower clip bound 1 - epsilon = {low_bound:g} is not positive, and the "
            f"ratio always is, so nothing is ever clipped from below (no lower clip at all). The usual value is 0.2 "
            f"(GSPO: 3e-4). {TRL_ACCEPTS}"
        )
    if epsilon_high is not None and epsilon_high < 0 and epsilon_high != epsilon:  # (epsilon's: said above)
        messages.append(
            f"epsilon_high={epsilon_high} is negative: the upper clip bound 1 + epsilon_high = {high_bound:g} is "
            f"below 1, so an update that makes a token more likely is clipped even at the unchanged policy. None uses "
            f"epsilon; DAPO's clip-higher uses 0.28. {TRL_ACCEPTS}"
        )
    elif high < epsilon:
        messages.append(
            f"epsilon_high={high} is below epsilon={epsilon}: the ratio is clipped to [1 - epsilon, 1 + "
            f"epsilon_high] = [{low_bound:g}, {high_bound:g}], so updates that make a token more likely are cut off "
            f"sooner than updates that make it less likely. Clip-higher (DAPO) is the opposite, epsilon_high > "
            f"epsilon (e.g. 0.28 with 0.2). {TRL_ACCEPTS}"
        )
    if delta is not None and not delta > 1:
        messages.append(
            f"delta={delta} is not above 1: the unclipped ratio is capped at delta (INTELLECT-2's two-sided "
            f"clipping), at or below the unchanged policy's ratio 1, so the cap acts on every token that gains "
            f"probability. The paper uses delta > 1 (e.g. 4); None turns it off. {TRL_ACCEPTS}"
        )
    elif delta is not None and delta <= high_bound:
        messages.append(
            f"delta={delta} is not above 1 + epsilon_high = {high_bound:g}; INTELLECT-2 recommends delta > 1 + "
            f"epsilon_high so the bound only caps ratios the clip would not. {TRL_ACCEPTS}"
        )
    if beta < 0:
        messages.append(
            f"beta={beta} is negative: the KL term then rewards moving away from the reference model instead of "
            f"penalizing it. beta >= 0 is the KL coefficient (0: no reference model). {TRL_ACCEPTS}"
        )
    return messages


def _check_settings(
    loss_type: str,
    dual_clip: float | None,
    ctx: AggregationContext,
) -> None:
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip (the dual-clip constant c) must be > 1 or None, got {dual_clip}.")
    if ctx.S < 1:
        raise ValueError(f"gradient_accumulation_steps must be >= 1, got {ctx.S}.")
    if ctx.P < 1:
        raise ValueError(f"num_processes must be >= 1, got {ctx.P}.")
    if ctx.L is not None and ctx.L < 1:
        raise ValueError(f"max_completion_length must be >= 1, got {ctx.L}.")
    for required in LOSS_TYPES.entry(loss_type).requires:
        if getattr(ctx, required) is None:
            raise ValueError(f"loss_type={loss_type!r} needs {required}; it was None.")


def policy_loss_problem(
    policy_loss: str, importance_sampling_level: str, settings: Mapping[str, object]
) -> str | None:
    """Why `policy_loss` cannot be combined with this level and these clip settings (name -> value, None = unset), or
    None. Canonical names."""
    entry = POLICY_LOSSES.entry(policy_loss)
    levels = entry.trait(IMPORTANCE_SAMPLING_LEVELS)
    if levels is not None and importance_sampling_level not in levels:
        return (
            f"importance_sampling_level={importance_sampling_level!r} cannot be combined with policy_loss="
            f"{policy_loss!r}: it is defined for {', '.join(levels)} only."
        )
    for name, value in settings.items():
        if value is not None and name not in entry.trait(TAKES, ()):
            return (
                f"{name}={value!r} cannot be combined with policy_loss={policy_loss!r}: {name} applies to the "
                f"policy losses that take it ({', '.join(e.name for e in POLICY_LOSSES.entries() if name in e.trait(TAKES, ()))})."
            )
    return None


def resolve_policy_loss_options(policy_loss: str, given: Mapping[str, float] | None) -> Mapping[str, float]:
    """The loss's declared options with `given` values over the defaults; an option it does not declare, or a value
    its declaration does not allow, is an error (`policy_loss_options_problem`)."""
    problem = policy_loss_options_problem(policy_loss, given)
    if problem is not None:
        raise ValueError(problem)
    declared = POLICY_LOSSES.entry(policy_loss).trait(OPTIONS, {})
    return MappingProxyType({**{name: option.default for name, option in declared.items()}, **(given or {})})


def policy_loss_options_problem(policy_loss: str, given: Mapping[str, float] | None) -> str | None:
    """Why `given` cannot be `policy_loss`'s options (an undeclared name, a value out of its declared bounds), or
    None."""
    declared = POLICY_LOSSES.entry(policy_loss).trait(OPTIONS, {})
    unknown = set(given or {}) - set(declared)
    if unknown:
        allowed = ", ".join(declared) or "none"
        return f"policy_loss={policy_loss!r} takes no option {sorted(unknown)}; its options: {allowed}."
    values = {**{name: option.default for name, option in declared.items()}, **(given or {})}
    for name, option in declared.items():
        problem = option.problem(name, values[name], values)
        if problem is not None:
            return problem
    return None


def compute_policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str = "dapo",
    importance_sampling_level: str = "token",
    policy_loss: str = "ppo_clip",
    kl_estimator: str = "k3",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    dual_clip: float | None = None,
    beta: float = 0.0,
    ref_logps: torch.Tensor | None = None,
    use_bias_correction_kl: bool = True,
    max_completion_length: int | None = None,
    num_items_in_batch: torch.Tensor | float | None = None,
    num_processes: int = 1,
    gradient_accumulation_steps: int = 1,
    policy_weights: torch.Tensor | None = None,
    policy_loss_options: Mapping[str, float] | None = None,
) -> PolicyLossOutput:
    """`policy_loss` per token (default: the clipped surrogate) + optional KL, aggregated by `loss_type`.

    ppo_clip: l[i,t] = -min(w*A, clip(w, 1-epsilon, 1+epsilon_high)*A), with w capped at `delta` in the first term
    and, for A < 0, l <= dual_clip*|A|. Then l*policy_weights + beta*kl (`kl_estimator`; times w when
    `use_bias_correction_kl`), aggregated over the mask. `policy_weights` (B, T), optional, multiplies the policy term
    only (entropy / off-policy masks, vLLM IS ratios). `policy_loss_options` sets the loss's own options (e.g.
    clip_cov_ratio); `grpo-plus list` names them.
    """
    aggregate = LOSS_TYPES.get(loss_type)
    log_weights_fn = IMPORTANCE_SAMPLERS.get(importance_sampling_level)
    loss_entry = POLICY_LOSSES.entry(policy_loss)
    kl_fn = KL_ESTIMATORS.get(kl_estimator)
    ctx = AggregationContext(
        mask=mask,
        num_sequences=logps.shape[0],
        gradient_accumulation_steps=gradient_accumulation_steps,
        num_processes=num_processes,
        max_completion_length=max_completion_length,
        num_items_in_batch=num_items_in_batch,
    )
    for message in unusual_settings(epsilon, epsilon_high, delta, beta):
        warn_once(message, stacklevel=2)
    _check_settings(loss_type, dual_clip, ctx)
    problem = policy_loss_problem(
        loss_entry.name,
        IMPORTANCE_SAMPLERS.resolve(importance_sampling_level),
        {"delta": delta, "dual_clip": dual_clip},
    )
    if problem is not None:
        raise ValueError(problem)
    options = resolve_policy_loss_options(loss_entry.name, policy_loss_options)
    _check_inputs(logps, old_logps, advantages, mask, ref_logps, beta, policy_weights)

    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    policy_ctx = PolicyLossContext(
        logps=logps,
        old_logps=old_logps,
        log_weights=log_weights_fn(logps - old_logps, mask),
        advantages=advantages,
        mask=mask,
        epsilon=epsilon,
        epsilon_high=epsilon if epsilon_high is None else epsilon_high,
        delta=delta,
        dual_clip=dual_clip,
        options=options,
    )
    term = loss_entry.fn(policy_ctx)
    weights = policy_ctx.weights  # w; TRL calls it coef_1

    per_token_kl = None
    if beta != 0.0:
        per_token_kl = kl_fn(logps, ref_logps)
        if use_bias_correction_kl:  # times w it is the unbiased reverse-KL gradient off-policy (DeepSeek-V3.2)
            per_token_kl = per_token_kl * weights

    per_token_loss = term.per_token_loss
    if policy_weights is not None:
        per_token_loss = per_token_loss * policy_weights
    if per_token_kl is not None:
        per_token_loss = per_token_loss + beta * per_token_kl

    loss = aggregate(per_token_loss * mask, ctx)
    if loss.dim() != 0:
        raise ValueError(f"loss_type {loss_type!r} must return a scalar, got shape {tuple(loss.shape)}.")

    return PolicyLossOutput(
        loss=loss,
        per_token_loss=per_token_loss.expand(mask.shape),
        mask=mask,
        importance_weights=weights.detach(),
        is_dual_clipped=term.is_dual_clipped,
        per_token_kl=None if per_token_kl is None else per_token_kl.detach(),
        clip_inputs=term.clip,
        extra_metrics=MappingProxyType({name: values.detach() for name, values in term.metrics.items()}),
    )
