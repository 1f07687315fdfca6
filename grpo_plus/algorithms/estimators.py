"""The published algorithms in a GRPOTrainer: which estimator, policy loss and KL estimator a config names (validated
here), the adaptive KL coefficient over training steps (saved in checkpoints), a round's advantages from every
process's rewards (with what the estimator reads besides them), and ReMax's greedy generation.

The formulas are the core's (`grpo_plus.objective`); this module holds what the trainer needs around them, and
`trainer.py` wires it in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from ..objective import (
    ADVANTAGE_ESTIMATORS,
    ADVANTAGE_NORMALIZERS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    AdaptiveKLController,
    PolicyLossOutput,
    combine_rewards,
    compute_advantages,
)
from ..objective.advantages import scale_rewards_problem
from ..objective.loss import policy_loss_options_problem, policy_loss_problem
from ..objective.policy_losses import OPTIONS
from ..settings import ConfigError, not_allowed

# The defaults of GRPOConfig's algorithm fields (one default per setting: config.py uses these).
DEFAULT_ESTIMATOR, DEFAULT_POLICY_LOSS, DEFAULT_KL_ESTIMATOR = "grpo", "ppo_clip", "k3"
DEFAULT_KL_HORIZON = 10000  # PPO's (Ziegler et al. 2019; TRL's old PPOConfig, verl's kl_ctrl.horizon)


@dataclass(frozen=True)
class AlgorithmSettings:
    """The algorithm a config names: estimator, policy loss (with its own options), KL estimator, adaptive KL."""

    advantage_estimator: str = DEFAULT_ESTIMATOR
    policy_loss: str = DEFAULT_POLICY_LOSS
    kl_estimator: str = DEFAULT_KL_ESTIMATOR
    adaptive_kl_target: float | None = None
    adaptive_kl_horizon: int = DEFAULT_KL_HORIZON
    # The policy loss's options, read from the config fields of the same names (a user-registered loss's options that
    # are no config field keep the defaults it declared).
    policy_loss_options: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def from_args(cls, own: Any, args: Any) -> AlgorithmSettings:
        """`own`: grpo_plus's fields (defaults filled in for a plain trl.GRPOConfig); `args`: the config itself, for
        options that are TRL fields (sapo_temperature_pos / _neg)."""
        name = own.policy_loss
        declared = POLICY_LOSSES.entry(name).trait(OPTIONS, {}) if name in POLICY_LOSSES else {}
        options = {name: getattr(own, name, getattr(args, name, option.default)) for name, option in declared.items()}
        return cls(
            advantage_estimator=own.advantage_estimator,
            policy_loss=name,
            kl_estimator=own.kl_estimator,
            adaptive_kl_target=own.adaptive_kl_target,
            adaptive_kl_horizon=own.adaptive_kl_horizon,
            policy_loss_options=MappingProxyType(options),
        )

    @property
    def adaptive_kl(self) -> bool:
        return self.adaptive_kl_target is not None

    def needs(self, estimator_input: str) -> bool:
        """Whether the estimator reads `estimator_input` ("completion_mask", "reward_baselines")."""
        return estimator_input in ADVANTAGE_ESTIMATORS.entry(self.advantage_estimator).requires

    def validate(self, args: Any, trl_native: bool) -> None:
        """Raise ConfigError for a name that is not registered or a combination that cannot run; canonicalize aliases
        on `args` (a plain trl.GRPOConfig has none of these fields: its defaults need no check)."""
        names = {}
        for registry in (ADVANTAGE_ESTIMATORS, POLICY_LOSSES, KL_ESTIMATORS):  # each `field` is one of ours
            names[registry.field] = registry.check(getattr(self, registry.field), error=ConfigError)
            if hasattr(args, registry.field):
                setattr(args, registry.field, names[registry.field])
        estimator, loss, kl = names["advantage_estimator"], names["policy_loss"], names["kl_estimator"]
        self._check_estimator(args, estimator)
        self._check_policy_loss(args, loss, trl_native)
        self._check_kl(args, kl, trl_native)

    def _check_estimator(self, args: Any, estimator: str) -> None:
        scale = (
            ADVANTAGE_NORMALIZERS.resolve(args.scale_rewards) if args.scale_rewards in ADVANTAGE_NORMALIZERS else None
        )
        problem = scale_rewards_problem(estimator, scale) if scale is not None else None
        if problem is not None:
            raise ConfigError(problem)
        if estimator != DEFAULT_ESTIMATOR and args.multi_objective_aggregation == "normalize_then_sum":
            raise ConfigError(
                f"advantage_estimator={estimator!r} cannot be combined with multi_objective_aggregation="
                "'normalize_then_sum': that aggregation is TRL's own GRPO advantage. Use "
                "multi_objective_aggregation='sum_then_normalize'."
            )
        if "reward_baselines" in ADVANTAGE_ESTIMATORS.entry(estimator).requires:
            self._check_greedy_baseline(args, estimator)

    @staticmethod
    def _check_greedy_baseline(args: Any, estimator: str) -> None:
        """ReMax generates one greedy completion per prompt of each process's own rows, through TRL's generation."""
        blockers = {
            "use_vllm=True": getattr(args, "use_vllm", False),
            "use_transformers_paged=True (continuous batching)": getattr(args, "use_transformers_paged", False),
        }
        for setting, active in blockers.items():
            if active:
                raise ConfigError(
                    f"advantage_estimator={estimator!r} cannot be combined with {setting}: its greedy baseline "
                    "generation runs through transformers' generate (the path grpo_plus checks greedy decoding on)."
                )
        eval_generations = getattr(args, "num_generations_eval", None) or args.num_generations
        evaluates = getattr(args.eval_strategy, "value", args.eval_strategy) != "no"
        if evaluates and args.per_device_eval_batch_size % eval_generations:
            raise ConfigError(
                f"advantage_estimator={estimator!r} needs per_device_eval_batch_size ({args.per_device_eval_batch_size}) "
                f"to be a multiple of the evaluation's num_generations ({eval_generations}): each process generates "
                "the greedy baseline for the prompts whose whole groups it holds."
            )
        steps = args.steps_per_generation
        if steps is None and args.generation_batch_size is None:
            steps = args.gradient_accumulation_steps  # TRL's default; else TRL derives it with the process count
        if steps is None:
            return  # checked again when the trainer is built, with the config TRL completed
        local_rows = args.per_device_train_batch_size * steps
        if local_rows % args.num_generations:
            raise ConfigError(
                f"advantage_estimator={estimator!r} needs per_device_train_batch_size * steps_per_generation "
                f"({args.per_device_train_batch_size} * {steps} = {local_rows}) to be a multiple "
                f"of num_generations ({args.num_generations}): each process generates the greedy baseline for the "
                "prompts whose whole groups it holds."
            )

    def _check_policy_loss(self, args: Any, loss: str, trl_native: bool) -> None:
        if trl_native and loss != DEFAULT_POLICY_LOSS:
            raise ConfigError(
                f"policy_loss={loss!r} cannot be combined with loss_type={args.loss_type!r}: TRL computes that loss "
                f"itself. Choose an aggregation grpo_plus computes (e.g. loss_type='dapo'; TRL's loss_type='cispo' is "
                "policy_loss='cispo' with loss_type='dapo', 'sapo' is policy_loss='sapo' with loss_type='grpo')."
            )
        problem = policy_loss_problem(
            loss,
            args.importance_sampling_level,
            {"delta": args.delta, "dual_clip": getattr(args, "dual_clip", None)},
        )
        if problem is not None and not trl_native:
            raise ConfigError(problem)
        problem = policy_loss_options_problem(loss, self.policy_loss_options)
        if problem is not None:
            raise ConfigError(problem)

    def _check_kl(self, args: Any, kl: str, trl_native: bool) -> None:
        if trl_native and (kl != DEFAULT_KL_ESTIMATOR or self.adaptive_kl):
            setting = f"kl_estimator={kl!r}" if kl != DEFAULT_KL_ESTIMATOR else "adaptive_kl_target"
            raise ConfigError(
                f"{setting} cannot be combined with loss_type={args.loss_type!r}: TRL computes that loss (and its k3 "
                "KL term with a fixed beta) itself."
            )
        if not self.adaptive_kl:
            return
        if not self.adaptive_kl_target > 0:
            raise not_allowed("adaptive_kl_target", self.adaptive_kl_target, "> 0 or None (None keeps beta fixed)")
        if self.adaptive_kl_horizon < 1:
            raise not_allowed("adaptive_kl_horizon", self.adaptive_kl_horizon, ">= 1")
        if args.beta <= 0:
            raise ConfigError(
                f"adaptive_kl_target={self.adaptive_kl_target} needs beta > 0 (got beta={args.beta}): beta is the "
                "coefficient the controller starts from and moves by factors, and beta=0 loads no reference model."
            )


# ---- the adaptive KL coefficient over training steps --------------------------------------------------------------


class KLCoefficient:
    """beta for each micro-batch: fixed, or PPO's adaptive controller updated once per optimizer step from the KL
    measured over that step's micro-batches on every process (the logged `kl`: token mean of the KL term)."""

    def __init__(self, beta: float, settings: AlgorithmSettings):
        self.beta = beta
        self.controller = None
        if settings.adaptive_kl:
            self.controller = AdaptiveKLController(beta, settings.adaptive_kl_target, settings.adaptive_kl_horizon)
        self._window: torch.Tensor | None = None  # [KL sum, KL tokens, completions] of this step's micro-batches

    @property
    def value(self) -> float:
        return self.beta if self.controller is None else self.controller.value

    def record(self, out: PolicyLossOutput) -> None:
        """Add one training micro-batch's KL and completions to the step's window."""
        if self.controller is None or out.per_token_kl is None:
            return
        kl_total = out.total(out.per_token_kl)
        stats = torch.cat([kl_total, kl_total.new_tensor([float(out.mask.shape[0])])]).detach()
        self._window = stats if self._window is None else self._window + stats

    def end_step(self, reduce_sum: Callable[[torch.Tensor], torch.Tensor], metrics: dict[str, list]) -> None:
        """After an optimizer step: move beta toward the target from the step's KL over all processes, log it."""
        if self.controller is None or self._window is None:
            return
        kl_sum, kl_tokens, completions = reduce_sum(self._window).tolist()
        self._window = None
        self.controller.update(kl_sum / max(kl_tokens, 1.0), int(completions))
        metrics["beta"].append(self.controller.value)

    # The stateful-part protocol (grpo_plus.run.state): the adaptive coefficient is saved in checkpoints and
    # restored on resume; a fixed beta has no state (checkpoint_name None opts out).
    @property
    def checkpoint_name(self) -> str | None:
        return None if self.controller is None else self.controller.checkpoint_name

    def state_dict(self) -> dict[str, Any]:
        return {} if self.controller is None else self.controller.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._window = None
        if self.controller is not None:
            self.controller.load_state_dict(state)


