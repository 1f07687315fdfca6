"""compute_advantages vs TRL 1.16's advantage block (extracted from its installed source, see trl_oracle), plus the
documented behaviour where grpo_plus differs on purpose (inf rewards, float rounding in constant groups), user
normalizers and error paths."""

from __future__ import annotations

import pytest
import torch
from trl.trainer.utils import nanstd as trl_nanstd
from trl_oracle import trl_advantages

from grpo_plus import available_advantage_normalizers, compute_advantages, register_advantage_normalizer
from grpo_plus.objective import ADVANTAGE_NORMALIZERS
from grpo_plus.objective.common import nanstd

NAN = float("nan")
G = 4
SCALES = {"group": "group", "local": "group", "batch": "batch", "global": "batch", "none": "none"}
DTYPES = [torch.float32, torch.float64]


def trl_rewards(rewards_per_func: torch.Tensor, weights) -> torch.Tensor:
    """The scalar reward TRL normalizes: weighted nansum over functions, NaN where every function returned None."""
    rewards = (rewards_per_func * torch.as_tensor(weights, dtype=rewards_per_func.dtype)).nansum(dim=1)
    rewards[torch.isnan(rewards_per_func).all(dim=1)] = NAN
    return rewards


def reward_matrix(num_funcs: int, dtype) -> torch.Tensor:
    """5 prompts x G completions: plain, one unscorable row, a zero-variance group (representable values, so the
    mean is exact), a group with a single scorable completion, and a fully unscorable group."""
    gen = torch.Generator().manual_seed(num_funcs)
    r = torch.randn(5 * G, num_funcs, generator=gen, dtype=dtype)
    r[5] = NAN  # prompt 1: one completion unscorable (every function returned None)
    r[8:12] = torch.tensor([0.5, -1.25, 2.0][:num_funcs], dtype=dtype)  # prompt 2: all equal
    r[13:16] = NAN  # prompt 3: only one scorable completion
    r[16:20] = NAN  # prompt 4: nothing scorable
    if num_funcs > 1:
        r[1, 0] = NAN  # a single function failing on one completion is not "unscorable": nansum skips it
    return r


