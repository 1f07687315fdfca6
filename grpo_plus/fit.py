"""Will a GRPO config fit the GPU? The worst step's peak, counted before step 1 from the config alone.

The worst step of a run is the one whose every completion reaches `max_completion_length` and whose every group has
signal (no row skipped). Its peak on the accelerator is

    static (weights, 4-bit where quantized; trainable weights, their gradients, the optimizer's state)
    + the largest of: generation (prefill, then the KV cache of every row at full length and one decode step),
                      the training pass of one micro-batch (forward + backward, counted).

Generation and the training pass are counted by running the real code on fake tensors (`grpo_plus.memory`): the
trainer's own `_compute_loss` (TRL's or grpo_plus's), transformers' model with the config's shapes, PEFT's LoRA layers,
TRL's fused LM head and activation offloading, on a fake accelerator, at 1 and 2 decoder layers, extrapolated to the
model's depth (decoder layers are identical, so every count is affine in the depth). What is not counted: the CUDA
context and cuBLAS / attention workspaces (outside `max_memory_allocated`), the allocator's block rounding and
fragmentation (`max_memory_reserved - max_memory_allocated`), bitsandbytes' dequantization buffers beyond one layer's
weight, and the host memory offloading uses. `DEFAULT_RESERVE_GIB` and `FRAGMENTATION` are the margins taken for them.

Sides: `trl` is stock `trl.GRPOTrainer` with the config's TRL settings; `grpo_plus` adds grpo_plus's own settings
(`activation_offloading`, `tiled_mlp_tokens`, the zero-waste pass). `with_memory_options` switches on every memory
setting a side has: for TRL gradient checkpointing and an offloaded KV cache for generation
(`generation_kwargs={"cache_implementation": "offloaded"}`), for grpo_plus also activation offloading and a tiled MLP.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import sys
import time
from dataclasses import dataclass, field

import torch

from .memory import (
    FAKE_ACCELERATOR,
    GIB,
    CudaAttentionKernels,
    MemoryCounter,
    PassMemory,
    SavedBytes,
    accelerator_autocast,
    fake_accelerator,
    fake_inputs,
    fake_parameters,
    fused_lm_head_counting,
    new_fake_mode,
    readable_values,
    storage_addresses,
    tensors_from_data,
)
from .trl_compat import cache_argument_name

logger = logging.getLogger(__name__)

SIDES = ("trl", "grpo_plus")
# Tensor memory a 24 GB card leaves after the CUDA context, cuBLAS workspaces and allocator slack.
CARD_RESERVE_GIB = 2.0
# When the trainer checks a real device: what max_memory_allocated does not see, kept free on top of the count.
DEFAULT_RESERVE_GIB = 1.0
FRAGMENTATION = 0.05  # share of the counted peak the caching allocator may hold in blocks it cannot reuse
LENGTH_STEP = 128  # completion lengths are searched in multiples of this
GROUP_LIMIT = 512  # the largest group the search tries
TILED_MLP_TOKENS = 4096  # what `with_memory_options` sets for grpo_plus
# GRPOConfig fields a training pass's memory depends on (the loss path), handed to the counting trainer as they are.
LOSS_FIELDS = (
    "loss_type", "importance_sampling_level", "epsilon", "epsilon_high", "delta", "beta", "top_entropy_quantile",
    "use_bias_correction_kl", "max_completion_length", "temperature", "cast_lm_head_to_fp32",
    "off_policy_mask_threshold", "mask_truncated_completions", "dual_clip", "zero_waste_pass",
    "zero_waste_shared_prompt",
)  # fmt: skip
GRPO_PLUS_ONLY = ("dual_clip", "zero_waste_pass", "zero_waste_shared_prompt")

# Architecture fields of the real models' config.json, so a count needs no download.
KNOWN_SHAPES: dict[str, tuple[str, dict]] = {
    "qwen2.5-0.5b": ("qwen2", dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        vocab_size=151936, rope_theta=1000000.0, tie_word_embeddings=True, max_position_embeddings=32768,
        rms_norm_eps=1e-6, sliding_window=32768, use_sliding_window=False, max_window_layers=21)),
    "qwen2.5-1.5b": ("qwen2", dict(
        hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        vocab_size=151936, rope_theta=1000000.0, tie_word_embeddings=True, max_position_embeddings=32768,
        rms_norm_eps=1e-6, sliding_window=32768, use_sliding_window=False, max_window_layers=21)),
    # The 7B's vocabulary is 152064 rows (its embedding is padded further than the smaller models').
    "qwen2.5-7b": ("qwen2", dict(
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        vocab_size=152064, rope_theta=1000000.0, tie_word_embeddings=False, max_position_embeddings=32768,
        rms_norm_eps=1e-6, sliding_window=131072, use_sliding_window=False, max_window_layers=28)),
    # SmolLM2-135M-Instruct, the embedded model (grpo_plus.app.embedded).
    "smollm2-135m": ("llama", dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        head_dim=64, vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True, max_position_embeddings=8192,
        rms_norm_eps=1e-5)),
    "tiny-qwen2": ("qwen2", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=512, rope_theta=1000000.0, tie_word_embeddings=True, max_position_embeddings=4096,
        rms_norm_eps=1e-6, use_sliding_window=False)),
}  # fmt: skip
KNOWN_MODELS = {
    **{f"Qwen/Qwen2.5-{size}{suffix}": f"qwen2.5-{size.lower()}" for size in ("0.5B", "1.5B", "7B")
       for suffix in ("", "-Instruct")},
    "HuggingFaceTB/SmolLM2-135M-Instruct": "smollm2-135m",
    "smollm2-135m-instruct": "smollm2-135m",
}  # fmt: skip


def known_config(name: str, **overrides):
    """The transformers config of a model in KNOWN_SHAPES, by shape name or hub id; None when unknown."""
    from transformers import AutoConfig

    shape = KNOWN_MODELS.get(name, name if name in KNOWN_SHAPES else None)
    if shape is None:
        return None
    model_type, fields = KNOWN_SHAPES[shape]
    config = AutoConfig.for_model(model_type, **{**fields, **overrides})
    config._attn_implementation = "sdpa"
    return config


# ---- what a count depends on ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FitSpec:
    """Everything the worst step's memory depends on, JSON-serializable (the trainer's check hands it to a child
    process). Build one with `FitSpec.from_args` (a GRPOConfig and a model) or directly."""

    model_config: dict  # transformers config.to_dict() (model_type included)
    weights_dtype: str  # "bfloat16", "float32", ...
    rows: int  # per_device_train_batch_size
    num_generations: int
    generation_rows: int  # rows generated at once on one process (per_device_train_batch_size x steps_per_generation)
    prompt_tokens: int
    completion_tokens: int
    lora: dict | None = None  # r, lora_alpha, target_modules, lora_dropout; None: every weight trains
    four_bit: bool = False  # bitsandbytes nf4 base (LoRA on top), prepared as prepare_model_for_kbit_training does
    gradient_checkpointing: bool = True
    mixed_precision: str = "bf16"  # "bf16", "fp16" or "no" (TRL's autocast)
    attn_implementation: str = "sdpa"
    loss: dict = field(default_factory=dict)  # GRPOConfig fields of LOSS_FIELDS
    optimizer_states: float = 2.0  # per trainable weight, in its dtype's bytes (AdamW: 2 moments)
    activation_offloading: bool = False
    tiled_mlp_tokens: int | None = None
    offloaded_kv_cache: bool = False
    zero_waste_generation: bool = True
    # Prompts of different lengths, so the micro-batch has left padding: TRL's forward then builds a [rows, 1, S, S]
    # attention mask (and attention kernels that take one). The worst case of a dataset whose prompts differ.
    padded_prompts: bool = True
    vllm_generates: bool = False  # use_vllm: the trainer's model never generates
    vllm_memory_fraction: float = 0.0  # the card's share a colocated vLLM engine takes (vllm_gpu_memory_utilization)
    vllm_quantization: str = "auto"  # what that engine serves the weights in (GRPOConfig.vllm_quantization)

    def replace(self, **changes) -> FitSpec:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> FitSpec:
        return cls(**json.loads(text))

    def config(self, layers: int | None = None):
        """The model's transformers config, at `layers` decoder layers (the model's own depth by default)."""
        from transformers import AutoConfig

        fields = {k: v for k, v in self.model_config.items() if k not in ("model_type", "transformers_version")}
        if layers is not None:
            fields["num_hidden_layers"] = layers
            if fields.get("max_window_layers") is not None:
                fields["max_window_layers"] = min(fields["max_window_layers"], layers)
            fields.pop("layer_types", None)  # recomputed from the sliding-window fields for the new depth
        fields.pop("_attn_implementation_autoset", None)
        config = AutoConfig.for_model(self.model_config["model_type"], **fields)
        config._attn_implementation = self.attn_implementation
        return config

    @property
    def layers(self) -> int:
        return int(self.model_config["num_hidden_layers"])

    @property
    def context_window(self) -> int | None:
        return self.model_config.get("max_position_embeddings")

    @classmethod
    def from_args(cls, args, model, prompt_tokens: int) -> FitSpec:
        """The spec of a trainer: `args` a (TRL or grpo_plus) GRPOConfig, `model` the policy as the trainer holds it
        (PEFT-wrapped, possibly 4-bit)."""
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        lora = None
        peft_config = getattr(model, "peft_config", None)
        if peft_config:
            adapter = next(iter(peft_config.values()))
            lora = lora_fields(adapter.r, adapter.lora_alpha, adapter.lora_dropout, adapter.target_modules)
        four_bit = bool(getattr(base, "is_loaded_in_4bit", False))
        dtype = next((p.dtype for p in base.parameters() if p.is_floating_point()), torch.float32)
        if four_bit:
            dtype = getattr(getattr(base.config, "quantization_config", None), "bnb_4bit_compute_dtype", None) or dtype
        return cls.from_config(args, base.config, dtype, lora, four_bit, prompt_tokens)

    @classmethod
    def from_config(cls, args, model_config, dtype, lora: dict | None, four_bit: bool, prompt_tokens: int) -> FitSpec:
        """The spec of a (TRL or grpo_plus) GRPOConfig `args` training a model of `model_config` in `dtype`."""
        mixed = "bf16" if args.bf16 else "fp16" if args.fp16 else "no"
        steps = args.steps_per_generation or args.gradient_accumulation_steps
        if lora is not None and getattr(args, "disable_dropout", False):  # TRL sets every dropout, LoRA's too, to 0
            lora = {**lora, "lora_dropout": 0.0}
        generation_kwargs = getattr(args, "generation_kwargs", None) or {}
        vllm = bool(getattr(args, "use_vllm", False))
        colocated = vllm and getattr(args, "vllm_mode", "colocate") == "colocate"
        return cls(
            model_config=model_config.to_dict(),
            weights_dtype=str(dtype).removeprefix("torch."),
            rows=args.per_device_train_batch_size,
            num_generations=args.num_generations,
            generation_rows=args.per_device_train_batch_size * steps,
            prompt_tokens=prompt_tokens,
            completion_tokens=args.max_completion_length,
            lora=lora,
            four_bit=four_bit,
            gradient_checkpointing=bool(args.gradient_checkpointing),
            mixed_precision=mixed,
            attn_implementation=getattr(model_config, "_attn_implementation", None) or "sdpa",
            loss={name: getattr(args, name) for name in LOSS_FIELDS if hasattr(args, name)},
            optimizer_states=optimizer_states(str(getattr(args, "optim", "adamw_torch"))),
            activation_offloading=bool(getattr(args, "activation_offloading", False)),
            tiled_mlp_tokens=getattr(args, "tiled_mlp_tokens", None),
            offloaded_kv_cache=generation_kwargs.get("cache_implementation") == "offloaded",
            zero_waste_generation=bool(getattr(args, "zero_waste_generation", True)),
            vllm_generates=vllm,
            vllm_memory_fraction=float(args.vllm_gpu_memory_utilization) if colocated else 0.0,
            vllm_quantization=str(getattr(args, "vllm_quantization", "auto")),
        )


def lora_fields(r: int, alpha: float, dropout: float, target_modules) -> dict:
    """The LoraConfig fields a count uses."""
    if isinstance(target_modules, (set, list, tuple)):
        target_modules = sorted(target_modules)
    return dict(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules)


def optimizer_states(optim: str) -> float:
    """Bytes of optimizer state per byte of trainable weight for a TrainingArguments `optim` (AdamW keeps two
    moments in the weight's dtype; 8-bit variants one byte per moment and weight; plain SGD none)."""
    optim = optim.lower().removeprefix("optimizernames.")
    if optim == "sgd":
        return 0.0
    if "8bit" in optim:
        return 0.5  # two one-byte moments per (typically fp32, 4-byte) weight
    return 2.0


def for_side(spec: FitSpec, side: str) -> FitSpec:
    """What `side` runs of `spec`: TRL leaves out grpo_plus's settings."""
    if side == "grpo_plus":
        return spec
    loss = {k: v for k, v in spec.loss.items() if k not in GRPO_PLUS_ONLY}
    return spec.replace(activation_offloading=False, tiled_mlp_tokens=None, loss=loss, zero_waste_generation=False)


def with_memory_options(spec: FitSpec, side: str) -> FitSpec:
    """`spec` with every memory setting `side` offers switched on (module docstring)."""
    spec = spec.replace(gradient_checkpointing=True, offloaded_kv_cache=True)
    if side == "grpo_plus":
        spec = spec.replace(activation_offloading=True, tiled_mlp_tokens=spec.tiled_mlp_tokens or TILED_MLP_TOKENS)
    return for_side(spec, side)


# ---- fake models and batches ----------------------------------------------------------------------------------------


def synthetic_micro_batch(rows: int, group_size: int, prompt_length: int, completion_length: int, vocab_size: int,
                          seed: int = 0, first_token: int = 3, padded: bool = False) -> dict:  # fmt: skip
    """A training micro-batch as TRL's `_prepare_inputs` hands it to `_compute_loss`, worst case for memory: `rows` rows
    in groups of `group_size` consecutive rows sharing a prompt, every completion `completion_length` tokens long (no
    EOS, no padding), every advantage non-zero; `padded`: the first group's prompt is one token shorter (left
    padding, as TRL pads prompts of different lengths)."""
    generator = torch.Generator().manual_seed(seed)
    groups = -(-rows // group_size)
    prompts = torch.randint(first_token, vocab_size, (groups, prompt_length), generator=generator)
    prompt_ids = prompts.repeat_interleave(group_size, dim=0)[:rows]
    completion_ids = torch.randint(first_token, vocab_size, (rows, completion_length), generator=generator)
    completion_mask = torch.ones(rows, completion_length, dtype=torch.long)
    advantages = torch.randn(rows, generator=generator)
    advantages[advantages == 0] = 1.0
    prompt_mask = torch.ones_like(prompt_ids)
    if padded and prompt_length > 1:
        prompt_mask[:group_size, 0] = 0
        prompt_ids[:group_size, 0] = 0
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": advantages,
        "num_items_in_batch": completion_mask.sum().float(),
    }


def word_tokenizer(vocab_size: int):
    """A tokenizer with exactly `vocab_size` ids: <pad> <eos> <bos>, then the words w3 .. w{vocab_size - 1} (one token
    per word, so a prompt written as "w5 w17 ..." has an exact length and any sampled id decodes)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<pad>",
        model_input_names=["input_ids", "attention_mask"],
    )  # fmt: skip


def build_policy(spec: FitSpec, layers: int | None, fake_mode=None, device: str = "cpu", seed: int = 0):
    """The policy as TRL sets it up, at `layers` decoder layers: LoRA through PEFT, TRL's fused LM head on the base
    model, gradient checkpointing (non-reentrant) with input grads enabled, grpo_plus's tiled MLP when the spec asks.
    Fake weights on `device` with `fake_mode`, random real ones (on the CPU) without.

    A 4-bit base (`four_bit`) is what `prepare_model_for_kbit_training` leaves (everything but the quantized linear
    layers in fp32, LoRA weights in bf16 as TRL converts them), with bf16 stand-ins for the 4-bit linear layers: a
    bitsandbytes 4-bit matmul keeps only the quantized weight for backward, as a frozen bf16 layer keeps only its
    weight; the transient dequantized weight is added separately (`static_bytes`)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from .tiled_mlp import tile_mlps

    torch.manual_seed(seed)
    dtype = getattr(torch, spec.weights_dtype)
    with torch.device("meta") if fake_mode is not None else contextlib.nullcontext():
        model = AutoModelForCausalLM.from_config(spec.config(layers), dtype=dtype)
    if spec.four_bit:
        quantized = {
            id(module.weight) for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head")
        }  # fmt: skip
        for param in model.parameters():
            if id(param) not in quantized:
                param.data = param.data.float()
    if spec.lora is not None:
        model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **spec.lora))
        if spec.four_bit:
            for param in model.parameters():
                if param.requires_grad:
                    param.data = param.data.to(torch.bfloat16)
    _add_fused_lm_head(model, spec)
    if fake_mode is not None:
        fake_parameters(model, fake_mode, device)
    if spec.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if spec.lora is not None:
            model.enable_input_require_grads()
    if spec.tiled_mlp_tokens:
        tile_mlps(model, spec.tiled_mlp_tokens)
    model.train()
    return model


