"""What the colocated vLLM engine serves the weights in: its dtype (`vllm_dtype`), its quantization
(`vllm_quantization`), and sleep mode where the build has none.

TRL builds the engine with vLLM's dtype on "auto" (bfloat16 for a float32 or bfloat16 checkpoint) and, for a 4-bit
bitsandbytes base, asks for in-flight `quantization="bitsandbytes"`, which vLLM 0.31 no longer has. grpo_plus's
out-of-place LoRA stream sends the dequantized base plus the adapters in the engine's dtype, so the engine can serve
it at that precision or in an online quantization vLLM computes at each reload from high-precision weights (fp8);
`engine_quantization` picks one by memory (`vllm_quantization="auto"`) or as set. `vllm_dtype="float32"` gives an
engine that computes as a float32 trainer does: its log-probs equal the trainer's to float32 rounding, so runs that
differ by float rounding sample alike (docs/guide/vllm.md, "Exactness").
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..compat.vllm import kernel_scan_guard, vllm_engine_factory

logger = logging.getLogger(__name__)

# vllm_quantization: what the colocated engine serves. "auto": TRL's choice, except for a 4-bit base (see
# ENGINE_WEIGHT_SHARE); "none": the engine's dtype; any other name goes to vLLM's `quantization` as it is.
VLLM_QUANTIZATION_AUTO, VLLM_QUANTIZATION_NONE = "auto", "none"
# With vllm_quantization="auto" a 4-bit base is served in bfloat16 when its weights take at most this share of the
# engine's memory (vllm_gpu_memory_utilization of the card: the KV cache gets the rest), else in fp8 where vLLM's fp8
# runs on the GPU (half the bytes; vLLM quantizes it from the bfloat16 weights at each reload).
ENGINE_WEIGHT_SHARE = 0.5
# vllm_dtype: "auto" leaves vLLM's choice (TRL's behaviour); the others are passed to vLLM's `dtype`.
VLLM_DTYPES = ("auto", "float32", "bfloat16", "float16")


def quantization_by_memory(bf16_bytes: int, engine_bytes: float, fp8_runs: bool) -> str | None:
    """vllm_quantization="auto" for a 4-bit base: None (the engine's bfloat16) when the weights in bfloat16 take at
    most ENGINE_WEIGHT_SHARE of the engine's memory, else "fp8" where it runs (else None: fit says if it does not)."""
    if bf16_bytes <= ENGINE_WEIGHT_SHARE * engine_bytes or not fp8_runs:
        return None
    return "fp8"


def served_weight_bytes(config) -> dict[str, int]:
    """Bytes of a model of transformers `config` in the engine, by format: "bfloat16" every weight in 2 bytes, "fp8"
    vLLM's online fp8 (its linear layers in 1 byte; embeddings, LM head and norms in 2), counted on the meta
    device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    head = model.get_output_embeddings()
    weights = {id(p): p.numel() for p in model.parameters()}
    linear = {
        id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head
    }
    total = sum(weights.values())
    return {"bfloat16": 2 * total, "fp8": 2 * total - sum(linear.values())}


def _fp8_runs() -> bool:
    """Whether vLLM's fp8 runs on this platform (its Fp8Config's minimum GPU capability)."""
    from vllm.model_executor.layers.quantization import get_quantization_config
    from vllm.platforms import current_platform

    if not torch.cuda.is_available():
        return False
    return current_platform.has_device_capability(get_quantization_config("fp8").get_min_capability())


def engine_quantization(setting: str, asked: str | None, model_path: str, memory_utilization: float,
                        trust_remote_code: bool = False) -> str | None:  # fmt: skip
    """The `quantization` the colocated engine is built with, where TRL asked for `asked` (vllm_quantization =
    `setting`)."""
    if setting == VLLM_QUANTIZATION_NONE:
        return None
    if setting != VLLM_QUANTIZATION_AUTO:
        return setting
    if asked != "bitsandbytes":
        return asked
    if not torch.cuda.is_available():
        return None  # a CPU engine: bfloat16 (vLLM's CPU build has no fp8 kernels)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    card = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    bf16 = served_weight_bytes(config)["bfloat16"]
    choice = quantization_by_memory(bf16, memory_utilization * card, _fp8_runs())
    logger.info(
        "colocated vLLM serves the 4-bit base in %s (vllm_quantization='auto': %.1f GiB in bfloat16, the engine has "
        "%.1f GiB).", choice or "bfloat16", bf16 / 2**30, memory_utilization * card / 2**30,
    )  # fmt: skip
    return choice


@contextmanager
def engine_precision(
    args: Any, quantization: str = VLLM_QUANTIZATION_AUTO, dtype: str = "auto", block_size: int | None = None
) -> Iterator[None]:
    """While TRL builds its trainer from `args` (TRL's vLLM fields): the colocated engine gets `engine_quantization`'s
    choice for `quantization` (vllm_quantization) instead of what TRL asks (for a 4-bit base "bitsandbytes", which vLLM
    0.31 no longer has and whose loader cannot take the dequantized weights the out-of-place sync sends), `dtype`
    (vllm_dtype) where it is not "auto", and its KV cache in blocks of `block_size` tokens (vllm_block_size) where it is
    not None (the layout of what it computes in that precision)."""
    setting = quantization
    if not getattr(args, "use_vllm", False) or getattr(args, "vllm_mode", "colocate") != "colocate":
        yield
        return
    module, name = vllm_engine_factory()
    build = getattr(module, name)

    def build_with_precision(**kwargs):
        kwargs["quantization"] = engine_quantization(
            setting, kwargs.get("quantization"), kwargs["model"], kwargs.get("gpu_memory_utilization", 0.9),
            kwargs.get("trust_remote_code", False),
        )  # fmt: skip
        if dtype != "auto":
            kwargs["dtype"] = dtype
        if block_size is not None:
            kwargs["block_size"] = block_size
        with kernel_scan_guard():
            return build(**kwargs)

    setattr(module, name, build_with_precision)
    try:
        yield
    finally:
        setattr(module, name, build)


def sleep_mode_blocker(args: Any) -> str | None:
    """Why `vllm_enable_sleep_mode=True` cannot run on this vLLM build, or None (also when vLLM is not used).

    vLLM refuses it on platforms without its sleep allocator (the CPU build: "Sleep mode is not supported on current
    platform"), but only from inside TRL's trainer, once the model is loaded; this says it first, naming the setting.
    """
    if not (getattr(args, "use_vllm", False) and getattr(args, "vllm_enable_sleep_mode", False)):
        return None
    if getattr(args, "vllm_mode", "colocate") != "colocate":
        return None  # the server's own setting, not the trainer's
    from vllm.platforms import current_platform

    if current_platform.is_sleep_mode_available():
        return None
    return (
        f"vllm_enable_sleep_mode=True: this vLLM build (platform {current_platform.device_name!r}) has no sleep mode (vLLM offers it on CUDA and ROCm GPUs). Set vllm_enable_sleep_mode=False; on this "
        "platform the colocated engine keeps its weights and KV cache (VLLM_CPU_KVCACHE_SPACE on the CPU build) "
        "between generations."
    )
