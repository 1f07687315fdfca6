"""Policy losses (`policy_loss`): the per-token surrogate l[i,t] from log-probs, importance weights and advantages,
before `policy_weights`, the KL term and aggregation (pure torch).

Each loss gets a `PolicyLossContext` (w = exp(log w) from the importance sampling level, A as (B, 1) or (B, T)) and
returns a `PolicyTerm`: the per-token loss, (B, T) or (B, 1), and what its metrics are computed from.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType

import torch

from ..registry import Registry
from .common import PAPER, SPLIT_INVARIANT, ZERO_ADVANTAGE_ROWS_CONTRIBUTE_NOTHING

# Traits of policy losses (besides the shared ones): the clipping settings it reads beyond epsilon / epsilon_high,
# the importance sampling levels it is defined for (None: any), and its own settings with their defaults.
TAKES = "takes"
IMPORTANCE_SAMPLING_LEVELS = "importance_sampling_levels"
OPTIONS = "options"
CLIP_SETTINGS = ("delta", "dual_clip")


@dataclass(frozen=True)
class ClipInputs:
    """What TRL's clip_ratio/* flags are computed from (detached): a token (or sequence) counts as low-clipped where
    its bounded weight is below `low_bound` with A < 0, high-clipped where above `high_bound` with A > 0."""

    bounded_weights: torch.Tensor  # (B, T) or (B, 1)
    advantages: torch.Tensor  # (B, 1) or (B, T)
    low_bound: float
    high_bound: float


@dataclass(frozen=True)
class PolicyLossContext:
    """What a policy loss may read. log_weights / weights: (B, T) or (B, 1) from `importance_sampling_level`;
    advantages: (B, 1) or (B, T); options: this loss's own settings (declared defaults filled in)."""

    logps: torch.Tensor
    old_logps: torch.Tensor
    log_weights: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    epsilon: float
    epsilon_high: float
    delta: float | None = None
    dual_clip: float | None = None
    options: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))

    @cached_property
    def weights(self) -> torch.Tensor:
        """w = exp(log w): TRL's coef_1."""
        return torch.exp(self.log_weights)

    @cached_property
    def token_advantages(self) -> torch.Tensor:
        """A broadcast to (B, T)."""
        return self.advantages.expand(self.mask.shape)


@dataclass
class PolicyTerm:
    """A policy loss's per-token loss (B, T) or (B, 1), and what its metrics are computed from."""

    per_token_loss: torch.Tensor
    clip: ClipInputs | None = None  # for TRL's clip_ratio/* metrics (losses that clip a ratio)
    is_dual_clipped: torch.Tensor | None = None
    # Further metrics, name -> values (B, T) or (B, 1) averaged over the mask as TRL does (e.g. cispo_clip_ratio).
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class Option:
    """A policy loss's own setting, declared beside the loss: its default and, optionally, the values it allows.

    `is_allowed(value, options)` gets the value and every option of the loss (their values as given or defaulted),
    so a bound may name another option; `allowed` says in words what it accepts ("> 0"; "{other}" is replaced by
    that option's value)."""

    default: float
    allowed: str = ""
    is_allowed: Callable[[float, Mapping[str, float]], bool] | None = None

    def problem(self, name: str, value: float, options: Mapping[str, float]) -> str | None:
        """Why `value` cannot be option `name`, or None."""
        if self.is_allowed is None or self.is_allowed(value, options):
            return None
        return f"{name}={value!r} is not allowed: {name} must be {self.allowed.format(**options)}."


def positive(default: float, what: str = "") -> Option:
    """An option that must be > 0 (`what` says what it is, for the error)."""
    return Option(default, f"> 0{f' ({what})' if what else ''}", lambda value, options: value > 0)


PolicyLoss = Callable[[PolicyLossContext], PolicyTerm]
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss", "policy_loss")


