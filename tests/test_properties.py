"""Property tests: for any shape, mask and reward pattern the core stays finite and masked tokens stay inert."""

from __future__ import annotations

import math

import torch
from helpers.losses import policy_loss_and_grad, policy_loss_inputs
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_plus.objective import available_advantage_normalizers, compute_advantages

PROPERTY_SETTINGS = settings(max_examples=50, deadline=None)


@st.composite
def policy_batches(draw):
    batch = draw(st.integers(1, 8))
    length = draw(st.integers(1, 16))
    # Each row: empty, a single token, full, or anything in between.
    lengths = draw(
        st.lists(
            st.one_of(st.just(0), st.just(1), st.just(length), st.integers(0, length)), min_size=batch, max_size=batch
        )
    )
    return dict(
        batch=batch,
        length=length,
        lengths=lengths,
        seed=draw(st.integers(0, 2**31 - 1)),
        scale=draw(st.sampled_from([0.01, 0.5, 3.0])),  # spread of logp - old_logp: from on-policy to far off
        dtype=draw(st.sampled_from([torch.float32, torch.float64])),
        per_token_advantages=draw(st.booleans()),
        loss_type=draw(st.sampled_from(["grpo", "bnpo", "dr_grpo", "dapo"])),
        level=draw(st.sampled_from(["token", "sequence", "sequence_token"])),
        beta=draw(st.sampled_from([0.0, 0.1])),
        epsilon_high=draw(st.sampled_from([None, 0.28])),
        delta=draw(st.sampled_from([None, 1.5])),
        dual_clip=draw(st.sampled_from([None, 3.0])),
    )


@PROPERTY_SETTINGS
@given(policy_batches())
def test_policy_loss_finite_and_masked_positions_inert(case):
    batch, length = case["batch"], case["length"]
    logps, old_logps, ref_logps, advantages, mask = policy_loss_inputs(
        case["lengths"],
        length,
        case["seed"],
        drift_noise=case["scale"],
        ref_noise=case["scale"],
        per_token_advantages=case["per_token_advantages"],
        dtype=case["dtype"],
    )
    out, grad = policy_loss_and_grad(
        logps,
        old_logps,
        advantages,
        mask,
        loss_type=case["loss_type"],
        importance_sampling_level=case["level"],
        epsilon_high=case["epsilon_high"],
        delta=case["delta"],
        dual_clip=case["dual_clip"],
        beta=case["beta"],
        ref_logps=ref_logps,
        max_completion_length=length,
        num_items_in_batch=mask.sum(),  # may be 0: every row masked
        gradient_accumulation_steps=2,
    )
    assert out.loss.dim() == 0 and torch.isfinite(out.loss)
    assert out.per_token_loss.shape == (batch, length)
    assert torch.isfinite(out.per_token_loss).all()
    assert torch.isfinite(grad).all()
    assert (grad[mask == 0] == 0).all()
    if mask.sum() == 0:
        assert out.loss == 0
    assert all(math.isfinite(value) for value in out.metrics.values())


@st.composite
def reward_batches(draw):
    num_generations = draw(st.integers(1, 6))
    num_prompts = draw(st.integers(1, 5))
    special = st.sampled_from([float("nan"), float("inf"), -float("inf")])
    value = st.one_of(
        st.floats(-1e3, 1e3, allow_nan=False, width=32), st.sampled_from([0.0, 1.0, 0.1, 1000.1]), special
    )
    groups = []
    for _ in range(num_prompts):
        kind = draw(st.sampled_from(["free", "constant", "constant_with_special"]))
        if kind == "free":
            groups.append(draw(st.lists(value, min_size=num_generations, max_size=num_generations)))
        else:
            constant = draw(st.floats(-1e3, 1e3, allow_nan=False, width=32))
            group = [constant] * num_generations
            if kind == "constant_with_special":
                for index in draw(st.lists(st.integers(0, num_generations - 1), max_size=num_generations)):
                    group[index] = draw(special)
            groups.append(group)
    return dict(
        groups=groups,
        num_generations=num_generations,
        dtype=draw(st.sampled_from([torch.float32, torch.float64])),
        scale=draw(st.sampled_from(available_advantage_normalizers(with_aliases=True))),
    )


@PROPERTY_SETTINGS
@given(reward_batches())
def test_advantages_finite_zero_for_unscorable_and_constant_groups(case):
    groups = torch.tensor(case["groups"], dtype=case["dtype"])
    rewards = groups.reshape(-1)
    advantages = compute_advantages(rewards, case["num_generations"], scale_rewards=case["scale"])
    assert advantages.shape == rewards.shape and advantages.dtype == rewards.dtype
    assert torch.isfinite(advantages).all()
    assert (advantages[~torch.isfinite(rewards)] == 0).all()
    grouped = advantages.view(groups.shape)
    for group_rewards, group_advantages in zip(groups, grouped, strict=True):
        finite = group_rewards[torch.isfinite(group_rewards)]
        if finite.numel() <= 1 or (finite == finite[0]).all():  # no contrast inside the group: no signal
            assert (group_advantages == 0).all(), (group_rewards, group_advantages)
