"""Counting one step of a spec on the fake accelerator (`grpo_plus.fit.memory`): the training pass of a micro-batch
through the trainer's own `_compute_loss`, generation's prefill and decode step, at 1 and 2 decoder layers extended to
the model's depth; the weights, gradients and optimizer state from the shapes; the worst step's peak (`estimate`).

A vision-language model's pictures (`PromptImages`) go through its own vision tower, counted at a few blocks: in the
training pass, where the input-gradient hook of LoRA with checkpointing (`enable_input_require_grads`, which reaches
the tower's patch embedding) makes every block keep its input for backward, at 2 and 3 blocks extended to its depth
(`TRAINING_VISION_BLOCKS`); in generation, where nothing is kept, at two (`GENERATION_VISION_BLOCKS`)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
from dataclasses import dataclass

import torch

from ..compat.model import cache_argument_name
from ..compat.moe import expert_weight_ids, four_bit_linear_weights
from ..compat.torch import FAKE_ACCELERATOR, fake_accelerator, new_fake_mode
from ..long_completions.lm_head_tiles import size_lm_head_tiles
from .attention import CpuAttentionKernels, CudaAttentionKernels
from .memory import (
    MemoryCounter,
    SavedBytes,
    accelerator_autocast,
    distinct_mlp_tiles,
    fake_inputs,
    fake_parameters,
    fused_lm_head_counting,
    on_values,
    readable_values,
    storage_addresses,
    tensors_from_data,
)
from .results import PassMemory, StepEstimate
from .spec import FitSpec, for_side, known_config, offloading_uncountable

# ---- fake models and batches ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PromptImages:
    """The pictures of a count's prompts, laid out as a Qwen-VL processor makes them: in each prompt, from its second
    token, per picture `<|vision_start|>`, `tokens` image tokens, `<|vision_end|>`; beside the ids, `pixel_values`
    (one row of `patch_values` per vision patch), `image_grid_thw` (1, height, width in patches) per picture,
    `mm_token_type_ids` (1 on image tokens) and `num_images` per row, as TRL hands them to `_compute_loss`."""

    per_prompt: int
    grid: tuple[int, int]
    tokens: int
    patch_values: int  # channels x temporal_patch_size x patch_size^2
    start_id: int
    image_id: int
    end_id: int

    @classmethod
    def of(cls, spec: FitSpec, config) -> PromptImages | None:
        """The spec's pictures (None without any), for its model's `config`."""
        if not spec.images_per_prompt:
            return None
        vision = config.vision_config
        channels = getattr(vision, "in_channels", None) or getattr(vision, "in_chans", 3)
        patch_values = channels * vision.temporal_patch_size * vision.patch_size**2
        return cls(spec.images_per_prompt, spec.image_grid, spec.image_tokens, patch_values,
                   config.vision_start_token_id, config.image_token_id, config.vision_end_token_id)  # fmt: skip

    @property
    def first_special(self) -> int:
        """Text tokens are drawn below this id (the vision tokens are among the last of the vocabulary)."""
        return min(self.start_id, self.image_id, self.end_id)

    def place(self, prompts: torch.Tensor) -> None:
        """Write the pictures' tokens into `prompts` (rows, prompt length), from its second column."""
        width = 1 + self.per_prompt * (self.tokens + 2)
        if prompts.shape[1] < width:
            raise ValueError(f"a prompt of {prompts.shape[1]} tokens cannot hold {self.per_prompt} pictures of "
                             f"{self.tokens} image tokens")  # fmt: skip
        column = 1
        for _ in range(self.per_prompt):
            prompts[:, column] = self.start_id
            prompts[:, column + 1 : column + 1 + self.tokens] = self.image_id
            prompts[:, column + 1 + self.tokens] = self.end_id
            column += self.tokens + 2

    def inputs(self, ids: torch.Tensor, real: bool = False) -> dict:
        """The image inputs of rows whose ids (prompt, or prompt and completion) are `ids`, one set of pictures per
        row. `pixel_values` reads zeros (a real tensor with `real`, else a broadcast zero that takes no memory: the
        count reads only its shape)."""
        rows, images = ids.shape[0], ids.shape[0] * self.per_prompt
        shape = (images * self.grid[0] * self.grid[1], self.patch_values)
        pixel_values = torch.zeros(shape) if real else torch.zeros(()).expand(shape)
        return {
            "pixel_values": pixel_values,
            "image_grid_thw": torch.tensor([[1, *self.grid]] * images),
            "mm_token_type_ids": (ids == self.image_id).long(),
            "num_images": [self.per_prompt] * rows,
        }