def register_policy_loss(
    name: str,
    *,
    aliases: tuple[str, ...] = (),
    override: bool = False,
    zero_advantage_rows_contribute_nothing: bool = False,
    split_invariant: bool = False,
    takes: tuple[str, ...] = (),
    importance_sampling_levels: tuple[str, ...] | None = None,
    options: Mapping[str, float | Option] | None = None,
    paper: str = "",
):
    """Decorator: register `fn(ctx: PolicyLossContext) -> PolicyTerm` under `name`.

    Declare `zero_advantage_rows_contribute_nothing=True` when a row whose advantage is 0 adds nothing to the loss or
    its gradient whatever its log-probs (the trainer may then leave such rows out of the training forward), and
    `split_invariant=True` when each row's loss depends on that row alone. `takes` names the clip settings it reads
    besides epsilon / epsilon_high ("delta", "dual_clip"); others set are an error. `importance_sampling_levels` limits
    the levels it accepts (None: any). `options` declares its own settings: name -> default, or an `Option` with the
    values it allows (`ctx.options` holds their values; a bad value fails at config time and in `compute_policy_loss`).
    """
    unknown = set(takes) - set(CLIP_SETTINGS)
    if unknown:
        raise ValueError(f"takes= names unknown settings {sorted(unknown)}; allowed: {list(CLIP_SETTINGS)}.")
    return POLICY_LOSSES.register(
        name,
        aliases=aliases,
        override=override,
        traits={
            ZERO_ADVANTAGE_ROWS_CONTRIBUTE_NOTHING: zero_advantage_rows_contribute_nothing,
            SPLIT_INVARIANT: split_invariant,
            TAKES: tuple(takes),
            IMPORTANCE_SAMPLING_LEVELS: None
            if importance_sampling_levels is None
            else tuple(importance_sampling_levels),
            OPTIONS: MappingProxyType(
                {
                    name: value if isinstance(value, Option) else Option(value)
                    for name, value in (options or {}).items()
                }
            ),
            PAPER: paper,
        },
    )


def available_policy_losses(with_aliases: bool = False) -> list[str]:
    """Names accepted by `policy_loss`."""
    return POLICY_LOSSES.names(with_aliases)


@register_policy_loss(
    "ppo_clip",
    zero_advantage_rows_contribute_nothing=True,
    split_invariant=True,
    takes=CLIP_SETTINGS,
    paper="https://arxiv.org/abs/1707.06347",
)
def clipped_surrogate(ctx: PolicyLossContext) -> PolicyTerm:
    """l = -min(min(w, delta) A, clip(w, 1-eps, 1+eps_high) A), and l <= c|A| for A < 0 (PPO / GRPO; TRL's)."""
    weights, advantages = ctx.weights, ctx.advantages
    clipped_weights = torch.clamp(weights, 1 - ctx.epsilon, 1 + ctx.epsilon_high)  # TRL's coef_2
    bounded_weights = weights if ctx.delta is None else torch.clamp(weights, max=ctx.delta)
    per_token_loss = -torch.min(bounded_weights * advantages, clipped_weights * advantages)
    is_dual_clipped = None
    if ctx.dual_clip is not None:
        dual_bound = -ctx.dual_clip * advantages
        is_dual_clipped = (advantages < 0) & (per_token_loss > dual_bound)
        per_token_loss = torch.where(is_dual_clipped, dual_bound, per_token_loss)
    clip = ClipInputs(bounded_weights.detach(), advantages.detach(), 1 - ctx.epsilon, 1 + ctx.epsilon_high)
    return PolicyTerm(per_token_loss, clip=clip, is_dual_clipped=is_dual_clipped)


