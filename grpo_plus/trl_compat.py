"""Everything grpo_plus knows about differences between TRL releases, in one place.

grpo_plus overrides or calls private `trl.GRPOTrainer` methods, which TRL may change in any release. This module
names the TRL minors `make test-matrix` has tested, warns once about any other, and checks, when a trainer is
built, that the private methods grpo_plus hooks still take the arguments it passes, so a changed method fails
loudly instead of giving silently wrong numbers. The TRL helpers grpo_plus uses are imported from here, so a
helper TRL moves or renames is one edit. A new difference between TRL versions belongs here as one small function
or constant.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import transformers
import trl
import trl.trainer.utils as trl_utils
from packaging.version import Version
from trl.models import unwrap_model_for_generation
from trl.models.utils import disable_gradient_checkpointing
from trl.rewards import get_soft_overlong_punishment, think_format_reward
from trl.trainer.utils import is_async_callable, nanmax, nanmin, split_tensor_dict, use_adapter

__all__ = [
    "FORWARD_INPUT_KEYS",
    "HOOKED_METHODS",
    "TESTED_TRL_MINORS",
    "TRLCompatibilityError",
    "UntestedTRLVersionWarning",
    "check_hooked_methods",
    "check_state_attributes",
    "check_trl_compatibility",
    "TRL_IMPORTANCE_SAMPLING_LEVELS",
    "TRL_NATIVE_LOSS_TYPES",
    "TRL_SAMPLER_CORRECTION",
    "TRL_SAMPLER_CORRECTION_SHAPE",
    "SAMPLER_LOGPS_KEY",
    "TRL_SCALE_REWARDS",
    "TRL_SAMPLER_METRICS",
    "TRL_SEQUENCE_SAMPLER_MODES",
    "TRL_ACCURACY_REWARD",
    "TRL_SHARED_REWARD_KWARGS",
    "trl_sampler_correction_changes",
    "trl_sampler_correction_off",
    "trl_sampler_metric_values",
    "trl_sampler_ratio",
    "disable_gradient_checkpointing",
    "entropy_bonus",
    "environment_routing",
    "fused_lm_head_forward",
    "fused_lm_head_module",
    "fused_lm_head_columns",
    "fused_lm_head_columns_default",
    "lm_head_folds_in_torch",
    "cache_argument_name",
    "colocate_weight_stream_name",
    "colocated_model_runner",
    "colocate_distribution",
    "vllm_engine_factory",
    "get_soft_overlong_punishment",
    "think_format_reward",
    "has_fused_lm_head",
    "ignore_renames_trl_still_uses",
    "is_async_callable",
    "is_tested_trl_version",
    "logps_unavailable_reason",
    "reward_call_problem",
    "uses_continuous_batching",
    "CAPABILITY_FLOORS",
    "SAVING_VERSION_FLOORS",
    "VERSION_FLOORS",
    "VersionFloor",
    "version_gap",
    "nanmax",
    "nanmin",
    "policy_weights",
    "reference_model",
    "split_tensor_dict",
    "tested_trl_versions_text",
    "trl_loss_fields",
    "unwrap_model_for_generation",
]

# transformers 5.2x renamed gradient checkpointing to activation checkpointing and warns (FutureWarning) on the old
# names, which TRL 1.14-1.16 and PEFT still use: TRL's GRPOConfig defaults `gradient_checkpointing=True` (so every
# GRPOConfig warns), `model.is_gradient_checkpointing` is read by TRL at every generation step
# (`unwrap_model_for_generation`, `disable_gradient_checkpointing`) and by PEFT's `get_peft_model`, and TRL turns
# checkpointing off and on around generation with `gradient_checkpointing_disable` / `_enable`; a checkpoint save
# re-arms the warnings, so `make demo` printed one after every save. Neither is the user's to fix (transformers 4.x,
# which grpo_plus supports, has no activation_checkpointing field), nor grpo_plus's: only these messages, only from
# the transformers modules that raise them, are silenced.
RENAMES_TRL_STILL_USES = (
    (
        r"`(is_gradient_checkpointing|gradient_checkpointing_enable|gradient_checkpointing_disable)` is deprecated",
        r"transformers\.modeling_utils",
    ),
    (r"`gradient_checkpointing(_kwargs)?` is deprecated", r"transformers\.training_args"),
)


def ignore_renames_trl_still_uses() -> None:
    """Silence transformers' FutureWarnings about the old gradient-checkpointing names that TRL and PEFT read."""
    for message, module in RENAMES_TRL_STILL_USES:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning, module=module)


# The TRL minors `make test-matrix` runs the parity tests against (every patch release of each). pyproject.toml caps
# TRL below the next minor; tests/test_trl_compat.py checks that the cap, this list and the Makefile agree.
TESTED_TRL_MINORS = ("1.14", "1.15", "1.16")

# ---- TRL's objective as TRL 1.14-1.16 implement it -----------------------------------------------------------------
# Loss types TRL computes itself and grpo_plus hands to TRL's own `_compute_loss` (token / sequence levels only).
TRL_NATIVE_LOSS_TYPES = ("cispo", "sapo", "luspo", "vespo")
TRL_IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
# The `scale_rewards` names TRL's inline advantage code accepts (grpo_plus's registry adds aliases and user modes).
TRL_SCALE_REWARDS = ("group", "batch", "none")

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


