"""Policy losses (`policy_loss`), KL estimators (`kl_estimator`) and the adaptive KL coefficient: each against an
oracle from its paper's formula (algorithm_oracles), verl's function of the same name (verl_oracle) and, for cispo,
sapo and k3, TRL's own `_compute_loss` (trl_oracle); random inputs with padding (an empty row, a one-token row)."""

from __future__ import annotations

import json
import math

import algorithm_oracles as oracle
import pytest
import torch
import verl_oracle as verl
from helpers.losses import policy_loss_and_grad, policy_loss_inputs
from trl_oracle import trl_policy_loss

from grpo_plus import AdaptiveKLController, available_kl_estimators, available_policy_losses, compute_policy_loss
from grpo_plus.objective import POLICY_LOSSES, ZERO_ADVANTAGE_ROWS_CONTRIBUTE_NOTHING

B, T = 6, 9
LENGTHS = [9, 0, 1, 4, 7, 5]
# grpo_plus against verl's code and the papers' oracles, float64: losses summed in another order, worst 1.9e-16 over
# 15 runs (threads 1-2, 4 input seeds, TRL 1.14-1.16; docs/notes.md, Tolerances): 2.6x. Gradients: bit for bit.
TOL = 5e-16


def inputs(seed=0, per_token_advantages=False, drift=(0.5, 0.0, -0.5, -0.4, 0.3, 0.6), **kwargs):
    """Rows of 9, 0, 1, 4, 7, 5 tokens; ratios leave [0.8, 1.28] on both sides; advantages of both signs."""
    return policy_loss_inputs(
        LENGTHS, T, seed, drift=list(drift), advantage_signs=[1, -1, 1, -1, 1, -1], advantage_floor=0.1,
        per_token_advantages=per_token_advantages, **kwargs,
    )  # fmt: skip


def grad_of(loss_fn, logps):
    leaf = logps.detach().clone().requires_grad_()
    loss = loss_fn(leaf)
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss.detach(), grad


def test_every_policy_loss_and_kl_estimator_is_tested():
    assert available_policy_losses() == ["cispo", "clip_cov", "gmpo", "gpg", "kl_cov", "ppo_clip", "sapo"]
    assert available_kl_estimators() == [
        "abs",
        "abs+",
        "k1",
        "k1+",
        "k2",
        "k2+",
        "k3",
        "k3+",
        "low_var_kl",
        "low_var_kl+",
    ]


# ---- GMPO --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("per_token_advantages", [False, True])
@pytest.mark.parametrize("epsilon_high", [None, 0.4])
def test_gmpo_equals_verl_geo_mean_and_the_paper(per_token_advantages, epsilon_high):
    logps, old, _, advantages, mask = inputs(1, per_token_advantages)
    settings = dict(policy_loss="gmpo", loss_type="grpo", epsilon=0.2, epsilon_high=epsilon_high)
    out, grad = policy_loss_and_grad(logps, old, advantages, mask, **settings)
    high = 0.2 if epsilon_high is None else epsilon_high
    config = verl.ActorConfig(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=high)
    token_advantages = advantages.unsqueeze(1).expand(B, T) if advantages.dim() == 1 else advantages
    verl_loss, verl_grad = grad_of(
        lambda lp: verl.compute_policy_loss_geo_mean(old, lp, token_advantages, mask.double(), config=config)[0], logps
    )
    assert abs(out.loss.item() - verl_loss.item()) < TOL
    torch.testing.assert_close(grad, verl_grad, atol=0, rtol=0)
    assert verl_grad.abs().max() > 1e-3
    if not per_token_advantages:  # the paper's formula is for one advantage per sequence
        paper_loss, paper_grad = grad_of(
            lambda lp: oracle.aggregate(
                oracle.gmpo(lp, old, advantages.tolist(), mask.tolist(), 0.2, high), mask.tolist(), "grpo"
            ),
            logps,
        )
        # verl (and so grpo_plus) divide by length + 1e-8: 1e-8 relative from the paper's exact mean.
        assert out.loss.item() == pytest.approx(paper_loss.item(), rel=1e-7)
        torch.testing.assert_close(grad, paper_grad, atol=2e-8, rtol=0)  # worst 5.5e-9: 3.7x
    # The clip flags count a log-ratio beyond the range on the side that limits the update.
    log_ratio = logps - old
    low = ((log_ratio < -0.2) & (token_advantages < 0) & (mask > 0)).sum() / mask.sum()
    assert out.metrics["clip_ratio/low_mean"] == pytest.approx(low.item(), rel=1e-7) and low > 0  # worst 3.7e-8


