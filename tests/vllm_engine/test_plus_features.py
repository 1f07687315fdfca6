"""The rest of grpo_plus on vLLM's real engine (colocate): dynamic sampling refilling through vLLM, exact resume, the
health guard, grpo_plus's own objective modes. One engine for the module (conftest.py)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.models import prompt_dataset, save_tiny_model, tiny_run_kwargs
from helpers.probes import GroupRecorder, logged, max_weight_diff, record_trained_batches
from helpers.rewards import constant_reward, odd_prompts_dead_reward
from transformers import AutoModelForCausalLM, AutoTokenizer

import grpo_plus
from grpo_plus.run.health import TrainingHealthError

# One engine for the module: every trainer asks vLLM for the same settings (max_num_seqs = 4 * 2).
VLLM = dict(
    use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3, per_device_train_batch_size=4,
    steps_per_generation=2,
)  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("vllm-model"), hidden_size=128))


def build(model_dir, output_dir, reward=odd_prompts_dead_reward, num_prompts=8, **overrides):
    """grpo_plus's trainer on the engine; `prompt_dataset(2)` gives every generation batch one dead group and one
    live one, `prompt_dataset(8)` five dead prompts of eight."""
    args = grpo_plus.GRPOConfig(**tiny_run_kwargs(output_dir, **{**VLLM, **overrides}))
    return grpo_plus.GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        reward_funcs=[reward],
        args=args,
        train_dataset=prompt_dataset(num_prompts),
    )


def weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_dynamic_sampling_refills_through_vllm(shared_engine, model_dir, tmp_path):
    """Five of the eight prompts are dead: grpo_plus generates more rounds through the engine until each generation
    batch holds only informative groups."""
    trainer = build(model_dir, tmp_path, dynamic_sampling=True, loss_type="dapo", max_steps=4)
    recorder = GroupRecorder(trainer, 4)
    trainer.train()
    assert max(logged(trainer, "dynamic_sampling/rounds")) > 1, "no refill round: the test proves nothing"
    assert set(logged(trainer, "dynamic_sampling/short_batch")) == {0.0}, "a generation batch was left short"
    for prompt_ids, advantages in recorder.groups():
        assert (prompt_ids == prompt_ids[0]).all(), "a group was split across micro-batches"
        assert advantages.abs().sum() > 0, "a zero-variance group was trained on"
    assert logged(trainer, "sampling/importance_sampling_ratio/mean"), "TRL's sampler correction did not run"


def test_resume_continues_the_uninterrupted_run_bit_for_bit(shared_engine, model_dir, tmp_path):
    """Colocated vLLM samples from the training process's torch random state, which the checkpoint restores: resumed
    inside a generation batch (checkpoint-1) and at its end (checkpoint-2), the run ends at the same weights."""
    settings = dict(max_steps=4, save_strategy="steps", save_steps=1, loss_type="dapo")
    whole = build(model_dir, tmp_path / "whole", **settings)
    whole_batches = record_trained_batches(whole)
    whole.train()
    for step in (1, 2):
        resumed = build(model_dir, tmp_path / f"from-{step}", **settings)
        batches = record_trained_batches(resumed)
        resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / f"checkpoint-{step}"))
        expected = [batch for trained_step, batch in whole_batches if trained_step > step]
        assert len(batches) == len(expected)
        for (_, got), want in zip(batches, expected, strict=True):
            assert torch.equal(got["completion_ids"], want["completion_ids"]), f"from step {step}: other completions"
        assert max_weight_diff(weights(whole), weights(resumed)) == 0.0, f"resumed from step {step}"


def test_health_guard_stops_a_run_whose_groups_are_all_dead(shared_engine, model_dir, tmp_path):
    trainer = build(
        model_dir, tmp_path, reward=constant_reward, max_steps=6, health_check="stop", health_patience_steps=2
    )
    with pytest.raises(TrainingHealthError, match="frac_reward_zero_std"):
        trainer.train()
    assert trainer.state.global_step < 6


@pytest.mark.parametrize(
    "settings",
    [
        dict(loss_type="dapo", importance_sampling_level="sequence_token"),
        dict(loss_type="grpo", advantage_estimator="rloo", scale_rewards="none"),
        dict(loss_type="dapo", dual_clip=3.0, epsilon_high=0.28),
    ],
    ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()),
)
def test_grpo_plus_objective_modes_train_with_the_sampler_correction(shared_engine, model_dir, tmp_path, settings):
    """grpo_plus's own modes take TRL's importance-sampling weights w as TRL's loss does (per-token loss times w) and
    train. On the first step the policy is the one that generated (every PPO ratio 1, no clip acts), so each token's
    loss is -w * A and the step's loss is that, aggregated by the loss type: checked against the logged loss."""
    trainer = build(model_dir, tmp_path, num_prompts=2, optim="sgd", learning_rate=0.5, **settings)
    before = weights(trainer)
    batches = record_trained_batches(trainer)
    trainer.train()
    losses = logged(trainer, "loss")
    assert losses and all(math.isfinite(loss) for loss in losses)
    assert max_weight_diff(before, weights(trainer)) > 1e-4
    (_, first), *_ = batches  # the first step's one micro-batch (gradient_accumulation_steps=1)
    mask = first["completion_mask"].float()
    sampler_weights = first["importance_sampling_ratio"].expand_as(mask)  # (B, 1) per sequence: TRL's default
    advantages = first["advantages"].reshape(-1, 1)

    def aggregated(per_token: torch.Tensor) -> float:
        if settings["loss_type"] == "dapo":
            return (per_token.sum() / mask.sum()).item()
        return (per_token.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).mean().item()  # grpo

    expected = aggregated(-sampler_weights * advantages * mask)
    assert losses[0] == pytest.approx(expected, rel=1e-4, abs=1e-6)
    unweighted = aggregated(-advantages * mask)
    assert abs(unweighted - expected) > 10 * max(1e-4 * abs(expected), 1e-6), "w ~ 1: the check cannot tell"


def test_sleep_mode_on_the_cpu_build_fails_before_the_engine_starts(model_dir, tmp_path):
    """vLLM's CPU build has no sleep mode: grpo_plus says so, naming the setting, before loading anything."""
    with pytest.raises(ValueError, match="vllm_enable_sleep_mode=True: this vLLM build .* has no sleep mode"):
        build(model_dir, tmp_path, vllm_enable_sleep_mode=True)
