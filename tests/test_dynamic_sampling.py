"""DAPO dynamic sampling and overlong shaping in grpo_plus.GRPOTrainer."""

import json

import pytest
import torch
from helpers.models import prompt_dataset, tiny_run_kwargs, tiny_trainer
from helpers.probes import (
    TRAIN_TINY,
    GroupRecorder,
    accelerate_launch,
    logged,
    record_score_rounds,
    run_python,
    train_tiny_flags,
)
from helpers.rewards import constant_reward, length_reward, odd_prompts_constant_reward

from grpo_plus import GRPOConfig
from grpo_plus.config import ConfigError
from grpo_plus.sampling.dynamic_sampling import concat_rows, informative_groups, shuffle_groups

G = 4


def make_trainer(tmp_path, reward, num_prompts=20, **overrides):
    """A dynamic-sampling run: (trainer, recorder of the micro-batches it trains on, the rounds it scores)."""
    settings = dict(dynamic_sampling=True, per_device_train_batch_size=8, gradient_accumulation_steps=2, max_steps=3)
    trainer = tiny_trainer(tmp_path, reward, dataset=prompt_dataset(num_prompts), **{**settings, **overrides})
    return trainer, GroupRecorder(trainer, G), record_score_rounds(trainer)


@pytest.mark.slow
def test_no_trained_group_has_zero_variance_and_batches_are_full(tmp_path):
    trainer, recorder, rounds = make_trainer(tmp_path, odd_prompts_constant_reward, loss_type="dapo")
    trainer.train()
    assert len(recorder.batches) == 3 * 2  # max_steps x gradient_accumulation_steps micro-batches
    for batch in recorder.batches:
        assert batch["prompt_ids"].shape[0] == 8, "a refilled batch must be full when prompts are plentiful"
    for prompt_ids, advantages in recorder.groups():
        assert (prompt_ids == prompt_ids[0]).all(), "a group was split across micro-batches"
        assert advantages.abs().sum() > 0, "a zero-variance group was trained on"
    assert max(logged(trainer, "dynamic_sampling/rounds")) > 1, "the reward kills 60% of groups: refills expected"
    assert logged(trainer, "dynamic_sampling/short_batch") == [0.0, 0.0, 0.0]
    assert all(f > 0 for f in logged(trainer, "dynamic_sampling/filtered_frac"))


@pytest.mark.slow
def test_round_limit_is_respected_and_short_batch_logged(tmp_path):
    trainer, recorder, rounds = make_trainer(tmp_path, constant_reward, max_sampling_rounds=3, max_steps=2)
    trainer.train()
    # 2 optimizer steps, one generation batch each (steps_per_generation == gradient_accumulation_steps).
    assert len(rounds) == 2 * 3
    assert logged(trainer, "dynamic_sampling/rounds") == [3.0, 3.0]
    assert logged(trainer, "dynamic_sampling/short_batch") == [1.0, 1.0]
    assert logged(trainer, "dynamic_sampling/trained_groups") == [0.0, 0.0]


@pytest.mark.slow
def test_normalizers_match_a_batch_built_from_the_kept_groups(tmp_path):
    trainer, recorder, _ = make_trainer(tmp_path, odd_prompts_constant_reward, loss_type="dapo", max_steps=2)
    losses = []
    compute = trainer._compute_loss

    def keep_loss(model, inputs):
        loss = compute(model, inputs)
        losses.append(loss.detach())
        return loss

    trainer._compute_loss = keep_loss  # the recorder wraps this wrapper's callee
    trainer.train()
    for window in range(2):
        micro = recorder.batches[2 * window : 2 * window + 2]
        kept_tokens = sum(int(b["completion_mask"].sum()) for b in micro)
        assert int(micro[0]["num_items_in_batch"]) == kept_tokens
    # The first micro-batch is on-policy (ratio 1), so DAPO's loss is -sum(A * m) / N over the kept rows' tokens.
    first = recorder.batches[0]
    mask = first["completion_mask"].float()
    expected = -(first["advantages"].unsqueeze(1) * mask).sum() / int(first["num_items_in_batch"])
    assert losses[0].item() == expected.item()  # bit for bit in every run (ratio exactly 1)


@pytest.mark.slow
@pytest.mark.engine  # DDP processes: make test-engines
def test_ddp_keeps_groups_whole(tiny_model_dir, tmp_path):
    flags = train_tiny_flags(
        tiny_model_dir,
        tmp_path / "out",
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        max_steps=2,
        dynamic_sampling=True,
        loss_type="dapo",
    )
    run_python(
        TRAIN_TINY,
        *flags,
        "--reward",
        "odd_constant",
        "--num_prompts",
        "20",
        "--record_groups",
        tmp_path / "groups",
        launcher=accelerate_launch(2),
    )
    for rank in (0, 1):
        groups = json.loads((tmp_path / f"groups.rank{rank}").read_text())
        assert len(groups) == 2 * 2 * 2  # steps x micro-batches x (8 rows / 4 per group)
        assert all(g["same_prompt"] and g["any_advantage"] and g["rows"] == G for g in groups)


def test_informative_groups_threshold_tolerates_float_noise():
    rewards = torch.tensor(
        [0.1, 0.1 + 1e-6, 0.1, 0.1, 0.0, 1.0, 0.0, 1.0, float("nan"), 2.0, float("nan"), float("nan")]
    )
    assert informative_groups(rewards, 4, 1e-4).tolist() == [False, True, False]
    assert informative_groups(rewards, 4, 0.0).tolist() == [True, True, False]