# ---- What the installed versions allow: what the docs promise ----------------------------------------------------
@dataclass(frozen=True)
class VersionFloor:
    """A saving or capability the docs (Tested versions) say is on from `package` >= `minimum` on, and off below it,
    `because`; with `since`, off only from `since` up to `minimum` (an older line had it another way).

    Above the floor a saving that stands aside is a defect, not a fact of the environment: the tests decide what
    to expect from these floors alone (`version_gap`), never from what the installed code happens to detect, so a
    release that breaks a saving fails them instead of turning the saving off with a log line."""

    name: str
    package: str
    minimum: str
    because: str
    since: str | None = None

    def gap(self) -> str | None:
        """Why the installed `package` is below the floor, or None when the saving must be on."""
        from importlib.metadata import version

        installed = Version(version(self.package))
        if installed >= Version(self.minimum) or (self.since is not None and installed < Version(self.since)):
            return None
        if self.since is None:
            return f"{self.package} {installed} < {self.minimum}: {self.because}"
        return f"{self.package} {self.since} <= {installed} < {self.minimum}: {self.because}"


SAVING_VERSION_FLOORS = {
    floor.name: floor
    for floor in (
        VersionFloor(
            "zero_waste_generation", "transformers", "5.0.0",
            "the decoding loop mirrors transformers 5's (`_prefill`, `next_sequence_length`); 4.x generates with TRL's "
            "own loop",
        ),
        VersionFloor(
            "multi_turn_cache", "transformers", "5.0.0",
            "tool turns continue each row's cache inside zero-waste generation's decoding loop",
        ),
        VersionFloor(
            "shared_prompt", "trl", "1.15.0",
            "TRL 1.14 has no fused LM head to score the packed shared-prompt rows",
        ),
        VersionFloor(
            "image_prompts", "transformers", "5.24.0",
            "the savings on image prompts read transformers 5.24's VLM internals (Qwen-VL's `get_rope_index` with "
            "`mm_token_type_ids`, Gemma 3's `block_sequence_ids`, generate encoding pixels before its loop); older "
            "ones compute image prompts TRL's way",
        ),
    )
}  # fmt: skip

# What TRL itself can do with the installed versions (not grpo_plus savings): the tests that need it skip below these
# floors, and nowhere else (tests/helpers/floors.py).
CAPABILITY_FLOORS = {
    floor.name: floor
    for floor in (
        VersionFloor(
            "cpu_logps", "trl", "1.16.0",
            "TRL 1.15 computes training log-probs only with its fused LM head's Triton kernel, which runs on "
            "CUDA/XPU, not CPU (1.14 computes full logits, 1.16 added a plain-torch fallback)",
            since="1.15.0",
        ),
        VersionFloor(
            "fused_lm_head", "trl", "1.15.0",
            "TRL 1.14 computes full logits; the memory count (`grpo-plus fit`, benchmarks/memory.py) follows TRL's "
            "fused LM head",
        ),
        VersionFloor(
            "generation_config_eos", "trl", "1.14.2",
            "TRL 1.14.0 ends completions at the tokenizer's eos token only, not at every eos id of the model's "
            "generation config",
        ),
        VersionFloor("tools", "transformers", "5.0.0", "TRL refuses `tools` below it (chat-template response parsing)"),
        VersionFloor(
            "environment_factory", "transformers", "5.2.0",
            "TRL refuses `environment_factory` below it (chat-template response parsing)",
        ),
    )
}  # fmt: skip
VERSION_FLOORS = {**SAVING_VERSION_FLOORS, **CAPABILITY_FLOORS}


def version_gap(name: str) -> str | None:
    """Why the docs say `name` (a key of SAVING_VERSION_FLOORS or CAPABILITY_FLOORS) is off with the installed
    versions, or None where they say it is on. Savings without a floor are on with every supported version."""
    return VERSION_FLOORS[name].gap()


class UntestedTRLVersionWarning(UserWarning):
    """The installed TRL is outside the versions grpo_plus is tested with."""


class TRLCompatibilityError(RuntimeError):
    """A private TRL method grpo_plus hooks no longer takes the arguments grpo_plus passes."""


@dataclass(frozen=True)
class HookedMethod:
    """A private method of `trl.GRPOTrainer` (or of the transformers Trainer under it) that grpo_plus relies on.

    `overridden`: grpo_plus.GRPOTrainer defines it (TRL calls grpo_plus's version); otherwise grpo_plus only calls
    TRL's. `check` says what must still hold in TRL for that to work:
    - "exact": TRL calls grpo_plus's override, which takes exactly `positional`, so TRL's parameters must be exactly
      those (a new parameter would be passed to an override that does not take it);
    - "accepts": grpo_plus calls TRL's method with `positional` (by position) and `keywords`, so TRL's signature must
      accept that call (an override that forwards whatever TRL passes, or a plain call);
    - "leading": TRL calls grpo_plus's override, which reads the leading `positional` parameters and hands any
      further ones to TRL's method unchanged, so TRL's parameters must start with exactly those;
    - "exists": the override forwards `*args, **kwargs` untouched: the method must only still exist.
    """

    name: str
    positional: tuple[str, ...] = ()
    keywords: tuple[str, ...] = ()
    check: str = "exact"
    overridden: bool = True