def _add_fused_lm_head(model, spec: FitSpec) -> None:
    try:
        from trl.trainer.utils import add_fused_lm_head
    except ImportError:  # TRL 1.14: full logits
        return
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    temperature = spec.loss.get("temperature", 1.0)
    add_fused_lm_head(base, temperature=temperature, outputs=("log_probs", "entropy"))


# ---- the counting trainers ---------------------------------------------------------------------------------------------

_TRAINERS: dict = {}


def counting_trainer(side: str, spec: FitSpec):
    """A (TRL or grpo_plus) GRPOTrainer with the spec's loss settings, built once per process on a tiny model; only
    its `_compute_loss` is used, handed the fake model to run (nothing of the tiny model enters it). Its `bf16` is the
    spec's (grpo_plus reads the field); the autocast a count runs under is the count's own (`counting`), not read from
    accelerate, which keeps one state per process."""
    key = (side, spec.mixed_precision, json.dumps(spec.loss, sort_keys=True, default=str))
    if key in _TRAINERS:
        _keep_accelerate_state()
        return _TRAINERS[key]
    import tempfile

    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    import grpo_plus

    package = trl if side == "trl" else grpo_plus
    loss = {k: v for k, v in spec.loss.items() if k != "max_completion_length"}
    config = known_config("tiny-qwen2")
    args = package.GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="grpo-plus-fit-"), use_cpu=True, bf16=spec.mixed_precision == "bf16",
        fp16=False, per_device_train_batch_size=2, num_generations=2, max_completion_length=8,
        gradient_checkpointing=False, report_to="none", save_strategy="no", disable_tqdm=True, logging_steps=1, seed=0,
        **loss,
    )  # fmt: skip
    with _quiet():
        trainer = package.GRPOTrainer(
            model=AutoModelForCausalLM.from_config(config, dtype=torch.float32),
            reward_funcs=[_zero_reward],
            args=args,
            train_dataset=Dataset.from_list([{"prompt": "w3 w4"}] * 2),
            processing_class=word_tokenizer(config.vocab_size),
        )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    _TRAINERS[key] = trainer
    return trainer


