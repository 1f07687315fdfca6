"""TRL's objective as TRL 1.14-1.16 implement it: the loss types and levels TRL computes itself, the settings its
trainer resolved for the training pass (read once, `trl_training_settings`), the parts of its `_compute_loss` grpo_plus
calls (policy weights, entropy bonus), TRL's own log-prob method, its vLLM importance-sampling correction, the config
fields its loss reads, where it can compute log-probs.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import trl
import trl.trainer.utils as trl_utils
from trl.trainer.utils import nanmax, nanmin, split_tensor_dict

from .common import args_fields, attribute_set, is_self, method_tree, self_attributes
from .lm_head import has_fused_lm_head
from .model import trl_pad_token_id

__all__ = [
    "SAMPLER_LOGPS_KEY",
    "TRL_IMPORTANCE_SAMPLING_LEVELS",
    "TRL_NATIVE_LOSS_TYPES",
    "TRL_SAMPLER_CORRECTION",
    "TRL_SAMPLER_CORRECTION_SHAPE",
    "TRL_SAMPLER_METRICS",
    "TRL_SCALE_REWARDS",
    "TRL_SEQUENCE_SAMPLER_MODES",
    "TRLLossMethods",
    "TRLSamplerCorrection",
    "TRLTrainingSettings",
    "entropy_bonus",
    "logps_unavailable_reason",
    "nanmax",
    "nanmin",
    "policy_weights",
    "split_tensor_dict",
    "trl_logps_and_entropies",
    "trl_loss_fields",
    "trl_loss_methods",
    "trl_sampler_correction_changes",
    "trl_sampler_correction_off",
    "trl_sampler_metric_values",
    "trl_sampler_ratio",
    "trl_training_settings",
]


# ---- TRL's objective as TRL 1.14-1.16 implement it -----------------------------------------------------------------
# Loss types TRL computes itself and grpo_plus hands to TRL's own `_compute_loss` (token / sequence levels only).
TRL_NATIVE_LOSS_TYPES = ("cispo", "sapo", "luspo", "vespo")


TRL_IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


# The `scale_rewards` names TRL's inline advantage code accepts (grpo_plus's registry adds aliases and user modes).
TRL_SCALE_REWARDS = ("group", "batch", "none")


@dataclass(frozen=True)
class TRLSamplerCorrection:
    """TRL's vLLM correction as the trainer holds it: `vllm_importance_sampling_mode`, `_clip_min`, `_clip_max`."""

    mode: str
    clip_min: float | None
    clip_max: float | None


@dataclass(frozen=True)
class TRLTrainingSettings:
    """What TRL's trainer (1.14-1.16) resolved at `__init__` for the training pass, from the config and the model, read
    once (`trl_training_settings`) and handed to what computes the pass: the loss settings its `_compute_loss` reads,
    its entropy bonus and router aux loss switches, its vLLM correction, the batch layout, mixed precision, gradient
    checkpointing's arguments, the pad token."""

    loss_type: str
    importance_sampling_level: str
    epsilon_low: float
    epsilon_high: float
    delta: float | None
    beta: float
    use_bias_correction_kl: bool
    max_completion_length: int
    top_entropy_quantile: float
    off_policy_mask_threshold: float | None
    entropy_bonus: bool  # a static or adaptive entropy coefficient is on (TRL's `_entropy_bonus_enabled`)
    aux_loss: bool  # the router's load-balancing loss is added (a mixture-of-experts model that reports it)
    router_aux_loss_coef: float
    sampler_correction: bool  # TRL's vLLM importance-sampling correction is on (vLLM and the switch)
    sampler: TRLSamplerCorrection
    steps_per_generation: int
    num_iterations: int
    gradient_accumulation_steps: int
    half_precision: bool  # training runs under bf16 / fp16 autocast
    gradient_checkpointing_kwargs: dict[str, Any] | None
    pad_token_id: int | None


def trl_training_settings(trainer: trl.GRPOTrainer) -> TRLTrainingSettings:
    """`TRLTrainingSettings` of a constructed TRL trainer (the attributes TRL 1.14-1.16 set in `__init__`)."""
    args = trainer.args
    return TRLTrainingSettings(
        loss_type=trainer.loss_type,
        importance_sampling_level=trainer.importance_sampling_level,
        epsilon_low=trainer.epsilon_low,
        epsilon_high=trainer.epsilon_high,
        delta=args.delta,
        beta=trainer.beta,
        use_bias_correction_kl=args.use_bias_correction_kl,
        max_completion_length=trainer.max_completion_length,
        top_entropy_quantile=trainer.top_entropy_quantile,
        off_policy_mask_threshold=trainer.off_policy_mask_threshold,
        entropy_bonus=trainer._entropy_bonus_enabled,
        aux_loss=trainer.aux_loss_enabled,
        router_aux_loss_coef=trainer.router_aux_loss_coef,
        sampler_correction=bool(trainer.use_vllm and trainer.vllm_importance_sampling_correction),
        sampler=TRLSamplerCorrection(
            trainer.vllm_importance_sampling_mode,
            trainer.vllm_importance_sampling_clip_min,
            trainer.vllm_importance_sampling_clip_max,
        ),
        steps_per_generation=args.steps_per_generation,
        num_iterations=trainer.num_iterations,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        half_precision=bool(args.bf16 or args.fp16),
        gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs,
        pad_token_id=trl_pad_token_id(trainer),
    )


