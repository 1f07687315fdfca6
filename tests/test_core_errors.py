"""Every documented error of the loss core names its argument; user-registered modes work end to end."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers.losses import PolicyLossInputs, policy_loss_and_grad, policy_loss_inputs

from grpo_plus import (
    AggregationContext,
    available_importance_sampling_levels,
    available_loss_types,
    compute_policy_loss,
    register_importance_sampling,
    register_loss_type,
)
from grpo_plus.objective import ADVANTAGE_NORMALIZERS, IMPORTANCE_SAMPLERS, LOSS_TYPES
from grpo_plus.objective.common import WARNED_ONCE
from grpo_plus.settings import ConfigError

B, T = 3, 5


def inputs(**overrides) -> PolicyLossInputs:
    """Rows of 5, 2 and 0 completion tokens; ratios off-policy by 0.3 * N(0, 1) per token unless `overrides` say."""
    return policy_loss_inputs([5, 2, 0], T, **{"logps_scale": 1.0, **overrides})


def call(**overrides):
    logps, old_logps, _, advantages, mask = inputs()
    kwargs = dict(
        logps=logps, old_logps=old_logps, advantages=advantages, mask=mask, loss_type="grpo", num_items_in_batch=7
    )
    kwargs.update(overrides)
    return compute_policy_loss(
        kwargs.pop("logps"), kwargs.pop("old_logps"), kwargs.pop("advantages"), kwargs.pop("mask"), **kwargs
    )


def test_valid_call_passes():
    assert torch.isfinite(call().loss)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(logps=torch.zeros(B * T)), r"^logps must have shape \(B, T\), got \(15,\)"),
        (dict(logps=torch.zeros(1, B, T)), r"^logps must have shape \(B, T\), got \(1, 3, 5\)"),
        (dict(old_logps=torch.zeros(B, T + 1)), r"^old_logps must have the shape of logps \(3, 5\), got \(3, 6\)"),
        (dict(mask=torch.ones(B + 1, T)), r"^mask must have the shape of logps \(3, 5\), got \(4, 5\)"),
        (dict(advantages=torch.zeros(B + 1)), r"^advantages must have shape .*got \(4,\)"),
        (dict(advantages=torch.zeros(B, T + 1)), r"^advantages must have shape .*got \(3, 6\)"),
        (dict(advantages=torch.zeros(B, 2)), r"^advantages must have shape .*got \(3, 2\)"),
        (dict(beta=0.1, ref_logps=torch.zeros(B, T - 1)), r"^ref_logps must have the shape of logps .*got \(3, 4\)"),
        (dict(beta=0.1), r"^ref_logps is required when beta != 0 \(beta=0.1\)"),
        (dict(policy_weights=torch.ones(B, 2)), r"^policy_weights must broadcast to \(3, 5\), got \(3, 2\)"),
        (dict(policy_weights=torch.ones(2, B, T)), r"^policy_weights must broadcast to \(3, 5\), got \(2, 3, 5\)"),
        (dict(mask=torch.full((B, T), 0.5)), r"^mask must contain only 0 and 1"),
        (dict(mask=2 * torch.ones(B, T, dtype=torch.long)), r"^mask must contain only 0 and 1"),
        (dict(mask=-torch.ones(B, T, dtype=torch.int32)), r"^mask must contain only 0 and 1"),
        (dict(mask=torch.full((B, T), 1.0 + 1e-6, dtype=torch.float64)), r"^mask must contain only 0 and 1"),
        (dict(dual_clip=1.0), r"^dual_clip \(the dual-clip constant c\) must be > 1 or None, got 1.0"),
        (dict(dual_clip=-3.0), r"^dual_clip .* must be > 1"),
        (dict(gradient_accumulation_steps=0), r"^gradient_accumulation_steps must be >= 1, got 0"),
        (dict(num_processes=0), r"^num_processes must be >= 1, got 0"),
        (dict(loss_type="dr_grpo", max_completion_length=0), r"^max_completion_length must be >= 1, got 0"),
        (dict(loss_type="dapo", num_items_in_batch=None), r"^loss_type='dapo' needs num_items_in_batch; it was None"),
        (dict(loss_type="dr_grpo"), r"^loss_type='dr_grpo' needs max_completion_length; it was None"),
    ],
    ids=lambda value: "-".join(value) if isinstance(value, dict) else None,
)
def test_bad_arguments_name_the_argument(overrides, match):
    with pytest.raises(ValueError, match=match):
        call(**overrides)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(epsilon=-0.1), r"^epsilon=-0.1 is negative: the lower clip bound 1 - epsilon = 1.1 is above 1"),
        (dict(epsilon_high=-0.1), r"^epsilon_high=-0.1 is negative: the upper clip bound 1 \+ epsilon_high = 0.9"),
        (dict(delta=1.0), r"^delta=1.0 is not above 1: the unclipped ratio is capped at delta"),
        (dict(delta=0.5), r"^delta=0.5 is not above 1"),
        (
            dict(beta=-0.1, ref_logps=torch.zeros(B, T)),
            r"^beta=-0.1 is negative: the KL term then rewards moving away",
        ),
    ],
    ids=lambda value: (
        "-".join(f"{k}={v}" for k, v in value.items() if k != "ref_logps") if isinstance(value, dict) else None
    ),
)
def test_values_trl_trains_with_warn_once_and_compute(overrides, match):
    """TRL 1.16 trains with these (a check grpo_plus adds must never refuse what TRL accepts): the core warns once per
    process, saying what is unusual, and computes (test_losses_parity.py: TRL's numbers)."""
    WARNED_ONCE.clear()
    with pytest.warns(UserWarning, match=match) as caught:
        out = call(**overrides)
    assert torch.isfinite(out.loss) and "TRL accepts this; training goes on." in str(caught[0].message)
    assert caught[0].filename == __file__  # points at the caller of compute_policy_loss
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        call(**overrides)  # once per process: the loss runs every micro-batch


@pytest.mark.parametrize(
    ("field", "wrong", "closest", "registered"),
    [
        ("loss_type", "dapoo", "dapo", ["bnpo", "dapo", "dr_grpo", "grpo"]),
        ("loss_type", "DR_GRPO", None, ["bnpo", "dapo", "dr_grpo", "grpo"]),
        ("importance_sampling_level", "sequense", "sequence", ["sequence", "sequence_token", "token"]),
        ("importance_sampling_level", "tokne", "token", ["sequence", "sequence_token", "token"]),
    ],
)
def test_unknown_names_list_registered_and_closest(field, wrong, closest, registered):
    with pytest.raises(ValueError) as info:
        call(**{field: wrong, "max_completion_length": T})
    message = str(info.value)
    assert message.startswith(f"{field}={wrong!r} is not registered.")
    if closest is not None:
        assert f"Did you mean {closest!r}?" in message
    for name in registered:
        assert name in message


def test_one_check_for_names_everywhere():
    """`Registry.check` is how every registered name is checked (the core, the config): canonical names for aliases,
    names another component handles passed through, anything else the error asked for with the closest name."""
    assert ADVANTAGE_NORMALIZERS.check("local") == "group"
    assert LOSS_TYPES.check("cispo", also=("cispo",)) == "cispo"
    with pytest.raises(ConfigError, match=r"loss_type='dapoo' is not registered. Did you mean 'dapo'\?.*cispo"):
        LOSS_TYPES.check("dapoo", also=("cispo",), error=ConfigError)
    with pytest.raises(ValueError, match=r"Allowed: .*Register your own with grpo_plus.register_loss_type\(name\)"):
        LOSS_TYPES.check(3)


def test_snapshot_and_restore_put_a_registry_back():
    built_in = call(loss_type="grpo").loss
    snapshot = LOSS_TYPES.snapshot()
    register_loss_type("snapshot_test")(lambda masked_loss, ctx: masked_loss.sum())
    register_loss_type("grpo", override=True, aliases=("grpo_alias_test",))(lambda masked_loss, ctx: masked_loss.sum())
    LOSS_TYPES.unregister("dapo")
    LOSS_TYPES.restore(snapshot)
    assert LOSS_TYPES.snapshot() == snapshot
    assert "snapshot_test" not in LOSS_TYPES and "grpo_alias_test" not in LOSS_TYPES and "dapo" in LOSS_TYPES
    assert call(loss_type="grpo").loss.item() == built_in.item()  # the built-in again


def test_register_twice_needs_override():
    @register_loss_type("twice_loss_test")
    def first(masked_loss, ctx):
        return masked_loss.sum()

    with pytest.raises(ValueError, match=r"'twice_loss_test' already registered; pass override=True"):
        register_loss_type("twice_loss_test")(lambda masked_loss, ctx: masked_loss.sum() * 2)
    out = call(loss_type="twice_loss_test")
    # still the first function
    torch.testing.assert_close(out.loss, (out.per_token_loss * inputs().mask).sum(), atol=0, rtol=0)

    @register_loss_type("twice_loss_test", override=True)
    def second(masked_loss, ctx):
        return masked_loss.sum() * 2

    out = call(loss_type="twice_loss_test")
    torch.testing.assert_close(out.loss, 2 * (out.per_token_loss * inputs().mask).sum(), atol=0, rtol=0)
    # Built-ins are protected the same way.
    with pytest.raises(ValueError, match=r"'grpo' already registered"):
        register_loss_type("grpo")(first)
    with pytest.raises(ValueError, match=r"'token' already registered"):
        register_importance_sampling("token")(lambda log_ratio, mask: log_ratio)


def test_override_with_an_alias_that_was_an_entry():
    register_loss_type("alias_target_test")(lambda masked_loss, ctx: masked_loss.sum())
    register_loss_type("alias_owner_test", aliases=("alias_target_test",), override=True)(
        lambda masked_loss, ctx: 3 * masked_loss.sum()
    )
    assert LOSS_TYPES.resolve("alias_target_test") == "alias_owner_test"
    assert "alias_target_test" not in available_loss_types()  # no longer a canonical name
    names = available_loss_types(with_aliases=True)
    assert names.count("alias_target_test") == 1
    out = call(loss_type="alias_target_test")
    torch.testing.assert_close(out.loss, 3 * (out.per_token_loss * inputs().mask).sum(), atol=0, rtol=0)


def test_requires_unknown_field():
    with pytest.raises(ValueError, match=r"requires= names unknown context fields \['max_len'\]"):
        register_loss_type("requires_test", requires=("max_len",))
    assert "requires_test" not in available_loss_types()


def test_requires_known_field_is_enforced():
    register_loss_type("needs_len_test", requires=("max_completion_length",))(
        lambda masked_loss, ctx: masked_loss.sum() / ctx.L
    )
    with pytest.raises(ValueError, match=r"loss_type='needs_len_test' needs max_completion_length"):
        call(loss_type="needs_len_test")
    out = call(loss_type="needs_len_test", max_completion_length=10)
    torch.testing.assert_close(out.loss, (out.per_token_loss * inputs().mask).sum() / 10, atol=0, rtol=0)


def test_loss_type_must_return_scalar():
    register_loss_type("per_sequence_test")(lambda masked_loss, ctx: masked_loss.sum(-1))
    with pytest.raises(ValueError, match=r"'per_sequence_test' must return a scalar, got shape \(3,\)"):
        call(loss_type="per_sequence_test")


def test_user_loss_type_end_to_end():
    """seq_mean_token_sum: sum over each sequence's tokens, mean over sequences, / S (a constant per-token weight
    across sequences of different length, without Dr. GRPO's L)."""
    seen: list[AggregationContext] = []

    @register_loss_type("seq_mean_token_sum", aliases=("smts",))
    def seq_mean_token_sum(masked_loss: torch.Tensor, ctx: AggregationContext) -> torch.Tensor:
        seen.append(ctx)
        return (masked_loss * ctx.mask).sum(-1).mean() / ctx.S

    assert "seq_mean_token_sum" in available_loss_types()
    assert "smts" in available_loss_types(with_aliases=True)

    logps, old_logps, _, advantages, mask = inputs()
    eps_low, eps_high, steps = 0.2, 0.28, 3
    out, grad = policy_loss_and_grad(
        logps,
        old_logps,
        advantages,
        mask,
        loss_type="smts",
        epsilon=eps_low,
        epsilon_high=eps_high,
        gradient_accumulation_steps=steps,
        num_processes=2,
        max_completion_length=9,
    )
    ctx = seen[-1]
    assert (ctx.B, ctx.S, ctx.P, ctx.L, ctx.N) == (B, steps, 2, 9, None)
    assert torch.equal(ctx.mask, mask)

    # Hand computation of the same objective.
    hand_leaf = logps.clone().requires_grad_()
    ratio = torch.exp(hand_leaf - old_logps)
    adv = advantages.unsqueeze(1)
    per_token = -torch.min(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)
    hand = (per_token * mask).sum(-1).mean() / steps
    hand.backward()
    torch.testing.assert_close(out.loss, hand, atol=0, rtol=0)  # the same operations: bit for bit
    torch.testing.assert_close(grad, hand_leaf.grad, atol=0, rtol=0)
    assert hand_leaf.grad.abs().max() > 0


def test_user_importance_sampling_end_to_end():
    """sequence_sum: log w[i] = sum_t m*(logp - old_logp), the unnormalized sequence likelihood ratio, (B, 1)."""

    @register_importance_sampling("sequence_sum")
    def sequence_sum(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return (log_ratio * mask).sum(-1, keepdim=True)

    assert "sequence_sum" in available_importance_sampling_levels()

    logps, old_logps, _, advantages, mask = inputs(drift_noise=0.05)
    out, grad = policy_loss_and_grad(
        logps,
        old_logps,
        advantages,
        mask,
        loss_type="dapo",
        importance_sampling_level="sequence_sum",
        num_items_in_batch=7,
    )

    hand_leaf = logps.clone().requires_grad_()
    ratio = torch.exp(((hand_leaf - old_logps) * mask).sum(-1, keepdim=True))
    adv = advantages.unsqueeze(1)
    per_token = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    hand = (per_token * mask).sum() / 7
    hand.backward()
    torch.testing.assert_close(out.loss, hand, atol=0, rtol=0)  # the same operations: bit for bit
    torch.testing.assert_close(grad, hand_leaf.grad, atol=0, rtol=0)
    assert hand_leaf.grad.abs().max() > 0
    assert out.importance_weights.shape == (B, 1)
    # Metrics of a (B, 1) weight count sequences, like TRL's sequence level.
    assert out.metrics["ratio/mean"] == ratio.detach().mean().item()

    IMPORTANCE_SAMPLERS.unregister("sequence_sum")
    with pytest.raises(ValueError, match=r"importance_sampling_level='sequence_sum' is not registered"):
        call(importance_sampling_level="sequence_sum")
