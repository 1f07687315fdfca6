"""Training-pass memory without a GPU: stock TRL vs grpo_plus, counted from shapes and dtypes alone.

    .venv/bin/python benchmarks/memory.py [--quick] [--json outputs/bench-memory/memory.json]

What is counted, on TRL's and grpo_plus's real `_compute_loss` (both trainers built as usual; the micro-batch is a
synthetic generation batch as TRL's `_prepare_inputs` hands it over), forward + backward:
  saved      bytes autograd keeps for backward, as `torch.autograd.graph.saved_tensors_hooks` sees them at the end of
             the forward (distinct storages, weights and inputs left out). Under gradient checkpointing this is what
             the checkpoints keep (each layer's inputs) plus the saves outside the checkpointed layers.
  peak       the most bytes alive at once during forward + backward, over tensors the pass allocates (activations,
             temporaries, the LoRA gradients), weights and inputs left out: every storage an operator returns is
             added when it appears and removed when it is freed (a weakref finalizer on the storage, which fires when
             the last tensor, Python or autograd-held, lets go of it).
Both come from a TorchDispatchMode that sees every operator, so they do not depend on the hardware or its allocator
(no rounding to blocks, no fragmentation, no CUDA context, no kernel workspaces).

The big models are never computed: their weights are FakeTensors (torch._subclasses.fake_tensor: shape, dtype and
device, no data), so every operator runs its meta kernel and returns a fake result of the right shape and dtype.
The small index tensors grpo_plus's packing reads (which rows, which prompt) stay real; the block attention mask built
from them is built fake (it is [packs, 1, width, width]); `.item()` on a fake value returns 0 and a boolean index into
a small fake tensor runs on zeros (only the metrics read values in `_compute_loss`). The method is checked
against real compute on the same code at small shapes (`validate`): fake and real counts must agree to the byte, and
the real count must match the CPU allocator's own record of the run (torch.profiler's memory events).

TRL's fused LM head (TRL >= 1.15) folds each [4096 x 32768] logits tile into running statistics. On CUDA that fold is
a Triton kernel, which allocates nothing; on CPU TRL runs a torch fallback that allocates fp32 temporaries of the
tile. The figures model the CUDA kernel (`--lm-head cpu` counts the fallback instead).

Models: the demo config (recipes/configs/demo_cpu.yaml: SmolLM2-135M-Instruct's architecture, fp32, LoRA r=16, 16
rows of a 56-token prompt + 20 tokens), and Qwen2.5-shaped models (benchmarks/shapes.py) in bf16 with the recipes'
LoRA, at 512 / 2K / 8K-token completions, micro-batches of 8 completions of one 128-token prompt, gradient
checkpointing on and off; at 512 tokens also 8 rows cut from a shuffled generation batch of 4 prompts x 8, as TRL
cuts them. Every completion is full length and every group has signal (no zero-advantage row): the worst case.
Decoder layers are identical, so each count is affine in the depth: the models are counted at 1, 2 and 3 layers and
extrapolated (checked against the full depth, `validate_depth`).

The 24 GB fit (recipes/configs/*.yaml): the step's peak is weights (4-bit where the recipe quantizes, from the
shapes) + LoRA weights + AdamW's two moments + the larger of the training pass's counted peak and generation's KV
cache (a 4-bit base adds one dequantized layer); it must stay under --budget-gib (22 GiB: a 24 GiB card less the CUDA
context, cuBLAS workspaces and allocator slack, which max_memory_allocated does not count). Per side, the longest
completion (multiples of 128) at the recipe's batch, and the largest group G trained as one micro-batch
(per_device_train_batch_size = G, one group generated at a time) at the recipe's completion length.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from shapes import markdown_table, qwen2_config, recipe, synthetic_micro_batch, word_tokenizer  # benchmarks/shapes.py
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ROOT = Path(__file__).resolve().parents[1]

SIDES = ("trl", "ours")
GIB = 2**30
# A fake run stops on a real tensor this large (some code builds it from small real inputs: make it fake, see
# MemoryCounter.faking); a data-dependent operator runs on real zeros only for fake tensors smaller than this.
REAL_LIMIT = 2**24


def _storage_key(tensor: torch.Tensor):
    """(identity, bytes) of a tensor's storage, or None for tensors without one."""
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return storage._cdata, storage.nbytes(), storage


