"""Partial rollouts on two processes, DDP and DeepSpeed ZeRO-2 (grpo_plus's generator, CPU processes over gloo; DeepSpeed's
CPU accelerator): each process runs its own
pool over its own generation batch and keeps it in its own checkpoint file; every generation batch of each process
is whole groups (G rows of one prompt); a run relaunched from checkpoint-1, whose pools hold rows in flight on both
processes, trains the uninterrupted run's completions on each process and ends at its weights, 0.0 apart (the
negative control: the rows in flight restored without their tokens end elsewhere). With colocated vLLM:
tests/vllm_engine/test_partial_processes.py. What cannot run on several processes is refused at construction
(tests/test_partial_rollouts.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers.probes import (
    check_partial_rollouts_processes,
    launch_partial_rollouts,
    max_weight_diff,
    same_later_completions,
)

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.floor("zero_waste_generation")]


ZERO2 = Path(__file__).resolve().parents[1] / "recipes" / "accelerate_configs" / "deepspeed_zero2.yaml"


@pytest.mark.parametrize("deepspeed", [None, ZERO2], ids=["ddp", "zero2"])
def test_two_processes_each_run_their_own_pool_and_resume_with_rows_in_flight(tiny_model_dir, tmp_path, deepspeed):
    whole = launch_partial_rollouts(tiny_model_dir, tmp_path / "whole", deepspeed=deepspeed)
    checkpoint = tmp_path / "whole" / "checkpoint-1"
    check_partial_rollouts_processes(whole, checkpoint)
    shutil.copytree(checkpoint, tmp_path / "resumed" / "checkpoint-1")
    resumed = launch_partial_rollouts(tiny_model_dir, tmp_path / "resumed", resume=True, deepspeed=deepspeed)
    same_later_completions(whole, resumed, first_step=1)
    gap = max_weight_diff(whole["weights"], resumed["weights"])
    print(f"resumed on two processes with rows in flight: final weights {gap} from the uninterrupted run's")
    assert gap == 0.0
    if deepspeed is None:  # the negative control, once: the pools are restored by the same code under either engine
        shutil.copytree(checkpoint, tmp_path / "forgotten" / "checkpoint-1")
        forgotten = launch_partial_rollouts(tiny_model_dir, tmp_path / "forgotten", resume=True, forget=True)
        assert max_weight_diff(whole["weights"], forgotten["weights"]) > 1e-3
