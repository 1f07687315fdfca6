"""The training-health guard (grpo_plus.run.health): each check fires once, at the step its condition has held for
`health_patience_steps` (at once for non-finite values and unscorable rewards), on scripted log streams and in real
runs; a healthy run hears nothing; the guard never changes a run it only warns about; "stop" saves the step and
raises, and the run resumes from that checkpoint as if it had never stopped."""

from __future__ import annotations

import io
import logging
import math
import types

import pytest
import torch
from helpers.models import make_model, make_tokenizer, tiny_trainer
from helpers.probes import max_weight_diff
from transformers import TrainerCallback, TrainerControl, TrainerState

import grpo_plus
from grpo_plus.algorithms.loss_metrics import TRAINED_ROWS_ENTROPY, append_for_whole_window
from grpo_plus.config import ConfigError, PlusSettings
from grpo_plus.run.checkpoints import is_complete_checkpoint
from grpo_plus.run.health import TrainingHealthError, TrainingHealthGuard
from grpo_plus.run.settings import HealthSettings

HEALTHY = {
    "loss": 0.1,
    "grad_norm": 0.5,
    "reward": 0.4,
    "rewards/correct/mean": 0.4,
    "frac_reward_zero_std": 0.25,
    "completions/clipped_ratio": 0.1,
    "completions/mean_terminated_length": 40.0,
    "entropy": 0.6,
}
ARGS = types.SimpleNamespace(
    output_dir="out", save_strategy="steps", max_completion_length=64, mask_truncated_completions=False, fp16=False
)


def feed(windows, settings: HealthSettings | None = None, args=ARGS, caplog=None):
    """Log `windows` ((step, what differs from HEALTHY) pairs, one per logging window) through a guard as the
    trainer does; returns the guard and its {check: step} of what fired."""
    guard = TrainingHealthGuard(settings or HealthSettings(patience_steps=3))
    state, control = TrainerState(), TrainerControl()
    guard.on_train_begin(args, state, control)
    for step, changes in windows:
        state.global_step = step
        guard.on_log(args, state, control, logs={**HEALTHY, **changes})
    return guard, {check: problem.step for check, problem in guard.fired.items()}


def health_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "grpo_plus.run.health"]


# ---- scripted log streams -------------------------------------------------------------------------------------------

NAN = float("nan")
# check -> (what the logs show from step 4 on, the step it must fire at with patience 3, words its message must hold)
STREAMS = {
    "zero_variance": (dict(frac_reward_zero_std=1.0, grad_norm=0.0, reward=0.0), 6, "steps 4-6"),
    "truncation": ({"completions/clipped_ratio": 0.97}, 6, "max_completion_length=64"),
    "zero_gradient": (dict(grad_norm=0.0), 6, "steps 4-6"),
    "nonfinite_gradient": (dict(grad_norm=NAN), 4, "at step 4"),
    "nonfinite_loss": (dict(loss=math.inf), 4, "at step 4"),
    "rewards_nan": (dict(reward=None), 4, "returned None"),
    "entropy_collapse": (dict(entropy=0.05), 6, "fell from 0.6 (step 1) to 0.05"),
}


@pytest.mark.parametrize("check", STREAMS)
def test_each_check_fires_once_at_the_step_it_should(check, caplog):
    bad, step, words = STREAMS[check]
    windows = [(s, {}) for s in (1, 2, 3)] + [(s, bad) for s in range(4, 13)]
    with caplog.at_level(logging.WARNING, logger="grpo_plus.run.health"):
        guard, fired = feed(windows)
    assert fired == {check: step}  # and no other check (zero variance explains its own zero gradient)
    messages = health_warnings(caplog)
    assert len(messages) == 1 and f"(step {step})" in messages[0] and words in messages[0], messages