def _keep_accelerate_state() -> None:
    """accelerate keeps one state per process, and building a TrainingArguments (a GRPOConfig, e.g. the next spec's)
    resets it: a counting trainer built earlier then cannot answer `accelerator.num_processes`. Bring it back on the
    CPU (a counting trainer never runs on a device)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    if not AcceleratorState._shared_state:
        Accelerator(cpu=True)


def _zero_reward(completions, **kwargs) -> list[float]:
    return [0.0] * len(completions)


@contextlib.contextmanager
def _quiet():
    """Building the counting trainer logs nothing a user needs (its tiny model, TRL's notes)."""
    import warnings

    import transformers

    previous = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        transformers.logging.set_verbosity(previous)


# ---- counting -------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def counting(counter: MemoryCounter, trainer, device: str, mixed: str, lm_head: str = "cuda",
             kernels: list | None = None):  # fmt: skip
    """What a count of the training pass runs inside (grpo_plus.memory's patches)."""
    attention = CudaAttentionKernels() if device == FAKE_ACCELERATOR else contextlib.nullcontext()
    if kernels is not None and isinstance(attention, CudaAttentionKernels):
        attention.kernels = kernels
    with (
        # Backward in this thread: autograd sizes its per-device worker threads once per process, before a stand-in
        # accelerator registered later exists, and an error in a worker thread would abort the process.
        torch.autograd.set_multithreading_enabled(False),
        tensors_from_data(counter),
        fused_lm_head_counting(counter, lm_head),
        accelerator_autocast(trainer, device, mixed),
        storage_addresses(),
        readable_values(),
        attention,
        counter,
    ):
        yield


