"""Tiny vision-language models of the families TRL's VLM GRPO tests train, with working processors, built locally.

TRL's own VLM tests download `trl-internal-testing/tiny-*` models; these are built from a config instead (random
weights, a character-level tokenizer with each family's image tokens and a chat template that places them), so the
test suite and the benchmarks run without a hub. The processors are transformers' own classes with their PIL image
processors (no torchvision). Qwen2-VL's processor also holds a video processor, which transformers builds only with
torchvision installed; `grpo_plus.app.vlm.ImageOnlyQwen2VLProcessor` is that processor without it (images only).

Families: qwen2_vl, qwen2_5_vl (M-RoPE, patch rows + `image_grid_thw`), gemma3 (`token_type_ids`, bidirectional
attention inside an image), idefics3 (images padded per row + `pixel_attention_mask`), llava (one tensor per image)
and llava_next (tiles per image + `image_sizes`).
"""

from __future__ import annotations

import torch
from datasets import Dataset
from PIL import Image
from transformers import (
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3Processor,
    Idefics3Config,
    Idefics3ForConditionalGeneration,
    Idefics3Processor,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaNextConfig,
    LlavaNextForConditionalGeneration,
    LlavaNextProcessor,
    LlavaProcessor,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
)

from .testing import make_tokenizer
from .vlm import ImageOnlyQwen2VLProcessor

__all__ = [
    "VLM_FAMILIES",
    "VisionLog",
    "image_dataset",
    "make_vlm",
    "save_tiny_vlm",
    "vlm_tokenizer",
]

VLM_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "gemma3", "idefics3", "llava", "llava_next")

# The text of one image part of a message, per family, before the processor expands it to the image's tokens.
IMAGE_MARKUP = {
    "qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "gemma3": "<start_of_image>",
    "idefics3": "<image>",
    "llava": "<image>",
    "llava_next": "<image>",
}
FAMILY_TOKENS = {
    "qwen2_vl": ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"],
    "gemma3": ["<start_of_image>", "<image_soft_token>", "<end_of_image>"],
    "idefics3": ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
    + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)],
    "llava": ["<image>"],
}
FAMILY_TOKENS["qwen2_5_vl"] = FAMILY_TOKENS["qwen2_vl"]
FAMILY_TOKENS["llava_next"] = FAMILY_TOKENS["llava"]
# Gemma 3's processor reads its image tokens from the tokenizer's named special tokens.
GEMMA3_NAMED_TOKENS = {
    "boi_token": "<start_of_image>",
    "image_token": "<image_soft_token>",
    "eoi_token": "<end_of_image>",
}


def chat_template(family: str) -> str:
    """The character tokenizer's chat template (`<u>...<eos><a>`), with each image part written as `family` writes
    it; string contents and text parts as they are."""
    return (
        "{% for message in messages %}<{{ message['role'][0] }}>"
        "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
        "{% for part in message['content'] %}"
        f"{{% if part['type'] == 'image' %}}{IMAGE_MARKUP[family]}"
        "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
        "{% endfor %}{% endif %}<eos>{% endfor %}"
        "{% if add_generation_prompt %}<a>{% endif %}"
    )


def vlm_tokenizer(family: str) -> PreTrainedTokenizerFast:
    """The character-level tokenizer of `grpo_plus.app.testing` plus `family`'s image tokens, each one token."""
    named = GEMMA3_NAMED_TOKENS if family == "gemma3" else {}
    tokenizer = make_tokenizer(extra_special_tokens=named)
    tokenizer.add_special_tokens({"additional_special_tokens": FAMILY_TOKENS[family]})
    tokenizer.chat_template = chat_template(family)
    tokenizer.padding_side = "left"  # TRL left-pads prompts; the processor's per-token fields must line up with them
    return tokenizer


def _sizes(hidden_size: int) -> dict:
    """Two layers of width `hidden_size`, four heads: a text or vision model that trains in milliseconds."""
    return dict(hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=2, num_attention_heads=4)


def _text_config(tokenizer, hidden_size: int, **extra) -> dict:
    return dict(
        **_sizes(hidden_size),
        vocab_size=len(tokenizer),
        num_key_value_heads=2,
        max_position_embeddings=4096,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        **extra,
    )


