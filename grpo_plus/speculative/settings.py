"""GRPOConfig's `speculative_*` fields: speculative rollouts without a draft model (the code: grpo_plus.speculative)."""

from __future__ import annotations

from dataclasses import dataclass

from ..settings import SettingsGroup, not_allowed, setting


@dataclass(frozen=True)
class SpeculativeSettings(SettingsGroup):
    """Whether grpo_plus's generator drafts tokens from n-gram matches and verifies them, and how far it drafts."""

    prefix = "speculative_"

    enabled: bool = setting(
        False,
        "Speculative rollouts without a draft model, in grpo_plus's own generator (zero_waste_generation, no "
        "vLLM): each unfinished completion proposes up to `speculative_max_draft_tokens` tokens copied from an "
        "n-gram match in its prompt, its own text or its siblings' text (the completions of the same prompt), and "
        "one forward checks them for every row. A drafted token is kept with its probability under the processed "
        "distribution TRL samples from (temperature, top_p, top_k, min_p, repetition_penalty, ...), else a token is "
        "drawn from that distribution without it: the completions are distributed exactly as without speculation, "
        "and greedy decoding gives the same tokens. Off: today's generation, unchanged.",
        field="speculative_rollouts",
    )
    max_draft_tokens: int = setting(
        4,
        "Speculative rollouts: the most tokens a completion drafts per forward (k). The forward then carries k + 1 "
        "tokens per row; a draft never runs past max_completion_length.",
    )
    adaptive_draft: bool = setting(
        True,
        "Speculative rollouts: each completion drafts as many tokens as its acceptance so far predicts it keeps "
        "(1 + a / (1 - a) for a kept fraction a, from a prior of 3 kept in 4), at least 1 and at most "
        "speculative_max_draft_tokens; a row whose drafts are refused then costs one extra position per forward, "
        "not k. False: every row drafts up to speculative_max_draft_tokens.",
    )
    ngram_max: int = setting(
        3,
        "Speculative rollouts: the longest n-gram (the completion's last n tokens) looked up in the prompt and the "
        "group's text to find a continuation to draft; longer matches are tried first.",
    )
    ngram_min: int = setting(
        1,
        "Speculative rollouts: the shortest n-gram looked up (at most speculative_ngram_max); below it, no draft.",
    )

    def __post_init__(self) -> None:
        for name in ("enabled", "adaptive_draft"):
            if not isinstance(getattr(self, name), bool):
                raise not_allowed(self.field_name(name), getattr(self, name), "true or false")
        for name in ("max_draft_tokens", "ngram_max", "ngram_min"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise not_allowed(self.field_name(name), value, "an integer >= 1")
        if self.ngram_min > self.ngram_max:
            raise not_allowed(
                "speculative_ngram_min",
                self.ngram_min,
                f"at most speculative_ngram_max ({self.ngram_max})",
            )

    def check_combinations(
        self, use_vllm: bool, zero_waste_generation: bool, continuous_batching: bool, generation_kwargs: dict | None
    ) -> None:
        """Refuse what speculation cannot run in, naming the field and what to do instead."""
        if not self.enabled:
            return
        beams = (generation_kwargs or {}).get("num_beams") or 1
        if beams > 1:
            raise not_allowed(
                "speculative_rollouts",
                True,
                f"False with beam search (generation_kwargs num_beams={beams}): speculation verifies drafts for "
                "sampling and greedy decoding only",
            )
        if use_vllm:
            raise not_allowed(
                "speculative_rollouts",
                True,
                "False with use_vllm=True: vLLM generates, and vLLM has its own n-gram speculative decoding: set "
                "vllm_speculative_config={'method': 'ngram', 'num_speculative_tokens': k, 'prompt_lookup_max': n} "
                "(a server: grpo-plus vllm-serve --speculative_config); grpo_plus's speculation runs in its own "
                "transformers generator",
            )
        if not zero_waste_generation:
            raise not_allowed(
                "speculative_rollouts",
                True,
                "False with zero_waste_generation=False: speculation is a decoding loop of grpo_plus's generator, "
                "which zero_waste_generation=False turns off (set it True)",
            )
        if continuous_batching:
            raise not_allowed(
                "speculative_rollouts",
                True,
                "False with use_transformers_continuous_batching=True: transformers' continuous batching generates "
                "there, not grpo_plus's generator",
            )
