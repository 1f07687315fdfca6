"""GRPOConfig: TRL's config, every field unchanged, plus each concern's settings group; and the one step that turns a
config into the run's settings.

Each grpo_plus field is declared once, in its concern's settings group (`grpo_plus/<concern>/settings.py`, the base in
`grpo_plus.settings`); GRPOConfig is `trl.GRPOConfig` plus the fields generated from the groups. `PlusSettings` is the
run's settings: every group, and TRL's fields that name the objective's axes, canonical. `build_settings` is the one
normalization step (plugins loaded, aliases canonicalized, the rollout-correction preset expanded, every value and
combination checked); it reads the config and never writes into it.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import numbers
import os
import sys
import types
import typing
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import trl

from .algorithms.settings import (
    AlgorithmSettings,
    ObjectiveFields,
    OverlongSettings,
    RolloutCorrectionSettings,
)
from .async_generation.settings import AsyncGenerationSettings
from .compat.loss import TRL_SAMPLER_CORRECTION, trl_sampler_correction_changes
from .compat.model import single_turn_arguments
from .compat.versions import ignore_renames_trl_still_uses
from .engine.settings import VLLMSettings
from .fit.settings import FitSettings
from .long_completions.settings import LongCompletionSettings
from .objective import ADVANTAGE_ESTIMATORS
from .objective.common import WARNED_ONCE
from .objective.loss import TRL_ACCEPTS, unusual_settings
from .partial_rollouts.settings import PartialRolloutSettings, server_request_seed
from .plugins import PluginSettings, load_plugins
from .rewards.settings import RewardRunnerSettings
from .routing.settings import RoutingSettings
from .run.settings import HealthSettings
from .sampling.settings import DynamicSamplingSettings, SelectiveRolloutSettings
from .settings import ConfigError, SettingsGroup, config_fields
from .speculative.settings import SpeculativeSettings
from .zero_waste.settings import ZeroWasteSettings

__all__ = ["ConfigError", "GRPOConfig", "PlusSettings", "build_settings", "field_type_problem"]

# Before any GRPOConfig is built: TRL's own defaults and calls set off transformers' renaming warnings (see compat.versions).
ignore_renames_trl_still_uses()


@dataclass(frozen=True)
class PlusSettings:
    """The run's settings, built once from a config (`PlusSettings.from_config`) and handed to the trainer, which keeps
    them (`GRPOTrainer.plus`): each concern's settings group, and TRL's fields that name the objective's axes
    (`objective`), canonical. Nothing reads grpo_plus's fields from the config after this. `PlusSettings()` holds
    every default: the settings of TRL's default config.

    `trl_fields`: TRL's fields as TRL's own trainer must see them (loss_type, importance_sampling_level, scale_rewards
    canonical; `vllm_importance_sampling_correction` off where grpo_plus's rollout correction replaces TRL's): see
    `trl_config`.
    """

    plugins: PluginSettings = PluginSettings()
    objective: ObjectiveFields = ObjectiveFields()
    algorithms: AlgorithmSettings = AlgorithmSettings()
    overlong: OverlongSettings = OverlongSettings()
    rollout: RolloutCorrectionSettings = RolloutCorrectionSettings()
    dynamic_sampling: DynamicSamplingSettings = DynamicSamplingSettings()
    selective_rollout: SelectiveRolloutSettings = SelectiveRolloutSettings()
    zero_waste: ZeroWasteSettings = ZeroWasteSettings()
    long_completions: LongCompletionSettings = LongCompletionSettings()
    fit: FitSettings = FitSettings()
    vllm: VLLMSettings = VLLMSettings()
    async_generation: AsyncGenerationSettings = AsyncGenerationSettings()
    partial_rollouts: PartialRolloutSettings = PartialRolloutSettings()
    speculative: SpeculativeSettings = SpeculativeSettings()
    routing: RoutingSettings = RoutingSettings()
    rewards: RewardRunnerSettings = RewardRunnerSettings()
    health: HealthSettings = HealthSettings()
    trl_fields: typing.Mapping[str, Any] = dataclasses.field(default_factory=lambda: types.MappingProxyType({}))

    @staticmethod
    def groups() -> dict[str, type[SettingsGroup]]:
        """Attribute -> settings group, for every group of GRPOConfig fields, in GRPOConfig's order."""
        hints = typing.get_type_hints(PlusSettings)
        return {
            f.name: hints[f.name]
            for f in dataclasses.fields(PlusSettings)
            if isinstance(hints[f.name], type) and issubclass(hints[f.name], SettingsGroup)
        }

    @classmethod
    def from_config(cls, config: trl.GRPOConfig) -> PlusSettings:
        """The settings of `config` (a GRPOConfig, or a TRL script's own `trl.GRPOConfig`: grpo_plus's defaults):
        those built when the config was constructed, if it has not changed since, else built now (and kept for it)."""
        known = _BUILT.get(id(config))
        if known is not None and known[0] == _fingerprint(config):
            return known[1]
        settings = build_settings(config)
        _keep(config, settings)
        return settings

    def config_values(self) -> dict[str, Any]:
        """GRPOConfig field -> the value the run uses (canonical), for every grpo_plus field and TRL's `trl_fields`."""
        values = dict(self.trl_fields)
        for name in self.groups():
            values.update(getattr(self, name).config_values())
        return values

    def trl_config(self, config: trl.GRPOConfig | None) -> trl.GRPOConfig | None:
        """The config TRL's trainer is built with: `config` itself where its TRL fields already hold the values
        grpo_plus reads, else a shallow copy holding them (`trl_fields`). The user's config is never written. (None:
        none given, TRL builds its default one.)"""
        if config is None:
            return None
        changed = {name: value for name, value in self.trl_fields.items() if getattr(config, name) != value}
        if not changed:
            return config
        trl_args = copy.copy(config)
        for name, value in changed.items():
            setattr(trl_args, name, value)
        return trl_args


