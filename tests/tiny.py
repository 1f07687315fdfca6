"""Tiny local models and tokenizers for tests: nothing is downloaded."""

from __future__ import annotations

import math
import signal
import string
import subprocess
import sys
import time
from pathlib import Path

import torch
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

from grpo_plus.checkpoints import is_complete_checkpoint

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>"]
CHARS = string.ascii_letters + string.digits + " .,:;!?+-*/=()<>'\"#\n"
CHAT_TEMPLATE = (
    "{% for message in messages %}<{{ message['role'][0] }}>{{ message['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<a>{% endif %}"
)


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer with pad/eos/bos and a minimal chat template."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + list(dict.fromkeys(CHARS)))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<pad>",
        # What causal-LM tokenizers declare; transformers 4.x would otherwise add token_type_ids, which generate rejects.
        model_input_names=["input_ids", "attention_mask"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_model(tokenizer: PreTrainedTokenizerFast, seed: int = 0, hidden_size: int = 32, layers: int = 2):
    """A randomly initialised Llama small enough to train in milliseconds."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=False,
    )
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def tiny_config(family: str, vocab_size: int, **overrides):
    """A two-layer model of `family` (llama, mistral, qwen2, qwen3: rotary positions; gpt2: learned absolute ones)."""
    common = dict(vocab_size=vocab_size, tie_word_embeddings=False, pad_token_id=0)
    if family == "gpt2":
        no_dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, **no_dropout, **common, **overrides)
    classes = {
        "llama": LlamaConfig,
        "mistral": MistralConfig,
        "qwen2": Qwen2Config,
        "qwen3": Qwen3Config,
        "gpt_neox": GPTNeoXConfig,  # not a checked family: its forward is not proven to take a block mask as given
    }
    sizes = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    return classes[family](**sizes, max_position_embeddings=64, **common, **overrides)


def accelerate_launch(num_processes: int = 2) -> list[str]:
    """`accelerate launch` for several CPU processes (gloo): --multi_gpu starts torchrun's launcher, which
    falls back to CPU; --cpu would run a single process."""
    accelerate = str(Path(sys.executable).parent / "accelerate")
    return [accelerate, "launch", "--multi_gpu", "--num_processes", str(num_processes), "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no"]  # fmt: skip


def save_tiny_model(path: str | Path, seed: int = 0, **kwargs) -> Path:
    """Write a tiny model + tokenizer to `path`, loadable by `from_pretrained(path)`."""
    path = Path(path)
    tokenizer = make_tokenizer()
    model = make_model(tokenizer, seed=seed, **kwargs)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def prompt_dataset(num_prompts: int = 8, conversational: bool = False) -> Dataset:
    """Short prompts with an integer `answer` column."""
    rows = []
    for i in range(num_prompts):
        a, b = i % 5 + 1, (3 * i) % 4 + 1
        text = f"{a}+{b}="
        prompt = [{"role": "user", "content": text}] if conversational else text
        rows.append({"prompt": prompt, "answer": a + b})
    return Dataset.from_list(rows)


def text_of(message) -> str:
    """A prompt or completion as text (standard: the string; conversational: the last message's content)."""
    return message if isinstance(message, str) else message[-1]["content"]


def starts_odd(prompt) -> bool:
    """The prompts the dead-group rewards below make constant: those starting with an odd digit."""
    return int(text_of(prompt)[0]) % 2 == 1


def length_reward(completions, **kwargs) -> list[float]:
    """Longer completions score higher, with ties: some groups have zero variance, others do not."""
    return [float(min(len(text_of(c)), 8) // 4) for c in completions]


def digit_reward(completions, **kwargs) -> list[float]:
    """Fraction of characters that are digits."""
    texts = [text_of(c) for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in texts]


class RowSeededSampler:
    """Logits processor: Gumbel-max sampling whose noise depends only on (seed, call, global row, position).

    Two runs that split the same generation batch differently across processes (or micro-batches) then draw
    identical completions, so their training can be compared weight for weight.
    """

    def __init__(self, seed: int, row_offset: int = 0):
        self.seed, self.row_offset, self.calls = seed, row_offset, 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        chosen = []
        for row in range(scores.shape[0]):
            generator = torch.Generator().manual_seed(
                hash((self.seed, self.calls, self.row_offset + row, input_ids.shape[1])) % (2**31)
            )
            uniform = torch.rand(scores.shape[1], generator=generator).clamp(1e-10, 1 - 1e-10)
            chosen.append(torch.argmax(scores[row].float() - torch.log(-torch.log(uniform))))
        one_hot = torch.full_like(scores, float("-inf"))
        one_hot[torch.arange(scores.shape[0]), torch.stack(chosen)] = 0.0
        return one_hot


def use_row_seeded_sampling(model, seed: int, row_offset: int = 0) -> RowSeededSampler:
    """Make `model.generate` sample with a RowSeededSampler (after TRL's temperature/top-k processors)."""
    sampler = RowSeededSampler(seed, row_offset)
    original_generate = model.generate

    def generate(*args, **kwargs):
        kwargs["logits_processor"] = [*kwargs.get("logits_processor", []), sampler]
        try:
            return original_generate(*args, **kwargs)
        finally:
            sampler.calls += 1

    model.generate = generate
    return sampler


def tiny_run_kwargs(output_dir, **overrides) -> dict:
    """GRPOConfig kwargs for a seconds-long CPU run on the tiny model."""
    kwargs = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=2,
        learning_rate=0.05,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=0,
        use_cpu=True,
        bf16=False,
        disable_tqdm=True,
    )
    kwargs.update(overrides)
    return kwargs


def odd_prompts_constant_reward(completions, prompts, **kwargs) -> list[float]:
    """Constant reward for prompts starting with an odd digit (dead groups), length reward otherwise."""
    return [1.0 if starts_odd(p) else float(len(text_of(c))) for p, c in zip(prompts, completions, strict=True)]


def half_dead_reward(completions, prompts, **kwargs) -> list[float]:
    """1 for prompts starting with an odd digit (dead groups), the digit fraction otherwise (rarely tied)."""
    return [1.0 if starts_odd(p) else d for p, d in zip(prompts, digit_reward(completions), strict=True)]


def constant_reward(completions, **kwargs) -> list[float]:
    """Every group is dead."""
    return [1.0] * len(completions)


class GroupRecorder:
    """Wraps a trainer's `_compute_loss` to record what every micro-batch trained on."""

    def __init__(self, trainer, num_generations: int):
        self.batches, self.num_generations = [], num_generations
        original = trainer._compute_loss

        def recording_compute_loss(model, inputs):
            self.batches.append({k: v.detach().clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)})
            return original(model, inputs)

        trainer._compute_loss = recording_compute_loss

    def groups(self):
        """(prompt_ids, advantages) per group of consecutive rows in every recorded micro-batch."""
        g = self.num_generations
        for batch in self.batches:
            for start in range(0, batch["prompt_ids"].shape[0], g):
                yield batch["prompt_ids"][start : start + g], batch["advantages"][start : start + g]


def explode_at_step_3(completions, trainer_state=None, **kwargs) -> list[float]:
    """Scores like `length_reward` for two optimizer steps, then raises: a crash in the middle of training."""
    if trainer_state is not None and trainer_state.global_step >= 2:
        return [1 / 0 for _ in completions]
    return length_reward(completions)


def max_weight_diff(a: dict, b: dict) -> float:
    """Largest |a - b| over the tensors of `a` (state dicts or weight files)."""
    return max((a[k] - b[k]).abs().max().item() for k in a)


class ForwardLog:
    """Records what every call of a model's backbone received (generation, no-grad passes and training forwards)."""

    def __init__(self, model):
        self.calls: list[dict] = []
        backbone = model.get_base_model() if hasattr(model, "get_base_model") else model
        backbone.base_model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask")
        self.calls.append(
            {
                "shape": tuple(input_ids.shape),
                "mask_dims": None if mask is None else mask.dim(),
                "grad": torch.is_grad_enabled(),
            }
        )

    @property
    def positions(self) -> int:
        """Token positions computed over all recorded calls."""
        return sum(math.prod(call["shape"]) for call in self.calls)

    @property
    def training_positions(self) -> int:
        """Token positions of the forwards that carried gradient (the training pass)."""
        return sum(math.prod(call["shape"]) for call in self.calls if call["grad"])

    def clear(self) -> None:
        self.calls.clear()


def odd_prompts_dead_reward(completions, prompts, **kwargs) -> list[float]:
    """1.0 for every completion of a prompt starting with an odd digit (always dead, "solved"); 0/1 alternating by
    row otherwise, so those groups (consecutive rows) are always informative whatever the model writes."""
    return [1.0 if starts_odd(p) else float(row % 2) for row, p in enumerate(prompts)]


def dead_rows(dataset) -> set[int]:
    """Rows of `prompt_dataset` that `odd_prompts_dead_reward` makes dead."""
    return {i for i, row in enumerate(dataset) if starts_odd(row["prompt"])}


def kill_after_checkpoint(command: list[str], checkpoint: Path, timeout: float = 240) -> str:
    """Run `command`, SIGKILL it as soon as `checkpoint` is complete (kill -9: no cleanup, no crash handler); returns
    what it printed."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout
    while not is_complete_checkpoint(checkpoint):
        assert process.poll() is None, process.stdout.read()[-3000:]
        assert time.monotonic() < deadline, f"no {checkpoint.name} in time"
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    output, _ = process.communicate()
    assert process.returncode == -signal.SIGKILL
    return output
