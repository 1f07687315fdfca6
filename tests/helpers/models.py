"""Tiny local models, tokenizers, datasets and trainers: nothing is downloaded.

The tokenizer, the tiny Llama, the prompt dataset and the run settings are `grpo_plus.app.testing`'s, which the
benchmarks share; this module adds the other model families and the trainer the tests build."""

from __future__ import annotations

from datasets import Dataset
from transformers import GPT2Config, GPTNeoXConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

import grpo_plus
from grpo_plus.app.testing import (  # noqa: F401  (re-exported: the tests import them from here)
    make_model,
    make_tokenizer,
    prompt_dataset,
    save_tiny_model,
    tiny_run_kwargs,
)


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
