"""A PEFT LoRA model's weights for an inference engine, merged out of place: the frozen base is only ever read.

TRL 1.16 sends a LoRA model to vLLM by merging the adapters into the base in place (`merge_adapter()`), streaming
every weight and unmerging (`unmerge_adapter()`). A merge and an unmerge do not cancel where the base is stored in
fewer bits than the sum: a bfloat16 base moves by rounding at every cycle (TRL issue 6688), and a 4-bit base is
dequantized, summed and quantized again, so it moves by about 0.43x the adapter's update per cycle, accumulating over
the run (measured: docs/guide/vllm.md). After a long run the adapter has been trained against a base that is not the
one users load it onto.

Here each LoRA layer's weight is computed in a new tensor, with PEFT's own pieces, in float32:

    W_served = dequantize(W_base) + sum_a get_delta_weight(a)        (get_delta_weight = scale * B @ A)
    W_served = variant.merge_safe(dequantize(W_base))                (DoRA: m / ||W + scale * B @ A|| * (W + ...))

(`peft.utils.integrations.dequantize_bnb_weight`, bitsandbytes' own dequantization, for a 4-bit base; PEFT's
`merge(safe_merge=True)` and its bitsandbytes layers compute the same sums, then write them into the base), then cast
once to the dtype the engine serves. The trainer's parameters are read, never written.

What a sync streams: the first, every weight (the engine starts from the checkpoint on disk, which for a 4-bit base is
not the trainer's dequantized one); later ones only the modules whose weights can change (LoRA layers,
modules_to_save, parameters left trainable) and the modules the engine packs with them into one layer (its
`packed_modules_mapping`, e.g. q/k/v into qkv_proj: vLLM's reload processes a layer once all its weights are in).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

# PEFT's LoRA variants whose merge has an out-of-place form (`merge_safe`) that leaves the base untouched.
MERGEABLE_VARIANTS = ("DoraLinearVariant", "DoraEmbeddingVariant")


class LoraSyncError(ValueError):
    """A PEFT model the out-of-place sync cannot send as the trainer computes it (raised when the trainer is built)."""


@dataclass(frozen=True)
class _Unit:
    """A module whose own tensors go to the engine together: a LoRA layer (its merged weight and its base layer's other
    parameters), the active copy of a modules_to_save module (every parameter of it), or a plain module (its direct
    parameters)."""

    path: str
    module: torch.nn.Module
    kind: str  # "lora", "saved", "plain"


def _peft_classes():
    from peft.tuners.lora import LoraLayer
    from peft.utils.other import ModulesToSaveWrapper

    return LoraLayer, ModulesToSaveWrapper


def _mergeable_lora_classes() -> tuple[type, ...]:
    """PEFT's LoRA layers whose base weight is one `weight` tensor, dense or bitsandbytes 4-bit."""
    from peft.tuners.lora.layer import Embedding, Linear

    classes: list[type] = [Linear, Embedding]
    try:
        from peft.tuners.lora.bnb import Linear4bit

        classes.append(Linear4bit)
    except ImportError:  # no bitsandbytes: no 4-bit layers
        pass
    return tuple(classes)


def _units(module: torch.nn.Module, path: str = "") -> Iterator[_Unit]:
    """Every module of `module` that holds tensors for the engine, LoRA layers and modules_to_save wrappers as one unit
    each (their adapters are not the engine's weights)."""
    lora_layer, saved_wrapper = _peft_classes()
    if isinstance(module, lora_layer):
        yield _Unit(path, module, "lora")
        return
    if isinstance(module, saved_wrapper):
        yield _Unit(path, module, "saved")
        return
    yield _Unit(path, module, "plain")
    for name, child in module.named_children():
        yield from _units(child, f"{path}.{name}" if path else name)


def dequantized(param: torch.Tensor) -> torch.Tensor:
    """A bitsandbytes 4-bit weight dequantized by bitsandbytes (through PEFT's helper) into a new tensor; any other
    tensor itself."""
    from peft.utils.integrations import dequantize_bnb_weight, get_bnb_param_type

    if get_bnb_param_type(param) == "4bit":
        return dequantize_bnb_weight(param, state=param.quant_state)
    return param.detach()


def _applied_adapters(layer) -> list[str]:
    """The adapters the layer's forward adds to its base (none while they are disabled or already merged into it)."""
    if layer.disable_adapters or layer.merged:
        return []
    owned = set(layer.lora_A) | set(getattr(layer, "lora_embedding_A", {}))
    return [name for name in layer.active_adapters if name in owned]


