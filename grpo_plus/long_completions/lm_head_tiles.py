"""The LM head's tile: how many vocabulary columns TRL's fused LM head projects at a time, sized from the vocabulary and
the tokens of each forward.

TRL (>= 1.15, `trl.kernels.chunked_logprob`) scores completions without materializing the logits: it projects
[min(tokens, 4096) x columns] tiles of them into one buffer, `columns` being TRL's module-global tile width (32,768;
`grpo_plus.compat.lm_head.FUSED_LM_HEAD_COLUMNS`) whatever the vocabulary, and folds each tile into running log-sum-exp statistics,
in forward and again in backward. Where Triton folds the tile (CUDA, XPU) the buffer is all it allocates; where it does
not (a CPU), the fold runs in torch and makes float32 temporaries of the tile's size (the scaled logits, their
exponentials, the entropy's product: ~5 of them), which at 4,096 tokens and a 32,000-token vocabulary are the largest
tensors of the pass (2.5 GB).

`lm_head_tile_columns="auto"` (the default):
- never more columns than the vocabulary has: a model whose vocabulary is narrower than TRL's tile gets a buffer of
  its width (the same single tile: the same numbers, bit for bit);
- where the fold runs in torch and a forward scores more than `AUTO_MIN_TOKENS` positions (the tiled MLP's threshold:
  a long micro-batch), tiles of `AUTO_TILE_COLUMNS` columns: the fold's temporaries ~8x smaller at a 32,000-token
  vocabulary. The same log-probs and gradient up to float rounding (the log-sum-exp is folded over more, narrower
  tiles, and the gradients of the tiles are added in another grouping). Said once in the log.
Where Triton folds the tiles, "auto" keeps TRL's width above the vocabulary's (a narrower tile would cost kernel
launches that have not been timed on a GPU here). None: TRL's width as it is; an integer: that many columns per tile.

Applied to each forward of the policy that asks for the fused head (`fused_lm_head=True`): TRL reads the width when
the forward starts and keeps it for the backward. How that forward is wrapped and the width handed to TRL (TRL's
private protocol) is `grpo_plus.compat.lm_head`'s; this module decides the width.
"""

from __future__ import annotations

import functools
import logging

import torch

from ..compat import lm_head as trl_lm_head
from .tiled_mlp import AUTO_MIN_TOKENS  # the tiled MLP's "auto" threshold: a long micro-batch

logger = logging.getLogger(__name__)

AUTO_TILE_COLUMNS = 4096  # the tile of lm_head_tile_columns="auto" (its default: long_completions/settings.py)


def check_setting(setting: int | str | None) -> int | str | None:
    """`setting` as the value it names ("4096" and "none" as a command line or YAML string gives them); raises
    ValueError naming what is allowed."""
    if isinstance(setting, str) and setting.strip().isdigit():
        setting = int(setting)
    elif isinstance(setting, str) and setting.strip().lower() == "none":
        setting = None
    if (
        setting is None
        or setting == "auto"
        or (isinstance(setting, int) and not isinstance(setting, bool) and setting >= 1)
    ):
        return setting
    raise ValueError(
        f"lm_head_tile_columns={setting!r} is not allowed: it must be 'auto', a positive number of vocabulary columns "
        "or None (TRL's tile)"
    )


def tile_columns(setting: int | str | None, vocab: int, tokens: int, trl_columns: int, folds_in_torch: bool) -> int:
    """Vocabulary columns per LM-head tile for a forward scoring `tokens` positions (module docstring)."""
    if setting is None:
        return trl_columns
    if setting != "auto":
        return int(setting)
    columns = min(trl_columns, vocab)
    if folds_in_torch and tokens > AUTO_MIN_TOKENS:
        columns = min(columns, AUTO_TILE_COLUMNS)
    return columns


_noted: set[int] = set()


def note_auto_once(tokens: int, trl_columns: int, vocab: int, columns: int) -> None:
    """Say once per process that the default narrowed TRL's LM-head tile, and why."""
    if columns not in _noted:
        _noted.add(columns)
        logger.warning(
            "lm_head_tile_columns='auto': a forward scoring %d positions (> %d) where the LM head's tiles are folded "
            "in torch (no Triton) projects %d vocabulary columns at a time instead of TRL's %d (the fold's float32 "
            "temporaries ~%.1fx smaller; same log-probs up to float rounding). lm_head_tile_columns=None keeps TRL's "
            "tile, an integer sets it.",
            tokens, AUTO_MIN_TOKENS, columns, trl_columns, min(trl_columns, vocab) / columns,
        )  # fmt: skip


def size_lm_head_tiles(model: torch.nn.Module, setting: int | str | None) -> bool:
    """Size the tiles of `model`'s fused LM head (TRL's `add_fused_lm_head` forward, on the model or a module under it,
    e.g. below PEFT) by `setting` at each `fused_lm_head=True` forward; False when no module has that forward (TRL 1.14,
    or a model TRL did not patch). Calling it again changes the setting. TRL's call protocol is
    `trl_lm_head.size_fused_lm_head_tiles`'s; the width is decided here (`columns_for`)."""
    return trl_lm_head.size_fused_lm_head_tiles(model, functools.partial(columns_for, check_setting(setting)))


def columns_for(setting: int | str | None, shape: trl_lm_head.FusedForwardShape) -> int:
    """The tile width of one fused forward of `shape` under `setting` (`tile_columns`), said once where "auto"
    narrowed TRL's tile."""
    columns = tile_columns(setting, shape.vocab, shape.tokens, shape.trl_columns, shape.folds_in_torch)
    if setting == "auto" and columns < min(shape.trl_columns, shape.vocab):
        note_auto_once(shape.tokens, shape.trl_columns, shape.vocab, columns)
    return columns
