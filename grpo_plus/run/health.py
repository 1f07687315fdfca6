"""Training-health guard: says once, in plain words, when a run has stopped learning, and optionally stops it.

It reads only what a GRPO run already logs (TRL's metrics, averaged over each logging window, and transformers'
`loss` and `grad_norm`), through `TrainerCallback.on_log`: no forward pass, no change to any number of the run.
Each check fires at most once per `train()` call, with what it saw, over which steps, why that stops learning and
what to change. With `health_check="stop"` the run instead ends at that step: the step's checkpoint is written by the
trainer's own save (as a scheduled one, when saving is on) and `train()` raises `TrainingHealthError`.

What a window holds: TRL averages each metric over the steps since the last log, leaving out NaN values (a window
whose values are all NaN logs None); `grad_norm` is the last step's. A condition "held for n steps" held in every
logging window covering those steps (a window counts for all of its steps).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .settings import HealthSettings

logger = logging.getLogger(__name__)

# The entropy the guard watches: TRL's `entropy` where the run logs it, else the zero-waste pass's entropy of the
# rows it trained (grpo_plus.algorithms.loss_metrics), each against its own starting value.
ENTROPY_KEYS = ("entropy", "zero_waste/entropy_trained_rows")


@dataclass(frozen=True)
class HealthProblem:
    """One check that fired: which, at which optimizer step, and the message logged."""

    check: str
    step: int
    message: str


class TrainingHealthError(RuntimeError):
    """Raised by `train()` when `health_check="stop"` ended the run; `problems` says what the guard saw."""

    def __init__(self, problems: list[HealthProblem], saved: str | None):
        self.problems = problems
        where = f" The state after step {problems[0].step} was saved in {saved}." if saved else ""
        details = "\n".join(f"- {problem.message}" for problem in problems)
        super().__init__(
            f"Training stopped at step {problems[0].step} by health_check='stop' (health_check='warn' only "
            f"warns).{where}\n{details}"
        )


@dataclass(frozen=True)
class _Reading:
    """One check in one logging window: whether its condition held (None: the window does not tell), the value
    seen, and for the entropy check which key was read."""

    held: bool | None
    value: float | None = None
    key: str = ""


@dataclass
class _Streak:
    """Consecutive logged steps over which a condition held."""

    first_step: int = 0
    steps: int = 0
    readings: list[_Reading] = field(default_factory=list)

    def extend(self, first_step: int, steps: int, reading: _Reading) -> None:
        if self.steps == 0:
            self.first_step = first_step
        self.steps += steps
        self.readings.append(reading)

    @property
    def mean(self) -> float:
        return sum(r.value for r in self.readings) / len(self.readings)

    @property
    def last(self) -> _Reading:
        return self.readings[-1]

    def span(self) -> str:
        last = self.first_step + self.steps - 1
        """Where the condition held, for a message: "at step 7" or "over 5 steps (steps 3-7)"."""
        return f"at step {last}" if self.steps == 1 else f"over {self.steps} steps (steps {self.first_step}-{last})"


def _value(logs: dict[str, Any], key: str) -> float | None:
    value = logs.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


class TrainingHealthGuard(TrainerCallback):
    """Watches every training log of a run (`on_log`) and reports each problem once (see the module docstring)."""

    def __init__(self, settings: HealthSettings):
        self.settings = settings
        self.fired: dict[str, HealthProblem] = {}
        self.stopped: list[HealthProblem] = []  # the problems that ended the run (health_check="stop")
        self.saved: str | None = None  # where the stopping step's checkpoint went
        self._streaks: dict[str, _Streak] = {}
        self._entropy_start: dict[str, tuple[float, str]] = {}  # key -> (first value logged, its steps)
        self._last_step = 0

    # A stateful part (grpo_plus.run.state): a resumed run keeps its streaks, its entropy reference and what
    # it already reported, so it warns (or stops) exactly where the uninterrupted run would have.
    checkpoint_name = "health_guard"
    checkpoint_missing_ok = True  # an older checkpoint: the guard only starts its streaks afresh

    def state_dict(self) -> dict[str, Any]:
        """What the next windows' verdicts depend on: the reported checks, the streaks, the entropy references."""
        return {
            "fired": {check: [p.step, p.message] for check, p in self.fired.items()},
            "streaks": {
                check: [s.first_step, s.steps, [[r.held, r.value, r.key] for r in s.readings]]
                for check, s in self._streaks.items()
            },
            "entropy_start": {key: list(start) for key, start in self._entropy_start.items()},
            "last_step": self._last_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.fired = {check: HealthProblem(check, step, message) for check, (step, message) in state["fired"].items()}
        self._streaks = {
            check: _Streak(first, steps, [_Reading(*reading) for reading in readings])
            for check, (first, steps, readings) in state["streaks"].items()
        }
        self._entropy_start = {key: (value, steps) for key, (value, steps) in state["entropy_start"].items()}
        self._last_step = state["last_step"]
        self._restored = True  # on_train_begin (called after the training state is loaded) keeps it

    def on_train_begin(self, args, state, control, **kwargs):
        self.stopped, self.saved = [], None
        if getattr(self, "_restored", False):
            self._restored = False
            return
        self.fired, self._streaks, self._entropy_start = {}, {}, {}
        self._last_step = state.global_step  # a resumed run's first window starts after its checkpoint

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.settings.check == "off" or not logs or "loss" not in logs:  # evaluation and end-of-training logs
            return
        first_step, steps = self._last_step + 1, state.global_step - self._last_step
        self._last_step = state.global_step
        if steps <= 0:
            return
        new = []
        for check, reading, patience in self._readings(args, logs, first_step, steps):
            streak = self._streaks.setdefault(check, _Streak())
            if reading.held is None:  # the window does not tell: the streak neither grows nor breaks
                continue
            if not reading.held:
                self._streaks[check] = _Streak()
                continue
            streak.extend(first_step, steps, reading)
            if check not in self.fired and streak.steps >= patience:
                message = getattr(self, f"_{check}_message")(streak, args, logs)
                self.fired[check] = HealthProblem(check, state.global_step, message)
                new.append(self.fired[check])
        for problem in new:
            if state.is_world_process_zero:
                logger.warning("Training health (step %d): %s", problem.step, problem.message)
        if new and self.settings.check == "stop" and not self.stopped:
            self.stopped = new
            control.should_training_stop = True
            if args.save_strategy != "no":  # the trainer saves this step's checkpoint right after logging it
                control.should_save = True
                self.saved = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")

    def raise_if_stopped(self) -> None:
        """After `train()` returned: raise TrainingHealthError if the guard ended the run."""
        if self.stopped:
            raise TrainingHealthError(self.stopped, self.saved)

    # ---- the checks -----------------------------------------------------------------------------------------------

    def _readings(self, args, logs: dict[str, Any], first_step: int, steps: int):
        """(check, its reading of this window, how many steps it must hold) for every check that is on."""
        settings, patience = self.settings, self.settings.patience_steps
        zero_std = _value(logs, "frac_reward_zero_std")
        all_dead = None if zero_std is None or settings.zero_std_frac is None else zero_std >= settings.zero_std_frac
        if settings.zero_std_frac is not None:
            yield "zero_variance", _Reading(all_dead, zero_std), patience
        if settings.truncated_frac is not None:
            clipped = _value(logs, "completions/clipped_ratio")
            yield (
                "truncation",
                _Reading(None if clipped is None else clipped >= settings.truncated_frac, clipped),
                patience,
            )
        grad_norm = _value(logs, "grad_norm")
        # A zero gradient while every group is dead is what zero_variance reports (with its causes).
        zero_gradient = None if grad_norm is None or all_dead else grad_norm == 0.0
        yield "zero_gradient", _Reading(zero_gradient, grad_norm), patience
        # Under fp16 the loss scaler skips an overflowing step (and lowers the scale): only a run of them is a problem.
        nonfinite_patience = patience if getattr(args, "fp16", False) else 1
        yield (
            "nonfinite_gradient",
            _Reading(None if grad_norm is None else not _finite(grad_norm), grad_norm),
            nonfinite_patience,
        )
        loss = _value(logs, "loss")
        yield "nonfinite_loss", _Reading(None if loss is None else not _finite(loss), loss), nonfinite_patience
        # TRL logs None for a window whose rewards were all NaN (every reward function returned None).
        reward = _value(logs, "reward")
        yield "rewards_nan", _Reading(None if "reward" not in logs else not _finite(reward), reward), 1
        if settings.entropy_collapse_frac is not None:
            yield "entropy_collapse", self._entropy_reading(logs, first_step, steps), patience

    def _entropy_reading(self, logs: dict[str, Any], first_step: int, steps: int) -> _Reading:
        for key in ENTROPY_KEYS:
            entropy = _value(logs, key)
            if _finite(entropy):
                span = f"steps {first_step}-{first_step + steps - 1}" if steps > 1 else f"step {first_step}"
                start, _ = self._entropy_start.setdefault(key, (entropy, span))
                return _Reading(start > 0 and entropy < self.settings.entropy_collapse_frac * start, entropy, key)
        return _Reading(None)

    # ---- the messages ---------------------------------------------------------------------------------------------

    def _zero_variance_message(self, streak: _Streak, args, logs) -> str:
        if self.settings.zero_std_frac >= 1:
            seen = "every group's rewards were identical"
            effect = "every advantage was 0 and so was the policy gradient: these steps learned nothing"
        else:
            seen = f"at least {self.settings.zero_std_frac:.0%} of groups had identical rewards"
            effect = "most advantages were 0 and the policy gradient came from the few groups left"
        return (
            f"{seen} (frac_reward_zero_std = {streak.mean:.2f}) {streak.span()}; {_reward_summary(logs)}. "
            f"GRPO's advantage is a completion's reward minus its group's mean, so {effect}. Is a reward constant "
            "(a reward function that always returns the same value, or fails to parse and scores 0)? Is the task "
            "too hard (every completion wrong) or too easy (every completion right) for the model? Read some "
            "completions (log_completions=True), fix the reward function, choose prompts the model solves some of "
            "the time, or sample more varied completions (larger num_generations, higher temperature); "
            "dynamic_sampling=True replaces such groups with new prompts."
        )

    def _truncation_message(self, streak: _Streak, args, logs) -> str:
        length = getattr(args, "max_completion_length", None)
        terminated = _value(logs, "completions/mean_terminated_length")
        ended = "none ended" if not terminated else f"those that ended averaged {terminated:.0f} tokens"
        if getattr(args, "mask_truncated_completions", False):
            effect = (
                "With mask_truncated_completions=True they are left out of the loss, so only the few that ended "
                "train (the gradient is small or 0)"
            )
        else:
            effect = (
                "A cut-off completion rarely reaches its answer, so it is scored as a failure whatever it was doing, "
                "and the rewards of a group say little"
            )
        return (
            f"{streak.mean:.0%} of completions were cut off at max_completion_length={length} before they ended "
            f"(completions/clipped_ratio) {streak.span()}; {ended} (completions/mean_terminated_length). "
            f"{effect}. Raise max_completion_length, ask for shorter answers in the prompt, or penalise length "
            "(overlong_buffer_length); mask_truncated_completions=True keeps cut-off completions out of the loss."
        )

    def _zero_gradient_message(self, streak: _Streak, args, logs) -> str:
        return (
            f"the gradient norm was exactly 0 (grad_norm, the last step of each logging window) {streak.span()} "
            "although not every group's rewards were identical: the loss moved no trainable parameter. Check that "
            "the model has trainable parameters the loss reaches (a frozen model, a LoRA adapter on modules the "
            "forward never uses), that not every completion is masked out of the loss (mask_truncated_completions="
            "True with every completion cut off), and that the advantages are not all 0 (scale_rewards, "
            "reward_weights)."
        )

    def _nonfinite_gradient_message(self, streak: _Streak, args, logs) -> str:
        return f"the gradient norm was {streak.last.value} {streak.span()}: " + _NONFINITE_ADVICE

    def _nonfinite_loss_message(self, streak: _Streak, args, logs) -> str:
        return f"the loss was {streak.last.value} {streak.span()}: " + _NONFINITE_ADVICE

    def _rewards_nan_message(self, streak: _Streak, args, logs) -> str:
        return (
            f"no completion could be scored {streak.span()}: every reward function returned None (or NaN) for "
            f"every completion ({_reward_summary(logs)}). An unscorable completion gets advantage 0, so nothing was "
            "learned. A reward function that always fails: check the dataset columns it reads (they arrive as "
            "keyword arguments), the completion format it parses (conversational completions are lists of "
            "messages), and the exceptions it catches."
        )

    def _entropy_collapse_message(self, streak: _Streak, args, logs) -> str:
        key = streak.last.key
        start, start_steps = self._entropy_start[key]
        return (
            f"the mean token entropy ({key}) fell from {start:.3g} ({start_steps}) to {streak.last.value:.3g}, "
            f"below {self.settings.entropy_collapse_frac:.0%} of where it started, and stayed there "
            f"{streak.span()}. The policy now samples nearly the same tokens every time: a group's completions "
            "become alike, their rewards equal, their advantages 0, and exploration and learning stop (entropy "
            "collapse). Raise epsilon_high (clip-higher; DAPO uses 0.28) so unlikely tokens can gain probability, "
            "lower the learning rate, raise the temperature, or add an entropy bonus (entropy_coef)."
        )


_NONFINITE_ADVICE = (
    "the loss or its gradient overflowed. An optimizer step with a non-finite gradient usually writes NaN into the "
    "weights (clipping by max_grad_norm scales every gradient by it), and every later step is lost. Resume from the "
    "last checkpoint with a lower learning_rate; prefer bf16 to fp16 (fp16 overflows), and check that no reward is "
    "inf. (transformers hides a NaN loss from the logged `loss` unless logging_nan_inf_filter=False; the gradient "
    "norm shows it.)"
)


def _reward_summary(logs: dict[str, Any]) -> str:
    """The logged mean reward and each reward function's mean ("None": it scored no completion)."""
    parts = [f"reward {_show(logs.get('reward'))}"]
    for key, value in logs.items():
        if key.startswith("rewards/") and key.endswith("/mean"):
            parts.append(f"{key} {_show(value)}")
    return ", ".join(parts)


def _show(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)