# Every setting of every group as a GRPOConfig field (type, default, help), generated from the groups' declarations.
GRPOPlusFields = config_fields("GRPOPlusFields", PlusSettings.groups().values(), __name__)


@dataclass
class GRPOConfig(GRPOPlusFields, trl.GRPOConfig):
    r"""[`trl.GRPOConfig`] with every TRL field unchanged, plus grpo_plus's fields (each declared in its concern's
    settings group: `grpo_plus.<concern>.settings`).

    `loss_type`, `importance_sampling_level` and `scale_rewards` also accept any name registered with
    `grpo_plus.register_loss_type`, `register_importance_sampling` and `register_advantage_normalizer`
    (and the aliases `local` = `group`, `global` = `batch`); `advantage_estimator`, `policy_loss` and `kl_estimator`
    pick the published algorithms (docs/guide/algorithms.md). Bad values fail here, at construction, before TRL sets
    up devices.

    The config keeps what it was given: aliases, a `rollout_correction` preset and the string "4096" stay as they are
    on it. The run's values, canonical, are in `PlusSettings.from_config(config)`, built here once and reused by the
    trainer. TRL's own trainer reads three of these names itself (`loss_type`, `importance_sampling_level`,
    `scale_rewards`) and `vllm_importance_sampling_correction`; where the config holds another value than the
    canonical one, `GRPOTrainer` hands TRL a copy of the config that holds it (its `trainer.args`), so stock TRL runs
    exactly as on a config written with the canonical names.
    """

    def __post_init__(self):
        # Every grpo_plus value checked before TRL/transformers set up devices, so a typo fails in milliseconds.
        layout_known = self.steps_per_generation is not None or self.generation_batch_size is None
        settings = build_settings(self)
        super().__post_init__()
        if not layout_known:  # TRL derived steps_per_generation from generation_batch_size: check what needs it
            _check_generation_layout(settings.algorithms, self)
        _keep(self, settings)