def measure_pass(spec: FitSpec, side: str, layers: int, rows: int | None = None, group: int | None = None,
                 real: bool = False, lm_head: str = "cuda", at_peak: list | None = None,
                 around=contextlib.nullcontext, kernels: list | None = None) -> PassMemory:  # fmt: skip
    """Count one micro-batch's `_compute_loss` forward + backward of `side` at `layers` decoder layers, with the
    trainable weights' gradients already allocated (as from the second micro-batch on: their bytes are static).

    `real=True` computes it for real on the CPU instead (random weights), counted by the same counter: what the fake
    count is checked against (its counts are the CPU's, reported as the accelerator's). `lm_head`: see
    `grpo_plus.memory.fused_lm_head_counting` ("cpu" to count the fold TRL runs where there is no Triton). `at_peak`:
    a list to fill with (bytes, what made them) of the accelerator storages alive at the peak. `around`: a context
    manager factory entered around the forward + backward alone (a profiler, for the validation). `kernels`: a list to
    fill with the attention kernels the pass ran (on the stand-in accelerator: flash, efficient, math)."""
    spec = for_side(spec, side)
    rows = rows or spec.rows
    device = "cpu" if real else fake_accelerator()
    fake_mode = None if real else new_fake_mode()
    trainer = counting_trainer(side, spec)
    model = build_policy(spec, layers, fake_mode, device)
    with fake_mode or contextlib.nullcontext():
        for param in model.parameters():
            if param.requires_grad:
                param.grad = torch.zeros_like(param)
    config = spec.config(layers)
    batch = synthetic_micro_batch(
        rows,
        min(group or spec.num_generations, rows),
        spec.prompt_tokens,
        spec.completion_tokens,
        config.vocab_size,
        padded=spec.padded_prompts,
    )
    inputs = batch if real else fake_inputs(batch, fake_mode, device)
    counter = MemoryCounter(fake_mode)
    if at_peak is not None:
        counter.describe = {}
    saved = SavedBytes(counter)
    with around(), counting(counter, trainer, device, spec.mixed_precision, lm_head, kernels):
        offload = contextlib.nullcontext()
        hooks = torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack)
        if spec.activation_offloading and not real:
            from .offloading import offloading_context

            offload, hooks = offloading_context(model, device), contextlib.nullcontext()
        with offload:
            with hooks:
                loss = trainer._compute_loss(model, dict(inputs))
            saved_bytes, after_forward, forward_peak = saved.bytes, counter.live, counter.peak
            loss.backward()
            del loss
    if at_peak is not None:
        at_peak.extend(counter.at_peak)
    return PassMemory(saved_bytes, after_forward, forward_peak, counter.peak, counter.live, counter.host_peak,
                      counter.items_faked)  # fmt: skip


def extrapolate(points: list[PassMemory], depth: int, start: int = 1) -> PassMemory:
    """Counts at depths start, start + 1 extended to `depth` (affine in the depth)."""
    first, second = (dataclasses.asdict(p) for p in points[:2])
    return PassMemory(**{k: first[k] + (depth - start) * (second[k] - first[k]) for k in first})


def training_pass(spec: FitSpec, side: str, rows: int | None = None, group: int | None = None) -> PassMemory:
    """The training pass's counts at the model's full depth (from 1 and 2 decoder layers)."""
    points = [measure_pass(spec, side, layers, rows, group) for layers in (1, 2)]
    return extrapolate(points, spec.layers)


