"""grpo_plus.app.plotting: PNGs from Trainer log histories, with labelled axes and legends."""

from __future__ import annotations

import math

from grpo_plus.app.plotting import BeforeAfter, plot_comparison, plot_training_curves, series
from grpo_plus.app.recipe import held_out_accuracy

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def grpo_log_history(steps: int = 12, slope: float = 0.05, offset: float = 0.0) -> list[dict]:
    """What TRL 1.16's GRPOTrainer leaves in `trainer.state.log_history` (plus an eval entry and the final summary)."""
    history = []
    for step in range(1, steps + 1):
        reward = min(1.0, 0.3 + offset + slope * step)
        history.append(
            {
                "loss": 0.01 * math.sin(step),
                "reward": reward,
                "reward_std": 0.2,
                "rewards/correctness_reward/mean": reward * 0.8,
                "rewards/format_reward/mean": reward * 0.2,
                "completions/mean_length": 12.0 - 0.2 * step,
                "clip_ratio/region_mean": 0.01 * (step % 3),
                "learning_rate": 1e-4,
                "epoch": step / steps,
                "step": step,
            }
        )
        if step % 4 == 0:
            history.append({"eval_accuracy": 0.5 + offset + 0.03 * step, "epoch": step / steps, "step": step})
    history.append({"train_runtime": 12.3, "train_loss": 0.01, "epoch": 1.0, "step": steps})
    return history


