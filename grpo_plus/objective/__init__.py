"""The GRPO objective as axes, one module each, one registry pattern (`grpo_plus.registry`), pure torch:

- `advantages`: advantage estimators (`advantage_estimator`) and reward scales (`scale_rewards`)
- `importance_sampling`: importance weights (`importance_sampling_level`)
- `policy_losses`: the per-token surrogate (`policy_loss`)
- `kl`: KL estimators (`kl_estimator`) and the adaptive KL coefficient
- `aggregation`: per-token loss -> micro-batch loss (`loss_type`)
- `loss`: `compute_policy_loss`, the axes composed
- `rollout_corr`: verl's rollout correction (`rollout_is`, `rollout_rs`): the sampler's log-probs against the
  trainer's -> truncated IS weights, a rejection mask, mismatch metrics

Nothing here imports the trainer, the config or TRL; any training loop can call `compute_advantages` and
`compute_policy_loss`.
"""

from .advantages import (
    ADVANTAGE_ESTIMATORS,
    ADVANTAGE_NORMALIZERS,
    AdvantageInputs,
    available_advantage_estimators,
    available_advantage_normalizers,
    combine_rewards,
    compute_advantages,
    register_advantage_estimator,
    register_advantage_normalizer,
)
from .aggregation import LOSS_TYPES, AggregationContext, available_loss_types, register_loss_type
from .common import PAPER, SPLIT_INVARIANT, ZERO_ADVANTAGE_ROWS_CONTRIBUTE_NOTHING, sequence_mean
from .importance_sampling import (
    IMPORTANCE_SAMPLERS,
    available_importance_sampling_levels,
    register_importance_sampling,
)
from .kl import KL_ESTIMATORS, AdaptiveKLController, available_kl_estimators, register_kl_estimator
from .loss import PolicyLossOutput, compute_policy_loss
from .policy_losses import (
    POLICY_LOSSES,
    ClipInputs,
    Option,
    PolicyLossContext,
    PolicyTerm,
    available_policy_losses,
    register_policy_loss,
)
from .rollout_corr import (
    REJECTION_CRITERIA,
    RolloutCorrection,
    available_rejection_criteria,
    register_rejection_criterion,
    rollout_correction,
)

# Every registry of the objective, in the order `grpo-plus list` shows them (the rejection criteria of `rollout_rs` are
# not a loss axis: grpo_plus.objective.rollout_corr holds them).
REGISTRIES = (
    ADVANTAGE_ESTIMATORS,
    ADVANTAGE_NORMALIZERS,
    POLICY_LOSSES,
    IMPORTANCE_SAMPLERS,
    KL_ESTIMATORS,
    LOSS_TYPES,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ADVANTAGE_NORMALIZERS",
    "IMPORTANCE_SAMPLERS",
    "KL_ESTIMATORS",
    "LOSS_TYPES",
    "PAPER",
    "POLICY_LOSSES",
    "REGISTRIES",
    "SPLIT_INVARIANT",
    "ZERO_ADVANTAGE_ROWS_CONTRIBUTE_NOTHING",
    "AdaptiveKLController",
    "AdvantageInputs",
    "AggregationContext",
    "ClipInputs",
    "Option",
    "PolicyLossContext",
    "PolicyLossOutput",
    "PolicyTerm",
    "REJECTION_CRITERIA",
    "RolloutCorrection",
    "available_advantage_estimators",
    "available_advantage_normalizers",
    "available_importance_sampling_levels",
    "available_kl_estimators",
    "available_loss_types",
    "available_policy_losses",
    "available_rejection_criteria",
    "combine_rewards",
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
    "sequence_mean",
]
