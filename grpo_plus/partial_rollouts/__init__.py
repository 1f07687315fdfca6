"""Partial rollouts for the long tail: a step's generation stops once it holds its groups (see `pool`); grpo_plus's
generator or vLLM (colocated or a server)."""

from .pool import Chunk, Handoff, PartialRolloutError, PartialRollouts, chunk_decoder, engine_chunk_decoder
from .pool import trainer_blocker as partial_rollouts_blocker
from .settings import PartialRolloutSettings

__all__ = [
    "Chunk",
    "Handoff",
    "PartialRolloutError",
    "PartialRolloutSettings",
    "PartialRollouts",
    "chunk_decoder",
    "engine_chunk_decoder",
    "partial_rollouts_blocker",
]
