"""Activation offloading in the training pass: what autograd keeps for backward lives in host memory until backward.

`GRPOConfig.activation_offloading` has the name and meaning of TRL's `SFTConfig.activation_offloading`, and runs TRL's
own implementation (`trl.models.activation_offloading`, from torchtune): a `saved_tensors_hooks` context that copies
every tensor autograd saves (above 1 KiB, not a weight) to pinned host memory on a side CUDA stream while the forward
goes on, and brings it back, again on the side stream, when backward reaches the operator that needs it. TRL wraps
SFT's / DPO's `training_step` in it; grpo_plus wraps GRPO's the same way. Under gradient checkpointing the saved
tensors are the checkpoints (each decoder layer's input), so the device keeps one layer's activations at a time
instead of one per layer; without checkpointing every activation moves.

Exact: it moves tensors and moves them back bit for bit, so the gradient is the one without it
(tests/test_long_completions.py). On a CPU there is nothing to move (the tensors already live in host memory): the
setting does nothing there and says so once.
"""

from __future__ import annotations

import contextlib
import logging

import torch

logger = logging.getLogger(__name__)


def offloading_context(
    model: torch.nn.Module, device: torch.device | str, pin_memory: bool = True
) -> contextlib.AbstractContextManager:
    """TRL's activation-offloading context for `model` on `device` (an accelerator), as TRL's SFTTrainer builds it:
    pinned host memory (`pin_memory`), a side stream, the output head left on the device."""
    from trl.models.activation_offloading import get_act_offloading_ctx_manager

    if torch.device(device).type == "cpu":
        raise ValueError(
            "activation offloading moves tensors from an accelerator to the CPU; this model is on the CPU"
        )
    return get_act_offloading_ctx_manager(model=model, use_pin_memory=pin_memory, warn_if_no_head=False)


def training_step_context(
    model: torch.nn.Module, device: torch.device, enabled: bool
) -> contextlib.AbstractContextManager:
    """The context a trainer enters around each training step: TRL's offloading when `enabled` on an accelerator,
    else nothing (on a CPU with a note, once)."""
    if not enabled:
        return contextlib.nullcontext()
    if torch.device(device).type == "cpu":
        logger.warning(
            "activation_offloading=True: the model trains on the CPU, where activations already live in host memory; "
            "nothing is offloaded."
        )
        return contextlib.nullcontext()
    return offloading_context(model, device)