@register_policy_loss(
    "gmpo",
    zero_advantage_rows_contribute_nothing=True,
    split_invariant=True,
    importance_sampling_levels=("token",),
    paper="https://arxiv.org/abs/2507.20673",
)
def geometric_mean(ctx: PolicyLossContext) -> PolicyTerm:
    """l_i = -A_i exp(mean_t sgn(A) min(sgn(A) d_t, sgn(A) clip(d_t, -eps, eps_high))), d = logp - old_logp (GMPO)."""
    log_ratio, mask = ctx.log_weights, ctx.mask
    advantages = ctx.token_advantages
    sign = torch.sign(advantages)
    clamped = torch.clamp(log_ratio, -ctx.epsilon, ctx.epsilon_high)
    clipped_log_ratio = sign * torch.min(sign * log_ratio, sign * clamped)
    length = mask.sum(dim=-1).to(log_ratio.dtype)
    # verl's geo_mean divides by length + 1e-8 (a masked row gives 0, not NaN); kept so its numbers are ours.
    sequence_ratio = torch.exp((clipped_log_ratio * mask).sum(dim=-1) / (length + 1e-8))
    sequence_advantage = (advantages * mask).sum(dim=-1) / (length + 1e-8)
    per_sequence_loss = -sequence_advantage * sequence_ratio
    bounds = math.exp(-ctx.epsilon), math.exp(ctx.epsilon_high)  # the clip range of d, as a ratio range
    clip = ClipInputs(torch.exp(log_ratio).detach(), advantages.detach(), *bounds)
    return PolicyTerm(per_sequence_loss.unsqueeze(-1), clip=clip)


def _verl_masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum(x m) / (sum(m) + 1e-8), as verl's masked_mean: Clip-Cov compares covariances to fixed bounds, so it centers
    them exactly as the paper's code does."""
    mask = mask.to(x.dtype)
    return (torch.where(mask.bool(), x, 0.0) * mask).sum() / (mask.sum() + 1e-8)


@register_policy_loss(
    "clip_cov",
    importance_sampling_levels=("token",),
    options={
        "clip_cov_ratio": positive(2e-4, "the share of tokens the method acts on"),
        "clip_cov_lb": Option(
            1.0,
            "below clip_cov_ub={clip_cov_ub} (the covariance band is (lb, ub))",
            lambda value, options: value < options["clip_cov_ub"],
        ),
        "clip_cov_ub": Option(5.0),
    },  # fmt: skip
    paper="https://arxiv.org/abs/2505.22617",
)
def clip_covariance(ctx: PolicyLossContext) -> PolicyTerm:
    """Clip-Cov: ppo_clip, the gradient cut on max(1, r n) random tokens with cov in (clip_cov_lb, clip_cov_ub).

    cov = (A - mean A)(logp - mean logp) over the micro-batch's n loss tokens; tokens the ratio clip already clips are
    never picked. Tokens are picked per micro-batch, with torch's global RNG (verl's selection).
    """
    mask, weights = ctx.mask, ctx.weights
    advantages = ctx.token_advantages
    loss_unclipped = -advantages * weights
    loss_clipped = -advantages * torch.clamp(weights, 1 - ctx.epsilon, 1 + ctx.epsilon_high)
    with torch.no_grad():
        clipped_by_ratio = (loss_clipped > loss_unclipped) & (mask > 0)
        covariance = (advantages - _verl_masked_mean(advantages, mask)) * (
            ctx.logps - _verl_masked_mean(ctx.logps, mask)
        )
        covariance = covariance.masked_fill((mask == 0) | clipped_by_ratio, float("-inf"))
        budget = max(int(ctx.options["clip_cov_ratio"] * mask.sum().item()), 1)
        in_band = (covariance < ctx.options["clip_cov_ub"]) & (covariance > ctx.options["clip_cov_lb"]) & (mask > 0)
        candidates = torch.nonzero(in_band)
        if len(candidates) > 0:  # the order torch.nonzero gives, then a random subset (verl's selection)
            candidates = candidates[torch.randperm(len(candidates))[: min(budget, len(candidates))]]
        keep = torch.ones_like(advantages)
        keep[candidates[:, 0], candidates[:, 1]] = 0
    per_token_loss = torch.max(loss_unclipped, loss_clipped) * keep
    clip = ClipInputs(weights.detach(), advantages.detach(), 1 - ctx.epsilon, 1 + ctx.epsilon_high)
    return PolicyTerm(per_token_loss, clip=clip, metrics={"clip_cov/cut_frac": (keep == 0).to(weights.dtype)})


