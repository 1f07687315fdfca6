"""Drop-in parity: stock trl.GRPOTrainer and grpo_plus.GRPOTrainer train to the same weights and logs."""

import math

import pytest
import torch
import trl
from tiny import digit_reward, length_reward, prompt_dataset, tiny_run_kwargs
from transformers import AutoModelForCausalLM

import grpo_plus
from grpo_plus.trl_compat import logps_unavailable_reason

pytestmark = [
    pytest.mark.slow,
    # TRL 1.15 on CPU (where these tests train): stock TRL itself cannot train, so there is nothing to compare
    # against (tests/test_losses_parity.py still checks its _compute_loss against the core).
    pytest.mark.skipif(logps_unavailable_reason("cpu") is not None, reason=str(logps_unavailable_reason("cpu"))),
]


def train(tiny_model_dir, tmp_path, package, **overrides):
    """Train the tiny model with `package`'s GRPOConfig/GRPOTrainer; returns (state_dict, log_history)."""
    args = package.GRPOConfig(**tiny_run_kwargs(tmp_path / package.__name__, **overrides))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    trainer = package.GRPOTrainer(
        model=model,
        reward_funcs=[length_reward, digit_reward],
        args=args,
        train_dataset=prompt_dataset(16),
    )
    trainer.train()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, trainer.state.log_history


def assert_same_run(tiny_model_dir, tmp_path, **overrides):
    trl_weights, trl_logs = train(tiny_model_dir, tmp_path, trl, **overrides)
    our_weights, our_logs = train(tiny_model_dir, tmp_path, grpo_plus, **overrides)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    moved = max((trl_weights[k] - initial[k]).abs().max().item() for k in initial)
    assert moved > 1e-3, "training did not change the weights: the comparison would be vacuous"
    diff = max((trl_weights[k] - our_weights[k]).abs().max().item() for k in trl_weights)
    assert diff <= 1e-5, f"max |w_trl - w_grpo_plus| = {diff}"
    assert len(trl_logs) == len(our_logs)
    for trl_entry, our_entry in zip(trl_logs, our_logs, strict=True):
        for key, value in trl_entry.items():
            if key in ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"):
                continue
            assert key in our_entry, f"grpo_plus did not log TRL's metric {key!r}"
            if isinstance(value, float) and not math.isnan(value):
                assert our_entry[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key
    return trl_logs


@pytest.mark.parametrize("epsilon_high", [None, 0.28])
@pytest.mark.parametrize("importance_sampling_level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_builtin_modes_match_stock_trl(tiny_model_dir, tmp_path, loss_type, importance_sampling_level, epsilon_high):
    # steps_per_generation (4) != gradient_accumulation_steps (2): the second optimizer step trains off-policy,
    # so importance ratios move away from 1 and the clipping branches run.
    logs = assert_same_run(
        tiny_model_dir,
        tmp_path,
        loss_type=loss_type,
        importance_sampling_level=importance_sampling_level,
        epsilon_high=epsilon_high,
        gradient_accumulation_steps=2,
        steps_per_generation=4,
        learning_rate=0.2,
    )
    assert any(entry.get("clip_ratio/region_mean", 0) > 0 for entry in logs), "clipping never triggered"


@pytest.mark.parametrize(
    "overrides",
    [
        dict(loss_type="dapo", gradient_accumulation_steps=2, num_iterations=2),
        dict(loss_type="grpo", gradient_accumulation_steps=3, steps_per_generation=2, per_device_train_batch_size=8),
        dict(loss_type="dapo", beta=0.1, epsilon_high=0.28),
        dict(loss_type="dr_grpo", scale_rewards="batch", delta=1.5),
        dict(loss_type="bnpo", scale_rewards="none", mask_truncated_completions=True),
        dict(loss_type="dapo", entropy_coef=0.01, top_entropy_quantile=0.5),
        dict(loss_type="grpo", use_adaptive_entropy=True, entropy_target=10.0, gradient_accumulation_steps=2),
        dict(loss_type="dapo", off_policy_mask_threshold=0.01, steps_per_generation=4, gradient_accumulation_steps=2),
        dict(loss_type="cispo", epsilon_high=5.0),
        dict(loss_type="sapo"),
    ],
    ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()),
)
def test_other_trl_settings_match_stock_trl(tiny_model_dir, tmp_path, overrides):
    assert_same_run(tiny_model_dir, tmp_path, **overrides)