def synthetic_prompts(groups: int, prompt_length: int, vocab_size: int, generator: torch.Generator,
                      first_token: int = 3, images: PromptImages | None = None) -> torch.Tensor:  # fmt: skip
    """(groups, prompt_length) random prompt ids, with `images`' tokens placed where a processor puts them."""
    high = vocab_size if images is None else min(vocab_size, images.first_special)
    prompts = torch.randint(first_token, high, (groups, prompt_length), generator=generator)
    if images is not None:
        images.place(prompts)
    return prompts


def synthetic_micro_batch(rows: int, group_size: int, prompt_length: int, completion_length: int, vocab_size: int,
                          seed: int = 0, first_token: int = 3, padded: bool = False,
                          reference: bool = False, images: PromptImages | None = None,
                          real_images: bool = False) -> dict:  # fmt: skip
    """A training micro-batch as TRL's `_prepare_inputs` hands it to `_compute_loss`, worst case for memory: `rows` rows
    in groups of `group_size` consecutive rows sharing a prompt, every completion `completion_length` tokens long (no
    EOS, no padding), every advantage non-zero; `padded`: the first group's prompt is one token shorter (left
    padding, as TRL pads prompts of different lengths); `reference`: with the reference model's log-probs (beta > 0:
    the KL term); `images`: each prompt with its pictures (every row carries its own copy, as in TRL's batch)."""
    generator = torch.Generator().manual_seed(seed)
    groups = -(-rows // group_size)
    prompts = synthetic_prompts(groups, prompt_length, vocab_size, generator, first_token, images)
    prompt_ids = prompts.repeat_interleave(group_size, dim=0)[:rows]
    completion_ids = synthetic_prompts(rows, completion_length, vocab_size, generator, first_token)
    if images is not None:  # no token a processor reserves for pictures
        completion_ids = completion_ids.clamp(max=images.first_special - 1)
    completion_mask = torch.ones(rows, completion_length, dtype=torch.long)
    advantages = torch.randn(rows, generator=generator)
    advantages[advantages == 0] = 1.0
    prompt_mask = torch.ones_like(prompt_ids)
    if padded and prompt_length > 1:
        prompt_mask[:group_size, 0] = 0
        prompt_ids[:group_size, 0] = 0
    batch = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": advantages,
        "num_items_in_batch": completion_mask.sum().float(),
    }
    if reference:
        batch["ref_per_token_logps"] = -torch.rand(rows, completion_length, generator=generator)
    if images is not None:
        batch.update(images.inputs(torch.cat([prompt_ids, completion_ids], dim=1), real=real_images))
    return batch


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