# ---- GPG, KL-Cov, Clip-Cov --------------------------------------------------------------------------------------


def test_gpg_loss_equals_verl_and_the_paper():
    logps, old, _, advantages, mask = inputs(2)
    out, grad = policy_loss_and_grad(logps, old, advantages, mask, policy_loss="gpg", num_items_in_batch=mask.sum())
    token_advantages = advantages.unsqueeze(1).expand(B, T)
    config = verl.ActorConfig()
    verl_loss, verl_grad = grad_of(
        lambda lp: verl.compute_policy_loss_gpg(old, lp, token_advantages, mask.double(), config=config)[0], logps
    )
    paper_loss, paper_grad = grad_of(
        lambda lp: oracle.aggregate(oracle.gpg_loss(lp, advantages.tolist(), mask.tolist()), mask.tolist(), "dapo"),
        logps,
    )
    for loss, g in ((verl_loss, verl_grad), (paper_loss, paper_grad)):
        assert abs(out.loss.item() - loss.item()) < TOL
        torch.testing.assert_close(grad, g, atol=0, rtol=0)
    assert "clip_ratio/region_mean" not in out.metrics  # no ratio, nothing clipped


@pytest.mark.parametrize("ratio", [1e-4, 0.1, 0.3])
def test_kl_cov_equals_verl_and_the_paper(ratio):
    logps, old, _, advantages, mask = inputs(3)
    options = {"kl_cov_ratio": ratio, "kl_cov_coef": 0.7}
    out, grad = policy_loss_and_grad(
        logps, old, advantages, mask, policy_loss="kl_cov", policy_loss_options=options, num_items_in_batch=mask.sum()
    )
    config = verl.ActorConfig(policy_loss=verl.ActorConfig(kl_cov_ratio=ratio, ppo_kl_coef=0.7))
    token_advantages = advantages.unsqueeze(1).expand(B, T).clone()
    verl_loss, verl_grad = grad_of(
        lambda lp: verl.compute_policy_loss_kl_cov(old, lp, token_advantages, mask.double(), config=config)[0], logps
    )
    chosen = []
    paper_loss, paper_grad = grad_of(
        lambda lp: oracle.aggregate(
            chosen.append(oracle.kl_cov(lp, old, advantages.tolist(), mask.tolist(), ratio, 0.7)) or chosen[-1][0],
            mask.tolist(),
            "dapo",
        ),
        logps,
    )
    for loss, g in ((verl_loss, verl_grad), (paper_loss, paper_grad)):
        assert abs(out.loss.item() - loss.item()) < TOL
        torch.testing.assert_close(grad, g, atol=0, rtol=0)
    penalized = len(chosen[-1][1])
    assert penalized == max(1, int(mask.sum().item() * ratio))
    assert out.metrics["kl_cov/penalized_frac"] == penalized / mask.sum().item()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_clip_cov_equals_verl_under_the_same_random_draw_and_cuts_what_the_paper_says(seed):
    logps, old, _, advantages, mask = inputs(4 + seed)
    options = {"clip_cov_ratio": 0.2, "clip_cov_lb": 0.0, "clip_cov_ub": 5.0}
    torch.manual_seed(seed)
    out, grad = policy_loss_and_grad(
        logps, old, advantages, mask, policy_loss="clip_cov", epsilon_high=0.28, policy_loss_options=options,
        num_items_in_batch=mask.sum(),
    )  # fmt: skip
    config = verl.ActorConfig(
        clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, policy_loss=verl.ActorConfig(**options)
    )
    token_advantages = advantages.unsqueeze(1).expand(B, T)
    torch.manual_seed(seed)
    verl_loss, verl_grad = grad_of(
        lambda lp: verl.compute_policy_loss_clip_cov(old, lp, token_advantages, mask.double(), config=config)[0], logps
    )
    assert abs(out.loss.item() - verl_loss.item()) < TOL
    torch.testing.assert_close(grad, verl_grad, atol=0, rtol=0)
    # The paper: PPO-clip's gradient everywhere but on max(1, r n) random tokens of the covariance band, cut to 0.
    candidates, tokens = oracle.clip_cov_candidates(
        logps, old, advantages.tolist(), mask.tolist(), 0.2, 0.28, 0.0, 5.0
    )
    _, ppo_grad = grad_of(
        lambda lp: oracle.aggregate(
            oracle.ppo_clip(lp, old, advantages.tolist(), mask.tolist(), 0.2, 0.28), mask.tolist(), "dapo"
        ),
        logps,
    )
    cut = {(i, t) for i, t in zip(*torch.nonzero((grad == 0) & (ppo_grad != 0), as_tuple=True), strict=True)}
    cut = {(int(i), int(t)) for i, t in cut}
    assert cut <= candidates and len(cut) == min(max(1, int(0.2 * tokens)), len(candidates)) and cut
    kept = (grad != 0) | (ppo_grad == 0)
    torch.testing.assert_close(grad[kept], ppo_grad[kept], atol=0, rtol=0)
    assert out.metrics["clip_cov/cut_frac"] == len(cut) / tokens