@register_policy_loss(
    "kl_cov",
    importance_sampling_levels=("token",),
    options={
        "kl_cov_ratio": positive(2e-4, "the share of tokens the method acts on"),
        "kl_cov_coef": Option(1.0, ">= 0", lambda value, options: value >= 0),
    },
    paper="https://arxiv.org/abs/2505.22617",
)
def kl_covariance(ctx: PolicyLossContext) -> PolicyTerm:
    """KL-Cov: l = -A w, + kl_cov_coef |logp - old_logp| on the max(1, k n) tokens of largest cov.

    cov = (A - mean A)(logp - mean logp) over the micro-batch's n loss tokens; tokens are picked per micro-batch.
    """
    mask, log_ratio = ctx.mask, ctx.log_weights
    advantages = ctx.token_advantages
    loss_plain = -advantages * ctx.weights
    loss_penalized = loss_plain + ctx.options["kl_cov_coef"] * log_ratio.abs()
    with torch.no_grad():
        valid = mask > 0
        valid_positions = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
        chosen = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
        if len(valid_positions) > 0:
            valid_advantages, valid_logps = advantages[valid].reshape(-1), ctx.logps[valid].reshape(-1)
            covariance = (valid_advantages - valid_advantages.mean()) * (valid_logps - valid_logps.mean())
            count = max(1, int(len(covariance) * ctx.options["kl_cov_ratio"]))
            chosen[valid_positions[torch.topk(covariance, count, largest=True).indices]] = True
        chosen = chosen.view(mask.shape)
    per_token_loss = torch.where(chosen, loss_penalized, loss_plain)
    return PolicyTerm(per_token_loss, metrics={"kl_cov/penalized_frac": chosen.to(ctx.weights.dtype)})


@register_policy_loss(
    "gpg",
    zero_advantage_rows_contribute_nothing=True,
    split_invariant=True,
    importance_sampling_levels=("token",),
    paper="https://arxiv.org/abs/2504.02546",
)
def policy_gradient(ctx: PolicyLossContext) -> PolicyTerm:
    """l = -A logp: plain policy gradient, no ratio, no clipping (GPG)."""
    return PolicyTerm(-ctx.logps * ctx.advantages)


@register_policy_loss(
    "cispo",
    zero_advantage_rows_contribute_nothing=True,
    split_invariant=True,
    paper="https://arxiv.org/abs/2506.13585",
)
def clipped_is_weight(ctx: PolicyLossContext) -> PolicyTerm:
    """l = -sg(min(w, eps_high)) A logp  (CISPO, MiniMax-M1; TRL's loss_type="cispo": epsilon_high caps w, e.g. 5.0)."""
    capped = torch.clamp(ctx.weights, max=ctx.epsilon_high).detach()
    flagged = ((ctx.weights > ctx.epsilon_high) & (ctx.advantages > 0)).to(ctx.weights.dtype)
    return PolicyTerm(-capped * ctx.advantages * ctx.logps, metrics={"cispo_clip_ratio": flagged})


@register_policy_loss(
    "sapo",
    zero_advantage_rows_contribute_nothing=True,
    split_invariant=True,
    options={"sapo_temperature_pos": positive(1.0), "sapo_temperature_neg": positive(1.05)},
    paper="https://arxiv.org/abs/2511.20347",
)
def soft_gate(ctx: PolicyLossContext) -> PolicyTerm:
    """l = -sigmoid(tau (w - 1)) 4/tau A, tau = tau_pos for A > 0 else tau_neg  (SAPO; TRL's loss_type="sapo")."""
    # Python floats in torch.where, as TRL writes it, so the temperatures round to TRL's dtype (float32).
    temperatures = torch.where(
        ctx.advantages > 0, ctx.options["sapo_temperature_pos"], ctx.options["sapo_temperature_neg"]
    )
    gate = torch.sigmoid(temperatures * (ctx.weights - 1)) * 4 / temperatures
    return PolicyTerm(-gate * ctx.advantages)
