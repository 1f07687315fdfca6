"""GSPO-token (importance_sampling_level="sequence_token") and dual-clip, against closed forms.

Notation: w_i = exp(sum_t m*(logp - old_logp) / |o_i|) is GSPO's sequence ratio, l(w, A) = -min(w*A, clip(w)*A) the
clipped per-token loss, and the aggregation is linear: loss = sum_{i,t} c[i,t] * m[i,t] * l[i,t] with c from
loss_type (grpo: 1/(B*|o_i|*S), bnpo: 1/(sum m * S), dr_grpo: 1/(B*L*S), dapo: P/N). dl/dw = -A where the
unclipped term is active and 0 where clip(w) is.
"""

from __future__ import annotations

import pytest
import torch
from helpers.losses import policy_loss_and_grad, policy_loss_inputs

B, T, L, S, P = 5, 8, 10, 2, 2
LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo"]


def make_inputs(seed: int, per_token_advantages: bool):
    """(logps, old_logps, advantages, mask): a high-clip row 0 and a low-clip row 1 (per-row ratio offsets with the
    advantage signs), the rest inside the clip range; one all-masked row, one single-token row."""
    logps, old_logps, _, advantages, mask = policy_loss_inputs(
        [8, 3, 0, 1, 6],
        T,
        seed,
        drift=[0.5, -0.5, 0.0, 0.4, -0.4],
        advantage_signs=[1.0, -1.0, 1.0, -1.0, 1.0],
        advantage_floor=0.2,
        per_token_advantages=per_token_advantages,
    )
    return logps, old_logps, advantages, mask


def aggregation_weights(loss_type: str, mask: torch.Tensor) -> torch.Tensor:
    """c[i,t] * m[i,t] of the docstring, (B, T)."""
    m = mask.to(torch.float64)
    if loss_type == "grpo":
        return m / (B * m.sum(-1, keepdim=True).clamp(min=1) * S)
    if loss_type == "bnpo":
        return m / (m.sum() * S)
    if loss_type == "dr_grpo":
        return m / (B * L * S)
    return m / (num_items(mask) / P)


def num_items(mask):
    return mask.sum() * S * P


def loss_and_grad(logps, old_logps, advantages, mask, **settings):
    return policy_loss_and_grad(
        logps,
        old_logps,
        advantages,
        mask,
        max_completion_length=L,
        num_items_in_batch=num_items(mask),
        gradient_accumulation_steps=S,
        num_processes=P,
        **settings,
    )


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("per_token_advantages", [False, True])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_sequence_token_value_equals_sequence(loss_type, per_token_advantages, beta):
    logps, old_logps, advantages, mask = make_inputs(1, per_token_advantages)
    ref_logps = logps + 0.1
    settings = dict(loss_type=loss_type, epsilon_high=0.28, beta=beta, ref_logps=ref_logps)
    seq, _ = loss_and_grad(logps, old_logps, advantages, mask, importance_sampling_level="sequence", **settings)
    tok, _ = loss_and_grad(logps, old_logps, advantages, mask, importance_sampling_level="sequence_token", **settings)
    # The stop-gradient trick adds logp - sg(logp) == 0 exactly, so every number is bit-for-bit the same.
    assert torch.equal(tok.loss, seq.loss)
    assert torch.equal(tok.per_token_loss * mask, seq.per_token_loss * mask)
    # Same clip decisions on every counted token. (The clip_ratio metrics weigh them differently: sequence-level
    # flags are (B, 1) and count sequences, TRL's convention; sequence_token's are (B, T) and count tokens.)
    counted = mask.bool()
    for flag in ("is_low_clipped", "is_high_clipped"):
        tok_flag, seq_flag = getattr(tok, flag).expand(B, T), getattr(seq, flag).expand(B, T)
        assert torch.equal(tok_flag[counted], seq_flag[counted])
    assert seq.is_low_clipped[counted.any(-1)].any() and seq.is_high_clipped[counted.any(-1)].any()


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("delta", [None, 1.5])
def test_sequence_token_gradient_equals_sequence_with_sequence_advantages(loss_type, delta):
    """With one advantage per sequence, l[i,t] = l_i(w) is the same for every token of sequence i and c[i,t] = c_i is
    uniform within the sequence for every built-in aggregation. GSPO: d loss/d logp_t = sum_s c_i l_i'(w) * dw/dlogp_t
    = |o_i| c_i l_i'(w) * w_i/|o_i| = c_i l_i'(w) w_i. GSPO-token: only token t's own term depends on logp_t, through
    w_i * exp(logp_t - sg(logp_t)), so d loss/d logp_t = c_i l_i'(w) w_i: the same (GSPO paper, section 4.3)."""
    logps, old_logps, advantages, mask = make_inputs(2, per_token_advantages=False)
    settings = dict(loss_type=loss_type, epsilon_high=0.28, delta=delta)
    _, seq_grad = loss_and_grad(logps, old_logps, advantages, mask, importance_sampling_level="sequence", **settings)
    _, tok_grad = loss_and_grad(
        logps, old_logps, advantages, mask, importance_sampling_level="sequence_token", **settings
    )
    assert seq_grad.abs().max() > 1e-3
    torch.testing.assert_close(tok_grad, seq_grad, atol=0, rtol=8e-16)  # float64: worst 2.5e-16 relative, 3.2x


