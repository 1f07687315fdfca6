"""Tiny local models, tokenizers, datasets and trainers: nothing is downloaded.

The tokenizer, the tiny models of each family, the prompt dataset and the run settings are
`grpo_plus.app.testing`'s, which the benchmarks share; this module adds the trainer the tests build."""

from __future__ import annotations

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

import grpo_plus
from grpo_plus.app.testing import (  # noqa: F401  (re-exported: the tests import them from here)
    make_model,
    make_tokenizer,
    prompt_dataset,
    save_tiny_model,
    tiny_config,
    tiny_run_kwargs,
)


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


def saved_model_trainer(model_dir, output_dir, reward_funcs, package=grpo_plus, **kwargs):
    """`tiny_trainer` on a fresh float32 load of the model (and tokenizer) saved in `model_dir`."""
    from transformers import AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return tiny_trainer(output_dir, list(reward_funcs), model=model, tokenizer=tokenizer, package=package, **kwargs)
