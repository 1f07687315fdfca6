"""GRPOConfig's algorithm fields, declared and checked: the published algorithms (`advantage_estimator`,
`policy_loss` and its options, `kl_estimator`, the adaptive KL coefficient, `dual_clip`), DAPO's soft overlong
punishment (`overlong_*`) and verl's rollout correction (`rollout_*`, with verl's presets); and TRL's fields that name
the objective's axes (`loss_type`, `importance_sampling_level`, `scale_rewards`), canonicalized.

The formulas are the core's (`grpo_plus.objective`); the code around them in a trainer is `algorithms.estimators` and
`algorithms.rollout_correction`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ..compat.loss import (
    TRL_IMPORTANCE_SAMPLING_LEVELS,
    TRL_NATIVE_LOSS_TYPES,
    TRL_SAMPLER_CORRECTION,
    TRL_SCALE_REWARDS,
)
from ..objective import (
    ADVANTAGE_ESTIMATORS,
    ADVANTAGE_NORMALIZERS,
    IMPORTANCE_SAMPLERS,
    KL_ESTIMATORS,
    LOSS_TYPES,
    POLICY_LOSSES,
)
from ..objective.advantages import scale_rewards_problem
from ..objective.loss import policy_loss_options_problem, policy_loss_problem
from ..objective.policy_losses import OPTIONS
from ..objective.rollout_corr import IS_LEVELS, parse_rejection_criteria, parse_thresholds
from ..registry import did_you_mean
from ..settings import ConfigError, SettingsGroup, field_reader, not_allowed, setting

DEFAULT_ESTIMATOR, DEFAULT_POLICY_LOSS, DEFAULT_KL_ESTIMATOR = "grpo", "ppo_clip", "k3"
DEFAULT_KL_HORIZON = 10000  # PPO's (Ziegler et al. 2019; TRL's old PPOConfig, verl's kl_ctrl.horizon)
DEFAULT_IS_THRESHOLD = 2.0  # verl's default rollout_is_threshold
# The policy loss verl's bypass "reinforce" is (-A logp, the IS weights multiplying it); its "ppo_clip" is ours.
POLICY_GRADIENT, PPO_CLIP = "gpg", DEFAULT_POLICY_LOSS
# What scale_rewards' booleans name (TRL maps True / False itself; a command line or YAML may give the strings).
_BOOL_STRINGS = {"true": "group", "false": "none"}
_CLIP_COV, _KL_COV = POLICY_LOSSES.entry("clip_cov").trait(OPTIONS), POLICY_LOSSES.entry("kl_cov").trait(OPTIONS)


# ---- TRL's fields that name the objective's axes ---------------------------------------------------------------------


@dataclass(frozen=True)
class ObjectiveFields:
    """TRL's `loss_type`, `importance_sampling_level` and `scale_rewards` as grpo_plus reads them: a name registered
    with grpo_plus (or one of TRL's own loss types) as its canonical name (aliases resolved, scale_rewards' booleans
    named). TRL's fields, not grpo_plus's: no GRPOConfig field is declared here; TRL's trainer gets these values
    (`grpo_plus.config.PlusSettings.trl_config`)."""

    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    scale_rewards: str | bool = "group"

    @classmethod
    def from_config(cls, config: Any) -> ObjectiveFields:
        return cls(config.loss_type, config.importance_sampling_level, config.scale_rewards)

    def __post_init__(self) -> None:
        scale = self.scale_rewards
        if isinstance(scale, bool):
            scale = "group" if scale else "none"
        elif isinstance(scale, str) and scale.lower() in _BOOL_STRINGS:
            scale = _BOOL_STRINGS[scale.lower()]
        set_value = object.__setattr__
        set_value(self, "loss_type", LOSS_TYPES.check(self.loss_type, also=TRL_NATIVE_LOSS_TYPES, error=ConfigError))
        set_value(self, "importance_sampling_level", IMPORTANCE_SAMPLERS.check(self.importance_sampling_level,
                                                                               error=ConfigError))  # fmt: skip
        set_value(self, "scale_rewards", ADVANTAGE_NORMALIZERS.check(scale, error=ConfigError))

    @property
    def trl_native(self) -> bool:
        """Whether TRL computes this loss itself (its `_compute_loss`): grpo_plus's own options do not reach it."""
        return self.loss_type in TRL_NATIVE_LOSS_TYPES

    def check_combinations(self, multi_objective_aggregation: str) -> None:
        """Raise ConfigError for a combination of these with TRL's `multi_objective_aggregation` that cannot run."""
        if self.trl_native and self.importance_sampling_level not in TRL_IMPORTANCE_SAMPLING_LEVELS:
            raise ConfigError(
                f"importance_sampling_level={self.importance_sampling_level!r} cannot be combined with "
                f"loss_type={self.loss_type!r}: TRL computes that loss itself and supports only "
                f"{', '.join(TRL_IMPORTANCE_SAMPLING_LEVELS)}."
            )
        if multi_objective_aggregation == "normalize_then_sum" and self.scale_rewards not in TRL_SCALE_REWARDS:
            raise ConfigError(
                f"scale_rewards={self.scale_rewards!r} cannot be combined with "
                "multi_objective_aggregation='normalize_then_sum': that aggregation normalizes each reward function "
                "itself and ignores scale_rewards. Use multi_objective_aggregation='sum_then_normalize'."
            )