@pytest.mark.parametrize("scale", list(SCALES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_funcs", "weights"), [(1, [1.0]), (3, [1.0, 0.5, -2.0])])
def test_equals_trl(scale, dtype, num_funcs, weights):
    per_func = reward_matrix(num_funcs, dtype)
    expected = trl_advantages(per_func, G, scale_rewards=SCALES[scale], reward_weights=weights)
    ours = compute_advantages(trl_rewards(per_func, weights), num_generations=G, scale_rewards=scale)
    assert ours.dtype == expected.dtype == dtype
    torch.testing.assert_close(ours, expected, atol=0, rtol=0)  # bit for bit in every run measured (TRL 1.14-1.16)
    assert torch.isfinite(ours).all()
    assert ours[5] == 0  # unscorable
    assert (ours[8:12] == 0).all()  # zero-variance group: exactly 0, never a division blow-up
    assert (ours[12:20] == 0).all()  # a lone scorable completion and an unscorable group carry no signal
    assert ours[:4].abs().max() > 0.1  # the normal group does get a signal


@pytest.mark.parametrize("dtype", DTYPES)
def test_num_generations_one_equals_trl(dtype):
    rewards = torch.randn(6, 1, dtype=dtype)
    for scale in ("group", "batch", "none"):
        expected = trl_advantages(rewards, 1, scale_rewards=scale)
        torch.testing.assert_close(compute_advantages(rewards[:, 0], 1, scale), expected, atol=0, rtol=0)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_inf_rewards_are_unscorable(scale):
    """Documented: an infinite reward counts as unscorable: advantage 0, and the rest of its group is normalized as
    if it were absent (TRL would spread inf/NaN over the whole group)."""
    rewards = torch.tensor([1.0, 2.0, float("inf"), 4.0, 0.0, -float("inf"), 3.0, 5.0], dtype=torch.float64)
    ours = compute_advantages(rewards, G, scale)
    without = rewards.clone()
    without[torch.isinf(without)] = NAN
    assert ours[2] == 0 and ours[5] == 0
    torch.testing.assert_close(ours, compute_advantages(without, G, scale), atol=0, rtol=0)
    torch.testing.assert_close(ours, trl_advantages(without.unsqueeze(1), G, scale), atol=0, rtol=0)
    assert torch.isfinite(ours).all() and (ours[[0, 1, 3, 4, 6, 7]] != 0).all()


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("value", [0.1, 0.3, -3.7, 1000.1, 12345.678])
def test_constant_group_is_exactly_zero_despite_rounding(scale, value):
    """A group of equal rewards that are not exactly representable: float32 rounding of the group mean, divided by
    std + 1e-4, gives TRL's code advantages up to ~0.9 here; ours are exactly 0 (documented difference)."""
    rewards = torch.tensor([value] * 7 + [0.0, 1.0, 3.0, 2.0, 5.0, -1.0, 4.0], dtype=torch.float32)
    ours = compute_advantages(rewards, 7, scale)
    assert (ours[:7] == 0).all()
    torch.testing.assert_close(ours[7:], trl_advantages(rewards.unsqueeze(1), 7, scale)[7:], atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nanstd_equals_trl(dtype):
    """nanstd (also used by dynamic sampling to find zero-variance groups) is TRL's, bit for bit."""
    x = torch.randn(5, 7, generator=torch.Generator().manual_seed(3), dtype=dtype)
    x[1] = 1000.1  # equal values, not representable
    x[2, 3] = NAN
    x[3] = NAN  # nothing scorable: NaN
    x[4, :6] = NAN  # one value: NaN
    for dim in (1, None):
        for keepdim in (False, True):
            expected = trl_nanstd(x, dim=dim, keepdim=keepdim)
            torch.testing.assert_close(nanstd(x, dim=dim, keepdim=keepdim), expected, atol=0, rtol=0, equal_nan=True)
    assert torch.isnan(nanstd(x, dim=1)[3:]).all()


def test_user_normalizer_leave_one_out_end_to_end():
    """RLOO: baseline = mean of the other scorable completions of the prompt, no scaling."""

    @register_advantage_normalizer("rloo_test", aliases=("leave_one_out_test",))
    def leave_one_out(grouped: torch.Tensor, eps: float) -> torch.Tensor:
        valid = ~torch.isnan(grouped)
        total = torch.nansum(grouped, dim=1, keepdim=True)
        count = valid.sum(dim=1, keepdim=True)
        return grouped - (total - grouped) / (count - 1)

    assert "rloo_test" in available_advantage_normalizers()
    assert "leave_one_out_test" in available_advantage_normalizers(with_aliases=True)
    rewards = torch.tensor([1.0, 2.0, 4.0, NAN, 3.0, 3.0, 3.0, 7.0], dtype=torch.float64)
    for name in ("rloo_test", "leave_one_out_test"):
        ours = compute_advantages(rewards, num_generations=4, scale_rewards=name)
        # Hand computation: prompt 0 scorable {1, 2, 4}; prompt 1 {3, 3, 3, 7}.
        expected = torch.tensor(
            [1 - 3, 2 - 2.5, 4 - 1.5, 0, 3 - 13 / 3, 3 - 13 / 3, 3 - 13 / 3, 7 - 3], dtype=torch.float64
        )
        torch.testing.assert_close(ours, expected, atol=0, rtol=0)  # the same operations: bit for bit
    ADVANTAGE_NORMALIZERS.unregister("rloo_test")
    assert "rloo_test" not in available_advantage_normalizers(with_aliases=True)
    assert "leave_one_out_test" not in available_advantage_normalizers(with_aliases=True)


def test_user_normalizer_rank_based_end_to_end():
    @register_advantage_normalizer("rank_test")
    def centered_rank(grouped: torch.Tensor, eps: float) -> torch.Tensor:
        ranks = grouped.argsort(dim=1).argsort(dim=1).to(grouped.dtype)
        return ranks / (grouped.shape[1] - 1) - 0.5

    rewards = torch.tensor([10.0, -1.0, 3.0, 0.5, 2.0, 1.0, 0.0, 9.0])
    ours = compute_advantages(rewards, num_generations=4, scale_rewards="rank_test")
    expected = torch.tensor([3, 0, 2, 1, 2, 1, 0, 3], dtype=torch.float32) / 3 - 0.5
    torch.testing.assert_close(ours, expected, atol=0, rtol=0)


def test_user_normalizer_nan_output_becomes_zero():
    register_advantage_normalizer("identity_test")(lambda grouped, eps: grouped)
    ours = compute_advantages(torch.tensor([1.0, NAN, float("inf"), 2.0]), 2, "identity_test")
    assert torch.equal(ours, torch.tensor([1.0, 0.0, 0.0, 2.0]))


def test_register_twice():
    register_advantage_normalizer("twice_test")(lambda grouped, eps: grouped * 0)
    with pytest.raises(ValueError, match=r"'twice_test'.*already registered.*override=True"):
        register_advantage_normalizer("twice_test")(lambda grouped, eps: grouped)
    register_advantage_normalizer("twice_test", override=True)(lambda grouped, eps: grouped + 1)
    assert torch.equal(compute_advantages(torch.zeros(2), 2, "twice_test"), torch.ones(2))
    with pytest.raises(ValueError, match="already registered"):
        register_advantage_normalizer("anything_test", aliases=("group",))(lambda grouped, eps: grouped)
    assert "anything_test" not in available_advantage_normalizers()


@pytest.mark.parametrize(
    ("rewards", "num_generations", "match"),
    [
        (torch.zeros(2, 4), 4, r"rewards must be a 1-D tensor.*\(2, 4\)"),
        (torch.zeros(()), 1, r"rewards must be a 1-D tensor"),
        ([1.0, 2.0], 2, r"rewards must be a 1-D tensor.*list"),
        (torch.zeros(10), 4, r"10 elements, not a multiple of num_generations=4"),
        (torch.zeros(8), 0, r"num_generations must be a positive int"),
        (torch.zeros(8), 2.0, r"num_generations must be a positive int"),
    ],
)
def test_bad_inputs(rewards, num_generations, match):
    with pytest.raises(ValueError, match=match):
        compute_advantages(rewards, num_generations)


def test_negative_eps():
    with pytest.raises(ValueError, match=r"eps must be >= 0"):
        compute_advantages(torch.zeros(4), 2, eps=-1e-4)


def test_unknown_name_lists_names_and_closest_match():
    with pytest.raises(ValueError) as info:
        compute_advantages(torch.zeros(4), 2, scale_rewards="gruop")
    message = str(info.value)
    assert "scale_rewards" in message and "'gruop'" in message
    assert "Did you mean 'group'?" in message
    for name in ("batch", "global", "group", "local", "none"):
        assert name in message


def test_normalizer_returning_wrong_shape():
    register_advantage_normalizer("flat_test")(lambda grouped, eps: grouped.reshape(-1))
    with pytest.raises(ValueError, match=r"'flat_test' returned shape \(8,\), expected \(2, 4\)"):
        compute_advantages(torch.randn(8), 4, "flat_test")