@dataclass(frozen=True)
class TRLLossMethods:
    """The parts of TRL's `_compute_loss` grpo_plus calls, bound to one trainer (`trl_loss_methods`): its high-entropy
    token mask (gathered over processes), DeepSeek-V3.2's off-policy mask, and its entropy bonus (`entropy_bonus`:
    `(entropies, mask, mode)`, advancing the adaptive coefficient TRL keeps on the trainer)."""

    high_entropy_mask: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    off_policy_mask: Callable[..., torch.Tensor]
    entropy_bonus: Callable[[torch.Tensor, torch.Tensor, str], torch.Tensor]


def trl_loss_methods(trainer: trl.GRPOTrainer) -> TRLLossMethods:
    """TRL's loss parts bound to `trainer` (TRL 1.14-1.16 names)."""
    return TRLLossMethods(
        trainer.get_high_entropy_mask, trainer.get_off_policy_mask, functools.partial(entropy_bonus, trainer)
    )


def trl_logps_and_entropies(trainer: trl.GRPOTrainer) -> Callable[..., tuple]:
    """TRL's own `_get_per_token_logps_and_entropies` of `trainer` (not grpo_plus's override of it), called as
    `(model, input_ids, attention_mask, logits_to_keep, batch_size=..., compute_entropy=..., compute_aux_loss=...,
    **model_inputs)`; looked up at each call, so a patched TRL method is the one called."""
    return functools.partial(_trl_logps_and_entropies, trainer)


def _trl_logps_and_entropies(trainer: trl.GRPOTrainer, *args, **kwargs) -> tuple:
    return trl.GRPOTrainer._get_per_token_logps_and_entropies(trainer, *args, **kwargs)


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
    with attribute_set(trainer, TRL_SAMPLER_CORRECTION, False):
        yield


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
    settings: TRLTrainingSettings,
    inputs: dict,
    advantages: torch.Tensor,
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    entropies: torch.Tensor | None,
    mask: torch.Tensor,
    methods: TRLLossMethods,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(entropy mask, weights of the policy term) as TRL's `_compute_loss` builds them: the high-entropy token mask
    (`top_entropy_quantile < 1`), DeepSeek-V3.2's off-policy sequence mask (`off_policy_mask_threshold`) and vLLM's
    importance-sampling ratio, multiplied; None where none applies. TRL does this inline in `_compute_loss`, with its
    own `get_high_entropy_mask` / `get_off_policy_mask` (`methods`), which are called here as TRL calls them."""
    entropy_mask = None
    if settings.top_entropy_quantile < 1.0:
        entropy_mask = methods.high_entropy_mask(entropies, mask, 1 - settings.top_entropy_quantile)
    weights = entropy_mask
    if settings.off_policy_mask_threshold is not None:
        off_policy = methods.off_policy_mask(
            advantages=advantages,
            per_token_logps=logps,
            sampling_per_token_logps=inputs.get(SAMPLER_LOGPS_KEY, old_logps),
            mask=mask,
            off_policy_threshold=settings.off_policy_mask_threshold,
        )
        weights = off_policy if weights is None else off_policy * weights
    if settings.sampler_correction:
        ratio = inputs["importance_sampling_ratio"]
        weights = ratio if weights is None else weights * ratio
    return entropy_mask, weights


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
    init = method_tree(methods["__init__"])
    # What each `self.<attribute>` of __init__ is set from: args fields, other attributes, and local variables that
    # hold an args field as it is (`coef = args.router_aux_loss_coef`; a local computed from more, e.g. the model
    # loaded from model_init_kwargs, is not the loss's setting).
    sources: dict[str, set[str]] = {}
    for node in ast.walk(init):
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            read = {f"args.{name}" for name in args_fields(node.value)}
            for target in targets:
                if isinstance(target, ast.Attribute) and is_self(target.value):
                    read |= {f"self.{name}" for name in self_attributes(node.value)}
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
        tree = method_tree(methods[name])
        fields |= args_fields(tree)
        for attribute in self_attributes(tree):
            pending.append(attribute)  # a method it calls (others are not in `methods`)
            fields |= fields_of(f"self.{attribute}", set())
    config_fields = {field.name for field in dataclasses.fields(trl.GRPOConfig)}
    return frozenset(fields & config_fields)


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