# ---- CISPO, SAPO: TRL's loss_type="cispo" / "sapo", computed by grpo_plus --------------------------------------------


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize(
    ("trl_loss_type", "ours", "settings"),
    [
        ("cispo", dict(policy_loss="cispo", loss_type="dapo"), dict(epsilon_high=1.3)),
        ("cispo", dict(policy_loss="cispo", loss_type="dapo"), dict(epsilon_high=5.0)),
        ("sapo", dict(policy_loss="sapo", loss_type="grpo"), dict()),
    ],
    ids=["cispo_capped", "cispo_5", "sapo"],
)
def test_cispo_and_sapo_equal_trls_own_loss(trl_loss_type, ours, settings, level, beta):
    logps, old, ref, advantages, mask = inputs(5, drift=(0.5, 0.0, -0.5, -0.4, 0.3, 0.6))
    common = dict(importance_sampling_level=level, beta=beta, ref_logps=ref, num_items_in_batch=mask.sum(), **settings)
    out, grad = policy_loss_and_grad(logps, old, advantages, mask, **ours, **common)
    trl_logps = logps.clone().requires_grad_()
    trl_loss, trl_metrics = trl_policy_loss(trl_logps, old, advantages, mask, loss_type=trl_loss_type, **common)
    trl_loss.backward()
    assert out.loss.item() == trl_loss.item()
    torch.testing.assert_close(grad, trl_logps.grad, atol=2e-16, rtol=0)  # worst 5.6e-17: 3.6x
    assert trl_logps.grad.abs().max() > 1e-3
    trl_names = {name for name in trl_metrics if name not in ("entropy",)}
    assert trl_names <= set(out.metrics), trl_names - set(out.metrics)
    for name in trl_names:
        assert out.metrics[name] == pytest.approx(trl_metrics[name], abs=3e-8), name  # TRL's are float32: worst 9.9e-9
    if trl_loss_type == "cispo" and settings["epsilon_high"] < 2:
        assert out.metrics["cispo_clip_ratio"] > 0  # the cap was hit: the comparison covers it


def test_cispo_and_sapo_follow_their_papers():
    logps, old, _, advantages, mask = inputs(6)
    w = torch.exp(logps - old)
    a = advantages.unsqueeze(1)
    cispo = policy_loss_and_grad(logps, old, advantages, mask, policy_loss="cispo", epsilon_high=1.2, loss_type="grpo")
    expected_cispo = -(torch.clamp(w, max=1.2) * a * logps * mask).sum(1) / mask.sum(1).clamp(min=1)
    assert cispo[0].loss.item() == expected_cispo.mean().item()
    # CISPO's gradient is the policy gradient weighted by the (stopped) capped ratio: -min(w, 1.2) A per token.
    expected_grad = -(torch.clamp(w, max=1.2) * a * mask) / mask.sum(1, keepdim=True).clamp(min=1) / B
    torch.testing.assert_close(cispo[1], expected_grad, atol=2e-16, rtol=0)  # worst 5.6e-17: 3.6x
    sapo, _ = policy_loss_and_grad(logps, old, advantages, mask, policy_loss="sapo", loss_type="grpo")
    tau = torch.where(a > 0, 1.0, 1.05)
    gate = torch.sigmoid(tau * (w - 1)) * 4 / tau
    expected_sapo = (-(gate * a) * mask).sum(1) / mask.sum(1).clamp(min=1)
    assert sapo.loss.item() == expected_sapo.mean().item()


