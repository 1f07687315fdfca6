"""Advantages: estimators (`advantage_estimator`) and the reward scales they may divide by (`scale_rewards`).

Two registries, one axis of the objective. A *normalizer* (name = `scale_rewards`) turns the rewards of one generation
batch grouped by prompt, shape (P, G) with NaN for completions that could not be scored, into GRPO advantages of the
same shape: `group`, `batch`, `none` are TRL's. An *estimator* (name = `advantage_estimator`, verl's names) picks the
baseline and scale: `grpo` calls the normalizer; the others subtract their own baseline and then, where their
registrar declared it (`scale_rewards="std"`), divide by the std `scale_rewards` names (group, batch or none); the
whitening estimators (REINFORCE++) scale themselves and ignore `scale_rewards`. `compute_advantages` turns non-finite
results into 0, so an unscorable completion never moves the policy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..registry import Registry
from .common import PAPER, exact_if_constant, exact_nanmean, nanstd

AdvantageNormalizer = Callable[[torch.Tensor, float], torch.Tensor]

ADVANTAGE_NORMALIZERS: Registry[AdvantageNormalizer] = Registry("advantage normalizer", "scale_rewards")


def register_advantage_normalizer(
    name: str, *, aliases: tuple[str, ...] = (), override: bool = False, paper: str = ""
):
    """Decorator: register `fn(grouped_rewards (P, G), eps) -> advantages (P, G)` under `name`."""
    return ADVANTAGE_NORMALIZERS.register(name, aliases=aliases, override=override, traits={PAPER: paper})


def available_advantage_normalizers(with_aliases: bool = False) -> list[str]:
    """Names accepted by `scale_rewards`."""
    return ADVANTAGE_NORMALIZERS.names(with_aliases)


def group_baseline(grouped: torch.Tensor) -> torch.Tensor:
    """Per-prompt mean reward, NaN-aware: shape (P, 1); exactly the reward itself for a group of equal rewards."""
    return exact_nanmean(grouped, dim=1)


@register_advantage_normalizer("group", aliases=("local",), paper="https://arxiv.org/abs/2402.03300")
def scale_by_group_std(grouped: torch.Tensor, eps: float) -> torch.Tensor:
    """A_i = (r_i - mean_group(r)) / (std_group(r) + eps)  (GRPO, DeepSeekMath)."""
    return (grouped - group_baseline(grouped)) / (nanstd(grouped, dim=1, keepdim=True) + eps)


@register_advantage_normalizer("batch", aliases=("global",), paper="https://arxiv.org/abs/2508.08221")
def scale_by_batch_std(grouped: torch.Tensor, eps: float) -> torch.Tensor:
    """A_i = (r_i - mean_group(r)) / (std_batch(r) + eps)  (PPO-Lite / "global" normalization)."""
    return (grouped - group_baseline(grouped)) / (nanstd(grouped) + eps)


@register_advantage_normalizer("none", paper="https://arxiv.org/abs/2503.20783")
def center_only(grouped: torch.Tensor, eps: float) -> torch.Tensor:
    """A_i = r_i - mean_group(r)  (Dr. GRPO: no std scaling, no difficulty bias)."""
    return grouped - group_baseline(grouped)


# ---------------------------------------------------------------------------------------------------------------------
# Estimators
# ---------------------------------------------------------------------------------------------------------------------

# Trait of estimators: what `scale_rewards` does to them. "normalizer": the estimator calls the registered normalizer
# (any `scale_rewards` name, user-registered ones too); "std": its advantage is divided by the group or batch reward std
# + eps (`scale_rewards` group / batch; none leaves it); "ignored": it scales itself.
SCALE_REWARDS_USE = "scale_rewards"
SCALE_REWARDS_USES = ("normalizer", "std", "ignored")
# The normalizers whose std an estimator with scale_rewards="std" may divide by.
STD_SCALES = ("group", "batch", "none")
ESTIMATOR_INPUTS = ("completion_mask", "reward_baselines")
# verl's masked_whiten adds this inside the square root (REINFORCE++ whitening).
WHITEN_EPS = 1e-8


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator sees: one generation batch's rewards grouped by prompt, and what it may need besides.

    rewards: (P, G), NaN where a completion could not be scored. lengths: (P, G) loss tokens of each completion
    (completion_mask summed), when given. reward_baselines: (P, 1) or (P, G) rewards of a baseline completion (ReMax's
    greedy one), when given. scale_rewards (canonical name) and eps are the settings the estimator was called with.
    """

    rewards: torch.Tensor
    scale_rewards: str
    eps: float
    lengths: torch.Tensor | None = None
    reward_baselines: torch.Tensor | None = None

    @property
    def scorable(self) -> torch.Tensor:
        """(P, G) bool: the completions that have a reward."""
        return ~torch.isnan(self.rewards)

    def reward_std(self) -> torch.Tensor:
        """The std + eps that `scale_rewards` names ((P, 1) per group, a scalar for the batch), or 1 for none."""
        if self.scale_rewards == "group":
            return nanstd(self.rewards, dim=1, keepdim=True) + self.eps
        if self.scale_rewards == "batch":
            return nanstd(self.rewards) + self.eps
        return torch.ones((), dtype=self.rewards.dtype, device=self.rewards.device)


