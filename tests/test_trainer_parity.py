"""Drop-in parity: stock trl.GRPOTrainer and grpo_plus.GRPOTrainer train to the same weights and logs.

grpo_plus generates with its zero-waste loop (each prompt prefilled once, finished rows out of the decode batch) in
every run here, checked by `assert_same_run`, so equal weights also show it sampled stock TRL's completions.

The runs use plain SGD: its update is the gradient times the learning rate, so equal weights show equal gradients.
Adam divides each coordinate by its own gradient scale, which hides a gradient off by a constant factor and, on
coordinates whose gradient is near zero, turns float32 rounding noise (~1e-7, e.g. from computing the same
log-probs in another layout, as the zero-waste pass does) into weight differences of ~1e-5.
"""

import math

import pytest
import torch
import trl
from tiny import (
    ForwardLog,
    digit_reward,
    half_dead_reward,
    length_reward,
    max_weight_diff,
    prompt_dataset,
    tiny_run_kwargs,
)
from transformers import AutoModelForCausalLM

import grpo_plus
from grpo_plus.generation import transformers_blocker
from grpo_plus.trl_compat import logps_unavailable_reason

pytestmark = [
    pytest.mark.slow,
    # TRL 1.15 on CPU (where these tests train): stock TRL itself cannot train, so there is nothing to compare
    # against (tests/test_losses_parity.py still checks its _compute_loss against the core).
    pytest.mark.skipif(logps_unavailable_reason("cpu") is not None, reason=str(logps_unavailable_reason("cpu"))),
]
# Metrics the zero-waste pass computes over the rows it computed (documented); TRL averages every row.
COMPUTED_ROWS_ONLY = ("entropy",)


def train(tiny_model_dir, tmp_path, package, reward_funcs=(length_reward, digit_reward), **overrides):
    """Train the tiny model with `package`'s GRPOConfig/GRPOTrainer; returns (state_dict, log_history, forwards)."""
    overrides = {"optim": "sgd", "learning_rate": 0.5, **overrides}
    args = package.GRPOConfig(**tiny_run_kwargs(tmp_path / package.__name__, **overrides))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    trainer = package.GRPOTrainer(
        model=model,
        reward_funcs=list(reward_funcs),
        args=args,
        train_dataset=prompt_dataset(16),
    )
    forwards = ForwardLog(model)
    trainer.train()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, trainer.state.log_history, forwards


