"""Differences between the TRL versions grpo_plus supports, in one place."""

from __future__ import annotations

import trl.trainer.utils

# TRL >= 1.15 patches the policy with a fused LM head: `model(..., shift_labels=..., fused_lm_head=True)` returns
# per-token log-probs (and entropies) without materializing logits. The shared-prompt forward scores packed rows
# through it; TRL 1.14 computes full logits inside `_get_per_token_logps_and_entropies` instead.
HAS_FUSED_LM_HEAD = hasattr(trl.trainer.utils, "add_fused_lm_head")
