"""Speculative rollouts without a draft model (`speculative_rollouts`): grpo_plus's generator drafts each completion's
next tokens from n-gram matches in its group's text and verifies them in one forward, the policy's distribution
unchanged."""

from .acceptance import point_mass_acceptance, verify
from .decoding import SpeculationStats, SpeculativeDecoder
from .settings import SpeculativeSettings

__all__ = ["SpeculationStats", "SpeculativeDecoder", "SpeculativeSettings", "point_mass_acceptance", "verify"]