# ---- the published algorithms --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AlgorithmSettings(SettingsGroup):
    """The algorithm a config names: estimator, policy loss (with its own options), KL estimator, adaptive KL, the
    dual clip. Registered names are held canonical (an alias becomes its name)."""

    advantage_estimator: str = setting(
        DEFAULT_ESTIMATOR,
        "How advantages are estimated from the rewards (verl's names): 'grpo' (group mean baseline, scaled "
        "by scale_rewards: TRL's), 'rloo', 'reinforce_plus_plus', 'reinforce_plus_plus_baseline', 'grpo_passk', "
        "'opo', 'gpg', 'remax' (one extra greedy generation per prompt), or one registered with "
        "grpo_plus.register_advantage_estimator. scale_rewards divides rloo / grpo_passk / opo / gpg / remax by the "
        "group or batch std (set it to 'none' for the papers' numbers); REINFORCE++ scales itself. "
        "`grpo-plus list` shows each formula.",
    )
    policy_loss: str = setting(
        DEFAULT_POLICY_LOSS,
        "The per-token surrogate, aggregated by loss_type: 'ppo_clip' (TRL's clipped ratio, with epsilon, "
        "epsilon_high, delta, dual_clip), 'gmpo' (geometric mean of clipped token ratios; verl's geo_mean), "
        "'clip_cov', 'kl_cov' (arXiv 2505.22617), 'gpg' (no ratio), 'cispo' and 'sapo' (TRL's loss_type='cispo' "
        "/ 'sapo', computed by grpo_plus), or one registered with grpo_plus.register_policy_loss.",
    )
    kl_estimator: str = setting(
        DEFAULT_KL_ESTIMATOR,
        "Estimator of the KL term (beta > 0): 'k1', 'k2', 'k3' (TRL's), 'abs', 'low_var_kl' (verl's clamped "
        "k3), or any of them with '+' (its value, k2's gradient: straight-through, as verl's kl_penalty).",
    )
    adaptive_kl_target: float | None = setting(
        None,
        "PPO's adaptive KL coefficient (Ziegler et al. 2019): after every optimizer step, beta *= 1 + "
        "clip(KL / target - 1, -0.2, 0.2) * n / adaptive_kl_horizon (n = completions in the step, KL = the logged "
        "token-mean `kl`), starting from beta. Its value is saved in checkpoints. None keeps beta fixed.",
    )
    adaptive_kl_horizon: int = setting(
        DEFAULT_KL_HORIZON,
        "Horizon of the adaptive KL coefficient: the number of completions over which beta moves by a "
        "factor of at most 1.2 (or 0.8).",
    )
    dual_clip: float | None = setting(
        None,
        "Dual-clip constant c > 1 (Ye et al. 2020): for tokens with negative advantage the per-token "
        "loss is capped at c*|A|, so a huge ratio on a bad token cannot blow up the update. None disables it.",
    )
    # The options of the policy losses grpo_plus ships, their defaults the losses' own declarations.
    clip_cov_ratio: float = setting(
        _CLIP_COV["clip_cov_ratio"].default,
        "policy_loss='clip_cov': share r of tokens whose gradient is cut (at least one).",
    )
    clip_cov_lb: float = setting(
        _CLIP_COV["clip_cov_lb"].default,
        "policy_loss='clip_cov': lower bound of the covariance band tokens are cut from.",
    )
    clip_cov_ub: float = setting(
        _CLIP_COV["clip_cov_ub"].default,
        "policy_loss='clip_cov': upper bound of the covariance band tokens are cut from.",
    )
    kl_cov_ratio: float = setting(
        _KL_COV["kl_cov_ratio"].default,
        "policy_loss='kl_cov': share k of tokens (largest covariance) that get the KL penalty.",
    )
    kl_cov_coef: float = setting(
        _KL_COV["kl_cov_coef"].default,
        "policy_loss='kl_cov': coefficient of |logp - old_logp| on those tokens (verl: ppo_kl_coef).",
    )
    # Not a field of its own: the chosen policy loss's options, each from the config field of its name (one of the
    # above, or TRL's: sapo_temperature_pos / _neg); an option that is no config field keeps its declared default.
    policy_loss_options: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def from_config(cls, config: Any, **given: Any) -> AlgorithmSettings:
        """The group from `config`; `policy_loss_options` read from `config` for the policy loss it names (or is
        given) unless given."""
        if "policy_loss_options" not in given:
            read = field_reader(config)
            name = given.get("policy_loss", read("policy_loss", DEFAULT_POLICY_LOSS))
            declared = POLICY_LOSSES.entry(name).trait(OPTIONS, {}) if name in POLICY_LOSSES else {}
            options = {option: read(option, spec.default) for option, spec in declared.items()}
            given["policy_loss_options"] = MappingProxyType(options)
        return super().from_config(config, **given)

    def __post_init__(self) -> None:
        for registry in (ADVANTAGE_ESTIMATORS, POLICY_LOSSES, KL_ESTIMATORS):  # each `field` is one of ours
            self._set(registry.field, registry.check(getattr(self, registry.field), error=ConfigError))
        self._set("policy_loss_options", MappingProxyType(dict(self.policy_loss_options)))
        if self.dual_clip is not None and not self.dual_clip > 1:
            allowed = "> 1 or None (the dual-clip constant c: for A < 0 the loss is capped at c*|A|)"
            raise not_allowed("dual_clip", self.dual_clip, allowed)
        problem = policy_loss_options_problem(self.policy_loss, self.policy_loss_options)
        if problem is not None:
            raise ConfigError(problem)
        if self.adaptive_kl:
            if not self.adaptive_kl_target > 0:
                raise not_allowed("adaptive_kl_target", self.adaptive_kl_target, "> 0 or None (None keeps beta fixed)")
            if self.adaptive_kl_horizon < 1:
                raise not_allowed("adaptive_kl_horizon", self.adaptive_kl_horizon, ">= 1")

    @property
    def adaptive_kl(self) -> bool:
        return self.adaptive_kl_target is not None

    def needs(self, estimator_input: str) -> bool:
        """Whether the estimator reads `estimator_input` ("completion_mask", "reward_baselines")."""
        return estimator_input in ADVANTAGE_ESTIMATORS.entry(self.advantage_estimator).requires

    def check_combinations(self, objective: ObjectiveFields, multi_objective_aggregation: str, delta: float | None,
                           beta: float) -> None:  # fmt: skip
        """Raise ConfigError for a combination with TRL's fields that cannot run: the objective's axes (canonical),
        `multi_objective_aggregation`, `delta`, `beta`."""
        estimator, loss, kl = self.advantage_estimator, self.policy_loss, self.kl_estimator
        problem = scale_rewards_problem(estimator, objective.scale_rewards)
        if problem is not None:
            raise ConfigError(problem)
        if estimator != DEFAULT_ESTIMATOR and multi_objective_aggregation == "normalize_then_sum":
            raise ConfigError(
                f"advantage_estimator={estimator!r} cannot be combined with multi_objective_aggregation="
                "'normalize_then_sum': that aggregation is TRL's own GRPO advantage. Use "
                "multi_objective_aggregation='sum_then_normalize'."
            )
        trl_native, loss_type = objective.trl_native, objective.loss_type
        if trl_native and self.dual_clip is not None:
            raise ConfigError(
                f"dual_clip cannot be combined with loss_type={loss_type!r}: it applies to the clipped "
                f"surrogate of the grpo_plus loss types ({', '.join(LOSS_TYPES.names())})."
            )
        if trl_native and loss != DEFAULT_POLICY_LOSS:
            raise ConfigError(
                f"policy_loss={loss!r} cannot be combined with loss_type={loss_type!r}: TRL computes that loss "
                f"itself. Choose an aggregation grpo_plus computes (e.g. loss_type='dapo'; TRL's loss_type='cispo' is "
                "policy_loss='cispo' with loss_type='dapo', 'sapo' is policy_loss='sapo' with loss_type='grpo')."
            )
        problem = policy_loss_problem(
            loss, objective.importance_sampling_level, {"delta": delta, "dual_clip": self.dual_clip}
        )
        if problem is not None and not trl_native:
            raise ConfigError(problem)
        if trl_native and (kl != DEFAULT_KL_ESTIMATOR or self.adaptive_kl):
            setting_ = f"kl_estimator={kl!r}" if kl != DEFAULT_KL_ESTIMATOR else "adaptive_kl_target"
            raise ConfigError(
                f"{setting_} cannot be combined with loss_type={loss_type!r}: TRL computes that loss (and its k3 "
                "KL term with a fixed beta) itself."
            )
        if self.adaptive_kl and beta <= 0:
            raise ConfigError(
                f"adaptive_kl_target={self.adaptive_kl_target} needs beta > 0 (got beta={beta}): beta is the "
                "coefficient the controller starts from and moves by factors, and beta=0 loads no reference model."
            )

    def check_greedy_baseline(
        self,
        *,
        use_vllm: bool,
        continuous_batching: bool,
        evaluates: bool,
        per_device_eval_batch_size: int,
        eval_generations: int,
        per_device_train_batch_size: int,
        steps_per_generation: int | None,
        num_generations: int,
    ) -> None:
        """ReMax generates one greedy completion per prompt of each process's own rows, through TRL's generation:
        raise ConfigError where TRL's generation settings or batch layout cannot give it (`steps_per_generation`
        None: not known yet, not checked)."""
        estimator = self.advantage_estimator
        if "reward_baselines" not in ADVANTAGE_ESTIMATORS.entry(estimator).requires:
            return
        blockers = {
            "use_vllm=True": use_vllm,
            "use_transformers_paged=True (continuous batching)": continuous_batching,
        }
        for blocker, active in blockers.items():
            if active:
                raise ConfigError(
                    f"advantage_estimator={estimator!r} cannot be combined with {blocker}: its greedy baseline "
                    "generation runs through transformers' generate (the path grpo_plus checks greedy decoding on)."
                )
        if evaluates and per_device_eval_batch_size % eval_generations:
            raise ConfigError(
                f"advantage_estimator={estimator!r} needs per_device_eval_batch_size ({per_device_eval_batch_size}) "
                f"to be a multiple of the evaluation's num_generations ({eval_generations}): each process generates "
                "the greedy baseline for the prompts whose whole groups it holds."
            )
        if steps_per_generation is None:
            return
        local_rows = per_device_train_batch_size * steps_per_generation
        if local_rows % num_generations:
            raise ConfigError(
                f"advantage_estimator={estimator!r} needs per_device_train_batch_size * steps_per_generation "
                f"({per_device_train_batch_size} * {steps_per_generation} = {local_rows}) to be a multiple "
                f"of num_generations ({num_generations}): each process generates the greedy baseline for the "
                "prompts whose whole groups it holds."
            )


