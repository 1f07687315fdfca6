"""Advantage estimators (`advantage_estimator`): each against an oracle written from its paper's formula
(algorithm_oracles) on random rewards with padding, NaN rewards and zero-variance groups, and with
scale_rewards="none" against verl's function of the same name (verl_oracle, transcribed from verl's source)."""

from __future__ import annotations

import math

import algorithm_oracles as oracle
import numpy as np
import pytest
import torch
import verl_oracle as verl
from algorithm_oracles import NAN

from grpo_plus import available_advantage_estimators, compute_advantages, register_advantage_estimator
from grpo_plus.objective.advantages import ADVANTAGE_ESTIMATORS, register_advantage_normalizer

G, P, T = 4, 6, 7
# float64 comparisons with a std or a count ratio in them: TRL's nanstd (whose numbers grpo_plus's group / batch scales
# keep) and verl's gpg divide integer counts, which torch does in float32, so both are rounded at ~1.5e-8 relative:
# worst 1.0e-7 over 10 runs (threads 1-2, 4 input seeds; docs/notes.md, Tolerances): 2.9x.
COUNT_RATIO_TOL = 3e-7
ESTIMATORS = [
    "grpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "grpo_passk",
    "opo",
    "gpg",
    "remax",
]


def rewards_and_lengths(seed: int, dtype=torch.float64, nan: bool = True, empty: bool = True):
    """P groups of G: random rewards (some repeated, so ties occur), one all-equal group, one group with ties at the
    top, NaN rewards (one in a group, a whole group) and completions of 0..T tokens."""
    generator = torch.Generator().manual_seed(seed)
    halves = torch.randint(0, 4, (P * G,), generator=generator).to(dtype) / 2  # ties inside groups
    rewards = halves + torch.rand(P * G, generator=generator, dtype=dtype) * (torch.arange(P * G) % 3 == 0)
    rewards[4:8] = 0.7  # zero-variance group
    rewards[8:12] = torch.tensor([2.0, 2.0, 0.5, 1.0], dtype=dtype)  # a tie at the top
    low = 0 if empty else 1
    lengths = torch.randint(low, T + 1, (P * G,), generator=generator)
    lengths[1] = T  # a full row
    if nan:
        rewards[13] = NAN  # one unscorable completion
        rewards[20:24] = NAN  # an unscorable group
    if empty:
        lengths[2] = 0  # a completion with no loss token (e.g. masked as truncated)
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).long()
    baselines = torch.rand(P, generator=generator, dtype=dtype) * 2
    return rewards, mask, baselines


def ours(name, rewards, mask, baselines, scale="none"):
    extra = {"completion_mask": mask} if ADVANTAGE_ESTIMATORS.entry(name).requires == ("completion_mask",) else {}
    if name == "remax":
        extra = {"reward_baselines": baselines}
    return compute_advantages(rewards, G, scale, estimator=name, **extra)


def paper(name, rewards, mask, baselines, scale="none"):
    lengths = mask.sum(1).tolist()
    if name == "grpo":  # TRL's GRPO normalizers are checked against TRL's code in test_advantages.py
        return None
    calls = {
        "rloo": lambda: oracle.rloo(rewards, G, scale),
        "reinforce_plus_plus": lambda: oracle.reinforce_plus_plus(rewards, lengths),
        "reinforce_plus_plus_baseline": lambda: oracle.reinforce_plus_plus_baseline(rewards, G, lengths),
        "grpo_passk": lambda: oracle.grpo_passk(rewards, G, scale),
        "opo": lambda: oracle.opo(rewards, G, lengths, scale),
        "gpg": lambda: oracle.gpg(rewards, G, scale),
        "remax": lambda: oracle.remax(rewards, G, baselines, scale),
    }
    return torch.tensor(calls[name](), dtype=rewards.dtype)


def test_every_estimator_is_tested():
    assert available_advantage_estimators() == sorted(ESTIMATORS)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", ESTIMATORS[1:])
