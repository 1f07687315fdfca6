"""The clipped GRPO policy objective as parts: importance ratio, clipping, KL, aggregation (pure torch).

Shapes: B sequences, T completion positions. `mask` is 1 on tokens that count, 0 elsewhere.
The built-in parts reproduce TRL 1.16's `GRPOTrainer._compute_loss` number for number.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import torch

from .registry import Registry

# ---------------------------------------------------------------------------------------------------------------------
# Importance sampling: log_ratio (B, T) = logp - old_logp  ->  log importance weights, (B, T) or (B, 1)
# ---------------------------------------------------------------------------------------------------------------------

# Trait of loss types and importance samplers: a row whose advantage is 0 adds nothing to the loss or its gradient, so
# the trainer may leave such rows out of the training forward (grpo_plus.train_pass).
ZERO_ADVANTAGE_ROWS_CONTRIBUTE_NOTHING = "zero_advantage_rows_contribute_nothing"

ImportanceSampler = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
IMPORTANCE_SAMPLERS: Registry[ImportanceSampler] = Registry("importance sampling", "importance_sampling_level")


def register_importance_sampling(
    name: str,
    *,
    aliases: tuple[str, ...] = (),
    override: bool = False,
    zero_advantage_rows_contribute_nothing: bool = False,
):
    """Decorator: register `fn(log_ratio (B, T), mask (B, T)) -> log weights (B, T) or (B, 1)` under `name`.

    Declare `zero_advantage_rows_contribute_nothing=True` when each row's weights depend on that row alone (no
    batch-wide normalization): the trainer may then leave zero-advantage rows out of the training forward.
    """
    return IMPORTANCE_SAMPLERS.register(
        name,
        aliases=aliases,
        override=override,
        traits={ZERO_ADVANTAGE_ROWS_CONTRIBUTE_NOTHING: zero_advantage_rows_contribute_nothing},
    )


def available_importance_sampling_levels(with_aliases: bool = False) -> list[str]:
    """Names accepted by `importance_sampling_level`."""
    return IMPORTANCE_SAMPLERS.names(with_aliases)


def sequence_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked mean over the last dim, (B, T) -> (B, 1); an all-masked row gives 0."""
    return ((x * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)


@register_importance_sampling("token", zero_advantage_rows_contribute_nothing=True)
def token_level_log_weights(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log w[i,t] = logp[i,t] - old_logp[i,t]  (PPO / GRPO)."""
    return log_ratio


@register_importance_sampling("sequence", zero_advantage_rows_contribute_nothing=True)
def sequence_level_log_weights(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log w[i] = sum_t m*(logp - old_logp) / sum_t m, shape (B, 1)  (GSPO)."""
    return sequence_mean(log_ratio, mask)


@register_importance_sampling("sequence_token", zero_advantage_rows_contribute_nothing=True)
def sequence_token_log_weights(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log w[i,t] = sg(log w[i]) + logp[i,t] - sg(logp[i,t]): GSPO's value, each token's own gradient (GSPO-token)."""
    return sequence_mean(log_ratio, mask).detach() + (log_ratio - log_ratio.detach())


# ---------------------------------------------------------------------------------------------------------------------
# Aggregation: masked per-token loss (B, T) + context -> this micro-batch's share of the window objective
# ---------------------------------------------------------------------------------------------------------------------


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
_CONTEXT_FIELDS = {"max_completion_length", "num_items_in_batch"}


def register_loss_type(
    name: str,
    *,
    aliases: tuple[str, ...] = (),
    requires: tuple[str, ...] = (),
    override: bool = False,
    zero_advantage_rows_contribute_nothing: bool = False,
):
    """Decorator: register `fn(masked_per_token_loss (B, T), ctx: AggregationContext) -> scalar` under `name`.

    `requires` names context fields that must not be None (`max_completion_length`, `num_items_in_batch`).
    The scalar is this micro-batch's contribution to the window objective: summing it over the S micro-batches
    of a window and averaging over the P processes (DDP) gives the loss whose gradient is applied.
    Declare `zero_advantage_rows_contribute_nothing=True` when rows whose masked loss is 0 (zero advantage) add
    nothing to the result's gradient: the trainer may then leave them out of the training forward (their per-token
    loss still arrives, as zeros, and `ctx` still describes the whole micro-batch).
    """
    unknown = set(requires) - _CONTEXT_FIELDS
    if unknown:
        raise ValueError(
            f"requires= names unknown context fields {sorted(unknown)}; allowed: {sorted(_CONTEXT_FIELDS)}."
        )
    return LOSS_TYPES.register(
        name,
        aliases=aliases,
        requires=requires,
        override=override,
        traits={ZERO_ADVANTAGE_ROWS_CONTRIBUTE_NOTHING: zero_advantage_rows_contribute_nothing},
    )


def available_loss_types(with_aliases: bool = False) -> list[str]:
    """Names accepted by `loss_type` (the aggregations grpo_plus computes itself)."""
    return LOSS_TYPES.names(with_aliases)


@register_loss_type("grpo", zero_advantage_rows_contribute_nothing=True)
def sequence_mean_token_mean(masked_loss: torch.Tensor, ctx: AggregationContext) -> torch.Tensor:
    """(1/B) sum_i [sum_t m*l / max(1, sum_t m)] / S  (GRPO, DeepSeekMath; length-biased)."""
    per_sequence = masked_loss.sum(-1) / ctx.mask.sum(-1).clamp(min=1.0)
    return per_sequence.mean() / ctx.S


@register_loss_type("bnpo", zero_advantage_rows_contribute_nothing=True)
def local_token_mean(masked_loss: torch.Tensor, ctx: AggregationContext) -> torch.Tensor:
    """sum m*l / max(1, sum m) over the local micro-batch, / S.

    Not invariant to how a batch is split: each micro-batch (and process) is normalized by its own token
    count, so the same effective batch gives a different gradient for different micro-batch sizes unless
    all micro-batches hold the same number of tokens.
    """
    return masked_loss.sum() / ctx.mask.sum().clamp(min=1.0) / ctx.S


@register_loss_type("dr_grpo", requires=("max_completion_length",), zero_advantage_rows_contribute_nothing=True)
def constant_normalizer(masked_loss: torch.Tensor, ctx: AggregationContext) -> torch.Tensor:
    """sum m*l / (B*L) / S  (Dr. GRPO: a constant normalizer, no length bias)."""
    return masked_loss.sum() / (ctx.B * ctx.L) / ctx.S


@register_loss_type("dapo", requires=("num_items_in_batch",), zero_advantage_rows_contribute_nothing=True)
def window_token_mean(masked_loss: torch.Tensor, ctx: AggregationContext) -> torch.Tensor:
    """sum m*l / (N/P): token mean over the whole accumulation window and all processes (DAPO)."""
    num_items = ctx.N.clamp(min=1.0) if isinstance(ctx.N, torch.Tensor) else max(float(ctx.N), 1.0)
    return masked_loss.sum() / (num_items / ctx.P)


# ---------------------------------------------------------------------------------------------------------------------
# The objective
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClipInputs:
    """What the clip flags are computed from (detached)."""

    bounded_weights: torch.Tensor  # w after the two-sided bound `delta`, (B, T) or (B, 1)
    advantages: torch.Tensor  # (B, 1) or (B, T)
    epsilon: float
    epsilon_high: float


@dataclass
class PolicyLossOutput:
    """Loss, per-token loss and the detached tensors the metrics are computed from."""

    loss: torch.Tensor
    per_token_loss: torch.Tensor
    mask: torch.Tensor
    importance_weights: torch.Tensor  # (B, T) or (B, 1): exp(log w) before the two-sided bound
    is_dual_clipped: torch.Tensor | None
    per_token_kl: torch.Tensor | None  # (B, T), as added to the loss (times w when bias-corrected)
    # What the clip flags are computed from, on first use (a loss-only caller never pays for them).
    clip_inputs: ClipInputs | None = field(repr=False, default=None)

    @cached_property
    def is_low_clipped(self) -> torch.Tensor:
        """w < 1 - epsilon where A < 0: (B, T), or (B, 1) for per-sequence weights with per-sequence advantages."""
        clip = self.clip_inputs
        return (clip.bounded_weights < 1 - clip.epsilon) & (clip.advantages < 0)

    @cached_property
    def is_high_clipped(self) -> torch.Tensor:
        """w > 1 + epsilon_high where A > 0, shaped like `is_low_clipped`."""
        clip = self.clip_inputs
        return (clip.bounded_weights > 1 + clip.epsilon_high) & (clip.advantages > 0)

    def metric_totals(self) -> dict[str, torch.Tensor]:
        """name -> tensor([sum, count]); sum the tensors over processes, then divide, for a global mean.

        Per-sequence tensors (B, 1) count sequences, per-token tensors count mask tokens (TRL's convention).
        """
        totals = {
            "clip_ratio/low_mean": self.total(self.is_low_clipped),
            "clip_ratio/high_mean": self.total(self.is_high_clipped),
            "clip_ratio/region_mean": self.total(self.is_low_clipped | self.is_high_clipped),
            "ratio/mean": self.total(self.importance_weights),
        }
        if self.is_dual_clipped is not None:
            totals["clip_ratio/dual_mean"] = self.total(self.is_dual_clipped)
        if self.per_token_kl is not None:
            totals["kl"] = self.total(self.per_token_kl)
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

    def sequence_clip_fractions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-sequence fraction of low- and high-clipped tokens, shape (B,) each (NaN for all-masked rows)."""

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


def _check_settings(
    loss_type: str,
    epsilon: float,
    epsilon_high: float,
    delta: float | None,
    dual_clip: float | None,
    ctx: AggregationContext,
) -> None:
    if epsilon < 0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon}.")
    if epsilon_high < 0:
        raise ValueError(f"epsilon_high must be >= 0 (or None to use epsilon), got {epsilon_high}.")
    if delta is not None and not delta > 1:
        raise ValueError(f"delta (two-sided clipping bound) must be > 1 or None, got {delta}.")
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


def compute_policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str = "dapo",
    importance_sampling_level: str = "token",
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
) -> PolicyLossOutput:
    """Clipped surrogate + optional KL, aggregated by `loss_type`.

    l[i,t] = -min(w*A, clip(w, 1-epsilon, 1+epsilon_high)*A), with w capped at `delta` in the first term and,
    for A < 0, l <= dual_clip*|A|. Then l*policy_weights + beta*kl, aggregated over the mask.
    `policy_weights` (B, T), optional, multiplies the policy term only (entropy / off-policy masks, vLLM IS ratios).
    """
    aggregate = LOSS_TYPES.get(loss_type)
    log_weights_fn = IMPORTANCE_SAMPLERS.get(importance_sampling_level)
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    ctx = AggregationContext(
        mask=mask,
        num_sequences=logps.shape[0],
        gradient_accumulation_steps=gradient_accumulation_steps,
        num_processes=num_processes,
        max_completion_length=max_completion_length,
        num_items_in_batch=num_items_in_batch,
    )
    _check_settings(loss_type, epsilon, epsilon_high, delta, dual_clip, ctx)
    _check_inputs(logps, old_logps, advantages, mask, ref_logps, beta, policy_weights)

    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    weights = torch.exp(log_weights_fn(logps - old_logps, mask))  # w; TRL calls it coef_1

    per_token_kl = None
    if beta != 0.0:
        # k3 estimator of KL(pi || pi_ref); multiplied by w it is the unbiased reverse-KL gradient (DeepSeek-V3.2).
        per_token_kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        if use_bias_correction_kl:
            per_token_kl = per_token_kl * weights

    clipped_weights = torch.clamp(weights, 1 - epsilon, 1 + epsilon_high)  # TRL's coef_2
    bounded_weights = weights if delta is None else torch.clamp(weights, max=delta)
    per_token_loss = -torch.min(bounded_weights * advantages, clipped_weights * advantages)

    is_dual_clipped = None
    if dual_clip is not None:
        dual_bound = -dual_clip * advantages
        is_dual_clipped = (advantages < 0) & (per_token_loss > dual_bound)
        per_token_loss = torch.where(is_dual_clipped, dual_bound, per_token_loss)

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
        is_dual_clipped=is_dual_clipped,
        per_token_kl=None if per_token_kl is None else per_token_kl.detach(),
        clip_inputs=ClipInputs(bounded_weights.detach(), advantages.detach(), epsilon, epsilon_high),
    )


__all__ = [
    "AggregationContext",
    "PolicyLossOutput",
    "compute_policy_loss",
    "register_loss_type",
    "register_importance_sampling",
    "available_loss_types",
    "available_importance_sampling_levels",
    "sequence_mean",
]
