"""The loss metrics a GRPOTrainer logs per micro-batch: TRL's names, global means over processes."""

from __future__ import annotations

from typing import Any

import torch

from .objective import PolicyLossOutput
from .trl_compat import nanmax, nanmin


def log_loss_metrics(
    metrics: dict[str, list],
    accelerator: Any,
    out: PolicyLossOutput,
    entropies: torch.Tensor,
    computed_rows: torch.Tensor | None = None,
) -> None:
    """Append TRL's loss metrics (clip fractions, ratio, KL, entropy) and grpo_plus's (dual clip, the policy loss's
    own) to `metrics`.

    With rows skipped by the zero-waste pass (`computed_rows`), `entropy` and `ratio/mean` average the computed rows
    (NaN when none was); the clip fractions still count every row (a zero-advantage row is never clipped, in TRL as
    here).
    """
    totals = out.metric_totals()
    if computed_rows is not None:
        totals["ratio/mean"] = out.total(out.importance_weights, computed_rows)
    totals["entropy"] = out.total(entropies, computed_rows)
    names = list(totals)
    reduced = accelerator.reduce(torch.stack([totals[n].float() for n in names]), reduction="sum")
    computed_only = ("entropy", "ratio/mean") if computed_rows is not None else ()
    for name, (total, count) in zip(names, reduced.tolist(), strict=True):
        if name in computed_only and count == 0:  # every row skipped: nothing to average
            metrics[name].append(float("nan"))
        else:
            metrics[name].append(total / max(count, 1.0))
    fractions = out.sequence_clip_fractions()
    if fractions is not None:  # a policy loss that clips a ratio (TRL logs these for its clipping losses only)
        low, high = fractions
        metrics["clip_ratio/low_min"].append(nanmin(accelerator.gather(low.float())).item())
        metrics["clip_ratio/high_max"].append(nanmax(accelerator.gather(high.float())).item())
