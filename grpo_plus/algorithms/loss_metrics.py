"""The loss metrics a GRPOTrainer logs per micro-batch: TRL's names, global means over processes."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..compat.loss import nanmax, nanmin
from ..objective import PolicyLossOutput

# The mean entropy of the rows the zero-waste pass trained (non-zero advantage), logged when it may skip rows.
TRAINED_ROWS_ENTROPY = "zero_waste/entropy_trained_rows"


def log_loss_metrics(
    metrics: dict[str, list],
    accelerator: Any,
    out: PolicyLossOutput,
    entropies: torch.Tensor,
    trained_rows: torch.Tensor | None = None,
    entropies_of_every_row: bool = True,
) -> None:
    """Append TRL's loss metrics (clip fractions, ratio, KL, entropy) and grpo_plus's (dual clip, the policy loss's
    own) to `metrics`.

    `entropy` is TRL's: the mean entropy over every completion token. When the zero-waste pass skipped rows without
    computing their entropy (`entropies_of_every_row` False, on any process), this micro-batch's value is unknown and
    the logging window's `entropy` is left unknown too (TRL's `log` then writes None): the mean of the other
    micro-batches would not be TRL's number either. With `trained_rows` (rows may be skipped), `TRAINED_ROWS_ENTROPY`
    is the mean entropy over the tokens of the rows with gradient (NaN when there are none), and `ratio/mean`
    averages the computed rows. The clip fractions count every row (a zero-advantage row is never clipped, in TRL as
    here).
    """
    computed_rows = None if trained_rows is None or bool(trained_rows.all()) else trained_rows
    totals = out.metric_totals()
    if computed_rows is not None:
        totals["ratio/mean"] = out.total(out.importance_weights, computed_rows)
    totals["entropy"] = out.total(entropies)
    if not entropies_of_every_row:  # NaN survives the sum over processes: unknown if unknown anywhere
        totals["entropy"] = torch.full_like(totals["entropy"], math.nan)
    if trained_rows is not None:
        totals[TRAINED_ROWS_ENTROPY] = out.total(entropies, trained_rows)
    names = list(totals)
    reduced = accelerator.reduce(torch.stack([totals[n].float() for n in names]), reduction="sum")
    computed_only = ("ratio/mean", TRAINED_ROWS_ENTROPY)
    for name, (total, count) in zip(names, reduced.tolist(), strict=True):
        if name == "entropy":
            append_for_whole_window(metrics[name], total / max(count, 1.0))
        elif name in computed_only and count == 0:  # no row computed: nothing to average
            metrics[name].append(math.nan)
        else:
            metrics[name].append(total / max(count, 1.0))
    fractions = out.sequence_clip_fractions()
    if fractions is not None:  # a policy loss that clips a ratio (TRL logs these for its clipping losses only)
        low, high = fractions
        metrics["clip_ratio/low_min"].append(nanmin(accelerator.gather(low.float())).item())
        metrics["clip_ratio/high_max"].append(nanmax(accelerator.gather(high.float())).item())


def append_for_whole_window(values: list[float], value: float) -> None:
    """Append one micro-batch's value of a metric TRL averages over the logging window (its `log` leaves NaN out);
    a NaN (unknown) value makes every value of the window NaN, so the window logs nothing rather than the mean of
    the micro-batches that are known."""
    if math.isnan(value) or any(math.isnan(v) for v in values):
        values[:] = [math.nan] * (len(values) + 1)
    else:
        values.append(value)