class MemoryCounter(TorchDispatchMode):
    """Bytes of the storages operators allocate while active: live now, and the most ever live at once.

    With a `fake_mode`, operators over fake tensors run fake; see the module docstring for the two exceptions.
    """

    def __init__(self, fake_mode=None):
        super().__init__()
        self.fake_mode = fake_mode
        self.live = 0
        self.peak = 0
        self.sizes: dict[int, int] = {}  # storage identity -> bytes, for the storages allocated while counting
        self.all_fake = False
        self.items_faked = 0
        self.on_release: list = []  # callbacks taking the identity of a storage that was freed

    def _release(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self.sizes.pop(key, None)
        for callback in self.on_release:
            callback(key)

    def _record(self, outputs, inputs) -> None:
        input_keys = {key[0] for key in map(_storage_key, inputs) if key is not None}
        for tensor in tree_leaves(outputs):
            if not isinstance(tensor, torch.Tensor):
                continue
            key = _storage_key(tensor)
            if key is None or key[0] in input_keys or key[0] in self.sizes:
                continue  # a view, an in-place result, or a storage that existed before counting began
            identity, nbytes, storage = key
            self.sizes[identity] = nbytes
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._release, identity, nbytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if self.fake_mode is not None:
            any_fake = any(self._is_fake(t) for t in tensors)
            if func is torch.ops.aten._local_scalar_dense.default and any_fake:
                self.items_faked += 1
                return False if args[0].dtype == torch.bool else 0
            if self.all_fake and not any_fake:
                outputs, fake_inputs = self._run_fake(func, args, kwargs)
                self._record(outputs, fake_inputs)  # a view of a converted input allocates nothing
                return outputs
        try:
            outputs = func(*args, **kwargs)
        except (DynamicOutputShapeException, DataDependentOutputException):
            outputs = self._run_on_zeros(func, args, kwargs)
        if self.fake_mode is not None:
            self._refuse_large_real(func, outputs)
        self._record(outputs, tensors)
        return outputs

    def _run_fake(self, func, args, kwargs):
        """The operator on fake copies of its (real) inputs: (outputs, the fake inputs)."""
        from torch.utils._pytree import tree_map

        converted = []

        def to_fake(value):
            if not isinstance(value, torch.Tensor):
                return value
            converted.append(self.fake_mode.from_tensor(value))
            return converted[-1]

        fake_args, fake_kwargs = tree_map(to_fake, args), tree_map(to_fake, kwargs)
        with self.fake_mode:
            return func(*fake_args, **fake_kwargs), converted

    def _refuse_large_real(self, func, outputs) -> None:
        """A fake run must not compute big tensors for real (it would take this machine's memory and time)."""
        for tensor in tree_leaves(outputs):
            if isinstance(tensor, torch.Tensor) and not self._is_fake(tensor) and tensor.numel() >= REAL_LIMIT:
                raise RuntimeError(
                    f"{func} made a real {tuple(tensor.shape)} tensor in a fake run: build it inside "
                    "MemoryCounter.faking() (see shared_prompt_mask_counting)"
                )

    def _run_on_zeros(self, func, args, kwargs):
        """A data-dependent operator (boolean indexing, nonzero) on small fake tensors, as in TRL's metric
        reductions: run on real zeros of the same shapes, and return its result as fake tensors."""
        from torch.utils._pytree import tree_map

        def to_zeros(value):
            if not self._is_fake(value):
                return value
            if value.numel() >= REAL_LIMIT:
                raise RuntimeError(f"{func} needs the values of a large fake tensor {tuple(value.shape)}")
            return torch.zeros(value.shape, dtype=value.dtype)

        outputs = func(*tree_map(to_zeros, args), **tree_map(to_zeros, kwargs))
        return tree_map(lambda v: self.fake_mode.from_tensor(v) if isinstance(v, torch.Tensor) else v, outputs)

    @staticmethod
    def _is_fake(tensor) -> bool:
        from torch._subclasses.fake_tensor import FakeTensor

        return isinstance(tensor, FakeTensor)

    @contextlib.contextmanager
    def faking(self):
        """Inside this block every operator runs fake, also on real inputs and for new tensors (torch.empty, ones)."""
        previous, self.all_fake = self.all_fake, self.fake_mode is not None
        try:
            yield
        finally:
            self.all_fake = previous


class SavedBytes:
    """saved_tensors_hooks adding up the distinct storages autograd saves that the counter saw being allocated, as
    long as they live (a branch of the graph that is dropped before the backward frees what it saved)."""

    def __init__(self, counter: MemoryCounter):
        self.counter, self.sizes, self.bytes = counter, {}, 0
        counter.on_release.append(self._released)

    def pack(self, tensor):
        key = _storage_key(tensor)
        if key is not None and key[0] in self.counter.sizes and key[0] not in self.sizes:
            self.sizes[key[0]] = key[1]
            self.bytes += key[1]
        return tensor

    @staticmethod
    def unpack(tensor):
        return tensor

    def _released(self, key: int) -> None:
        self.bytes -= self.sizes.pop(key, 0)


@contextlib.contextmanager
def fused_lm_head_counting(counter: MemoryCounter, lm_head: str):
    """TRL's chunked log-prob function with its buffers fake in a fake run (no real [4096 x 32768] tiles), and with
    the CPU fallback's fold replaced by nothing (`lm_head="cuda"`: the Triton kernel allocates nothing)."""
    from trl.kernels import chunked_logprob

    function = chunked_logprob.ChunkedLogProbFunction
    saved = {name: getattr(chunked_logprob, name) for name in ("_forward_tile", "_backward_tile", "_addmm_fp32")}
    forward, backward = function.forward, function.backward

    def counted(step):
        def run(ctx, *args, **kwargs):
            with counter.faking():
                return step(ctx, *args, **kwargs)

        return staticmethod(run)

    def allocates_nothing(*args, **kwargs):
        return None

    function.forward, function.backward = counted(forward), counted(backward)
    if lm_head == "cuda":
        for name in saved:
            setattr(chunked_logprob, name, allocates_nothing)
    try:
        yield
    finally:
        function.forward, function.backward = staticmethod(forward), staticmethod(backward)
        for name, value in saved.items():
            setattr(chunked_logprob, name, value)


@contextlib.contextmanager
def shared_prompt_mask_counting(counter: MemoryCounter):
    """grpo_plus's block attention mask, [packs, 1, width, width], is built from small real index tensors; in a fake
    run it is built fake."""
    from grpo_plus import train_pass

    original = train_pass.block_attention_mask

    def block_attention_mask(*args, **kwargs):
        with counter.faking():
            return original(*args, **kwargs)

    train_pass.block_attention_mask = block_attention_mask
    try:
        yield
    finally:
        train_pass.block_attention_mask = original


@dataclass
class PassMemory:
    saved: int  # bytes autograd saved for backward (distinct storages allocated by the pass)
    after_forward: int  # bytes alive when the forward returned (what the backward will need, plus the loss)
    forward_peak: int
    peak: int  # most bytes alive at once, forward and backward
    after_backward: int  # what stays: the LoRA gradients
    items_faked: int = 0

    def gib(self) -> dict:
        return {k: v / GIB for k, v in asdict(self).items() if k != "items_faked"}


def measure_pass(trainer, model, inputs: dict, fake_mode=None, lm_head: str = "cuda") -> PassMemory:
    """Count one `_compute_loss` forward + backward of `trainer` on `model` (the trainer's own model or a stand-in)."""
    model.zero_grad(set_to_none=True)
    counter = MemoryCounter(fake_mode)
    saved = SavedBytes(counter)
    with fused_lm_head_counting(counter, lm_head), shared_prompt_mask_counting(counter), counter:
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            loss = trainer._compute_loss(model, dict(inputs))
        saved_bytes, after_forward, forward_peak = saved.bytes, counter.live, counter.peak
        loss.backward()
        del loss
    result = PassMemory(saved_bytes, after_forward, forward_peak, counter.peak, counter.live, counter.items_faked)
    model.zero_grad(set_to_none=True)
    return result


def _zero_reward(completions, **kwargs) -> list[float]:
    return [0.0] * len(completions)


def lora_settings(recipe_name: str) -> dict:
    """LoraConfig fields of a recipe config (dropout 0: a benchmark compares passes, not regularisation)."""
    settings = recipe(recipe_name)
    return dict(
        r=settings["lora_r"],
        lora_alpha=settings["lora_alpha"],
        lora_dropout=0.0,
        target_modules=settings["lora_target_modules"],
        task_type="CAUSAL_LM",
    )


def build_trainer(side: str, *, bf16: bool, output_dir: Path):
    """Stock TRL's (`trl`) or grpo_plus's (`ours`) GRPOTrainer as a user builds it (LoRA through `peft_config`,
    loss_type dapo + clip-higher as in the recipes). Only its `_compute_loss` is used, and it is handed the model to
    run, so a stand-in of any size goes through TRL's and grpo_plus's own code. Nothing of the trainer's own (tiny)
    model, group size or batch size enters `_compute_loss`: the inputs' prompts make the groups."""
    import trl
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    import grpo_plus

    package = trl if side == "trl" else grpo_plus
    torch.manual_seed(0)
    config = qwen2_config("tiny-qwen2")
    args = package.GRPOConfig(
        output_dir=str(output_dir), use_cpu=True, bf16=bf16, per_device_train_batch_size=2, num_generations=2,
        max_completion_length=8, gradient_checkpointing=False, loss_type="dapo", epsilon_high=0.28,
        report_to="none", save_strategy="no", disable_tqdm=True, logging_steps=1, seed=0,
    )  # fmt: skip
    trainer = package.GRPOTrainer(
        model=AutoModelForCausalLM.from_config(config, dtype=torch.float32),
        reward_funcs=[_zero_reward],
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "w3 w4"}] * 2),
        processing_class=word_tokenizer(config.vocab_size),
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def _fake_parameters(model: torch.nn.Module, fake_mode) -> None:
    """Replace every meta parameter and buffer by a fake CPU tensor of the same shape and dtype (ties kept)."""
    converted: dict[int, torch.Tensor] = {}  # by id of the (long-lived) parameter or buffer: tied weights stay tied
    device = torch.device("cpu")

    def fake(tensor):
        return fake_mode.fake_tensor_converter.from_meta_and_device(fake_mode, tensor, device)

    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                if id(param) not in converted:
                    converted[id(param)] = torch.nn.Parameter(fake(param.detach()), requires_grad=param.requires_grad)
                module._parameters[name] = converted[id(param)]
        for name, buffer in list(module._buffers.items()):
            if buffer is not None:
                converted.setdefault(id(buffer), fake(buffer))
                module._buffers[name] = converted[id(buffer)]