# ---- zero-advantage rows: the declaration the zero-waste pass relies on -----------------------------------------------


@pytest.mark.parametrize("name", available_policy_losses())
def test_zero_advantage_rows_contribute_nothing_exactly_where_declared(name):
    """Declared: the loss and gradient do not depend on a zero-advantage row's log-probs at all. Not declared (Clip-Cov,
    KL-Cov): they do (the covariance is centered over every token, and KL-Cov may penalize those rows)."""
    logps, old, _, advantages, mask = inputs(7, drift=(0.5, 0.0, -0.5, -0.4, 0.3, 0.6))
    advantages[[0, 4]] = 0.0
    options = {"clip_cov": {"clip_cov_ratio": 0.3, "clip_cov_lb": 0.0}, "kl_cov": {"kl_cov_ratio": 0.3}}.get(name)
    settings = dict(policy_loss=name, loss_type="dapo", num_items_in_batch=mask.sum(), policy_loss_options=options)
    moved = logps.clone()
    moved[[0, 4]] += 2 + torch.linspace(-1.5, 1.5, T, dtype=logps.dtype)  # the zero-advantage rows' log-probs change
    torch.manual_seed(0)
    out, grad = policy_loss_and_grad(logps, old, advantages, mask, **settings)
    torch.manual_seed(0)
    out_moved, grad_moved = policy_loss_and_grad(moved, old, advantages, mask, **settings)
    same = out.loss.item() == out_moved.loss.item() and torch.equal(grad, grad_moved)  # declared: 0.0 on 20 seeds
    assert same == POLICY_LOSSES.entry(name).trait(ZERO_ADVANTAGE_ROWS_CONTRIBUTE_NOTHING)
    if same:
        assert (grad[[0, 4]] == 0).all()


# ---- KL estimators ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["k1", "k2", "k3", "abs", "low_var_kl"])
def test_kl_estimators_equal_schulmans_formulas_and_verls_kl_penalty(name):
    logps, _, ref, advantages, mask = inputs(8, ref_noise=1.0)
    ref = ref.clone()
    ref[0, :3] = logps[0, :3] + torch.tensor([25.0, -30.0, 3.0], dtype=ref.dtype)  # beyond verl's clamps
    beta = 0.1
    out, grad = policy_loss_and_grad(
        logps, logps.detach(), torch.zeros_like(advantages), mask, beta=beta, ref_logps=ref, kl_estimator=name,
        num_items_in_batch=mask.sum(),
    )  # fmt: skip
    paper = torch.tensor(
        [
            [oracle.kl(name, float(lp), float(r)) for lp, r in zip(lr, rr, strict=True)]
            for lr, rr in zip(logps, ref, strict=True)
        ],
        dtype=logps.dtype,
    )  # noqa: E501
    expected_loss = beta * (paper * mask).sum() / mask.sum()
    assert out.loss.item() == pytest.approx(expected_loss.item(), rel=3e-14)  # worst 1.0e-14: 3x
    torch.testing.assert_close(out.per_token_kl * mask, paper * mask, atol=0, rtol=4e-15)  # worst 1.2e-15: 3.3x
    verl_name = {"k3": "k3", "low_var_kl": "low_var_kl"}.get(name, name)
    verl_value = verl.kl_penalty(logps, ref, verl_name)
    inside = (ref - logps).abs() < 20
    if name == "k3":  # verl's k3 is clamped: equal to TRL's k3 (ours) where the clamps do not act
        inside &= verl_value.abs() < 10
        assert not inside[0, :2].any() and (verl_value[0, :2] != paper[0, :2]).all()
        torch.testing.assert_close(verl.kl_penalty(logps, ref, "low_var_kl"), verl_value, atol=0, rtol=0)
    else:
        inside = torch.ones_like(inside)
    torch.testing.assert_close((paper * inside), (verl_value * inside), atol=0, rtol=2e-14)  # worst 5.3e-15: 3.8x
    assert grad.abs().max() > 0


