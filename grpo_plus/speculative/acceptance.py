"""Verification: which drafted tokens a row keeps, and the token that follows them, so that every token is
distributed exactly as decoding one token per forward would draw it.

Speculative sampling against a point-mass draft (a token proposed from text, not from a draft model's distribution
q): with q = 1 at the drafted token d, standard speculative sampling accepts d with probability min(1, p(d) / q(d)) =
p(d), and on rejection draws from max(0, p - q) renormalized, which is p with d removed and renormalized. The token at
that position is then d with probability p(d) and x != d with probability (1 - p(d)) * p(x) / (1 - p(d)) = p(x): p
itself. The next position is only looked at if d was kept, with d in its prefix, as one-token decoding would. When a
row keeps all its drafts, one more token is drawn from p at the position after them (the bonus). Greedy decoding keeps
d iff d is the argmax, and picks the argmax after the last kept draft: the tokens greedy decoding picks.

Pure torch. `p` is the processed distribution: the logits after the logits processors and warpers transformers builds
from the generation config (temperature, top_k, top_p, min_p, repetition penalty, ...), each position processed with
its own prefix (grpo_plus.speculative.decoding).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# (probability of each drafted token under p (n, m), uniforms in [0, 1) (n, m)) -> (n, m) bool: whether kept.
AcceptanceRule = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def point_mass_acceptance(draft_probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Speculative sampling's rule for a point-mass draft: keep d with probability p(d)."""
    return uniforms < draft_probs


def verify(
    scores: torch.Tensor,
    drafts: torch.Tensor,
    draft_lengths: torch.Tensor,
    do_sample: bool,
    accept: AcceptanceRule = point_mass_acceptance,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept (n,): how many leading drafts each row keeps, next_tokens (n,): the token after them).

    `scores` (n, m + 1, V): processed scores, position j predicting the token after j drafts; `drafts` (n, m), of
    which the first `draft_lengths[i]` of row i are real. Draws from torch's global generator."""
    count, width = drafts.shape
    positions = torch.arange(width, device=drafts.device)
    proposed = positions < draft_lengths[:, None]
    if do_sample:
        probs = torch.softmax(scores, dim=-1)
        draft_probs = probs[:, :width].gather(-1, drafts[..., None]).squeeze(-1)
        kept_each = accept(draft_probs, torch.rand(draft_probs.shape, device=scores.device))
    else:
        kept_each = drafts == scores[:, :width].argmax(-1)
    kept = (kept_each & proposed).long().cumprod(dim=1).sum(dim=1)
    rows = torch.arange(count, device=drafts.device)
    if not do_sample:
        return kept, scores[rows, kept].argmax(-1)
    last = probs[rows, kept]
    rejected = (kept < draft_lengths).nonzero().squeeze(1)
    if len(rejected):
        refused = drafts[rejected, kept[rejected]]
        residual = last[rejected].index_put(
            (torch.arange(len(rejected), device=last.device), refused), last.new_zeros(())
        )
        # p(d) < 1 was drawn against, so mass is left elsewhere; in float it may round to none: d then stays p's draw
        empty = residual.sum(-1) <= 0
        residual[empty, refused[empty]] = 1.0
        last = last.index_copy(0, rejected, residual)
    return kept, torch.multinomial(last, num_samples=1).squeeze(1)
