"""Stock TRL vs grpo_plus on one GPU, in one command: `make bench-gpu` (python benchmarks/gpu.py).

    python benchmarks/gpu.py [--cases 0.5b-lora 1.5b-lora-gc 7b-qlora long] [--steps 4] [--warmup 1] [--rounds 1]
                             [--json outputs/bench-gpu/gpu.json] [--fresh] [--smoke]

Per case, stock `trl.GRPOTrainer` and `grpo_plus.GRPOTrainer` with `zero_waste_pass` on and off train the same
config from the same seed, each in a child process of its own (so each side's peak memory is its own and an
out-of-memory error stays in its child), one after the other and in reverse order on every second round. Models are
built from the architecture of the real Qwen2.5 models (harness/shapes.py) with random weights: nothing is
downloaded. Every completion is forced to the configured length (EOS is never sampled), and sampling is a Gumbel-max
whose noise depends only on (seed, generation call, position), so all sides sample the same completions as long as
their logits agree. The reward (the share of even token ids) differs between the completions of a group, so every
group has signal (`--dead-share` makes some groups constant).

Cases (prompts of 128 tokens, 8 completions per prompt, the recipes' LoRA settings, loss_type dapo + clip-higher):
  0.5b-lora      Qwen2.5-0.5B shape, bf16, LoRA r=32, 512-token completions, micro-batch 8, 2 micro-batches a step
  1.5b-lora-gc   Qwen2.5-1.5B shape, bf16, LoRA r=32, gradient checkpointing, otherwise as above
  7b-qlora       Qwen2.5-7B shape, 4-bit nf4 (bitsandbytes, double quantization, bf16 compute, as
                 recipes/grpo_qlora.py loads it), LoRA r=16, gradient checkpointing, micro-batch 4
  long           where a 24 GB card stops: the 1.5B LoRA + checkpointing config's training pass (forward + backward of
                 one micro-batch of 8 completions, synthetic, no generation) at 1K/2K/4K/8K/16K/24K/32K-token
                 completions, under a 24 GiB limit (torch.cuda.set_per_process_memory_fraction), until it runs out of
                 memory; besides TRL and grpo_plus (zero-waste on / off) a fourth side, `ours_long`: grpo_plus with
                 its long-completion settings (activation_offloading=True, tiled_mlp_tokens=4096)
Per case and side: peak VRAM (max_memory_allocated, split into generation and training, and max_memory_reserved),
median step time, training-pass time (forward + backward of the step's micro-batches) and generation time
(generation + scoring) over the steps after the warm-up, and the grpo_plus / TRL ratios. Checks against TRL: the
same completions (a hash per generation), losses equal, and the largest relative difference of the logged entropy
and gradient norm. On-policy with full-length completions, dapo's loss is 0 in every group (the advantages of a
group sum to 0 and the ratio is 1), so the losses agree by construction; the entropy and the gradient norm are what
read the training forward. Also: which SDPA kernel takes the block attention mask of the shared-prompt forward.
Results: a JSON and a Markdown table (merged with earlier cases in the same file unless --fresh, so cases can run in
separate commands). On a machine without CUDA it says so in one line and exits 0; --smoke runs the same code at tiny
shapes on CPU, every side in this process (tests/test_benchmarks_gpu.py runs it in `make test`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# benchmarks/harness/: the script's own folder is on the path; what these import runs on a bare GPU machine
from harness.flags import arguments
from harness.process import ChildFailed, child_result, launch_child
from harness.report import ROOT, markdown_table, write_report
from harness.shapes import QWEN25_SHAPES, prompt_text, qwen2_config, recipe, synthetic_micro_batch, word_tokenizer
from harness.timing import StepTimer, alternating

SIDES = ("trl", "ours", "ours_off")  # stock TRL; grpo_plus with zero_waste_pass on; and off
# The training-pass ladders also run grpo_plus with its long-completion settings (docs/guide/long-completions.md).
LADDER_SIDES = (*SIDES, "ours_long")
LONG_SETTINGS = {"activation_offloading": True, "tiled_mlp_tokens": 4096}
GIB = 2**30
CARD_BYTES = 24 * GIB


@dataclasses.dataclass(frozen=True)
class Case:
    shape: str
    recipe: str  # recipes/configs/<recipe>.yaml: LoRA settings and learning rate
    gradient_checkpointing: bool
    rows: int  # per_device_train_batch_size
    accumulation: int  # gradient_accumulation_steps (= steps_per_generation)
    completion_length: int
    prompt_length: int = 128
    group: int = 8
    qlora: bool = False
    ladder: tuple[int, ...] = ()  # completion lengths of a training-pass-only case
    memory_cap: int | None = None  # bytes a ladder case may use
    description: str = ""


CASES = {
    "0.5b-lora": Case("qwen2.5-0.5b", "qwen2.5-0.5b_lora", False, 8, 2, 512,
                      description="Qwen2.5-0.5B shape, bf16, LoRA r=32"),
    "1.5b-lora-gc": Case("qwen2.5-1.5b", "qwen2.5-1.5b_lora", True, 8, 2, 512,
                         description="Qwen2.5-1.5B shape, bf16, LoRA r=32, grad. checkpointing"),
    "7b-qlora": Case("qwen2.5-7b", "qwen2.5-7b_qlora", True, 4, 2, 512, qlora=True,
                     description="Qwen2.5-7B shape, nf4 QLoRA r=16, grad. checkpointing"),
    "long": Case("qwen2.5-1.5b", "qwen2.5-1.5b_lora", True, 8, 1, 4096,
                 ladder=(1024, 2048, 4096, 8192, 16384, 24576, 32640),
                 memory_cap=CARD_BYTES, description="Qwen2.5-1.5B shape, bf16, LoRA r=32, grad. checkpointing, "
                 "training pass of 8 completions, 24 GiB limit"),
}  # fmt: skip
SMOKE_CASES = {
    "smoke-lora": Case("tiny-qwen2", "qwen2.5-0.5b_lora", False, 4, 2, 16, prompt_length=8, group=4,
                       description="tiny Qwen2, fp32, LoRA r=32"),
    "smoke-qlora-gc": Case("tiny-qwen2", "qwen2.5-7b_qlora", True, 4, 2, 16, prompt_length=8, group=4, qlora=True,
                           description="tiny Qwen2, nf4 QLoRA r=16 (bitsandbytes on CPU), grad. checkpointing"),
    "smoke-long": Case("tiny-qwen2", "qwen2.5-1.5b_lora", True, 4, 1, 32, prompt_length=8, group=4, ladder=(16, 32),
                       description="tiny Qwen2, LoRA r=32, grad. checkpointing, training pass"),
}  # fmt: skip


# ---- one side, in a child process ---------------------------------------------------------------------------------


class FullLengthSampler:
    """Logits processor: never EOS, and Gumbel-max sampling whose noise depends only on (seed, call, position).

    Appended after TRL's temperature processor, it leaves one finite logit per row, so TRL's sampling picks it: every
    side that computes the same logits samples the same tokens, and every completion has the configured length.
    """

    def __init__(self, seed: int, banned_ids: list[int]):
        self.seed, self.banned_ids, self.calls = seed, banned_ids, 0

    def __call__(self, input_ids, scores):
        import torch

        scores = scores.float()
        scores[:, self.banned_ids] = float("-inf")
        generator = torch.Generator(device=scores.device)
        generator.manual_seed(hash((self.seed, self.calls, input_ids.shape[1])) % 2**62)
        uniform = torch.rand(scores.shape, generator=generator, device=scores.device).clamp_(1e-10, 1 - 1e-10)
        choice = (scores - torch.log(-torch.log(uniform))).argmax(dim=-1, keepdim=True)
        return torch.full_like(scores, float("-inf")).scatter_(1, choice, 0.0)


def use_full_length_sampling(model, seed: int, banned_ids: list[int]) -> None:
    """Make `model.generate` (what TRL calls, through PEFT) sample with a FullLengthSampler."""
    sampler = FullLengthSampler(seed, banned_ids)
    original = model.generate

    def generate(*args, **kwargs):
        kwargs["logits_processor"] = [*kwargs.get("logits_processor", []), sampler]
        try:
            return original(*args, **kwargs)
        finally:
            sampler.calls += 1

    model.generate = generate


def even_token_reward(completion_ids, prompts=None, **kwargs) -> list[float]:
    """Share of even token ids: differs between the completions of a group, so groups have signal."""
    return [sum(1 for token in ids if token % 2 == 0) / max(len(ids), 1) for ids in completion_ids]


def make_dead_reward(dead_prompts: set[str]):
    def dead_or_even_reward(completion_ids, prompts, **kwargs) -> list[float]:
        """`even_token_reward`, but constant for the prompts in `dead_prompts` (zero-advantage groups)."""
        scores = even_token_reward(completion_ids)
        return [0.5 if prompt in dead_prompts else score for prompt, score in zip(prompts, scores, strict=True)]

    return dead_or_even_reward


def random_checkpoint(case: Case, cache_dir: Path) -> Path:
    """A checkpoint of the case's architecture with random bf16 weights, written once by the parent process
    (bitsandbytes quantizes while loading, so the 4-bit case loads it as the QLoRA recipe loads a hub model)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = cache_dir / f"{case.shape}-random-seed0"
    if (path / "config.json").exists():
        return path
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(qwen2_config(case.shape), dtype=torch.bfloat16)
    partial = path.with_name(path.name + ".partial")
    model.save_pretrained(partial)
    partial.rename(path)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return path


