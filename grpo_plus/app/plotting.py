"""Training-curve plots from a Trainer's `state.log_history` (reward_curve.png, `grpo-plus compare`).

Figures are built with `matplotlib.figure.Figure` directly, not pyplot: no display or GUI backend is
touched, nothing accumulates in pyplot's global figure list, and the returned Figure can be inspected.
"""

from __future__ import annotations

import fnmatch
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure

__all__ = [
    "DEFAULT_COMPARE_METRICS",
    "DEFAULT_TRAINING_KEYS",
    "BeforeAfter",
    "plot_comparison",
    "plot_training_curves",
    "series",
]

# One panel per entry; a tuple puts several series (glob patterns allowed) in the same panel.
DEFAULT_TRAINING_KEYS: tuple[str | tuple[str, ...], ...] = (
    ("reward", "rewards/*/mean"),
    "completions/mean_length",
    "frac_reward_zero_std",
    "eval_accuracy",
    "clip_ratio/region_mean",
)
# Panels left out when every logged value is 0. The clip fraction is exactly 0 in any run that takes one optimizer
# step per generation batch (the ratio is 1), which says nothing; where clipping happens the panel is kept.
DEFAULT_HIDDEN_WHEN_ZERO = ("clip_ratio/*",)
DEFAULT_COMPARE_METRICS = ("reward", "eval_accuracy", "completions/mean_length", "clip_ratio/region_mean")

# Readable axis labels for the keys TRL's GRPOTrainer logs.
_LABELS = {
    "reward": "mean reward",
    "reward_std": "reward std",
    "completions/mean_length": "mean completion length (tokens)",
    "clip_ratio/region_mean": "fraction of tokens clipped",
    "frac_reward_zero_std": "fraction of groups with equal rewards",
    "kl": "KL to reference",
    "entropy": "entropy",
    "loss": "loss",
    "eval_accuracy": "held-out accuracy",
    "learning_rate": "learning rate",
}


@dataclass(frozen=True)
class BeforeAfter:
    """A metric measured once before and once after training (the recipes' held-out accuracy): two measurements,
    drawn as two bars, never as a line that would suggest a curve between them."""

    label: str  # e.g. "held-out accuracy"
    before: float
    after: float
    steps: int  # optimizer steps between the two measurements


def series(log_history: Sequence[Mapping[str, Any]], key: str, x: str = "step") -> tuple[list[float], list[float]]:
    """(x, y) points of `key` in a log history; entries without `x` use their index, non-numbers are skipped."""
    xs, ys = [], []
    for i, entry in enumerate(log_history):
        value = entry.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            xs.append(entry.get(x, i))
            ys.append(float(value))
    return xs, ys


def _expand(log_history: Sequence[Mapping[str, Any]], patterns: str | Sequence[str]) -> list[str]:
    """Logged keys matching the pattern(s), in pattern order then first-seen order."""
    patterns = (patterns,) if isinstance(patterns, str) else tuple(patterns)
    logged = list(dict.fromkeys(k for entry in log_history for k in entry))
    keys = [k for p in patterns for k in logged if fnmatch.fnmatchcase(k, p)]
    return list(dict.fromkeys(keys))