def _qwen_vl(family, tokenizer, image_size, hidden_size):
    """Qwen2-VL / Qwen2.5-VL: 14-pixel patches, 2x2 merged into one image token; M-RoPE positions."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    pixels = image_size * image_size
    image_processor = Qwen2VLImageProcessorPil(min_pixels=pixels, max_pixels=pixels)
    processor = ImageOnlyQwen2VLProcessor(image_processor, tokenizer, chat_template=chat_template(family))
    token = tokenizer.convert_tokens_to_ids
    half = hidden_size // 4 // 2  # rotary frequencies per head (4 heads), split over time, height and width
    rope = {"rope_type": "default", "mrope_section": [half // 2, half // 4, half // 4], "rope_theta": 10000.0}
    common = dict(
        text_config=_text_config(tokenizer, hidden_size, rope_parameters=rope),
        image_token_id=token("<|image_pad|>"),
        video_token_id=token("<|video_pad|>"),
        vision_start_token_id=token("<|vision_start|>"),
        vision_end_token_id=token("<|vision_end|>"),
        tie_word_embeddings=False,
    )
    if family == "qwen2_vl":
        vision = dict(depth=2, embed_dim=hidden_size, hidden_size=hidden_size, num_heads=4, mlp_ratio=2)
        return Qwen2VLForConditionalGeneration(Qwen2VLConfig(vision_config=vision, **common)), processor
    vision = dict(
        depth=2, hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_heads=4, out_hidden_size=hidden_size,
        fullatt_block_indexes=[1], window_size=56,
    )  # fmt: skip
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(vision_config=vision, **common)), processor


def _gemma3(family, tokenizer, image_size, hidden_size):
    """Gemma 3: a SigLIP tower (8 x 8 patches), pooled to 16 image tokens that attend each other both ways."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokens_per_image = 16
    image_processor = Gemma3ImageProcessorPil(size={"height": image_size, "width": image_size})
    processor = Gemma3Processor(
        image_processor, tokenizer, chat_template=chat_template(family), image_seq_length=tokens_per_image
    )
    vision = dict(**_sizes(hidden_size), image_size=image_size, patch_size=image_size // 8, vision_use_head=False)
    token = tokenizer.convert_tokens_to_ids
    text = _text_config(
        tokenizer, hidden_size, head_dim=hidden_size // 4, sliding_window=4096, query_pre_attn_scalar=8
    )
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,  # vision_use_head=False: as Gemma 3's SigLIP, whose pooling head is not read
        mm_tokens_per_image=tokens_per_image,
        boi_token_index=token("<start_of_image>"),
        eoi_token_index=token("<end_of_image>"),
        image_token_index=token("<image_soft_token>"),
        tie_word_embeddings=False,
    )
    model = Gemma3ForConditionalGeneration(config)
    # transformers starts the image projection at zero (no gradient reaches the vision tower before one step).
    torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=0.5)
    return model, processor


