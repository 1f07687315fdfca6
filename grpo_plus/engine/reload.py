"""vLLM's layerwise reload around a weight stream, and what it put into the engine.

TRL's colocate sync (`VLLMGeneration.sync_weights`) hands each parameter to the vLLM model's `load_weights`, which
writes it into the parameters vLLM created for the checkpoint. vLLM may process those after loading: its CPU build
repacks every linear weight for its GEMM kernel and replaces the parameter with an empty one
(`dispatch_cpu_unquantized_gemm(..., remove_weight=True)`), so TRL's first sync fails there with `AttributeError:
'Parameter' object has no attribute 'weight_loader'`; quantization methods convert theirs, which a direct load
bypasses. vLLM's layerwise reload (what its `reload_weights` runs) puts each layer's checkpoint-format parameters back,
loads into them, re-runs the layer's processing once all its weights are in, and copies the result into the tensors
the engine runs on. `layerwise_reload` wraps it around the `load_weights` calls of a sync, and mends what it leaves
wrong for a sync that streams the trainer's weights:

- a layer given only part of its weights (q but not k of a fused qkv_proj) would be processed with the rest
  uninitialized: IncompleteSyncError instead;
- a tied LM head receives nothing (vLLM loads `embed_tokens.weight` once and skips `lm_head.*`) and keeps what its
  processing made of the weights the engine started with: processed again here (`tied_layers_left_unprocessed`).

`ReloadReport` says what the engine took: the layers that received weights, the elements loaded, the layers that kept
their previous tensors. The sync check (`grpo_plus.engine.receipt`) compares it with what was streamed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ..compat.vllm import colocated_model_runner


class SyncCheckError(RuntimeError):
    """A weight sync left the colocated engine serving other weights than the trainer's."""


class IncompleteSyncError(SyncCheckError):
    """A weight sync left a vLLM linear layer partly loaded."""


@dataclass
class ReloadReport:
    """What one reload put into the engine: engine layer names that received weights, how many elements they took,
    layers with parameters that received none (they keep their previous tensors), and tied layers processed again."""

    loaded_layers: list[str] = field(default_factory=list)
    loaded_elements: int = 0
    unloaded_layers: list[str] = field(default_factory=list)
    tied_layers: list[str] = field(default_factory=list)


@contextmanager
def layerwise_reload(llm: Any, report: ReloadReport | None = None) -> Iterator[torch.nn.Module]:
    """vLLM's in-place reload around the `load_weights` calls made inside: yields the engine's model; fills `report`.

    Each layer is processed (repacked, quantized) as soon as all its weights are loaded, the rest on exit
    (`finalize_layerwise_reload`), as `GPUModelRunner.reload_weights` does for an iterator of weights."""
    runner = colocated_model_runner(llm)
    with model_reload(runner.get_model(), runner.model_config, report) as model:
        yield model


@contextmanager
def model_reload(model: torch.nn.Module, model_config: Any, report: ReloadReport | None = None):
    """`layerwise_reload` on a vLLM model and its model config, wherever they live (the colocated engine's runner, or
    a server worker's weight-transfer engine: `grpo_plus.engine.gloo_transport`)."""
    from vllm.model_executor.model_loader.reload.layerwise import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    initialize_layerwise_reload(model)
    sizes = _loadable_sizes(model)
    try:
        yield model
        partial = partially_loaded_linear_layers(model)
        tied = tied_layers_left_unprocessed(model)
        received = _what_was_received(model, sizes)
    finally:
        finalize_layerwise_reload(model, model_config)
    for name, layer in tied:
        reprocess_tied_layer(name, layer)
    for layer in cpu_experts_left_unpacked(model, received[0]):
        layer.quant_method.moe_kernel.fused_experts.process_weights_after_loading(layer)
    if report is not None:
        report.loaded_layers, report.loaded_elements, unloaded = received
        report.tied_layers = [name for name, _ in tied]
        report.unloaded_layers = [name for name in unloaded if name not in report.tied_layers]
    if partial:
        raise IncompleteSyncError(
            f"the weight sync gave vLLM only part of the weights of {len(partial)} linear layers ({', '.join(partial[:3])}"
            f"{', ...' if len(partial) > 3 else ''}), which it would serve with the rest uninitialized. A layer vLLM "
            "packs from several checkpoint weights (q/k/v, gate/up) needs all of them in one sync."
        )


