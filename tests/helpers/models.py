"""Tiny local models, tokenizers, datasets and trainers: nothing is downloaded."""

from __future__ import annotations

import string
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

import grpo_plus

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
    return classes[family](**{**sizes, **overrides}, max_position_embeddings=64, **common)


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


def tiny_trainer(
    output_dir,
    reward_funcs,
    *,
    model=None,
    tokenizer=None,
    dataset: Dataset | None = None,
    peft_config=None,
    package=grpo_plus,
    **settings,
):
    """`package`'s GRPOTrainer (grpo_plus's; `trl` for stock TRL's) on `dataset` (prompt_dataset(8) by default), with
    GRPOConfig(**tiny_run_kwargs(output_dir, **settings)).

    `model`: a model, or None for a fresh tiny Llama (and its tokenizer). `tokenizer`: the processing class; left None
    for a given model, TRL loads the one saved beside it."""
    if model is None:
        tokenizer = tokenizer or make_tokenizer()
        model = make_model(tokenizer)
    return package.GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=reward_funcs,
        args=package.GRPOConfig(**tiny_run_kwargs(output_dir, **settings)),
        train_dataset=prompt_dataset(8) if dataset is None else dataset,
        peft_config=peft_config,
    )
