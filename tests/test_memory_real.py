"""benchmarks/memory_real.py's child, in this process at a tiny shape: both sides run the same pass (the same LoRA
gradient norm), the step increment is read from the kernel's high-water mark, and grpo_plus's default leaves a short
micro-batch's MLP whole. The bench itself (fresh processes, pinned malloc, real shapes) is `make bench-memory-real`."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "memory_real.py"
pytestmark = pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's clear_refs")


def bench_module():
    sys.path.insert(0, str(BENCH.parent))  # the bench imports benchmarks/harness/, as run from there
    try:
        spec = importlib.util.spec_from_file_location("memory_real", BENCH)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH.parent))
    return module


def test_both_sides_do_the_same_work_and_the_increment_is_read():
    bench = bench_module()
    model = {**bench.QUICK_MODEL, "num_hidden_layers": 1, "vocab_size": 512}

    def run(side: str, seed: int = 0) -> dict:
        return bench.run_child(dict(side=side, changes={}, length=32, model=model, device="cpu", seed=seed))

    trl, ours, other_rows = run("trl"), run("grpo_plus"), run("trl", seed=1)
    assert trl["grad_norm"] > 0 and f"{ours['grad_norm']:.6g}" == f"{trl['grad_norm']:.6g}"
    assert f"{other_rows['grad_norm']:.6g}" != f"{trl['grad_norm']:.6g}"  # negative control: other rows, other norm
    assert trl["increment"] >= 0 and ours["increment"] >= 0 and trl["rss_before"] > 0
    assert ours["tiled_calls"] == 0  # 8 x 96 positions: far below the default's threshold