def test_nothing_fires_on_a_healthy_stream_nor_on_streaks_shorter_than_the_patience(caplog):
    short = {"frac_reward_zero_std": 1.0, "completions/clipped_ratio": 1.0, "grad_norm": 0.0, "entropy": 0.01}
    windows = [(1, {}), (2, short), (3, short), (4, {}), (5, short), (6, short), (7, {}), (8, {})]
    windows += [(9, {"entropy": 0.061}), (10, {"frac_reward_zero_std": 0.99, "completions/clipped_ratio": 0.89})]
    with caplog.at_level(logging.WARNING, logger="grpo_plus.run.health"):
        _, fired = feed(windows)
    assert fired == {} and health_warnings(caplog) == []


def test_a_window_counts_for_every_step_it_averages():
    """logging_steps=5: the first window already holds 5 steps; with patience 6 the second one completes it."""
    dead = {"frac_reward_zero_std": 1.0}
    assert feed([(5, dead), (10, dead)], HealthSettings(patience_steps=5))[1] == {"zero_variance": 5}
    guard, fired = feed([(5, dead), (10, dead)], HealthSettings(patience_steps=6))
    assert fired == {"zero_variance": 10} and "over 10 steps (steps 1-10)" in guard.fired["zero_variance"].message


def test_a_window_that_does_not_tell_neither_extends_nor_breaks_a_streak():
    """Entropy unknown (None: rows skipped, no trained row) in between: the collapse streak goes on after it."""
    windows = [(1, {}), (2, {"entropy": 0.01}), (3, {"entropy": None}), (4, {"entropy": 0.01}), (5, {"entropy": 0.01})]
    assert feed(windows)[1] == {"entropy_collapse": 5}


def test_entropy_collapse_reads_the_trained_rows_entropy_when_trls_is_not_logged():
    skipped = {"entropy": None}
    windows = [(1, {**skipped, TRAINED_ROWS_ENTROPY: 0.8})] + [
        (s, {**skipped, TRAINED_ROWS_ENTROPY: 0.07}) for s in (2, 3, 4)
    ]
    guard, fired = feed(windows)
    assert fired == {"entropy_collapse": 4} and TRAINED_ROWS_ENTROPY in guard.fired["entropy_collapse"].message


def test_under_fp16_a_nonfinite_gradient_must_persist():
    """The fp16 loss scaler skips an overflowing step and lowers the scale: one inf norm is routine there."""
    windows = [(1, {"grad_norm": math.inf}), (2, {})] + [(s, {"grad_norm": math.inf}) for s in (3, 4, 5)]
    fp16 = types.SimpleNamespace(**{**vars(ARGS), "fp16": True})
    assert feed(windows, args=fp16)[1] == {"nonfinite_gradient": 5}
    assert feed(windows)[1] == {"nonfinite_gradient": 1}


def test_evaluation_and_summary_logs_are_not_read():
    guard, fired = feed([(1, {})])
    state = TrainerState(global_step=2)
    guard.on_log(ARGS, state, TrainerControl(), logs={"eval_loss": NAN, "eval_reward": None})
    guard.on_log(ARGS, state, TrainerControl(), logs={"train_runtime": 1.0, "train_loss": NAN})
    assert guard.fired == {}


def test_thresholds_of_none_turn_checks_off_and_off_turns_all_off():
    dead = {"frac_reward_zero_std": 1.0, "completions/clipped_ratio": 1.0, "entropy": 0.0, "reward": None}
    windows = [(1, {})] + [(s, dead) for s in range(2, 9)]
    none = HealthSettings(patience_steps=3, zero_std_frac=None, truncated_frac=None, entropy_collapse_frac=None)
    assert feed(windows, none)[1] == {"rewards_nan": 2}
    assert feed(windows, HealthSettings(check="off", patience_steps=3))[1] == {}


