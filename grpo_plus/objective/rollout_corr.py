"""Rollout correction (`rollout_is`, `rollout_rs`): the sampler's log-probs against the trainer's -> truncated importance
weights, a rejection mask and the mismatch metrics, as verl's `compute_rollout_correction_and_rejection_mask` computes
them (pure torch).

The sampler (vLLM in bf16, a 4-bit base served dequantized, a stale copy of the weights) draws completions from
pi_rollout; the trainer scores them under pi_old. With log r[i,t] = old_logp - rollout_logp (the trainer's policy over
the sampler's, bounded to +-20 before any exp):

- importance weights (`rollout_is`): per token w[i,t] = exp(log r[i,t]), or per sequence w[i] = exp(sum_t m*log r)
  broadcast over t; zero off the mask, truncated above at `rollout_is_threshold` (TIS), optionally divided by their
  batch mean (`rollout_is_batch_normalize`: per token over the tokens, per sequence over the sequences). Detached.
- rejection (`rollout_rs`, comma-separated criteria, all must pass): a per-token divergence k1 = -log r,
  k2 = (log r)^2 / 2 or k3 = r - 1 - log r, taken per token or summed / averaged / maximized over each sequence, must
  stay within `rollout_rs_threshold` (k1: a ratio range "lower_upper", compared in log space; k2, k3: an upper bound);
  a failing token (or every token of a failing sequence) leaves the response mask.
- metrics, under verl's names (`rollout_corr/...`): the weights' and each criterion's statistics, and the gap between
  the two policies (KL, k3 KL, perplexities, chi^2).

Source of the semantics: verl's `verl/trainer/ppo/rollout_corr_helper.py` and `docs/algo/rollout_corr.md`
(volcengine/verl, Liu, Li et al. 2025, "When Speed Kills Stability", https://richardli.xyz/rl-collapse).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from ..registry import Registry
from .common import PAPER

SAFETY_BOUND = 20.0  # log-ratios are clamped to [-20, 20] before exp: weights stay in [2e-9, 5e8]
IS_LEVELS = ("token", "sequence")
METRIC_PREFIX = "rollout_corr/"
PAPER_URL = "https://richardli.xyz/rl-collapse"
# Traits of a rejection criterion: "token" (each token judged alone) or "sequence" (one statistic per sequence, its
# verdict for every token of it); two-sided criteria take a ratio range "lower_upper" (compared as log-ratios), the
# others one upper bound.
LEVEL = "level"
TWO_SIDED = "two_sided"

# (log-ratio bounded to +-20 (B, T), mask (B, T) float) -> the statistic, (B, T) per token or (B,) per sequence.
RejectionStatistic = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
REJECTION_CRITERIA: Registry[RejectionStatistic] = Registry("rejection criterion", "rollout_rs")


class RolloutCorrection(NamedTuple):
    """What `rollout_correction` returns: IS weights (B, T) or None, the response mask after rejection (the input's
    dtype), and the metrics (name -> float, prefixed `rollout_corr/`)."""

    weights: torch.Tensor | None
    response_mask: torch.Tensor
    metrics: dict[str, float]


def register_rejection_criterion(
    name: str,
    *,
    level: str,
    two_sided: bool = False,
    aliases: tuple[str, ...] = (),
    override: bool = False,
    paper: str = "",
):
    """Decorator: register `fn(log_ratio (B, T), mask (B, T)) -> statistic` under `name`, usable in `rollout_rs`.

    `level="token"`: the statistic is (B, T), each token kept or rejected alone; `level="sequence"`: (B,), one verdict
    per sequence. `two_sided=True`: its threshold is a ratio range "lower_upper" (a single value u means 1/u_u),
    compared in log space; else one positive upper bound.
    """
    if level not in ("token", "sequence"):
        raise ValueError(
            f"level={level!r} is not allowed: a rejection criterion's level must be 'token' or 'sequence'."
        )
    return REJECTION_CRITERIA.register(
        name,
        aliases=aliases,
        override=override,
        traits={LEVEL: level, TWO_SIDED: two_sided, PAPER: paper},
    )


def available_rejection_criteria(with_aliases: bool = False) -> list[str]:
    """Names accepted in `rollout_rs` (comma-separated)."""
    return REJECTION_CRITERIA.names(with_aliases)


# ---- masked reductions, as verl's torch_functional computes them ------------------------------------------------------


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(x m) over `dim` (all when None); values off the mask never enter, not even a NaN or inf."""
    summed = torch.where(mask.bool(), x, 0.0) * mask
    return summed.sum() if dim is None else summed.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(x m) / (sum(m) + 1e-8): verl's masked mean (an all-masked row gives 0, not NaN)."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / (count + 1e-8)


