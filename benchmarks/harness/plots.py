"""The plots benchmarks share: held-out accuracy against training minutes and against the optimizer step."""

from __future__ import annotations


def accuracy_panels(eval_size: int | str, minutes_label: str):
    """(figure, panel by training minutes, panel by step): two panels side by side, titled and labelled, the y axis
    the greedy accuracy on `eval_size` held-out questions; `minutes_label` says what the minutes count."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), layout="constrained")
    by_minutes, by_step = fig.subplots(1, 2)
    by_minutes.set_title("held-out accuracy against training time")
    by_minutes.set_xlabel(minutes_label)
    by_step.set_title("held-out accuracy against the optimizer step")
    by_step.set_xlabel("optimizer step")
    for ax in (by_minutes, by_step):
        ax.set_ylabel(f"greedy accuracy, {eval_size} held-out questions")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    return fig, by_minutes, by_step