def _grid(n: int, *, ncols: int, title: str | None, panel_size: tuple[float, float] = (5.0, 3.4)) -> list[Axes]:
    """A Figure with n panels in rows of `ncols`; unused cells are hidden."""
    ncols = max(1, min(ncols, n))
    nrows = math.ceil(n / ncols)
    fig = Figure(figsize=(panel_size[0] * ncols, panel_size[1] * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel().tolist()
    for ax in axes[n:]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    return axes[:n]


def _empty_figure(title: str | None, message: str) -> Figure:
    """A one-panel figure saying there is nothing to plot (better than no file for a report that links it)."""
    (ax,) = _grid(1, ncols=1, title=title)
    text = ax.text(0.5, 0.5, message, ha="center", va="center", wrap=True, transform=ax.transAxes)
    text.set_in_layout(False)  # a long message must not squeeze the axes to nothing under constrained layout
    ax.set_xlabel("step")
    ax.set_ylabel("value")
    return ax.figure


def _save(fig: Figure, path: str | os.PathLike) -> None:
    """Write the figure as PNG, creating the parent directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, format="png")


def _label(key: str) -> str:
    """Axis label for a logged key."""
    return _LABELS.get(key, key)


def _line_label(key: str) -> str:
    """Legend label: 'rewards/<func>/mean' reads as '<func>'."""
    parts = key.split("/")
    return parts[1] if len(parts) == 3 and parts[0] == "rewards" and parts[2] == "mean" else key


def plot_training_curves(
    log_history: Sequence[Mapping[str, Any]],
    path: str | os.PathLike,
    *,
    keys: Sequence[str | Sequence[str]] = DEFAULT_TRAINING_KEYS,
    hidden_when_zero: Sequence[str] = DEFAULT_HIDDEN_WHEN_ZERO,
    title: str | None = "GRPO training",
    x: str = "step",
    before_after: BeforeAfter | None = None,
) -> Figure:
    """Plot logged training metrics (one panel per entry of `keys`, missing keys skipped) to a PNG; return the Figure.

    A panel whose keys all match a pattern of `hidden_when_zero` and never leave 0 is skipped too. `before_after`
    adds a last panel with its two measurements as bars.
    """
    panels = [
        found
        for patterns in keys
        if (found := _expand(log_history, patterns)) and not _flat_zero(log_history, found, hidden_when_zero, x)
    ]
    if not panels and before_after is None:
        fig = _empty_figure(title, "no metrics logged")
        _save(fig, path)
        return fig
    count = len(panels) + (before_after is not None)
    axes = _grid(count, ncols=2 if count > 1 else 1, title=title)
    for ax, panel in zip(axes, panels, strict=False):
        _plot_panel(ax, log_history, panel, x)
    if before_after is not None:
        _plot_before_after(axes[-1], before_after)
    fig = axes[0].figure
    _save(fig, path)
    return fig


def _flat_zero(log_history: Sequence[Mapping[str, Any]], keys: list[str], patterns: Sequence[str], x: str) -> bool:
    """True if every key matches one of `patterns` and all its logged values are 0."""
    return all(
        any(fnmatch.fnmatchcase(key, p) for p in patterns) and not any(series(log_history, key, x)[1]) for key in keys
    )


def _plot_panel(ax: Axes, log_history: Sequence[Mapping[str, Any]], keys: list[str], x: str) -> None:
    """One panel of plot_training_curves: each key a line; the reward line gets a ±std band when logged."""
    for key in keys:
        xs, ys = series(log_history, key, x)
        (line,) = ax.plot(xs, ys, marker="." if len(xs) < 50 else None, label=_line_label(key))
        if key == "reward":
            _std_band(ax, log_history, x, line.get_color())
    ax.set_title(_line_label(keys[0]) if len(keys) == 1 else _label(keys[0]))
    ax.set_xlabel(x)
    ax.set_ylabel(_label(keys[0]))
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def _plot_before_after(ax: Axes, measured: BeforeAfter) -> None:
    """Two bars, before and after training, each with its value written on it."""
    labels = ["before training", f"after {measured.steps} steps"]
    bars = ax.bar(labels, [measured.before, measured.after], color=["0.65", "C0"], width=0.55)
    ax.bar_label(bars, fmt="%.3f", padding=2)
    top = max(measured.before, measured.after)
    ax.set_ylim(0, 1.12 if 0 <= min(measured.before, measured.after) and top <= 1 else top * 1.12 or 1)
    ax.set_title(f"{measured.label}: before / after")
    ax.set_ylabel(measured.label)
    ax.grid(alpha=0.3, axis="y")


def _std_band(ax: Axes, log_history: Sequence[Mapping[str, Any]], x: str, color: str) -> None:
    """Shade reward ± reward_std over the steps where both were logged."""
    points = [
        (entry.get(x, i), entry["reward"], entry["reward_std"])
        for i, entry in enumerate(log_history)
        if isinstance(entry.get("reward"), (int, float)) and isinstance(entry.get("reward_std"), (int, float))
    ]
    if len(points) > 1:
        xs = [p[0] for p in points]
        low = [mean - std for _, mean, std in points]
        high = [mean + std for _, mean, std in points]
        ax.fill_between(xs, low, high, color=color, alpha=0.15, label="reward ± std")


def plot_comparison(
    runs: Mapping[str, Sequence[Mapping[str, Any]]],
    path: str | os.PathLike,
    metrics: Sequence[str] = DEFAULT_COMPARE_METRICS,
    *,
    title: str | None = "GRPO runs compared",
    x: str = "step",
) -> Figure:
    """Plot each metric in its own panel with one line per named run; metrics no run logged are left out."""
    shown = [m for m in metrics if any(series(history, m, x)[0] for history in runs.values())]
    if not shown:
        fig = _empty_figure(title, "none of the runs logged " + ", ".join(metrics))
        _save(fig, path)
        return fig
    axes = _grid(len(shown), ncols=2, title=title)
    for ax, metric in zip(axes, shown, strict=True):
        for name, history in runs.items():
            xs, ys = series(history, metric, x)
            if xs:
                ax.plot(xs, ys, marker="." if len(xs) < 50 else None, label=name)
        ax.set_title(metric)
        ax.set_xlabel(x)
        ax.set_ylabel(_label(metric))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig = axes[0].figure
    _save(fig, path)
    return fig