# ---- DAPO's soft overlong punishment --------------------------------------------------------------------------------


@dataclass(frozen=True)
class OverlongSettings(SettingsGroup):
    """DAPO's soft overlong punishment, added as an extra reward (TRL's `get_soft_overlong_punishment`)."""

    prefix = "overlong_"

    buffer_length: int | None = setting(
        None,
        "DAPO soft overlong punishment: completions longer than max_completion_length - "
        "overlong_buffer_length get a linearly growing penalty, reaching -overlong_penalty at "
        "max_completion_length (TRL's `get_soft_overlong_punishment`, added as an extra reward). None disables it.",
    )
    penalty: float = setting(1.0, "Weight of the soft overlong punishment reward (the DAPO paper uses 1.0).")

    def __post_init__(self) -> None:
        if self.penalty < 0:
            raise not_allowed("overlong_penalty", self.penalty, ">= 0")

    def check_length(self, max_completion_length: int | None) -> None:
        """Raise ConfigError where the buffer does not fit TRL's `max_completion_length`."""
        buffer, length = self.buffer_length, max_completion_length
        if buffer is not None and not (length and 0 < buffer <= length):
            raise not_allowed("overlong_buffer_length", buffer, f"in (0, max_completion_length={length}] or None")


# ---- verl's rollout correction -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Preset:
    """One of verl's `RolloutCorrectionConfig` presets as GRPOConfig fields; `policy_loss` is the bypass loss (None:
    any policy loss). The thresholds are the preset's defaults, which the config's own values replace (verl's preset
    parameters)."""

    rollout_is: str | None = None
    rollout_is_threshold: float | None = None
    rollout_rs: str | None = None
    rollout_rs_threshold: str | float | None = None
    rollout_bypass_mode: bool = False
    policy_loss: str | None = None