HOOKED_METHODS = (
    HookedMethod("_compute_loss", ("model", "inputs")),
    HookedMethod("_prepare_inputs", ("generation_batch",)),
    # The reward runner (grpo_plus.rewards.runner) also relies on how it calls each reward function: see
    # TRL_SHARED_REWARD_KWARGS and reward_call_problem.
    HookedMethod("_calculate_rewards", ("inputs", "prompts", "completions", "completion_ids_list")),
    HookedMethod("_generate_and_score_completions", ("inputs",)),
    # 1.14.0: (..., multimodal_fields, has_tool_images=False); 1.14.2+: (..., multimodal_fields, num_generations,
    # has_tool_images=False). The zero-waste generation override reads the first three and passes the rest on.
    HookedMethod("_generate_single_turn", ("prompt_ids", "images", "multimodal_fields"), check="leading"),
    # 1.14: (model, *args, batch_size=None, compute_aux_loss=False, **kwargs); 1.15+: every argument spelled out.
    # grpo_plus's override (the zero-waste pass) takes any keyword TRL passes and calls TRL's method this way.
    HookedMethod(
        "_get_per_token_logps_and_entropies",
        ("model", "input_ids", "attention_mask", "logits_to_keep"),
        ("batch_size", "compute_entropy", "compute_aux_loss", *FORWARD_INPUT_KEYS),
        check="accepts",
    ),
    HookedMethod("_save_checkpoint", ("model", "trial")),  # TRL's, over transformers': extra training state
    HookedMethod("_save", ("output_dir", "state_dict")),  # transformers': no Hub token, no local base-model path
    HookedMethod("_maybe_log_save_evaluate", check="exists"),  # transformers': a step is complete after it
    # ReMax's greedy baseline generates through TRL's own _generate (1.9-1.16: returns prompt_ids, completion_ids,
    # tool_mask, completions, ...), with TRL's generation_config switched to greedy for the call.
    HookedMethod("_generate", ("prompts",), check="accepts", overridden=False),
)


# TRL trainer attributes holding training state that grpo_plus checkpoints (grpo_plus.training_state); TRL 1.14-1.16
# all set them in GRPOTrainer.__init__ (the adaptive-entropy ones with use_adaptive_entropy).
TRL_STATE_ATTRIBUTES = ("_step", "_buffered_inputs", "_metrics", "_logs")
TRL_ADAPTIVE_ENTROPY_ATTRIBUTES = ("entropy_coef", "_last_world_entropy", "_entropy_window_stats")


def check_state_attributes(trainer: trl.GRPOTrainer) -> None:
    """Raise TRLCompatibilityError if TRL no longer keeps the training state grpo_plus checkpoints where it looks."""
    names = TRL_STATE_ATTRIBUTES + (
        TRL_ADAPTIVE_ENTROPY_ATTRIBUTES if getattr(trainer, "use_adaptive_entropy", False) else ()
    )
    missing = [name for name in names if not hasattr(trainer, name)]
    if missing:
        raise TRLCompatibilityError(
            f"grpo_plus cannot checkpoint this TRL {trl.__version__}'s training state: GRPOTrainer has no "
            f"{', '.join(missing)}. grpo_plus works with TRL {tested_trl_versions_text()}."
        )


def tested_trl_versions_text() -> str:
    """'1.14.x, 1.15.x, 1.16.x'"""
    return ", ".join(f"{minor}.x" for minor in TESTED_TRL_MINORS)


def is_tested_trl_version(version: str) -> bool:
    """True if `version` (e.g. '1.16.0', '1.15.0.dev0') belongs to a tested TRL minor."""
    release = Version(version).release
    return ".".join(str(part) for part in release[:2]) in TESTED_TRL_MINORS


def _signature_problem(method, expected: HookedMethod) -> str | None:
    """Why `method` does not fit `expected`, or None if it does."""
    if expected.check == "exists":
        return None
    parameters = list(inspect.signature(method).parameters.values())[1:]  # drop self
    if expected.check in ("exact", "leading"):
        names = tuple(p.name for p in parameters)
        leading = expected.check == "leading"
        read = parameters[: len(expected.positional)] if leading else parameters
        if tuple(p.name for p in read) != expected.positional or any(
            p.kind is not p.POSITIONAL_OR_KEYWORD for p in read
        ):
            takes = ", ".join([*expected.positional, *(["..."] if leading else [])])
            return f"its parameters are ({', '.join(names)}), grpo_plus's override takes ({takes})"
        return None
    try:
        inspect.signature(method).bind(None, *expected.positional, **dict.fromkeys(expected.keywords))
    except TypeError as error:
        call = ", ".join([*expected.positional, *(f"{k}=..." for k in expected.keywords)])
        return f"it cannot be called as ({call}): {error}"
    # Positional arguments land by position: the named parameters they fill must mean what grpo_plus passes
    # (TRL 1.14 takes all but `model` through *args, which is fine).
    positional_kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    named = tuple(p.name for p in parameters if p.kind in positional_kinds)[: len(expected.positional)]
    if named != expected.positional[: len(named)]:
        return f"its leading parameters are ({', '.join(named)}), grpo_plus passes ({', '.join(expected.positional)})"
    return None