def measure_generation(spec: FitSpec, layers: int, rows: int | None = None) -> tuple[int, int, int]:
    """(prefill peak, decode-step peak, KV cache) bytes of generation at `layers` decoder layers, every row alive at full length:
    the prefill of the prompts (each distinct prompt once with zero-waste generation) and one decode step with a
    KV cache of every row at the full length already there (transformers' DynamicCache, its bytes included), then
    the draw (temperature, softmax, multinomial over the vocabulary)."""
    from transformers.cache_utils import DynamicCache

    rows = rows or spec.generation_rows
    device = fake_accelerator()
    fake_mode = new_fake_mode()
    model = build_policy(spec.replace(gradient_checkpointing=False, tiled_mlp_tokens=None), layers, fake_mode, device)
    model.eval()
    config = spec.config(layers)
    prefill_rows = -(-rows // spec.num_generations) if spec.zero_waste_generation else rows
    prompt = fake_inputs({"ids": torch.randint(3, config.vocab_size, (prefill_rows, spec.prompt_tokens))},
                         fake_mode, device)["ids"]  # fmt: skip
    trainer_stub = _AutocastStub(spec.mixed_precision, device)
    counter = MemoryCounter(fake_mode)
    with (
        torch.no_grad(),
        counting(counter, trainer_stub, device, spec.mixed_precision),
        trainer_stub.accelerator.autocast(),
    ):
        prefilled = model(input_ids=prompt, use_cache=True, logits_to_keep=1)[cache_argument_name()]
    prefill = counter.peak
    # The cache holds what the attention layers make: keys after rotary embedding (fp32 where the residual stream is,
    # as with a 4-bit base prepared by prepare_model_for_kbit_training), values from the projection.
    key_dtype, value_dtype = prefilled.layers[0].keys.dtype, prefilled.layers[0].values.dtype
    del prefilled
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    length = spec.prompt_tokens + spec.completion_tokens - 1
    shape = (rows, config.num_key_value_heads, length, head_dim)
    token = fake_inputs({"ids": torch.randint(3, config.vocab_size, (rows, 1))}, fake_mode, device)["ids"]
    counter = MemoryCounter(fake_mode)  # one counter for the cache and the step: the step frees cache storages
    with (
        torch.no_grad(),
        counting(counter, trainer_stub, device, spec.mixed_precision),
        trainer_stub.accelerator.autocast(),
    ):
        cache = DynamicCache(config=config)
        for layer in range(layers):
            cache.update(torch.empty(shape, dtype=key_dtype, device=device),
                         torch.empty(shape, dtype=value_dtype, device=device), layer)  # fmt: skip
        cache_bytes = counter.live
        logits = model(input_ids=token, use_cache=True, logits_to_keep=1, **{cache_argument_name(): cache}).logits
        scores = logits[:, -1, :].float() / max(spec.loss.get("temperature", 1.0), 1e-6)
        torch.multinomial(torch.softmax(scores, dim=-1), 1)
    return prefill, counter.peak, cache_bytes


class _AutocastStub:
    """A stand-in trainer for a generation count: its `accelerator.autocast()` is the autocast accelerate wraps the
    prepared model's forward in (generation runs under it too)."""

    class _Accelerator:
        def __init__(self, mixed: str, device: str):
            self.mixed_precision, self.device = mixed, device

        def autocast(self):
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.mixed_precision)
            return contextlib.nullcontext() if dtype is None else torch.autocast(self.device, dtype=dtype)

    def __init__(self, mixed: str, device: str):
        self.accelerator = self._Accelerator(mixed, device)


def generation(spec: FitSpec, rows: int | None = None) -> dict:
    """Generation's peak at full depth (module docstring); with an offloaded KV cache transformers keeps two layers
    of it on the device (the one being updated and the next, prefetched) instead of all of them. Nothing when vLLM
    generates (a colocated engine's memory is its share of the card, `card_budget`)."""
    if spec.vllm_generates:
        return {"prefill": 0, "decode": 0, "kv_cache_on_device": 0, "peak": 0}
    points = [measure_generation(spec, layers, rows) for layers in (1, 2)]
    prefill, decode, cache = (
        first + (spec.layers - 1) * (second - first) for first, second in zip(*points, strict=True)
    )
    if spec.offloaded_kv_cache:
        per_layer = points[1][2] - points[0][2]
        decode -= max(spec.layers - 2, 0) * per_layer
        cache = min(spec.layers, 2) * per_layer
    return {"prefill": prefill, "decode": decode, "kv_cache_on_device": cache, "peak": max(prefill, decode)}


def nf4_bytes(numel: int) -> int:
    """bitsandbytes nf4 with double quantization: 4 bits a weight, a uint8 absmax per 64-weight block, then per 256
    blocks an fp32 absmax of those, plus the 256-entry fp32 code and an fp32 offset."""
    blocks = math.ceil(numel / 64)
    return numel // 2 + blocks + 4 * math.ceil(blocks / 256) + 4 * 256 + 4


_STATIC: dict[str, dict] = {}


def static_bytes(spec: FitSpec) -> dict:
    """Bytes that stay for the whole run, from the model's shapes: frozen weights (nf4 where 4-bit), trainable
    weights, their gradients and the optimizer's state; for a 4-bit base also one dequantized weight (the largest
    linear layer, in bf16), which bitsandbytes makes for each matmul; without LoRA and with beta > 0, TRL's reference
    model (a second copy of the weights)."""
    key = spec.replace(rows=0, num_generations=0, generation_rows=0, prompt_tokens=0, completion_tokens=0).to_json()
    if key not in _STATIC:
        _STATIC[key] = _static_bytes(spec)
    return dict(_STATIC[key])


def _static_bytes(spec: FitSpec) -> dict:
    model = build_policy(spec.replace(gradient_checkpointing=False, tiled_mlp_tokens=None), None,
                         new_fake_mode(), "cpu")  # fmt: skip
    frozen = trainable = dequantized = 0
    seen = set()
    for name, param in model.named_parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        size = param.numel() * param.element_size()
        if param.requires_grad:
            trainable += size
        elif (
            spec.four_bit
            and name.endswith("weight")
            and param.dim() == 2
            and "lm_head" not in name
            and ("embed" not in name)
        ):
            frozen += nf4_bytes(param.numel())
            dequantized = max(dequantized, param.numel() * 2)
        else:
            frozen += size
    reference = frozen + trainable if spec.lora is None and spec.loss.get("beta", 0.0) > 0 else 0
    return {
        "weights": frozen,
        "trainable": trainable,
        "gradients": trainable,
        "optimizer": int(spec.optimizer_states * trainable),
        "reference_model": reference,
        "dequantized_layer": dequantized,
    }


# ---- the worst step -------------------------------------------------------------------------------------------------