@pytest.mark.parametrize("save_strategy", ["steps", "no"])
def test_stop_asks_the_trainer_to_save_and_stop_then_raises(save_strategy):
    args = types.SimpleNamespace(**{**vars(ARGS), "save_strategy": save_strategy})
    guard = TrainingHealthGuard(HealthSettings(check="stop", patience_steps=1))
    state, control = TrainerState(global_step=0), TrainerControl()
    guard.on_train_begin(args, state, control)
    state.global_step = 1
    guard.on_log(args, state, control, logs={**HEALTHY, "grad_norm": NAN, "reward": None})
    assert control.should_training_stop and control.should_save == (save_strategy == "steps")
    with pytest.raises(TrainingHealthError, match="stopped at step 1") as raised:
        guard.raise_if_stopped()
    assert [p.check for p in raised.value.problems] == ["nonfinite_gradient", "rewards_nan"]
    assert ("out/checkpoint-1" in str(raised.value)) == (save_strategy == "steps")


@pytest.mark.parametrize("resume_after", [2, 4, 5, 8])
def test_a_guard_resumed_from_its_saved_state_reports_what_the_uninterrupted_one_does(resume_after):
    """The guard is a stateful part: restored mid-streak (or after firing), it fires at the same steps, once."""
    bad = {**STREAMS["zero_variance"][0], "entropy": 0.05}
    windows = [(s, {}) for s in (1, 2, 3)] + [(s, bad) for s in range(4, 11)]
    _, uninterrupted = feed(windows)
    assert uninterrupted == {"zero_variance": 6, "entropy_collapse": 6}
    first, _ = feed(windows[:resume_after])
    saved = first.state_dict()
    torch.save(saved, buffer := io.BytesIO())  # what a checkpoint holds, read back as resume reads it
    buffer.seek(0)
    guard = TrainingHealthGuard(HealthSettings(patience_steps=3))
    guard.load_state_dict(torch.load(buffer, weights_only=True))
    state, control = TrainerState(global_step=resume_after), TrainerControl()
    guard.on_train_begin(ARGS, state, control)
    for step, changes in windows[resume_after:]:
        state.global_step = step
        guard.on_log(ARGS, state, control, logs={**HEALTHY, **changes})
    assert {check: problem.step for check, problem in guard.fired.items()} == uninterrupted


@pytest.mark.parametrize(
    "field, value",
    [("health_check", "loud"), ("health_patience_steps", 0), ("health_zero_std_frac", 0.0),
     ("health_truncated_frac", 1.5), ("health_entropy_collapse_frac", 1.0)],
)  # fmt: skip
def test_bad_settings_fail_at_config_time_naming_the_field(field, value):
    with pytest.raises(ConfigError, match=f"{field}={value!r} is not allowed"):
        grpo_plus.GRPOConfig(output_dir="unused", use_cpu=True, bf16=False, report_to="none", **{field: value})


def test_the_health_fields_are_read_into_their_group():
    args = grpo_plus.GRPOConfig(
        output_dir="unused",
        use_cpu=True,
        bf16=False,
        report_to="none",
        health_check="stop",
        health_truncated_frac=None,
    )
    assert PlusSettings.from_config(args).health == HealthSettings(check="stop", truncated_frac=None)
    assert HealthSettings.from_config(args) == HealthSettings(check="stop", truncated_frac=None)


# ---- real runs ------------------------------------------------------------------------------------------------------

PATIENCE, CONSTANT_FROM = 3, 4  # rewards vary for steps 1-3 and are constant from step 4: zero variance at step 6


def scripted_reward(completions, trainer_state, **kwargs) -> list[float]:
    """0/1 alternating by row (every group informative) until step CONSTANT_FROM, then 1 for everything."""
    if trainer_state.global_step + 1 >= CONSTANT_FROM:
        return [1.0] * len(completions)
    return [float(row % 2) for row in range(len(completions))]


def alternating_reward(completions, **kwargs) -> list[float]:
    return [float(row % 2) for row in range(len(completions))]


def unscorable_reward(completions, **kwargs) -> list[None]:
    return [None] * len(completions)