def test_sequence_token_gradient_differs_from_sequence_with_bias_corrected_kl():
    """The bias-corrected KL term kl_t * w_i is not uniform within a sequence, so the equality above needs beta=0."""
    logps, old_logps, advantages, mask = make_inputs(3, per_token_advantages=False)
    settings = dict(loss_type="grpo", beta=1.0, ref_logps=logps - 0.5 * torch.rand(B, T, dtype=torch.float64))
    _, seq_grad = loss_and_grad(logps, old_logps, advantages, mask, importance_sampling_level="sequence", **settings)
    _, tok_grad = loss_and_grad(
        logps, old_logps, advantages, mask, importance_sampling_level="sequence_token", **settings
    )
    assert not torch.allclose(tok_grad, seq_grad, rtol=0.05, atol=1e-6)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_per_token_advantages_gradients_follow_closed_forms(loss_type):
    logps, old_logps, advantages, mask = make_inputs(4, per_token_advantages=True)
    eps_low, eps_high = 0.2, 0.28
    settings = dict(loss_type=loss_type, epsilon=eps_low, epsilon_high=eps_high)
    seq, seq_grad = loss_and_grad(logps, old_logps, advantages, mask, importance_sampling_level="sequence", **settings)
    _, tok_grad = loss_and_grad(
        logps, old_logps, advantages, mask, importance_sampling_level="sequence_token", **settings
    )

    m = mask.to(torch.float64)
    w = torch.exp(((logps - old_logps) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1))
    clipped = ((w > 1 + eps_high) & (advantages > 0)) | ((w < 1 - eps_low) & (advantages < 0))
    assert clipped.any() and (~clipped & mask.bool()).any()  # both branches occur
    dl_dw = torch.where(clipped, 0.0, -advantages)
    c = aggregation_weights(loss_type, mask)
    # GSPO-token: d loss / d logp_t = c[i,t] * dl_t/dw * w_i  (token t's own term only).
    torch.testing.assert_close(tok_grad, c * dl_dw * w, atol=0, rtol=0)  # bit for bit in every run
    # GSPO: every token's logp moves w_i by w_i * m_t / |o_i|, so d loss / d logp_t = (m_t/|o_i|) w_i sum_s c dl_s/dw.
    length = m.sum(-1, keepdim=True).clamp(min=1)
    expected = m / length * w * (c * dl_dw).sum(-1, keepdim=True)
    torch.testing.assert_close(seq_grad, expected, atol=0, rtol=6e-16)  # worst 2.1e-16 relative: 2.9x
    assert (tok_grad - seq_grad).abs().max() > 1e-3  # GSPO-token really is a different estimator here
    assert seq.metrics["clip_ratio/region_mean"] > 0


# ---------------------------------------------------------------------------------------------------------------------
# Dual clip: for A < 0, l = min(l, c*|A|)
# ---------------------------------------------------------------------------------------------------------------------


def dual_inputs(per_token_advantages: bool):
    """Ratios up to ~e^2.5 (logps - old_logps = 0.6 + 1.2 * N(0, 1)), so that w*|A| > c*|A| for c = 3 on a good share
    of tokens."""
    logps, old_logps, _, advantages, mask = policy_loss_inputs(
        [8, 5, 0, 1, 6],
        T,
        5,
        drift=0.6,
        drift_noise=1.2,
        advantage_signs=[-1.0, 1.0, -1.0, -1.0, 1.0],
        per_token_advantages=per_token_advantages,
    )
    return logps, old_logps, advantages, mask


@pytest.mark.parametrize(
    ("level", "per_token_advantages"), [("token", False), ("token", True), ("sequence", False), ("sequence", True)]
)
@pytest.mark.parametrize("delta", [None, 4.0])
def test_dual_clip_bounds_negative_advantage_loss(level, per_token_advantages, delta):
    c = 3.0
    logps, old_logps, advantages, mask = dual_inputs(per_token_advantages)
    settings = dict(loss_type="dapo", importance_sampling_level=level, epsilon_high=0.28, delta=delta)
    plain, _ = loss_and_grad(logps, old_logps, advantages, mask, **settings)
    dual, grad = loss_and_grad(logps, old_logps, advantages, mask, dual_clip=c, **settings)
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    adv = adv.expand(B, T)
    negative, positive = adv < 0, adv > 0
    bound = c * adv.abs()
    assert (dual.per_token_loss[negative] <= bound[negative]).all()
    # Without dual clip the bound is exceeded somewhere on a counted token, so the check above has teeth.
    exceeded = negative & (plain.per_token_loss > bound) & mask.bool()
    assert exceeded.any()
    assert torch.equal(dual.per_token_loss[exceeded], bound[exceeded])
    # Positive advantages and negative ones under the bound are untouched.
    assert torch.equal(dual.per_token_loss[positive], plain.per_token_loss[positive])
    assert torch.equal(dual.per_token_loss[~exceeded & mask.bool()], plain.per_token_loss[~exceeded & mask.bool()])
    # A dual-clipped token's loss is a constant: zero gradient there (token level; at sequence level the ratio is
    # shared, so the whole sequence is constant when its single advantage is dual-clipped).
    if level == "token" or not per_token_advantages:
        assert (grad[exceeded] == 0).all()
        assert (grad[~exceeded & mask.bool()] != 0).any()
    # clip_ratio/dual_mean: share of counted tokens (token level) or of sequences (sequence level, TRL's convention).
    if dual.is_dual_clipped.shape[-1] == 1:
        expected = (negative[:, :1] & (plain.per_token_loss[:, :1] > bound[:, :1])).double().mean().item()
    else:
        expected = exceeded.sum().item() / mask.sum().item()
    assert dual.metrics["clip_ratio/dual_mean"] == expected
    assert expected > 0
    assert "clip_ratio/dual_mean" not in plain.metrics
