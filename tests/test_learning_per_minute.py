"""benchmarks/learning_per_minute.py cannot rot: its smoke run trains stock TRL and grpo_plus in lock-step on a
reasoning-gym task (the tiny model) and reports curves that coincide step by step; its equal-wall-clock reading uses
only evaluations made by then."""

from __future__ import annotations

import json

import pytest


@pytest.fixture
def benchmark(benchmark_in_this_process):  # it imports benchmarks/harness/, as run from there
    import learning_per_minute

    return learning_per_minute


@pytest.mark.engine  # a benchmark's smoke run (moved out of make test: its 10-minute budget)
def test_smoke_run_reports_both_sides_with_the_same_numbers_per_step(benchmark, tmp_path):
    output = tmp_path / "lpm.json"
    assert benchmark.main(["--smoke", "--json", str(output)]) == 0
    report = json.loads(output.read_text())
    sides, summary = report["sides"], report["summary"]
    assert [[p["step"] for p in sides[name]["evals"]] for name in ("trl", "ours")] == [[0, 1, 2], [0, 1, 2]]
    # float32, lock-step, random states swapped in and out, evaluations between steps: the same losses, rewards,
    # completion lengths and held-out scores on both sides (an evaluation that drew random numbers, or a trainer
    # that saw the other's random state, would part them)
    assert summary["per_step_check"] == {
        "max_abs_loss_difference": 0.0,
        "same_completion_lengths": True,
        "same_rewards": True,
        "same_evaluations": True,
    }
    totals = summary["training_minutes"]
    assert summary["equal_wall_clock"]["minutes"] == min(totals.values())
    for name in ("trl", "ours"):
        assert totals[name] == pytest.approx(sum(sides[name]["step_seconds"]) / 60)
        assert sides[name]["evals"][-1]["train_seconds"] == pytest.approx(sum(sides[name]["step_seconds"]))
    assert output.with_suffix(".png").stat().st_size > 10_000


def test_equal_wall_clock_takes_each_sides_last_evaluation_made_by_then(benchmark):
    def side(step_seconds, accuracies, every):
        cumulative = [sum(step_seconds[:i]) for i in range(len(step_seconds) + 1)]
        evals = [
            {"step": s, "train_seconds": cumulative[s], "accuracy": a, "eval_seconds": 1.0}
            for s, a in zip(range(0, len(step_seconds) + 1, every), accuracies, strict=True)
        ]
        n = len(step_seconds)
        return {"evals": evals, "step_seconds": step_seconds, "losses": [0.0] * n, "rewards": [0.0] * n,
                "completion_lengths": [1.0] * n}  # fmt: skip

    # 4 steps each, evaluated every 2: TRL 30 s a step, grpo_plus 10 s
    sides = {"trl": side([30.0] * 4, [0.5, 0.6, 0.9], 2), "ours": side([10.0] * 4, [0.5, 0.6, 0.9], 2)}
    summary = benchmark.summarize(sides)
    equal = summary["equal_wall_clock"]
    assert equal["minutes"] == pytest.approx(40 / 60) and equal["set_by"] == "ours"
    # by 40 s TRL has made 1 step and been evaluated only before training: 0.5, not its later 0.6 or 0.9
    assert equal["accuracy"] == {"trl": 0.5, "ours": 0.9}
    assert equal["steps_done"] == {"trl": 1, "ours": 4}
    assert summary["minutes_to_reach_it"] == {"trl": pytest.approx(2.0), "ours": pytest.approx(40 / 60)}
    assert summary["training_time_ratio"] == pytest.approx(1 / 3)