def test_concat_rows_pads_prompts_left_and_completions_right():
    a = {
        "prompt_ids": torch.tensor([[5, 6]]),
        "prompt_mask": torch.tensor([[1, 1]]),
        "completion_ids": torch.tensor([[7]]),
        "completion_mask": torch.tensor([[1]]),
        "advantages": torch.tensor([0.5]),
    }
    b = {
        "prompt_ids": torch.tensor([[4]]),
        "prompt_mask": torch.tensor([[1]]),
        "completion_ids": torch.tensor([[8, 9, 3]]),
        "completion_mask": torch.tensor([[1, 1, 1]]),
        "advantages": torch.tensor([-0.5]),
    }
    merged = concat_rows([a, b], pad_token_id=0)
    assert merged["prompt_ids"].tolist() == [[5, 6], [0, 4]]
    assert merged["prompt_mask"].tolist() == [[1, 1], [0, 1]]
    assert merged["completion_ids"].tolist() == [[7, 0, 0], [8, 9, 3]]
    assert merged["completion_mask"].tolist() == [[1, 0, 0], [1, 1, 1]]
    assert merged["advantages"].tolist() == [0.5, -0.5]
    # routing replay's records (rows, completion columns, layers, k) pad like the completions, with -1 (no record)
    a["routes"], b["routes"] = torch.zeros(1, 1, 2, 2, dtype=torch.int16), torch.ones(1, 3, 2, 2, dtype=torch.int16)
    routes = concat_rows([a, b], pad_token_id=0)["routes"]
    assert routes.shape == (2, 3, 2, 2) and routes[0, 1:].eq(-1).all() and routes[0, 0].eq(0).all()
    assert routes[1].eq(1).all()


def test_shuffle_groups_moves_whole_groups():
    batch = {"completion_ids": torch.arange(12).unsqueeze(1), "num_items_in_batch": torch.tensor(12)}
    shuffled = shuffle_groups(batch, 3)["completion_ids"].squeeze(1).view(4, 3)
    assert sorted(row[0].item() for row in shuffled) == [0, 3, 6, 9]
    assert all((row - row[0]).tolist() == [0, 1, 2] for row in shuffled)


def test_dynamic_sampling_needs_whole_groups_per_micro_batch(tmp_path):
    with pytest.raises(ConfigError, match="per_device_train_batch_size \\(6\\) to be a multiple of num_generations"):
        GRPOConfig(
            **tiny_run_kwargs(
                tmp_path,
                dynamic_sampling=True,
                per_device_train_batch_size=6,
                num_generations=4,
                gradient_accumulation_steps=2,
            )
        )


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(max_sampling_rounds=0), "max_sampling_rounds"),
        (dict(dynamic_sampling_min_std=-1.0), "dynamic_sampling_min_std"),
        (dict(overlong_buffer_length=9), "overlong_buffer_length"),
        (dict(overlong_buffer_length=0), "overlong_buffer_length"),
        (dict(overlong_penalty=-1.0), "overlong_penalty"),
    ],
)
def test_sampling_settings_are_validated(tmp_path, kwargs, field):
    with pytest.raises(ConfigError, match=field):
        GRPOConfig(**tiny_run_kwargs(tmp_path, **kwargs))


@pytest.mark.slow
def test_dynamic_sampling_refuses_image_prompts_before_training():
    """A dataset whose rows carry pictures (TRL's "image" / "images" columns) cannot be refilled and stitched: the
    trainer's dynamic sampling is refused when it is set up, naming the column and what to do."""
    from datasets import Dataset
    from PIL import Image

    from grpo_plus.sampling.dynamic_sampling import DynamicSampling
    from grpo_plus.sampling.settings import DynamicSamplingSettings

    settings = DynamicSamplingSettings(enabled=True)
    picture = Image.new("RGB", (8, 8))
    for column, value in (("image", picture), ("images", [picture, picture])):
        dataset = Dataset.from_list([{"prompt": "a", column: value}] * 2)
        with pytest.raises(
            ConfigError, match=rf"does not support image prompts.*'{column}' column.*dynamic_sampling=False"
        ):
            DynamicSampling.for_dataset(settings, dataset, num_generations=2, seed=0)
    assert DynamicSampling.for_dataset(settings, Dataset.from_list([{"prompt": "a"}] * 2), 2, seed=0) is not None
    assert DynamicSampling.for_dataset(DynamicSamplingSettings(), dataset, 2, seed=0) is None  # off: no objection


def test_overlong_punishment_is_a_weighted_reward(tmp_path):
    trainer = tiny_trainer(tmp_path, length_reward, overlong_buffer_length=4, overlong_penalty=0.5, max_steps=1)
    assert trainer.reward_func_names == ["length_reward", "soft_overlong_punishment_reward"]
    assert trainer.reward_weights.tolist() == [1.0, 0.5]
    punish = trainer.reward_funcs[1]
    assert punish(completion_ids=[[1] * 4, [1] * 6, [1] * 8]) == [0.0, -0.5, -1.0]
    trainer.train()
    assert "rewards/soft_overlong_punishment_reward/mean" in trainer.state.log_history[0]
