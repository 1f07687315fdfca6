"""GRPOConfig: TRL's config, every field unchanged, plus grpo_plus's new concepts and early validation."""

from __future__ import annotations

import dataclasses
import functools
import numbers
import os
import sys
import types
import typing
import warnings
from dataclasses import dataclass, field
from typing import Any

import trl

from .algorithms.estimators import (
    DEFAULT_ESTIMATOR,
    DEFAULT_KL_ESTIMATOR,
    DEFAULT_KL_HORIZON,
    DEFAULT_POLICY_LOSS,
    AlgorithmSettings,
)
from .algorithms.rollout_correction import PRESETS, RolloutCorrectionSettings, expand_preset
from .compat.loss import TRL_IMPORTANCE_SAMPLING_LEVELS, TRL_NATIVE_LOSS_TYPES, TRL_SCALE_REWARDS
from .compat.versions import ignore_renames_trl_still_uses
from .engine.settings import VLLMSettings
from .long_completions.lm_head_tiles import AUTO_MIN_TOKENS as LM_HEAD_AUTO_MIN_TOKENS
from .long_completions.lm_head_tiles import AUTO_TILE_COLUMNS, LM_HEAD_TILE_DEFAULT
from .long_completions.lm_head_tiles import check_setting as check_lm_head_setting
from .long_completions.tiled_mlp import AUTO_MIN_TOKENS, AUTO_TILE_TOKENS, TILED_MLP_DEFAULT
from .objective import ADVANTAGE_NORMALIZERS, IMPORTANCE_SAMPLERS, LOSS_TYPES, POLICY_LOSSES
from .objective.common import WARNED_ONCE
from .objective.loss import TRL_ACCEPTS, unusual_settings
from .objective.policy_losses import OPTIONS
from .plugins import load_plugins
from .rewards.runner import REWARD_ON_ERROR, RewardRunnerSettings
from .run.health import HealthSettings
from .sampling.dynamic_sampling import DynamicSamplingSettings
from .sampling.selective_rollout import SelectiveRolloutSettings
from .settings import ConfigError, not_allowed

FIT_CHECK_MODES = ("warn", "error", "auto", "off")

__all__ = ["ConfigError", "GRPOConfig", "PlusSettings", "validate_grpo_settings"]

# Before any GRPOConfig is built: TRL's own defaults and calls set off transformers' renaming warnings (see compat.versions).
ignore_renames_trl_still_uses()

_BOOL_STRINGS = {"true": "group", "false": "none"}
_SELECTIVE_DEFAULTS = SelectiveRolloutSettings()
_DYNAMIC_DEFAULTS = DynamicSamplingSettings()
_CLIP_COV, _KL_COV = POLICY_LOSSES.entry("clip_cov").trait(OPTIONS), POLICY_LOSSES.entry("kl_cov").trait(OPTIONS)
_HEALTH_DEFAULTS = HealthSettings()
_REWARD_DEFAULTS = RewardRunnerSettings()


def validate_grpo_settings(args: trl.GRPOConfig) -> None:
    """Check the GRPO objective fields of a (grpo_plus or TRL) config; canonicalize aliases in place."""
    load_plugins(PlusSettings.from_args(args).plugins)
    _check_field_types(args)
    expand_preset(args)  # a rollout_correction preset writes its fields (plugins first: they may register criteria)
    settings = PlusSettings.from_args(args)
    args.loss_type = LOSS_TYPES.check(args.loss_type, also=TRL_NATIVE_LOSS_TYPES, error=ConfigError)
    trl_native = args.loss_type in TRL_NATIVE_LOSS_TYPES
    args.importance_sampling_level = IMPORTANCE_SAMPLERS.check(args.importance_sampling_level, error=ConfigError)
    if isinstance(args.scale_rewards, bool):
        args.scale_rewards = "group" if args.scale_rewards else "none"
    elif isinstance(args.scale_rewards, str) and args.scale_rewards.lower() in _BOOL_STRINGS:
        args.scale_rewards = _BOOL_STRINGS[args.scale_rewards.lower()]
    args.scale_rewards = ADVANTAGE_NORMALIZERS.check(args.scale_rewards, error=ConfigError)

    _check_ranges(args)
    _check_combinations(args, trl_native, settings)
    settings.validate(args, trl_native)
    _warn_about_unusual_values(args)


# What a scalar field's value must be, by its declared type (bool before int: a bool is an int in Python).
_SCALAR_KINDS = {bool: "true or false", int: "an integer", float: "a number"}


