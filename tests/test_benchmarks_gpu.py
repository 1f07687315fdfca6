"""The GPU benchmark and the memory counting cannot rot: benchmarks/gpu.py --smoke trains every case at tiny shapes
on CPU, and benchmarks/memory.py's counting is checked against real compute and the CPU allocator."""

import ast
import dataclasses
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from helpers.probes import run_python

from grpo_plus.compat.versions import version_gap

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))


def run_gpu_benchmark(*args, env=None):
    return run_python(BENCHMARKS / "gpu.py", *args, env={**os.environ, **(env or {})}, cwd=ROOT, timeout=900)


@pytest.mark.engine  # its work is in a child process (moved out of make test: its 10-minute budget)
def test_bench_gpu_without_cuda_says_so_in_one_line(tmp_path):
    result = run_gpu_benchmark("--json", tmp_path / "gpu.json", env={"CUDA_VISIBLE_DEVICES": ""})
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0], result.stdout
    assert not (tmp_path / "gpu.json").exists()


@pytest.mark.engine  # its work is in a child process (moved out of make test: its 10-minute budget)
@pytest.mark.slow
def test_gpu_benchmark_smoke_runs_every_case_and_matches_stock_trl(tmp_path):
    output = tmp_path / "gpu.json"
    run_gpu_benchmark("--smoke", "--fresh", "--json", output)
    report = json.loads(output.read_text())
    cases = report["cases"]
    assert set(cases) == {"smoke-lora", "smoke-qlora-gc", "smoke-long"}

    for name in ("smoke-lora", "smoke-qlora-gc"):
        summary = cases[name]["summary"]
        assert set(summary) == {"trl", "ours", "ours_off"}
        for side, values in summary.items():
            assert "error" not in values, (name, side, values)
            assert values["full_length"], f"{name}/{side}: completions shorter than configured"
            assert len(values["losses"]) == 2 and values["step"] > 0 and values["train_pass"] > 0
        for side in ("ours", "ours_off"):
            values = summary[side]
            assert values["same_completions"] and values["losses_equal"], (name, side)
            # float32 on CPU: the zero-waste forward reads the same numbers as TRL's (entropies bit for bit in every
            # run); the gradient's norm sums the rows' gradients in another order: worst 6.4e-8 relative (half a
            # float32 ulp, the newest environment), 0 in most runs: 3.9x
            assert values["entropies_max_rel_diff"] == 0 and values["grad_norms_max_rel_diff"] <= 2.5e-7
        if (
            version_gap("shared_prompt") is None
        ):  # TRL 1.14: no shared prompt, and full-length completions leave no padding
            assert summary["ours"]["positions_frac"] < 1.0, "the zero-waste pass computed every position"
        assert summary["ours_off"]["positions_frac"] == 1.0

    ladder = cases["smoke-long"]["summary"]
    for side in ("trl", "ours", "ours_off", "ours_long"):  # ours_long: activation offloading + tiled MLP
        assert [rung["completion_length"] for rung in ladder[side]] == [16, 32]
        assert all(rung["train_pass"] > 0 and "out_of_memory" not in rung for rung in ladder[side])

    assert report["sdpa"]["backends"]["MATH"]["runs"], report["sdpa"]
    markdown = output.with_suffix(".md").read_text()
    for row in ("| smoke-lora | on |", "| smoke-lora | off |", "| smoke-qlora-gc | on |", "| smoke-qlora-gc | off |"):
        assert row in markdown
    assert markdown.count("| smoke-long |") == 8


@pytest.mark.floor("fused_lm_head")  # memory.py counts TRL's fused LM head
def test_memory_counting_matches_real_compute_and_the_allocator():
    """benchmarks/memory.py's validation: the fake count (shapes only, on the fake accelerator) equals real compute
    byte for byte, and the real count equals the CPU allocator's record up to the small tensors no operator returns
    (checkpointing off: it stashes the RNG state per layer, 5 KiB that no operator returns)."""
    from memory import validate_counting

    rows = validate_counting(checkpointing=(False,))
    assert {row["side"] for row in rows} == {"trl", "grpo_plus"}
    for row in rows:
        assert row["real_saved"] > 0 and row["real_peak"] > row["real_saved"]
        assert row["agree"], row
        assert row["real_peak"] <= row["allocator_peak"] <= row["real_peak"] + 1024, row


def test_gpu_parity_plugin_patches_what_the_parity_tests_import(monkeypatch):
    """The plugin must patch the names tests/test_trainer_parity.py imports and the floor it skips by, or it would
    train on CPU (or skip)."""
    from helpers import floors, models, probes

    import grpo_plus.compat.loss as trl_loss

    source = (ROOT / "tests" / "test_trainer_parity.py").read_text()
    tree = ast.parse(source)
    imported = {(node.module, alias.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                for alias in node.names}  # fmt: skip
    assert {("helpers.models", "tiny_run_kwargs"), ("helpers.probes", "max_weight_diff")} <= imported
    assert 'pytest.mark.floor("cpu_logps")' in source

    for module, name in (
        (models, "tiny_run_kwargs"),
        (probes, "max_weight_diff"),
        (trl_loss, "logps_unavailable_reason"),
    ):
        monkeypatch.setattr(module, name, getattr(module, name))  # restored after the test
    on_cpu_floor = dataclasses.replace(floors.FLOORS["cpu_logps"], unmet=lambda: "as on TRL 1.15: a CPU cannot")
    monkeypatch.setitem(floors.FLOORS, "cpu_logps", on_cpu_floor)  # restored after the test
    on_cuda = trl_loss.logps_unavailable_reason("cuda")
    spec = importlib.util.spec_from_file_location("gpu_parity_under_test", ROOT / "tests" / "gpu_parity.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    assert models.tiny_run_kwargs("out")["use_cpu"] is False
    assert floors.FLOORS["cpu_logps"].unmet() is None  # as on TRL 1.15 too: its Triton kernel runs on CUDA
    assert floors.FLOORS["cpu_logps"].missing() == trl_loss.logps_unavailable_reason("cpu") == on_cuda
    assert probes.max_weight_diff({"w": torch.ones(2)}, {"w": torch.zeros(2)}) == 1.0


def test_full_length_sampler_never_ends_and_draws_the_same_tokens_for_the_same_logits():
    from gpu import FullLengthSampler

    torch.manual_seed(0)
    scores = torch.randn(6, 50)
    scores[:, 1] = 100.0  # EOS would win every draw
    input_ids = torch.zeros(6, 9, dtype=torch.long)
    first, second = FullLengthSampler(seed=0, banned_ids=[0, 1]), FullLengthSampler(seed=0, banned_ids=[0, 1])
    out = first(input_ids, scores.clone())
    chosen = out.argmax(dim=-1)
    assert torch.isfinite(out).sum(dim=-1).eq(1).all()  # one finite logit per row: sampling must pick it
    assert not torch.isin(chosen, torch.tensor([0, 1])).any()
    assert torch.equal(second(input_ids, scores.clone()), out)  # same seed, call and position: same tokens
    assert len(set(chosen.tolist())) > 1  # rows draw their own noise
    first.calls += 1
    assert not torch.equal(first(input_ids, scores.clone()), out)  # the next generation call draws afresh
