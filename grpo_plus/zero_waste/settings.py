"""GRPOConfig's `zero_waste_*` fields: which savings of the zero-waste pass and generation are on (the code:
grpo_plus.zero_waste.training_pass, generation)."""

from __future__ import annotations

from dataclasses import dataclass

from ..settings import SettingsGroup, setting


@dataclass(frozen=True)
class ZeroWasteSettings(SettingsGroup):
    """The zero-waste training pass and zero-waste generation, each saving on or off."""

    prefix = "zero_waste_"

    training_pass: bool = setting(
        True,
        "Compute log-probs only for what carries gradient: skip rows with zero advantage, cut the padding "
        "after each completion, and (see zero_waste_shared_prompt) compute each group's prompt once. The "
        "gradient is TRL's; where it would not be (beta > 0, entropy bonus or top_entropy_quantile < 1, router aux "
        "loss, a user mode that did not declare zero_advantage_rows_contribute_nothing), that part falls back to "
        "the full pass and says why once in the log. With rows skipped, `entropy` (TRL's, every row) is left "
        "unknown unless zero_waste_exact_entropy=True, and `zero_waste/entropy_trained_rows` covers the rows "
        "trained.",
        field="zero_waste_pass",
    )
    shared_prompt: bool = setting(
        True,
        "Part of the zero-waste pass: compute a group's shared prompt once, with a block attention mask "
        "that lets each completion see the prompt and itself (Prefix Grouper), in the training forward and in "
        "TRL's old/reference log-prob passes. Applies to the checked model families (llama, mistral, qwen2, "
        "qwen3, gpt2) with sdpa or eager attention on TRL >= 1.15; elsewhere prompts are recomputed per row.",
    )
    generation: bool = setting(
        True,
        "Generate with transformers (no vLLM) without the waste: prefill each distinct prompt once and "
        "copy its KV cache to the G completions, and leave finished completions out of the decode batch. Same "
        "sampling settings and random draws as TRL's `model.generate`. Falls back to TRL's generation, saying why "
        "once in the log, with vLLM, continuous batching, multimodal prompts, tools, caches that cannot be copied "
        "by row, and other decoding modes (beams).",
    )
    exact_entropy: bool = setting(
        False,
        "With rows skipped by the zero-waste pass, also run the skipped rows through a no-grad forward so "
        "the logged `entropy` is TRL's (every completion token), at the cost of that forward. Off: `entropy` is "
        "logged only for logging windows in which no row was skipped (else None), and "
        "`zero_waste/entropy_trained_rows` gives the entropy of the rows trained. Never changes the training.",
    )
