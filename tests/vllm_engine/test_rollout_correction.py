"""verl's rollout correction on vLLM's real engine (colocate, its CPU build; one engine for the module, conftest.py):
the engine computes in bfloat16 ("auto" for a float32 checkpoint) against a float32 trainer, so the sampler really
differs from the trainer. Decoupled mode corrects with the engine's log-probs in place of TRL's correction; bypass mode
trains with no old-log-prob pass where TRL would run one (steps_per_generation=2)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.models import prompt_dataset, save_tiny_model, tiny_run_kwargs
from helpers.probes import logged, record_trained_batches
from helpers.rewards import odd_prompts_dead_reward
from transformers import AutoModelForCausalLM, AutoTokenizer

import grpo_plus
from grpo_plus import rollout_correction
from grpo_plus.app.testing import ForwardLog

# One engine for the module: every trainer asks vLLM for the same settings (max_num_seqs = 4 * 2).
VLLM = dict(
    use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3, per_device_train_batch_size=4,
    steps_per_generation=2, max_steps=2, loss_type="dapo",
)  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("vllm-model"), hidden_size=128))


def build(model_dir, output_dir, **overrides):
    args = grpo_plus.GRPOConfig(**tiny_run_kwargs(output_dir, **{**VLLM, **overrides}))
    return grpo_plus.GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        reward_funcs=[odd_prompts_dead_reward],
        args=args,
        train_dataset=prompt_dataset(2),
    )


def test_decoupled_mode_corrects_with_the_engines_log_probs(shared_engine, model_dir, tmp_path):
    """The engine's log-probs reach the correction: the weights and mask each micro-batch trains on are the
    correction of the trainer's old log-probs against the engine's; TRL's own correction is off (no `sampling/*`
    metric), verl's metrics are logged from step 1 and see the bfloat16 engine (k3 KL above 0)."""
    options = dict(rollout_is="token", rollout_rs="token_k1", rollout_rs_threshold="0.98_1.02")
    trainer = build(model_dir, tmp_path, **options)
    assert trainer.vllm_importance_sampling_correction is False
    batches = record_trained_batches(trainer)
    trainer.train()
    for _, batch in batches:
        old, sampled = batch["old_per_token_logps"], batch["sampling_per_token_logps"]
        sampled = torch.where(torch.isnan(sampled), old, sampled)  # a token vLLM could not score: ratio 1
        expected = rollout_correction(old, sampled, batch["completion_mask"], **options)
        torch.testing.assert_close(batch["rollout_is_weights"], expected.weights, atol=0, rtol=0)
        assert torch.equal(batch["rollout_response_mask"], expected.response_mask)
    assert not logged(trainer, "sampling/importance_sampling_ratio/mean")
    k3 = logged(trainer, "rollout_corr/k3_kl")
    assert k3 and all(math.isfinite(value) and value > 0 for value in k3)
    assert all(math.isfinite(loss) for loss in logged(trainer, "loss"))


def test_bypass_mode_trains_without_an_old_log_prob_pass(shared_engine, model_dir, tmp_path):
    """steps_per_generation=2 with one accumulation step: TRL computes old log-probs at generation (the control run
    without the correction does, below); in bypass mode every forward of the trainer's model carries gradient (the
    sync check, whose probe is a no-grad forward of the trainer's model, is off in both runs)."""
    trainer = build(
        model_dir, tmp_path / "bypass", rollout_correction="bypass_ppo_clip_k3_rs", rollout_rs_threshold=1.0,
        vllm_sync_check="off",
    )  # fmt: skip
    forwards = ForwardLog(trainer.model)
    trainer.train()
    assert forwards.calls and all(call["grad"] for call in forwards.calls)
    assert all(math.isfinite(loss) for loss in logged(trainer, "loss"))
    assert logged(trainer, "rollout_corr/trained_rows/kl") or logged(trainer, "rollout_corr/kl")

    control = build(model_dir, tmp_path / "trl", vllm_sync_check="off")
    control_forwards = ForwardLog(control.model)
    control.train()
    assert any(not call["grad"] for call in control_forwards.calls)


def test_decoupled_mode_on_policy_runs_no_old_log_prob_pass(shared_engine, model_dir, tmp_path):
    """One optimizer step per generation batch (gradient_accumulation_steps = steps_per_generation): the decoupled
    correction's old log-probs are the training forward's, so besides the sync checks' probes no forward runs without
    gradient; the weights correct the bfloat16 engine against the float32 trainer (k3 KL above 0 over the rows the
    forward computed)."""
    trainer = build(model_dir, tmp_path, rollout_correction="decoupled_token_is", gradient_accumulation_steps=2)
    forwards = ForwardLog(trainer.model)
    trainer.train()
    probes = sum(receipt.trainer_positions for receipt in trainer.vllm_generation.sync_log.receipts)
    assert forwards.positions - forwards.training_positions == probes
    k3 = logged(trainer, "rollout_corr/trained_rows/k3_kl")
    assert len(k3) == 2 and all(math.isfinite(value) and value > 0 for value in k3)
    assert all(math.isfinite(loss) for loss in logged(trainer, "loss"))


def first_step_metrics(trainer) -> dict:
    """verl's mismatch metrics from the first log entry that has them (step 1), under either name."""
    for entry in trainer.state.log_history:
        metrics = {
            key.split("/")[-1]: value for key, value in entry.items() if key.startswith("rollout_corr/") and value
        }
        if metrics:
            return metrics
    raise AssertionError("no rollout_corr/* metric logged")


def test_metrics_flag_a_perturbed_sampler_at_step_one(shared_engine, model_dir, tmp_path):
    """verl's metrics-only preset on the real engine, one step each: the engine sampling at the trainer's temperature
    (a bfloat16 engine against a float32 trainer: precision noise) and then at another one (generation_kwargs
    overrides the engine's temperature while the trainer still divides its logits by `temperature`: a mistake a user
    can make). The first step's metrics tell them apart: the K3 KL, the log-perplexity gap and the weights' chi-square
    jump by orders of magnitude (rollout-correction.md, "Metrics to watch"). On this tiny near-uniform model the
    perplexity ratio stays near 1 either way: it is not the metric that flags a temperature."""
    clean = build(model_dir, tmp_path / "clean", rollout_correction="disabled", max_steps=1)
    clean.train()
    perturbed = build(
        model_dir, tmp_path / "perturbed", rollout_correction="disabled", max_steps=1,
        generation_kwargs={"temperature": 0.5},
    )  # fmt: skip
    perturbed.train()
    noise, flagged = first_step_metrics(clean), first_step_metrics(perturbed)
    print({key: (noise[key], flagged[key]) for key in ("k3_kl", "log_ppl_abs_diff", "chi2_token")})
    # measured: k3_kl 8.6e-7 against 0.031, log_ppl_abs_diff 3.3e-4 against 0.063, chi2_token -9e-5 against 0.14
    assert 0 < noise["k3_kl"] < 1e-5 and flagged["k3_kl"] > 1000 * noise["k3_kl"]
    assert flagged["log_ppl_abs_diff"] > 100 * noise["log_ppl_abs_diff"]
    assert abs(noise["chi2_token"]) < 1e-3 < 0.05 < flagged["chi2_token"]  # the weights' variance: noise has none