def _idefics3(family, tokenizer, image_size, hidden_size):
    """Idefics3: a SigLIP-like tower (8 x 8 patches), pixel-shuffled 2 x 2 into 16 image tokens; one image tensor
    per row, padded (`pixel_attention_mask`)."""
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    patch, scale = image_size // 8, 2
    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": image_size}, max_image_size={"longest_edge": image_size}, do_image_splitting=False
    )
    image_seq_len = (image_size // patch) ** 2 // scale**2
    processor = Idefics3Processor(
        image_processor, tokenizer, image_seq_len=image_seq_len, chat_template=chat_template(family)
    )
    config = Idefics3Config(
        text_config=_text_config(tokenizer, hidden_size, model_type="llama"),
        vision_config=dict(**_sizes(hidden_size), image_size=image_size, patch_size=patch),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        scale_factor=scale,
        tie_word_embeddings=False,
    )
    return Idefics3ForConditionalGeneration(config), processor


def _llava(family, tokenizer, image_size, hidden_size):
    """LLaVA (one image, 64 tokens) and LLaVA-Next (each image as up to two tiles plus a base view, `image_sizes`):
    a CLIP tower, a Llama language model."""
    patch = image_size // 8
    size = {"height": image_size, "width": image_size}
    processor_options = dict(
        patch_size=patch, vision_feature_select_strategy="default", chat_template=chat_template(family),
        num_additional_image_tokens=1,
    )  # fmt: skip
    common = dict(
        text_config=_text_config(tokenizer, hidden_size, model_type="llama"),
        vision_config=dict(
            **_sizes(hidden_size),
            model_type="clip_vision_model",
            image_size=image_size,
            patch_size=patch,
            projection_dim=hidden_size,
        ),  # fmt: skip
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-1,
        image_seq_length=64,
        tie_word_embeddings=False,
    )
    if family == "llava":
        from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

        image_processor = LlavaImageProcessorPil(size=size, crop_size=size, do_center_crop=False)
        processor = LlavaProcessor(image_processor, tokenizer, **processor_options)
        return LlavaForConditionalGeneration(LlavaConfig(**common)), processor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    pinpoints = [[image_size, image_size], [image_size, 2 * image_size]]
    image_processor = LlavaNextImageProcessorPil(
        size=size, crop_size=size, do_center_crop=False, image_grid_pinpoints=pinpoints
    )
    processor = LlavaNextProcessor(image_processor, tokenizer, **processor_options)
    return LlavaNextForConditionalGeneration(LlavaNextConfig(**common, image_grid_pinpoints=pinpoints)), processor


BUILDERS = {"qwen2_vl": _qwen_vl, "qwen2_5_vl": _qwen_vl, "gemma3": _gemma3, "idefics3": _idefics3,
            "llava": _llava, "llava_next": _llava}  # fmt: skip


def make_vlm(family: str, seed: int = 0, image_size: int = 56, hidden_size: int = 32):
    """(model, processor): a randomly initialised two-layer `family` VLM in float32 and its processor, for square
    images of `image_size` pixels (a multiple of 56). Qwen-VL: one image is (image_size / 14)^2 patches and a quarter
    as many image tokens."""
    if family not in VLM_FAMILIES:
        raise ValueError(f"family={family!r} is not one of {', '.join(VLM_FAMILIES)}")
    tokenizer = vlm_tokenizer(family)
    torch.manual_seed(seed)
    model, processor = BUILDERS[family](family, tokenizer, image_size, hidden_size)
    model = model.to(torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model, processor


def save_tiny_vlm(path, family: str, **kwargs):
    """Write a tiny `family` VLM (`make_vlm(family, **kwargs)`) and its processor to `path`: the model loads with
    `AutoModelForImageTextToText.from_pretrained(path)` (TRL loads a reference model that way), the processor with
    `grpo_plus.app.vlm.load_processor(path)`. Returns the processor."""
    model, processor = make_vlm(family, **kwargs)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return processor


COLORS = [(220, 40, 40), (40, 180, 60), (50, 70, 210), (230, 200, 40), (150, 60, 190), (40, 190, 200)]
QUESTIONS = ["What color?", "Name it.", "Describe:", "Shape?"]


def synthetic_image(index: int, size: int) -> Image.Image:
    """A `size` x `size` image, distinct for each `index`: a colored background with a lighter square."""
    image = Image.new("RGB", (size, size), COLORS[index % len(COLORS)])
    offset = (index * 7) % max(size // 2, 1)
    square = Image.new("RGB", (size // 3 + 1, size // 3 + 1), (255 - 20 * (index % 5), 255, 255))
    image.paste(square, (offset, size // 4))
    return image


def image_dataset(num_prompts: int = 4, image_size: int = 56, images_per_prompt: int = 1) -> Dataset:
    """Conversational prompts with `images_per_prompt` images each (TRL's `zen-image` layout: an image placeholder in
    the prompt, the pictures in an `image` column, or `images` when several), all distinct, with an `answer`."""
    rows = []
    for i in range(num_prompts):
        placeholders = [{"type": "image"}] * images_per_prompt
        prompt = [
            {"role": "user", "content": [*placeholders, {"type": "text", "text": QUESTIONS[i % len(QUESTIONS)]}]}
        ]
        images = [synthetic_image(i * images_per_prompt + k, image_size) for k in range(images_per_prompt)]
        row = {"prompt": prompt, "answer": i % 10}
        row.update({"image": images[0]} if images_per_prompt == 1 else {"images": images})
        rows.append(row)
    return Dataset.from_list(rows)


def vision_tower(model) -> torch.nn.Module:
    """The vision encoder module of a VLM (PEFT-wrapped or not)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = base.model
    for name in ("visual", "vision_tower", "vision_model"):
        if hasattr(inner, name):
            return getattr(inner, name)
    raise ValueError(f"{type(base).__name__} has no vision tower this helper knows")


class VisionLog:
    """Counts the image patches a VLM's vision tower encodes: every call (generation, no-grad passes, training) in
    `patches`, the calls that carried gradient (the training pass) in `training_patches`."""

    def __init__(self, model):
        self.patches = self.training_patches = self.calls = 0
        vision_tower(model).register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs):
        pixels = args[0] if args else next(iter(kwargs.values()))
        if pixels.dim() == 2:  # Qwen-VL: one row per patch
            patches = pixels.shape[0]
        else:  # one (channels, height, width) picture per image or tile
            per_side = module.config.image_size // module.config.patch_size
            patches = pixels.shape[0] * per_side * per_side
        self.calls += 1
        self.patches += patches
        self.training_patches += patches if torch.is_grad_enabled() else 0