_SEQ_RS, _GEO_RS, _K3_RS = ("seq_sum_k1", "0.5_2.0"), ("seq_mean_k1", "0.999_1.001"), ("seq_mean_k3", 0.01)
_BYPASS_CLIP, _BYPASS_PG = (
    dict(rollout_bypass_mode=True, policy_loss=PPO_CLIP),
    dict(rollout_bypass_mode=True, policy_loss=POLICY_GRADIENT),
)
# verl's presets (the classmethods of RolloutCorrectionConfig, volcengine/verl b178a3c), by name.
PRESETS: Mapping[str, Preset] = MappingProxyType(
    {
        "decoupled_token_is": Preset("token", 2.0),
        "decoupled_seq_is": Preset("sequence", 2.0),
        "decoupled_seq_is_rs": Preset("sequence", 2.0, *_SEQ_RS),
        "decoupled_geo_rs": Preset(None, None, *_GEO_RS),
        "decoupled_geo_rs_seq_tis": Preset("sequence", 2.0, *_GEO_RS),
        "decoupled_geo_rs_token_tis": Preset("token", 2.0, *_GEO_RS),
        "decoupled_k3_rs": Preset(None, None, *_K3_RS),
        "decoupled_k3_rs_seq_tis": Preset("sequence", 2.0, *_K3_RS),
        "decoupled_k3_rs_token_tis": Preset("token", 2.0, *_K3_RS),
        "bypass_ppo_clip": Preset(**_BYPASS_CLIP),
        "bypass_ppo_clip_geo_rs": Preset(None, None, *_GEO_RS, **_BYPASS_CLIP),
        "bypass_ppo_clip_k3_rs": Preset(None, None, *_K3_RS, **_BYPASS_CLIP),
        "bypass_pg_is": Preset("sequence", 2.0, **_BYPASS_PG),
        "bypass_pg_geo_rs": Preset(None, None, *_GEO_RS, **_BYPASS_PG),
        "bypass_pg_geo_rs_seq_tis": Preset("sequence", 2.0, *_GEO_RS, **_BYPASS_PG),
        "bypass_pg_geo_rs_token_tis": Preset("token", 2.0, *_GEO_RS, **_BYPASS_PG),
        "disabled": Preset(),  # verl's: the metrics only, no correction
    }
)