def load_policy(case: Case, device: str, cache_dir: Path):
    """The base model as the recipes load it: bf16 (fp32 on CPU) from the config with random weights, or 4-bit nf4
    from a random checkpoint, prepared for k-bit training (recipes/grpo_qlora.py)."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    on_gpu = device == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    if not case.qlora:
        torch.manual_seed(0)
        with torch.device(device):
            return AutoModelForCausalLM.from_config(qwen2_config(case.shape), dtype=dtype)
    from peft import prepare_model_for_kbit_training

    from grpo_plus.compat.bitsandbytes import keep_4bit_trainable_on_cpu

    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype
    )
    model = AutoModelForCausalLM.from_pretrained(
        random_checkpoint(case, cache_dir), dtype=dtype, quantization_config=quantization,
        device_map={"": 0} if on_gpu else None, attn_implementation="sdpa",
    )  # fmt: skip
    model = prepare_model_for_kbit_training(
        model, use_gradient_checkpointing=case.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False},
    )  # fmt: skip
    keep_4bit_trainable_on_cpu(model)
    return model


class Probe(StepTimer):
    """Each optimizer step's time (harness.timing.StepTimer, synchronized on CUDA), the generation and training-pass
    time within it, peak memory (generation and training apart), and what each generation produced."""

    def __init__(self, cuda: bool):
        import torch

        super().__init__(sync=self._synchronize if cuda else None)
        self.torch, self.cuda = torch, cuda
        self.generation_seconds, self.train_seconds = [], []
        self.generation_peak = self.train_peak = 0
        self.completion_hashes: list[str] = []
        self._generation = self._train = 0.0
        self._generated = False

    def _synchronize(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def _segment_peak(self) -> int:
        """Peak allocated since the last reset, then reset (0 on CPU)."""
        if not self.cuda:
            return 0
        peak = self.torch.cuda.max_memory_allocated()
        self.torch.cuda.reset_peak_memory_stats()
        return peak

    def wrap(self, trainer) -> None:
        prepare, training_step, generate = (
            trainer._prepare_inputs, trainer.training_step, trainer._generate_and_score_completions
        )  # fmt: skip

        def timed_prepare(*args, **kwargs):
            self._synchronize()
            self.train_peak = max(self.train_peak, self._segment_peak())
            start = time.perf_counter()
            self._generated = False
            try:
                return prepare(*args, **kwargs)
            finally:
                self._synchronize()
                seconds, peak = time.perf_counter() - start, self._segment_peak()
                self._generation += seconds
                self._train -= seconds  # training_step's time includes this call
                if self._generated:
                    self.generation_peak = max(self.generation_peak, peak)
                else:
                    self.train_peak = max(self.train_peak, peak)

        def timed_training_step(*args, **kwargs):
            self._synchronize()
            start = time.perf_counter()
            try:
                return training_step(*args, **kwargs)
            finally:
                self._synchronize()
                self._train += time.perf_counter() - start

        def recorded_generate(*args, **kwargs):
            self._generated = True
            output = generate(*args, **kwargs)
            ids = output["completion_ids"].detach().cpu().numpy().tobytes()
            self.completion_hashes.append(hashlib.sha1(ids).hexdigest()[:16])
            return output

        trainer._prepare_inputs, trainer.training_step = timed_prepare, timed_training_step
        trainer._generate_and_score_completions = recorded_generate

    def on_step_begin(self, args, state, control, **kwargs):
        super().on_step_begin(args, state, control, **kwargs)
        self._generation = self._train = 0.0

    def on_step_end(self, args, state, control, **kwargs):
        super().on_step_end(args, state, control, **kwargs)
        self.generation_seconds.append(self._generation)
        self.train_seconds.append(self._train)
        self.train_peak = max(self.train_peak, self._segment_peak())


def build_trainer(case: Case, side: str, device: str, steps: int, output_dir: Path, cache_dir: Path,
                  dead_share: float = 0.0):  # fmt: skip
    import trl
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import set_seed

    import grpo_plus

    set_seed(0)
    settings = recipe(case.recipe)
    vocab_size = QWEN25_SHAPES[case.shape]["vocab_size"]
    prompts_per_step = case.rows * case.accumulation // case.group
    prompts = [prompt_text(case.prompt_length, vocab_size, seed=i) for i in range(max(prompts_per_step, 1) * steps)]
    dead = set(prompts[: round(dead_share * len(prompts))])
    package = trl if side == "trl" else grpo_plus
    extra = {} if side == "trl" else {"zero_waste_pass": side in ("ours", "ours_long")}
    if side == "ours_long":
        extra.update(LONG_SETTINGS)
        if case.shape == "tiny-qwen2":  # --smoke: slices small enough that the tiny sequences are tiled
            extra["tiled_mlp_tokens"] = 32
    args = package.GRPOConfig(
        output_dir=str(output_dir), use_cpu=device == "cpu", bf16=device == "cuda", seed=0, max_steps=steps,
        per_device_train_batch_size=case.rows, gradient_accumulation_steps=case.accumulation,
        num_generations=case.group, max_completion_length=case.completion_length, temperature=1.0,
        learning_rate=settings["learning_rate"], lr_scheduler_type="constant", loss_type="dapo", epsilon_high=0.28,
        gradient_checkpointing=case.gradient_checkpointing, mask_truncated_completions=False, logging_steps=1,
        save_strategy="no", report_to="none", disable_tqdm=True, shuffle_dataset=False, **extra,
    )  # fmt: skip
    model = load_policy(case, device, cache_dir)
    tokenizer = word_tokenizer(vocab_size)
    lora = LoraConfig(
        r=settings["lora_r"], lora_alpha=settings["lora_alpha"], lora_dropout=0.0,
        target_modules=settings["lora_target_modules"], task_type="CAUSAL_LM",
    )  # fmt: skip
    set_seed(0)  # the LoRA initialisation draws random numbers: the same on every side
    trainer = package.GRPOTrainer(
        model=model,
        reward_funcs=[make_dead_reward(dead) if dead else even_token_reward],
        args=args,
        train_dataset=Dataset.from_list([{"prompt": prompt} for prompt in prompts]),
        processing_class=tokenizer,
        peft_config=lora,
    )
    base = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
    use_full_length_sampling(base, seed=0, banned_ids=sorted({tokenizer.eos_token_id, tokenizer.pad_token_id}))
    return trainer


def run_steps(case: Case, side: str, steps: int, warmup: int, work: Path, cache_dir: Path, dead_share: float) -> dict:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = device == "cuda"
    trainer = build_trainer(case, side, device, steps, work / side, cache_dir, dead_share)
    probe = Probe(cuda)
    probe.wrap(trainer)
    trainer.add_callback(probe)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    weights = torch.cuda.memory_allocated() if cuda else None
    result = {"side": side, "weights_bytes": weights}
    try:
        trainer.train()
    except torch.cuda.OutOfMemoryError as error:
        result["out_of_memory"] = str(error).splitlines()[0]
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    measured = slice(warmup, None)
    result.update(
        losses=[entry["loss"] for entry in logs],
        entropies=[entry.get("entropy") for entry in logs],
        completion_lengths=[entry.get("completions/mean_length") for entry in logs],
        grad_norms=[entry.get("grad_norm") for entry in logs],
        completion_hashes=probe.completion_hashes,
        step_seconds=probe.step,
        step=_median(probe.step[measured]),
        generation=_median(probe.generation_seconds[measured]),
        train_pass=_median(probe.train_seconds[measured]),
        positions_frac=_mean(entry.get("zero_waste/positions_frac") for entry in logs),
        # The probe resets max_memory_allocated per segment (generation, training): the run's peak is the larger.
        peak_allocated=max(probe.generation_peak, probe.train_peak) if cuda else None,
        generation_peak=probe.generation_peak if cuda else None,
        train_peak=probe.train_peak if cuda else None,
        peak_reserved=torch.cuda.max_memory_reserved() if cuda else None,
    )
    return result


def run_ladder(case: Case, side: str, work: Path, cache_dir: Path) -> dict:
    """The training pass alone (`_compute_loss` forward + backward of one micro-batch) at growing completion lengths,
    under the case's memory cap, until a length does not fit."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = device == "cuda"
    if cuda and case.memory_cap:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, case.memory_cap / total))
    trainer = build_trainer(case, side, device, 1, work / side, cache_dir)
    model = trainer.model
    if case.gradient_checkpointing:  # what Trainer.train() turns on before the first step
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs)
    model.train()
    trainer.current_gradient_accumulation_steps = 1
    vocab_size = QWEN25_SHAPES[case.shape]["vocab_size"]
    rungs = []
    for length in case.ladder:
        inputs = synthetic_micro_batch(case.rows, case.group, case.prompt_length, length, vocab_size)
        inputs = {key: value.to(device) for key, value in inputs.items()}
        rung = {"completion_length": length}
        try:
            seconds = []
            for _ in range(2):  # the first pass warms up kernels and the allocator
                model.zero_grad(set_to_none=True)
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                start = time.perf_counter()
                # what training_step runs inside: grpo_plus's activation offloading where it is on
                with getattr(trainer, "_offload_step", contextlib.nullcontext()):
                    trainer._compute_loss(model, inputs).backward()
                if cuda:
                    torch.cuda.synchronize()
                seconds.append(time.perf_counter() - start)
            rung.update(train_pass=seconds[-1], peak_allocated=torch.cuda.max_memory_allocated() if cuda else None,
                        peak_reserved=torch.cuda.max_memory_reserved() if cuda else None)  # fmt: skip
        except torch.cuda.OutOfMemoryError as error:
            rung["out_of_memory"] = str(error).splitlines()[0]
        model.zero_grad(set_to_none=True)
        rungs.append(rung)
        if "out_of_memory" in rung:
            if cuda:
                torch.cuda.empty_cache()
            break
    return {"side": side, "rungs": rungs}