def build_policy(
    config, *, dtype: torch.dtype, lora: dict, gradient_checkpointing: bool, qlora: bool = False, fake_mode=None,
    seed: int = 0,
):  # fmt: skip
    """The policy as TRL sets it up: LoRA through peft, TRL's fused LM head on the base model, gradient checkpointing
    (non-reentrant) with input grads enabled. Fake weights when `fake_mode` is given, random real ones otherwise.

    `qlora`: the recipe's 4-bit base after `prepare_model_for_kbit_training` (everything but the quantized layers in
    fp32, trainable LoRA weights in bf16 as TRL converts them), with bf16 stand-ins for the 4-bit linear layers: a 4-bit
    layer's autograd saves nothing new (bitsandbytes keeps the quantized weight, and its input only for LoRA's own
    branch, as a frozen bf16 layer does); the transient dequantized weight is added to the fit estimate separately.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    torch.manual_seed(seed)
    with torch.device("meta") if fake_mode is not None else contextlib.nullcontext():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if qlora:
        linear_weights = {
            id(module.weight) for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head")
        }  # fmt: skip
        for param in model.parameters():
            if id(param) not in linear_weights:
                param.data = param.data.float()
    model = get_peft_model(model, LoraConfig(**lora))
    add_fused_lm_head(model.get_base_model(), temperature=1.0, outputs=("log_probs", "entropy"))
    if qlora:
        for param in model.parameters():
            if param.requires_grad:
                param.data = param.data.to(torch.bfloat16)
    if fake_mode is not None:
        _fake_parameters(model, fake_mode)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model.train()
    return model


# ---- configurations -----------------------------------------------------------------------------------------------


@dataclass
class Setup:
    """One model + training configuration: what a micro-batch looks like and how the policy is set up."""

    name: str
    config: object  # transformers config of the full model
    dtype: torch.dtype  # weights
    bf16: bool  # TRL's autocast
    lora: dict
    gradient_checkpointing: bool
    qlora: bool
    prompt_length: int
    rows: int  # per_device_train_batch_size
    group: int  # num_generations
    completion_length: int
    generation_rows: int  # rows generated at once: per_device_train_batch_size x steps_per_generation


DEMO_PROMPT_TOKENS = 56  # the demo's chat-templated prompts (DESIGN.md: 55-56 tokens on add-1d)
RECIPE_PROMPT_TOKENS = 128  # a chat-templated word problem for Qwen2.5 (system prompt + question), rounded up


def embedded_config():
    """SmolLM2-135M-Instruct's architecture (the embedded model), as the demo loads it."""
    from transformers import AutoConfig

    from grpo_plus.app.embedded import resolve_model

    config = AutoConfig.from_pretrained(resolve_model("smollm2-135m-instruct"))
    config._attn_implementation = "sdpa"
    return config