def merged_weight(layer, dtype: torch.dtype) -> torch.Tensor:
    """The weight a LoRA layer's forward computes with, as one tensor in `dtype`: its base dequantized, plus each
    applied adapter (PEFT's `get_delta_weight`, or its variant's out-of-place `merge_safe`), summed in float32."""
    weight = dequantized(layer.get_base_layer().weight)
    adapters = _applied_adapters(layer)
    if adapters:
        weight = weight.float()  # a new tensor where the base is not float32; never written below either way
    for adapter in adapters:
        variant = layer.lora_variant.get(adapter)
        if variant is None:
            weight = weight + layer.get_delta_weight(adapter).float()
        else:
            weight = variant.merge_safe(layer, adapter, weight).float()
            # merge_safe keeps DoRA's weight norm for the unmerge that follows a merge; none follows here
            layer._caches.pop(f"{adapter}-weight_norm", None)
    return weight.to(dtype)


def sync_blocker(model, engine_ties_embeddings: bool) -> str | None:
    """Why `model` (a PEFT model) cannot be sent to the engine as the trainer computes it, or None."""
    from peft import PeftType

    lora_layer, saved_wrapper = _peft_classes()
    kinds = {name: config.peft_type for name, config in model.peft_config.items()}
    not_lora = {name: str(kind) for name, kind in kinds.items() if kind != PeftType.LORA}
    if not_lora:
        return (
            f"adapters {not_lora} are not LoRA: grpo_plus sends LoRA adapters (merged out of place) to vLLM; other "
            "PEFT methods are not supported with use_vllm=True."
        )
    mergeable = _mergeable_lora_classes()
    base = model.get_base_model()
    for unit in _units(base):
        layer = unit.module
        if unit.kind == "plain":
            for name, param in layer.named_parameters(recurse=False):
                from peft.utils.integrations import get_bnb_param_type

                if get_bnb_param_type(param) == "8bit":
                    return f"{unit.path}.{name} is an 8-bit bitsandbytes weight: vLLM has no in-flight 8-bit loading."
            continue
        if unit.kind != "lora":
            continue
        if not isinstance(layer, mergeable):
            return (
                f"{unit.path} is a {type(layer).__name__} LoRA layer: grpo_plus merges LoRA on linear and embedding "
                "layers (dense or bitsandbytes 4-bit) for vLLM. Leave this module out of target_modules / "
                "target_parameters."
            )
        adapters = _applied_adapters(layer)
        for adapter in adapters:
            if layer.lora_bias.get(adapter, False):
                return (
                    f"{unit.path}: lora_bias=True (adapter {adapter!r}) is not supported with use_vllm=True; set "
                    "lora_bias=False."
                )
            variant = layer.lora_variant.get(adapter)
            if variant is not None and type(variant).__name__ not in MERGEABLE_VARIANTS:
                return (
                    f"{unit.path}: the LoRA variant {type(variant).__name__} (adapter {adapter!r}) has no out-of-place "
                    "merge; with use_vllm=True grpo_plus supports plain LoRA, rsLoRA and DoRA."
                )
        if len(adapters) > 1 and any(adapter in layer.lora_variant for adapter in adapters):
            return (
                f"{unit.path}: several active adapters ({', '.join(adapters)}) with a LoRA variant (DoRA): activate "
                "one adapter for training with use_vllm=True."
            )
    if engine_ties_embeddings:
        ends = {"input": base.get_input_embeddings(), "output": base.get_output_embeddings()}
        adapted = [side for side, end in ends.items() if isinstance(end, (lora_layer, saved_wrapper))]
        if adapted:
            return (
                f"the model ties its input and output embeddings, and its {' and '.join(adapted)} embeddings carry "
                "a LoRA adapter or modules_to_save: the trainer's two ends then differ, but vLLM serves one tied "
                "matrix. Leave embed_tokens / lm_head out of target_modules and modules_to_save, or untie them "
                "(tie_word_embeddings=False) before training."
            )
    return None


def _packed_partners(path: str, packed_modules: Mapping[str, Sequence[str]]) -> set[str]:
    """The paths of the modules the engine packs into one layer with module `path` (itself included)."""
    parent, _, leaf = path.rpartition(".")
    partners = {path}
    for group in packed_modules.values():
        if leaf in group:
            partners |= {f"{parent}.{name}" if parent else name for name in group}
    return partners


