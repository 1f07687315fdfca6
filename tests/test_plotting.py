"""grpo_plus.plotting: PNGs from Trainer log histories, with labelled axes and legends."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("matplotlib")

from grpo_plus.plotting import plot_comparison, plot_training_curves, series  # noqa: E402

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
    assert len(axes) == 3  # reward (+ per-function rewards), completion length, clip ratio
    for ax in axes:
        assert ax.get_xlabel() == "step" and ax.get_ylabel() and ax.get_title()
        assert ax.get_legend() is not None
    reward_ax = axes[0]
    labels = [t.get_text() for t in reward_ax.get_legend().get_texts()]
    assert {"reward", "correctness_reward", "format_reward"} <= set(labels)
    (xs, ys) = reward_ax.lines[0].get_data()
    assert list(xs) == list(range(1, 13)) and ys[-1] > ys[0]


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