def recipe_setup(recipe_name: str) -> Setup:
    """A Setup from recipes/configs/<name>.yaml; Qwen2.5 configs get the real model's architecture."""
    settings = recipe(recipe_name)
    if recipe_name == "demo_cpu":
        config, prompt_length = embedded_config(), DEMO_PROMPT_TOKENS
    else:
        shape = "qwen2.5-" + recipe_name.split("-")[1].split("_")[0]
        config, prompt_length = qwen2_config(shape), RECIPE_PROMPT_TOKENS
    rows = settings["per_device_train_batch_size"]
    return Setup(
        name=recipe_name,
        config=config,
        dtype=torch.bfloat16 if settings.get("dtype") == "bfloat16" else torch.float32,
        bf16=bool(settings.get("bf16", True)),
        lora=lora_settings(recipe_name),
        gradient_checkpointing=bool(settings.get("gradient_checkpointing", True)),
        qlora=recipe_name.endswith("qlora"),
        prompt_length=prompt_length,
        rows=rows,
        group=settings["num_generations"],
        completion_length=settings["max_completion_length"],
        generation_rows=rows * settings.get("gradient_accumulation_steps", 1),
    )


def with_depth(config, layers: int):
    """The same architecture with `layers` decoder layers."""
    fields = {**config.to_dict(), "num_hidden_layers": layers}
    if fields.get("max_window_layers") is not None:
        fields["max_window_layers"] = min(fields["max_window_layers"], layers)
    if fields.get("layer_types") is not None:  # recomputed from the sliding-window fields for the new depth
        fields["layer_types"] = None
    config = config.__class__.from_dict(fields)
    config._attn_implementation = "sdpa"
    return config