def masked_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Largest value of each row on the mask, (B,); 0 for a row with none."""
    largest = x.masked_fill(~mask.bool(), float("-inf")).max(dim=-1).values
    return torch.where(torch.isinf(largest) & (largest < 0), torch.zeros_like(largest), largest)


# ---- the per-token divergences and the built-in criteria --------------------------------------------------------------


def k1(log_ratio: torch.Tensor) -> torch.Tensor:
    """k1 = -log r = log(pi_rollout / pi_old)."""
    return -log_ratio


def k2(log_ratio: torch.Tensor) -> torch.Tensor:
    """k2 = (log r)^2 / 2."""
    return 0.5 * log_ratio**2


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """k3 = r - 1 - log r (>= 0, 0 only where the policies agree)."""
    return torch.exp(log_ratio) - 1.0 - log_ratio


DIVERGENCES = {"k1": k1, "k2": k2, "k3": k3}
AGGREGATIONS: dict[str, tuple[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor], str]] = {
    "token": ("token", lambda values, mask: values, "per token"),
    "seq_sum": ("sequence", lambda values, mask: masked_sum(values, mask, -1), "summed over each sequence"),
    "seq_mean": ("sequence", lambda values, mask: masked_mean(values, mask, -1), "averaged over each sequence"),
    "seq_max": ("sequence", masked_max, "the largest of each sequence"),
}


def _register_builtin(aggregation: str, divergence: str) -> None:
    level, reduce, how = AGGREGATIONS[aggregation]
    of_token = DIVERGENCES[divergence]

    def statistic(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return reduce(of_token(log_ratio), mask)

    bound = "kept within a ratio range 'lower_upper'" if divergence == "k1" else "kept at most an upper bound"
    statistic.__doc__ = f"{of_token.__doc__.rstrip('.')}, {how}, {bound} (verl)."
    name = f"{aggregation}_{divergence}"
    statistic.__name__ = statistic.__qualname__ = name
    register_rejection_criterion(name, level=level, two_sided=divergence == "k1", paper=PAPER_URL)(statistic)


# verl's eleven: the max of k1 (a signed log-ratio) is not one of them.
for _aggregation in AGGREGATIONS:
    for _divergence in DIVERGENCES:
        if (_aggregation, _divergence) != ("seq_max", "k1"):
            _register_builtin(_aggregation, _divergence)


# ---- parsing rollout_rs and rollout_rs_threshold ---------------------------------------------------------------------


def parse_rejection_criteria(rollout_rs: str) -> tuple[str, ...]:
    """The criteria of a comma-separated `rollout_rs` ("token_k1, seq_mean_k3"), canonical, duplicates dropped, in
    order; an unknown name raises ValueError naming the allowed ones."""
    if not isinstance(rollout_rs, str):
        raise ValueError(f"rollout_rs={rollout_rs!r} is not allowed: rollout_rs must be a comma-separated string.")
    names = []
    for part in rollout_rs.split(","):
        if part.strip():
            name = REJECTION_CRITERIA.check(part.strip())
            if name not in names:
                names.append(name)
    if not names:
        raise ValueError(
            f"rollout_rs={rollout_rs!r} names no criterion; allowed: {', '.join(REJECTION_CRITERIA.names())}."
        )
    return tuple(names)


class Bounds(NamedTuple):
    """A criterion's thresholds, as its statistic is compared: lower None for a one-sided criterion; a two-sided
    (ratio) criterion's bounds are log-ratios."""

    lower: float | None
    upper: float


