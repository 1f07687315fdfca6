"""The benchmarks that run on vLLM's real engine cannot rot: their smoke runs, on the CPU build.

benchmarks/partial_rollouts.py --vllm: grpo_plus's synchronous vLLM generation against partial rollouts in the same
colocated engine (one engine for the run, started by the script), on a random tiny Llama 128 wide (vLLM's CPU attention
takes heads of 32 and wider)."""

from __future__ import annotations

import json

import pytest


def test_the_partial_rollouts_benchmark_runs_on_the_engine(tmp_path, benchmark_in_this_process):
    """--vllm --smoke: both sides train their 3 steps on the engine, each step's generation timed (the partial side's
    chunks: vLLM's calls), the partial side's staleness metrics kept; stock TRL's side is refused there."""
    import partial_rollouts

    output = tmp_path / "partial_vllm.json"
    assert partial_rollouts.main(["--vllm", "--sides", "ours,partial", "--smoke", "--json", str(output)]) == 0
    report = json.loads(output.read_text())
    (run,) = report["runs"]
    for side in ("ours", "partial"):
        assert len(run[side]["generation_seconds"]) == len(run[side]["step_seconds"]) == 3
        assert all(seconds > 0 for seconds in run[side]["generation_seconds"]), side
    assert run["partial"]["staleness"]["partial_rollouts/stale_token_frac"][0] == 0  # step 0 carries nothing
    assert "trl" not in run and report["settings"]["vllm"] == "True"
    with pytest.raises(SystemExit):
        partial_rollouts.main(["--vllm", "--smoke"])  # the default sides include stock TRL's
