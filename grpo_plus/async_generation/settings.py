"""GRPOConfig's asynchronous-generation fields (`async_generation`, `max_staleness`, `weight_sync_steps`: TRL's
AsyncGRPOConfig names, with their meaning): declared and checked."""

from __future__ import annotations

from dataclasses import dataclass

from ..settings import SettingsGroup, not_allowed, setting


@dataclass(frozen=True)
class AsyncGenerationSettings(SettingsGroup):
    """Whether a vLLM server generates the next batches while the trainer trains, and how far behind they may be."""

    enabled: bool = setting(
        False,
        "With a vLLM server (use_vllm=True, vllm_mode='server'): the server generates the next generation batches "
        "while the trainer trains on the current one, each with the weights the server holds when it is asked "
        "(the last sync). Training then waits only for what generation takes beyond the training step. The "
        "batches are off-policy by up to `max_staleness` optimizer steps; the sampler's log-probs correct them "
        "(TRL's vllm_importance_sampling_correction, its default, or a rollout_correction preset). Off: TRL's "
        "synchronous loop.",
        field="async_generation",
    )
    max_staleness: int = setting(
        1,
        "Asynchronous generation: the most optimizer steps a generation batch's weights may lag behind the "
        "weights it is trained from (TRL AsyncGRPOConfig's meaning). A batch older than this is never trained "
        "on: it is dropped and generated again with the server's current weights (`async/dropped_batches`). The "
        "server is asked for `max_staleness - weight_sync_steps + 1` batches ahead, so in an uninterrupted run "
        "every batch is exactly as stale as this allows and the run is reproducible: batch k is generated with "
        "the weights of step k - max_staleness (the last sync at or before it). Partial rollouts "
        "(partial_rollout_tokens): the most optimizer steps a group waits unfinished before it is decoded to the end "
        "(no token is trained more than max_staleness steps after the weights that sampled it).",
    )
    weight_sync_steps: int = setting(
        1,
        "Asynchronous generation: the optimizer steps between two weight syncs to the vLLM server (TRL "
        "AsyncGRPOConfig's meaning); at most `max_staleness`.",
    )

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise not_allowed("async_generation", self.enabled, "true or false")
        if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int) or self.max_staleness < 1:
            raise not_allowed(
                "max_staleness",
                self.max_staleness,
                "an integer >= 1 (0 is TRL's synchronous loop: set async_generation=False instead)",
            )
        if (
            isinstance(self.weight_sync_steps, bool)
            or not isinstance(self.weight_sync_steps, int)
            or not 1 <= self.weight_sync_steps <= self.max_staleness
        ):
            raise not_allowed(
                "weight_sync_steps",
                self.weight_sync_steps,
                f"an integer from 1 to max_staleness ({self.max_staleness}): a batch generated just before a sync "
                "is trained weight_sync_steps - 1 steps later at the least",
            )

    @property
    def batches_ahead(self) -> int:
        """How many generation batches the server is asked for before the trainer needs them."""
        return self.max_staleness - self.weight_sync_steps + 1

    def check_combinations(
        self, use_vllm: bool, vllm_mode: str, sampler_corrected: bool, dynamic_sampling: bool, selective: bool
    ) -> None:
        """Refuse what cannot run asynchronously, naming the field and what to do."""
        if not self.enabled:
            return
        if not use_vllm or vllm_mode != "server":
            raise not_allowed(
                "async_generation",
                True,
                "False unless use_vllm=True and vllm_mode='server' (a `grpo-plus vllm-serve` server generates while "
                f"the trainer trains; here use_vllm={use_vllm}, vllm_mode={vllm_mode!r})",
            )
        if not sampler_corrected:
            raise not_allowed(
                "async_generation",
                True,
                "False unless the sampler's log-probs correct the off-policy batches: keep "
                "vllm_importance_sampling_correction=True (TRL's default) or set a rollout_correction preset",
            )
        if dynamic_sampling or selective:
            raise not_allowed(
                "async_generation",
                True,
                "False with dynamic sampling or selective rollout (they choose a step's prompts from the rewards of "
                "its own generation rounds, which asynchronous generation asks for before the step)",
            )
