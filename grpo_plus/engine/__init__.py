"""The vLLM engine's side of training (colocated or a server): how the trainer's weights reach it and the proof
that they did.

Modules, along the seams: `reload` (vLLM's layerwise reload around a weight stream, what it mends and what it
reports), `lora_stream` (a LoRA model's weights merged out of place, the base never written), `sync` (TRL's
`VLLMGeneration` wired to both, one log per sync), `receipt` (the check after each sync, before the engine generates:
`GRPOConfig.vllm_sync_check`), `precision` (what the engine serves the weights in: `vllm_dtype`, `vllm_quantization`),
`speculation` (vLLM's own speculative decoding in the colocated engine: `vllm_speculative_config`),
`settings` (those GRPOConfig fields, validated); in server mode `server` (`grpo-plus vllm-serve`, the trainer's
client, the LoRA stream and coverage checks there) and `gloo_transport` (the weight transfer off CUDA).
"""

from .lora_stream import LoraSyncError, LoraWeightStream
from .receipt import SYNC_CHECK_MODES, SyncChecker, SyncReceipt
from .reload import IncompleteSyncError, ReloadReport, SyncCheckError, layerwise_reload
from .settings import VLLMSettings
from .sync import SyncLog, reload_on_sync

__all__ = [
    "SYNC_CHECK_MODES",
    "IncompleteSyncError",
    "LoraSyncError",
    "LoraWeightStream",
    "ReloadReport",
    "SyncCheckError",
    "SyncChecker",
    "SyncLog",
    "SyncReceipt",
    "VLLMSettings",
    "layerwise_reload",
    "reload_on_sync",
]
