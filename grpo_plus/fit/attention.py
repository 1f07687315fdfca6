"""Which scaled-dot-product attention kernel a count runs on the stand-in accelerator: the one CUDA would pick
(`CudaAttentionKernels`, what `grpo-plus fit` and the trainer's check count), or the one a CPU runs
(`CpuAttentionKernels`, what a count checked against a CPU's real peak counts: benchmarks/memory_real.py).

torch chooses the kernel in C++ per device type, and the stand-in (`grpo_plus.compat.torch.fake_accelerator`) has no
say there: without these, every attention on it would take the math path and materialize every [query x key] score.
On an H100 torch takes the flash kernel (no mask, fp16/bf16, head dim <= 256), else the memory-efficient one (no
grouped-query heads), else the math path; on a CPU its flash kernel for CPUs (any float dtype, a mask as is).
"""

from __future__ import annotations

import functools

import torch

from ..compat.torch import FAKE_ACCELERATOR, TorchDispatchMode, no_dispatch_modes


class CudaAttentionKernels:
    """Scaled-dot-product attention on the stand-in accelerator through the kernel CUDA would run.

    torch picks the kernel in C++ per device type, and a backend registered from Python cannot take part: on the
    stand-in, `F.scaled_dot_product_attention` would always run the math path, which materializes every
    [query x key] score. Within this block it makes CUDA's choice on an H100 from what each kernel accepts (torch's
    `sdp_utils`: flash needs fp16/bf16, no mask, head dim <= 256; memory-efficient takes a mask and fp32 but no
    grouped-query heads; else math) and calls that kernel's own operator, whose meta function gives its outputs
    (output, log-sum-exp statistics) and whose derivative gives its backward, as the C++ dispatch would. A boolean
    mask becomes the additive mask the efficient kernel takes, as torch converts it. `kernels` lists the ones used.

    The function itself is swapped (not a TorchFunctionMode): gradient checkpointing recomputes in autograd's device
    thread, where a thread-local mode is not active.
    """

    def __init__(self):
        self.kernels: list[str] = []
        self._original = None

    def __enter__(self):
        self._original = torch.nn.functional.scaled_dot_product_attention
        torch.nn.functional.scaled_dot_product_attention = self._attention
        return self

    def __exit__(self, *exc):
        torch.nn.functional.scaled_dot_product_attention = self._original

    def _use(self, name: str) -> None:
        if name not in self.kernels:
            self.kernels.append(name)

    def _attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False):  # fmt: skip
        if not query.device.type == FAKE_ACCELERATOR:
            return self._original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                  scale=scale, enable_gqa=enable_gqa)  # fmt: skip
        if torch.is_autocast_enabled(FAKE_ACCELERATOR):  # sdpa is on CUDA autocast's lower-precision list
            dtype = torch.get_autocast_dtype(FAKE_ACCELERATOR)
            query, key, value = (t.to(dtype) if t.is_floating_point() else t for t in (query, key, value))
            if attn_mask is not None and attn_mask.is_floating_point():
                attn_mask = attn_mask.to(dtype)
        head_dim = query.shape[-1]
        half = query.dtype in (torch.float16, torch.bfloat16)
        if attn_mask is None and half and head_dim <= 256 and head_dim % 8 == 0:
            self._use("flash")
            return torch.ops.aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale
            )[0]
        same_heads = key.shape[-3] == query.shape[-3]
        if (same_heads or not enable_gqa) and query.dtype in (torch.float16, torch.bfloat16, torch.float32):
            self._use("efficient")
            bias = attn_mask
            if bias is not None and bias.dtype == torch.bool:  # torch's convert_boolean_attn_mask
                bias = torch.zeros(bias.shape, dtype=query.dtype, device=bias.device).masked_fill(
                    bias.logical_not(), float("-inf")
                )
            if bias is not None:
                bias = bias.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
            return torch.ops.aten._scaled_dot_product_efficient_attention(
                query, key, value, bias, True, dropout_p, is_causal, scale=scale
            )[0]
        self._use("math")
        return self._original(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            enable_gqa=enable_gqa,
        )  # fmt: skip


@functools.cache
def cpu_flash_takes_grouped_heads() -> bool:
    """Whether this torch's CPU flash kernel takes grouped-query keys and values as they are (torch 2.13 does; a
    release that repeats them to the query's heads first would hand the kernel repeated copies). Found once by running
    `F.scaled_dot_product_attention(..., enable_gqa=True)` on tiny CPU tensors and reading the heads the kernel got:
    the installed torch's own dispatch, not a version table."""
    heads: list[int] = []

    class KernelInputs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default:
                heads.append(args[1].shape[-3])
            return func(*args, **(kwargs or {}))

    with no_dispatch_modes(), KernelInputs():
        query, key = torch.zeros(1, 4, 2, 8), torch.zeros(1, 2, 2, 8)
        torch.nn.functional.scaled_dot_product_attention(query, key, key, is_causal=True, enable_gqa=True)
    return heads == [2]


class CpuAttentionKernels(CudaAttentionKernels):
    """Scaled-dot-product attention on the stand-in accelerator through the kernel a CPU runs: torch's flash kernel for
    CPUs (any float dtype, a mask taken as is), which takes grouped-query heads' keys and values as they are where this
    torch's does (`cpu_flash_takes_grouped_heads`), else repeated to the query's heads. What a count checked against a
    CPU's real peak (benchmarks/memory_real.py) must count: a CUDA card has no fused float32 kernel for grouped-query
    heads (`CudaAttentionKernels` then takes the math path, which materializes every score), a CPU does."""

    def __enter__(self):
        self.grouped_heads = cpu_flash_takes_grouped_heads()  # before the stand-in's sdpa is swapped in
        return super().__enter__()

    def _attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False):  # fmt: skip
        if not query.device.type == FAKE_ACCELERATOR or dropout_p:
            return super()._attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        self._use("flash_cpu")
        if key.shape[-3] != query.shape[-3] and not self.grouped_heads:
            repeat = query.shape[-3] // key.shape[-3]
            key, value = key.repeat_interleave(repeat, -3), value.repeat_interleave(repeat, -3)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, is_causal, attn_mask=attn_mask, scale=scale
        )[0]
