"""Mixture-of-experts models as transformers 5.x builds them: the config's expert counts, the router's logits (how
transformers' output recorder finds them), and the `output_router_logits` switch that breaks `generate`.

Facts (transformers 5.24; Qwen3-MoE, OLMoE, Mixtral and gpt-oss alike):
- The causal LM's forward adds the load-balancing loss when `output_router_logits` is on (the argument, else the
  config's field): `load_balancing_loss_func(router_logits, num_experts, num_experts_per_tok, attention_mask)`, one
  copy per family, all the same code (TRL 1.16's fused LM head imports Mixtral's). With a KV cache the router sees only
  the new tokens while the mask spans the whole sequence: with `output_router_logits=True` in the config, `generate`
  fails at its second step ("The size of tensor a (3) must match the size of tensor b (33)"), in stock TRL too.
- The router logits are recorded by `OutputRecorder(<Family>TopKRouter, index=0)` hooks declared in the base
  model's `_can_record_outputs["router_logits"]`: the router module's first output, (tokens, experts), per layer.
- The experts of a layer are one module (`<layer>.mlp.experts`) holding 3D parameters (`gate_up_proj`, `down_proj`:
  (experts, ...)), which PEFT reaches through `target_parameters`, not `target_modules`, and which bitsandbytes'
  4-bit loading leaves in the model's dtype (it quantizes `nn.Linear` layers only; the router is no `nn.Linear`
  either). PEFT's `prepare_model_for_kbit_training` casts every unquantized bf16 / fp16 weight to fp32: the experts,
  nearly all of an MoE model's bytes, would double.
- Each router module (`<Family>TopKRouter`) returns (logits, combine weights, expert indices) and the block hands the
  last two to its experts module as positional arguments; the decoder layer passes its keyword arguments to its
  attention (not to the MoE block), also when gradient checkpointing calls the layer's forward again in backward.
  Routing replay (grpo_plus.routing) stands on these.
- Checkpoints, like the hub's files, hold each expert's `gate_proj` / `up_proj` / `down_proj` under its own name:
  `save_pretrained` reverts the conversion `from_pretrained` applies (`transformers.core_model_loading.
  revert_weight_conversion`). The Trainer's `_load_from_checkpoint` calls `model.load_state_dict(state_dict, False)` on
  the saved names, so a resumed full fine-tune keeps the experts it was built with ("There were missing keys in the
  checkpoint model loaded"), with stock TRL as with grpo_plus. `converted_checkpoint_load` loads such a checkpoint
  through the conversion `save_pretrained` reverted, applied by transformers' own converter
  (`transformers.integrations.deepspeed._apply_weight_conversions_to_state_dict`, what its ZeRO-3 loading converts
  with), into the live parameters in place.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch

__all__ = [
    "ExpertCounts",
    "converted_checkpoint_load",
    "experts_converted_on_resume",
    "expert_counts",
    "expert_weight_ids",
    "expert_weights_set_aside",
    "four_bit_linear_weights",
    "is_moe",
    "recorded_router_logits",
    "router_logits_off",
    "router_logits_requested",
]


class ExpertCounts(NamedTuple):
    """A layer's experts, and how many of them each token is routed to (top-k)."""

    experts: int
    active: int


def expert_counts(config) -> ExpertCounts | None:
    """The text config's (experts, routed per token), or None for a dense model. Qwen3-MoE and OLMoE call the count
    `num_experts`, Mixtral and gpt-oss `num_local_experts` (transformers 5 maps `num_experts` to it on theirs)."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    experts = getattr(text_config, "num_local_experts", None) or getattr(text_config, "num_experts", None)
    active = getattr(text_config, "num_experts_per_tok", None)
    if not experts or not active:
        return None
    return ExpertCounts(int(experts), int(active))


def is_moe(config) -> bool:
    """Whether the model routes tokens to experts and can report its router logits (TRL's own test, 1.16:
    `hasattr(text_config, "output_router_logits")`), with its expert counts declared."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return hasattr(text_config, "output_router_logits") and expert_counts(text_config) is not None


