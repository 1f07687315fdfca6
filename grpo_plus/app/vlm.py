"""What the VLM recipe (recipes/grpo_vlm.py) uses: a vision-language model's processor without torchvision, and a
built-in verifiable image task.

Processors: transformers 5 builds Qwen2-VL's and Qwen2.5-VL's processor with a video processor, which needs
torchvision; where torchvision is not installed (PyPI's CPU wheel does not match every torch build, and the CUDA one
is several GB), `load_processor` builds the same processor without it (`ImageOnlyQwen2VLProcessor`: the model's own
tokenizer, chat template and image processor, on PIL). Images work exactly as with the full processor; videos raise.

Task "count-shapes": a picture of 1 to 6 filled shapes (circles, squares, triangles) on a plain background; the
question asks how many there are, with the arithmetic task's instruction (end with "The answer is <number>."), so
`grpo_plus.app.tasks.correctness_reward` and `format_reward` score it. Train and held-out pictures come from separate
seeds.
"""

from __future__ import annotations

import random
from typing import Any

from PIL import Image, ImageDraw
from transformers import Qwen2VLProcessor
from transformers.processing_utils import ProcessorMixin

from . import tasks

__all__ = ["IMAGE_LEVELS", "ImageOnlyQwen2VLProcessor", "load_processor", "make_image_dataset"]

IMAGE_LEVELS = ("count-shapes",)
QWEN_VL_TYPES = ("qwen2_vl", "qwen2_5_vl")
SHAPES = ("circle", "square", "triangle")
COLORS = ((220, 40, 40), (40, 160, 60), (50, 70, 210), (230, 180, 30), (150, 60, 190), (30, 170, 190))


class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
    """Qwen2-VL's processor (also Qwen2.5-VL's) without a video processor: transformers builds that one only with
    torchvision installed, and images do not need it. Videos raise; everything else is Qwen2VLProcessor's."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)


def load_processor(path: str, revision: str | None = None, max_pixels: int | None = None) -> Any:
    """The model's processor (`AutoProcessor`); for Qwen-VL without torchvision, the same processor without its video
    processor. `max_pixels`: the most pixels an image keeps (Qwen-VL resizes larger ones; 448 x 448 is 256 image
    tokens), None for the model's own setting."""
    from transformers import AutoConfig, AutoProcessor
    from transformers.utils import is_torchvision_available

    options = {} if max_pixels is None else {"max_pixels": max_pixels}
    model_type = AutoConfig.from_pretrained(path, revision=revision).model_type
    if model_type not in QWEN_VL_TYPES or is_torchvision_available():
        return AutoProcessor.from_pretrained(path, revision=revision, **options)
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(path, revision=revision)
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(path, revision=revision, **options)
    return ImageOnlyQwen2VLProcessor(
        image_processor, tokenizer, chat_template=_chat_template(path, revision, tokenizer)
    )


def _chat_template(path: str, revision: str | None, tokenizer) -> str | None:
    """The processor's chat template (chat_template.jinja, or the legacy chat_template.json), else the tokenizer's."""
    import json

    from transformers.utils import cached_file

    for name in ("chat_template.jinja", "chat_template.json"):
        found = cached_file(path, name, revision=revision, _raise_exceptions_for_missing_entries=False)
        if found is not None:
            text = open(found, encoding="utf-8").read()
            return json.loads(text)["chat_template"] if name.endswith(".json") else text
    return tokenizer.chat_template


def shapes_picture(rng: random.Random, count: int, size: int) -> Image.Image:
    """`count` filled shapes of random kind, color and place (non-overlapping cells of a 3 x 3 grid)."""
    image = Image.new("RGB", (size, size), (245, 245, 240))
    draw = ImageDraw.Draw(image)
    cell = size // 3
    for index in rng.sample(range(9), count):
        left, top = (index % 3) * cell, (index // 3) * cell
        margin = rng.randint(cell // 8, cell // 4)
        box = (left + margin, top + margin, left + cell - margin, top + cell - margin)
        color, shape = rng.choice(COLORS), rng.choice(SHAPES)
        if shape == "circle":
            draw.ellipse(box, fill=color)
        elif shape == "square":
            draw.rectangle(box, fill=color)
        else:
            draw.polygon([(box[0], box[3]), ((box[0] + box[2]) // 2, box[1]), (box[2], box[3])], fill=color)
    return image


def make_image_dataset(split: str = "train", level: str = "count-shapes", size: int | None = None, seed: int = 0,
                       image_size: int = 448):  # fmt: skip
    """A `datasets.Dataset` with a conversational "prompt" holding an image placeholder, the picture in "image" (TRL's
    layout) and the integer "answer"."""
    from datasets import Dataset

    if level not in IMAGE_LEVELS:
        raise ValueError(f"Unknown image task level {level!r}; image levels: {', '.join(IMAGE_LEVELS)}.")
    split = tasks.normalize_split(split)
    count = tasks.DEFAULT_SIZES[split] if size is None else size
    rng = random.Random(f"{level}:{split}:{seed}")
    rows = []
    for _ in range(count):
        shapes = rng.randint(1, 6)
        question = f"How many shapes are in the picture?\n{tasks.INSTRUCTION}"
        prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        rows.append({"prompt": prompt, "image": shapes_picture(rng, shapes, image_size), "answer": shapes})
    return Dataset.from_list(rows)
