"""Trajectory-exact resume under DDP (issue 27.1): 2 CPU processes over gloo, steps_per_generation = 4 and
gradient_accumulation_steps = 2, a checkpoint after every step; relaunched from each checkpoint (fresh processes),
the run ends at the uninterrupted run's weights and log history, and every rank trains on the very micro-batches
(completions, log-probs, advantages) it trained on uninterrupted, to the bit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers.probes import TRAIN_TINY, accelerate_launch, max_weight_diff, run_python, train_tiny_flags
from safetensors.torch import load_file

from grpo_plus.run.state import PROCESS_FILE

pytestmark = [pytest.mark.slow, pytest.mark.engine]
TIMINGS = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss"}
SETTINGS = dict(
    steps_per_generation=4, gradient_accumulation_steps=2, max_steps=4, save_strategy="steps", save_steps=1
)


def launch(model_dir, output_dir: Path, resume: bool = False) -> dict:
    """Train on 2 DDP processes; the final weights, log history (less timings) and each rank's micro-batches."""
    args = [*train_tiny_flags(model_dir, output_dir, **SETTINGS), "--num_prompts", "16"]
    args += ["--dump_weights", f"{output_dir}.safetensors", "--dump_logs", f"{output_dir}.json"]
    args += ["--record_batches", f"{output_dir}.batches", *(["--resume"] if resume else [])]
    result = run_python(TRAIN_TINY, *args, launcher=accelerate_launch(2), timeout=600)
    assert result.stdout.count("FINISHED") == 2, result.stdout[-2000:]
    logs = json.loads(Path(f"{output_dir}.json").read_text())
    return {
        "weights": load_file(f"{output_dir}.safetensors"),
        "logs": [{k: v for k, v in e.items() if k not in TIMINGS} for e in logs if "train_runtime" not in e],
        "batches": [torch.load(f"{output_dir}.batches.rank{rank}", weights_only=True) for rank in (0, 1)],
    }


def test_ddp_resume_at_every_step_continues_the_uninterrupted_run(tiny_model_dir, tmp_path):
    whole = launch(tiny_model_dir, tmp_path / "whole")
    first, second = whole["batches"]
    assert not torch.equal(first[0][1]["completion_ids"], second[0][1]["completion_ids"]), "ranks trained alike"
    for step in (1, 2, 3):
        out = tmp_path / f"from-{step}"
        shutil.copytree(tmp_path / "whole" / f"checkpoint-{step}", out / f"checkpoint-{step}")
        assert all((out / f"checkpoint-{step}" / PROCESS_FILE.format(rank)).is_file() for rank in (0, 1))
        resumed = launch(tiny_model_dir, out, resume=True)
        assert max_weight_diff(whole["weights"], resumed["weights"]) == 0.0, step
        assert resumed["logs"] == whole["logs"], step
        for rank in (0, 1):
            expected = [(s, batch) for s, batch in whole["batches"][rank] if s > step]
            got = resumed["batches"][rank]
            assert [s for s, _ in got] == [s for s, _ in expected], (step, rank)
            for (s, batch), (_, want) in zip(got, expected, strict=True):
                assert batch.keys() == want.keys() and all(torch.equal(batch[k], want[k]) for k in want), (step, s)
