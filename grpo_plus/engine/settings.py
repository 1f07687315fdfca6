"""GRPOConfig's colocated-engine fields (`vllm_quantization`, `vllm_dtype`, `vllm_block_size`, `vllm_sync_check`,
`vllm_speculative_config`): declared and checked."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

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
    block_size: int | None = setting(
        None,
        "The KV cache's block size of a colocated vLLM engine (vLLM's `block_size`, in tokens). None: vLLM's "
        "choice (16 on GPUs, 128 on its CPU build). vLLM's prefix cache reuses whole blocks only: with "
        "partial_rollout_tokens every row is its own request, re-sent with its tokens at each chunk, so on the CPU "
        "build 32 reuses what 128 computes again (docs/guide/async-generation.md).",
        config_type=int | None,
    )
    sync_check: str = setting(
        "every",
        "After a weight sync into a colocated vLLM engine, before it generates: check that every tensor "
        "that can change was streamed and taken by the engine, that its prefix cache holds nothing from the old "
        "weights, and that its log-probs of a fixed probe equal the trainer's within what the dtypes allow; a "
        "failed check raises SyncCheckError naming what disagrees. 'every' sync, the 'first' only, or 'off'.",
        choices=SYNC_CHECK_MODES,
    )
    speculative_config: dict | None = setting(
        None,
        "vLLM's own speculative decoding in a colocated engine (use_vllm=True, vllm_mode='colocate'): the dict vLLM's "
        '`speculative_config` engine argument takes, handed to the engine TRL builds as it is, e.g. {"method": '
        '"ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3} (n-gram drafts from each request\'s '
        "prompt and output; a JSON string on the command line). A server (vllm_mode='server') takes it as "
        "`grpo-plus vllm-serve --speculative_config '{...}'`. None: no speculative decoding (TRL's engine).",
        config_type=dict | str | None,
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config", speculative_config_value(self.speculative_config))
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
        if self.block_size is not None and (
            isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1
        ):
            raise not_allowed("vllm_block_size", self.block_size, "None (vLLM's choice) or an integer >= 1")
        if self.sync_check not in SYNC_CHECK_MODES:
            raise not_allowed(
                "vllm_sync_check",
                self.sync_check,
                "'every' (each weight sync checked before the engine generates from it), 'first' (the first sync "
                "only) or 'off'",
            )

    def check_combinations(self, use_vllm: bool, vllm_mode: str) -> None:
        """vllm_speculative_config and vllm_block_size are the colocated engine's: refused where grpo_plus builds no
        engine."""
        if self.block_size is not None and not (use_vllm and vllm_mode == "colocate"):
            raise not_allowed(
                "vllm_block_size",
                self.block_size,
                "None without a colocated engine (use_vllm=True, vllm_mode='colocate'): it is the block size of the "
                "engine the trainer builds (a server builds its own)",
            )
        if self.speculative_config is None:
            return
        if not use_vllm:
            raise not_allowed(
                "vllm_speculative_config",
                self.speculative_config,
                "None without vLLM (use_vllm=False): it configures vLLM's engine; grpo_plus's own generator drafts "
                "with speculative_rollouts=True",
            )
        if vllm_mode != "colocate":
            raise not_allowed(
                "vllm_speculative_config",
                self.speculative_config,
                f"None with vllm_mode={vllm_mode!r}: the server builds its engine, so give it there: grpo-plus "
                f"vllm-serve --speculative_config '{json.dumps(self.speculative_config)}'",
            )


def speculative_config_value(value: Any, name: str = "vllm_speculative_config") -> dict | None:
    """`value` as the dict vLLM's `speculative_config` takes (a JSON string parsed), or None; a ConfigError naming
    `name` where it is no mapping with a "method" (vLLM checks the rest when it builds the engine)."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise not_allowed(name, value, f"a JSON object ({error})") from None
    if not isinstance(value, Mapping):
        raise not_allowed(
            name, value, 'a dict, as vLLM\'s speculative_config takes it (e.g. {"method": "ngram", ...})'
        )
    method = value.get("method")
    if not isinstance(method, str) or not method:
        raise not_allowed(
            name,
            dict(value),
            'a dict with a "method" (vLLM\'s speculative decoding method: "ngram" drafts from the prompt and the '
            'output, with "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"; the others need a '
            "draft model)",
        )
    return dict(value)