def test_equals_the_papers_formula(name, dtype, seed):
    rewards, mask, baselines = rewards_and_lengths(seed, dtype)
    got = ours(name, rewards, mask, baselines)
    expected = paper(name, rewards, mask, baselines)
    assert got.dtype == dtype and got.shape == (P * G,)
    # worst 3.6e-7 (float32), 1.3e-15 (float64): 2.8x, 3x
    torch.testing.assert_close(got, expected, atol=1e-6 if dtype == torch.float32 else 4e-15, rtol=0)
    assert torch.isfinite(got).all()
    assert got[13] == 0 and (got[20:24] == 0).all()  # unscorable
    if name in ("rloo", "grpo_passk", "opo", "gpg"):  # a group baseline: a zero-variance group carries no signal
        assert (got[4:8] == 0).all()
    if ADVANTAGE_ESTIMATORS.entry(name).requires == ("completion_mask",):
        assert got[2] == 0  # a completion without loss tokens
    assert got.abs().max() > 0.1


@pytest.mark.parametrize("scale", ["group", "batch"])
@pytest.mark.parametrize("name", ["rloo", "grpo_passk", "opo", "gpg", "remax"])
def test_scale_rewards_divides_by_the_std_it_names(name, scale):
    rewards, mask, baselines = rewards_and_lengths(3)
    got = ours(name, rewards, mask, baselines, scale)
    torch.testing.assert_close(got, paper(name, rewards, mask, baselines, scale), atol=COUNT_RATIO_TOL, rtol=0)
    assert not torch.allclose(got, ours(name, rewards, mask, baselines, "none"))


