"""Zero-waste training pass across processes: under DDP a rank whose whole micro-batch is dead still joins the
gradient all-reduce. (DeepSpeed ZeRO-2/3: tests/test_deepspeed.py.)"""

import json
from pathlib import Path

import pytest
from helpers.probes import TRAIN_TINY, accelerate_launch, max_weight_diff, run_python, train_tiny_flags
from safetensors.torch import load_file

pytestmark = [pytest.mark.slow, pytest.mark.engine]  # DDP processes: make test-engines


def test_ddp_with_an_all_dead_micro_batch_matches_one_process(tiny_model_dir, tmp_path):
    """Zero-waste pass under DDP: a rank whose whole micro-batch has zero advantage computes almost nothing, yet
    joins the gradient all-reduce (no hang) and the run ends where one process ends."""
    common = dict(num_generations=4, max_steps=4, optim="sgd", loss_type="dapo", learning_rate=0.5)
    one = train_tiny_flags(tiny_model_dir, tmp_path / "one", per_device_train_batch_size=8, **common)
    two = train_tiny_flags(tiny_model_dir, tmp_path / "two", per_device_train_batch_size=4, **common)
    extra = ["--row_seeded_sampling", "--reward", "half_dead"]
    run_python(TRAIN_TINY, *one, *extra, "--dump_weights", tmp_path / "one.safetensors")
    run_python(
        TRAIN_TINY,
        *two,
        *extra,
        "--dump_weights",
        tmp_path / "two.safetensors",
        "--record_groups",
        tmp_path / "g",
        launcher=accelerate_launch(2),
        timeout=400,
    )
    ranks = [json.loads((tmp_path / f"g.rank{rank}").read_text()) for rank in (0, 1)]
    mixed = [a["any_advantage"] != b["any_advantage"] for a, b in zip(*ranks, strict=True)]
    assert any(mixed), f"no step had one rank all dead and the other live: {ranks}"
    one_w, two_w = load_file(tmp_path / "one.safetensors"), load_file(tmp_path / "two.safetensors")
    assert max_weight_diff(one_w, load_file(Path(tiny_model_dir) / "model.safetensors")) > 1e-3
    assert max_weight_diff(one_w, two_w) <= 1e-5