def check_hooked_methods(trainer_class: type | None = None, trl_version: str | None = None) -> None:
    """Raise TRLCompatibilityError if a hooked method of TRL's GRPOTrainer changed its signature."""
    trainer_class = trl.GRPOTrainer if trainer_class is None else trainer_class
    trl_version = trl.__version__ if trl_version is None else trl_version
    for expected in HOOKED_METHODS:
        method = getattr(trainer_class, expected.name, None)
        problem = "it does not exist" if method is None else _signature_problem(method, expected)
        if problem is not None:
            raise TRLCompatibilityError(
                f"grpo_plus cannot run on TRL {trl_version}: GRPOTrainer.{expected.name} changed ({problem}). "
                f"grpo_plus works with TRL {tested_trl_versions_text()}: "
                f'pip install "trl>={TESTED_TRL_MINORS[0]},<{_next_minor(TESTED_TRL_MINORS[-1])}"'
            )


_warned_versions: set[str] = set()


def check_trl_compatibility(trainer_class: type | None = None, trl_version: str | None = None) -> None:
    """Warn once per process about a TRL outside the tested minors; raise if a hooked method's signature changed."""
    trl_version = trl.__version__ if trl_version is None else trl_version
    if not is_tested_trl_version(trl_version) and trl_version not in _warned_versions:
        _warned_versions.add(trl_version)
        warnings.warn(
            f"grpo_plus is tested with TRL {tested_trl_versions_text()}; TRL {trl_version} is installed. grpo_plus "
            "hooks private GRPOTrainer methods, so check results against stock TRL, or install a tested version: "
            f'pip install "trl>={TESTED_TRL_MINORS[0]},<{_next_minor(TESTED_TRL_MINORS[-1])}"',
            UntestedTRLVersionWarning,
            stacklevel=3,
        )
    check_hooked_methods(trainer_class, trl_version)


def _next_minor(minor: str) -> str:
    major, minor_number = minor.split(".")
    return f"{major}.{int(minor_number) + 1}"


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


def fused_lm_head_forward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    shift_labels: torch.Tensor,
    **model_inputs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-position (log-prob of `shift_labels`, entropy) through TRL's fused LM head (TRL >= 1.15 patches the model
    so that `fused_lm_head=True` returns `.log_probs` / `.entropy` instead of logits; -100 labels score nothing).
    `attention_mask` may be a 4D mask, which the checked model families take as given. `model_inputs`: a VLM's
    images (`pixel_values`, ...), passed on."""
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        shift_labels=shift_labels,
        fused_lm_head=True,
        **model_inputs,
    )
    return out.log_probs, out.entropy


def entropy_bonus(trainer: trl.GRPOTrainer, entropies: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """TRL's entropy bonus `coef * mean token entropy` over `mask`, with its static or adaptive (Skywork-OR1)
    coefficient, advancing the adaptive controller state TRL keeps on the trainer (`entropy_coef`,
    `_last_world_entropy`, `_entropy_window_stats`) and logging `entropy_coef` as TRL does.

    TRL computes this inline in `_compute_loss`, where it cannot be called: this mirrors TRL 1.16.0
    `trl/trainer/grpo_trainer.py` lines 3186-3245 (the same code in 1.14.2 lines 3257-3316 and 1.15.0 from 3112).
    """
    accumulation_steps = trainer.current_gradient_accumulation_steps if mode == "train" else 1.0
    mean_entropy = (entropies * mask).sum() / mask.sum().clamp(min=1.0) / accumulation_steps
    args = trainer.args
    coef = trainer.entropy_coef
    if trainer.use_adaptive_entropy and trainer._last_world_entropy > args.entropy_target:
        coef = 0.0  # the coefficient and gating of the previous optimizer step, for the whole window
    if trainer.use_adaptive_entropy and mode == "train":
        stats = torch.stack([(entropies * mask).sum(), mask.sum()]).detach()
        window = trainer._entropy_window_stats
        trainer._entropy_window_stats = stats if window is None else window + stats
        if trainer.accelerator.sync_gradients:
            totals = trainer.accelerator.reduce(trainer._entropy_window_stats, reduction="sum")
            world_entropy = (totals[0] / totals[1].clamp(min=1.0)).item()
            if world_entropy <= args.entropy_target:
                trainer.entropy_coef = min(trainer.entropy_coef + args.entropy_coef_delta, args.entropy_coef_max)
            else:
                trainer.entropy_coef = max(trainer.entropy_coef - args.entropy_coef_delta, args.entropy_coef_min)
            trainer._last_world_entropy = world_entropy
            trainer._entropy_window_stats = None
    if mode == "train" and trainer.accelerator.sync_gradients:
        trainer._metrics[mode]["entropy_coef"].append(trainer.entropy_coef)
    return coef * mean_entropy


# TRL's own vLLM importance-sampling correction (1.7-1.16): its switch, and the fields that shape it. A config that moved
# one of those away from TRL's default asked for TRL's correction (grpo_plus's rollout correction then refuses to
# replace it). And the generation-batch key of the sampler's log-probs of the sampled tokens (vLLM's, or a
# `rollout_func`'s "logprobs"; NaN where vLLM could not score a token).
TRL_SAMPLER_CORRECTION = "vllm_importance_sampling_correction"
TRL_SAMPLER_CORRECTION_SHAPE = (
    "vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_max",
    "vllm_importance_sampling_clip_min",
)
SAMPLER_LOGPS_KEY = "sampling_per_token_logps"


def trl_sampler_correction_changes(args) -> dict[str, object]:
    """The fields of TRL's vLLM correction `args` sets to other values than TRL's `GRPOConfig` defaults."""
    defaults = {
        f.name: f.default for f in dataclasses.fields(trl.GRPOConfig) if f.name in TRL_SAMPLER_CORRECTION_SHAPE
    }
    return {name: getattr(args, name) for name, default in defaults.items() if getattr(args, name, default) != default}


# TRL 1.14-1.16 run the no-grad old-log-prob pass for that correction, derive its ratio and log its `sampling/*` metrics
# inline in `_generate_and_score_completions`, reading the switch nowhere else on grpo_plus's path (TRL's own
# `_compute_loss` reads it too, and the ratio from the generation batch). Where training is on-policy grpo_plus turns the
# switch off for that call and computes the same ratio and metrics in the loss, from the training forward (detached),
# with the formulas below (TRL's, the same in 1.14.0-1.16.0).
TRL_SEQUENCE_SAMPLER_MODES = ("sequence_mask", "sequence_truncate")


@contextmanager
def trl_sampler_correction_off(trainer: trl.GRPOTrainer) -> Iterator[None]:
    """TRL's vLLM correction switched off for one `_generate_and_score_completions` call: no old-log-prob pass (on-policy
    TRL then computes no old log-probs), no ratio, no `sampling/*` metrics; the sampler's log-probs are kept."""
    with _attribute_set(trainer, TRL_SAMPLER_CORRECTION, False):
        yield


