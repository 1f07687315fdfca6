"""TRL's fused LM head (1.15+): its forward, the module that carries it, its tile width, who folds its tiles."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import trl.trainer.utils as trl_utils

from .common import attribute_set

__all__ = [
    "FUSED_LM_HEAD_COLUMNS",
    "fused_lm_head_columns",
    "fused_lm_head_columns_default",
    "fused_lm_head_forward",
    "fused_lm_head_module",
    "has_fused_lm_head",
    "lm_head_folds_in_torch",
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
    (and their backwards)."""
    with attribute_set(trl_utils, FUSED_LM_HEAD_COLUMNS, columns):
        yield


def lm_head_folds_in_torch(device: torch.device) -> bool:
    """True where TRL's fused LM head folds its tiles with torch operators (no Triton for `device`: a CPU), which make
    float32 temporaries of the tile's size; False where a Triton kernel folds them (CUDA, XPU) and allocates nothing."""
    from trl.kernels import chunked_logprob

    return not chunked_logprob._use_triton(device)
