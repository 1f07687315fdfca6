"""GRPOConfig's long-completion fields: `activation_offloading`, `tiled_mlp_tokens`, `lm_head_tile_columns`, declared
and checked (the code: grpo_plus.long_completions.offloading, tiled_mlp, lm_head_tiles)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..settings import SettingsGroup, not_allowed, setting
from .lm_head_tiles import AUTO_TILE_COLUMNS, check_setting
from .tiled_mlp import AUTO_MIN_TOKENS, AUTO_TILE_TOKENS


def named_value(value: Any) -> Any:
    """A tile setting as a command line or YAML gives it ("4096", "none") read as the value it names."""
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    if isinstance(value, str) and value.strip().lower() == "none":
        return None
    return value


@dataclass(frozen=True)
class LongCompletionSettings(SettingsGroup):
    """Memory at long completions: activation offloading, the tiled MLP, the LM head's tile. The tile settings hold
    the value a string names ("4096" -> 4096, "none" -> None)."""

    activation_offloading: bool = setting(
        False,
        "TRL's SFTConfig field, for GRPO: the tensors autograd keeps for backward (under gradient "
        "checkpointing each layer's checkpoint, without it every activation) are copied to pinned CPU memory on a "
        "side stream during the training forward and brought back for backward (trl.models.activation_offloading)."
        " Same gradient; frees device memory at long completions. Nothing to offload on a CPU.",
    )
    tiled_mlp_tokens: int | str | None = setting(
        "auto",
        "Tiled MLP: in the training forward, run each decoder layer's MLP over at most this many token "
        "positions at a time and recompute it slice by slice in backward, so one slice's MLP intermediates are "
        "alive instead of the whole sequence's (e.g. 4096). Same gradient up to float rounding; under gradient "
        "checkpointing no more MLP forwards than whole where the layer only adds the MLP's output to the residual "
        "(Llama, Qwen, Mistral), one more per step where it normalizes it (Gemma 2, 3) or without checkpointing. "
        "Stands aside while a dropout inside the MLP (LoRA dropout) is active, and under DeepSpeed ZeRO-3. "
        "'auto' (the default): tiles of "
        f"{AUTO_TILE_TOKENS} for a micro-batch forward of more than {AUTO_MIN_TOKENS} token positions (rows x "
        "sequence); None: always whole.",
    )
    lm_head_tile_columns: int | str | None = setting(
        "auto",
        "Vocabulary columns TRL's fused LM head projects at a time (TRL >= 1.15; TRL: 32768). 'auto' (the "
        "default): never more than the vocabulary (the same tiles: the same numbers), and where the tiles are "
        f"folded in torch (no Triton: a CPU) {AUTO_TILE_COLUMNS} columns for a forward scoring more than "
        f"{AUTO_MIN_TOKENS} positions (the fold's float32 temporaries ~8x smaller at a 32k vocabulary; "
        "same log-probs up to float rounding), said once. None: TRL's tile; an integer: that many columns.",
    )

    def __post_init__(self) -> None:
        tokens, columns = named_value(self.tiled_mlp_tokens), named_value(self.lm_head_tile_columns)
        if tokens not in (None, "auto") and not (isinstance(tokens, int) and tokens >= 1):
            raise not_allowed("tiled_mlp_tokens", tokens, "'auto', a positive number of token positions or None")
        try:
            check_setting(columns)
        except ValueError:
            allowed = "'auto', a positive number of vocabulary columns or None (TRL's tile)"
            raise not_allowed("lm_head_tile_columns", columns, allowed) from None
        self._set("tiled_mlp_tokens", tokens)
        self._set("lm_head_tile_columns", columns)
