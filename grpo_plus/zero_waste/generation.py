"""Zero-waste generation: `model.generate` for GRPO batches, each distinct prompt prefilled once, finished rows out.

A GRPO generation batch holds every prompt G times (TRL's sampler repeats it), and `model.generate` prefills each
copy, then keeps decoding a row after it emitted EOS until the longest row ends. `generate` here runs transformers'
own `generate` (its input preparation, `GenerationConfig` merging, logits processors and stopping criteria) with a
decoding loop of its own (`custom_generate`) that differs from transformers' `_sample` in two places:

- **prefill**: the distinct prompt rows go through the model once; the KV cache and the last logits are then
  copied to every row holding that prompt (`Cache.batch_select_indices`).
- **decode**: only unfinished rows go through the model. The logits processors, the softmax and the draw still see
  every row, finished rows with neutral scores, so `torch.multinomial` consumes the same random numbers as in
  transformers' loop and each row gets the token it would get there; finished rows get the pad token, as there.

Exactness (float32, measured on CPU; see README): the prefill of one prompt copy gives the same bits as the prefill
of all copies. A decode batch of fewer rows changes which matrix-multiply kernel the BLAS picks for some batch sizes
(MKL: fewer than 4 rows, or other sizes with several threads), which moves logits by float noise (~1e-5); a sampled
token changes only if that noise flips a near-tie.

Image prompts (vision-language models): rows are the same prompt only if their images are equal too; the prefill
gets the distinct prompts' images only (`grpo_plus.zero_waste.images.RowImages`, told each row's image count by the caller:
TRL's `images`), so the vision tower encodes each image once; the decode steps, which transformers runs without the
pixels, run without the image inputs (they cannot follow the rows: they are per image, not per row).

Where the loop would not be transformers' own, `generate` calls `model.generate` unchanged and says why
(`GenerationStats.fallback`): another decoding mode (beams, assisted, contrastive), a cache that cannot be copied by
row (static, quantized, linear-attention or encoder-decoder caches), active dropout (TRL generates with the model in
training mode; one prefill per prompt would draw other dropout masks than G prefills), model inputs other than ids /
mask / positions / token types / images, images without a per-row image count, streaming or score outputs, processes
kept in lock-step (DeepSpeed ZeRO-3 / FSDP), or a transformers release whose decoding loop is not the one mirrored here
(it needs `_prefill` and `next_sequence_length`, 5.x).
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

import torch
import transformers
from transformers import GenerationMixin
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.generation.configuration_utils import GenerationMode

from ..compat.model import cache_argument_name
from ..compat.moe import moe_layers
from ..compat.versions import version_gap
from ..routing.replay import StepRoutes, recorded_experts
from .images import IMAGE_KEYS, PER_TOKEN_KEYS, RowImages, image_prompts_blocker
from .multi_turn import TurnCache, keep_blocker
from .rows import dropout_blocker

# Model inputs the loop splits by row (position_ids may be (k, B, L): M-RoPE); generate also passes the cache,
# use_cache and logits_to_keep. Image inputs (IMAGE_KEYS) go to the prefill, cut to its rows.
ROW_INPUTS = ("attention_mask", "position_ids", *PER_TOKEN_KEYS)
CACHE_INPUT = cache_argument_name()
SHARED_INPUTS = (CACHE_INPUT, "use_cache", "logits_to_keep")
DECODING_MODES = (GenerationMode.SAMPLE, GenerationMode.GREEDY_SEARCH)


class NotApplicable(Exception):
    """Raised inside generate's decoding step, before any forward, when the loop would not be transformers' own."""


@dataclass
class GenerationStats:
    """What one `generate` call computed: token positions through the model, against transformers' own loop."""

    positions: int = 0
    full_positions: int = 0  # what model.generate computes for the same batch (every copy, every row every step)
    prefill_positions: int = 0  # the prefill's share of `positions`
    full_prefill_positions: int = 0  # the prefill's share of `full_positions`: every row, every column
    images: int = 0  # images the vision tower encoded (each distinct prompt's)
    full_images: int = 0  # images model.generate encodes (every row's)
    fallback: str | None = None  # why model.generate ran unchanged, or None
    turns_blocker: str | None = None  # why the rows' caches could not be kept for the next tool turn, or None
    speculation: object | None = None  # the speculative loop's counts when one was handed over (grpo_plus.speculative)
    record_routes: bool = False  # asked: record each completion token's experts (MoE: grpo_plus.routing)
    routes: torch.Tensor | None = None  # (B, completion width, layers, k), -1 where none: grpo_plus.routing.replay
    record_logps: bool = False  # asked: each sampled token's log-prob, as drawn (the processed scores)
    sampler_logps: torch.Tensor | None = None  # (B, completion width) float32: grpo_plus.partial_rollouts

    @property
    def positions_frac(self) -> float:
        """Share of model.generate's token positions computed (1.0 when it ran unchanged)."""
        return self.positions / self.full_positions if self.full_positions else 1.0

    @property
    def prefill_positions_frac(self) -> float:
        """Share of model.generate's prefill positions computed (1.0 when it ran unchanged)."""
        return self.prefill_positions / self.full_prefill_positions if self.full_prefill_positions else 1.0


