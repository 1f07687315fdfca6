"""Asynchronous generation's settings, refusals and read-ahead (grpo_plus.async_generation), without an engine.

The pipeline itself runs on the real engine: tests/vllm_engine/test_async_generation.py (the lagged oracle, resume).
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.models import prompt_dataset, tiny_run_kwargs, tiny_trainer
from helpers.rewards import odd_prompts_dead_reward

import grpo_plus
from grpo_plus.async_generation import PromptLookahead, trainer_blocker
from grpo_plus.config import PlusSettings
from grpo_plus.settings import ConfigError

SERVER = dict(use_vllm=True, vllm_mode="server")


def config(tmp_path, **fields):
    return grpo_plus.GRPOConfig(**tiny_run_kwargs(tmp_path, **fields))


def test_the_fields_have_trls_names_and_are_off_by_default(tmp_path):
    args = config(tmp_path)
    assert (args.async_generation, args.max_staleness, args.weight_sync_steps) == (False, 1, 1)
    settings = PlusSettings.from_config(config(tmp_path, async_generation=True, max_staleness=3,
                                                         weight_sync_steps=2, **SERVER)).async_generation  # fmt: skip
    assert settings.enabled and settings.batches_ahead == 2


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(async_generation=True), "vllm_mode='server'"),
        (dict(async_generation=True, use_vllm=True, vllm_mode="colocate"), "vllm_mode='server'"),
        (dict(async_generation=True, vllm_importance_sampling_correction=False, **SERVER), "rollout_correction"),
        (dict(async_generation=True, dynamic_sampling=True, **SERVER), "dynamic sampling"),
        (dict(max_staleness=0), "set async_generation=False"),
        (dict(max_staleness=True), "must be an integer"),
        (dict(max_staleness=2, weight_sync_steps=3), "from 1 to max_staleness"),
        (dict(weight_sync_steps=0), "from 1 to max_staleness"),
    ],
)
def test_what_cannot_run_asynchronously_is_refused_at_construction(tmp_path, fields, message):
    with pytest.raises(ConfigError, match=message):
        config(tmp_path, **fields)


def test_a_rollout_correction_preset_corrects_the_stale_batches_in_place_of_trls(tmp_path):
    fields = dict(async_generation=True, vllm_importance_sampling_correction=False, **SERVER)
    assert config(tmp_path, rollout_correction="decoupled_token_is", **fields).async_generation


@pytest.mark.parametrize(
    "arguments, message",
    [
        (dict(num_processes=2, distributed_type="DEEPSPEED"), "runs with DDP"),
        (dict(num_processes=2, distributed_type="FSDP"), "not FSDP"),
        (dict(generate_every=4, gradient_accumulation_steps=2), "one generation batch per optimizer step"),
        (dict(tools=True), "tool loop"),
        (dict(rollout_func=True), "rollout_func"),
    ],
)
def test_what_the_trainer_cannot_generate_ahead_is_named(arguments, message):
    values = dict(
        num_processes=1, distributed_type="NO", generate_every=2, gradient_accumulation_steps=2, tools=False,
        rollout_func=False,
    )  # fmt: skip
    assert message in trainer_blocker(**{**values, **arguments})
    assert trainer_blocker(**values) is None
    assert trainer_blocker(**{**values, "num_processes": 2, "distributed_type": "MULTI_CPU"}) is None  # DDP


def test_the_read_ahead_is_the_trainers_own_order_over_epochs_and_draws_no_random_numbers(tmp_path):
    """The lookahead's batches are the generation batches TRL's loop hands over, epoch after epoch (TRL's RepeatSampler,
    steps_per_generation = 2: every other dataloader batch), and reading them leaves every global generator as it was
    (a dataloader's pass draws its base seed from torch's: TRL's batch shuffle would then differ)."""
    trainer = tiny_trainer(
        tmp_path, [odd_prompts_dead_reward], dataset=prompt_dataset(6), gradient_accumulation_steps=2
    )
    generate_every = trainer.args.steps_per_generation * trainer.num_iterations
    assert generate_every == 2
    expected, dataloader = [], trainer.get_train_dataloader()
    for _ in range(3):  # three epochs of the trainer's own dataloader, as transformers' loop iterates it
        for position, batch in enumerate(dataloader):
            if position % generate_every == 0:
                expected.append([row["prompt"] for row in batch])
    lookahead = PromptLookahead(trainer.get_train_dataloader, generate_every)
    before = (torch.random.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    read = [[row["prompt"] for row in lookahead.next_batch()] for _ in range(len(expected))]
    after = (torch.random.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    assert read == expected and len({tuple(b) for b in read}) > 1
    assert torch.equal(before[0], after[0]) and before[1] == after[1] and np.array_equal(before[2], after[2])
    # negative control: a pass over a dataloader does draw from torch's generator
    next(iter(trainer.get_train_dataloader()))
    assert not torch.equal(torch.random.get_rng_state(), after[0])


class _Trainer:
    """Stands for what a request's function holds (the trainer, through the pipeline)."""


def test_the_request_thread_keeps_nothing_of_a_finished_request():
    """A request's function holds the pipeline, hence the trainer: once it ran, the thread (which lives until closed,
    waiting for the next one) must hold nothing of it, or every trainer that generated asynchronously stays in memory
    (the suite ran out of memory before this). Negative control: the same check sees a reference kept elsewhere."""
    import functools
    import gc
    import weakref

    from grpo_plus.async_generation.pipeline import RequestThread

    requests, kept = RequestThread("test"), []
    for keep in (False, True):
        trainer = _Trainer()
        alive = weakref.ref(trainer)
        future = requests.submit(functools.partial(kept.append if keep else id, trainer))
        future.result(timeout=10)
        del trainer, future
        gc.collect()
        assert (alive() is not None) == keep
    requests.close()


def test_the_benchmarks_plot_is_drawn_from_its_results_file(tmp_path, benchmark_in_this_process):
    """benchmarks/async_generation.py --plot-from: the committed report's held-out accuracy curves drawn again into a
    PNG, without training (the plot beside the docs' table); a report without its runs' evaluations is refused."""
    import json

    import async_generation

    results = Path(__file__).resolve().parents[1] / "docs" / "guide" / "results" / "async_generation.json"
    png = tmp_path / "async.png"
    assert async_generation.main(["--plot-from", str(results), "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    broken = json.loads(results.read_text())
    for side in async_generation.SIDES:
        del broken["runs"][0][side]["evals"]
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    with pytest.raises(KeyError, match="evals"):
        async_generation.main(["--plot-from", str(tmp_path / "broken.json"), "--png", str(tmp_path / "b.png")])