@functools.cache
def _scalar_field_kinds(cls: type) -> dict[str, tuple[type, bool]]:
    """Field -> (bool, int or float; whether None is allowed) for the fields of `cls` declared with such a type."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # an annotation that does not resolve: check nothing rather than fail
        return {}
    kinds = {}
    for f in dataclasses.fields(cls):
        hint = hints.get(f.name)
        options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        scalar = [option for option in options if option is not type(None)]
        if len(scalar) == 1 and scalar[0] in _SCALAR_KINDS:
            kinds[f.name] = (scalar[0], len(scalar) < len(options))
    return kinds


def field_type_problem(cls: type, name: str, value: Any) -> str | None:
    """Why `value` cannot be dataclass `cls`'s field `name` (e.g. a list where a number belongs), or None.

    Only scalar fields (bool, int, float, optionally None) are checked. Strings are left to the parser that
    converts them (a CLI or YAML "1e-5"), except for a bool field, where any non-empty string would count as true."""
    kind_and_optional = _scalar_field_kinds(cls).get(name)
    if kind_and_optional is None or value is None:
        return None
    kind, optional = kind_and_optional
    if isinstance(value, str) and kind is not bool:
        return None
    if kind is bool:
        ok = isinstance(value, (bool, numbers.Integral)) and value in (0, 1)
    elif kind is int:
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    else:
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if ok:
        return None
    allowed = _SCALAR_KINDS[kind] + (" or null/None" if optional else "")
    return f"{name}={value!r} is not allowed: {name} must be {allowed}, not a {type(value).__name__}."


def _check_field_types(args: trl.GRPOConfig) -> None:
    for name in _scalar_field_kinds(type(args)):
        problem = field_type_problem(type(args), name, getattr(args, name, None))
        if problem is not None:
            raise ConfigError(problem)


def _warn_about_unusual_values(args: trl.GRPOConfig) -> None:
    """Values TRL accepts and trains with that are most likely mistakes: a warning, once per config, saying what they
    do (a check grpo_plus adds must never refuse what TRL accepts)."""
    messages = unusual_settings(args.epsilon, args.epsilon_high, args.delta, args.beta)
    if args.top_entropy_quantile > 1:
        messages.append(
            f"top_entropy_quantile={args.top_entropy_quantile} is above 1: like 1.0, every token keeps its gradient "
            f"(the entropy mask applies below 1 only). It is the share of highest-entropy tokens trained, in [0, 1]. "
            f"{TRL_ACCEPTS}"
        )
    if args.num_iterations == 0:
        messages.append(
            "num_iterations=0: each generation batch is trained on 0 times, so the run ends without a single "
            f"optimizer step (the GRPO paper's mu is >= 1; 1 is the default). {TRL_ACCEPTS}"
        )
    for message in messages:
        _warn_once(args, message)


def _warn_once(args: Any, message: str) -> None:
    """Warn once per config object: it is validated when built and again by the trainer."""
    warned = args.__dict__.setdefault("_grpo_plus_warned", set())
    if message not in warned:
        warned.add(message)
        WARNED_ONCE.add(message)  # the loss, which checks the same values, does not repeat it
        warnings.warn(message, UserWarning, stacklevel=_stacklevel_outside_grpo_plus())


def _stacklevel_outside_grpo_plus() -> int:
    """The stacklevel of the first caller outside grpo_plus (and dataclass-generated __init__), for warnings."""
    package = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and (
        frame.f_code.co_filename.startswith(package) or frame.f_code.co_filename == "<string>"
    ):
        frame, level = frame.f_back, level + 1
    return level


def _check_ranges(args: trl.GRPOConfig) -> None:
    def fail(name: str, allowed: str) -> None:
        raise ConfigError(f"{name}={getattr(args, name)!r} is not allowed: {name} must be {allowed}.")

    # Values TRL itself fails on (at its first step); those it trains with are warned about instead.
    if args.num_iterations < 0:
        fail("num_iterations", "a positive integer (1 by default; TRL's sampler fails on a negative count)")
    if args.top_entropy_quantile < 0:
        fail(
            "top_entropy_quantile", "in [0, 1], the share of highest-entropy tokens trained (TRL's mask fails below 0)"
        )
    if args.loss_type == "dr_grpo" and args.max_completion_length is None:
        fail("max_completion_length", "set for loss_type='dr_grpo' (it is Dr. GRPO's constant normalizer L)")


def _check_combinations(args: trl.GRPOConfig, trl_native: bool, settings: PlusSettings) -> None:
    if trl_native:
        if args.importance_sampling_level not in TRL_IMPORTANCE_SAMPLING_LEVELS:
            raise ConfigError(
                f"importance_sampling_level={args.importance_sampling_level!r} cannot be combined with "
                f"loss_type={args.loss_type!r}: TRL computes that loss itself and supports only "
                f"{', '.join(TRL_IMPORTANCE_SAMPLING_LEVELS)}."
            )
        if settings.dual_clip is not None:
            raise ConfigError(
                f"dual_clip cannot be combined with loss_type={args.loss_type!r}: it applies to the clipped "
                f"surrogate of the grpo_plus loss types ({', '.join(LOSS_TYPES.names())})."
            )
    if args.multi_objective_aggregation == "normalize_then_sum" and args.scale_rewards not in TRL_SCALE_REWARDS:
        raise ConfigError(
            f"scale_rewards={args.scale_rewards!r} cannot be combined with "
            "multi_objective_aggregation='normalize_then_sum': that aggregation normalizes each reward function "
            "itself and ignores scale_rewards. Use multi_objective_aggregation='sum_then_normalize'."
        )


@dataclass
class GRPOConfig(trl.GRPOConfig):
    r"""[`trl.GRPOConfig`] with every TRL field unchanged, plus grpo_plus's fields.

    `loss_type`, `importance_sampling_level` and `scale_rewards` also accept any name registered with
    `grpo_plus.register_loss_type`, `register_importance_sampling` and `register_advantage_normalizer`
    (and the aliases `local` = `group`, `global` = `batch`); `advantage_estimator`, `policy_loss` and `kl_estimator`
    pick the published algorithms (docs/guide/algorithms.md). Bad values fail here, at construction.
    """

    dual_clip: float | None = field(
        default=None,
        metadata={
            "help": "Dual-clip constant c > 1 (Ye et al. 2020): for tokens with negative advantage the per-token "
            "loss is capped at c*|A|, so a huge ratio on a bad token cannot blow up the update. None disables it."
        },
    )
    dynamic_sampling: bool = field(
        default=False,
        metadata={
            "help": "DAPO dynamic sampling: drop prompt groups whose rewards are all equal (zero advantage), generate "
            "more prompts until the generation batch is full again or `max_sampling_rounds` is reached. Needs "
            "`per_device_train_batch_size` to be a multiple of `num_generations` so every micro-batch holds whole "
            "groups."
        },
    )
    dynamic_sampling_min_std: float = field(
        default=_DYNAMIC_DEFAULTS.min_std,
        metadata={
            "help": "A group counts as informative when the std of its rewards exceeds this (absolute, in reward "
            "units); the default tolerates float noise in continuous rewards."
        },
    )
    max_sampling_rounds: int = field(
        default=_DYNAMIC_DEFAULTS.max_rounds,
        metadata={
            "help": "Most generation rounds per generation batch with dynamic sampling (1 = filter only, no refill). "
            "When the batch is still short, training uses the informative groups found (logged)."
        },
    )
    overlong_buffer_length: int | None = field(
        default=None,
        metadata={
            "help": "DAPO soft overlong punishment: completions longer than max_completion_length - "
            "overlong_buffer_length get a linearly growing penalty, reaching -overlong_penalty at "
            "max_completion_length (TRL's `get_soft_overlong_punishment`, added as an extra reward). None disables it."
        },
    )
    overlong_penalty: float = field(
        default=1.0,
        metadata={"help": "Weight of the soft overlong punishment reward (the DAPO paper uses 1.0)."},
    )
    zero_waste_pass: bool = field(
        default=True,
        metadata={
            "help": "Compute log-probs only for what carries gradient: skip rows with zero advantage, cut the padding "
            "after each completion, and (see zero_waste_shared_prompt) compute each group's prompt once. The "
            "gradient is TRL's; where it would not be (beta > 0, entropy bonus or top_entropy_quantile < 1, router aux "
            "loss, a user mode that did not declare zero_advantage_rows_contribute_nothing), that part falls back to "
            "the full pass and says why once in the log. With rows skipped, `entropy` (TRL's, every row) is left "
            "unknown unless zero_waste_exact_entropy=True, and `zero_waste/entropy_trained_rows` covers the rows "
            "trained."
        },
    )
    zero_waste_shared_prompt: bool = field(
        default=True,
        metadata={
            "help": "Part of the zero-waste pass: compute a group's shared prompt once, with a block attention mask "
            "that lets each completion see the prompt and itself (Prefix Grouper), in the training forward and in "
            "TRL's old/reference log-prob passes. Applies to the checked model families (llama, mistral, qwen2, "
            "qwen3, gpt2) with sdpa or eager attention on TRL >= 1.15; elsewhere prompts are recomputed per row."
        },
    )
    zero_waste_generation: bool = field(
        default=True,
        metadata={
            "help": "Generate with transformers (no vLLM) without the waste: prefill each distinct prompt once and "
            "copy its KV cache to the G completions, and leave finished completions out of the decode batch. Same "
            "sampling settings and random draws as TRL's `model.generate`. Falls back to TRL's generation, saying why "
            "once in the log, with vLLM, continuous batching, multimodal prompts, tools, caches that cannot be copied "
            "by row, and other decoding modes (beams)."
        },
    )
    activation_offloading: bool = field(
        default=False,
        metadata={
            "help": "TRL's SFTConfig field, for GRPO: the tensors autograd keeps for backward (under gradient "
            "checkpointing each layer's checkpoint, without it every activation) are copied to pinned CPU memory on a "
            "side stream during the training forward and brought back for backward (trl.models.activation_offloading)."
            " Same gradient; frees device memory at long completions. Nothing to offload on a CPU."
        },
    )
    tiled_mlp_tokens: int | str | None = field(
        default=TILED_MLP_DEFAULT,
        metadata={
            "help": "Tiled MLP: in the training forward, run each decoder layer's MLP over at most this many token "
            "positions at a time and recompute it slice by slice in backward, so one slice's MLP intermediates are "
            "alive instead of the whole sequence's (e.g. 4096). Same gradient up to float rounding; under gradient "
            "checkpointing no more MLP forwards than whole where the layer only adds the MLP's output to the residual "
            "(Llama, Qwen, Mistral), one more per step where it normalizes it (Gemma 2, 3) or without checkpointing. "
            "Stands aside while a dropout inside the MLP (LoRA dropout) is active, and under DeepSpeed ZeRO-3. "
            "'auto' (the default): tiles of "
            f"{AUTO_TILE_TOKENS} for a micro-batch forward of more than {AUTO_MIN_TOKENS} token positions (rows x "
            "sequence); None: always whole."
        },
    )
    lm_head_tile_columns: int | str | None = field(
        default=LM_HEAD_TILE_DEFAULT,
        metadata={
            "help": "Vocabulary columns TRL's fused LM head projects at a time (TRL >= 1.15; TRL: 32768). 'auto' (the "
            "default): never more than the vocabulary (the same tiles: the same numbers), and where the tiles are "
            f"folded in torch (no Triton: a CPU) {AUTO_TILE_COLUMNS} columns for a forward scoring more than "
            f"{LM_HEAD_AUTO_MIN_TOKENS} positions (the fold's float32 temporaries ~8x smaller at a 32k vocabulary; "
            "same log-probs up to float rounding), said once. None: TRL's tile; an integer: that many columns."
        },
    )
    fit_check: str = field(
        default="warn",
        metadata={
            "help": "Before step 1, on a CUDA device: count the worst step's peak memory (every completion at "
            "max_completion_length) and compare it with the device's free memory. 'warn' logs a warning naming "
            "settings that would fit, 'error' raises instead of training, 'auto' turns on what makes it fit among "
            "tiled_mlp_tokens=4096 and activation_offloading (same gradient up to float rounding), says so, and "
            "raises with the numbers when neither nor both do, 'off' skips the count.",
            "choices": ["warn", "error", "auto", "off"],
        },
    )
    vllm_quantization: str = field(
        default="auto",
        metadata={
            "help": "What a colocated vLLM engine (use_vllm=True, vllm_mode='colocate') serves the weights in. 'auto': "
            "TRL's choice (the checkpoint's precision), except for a 4-bit bitsandbytes base, for which TRL asks vLLM "
            "for bitsandbytes (gone in vLLM 0.31): there bfloat16 when its weights take at most half the engine's "
            "share of the GPU, else fp8 where vLLM runs it. 'none': the engine's dtype. Any other name (e.g. 'fp8') "
            "goes to vLLM's `quantization` as it is (an online method: vLLM quantizes the synced weights).",
        },
    )
    vllm_dtype: str = field(
        default="auto",
        metadata={
            "help": "The dtype a colocated vLLM engine computes in. 'auto': vLLM's choice, as TRL leaves it (bfloat16 "
            "for a float32 or bfloat16 checkpoint); 'float32', 'bfloat16', 'float16': that dtype. With a float32 "
            "trainer, 'float32' makes the engine's log-probs the trainer's to float rounding (slower generation).",
            "choices": ["auto", "float32", "bfloat16", "float16"],
        },
    )
    vllm_sync_check: str = field(
        default="every",
        metadata={
            "help": "After a weight sync into a colocated vLLM engine, before it generates: check that every tensor "
            "that can change was streamed and taken by the engine, that its prefix cache holds nothing from the old "
            "weights, and that its log-probs of a fixed probe equal the trainer's within what the dtypes allow; a "
            "failed check raises SyncCheckError naming what disagrees. 'every' sync, the 'first' only, or 'off'.",
            "choices": ["every", "first", "off"],
        },
    )
    advantage_estimator: str = field(
        default=DEFAULT_ESTIMATOR,
        metadata={
            "help": "How advantages are estimated from the rewards (verl's names): 'grpo' (group mean baseline, scaled "
            "by scale_rewards: TRL's), 'rloo', 'reinforce_plus_plus', 'reinforce_plus_plus_baseline', 'grpo_passk', "
            "'opo', 'gpg', 'remax' (one extra greedy generation per prompt), or one registered with "
            "grpo_plus.register_advantage_estimator. scale_rewards divides rloo / grpo_passk / opo / gpg / remax by the "
            "group or batch std (set it to 'none' for the papers' numbers); REINFORCE++ scales itself. "
            "`grpo-plus list` shows each formula."
        },
    )
    policy_loss: str = field(
        default=DEFAULT_POLICY_LOSS,
        metadata={
            "help": "The per-token surrogate, aggregated by loss_type: 'ppo_clip' (TRL's clipped ratio, with epsilon, "
            "epsilon_high, delta, dual_clip), 'gmpo' (geometric mean of clipped token ratios; verl's geo_mean), "
            "'clip_cov', 'kl_cov' (arXiv 2505.22617), 'gpg' (no ratio), 'cispo' and 'sapo' (TRL's loss_type='cispo' "
            "/ 'sapo', computed by grpo_plus), or one registered with grpo_plus.register_policy_loss."
        },
    )
    kl_estimator: str = field(
        default=DEFAULT_KL_ESTIMATOR,
        metadata={
            "help": "Estimator of the KL term (beta > 0): 'k1', 'k2', 'k3' (TRL's), 'abs', 'low_var_kl' (verl's clamped "
            "k3), or any of them with '+' (its value, k2's gradient: straight-through, as verl's kl_penalty)."
        },
    )
    adaptive_kl_target: float | None = field(
        default=None,
        metadata={
            "help": "PPO's adaptive KL coefficient (Ziegler et al. 2019): after every optimizer step, beta *= 1 + "
            "clip(KL / target - 1, -0.2, 0.2) * n / adaptive_kl_horizon (n = completions in the step, KL = the logged "
            "token-mean `kl`), starting from beta. Its value is saved in checkpoints. None keeps beta fixed."
        },
    )
    adaptive_kl_horizon: int = field(
        default=DEFAULT_KL_HORIZON,
        metadata={
            "help": "Horizon of the adaptive KL coefficient: the number of completions over which beta moves by a "
            "factor of at most 1.2 (or 0.8)."
        },
    )
    clip_cov_ratio: float = field(
        default=_CLIP_COV["clip_cov_ratio"].default,
        metadata={"help": "policy_loss='clip_cov': share r of tokens whose gradient is cut (at least one)."},
    )
    clip_cov_lb: float = field(
        default=_CLIP_COV["clip_cov_lb"].default,
        metadata={"help": "policy_loss='clip_cov': lower bound of the covariance band tokens are cut from."},
    )
    clip_cov_ub: float = field(
        default=_CLIP_COV["clip_cov_ub"].default,
        metadata={"help": "policy_loss='clip_cov': upper bound of the covariance band tokens are cut from."},
    )
    kl_cov_ratio: float = field(
        default=_KL_COV["kl_cov_ratio"].default,
        metadata={"help": "policy_loss='kl_cov': share k of tokens (largest covariance) that get the KL penalty."},
    )
    kl_cov_coef: float = field(
        default=_KL_COV["kl_cov_coef"].default,
        metadata={
            "help": "policy_loss='kl_cov': coefficient of |logp - old_logp| on those tokens (verl: ppo_kl_coef)."
        },
    )
    zero_waste_exact_entropy: bool = field(
        default=False,
        metadata={
            "help": "With rows skipped by the zero-waste pass, also run the skipped rows through a no-grad forward so "
            "the logged `entropy` is TRL's (every completion token), at the cost of that forward. Off: `entropy` is "
            "logged only for logging windows in which no row was skipped (else None), and "
            "`zero_waste/entropy_trained_rows` gives the entropy of the rows trained. Never changes the training."
        },
    )
    health_check: str = field(
        default=_HEALTH_DEFAULTS.check,
        metadata={
            "help": "Training-health guard (grpo_plus.run.health), reading only what the run logs: 'warn' logs one "
            "warning per problem (every group zero-variance, most completions truncated, gradient norm 0 or "
            "non-finite, loss or rewards NaN, entropy collapse), saying what it saw and what to change; 'stop' "
            "ends the run at that step instead, saving its checkpoint and raising TrainingHealthError; 'off'."
        },
    )
    health_patience_steps: int = field(
        default=_HEALTH_DEFAULTS.patience_steps,
        metadata={
            "help": "How many consecutive optimizer steps a condition (zero variance, truncation, zero gradient, "
            "entropy collapse) must hold before the guard reports it. Non-finite values and unscorable rewards are "
            "reported at once (non-finite gradients under fp16 after this many steps: the loss scaler skips some)."
        },
    )
    health_zero_std_frac: float | None = field(
        default=_HEALTH_DEFAULTS.zero_std_frac,
        metadata={
            "help": "Report when frac_reward_zero_std (the share of groups whose rewards were all equal, so their "
            "advantages 0) is at least this. 1.0: every group. None turns the check off."
        },
    )
    health_truncated_frac: float | None = field(
        default=_HEALTH_DEFAULTS.truncated_frac,
        metadata={
            "help": "Report when completions/clipped_ratio (the share of completions cut off at "
            "max_completion_length) is at least this. None turns the check off."
        },
    )
    health_entropy_collapse_frac: float | None = field(
        default=_HEALTH_DEFAULTS.entropy_collapse_frac,
        metadata={
            "help": "Report entropy collapse when the logged mean token entropy falls below this fraction of its first "
            "logged value. None turns the check off."
        },
    )
    reward_timeout: float | None = field(
        default=_REWARD_DEFAULTS.timeout,
        metadata={
            "help": "Seconds a reward function's call (one per reward function per generation batch) may take, in "
            "worker processes (needs reward_workers >= 1). The completions not scored by then, narrowed down to "
            "those the function stalled on, get None (no reward; the other reward functions still count) and are "
            "counted in rewards/<name>/timeouts. None: no timeout (TRL's behaviour)."
        },
    )
    reward_workers: int = field(
        default=_REWARD_DEFAULTS.workers,
        metadata={
            "help": "0: reward functions are called in the trainer's process (TRL's behaviour). N > 0: each call is "
            "split into N pieces of consecutive completions scored at once by N worker processes, so a reward that "
            "stalls, raises or ends its process never takes the trainer with it (a dead worker is replaced). The "
            "rewards are those of one in-process call, for functions that score each completion on its own "
            "(reward_whole_batch names the others). Reward models and environment-owned rewards stay TRL's."
        },
    )
    reward_on_error: str = field(
        default=_REWARD_DEFAULTS.on_error,
        metadata={
            "help": "What a reward function's exception does: 'raise' (TRL's behaviour) or 'none': the call is narrowed "
            "down to the completions that raise, which get None, counted in rewards/<name>/errors, with a warning the "
            "first time. A worker that ends (os._exit, a segfault) gives its completions None either way.",
            "choices": list(REWARD_ON_ERROR),
        },
    )
    reward_whole_batch: list[str] | None = field(
        default=None,
        metadata={
            "help": "Names of reward functions that score a completion against the others of its batch: the reward "
            "runner calls them on the whole batch (never split across workers, never narrowed down: a failure gives "
            "every completion of the call None)."
        },
    )
    rollout_correction: str | None = field(
        default=None,
        metadata={
            "help": "verl's rollout correction, by preset name (verl's RolloutCorrectionConfig presets): "
            + ", ".join(PRESETS)
            + ". A preset sets rollout_is, rollout_rs, rollout_bypass_mode (and policy_loss 'ppo_clip' or 'gpg' for the "
            "bypass ones) and its thresholds, which rollout_is_threshold / rollout_rs_threshold replace; a field set to "
            "another value than the preset's is an error. 'disabled' logs the mismatch metrics only. Any rollout_* "
            "setting replaces TRL's vllm_importance_sampling_correction. Needs the sampler's log-probs (vLLM, or a "
            "rollout_func returning 'logprobs'). docs/guide/rollout-correction.md says which to pick."
        },
    )
    rollout_is: str | None = field(
        default=None,
        metadata={
            "help": "verl's IS weights for the sampler/trainer mismatch, multiplying the policy term: 'token' "
            "(w = pi_old / pi_rollout per token) or 'sequence' (their product over the sequence), truncated at "
            "rollout_is_threshold. In bypass mode, for policy_loss='gpg' only (verl's REINFORCE). None: no weights.",
            "choices": list(RolloutCorrectionSettings.IS_CHOICES),
        },
    )
    rollout_is_threshold: float | None = field(
        default=None,
        metadata={"help": "Upper cap of the rollout IS weights (verl's TIS; None: verl's default 2.0)."},
    )
    rollout_is_batch_normalize: bool = field(
        default=False,
        metadata={
            "help": "Divide the rollout IS weights by their mean over the batch (tokens for 'token', sequences for "
            "'sequence'), after truncation: decoupled over the generation batch of every process, bypass over each "
            "micro-batch of every process (verl's)."
        },
    )
    rollout_rs: str | None = field(
        default=None,
        metadata={
            "help": "verl's rejection sampling: comma-separated criteria a token or sequence must all pass, else it "
            "leaves the loss mask: token_k1/k2/k3 (each token), seq_sum_k1/k2/k3, seq_mean_k1/k2/k3 (seq_mean_k1 is "
            "the geometric mean of the ratio), seq_max_k2/k3, with k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r "
            "of r = pi_old / pi_rollout. None: no rejection."
        },
    )
    rollout_rs_threshold: float | str | None = field(
        default=None,
        metadata={
            "help": "Thresholds of rollout_rs, comma-separated, one per criterion or one for all: the k1 criteria "
            "take a ratio range 'lower_upper' (e.g. '0.999_1.001'; one value u means 1/u_u), k2 / k3 an upper bound "
            "(e.g. 0.01)."
        },
    )
    rollout_bypass_mode: bool = field(
        default=False,
        metadata={
            "help": "verl's bypass mode: the sampler's log-probs are the old policy (pi_old = pi_rollout), so the "
            "no-grad old-log-prob pass never runs; rejection and IS weights are computed in each micro-batch from "
            "the training forward. policy_loss='ppo_clip' corrects by its ratio pi_theta / pi_rollout; "
            "policy_loss='gpg' (verl's REINFORCE) takes the rollout_is weights."
        },
    )
    plugins: list[str] | None = field(
        default=None,
        metadata={
            "help": "Python modules to import before the config is validated, so modes they register can be named "
            "in `loss_type`, `importance_sampling_level`, `scale_rewards`, `advantage_estimator`, `policy_loss` or "
            "`kl_estimator` (e.g. from a YAML config). Packages can "
            "instead declare a `grpo_plus.plugins` entry point, which is loaded automatically."
        },
    )

    selective_rollout: bool = field(
        default=False,
        metadata={
            "help": "Selective rollout (GRESO): before generating, skip prompts whose recent groups all had equal "
            "rewards (all right or all wrong) with a probability that grows with the streak, and draw other prompts "
            "instead, so every generation batch stays full. Helps when training passes over a fixed prompt set "
            "several times. Needs a map-style train_dataset; the per-prompt history is saved in checkpoints."
        },
    )
    selective_rollout_explore_solved: float = field(
        default=_SELECTIVE_DEFAULTS.explore_solved,
        metadata={
            "help": "Initial exploration probability p for prompts whose last z groups were all right: such a prompt "
            "is generated for with probability max(p**z, 0.01) when it comes up, else skipped. Adapted during "
            "training between selective_rollout_explore_min and selective_rollout_explore_max."
        },
    )
    selective_rollout_explore_unsolved: float = field(
        default=_SELECTIVE_DEFAULTS.explore_unsolved,
        metadata={"help": "Initial exploration probability p for prompts whose last z groups were all wrong."},
    )
    selective_rollout_explore_min: float = field(
        default=_SELECTIVE_DEFAULTS.explore_min,
        metadata={"help": "Lowest value the adapted exploration probabilities may reach."},
    )
    selective_rollout_explore_max: float = field(
        default=_SELECTIVE_DEFAULTS.explore_max,
        metadata={"help": "Highest value the adapted exploration probabilities may reach."},
    )
    selective_rollout_explore_step: float = field(
        default=_SELECTIVE_DEFAULTS.explore_step,
        metadata={
            "help": "After every generation batch (from the second pass over the data on), each exploration "
            "probability moves down by this step when its kind of dead group made up at least its target share of "
            "the generated groups, up otherwise. 0 keeps them fixed."
        },
    )
    selective_rollout_target_dead_frac: float = field(
        default=_SELECTIVE_DEFAULTS.target_dead_frac,
        metadata={
            "help": "Target share of dead (zero-variance) groups among the generated ones, split one third to "
            "all-right and two thirds to all-wrong prompts (GRESO's split: all-wrong prompts are explored more)."
        },
    )
    selective_rollout_history: int = field(
        default=_SELECTIVE_DEFAULTS.history,
        metadata={"help": "Longest dead streak z that counts toward a prompt's skip probability 1 - p**z."},
    )
    selective_rollout_solved_reward: float | None = field(
        default=_SELECTIVE_DEFAULTS.solved_reward,
        metadata={
            "help": "A dead group whose reward is at least this counts as all right, below as all wrong. None: the "
            "midpoint of the lowest and highest reward seen so far (0.5 for a 0/1 reward). A group counts as dead "
            "when its reward std is at most dynamic_sampling_min_std."
        },
    )

    def __post_init__(self):
        # Validate our fields before TRL/transformers set up devices, so a typo fails in milliseconds.
        validate_grpo_settings(self)
        super().__post_init__()


_OWN_FIELDS = tuple(f for f in dataclasses.fields(GRPOConfig) if f.name not in trl.GRPOConfig.__dataclass_fields__)


def _tiled_setting(value: Any) -> Any:
    """tiled_mlp_tokens / lm_head_tile_columns as the command line gives it ("4096", "none") read as the value it names."""
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    if isinstance(value, str) and value.strip().lower() == "none":
        return None
    return value


@dataclass(frozen=True)
class PlusSettings:
    """grpo_plus's own GRPOConfig fields, read once, grouped by capability (PEFT-style: each group validates itself).

    Built from any config: a plain `trl.GRPOConfig` gets GRPOConfig's field defaults, so there is one default per
    setting (`tests/test_config.py` checks every own field of GRPOConfig lands here).
    """

    dual_clip: float | None
    overlong_buffer_length: int | None
    overlong_penalty: float
    zero_waste_pass: bool
    zero_waste_shared_prompt: bool
    zero_waste_generation: bool
    zero_waste_exact_entropy: bool
    health: HealthSettings
    plugins: tuple[str, ...]
    activation_offloading: bool
    tiled_mlp_tokens: int | str | None
    lm_head_tile_columns: int | str | None
    fit_check: str
    vllm: VLLMSettings
    dynamic_sampling: DynamicSamplingSettings
    selective_rollout: bool
    selective: SelectiveRolloutSettings
    algorithms: AlgorithmSettings
    rewards: RewardRunnerSettings
    rollout: RolloutCorrectionSettings

    @classmethod
    def from_args(cls, args: trl.GRPOConfig) -> PlusSettings:
        own = types.SimpleNamespace(**{f.name: getattr(args, f.name, f.default) for f in _OWN_FIELDS})
        return cls(
            dual_clip=own.dual_clip,
            overlong_buffer_length=own.overlong_buffer_length,
            overlong_penalty=own.overlong_penalty,
            zero_waste_pass=own.zero_waste_pass,
            zero_waste_shared_prompt=own.zero_waste_shared_prompt,
            zero_waste_generation=own.zero_waste_generation,
            zero_waste_exact_entropy=own.zero_waste_exact_entropy,
            health=HealthSettings.from_args(own),
            plugins=tuple(own.plugins or ()),
            activation_offloading=own.activation_offloading,
            tiled_mlp_tokens=_tiled_setting(own.tiled_mlp_tokens),
            lm_head_tile_columns=_tiled_setting(own.lm_head_tile_columns),
            fit_check=own.fit_check,
            vllm=VLLMSettings.from_args(own),
            dynamic_sampling=DynamicSamplingSettings.from_args(own),
            selective_rollout=own.selective_rollout,
            selective=SelectiveRolloutSettings.from_args(own),
            algorithms=AlgorithmSettings.from_args(own, args),
            rewards=RewardRunnerSettings.from_args(own),
            rollout=RolloutCorrectionSettings.from_args(own),
        )

    def validate(self, args: trl.GRPOConfig, trl_native: bool) -> None:
        """Raise ConfigError for a value grpo_plus cannot use (the selective-rollout fields are checked whether or
        not it is on, so a typo in a YAML file surfaces)."""
        if self.dual_clip is not None and not self.dual_clip > 1:
            allowed = "> 1 or None (the dual-clip constant c: for A < 0 the loss is capped at c*|A|)"
            raise not_allowed("dual_clip", self.dual_clip, allowed)
        buffer, length = self.overlong_buffer_length, args.max_completion_length
        if buffer is not None and not (length and 0 < buffer <= length):
            raise not_allowed("overlong_buffer_length", buffer, f"in (0, max_completion_length={length}] or None")
        if self.overlong_penalty < 0:
            raise not_allowed("overlong_penalty", self.overlong_penalty, ">= 0")
        if self.tiled_mlp_tokens not in (None, "auto") and not (
            isinstance(self.tiled_mlp_tokens, int) and self.tiled_mlp_tokens >= 1
        ):
            raise not_allowed(
                "tiled_mlp_tokens", self.tiled_mlp_tokens, "'auto', a positive number of token positions or None"
            )
        try:
            check_lm_head_setting(self.lm_head_tile_columns)
        except ValueError:
            allowed = "'auto', a positive number of vocabulary columns or None (TRL's tile)"
            raise not_allowed("lm_head_tile_columns", self.lm_head_tile_columns, allowed) from None
        if self.fit_check not in FIT_CHECK_MODES:
            raise not_allowed("fit_check", self.fit_check, f"one of {', '.join(map(repr, FIT_CHECK_MODES))}")
        self.vllm.validate()
        self.dynamic_sampling.validate(args.per_device_train_batch_size, args.num_generations)
        self.selective.validate()
        self.algorithms.validate(args, trl_native)
        self.rollout.validate(args, trl_native, getattr(args, "policy_loss", self.algorithms.policy_loss))
        self.health.validate()
        self.rewards.validate()
