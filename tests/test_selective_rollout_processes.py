"""Selective rollout (GRESO) across processes: DDP ranks make the same decisions; a run killed with kill -9 and
resumed decides as the uninterrupted one."""

import json
import sys
from pathlib import Path

import pytest
from helpers.models import prompt_dataset
from helpers.probes import TRAIN_TINY, accelerate_launch, kill_after_checkpoint, run_python, train_tiny_flags
from helpers.rewards import dead_rows

from grpo_plus.run.checkpoints import last_complete_checkpoint
from grpo_plus.run.state import SHARED_FILE

pytestmark = [pytest.mark.slow, pytest.mark.engine]  # DDP processes and a killed run: make test-engines


def draw_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def odd_dead_flags(model_dir, output_dir, **overrides) -> list[str]:
    """train_tiny.py on 8 prompts, those starting with an odd digit dead."""
    return [*train_tiny_flags(model_dir, output_dir, **overrides), "--reward", "odd_dead", "--num_prompts", "8"]


def test_ddp_processes_agree_on_every_decision(tiny_model_dir, tmp_path):
    flags = odd_dead_flags(
        tiny_model_dir, tmp_path / "out", per_device_train_batch_size=4, max_steps=10, selective_rollout=True
    )
    run_python(TRAIN_TINY, *flags, "--record_draws", tmp_path / "draws", launcher=accelerate_launch(2))
    rank0, rank1 = draw_lines(tmp_path / "draws.rank0"), draw_lines(tmp_path / "draws.rank1")
    assert len(rank0) == 10 and all(len(line["indices"]) == 2 for line in rank0)  # 2 x 4 rows / 4 generations
    assert rank0 == rank1
    skipped = [index for line in rank0 for index in line["skipped"]]
    assert skipped and set(skipped) <= dead_rows(prompt_dataset(8))


def test_kill_and_resume_reproduces_the_uninterrupted_decisions(tiny_model_dir, tmp_path):
    def flags(name):
        return odd_dead_flags(
            tiny_model_dir,
            tmp_path / name,
            per_device_train_batch_size=8,
            max_steps=14,
            save_strategy="steps",
            save_steps=2,
            selective_rollout=True,
        )

    run_python(TRAIN_TINY, *flags("whole"), "--record_draws", tmp_path / "whole")
    whole = {line["after_step"]: line for line in draw_lines(tmp_path / "whole.rank0")}
    assert len(whole) == 14

    out = tmp_path / "killed"
    first = [
        sys.executable,
        TRAIN_TINY,
        *flags("killed"),
        "--step_delay",
        "0.4",
        "--record_draws",
        str(tmp_path / "first"),
    ]
    kill_after_checkpoint(first, out / "checkpoint-6")
    killed_step = int(last_complete_checkpoint(out).rsplit("-", 1)[1])
    assert 6 <= killed_step < 14
    assert (out / f"checkpoint-{killed_step}" / SHARED_FILE).is_file()

    run_python(TRAIN_TINY, *flags("killed"), "--resume", "--record_draws", tmp_path / "resumed")
    resumed = draw_lines(tmp_path / "resumed.rank0")
    assert [line["after_step"] for line in resumed] == list(range(killed_step, 14))
    assert all(line == whole[line["after_step"]] for line in resumed), "the resumed run decided differently"
    assert any(line["skipped"] for line in resumed), "nothing was skipped after the resume: the test is vacuous"
