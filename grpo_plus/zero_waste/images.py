"""A vision-language model's image inputs, row by row: what TRL passes beside ids and mask, cut to any rows.

TRL's `_get_per_token_logps_and_entropies` receives the images of a whole batch as the processor made them, laid out
per model family: Qwen-VL's `pixel_values` hold one row per image patch (`image_grid_thw` says how many per image),
Gemma 3's and LLaVA's one tensor per image, LLaVA-Next's one per image with its tiles (`image_sizes` per image),
Idefics3's one per row (images padded, `pixel_attention_mask` per row); `token_type_ids` / `mm_token_type_ids` are per
row and column. `num_images` says how many images each row has. TRL cuts these only into contiguous row ranges;
`RowImages` cuts them to any rows, compares rows' images (rows of a GRPO group carry the same ones), and gives what a
forward over packed rows needs: each pack's images, the model's own position ids (Qwen-VL's 3D M-RoPE positions,
`get_rope_index`) and Gemma 3's bidirectional image blocks. The layouts mirror TRL 1.16's slicing.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..compat.versions import version_gap
from .rows import SHARED_PROMPT_FAMILIES

# Image inputs whose leading dimension counts images, tiles, patches or rows (never columns).
IMAGE_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes", "image_position_ids",
              "spatial_shapes")  # fmt: skip
# Per row and column of TRL's `cat(prompt, completion)` layout.
PER_TOKEN_KEYS = ("token_type_ids", "mm_token_type_ids")
# Per row counts (lists), read by TRL's slicing, not by the model.
COUNT_KEYS = ("num_images", "num_tiles")
# VLM families whose forward the shared-prompt pass feeds packed rows (position ids, a 4D block mask, each pack's
# images), checked against TRL's own forward by tests/test_vlm.py. The language models of llava / llava_next /
# idefics3 must be one of `rows.SHARED_PROMPT_FAMILIES` too.
SHARED_PROMPT_VLM_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "gemma3", "idefics3", "llava", "llava_next")
# Families whose image tokens attend each other both ways inside one image (transformers builds the mask from
# `token_type_ids`); the packed forward's block mask adds those pairs.
BIDIRECTIONAL_IMAGE_FAMILIES = ("gemma3",)
# Families whose language model is a type of their own (checked with the family), not one of the text families.
OWN_TEXT_MODEL = ("qwen2_vl", "qwen2_5_vl", "gemma3")


@dataclass
class RowImages:
    """The image inputs of a batch of `batch_size` rows (TRL's keyword arguments), addressable by row.

    `spans[key]`: for each row, the (start, end) of its entries along the key's leading dimension.
    """

    inputs: dict[str, object]
    batch_size: int
    spans: dict[str, list[tuple[int, int]]]

    @classmethod
    def from_inputs(cls, inputs: dict[str, object], batch_size: int) -> RowImages | str:
        """The batch's image inputs (TRL's keywords, None values ignored), or why their rows cannot be told apart."""
        present = {key: value for key, value in inputs.items() if value is not None}
        units = _units_per_row(present, batch_size)
        if isinstance(units, str):
            return units
        spans = {}
        for key, counts in units.items():
            ends = torch.tensor(counts).cumsum(0).tolist()
            spans[key] = list(zip([0, *ends[:-1]], ends, strict=True))
        return cls(present, batch_size, spans)

    @property
    def has_images(self) -> bool:
        return "pixel_values" in self.inputs

    def select(self, rows: torch.Tensor | Sequence[int] | None, columns: slice | None = None) -> dict[str, object]:
        """TRL's keyword arguments for the batch's `rows` (None: all, in order; repeats allowed) and `columns` of the
        per-token inputs (None: all)."""
        row_list = list(range(self.batch_size)) if rows is None else _as_list(rows)
        selected: dict[str, object] = {}
        for key, value in self.inputs.items():
            if key in PER_TOKEN_KEYS:
                index = torch.tensor(row_list, dtype=torch.long, device=value.device)
                value = value if rows is None else value[index]
                selected[key] = value if columns is None else value[:, columns]
            elif key in COUNT_KEYS:
                selected[key] = [value[row] for row in row_list]
            elif key in self.spans:
                selected[key] = _gather_spans(value, [self.spans[key][row] for row in row_list])
            else:
                selected[key] = value
        return selected

    def model_inputs(self, rows: torch.Tensor | Sequence[int]) -> dict[str, object]:
        """What the model's own forward takes for the images of `rows` (no counts, no per-token inputs)."""
        selected = self.select(rows)
        return {key: value for key, value in selected.items() if key in IMAGE_KEYS}

    def image_count(self, rows: torch.Tensor | Sequence[int] | None = None) -> int:
        """Images (or tiles, for tile-indexed layouts) the rows hold."""
        counts = self.inputs.get("num_tiles") or self.inputs.get("num_images")
        if counts is None:
            return 0
        return sum(counts[row] for row in (range(self.batch_size) if rows is None else _as_list(rows)))

    def row_keys(self) -> torch.Tensor:
        """(B,) int: rows with equal image inputs (every image tensor of the row equal) get the same key."""
        keys: list[int] = []
        representatives: list[int] = []
        for row in range(self.batch_size):
            for key, other in enumerate(representatives):
                if self._same_images(row, other):
                    keys.append(key)
                    break
            else:
                keys.append(len(representatives))
                representatives.append(row)
        return torch.tensor(keys, dtype=torch.long)

    def _same_images(self, row: int, other: int) -> bool:
        for key, value in self.inputs.items():
            if key in self.spans:
                (a, b), (c, d) = self.spans[key][row], self.spans[key][other]
                if b - a != d - c or not _equal(value[a:b], value[c:d]):
                    return False
            elif key in COUNT_KEYS and value[row] != value[other]:
                return False
        return True