def ending_model():
    """The tiny model, generating with a third of its vocabulary counted as end of sequence (most completions end
    within 8 tokens, as a healthy run's should) unless a test suppresses them."""
    tokenizer = make_tokenizer()
    model = make_model(tokenizer)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, *range(3, len(tokenizer), 3)]
    return model, tokenizer


def run(tmp_path, reward, *, snapshot_at=None, **settings):
    """Train the ending model; returns (trainer, weights, logs, weights at step `snapshot_at`)."""
    model, tokenizer = ending_model()
    trainer = tiny_trainer(tmp_path, [reward], model=model, tokenizer=tokenizer, **settings)
    snapshot = Snapshot(snapshot_at)
    trainer.add_callback(snapshot)
    try:
        trainer.train()
    finally:
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return trainer, weights, trainer.state.log_history, snapshot.weights


class Snapshot(TrainerCallback):
    def __init__(self, step):
        self.step, self.weights, self.model = step, None, None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.model = model

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.weights = {k: v.detach().clone() for k, v in self.model.state_dict().items()}


def without_times(logs):
    return [{k: v for k, v in entry.items() if "time" not in k and "per_second" not in k} for entry in logs]


@pytest.fixture(scope="module")
def warned_run(tmp_path_factory):
    """The scripted reward over 8 steps with the guard warning (a module fixture: three tests read it)."""
    path = tmp_path_factory.mktemp("warned")
    handler = _Collect()
    logging.getLogger("grpo_plus.run.health").addHandler(handler)
    try:
        trainer, weights, logs, at_stop = run(
            path, scripted_reward, max_steps=8, health_patience_steps=PATIENCE, snapshot_at=6
        )
    finally:
        logging.getLogger("grpo_plus.run.health").removeHandler(handler)
    return trainer, weights, logs, at_stop, handler.messages


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.slow
def test_constant_rewards_warn_once_at_the_step_they_should(warned_run):
    trainer, _, logs, _, messages = warned_run
    zero_std = [entry["frac_reward_zero_std"] for entry in logs if "frac_reward_zero_std" in entry]
    assert zero_std[: CONSTANT_FROM - 1] == [0.0] * (CONSTANT_FROM - 1) and set(zero_std[CONSTANT_FROM - 1 :]) == {1.0}
    assert {check: p.step for check, p in trainer._health.fired.items()} == {"zero_variance": 6}
    assert len(messages) == 1 and "steps 4-6" in messages[0] and "rewards/scripted_reward/mean 1" in messages[0]


@pytest.mark.slow
def test_the_guard_changes_no_number_of_the_run(warned_run, tmp_path):
    _, weights, logs, _, _ = warned_run
    _, off_weights, off_logs, _ = run(tmp_path, scripted_reward, max_steps=8, health_check="off")
    assert all(torch.equal(weights[k], off_weights[k]) for k in weights)
    assert without_times(logs) == without_times(off_logs)


@pytest.mark.slow
def test_stop_saves_the_step_raises_and_resumes_as_if_never_stopped(warned_run, tmp_path):
    _, weights, _, at_step_6, _ = warned_run
    stop = dict(max_steps=8, health_patience_steps=PATIENCE, save_strategy="steps", save_steps=100)
    model, tokenizer = ending_model()
    trainer = tiny_trainer(tmp_path, [scripted_reward], model=model, tokenizer=tokenizer, health_check="stop", **stop)
    with pytest.raises(TrainingHealthError, match="frac_reward_zero_std") as raised:
        trainer.train()
    assert raised.value.problems[0].step == 6 and str(tmp_path / "checkpoint-6") in str(raised.value)
    assert trainer.state.global_step == 6 and max_weight_diff(at_step_6, model.state_dict()) == 0.0
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-6"]
    assert is_complete_checkpoint(tmp_path / "checkpoint-6")
    # Resumed (the user decided to go on), the run ends where the uninterrupted one did.
    model, tokenizer = ending_model()
    trainer = tiny_trainer(tmp_path, [scripted_reward], model=model, tokenizer=tokenizer, **stop)
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-6"))
    assert max_weight_diff(weights, model.state_dict()) == 0.0