def _conflict(preset: str, name: str, given: Any, wanted: Any) -> ConfigError:
    return ConfigError(
        f"{name}={given!r} conflicts with rollout_correction={preset!r}, which sets {name}={wanted!r}: leave {name} "
        "unset, or drop the preset and set the rollout_* fields yourself."
    )


def _canonical(field: str, value: Any) -> Any:
    """A rollout_rs as its canonical comma-separated criteria (so " seq_mean_k1" equals the preset's); else value."""
    if field != "rollout_rs":
        return value
    try:
        return ",".join(parse_rejection_criteria(value))
    except ValueError:
        return value


@dataclass(frozen=True)
class RolloutCorrectionSettings(SettingsGroup):
    """GRPOConfig's rollout-correction fields (verl's names; `rollout_bypass_mode` is verl's `bypass_mode`). A preset
    (`rollout_correction`) is expanded into the fields when the group is built: a field the config set to another value
    than the preset's is an error; the thresholds are the config's where it set them (verl's preset parameters), else
    the preset's. `rollout_rs` is held as its canonical comma-separated criteria."""

    rollout_correction: str | None = setting(
        None,
        "verl's rollout correction, by preset name (verl's RolloutCorrectionConfig presets): "
        + ", ".join(PRESETS)
        + ". A preset sets rollout_is, rollout_rs, rollout_bypass_mode (and policy_loss 'ppo_clip' or 'gpg' for the "
        "bypass ones) and its thresholds, which rollout_is_threshold / rollout_rs_threshold replace; a field set to "
        "another value than the preset's is an error. 'disabled' logs the mismatch metrics only. Any rollout_* "
        "setting replaces TRL's vllm_importance_sampling_correction. Needs the sampler's log-probs (vLLM, or a "
        "rollout_func returning 'logprobs'). docs/guide/rollout-correction.md says which to pick.",
    )
    rollout_is: str | None = setting(
        None,
        "verl's IS weights for the sampler/trainer mismatch, multiplying the policy term: 'token' "
        "(w = pi_old / pi_rollout per token) or 'sequence' (their product over the sequence), truncated at "
        "rollout_is_threshold. In bypass mode, for policy_loss='gpg' only (verl's REINFORCE). None: no weights.",
        choices=IS_LEVELS,
    )
    rollout_is_threshold: float | None = setting(
        None, "Upper cap of the rollout IS weights (verl's TIS; None: verl's default 2.0)."
    )
    rollout_is_batch_normalize: bool = setting(
        False,
        "Divide the rollout IS weights by their mean over the batch (tokens for 'token', sequences for "
        "'sequence'), after truncation: decoupled over the generation batch of every process, bypass over each "
        "micro-batch of every process (verl's).",
    )
    rollout_rs: str | None = setting(
        None,
        "verl's rejection sampling: comma-separated criteria a token or sequence must all pass, else it "
        "leaves the loss mask: token_k1/k2/k3 (each token), seq_sum_k1/k2/k3, seq_mean_k1/k2/k3 (seq_mean_k1 is "
        "the geometric mean of the ratio), seq_max_k2/k3, with k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r "
        "of r = pi_old / pi_rollout. None: no rejection.",
    )
    rollout_rs_threshold: float | str | None = setting(
        None,
        "Thresholds of rollout_rs, comma-separated, one per criterion or one for all: the k1 criteria "
        "take a ratio range 'lower_upper' (e.g. '0.999_1.001'; one value u means 1/u_u), k2 / k3 an upper bound "
        "(e.g. 0.01).",
    )
    rollout_bypass_mode: bool = setting(
        False,
        "verl's bypass mode: the sampler's log-probs are the old policy (pi_old = pi_rollout), so the "
        "no-grad old-log-prob pass never runs; rejection and IS weights are computed in each micro-batch from "
        "the training forward. policy_loss='ppo_clip' corrects by its ratio pi_theta / pi_rollout; "
        "policy_loss='gpg' (verl's REINFORCE) takes the rollout_is weights.",
    )

    def __post_init__(self) -> None:
        if self.rollout_correction is not None:
            self._expand_preset()
        if self.rollout_is is not None and self.rollout_is not in IS_LEVELS:
            raise not_allowed("rollout_is", self.rollout_is, "None, 'token' or 'sequence' (verl's IS levels)")
        threshold = self.rollout_is_threshold
        if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))):
            raise not_allowed("rollout_is_threshold", threshold, "a number > 0 (the IS weights' upper cap) or None")
        if threshold is not None and not threshold > 0:
            raise not_allowed("rollout_is_threshold", threshold, "> 0 (the IS weights' upper cap) or None")
        if self.rollout_is is None:
            for name, value, unset in (
                ("rollout_is_threshold", threshold, None),
                ("rollout_is_batch_normalize", self.rollout_is_batch_normalize, False),
            ):
                if value != unset:
                    raise ConfigError(f"{name}={value!r} has no effect without rollout_is ('token' or 'sequence').")
        if self.rollout_rs is None:
            if self.rollout_rs_threshold is not None:
                raise ConfigError(
                    f"rollout_rs_threshold={self.rollout_rs_threshold!r} has no effect without rollout_rs (the "
                    "rejection criteria)."
                )
            return
        try:
            criteria = parse_rejection_criteria(self.rollout_rs)
            parse_thresholds(criteria, self.rollout_rs_threshold)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        self._set("rollout_rs", ",".join(criteria))

    def _expand_preset(self) -> None:
        """The fields of the `rollout_correction` preset, where the config left them unset."""
        name = self.rollout_correction
        if name not in PRESETS:
            raise ConfigError(
                f"rollout_correction={name!r} is not one of verl's presets.{did_you_mean(name, PRESETS)} Allowed: "
                f"{', '.join(PRESETS)}, or None."
            )
        preset = PRESETS[name]
        for field_ in ("rollout_is", "rollout_rs"):
            given, wanted = getattr(self, field_), getattr(preset, field_)
            if given is not None and _canonical(field_, given) != wanted:
                raise _conflict(name, field_, given, wanted)
            self._set(field_, wanted)
        if self.rollout_bypass_mode and not preset.rollout_bypass_mode:
            raise _conflict(name, "rollout_bypass_mode", True, False)
        self._set("rollout_bypass_mode", preset.rollout_bypass_mode)
        for field_, part in (("rollout_is_threshold", "rollout_is"), ("rollout_rs_threshold", "rollout_rs")):
            if getattr(preset, part) is None and getattr(self, field_) is not None:
                raise ConfigError(
                    f"{field_}={getattr(self, field_)!r} has nothing to apply to: rollout_correction={name!r} sets "
                    f"{part}=None."
                )
            if getattr(self, field_) is None:
                self._set(field_, getattr(preset, field_))

    def preset_policy_loss(self, policy_loss: str) -> str:
        """The policy loss a config names (`policy_loss`, as given) under this group's preset: a bypass preset's
        where the config left it at its default (ppo_clip), else the config's; another value than the preset's is an
        error."""
        preset = PRESETS[self.rollout_correction] if self.rollout_correction is not None else None
        if preset is None or preset.policy_loss is None:
            return policy_loss
        if policy_loss not in (PPO_CLIP, preset.policy_loss):
            raise _conflict(self.rollout_correction, "policy_loss", policy_loss, preset.policy_loss)
        return preset.policy_loss

    @property
    def active(self) -> bool:
        """Whether grpo_plus's correction replaces TRL's: a preset (even verl's metrics-only "disabled"), IS weights,
        rejection or bypass is set."""
        return (
            self.rollout_correction is not None
            or self.rollout_is is not None
            or self.rollout_rs is not None
            or self.rollout_bypass_mode
        )

    @property
    def bypass(self) -> bool:
        return self.active and bool(self.rollout_bypass_mode)

    @property
    def decoupled(self) -> bool:
        return self.active and not self.rollout_bypass_mode

    @property
    def old_logps_source(self) -> str:
        """Where the old log-probs come from: 'generation' (decoupled: every row, at generation), 'none' (bypass: the
        sampler's are the old ones, no pass runs), 'trl' (no correction of ours: as TRL decides)."""
        return "none" if self.bypass else "generation" if self.decoupled else "trl"

    def in_loss_blocker(self) -> str | None:
        """Why the decoupled correction needs every row of the generation batch before the first micro-batch's loss
        (so on-policy too its old log-probs come from a no-grad pass at generation), or None."""
        if not self.decoupled:
            return None
        if self.rollout_rs is not None:
            return (
                f"rollout_rs={self.rollout_rs!r}: the mask after rejection sets the loss's token count over the whole "
                "generation batch (num_items_in_batch, dapo's N) before the first micro-batch's loss"
            )
        if self.rollout_is is not None and self.rollout_is_batch_normalize:
            return "rollout_is_batch_normalize=True: each weight is divided by the mean over the generation batch"
        return None

    def row_skip_blocker(self) -> str | None:
        """Why the zero-waste pass must compute every row of the training forward, or None."""
        if self.bypass and self.rollout_is is not None and self.rollout_is_batch_normalize:
            return (
                "rollout_is_batch_normalize=True in bypass mode: each row's IS weight is divided by the mean over "
                "every row's, computed from the training forward"
            )
        return None

    def options(self) -> dict[str, Any]:
        """The keyword arguments of `grpo_plus.objective.rollout_correction` (the IS threshold defaulted to verl's)."""
        threshold = DEFAULT_IS_THRESHOLD if self.rollout_is_threshold is None else self.rollout_is_threshold
        return dict(
            rollout_is=self.rollout_is,
            rollout_is_threshold=threshold,
            rollout_is_batch_normalize=self.rollout_is_batch_normalize,
            rollout_rs=self.rollout_rs,
            rollout_rs_threshold=self.rollout_rs_threshold,
        )

    def check_combinations(self, objective: ObjectiveFields, policy_loss: str) -> None:
        """Raise ConfigError where the correction cannot run with TRL's loss (`objective`) or the `policy_loss`."""
        if not self.active:
            return
        if objective.trl_native:
            raise ConfigError(
                f"The rollout correction cannot be combined with loss_type={objective.loss_type!r}: TRL computes that "
                "loss itself and applies only its own vllm_importance_sampling_* correction. Use one of grpo_plus's "
                "loss types with policy_loss='cispo' or 'sapo' instead (the same losses, computed by grpo_plus)."
            )
        if self.bypass and self.rollout_is is not None and policy_loss != POLICY_GRADIENT:
            raise ConfigError(
                f"rollout_is={self.rollout_is!r} with rollout_bypass_mode=True needs policy_loss='gpg' (verl's "
                f"REINFORCE, the weights multiplying -A logp): policy_loss={policy_loss!r} already corrects by its "
                "ratio pi_theta / pi_rollout, and verl applies no IS weights on top of it (they would count the "
                "mismatch twice). Set rollout_is=None, or policy_loss='gpg'."
            )

    def replaces_trl_correction(self, use_vllm: bool, trl_correction: bool, trl_changes: Mapping[str, Any]) -> bool:
        """Whether TRL's own vLLM correction (`vllm_importance_sampling_correction`, on: `trl_correction`) is turned
        off because this one replaces it, under vLLM; a config that also moved TRL's mode or bounds from their
        defaults (`trl_changes`) asked for both: refused."""
        if not (self.active and use_vllm and trl_correction):
            return False
        if trl_changes:
            settings = ", ".join(f"{name}={value!r}" for name, value in trl_changes.items())
            raise ConfigError(
                f"The config sets both TRL's vLLM correction ({settings}) and grpo_plus's rollout correction: choose "
                "one. For TRL's, leave the rollout_* fields unset; for grpo_plus's, leave TRL's at their defaults "
                f"(it is then turned off) or set {TRL_SAMPLER_CORRECTION}=False."
            )
        return True