@contextmanager
def _attribute_set(owner, name: str, value) -> Iterator[None]:
    """`owner.name` is `value` inside this block, what it was after it."""
    was = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, was)


def trl_sampler_ratio(
    old_logps: torch.Tensor,
    sampled_logps: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
) -> torch.Tensor:
    """TRL's `importance_sampling_ratio`: d = (old - sampled) * mask per token (NaN, a token the sampler could not score:
    0), r = exp(d) per token (B, T) or exp(sum_t d) per sequence (B, 1); '*_truncate' clamps r to [clip_min, clip_max],
    '*_mask' sets r outside them to 0."""
    diff = torch.nan_to_num((old_logps - sampled_logps) * mask, nan=0.0)
    if mode in TRL_SEQUENCE_SAMPLER_MODES:
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode in ("sequence_truncate", "token_truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    if mode in ("sequence_mask", "token_mask"):
        low = -float("inf") if clip_min is None else clip_min
        high = float("inf") if clip_max is None else clip_max
        return ratio.masked_fill((ratio < low) | (ratio > high), value=0.0)
    raise ValueError(
        f"Unknown vLLM importance sampling level: {mode}. Possible values are 'token_truncate', 'token_mask', "
        "'sequence_truncate', and 'sequence_mask'."
    )


def trl_sampler_metric_values(
    old_logps: torch.Tensor,
    sampled_logps: torch.Tensor,
    mask: torch.Tensor,
    ratio: torch.Tensor,
    mode: str,
    rows: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The values TRL's `sampling/*` metrics summarize, of the rows `rows` ((B,) bool; None: every row): "delta",
    |old - sampled| on the mask where known, and "ratio", the ratio on the mask (token modes) or of each sequence."""
    mask = mask.bool()
    if rows is not None:
        mask = mask & rows[:, None]
    delta = torch.abs(old_logps - sampled_logps)
    if mode in TRL_SEQUENCE_SAMPLER_MODES:
        flat = ratio.flatten() if rows is None else ratio[rows].flatten()
    else:
        flat = ratio[mask]
    return {"delta": delta[mask & ~torch.isnan(delta)], "ratio": flat}


# TRL's `sampling/*` metrics: (name, values, statistic per process (0 where it has none), reduction over processes).
# TRL reduces the two differences with mean / max; the NaN-aware ones give the same where every process knows its value.
TRL_SAMPLER_METRICS = (
    ("sampling/sampling_logp_difference/mean", "delta", torch.mean, torch.nanmean),
    ("sampling/sampling_logp_difference/max", "delta", torch.max, nanmax),
    ("sampling/importance_sampling_ratio/min", "ratio", torch.min, nanmin),
    ("sampling/importance_sampling_ratio/mean", "ratio", torch.mean, torch.nanmean),
    ("sampling/importance_sampling_ratio/max", "ratio", torch.max, nanmax),
)


def policy_weights(
    trainer: trl.GRPOTrainer,
    inputs: dict,
    advantages: torch.Tensor,
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    entropies: torch.Tensor | None,
    mask: torch.Tensor,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(entropy mask, weights of the policy term) as TRL's `_compute_loss` builds them: the high-entropy token mask
    (`top_entropy_quantile < 1`), DeepSeek-V3.2's off-policy sequence mask (`off_policy_mask_threshold`) and vLLM's
    importance-sampling ratio, multiplied; None where none applies. TRL does this inline in `_compute_loss`, with its
    own `get_high_entropy_mask` / `get_off_policy_mask`, which are called here as TRL calls them."""
    entropy_mask = None
    if trainer.top_entropy_quantile < 1.0:
        entropy_mask = trainer.get_high_entropy_mask(entropies, mask, 1 - trainer.top_entropy_quantile)
    weights = entropy_mask
    if trainer.off_policy_mask_threshold is not None:
        off_policy = trainer.get_off_policy_mask(
            advantages=advantages,
            per_token_logps=logps,
            sampling_per_token_logps=inputs.get(SAMPLER_LOGPS_KEY, old_logps),
            mask=mask,
            off_policy_threshold=trainer.off_policy_mask_threshold,
        )
        weights = off_policy if weights is None else off_policy * weights
    if trainer.use_vllm and trainer.vllm_importance_sampling_correction:
        ratio = inputs["importance_sampling_ratio"]
        weights = ratio if weights is None else weights * ratio
    return entropy_mask, weights


def has_fused_lm_head() -> bool:
    """True if TRL scores completions through its fused LM head (1.15+: `model(..., labels=..., fused_lm_head=True)`
    returns `.log_probs` / `.entropy`); False if it computes full logits (1.14). The zero-waste pass scores its
    packed shared-prompt rows through that head (`shift_labels=...`), so on 1.14 it recomputes prompts per row."""
    return hasattr(trl_utils, "add_fused_lm_head")


# TRL's fused LM head (1.15-1.16 `trl.trainer.utils.add_fused_lm_head`): its forward, `_fused_forward`, set on the model
# instance, reads the module global `_CHUNKED_LOGPROB_CHUNK_SIZE` (vocabulary columns per tile) at each call and hands it
# to `ChunkedLogProbFunction`, whose backward keeps the forward's width; `trl.kernels.chunked_logprob._use_triton(device)`
# says whether Triton folds the tiles (else torch does). grpo_plus.lm_head_tiles sizes the tile through these.
FUSED_LM_HEAD_COLUMNS = "_CHUNKED_LOGPROB_CHUNK_SIZE"


def fused_lm_head_module(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module of `model` (itself or one under it, e.g. below PEFT) whose instance forward is TRL's fused LM head
    forward (possibly wrapped: a wrapper that keeps it as `.forward`), or None (TRL 1.14, or a model not patched)."""
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if _is_fused_lm_head_forward(forward) or _is_fused_lm_head_forward(getattr(forward, "forward", None)):
            return module
    return None


def _is_fused_lm_head_forward(forward) -> bool:
    code = getattr(getattr(forward, "__func__", None), "__code__", None)
    return code is not None and code.co_name == "_fused_forward" and code.co_filename == trl_utils.__file__


def fused_lm_head_columns_default() -> int:
    """TRL's vocabulary columns per LM-head tile (32,768 in 1.15-1.16)."""
    return getattr(trl_utils, FUSED_LM_HEAD_COLUMNS)


@contextmanager
def fused_lm_head_columns(columns: int) -> Iterator[None]:
    """TRL's fused LM head projects `columns` vocabulary columns per tile in the forwards started inside this block
    (and their backwards)."""
    with _attribute_set(trl_utils, FUSED_LM_HEAD_COLUMNS, columns):
        yield


def lm_head_folds_in_torch(device: torch.device) -> bool:
    """True where TRL's fused LM head folds its tiles with torch operators (no Triton for `device`: a CPU), which make
    float32 temporaries of the tile's size; False where a Triton kernel folds them (CUDA, XPU) and allocates nothing."""
    from trl.kernels import chunked_logprob

    return not chunked_logprob._use_triton(device)


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


def agentic_unavailable_reason(*, environments: bool = False) -> str | None:
    """Why TRL refuses tools (or, with `environments`, an `environment_factory`) with this transformers, or None.

    TRL 1.14-1.16 raise ImportError at construction below the documented floors (CAPABILITY_FLOORS' `tools` and
    `environment_factory`); grpo_plus adds nothing there and fails the same way."""
    return version_gap("environment_factory" if environments else "tools")


# How TRL 1.14-1.16's `_calculate_rewards` calls a reward function, which the reward runner splits by completion: by
# keyword, `prompts`, `completions`, `completion_ids` and every other key of its `reward_kwargs` a list with one item
# per completion (the dataset columns, and `environments` with an environment_factory), except these, which it sets
# once for the call: the trainer state, and the two logging functions (`log_extra(column, values)` with one value
# per completion, `log_metric(name, value)` with one value for the call), which the runner calls in the trainer's
# process with what a worker recorded.
TRL_SHARED_REWARD_KWARGS = ("trainer_state", "log_extra", "log_metric")
_TRL_PER_COMPLETION_REWARD_KWARGS = ("environments",)


@functools.cache
def reward_call_problem() -> str | None:
    """Why the reward runner cannot split this TRL's reward calls by completion, or None: every key that
    `_calculate_rewards` sets in its `reward_kwargs` (besides the dataset columns) must be one it knows, shared by the
    call (TRL_SHARED_REWARD_KWARGS) or one item per completion (`environments`), read from TRL's own source."""
    tree = _method_tree(trl.GRPOTrainer._calculate_rewards)
    keys = {
        target.slice.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Subscript)
        and isinstance(target.value, ast.Name)
        and target.value.id == "reward_kwargs"
        and isinstance(target.slice, ast.Constant)
    }
    unknown = sorted(keys - {*TRL_SHARED_REWARD_KWARGS, *_TRL_PER_COMPLETION_REWARD_KWARGS})
    if unknown:
        return (
            f"TRL {trl.__version__}'s _calculate_rewards passes reward functions {', '.join(unknown)}, which the reward "
            "runner does not know how to split by completion"
        )
    return None


def completion_eos_token_ids(trainer) -> list[int]:
    """The token ids that end a completion in TRL's generation.

    TRL 1.14.2+ ends at every id of the model's `generation_config.eos_token_id` (kept as `eos_token_ids`); TRL 1.14.0
    overrides the generation config with the tokenizer's one `eos_token_id`."""
    ids = getattr(trainer, "eos_token_ids", None)
    return list(ids) if ids is not None else [trainer._tokenizer.eos_token_id]


def ends_completions_at_generation_config_eos() -> bool:
    """Whether TRL ends completions at every eos id of the model's generation config (see
    `completion_eos_token_ids`)."""
    return "self.eos_token_ids" in inspect.getsource(trl.GRPOTrainer.__init__)


@functools.cache
def loop_keeps_running_loss_on_trainer() -> bool:
    """Whether transformers' training loop keeps its running loss on the trainer (`self._tr_loss`, transformers >= 5)
    rather than in a local variable of `_inner_training_loop` (4.x), which it passes to `_maybe_log_save_evaluate`."""
    return "self._tr_loss" in inspect.getsource(transformers.Trainer._inner_training_loop)


@functools.cache
def trl_loss_fields(trainer_class: type | None = None) -> frozenset[str]:
    """The GRPOConfig fields TRL's training loss reads, read from TRL's own source so that a release reading another
    field is counted without an edit here: in `_compute_loss` and the trainer methods it calls, every
    `self.args.<field>`, and every `self.<attribute>` that `__init__` sets from `args.<field>` (directly or through
    other attributes and local variables, e.g. `epsilon_low` from `epsilon`). Only GRPOConfig fields are kept."""
    trainer_class = trainer_class or trl.GRPOTrainer
    methods = {}
    for klass in reversed(trainer_class.__mro__):  # the most derived definition wins
        for name, value in vars(klass).items():
            if inspect.isfunction(value) and klass.__module__.startswith("trl"):
                methods[name] = value
    init = _method_tree(methods["__init__"])
    # What each `self.<attribute>` of __init__ is set from: args fields, other attributes, and local variables that
    # hold an args field as it is (`coef = args.router_aux_loss_coef`; a local computed from more, e.g. the model
    # loaded from model_init_kwargs, is not the loss's setting).
    sources: dict[str, set[str]] = {}
    for node in ast.walk(init):
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            read = {f"args.{name}" for name in _args_fields(node.value)}
            for target in targets:
                if isinstance(target, ast.Attribute) and _is_self(target.value):
                    read |= {f"self.{name}" for name in _self_attributes(node.value)}
                    read |= {f"local.{n.id}" for n in ast.walk(node.value) if isinstance(n, ast.Name)}
                    sources.setdefault(f"self.{target.attr}", set()).update(read)
                elif isinstance(target, ast.Name) and isinstance(node.value, ast.Attribute):
                    sources.setdefault(f"local.{target.id}", set()).update(read)

    def fields_of(name: str, seen: set[str]) -> set[str]:
        if name in seen:
            return set()
        seen.add(name)
        out = set()
        for source in sources.get(name, ()):
            out |= {source[5:]} if source.startswith("args.") else fields_of(source, seen)
        return out

    fields, visited, pending = set(), set(), ["_compute_loss"]
    while pending:
        name = pending.pop()
        if name in visited or name not in methods:
            continue
        visited.add(name)
        tree = _method_tree(methods[name])
        fields |= _args_fields(tree)
        for attribute in _self_attributes(tree):
            pending.append(attribute)  # a method it calls (others are not in `methods`)
            fields |= fields_of(f"self.{attribute}", set())
    config_fields = {field.name for field in dataclasses.fields(trl.GRPOConfig)}
    return frozenset(fields & config_fields)


def _method_tree(function) -> ast.AST:
    return ast.parse(textwrap.dedent(inspect.getsource(function)))


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def _self_attributes(tree: ast.AST) -> set[str]:
    """Names read as `self.<name>` in `tree`."""
    return {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and _is_self(node.value)}


def _args_fields(tree: ast.AST) -> set[str]:
    """Names read as `args.<name>` or `self.args.<name>` in `tree`."""
    fields = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            value = node.value
            if isinstance(value, ast.Name) and value.id == "args":
                fields.add(node.attr)
            elif isinstance(value, ast.Attribute) and value.attr == "args" and _is_self(value.value):
                fields.add(node.attr)
    return fields


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


def logps_unavailable_reason(device_type: str = "cpu") -> str | None:
    """Why this TRL cannot compute training log-probs on `device_type`, or None if it can.

    TRL 1.15's fused LM head has only a Triton kernel, which runs on CUDA/XPU (and is None without Triton, e.g. with
    a CPU-only torch); 1.14 computes full logits and 1.16 added a plain-torch fallback (`_use_triton` picks it).
    """
    if not has_fused_lm_head() or hasattr(trl_utils, "_use_triton"):
        return None
    if getattr(trl_utils, "_ChunkedLogProbFunction", None) is None:
        return (
            f"TRL {trl.__version__} computes log-probs only with its Triton kernel, and Triton is not installed "
            "(CPU-only torch); TRL 1.14 and 1.16+ run without it"
        )
    if device_type not in ("cuda", "xpu"):
        return (
            f"TRL {trl.__version__} computes log-probs only with its Triton kernel, which runs on CUDA/XPU, not "
            f"{device_type}; TRL 1.14 and 1.16+ run on {device_type}"
        )
    return None


# ---- vLLM (TRL's `trl.generation.vllm_generation.VLLMGeneration`, the same in 1.14.0-1.16.0) -------------------------
# Its colocate sync, `sync_weights()`, is `for name, param in self._iter_named_params(): <model runner>.model.
# load_weights([(name, param)])` with the model runner at `llm.llm_engine.model_executor.driver_worker.model_runner`
# (vLLM's V1 engine in-process), then `llm.reset_prefix_cache()`; names go through `_fix_param_name_to_vllm`.
# grpo_plus replaces the stream on the instance, and wraps `sync_weights` there to check each sync after it.
COLOCATE_WEIGHT_STREAM = "_iter_named_params"
COLOCATE_SYNC_METHODS = (COLOCATE_WEIGHT_STREAM, "sync_weights", "_fix_param_name_to_vllm")


def colocate_weight_stream_name() -> str:
    """The `VLLMGeneration` method that streams (name, tensor) pairs to the colocated engine at each sync (it gathers
    ZeRO-3 / FSDP shards and merges PEFT adapters); raises TRLCompatibilityError if this TRL lacks it or another
    method of COLOCATE_SYNC_METHODS."""
    from trl.generation.vllm_generation import VLLMGeneration

    missing = [name for name in COLOCATE_SYNC_METHODS if not callable(getattr(VLLMGeneration, name, None))]
    if missing:
        raise TRLCompatibilityError(
            f"grpo_plus cannot sync weights into vLLM with TRL {trl.__version__}: VLLMGeneration has no "
            f"{', '.join(missing)}. grpo_plus works with TRL {tested_trl_versions_text()}."
        )
    return COLOCATE_WEIGHT_STREAM


def colocated_model_runner(llm):
    """The model runner of a colocated `vllm.LLM`, where TRL's colocate sync finds the model."""
    return llm.llm_engine.model_executor.driver_worker.model_runner


def colocate_distribution(generation):
    """TRL's `DistributedBackend` of a `VLLMGeneration`: `gather_params(params)` (ZeRO-3's gather, a no-op elsewhere),
    `is_fsdp`, `fsdp_version` (1 or 2 under FSDP, else None; TRL 1.14-1.16), the same object TRL's own weight stream
    uses."""
    return generation._dist


# TRL builds the colocated engine with `LLM(...)` looked up in this module's namespace (VLLMGeneration._init_vllm),
# passing quantization="bitsandbytes" when the model has 4-bit bitsandbytes layers.
VLLM_ENGINE_MODULE, VLLM_ENGINE_FACTORY = "trl.generation.vllm_generation", "LLM"


# TRL's server mode connects with `VLLMClient(...)` looked up in this module's namespace (VLLMGeneration._init_vllm),
# then calls its `init_communicator(device)`, which refuses any device but CUDA.
VLLM_CLIENT_MODULE, VLLM_CLIENT_FACTORY = "trl.generation.vllm_generation", "VLLMClient"


def vllm_engine_factory():
    """(module, attribute name) where TRL looks up the class it builds the colocated vLLM engine with."""
    import importlib

    return importlib.import_module(VLLM_ENGINE_MODULE), VLLM_ENGINE_FACTORY


# ---- reward functions (`trl.rewards`, the same in 1.14.0-1.16.0) ----------------------------------------------------
# `accuracy_reward(completions, solution, log_extra=None, **kwargs)` gives math-verify its signal-based timeouts
# (10 s per parse, 5 s per comparison) only on the main thread; on any other it runs with none (a pathological answer
# hangs the call). grpo_plus.rewards.accuracy_reward calls it where they work: the caller's main thread, or a helper
# process's, which imports it by this path (importing grpo_plus there would cost seconds). It logs "solution",
# "gold_parsed" and "answer_parsed" through `log_extra`.
TRL_ACCURACY_REWARD = "trl.rewards:accuracy_reward"