def _median(values):
    values = list(values)
    return statistics.median(values) if values else None


def _mean(values):
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def run_side(spec: dict) -> dict:
    """One side of one case (in a child process on a GPU, in this process with --smoke)."""
    import transformers

    transformers.logging.set_verbosity_error()
    case = {**CASES, **SMOKE_CASES}[spec["case"]]
    work, cache_dir = Path(spec["work"]), Path(spec["cache_dir"])
    if case.ladder:
        return run_ladder(case, spec["side"], work, cache_dir)
    return run_steps(case, spec["side"], spec["steps"], spec["warmup"], work, cache_dir, spec["dead_share"])


# ---- the parent: alternate the sides, compare, report -------------------------------------------------------------


def run_child(spec: dict, timeout: float) -> dict:
    """Run one side in a fresh process; its result, or what went wrong."""
    try:
        return launch_child(Path(__file__).resolve(), spec, dict(os.environ), timeout=timeout)
    except ChildFailed as error:
        return {"side": spec["side"], "error": str(error)}


def compare_steps(runs: dict[str, list[dict]], completion_length: int) -> dict:
    """Per side, times and peaks (medians over rounds), and whether every side matched TRL's completions/losses."""
    summary = {}
    for side, results in runs.items():
        ok = [r for r in results if "error" not in r]
        if not ok:
            summary[side] = {"error": results[0].get("error")}
            continue
        summary[side] = {
            key: _median(r[key] for r in ok if r.get(key) is not None)
            for key in ("step", "generation", "train_pass", "positions_frac")
        }
        for key in ("peak_allocated", "generation_peak", "train_peak", "peak_reserved", "weights_bytes"):
            values = [r[key] for r in ok if r.get(key) is not None]
            summary[side][key] = max(values) if values else None
        summary[side]["full_length"] = all(length == completion_length for length in ok[0]["completion_lengths"])
        summary[side]["out_of_memory"] = next((r["out_of_memory"] for r in ok if "out_of_memory" in r), None)
        for key in ("losses", "entropies", "grad_norms", "completion_lengths"):
            summary[side][key] = ok[0][key]
        summary[side]["completion_hashes"] = ok[0]["completion_hashes"]
    reference = summary.get("trl", {})
    for side, values in summary.items():
        if side == "trl" or "error" in values or "error" in reference:
            continue
        values["same_completions"] = values["completion_hashes"] == reference["completion_hashes"]
        pairs = list(zip(values["losses"], reference["losses"], strict=False))
        values["losses_equal"] = (
            bool(pairs)
            and len(values["losses"]) == len(reference["losses"])
            and all(abs(a - b) <= 1e-6 * max(1.0, abs(b)) for a, b in pairs)
        )
        for key in ("entropies", "grad_norms"):
            values[f"{key}_max_rel_diff"] = max_relative_difference(values[key], reference[key])
    return summary