@dataclass
class StepEstimate:
    """The worst step's peak of one side, per part (bytes)."""

    side: str
    spec: FitSpec
    static: dict
    training: PassMemory
    generation: dict
    seconds: tuple[float, float] | None = None  # (wall, CPU) of the trainer's check, when it ran one

    @property
    def static_total(self) -> int:
        return sum(self.static.values())

    @property
    def training_peak(self) -> int:
        return self.training.peak

    @property
    def total(self) -> int:
        return self.static_total + max(self.training_peak, self.generation["peak"])

    @property
    def binding(self) -> str:
        return "training pass" if self.training_peak >= self.generation["peak"] else "generation"

    def parts(self) -> dict[str, int]:
        static = self.static
        return {
            "weights": static["weights"] + static["reference_model"] + static["dequantized_layer"],
            "trainable weights + gradients + optimizer": static["trainable"]
            + static["gradients"]
            + static["optimizer"],
            "training pass (activations, peak)": self.training_peak,
            "generation (KV cache + step)": self.generation["peak"],
            "worst step": self.total,
        }


def estimate(spec: FitSpec, side: str, rows: int | None = None, group: int | None = None,
             generation_rows: int | None = None) -> StepEstimate:  # fmt: skip
    """The worst step's peak of `side` for `spec`."""
    spec = for_side(spec, side)
    static = static_bytes(spec)
    training = training_pass(spec, side, rows, group)
    return StepEstimate(side, spec, static, training, generation(spec, generation_rows))


def largest_within(cost, budget: int, low: int, high: int) -> int:
    """The largest n in [low, high] with cost(n) <= budget, for a cost that grows with n and is close to affine
    (every term of a step's peak is linear in the completion length or in the rows, or nearly): secant steps from the
    ends, then the answer's neighbours are checked, so the result is exact for any increasing cost. low - 1 when
    cost(low) > budget."""
    values: dict[int, float] = {}

    def at(n: int) -> float:
        if n not in values:
            values[n] = cost(n)
        return values[n]

    if at(low) > budget:
        return low - 1
    if at(high) <= budget:
        return high
    fit, over = low, high  # cost(fit) <= budget < cost(over)
    while over - fit > 1:
        slope = (at(over) - at(fit)) / (over - fit)
        guess = fit + int((budget - at(fit)) / slope) if slope > 0 else (fit + over) // 2
        guess = min(max(guess, fit + 1), over - 1)
        if at(guess) <= budget:
            fit = guess
            if guess + 1 < over and at(guess + 1) > budget:
                over = guess + 1
        else:
            over = guess
            if guess - 1 > fit and at(guess - 1) <= budget:
                fit = guess - 1
    return fit