AdvantageEstimator = Callable[[AdvantageInputs], torch.Tensor]
ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator", "advantage_estimator")


def register_advantage_estimator(
    name: str,
    *,
    aliases: tuple[str, ...] = (),
    requires: tuple[str, ...] = (),
    scale_rewards: str = "std",
    override: bool = False,
    paper: str = "",
):
    """Decorator: register `fn(inputs: AdvantageInputs) -> advantages` under `name`.

    The result is (P, G), one advantage per completion, or (P*G, T) per token (TRL's loss takes both). `requires` names
    what the estimator reads besides rewards: "completion_mask" (then `inputs.lengths` is set), "reward_baselines".
    `scale_rewards` declares what the `scale_rewards` setting does: "std" (the result is divided by the group / batch
    reward std + eps, or left for none), "ignored" (the estimator scales itself), "normalizer" (it calls the
    registered normalizer itself, as `grpo` does).
    """
    unknown = set(requires) - set(ESTIMATOR_INPUTS)
    if unknown:
        raise ValueError(
            f"requires= names unknown estimator inputs {sorted(unknown)}; allowed: {list(ESTIMATOR_INPUTS)}."
        )
    if scale_rewards not in SCALE_REWARDS_USES:
        raise ValueError(f"scale_rewards= must be one of {', '.join(SCALE_REWARDS_USES)}, got {scale_rewards!r}.")
    return ADVANTAGE_ESTIMATORS.register(
        name,
        aliases=aliases,
        requires=requires,
        override=override,
        traits={SCALE_REWARDS_USE: scale_rewards, PAPER: paper},
    )


def available_advantage_estimators(with_aliases: bool = False) -> list[str]:
    """Names accepted by `advantage_estimator`."""
    return ADVANTAGE_ESTIMATORS.names(with_aliases)


def scale_rewards_problem(estimator: str, scale_rewards: str) -> str | None:
    """Why `scale_rewards` (canonical name) cannot be combined with `estimator`, or None."""
    if ADVANTAGE_ESTIMATORS.entry(estimator).trait(SCALE_REWARDS_USE) == "std" and scale_rewards not in STD_SCALES:
        return (
            f"scale_rewards={scale_rewards!r} cannot be combined with advantage_estimator={estimator!r}: that estimator "
            f"divides by the reward std scale_rewards names, one of {', '.join(STD_SCALES)}; a registered normalizer "
            "replaces the whole advantage and applies to advantage_estimator='grpo' only."
        )
    return None


@register_advantage_estimator("grpo", scale_rewards="normalizer", paper="https://arxiv.org/abs/2402.03300")
def group_relative(inputs: AdvantageInputs) -> torch.Tensor:
    """A_i = (r_i - mean_group(r)) / scale, scale as `scale_rewards` normalizes (GRPO; TRL's advantages)."""
    advantages = ADVANTAGE_NORMALIZERS.get(inputs.scale_rewards)(inputs.rewards, inputs.eps)
    if advantages.shape != inputs.rewards.shape:
        raise ValueError(
            f"advantage normalizer {inputs.scale_rewards!r} returned shape {tuple(advantages.shape)}, "
            f"expected {tuple(inputs.rewards.shape)}."
        )
    return advantages


@register_advantage_estimator("rloo", paper="https://arxiv.org/abs/2402.14740")
def leave_one_out(inputs: AdvantageInputs) -> torch.Tensor:
    """A_i = r_i - mean_{j != i}(r_j) = G/(G-1) (r_i - mean_group(r))  (RLOO, Ahmadian et al. 2024)."""
    count = inputs.scorable.sum(dim=1, keepdim=True).to(inputs.rewards.dtype)
    factor = torch.where(count > 1, count / (count - 1).clamp(min=1.0), torch.zeros_like(count))
    return factor * (inputs.rewards - group_baseline(inputs.rewards))


