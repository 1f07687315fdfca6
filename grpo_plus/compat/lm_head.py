"""TRL's fused LM head (1.15+): its forward, the module that carries it, its tile width, who folds its tiles, its
call protocol (a forward sized per call), its chunked log-prob kernel."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from types import ModuleType

import torch
import trl.trainer.utils as trl_utils

from .common import attribute_set

__all__ = [
    "FUSED_LM_HEAD_COLUMNS",
    "LM_HEAD_TILE_FOLDS",
    "FusedForwardShape",
    "fused_lm_head_columns",
    "fused_lm_head_columns_default",
    "fused_lm_head_forward",
    "fused_lm_head_module",
    "has_fused_lm_head",
    "lm_head_folds_in_torch",
    "lm_head_kernel_patched",
    "size_fused_lm_head_tiles",
]


def fused_lm_head_forward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    shift_labels: torch.Tensor,
    **model_inputs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-position (log-prob of `shift_labels`, entropy) through TRL's fused LM head (TRL >= 1.15 patches the model
    so that `fused_lm_head=True` returns `.log_probs` / `.entropy` instead of logits; -100 labels score nothing).
    `attention_mask` may be a 4D mask, which the checked model families take as given. `model_inputs`: a VLM's
    images (`pixel_values`, ...), passed on."""
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        shift_labels=shift_labels,
        fused_lm_head=True,
        **model_inputs,
    )
    return out.log_probs, out.entropy


def has_fused_lm_head() -> bool:
    """True if TRL scores completions through its fused LM head (1.15+: `model(..., labels=..., fused_lm_head=True)`
    returns `.log_probs` / `.entropy`); False if it computes full logits (1.14). The zero-waste pass scores its
    packed shared-prompt rows through that head (`shift_labels=...`), so on 1.14 it recomputes prompts per row."""
    return hasattr(trl_utils, "add_fused_lm_head")


# TRL's fused LM head (1.15-1.16 `trl.trainer.utils.add_fused_lm_head`): its forward, `_fused_forward`, set on the model
# instance, reads the module global `_CHUNKED_LOGPROB_CHUNK_SIZE` (vocabulary columns per tile) at each call and hands it
# to `ChunkedLogProbFunction`, whose backward keeps the forward's width; `trl.kernels.chunked_logprob._use_triton(device)`
# says whether Triton folds the tiles (else torch does). grpo_plus.long_completions.lm_head_tiles sizes the tile through these.
FUSED_LM_HEAD_COLUMNS = "_CHUNKED_LOGPROB_CHUNK_SIZE"