# ---- measurements -------------------------------------------------------------------------------------------------


class Bench:
    """Trainers built once; fake measurements of any Setup, extrapolated in depth (see `measure`)."""

    EXTRAPOLATE_FROM = (1, 2, 3)

    def __init__(self, output_dir: Path, lm_head: str = "cuda"):
        self.lm_head = lm_head
        self.trainers = {
            (side, bf16): build_trainer(side, bf16=bf16, output_dir=output_dir)
            for side in SIDES
            for bf16 in (False, True)
        }
        self.cache: dict = {}

    def measure_at_depth(self, setup: Setup, side: str, rows: int, completion_length: int, layers: int,
                         gradient_checkpointing: bool, group: int | None = None,
                         drawn_from: int | None = None) -> PassMemory:  # fmt: skip
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        config = with_depth(setup.config, layers)
        model = build_policy(
            config, dtype=setup.dtype, lora=setup.lora, gradient_checkpointing=gradient_checkpointing,
            qlora=setup.qlora, fake_mode=fake_mode,
        )  # fmt: skip
        group = group or setup.group
        inputs = synthetic_micro_batch(
            drawn_from or rows, min(group, drawn_from or rows), setup.prompt_length, completion_length,
            config.vocab_size,
        )  # fmt: skip
        if drawn_from:  # TRL shuffles the rows of a generation batch before cutting it into micro-batches
            order = torch.randperm(drawn_from, generator=torch.Generator().manual_seed(0))[:rows]
            inputs = {k: v[order] if v.dim() else v for k, v in inputs.items()}
            inputs["num_items_in_batch"] = inputs["completion_mask"].sum().float()
        return measure_pass(self.trainers[side, setup.bf16], model, inputs, fake_mode, self.lm_head)

    def measure(self, setup: Setup, side: str, rows: int, completion_length: int,
                gradient_checkpointing: bool | None = None, group: int | None = None,
                drawn_from: int | None = None) -> PassMemory:  # fmt: skip
        """Counts of the full-depth model from 1, 2 and 3 layers: decoder layers are identical, so every count is
        affine in the depth; three points check that (second difference 0) before extrapolating, else the full model
        is measured. `validate_depth` compares the extrapolation with full-depth measurements."""
        gc = setup.gradient_checkpointing if gradient_checkpointing is None else gradient_checkpointing
        key = (setup.name, side, rows, completion_length, gc, group, drawn_from)
        if key not in self.cache:
            points = [
                self.measure_at_depth(setup, side, rows, completion_length, n, gc, group, drawn_from)
                for n in self.EXTRAPOLATE_FROM
            ]
            fields = [f for f in asdict(points[0]) if f != "items_faked"]
            values = {f: [getattr(p, f) for p in points] for f in fields}
            depth = setup.config.num_hidden_layers
            if all(v[2] - v[1] == v[1] - v[0] for v in values.values()):
                result = PassMemory(**{f: v[0] + (depth - 1) * (v[1] - v[0]) for f, v in values.items()})
            else:
                result = self.measure_at_depth(setup, side, rows, completion_length, depth, gc, group, drawn_from)
            self.cache[key] = result
        return self.cache[key]