class LoraWeightStream:
    """Calling it yields (name, tensor) for the engine's `load_weights`: a LoRA model's weights as its forward computes
    with them, each LoRA layer merged out of place (module docstring). Raises LoraSyncError when built for a model
    it cannot send that way.

    `packed_modules` is the engine model's `packed_modules_mapping` (None: every sync streams every weight);
    `gather` a context manager factory that makes the given parameters whole (ZeRO-3: TRL's `gather_params`; FSDP2:
    `fsdp2_unsharded`); `copy_sources` sends copies of the parameters sent unchanged (FSDP2 frees the whole weights'
    storage when it reshards, while vLLM may hold a streamed tensor until its layer is complete, after the stream);
    `rename` maps a module path to the engine's name (TRL's `_fix_param_name_to_vllm`)."""

    def __init__(
        self,
        model,
        engine_dtype: torch.dtype,
        *,
        engine_ties_embeddings: bool,
        packed_modules: Mapping[str, Sequence[str]] | None,
        gather: Callable[[list[torch.nn.Parameter]], AbstractContextManager] | None = None,
        copy_sources: bool = False,
        rename: Callable[[str], str] = lambda name: name,
    ):
        reason = sync_blocker(model, engine_ties_embeddings)
        if reason is not None:
            raise LoraSyncError(f"use_vllm=True with this PEFT model: {reason}")
        self.model = model
        self.engine_dtype = engine_dtype
        self.packed_modules = packed_modules
        self.gather = gather or (lambda params: nullcontext())
        self.copy_sources = copy_sources
        self.rename = rename
        self.next_is_full = True  # the engine holds the checkpoint from disk until a first full stream completes

    def next_is_full_stream(self) -> bool:
        """Whether the next call streams every weight (the first, or without the engine's packing map)."""
        return self.next_is_full or self.packed_modules is None

    @torch.no_grad()
    def __call__(self) -> Iterator[tuple[str, torch.Tensor]]:
        full = self.next_is_full_stream()
        with self.gather(list(self.model.parameters())):
            units = list(_units(self.model.get_base_model()))
            wanted = None if full else self._changing(units)
            seen: set[int] = set()  # tied parameters go once, under the first name (as named_parameters gives them)
            for unit in units:
                if wanted is not None and unit.path not in wanted:
                    continue
                for name, source in self._sources(unit):
                    if id(source) in seen:
                        continue
                    seen.add(id(source))
                    yield self.rename(f"{unit.path}.{name}" if unit.path else name), self._served(unit, name, source)
        self.next_is_full = False

    def _changing(self, units: list[_Unit]) -> set[str]:
        """The paths of the units whose tensors may have changed since the last sync, with their packed partners."""
        changing = set()
        for unit in units:
            trainable = any(p.requires_grad for p in unit.module.parameters(recurse=unit.kind != "plain"))
            if unit.kind != "plain" or trainable:
                changing |= _packed_partners(unit.path, self.packed_modules)
        return changing

    def _sources(self, unit: _Unit) -> Iterator[tuple[str, torch.Tensor]]:
        """The trainer's parameters a unit sends, by name (a LoRA layer: its base layer's)."""
        if unit.kind == "lora":
            yield from unit.module.get_base_layer().named_parameters(recurse=False)
        elif unit.kind == "saved":
            yield from self._saved(unit.module)
        else:
            yield from unit.module.named_parameters(recurse=False)

    @staticmethod
    def _saved(wrapper) -> Iterator[tuple[str, torch.Tensor]]:
        """The parameters of the copy a modules_to_save wrapper's forward runs (the original while none is active)."""
        active = [name for name in wrapper.active_adapters if name in wrapper.modules_to_save]
        copy = (
            wrapper.original_module if wrapper.disable_adapters or not active else wrapper.modules_to_save[active[0]]
        )
        yield from copy.named_parameters()

    def _served(self, unit: _Unit, name: str, source: torch.Tensor) -> torch.Tensor:
        """What the engine loads for a parameter: a LoRA layer's weight merged; a 4-bit weight dequantized, in the
        engine's dtype; anything else as the trainer holds it (as TRL streams it), detached; with `copy_sources`,
        never the parameter's own storage."""
        from peft.utils.integrations import get_bnb_param_type

        if unit.kind == "lora" and name == "weight":
            served = merged_weight(unit.module, self.engine_dtype)  # the base itself while no adapter is applied
        elif get_bnb_param_type(source) == "4bit":
            served = dequantized(source).to(self.engine_dtype)
        else:
            served = source.detach()
        if self.copy_sources and served.untyped_storage().data_ptr() == source.untyped_storage().data_ptr():
            served = served.clone()
        return served
