"""Old path of the policy-loss core, kept so `from grpo_plus.losses import ...` goes on working.

The objective now lives in `grpo_plus.objective`, one module per axis (importance sampling, policy losses, KL,
aggregation, and `loss` composing them); this module re-exports what `grpo_plus.losses` exported, the same objects.
"""

from .objective.aggregation import CONTEXT_FIELDS as _CONTEXT_FIELDS  # noqa: F401
from .objective.aggregation import LOSS_TYPES, AggregationContext, available_loss_types, register_loss_type
from .objective.common import ZERO_ADVANTAGE_ROWS_CONTRIBUTE_NOTHING, sequence_mean
from .objective.importance_sampling import (
    IMPORTANCE_SAMPLERS,
    available_importance_sampling_levels,
    register_importance_sampling,
)
from .objective.loss import PolicyLossOutput, _check_inputs, _check_settings, _is_binary, compute_policy_loss  # noqa: F401
from .objective.policy_losses import ClipInputs  # noqa: F401

__all__ = [
    "AggregationContext",
    "IMPORTANCE_SAMPLERS",
    "LOSS_TYPES",
    "PolicyLossOutput",
    "ZERO_ADVANTAGE_ROWS_CONTRIBUTE_NOTHING",
    "compute_policy_loss",
    "register_loss_type",
    "register_importance_sampling",
    "available_loss_types",
    "available_importance_sampling_levels",
    "sequence_mean",
]