def parse_thresholds(criteria: tuple[str, ...], rollout_rs_threshold: str | float | None) -> dict[str, Bounds]:
    """Each criterion's bounds from `rollout_rs_threshold`: one entry per criterion (comma-separated) or one for all.

    A two-sided criterion takes "lower_upper" (ratios; a single value u means 1/u .. u), the others one positive upper
    bound. Raises ValueError saying which entry is wrong and what is allowed."""
    if rollout_rs_threshold is None:
        raise ValueError("rollout_rs_threshold must be set when rollout_rs is (one threshold per criterion, or one).")
    if isinstance(rollout_rs_threshold, bool) or not isinstance(rollout_rs_threshold, (str, int, float)):
        raise ValueError(
            f"rollout_rs_threshold={rollout_rs_threshold!r} is not allowed: it must be a number or a string "
            "(comma-separated, one per criterion; 'lower_upper' for the k1 criteria)."
        )
    specs = [part.strip() for part in str(rollout_rs_threshold).split(",") if part.strip()]
    if len(specs) not in (1, len(criteria)):
        raise ValueError(
            f"rollout_rs_threshold={rollout_rs_threshold!r} has {len(specs)} entries: it must have one, shared by "
            f"every criterion, or one per criterion of rollout_rs ({len(criteria)}: {', '.join(criteria)})."
        )
    specs = specs * len(criteria) if len(specs) == 1 else specs
    return {name: _bounds(name, spec) for name, spec in zip(criteria, specs, strict=True)}


def _bounds(name: str, spec: str) -> Bounds:
    two_sided = REJECTION_CRITERIA.entry(name).trait(TWO_SIDED, False)
    parts = spec.split("_", 1) if two_sided and "_" in spec else [spec]
    if not two_sided and "_" in spec:
        raise ValueError(f"rollout_rs_threshold entry {spec!r} for {name!r} must be one upper bound, without '_'.")
    try:
        values = [float(part) for part in parts]
    except ValueError:
        form = "a ratio range 'lower_upper' or one upper ratio" if two_sided else "a positive number"
        raise ValueError(f"rollout_rs_threshold entry {spec!r} for {name!r} is not {form}.") from None
    if not all(value > 0 for value in values):
        raise ValueError(f"rollout_rs_threshold entry {spec!r} for {name!r} must be positive.")
    if not two_sided:
        return Bounds(None, values[0])
    lower, upper = values if len(values) == 2 else (1.0 / values[0], values[0])
    return Bounds(math.log(lower), math.log(upper))


def check_options(rollout_is: str | None, rollout_is_threshold: float | None) -> None:
    """Raise ValueError for an IS level or truncation threshold verl does not accept."""
    if rollout_is is not None and rollout_is not in IS_LEVELS:
        raise ValueError(f"rollout_is={rollout_is!r} is not allowed: rollout_is must be None, 'token' or 'sequence'.")
    if rollout_is is not None and rollout_is_threshold is not None and not rollout_is_threshold > 0:
        raise ValueError(f"rollout_is_threshold={rollout_is_threshold!r} is not allowed: it must be > 0.")


# ---- the three parts ---------------------------------------------------------------------------------------------------