def max_relative_difference(values: list, reference: list) -> float | None:
    """Largest |a - b| / |b| over the steps both sides logged (None when there is nothing to compare)."""
    pairs = [(a, b) for a, b in zip(values, reference, strict=False) if a is not None and b]
    return max((abs(a - b) / abs(b) for a, b in pairs), default=None)


def sdpa_kernel_report(device: str, shape: str = "qwen2.5-1.5b", prompt_length: int = 128,
                       completion_length: int = 512, group: int = 8) -> dict:  # fmt: skip
    """Which SDPA backends run the shared-prompt forward's attention (transformers' own sdpa_attention_forward with
    the block mask grpo_plus builds for one group) and what each costs, forward + backward; and which one the
    dispatcher picks by itself (from the kernel names a profiler records). TRL's causal call is timed alongside."""
    from types import SimpleNamespace

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from grpo_plus.zero_waste.rows import pack_shared_prompts

    config = qwen2_config(shape)
    batch = synthetic_micro_batch(group, group, prompt_length, completion_length, config.vocab_size)
    packed = pack_shared_prompts(
        batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], batch["completion_mask"],
        config.hidden_size,
    )  # fmt: skip
    packs, width = packed.input_ids.shape
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = config.hidden_size // heads
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    module = SimpleNamespace(is_causal=True, num_key_value_groups=heads // kv_heads, layer_idx=0, training=True)
    mask = packed.block_mask.to(device)

    def attention(rows, length, attention_mask):
        generator = torch.Generator(device=device).manual_seed(0)

        def tensor(h):
            return torch.randn(rows, h, length, head_dim, device=device, dtype=dtype, generator=generator)

        query, key, value = (tensor(heads), tensor(kv_heads), tensor(kv_heads))
        for t in (query, key, value):
            t.requires_grad_(True)
        out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=head_dim**-0.5)
        out.float().sum().backward()

    def timed(run) -> float:
        run()  # warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        if device == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1000

    report = {"device": device, "shape": shape, "packs": packs, "pack_width": width, "rows": group,
              "row_width": prompt_length + completion_length, "backends": {}}  # fmt: skip
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                    SDPBackend.MATH):  # fmt: skip
        try:
            with sdpa_kernel(backend):
                milliseconds = timed(lambda: attention(packs, width, mask))
            report["backends"][backend.name] = {"runs": True, "ms": milliseconds}
        except RuntimeError as error:
            report["backends"][backend.name] = {"runs": False, "why": str(error).strip().splitlines()[0][:200]}
    report["default_ms"] = timed(lambda: attention(packs, width, mask))
    report["default_kernels"] = _kernel_names(lambda: attention(packs, width, mask), device)
    report["trl_causal_ms"] = timed(lambda: attention(group, prompt_length + completion_length, None))
    report["trl_causal_kernels"] = _kernel_names(
        lambda: attention(group, prompt_length + completion_length, None), device
    )
    return report


