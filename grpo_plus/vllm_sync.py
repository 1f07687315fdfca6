"""Weight sync into a colocated vLLM engine that works on every vLLM build: TRL's weight stream, loaded through vLLM's
layerwise reload.

TRL's colocate sync (`VLLMGeneration.sync_weights`) hands each parameter to the vLLM model's `load_weights`, which
writes it into the parameters vLLM created for the checkpoint. vLLM may process those after loading: its CPU build
repacks every linear weight for its GEMM kernel and replaces the parameter with an empty one
(`dispatch_cpu_unquantized_gemm(..., remove_weight=True)`), so TRL's first sync fails there with `AttributeError:
'Parameter' object has no attribute 'weight_loader'`; quantization methods convert theirs, which a direct load
bypasses. vLLM's layerwise reload (what its `reload_weights` runs) puts each layer's checkpoint-format parameters back,
loads into them, re-runs the layer's processing once all its weights are in, and copies the result into the tensors
the engine runs on. grpo_plus wraps it around TRL's own weight stream (`VLLMGeneration._iter_named_params`: the
ZeRO-3 / FSDP gathering, PEFT's merge and unmerge, the names vLLM expects), so only where the weights land changes.

A LoRA model's stream is TRL's: the adapters merged into the base, every base weight streamed, unmerged after.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .trl_compat import colocate_weight_stream_name, colocated_model_runner


@contextmanager
def layerwise_reload(llm: Any) -> Iterator[torch.nn.Module]:
    """vLLM's in-place reload around the `load_weights` calls made inside: yields the engine's model.

    Each layer is processed (repacked, quantized) as soon as all its weights are loaded, the rest on exit
    (`finalize_layerwise_reload`), as `GPUModelRunner.reload_weights` does for an iterator of weights."""
    from vllm.model_executor.model_loader.reload.layerwise import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    runner = colocated_model_runner(llm)
    model = runner.get_model()
    initialize_layerwise_reload(model)
    try:
        yield model
    finally:
        finalize_layerwise_reload(model, runner.model_config)


def reload_on_sync(generation: Any) -> None:
    """Make TRL's `VLLMGeneration` (colocate mode) load every weight sync through `layerwise_reload`.

    Works on stock TRL's object too (the tests give stock TRL the same sync). Server mode is left as TRL runs it: the
    weights are loaded by the server's process (`trl vllm-serve`)."""
    if generation.mode != "colocate" or getattr(generation, "reloads_on_sync", False):
        return
    stream = getattr(generation, colocate_weight_stream_name())

    def reloading_stream() -> Iterator[tuple[str, torch.Tensor]]:
        # vLLM keeps a reference to each streamed tensor until its layer is complete (most layers: within the
        # stream; a layer with padding vLLM never loads, such as a vocabulary padded to a multiple of 64: at the
        # end). TRL streams gathered ZeRO-3 shards that it then releases by rebinding `param.data`, which leaves the
        # referenced tensor intact, and merged LoRA weights of linear layers, which are complete within the stream.
        with layerwise_reload(generation.llm):
            yield from stream()

    setattr(generation, colocate_weight_stream_name(), reloading_stream)
    generation.reloads_on_sync = True


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