# ---- the advantages of a round --------------------------------------------------------------------------------------


def local_advantages(
    rewards: torch.Tensor,
    num_generations: int,
    scale_rewards: str,
    estimator: str,
    logged: list,
    rows: slice,
    width: int,
    **estimator_inputs: torch.Tensor,
) -> torch.Tensor:
    """The advantages of every process's completions (from the gathered `rewards`), this process's `rows` of them
    (per-token ones cut or padded to its `width` completion columns: every process pads to its own); `logged` (the
    completions log's advantages) gets every row's, as TRL logs them."""
    advantages = compute_advantages(rewards, num_generations, scale_rewards, estimator=estimator, **estimator_inputs)
    for _ in range(min(len(advantages), len(logged))):
        logged.pop()
    logged.extend((advantages if advantages.dim() == 1 else advantages.mean(dim=1)).tolist())
    local = advantages[rows]
    if local.dim() == 2:
        local = torch.nn.functional.pad(local[:, :width], (0, max(width - local.shape[1], 0)))
    return local


def estimator_inputs(
    settings: AlgorithmSettings,
    output: dict[str, Any],
    gather: Callable[[torch.Tensor], torch.Tensor],
    greedy_rewards: Callable[[], torch.Tensor],
) -> dict[str, torch.Tensor]:
    """What the estimator reads besides the rewards, over every process's completions: their masks (rebuilt from the
    gathered lengths) and ReMax's greedy baselines (`greedy_rewards()`), as it declared (`requires`)."""
    needed = {}
    if settings.needs("completion_mask"):
        lengths = (output["completion_mask"] * output.get("tool_mask", 1)).sum(dim=1)
        needed["completion_mask"] = mask_from_lengths(gather(lengths))
    if settings.needs("reward_baselines"):
        needed["reward_baselines"] = greedy_rewards()
    return needed


