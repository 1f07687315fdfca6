"""Group-relative advantages: reward baselines and scales, one registry (pure torch).

A normalizer gets the rewards of one generation batch grouped by prompt, shape (num_prompts, G), with NaN
for completions that could not be scored, and returns advantages of the same shape. `compute_advantages`
turns non-finite results into 0, so an unscorable completion never moves the policy.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .registry import Registry

AdvantageNormalizer = Callable[[torch.Tensor, float], torch.Tensor]

ADVANTAGE_NORMALIZERS: Registry[AdvantageNormalizer] = Registry("advantage normalizer", "scale_rewards")


def register_advantage_normalizer(name: str, *, aliases: tuple[str, ...] = (), override: bool = False):
    """Decorator: register `fn(grouped_rewards (P, G), eps) -> advantages (P, G)` under `name`."""
    return ADVANTAGE_NORMALIZERS.register(name, aliases=aliases, override=override)


def available_advantage_normalizers(with_aliases: bool = False) -> list[str]:
    """Names accepted by `scale_rewards`."""
    return ADVANTAGE_NORMALIZERS.names(with_aliases)


def exact_nanmean(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """NaN-aware mean (keepdim=True) that is exactly the common value where all non-NaN values are equal.

    The plain mean of equal values is not always that value: in float32 the mean of seven 1000.1s is off by an
    ulp, and TRL 1.16 divides that by std + 1e-4, giving a zero-variance group advantages near -0.37.
    """
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    scorable = ~torch.isnan(x)
    dims = tuple(range(x.dim())) if dim is None else dim
    highest = torch.where(scorable, x, float("-inf")).amax(dim=dims, keepdim=True)
    lowest = torch.where(scorable, x, float("inf")).amin(dim=dims, keepdim=True)
    return torch.where(highest == lowest, highest, mean)


def nanstd(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Bessel-corrected standard deviation ignoring NaN; NaN where fewer than two values remain (TRL's nanstd)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(x), dim=dim, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(count, float("nan"), dtype=x.dtype))
    std = torch.sqrt(variance * correction)
    return std if keepdim else (std.squeeze(dim) if dim is not None else std.reshape(()))


def group_baseline(grouped: torch.Tensor) -> torch.Tensor:
    """Per-prompt mean reward, NaN-aware: shape (P, 1); exactly the reward itself for a group of equal rewards."""
    return exact_nanmean(grouped, dim=1)


@register_advantage_normalizer("group", aliases=("local",))
def scale_by_group_std(grouped: torch.Tensor, eps: float) -> torch.Tensor:
    """A_i = (r_i - mean_group(r)) / (std_group(r) + eps)  (GRPO, DeepSeekMath)."""
    return (grouped - group_baseline(grouped)) / (nanstd(grouped, dim=1, keepdim=True) + eps)


@register_advantage_normalizer("batch", aliases=("global",))
def scale_by_batch_std(grouped: torch.Tensor, eps: float) -> torch.Tensor:
    """A_i = (r_i - mean_group(r)) / (std_batch(r) + eps)  (PPO-Lite / "global" normalization)."""
    return (grouped - group_baseline(grouped)) / (nanstd(grouped) + eps)


@register_advantage_normalizer("none")
def center_only(grouped: torch.Tensor, eps: float) -> torch.Tensor:
    """A_i = r_i - mean_group(r)  (Dr. GRPO: no std scaling, no difficulty bias)."""
    return grouped - group_baseline(grouped)


def compute_advantages(
    rewards: torch.Tensor,
    num_generations: int,
    scale_rewards: str = "group",
    eps: float = 1e-4,
) -> torch.Tensor:
    """Advantages for a flat batch of rewards laid out prompt by prompt, G completions each.

    NaN or infinite rewards count as unscorable: they are left out of every baseline and scale and get
    advantage 0. A group whose rewards are all equal gets advantage 0.
    """
    normalizer = ADVANTAGE_NORMALIZERS.get(scale_rewards)
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
    rewards = rewards if rewards.is_floating_point() else rewards.float()
    rewards = torch.where(torch.isinf(rewards), torch.full_like(rewards, float("nan")), rewards)
    grouped = rewards.view(-1, num_generations)
    advantages = normalizer(grouped, eps)
    if advantages.shape != grouped.shape:
        raise ValueError(
            f"advantage normalizer {scale_rewards!r} returned shape {tuple(advantages.shape)}, "
            f"expected {tuple(grouped.shape)}."
        )
    return torch.nan_to_num(advantages.reshape(-1), nan=0.0, posinf=0.0, neginf=0.0)


def combine_rewards(rewards_per_func: torch.Tensor, reward_weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum over reward functions ignoring NaN; NaN where every function returned None (TRL's rule)."""
    rewards = (rewards_per_func * reward_weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
    rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
    return rewards