@pytest.mark.slow
# Below it TRL ends completions only at the tokenizer's eos token: the tiny model cannot end its completions, so no
# run of it is healthy.
@pytest.mark.floor("generation_config_eos")
def test_a_healthy_run_hears_nothing(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="grpo_plus.run.health"):
        trainer, _, logs, _ = run(tmp_path, alternating_reward, max_steps=6, health_patience_steps=2)
    assert max(entry.get("completions/clipped_ratio", 0) for entry in logs) < 0.9, "the run was not healthy"
    assert trainer._health.fired == {} and health_warnings(caplog) == []


@pytest.mark.slow
@pytest.mark.parametrize("masked", [False, True])
def test_truncated_completions_warn_and_masked_ones_zero_the_gradient(tmp_path, masked, caplog):
    """No completion can end (end-of-sequence and padding suppressed): truncation fires at step 2 (patience 2); with
    mask_truncated_completions every completion leaves the loss, and the zero gradient fires too."""
    model, tokenizer = ending_model()
    ends = [tokenizer.pad_token_id, *model.generation_config.eos_token_id]  # TRL counts a final pad as an end too
    with caplog.at_level(logging.WARNING, logger="grpo_plus.run.health"):
        trainer = tiny_trainer(
            tmp_path, [alternating_reward], model=model, tokenizer=tokenizer, max_steps=3, health_patience_steps=2,
            mask_truncated_completions=masked, generation_kwargs={"suppress_tokens": ends},
        )  # fmt: skip
        trainer.train()
    expected = {"truncation": 2, "zero_gradient": 2} if masked else {"truncation": 2}
    assert {check: p.step for check, p in trainer._health.fired.items()} == expected
    message = trainer._health.fired["truncation"].message
    assert "100% of completions" in message and ("left out of the loss" in message) == masked
    assert len(health_warnings(caplog)) == len(expected)


@pytest.mark.slow
def test_unscorable_rewards_and_a_nan_gradient_are_reported_at_once(tmp_path):
    trainer, _, _, _ = run(tmp_path / "none", unscorable_reward, max_steps=2)
    assert {check: p.step for check, p in trainer._health.fired.items()} == {"rewards_nan": 1}

    model, tokenizer = ending_model()

    def poison(module, args, output):  # the training forward overflows (generation, without gradient, does not)
        if torch.is_grad_enabled():
            output.last_hidden_state.fill_(float("nan"))

    model.model.register_forward_hook(poison)
    trainer = tiny_trainer(
        tmp_path / "nan", [alternating_reward], model=model, tokenizer=tokenizer, max_steps=1,
        logging_nan_inf_filter=False,
    )  # fmt: skip
    trainer.train()
    assert {check: p.step for check, p in trainer._health.fired.items()} == {
        "nonfinite_gradient": 1,
        "nonfinite_loss": 1,
    }


# ---- the entropy metric's logging window ---------------------------------------------------------------------------


def trl_window_mean(values: list[float]) -> float | None:
    """What TRL's `log` writes for a window's values: the mean of those that are not NaN, None if none is left."""
    valid = [v for v in values if not math.isnan(v)]
    return sum(valid) / len(valid) if valid else None


@pytest.mark.parametrize("unknown_at", [0, 1, 2])
def test_one_unknown_micro_batch_leaves_the_whole_window_unknown(unknown_at):
    """A window whose micro-batches are partly unknown (rows skipped) logs None, not the mean of the known ones,
    which is not TRL's number; a window of known values logs their mean, as TRL does."""
    values: list[float] = []
    for index, value in enumerate([0.5, 0.7, 0.9]):
        append_for_whole_window(values, NAN if index == unknown_at else value)
    assert trl_window_mean(values) is None and len(values) == 3
    known: list[float] = []
    for value in [0.5, 0.7, 0.9]:
        append_for_whole_window(known, value)
    assert trl_window_mean(known) == pytest.approx(0.7)
