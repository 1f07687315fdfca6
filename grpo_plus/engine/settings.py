"""GRPOConfig's colocated-engine fields (`vllm_quantization`, `vllm_dtype`, `vllm_sync_check`): declared and checked."""

from __future__ import annotations

from dataclasses import dataclass

from ..settings import SettingsGroup, not_allowed, setting
from .precision import VLLM_DTYPES, VLLM_QUANTIZATION_AUTO
from .receipt import SYNC_CHECK_MODES


@dataclass(frozen=True)
class VLLMSettings(SettingsGroup):
    """What the colocated engine serves the weights in, and which syncs are checked."""

    prefix = "vllm_"

    quantization: str = setting(
        VLLM_QUANTIZATION_AUTO,
        "What a colocated vLLM engine (use_vllm=True, vllm_mode='colocate') serves the weights in. 'auto': "
        "TRL's choice (the checkpoint's precision), except for a 4-bit bitsandbytes base, for which TRL asks vLLM "
        "for bitsandbytes (gone in vLLM 0.31): there bfloat16 when its weights take at most half the engine's "
        "share of the GPU, else fp8 where vLLM runs it. 'none': the engine's dtype. Any other name (e.g. 'fp8') "
        "goes to vLLM's `quantization` as it is (an online method: vLLM quantizes the synced weights).",
    )
    dtype: str = setting(
        "auto",
        "The dtype a colocated vLLM engine computes in. 'auto': vLLM's choice, as TRL leaves it (bfloat16 "
        "for a float32 or bfloat16 checkpoint); 'float32', 'bfloat16', 'float16': that dtype. With a float32 "
        "trainer, 'float32' makes the engine's log-probs the trainer's to float rounding (slower generation).",
        choices=VLLM_DTYPES,
    )
    sync_check: str = setting(
        "every",
        "After a weight sync into a colocated vLLM engine, before it generates: check that every tensor "
        "that can change was streamed and taken by the engine, that its prefix cache holds nothing from the old "
        "weights, and that its log-probs of a fixed probe equal the trainer's within what the dtypes allow; a "
        "failed check raises SyncCheckError naming what disagrees. 'every' sync, the 'first' only, or 'off'.",
        choices=SYNC_CHECK_MODES,
    )

    def __post_init__(self) -> None:
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