def assert_png(path, min_bytes: int = 10_000) -> None:
    """A real PNG of some substance (not an empty canvas)."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert len(data) > min_bytes


def visible_axes(fig):
    """The panels that are drawn."""
    return [ax for ax in fig.axes if ax.get_visible()]


def test_training_curves_png_with_labels_and_legend(tmp_path):
    path = tmp_path / "reward_curve.png"
    fig = plot_training_curves(grpo_log_history(), path)
    assert_png(path)
    axes = visible_axes(fig)
    assert len(axes) == 4  # reward (+ per-function rewards), completion length, held-out accuracy, clip ratio
    for ax in axes:
        assert ax.get_xlabel() == "step" and ax.get_ylabel() and ax.get_title()
        assert ax.get_legend() is not None
    reward_ax = axes[0]
    labels = [t.get_text() for t in reward_ax.get_legend().get_texts()]
    assert {"reward", "correctness_reward", "format_reward"} <= set(labels)
    (xs, ys) = reward_ax.lines[0].get_data()
    assert list(xs) == list(range(1, 13)) and ys[-1] > ys[0]


def demo_log_history(steps: int = 6) -> list[dict]:
    """What the demo logs: one optimizer step per generation batch, so every clip fraction is exactly 0 (ratio 1),
    while the fraction of groups with equal rewards moves."""
    dead_groups = [0.0, 0.0, 0.25, 0.5, 0.25, 0.5]
    history = [
        {
            "reward": 0.4 + 0.05 * step,
            "reward_std": 0.3,
            "completions/mean_length": 15.0 - step,
            "frac_reward_zero_std": dead_groups[(step - 1) % len(dead_groups)],
            "clip_ratio/low_mean": 0.0,
            "clip_ratio/high_mean": 0.0,
            "clip_ratio/region_mean": 0.0,
            "step": step,
        }
        for step in range(1, steps + 1)
    ]
    return history


def test_flat_clip_panel_gives_way_to_panels_that_move(tmp_path):
    fig = plot_training_curves(demo_log_history(), tmp_path / "reward_curve.png")
    assert_png(tmp_path / "reward_curve.png")
    axes = {ax.get_title(): ax for ax in visible_axes(fig)}
    assert set(axes) == {"reward", "completions/mean_length", "frac_reward_zero_std"}
    for title, ax in axes.items():
        assert len(set(ax.lines[0].get_ydata())) > 1, f"panel {title} is flat"
    assert axes["frac_reward_zero_std"].get_ylabel() == "fraction of groups with equal rewards"


def test_held_out_before_and_after_are_two_bars_not_a_line(tmp_path):
    """The recipe measures held-out accuracy twice (before and after training): the panel shows two labelled bars
    with their values, and no line between them that would read as a curve over the steps."""
    measured = held_out_accuracy({"accuracy": 0.556}, {"accuracy": 1.0}, steps=30)
    fig = plot_training_curves(demo_log_history(), tmp_path / "reward_curve.png", before_after=measured)
    assert_png(tmp_path / "reward_curve.png")
    axes = {ax.get_title(): ax for ax in visible_axes(fig)}
    panel = axes["held-out accuracy: before / after"]
    assert len(panel.lines) == 0
    assert [bar.get_height() for bar in panel.patches] == [0.556, 1.0]
    assert [tick.get_text() for tick in panel.get_xticklabels()] == ["before training", "after 30 steps"]
    assert [text.get_text() for text in panel.texts] == ["0.556", "1.000"]
    assert panel.get_ylim() == (0, 1.12) and panel.get_ylabel() == "held-out accuracy"
    assert "eval_accuracy" not in axes


def test_before_after_alone_is_drawn(tmp_path):
    fig = plot_training_curves([], tmp_path / "r.png", before_after=BeforeAfter("held-out accuracy", 0.2, 0.5, 4))
    assert [ax.get_title() for ax in visible_axes(fig)] == ["held-out accuracy: before / after"]


def test_clip_panel_is_kept_where_clipping_happens(tmp_path):
    history = demo_log_history()
    history[3]["clip_ratio/region_mean"] = 0.02
    fig = plot_training_curves(history, tmp_path / "reward_curve.png")
    assert "clip_ratio/region_mean" in [ax.get_title() for ax in visible_axes(fig)]


def test_held_out_accuracy_needs_both_evaluations():
    assert held_out_accuracy(None, {"accuracy": 1.0}, 5) is None
    assert held_out_accuracy({"format_rate": 0.1}, {"format_rate": 0.2}, 5) is None


def test_training_curves_missing_keys_are_skipped(tmp_path):
    history = [{"reward": 0.1 * s, "step": s} for s in range(5)] + [{"train_runtime": 1.0, "step": 5}]
    fig = plot_training_curves(history, tmp_path / "r.png", keys=("reward", "kl", "entropy"))
    assert len(visible_axes(fig)) == 1
    assert_png(tmp_path / "r.png", min_bytes=5_000)


def test_training_curves_with_nothing_logged_still_writes_a_png(tmp_path):
    fig = plot_training_curves([{"train_runtime": 1.0}], tmp_path / "sub" / "r.png")
    assert_png(tmp_path / "sub" / "r.png", min_bytes=2_000)
    assert "no metrics" in fig.axes[0].texts[0].get_text()


def test_series_skips_non_numbers_and_uses_index_without_step():
    history = [{"reward": 1.0}, {"reward": float("nan")}, {"reward": None}, {"reward": True}, {"reward": 2}]
    assert series(history, "reward") == ([0, 4], [1.0, 2.0])


def test_comparison_grid_one_line_per_run(tmp_path):
    runs = {"dapo": grpo_log_history(slope=0.06), "grpo": grpo_log_history(slope=0.03, offset=-0.1)}
    path = tmp_path / "compare.png"
    fig = plot_comparison(runs, path)
    assert_png(path)
    axes = visible_axes(fig)
    assert [ax.get_title() for ax in axes] == [
        "reward",
        "eval_accuracy",
        "completions/mean_length",
        "clip_ratio/region_mean",
    ]
    for ax in axes:
        assert ax.get_xlabel() == "step" and ax.get_ylabel()
        assert [t.get_text() for t in ax.get_legend().get_texts()] == ["dapo", "grpo"]
        assert len(ax.lines) == 2
    eval_xs = axes[1].lines[0].get_data()[0]
    assert list(eval_xs) == [4, 8, 12]


def test_comparison_leaves_out_metrics_no_run_logged(tmp_path):
    runs = {"a": [{"reward": 0.1, "step": 1}, {"reward": 0.2, "step": 2}], "b": [{"reward": 0.3, "step": 1}]}
    fig = plot_comparison(runs, tmp_path / "c.png")
    assert [ax.get_title() for ax in visible_axes(fig)] == ["reward"]
    fig = plot_comparison({"a": [{"loss": 1.0}]}, tmp_path / "d.png")
    assert "none of the runs" in fig.axes[0].texts[0].get_text()
    assert_png(tmp_path / "d.png", min_bytes=2_000)