def parameter_bytes(setup: Setup) -> dict:
    """Bytes of the weights (frozen base, 4-bit where the recipe quantizes) and of the LoRA weights and their AdamW
    state (two moments of each trainable weight, in its dtype), from the model's shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = build_policy(
        setup.config, dtype=setup.dtype, lora=setup.lora, gradient_checkpointing=False, qlora=setup.qlora,
        fake_mode=FakeTensorMode(allow_non_fake_inputs=True),
    )  # fmt: skip
    base = lora = 0
    largest_linear = 0
    seen = set()
    for name, param in model.named_parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        if param.requires_grad:
            lora += param.numel() * param.element_size()
        elif setup.qlora and name.endswith("base_layer.weight"):
            base += nf4_bytes(param.numel())
            largest_linear = max(largest_linear, param.numel() * 2)  # dequantized to bf16 for each matmul
        else:
            base += param.numel() * param.element_size()
    return {"base": base, "lora": lora, "adam": 2 * lora, "dequantized_layer": largest_linear}


def nf4_bytes(numel: int) -> int:
    """bitsandbytes nf4 with double quantization: 4 bits a weight, a uint8 absmax per 64-weight block, then per 256
    blocks an fp32 absmax of those, plus the 256-entry fp32 code and an fp32 offset."""
    blocks = math.ceil(numel / 64)
    return numel // 2 + blocks + 4 * math.ceil(blocks / 256) + 4 * 256 + 4


def kv_cache_bytes(config, rows: int, tokens: int, element_size: int = 2) -> int:
    """Keys and values of every layer for `rows` sequences of `tokens` (transformers' DynamicCache), in bf16."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return rows * tokens * config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * element_size


def step_bytes(bench: Bench, setup: Setup, side: str, rows: int, completion_length: int, generation_rows: int,
               params: dict, group: int | None = None) -> dict:  # fmt: skip
    """Peak bytes of one optimizer step on a GPU, computed from the counts: weights + LoRA + AdamW state, plus the
    larger of the training pass's peak (activations, temporaries, LoRA gradients; for a 4-bit base one dequantized
    layer on top) and generation's KV cache. CUDA's context and the allocator's slack are not in it."""
    # The micro-batch is cut from a shuffled generation batch, as TRL does (whole groups when it is one micro-batch).
    drawn_from = generation_rows if generation_rows > rows else None
    train = bench.measure(setup, side, rows, completion_length, group=group, drawn_from=drawn_from)
    training = train.peak + params["dequantized_layer"]
    generation = kv_cache_bytes(setup.config, generation_rows, setup.prompt_length + completion_length)
    static = params["base"] + params["lora"] + params["adam"]
    return {
        "static": static,
        "training": training,
        "generation": generation,
        "total": static + max(training, generation),
    }


def largest_fitting(fits, low: int, high: int) -> int:
    """The largest n in [low, high] with fits(n), for a monotone `fits`; low - 1 when none does."""
    if not fits(low):
        return low - 1
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low


def fit_on_card(bench: Bench, setup: Setup, budget: int, step: int = 128) -> dict:
    """Per side: the longest completion (a multiple of `step`) at the recipe's batch, and the largest group G trained
    as one micro-batch (per_device_train_batch_size = G, one group generated at a time) at the recipe's length."""
    params = parameter_bytes(setup)
    limit = setup.config.max_position_embeddings - setup.prompt_length
    result = {"params": params}
    for side in SIDES:

        def length_fits(k: int, side=side) -> bool:
            need = step_bytes(bench, setup, side, setup.rows, k * step, setup.generation_rows, params)
            return need["total"] <= budget

        def group_fits(g: int, side=side) -> bool:
            need = step_bytes(bench, setup, side, g, setup.completion_length, g, params, group=g)
            return need["total"] <= budget

        at_recipe = step_bytes(bench, setup, side, setup.rows, setup.completion_length, setup.generation_rows, params)
        result[side] = {
            "longest_completion": step * largest_fitting(length_fits, 1, limit // step),
            "largest_group": largest_fitting(group_fits, 2, GROUP_LIMIT),
            "at_recipe": at_recipe,
        }
    return result


# ---- validation ---------------------------------------------------------------------------------------------------


def profiler_peak(run) -> int:
    """Most bytes the CPU allocator held at once during `run()`, above what it held before (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def validate_counting(bench: Bench) -> list[dict]:
    """Real compute vs fake counting vs the allocator, on a tiny Qwen2 (fp32 and bf16 autocast, checkpointing off
    and on, both trainers, TRL's CPU fold in the LM head so the real run computes real values)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    config = qwen2_config("tiny-qwen2")
    lora = dict(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    inputs = synthetic_micro_batch(8, 4, 16, 32, config.vocab_size, seed=1)
    rows = []
    for bf16 in (False, True):
        for gc in (False, True):
            for side in SIDES:
                trainer = bench.trainers[side, bf16]
                real_model = build_policy(config, dtype=torch.float32, lora=lora, gradient_checkpointing=gc)
                real = measure_pass(trainer, real_model, inputs, lm_head="cpu")
                again = []
                allocator_peak = profiler_peak(
                    lambda t=trainer, m=real_model, out=again: out.append(measure_pass(t, m, inputs, lm_head="cpu"))
                )
                fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
                fake_model = build_policy(
                    config, dtype=torch.float32, lora=lora, gradient_checkpointing=gc, fake_mode=fake_mode
                )
                fake = measure_pass(trainer, fake_model, inputs, fake_mode, lm_head="cpu")
                rows.append(
                    dict(
                        bf16=bf16, gradient_checkpointing=gc, side=side, real_saved=real.saved, fake_saved=fake.saved,
                        real_peak=real.peak, fake_peak=fake.peak, allocator_peak=allocator_peak,
                        agree=real.saved == fake.saved and real.peak == fake.peak and real == again[0],
                    )
                )  # fmt: skip
    return rows


def validate_demo(bench: Bench, setup: Setup) -> list[dict]:
    """The demo config at full size, real compute (random weights) vs fake counting, both trainers."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    inputs = synthetic_micro_batch(
        setup.rows, setup.group, setup.prompt_length, setup.completion_length, setup.config.vocab_size
    )
    rows = []
    for side in SIDES:
        trainer = bench.trainers[side, setup.bf16]
        real_model = build_policy(setup.config, dtype=setup.dtype, lora=setup.lora, gradient_checkpointing=False)
        real = measure_pass(trainer, real_model, inputs, lm_head=bench.lm_head)
        del real_model
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        fake_model = build_policy(
            setup.config, dtype=setup.dtype, lora=setup.lora, gradient_checkpointing=False, fake_mode=fake_mode
        )
        fake = measure_pass(trainer, fake_model, inputs, fake_mode, lm_head=bench.lm_head)
        rows.append(dict(side=side, real=asdict(real), fake=asdict(fake), agree=_same_counts(real, fake)))
    return rows


def _same_counts(a: PassMemory, b: PassMemory) -> bool:
    return all(getattr(a, f) == getattr(b, f) for f in ("saved", "after_forward", "forward_peak", "peak"))


def validate_depth(bench: Bench, setup: Setup, completion_length: int) -> list[dict]:
    """Full-depth fake counts vs the depth extrapolation `Bench.measure` uses."""
    rows = []
    for gc in (False, True):
        for side in SIDES:
            full = bench.measure_at_depth(
                setup, side, setup.rows, completion_length, setup.config.num_hidden_layers, gc
            )
            extrapolated = bench.measure(setup, side, setup.rows, completion_length, gc)
            rows.append(dict(gradient_checkpointing=gc, side=side, full_peak=full.peak,
                             extrapolated_peak=extrapolated.peak, agree=_same_counts(full, extrapolated)))  # fmt: skip
    return rows


# ---- report -------------------------------------------------------------------------------------------------------

TABLE_LENGTHS = (512, 2048, 8192)
GROUP_LIMIT = 512  # the largest group the fit search tries
FIT_RECIPES = ("demo_cpu", "qwen2.5-0.5b_lora", "qwen2.5-1.5b_lora", "qwen2.5-7b_qlora")


def gib(value: float) -> str:
    return f"{value / GIB:.2f}"


def memory_table(rows: list[dict]) -> str:
    header = ["config", "completion tokens", "grad. checkpointing", "saved: TRL (GiB)", "saved: grpo_plus", "ratio",
              "peak: TRL (GiB)", "peak: grpo_plus", "ratio"]  # fmt: skip
    cells = []
    for row in rows:
        trl, ours = row["trl"], row["ours"]
        cells.append([
            row["config"], row["completion"], "on" if row["gradient_checkpointing"] else "off",
            gib(trl["saved"]), gib(ours["saved"]), f"{ours['saved'] / trl['saved']:.2f}",
            gib(trl["peak"]), gib(ours["peak"]), f"{ours['peak'] / trl['peak']:.2f}",
        ])  # fmt: skip
    return markdown_table(header, cells)


def at_least(group: int) -> str:
    return f">= {group}" if group >= GROUP_LIMIT else str(group)


def fit_table(fits: dict, budget: int) -> str:
    header = ["recipe config", "step peak at its settings: TRL / grpo_plus (GiB)",
              f"longest completion ({gib(budget)} GiB): TRL", "grpo_plus", "largest G in one micro-batch: TRL",
              "grpo_plus"]  # fmt: skip
    cells = [
        [f"`{name}.yaml`", f"{gib(fit['trl']['at_recipe']['total'])} / {gib(fit['ours']['at_recipe']['total'])}",
         fit["trl"]["longest_completion"], fit["ours"]["longest_completion"], at_least(fit["trl"]["largest_group"]),
         at_least(fit["ours"]["largest_group"])]
        for name, fit in fits.items()
    ]  # fmt: skip
    return markdown_table(header, cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the memory table only: no validation, no fit search")
    parser.add_argument("--lm-head", choices=("cuda", "cpu"), default="cuda", help="whose fused LM head to count")
    parser.add_argument("--budget-gib", type=float, default=22.0,
                        help="tensor memory of a 24 GB card (24 GiB less ~2 GiB for the CUDA context, cuBLAS "
                        "workspaces and allocator slack, which max_memory_allocated does not count)")  # fmt: skip
    parser.add_argument("--json", default=str(ROOT / "outputs" / "bench-memory" / "memory.json"))
    args = parser.parse_args()

    import transformers

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    started = time.perf_counter()
    output = Path(args.json)
    output.parent.mkdir(parents=True, exist_ok=True)
    bench = Bench(output.parent / "trainers", lm_head=args.lm_head)
    report: dict = {"torch": torch.__version__, "lm_head": args.lm_head, "budget_bytes": args.budget_gib * GIB}

    if not args.quick:
        print("Validation 1: real compute vs fake counting vs the CPU allocator (tiny Qwen2) ...", flush=True)
        report["validate_counting"] = validate_counting(bench)
        for row in report["validate_counting"]:
            print(f"  bf16={row['bf16']!s:5} gc={row['gradient_checkpointing']!s:5} {row['side']:4}: saved "
                  f"{row['real_saved']} / {row['fake_saved']} B, peak {row['real_peak']} / {row['fake_peak']} B "
                  f"(real / fake), allocator {row['allocator_peak']} B; agree: {row['agree']}", flush=True)  # fmt: skip

    demo = recipe_setup("demo_cpu")
    print("Demo config: real compute vs fake counting (SmolLM2-135M shape, full depth) ...", flush=True)
    report["validate_demo"] = validate_demo(bench, demo)
    for row in report["validate_demo"]:
        print(f"  {row['side']:4}: peak real {gib(row['real']['peak'])} GiB, fake {gib(row['fake']['peak'])} GiB; "
              f"all counts agree: {row['agree']}", flush=True)  # fmt: skip
    table = [
        dict(config="demo (SmolLM2-135M, fp32, LoRA r=16, 16 rows)", completion=demo.completion_length,
             gradient_checkpointing=False, **{row["side"]: row["fake"] for row in report["validate_demo"]})
    ]  # fmt: skip

    half = recipe_setup("qwen2.5-0.5b_lora")
    if not args.quick:
        print("Validation 2: full-depth counts vs the depth extrapolation (Qwen2.5-0.5B shape, 512 tokens) ...")
        report["validate_depth"] = validate_depth(bench, half, 512)
        for row in report["validate_depth"]:
            print(
                f"  gc={row['gradient_checkpointing']!s:5} {row['side']:4}: peak {row['full_peak']} / "
                f"{row['extrapolated_peak']} B (full / extrapolated); agree: {row['agree']}",
                flush=True,
            )
    print("Qwen2.5-0.5B shape, bf16, LoRA r=32, micro-batches of 8 completions, 128-token prompts ...")
    cases = [(length, gc, None) for length in TABLE_LENGTHS for gc in (False, True)]
    cases += [(512, gc, half.generation_rows) for gc in (False, True)]
    for length, gc, drawn_from in cases:
        batch = "one prompt x 8" if drawn_from is None else f"8 of {drawn_from} rows (4 prompts), shuffled"
        row = dict(
            config=f"Qwen2.5-0.5B shape, bf16, LoRA r=32; {batch}", completion=length, gradient_checkpointing=gc
        )
        for side in SIDES:
            row[side] = asdict(bench.measure(half, side, half.rows, length, gc, drawn_from=drawn_from))
        table.append(row)
        print(f"  {length:5d} tokens, gc={gc!s:5}, {batch}: peak TRL {gib(row['trl']['peak'])} GiB, grpo_plus "
              f"{gib(row['ours']['peak'])} GiB", flush=True)  # fmt: skip
    report["table"] = table
    print("\n" + memory_table(table))

    if not args.quick:
        budget = int(args.budget_gib * GIB)
        report["fit"] = {}
        for name in FIT_RECIPES:
            print(f"\nFit on a 24 GB card ({args.budget_gib} GiB of tensors): {name} ...", flush=True)
            began = time.perf_counter()
            fit = report["fit"][name] = fit_on_card(bench, recipe_setup(name), budget)
            for side in SIDES:
                at = fit[side]["at_recipe"]
                print(f"  {side:4}: at the recipe's settings {gib(at['total'])} GiB (weights + LoRA + AdamW "
                      f"{gib(at['static'])}, training pass {gib(at['training'])}, KV cache {gib(at['generation'])});"
                      f" longest completion {fit[side]['longest_completion']}, largest G {fit[side]['largest_group']}",
                      flush=True)  # fmt: skip
            print(f"  ({time.perf_counter() - began:.0f} s)", flush=True)
        print("\n" + fit_table(report["fit"], budget))

    report["wall_minutes"] = (time.perf_counter() - started) / 60
    output.write_text(json.dumps(report, indent=1, default=str))
    markdown = memory_table(table) + ("\n\n" + fit_table(report["fit"], budget) if "fit" in report else "")
    output.with_suffix(".md").write_text(markdown + "\n")
    print(f"\nwall time {report['wall_minutes']:.1f} min; results in {output} and {output.with_suffix('.md')}")


if __name__ == "__main__":
    main()
