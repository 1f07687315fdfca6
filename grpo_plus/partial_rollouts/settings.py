"""GRPOConfig's `partial_rollout_tokens` field: partial rollouts for the long tail in grpo_plus's own generator or
vLLM, colocated or a server (the code: grpo_plus.partial_rollouts). The staleness bound is `max_staleness` (declared
once, in async_generation)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..settings import SettingsGroup, not_allowed, setting

# Sampling settings whose meaning depends on which tokens are the completion: each chunk sends a row's tokens so far as
# part of its prompt, so the sampler would count only the chunk's own (vLLM's presence / frequency penalties,
# min_tokens and structured outputs; transformers' min_new_tokens). Repetition penalties, n-gram bans and
# transformers' min_length cover the prompt as well: unchanged by chunks.
COMPLETION_SCOPED_GENERATION_KWARGS = (
    "presence_penalty", "frequency_penalty", "min_tokens", "structured_outputs", "min_new_tokens",
)  # fmt: skip


@dataclass(frozen=True)
class PartialRolloutSettings(SettingsGroup):
    """Whether a step's generation decodes in chunks and stops once it holds the groups its step needs."""

    tokens: int | None = setting(
        None,
        "Partial rollouts for the long tail, grpo_plus's own generator (zero_waste_generation) or vLLM (colocated, "
        "or a server with one trainer process); on several processes (DDP, ZeRO-1/2) a pool per process: "
        "a step's generation decodes every unfinished completion by at most this many tokens at a time and stops "
        "as soon as it holds as many complete groups (all G completions ended) as the step trains; the unfinished "
        "rows keep their tokens and per-token sampler log-probs and continue in a later step under newer weights "
        "(each token's optimizer step recorded). A group is decoded to the end once it has waited `max_staleness` "
        "steps. None (default): TRL's generation, unchanged.",
        field="partial_rollout_tokens",
    )
    # GRPOConfig's `max_staleness` (declared by async_generation), given by the caller: the most optimizer steps a
    # group waits in the pool before it is decoded to the end
    max_staleness: int = field(default=1)
    # TRL's `generation_kwargs` seed against a vLLM server (`server_request_seed`), given by the caller: each row's
    # request of each chunk is seeded from it (`pool.row_seed`); None: requests unseeded
    request_seed: int | None = field(default=None)

    def __post_init__(self) -> None:
        if self.tokens is not None and (isinstance(self.tokens, bool) or not isinstance(self.tokens, int)):
            raise not_allowed("partial_rollout_tokens", self.tokens, "None or an integer >= 1")
        if self.tokens is not None and self.tokens < 1:
            raise not_allowed("partial_rollout_tokens", self.tokens, "None or an integer >= 1")
        seed = self.request_seed
        if self.enabled and seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise not_allowed("generation_kwargs seed", seed, "an integer (each row's request is seeded from it)")

    @property
    def enabled(self) -> bool:
        return self.tokens is not None

    def check_combinations(
        self,
        *,
        use_vllm: bool,
        vllm_mode: str,
        zero_waste_generation: bool,
        async_generation: bool,
        dynamic_sampling: bool,
        selective_rollout: bool,
        continuous_batching: bool,
        greedy_baseline: bool = False,
        generation_kwargs: dict | None = None,
        trl_takes_num_generations: bool = True,
        structured_outputs_regex: str | None = None,
        tensor_parallel_size: int = 1,
    ) -> None:
        """Refuse what partial rollouts cannot run with, naming the field and what to do instead."""
        if not self.enabled:
            return
        scoped = [key for key in COMPLETION_SCOPED_GENERATION_KWARGS if key in (generation_kwargs or {})]
        refusals = (
            (
                async_generation,
                "with async_generation=True: asynchronous generation overlaps a server's generation with training, "
                "partial rollouts cut the long tail of each step's generation; the two are alternatives (choose one)",
            ),
            (
                use_vllm and vllm_mode != "server" and "seed" in (generation_kwargs or {}),
                "with generation_kwargs seed in vLLM's colocate mode: TRL gives every row's request the same seed, "
                "which draws the same tokens for a group's rows (which share their prompt); leave the seed out (the "
                "colocated engine is seeded once, from GRPOConfig's seed, and a resumed run draws the same tokens "
                "without it)",
            ),
            (
                use_vllm and vllm_mode == "server" and not trl_takes_num_generations,
                "with vllm_mode='server' on this TRL: its server requests send each prompt once for a group "
                "(n completions of one prompt), and a group's carried rows hold different tokens; TRL 1.14.2 or later "
                "takes the group size per call (or use vllm_mode='colocate')",
            ),
            (
                not use_vllm and not zero_waste_generation,
                "with zero_waste_generation=False: partial rollouts run in grpo_plus's own generator, which records "
                "each token's sampler log-prob (set zero_waste_generation=True)",
            ),
            (
                dynamic_sampling or selective_rollout,
                "with dynamic sampling or selective rollout: they choose a step's prompts from its own generation "
                "rounds",
            ),
            (
                greedy_baseline,
                "with an advantage estimator that generates a greedy baseline (remax): it would generate for prompts "
                "whose completions the pool decoded under other weights",
            ),
            (
                continuous_batching,
                "with use_transformers_continuous_batching=True: transformers' continuous batching generates there, "
                "not grpo_plus's generator",
            ),
        )
        refusals += (
            (
                bool(scoped),
                f"with generation_kwargs {', '.join(scoped)}: each chunk sends a row's tokens so far as its prompt, so "
                "a setting counted over the completion would see only the chunk's tokens",
            ),
            (
                structured_outputs_regex is not None,
                "with vllm_structured_outputs_regex: each chunk would restart the pattern at the row's tokens so far",
            ),
            (
                use_vllm and vllm_mode == "colocate" and tensor_parallel_size > 1,
                f"with vllm_tensor_parallel_size={tensor_parallel_size}: TRL gathers a tensor-parallel group's rows "
                "into each call, while each process's pool stops after its own chunks (set it to 1)",
            ),
        )
        for refused, why in refusals:
            if refused:
                raise not_allowed("partial_rollout_tokens", self.tokens, f"None {why}")


def server_request_seed(use_vllm: bool, vllm_mode: str, generation_kwargs: dict | None) -> int | None:
    """The seed in TRL's `generation_kwargs` when a vLLM server generates, else None: with partial rollouts, each
    row's request is seeded from it."""
    if not use_vllm or vllm_mode != "server":
        return None
    return (generation_kwargs or {}).get("seed")
