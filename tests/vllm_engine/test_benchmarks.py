"""The benchmarks that run on vLLM's real engine cannot rot: their smoke runs, on the CPU build.

benchmarks/partial_rollouts.py --vllm: grpo_plus's synchronous vLLM generation against partial rollouts in the same
colocated engine (one engine for the run, started by the script), on a random tiny Llama 128 wide (vLLM's CPU attention
takes heads of 32 and wider). benchmarks/vllm_decode_cost.py: the engine built as asked (dtype, block size), each figure
measured."""

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
    # the engine vLLM built from the trainers' vllm_dtype / vllm_block_size (the CPU build's own: bfloat16, 128)
    assert report["engine"] == {"dtype": "torch.float32", "block_size": 32}
    with pytest.raises(SystemExit):
        partial_rollouts.main(["--vllm", "--smoke"])  # the default sides include stock TRL's


def test_the_decode_cost_benchmark_builds_the_engine_asked_and_measures_it(tmp_path, benchmark_in_this_process):
    """--smoke, one case: the engine vLLM built (its own process) has the dtype and block size asked, and every figure
    was measured (the module's docstring: a decode step with 1 and 16 rows, a prefill and the same rows re-sent)."""
    import vllm_decode_cost

    output = tmp_path / "decode.json"
    assert vllm_decode_cost.main(["--smoke", "--cases", "float32:32", "--json", str(output)]) == 0
    (case,) = json.loads(output.read_text())["cases"]
    assert (case["dtype"], case["block_size"]) == ("torch.float32", 32)
    assert case["row_tokens"] > 16  # the prompt and the 2 x 8 tokens generated for it
    for key in ("decode_ms_1_row", "decode_ms_16_rows", "prefill_s", "resend_s"):
        assert len(case["runs"][key]) == 1 and case[key] > 0, key
