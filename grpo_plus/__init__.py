"""grpo_plus: pluggable GRPO objectives on top of TRL's GRPOTrainer.

The core (`grpo_plus.objective`: advantages, policy losses, KL, aggregation, rollout correction) imports only
torch; the trainer and config are loaded lazily so `import grpo_plus` stays light. The demo kit the recipes use (task,
embedded model, Hub push, plots, the `grpo-plus` command) is `grpo_plus.app`, which the library never imports.
"""

from .compat.bitsandbytes import hide_bitsandbytes_kernel_notice
from .objective import (
    AdaptiveKLController,
    AggregationContext,
    PolicyLossOutput,
    available_advantage_estimators,
    available_advantage_normalizers,
    available_importance_sampling_levels,
    available_kl_estimators,
    available_loss_types,
    available_policy_losses,
    available_rejection_criteria,
    compute_advantages,
    compute_policy_loss,
    register_advantage_estimator,
    register_advantage_normalizer,
    register_importance_sampling,
    register_kl_estimator,
    register_loss_type,
    register_policy_loss,
    register_rejection_criterion,
    rollout_correction,
)

__version__ = "0.1.0"

# Before trl/peft import bitsandbytes: its notice about an optional Hub kernel is noise on every run (see compat.bitsandbytes).
hide_bitsandbytes_kernel_notice()

_LAZY = {"GRPOConfig": ".config", "GRPOTrainer": ".trainer"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'grpo_plus' has no attribute {name!r}")


__all__ = [
    "AdaptiveKLController",
    "AggregationContext",
    "GRPOConfig",
    "GRPOTrainer",
    "PolicyLossOutput",
    "available_advantage_estimators",
    "available_advantage_normalizers",
    "available_importance_sampling_levels",
    "available_kl_estimators",
    "available_loss_types",
    "available_policy_losses",
    "available_rejection_criteria",
    "compute_advantages",
    "compute_policy_loss",
    "register_advantage_estimator",
    "register_advantage_normalizer",
    "register_importance_sampling",
    "register_kl_estimator",
    "register_loss_type",
    "register_policy_loss",
    "register_rejection_criterion",
    "rollout_correction",
]