def _loadable_sizes(model: torch.nn.Module) -> dict[str, int]:
    """Checkpoint-format elements each layer with parameters loads, right after the reload began."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    return {
        name: get_layerwise_info(layer).load_numel_total or 0
        for name, layer in model.named_modules()
        if any(p is not None for p in layer._parameters.values())
    }


def _what_was_received(model: torch.nn.Module, sizes: dict[str, int]) -> tuple[list[str], int, list[str]]:
    """(layers that received weights, elements they took, layers with parameters that received none), before
    `finalize_layerwise_reload` resets the bookkeeping. A layer processed during the stream took all its elements (its
    bookkeeping was reset then); one still waiting took `load_numel`."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    loaded, elements, unloaded = [], 0, []
    for name, layer in model.named_modules():
        if name not in sizes:
            continue
        info = get_layerwise_info(layer)
        if not info.can_load():
            loaded.append(name)
            elements += sizes[name]
        elif info.load_numel > 0:
            loaded.append(name)
            elements += info.load_numel
        elif sizes[name] > 0:
            unloaded.append(name)
    return loaded, elements, unloaded


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


def tied_layers_left_unprocessed(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Layers that received no weights in this reload but share a parameter with one that did: a tied LM head.

    vLLM loads a tied checkpoint weight once (`embed_tokens.weight`; `lm_head.*` is skipped) into the embedding layer,
    whose processing runs; the head, which received nothing, gets its old tensors back at the end of the reload
    without being processed again. Where processing copies the weight into a kernel's own format (vLLM's CPU build
    packs the head's weight for oneDNN when the engine starts: `UnquantizedEmbeddingMethod`), the head then keeps
    computing with the weights the engine started from while the embedding moves on, and the engine's log-probs
    drift from the trainer's from the first sync that changes the embedding (measured on SmolLM2-135M with a float32
    engine: |engine - trainer| at most 2.6e-5 before, 0.23 after one perturbation of the embedding)."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    loaded_tensors: set[int] = set()
    unloaded: list[tuple[str, torch.nn.Module, list[torch.Tensor]]] = []
    for name, layer in model.named_modules():
        info = get_layerwise_info(layer)
        if not info.can_load():  # processed during the stream (its bookkeeping was reset): every weight arrived
            loaded_tensors.update(id(t) for t in layer.parameters(recurse=False))
        elif info.load_numel > 0 and info.kernel_tensors is not None:
            loaded_tensors.update(id(t) for t in info.kernel_tensors[0].values())
        elif info.load_numel_total and info.kernel_tensors is not None:
            unloaded.append((name, layer, list(info.kernel_tensors[0].values())))
    return [(name, layer) for name, layer, tensors in unloaded if any(id(t) in loaded_tensors for t in tensors)]


def cpu_experts_left_unpacked(model: torch.nn.Module, loaded: list[str]) -> list[torch.nn.Module]:
    """The MoE layers among `loaded` (the layers this reload gave weights) whose experts run on vLLM's CPU kernel.

    vLLM 0.31 pads and packs the experts' weights for its CPU kernel when the engine loads the model, and on a reload
    (a "weight update") copies the new weights in without doing so again (`UnquantizedFusedMoEMethod`: the experts'
    `process_weights_after_loading` runs on the first load only): the kernel then reads unpacked weights as packed
    ones. Measured on a tiny Qwen3-MoE, float32 engine: the checkpoint's own weights reloaded moved the engine's
    log-probs by up to 0.067; packed again, they are those of the engine loaded from disk (4.8e-7 from the trainer's).
    A layer that received nothing keeps its packed weights and is left out."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a build without the CPU experts kernel
        return []
    names = set(loaded)
    layers = []
    for name, layer in model.named_modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        if name in names and isinstance(getattr(kernel, "fused_experts", None), CPUUnquantizedExperts):
            layers.append(layer)
    return layers


def reprocess_tied_layer(name: str, layer: torch.nn.Module) -> None:
    """Run a tied layer's weight processing again on its (now updated) shared weight; IncompleteSyncError where its
    quantization method cannot process weights twice (vLLM's `supports_pre_processed_weights`)."""
    method = getattr(layer, "quant_method", None)
    if method is None:
        return
    if not getattr(method, "supports_pre_processed_weights", False):
        raise IncompleteSyncError(
            f"{name} shares its weight with a layer the sync loaded, and its {type(method).__name__} processing "
            "cannot be run again on it: the engine would keep serving the weight it started with."
        )
    method.process_weights_after_loading(layer)