def build_policy(spec: FitSpec, layers: int | None, fake_mode=None, device: str = "cpu", seed: int = 0,
                 vision_blocks: int | None = None):  # fmt: skip
    """The policy as TRL sets it up, at `layers` decoder layers (a VLM's vision tower at `vision_blocks`,
    `FitSpec.config`): LoRA through PEFT, TRL's fused LM head on the base model, gradient checkpointing
    (non-reentrant) with input grads enabled, grpo_plus's tiled MLP when the spec asks. Fake weights on `device` with
    `fake_mode`, random real ones (on the CPU) without.

    A 4-bit base (`four_bit`) is what `prepare_model_for_kbit_training` leaves (everything but the quantized linear
    layers in fp32, LoRA weights in bf16 as TRL converts them), with bf16 stand-ins for the 4-bit linear layers: a
    bitsandbytes 4-bit matmul keeps only the quantized weight for backward, as a frozen bf16 layer keeps only its
    weight; the transient dequantized weight is added separately (`static_bytes`)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from ..long_completions.tiled_mlp import tile_mlps

    torch.manual_seed(seed)
    dtype = getattr(torch, spec.weights_dtype)
    auto = AutoModelForImageTextToText if spec.vision_language else AutoModelForCausalLM  # as TRL loads them
    with torch.device("meta") if fake_mode is not None else contextlib.nullcontext():
        model = auto.from_config(spec.countable_config(layers, vision_blocks), dtype=dtype)
    if spec.four_bit:  # what the recipe's preparation leaves: an MoE's experts stay in the weights' dtype
        kept = four_bit_linear_weights(model) | expert_weight_ids(model)
        for param in model.parameters():
            if id(param) not in kept:
                param.data = param.data.float()
    if spec.lora is not None:
        model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **spec.lora))
        if spec.four_bit:
            for param in model.parameters():
                if param.requires_grad:
                    param.data = param.data.to(torch.bfloat16)
    _add_fused_lm_head(model, spec)
    if spec.lm_head_tile_columns is not None:
        size_lm_head_tiles(model, spec.lm_head_tile_columns)
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
    """A (TRL or grpo_plus) GRPOTrainer with the spec's objective (`spec.loss`), built once per process on a tiny model;
    only its `_compute_loss` is used, handed the fake model to run (nothing of the tiny model enters it). Its `bf16` is the
    spec's (grpo_plus reads the field); the autocast a count runs under is the count's own (`counting`), not read from
    accelerate, which keeps one state per process."""
    # What makes it a counting trainer (a tiny CPU run, no engine), over the config's objective.
    own = dict(
        use_cpu=True, bf16=spec.mixed_precision == "bf16", fp16=False, per_device_train_batch_size=2,
        num_generations=2, max_completion_length=8, steps_per_generation=None, use_vllm=False,
        gradient_checkpointing=False, report_to="none", save_strategy="no", disable_tqdm=True, logging_steps=1, seed=0,
    )  # fmt: skip
    objective = {name: value for name, value in spec.loss.items() if name not in own}
    key = (side, spec.mixed_precision, json.dumps(objective, sort_keys=True, default=str))
    if key in _TRAINERS:
        _keep_accelerate_state()
        return _TRAINERS[key]
    import tempfile

    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    import grpo_plus

    package = trl if side == "trl" else grpo_plus
    config = known_config("tiny-qwen2")
    args = package.GRPOConfig(output_dir=tempfile.mkdtemp(prefix="grpo-plus-fit-"), **objective, **own)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if args.beta != 0.0:  # TRL then takes the reference from the adapter-disabled model instead of loading one
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=1, target_modules=["q_proj"]))
    with quiet():
        trainer = package.GRPOTrainer(
            model=model,
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


# The loggers of the training code a count runs: grpo_plus's (fit's own logs nothing while it counts) and TRL's.
_TRAINING_LOGGERS = ("grpo_plus", "trl")


@contextlib.contextmanager
def quiet():
    """Within the block a count logs nothing but errors: it runs training code (transformers' models, TRL's and
    grpo_plus's trainers, grpo_plus's tiled MLP), whose warnings and one-time notes ("tiled_mlp_tokens='auto': ...")
    belong to a training run, not to a count. Every count runs in it (`measure_pass`, `measure_generation`)."""
    import warnings

    import transformers

    previous = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    training_loggers = [logging.getLogger(name) for name in _TRAINING_LOGGERS]
    levels = [each.level for each in training_loggers]
    for each in training_loggers:
        each.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        transformers.logging.set_verbosity(previous)
        for each, level in zip(training_loggers, levels, strict=True):
            each.setLevel(level)


# ---- counting -------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def counting(counter: MemoryCounter, trainer, device: str, mixed: str, lm_head: str = "cuda",
             kernels: list | None = None):  # fmt: skip
    """What a count of the training pass runs inside (grpo_plus.fit.memory's patches, grpo_plus.fit.attention's
    kernels). `lm_head="cpu"` counts a CPU's LM-head fold and attention kernel (what a CPU's real peak is checked
    against), "cuda" a GPU's."""
    kernels_of = CpuAttentionKernels if lm_head == "cpu" else CudaAttentionKernels
    attention = kernels_of() if device == FAKE_ACCELERATOR else contextlib.nullcontext()
    if kernels is not None and isinstance(attention, CudaAttentionKernels):
        attention.kernels = kernels
    with (
        # Backward in this thread: autograd sizes its per-device worker threads once per process, before a stand-in
        # accelerator registered later exists, and an error in a worker thread would abort the process.
        torch.autograd.set_multithreading_enabled(False),
        tensors_from_data(counter),
        fused_lm_head_counting(counter, lm_head),
        distinct_mlp_tiles(counter.fake_mode is not None),
        accelerator_autocast(trainer, device, mixed),
        storage_addresses(),
        readable_values(),
        attention,
        counter,
    ):
        yield


