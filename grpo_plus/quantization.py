"""Keep bitsandbytes 4-bit layers trainable on CPU.

bitsandbytes 0.49+ repacks a Linear4bit weight into a faster CPU inference layout the first time the layer runs in
eval mode without grad (e.g. a held-out evaluation). Its kernel for that layout has no autograd, so every later
training forward silently drops the gradient through the frozen 4-bit base: LoRA layers below it get wrong
gradients. `keep_4bit_trainable_on_cpu` undoes the repacking and switches it off for the model's lifetime.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def keep_4bit_trainable_on_cpu(model: torch.nn.Module) -> int:
    """Unpack CPU-inference-packed 4-bit weights and disable the repacking; returns how many layers were unpacked."""
    try:
        from bitsandbytes.nn import Linear4bit
        from bitsandbytes.nn.modules import _convert_weight_packed_for_cpu_inverse
    except ImportError:  # no bitsandbytes, or a version without the CPU repacking
        return 0
    unpacked = 0
    for module in model.modules():
        if not isinstance(module, Linear4bit):
            continue
        module.support_avx512bf16_for_cpu = False
        weight = module.weight
        if getattr(getattr(weight, "quant_state", None), "packing_format_for_cpu", False):
            weight.data, weight.quant_state = _convert_weight_packed_for_cpu_inverse(weight.data, weight.quant_state)
            unpacked += 1
    if unpacked:
        logger.info("Restored %d 4-bit layers from bitsandbytes' CPU inference layout for training.", unpacked)
    return unpacked
