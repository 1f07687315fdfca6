"""Weight sync into a colocated vLLM engine that works on every vLLM build: TRL's weight stream (or, for a LoRA model,
grpo_plus's out-of-place one), loaded through vLLM's layerwise reload; and the precision the engine serves a 4-bit
base in.

TRL's colocate sync (`VLLMGeneration.sync_weights`) hands each parameter to the vLLM model's `load_weights`, which
writes it into the parameters vLLM created for the checkpoint. vLLM may process those after loading: its CPU build
repacks every linear weight for its GEMM kernel and replaces the parameter with an empty one
(`dispatch_cpu_unquantized_gemm(..., remove_weight=True)`), so TRL's first sync fails there with `AttributeError:
'Parameter' object has no attribute 'weight_loader'`; quantization methods convert theirs, which a direct load
bypasses. vLLM's layerwise reload (what its `reload_weights` runs) puts each layer's checkpoint-format parameters back,
loads into them, re-runs the layer's processing once all its weights are in, and copies the result into the tensors
the engine runs on. grpo_plus wraps it around the weight stream, so only where the weights land changes.

The stream: for a full model TRL's own (`VLLMGeneration._iter_named_params`: ZeRO-3 / FSDP gathering, the names vLLM
expects). For a LoRA model TRL merges the adapters into the base in place for the stream and unmerges after, which
moves a bfloat16 or 4-bit base a little at every sync; grpo_plus streams `lora_sync.LoraWeightStream` instead, each
LoRA layer merged in a new tensor (ZeRO-3 gathered as TRL gathers; under FSDP TRL's stream stays, with a warning).

A 4-bit (QLoRA) base: TRL asks vLLM for in-flight `quantization="bitsandbytes"`, which vLLM 0.31 no longer has. The
out-of-place stream sends the dequantized base plus the adapters in the engine's dtype, so the engine can serve it at
that precision or in an online quantization vLLM computes at each reload from high-precision weights (fp8);
`engine_quantization` picks one by memory (`vllm_quantization="auto"`) or as set.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from .lora_sync import LoraWeightStream
from .trl_compat import colocate_distribution, colocate_weight_stream_name, colocated_model_runner, vllm_engine_factory

logger = logging.getLogger(__name__)

# vllm_quantization: what the colocated engine serves. "auto": TRL's choice, except for a 4-bit base (see
# ENGINE_WEIGHT_SHARE); "none": the engine's dtype; any other name goes to vLLM's `quantization` as it is.
VLLM_QUANTIZATION_AUTO, VLLM_QUANTIZATION_NONE = "auto", "none"
# With vllm_quantization="auto" a 4-bit base is served in bfloat16 when its weights take at most this share of the
# engine's memory (vllm_gpu_memory_utilization of the card: the KV cache gets the rest), else in fp8 where vLLM's fp8
# runs on the GPU (half the bytes; vLLM quantizes it from the bfloat16 weights at each reload).
ENGINE_WEIGHT_SHARE = 0.5


@contextmanager
def layerwise_reload(llm: Any) -> Iterator[torch.nn.Module]:
    """vLLM's in-place reload around the `load_weights` calls made inside: yields the engine's model.

    Each layer is processed (repacked, quantized) as soon as all its weights are loaded, the rest on exit
    (`finalize_layerwise_reload`), as `GPUModelRunner.reload_weights` does for an iterator of weights. A linear layer
    given only part of its weights (q but not k of a fused qkv_proj) would be processed with the rest uninitialized:
    that raises IncompleteSyncError instead."""
    from vllm.model_executor.model_loader.reload.layerwise import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    runner = colocated_model_runner(llm)
    model = runner.get_model()
    initialize_layerwise_reload(model)
    try:
        yield model
        partial = partially_loaded_linear_layers(model)
    finally:
        finalize_layerwise_reload(model, runner.model_config)
    if partial:
        raise IncompleteSyncError(
            f"the weight sync gave vLLM only part of the weights of {len(partial)} linear layers ({', '.join(partial[:3])}"
            f"{', ...' if len(partial) > 3 else ''}), which it would serve with the rest uninitialized. A layer vLLM "
            "packs from several checkpoint weights (q/k/v, gate/up) needs all of them in one sync."
        )


class IncompleteSyncError(RuntimeError):
    """A weight sync left a vLLM linear layer partly loaded."""


def partially_loaded_linear_layers(model: torch.nn.Module) -> list[str]:
    """vLLM linear layers of `model` that received some, but not all, of their weights since the reload began (their
    padding-free shapes make any shortfall a missing weight; embeddings are padded and left out)."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    partial = []
    for name, layer in model.named_modules():
        if isinstance(layer, LinearBase):
            info = get_layerwise_info(layer)
            if info.can_load() and 0 < info.load_numel < info.load_numel_total:
                partial.append(name)
    return partial


