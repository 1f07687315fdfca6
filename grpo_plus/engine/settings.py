"""GRPOConfig's colocated-engine fields (`vllm_quantization`, `vllm_dtype`, `vllm_sync_check`), read and validated."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..settings import not_allowed
from .precision import VLLM_DTYPES
from .receipt import SYNC_CHECK_MODES


@dataclass(frozen=True)
class VLLMSettings:
    """What the colocated engine serves the weights in, and which syncs are checked."""

    quantization: str = "auto"
    dtype: str = "auto"
    sync_check: str = "every"

    @classmethod
    def from_args(cls, args: Any) -> VLLMSettings:
        """Each field from GRPOConfig's `vllm_<field>`."""
        return cls(quantization=args.vllm_quantization, dtype=args.vllm_dtype, sync_check=args.vllm_sync_check)

    def validate(self) -> None:
        """Raise ConfigError, naming the GRPOConfig field, for a value the engine cannot use."""
        if not isinstance(self.quantization, str) or self.quantization.lower() == "bitsandbytes":
            raise not_allowed(
                "vllm_quantization",
                self.quantization,
                "'auto', 'none' or an online quantization vLLM has (e.g. 'fp8'); not 'bitsandbytes': vLLM 0.31 has "
                "no bitsandbytes, and grpo_plus syncs a 4-bit base dequantized, for the engine to serve in bfloat16 "
                "or quantize itself",
            )
        if self.dtype not in VLLM_DTYPES:
            raise not_allowed("vllm_dtype", self.dtype, f"one of {', '.join(map(repr, VLLM_DTYPES))}")
        if self.sync_check not in SYNC_CHECK_MODES:
            raise not_allowed(
                "vllm_sync_check",
                self.sync_check,
                "'every' (each weight sync checked before the engine generates from it), 'first' (the first sync "
                "only) or 'off'",
            )