def transformers_blocker() -> str | None:
    """Why the installed transformers cannot run the loop, or None. Below the documented floor (transformers 4.x)
    that is a fact of the environment; above it, a loop that is not the one mirrored here is a release grpo_plus
    does not handle yet, which tests/test_savings_on.py fails on."""
    gap = version_gap("zero_waste_generation")
    if gap is not None:
        return gap
    prepare = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    if hasattr(GenerationMixin, "_prefill") and "next_sequence_length" in prepare:
        return None
    return (
        f"transformers {transformers.__version__} decodes with another loop than the one grpo_plus mirrors "
        "(`_prefill` and `next_sequence_length`)"
    )


def generation_blocker(*, use_vllm: bool, continuous_batching: bool) -> str | None:
    """Why a trainer's generation must be TRL's own, or None when `generate` here may run it."""
    if use_vllm:
        return "vLLM generates (its prefix caching is vLLM's)"
    if continuous_batching:
        return "continuous batching generates (use_transformers_continuous_batching=True)"
    return transformers_blocker()


def processes_in_lockstep(model) -> bool:
    """True when generate would keep processes stepping together (transformers' `synced_gpus` rule)."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    from transformers.integrations.fsdp import is_fsdp_managed_module

    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    world_size = torch.distributed.get_world_size() if distributed else 1
    return (is_deepspeed_zero3_enabled() or is_fsdp_managed_module(model)) and world_size > 1


def generate(
    model,
    turns: TurnCache | None = None,
    num_images: list[int] | None = None,
    speculation=None,
    record_routes: bool = False,
    **generate_kwargs,
) -> tuple[torch.Tensor, GenerationStats]:
    """`model.generate(**generate_kwargs)` (ids only) with shared prefills and finished rows out of the decode batch.

    Returns the sequences `model.generate` returns and what was computed; where the loop does not apply,
    `model.generate` runs unchanged and `stats.fallback` says why. With `turns`, the call keeps every row's cache
    there and starts from what an earlier call kept (grpo_plus.zero_waste.multi_turn). `num_images`: each row's number of images
    (a VLM's `pixel_values` and co. in `generate_kwargs` hold them all, in row order). `speculation`: a decoding loop
    that replaces this one (`decode(...)`, called as `decode_rows` is: grpo_plus.speculative's), or None.
    `record_routes`: an MoE model's experts for each completion token in `stats.routes` (grpo_plus.routing.replay).
    """
    return _generate(model, model.generate, generate_kwargs, turns, num_images, speculation, record_routes)


@contextlib.contextmanager
def generate_patched(
    model,
    on_call,
    turns: TurnCache | None = None,
    num_images: list[int] | None = None,
    speculation=None,
    record_routes: bool = False,
    record_logps: bool = False,
):
    """Within the block, `model.generate(...)` runs `generate` here (continuing from `turns` if given; `num_images`,
    `speculation`: see `generate`); `on_call(stats)` sees every call's stats (with `record_routes`, an MoE model's
    experts for each completion token in `stats.routes`, where this loop decoded; with `record_logps`, each sampled
    token's log-prob under the processed distribution it was drawn from in `stats.sampler_logps`)."""
    previous = model.__dict__.get("generate")  # a wrapper someone installed on the instance stays in the chain
    model_generate = model.generate

    def patched(*args, **kwargs):
        if args:
            kwargs["inputs"] = args[0]
        sequences, stats = _generate(
            model, model_generate, kwargs, turns, num_images, speculation, record_routes, record_logps
        )
        on_call(stats)
        return sequences

    model.generate = patched
    try:
        yield
    finally:
        if previous is None:
            del model.generate
        else:
            model.generate = previous


def _generate(
    model,
    model_generate,
    generate_kwargs: dict,
    turns=None,
    num_images=None,
    speculation=None,
    record_routes=False,
    record_logps=False,
) -> tuple[torch.Tensor, GenerationStats]:
    stats = GenerationStats(record_routes=record_routes, record_logps=record_logps)
    reason = transformers_blocker()
    base_model = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT wraps the model
    if reason is None and not isinstance(base_model, GenerationMixin):
        reason = f"{type(base_model).__name__} does not generate with transformers' GenerationMixin"
    for name in ("streamer", "assistant_model", "synced_gpus", "custom_generate"):
        if reason is None and generate_kwargs.get(name) is not None:
            reason = f"generate was called with {name}={generate_kwargs[name]!r}"
    if reason is None:
        reason = dropout_blocker(model)  # one prefill per prompt and a smaller decode batch draw other masks
    if reason is None and processes_in_lockstep(model):
        reason = "DeepSpeed ZeRO-3 / FSDP over several processes keeps every process's forwards in lock-step"
    images = None
    if reason is None:
        images = generate_images(generate_kwargs, num_images)
        reason = images if isinstance(images, str) else None
    if reason is None:

        def decode(model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs):
            if not model_kwargs.get("mm_encoder_outputs"):  # generate found no pixels to encode (held back, or none)
                model_kwargs.pop("mm_encoder_outputs", None)
            loop = (
                decode_rows if speculation is None else speculation.decode
            )  # grpo_plus.speculative's, which may use this
            return loop(
                model, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs, stats, turns,
                images,
            )  # fmt: skip

        # transformers' generate encodes every row's pixels before the decoding loop; without them, it leaves that to
        # the loop's prefill, which gets the distinct prompts' images only.
        kwargs = {name: value for name, value in generate_kwargs.items() if name not in HELD_BACK}
        try:
            return model_generate(**kwargs, custom_generate=decode), stats
        except NotApplicable as error:
            reason = str(error)
    stats.fallback = reason
    return model_generate(**generate_kwargs), stats


# What generate's setup would encode before the loop (`_prepare_multimodal_encoder_kwargs_for_generation`).
HELD_BACK = ("pixel_values",)


def generate_images(generate_kwargs: dict, num_images: list[int] | None) -> RowImages | str | None:
    """The image inputs of a `generate` call, by row (None without images; a string: why rows cannot be told apart)."""
    inputs = {name: generate_kwargs[name] for name in IMAGE_KEYS if generate_kwargs.get(name) is not None}
    if not inputs:
        return None
    input_ids = generate_kwargs.get("input_ids", generate_kwargs.get("inputs"))
    if input_ids is None:
        return "generate got images without input_ids"
    if (reason := image_prompts_blocker()) is not None:
        return reason
    return RowImages.from_inputs({**inputs, "num_images": num_images}, input_ids.shape[0])


def decode_blocker(model, generation_config, model_kwargs) -> str | None:
    mode = generation_config.get_generation_mode()
    if mode not in DECODING_MODES:
        return f"the generation mode is {mode.value}, not sampling or greedy"
    if model.config.is_encoder_decoder:
        return "the model is an encoder-decoder"
    outputs = (
        "return_dict_in_generate",
        "output_scores",
        "output_logits",
        "output_attentions",
        "output_hidden_states",
    )
    asked = [name for name in outputs if getattr(generation_config, name, False)]
    if asked:
        return f"generate was asked for {', '.join(asked)}"
    if getattr(generation_config, "is_assistant", False):
        return "the model is an assistant model"
    handled = ROW_INPUTS + SHARED_INPUTS + IMAGE_KEYS
    others = sorted(k for k, v in model_kwargs.items() if v is not None and k not in handled)
    if others:
        return f"generate passes model inputs {', '.join(others)}, which are not split by row here"
    if not model_kwargs.get("use_cache"):
        return "use_cache=False"
    cache = model_kwargs.get(CACHE_INPUT)
    if not isinstance(cache, DynamicCache) or not all(isinstance(layer, DynamicLayer) for layer in cache.layers):
        layers = sorted({type(layer).__name__ for layer in getattr(cache, "layers", ())})
        return f"the model's cache ({type(cache).__name__} {layers}) cannot be copied by row"
    if cache.get_seq_length() > 0:
        return "generate continues from a filled cache"
    return None


def distinct_rows(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None, row_keys: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(first row of each distinct prompt, in order of appearance; (B,) index of each row's prompt in that list).
    Rows are one prompt if their ids, mask and `row_keys` (B,) entries (e.g. which images they have) are equal."""
    key = input_ids if attention_mask is None else torch.cat([input_ids, attention_mask.to(input_ids.dtype)], dim=1)
    if row_keys is not None:
        key = torch.cat([key, row_keys.to(key.device, key.dtype).unsqueeze(1)], dim=1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    rows = torch.arange(len(inverse), device=inverse.device)
    first = torch.full((int(inverse.max()) + 1,), len(inverse), device=inverse.device)
    first = first.scatter_reduce(0, inverse, rows, reduce="amin")
    order = first.argsort()  # prompts in order of first appearance
    rank = torch.empty_like(order)
    rank[order] = torch.arange(len(order), device=order.device)
    return first[order], rank[inverse]


def select_rows(model_kwargs: dict, index: torch.Tensor, images: RowImages | None = None) -> dict:
    """The model inputs of rows `index` (repeats allowed): row tensors indexed, the cache's rows copied, the image
    inputs those of the rows' images (`images`), or none (without `images`: the decode steps, which transformers runs
    without pixels)."""
    selected = {name: value for name, value in model_kwargs.items() if name not in IMAGE_KEYS}
    for name in ROW_INPUTS:
        value = selected.get(name)
        if value is not None:
            selected[name] = value[:, index] if value.dim() == 3 and name == "position_ids" else value[index]
    if images is not None:
        selected.update(images.model_inputs(index))
    cache = selected.get(CACHE_INPUT)
    if cache is not None and cache.get_seq_length() > 0:
        cache.batch_select_indices(index)
    return selected


def prefill_prompts(model, input_ids, generation_config, model_kwargs, stats, turns, images):
    """Each distinct prompt through the model once, its cache and last logits copied to the rows holding it: (every
    row's model inputs, (B, V) float32 logits of the first new token, `turns` or None where it cannot be kept)."""
    batch_size, prompt_width = input_ids.shape
    if images is not None and turns is not None:  # a kept cache holds image features the next turn cannot re-match
        stats.turns_blocker, turns = "the prompts have images", None
    row_keys = None if images is None else images.row_keys()
    prompts, prompt_of_row = distinct_rows(input_ids, model_kwargs.get("attention_mask"), row_keys)
    prompt_kwargs = select_rows(model_kwargs, prompts, images)
    reused = 0
    if turns is not None and _restorable(prompt_kwargs, generation_config, prompt_width):
        reused = turns.restore(prompt_kwargs[CACHE_INPUT], input_ids[prompts], prompt_kwargs.get("attention_mask"))
    outputs = model._prefill(input_ids[prompts], generation_config, prompt_kwargs)
    prompt_kwargs = model._update_model_kwargs_for_generation(outputs, prompt_kwargs)
    logits = outputs.logits[:, -1].to(copy=True, dtype=torch.float32, device=input_ids.device)
    del outputs
    if turns is not None:
        stats.turns_blocker = keep_blocker(prompt_kwargs[CACHE_INPUT])
    if images is not None:
        stats.images += images.image_count(prompts)
        stats.full_images += images.image_count()
    stats.prefill_positions += len(prompts) * (prompt_width - reused)
    stats.full_prefill_positions += batch_size * prompt_width
    stats.positions += len(prompts) * (prompt_width - reused)
    stats.full_positions += batch_size * prompt_width
    # The decode steps run without image inputs, as transformers' own do (it passes them to the prefill only).
    model_kwargs = {name: value for name, value in prompt_kwargs.items() if name not in IMAGE_KEYS}
    if len(prompts) < batch_size:  # else every prompt is distinct: `prompts` is every row, in order
        model_kwargs, logits = select_rows(prompt_kwargs, prompt_of_row), logits[prompt_of_row]
    return model_kwargs, logits, turns


def decode_rows(
    model, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs, stats, turns, images
):
    """transformers' `_sample` loop with one prefill per distinct prompt and only unfinished rows in the forwards;
    with `turns`, the prefill starts from the columns an earlier call kept, and every row's cache is kept. `images`:
    every row's image inputs (held back from generate's own encoding), or None."""
    reason = decode_blocker(model, generation_config, model_kwargs)
    if reason is not None:
        raise NotApplicable(reason)
    batch_size, prompt_width = input_ids.shape
    has_eos_stopping_criteria = any(hasattr(criteria, "eos_token_id") for criteria in stopping_criteria)
    model_kwargs, logits, turns = prefill_prompts(
        model, input_ids, generation_config, model_kwargs, stats, turns, images
    )

    unfinished = torch.ones(batch_size, dtype=torch.long, device=input_ids.device)
    live = torch.arange(batch_size, device=input_ids.device)  # the rows of the cache, in order
    # MoE models switch expert kernels for decoding on accelerators, as transformers' loop does.
    optimized_for_decode = getattr(model, "_optimize_model_for_decode", contextlib.nullcontext)
    # routing replay: decoding step j feeds in completion token j of the live rows; its experts are that token's
    layers = moe_layers(model) if stats.record_routes else None
    steps = StepRoutes(layers, batch_size) if layers is not None else None
    recording = recorded_experts(model, layers) if layers is not None else contextlib.nullcontext()
    logps: list[torch.Tensor] | None = [] if stats.record_logps else None
    with optimized_for_decode(), recording as chosen:
        while True:
            input_ids, unfinished = _next_tokens(
                input_ids, logits, live, unfinished, logits_processor, stopping_criteria, generation_config, logps
            )
            if not bool(unfinished.any()):
                if logps is not None:
                    stats.sampler_logps = torch.stack(logps, dim=1)
                if turns is not None:
                    _keep(turns, model_kwargs, torch.arange(len(live), device=live.device), input_ids[live])
                stats.routes = (
                    None if steps is None else steps.assemble(input_ids.shape[1] - prompt_width, input_ids.device)
                )
                return input_ids
            # A row that ended leaves the batch, unless no stopping criterion pads it (transformers' loop then
            # keeps sampling real tokens for it, e.g. after a stop string without an EOS token).
            rows = unfinished.nonzero().squeeze(1) if has_eos_stopping_criteria else live
            if len(rows) < len(live):
                if turns is not None:  # the leaving rows' caches, for the next tool turn
                    leaving = torch.isin(live, rows, invert=True).nonzero().squeeze(1)
                    _keep(turns, model_kwargs, leaving, input_ids[live[leaving]])
                model_kwargs = select_rows(model_kwargs, torch.searchsorted(live, rows))
                live = rows
            stats.positions += len(live)
            stats.full_positions += batch_size
            inputs = model.prepare_inputs_for_generation(input_ids[live], next_sequence_length=1, **model_kwargs)
            outputs = model(**inputs, return_dict=True)
            if steps is not None:
                steps.add(live, chosen)
            model_kwargs = model._update_model_kwargs_for_generation(outputs, model_kwargs)
            logits = outputs.logits[:, -1].to(copy=True, dtype=torch.float32, device=input_ids.device)
            del outputs


def _restorable(model_kwargs: dict, generation_config, width: int) -> bool:
    """Whether `_prefill` slices its input to the columns a filled cache lacks (it does when the attention mask, or the
    all-ones mask generate dropped, spans the whole input)."""
    mask = model_kwargs.get("attention_mask")
    return (mask.shape[1] if mask is not None else getattr(generation_config, "_mask_length", -1)) == width


def _keep(turns: TurnCache, model_kwargs: dict, cache_rows: torch.Tensor, sequences: torch.Tensor) -> None:
    mask = model_kwargs.get("attention_mask")
    turns.keep(model_kwargs[CACHE_INPUT], cache_rows, sequences, None if mask is None else mask[cache_rows])


def _next_tokens(
    input_ids, logits, live, unfinished, logits_processor, stopping_criteria, generation_config, logps=None
):
    """One token for every row, as transformers' `_sample` picks it: (input_ids with it appended, unfinished rows).

    `logits` holds the rows `live`; the others (finished, their token replaced by the pad token) get uniform scores
    for the processors and the draw, so the draw consumes the random numbers transformers' loop consumes. `logps`, a
    list or None: appended with each row's log-prob of its token under the processed scores it was drawn from (the
    distribution vLLM's `processed_logprobs` reports; a finished row's entry means nothing).
    """
    batch_size = input_ids.shape[0]
    next_token_logits = logits.new_zeros((batch_size, logits.shape[-1])).index_copy_(0, live, logits)
    next_token_scores = logits_processor(input_ids, next_token_logits)
    computed = torch.zeros(batch_size, dtype=torch.bool, device=logits.device).index_fill_(0, live, True)
    next_token_scores = next_token_scores.masked_fill(~computed[:, None], 0.0)
    if generation_config.do_sample:
        probs = torch.nn.functional.softmax(next_token_scores, dim=-1)
        next_tokens = torch.multinomial(probs, num_samples=1).squeeze(1)
    else:
        next_tokens = torch.argmax(next_token_scores, dim=-1)
    if any(hasattr(criteria, "eos_token_id") for criteria in stopping_criteria):
        pad_token_id = generation_config._pad_token_tensor
        next_tokens = next_tokens * unfinished + pad_token_id * (1 - unfinished)
    if logps is not None:
        logps.append(torch.log_softmax(next_token_scores, dim=-1).gather(1, next_tokens[:, None]).squeeze(1))
    input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
    return input_ids, unfinished & ~stopping_criteria(input_ids, None)