def greedy_rewards(
    inputs: list[dict[str, Any]],
    num_generations: int,
    generate: Callable[[list[Any]], tuple[list, list]],
    calculate_rewards: Callable[..., torch.Tensor],
    reward_weights: torch.Tensor,
    metrics: dict[str, list],
    state: Any,
) -> torch.Tensor:
    """ReMax's baseline: the reward of one greedy completion per prompt of this process's groups, generated by
    `generate(prompts)` -> (completion ids, completions) (TRL's own generation with sampling off, zero-waste generation
    included: `compat.model.greedy_completions`) and scored by `calculate_rewards` (TRL's, gathered: every process's
    prompts in order) with `reward_weights`; logged as `remax/greedy_reward`. What generation logs to `metrics` and
    counts in the trainer's `state` is undone: the baseline is no training sample."""
    firsts = first_of_each_group(inputs, num_generations)
    prompts = [row["prompt"] for row in firsts]
    with unlogged(metrics, state):
        completion_ids, completions = generate(prompts)
    rewards = combine_rewards(calculate_rewards(firsts, prompts, completions, completion_ids), reward_weights)
    metrics["remax/greedy_reward"].append(torch.nanmean(rewards).item())
    return rewards


# ---- what the estimators read besides rewards --------------------------------------------------------------------