@pytest.mark.parametrize("name", ["k1", "k3", "abs", "low_var_kl"])
def test_straight_through_forms_have_the_named_value_and_k2s_gradient(name):
    logps, _, ref, advantages, mask = inputs(9, ref_noise=1.0)
    settings = dict(beta=1.0, ref_logps=ref, num_items_in_batch=mask.sum(), use_bias_correction_kl=False)
    zero = torch.zeros_like(advantages)
    plain, _ = policy_loss_and_grad(logps, logps.detach(), zero, mask, kl_estimator=name, **settings)
    straight, grad = policy_loss_and_grad(logps, logps.detach(), zero, mask, kl_estimator=name + "+", **settings)
    _, k2_grad = policy_loss_and_grad(logps, logps.detach(), zero, mask, kl_estimator="k2", **settings)
    assert straight.loss.item() == plain.loss.item()
    torch.testing.assert_close(grad, k2_grad, atol=0, rtol=0)
    # d/dlogp (logp - ref)^2/2, worst 1.4e-17: 3.6x
    torch.testing.assert_close(grad, (logps - ref) * mask / mask.sum(), atol=5e-17, rtol=0)
    # verl's "+" (what its docs describe; its kl_penalty at this commit passes the suffixed name on and raises):
    leaf = logps.clone().requires_grad_()
    backward_score = 0.5 * (leaf - ref).square()
    verl_value = backward_score - backward_score.detach() + verl.kl_penalty_forward(leaf, ref, name).detach()
    (verl_grad,) = torch.autograd.grad((verl_value * mask).sum() / mask.sum(), leaf)
    torch.testing.assert_close(grad, verl_grad, atol=0, rtol=0)


def test_bias_corrected_kl_is_weighted_by_the_ratio_for_every_estimator():
    logps, old, ref, advantages, mask = inputs(10)
    zero = torch.zeros_like(advantages)
    for name in ("k1", "abs", "low_var_kl+"):
        settings = dict(beta=1.0, ref_logps=ref, kl_estimator=name, num_items_in_batch=mask.sum())
        corrected, _ = policy_loss_and_grad(logps, old, zero, mask, **settings)
        plain, _ = policy_loss_and_grad(logps, old, zero, mask, use_bias_correction_kl=False, **settings)
        torch.testing.assert_close(corrected.per_token_kl, plain.per_token_kl * torch.exp(logps - old), atol=0, rtol=0)


# ---- the adaptive KL coefficient ---------------------------------------------------------------------------------


def test_adaptive_kl_controller_equals_verls_and_the_paper():
    steps = [(0.5, 16), (0.01, 16), (0.1, 32), (0.11, 8), (3.0, 64), (0.0, 16)]
    ours, theirs = AdaptiveKLController(0.04, 0.1, 100), verl.AdaptiveKLController(0.04, 0.1, 100)
    values = []
    for current, n in steps:
        values.append(ours.update(current, n))
        theirs.update(current, n)
        assert ours.value == theirs.value  # to the bit
    assert values == oracle.adaptive_kl(0.04, 0.1, 100, steps)
    assert values[0] > 0.04 and values[1] < values[0]  # KL above the target raises beta, below lowers it


def test_adaptive_kl_controller_state_round_trips_and_rejects_bad_state():
    controller = AdaptiveKLController(0.04, 0.1, 100)
    controller.update(0.3, 16)
    state = controller.state_dict()
    restored = AdaptiveKLController(0.04, 0.1, 100)
    restored.load_state_dict(json.loads(json.dumps(state)))
    assert restored.value == controller.value and restored.checkpoint_name == "adaptive_kl_controller"
    for bad, match in [({"version": 2, "value": 1.0}, "version 2"), ({"version": 1, "value": -1.0}, "> 0")]:
        with pytest.raises(ValueError, match=match):
            restored.load_state_dict(bad)
    with pytest.raises(ValueError, match="horizon must be > 0"):
        AdaptiveKLController(0.04, 0.1, 0)


