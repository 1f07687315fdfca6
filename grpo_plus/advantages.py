"""Old path of the advantage core, kept so `from grpo_plus.advantages import ...` goes on working.

Advantages now live in `grpo_plus.objective.advantages` (estimators and reward scales); this module re-exports what
`grpo_plus.advantages` exported, the same objects.
"""

from .objective.advantages import (
    ADVANTAGE_NORMALIZERS,
    available_advantage_normalizers,
    center_only,
    combine_rewards,
    compute_advantages,
    group_baseline,
    register_advantage_normalizer,
    scale_by_batch_std,
    scale_by_group_std,
)
from .objective.common import exact_nanmean, nanstd

__all__ = [
    "ADVANTAGE_NORMALIZERS",
    "available_advantage_normalizers",
    "center_only",
    "combine_rewards",
    "compute_advantages",
    "exact_nanmean",
    "group_baseline",
    "nanstd",
    "register_advantage_normalizer",
    "scale_by_batch_std",
    "scale_by_group_std",
]