def importance_weights(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    level: str,
    threshold: float,
    batch_normalize: bool = False,
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated IS weights (B, T), 0 off the mask, and their metrics (unprefixed, computed before truncation).

    token: w = exp(clamp(log r)); sequence: w = exp(clamp(sum_t m log r)) on every token of the row. Then w <= threshold,
    and with `batch_normalize` w / mean(w) (token: over the mask's tokens; sequence: over the rows with a token; over
    every process when `all_reduce_sum` sums a tensor across them, as verl's distributed mean).
    """
    if level == "token":
        log_for_metrics = log_ratio
        weights = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    else:
        log_for_metrics = masked_sum(log_ratio, mask, -1).unsqueeze(-1)  # (B, 1): log of the product of ratios
        weights = torch.exp(log_for_metrics.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)
    weights = torch.where(
        mask.bool(), weights, 0.0
    )  # exactly 0 off the mask, even where a log-prob there is not finite
    metrics = _importance_metrics(weights, log_for_metrics, mask, level, threshold)
    weights = weights.clamp(max=threshold).detach()
    if batch_normalize:
        if level == "token":
            values, counted = weights, mask
        else:
            values, counted = masked_mean(weights, mask, -1), (mask.sum(-1) > 0).to(weights.dtype)
        if all_reduce_sum is not None:
            mean = all_reduce_sum((values * counted).sum()) / all_reduce_sum(counted.sum())
        elif level == "token":
            mean = masked_mean(values, counted)
        else:
            mean = (values * counted).sum() / counted.sum().clamp_min(1e-8)
        normalizes = bool(mean > 1e-8)
        weights = weights / mean if normalizes else weights
        metrics["rollout_is_batch_norm_factor"] = mean if normalizes else torch.ones_like(mean)
    return weights, metrics


def _importance_metrics(
    weights: torch.Tensor, log_for_metrics: torch.Tensor, mask: torch.Tensor, level: str, threshold: float
) -> dict[str, torch.Tensor]:
    """verl's IS metrics: mean, extremes and the shares beyond [1/threshold, threshold] (per sequence from the
    unbounded log-ratio sums), std and effective sample size of the weights clamped to that range, per-row means."""
    lower = 1.0 / threshold
    metrics: dict[str, torch.Tensor] = {"rollout_is_mean": masked_mean(weights, mask)}
    if level == "sequence":
        metrics["rollout_is_max"] = torch.exp(log_for_metrics.max().clamp(max=SAFETY_BOUND))
        metrics["rollout_is_min"] = torch.exp(log_for_metrics.min())
        metrics["rollout_is_ratio_fraction_high"] = (log_for_metrics > math.log(threshold)).float().mean()
        metrics["rollout_is_ratio_fraction_low"] = (log_for_metrics < math.log(lower)).float().mean()
    else:
        on_mask = mask.bool()
        metrics["rollout_is_ratio_fraction_high"] = masked_mean((weights > threshold).float(), mask)
        metrics["rollout_is_ratio_fraction_low"] = masked_mean((weights < lower).float(), mask)
        metrics["rollout_is_max"] = weights.masked_fill(~on_mask, float("-inf")).max()
        metrics["rollout_is_min"] = weights.masked_fill(~on_mask, float("inf")).min()
    in_range = weights.clamp(min=lower, max=threshold)
    metrics["rollout_is_std"] = _clamped_std(in_range, mask)
    normalized = in_range / (masked_mean(in_range, mask) + 1e-8)
    # 1 / E[(w / E[w])^2], the reciprocal taken in float64 (verl divides the Python float)
    metrics["rollout_is_eff_sample_size"] = 1.0 / masked_mean(normalized**2, mask).to(torch.float64)
    row_means = masked_mean(weights, mask, -1)
    metrics.update(_row_summary("rollout_is_seq", row_means, threshold, lower, ideal=1.0))
    return metrics


def _clamped_std(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sqrt(max(E[v^2] - E[v]^2, 0)) over the mask; 0 with fewer than two tokens."""
    if not mask.sum() > 1:
        return torch.zeros((), dtype=values.dtype, device=values.device)
    variance = masked_mean(values**2, mask) - masked_mean(values, mask) ** 2
    return torch.sqrt(variance.clamp(min=0.0))


def _row_summary(
    prefix: str, rows: torch.Tensor, upper: float, lower: float | None, ideal: float
) -> dict[str, torch.Tensor]:
    """mean, std (Bessel; 0 for one row), max, min, largest |v - ideal| and the shares above `upper` (and below
    `lower`) of one value per row."""
    zero = torch.zeros((), dtype=rows.dtype, device=rows.device)
    summary = {
        f"{prefix}_mean": rows.mean(),
        f"{prefix}_std": rows.std() if rows.numel() > 1 else zero,
        f"{prefix}_max": rows.max(),
        f"{prefix}_min": rows.min(),
        f"{prefix}_max_deviation": (rows - ideal).abs().max(),
        f"{prefix}_fraction_high": (rows > upper).float().mean(),
    }
    if lower is not None:
        summary[f"{prefix}_fraction_low"] = (rows < lower).float().mean()
    return summary


def rejection_mask(
    log_ratio: torch.Tensor, mask: torch.Tensor, criteria: tuple[str, ...], bounds: dict[str, Bounds]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """keep (B, T) in the log-ratio's dtype (1 = kept; every criterion must pass) and the rejection metrics."""
    bounded = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    has_tokens = mask.sum(-1) > 0
    on_mask = mask.bool()
    keep = torch.ones_like(log_ratio)
    metrics: dict[str, torch.Tensor] = {}
    for name in criteria:
        entry = REJECTION_CRITERIA.entry(name)
        lower, upper = bounds[name]
        statistic = entry.fn(bounded, mask)
        passes = statistic <= upper if lower is None else (statistic >= lower) & (statistic <= upper)
        if entry.trait(LEVEL) == "sequence":
            per_row = statistic
            passes = passes.unsqueeze(-1).expand_as(on_mask)
            statistic = statistic.unsqueeze(-1).expand_as(mask)
        else:
            per_row = None
        kept = passes.to(log_ratio.dtype)
        keep = keep * kept
        rows_kept = (~(~passes & on_mask)).all(dim=-1)
        metrics.update(_criterion_metrics(name, statistic, per_row, mask, has_tokens, lower, upper))
        prefix = f"rollout_rs_{name}"
        metrics[f"{prefix}_masked_fraction"] = masked_mean(1 - kept, mask)
        valid = has_tokens.float()
        metrics[f"{prefix}_seq_masked_fraction"] = ((1.0 - rows_kept.to(log_ratio.dtype)) * valid).sum() / valid.sum()
    metrics["rollout_rs_masked_fraction"] = masked_mean(1 - keep, mask)
    rejected_somewhere = (~((keep > 0.5) & on_mask) & on_mask).any(dim=-1)
    metrics["rollout_rs_seq_masked_fraction"] = rejected_somewhere.float().mean()
    return keep, metrics


def _criterion_metrics(
    name: str,
    statistic: torch.Tensor,
    per_row: torch.Tensor | None,
    mask: torch.Tensor,
    has_tokens: torch.Tensor,
    lower: float | None,
    upper: float,
) -> dict[str, torch.Tensor]:
    """verl's per-criterion metrics: the statistic's token-weighted mean, extremes and shares beyond the bounds (per
    row for a sequence criterion), its std clamped to the bounds (a one-sided criterion's lower bound is 0), and a
    summary of its per-row values (for a token criterion, each row's mean)."""
    prefix = f"rollout_rs_{name}"
    rows = (per_row if per_row is not None else masked_mean(statistic, mask, -1))[has_tokens]
    on_mask = mask.bool()
    metrics = {f"{prefix}_mean": masked_mean(statistic, mask)}
    if per_row is not None:
        metrics[f"{prefix}_max"], metrics[f"{prefix}_min"] = rows.max(), rows.min()
        high = (rows > upper).float().mean()
        low = (rows < lower).float().mean() if lower is not None else torch.zeros_like(high)
    else:
        metrics[f"{prefix}_max"] = statistic.masked_fill(~on_mask, float("-inf")).max()
        metrics[f"{prefix}_min"] = statistic.masked_fill(~on_mask, float("inf")).min()
        high = masked_mean((statistic > upper).float(), mask)
        low = masked_mean((statistic < lower).float(), mask) if lower is not None else torch.zeros_like(high)
    metrics[f"{prefix}_fraction_high"], metrics[f"{prefix}_fraction_low"] = high, low
    metrics[f"{prefix}_std"] = _clamped_std(statistic.clamp(min=0.0 if lower is None else lower, max=upper), mask)
    metrics.update(_row_summary(f"{prefix}_seq", rows, upper, lower, ideal=0.0))
    return metrics


def mismatch_metrics(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The gap between the trainer's and the sampler's policy (verl's off-policy metrics): KL(rollout || old) as the
    mean of rollout_logp - old_logp, its k3 estimate, each policy's perplexity (the mean over rows of exp(-mean logp)),
    the per-row log-perplexity difference (mean, |mean|, extremes) and ratio, token and sequence chi^2 = E[r^2] - 1."""
    log_ratio = old_log_probs - rollout_log_probs
    old_mean = masked_mean(old_log_probs, mask, -1)
    rollout_mean = masked_mean(rollout_log_probs, mask, -1)
    log_ppl_diff = rollout_mean - old_mean
    bounded = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    sequence_log_ratio = masked_sum(log_ratio, mask, -1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {
        "training_ppl": torch.exp(-old_mean).mean(),
        "training_log_ppl": (-old_mean).mean(),
        "kl": masked_mean(rollout_log_probs - old_log_probs, mask),
        "k3_kl": masked_mean(torch.exp(log_ratio) - log_ratio - 1, mask),
        "rollout_ppl": torch.exp(-rollout_mean).mean(),
        "rollout_log_ppl": (-rollout_mean).mean(),
        "log_ppl_diff": log_ppl_diff.mean(),
        "log_ppl_abs_diff": log_ppl_diff.abs().mean(),
        "log_ppl_diff_max": log_ppl_diff.max(),
        "log_ppl_diff_min": log_ppl_diff.min(),
        "ppl_ratio": torch.exp(log_ppl_diff).mean(),
        "chi2_token": masked_mean(torch.exp(bounded) ** 2, mask) - 1.0,
        "chi2_seq": torch.exp(2.0 * sequence_log_ratio).mean() - 1.0,
    }


def rollout_correction(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    rollout_is: str | None = None,
    rollout_is_threshold: float | None = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | None = None,
    rollout_rs_threshold: str | float | None = None,
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> RolloutCorrection:
    """(IS weights or None, the response mask after rejection, metrics): verl's rollout correction on one batch.

    `old_log_probs` (the trainer's policy), `rollout_log_probs` (the sampler's) and `response_mask` are (B, T). The
    weights are computed when `rollout_is` ("token" or "sequence") and `rollout_is_threshold` are set; the mask changes
    when `rollout_rs` names criteria (see the module docstring and `available_rejection_criteria`); the metrics are
    always computed. `all_reduce_sum`, optional, sums a tensor over processes: the batch normalization then divides by
    the mean over every process's tokens (verl's distributed mean).
    """
    if old_log_probs.shape != rollout_log_probs.shape or old_log_probs.shape != response_mask.shape:
        raise ValueError(
            "old_log_probs, rollout_log_probs and response_mask must have one shape (B, T), got "
            f"{tuple(old_log_probs.shape)}, {tuple(rollout_log_probs.shape)}, {tuple(response_mask.shape)}."
        )
    if not bool(response_mask.any()):
        raise ValueError("response_mask must mark at least one token (1).")
    check_options(rollout_is, rollout_is_threshold)
    criteria = parse_rejection_criteria(rollout_rs) if rollout_rs is not None else ()
    bounds = parse_thresholds(criteria, rollout_rs_threshold) if criteria else {}

    mask = response_mask  # its own dtype, as verl counts it (an integer mask: the counts are exact in float32)
    log_ratio = old_log_probs - rollout_log_probs
    metrics: dict[str, torch.Tensor] = {}
    weights = None
    if rollout_is is not None and rollout_is_threshold is not None:
        weights, is_metrics = importance_weights(
            log_ratio, mask, rollout_is, rollout_is_threshold, rollout_is_batch_normalize, all_reduce_sum
        )
        metrics.update(is_metrics)
    corrected_mask = response_mask.clone()
    if criteria:
        keep, rs_metrics = rejection_mask(log_ratio, mask, criteria, bounds)
        corrected_mask = (response_mask * keep).to(response_mask.dtype)
        metrics.update(rs_metrics)
    metrics.update(mismatch_metrics(old_log_probs, rollout_log_probs, mask))
    return RolloutCorrection(weights, corrected_mask, _as_floats(metrics))


def _as_floats(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    """name -> float, prefixed `rollout_corr/`, read from the device in one transfer."""
    names = list(metrics)
    values = torch.stack([metrics[name].detach().reshape(()).to(torch.float64) for name in names]).tolist()
    return {METRIC_PREFIX + name: value for name, value in zip(names, values, strict=True)}