@quiet()
def measure_pass(spec: FitSpec, side: str, layers: int, rows: int | None = None, group: int | None = None,
                 real: bool = False, lm_head: str = "cuda", at_peak: list | None = None,
                 around=contextlib.nullcontext, kernels: list | None = None,
                 vision_blocks: int | None = None) -> PassMemory:  # fmt: skip
    """Count one micro-batch's `_compute_loss` forward + backward of `side` at `layers` decoder layers (a VLM's
    vision tower with `vision_blocks` blocks, `FitSpec.config`; its own depth by default), with the
    trainable weights' gradients already allocated (as from the second micro-batch on: their bytes are static).

    `real=True` computes it for real on the CPU instead (random weights), counted by the same counter: what the fake
    count is checked against (its counts are the CPU's, reported as the accelerator's). `lm_head`: see
    `grpo_plus.fit.memory.fused_lm_head_counting` ("cpu" to count the fold TRL runs where there is no Triton).
    `at_peak`: a list to fill with (bytes, what made them) of the accelerator storages alive at the peak. `around`: a
    context manager factory entered around the forward + backward alone (a profiler, for the validation). `kernels`: a
    list to fill with the attention kernels the pass ran (on the stand-in accelerator: flash, efficient, math)."""
    spec = for_side(spec, side)
    rows = rows or spec.rows
    plain = not real and lm_head == "cuda" and at_peak is None and around is contextlib.nullcontext and kernels is None
    plain = plain and _PASSES is not None
    key = (side, _training_key(spec), layers, rows, group, vision_blocks)
    if plain and key in _PASSES:
        return _PASSES[key]
    device = "cpu" if real else fake_accelerator()
    fake_mode = None if real else new_fake_mode()
    trainer = counting_trainer(side, spec)
    model = build_policy(spec, layers, fake_mode, device, vision_blocks=vision_blocks)
    with fake_mode or contextlib.nullcontext():
        for param in model.parameters():
            if param.requires_grad:
                param.grad = torch.zeros_like(param)
    config = spec.config(layers, vision_blocks)
    batch = synthetic_micro_batch(
        rows,
        min(group or spec.num_generations, rows),
        spec.prompt_length,
        spec.completion_tokens,
        config.get_text_config().vocab_size,
        padded=spec.padded_prompts,
        reference=spec.loss.get("beta", 0.0) != 0.0,
        images=PromptImages.of(spec, config),
        real_images=real,
    )
    inputs = batch if real else fake_inputs(batch, fake_mode, device)
    counter = MemoryCounter(fake_mode)
    if at_peak is not None:
        counter.describe = {}
    _rope_index_on_values(model, counter)
    saved = SavedBytes(counter)
    with around(), counting(counter, trainer, device, spec.mixed_precision, lm_head, kernels):
        offload = contextlib.nullcontext()
        hooks = torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack)
        if spec.activation_offloading and not real:
            from ..long_completions.offloading import offloading_context

            if (reason := offloading_uncountable()) is not None:
                raise ValueError(f"grpo-plus fit cannot count activation_offloading=True here: {reason}")

            # Pageable host memory: the same bytes as pinned, and the stand-in accelerator has no pinned allocator (TRL
            # pins a saved tensor with broadcast strides, e.g. an attention bias, through torch.empty(pin_memory=True)).
            offload, hooks = offloading_context(model, device, pin_memory=False), contextlib.nullcontext()
        with offload:
            with hooks:
                loss = trainer._compute_loss(model, dict(inputs))
            saved_bytes, after_forward, forward_peak = saved.bytes, counter.live, counter.peak
            loss.backward()
            del loss
    if at_peak is not None:
        at_peak.extend(counter.at_peak)
    counted = PassMemory(saved_bytes, after_forward, forward_peak, counter.peak, counter.live, counter.host_peak,
                         counter.items_faked)  # fmt: skip
    if plain:
        _PASSES[key] = counted
    return counted


