"""The LM head's tile: how many vocabulary columns TRL's fused LM head projects at a time, sized from the vocabulary and
the tokens of each forward.

TRL (>= 1.15, `trl.kernels.chunked_logprob`) scores completions without materializing the logits: it projects
[min(tokens, 4096) x columns] tiles of them into one buffer, `columns` being `trl.trainer.utils.
_CHUNKED_LOGPROB_CHUNK_SIZE` (32,768) whatever the vocabulary, and folds each tile into running log-sum-exp statistics,
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
the forward starts and keeps it for the backward (`trl_lm_head.fused_lm_head_columns`).
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
    or a model TRL did not patch). Calling it again changes the setting."""
    setting = check_setting(setting)
    patched = trl_lm_head.fused_lm_head_module(model)
    if patched is None:
        return False
    current = patched.__dict__["forward"]
    if isinstance(current, _SizedTiles):
        current.setting = setting
        return True
    patched.forward = _SizedTiles(current, patched, setting)
    return True


class _SizedTiles:
    """The fused forward, run with the tile width `tile_columns` gives for the forward's vocabulary and tokens."""

    def __init__(self, forward, module: torch.nn.Module, setting: int | str | None):
        self.forward, self.module, self.setting = forward, module, setting
        functools.update_wrapper(self, forward)  # `generate` validates its model kwargs against the signature

    def __call__(self, *args, fused_lm_head: bool = False, **kwargs):
        if not fused_lm_head:
            return self.forward(*args, **kwargs)
        head = self.module.get_output_embeddings().weight
        vocab = getattr(head, "ds_shape", head.shape)[0]  # DeepSpeed ZeRO-3 partitions it: shape (0,) until gathered
        labels = kwargs.get("shift_labels", kwargs.get("labels"))
        tokens = labels.numel() if labels is not None else 0
        trl_columns = trl_lm_head.fused_lm_head_columns_default()
        folds_in_torch = trl_lm_head.lm_head_folds_in_torch(head.device)
        columns = tile_columns(self.setting, vocab, tokens, trl_columns, folds_in_torch)
        if self.setting == "auto" and columns < min(trl_columns, vocab):
            note_auto_once(tokens, trl_columns, vocab, columns)
        with trl_lm_head.fused_lm_head_columns(columns):
            return self.forward(*args, fused_lm_head=True, **kwargs)
