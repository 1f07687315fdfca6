"""Partial rollouts with colocated vLLM on two DDP processes (vLLM's CPU build, an engine per process, the tiny
model, float32): each process runs its own pool through its own engine, every generation batch of each process is
whole groups, both processes' pools hold rows in flight at checkpoint-1 (each in its own file, and they differ), and
a run relaunched from it trains the uninterrupted run's completions on each process and ends at its weights, 0.0
apart (each engine samples from its process's torch random state, which the checkpoint restores). The negative control
of the resume (rows in flight restored without their tokens) runs with grpo_plus's generator:
tests/test_partial_rollouts_processes.py."""

from __future__ import annotations

import os
import shutil

from helpers.models import save_tiny_model
from helpers.probes import (
    check_partial_rollouts_processes,
    launch_partial_rollouts,
    max_weight_diff,
    same_later_completions,
)

ENGINE = ["--use_vllm", "true", "--vllm_mode", "colocate", "--vllm_gpu_memory_utilization", "0.3"]
ENGINE += ["--vllm_dtype", "float32", "--ddp_backend", "gloo"]


def test_colocated_engines_on_two_processes_each_run_their_own_pool_and_resume(tmp_path):
    model_dir = save_tiny_model(tmp_path / "model", hidden_size=128)  # vLLM's CPU kernels: a head size it takes
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    whole = launch_partial_rollouts(model_dir, tmp_path / "whole", *ENGINE, env=env)
    checkpoint = tmp_path / "whole" / "checkpoint-1"
    check_partial_rollouts_processes(whole, checkpoint)
    shutil.copytree(checkpoint, tmp_path / "resumed" / "checkpoint-1")
    resumed = launch_partial_rollouts(model_dir, tmp_path / "resumed", *ENGINE, resume=True, env=env)
    same_later_completions(whole, resumed, first_step=1)
    gap = max_weight_diff(whole["weights"], resumed["weights"])
    print(
        f"colocated vLLM, two processes, resumed with rows in flight: final weights {gap} from the uninterrupted run's"
    )
    assert gap == 0.0