def _rope_index_on_values(model, counter: MemoryCounter) -> None:
    """A fake count of a model with M-RoPE (Qwen-VL) computes its `get_rope_index` on the ids' values
    (`grpo_plus.fit.memory.on_values`): both trainers call it on this model instance (TRL through the model's forward,
    grpo_plus's shared-prompt pass directly)."""
    from ..zero_waste.images import base_model

    inner = getattr(base_model(model), "model", None)
    if counter.fake_mode is not None and hasattr(inner, "get_rope_index"):
        inner.get_rope_index = on_values(counter, type(inner).get_rope_index.__get__(inner))


# Counts made within `remembered_counts()`, by what they depend on: a report asks for the same count more than once (a
# training pass does not depend on generation's settings, generation not on the training pass's), and a count takes
# seconds. None outside it: every count is made afresh.
_PASSES: dict[tuple, PassMemory] | None = None
_GENERATIONS: dict[tuple, tuple[int, int, int]] | None = None


@contextlib.contextmanager
def remembered_counts():
    """Within the block, a count asked for again is not made again (what `grpo-plus fit` and the trainer's check
    run in)."""
    global _PASSES, _GENERATIONS
    previous = _PASSES, _GENERATIONS
    if _PASSES is None:
        _PASSES, _GENERATIONS = {}, {}
    try:
        yield
    finally:
        _PASSES, _GENERATIONS = previous


def _training_key(spec: FitSpec) -> str:
    """What a training pass count depends on: the spec less generation's own settings."""
    return spec.replace(generation_rows=0, offloaded_kv_cache=False, zero_waste_generation=True).to_json()


def _generation_key(spec: FitSpec) -> str:
    """What a generation count depends on: the spec less the training pass's own settings (the sampling temperature
    stays: the count draws a token)."""
    loss = {"temperature": spec.loss.get("temperature", 1.0)}
    return spec.replace(rows=0, gradient_checkpointing=False, tiled_mlp_tokens=None, activation_offloading=False,
                        optimizer_states=0.0, padded_prompts=True, loss=loss).to_json()  # fmt: skip


def extrapolate(points: list[PassMemory], depth: int, start: int = 1) -> PassMemory:
    """Counts at depths start, start + 1 extended to `depth` (affine in the depth)."""
    first, second = (dataclasses.asdict(p) for p in points[:2])
    return PassMemory(**{k: first[k] + (depth - start) * (second[k] - first[k]) for k in first})


# Vision blocks the training pass is counted with, extended to the tower's depth: each block keeps its input for
# backward (a constant per block), and every candidate for the peak (the tower's last block, forward or recomputed,
# the language model's pass) has every block's input alive, so each count is affine in the tower's depth too, with
# the kinds of its last blocks as the whole tower's (`FitSpec.config`).
TRAINING_VISION_BLOCKS = (2, 3)


def training_pass(spec: FitSpec, side: str, rows: int | None = None, group: int | None = None) -> PassMemory:
    """The training pass's counts at the model's full depth (from 1 and 2 decoder layers; a vision tower deeper than
    three blocks from TRAINING_VISION_BLOCKS)."""
    depth = spec.model_config["vision_config"]["depth"] if spec.vision_language and spec.images_per_prompt else 0
    if depth <= max(TRAINING_VISION_BLOCKS):
        points = [measure_pass(spec, side, layers, rows, group) for layers in (1, 2)]
    else:
        start = TRAINING_VISION_BLOCKS[0]
        points = [extrapolate([measure_pass(spec, side, layers, rows, group, vision_blocks=blocks)
                               for blocks in TRAINING_VISION_BLOCKS], depth, start) for layers in (1, 2)]  # fmt: skip
    return extrapolate(points, spec.layers)


