"""Model shapes, a tokenizer and synthetic micro-batches (benchmarks/gpu.py, the training-pass sweeps).

The Qwen2.5 entries are the architecture fields of the real models' config.json (Qwen/Qwen2.5-{0.5B,1.5B,7B}-Instruct),
so a model built from them with random weights has the real parameter count, layer shapes and memory, without a
download. `tiny-qwen2` is for --smoke runs and for checking the memory counting against real compute.
"""

from __future__ import annotations

from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
RECIPE_CONFIGS = ROOT / "recipes" / "configs"

QWEN25_SHAPES: dict[str, dict] = {
    "qwen2.5-0.5b": dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        vocab_size=151936, rope_theta=1000000.0, tie_word_embeddings=True, max_position_embeddings=32768,
        rms_norm_eps=1e-6, sliding_window=32768, use_sliding_window=False, max_window_layers=21,
    ),
    "qwen2.5-1.5b": dict(
        hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        vocab_size=151936, rope_theta=1000000.0, tie_word_embeddings=True, max_position_embeddings=32768,
        rms_norm_eps=1e-6, sliding_window=32768, use_sliding_window=False, max_window_layers=21,
    ),
    # The 7B's vocabulary is 152064 rows (its embedding is padded further than the smaller models').
    "qwen2.5-7b": dict(
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        vocab_size=152064, rope_theta=1000000.0, tie_word_embeddings=False, max_position_embeddings=32768,
        rms_norm_eps=1e-6, sliding_window=131072, use_sliding_window=False, max_window_layers=28,
    ),
    "tiny-qwen2": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=512, rope_theta=1000000.0, tie_word_embeddings=True, max_position_embeddings=4096,
        rms_norm_eps=1e-6, use_sliding_window=False,
    ),
}  # fmt: skip
# Token ids 0..2 are special in the benchmark tokenizer; prompts and completions draw from the rest.
PAD, EOS, BOS = 0, 1, 2
FIRST_WORD = 3


def qwen2_config(shape: str, attn_implementation: str = "sdpa", **overrides):
    """A transformers Qwen2Config of one of QWEN25_SHAPES, with the benchmark tokenizer's special token ids."""
    from transformers import Qwen2Config

    fields = {**QWEN25_SHAPES[shape], **overrides}
    config = Qwen2Config(pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS, **fields)
    config._attn_implementation = attn_implementation
    return config


def word_tokenizer(vocab_size: int):
    """A tokenizer with exactly `vocab_size` ids: <pad> <eos> <bos>, then the words w3 .. w{vocab_size - 1}.

    Any id a random model samples decodes to a word, and a prompt written as "w5 w17 ..." encodes to those ids, one
    token per word, so prompt lengths are exact.
    """
    from tokenizers import pre_tokenizers

    from grpo_plus.app.testing import word_level_tokenizer

    vocab = {"<pad>": PAD, "<eos>": EOS, "<bos>": BOS}
    vocab.update({f"w{i}": i for i in range(FIRST_WORD, vocab_size)})
    return word_level_tokenizer(vocab, pre_tokenizers.WhitespaceSplit())


def prompt_text(length: int, vocab_size: int, seed: int) -> str:
    """A prompt of exactly `length` tokens for word_tokenizer(vocab_size)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(FIRST_WORD, vocab_size, (length,), generator=generator)
    return " ".join(f"w{i}" for i in ids.tolist())


def recipe(name: str) -> dict:
    """The raw settings of recipes/configs/<name>.yaml."""
    import yaml

    return yaml.safe_load((RECIPE_CONFIGS / f"{name}.yaml").read_text())


def synthetic_micro_batch(
    rows: int, group_size: int, prompt_length: int, completion_length: int, vocab_size: int,
    dead_share: float = 0.0, seed: int = 0, ragged: bool = False, first_token: int = FIRST_WORD,
) -> dict:  # fmt: skip
    """A training micro-batch as TRL's `_prepare_inputs` hands it to `_compute_loss`: `rows` rows in groups of
    `group_size` consecutive rows sharing a prompt, every completion `completion_length` tokens long (no EOS, no
    padding: the worst case for memory) or, `ragged`, between a quarter of that and all of it (the first row full),
    advantages random except in the first `dead_share` of the groups (0). Token ids from `first_token` up."""
    generator = torch.Generator().manual_seed(seed)
    groups = -(-rows // group_size)
    prompts = torch.randint(first_token, vocab_size, (groups, prompt_length), generator=generator)
    prompt_ids = prompts.repeat_interleave(group_size, dim=0)[:rows]
    completion_mask = torch.ones(rows, completion_length, dtype=torch.long)
    if ragged:
        lengths = torch.randint(max(completion_length // 4, 1), completion_length + 1, (rows,), generator=generator)
        lengths[0] = completion_length
        completion_mask = (torch.arange(completion_length) < lengths.unsqueeze(1)).long()
    completion_ids = torch.randint(first_token, vocab_size, (rows, completion_length), generator=generator)
    completion_ids = completion_ids * completion_mask
    advantages = torch.randn(rows, generator=generator)
    dead_rows = round(dead_share * groups) * group_size
    advantages[:dead_rows] = 0.0
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": advantages,
        "num_items_in_batch": completion_mask.sum().float(),
    }
