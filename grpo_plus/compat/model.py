"""How TRL calls the model: the inputs it passes, the reference model, the KV cache's name, where completions end,
how rows reach environments, its own generation run greedy.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import trl
from trl.models import unwrap_model_for_generation
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import use_adapter

__all__ = [
    "FORWARD_INPUT_KEYS",
    "cache_argument_name",
    "completion_eos_token_ids",
    "disable_gradient_checkpointing",
    "ends_completions_at_generation_config_eos",
    "environment_routing",
    "greedy_completions",
    "greedy_decoding",
    "reference_model",
    "trl_pad_token_id",
    "unwrap_model_for_generation",
    "uses_continuous_batching",
]


# Model inputs `_get_per_token_logps_and_entropies` takes besides ids and mask (multimodal models), by keyword.
FORWARD_INPUT_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


@contextmanager
def reference_model(trainer: trl.GRPOTrainer) -> Iterator[torch.nn.Module]:
    """The model TRL computes reference log-probs with, set up as TRL does (1.14-1.16 `_generate_and_score_completions`):
    `ref_model` when there is one, else the PEFT policy with its adapters off (or its initial copy named "ref")."""
    if trainer.ref_model is not None:
        yield trainer.ref_model
        return
    peft_model = trainer.accelerator.unwrap_model(trainer.model)
    with use_adapter(peft_model, adapter_name="ref" if "ref" in peft_model.peft_config else None):
        yield trainer.model


def trl_pad_token_id(trainer: trl.GRPOTrainer) -> int | None:
    """The pad token TRL pads completions with (1.14-1.16 keep the tokenizer as `_tokenizer`, also for a processor)."""
    return trainer._tokenizer.pad_token_id


def environment_routing(trainer) -> tuple[bool, tuple | None]:
    """(whether TRL reads each row's prompt from a 'prompt' column, the environment names a row's 'environment'
    column selects from, or None where rows are not routed).

    TRL 1.14-1.16 keep `environment_factory` as `environment_factories` ({None: factory} for a single one) and
    `_multi_environment` (a dict was passed: each row's 'environment' picks one); with environments, a row without a
    'prompt' starts from an empty user message that `reset()` completes."""
    factories = getattr(trainer, "environment_factories", None)
    if factories is None:
        return True, None
    return False, tuple(factories) if getattr(trainer, "_multi_environment", False) else None


def completion_eos_token_ids(trainer) -> list[int]:
    """The token ids that end a completion in TRL's generation.

    TRL 1.14.2+ ends at every id of the model's `generation_config.eos_token_id` (kept as `eos_token_ids`); TRL 1.14.0
    overrides the generation config with the tokenizer's one `eos_token_id`."""
    ids = getattr(trainer, "eos_token_ids", None)
    return list(ids) if ids is not None else [trainer._tokenizer.eos_token_id]


def single_turn_arguments(num_generations: int) -> tuple:
    """What TRL's `_generate_single_turn` takes after the prompts' ids, images and fields: the group size from TRL
    1.14.2 on, nothing in 1.14.0."""
    parameters = inspect.signature(trl.GRPOTrainer._generate_single_turn).parameters
    return (num_generations,) if "num_generations" in parameters else ()


def ends_completions_at_generation_config_eos() -> bool:
    """Whether TRL ends completions at every eos id of the model's generation config (see
    `completion_eos_token_ids`)."""
    return "self.eos_token_ids" in inspect.getsource(trl.GRPOTrainer.__init__)


def cache_argument_name() -> str:
    """The name of the KV cache among a model's forward arguments, its outputs and `generate`'s model inputs: `cache`
    from transformers 5.24 (which renamed `past_key_values` everywhere, keeping the old name as a deprecated alias of
    the forward argument and the output attribute, with a warning, but not among `generate`'s model inputs),
    `past_key_values` before."""
    from transformers import GenerationMixin

    parameters = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def uses_continuous_batching(trainer) -> bool:
    """True if TRL generates with transformers' continuous batching (`generate_batch`) instead of `generate`
    (`use_transformers_continuous_batching` in 1.14-1.16; `use_transformers_paged` before)."""
    return bool(
        getattr(trainer, "use_transformers_continuous_batching", False)
        or getattr(trainer, "use_transformers_paged", False)
    )


def greedy_completions(trainer: trl.GRPOTrainer, prompts: list) -> tuple[list, list]:
    """(completion ids, completions) of `prompts` from TRL's own generation (`_generate`, 1.9-1.16: returns prompt_ids,
    completion_ids, tool_mask, completions, ...; grpo_plus's zero-waste generation included) with sampling off."""
    with greedy_decoding(trainer):
        _, completion_ids, _, completions, *_ = trainer._generate(prompts)
    return completion_ids, completions


@contextmanager
def greedy_decoding(trainer: trl.GRPOTrainer) -> Iterator[None]:
    """TRL's generation settings (its `generation_config`, and `generation_kwargs` where it keeps them) with sampling
    off (argmax decoding), for the duration; the rest (max length, EOS, pad, repetition penalty, cache) unchanged."""
    config, kwargs = trainer.generation_config, getattr(trainer, "generation_kwargs", None)
    greedy = copy.deepcopy(config)
    for name in ("temperature", "top_p", "top_k", "min_p"):
        setattr(greedy, name, None)  # sampling knobs: unset, so transformers has nothing to warn about
    greedy.do_sample = False
    trainer.generation_config = greedy
    if kwargs is not None:
        trainer.generation_kwargs = {**kwargs, "do_sample": False, "temperature": None, "top_p": None, "top_k": None,
                                     "min_p": None}  # fmt: skip
    try:
        yield
    finally:
        trainer.generation_config = config
        if kwargs is not None:
            trainer.generation_kwargs = kwargs