def _kernel_names(run, device: str) -> list[str]:
    """Names of the attention kernels/operators a profiler records while `run()` runs."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        run()
    words = ("flash", "fmha", "efficient", "cudnn", "attention", "softmax")
    names = {event.name for event in prof.events() if any(word in event.name.lower() for word in words)}
    return sorted(names)[:20]


def format_table(cases: dict) -> str:
    """The Markdown tables of every case in `cases` (the JSON's `cases`): full steps, then the ladder."""

    def gib(value):
        return "—" if value is None else f"{value / GIB:.2f}"

    def number(value, spec=".2f"):
        return "—" if value is None else format(value, spec)

    def pair(trl, ours, key, show=number):
        return f"{show(trl.get(key))} / {show(ours.get(key))}"

    def ratio(trl, ours, key):
        a, b = ours.get(key), trl.get(key)
        return "—" if a is None or not b else f"{a / b:.2f}"

    steps, ladder = [], []
    for name, case in cases.items():
        summary = case["summary"]
        if case.get("ladder"):
            for side, rungs in summary.items():
                for rung in rungs:
                    fits = "out of memory" if "out_of_memory" in rung else gib(rung.get("peak_allocated"))
                    ladder.append([name, side, rung["completion_length"], fits, number(rung.get("train_pass"))])
            continue
        trl = summary.get("trl", {})
        for side, label in (("ours", "on"), ("ours_off", "off")):
            ours = summary.get(side, {})
            if "error" in ours or "error" in trl:
                steps.append([name, label, "error: " + str(ours.get("error") or trl.get("error"))[:100]] + [""] * 11)
                continue
            steps.append([
                name, label, pair(trl, ours, "peak_allocated", gib), ratio(trl, ours, "peak_allocated"),
                pair(trl, ours, "peak_reserved", gib), pair(trl, ours, "step"), ratio(trl, ours, "step"),
                pair(trl, ours, "train_pass"), ratio(trl, ours, "train_pass"), pair(trl, ours, "generation"),
                ratio(trl, ours, "generation"), "yes" if ours.get("same_completions") else "no",
                "yes" if ours.get("losses_equal") else "no",
                f"{number(ours.get('entropies_max_rel_diff'), '.1e')} / {number(ours.get('grad_norms_max_rel_diff'), '.1e')}",
            ])  # fmt: skip
    header = ["case", "zero-waste", "peak alloc. TRL / grpo_plus (GiB)", "ratio", "reserved TRL / grpo_plus (GiB)",
              "step TRL / grpo_plus (s)", "ratio", "training pass (s)", "ratio", "generation (s)", "ratio",
              "same completions", "losses equal", "entropy / grad-norm max rel. diff"]  # fmt: skip
    tables = [markdown_table(header, steps)] if steps else []
    if ladder:
        header = ["case", "side", "completion tokens", "training-pass peak alloc. (GiB)", "training pass (s)"]
        tables.append(markdown_table(header, ladder))
    return "\n\n".join(tables)


def main(argv=None) -> int:
    json_path = ROOT / "outputs" / "bench-gpu" / "gpu.json"
    parser = arguments(
        __doc__, steps=4, warmup=1, json=json_path, smoke="the same code at tiny shapes on CPU (for the tests)"
    )
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    parser.add_argument("--rounds", type=int, default=1, help="rounds of all sides (every second one reversed)")
    parser.add_argument("--dead-share", type=float, default=0.0, help="share of prompts whose groups get no signal")
    parser.add_argument("--cache-dir", default=os.environ.get("GRPO_PLUS_BENCH_CACHE", "/tmp/grpo_plus_bench"),
                        help="where the 7B case writes its random checkpoint (15 GB) once")  # fmt: skip
    parser.add_argument("--fresh", action="store_true", help="drop the results of earlier runs from --json")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per side before it is stopped")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child_result(run_side(json.loads(args.child)))
        return 0

    import torch

    if args.smoke:
        cases, device = SMOKE_CASES, "cpu"
        args.steps, args.warmup = min(args.steps, 2), 0
    elif not torch.cuda.is_available():
        print(f"bench-gpu: no CUDA device here (torch {torch.__version__}); nothing measured. See README "
              "'GPU and memory' for running it on a GPU machine.")  # fmt: skip
        return 0
    else:
        cases, device = {name: CASES[name] for name in args.cases}, "cuda"

    import transformers
    import trl

    output = args.json
    report = {} if args.fresh or not output.exists() else json.loads(output.read_text())
    report.setdefault("cases", {})
    environment = {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
        "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }  # fmt: skip
    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="bench-gpu-"))
    cache_dir = Path(args.cache_dir) if not args.smoke else work / "checkpoints"
    for case in cases.values():
        if case.qlora:  # written here, so that no side's time or memory includes it
            random_checkpoint(case, cache_dir)
    for name, case in cases.items():
        print(f"== {name}: {case.description}", flush=True)
        sides = LADDER_SIDES if case.ladder else SIDES
        runs: dict[str, list[dict]] = {side: [] for side in sides}
        for _, side in alternating(sides, 1 if case.ladder else args.rounds):
            spec = dict(case=name, side=side, steps=args.steps, warmup=args.warmup, work=str(work),
                        cache_dir=str(cache_dir), dead_share=args.dead_share)  # fmt: skip
            # --smoke: in this process (a child's imports would cost more than its tiny run)
            result = run_side(spec) if args.smoke else run_child(spec, args.timeout)
            runs[side].append(result)
            print(f"   {side:8s} {'error: ' + result['error'] if 'error' in result else 'done'}", flush=True)
        if case.ladder:
            summary = {side: results[0].get("rungs", [{"completion_length": 0, "error": results[0].get("error")}])
                       for side, results in runs.items()}  # fmt: skip
        else:
            summary = compare_steps(runs, case.completion_length)
        report["cases"][name] = {"environment": environment, "case": dataclasses.asdict(case),
                                 "ladder": bool(case.ladder), "summary": summary}  # fmt: skip
    with contextlib.suppress(Exception):  # a report on the kernels is a bonus, never a reason to lose the run
        report["sdpa"] = sdpa_kernel_report(device, **({"shape": "tiny-qwen2", "completion_length": 16,
                                                       "prompt_length": 8, "group": 4} if args.smoke else {}))  # fmt: skip
    table = format_table(report["cases"])
    print("\n" + table)
    if "sdpa" in report:
        sdpa = report["sdpa"]
        runs_on = [name for name, value in sdpa["backends"].items() if value["runs"]]
        print(f"\nShared-prompt block mask ({sdpa['packs']} packs x {sdpa['pack_width']} positions) on {device}: "
              f"runs on {', '.join(runs_on)}; default dispatch {sdpa['default_ms']:.2f} ms via "
              f"{', '.join(sdpa['default_kernels']) or '?'}; TRL's causal rows {sdpa['trl_causal_ms']:.2f} ms")  # fmt: skip
    write_report(report, output, markdown=table, started=started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
