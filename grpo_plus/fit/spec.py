"""What a count depends on: `FitSpec` (the config and model, JSON-serializable), the sides it is counted for, and
the real models' shapes grpo_plus knows (nothing is downloaded)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

import torch

from ..compat.moe import is_moe
from ..compat.versions import version_gap

SIDES = ("trl", "grpo_plus")
TILED_MLP_TOKENS = 4096  # what `with_memory_options` sets for grpo_plus
# What the count's own model reads from a config besides the objective: TRL's fused LM head divides by the temperature.
MODEL_FIELDS = ("temperature",)

# Architecture fields of the real models' config.json, so a count needs no download.
KNOWN_SHAPES: dict[str, tuple[str, dict]] = {
    "qwen2.5-0.5b": ("qwen2", dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        vocab_size=151936, rope_theta=1000000.0, tie_word_embeddings=True, max_position_embeddings=32768,
        rms_norm_eps=1e-6, sliding_window=32768, use_sliding_window=False, max_window_layers=21)),
    "qwen2.5-1.5b": ("qwen2", dict(
        hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        vocab_size=151936, rope_theta=1000000.0, tie_word_embeddings=True, max_position_embeddings=32768,
        rms_norm_eps=1e-6, sliding_window=32768, use_sliding_window=False, max_window_layers=21)),
    # The 7B's vocabulary is 152064 rows (its embedding is padded further than the smaller models').
    "qwen2.5-7b": ("qwen2", dict(
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        vocab_size=152064, rope_theta=1000000.0, tie_word_embeddings=False, max_position_embeddings=32768,
        rms_norm_eps=1e-6, sliding_window=131072, use_sliding_window=False, max_window_layers=28)),
    # SmolLM2-135M-Instruct, the embedded model (grpo_plus.app.embedded).
    "smollm2-135m": ("llama", dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        head_dim=64, vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True, max_position_embeddings=8192,
        rms_norm_eps=1e-5)),
    # Qwen2.5-VL-3B-Instruct's config.json (the language model's fields at the top level, as it writes them).
    "qwen2.5-vl-3b": ("qwen2_5_vl", dict(
        hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
        vocab_size=151936, rope_theta=1000000.0, tie_word_embeddings=True, max_position_embeddings=128000,
        rms_norm_eps=1e-6, sliding_window=32768, use_sliding_window=False, max_window_layers=70,
        rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}, bos_token_id=151643, eos_token_id=151645,
        vision_start_token_id=151652, vision_end_token_id=151653, image_token_id=151655, video_token_id=151656,
        vision_config=dict(
            depth=32, hidden_act="silu", hidden_size=1280, intermediate_size=3420, num_heads=16, in_chans=3,
            out_hidden_size=2048, patch_size=14, spatial_merge_size=2, spatial_patch_size=14, window_size=112,
            fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2, temporal_patch_size=2))),
    # allenai/OLMoE-1B-7B-0924(-Instruct): 64 experts of width 1024 per layer, 8 routed per token (6.9B weights, 1.3B
    # active); its router's aux-loss coefficient 0.01.
    "olmoe-1b-7b": ("olmoe", dict(
        hidden_size=2048, intermediate_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
        num_experts=64, num_experts_per_tok=8, vocab_size=50304, rope_theta=10000.0, tie_word_embeddings=False,
        max_position_embeddings=4096, rms_norm_eps=1e-5, norm_topk_prob=False, router_aux_loss_coef=0.01,
        clip_qkv=None, pad_token_id=1, eos_token_id=50279)),
    "tiny-qwen2": ("qwen2", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=512, rope_theta=1000000.0, tie_word_embeddings=True, max_position_embeddings=4096,
        rms_norm_eps=1e-6, use_sliding_window=False)),
}  # fmt: skip
KNOWN_MODELS = {
    **{f"Qwen/Qwen2.5-{size}{suffix}": f"qwen2.5-{size.lower()}" for size in ("0.5B", "1.5B", "7B")
       for suffix in ("", "-Instruct")},
    "Qwen/Qwen2.5-VL-3B-Instruct": "qwen2.5-vl-3b",
    "HuggingFaceTB/SmolLM2-135M-Instruct": "smollm2-135m",
    "smollm2-135m-instruct": "smollm2-135m",
    **{f"allenai/OLMoE-1B-7B-0924{suffix}": "olmoe-1b-7b" for suffix in ("", "-Instruct")},
}  # fmt: skip
# Vision-language families the count runs with their images (the model's own vision tower on fake tensors): Qwen-VL's
# patch rows and `image_grid_thw`. Other families' towers are not counted yet (`image_count_blocker`).
IMAGE_FAMILIES = ("qwen2_vl", "qwen2_5_vl")
DEFAULT_IMAGE_SIZE = 448  # pixels on a side: 32 x 32 patches of 14, 2 x 2 merged: 256 image tokens (Qwen-VL)


def known_config(name: str, **overrides):
    """The transformers config of a model in KNOWN_SHAPES, by shape name or hub id; None when unknown."""
    from transformers import AutoConfig

    shape = KNOWN_MODELS.get(name, name if name in KNOWN_SHAPES else None)
    if shape is None:
        return None
    model_type, fields = KNOWN_SHAPES[shape]
    config = AutoConfig.for_model(model_type, **{**fields, **overrides})
    config._attn_implementation = "sdpa"
    return config


def image_count_blocker(model_config: dict) -> str | None:
    """Why a count cannot run this model with its pictures, or None (a text model, or a family in IMAGE_FAMILIES)."""
    model_type = model_config.get("model_type")
    if "vision_config" not in model_config or model_type in IMAGE_FAMILIES:
        return None
    return f"model_type={model_type!r}: the count runs the vision towers of {', '.join(IMAGE_FAMILIES)} only"


def resized_image(model_config: dict, height: int, width: int, max_pixels: int | None = None) -> tuple[int, int]:
    """(height, width) a Qwen-VL processor resizes a `height` x `width` picture to: transformers' `smart_resize`
    (multiples of patch_size x spatial_merge_size, at most `max_pixels`, the processor's default without one)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize  # no torchvision needed

    vision = model_config["vision_config"]
    factor = vision["patch_size"] * vision.get("spatial_merge_size", 2)
    options = {} if max_pixels is None else {"max_pixels": max_pixels}
    return tuple(smart_resize(height, width, factor=factor, **options))


@dataclass(frozen=True)
class FitSpec:
    """Everything the worst step's memory depends on, JSON-serializable (the trainer's check hands it to a child
    process). Build one with `FitSpec.from_args` (a GRPOConfig and a model) or directly."""

    model_config: dict  # transformers config.to_dict() (model_type included)
    weights_dtype: str  # "bfloat16", "float32", ...
    rows: int  # per_device_train_batch_size
    num_generations: int
    generation_rows: int  # rows generated at once on one process (per_device_train_batch_size x steps_per_generation)
    prompt_tokens: int
    completion_tokens: int
    lora: dict | None = None  # r, lora_alpha, target_modules, lora_dropout; None: every weight trains
    four_bit: bool = False  # bitsandbytes nf4 base (LoRA on top), prepared as prepare_model_for_kbit_training does
    gradient_checkpointing: bool = True
    mixed_precision: str = "bf16"  # "bf16", "fp16" or "no" (TRL's autocast)
    attn_implementation: str = "sdpa"
    loss: dict = field(default_factory=dict)  # the config's objective_fields() (and MODEL_FIELDS), as it has them
    optimizer_states: float = 2.0  # per trainable weight, in its dtype's bytes (AdamW: 2 moments)
    activation_offloading: bool = False
    tiled_mlp_tokens: int | None = None
    lm_head_tile_columns: int | str | None = (
        None  # GRPOConfig's; None: TRL's tile (grpo_plus.long_completions.lm_head_tiles)
    )
    offloaded_kv_cache: bool = False
    zero_waste_generation: bool = True
    # Prompts of different lengths, so the micro-batch has left padding: TRL's forward then builds a [rows, 1, S, S]
    # attention mask (and attention kernels that take one). The worst case of a dataset whose prompts differ.
    padded_prompts: bool = True
    vllm_generates: bool = False  # use_vllm: the trainer's model never generates
    vllm_memory_fraction: float = 0.0  # the card's share a colocated vLLM engine takes (vllm_gpu_memory_utilization)
    vllm_quantization: str = "auto"  # what that engine serves the weights in (GRPOConfig.vllm_quantization)
    # A vision-language model's pictures: how many each prompt carries, and their (height, width) in pixels as the
    # processor resized them (Qwen-VL: multiples of patch_size x spatial_merge_size). `prompt_tokens` counts each
    # picture as the chat template writes it (one image placeholder); `prompt_length` has its image tokens.
    images_per_prompt: int = 0
    image_size: tuple[int, int] = (0, 0)

    def replace(self, **changes) -> FitSpec:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> FitSpec:
        fields = json.loads(text)
        fields["image_size"] = tuple(fields.get("image_size", (0, 0)))
        return cls(**fields)

    def config(self, layers: int | None = None, vision_blocks: int | None = None):
        """The model's transformers config, at `layers` decoder layers (the model's own depth by default); a
        vision-language model's vision tower at its depth, or with `vision_blocks` blocks ending in a block of the
        kind the tower ends with, the others of the other kind (Qwen2.5-VL: windowed blocks, then a full one)."""
        from transformers import AutoConfig

        fields = {k: v for k, v in self.model_config.items() if k not in ("model_type", "transformers_version")}
        if vision_blocks is not None and "vision_config" in fields:
            fields["vision_config"] = vision = dict(fields["vision_config"])
            if vision_blocks < vision["depth"]:
                full = vision.get("fullatt_block_indexes") or []
                if full:  # the last block of the kind the tower ends with, the others of the other kind
                    ends_full = vision["depth"] - 1 in full
                    kinds = [not ends_full] * (vision_blocks - 1) + [ends_full]
                    if all(index in full for index in range(vision["depth"])):
                        kinds = [True] * vision_blocks
                    vision["fullatt_block_indexes"] = [index for index, is_full in enumerate(kinds) if is_full]
                vision["depth"] = vision_blocks
        if "text_config" in fields:
            fields["text_config"] = text = dict(fields["text_config"])
        else:
            text = fields
        if layers is not None:
            text["num_hidden_layers"] = layers
            if text.get("max_window_layers") is not None:
                text["max_window_layers"] = min(text["max_window_layers"], layers)
            text.pop("layer_types", None)  # recomputed from the sliding-window fields for the new depth
        for held in (fields, text):
            held.pop("_attn_implementation_autoset", None)
        config = AutoConfig.for_model(self.model_config["model_type"], **fields)
        config._attn_implementation = self.attn_implementation
        for sub in ("text_config", "vision_config"):
            if getattr(config, sub, None) is not None:
                getattr(config, sub)._attn_implementation = self.attn_implementation
        return config

    def countable_config(self, layers: int | None = None, vision_blocks: int | None = None):
        """`config(...)`, refused (ValueError) for a mixture-of-experts model below the `moe_experts` floor: the
        count follows transformers 5's experts module, not 4.x's separate expert MLPs."""
        config = self.config(layers, vision_blocks)
        if is_moe(config) and (reason := version_gap("moe_experts")) is not None:
            raise ValueError(
                f"grpo-plus fit cannot count the mixture-of-experts model {config.model_type!r}: {reason}"
            )
        return config

    @property
    def text_fields(self) -> dict:
        """The language model's config fields (a vision-language model's `text_config`)."""
        return self.model_config.get("text_config") or self.model_config

    @property
    def layers(self) -> int:
        return int(self.text_fields["num_hidden_layers"])

    @property
    def context_window(self) -> int | None:
        return self.text_fields.get("max_position_embeddings")

    @property
    def vision_language(self) -> bool:
        return "vision_config" in self.model_config

    @property
    def image_grid(self) -> tuple[int, int]:
        """(height, width) of one picture in vision patches (Qwen-VL's `image_grid_thw` less its time axis)."""
        patch = self.model_config["vision_config"]["patch_size"]
        return self.image_size[0] // patch, self.image_size[1] // patch

    @property
    def image_tokens(self) -> int:
        """Image tokens of one picture in the prompt (Qwen-VL: its patches, `spatial_merge_size`^2 merged into one)."""
        if not self.images_per_prompt:
            return 0
        merge = self.model_config["vision_config"].get("spatial_merge_size", 2)
        height, width = self.image_grid
        return height * width // merge**2

    @property
    def prompt_length(self) -> int:
        """The longest prompt in tokens, each picture's image tokens included."""
        return self.prompt_tokens + self.images_per_prompt * (self.image_tokens - 1)

    @classmethod
    def from_args(cls, args, model, prompt_tokens: int, settings=None) -> FitSpec:
        """The spec of a trainer: `args` a (TRL or grpo_plus) GRPOConfig, `model` the policy as the trainer holds it
        (PEFT-wrapped, possibly 4-bit), `settings` the run's (`grpo_plus.config.PlusSettings`; None: `args`')."""
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        lora = None
        peft_config = getattr(model, "peft_config", None)
        if peft_config:
            adapter = next(iter(peft_config.values()))
            lora = lora_fields(adapter.r, adapter.lora_alpha, adapter.lora_dropout, adapter.target_modules,
                               getattr(adapter, "target_parameters", None))  # fmt: skip
        four_bit = bool(getattr(base, "is_loaded_in_4bit", False))
        dtype = next((p.dtype for p in base.parameters() if p.is_floating_point()), torch.float32)
        if four_bit:
            dtype = getattr(getattr(base.config, "quantization_config", None), "bnb_4bit_compute_dtype", None) or dtype
        return cls.from_config(args, base.config, dtype, lora, four_bit, prompt_tokens, settings)

    @classmethod
    def from_config(cls, args, model_config, dtype, lora: dict | None, four_bit: bool, prompt_tokens: int,
                    settings=None) -> FitSpec:  # fmt: skip
        """The spec of a (TRL or grpo_plus) GRPOConfig `args` training a model of `model_config` in `dtype`; grpo_plus's
        values from `settings` (`grpo_plus.config.PlusSettings`; None: those of `args`), as the run uses them."""
        from ..config import PlusSettings

        settings = PlusSettings.from_config(args) if settings is None else settings
        values = settings.config_values()  # canonical: aliases resolved, the rollout preset's policy loss
        mixed = "bf16" if args.bf16 else "fp16" if args.fp16 else "no"
        steps = args.steps_per_generation or args.gradient_accumulation_steps
        if lora is not None and getattr(args, "disable_dropout", False):  # TRL sets every dropout, LoRA's too, to 0
            lora = {**lora, "lora_dropout": 0.0}
        generation_kwargs = getattr(args, "generation_kwargs", None) or {}
        vllm = bool(getattr(args, "use_vllm", False))
        colocated = vllm and getattr(args, "vllm_mode", "colocate") == "colocate"
        return cls(
            model_config=model_config.to_dict(),
            weights_dtype=str(dtype).removeprefix("torch."),
            rows=args.per_device_train_batch_size,
            num_generations=args.num_generations,
            generation_rows=args.per_device_train_batch_size * steps,
            prompt_tokens=prompt_tokens,
            completion_tokens=args.max_completion_length,
            lora=lora,
            four_bit=four_bit,
            gradient_checkpointing=bool(args.gradient_checkpointing),
            mixed_precision=mixed,
            attn_implementation=getattr(model_config, "_attn_implementation", None) or "sdpa",
            loss={
                name: values[name] if name in values else getattr(args, name)
                for name in objective_fields()
                if name in values or hasattr(args, name)
            },  # fmt: skip
            optimizer_states=optimizer_states(str(getattr(args, "optim", "adamw_torch"))),
            activation_offloading=settings.long_completions.activation_offloading,
            tiled_mlp_tokens=settings.long_completions.tiled_mlp_tokens,
            lm_head_tile_columns=settings.long_completions.lm_head_tile_columns,
            offloaded_kv_cache=generation_kwargs.get("cache_implementation") == "offloaded",
            zero_waste_generation=settings.zero_waste.generation,
            vllm_generates=vllm,
            vllm_memory_fraction=float(args.vllm_gpu_memory_utilization) if colocated else 0.0,
            vllm_quantization=settings.vllm.quantization,
        )


def objective_fields() -> tuple[str, ...]:
    """The GRPOConfig fields the training pass's loss reads, derived so that none can be left out: every objective
    registry's field (`grpo_plus.objective.REGISTRIES`: loss_type, policy_loss, kl_estimator, ...), every option a
    registered policy loss declares and the clip settings a loss may take, the algorithm settings (adaptive KL), the
    zero-waste pass's fields, `plugins` (where user-registered names come from), and every field TRL's own loss reads
    (`compat.loss.trl_loss_fields`, read from TRL's source); and `MODEL_FIELDS`. The counting trainer gets them as the
    config has them (`counting_trainer` sets the batch, the length and the engine itself)."""
    from ..algorithms.settings import AlgorithmSettings
    from ..compat.loss import trl_loss_fields
    from ..config import GRPOConfig
    from ..objective import POLICY_LOSSES, REGISTRIES
    from ..objective.policy_losses import CLIP_SETTINGS, OPTIONS

    names = {registry.field for registry in REGISTRIES}
    names |= {option for entry in POLICY_LOSSES.entries() for option in entry.trait(OPTIONS, {})}
    names |= set(CLIP_SETTINGS)
    names |= {f.name for f in dataclasses.fields(AlgorithmSettings)}
    config_fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    names |= {name for name in config_fields if name.startswith("zero_waste_")} | {"plugins"}
    names |= trl_loss_fields() | set(MODEL_FIELDS)
    return tuple(sorted(names & config_fields))


def lora_fields(r: int, alpha: float, dropout: float, target_modules, target_parameters=None) -> dict:
    """The LoraConfig fields a count uses (`target_parameters`: PEFT's adapters on parameters, an MoE's experts)."""
    if isinstance(target_modules, (set, list, tuple)):
        target_modules = sorted(target_modules)
    fields = dict(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules)
    if target_parameters:
        fields["target_parameters"] = sorted(target_parameters)
    return fields


def optimizer_states(optim: str) -> float:
    """Bytes of optimizer state per byte of trainable weight for a TrainingArguments `optim` (AdamW keeps two
    moments in the weight's dtype; 8-bit variants one byte per moment and weight; plain SGD none)."""
    optim = optim.lower().removeprefix("optimizernames.")
    if optim == "sgd":
        return 0.0
    if "8bit" in optim:
        return 0.5  # two one-byte moments per (typically fp32, 4-byte) weight
    return 2.0


def for_side(spec: FitSpec, side: str) -> FitSpec:
    """What `side` runs of `spec`: TRL leaves out grpo_plus's settings (the fields trl.GRPOConfig does not have)."""
    if side == "grpo_plus":
        return spec
    import trl

    trl_fields = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    loss = {k: v for k, v in spec.loss.items() if k in trl_fields}
    return spec.replace(activation_offloading=False, tiled_mlp_tokens=None, lm_head_tile_columns=None, loss=loss,
                        zero_waste_generation=False)  # fmt: skip


def offloading_uncountable() -> str | None:
    """Why activation offloading cannot be counted here (TRL < 1.16 on a machine without CUDA), or None."""
    reason = version_gap("offloading_count")
    return None if reason is None or torch.cuda.is_available() else f"{reason} (this machine has no CUDA)"


def with_memory_options(spec: FitSpec, side: str) -> FitSpec:
    """`spec` with every memory setting `side` offers switched on (module docstring), but activation offloading
    where it cannot be counted (`offloading_uncountable`)."""
    spec = spec.replace(gradient_checkpointing=True, offloaded_kv_cache=True)
    if side == "grpo_plus":
        spec = spec.replace(tiled_mlp_tokens=spec.tiled_mlp_tokens or TILED_MLP_TOKENS)
        if offloading_uncountable() is None:
            spec = spec.replace(activation_offloading=True)
    return for_side(spec, side)
