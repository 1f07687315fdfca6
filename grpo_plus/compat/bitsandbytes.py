"""bitsandbytes on CPU: keep 4-bit layers trainable, and keep its optional-kernel notice out of the console.

bitsandbytes 0.49+ repacks a Linear4bit weight into a faster CPU inference layout the first time the layer runs in
eval mode without grad (e.g. a held-out evaluation). Its kernel for that layout has no autograd, so every later
training forward silently drops the gradient through the frozen 4-bit base: LoRA layers below it get wrong
gradients. `keep_4bit_trainable_on_cpu` undoes the repacking and switches it off for the model's lifetime.

On CPUs with AVX512-BF16, importing bitsandbytes logs "Failed to load CPU gemm_4bit_forward from kernels-community"
unless the optional `kernels` package (which fetches that kernel from the Hub) is installed. peft imports bitsandbytes
whenever it is installed, so every TRL run printed it, 4-bit or not. 4-bit CPU training works without that kernel;
`hide_bitsandbytes_kernel_notice` (called by `import grpo_plus`) drops exactly that one message.
"""

from __future__ import annotations

import logging
import sys

import torch

logger = logging.getLogger(__name__)

_KERNEL_NOTICE_LOGGER = "bitsandbytes.backends.cpu.ops"
_KERNEL_NOTICE = "gemm_4bit_forward from kernels-community"


class _WithoutKernelNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _KERNEL_NOTICE not in record.getMessage()


def hide_bitsandbytes_kernel_notice() -> None:
    """Drop bitsandbytes' import-time notice about its optional Hub kernel (only that message, nothing else).

    Works for imports of bitsandbytes that come later (logging filters attach to the logger by name).
    """
    notice_logger = logging.getLogger(_KERNEL_NOTICE_LOGGER)
    if not any(isinstance(f, _WithoutKernelNotice) for f in notice_logger.filters):
        notice_logger.addFilter(_WithoutKernelNotice())


def keep_4bit_trainable_on_cpu(model: torch.nn.Module) -> int:
    """Unpack CPU-inference-packed 4-bit weights and disable the repacking; returns how many layers were unpacked."""
    if "bitsandbytes" not in sys.modules:  # no 4-bit layer can exist; do not import bitsandbytes just to look
        return 0
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