def build_settings(config: trl.GRPOConfig) -> PlusSettings:
    """The one normalization step: `config`'s settings, every value and combination checked (ConfigError names the
    field and what is allowed), without writing into `config`. Plugins are loaded first (they may register names the
    other fields use); aliases become their names, the rollout-correction preset is expanded. Values TRL trains with
    that are most likely mistakes are warned about here, once per build."""
    plugins = PluginSettings.from_config(config)
    load_plugins(plugins.plugins)
    _check_field_types(config)
    rollout = RolloutCorrectionSettings.from_config(config)
    objective = ObjectiveFields.from_config(config)
    _check_ranges(config, objective)
    objective.check_combinations(config.multi_objective_aggregation)
    policy_loss = rollout.preset_policy_loss(getattr(config, "policy_loss", AlgorithmSettings.policy_loss))
    algorithms = AlgorithmSettings.from_config(config, policy_loss=policy_loss)
    overlong = OverlongSettings.from_config(config)
    overlong.check_length(config.max_completion_length)
    long_completions, fit = LongCompletionSettings.from_config(config), FitSettings.from_config(config)
    vllm = VLLMSettings.from_config(config)
    vllm.check_combinations(config.use_vllm, config.vllm_mode)
    dynamic_sampling = DynamicSamplingSettings.from_config(config)
    dynamic_sampling.check_batch(config.per_device_train_batch_size, config.num_generations)
    selective_rollout = SelectiveRolloutSettings.from_config(config, min_std=dynamic_sampling.min_std)
    algorithms.check_combinations(objective, config.multi_objective_aggregation, config.delta, config.beta)
    _check_generation_layout(algorithms, config)
    rollout.check_combinations(objective, algorithms.policy_loss)
    async_generation = AsyncGenerationSettings.from_config(config)
    async_generation.check_combinations(
        config.use_vllm, config.vllm_mode, getattr(config, TRL_SAMPLER_CORRECTION, False) or rollout.active,
        dynamic_sampling.enabled, selective_rollout.enabled,
    )  # fmt: skip
    zero_waste, speculative = ZeroWasteSettings.from_config(config), SpeculativeSettings.from_config(config)
    generation_kwargs = _dict_field(config.generation_kwargs)
    speculative.check_combinations(
        config.use_vllm, zero_waste.generation, _continuous_batching(config), generation_kwargs
    )
    partial_rollouts = PartialRolloutSettings.from_config(
        config, max_staleness=async_generation.max_staleness,
        request_seed=server_request_seed(config.use_vllm, config.vllm_mode, generation_kwargs),
    )  # fmt: skip
    partial_rollouts.check_combinations(
        use_vllm=bool(config.use_vllm), vllm_mode=config.vllm_mode, zero_waste_generation=zero_waste.generation,
        async_generation=async_generation.enabled, dynamic_sampling=dynamic_sampling.enabled,
        selective_rollout=selective_rollout.enabled, continuous_batching=_continuous_batching(config),
        greedy_baseline="reward_baselines" in ADVANTAGE_ESTIMATORS.entry(algorithms.advantage_estimator).requires,
        generation_kwargs=generation_kwargs,
        trl_takes_num_generations=bool(single_turn_arguments(1)),
        structured_outputs_regex=config.vllm_structured_outputs_regex,
        tensor_parallel_size=config.vllm_tensor_parallel_size,
    )  # fmt: skip
    routing = RoutingSettings.from_config(config)
    routing.check_combinations(
        config.use_vllm, zero_waste.generation, speculative.enabled, objective.loss_type, _continuous_batching(config)
    )
    trl_fields = {
        name: getattr(objective, name) for name in ("loss_type", "importance_sampling_level", "scale_rewards")
    }
    trl_correction = getattr(config, TRL_SAMPLER_CORRECTION, False)
    if rollout.replaces_trl_correction(config.use_vllm, trl_correction, trl_sampler_correction_changes(config)):
        trl_fields[TRL_SAMPLER_CORRECTION] = False
    settings = PlusSettings(
        plugins=plugins,
        objective=objective,
        algorithms=algorithms,
        overlong=overlong,
        rollout=rollout,
        dynamic_sampling=dynamic_sampling,
        selective_rollout=selective_rollout,
        zero_waste=zero_waste,
        long_completions=long_completions,
        fit=fit,
        vllm=vllm,
        async_generation=async_generation,
        partial_rollouts=partial_rollouts,
        speculative=speculative,
        routing=routing,
        rewards=RewardRunnerSettings.from_config(config),
        health=HealthSettings.from_config(config),
        trl_fields=types.MappingProxyType(trl_fields),
    )
    _warn_about_unusual_values(config)
    return settings


def _dict_field(value: Any) -> Any:
    """A dict field of TRL's config as its `__post_init__` will hold it: a JSON object given as a string (a command
    line's) parsed, as transformers parses it there (after grpo_plus's checks run)."""
    return json.loads(value) if isinstance(value, str) and value.startswith("{") else value