@pytest.mark.parametrize("name", ["reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_whitening_estimators_ignore_scale_rewards(name):
    rewards, mask, baselines = rewards_and_lengths(4)
    reference = ours(name, rewards, mask, baselines, "none")
    for scale in ("group", "batch"):
        assert torch.equal(ours(name, rewards, mask, baselines, scale), reference)


# ---- verl's functions of the same name (scale_rewards="none"; verl has no NaN rewards and no empty completions) -------


def verl_advantages(name, rewards, mask, baselines, norm_by_std=False, epsilon=1e-6):
    lengths = mask.sum(1)
    token_rewards = torch.zeros(mask.shape, dtype=rewards.dtype)
    token_rewards[torch.arange(len(rewards)), lengths - 1] = rewards  # outcome reward on the last token
    index = np.repeat(np.arange(len(rewards) // G), G)
    config = verl.AlgoConfig(norm_adv_by_std_in_grpo=norm_by_std, gamma=1.0)
    mask = mask.to(rewards.dtype)
    if name == "remax":
        return verl.compute_remax_outcome_advantage(token_rewards, baselines.repeat_interleave(G), mask)[0]
    if name == "reinforce_plus_plus":
        return verl.compute_reinforce_plus_plus_outcome_advantage(token_rewards, mask, config=config)[0]
    if name == "grpo":
        return verl.compute_grpo_outcome_advantage(token_rewards, mask, index, epsilon, norm_by_std, config)[0]
    function = verl.ADV_ESTIMATOR_REGISTRY[name]
    return function(token_rewards, mask, index, epsilon, config=config)[0]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", ESTIMATORS)
def test_equals_verl_with_scale_rewards_none(name, seed):
    rewards, mask, baselines = rewards_and_lengths(seed, nan=False, empty=False)
    expected = verl_advantages(name, rewards.clone(), mask, baselines)
    got = ours(name, rewards, mask, baselines)
    torch.testing.assert_close(
        got.unsqueeze(1) * mask, expected, atol=COUNT_RATIO_TOL if name == "gpg" else 1e-9, rtol=0
    )
    assert expected.abs().max() > 0.1


@pytest.mark.parametrize("name", ["grpo", "grpo_passk"])
def test_group_scale_equals_verls_std_normalization_at_the_same_eps(name):
    """verl's norm_adv_by_std_in_grpo=True is scale_rewards='group' (verl's epsilon passed as ours)."""
    rewards, mask, baselines = rewards_and_lengths(5, nan=False, empty=False)
    expected = verl_advantages(name, rewards.clone(), mask, baselines, norm_by_std=True, epsilon=1e-4)
    got = ours(name, rewards, mask, baselines, "group")
    torch.testing.assert_close(got.unsqueeze(1) * mask, expected, atol=8e-8, rtol=0)  # a std: worst 2.6e-8, 3.1x


def test_exactly_zero_for_equal_rewards_that_float_means_miss():
    """Seven copies of 1000.1 (float32) average to a value an ulp off: every baseline estimator still gives 0."""
    rewards = torch.full((14,), 1000.1, dtype=torch.float32)
    mask = torch.ones(14, 5, dtype=torch.long)
    mask[3, 2:] = 0  # unequal lengths: opo's weighted mean is no plain mean
    for name in ("rloo", "opo", "gpg", "grpo_passk", "reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        extra = (
            {"completion_mask": mask} if name in ("opo", "reinforce_plus_plus", "reinforce_plus_plus_baseline") else {}
        )
        got = compute_advantages(rewards, 7, "group", estimator=name, **extra)
        assert (got == 0).all(), (name, got)


# ---- errors and user estimators -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(estimator="opo"), r"advantage_estimator='opo' needs completion_mask; it was None"),
        (dict(estimator="remax"), r"advantage_estimator='remax' needs reward_baselines; it was None"),
        (dict(estimator="rlooo"), r"advantage_estimator='rlooo' is not registered. Did you mean 'rloo'\?"),
        (dict(estimator="opo", completion_mask=torch.ones(7, 3)), r"completion_mask has 7 rows, rewards 8"),
        (dict(estimator="remax", reward_baselines=torch.ones(3)), r"reward_baselines must have shape \(2,\).*\(8,\)"),
    ],
)
def test_errors_name_what_is_missing(kwargs, match):
    with pytest.raises(ValueError, match=match):
        compute_advantages(torch.rand(8), 4, "none", **kwargs)


def test_a_registered_normalizer_applies_to_grpo_only():
    register_advantage_normalizer("rank_test")(lambda grouped, eps: grouped.argsort(1).argsort(1).to(grouped.dtype))
    assert compute_advantages(torch.tensor([3.0, 1.0, 2.0, 0.0]), 4, "rank_test").tolist() == [3, 1, 2, 0]
    with pytest.raises(
        ValueError, match="scale_rewards='rank_test' cannot be combined with advantage_estimator='rloo'"
    ):
        compute_advantages(torch.rand(4), 4, "rank_test", estimator="rloo")


def test_a_user_estimator_may_give_per_token_advantages_and_is_scaled_as_declared():
    @register_advantage_estimator("late_tokens_test", requires=("completion_mask",))
    def late_tokens(inputs):
        """A[i,t] = (r_i - mean_group(r)) * (t + 1): later tokens weigh more."""
        centered = (inputs.rewards - inputs.rewards.mean(dim=1, keepdim=True)).reshape(-1, 1)
        return centered * torch.arange(1, 4, dtype=centered.dtype)

    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 1.0, 3.0], dtype=torch.float64)
    mask = torch.ones(8, 3, dtype=torch.long)
    got = compute_advantages(rewards, 4, "group", estimator="late_tokens_test", completion_mask=mask)
    std = torch.tensor([0.5, 2 / math.sqrt(6)], dtype=torch.float64).repeat_interleave(4).unsqueeze(1)  # per group
    centered = (rewards.view(2, 4) - rewards.view(2, 4).mean(1, keepdim=True)).reshape(-1, 1)
    torch.testing.assert_close(got, centered * torch.arange(1, 4) / (std + 1e-4), atol=0, rtol=4e-8)  # worst 1.5e-8
    assert got.shape == (8, 3)
