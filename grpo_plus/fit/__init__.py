"""Will a GRPO config fit the GPU? The worst step's peak, counted before step 1 from the config alone.

The worst step of a run is the one whose every completion reaches `max_completion_length` and whose every group has
signal (no row skipped). Its peak on the accelerator is

    static (weights, 4-bit where quantized; trainable weights, their gradients, the optimizer's state)
    + the largest of: generation (prefill, then the KV cache of every row at full length and one decode step),
                      the training pass of one micro-batch (forward + backward, counted).

Generation and the training pass are counted by running the real code on fake tensors (`grpo_plus.fit.memory`): the
trainer's own `_compute_loss` (TRL's or grpo_plus's), transformers' model with the config's shapes, PEFT's LoRA layers,
TRL's fused LM head and activation offloading, on a fake accelerator, at 1 and 2 decoder layers, extrapolated to the
model's depth (decoder layers are identical, so every count is affine in the depth). What is not counted: the CUDA
context and cuBLAS / attention workspaces (outside `max_memory_allocated`), the allocator's block rounding and
fragmentation (`max_memory_reserved - max_memory_allocated`), bitsandbytes' dequantization buffers beyond one layer's
weight, and the host memory offloading uses. `DEFAULT_RESERVE_GIB` and `FRAGMENTATION` are the margins taken for them.

A vision-language model (Qwen2-VL, Qwen2.5-VL: `IMAGE_FAMILIES`) is counted with its prompts' pictures
(`FitSpec.images_per_prompt`, `image_size`): the image tokens are in the prompt, and its own vision tower encodes the
pictures, in TRL's training pass and generation each row's (every picture G times), in grpo_plus's once per group.

Sides: `trl` is stock `trl.GRPOTrainer` with the config's TRL settings; `grpo_plus` adds grpo_plus's own settings
(`activation_offloading`, `tiled_mlp_tokens`, the zero-waste pass). `with_memory_options` switches on every memory
setting a side has: for TRL gradient checkpointing and an offloaded KV cache for generation
(`generation_kwargs={"cache_implementation": "offloaded"}`), for grpo_plus also activation offloading and a tiled MLP.

The package, along its seams: `spec` (what a count depends on), `count` (the counts), `search` (the longest completion,
the largest group, settings that fit, the report `grpo-plus fit` prints), `check` (the trainer's check, run in a child
process: `python -m grpo_plus.fit`), `results` (what a count answers), `memory` (counting on fake tensors),
`attention` (the attention kernel a count runs).

The names below load their module on first use: the trainer imports `grpo_plus.fit.check` alone, and the counting code
(fake tensors, 2.8k lines) loads in the child process that counts, not in the training process.
"""

from __future__ import annotations

import importlib

# Each public name, by the module that defines it (loaded when the name is first read).
_PUBLIC = {
    "check": (
        "CARD_RESERVE_GIB", "DEFAULT_RESERVE_GIB", "FRAGMENTATION", "FitCheckError", "card_budget",
        "check_before_training", "check_fit", "device_budget", "engine_weights", "prompt_lengths",
    ),
    "count": (
        "build_policy", "counting_trainer", "estimate", "extrapolate", "generation", "measure_generation",
        "measure_pass", "static_bytes", "synthetic_micro_batch", "training_pass",
    ),
    "results": ("GIB", "PassMemory", "StepEstimate"),
    "search": (
        "GROUP_LIMIT", "LENGTH_STEP", "FitReport", "automatic_options", "fit_report", "format_report", "largest_group",
        "largest_within", "longest_completion", "suggestions",
    ),
    "spec": (
        "DEFAULT_IMAGE_SIZE", "IMAGE_FAMILIES", "KNOWN_MODELS", "KNOWN_SHAPES", "SIDES", "TILED_MLP_TOKENS", "FitSpec",
        "for_side", "image_count_blocker", "known_config", "lora_fields", "optimizer_states", "resized_image",
        "with_memory_options",
    ),
}  # fmt: skip
_MODULE_OF = {name: module for module, names in _PUBLIC.items() for name in names}
_SUBMODULES = ("attention", "check", "count", "memory", "results", "search", "spec")

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name in _MODULE_OF:
        value = getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
        globals()[name] = value  # read once: later reads do not come here
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, *_SUBMODULES})