@quiet()
def measure_generation(spec: FitSpec, layers: int, rows: int | None = None) -> tuple[int, int, int]:
    """(prefill peak, decode-step peak, KV cache) bytes of generation at `layers` decoder layers, every row alive at full length:
    the prefill of the prompts (each distinct prompt once with zero-waste generation) and one decode step with a
    KV cache of every row at the full length already there (transformers' DynamicCache, its bytes included), then
    the draw (temperature, softmax, multinomial over the vocabulary)."""
    rows = rows or spec.generation_rows
    if _GENERATIONS is None:
        return _measure_generation(spec, layers, rows)
    key = (_generation_key(spec), layers, rows)
    if key not in _GENERATIONS:
        _GENERATIONS[key] = _measure_generation(spec, layers, rows)
    return _GENERATIONS[key]


# Vision blocks a generation count builds: without gradients a block's output replaces its input, so the tower's
# memory does not grow with its depth, and one block of each attention kind meets its peak (module docstring).
GENERATION_VISION_BLOCKS = 2


def _measure_generation(spec: FitSpec, layers: int, rows: int) -> tuple[int, int, int]:
    from transformers.cache_utils import DynamicCache

    device = fake_accelerator()
    fake_mode = new_fake_mode()
    model = build_policy(spec.replace(gradient_checkpointing=False, tiled_mlp_tokens=None), layers, fake_mode, device,
                         vision_blocks=GENERATION_VISION_BLOCKS)  # fmt: skip
    model.eval()
    config = spec.config(layers, GENERATION_VISION_BLOCKS)
    text_config = config.get_text_config()
    # Zero-waste generation prefills each distinct prompt once (and encodes its pictures once); TRL every row.
    prefill_rows = -(-rows // spec.num_generations) if spec.zero_waste_generation else rows
    images = PromptImages.of(spec, config)
    prompt = synthetic_prompts(prefill_rows, spec.prompt_length, text_config.vocab_size, torch.Generator(),
                               images=images)  # fmt: skip
    prefill_inputs = fake_inputs({"input_ids": prompt, **({} if images is None else images.inputs(prompt))},
                                 fake_mode, device)  # fmt: skip
    trainer_stub = _AutocastStub(spec.mixed_precision, device)
    counter = MemoryCounter(fake_mode)
    with (
        torch.no_grad(),
        counting(counter, trainer_stub, device, spec.mixed_precision),
        trainer_stub.accelerator.autocast(),
    ):
        prefilled = model(**prefill_inputs, use_cache=True, logits_to_keep=1)[cache_argument_name()]
    prefill = counter.peak
    # The cache holds what the attention layers make: keys after rotary embedding (fp32 where the residual stream is,
    # as with a 4-bit base prepared by prepare_model_for_kbit_training), values from the projection.
    key_dtype, value_dtype = prefilled.layers[0].keys.dtype, prefilled.layers[0].values.dtype
    del prefilled
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    length = spec.prompt_length + spec.completion_tokens - 1
    shape = (rows, text_config.num_key_value_heads, length, head_dim)
    token = fake_inputs({"ids": torch.randint(3, text_config.vocab_size, (rows, 1))}, fake_mode, device)["ids"]
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
    key = spec.replace(rows=0, num_generations=0, generation_rows=0, prompt_tokens=0, completion_tokens=0,
                       images_per_prompt=0, image_size=(0, 0)).to_json()  # fmt: skip
    if key not in _STATIC:
        _STATIC[key] = _static_bytes(spec)
    return dict(_STATIC[key])


def _static_bytes(spec: FitSpec) -> dict:
    model = build_policy(spec.replace(gradient_checkpointing=False, tiled_mlp_tokens=None), None,
                         new_fake_mode(), "cpu")  # fmt: skip
    frozen = trainable = dequantized = 0
    seen = set()
    quantized = four_bit_linear_weights(model) if spec.four_bit else set()  # an MoE's router and experts: not these
    for param in model.parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        size = param.numel() * param.element_size()
        if param.requires_grad:
            trainable += size
        elif id(param) in quantized:
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


def estimate(spec: FitSpec, side: str, rows: int | None = None, group: int | None = None,
             generation_rows: int | None = None) -> StepEstimate:  # fmt: skip
    """The worst step's peak of `side` for `spec`."""
    spec = for_side(spec, side)
    static = static_bytes(spec)
    training = training_pass(spec, side, rows, group)
    return StepEstimate(side, spec, static, training, generation(spec, generation_rows))