def fused_lm_head_module(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module of `model` (itself or one under it, e.g. below PEFT) whose instance forward is TRL's fused LM head
    forward (possibly wrapped: a wrapper that keeps it as `.forward`), or None (TRL 1.14, or a model not patched)."""
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if _is_fused_lm_head_forward(forward) or _is_fused_lm_head_forward(getattr(forward, "forward", None)):
            return module
    return None


def _is_fused_lm_head_forward(forward) -> bool:
    code = getattr(getattr(forward, "__func__", None), "__code__", None)
    return code is not None and code.co_name == "_fused_forward" and code.co_filename == trl_utils.__file__


def fused_lm_head_columns_default() -> int:
    """TRL's vocabulary columns per LM-head tile (32,768 in 1.15-1.16)."""
    return getattr(trl_utils, FUSED_LM_HEAD_COLUMNS)


@contextmanager
def fused_lm_head_columns(columns: int) -> Iterator[None]:
    """TRL's fused LM head projects `columns` vocabulary columns per tile in the forwards started inside this block
    (and their backwards); a TRL without the fused LM head (1.14) has no tile, and nothing is set."""
    if not hasattr(trl_utils, FUSED_LM_HEAD_COLUMNS):
        yield
        return
    with attribute_set(trl_utils, FUSED_LM_HEAD_COLUMNS, columns):
        yield


def lm_head_folds_in_torch(device: torch.device) -> bool:
    """True where TRL's fused LM head folds its tiles with torch operators (no Triton for `device`: a CPU), which make
    float32 temporaries of the tile's size; False where a Triton kernel folds them (CUDA, XPU) and allocates nothing."""
    from trl.kernels import chunked_logprob

    use_triton = getattr(chunked_logprob, "_use_triton", None)
    if use_triton is None:  # TRL 1.15: the Triton kernel on every device (no torch fold; it runs on CUDA/XPU only)
        return False
    return not use_triton(device)


# ---- the fused forward, its tile width chosen per call ----------------------------------------------------------------


@dataclass(frozen=True)
class FusedForwardShape:
    """What one `fused_lm_head=True` forward scores: the head's `vocab` rows, `tokens` labelled positions, TRL's tile
    width `trl_columns`, and whether torch folds the tiles (`folds_in_torch`: no Triton for the head's device)."""

    vocab: int
    tokens: int
    trl_columns: int
    folds_in_torch: bool


def size_fused_lm_head_tiles(model: torch.nn.Module, columns_for: Callable[[FusedForwardShape], int]) -> bool:
    """Run each `fused_lm_head=True` forward of `model`'s fused LM head (the module carrying TRL's fused forward, on
    the model or under it, e.g. below PEFT) with `columns_for(shape)` vocabulary columns per tile (its backward keeps
    them); other forwards run as they are. False when no module carries that forward (TRL 1.14, or a model TRL did not
    patch). Calling it again replaces `columns_for`."""
    patched = fused_lm_head_module(model)
    if patched is None:
        return False
    current = patched.__dict__["forward"]
    if isinstance(current, _SizedTiles):
        current.columns_for = columns_for
        return True
    patched.forward = _SizedTiles(current, patched, columns_for)
    return True


class _SizedTiles:
    """TRL's fused forward (an instance attribute set by `add_fused_lm_head`), run with the tile width `columns_for`
    gives the forward's shape. TRL's protocol (1.15-1.16): the forward takes `fused_lm_head=True` and the labels as
    `shift_labels` (or `labels`), and reads the module global width when it starts."""

    def __init__(self, forward, module: torch.nn.Module, columns_for: Callable[[FusedForwardShape], int]):
        self.forward, self.module, self.columns_for = forward, module, columns_for
        functools.update_wrapper(self, forward)  # `generate` validates its model kwargs against the signature

    def __call__(self, *args, fused_lm_head: bool = False, **kwargs):
        if not fused_lm_head:
            return self.forward(*args, **kwargs)
        head = self.module.get_output_embeddings().weight
        vocab = getattr(head, "ds_shape", head.shape)[0]  # DeepSpeed ZeRO-3 partitions it: shape (0,) until gathered
        labels = kwargs.get("shift_labels", kwargs.get("labels"))
        tokens = labels.numel() if labels is not None else 0
        shape = FusedForwardShape(vocab, tokens, fused_lm_head_columns_default(), lm_head_folds_in_torch(head.device))
        with fused_lm_head_columns(self.columns_for(shape)):
            return self.forward(*args, fused_lm_head=True, **kwargs)


# ---- TRL's chunked log-prob kernel ------------------------------------------------------------------------------------
# `trl.kernels.chunked_logprob` (1.15-1.16): `ChunkedLogProbFunction`, an autograd Function whose forward and backward
# loop over [4096 x columns] tiles with the module's `range`, folding each tile with these helpers (a Triton kernel where
# there is one, torch operators elsewhere). grpo_plus.fit counts a pass through it on fake tensors.
LM_HEAD_TILE_FOLDS = ("_forward_tile", "_backward_tile", "_addmm_fp32")


@contextmanager
def lm_head_kernel_patched(
    each_step: Callable[[ModuleType], AbstractContextManager], fold: Callable | None = None
) -> Iterator[bool]:
    """Within the block, every forward and backward of TRL's chunked log-prob kernel runs inside `each_step(kernel
    module)`, and with `fold` each tile fold (`LM_HEAD_TILE_FOLDS`) is `fold` instead; restored on exit. Yields False
    (nothing patched) on a TRL without the kernel (1.14)."""
    try:
        from trl.kernels import chunked_logprob
    except ImportError:  # TRL 1.14: no fused LM head
        yield False
        return
    function = chunked_logprob.ChunkedLogProbFunction
    forward, backward = function.forward, function.backward

    def wrapped(step):
        def run(ctx, *args, **kwargs):
            with each_step(chunked_logprob):
                return step(ctx, *args, **kwargs)

        return staticmethod(run)

    with ExitStack() as stack:
        if fold is not None:
            for name in LM_HEAD_TILE_FOLDS:
                stack.enter_context(attribute_set(chunked_logprob, name, fold))
        function.forward, function.backward = wrapped(forward), wrapped(backward)
        try:
            yield True
        finally:
            function.forward, function.backward = staticmethod(forward), staticmethod(backward)
