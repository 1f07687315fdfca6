"""KL to the reference policy (`kl_estimator`, pure torch): per-token estimators of KL(pi || pi_ref) from
logp = log pi and ref = log pi_ref of the sampled tokens, and PPO's adaptive KL coefficient.

Estimators as J. Schulman's "Approximating KL divergence" (http://joschu.net/blog/kl-approx.html) names them, and as
verl's `kl_penalty` computes them; `k3` is TRL's (unclamped), verl's clamped k3 is `low_var_kl`. A name ending in "+"
is the straight-through form: the named estimator's value, k2's gradient (unbiased for the reverse KL's gradient).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..registry import Registry
from .common import PAPER

KLEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
KL_ESTIMATORS: Registry[KLEstimator] = Registry("kl estimator", "kl_estimator")
KL_APPROX = "http://joschu.net/blog/kl-approx.html"
STRAIGHT_THROUGH = "+"


def register_kl_estimator(
    name: str,
    *,
    aliases: tuple[str, ...] = (),
    override: bool = False,
    straight_through: bool = True,
    paper: str = "",
):
    """Decorator: register `fn(logps (B, T), ref_logps (B, T)) -> per-token KL (B, T)` under `name`, and (unless
    `straight_through=False`) its straight-through form under `name + "+"`: fn's value with k2's gradient."""

    def decorator(fn: KLEstimator) -> KLEstimator:
        KL_ESTIMATORS.register(name, fn, aliases=aliases, override=override, traits={PAPER: paper})
        if straight_through:
            forms = tuple(alias + STRAIGHT_THROUGH for alias in aliases)
            KL_ESTIMATORS.register(
                name + STRAIGHT_THROUGH,
                straight_through_form(fn),
                aliases=forms,
                override=override,
                traits={PAPER: paper},
            )
        return fn

    return decorator


def straight_through_form(estimator: KLEstimator) -> KLEstimator:
    """`estimator`'s value in the forward pass, k2's gradient in the backward pass (verl's "+" suffix)."""

    def straight_through(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
        backward = squared_log_ratio(logps, ref_logps)
        return backward - backward.detach() + estimator(logps, ref_logps).detach()

    value = (estimator.__doc__ or "").strip().splitlines()[0].split("  (")[0].rstrip(".")
    straight_through.__doc__ = f"{value} in value, gradient of k2 (straight-through)."
    return straight_through


def available_kl_estimators(with_aliases: bool = False) -> list[str]:
    """Names accepted by `kl_estimator`."""
    return KL_ESTIMATORS.names(with_aliases)


@register_kl_estimator("k1", aliases=("kl",), paper=KL_APPROX)
def log_ratio(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """kl = logp - ref  (k1: unbiased value, high variance, can be negative)."""
    return logps - ref_logps


@register_kl_estimator("k2", aliases=("mse",), straight_through=False, paper=KL_APPROX)
def squared_log_ratio(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """kl = (logp - ref)^2 / 2  (k2: low variance; its gradient is the reverse KL's)."""
    return 0.5 * (logps - ref_logps).square()


KL_ESTIMATORS.register("k2+", squared_log_ratio, aliases=("mse+",), traits={PAPER: KL_APPROX})  # k2 is its own "+"


@register_kl_estimator("k3", paper=KL_APPROX)
def exp_minus_one_minus_log(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """kl = exp(ref - logp) - (ref - logp) - 1  (k3: unbiased, >= 0; TRL's estimator, unclamped)."""
    return torch.exp(ref_logps - logps) - (ref_logps - logps) - 1


@register_kl_estimator("abs", paper=KL_APPROX)
def absolute_log_ratio(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """kl = |logp - ref|."""
    return (logps - ref_logps).abs()


@register_kl_estimator("low_var_kl", paper=KL_APPROX)
def clamped_k3(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """kl = clamp(exp(d) - d - 1, -10, 10), d = clamp(ref - logp, -20, 20)  (verl's k3 / low_var_kl)."""
    log_ratio_to_ref = torch.clamp(ref_logps - logps, min=-20, max=20)
    return torch.clamp(torch.exp(log_ratio_to_ref) - log_ratio_to_ref - 1, min=-10, max=10)


class AdaptiveKLController:
    """PPO's adaptive KL coefficient (Ziegler et al. 2019, https://arxiv.org/abs/1909.08593): after each step,
    beta *= 1 + clip(KL / target - 1, -0.2, 0.2) * n / horizon, n = completions in the step.

    Its state (the current coefficient) goes into checkpoints: `state_dict()` gives plain JSON values,
    `load_state_dict` restores them, `checkpoint_name` names the state in a checkpoint.
    """

    checkpoint_name = "adaptive_kl_controller"
    state_version = 1

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if not init_kl_coef > 0:
            raise ValueError(f"init_kl_coef must be > 0 (the coefficient moves by factors), got {init_kl_coef}.")
        if not target_kl > 0:
            raise ValueError(f"target_kl must be > 0, got {target_kl}.")
        if not horizon > 0:
            raise ValueError(f"horizon must be > 0, got {horizon}.")
        self.value, self.target, self.horizon = float(init_kl_coef), float(target_kl), horizon

    def update(self, current_kl: float, n_steps: int) -> float:
        """Move the coefficient toward the target after a step whose mean KL was `current_kl` over `n_steps`
        completions; returns the new coefficient."""
        proportional_error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict[str, Any]:
        return {"version": self.state_version, "value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("version") != self.state_version:
            found = state.get("version") if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                f"unknown adaptive KL controller state version {found!r} (expected {self.state_version})."
            )
        value = state.get("value")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"the saved KL coefficient must be a number > 0, found {value!r}.")
        self.value = float(value)