def _equal(first: torch.Tensor, second: torch.Tensor) -> bool:
    """torch.equal, answered without reading the values when both are the same view of the same memory (a batch whose
    rows share one picture tensor; a memory count's broadcast pixels: there each comparison would run through the
    counter's dispatch, 17 ms a row pair on a 448 x 448 picture)."""
    from torch._subclasses.fake_tensor import FakeTensor  # a fake tensor's data pointer means nothing

    comparable = not isinstance(first, FakeTensor) and not isinstance(second, FakeTensor)
    if comparable and (first.data_ptr(), first.stride(), first.shape, first.dtype, first.device) == (
        second.data_ptr(),
        second.stride(),
        second.shape,
        second.dtype,
        second.device,
    ):
        return True
    return torch.equal(first, second)


def _as_list(rows) -> list[int]:
    return rows.tolist() if isinstance(rows, torch.Tensor) else list(rows)


def _gather_spans(value: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    index = [torch.arange(start, end) for start, end in spans]
    flat = torch.cat(index) if index else torch.zeros(0, dtype=torch.long)
    return value[flat.to(value.device)]


def _units_per_row(inputs: dict[str, object], batch_size: int) -> dict[str, list[int]] | str:
    """How many leading-dimension entries of each image input every row owns, as TRL 1.16 slices them (its
    `_get_per_token_logps_and_entropies`), or why it cannot be said."""
    pixel_values = inputs.get("pixel_values")
    if pixel_values is None:
        extra = [key for key in IMAGE_KEYS if key in inputs]
        return f"image inputs {', '.join(extra)} without pixel_values" if extra else {}
    num_images = inputs.get("num_images")
    if num_images is None or len(num_images) != batch_size:
        return "the batch has pixel_values but no per-row image count (num_images)"
    num_tiles = inputs.get("num_tiles")
    units: dict[str, list[int]] = {}
    if "image_grid_thw" in inputs:
        patches = inputs["image_grid_thw"].prod(dim=-1).tolist()
        starts = torch.tensor([0, *num_images]).cumsum(0).tolist()
        units["pixel_values"] = [sum(patches[starts[r] : starts[r + 1]]) for r in range(batch_size)]
        units["image_grid_thw"] = list(num_images)
    elif "image_position_ids" in inputs:
        units["pixel_values"] = units["image_position_ids"] = list(num_images)
    elif "spatial_shapes" in inputs:
        if num_tiles is None:
            return "the batch has spatial_shapes but no per-row tile count (num_tiles)"
        units["pixel_values"] = units["pixel_attention_mask"] = units["spatial_shapes"] = list(num_tiles)
    elif num_tiles is not None:
        units["pixel_values"] = list(num_tiles)
    elif pixel_values.size(0) == sum(num_images):
        units["pixel_values"] = list(num_images)
    elif pixel_values.size(0) == batch_size:
        units["pixel_values"] = [1] * batch_size
    else:
        return f"pixel_values has {pixel_values.size(0)} entries for {batch_size} rows and {sum(num_images)} images"
    if "pixel_attention_mask" in inputs and "spatial_shapes" not in inputs:
        units["pixel_attention_mask"] = [1] * batch_size
    if "image_sizes" in inputs:
        units["image_sizes"] = list(num_images)
    return units


# ---- what the packed forward needs of the model ----------------------------------------------------------------------


def image_prompts_blocker() -> str | None:
    """Why the installed transformers cannot take the savings on image prompts, or None. Below the documented floor
    that is a fact of the environment; above it, a release that moved what grpo_plus reads is one grpo_plus does not
    handle yet, which tests/test_savings_on.py fails on."""
    gap = version_gap("image_prompts")
    if gap is not None:
        return gap
    import transformers
    from transformers.models.gemma3 import modeling_gemma3
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

    if "mm_token_type_ids" not in inspect.signature(Qwen2VLModel.get_rope_index).parameters:
        return f"transformers {transformers.__version__}'s Qwen2-VL computes M-RoPE positions without token types"
    if not hasattr(modeling_gemma3, "get_block_sequence_ids_for_mask"):
        return f"transformers {transformers.__version__}'s Gemma 3 marks its image blocks another way"
    return None


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under PEFT's wrapper (the unwrapped model itself otherwise)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def image_token_ids(config) -> set[int]:
    """The ids of the tokens a family's processor puts where an image's features go."""
    ids = {getattr(config, name, None) for name in ("image_token_id", "image_token_index", "video_token_id")}
    return {token for token in ids if isinstance(token, int)}


def rope_positions(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, images: RowImages):
    """The position ids TRL's forward gives the batch, where they are not column indices: Qwen-VL's (3, B, L) M-RoPE
    positions from the model's own `get_rope_index` (as its forward computes them when given none); else None."""
    inner = getattr(base_model(model), "model", None)
    get_rope_index = getattr(inner, "get_rope_index", None)
    grid = images.inputs.get("image_grid_thw")
    token_types = images.inputs.get("mm_token_type_ids")
    if get_rope_index is None or grid is None or token_types is None:
        return None
    positions, _ = get_rope_index(
        input_ids, mm_token_type_ids=token_types, image_grid_thw=grid, attention_mask=attention_mask
    )
    return positions


def bidirectional_blocks(config, images: RowImages) -> torch.Tensor | None:
    """(B, L): for families whose image tokens attend each other both ways, each image's block id (-1 for other
    tokens), as transformers derives them from `token_type_ids`; else None."""
    token_types = images.inputs.get("token_type_ids")
    if config.model_type not in BIDIRECTIONAL_IMAGE_FAMILIES or token_types is None:
        return None
    from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

    return get_block_sequence_ids_for_mask(token_types, device=token_types.device)


def shared_prompt_vlm_blocker(config, prompt_ids: torch.Tensor) -> str | None:
    """Why a VLM's batch cannot take the shared-prompt forward (beyond what a text model needs), or None."""
    if config.model_type not in SHARED_PROMPT_VLM_FAMILIES:
        return (
            f"model_type={config.model_type!r} is not one of the checked vision-language families "
            f"{', '.join(SHARED_PROMPT_VLM_FAMILIES)}"
        )
    image_tokens = torch.tensor(sorted(image_token_ids(config)), device=prompt_ids.device)
    if bool(torch.isin(prompt_ids[:, -1], image_tokens).any()):
        return "a prompt ends in an image token (each completion repeats the prompt's last token)"
    return None


def vlm_text_families(config) -> tuple[str, ...]:
    """The language-model types the shared-prompt forward takes inside a checked VLM family: its own text model
    (qwen2_vl_text, gemma3_text, ...) or one of the checked text families."""
    if config.model_type in OWN_TEXT_MODEL:
        return (*SHARED_PROMPT_FAMILIES, config.get_text_config().model_type)
    return SHARED_PROMPT_FAMILIES