def assert_same_run(tiny_model_dir, tmp_path, reward_funcs=(length_reward, digit_reward), **overrides):
    """Both trainers end with the same weights and log the same values; returns both logs and ForwardLogs."""
    trl_weights, trl_logs, trl_forwards = train(tiny_model_dir, tmp_path, trl, reward_funcs, **overrides)
    our_weights, our_logs, our_forwards = train(tiny_model_dir, tmp_path, grpo_plus, reward_funcs, **overrides)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    moved = max_weight_diff(initial, trl_weights)
    assert moved > 1e-3, "training did not change the weights: the comparison would be vacuous"
    diff = max_weight_diff(trl_weights, our_weights)
    assert diff <= 1e-5, f"max |w_trl - w_grpo_plus| = {diff}"
    assert len(trl_logs) == len(our_logs)
    if transformers_blocker() is None:  # else (transformers 4.x) grpo_plus generates with TRL's loop, and logs why
        key = "zero_waste/generation_positions_frac"
        generated = [entry[key] for entry in our_logs if key in entry]
        assert generated and max(generated) < 1.0, "grpo_plus's zero-waste generation did not run"
    rows_skipped = any(entry.get("zero_waste/rows_computed_frac", 1.0) < 1.0 for entry in our_logs)
    for trl_entry, our_entry in zip(trl_logs, our_logs, strict=True):
        for key, value in trl_entry.items():
            if key in ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"):
                continue
            assert key in our_entry, f"grpo_plus did not log TRL's metric {key!r}"
            if rows_skipped and key in COMPUTED_ROWS_ONLY:
                continue
            if isinstance(value, float) and not math.isnan(value):
                assert our_entry[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key
    return trl_logs, our_logs, trl_forwards, our_forwards


@pytest.mark.parametrize("clip_higher", [False, True])
@pytest.mark.parametrize("importance_sampling_level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_builtin_modes_match_stock_trl(tiny_model_dir, tmp_path, loss_type, importance_sampling_level, clip_higher):
    # steps_per_generation (4) != gradient_accumulation_steps (2): the second optimizer step trains off-policy,
    # so importance ratios move away from 1 and the clipping branches run. A sequence's mean ratio moves far less
    # than single tokens' (GSPO clips at ~3e-4), so the sequence level gets a GSPO-sized epsilon.
    epsilon = 0.2 if importance_sampling_level == "token" else 0.003
    logs, _, _, _ = assert_same_run(
        tiny_model_dir,
        tmp_path,
        loss_type=loss_type,
        importance_sampling_level=importance_sampling_level,
        epsilon=epsilon,
        epsilon_high=1.4 * epsilon if clip_higher else None,
        gradient_accumulation_steps=2,
        steps_per_generation=4,
        learning_rate=1.0,
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


@pytest.mark.parametrize(
    "overrides",
    [
        dict(loss_type="dapo", per_device_train_batch_size=8, gradient_accumulation_steps=2),
        dict(loss_type="grpo", importance_sampling_level="sequence", steps_per_generation=4,
             gradient_accumulation_steps=2, per_device_train_batch_size=8, epsilon_high=0.28),
        dict(loss_type="bnpo", num_iterations=2, per_device_train_batch_size=16, importance_sampling_level="sequence_token"),
        dict(loss_type="dr_grpo", per_device_train_batch_size=16, mask_truncated_completions=True,
             max_completion_length=12, dual_clip=3.0),
    ],
    ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()),
)  # fmt: skip
def test_zero_waste_pass_matches_stock_trl_where_it_skips(tiny_model_dir, tmp_path, overrides):
    """Half the prompts get a constant reward: their rows are skipped, groups share prompts, yet TRL's run results.

    Settings stock TRL lacks (dual_clip, sequence_token) are compared with the same grpo_plus run, savings off.
    """
    if "dual_clip" in overrides or overrides.get("importance_sampling_level") == "sequence_token":
        full_logs, our_logs, full, saved = assert_zero_waste_run_unchanged(tiny_model_dir, tmp_path, **overrides)
    else:
        full_logs, our_logs, full, saved = assert_same_run(
            tiny_model_dir, tmp_path, reward_funcs=(half_dead_reward,), **overrides
        )
    assert any(entry.get("frac_reward_zero_std", 0) > 0 for entry in full_logs), "no dead group: nothing to skip"
    assert any(entry.get("zero_waste/rows_computed_frac", 1) < 1 for entry in our_logs), "no row was skipped"
    # Token positions of the forwards that carried gradient: the full pass against the zero-waste pass.
    assert saved.training_positions < 0.7 * full.training_positions, (
        saved.training_positions,
        full.training_positions,
    )


def assert_zero_waste_run_unchanged(tiny_model_dir, tmp_path, **overrides):
    """For settings stock TRL lacks: grpo_plus with the zero-waste pass equals grpo_plus without it."""
    full_weights, full_logs, full = train(
        tiny_model_dir, tmp_path / "full", grpo_plus, (half_dead_reward,), zero_waste_pass=False, **overrides
    )
    our_weights, our_logs, saved = train(
        tiny_model_dir, tmp_path / "saved", grpo_plus, (half_dead_reward,), **overrides
    )
    diff = max_weight_diff(full_weights, our_weights)
    assert diff <= 1e-5, f"max |w_full - w_zero_waste| = {diff}"
    for full_entry, our_entry in zip(full_logs, our_logs, strict=True):
        if "loss" in full_entry:
            assert our_entry["loss"] == pytest.approx(full_entry["loss"], rel=1e-6, abs=1e-7)
    return full_logs, our_logs, full, saved
