"""Asynchronous generation: a vLLM server generates the next batches while the trainer trains (`async_generation`)."""

from .pipeline import AsyncGeneration, AsyncGenerationError, PromptLookahead, trainer_blocker
from .settings import AsyncGenerationSettings

__all__ = ["AsyncGeneration", "AsyncGenerationError", "AsyncGenerationSettings", "PromptLookahead", "trainer_blocker"]