def router_logits_requested(config) -> bool:
    """Whether the model's forward computes its load-balancing loss unless told otherwise (the config's field)."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text_config, "output_router_logits", False))


@contextmanager
def router_logits_off(model: torch.nn.Module) -> Iterator[None]:
    """Within the block the model's config says `output_router_logits=False` (generation: nothing trains on the
    router's logits there, and transformers' loss over them fails under a KV cache); restored after."""
    config = getattr(model, "config", None)
    if config is None or not router_logits_requested(config):
        yield
        return
    text_config = config.get_text_config()
    text_config.output_router_logits = False
    try:
        yield
    finally:
        text_config.output_router_logits = True


def _router_spec(model: torch.nn.Module):
    """transformers' recorder spec for the router logits: (module class or None, class-name suffix or None, index,
    layer name or None), or None where the model records none."""
    for module in model.modules():
        spec = (getattr(type(module), "_can_record_outputs", None) or {}).get("router_logits")
        if spec is None:
            continue
        if isinstance(spec, str):
            return None, spec, 0, None
        if isinstance(spec, type):
            return spec, None, 0, None
        return spec.target_class, spec.class_name, spec.index, spec.layer_name
    return None


@contextmanager
def recorded_router_logits(model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """Within the block, every forward of `model` appends each MoE layer's router logits ((tokens, experts), in
    layer order, with their graph) to the yielded list, found as transformers' own recorder finds them."""
    spec = _router_spec(model)
    if spec is None:
        raise ValueError(f"{type(model).__name__} declares no router logits to record")
    target_class, class_name, index, layer_name = spec
    recorded: list[torch.Tensor] = []

    def record(module, args, output):
        recorded.append(output[index] if isinstance(output, (tuple, list)) else output)

    handles = []
    for name, module in model.named_modules():
        matches = (target_class is not None and isinstance(module, target_class)) or (
            class_name is not None and name.endswith(class_name)
        )
        if matches and (layer_name is None or layer_name in name):
            handles.append(module.register_forward_hook(record))
    try:
        yield recorded
    finally:
        for handle in handles:
            handle.remove()


def four_bit_linear_weights(model: torch.nn.Module) -> set[int]:
    """ids of the weights bitsandbytes' 4-bit loading quantizes: every `nn.Linear` but the LM head (transformers'
    default `llm_int8_skip_modules`); an MoE's experts (3D parameters) and router are none of them."""
    return {
        id(module.weight)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head")
    }


def _expert_parameters(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
    """(module, name) of every parameter an MoE layer's experts module holds itself (`*.experts`, PEFT wrappers
    looked through: their base layer's)."""
    found = []
    for name, module in model.named_modules():
        if name.endswith(".experts") or name.endswith(".experts.base_layer"):
            found.extend((module, key) for key, value in module._parameters.items() if value is not None)
    return found


def expert_weight_ids(model: torch.nn.Module) -> set[int]:
    """ids of the weights MoE layers' experts modules hold (see `expert_weights_set_aside`)."""
    return {id(module._parameters[key]) for module, key in _expert_parameters(model)}


@contextmanager
def expert_weights_set_aside(model: torch.nn.Module) -> Iterator[None]:
    """Within the block the experts' own weights are not parameters of `model` (put back after, frozen): a preparation
    that casts or walks every parameter (PEFT's `prepare_model_for_kbit_training`) leaves them in their dtype. No
    forward may run inside."""
    kept = [(module, key, module._parameters.pop(key)) for module, key in _expert_parameters(model)]
    try:
        yield
    finally:
        for module, key, param in kept:
            param.requires_grad_(False)
            module._parameters[key] = param


# ---- routing replay: the routers' combine weights at given experts ----------------------------------------------
# transformers 5.24's routers return (logits, combine weights, expert indices), the block hands the last two to its
# experts module. Each family computes the weights its own way; at given experts the weights are that same formula:
# - Qwen3-MoE, OLMoE: softmax over every expert (float32), the chosen ones' probabilities, renormalized to sum 1 when
#   the config's `norm_topk_prob` is on, cast to the logits' dtype;
# - Mixtral: softmax over every expert (float32), the chosen ones' probabilities, always renormalized, kept float32;
# - gpt-oss: softmax over the chosen experts' logits only (in the logits' dtype).


def _softmax_then_chosen(router, logits: torch.Tensor, experts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, experts)
    if getattr(router, "norm_topk_prob", True):  # Mixtral's router declares none: it always renormalizes
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype)


