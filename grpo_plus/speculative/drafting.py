"""Drafts without a draft model: each unfinished completion proposes the tokens that followed its last n tokens where
they occur in its group's text (the prompt, its own completion so far, its siblings' completions so far).

Pure torch. The rows' text lives in one (B, W) buffer: a row's real tokens are the columns `start[r]:end[r]` (the
prompt after its left padding, then the completion so far); the rest is padding, which never matches.
"""

from __future__ import annotations

import torch

NO_TOKEN = -1  # what a padding column holds for matching: no token id equals it


def ngram_drafts(
    sequences: torch.Tensor,
    start: torch.Tensor,
    end: torch.Tensor,
    rows: torch.Tensor,
    group_of_row: torch.Tensor,
    budget: torch.Tensor,
    ngram_max: int,
    ngram_min: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(drafts (len(rows), max(lengths)) long, lengths (len(rows),)): for each row of `rows`, the tokens that follow
    the longest n-gram (ngram_max down to ngram_min) ending its text that also occurs in its group's text (the rows
    with the same `group_of_row`, finished ones included) with at least one token after it, at most `budget[i]` of
    them. Among the matches of that length, the latest (nearest to where the row is: a sibling at the same point of
    the same text), then the first row in batch order is taken. A row with no match (or no budget) drafts nothing (length 0)."""
    device = sequences.device
    count = len(rows)
    columns = torch.arange(sequences.shape[1], device=device)
    real = (columns >= start[:, None]) & (columns < end[:, None])
    text = torch.where(real, sequences, torch.full_like(sequences, NO_TOKEN))
    best_source = torch.zeros(count, dtype=torch.long, device=device)
    best_from = torch.zeros(count, dtype=torch.long, device=device)
    lengths = torch.zeros(count, dtype=torch.long, device=device)
    for group in torch.unique(group_of_row[rows]).tolist():
        members = (group_of_row == group).nonzero().squeeze(1)  # the group's rows: the sources
        asking = (group_of_row[rows] == group).nonzero().squeeze(1)  # positions in `rows` of its unfinished rows
        sources, source_end = text[members], end[members]
        for n in range(ngram_max, ngram_min - 1, -1):
            waiting = asking[(lengths[asking] == 0) & (budget[asking] > 0)]
            if len(waiting) == 0 or n > sources.shape[1] - 1:
                continue
            asker = rows[waiting]
            offsets = end[asker, None] - n + torch.arange(n, device=device)
            suffix = text[asker[:, None], offsets.clamp(min=0)]  # (a, n): each asking row's last n tokens
            whole = (offsets >= 0).all(1) & (suffix != NO_TOKEN).all(1)
            windows = sources.unfold(1, n, 1)  # (G, W - n + 1, n)
            match = (windows[None] == suffix[:, None, None, :]).all(-1) & whole[:, None, None]  # (a, G, W - n + 1)
            follows = source_end[None, :, None] - n - torch.arange(windows.shape[1], device=device)  # tokens after
            usable = torch.minimum(follows, budget[waiting][:, None, None])
            # the latest match (the text nearest to where the row is), then the first source in batch order
            score = torch.where(match & (follows > 0), torch.arange(windows.shape[1], device=device), -1)
            top, where = score.flatten(1).max(1)
            found = top >= 0
            positions, where = waiting[found], where[found]
            source, at = where // windows.shape[1], where % windows.shape[1]
            best_source[positions] = members[source]
            best_from[positions] = at + n
            lengths[positions] = usable[found.nonzero().squeeze(1), source, at]
    width = int(lengths.max()) if count else 0
    offsets = best_from[:, None] + torch.arange(width, device=device)
    drafts = sequences[best_source[:, None], offsets.clamp(max=sequences.shape[1] - 1)]
    drafts = torch.where(torch.arange(width, device=device) < lengths[:, None], drafts, 0)
    return drafts, lengths
