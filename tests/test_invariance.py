"""Splitting one batch over k gradient-accumulation micro-batches and/or P processes must not change the gradient.

Full batch: one call with gradient_accumulation_steps=1, num_processes=1. Split: process p holds a contiguous shard
of B/P sequences and runs k micro-batches of it with gradient_accumulation_steps=k, num_processes=P; each process's
gradient is the sum of its micro-batch gradients, and DDP averages the P gradients. The gradient is taken w.r.t. the
log-probs, which is stronger than w.r.t. shared parameters (those gradients are J^T times these).
dapo's num_items_in_batch is the token count of the whole window on all processes (what TRL passes).
"""

from __future__ import annotations

import pytest
import torch
from helpers.losses import PolicyLossInputs, policy_loss_inputs

from grpo_plus import available_policy_losses
from grpo_plus.objective import POLICY_LOSSES, SPLIT_INVARIANT, compute_policy_loss

B, T = 16, 12
L = 15  # max_completion_length
SPLITS = [(2, 1), (4, 1), (1, 2), (1, 4), (2, 2), (4, 2), (2, 4)]  # (k micro-batches, P processes)


def make_inputs(seed: int, per_token_advantages: bool = False) -> PolicyLossInputs:
    """Ragged completions drawn per seed (one all masked, one a single token); ratios off-policy by 0.4 * N(0, 1)."""
    lengths = torch.randint(0, T + 1, (B,), generator=torch.Generator().manual_seed(seed))
    lengths[3] = 0
    lengths[5] = 1
    return policy_loss_inputs(lengths, T, seed, drift_noise=0.4, per_token_advantages=per_token_advantages)


def split_gradient(inputs, k: int, num_processes: int, **settings) -> torch.Tensor:
    """DDP-averaged gradient after each of P processes accumulated k micro-batches."""
    logps, old_logps, ref_logps, advantages, mask = inputs
    leaf = logps.clone().requires_grad_()
    num_items = mask.sum()  # the whole window, all processes
    shard, micro = B // num_processes, B // num_processes // k
    process_grads = []
    for p in range(num_processes):
        window_loss = 0.0
        for j in range(k):
            rows = slice(p * shard + j * micro, p * shard + (j + 1) * micro)
            out = compute_policy_loss(
                leaf[rows],
                old_logps[rows],
                advantages[rows],
                mask[rows],
                ref_logps=ref_logps[rows],
                max_completion_length=L,
                num_items_in_batch=num_items,
                gradient_accumulation_steps=k,
                num_processes=num_processes,
                **settings,
            )
            window_loss = window_loss + out.loss
        (grad,) = torch.autograd.grad(window_loss, leaf)
        process_grads.append(grad)
    return torch.stack(process_grads).mean(0)  # DDP all-reduce (mean)


@pytest.mark.parametrize(("k", "num_processes"), SPLITS)
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize(
    "variant",
    [
        dict(importance_sampling_level="token"),
        dict(importance_sampling_level="sequence", epsilon_high=0.28, beta=0.04, delta=1.5),
        dict(importance_sampling_level="sequence_token", beta=0.04, dual_clip=3.0, per_token_advantages=True),
    ],
    ids=["token", "sequence+kl+delta", "sequence_token+kl+dual+per_token_adv"],
)
def test_split_gives_full_batch_gradient(k, num_processes, loss_type, variant):
    variant = dict(variant)
    inputs = make_inputs(seed=k * 10 + num_processes, per_token_advantages=variant.pop("per_token_advantages", False))
    settings = dict(loss_type=loss_type, **variant)
    full = split_gradient(inputs, 1, 1, **settings)
    split = split_gradient(inputs, k, num_processes, **settings)
    assert full.abs().max() > 1e-3
    # bit for bit in every run measured (docs/notes.md, Tolerances): a token's gradient sums over no other row
    torch.testing.assert_close(split, full, atol=0, rtol=0)


@pytest.mark.parametrize(("k", "num_processes"), [(2, 1), (4, 1), (1, 2), (2, 2)])
def test_bnpo_is_not_split_invariant(k, num_processes):
    """By design (documented in bnpo's docstring and the README): bnpo normalizes each micro-batch by its own token
    count, so when micro-batches hold different numbers of tokens the gradient depends on the split."""
    logps, old_logps, ref_logps, advantages, _ = make_inputs(seed=0)
    lengths = torch.tensor([T] * (B // 4) + [1] * (B - B // 4))  # the first quarter long, the rest one token
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).long()
    inputs = (logps, old_logps, ref_logps, advantages, mask)
    full = split_gradient(inputs, 1, 1, loss_type="bnpo")
    split = split_gradient(inputs, k, num_processes, loss_type="bnpo")
    relative = (split - full).norm() / full.norm()
    assert relative > 1e-3
    # With equal token counts per micro-batch bnpo is invariant again (the difference above is the normalizer).
    even = (logps, old_logps, ref_logps, advantages, torch.ones(B, T, dtype=torch.long))
    torch.testing.assert_close(
        split_gradient(even, k, num_processes, loss_type="bnpo"),
        split_gradient(even, 1, 1, loss_type="bnpo"),
        atol=0,
        rtol=0,
    )


@pytest.mark.parametrize(("k", "num_processes"), [(2, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
@pytest.mark.parametrize("policy_loss", available_policy_losses())
def test_policy_losses_are_split_invariant_exactly_where_declared(policy_loss, loss_type, k, num_processes):
    """Row-local losses (ppo_clip, gmpo, gpg, cispo, sapo; any KL estimator) give the full batch's gradient under any
    split. Clip-Cov and KL-Cov pick their tokens per micro-batch (covariance centered on it, a share of its tokens),
    so the split changes the gradient: declared, and documented."""
    options = {"clip_cov": {"clip_cov_ratio": 0.3, "clip_cov_lb": 0.0}, "kl_cov": {"kl_cov_ratio": 0.3}}.get(
        policy_loss
    )
    settings = dict(
        loss_type=loss_type,
        policy_loss=policy_loss,
        policy_loss_options=options,
        beta=0.04,
        kl_estimator="low_var_kl+",
    )
    inputs = make_inputs(seed=100 + k * 10 + num_processes)
    torch.manual_seed(0)
    full = split_gradient(inputs, 1, 1, **settings)
    torch.manual_seed(0)
    split = split_gradient(inputs, k, num_processes, **settings)
    assert full.abs().max() > 1e-3
    if POLICY_LOSSES.entry(policy_loss).trait(SPLIT_INVARIANT):
        torch.testing.assert_close(split, full, atol=0, rtol=0)  # bit for bit, as above
    else:
        assert (split - full).norm() / full.norm() > 1e-3
