"""benchmarks/long_completions.py cannot rot: its --smoke run (tiny random Llama, 8 and 16 tokens, 2 lock-step steps)
trains both sides on the same completions, and what it reports per step adds up against an independent count of
what stock TRL computes."""

import json

import pytest

from grpo_plus.compat.versions import version_gap

PARTS = ("generation", "scoring", "train_pass", "optimizer")


@pytest.mark.engine  # a benchmark's smoke run (moved out of make test: its 10-minute budget)
def test_long_completions_smoke_reports_paired_steps_and_trl_positions(tmp_path, benchmark_in_this_process):
    output = tmp_path / "long.json"
    import long_completions

    long_completions.main(["--smoke", "--json", str(output)])
    report = json.loads(output.read_text())
    assert [run["max_completion_length"] for run in report["runs"]] == [8, 16]

    for run in report["runs"]:
        cap = run["max_completion_length"]
        # lock-step with each side's own random state: the same completions, hence the same losses (float32)
        assert run["same_completions_per_step"] == [True, True]
        assert run["max_loss_difference"] == 0  # bit for bit in every run
        trl_steps, our_steps = run["steps"]["trl"], run["steps"]["ours"]
        assert len(trl_steps) == len(our_steps) == 2
        for trl_step, our_step in zip(trl_steps, our_steps, strict=True):
            rows, longest = trl_step["rows"], trl_step["max_length"]
            assert rows == 16 and 1 <= longest <= cap and trl_step["mean_length"] <= longest
            # TRL's clipped ratio: a share of the rows, and above 0 only where a completion ran to the cap
            assert (trl_step["truncated"] * rows).is_integer() and (trl_step["truncated"] == 0 or longest == cap)
            assert 0 <= trl_step["dead_groups"] <= 1
            assert (our_step["mean_length"], our_step["dead_groups"]) == (
                trl_step["mean_length"],
                trl_step["dead_groups"],
            )
            # TRL prefills every prompt copy, decodes every row until the longest ends, and trains every row at the
            # padded prompt width + the longest completion: counted here from the prefill and the longest length
            prompt_width = trl_step["prefill_positions"] // rows
            assert trl_step["generation_positions"] == rows * prompt_width + rows * (longest - 1)
            assert trl_step["train_positions"] == rows * (prompt_width + longest)
            # the zero-waste side computed less in both (generation: where this transformers runs grpo_plus's loop),
            # and every timed part was measured
            if version_gap("zero_waste_generation") is None:
                assert our_step["generation_positions"] < trl_step["generation_positions"]
            else:
                assert our_step["generation_positions"] == trl_step["generation_positions"]
            assert our_step["train_positions"] < trl_step["train_positions"]
            for step in (trl_step, our_step):
                for clock in ("wall", "cpu"):
                    assert all(step[clock][part] > 0 for part in PARTS), (clock, step[clock])
                # the trainer thread's CPU time cannot exceed the wall time it spent (one intra-op thread)
                assert step["cpu"]["step"] <= step["wall"]["step"] * 1.05
        summed, ratios = run["summed"], run["ratios"]
        for clock in ("wall", "cpu"):
            assert summed["trl"][clock]["step"] == sum(step[clock]["step"] for step in trl_steps)
            assert (
                ratios[clock]["train_pass"] == summed["ours"][clock]["train_pass"] / summed["trl"][clock]["train_pass"]
            )
        for key in ("generation_positions", "train_positions"):
            assert ratios["positions"][key] == summed["ours"][key] / summed["trl"][key]

    markdown = output.with_suffix(".md").read_text()
    for length in (8, 16):
        assert markdown.count(f"| {length} | stock TRL |") == 2 and f"| {length} | **ratio** |" in markdown