# ---- errors ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        (dict(policy_loss="gmpo", importance_sampling_level="sequence"), "cannot be combined with policy_loss='gmpo'"),
        (dict(policy_loss="cispo", delta=2.0), r"delta=2.0 cannot be combined with policy_loss='cispo'.*ppo_clip"),
        (dict(policy_loss="sapo", dual_clip=3.0), "dual_clip=3.0 cannot be combined with policy_loss='sapo'"),
        (dict(policy_loss="clip_cov", policy_loss_options={"kl_cov_ratio": 0.1}), "takes no option.*clip_cov_ratio"),
        (dict(policy_loss="clip_cov", policy_loss_options={"clip_cov_lb": 6.0}), r"must be below clip_cov_ub=5.0"),
        (dict(policy_loss="kl_cov", policy_loss_options={"kl_cov_coef": -1.0}), r"kl_cov_coef=-1.0 .* must be >= 0"),
        (dict(policy_loss="sapo", policy_loss_options={"sapo_temperature_neg": 0.0}), "sapo_temperature_neg=0.0"),
        (dict(policy_loss="gmpoo"), r"policy_loss='gmpoo' is not registered. Did you mean 'gmpo'\?"),
        (dict(kl_estimator="k4"), r"kl_estimator='k4' is not registered"),
    ],
)
def test_bad_combinations_fail_naming_the_setting(settings, match):
    logps, old, _, advantages, mask = inputs(11)
    with pytest.raises(ValueError, match=match):
        compute_policy_loss(logps, old, advantages, mask, num_items_in_batch=mask.sum(), **settings)


def test_a_registered_policy_loss_gets_its_options_and_composes():
    from grpo_plus import register_policy_loss
    from grpo_plus.objective import PolicyTerm

    @register_policy_loss("scaled_pg_test", zero_advantage_rows_contribute_nothing=True, options={"scale": 2.0})
    def scaled_policy_gradient(ctx):
        """l = -scale A logp."""
        return PolicyTerm(-ctx.options["scale"] * ctx.advantages * ctx.logps)

    logps, old, _, advantages, mask = inputs(12)
    out = compute_policy_loss(logps, old, advantages, mask, policy_loss="scaled_pg_test", loss_type="grpo",
                              policy_loss_options={"scale": 3.0})  # fmt: skip
    gpg = compute_policy_loss(logps, old, advantages, mask, policy_loss="gpg", loss_type="grpo")
    assert out.loss.item() == pytest.approx(3 * gpg.loss.item(), rel=5e-16)  # worst 1.7e-16: 2.9x
    assert math.isfinite(out.metrics["ratio/mean"])


def test_a_registered_policy_loss_declares_its_options_bounds_beside_it():
    """An option's allowed values live in its declaration (`Option`): a value outside them fails in the core, and the
    bound may name another option of the same loss."""
    from grpo_plus import register_policy_loss
    from grpo_plus.objective import Option, PolicyTerm

    @register_policy_loss(
        "banded_pg_test",
        options={"low": Option(0.5, "below high={high}", lambda value, options: value < options["high"]),
                 "high": Option(2.0, "> 0", lambda value, options: value > 0)},
    )  # fmt: skip
    def banded_policy_gradient(ctx):
        """l = -clip(w, low, high) A logp."""
        weights = ctx.weights.clamp(ctx.options["low"], ctx.options["high"]).detach()
        return PolicyTerm(-weights * ctx.advantages * ctx.logps)

    logps, old, _, advantages, mask = inputs(13)
    settings = dict(policy_loss="banded_pg_test", loss_type="grpo")
    compute_policy_loss(logps, old, advantages, mask, **settings, policy_loss_options={"low": 1.0})  # < high=2.0
    with pytest.raises(ValueError, match=r"low=3.0 is not allowed: low must be below high=2.0"):
        compute_policy_loss(logps, old, advantages, mask, **settings, policy_loss_options={"low": 3.0})
    with pytest.raises(ValueError, match=r"high=-1.0 is not allowed: high must be > 0"):
        compute_policy_loss(logps, old, advantages, mask, **settings, policy_loss_options={"high": -1.0, "low": -2})