def _softmax_over_chosen(router, logits: torch.Tensor, experts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    chosen = logits.gather(1, experts)
    return torch.softmax(chosen, dim=1, dtype=chosen.dtype).to(dtype)


ROUTER_COMBINE_WEIGHTS = {
    "Qwen3MoeTopKRouter": _softmax_then_chosen,
    "OlmoeTopKRouter": _softmax_then_chosen,
    "MixtralTopKRouter": _softmax_then_chosen,
    "GptOssTopKRouter": _softmax_over_chosen,
}


class MoeLayer(NamedTuple):
    """One decoder layer's parts routing replay hooks: its attention (which receives the forward's keyword
    arguments, also in a gradient-checkpointing recompute), its router and its experts module."""

    attention: torch.nn.Module
    router: torch.nn.Module
    experts: torch.nn.Module


def moe_layers(model: torch.nn.Module) -> list[MoeLayer]:
    """Every MoE decoder layer of `model` (wrappers looked through), in order; [] for a model without them."""
    # One walk (pre-order: a decoder layer's modules follow it): each layer's first router and first module named
    # "...experts" below it. Routing replay looks for them at every training step.
    found = []
    layer, prefix, router, experts = None, "", None, None
    for name, module in [*model.named_modules(), ("", None)]:
        if layer is not None and (module is None or hasattr(module, "self_attn") or not name.startswith(prefix)):
            if router is not None and experts is not None:
                found.append(MoeLayer(layer.self_attn, router, experts))
            layer = None
        if module is None:
            break
        if hasattr(module, "self_attn"):
            layer, prefix, router, experts = module, f"{name}." if name else "", None, None
        elif layer is not None:
            if router is None and type(module).__name__ in ROUTER_COMBINE_WEIGHTS:
                router = module
            if experts is None and name.endswith("experts"):
                experts = module
    return found


def replay_blocker(model: torch.nn.Module) -> str | None:
    """Why routing replay cannot route `model`'s tokens to given experts, or None."""
    from .versions import version_gap

    if (gap := version_gap("moe_experts")) is not None:
        return f"below the documented floor `moe_experts` (docs/guide/versions.md): {gap}"
    config = getattr(model, "config", None)
    if config is None or not is_moe(config):
        return f"{type(model).__name__} is no mixture-of-experts model (it declares no experts and router)"
    if not moe_layers(model):
        routers = ", ".join(ROUTER_COMBINE_WEIGHTS)
        return f"its router is none of those routing replay knows ({routers}: transformers 5's Qwen3-MoE, OLMoE, Mixtral, gpt-oss)"
    return None


def combine_weights_at(router: torch.nn.Module, logits: torch.Tensor, experts: torch.Tensor, dtype) -> torch.Tensor:
    """The combine weights `router` gives the (tokens, k) `experts` from its (tokens, experts) `logits`, by its
    family's own formula (differentiable in the logits)."""
    return ROUTER_COMBINE_WEIGHTS[type(router).__name__](router, logits, experts, dtype)


# ---- resuming a full fine-tune: the checkpoint's per-expert weights into the fused experts ----------------------------

# The Trainer's file names for a full model's weights (transformers.utils: SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME).
SAFE_WEIGHTS, SAFE_WEIGHTS_INDEX = "model.safetensors", "model.safetensors.index.json"


def _checkpoint_files(folder: str) -> list[str]:
    """The safetensors files holding a full model's weights in `folder` (one file or the shards of its index)."""
    single, index = os.path.join(folder, SAFE_WEIGHTS), os.path.join(folder, SAFE_WEIGHTS_INDEX)
    if os.path.isfile(single):
        return [single]
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as handle:
            shards = sorted(set(json.load(handle)["weight_map"].values()))
        return [os.path.join(folder, shard) for shard in shards]
    return []


def _saved_conversions(model) -> list | None:
    """The weight conversions `save_pretrained` reverted when it wrote `model`'s checkpoint (chosen as
    `revert_weight_conversion` chooses them), or None where there are none."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange

    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:
        conversions = [
            c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)
        ]
    return conversions or None


def converted_checkpoint_load(model: torch.nn.Module, folder: str) -> Any | None:
    """Load the full-model checkpoint in `folder` into `model` (a transformers model, not wrapped) through the weight
    conversion its names need, in place (the parameters stay the objects the optimizer and hooks hold); returns
    `load_state_dict`'s result (missing keys; keys the conversion finds no place for are dropped, not reported). None,
    loading nothing, where transformers' own `_load_from_checkpoint` loads it right: every saved name is one of the
    model's, no weights file in safetensors, a wrapped or PEFT model, transformers 4 (no conversions)."""
    try:
        from safetensors import safe_open
        from safetensors.torch import load_file
        from transformers import PreTrainedModel
        from transformers.integrations.deepspeed import _apply_weight_conversions_to_state_dict
    except ImportError:  # transformers 4.x: checkpoints hold the names the model has
        return None
    files = _checkpoint_files(folder)
    if not isinstance(model, PreTrainedModel) or not files:
        return None
    saved: set[str] = set()
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as handle:
            saved.update(handle.keys())
    model_keys = set(model.state_dict())
    conversions = _saved_conversions(model)
    if saved <= model_keys or conversions is None:
        return None
    state_dict: dict[str, torch.Tensor] = {}
    for file in files:
        state_dict.update(load_file(file, device="cpu"))
    loaded: set[str] = set()
    for piece in _apply_weight_conversions_to_state_dict(model, state_dict, conversions):
        model.load_state_dict(piece, strict=False)
        loaded.update(piece)
    return torch.nn.modules.module._IncompatibleKeys(sorted(model_keys - loaded), [])


def experts_converted_on_resume() -> Callable:
    """A GRPOTrainer's `_load_from_checkpoint` (transformers' Trainer method, which TRL inherits): a full fine-tune's
    checkpoint loaded through `converted_checkpoint_load` where its names need the conversion, what it loaded reported
    with transformers' own warnings (`_issue_warnings_after_load`); any other checkpoint by TRL's method."""
    import trl

    def _load_from_checkpoint(trainer, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        result = converted_checkpoint_load(trainer.model if model is None else model, resume_from_checkpoint)
        if result is None:
            return trl.GRPOTrainer._load_from_checkpoint(trainer, resume_from_checkpoint, model)
        trainer._issue_warnings_after_load(result)

    return _load_from_checkpoint
