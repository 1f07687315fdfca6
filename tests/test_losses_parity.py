"""compute_policy_loss vs TRL 1.16's own `GRPOTrainer._compute_loss` (run on a stand-in trainer, see trl_oracle).

Every built-in loss_type x importance_sampling_level x {symmetric, clip-higher} x {beta 0, > 0} x {delta None, set},
float64, ragged masks with an all-masked row and a single-token row, gradient accumulation and two processes:
the loss, its gradient w.r.t. logps and the clip / KL metrics must equal TRL's.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers.losses import PolicyLossInputs, policy_loss_and_grad, policy_loss_inputs
from trl_oracle import trl_entropy_mask, trl_policy_loss

# grpo_plus against TRL 1.14-1.16's _compute_loss, float64, over 15 runs (threads 1-2, 4 input seeds, each TRL minor;
# docs/notes.md, Tolerances): losses and per-sequence clip minima bit for bit; gradients worst 2.8e-17 (3.6x);
# metrics, which TRL reduces in float32, worst 2.8e-8 (3.6x).
GRAD_TOL = 1e-16
METRICS_TOL = 1e-7
B, T = 6, 9
S, P = 2, 2  # gradient-accumulation steps, processes
L = T + 3  # max_completion_length (dr_grpo); deliberately != T
LENGTHS = [9, 0, 1, 4, 7, 5]  # ragged: one all-masked row, one single-token completion
METRICS = ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"]


def make_inputs(seed: int, per_token_advantages: bool = False) -> PolicyLossInputs:
    # logps - old_logps = a per-sequence offset plus per-token noise, chosen with the advantage signs so that
    # token- and sequence-level ratios leave the clip range on both sides (w > 1.28 with A > 0, w < 0.8 with
    # A < 0), and some ratios with A < 0 exceed delta=1.5.
    return policy_loss_inputs(
        LENGTHS,
        T,
        seed,
        drift=[0.8, 0.0, -0.8, -0.8, 0.1, 0.8],
        advantage_signs=[1.0, 1.0, 1.0, -1.0, 1.0, -1.0],
        advantage_floor=0.1,
        per_token_advantages=per_token_advantages,
    )


def run_both(logps, old_logps, ref_logps, advantages, mask, *, policy_weights=None, trl_only=None, **settings):
    """(ours, trl) as dicts with loss, grad and metrics; both see identical tensors and settings.

    `policy_weights` go to ours only, `trl_only` (entropies, top_entropy_quantile) to TRL's stand-in only.
    """
    common = dict(
        ref_logps=ref_logps,
        max_completion_length=L,
        gradient_accumulation_steps=S,
        num_processes=P,
        # dapo: N spans the window over all processes (here: S micro-batches x P processes like this one).
        num_items_in_batch=mask.sum() * S * P,
        **settings,
    )
    out, ours_grad = policy_loss_and_grad(logps, old_logps, advantages, mask, policy_weights=policy_weights, **common)
    trl_logps = logps.clone().requires_grad_()
    # TRL's stand-in: steps_per_generation defaults to gradient_accumulation_steps, so its dapo normalizer
    # N/P * S/steps_per_generation equals ours, N/P.
    trl_loss, trl_metrics = trl_policy_loss(trl_logps, old_logps, advantages, mask, **common, **(trl_only or {}))
    trl_loss.backward()
    ours = {"loss": out.loss.detach(), "grad": ours_grad, "metrics": out.metrics, "out": out}
    theirs = {"loss": trl_loss.detach(), "grad": trl_logps.grad, "metrics": trl_metrics}
    return ours, theirs


def assert_parity(ours, theirs, beta):
    assert torch.isfinite(theirs["loss"])
    assert ours["loss"].item() == theirs["loss"].item()
    torch.testing.assert_close(ours["grad"], theirs["grad"], atol=GRAD_TOL, rtol=0)
    assert theirs["grad"].abs().max() > 0  # the comparison is not vacuous
    for name in METRICS + (["kl"] if beta else []):
        assert abs(ours["metrics"][name] - theirs["metrics"][name]) <= METRICS_TOL, name
    assert ("kl" in ours["metrics"]) == bool(beta)


GRID = list(
    itertools.product(
        ["grpo", "bnpo", "dr_grpo", "dapo"], ["token", "sequence"], [None, 0.28], [0.0, 0.04], [None, 1.5]
    )
)


@pytest.mark.parametrize(("loss_type", "level", "epsilon_high", "beta", "delta"), GRID)
def test_loss_grad_metrics_equal_trl(loss_type, level, epsilon_high, beta, delta):
    seed = GRID.index((loss_type, level, epsilon_high, beta, delta))
    inputs = make_inputs(seed)
    settings = dict(
        loss_type=loss_type, importance_sampling_level=level, epsilon=0.2, epsilon_high=epsilon_high, beta=beta
    )
    ours, theirs = run_both(*inputs, delta=delta, **settings)
    assert_parity(ours, theirs, beta)
    # The inputs do exercise clipping on both sides (else the metric comparison proves little).
    assert theirs["metrics"]["clip_ratio/low_mean"] > 0 and theirs["metrics"]["clip_ratio/high_mean"] > 0
    # TRL's per-sequence clip extremes come from the same per-sequence fractions we expose.
    low, high = ours["out"].sequence_clip_fractions()
    assert torch.nan_to_num(low, nan=float("inf")).min().item() == theirs["metrics"]["clip_ratio/low_min"]
    assert (
        abs(torch.nan_to_num(high, nan=-float("inf")).max().item() - theirs["metrics"]["clip_ratio/high_max"])
        <= METRICS_TOL
    )


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_per_token_advantages_and_uncorrected_kl_equal_trl(loss_type, level):
    """(B, T) advantages (subclass-style) and use_bias_correction_kl=False, with KL, clip-higher and delta."""
    inputs = make_inputs(100, per_token_advantages=True)
    ours, theirs = run_both(
        *inputs,
        loss_type=loss_type,
        importance_sampling_level=level,
        epsilon_high=0.28,
        beta=0.04,
        delta=1.5,
        use_bias_correction_kl=False,
    )
    assert_parity(ours, theirs, beta=0.04)


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float64, torch.int32])
def test_mask_dtypes_equal_trl(mask_dtype):
    logps, old_logps, ref_logps, advantages, mask = make_inputs(7)
    ours, _ = run_both(logps, old_logps, ref_logps, advantages, mask.to(mask_dtype), loss_type="grpo", beta=0.04)
    reference, theirs = run_both(logps, old_logps, ref_logps, advantages, mask, loss_type="grpo", beta=0.04)
    assert_parity(ours, theirs, beta=0.04)
    assert torch.equal(ours["grad"], reference["grad"])


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_entropy_mask_as_policy_weights_equals_trl(loss_type, level, beta):
    """TRL multiplies the policy term by its high-entropy mask (top_entropy_quantile < 1); the trainer passes that
    mask as `policy_weights`. The KL term is added after the mask in both."""
    logps, old_logps, ref_logps, advantages, mask = make_inputs(200)
    entropies = torch.rand(B, T, generator=torch.Generator().manual_seed(201), dtype=torch.float64) * 2
    quantile = 0.4
    entropy_mask = trl_entropy_mask(entropies, mask, quantile)
    assert 0 < entropy_mask.sum() < mask.sum()  # the mask really drops tokens
    settings = dict(loss_type=loss_type, importance_sampling_level=level, beta=beta, epsilon_high=0.28)
    ours, _ = run_both(logps, old_logps, ref_logps, advantages, mask, policy_weights=entropy_mask, **settings)
    _, theirs = run_both(
        logps,
        old_logps,
        ref_logps,
        advantages,
        mask,
        trl_only=dict(entropies=entropies, top_entropy_quantile=quantile),
        **settings,
    )
    assert_parity(ours, theirs, beta)
    # ... and without the weights the numbers differ: the entropy mask did something.
    unweighted, _ = run_both(logps, old_logps, ref_logps, advantages, mask, **settings)
    assert (unweighted["grad"] - theirs["grad"]).abs().max() > 1e-3


@pytest.mark.parametrize(
    "settings",
    [dict(epsilon=-0.1), dict(epsilon_high=-0.1), dict(delta=0.5), dict(delta=1.0), dict(beta=-0.04)],
    ids=["negative_epsilon", "negative_epsilon_high", "delta_0.5", "delta_1", "negative_beta"],
)
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
@pytest.mark.filterwarnings("ignore:.*TRL accepts this")
def test_values_trl_trains_with_and_grpo_plus_warns_about_give_trls_loss(loss_type, settings):
    """Settings TRL trains with, however unusual (grpo_plus warns, never refuses them): TRL's loss, gradient and
    metrics."""
    ours, theirs = run_both(*make_inputs(300), loss_type=loss_type, **{"beta": 0.0, **settings})
    assert_parity(ours, theirs, settings.get("beta", 0.0))