@dataclass
class SyncLog:
    """What each weight sync into the colocated engine sent: seconds (the stream, vLLM's loading and processing),
    bytes and tensors streamed, one entry per sync."""

    seconds: list[float] = field(default_factory=list)
    bytes: list[int] = field(default_factory=list)
    tensors: list[int] = field(default_factory=list)


def reload_on_sync(generation: Any, *, lora_merge_in_place: bool = False) -> SyncLog | None:
    """Make TRL's `VLLMGeneration` (colocate mode) load every weight sync through `layerwise_reload`, a LoRA model's
    weights merged out of place (`lora_sync.LoraWeightStream`); returns the sync's log (None in server mode).

    Works on stock TRL's object too (the tests give stock TRL the same sync). `lora_merge_in_place=True` keeps TRL's
    own stream for a LoRA model (merge into the base, stream, unmerge: what the benchmark and the tests compare with).
    Raises LoraSyncError, before any sync, for a PEFT model the out-of-place stream cannot send. Server mode is left
    as TRL runs it: the weights are loaded by the server's process (`trl vllm-serve`)."""
    if generation.mode != "colocate":
        return None
    if getattr(generation, "sync_log", None) is not None:
        return generation.sync_log
    stream = None if lora_merge_in_place else lora_stream(generation)
    if stream is None:
        stream = getattr(generation, colocate_weight_stream_name())
    log = SyncLog()

    def reloading_stream() -> Iterator[tuple[str, torch.Tensor]]:
        # vLLM keeps a reference to each streamed tensor until its layer is complete (most layers: within the
        # stream; a layer with padding vLLM never loads, such as a vocabulary padded to a multiple of 64: at the
        # end). The out-of-place stream's merged weights are new tensors nothing else writes. TRL's streams gathered
        # ZeRO-3 shards that it then releases by rebinding `param.data`, which leaves the referenced tensor intact,
        # and LoRA weights merged in place, which its unmerge changes: safe only for layers complete within the
        # stream (linear layers).
        started, sent, count = time.perf_counter(), 0, 0
        with layerwise_reload(generation.llm):
            for name, tensor in stream():
                sent, count = sent + tensor.numel() * tensor.element_size(), count + 1
                yield name, tensor
        log.seconds.append(time.perf_counter() - started)
        log.bytes.append(sent)
        log.tensors.append(count)

    setattr(generation, colocate_weight_stream_name(), reloading_stream)
    generation.sync_log = log
    return log


def lora_stream(generation: Any) -> LoraWeightStream | None:
    """The out-of-place stream for `generation`'s model when it is a PEFT model (None for a full model, and under FSDP,
    where TRL's stream stays)."""
    from accelerate.utils import is_peft_model

    model = generation.model
    if not is_peft_model(model):
        return None
    distribution = colocate_distribution(generation)
    if distribution.is_fsdp:
        logger.warning(
            "LoRA with FSDP and colocated vLLM: weights are synced by TRL's stream, which merges the adapters into the "
            "base and unmerges them at each sync (a bfloat16 or 4-bit base moves a little each time); grpo_plus's "
            "out-of-place sync runs with DeepSpeed (ZeRO-3 included), DDP and one process."
        )
        return None
    runner = colocated_model_runner(generation.llm)
    config = runner.model_config
    return LoraWeightStream(
        model,
        config.dtype,
        engine_ties_embeddings=bool(getattr(config.hf_text_config, "tie_word_embeddings", False)),
        packed_modules=getattr(runner.get_model(), "packed_modules_mapping", None),
        gather=distribution.gather_params,
        rename=generation._fix_param_name_to_vllm,
    )


# ---- the precision the engine serves ----------------------------------------------------------------------------------


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
def engine_precision(args: Any) -> Iterator[None]:
    """While TRL builds its trainer: the colocated engine gets `engine_quantization`'s choice instead of what TRL asks
    (for a 4-bit base "bitsandbytes", which vLLM 0.31 no longer has and whose loader cannot take the dequantized
    weights the out-of-place sync sends)."""
    setting = getattr(args, "vllm_quantization", VLLM_QUANTIZATION_AUTO)
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