def longest_completion(spec: FitSpec, side: str, budget: int) -> int:
    """The longest completion (a multiple of LENGTH_STEP, within the context window) whose worst step fits `budget`
    bytes at the spec's batch settings; 0 when not even LENGTH_STEP tokens fit."""
    window = spec.context_window or 2**17
    limit = max((window - spec.prompt_tokens) // LENGTH_STEP, 1)

    def cost(steps: int) -> int:
        return estimate(spec.replace(completion_tokens=steps * LENGTH_STEP), side).total

    return LENGTH_STEP * max(largest_within(cost, budget, 1, limit), 0)


def largest_group(spec: FitSpec, side: str, budget: int) -> int:
    """The largest G trained as one micro-batch (per_device_train_batch_size = G, one group generated at a time) whose
    worst step fits `budget` at the spec's completion length; 1 when not even G = 2 fits."""

    def cost(group: int) -> int:
        return estimate(spec.replace(rows=group, num_generations=group, generation_rows=group), side).total

    return largest_within(cost, budget, 2, GROUP_LIMIT)


def suggestions(spec: FitSpec, side: str, budget: int) -> list[str]:
    """Settings that would make `spec` fit `budget` on `side`, each checked by a count, cheapest change first."""
    candidates: list[tuple[str, FitSpec]] = []
    if not spec.gradient_checkpointing:
        candidates.append(("gradient_checkpointing=True", spec.replace(gradient_checkpointing=True)))
    if not spec.offloaded_kv_cache:
        candidates.append(('generation_kwargs={"cache_implementation": "offloaded"}',
                           spec.replace(offloaded_kv_cache=True)))  # fmt: skip
    if side == "grpo_plus":
        if not spec.activation_offloading:
            candidates.append(("activation_offloading=True", spec.replace(activation_offloading=True)))
        if not spec.tiled_mlp_tokens:
            candidates.append(
                (f"tiled_mlp_tokens={TILED_MLP_TOKENS}", spec.replace(tiled_mlp_tokens=TILED_MLP_TOKENS))
            )
    found, combined, names = [], spec, []
    for name, changed in candidates:
        if estimate(changed, side).total <= budget:
            found.append(name)
            return found
    for name, _ in candidates:  # all of them together
        names.append(name)
    if candidates:
        combined = with_memory_options(spec, side)
        if estimate(combined, side).total <= budget:
            return [" + ".join(names)]
    for rows in _halvings(spec.rows):
        fewer = combined.replace(rows=rows, generation_rows=max(rows, spec.generation_rows * rows // spec.rows))
        if estimate(fewer, side).total <= budget:
            prefix = " + ".join(names) + " + " if names else ""
            return [f"{prefix}per_device_train_batch_size={rows} (gradient_accumulation_steps x{spec.rows // rows})"]
    longest = longest_completion(combined, side, budget)
    if longest:
        return [f"max_completion_length={longest}" + (" with " + " + ".join(names) if names else "")]
    return []


def _halvings(rows: int) -> list[int]:
    out = []
    while rows > 1:
        rows //= 2
        out.append(rows)
    return out


# ---- the report (grpo-plus fit) ---------------------------------------------------------------------------------------


@dataclass
class FitReport:
    """What `grpo-plus fit` prints: per side, the worst step at the config's settings, the settings that would make it
    fit when it does not, and with every memory option the longest completion and the largest G that fit."""

    spec: FitSpec
    budget: int
    at_settings: dict[str, StepEstimate]
    fixes: dict[str, list[str]]
    longest: dict[str, int]
    largest_group: dict[str, int | None]
    seconds: float

    @property
    def length_limit(self) -> int | None:
        window = self.spec.context_window
        return None if window is None else (window - self.spec.prompt_tokens) // LENGTH_STEP * LENGTH_STEP


def fit_report(spec: FitSpec, budget: int, groups: bool = True) -> FitReport:
    """Count everything `grpo-plus fit` prints (module docstring); `groups=False` skips the largest-G searches."""
    started = time.perf_counter()
    at_settings = {side: estimate(spec, side) for side in SIDES}
    fixes = {side: suggestions(for_side(spec, side), side, budget) if at_settings[side].total > budget else []
             for side in SIDES}  # fmt: skip
    longest = {side: longest_completion(with_memory_options(spec, side), side, budget) for side in SIDES}
    largest = {side: largest_group(with_memory_options(spec, side), side, budget) if groups else None
               for side in SIDES}  # fmt: skip
    return FitReport(spec, budget, at_settings, fixes, longest, largest, time.perf_counter() - started)


def format_report(report: FitReport, source: str = "") -> str:
    """The report as `grpo-plus fit` prints it; the last line reads
    `longest completion: TRL N tokens, grpo_plus M tokens (M/N x)`."""
    spec = report.spec
    config = spec.config()
    lora = f"LoRA r={spec.lora['r']}" if spec.lora else "every weight trains"
    lines = [
        f"grpo-plus fit{': ' + source if source else ''} ({report.budget / GIB:.2f} GiB for tensors)",
        f"model: {config.model_type}, {spec.layers} layers, hidden {config.hidden_size}, {spec.weights_dtype}"
        f"{' in 4 bits (nf4)' if spec.four_bit else ''}, {lora}; {spec.rows} rows per micro-batch, G = "
        f"{spec.num_generations}, {spec.generation_rows} rows generated at once; {spec.prompt_tokens} prompt + "
        f"{spec.completion_tokens} completion tokens ({'prompts of different lengths' if spec.padded_prompts else 'prompts of one length'}); "
        f"gradient checkpointing {'on' if spec.gradient_checkpointing else 'off'}",
        "",
        f"worst step at the config's settings (GiB)       {'TRL':>9} {'grpo_plus':>10}",
    ]  # fmt: skip
    parts = {side: report.at_settings[side].parts() for side in SIDES}
    for name in parts["trl"]:
        lines.append(f"  {name:<45} {parts['trl'][name] / GIB:>9.2f} {parts['grpo_plus'][name] / GIB:>10.2f}")
    verdict = {side: "fits" if report.at_settings[side].total <= report.budget else "OVER" for side in SIDES}
    lines.append(f"  {'fits ' + format(report.budget / GIB, '.2f') + ' GiB':<45} {verdict['trl']:>9} "
                 f"{verdict['grpo_plus']:>10}")  # fmt: skip
    for side in SIDES:
        if report.at_settings[side].total > report.budget:
            fixes = report.fixes[side]
            lines.append(f"  settings that would make it fit with {'TRL' if side == 'trl' else 'grpo_plus'}: "
                         + ("; or ".join(fixes) if fixes else "none (a smaller model, fewer tokens, a larger GPU)"))  # fmt: skip
    options = (f"TRL: gradient_checkpointing + generation_kwargs cache_implementation='offloaded'; grpo_plus: also "
               f"activation_offloading + tiled_mlp_tokens={spec.tiled_mlp_tokens or TILED_MLP_TOKENS}")  # fmt: skip
    lines += ["", f"with every memory option ({options}), at the config's batch settings:"]
    limit = report.length_limit
    marks = {side: " (context window)" if limit and report.longest[side] >= limit else "" for side in SIDES}
    lines.append(f"  {'longest completion that fits (tokens)':<45} {str(report.longest['trl']) + marks['trl']:>9} "
                 f"{str(report.longest['grpo_plus']) + marks['grpo_plus']:>10}")  # fmt: skip
    if report.largest_group["trl"] is not None:
        groups = {side: (f">= {GROUP_LIMIT}" if report.largest_group[side] >= GROUP_LIMIT else
                         str(report.largest_group[side])) for side in SIDES}  # fmt: skip
        lines.append(f"  {'largest G in one micro-batch (at ' + str(spec.completion_tokens) + ' tokens)':<45} "
                     f"{groups['trl']:>9} {groups['grpo_plus']:>10}")  # fmt: skip
    if any(marks.values()):
        lines.append(f"  (context window: the model's max_position_embeddings {spec.context_window} less the "
                     f"{spec.prompt_tokens}-token prompt binds first)")  # fmt: skip
    lines.append(f"  counted in {report.seconds:.0f} s; not counted: CUDA context, kernel workspaces, allocator "
                 "fragmentation (kept outside the budget)")  # fmt: skip
    trl, ours = report.longest["trl"], report.longest["grpo_plus"]
    ratio = f"{ours / trl:.2f}x" if trl else "TRL fits none"
    lines += ["", f"longest completion: TRL {trl} tokens, grpo_plus {ours} tokens ({ratio})"]
    return "\n".join(lines)


# ---- the trainer's check --------------------------------------------------------------------------------------------


class FitCheckError(RuntimeError):
    """The worst step of this config does not fit the device's free memory (GRPOConfig.fit_check='error')."""


def card_budget(spec: FitSpec, card_bytes: int, reserve_bytes: int) -> int:
    """What the training side may use of a card of `card_bytes`: all of it but the reserve and, with colocated vLLM,
    the engine's share (`vllm_gpu_memory_utilization` of the card's total, which vLLM sizes its KV cache to fill)."""
    return int(card_bytes * (1 - spec.vllm_memory_fraction) - reserve_bytes)


def engine_weights(spec: FitSpec, card_bytes: int) -> tuple[str, int]:
    """(format, bytes) of a colocated vLLM engine's weights on a card of `card_bytes`: bfloat16, or fp8 where
    `vllm_quantization` asks for it or picks it for a 4-bit base ('auto', grpo_plus.vllm_sync; a GPU that runs
    vLLM's fp8 assumed)."""
    from .vllm_sync import VLLM_QUANTIZATION_AUTO, quantization_by_memory, served_weight_bytes

    sizes = served_weight_bytes(spec.config())
    chosen = spec.vllm_quantization
    if chosen == VLLM_QUANTIZATION_AUTO:
        engine = spec.vllm_memory_fraction * card_bytes
        chosen = quantization_by_memory(sizes["bfloat16"], engine, fp8_runs=True) if spec.four_bit else None
    return ("fp8", sizes["fp8"]) if chosen == "fp8" else ("bfloat16", sizes["bfloat16"])


def device_budget(device: torch.device, reserve_gib: float = DEFAULT_RESERVE_GIB) -> tuple[int, int]:
    """(bytes the run may still use on `device`: free memory plus what tensors hold now, less the reserve;
    bytes its tensors hold now)."""
    free, _ = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    return int(free + allocated - reserve_gib * GIB), allocated


def fits_message(estimate_: StepEstimate, budget: int, device: str) -> str:
    parts = ", ".join(f"{name} {value / GIB:.2f}" for name, value in estimate_.parts().items())
    return (
        f"the worst step (every completion {estimate_.spec.completion_tokens} tokens, every row alive) needs "
        f"{estimate_.total * (1 + FRAGMENTATION) / GIB:.2f} GiB on {device} ({parts} GiB, plus "
        f"{FRAGMENTATION:.0%} for allocator fragmentation); {budget / GIB:.2f} GiB are there"
    )


def check_fit(spec: FitSpec, budget: int, device: str, mode: str, timeout: float = 600.0) -> StepEstimate | None:
    """The trainer's check before step 1: count the worst step of grpo_plus in a child process (a crash or a hang of
    the count can never take the run down; it runs the fake stand-in accelerator there, CUDA hidden), then warn, or
    raise FitCheckError with `mode="error"`, when it exceeds `budget`, naming settings that would fit. Returns the
    estimate (None when the count could not run: logged, training goes on)."""
    import resource
    import subprocess

    started = time.perf_counter()
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = {**__import__("os").environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "grpo_plus.fit", "--budget", str(budget)]
    try:
        result = subprocess.run(command, input=spec.to_json(), capture_output=True, text=True, timeout=timeout,
                                env=env, check=False)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as error:
        logger.warning("grpo_plus fit check could not run (%s); training goes on unchecked.", error)
        return None
    if result.returncode != 0 or not result.stdout.strip():
        tail = (result.stderr or "").strip().splitlines()[-3:]
        logger.warning("grpo_plus fit check failed (exit %s: %s); training goes on unchecked.", result.returncode,
                       " | ".join(tail))  # fmt: skip
        return None
    report = json.loads(result.stdout.strip().splitlines()[-1])
    estimate_ = _estimate_from_report(spec, report)
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = cpu_after.ru_utime + cpu_after.ru_stime - cpu_before.ru_utime - cpu_before.ru_stime
    seconds = time.perf_counter() - started
    estimate_.seconds = (seconds, cpu)
    needed = estimate_.total * (1 + FRAGMENTATION)
    if needed <= budget:
        logger.info("grpo_plus fit check (%.0f s, %.0f s of CPU): %s.", seconds, cpu,
                    fits_message(estimate_, budget, device))  # fmt: skip
        return estimate_
    fixes = report.get("suggestions") or []
    advice = (f"Settings that would fit: {'; or '.join(fixes)}." if fixes else
              "No setting grpo_plus offers makes it fit: a smaller model, fewer tokens or a larger GPU.")  # fmt: skip
    message = f"grpo_plus fit check: {fits_message(estimate_, budget, device)}. {advice}"
    if mode == "error":
        raise FitCheckError(message + " (fit_check='warn' trains anyway; 'off' skips the check.)")
    logger.warning("%s Training goes on; it may run out of memory when completions reach the full length.", message)
    return estimate_


def prompt_lengths(dataset, processing_class, sample: int = 256) -> list[int]:
    """The lengths, in tokens, of the prompts among the first `sample` rows of `dataset` (chat prompts through the
    chat template with the generation prompt, as TRL tokenizes them); empty when they cannot be read."""
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    lengths: list[int] = []
    try:
        rows = dataset.select(range(min(sample, len(dataset)))) if hasattr(dataset, "select") else dataset
        for index, row in enumerate(rows):
            if index >= sample:
                break
            prompt = row["prompt"]
            if isinstance(prompt, list):
                ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
                ids = ids["input_ids"] if isinstance(ids, dict) else ids
            else:
                ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            lengths.append(len(ids))
    except Exception as error:  # a dataset or template this cannot read: the check goes on with a typical length
        logger.info("fit check: prompts not measured (%s); assuming 128 tokens of different lengths.", error)
        return []
    return lengths


def check_before_training(args, model, dataset, processing_class, device: torch.device,
                          mode: str) -> StepEstimate | None:  # fmt: skip
    """GRPOConfig.fit_check on a CUDA device: the worst step of this trainer against the device's free memory."""
    if model.config.get_text_config() is not model.config:  # a vision-language model: its tower is not counted
        logger.warning(
            "grpo_plus fit check: %s is a vision-language model; the count has no vision tower or image tokens yet, "
            "so training goes on unchecked (fit_check='off' skips this line).",
            type(model).__name__,
        )
        return None
    lengths = prompt_lengths(dataset, processing_class)
    spec = FitSpec.from_args(args, model, max(lengths, default=128))
    spec = spec.replace(padded_prompts=len(set(lengths)) != 1)
    budget, _ = device_budget(device)
    if spec.vllm_memory_fraction:  # the engine, started with the trainer, holds tensors of this process: not ours
        budget -= int(spec.vllm_memory_fraction * torch.cuda.mem_get_info(device)[1])
    return check_fit(spec, budget, str(device), mode)


def _estimate_from_report(spec: FitSpec, report: dict) -> StepEstimate:
    return StepEstimate("grpo_plus", spec, report["static"], PassMemory(**report["training"]), report["generation"])


def _child_main(argv: list[str]) -> int:
    """`python -m grpo_plus.fit --budget BYTES` < spec.json: the trainer's count, one JSON line on stdout."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", type=int, required=True)
    args = parser.parse_args(argv)
    spec = FitSpec.from_json(sys.stdin.read())
    with _quiet():
        result = estimate(spec, "grpo_plus")
        fixes = suggestions(spec, "grpo_plus", int(args.budget / (1 + FRAGMENTATION))) if (
            result.total * (1 + FRAGMENTATION) > args.budget
        ) else []  # fmt: skip
    print(json.dumps({"static": result.static, "training": dataclasses.asdict(result.training),
                      "generation": result.generation, "suggestions": fixes}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