def mask_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """(N, max length) 0/1 mask with lengths[i] leading ones: the completion masks of every process, rebuilt from their
    gathered lengths (each process pads its completions to its own width)."""
    width = max(int(lengths.max()) if lengths.numel() else 0, 1)
    return (torch.arange(width, device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)).long()


def first_of_each_group(inputs: list[dict[str, Any]], num_generations: int) -> list[dict[str, Any]]:
    """One row per prompt of a process's rows (TRL's sampler repeats each prompt num_generations times in a row)."""
    if len(inputs) % num_generations:
        raise ValueError(
            f"The greedy baseline needs whole groups on each process: {len(inputs)} rows is not a multiple of "
            f"num_generations={num_generations}."
        )
    firsts = inputs[::num_generations]
    for group, first in enumerate(firsts):
        rows = inputs[group * num_generations : (group + 1) * num_generations]
        if any(row["prompt"] != first["prompt"] for row in rows):
            raise ValueError(f"Rows {group * num_generations}..{(group + 1) * num_generations - 1} are not one group.")
    return firsts


@contextmanager
def unlogged(metrics: dict[str, list], state: Any) -> Iterator[None]:
    """Undo what a generation call logs (`metrics`' values) and counts (`state.num_input_tokens_seen`) on exit."""
    saved, tokens_seen = {name: list(values) for name, values in metrics.items()}, state.num_input_tokens_seen
    try:
        yield
    finally:
        metrics.clear()
        metrics.update(saved)
        state.num_input_tokens_seen = tokens_seen