def _whiten_over_tokens(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """(v - mu) / sqrt(var + 1e-8) with mu and the unbiased var taken over every loss token of the batch (each
    completion's value counted once per token: verl's masked_whiten of the value broadcast over the completion); 0 for
    completions without tokens or value, and everywhere when the batch holds fewer than two tokens."""
    weights = torch.where(torch.isnan(values), torch.zeros_like(lengths), lengths).to(values.dtype)
    filled = torch.nan_to_num(values, nan=0.0)
    tokens = weights.sum()
    mean = (weights * filled).sum() / tokens.clamp(min=1.0)
    mean = exact_if_constant(torch.where(weights > 0, values, torch.full_like(values, float("nan"))), mean, None)
    variance = (weights * (filled - mean) ** 2).sum() / tokens.clamp(min=1.0) * tokens / (tokens - 1).clamp(min=1.0)
    whitened = (values - mean) * torch.rsqrt(variance + WHITEN_EPS)
    return torch.where((weights > 0) & (tokens > 1), whitened, torch.zeros_like(whitened))


@register_advantage_estimator(
    "reinforce_plus_plus",
    requires=("completion_mask",),
    scale_rewards="ignored",
    paper="https://arxiv.org/abs/2501.03262",
)
def reinforce_plus_plus(inputs: AdvantageInputs) -> torch.Tensor:
    """A_i = (r_i - mean_tokens(r)) / std_tokens(r) over the batch's loss tokens, no group baseline (REINFORCE++)."""
    return _whiten_over_tokens(inputs.rewards, inputs.lengths)


@register_advantage_estimator(
    "reinforce_plus_plus_baseline",
    requires=("completion_mask",),
    scale_rewards="ignored",
    paper="https://arxiv.org/abs/2501.03262",
)
def reinforce_plus_plus_baseline(inputs: AdvantageInputs) -> torch.Tensor:
    """A_i = whiten_tokens(r_i - mean_group(r)) over the batch's loss tokens (REINFORCE++-baseline)."""
    return _whiten_over_tokens(inputs.rewards - group_baseline(inputs.rewards), inputs.lengths)


@register_advantage_estimator("grpo_passk", paper="https://arxiv.org/abs/2503.19595")
def pass_at_k(inputs: AdvantageInputs) -> torch.Tensor:
    """A = r_max - r_second for each group's best completion, 0 for the others  (Pass@k training)."""
    rewards = inputs.rewards
    advantages = torch.zeros_like(rewards)
    if rewards.shape[1] < 2:
        return advantages
    ranked, order = torch.where(inputs.scorable, rewards, float("-inf")).topk(2, dim=1)
    gap = ranked[:, :1] - ranked[:, 1:]
    gap = torch.where(torch.isfinite(gap), gap, torch.zeros_like(gap))  # fewer than two scorable: no signal
    return advantages.scatter(1, order[:, :1], gap)


@register_advantage_estimator("opo", requires=("completion_mask",), paper="https://arxiv.org/abs/2505.23585")
def length_weighted_baseline(inputs: AdvantageInputs) -> torch.Tensor:
    """A_i = r_i - sum_j |o_j| r_j / sum_j |o_j| over the group  (OPO: the optimal baseline for on-policy RL)."""
    rewards, lengths = inputs.rewards, inputs.lengths.to(inputs.rewards.dtype)
    weights = torch.where(inputs.scorable, lengths, torch.zeros_like(lengths))
    total = weights.sum(dim=1, keepdim=True)
    baseline = (weights * torch.nan_to_num(rewards, nan=0.0)).sum(dim=1, keepdim=True) / total.clamp(min=1.0)
    baseline = exact_if_constant(
        torch.where(weights > 0, rewards, torch.full_like(rewards, float("nan"))), baseline, 1
    )
    advantages = rewards - baseline
    return torch.where((lengths > 0) & (total > 0), advantages, torch.zeros_like(advantages))


@register_advantage_estimator("gpg", paper="https://arxiv.org/abs/2504.02546")
def group_policy_gradient(inputs: AdvantageInputs) -> torch.Tensor:
    """A_i = alpha (r_i - mean_group(r)), alpha = B / #(r != 0) over the batch  (GPG as verl computes it)."""
    rewards, scorable = inputs.rewards, inputs.scorable
    nonzero = (scorable & (rewards != 0)).sum().to(rewards.dtype)
    alpha = scorable.sum().to(rewards.dtype) / nonzero.clamp(min=1.0)
    return alpha * (rewards - group_baseline(rewards))


@register_advantage_estimator("remax", requires=("reward_baselines",), paper="https://arxiv.org/abs/2310.10505")
def greedy_baseline(inputs: AdvantageInputs) -> torch.Tensor:
    """A_i = r_i - r(greedy completion of the prompt)  (ReMax; 0 where the greedy completion could not be scored)."""
    return inputs.rewards - inputs.reward_baselines


def _lengths(completion_mask: torch.Tensor | None, num_rewards: int) -> torch.Tensor | None:
    if completion_mask is None:
        return None
    if not isinstance(completion_mask, torch.Tensor) or completion_mask.dim() != 2:
        shape = tuple(completion_mask.shape) if isinstance(completion_mask, torch.Tensor) else type(completion_mask)
        raise ValueError(f"completion_mask must be a (num_completions, T) tensor, got {shape}.")
    if completion_mask.shape[0] != num_rewards:
        raise ValueError(
            f"completion_mask has {completion_mask.shape[0]} rows, rewards {num_rewards}: one row per completion."
        )
    return completion_mask.sum(dim=1)


def _reward_baselines(reward_baselines: torch.Tensor | None, num_prompts: int, num_generations: int, dtype):
    if reward_baselines is None:
        return None
    baselines = torch.as_tensor(reward_baselines).to(dtype)
    if baselines.dim() != 1 or baselines.numel() not in (num_prompts, num_prompts * num_generations):
        raise ValueError(
            f"reward_baselines must have shape ({num_prompts},) (one per prompt) or ({num_prompts * num_generations},) "
            f"(one per completion), got {tuple(baselines.shape)}."
        )
    baselines = torch.where(torch.isinf(baselines), torch.full_like(baselines, float("nan")), baselines)
    return baselines.view(num_prompts, -1)


def compute_advantages(
    rewards: torch.Tensor,
    num_generations: int,
    scale_rewards: str = "group",
    eps: float = 1e-4,
    *,
    estimator: str = "grpo",
    completion_mask: torch.Tensor | None = None,
    reward_baselines: torch.Tensor | None = None,
) -> torch.Tensor:
    """Advantages for a flat batch of rewards laid out prompt by prompt, G completions each: shape (N,), or (N, T) for
    an estimator that gives per-token advantages.

    NaN or infinite rewards count as unscorable: they are left out of every baseline and scale and get advantage 0.
    A group whose rewards are all equal gets advantage 0 (except under REINFORCE++-baseline's batch whitening, whose
    shift moves it). `completion_mask` (N, T) gives the completion lengths that opo and REINFORCE++ weight by;
    `reward_baselines` (num_prompts,) or (N,) the baseline rewards ReMax subtracts.
    """
    entry = ADVANTAGE_ESTIMATORS.entry(estimator)
    scale_rewards = ADVANTAGE_NORMALIZERS.resolve(scale_rewards)
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1:
        shape = tuple(rewards.shape) if isinstance(rewards, torch.Tensor) else type(rewards).__name__
        raise ValueError(f"rewards must be a 1-D tensor of shape (num_prompts * num_generations,), got {shape}.")
    if not isinstance(num_generations, int) or num_generations < 1:
        raise ValueError(f"num_generations must be a positive int, got {num_generations!r}.")
    if rewards.numel() % num_generations:
        raise ValueError(
            f"rewards has {rewards.numel()} elements, not a multiple of num_generations={num_generations}: "
            "every prompt needs all of its completions."
        )
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}.")
    problem = scale_rewards_problem(entry.name, scale_rewards)
    if problem is not None:
        raise ValueError(problem)
    given = {"completion_mask": completion_mask, "reward_baselines": reward_baselines}
    for needed in entry.requires:
        if given[needed] is None:
            raise ValueError(f"advantage_estimator={entry.name!r} needs {needed}; it was None.")
    rewards = rewards if rewards.is_floating_point() else rewards.float()
    rewards = torch.where(torch.isinf(rewards), torch.full_like(rewards, float("nan")), rewards)
    grouped = rewards.view(-1, num_generations)
    lengths = _lengths(completion_mask, rewards.numel())
    inputs = AdvantageInputs(
        rewards=grouped,
        scale_rewards=scale_rewards,
        eps=eps,
        lengths=None if lengths is None else lengths.to(grouped.device).view_as(grouped),
        reward_baselines=_reward_baselines(reward_baselines, grouped.shape[0], num_generations, grouped.dtype),
    )
    advantages = entry.fn(inputs)
    per_token = advantages.dim() == 2 and advantages.shape[0] == rewards.numel() and advantages.shape != grouped.shape
    if advantages.shape != grouped.shape and not per_token:
        raise ValueError(
            f"advantage_estimator {entry.name!r} returned shape {tuple(advantages.shape)}, expected "
            f"{tuple(grouped.shape)} (one per completion) or ({rewards.numel()}, T) (per token)."
        )
    if entry.trait(SCALE_REWARDS_USE) == "std":
        scale = inputs.reward_std()
        if per_token and scale.dim() == 2:
            scale = scale.repeat_interleave(num_generations, dim=0)  # (P, 1) -> (N, 1)
        advantages = advantages / scale
    flat = advantages if per_token else advantages.reshape(-1)
    return torch.nan_to_num(flat, nan=0.0, posinf=0.0, neginf=0.0)


def combine_rewards(rewards_per_func: torch.Tensor, reward_weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum over reward functions ignoring NaN; NaN where every function returned None (TRL's rule)."""
    rewards = (rewards_per_func * reward_weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
    rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
    return rewards
