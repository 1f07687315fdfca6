"""Multi-turn generation without re-prefilling: each row's keys/values kept from one tool turn to the next.

TRL's tool loop (`_tool_call_loop`) generates a turn, runs the tools the completions called, and calls
`_generate_single_turn` again on prompt + completion + tool output (token ids concatenated, never re-rendered) for
every row that called a tool. `model.generate` then prefills that whole history again, turn after turn: the prompt
and everything before the tool output are computed once per turn.

Within one rollout the weights do not change, and in a causal decoder the key/value at position j depends only on
the tokens 0..j (positions are counted over real tokens, so left padding does not move them). `TurnCache` keeps, for
every row a `generate` call produced, the keys/values its cache holds and the tokens they belong to. The next call
looks up, for each of its rows, the kept row sharing the longest token prefix with it, and fills the cache with those
keys/values before the prefill, which then computes only the columns no row has kept: the tool output and the next
turn's template tokens (plus the last token of the previous turn, which was sampled but never fed).

The batch keeps TRL's layout exactly (the same left padding, attention mask and position ids as TRL's fresh prefill):
the filled columns sit where TRL's prefill would put them. Columns to the left of a row's first token are padding,
masked as in TRL, and filled with zeros. A row whose history does not extend a kept row (another template rendering,
a history TRL truncated) shares a shorter prefix, or none, and its other columns are computed: the reuse never
depends on how TRL builds the next turn's ids, only on the ids themselves.

Exactness: the kept keys/values were computed incrementally (one decode step at a time) where TRL computes them in
one batched prefill; a matrix multiply over other shapes can round differently, so logits may differ by float noise
(measured in tests/test_multi_turn.py and docs/guide/agentic.md), and a sampled token changes only if that noise
flips a near-tie.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer


@dataclass
class KeptRow:
    """One row's cache after a `generate` call: its real tokens and, per layer, their keys and values."""

    tokens: torch.Tensor  # (n,) on the CPU
    keys: list[torch.Tensor]  # per layer (heads, n, head_dim)
    values: list[torch.Tensor]

    @property
    def length(self) -> int:
        return len(self.tokens)


class TurnCache:
    """The keys/values of the rows of the last `generate` call of one generation round, for the next call to reuse.

    Open it for one round of TRL's generation (weights fixed) and drop it after: kept keys/values are only valid for
    the weights that computed them.
    """

    def __init__(self) -> None:
        self._current: list[KeptRow] = []  # the rows of the last (or the running) call: what the next call reuses
        self.blocker: str | None = None  # why nothing could be kept (the next turns prefill whole histories)

    def keep(self, cache: Cache, cache_rows: torch.Tensor, sequences: torch.Tensor, mask: torch.Tensor | None):
        """Keep rows `cache_rows` of `cache`. `sequences` (len(cache_rows), >= C) are their token ids, of which the
        first C (the cache length) are in the cache; `mask` (len(cache_rows), >= C) their attention mask, or None."""
        self.blocker = keep_blocker(cache)
        if self.blocker is not None:
            return
        width = cache.get_seq_length()
        real = torch.ones(sequences.shape[0], width, dtype=torch.bool) if mask is None else mask[:, :width].bool()
        real, tokens = real.cpu(), sequences[:, :width].cpu()
        layers = [
            (layer.keys.index_select(0, cache_rows), layer.values.index_select(0, cache_rows))
            for layer in cache.layers
        ]
        for i in range(len(cache_rows)):
            columns = real[i].nonzero().squeeze(1).to(layers[0][0].device)
            self._current.append(
                KeptRow(
                    tokens=tokens[i][real[i]],
                    keys=[keys[i].index_select(1, columns) for keys, _ in layers],
                    values=[values[i].index_select(1, columns) for _, values in layers],
                )
            )

    def restore(self, cache: Cache, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> int:
        """Fill the empty `cache` with kept keys/values for the leading columns of the left-padded batch
        (`input_ids`, `attention_mask`) that every row has kept; return how many columns it filled (0: none).

        Starts a new call: the rows kept from now on are the ones the next call reuses."""
        kept, self._current = self._current, []
        if not kept or any(_has_keys(layer) for layer in cache.layers):
            return 0
        batch_size, width = input_ids.shape
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        mask, ids = mask.cpu(), input_ids.cpu()
        lengths = mask.sum(dim=1)
        padding = width - lengths
        if not bool((mask == (torch.arange(width) >= padding[:, None])).all()):
            return 0  # not left-padded: the kept columns would not line up
        sources, shared = _longest_shared_prefixes(kept, [ids[i, padding[i] :] for i in range(batch_size)])
        shared = torch.minimum(shared, lengths - 1)  # the last token is always fed: its logits start the decode
        filled = width - int((lengths - shared).max())
        if filled <= 0:
            return 0
        example = kept[0].keys[0]
        for layer in range(len(kept[0].keys)):
            keys = example.new_zeros((batch_size, *kept[0].keys[layer].shape[:1], filled, example.shape[-1]))
            values = torch.zeros_like(keys)
            for row in range(batch_size):
                start = int(padding[row])
                if start < filled:
                    source = kept[int(sources[row])]
                    keys[row, :, start:filled] = source.keys[layer][:, : filled - start]
                    values[row, :, start:filled] = source.values[layer][:, : filled - start]
            cache.update(keys, values, layer)
        return filled


def keep_blocker(cache: Cache) -> str | None:
    """Why `cache`'s rows cannot be kept for the next turn, or None. Every layer must hold every position's
    keys/values: full-attention layers do, a sliding-window layer until the sequence outgrows its window; a quantized
    or linear-attention layer holds something else."""
    if not cache.layers or not all(_has_keys(layer) for layer in cache.layers):
        return "some cache layer holds no keys/values of its own (shared across layers)"
    others = sorted({type(layer).__name__ for layer in cache.layers if not _holds_every_position(layer)})
    if others:
        return f"the model's cache has {', '.join(others)} layers, which do not hold every position's keys/values"
    return None


def _holds_every_position(layer) -> bool:
    if type(layer) is DynamicSlidingWindowLayer:  # it drops the oldest positions once the window is full
        return layer.keys.shape[-2] == layer.cumulative_length
    return type(layer) is DynamicLayer


def _has_keys(layer) -> bool:
    return bool(getattr(layer, "is_initialized", False)) and layer.keys is not None and layer.keys.numel() > 0


def _longest_shared_prefixes(kept: list[KeptRow], rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """For each row, (the kept row sharing the longest token prefix with it (the first of ties), that length)."""
    longest = max(max(row.length for row in kept), max(len(row) for row in rows))
    table = torch.full((len(kept), longest), -1, dtype=torch.long)
    for i, row in enumerate(kept):
        table[i, : row.length] = row.tokens
    sources, shared = [], []
    for row in rows:
        same = table[:, : len(row)] == row  # (kept, len(row))
        prefix = same.cumprod(dim=1).sum(dim=1)
        best = int(prefix.argmax())
        sources.append(best)
        shared.append(int(prefix[best]))
    return torch.tensor(sources), torch.tensor(shared)