def _continuous_batching(config: trl.GRPOConfig) -> bool:
    """Whether TRL generates with transformers' continuous batching (its field's name before TRL 1.14: `_paged`)."""
    names = ("use_transformers_continuous_batching", "use_transformers_paged")
    return any(bool(getattr(config, name, False)) for name in names)


# ---- the settings built for a config, kept while it lives and is unchanged -----------------------------------------

_BUILT: dict[int, tuple[tuple, PlusSettings]] = {}


def _fingerprint(config: Any) -> tuple:
    """Every field's value of `config`, copied: equal while the config is unchanged."""

    def copied(value: Any) -> Any:
        try:
            return copy.deepcopy(value)
        except Exception:  # a value that cannot be copied is compared as the object it is
            return value

    return tuple((f.name, copied(getattr(config, f.name, None))) for f in dataclasses.fields(config))


def _keep(config: Any, settings: PlusSettings) -> None:
    """Keep `settings` as `config`'s while the config lives (keyed by its identity, checked against its values)."""
    key = id(config)
    if key not in _BUILT:
        weakref.finalize(config, _BUILT.pop, key, None)
    _BUILT[key] = (_fingerprint(config), settings)


# ---- checks of TRL's fields ------------------------------------------------------------------------------------------

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


def _check_field_types(config: trl.GRPOConfig) -> None:
    for name in _scalar_field_kinds(type(config)):
        problem = field_type_problem(type(config), name, getattr(config, name, None))
        if problem is not None:
            raise ConfigError(problem)


def _check_ranges(config: trl.GRPOConfig, objective: ObjectiveFields) -> None:
    def fail(name: str, allowed: str) -> None:
        raise ConfigError(f"{name}={getattr(config, name)!r} is not allowed: {name} must be {allowed}.")

    # Values TRL itself fails on (at its first step); those it trains with are warned about instead.
    if config.num_iterations < 0:
        fail("num_iterations", "a positive integer (1 by default; TRL's sampler fails on a negative count)")
    if config.top_entropy_quantile < 0:
        fail(
            "top_entropy_quantile", "in [0, 1], the share of highest-entropy tokens trained (TRL's mask fails below 0)"
        )
    if objective.loss_type == "dr_grpo" and config.max_completion_length is None:
        fail("max_completion_length", "set for loss_type='dr_grpo' (it is Dr. GRPO's constant normalizer L)")


def _check_generation_layout(algorithms: AlgorithmSettings, config: trl.GRPOConfig) -> None:
    """What the estimator needs of TRL's generation settings and batch layout (ReMax's greedy baseline). A config whose
    `steps_per_generation` TRL derives from `generation_batch_size` is checked once TRL has derived it."""
    steps = config.steps_per_generation
    if steps is None and config.generation_batch_size is None:
        steps = config.gradient_accumulation_steps  # TRL's default; else TRL derives it with the process count
    algorithms.check_greedy_baseline(
        use_vllm=bool(getattr(config, "use_vllm", False)),
        continuous_batching=bool(getattr(config, "use_transformers_paged", False)),
        evaluates=getattr(config.eval_strategy, "value", config.eval_strategy) != "no",
        per_device_eval_batch_size=config.per_device_eval_batch_size,
        eval_generations=getattr(config, "num_generations_eval", None) or config.num_generations,
        per_device_train_batch_size=config.per_device_train_batch_size,
        steps_per_generation=steps,
        num_generations=config.num_generations,
    )


def _warn_about_unusual_values(config: trl.GRPOConfig) -> None:
    """Values TRL accepts and trains with that are most likely mistakes: a warning saying what they do (a check
    grpo_plus adds must never refuse what TRL accepts)."""
    messages = unusual_settings(config.epsilon, config.epsilon_high, config.delta, config.beta)
    if config.top_entropy_quantile > 1:
        messages.append(
            f"top_entropy_quantile={config.top_entropy_quantile} is above 1: like 1.0, every token keeps its gradient "
            f"(the entropy mask applies below 1 only). It is the share of highest-entropy tokens trained, in [0, 1]. "
            f"{TRL_ACCEPTS}"
        )
    if config.num_iterations == 0:
        messages.append(
            "num_iterations=0: each generation batch is trained on 0 times, so the run ends without a single "
            f"optimizer step (the GRPO paper's mu is >= 1; 1 is the default). {TRL_ACCEPTS}"
        )
    for message in messages:
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
