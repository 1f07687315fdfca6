"""Trajectory-exact resume (issue 27.1): a run saved at any optimizer step and resumed by a fresh trainer ends at the
uninterrupted run's weights and logs, to the bit, and trains on the very completions it would have (float32, CPU).

Each case runs once uninterrupted with a checkpoint after every step, then resumes from every checkpoint. Compared:
the final weights, the whole log history (losses, rewards, every metric but timings), every micro-batch the training
pass saw (completions, masks, log-probs, advantages) and TRL's completions log at every logging step. Stock TRL,
run through the same comparison, diverges inside a generation batch (so the comparison can fail)."""

from __future__ import annotations

import importlib.util
import io
import json
import logging
import shutil
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import trl
from helpers.crashes import Crash, crash_in, same
from helpers.models import prompt_dataset, saved_model_trainer
from helpers.probes import max_weight_diff, record_trained_batches
from helpers.rewards import digit_reward, half_dead_reward, length_reward, odd_prompts_dead_reward, text_of
from transformers import AutoModelForCausalLM, TrainerCallback

import grpo_plus
from grpo_plus.compat.versions import TRLCompatibilityError, check_state_attributes
from grpo_plus.run.checkpoints import CheckpointError
from grpo_plus.run.state import PROCESS_FILE, SHARED_FILE, TrainingState, stateful_parts

ROOT = Path(__file__).resolve().parents[1]

# Wall-clock measurements: the only logged values that may differ between two runs of the same trajectory.
TIMINGS = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss"}
# steps_per_generation = 4 micro-batches per generation batch, 2 per optimizer step: a generation every 2 steps.
BUFFERED = dict(steps_per_generation=4, gradient_accumulation_steps=2)
ADAPTIVE_ENTROPY = dict(entropy_coef=0.01, use_adaptive_entropy=True, entropy_target=10.0)
CASES = {
    "buffered": dict(**BUFFERED, max_steps=4),
    # each generation batch trained on twice: a generation every 4 steps; logging every 2 steps, completions logged;
    # TRL's adaptive entropy bonus (its coefficient moves every step)
    "num_iterations": dict(
        **BUFFERED, num_iterations=2, max_steps=5, logging_steps=2, log_completions=True, **ADAPTIVE_ENTROPY
    ),
    # DAPO dynamic sampling: refill rounds fill each generation batch with informative groups
    "dynamic_sampling": dict(**BUFFERED, max_steps=4, dynamic_sampling=True, rewards=[half_dead_reward]),
    # GRESO selective rollout: prompts seen dead are skipped when drawn again (4 prompts: every batch is a new pass)
    "selective_rollout": dict(
        **BUFFERED, max_steps=4, selective_rollout=True, rewards=[odd_prompts_dead_reward], dataset=prompt_dataset(4)
    ),
}


@dataclass
class Run:
    """What a run ended at, logged and trained on."""

    weights: dict[str, torch.Tensor]
    log_history: list[dict]
    trained: list[tuple[int, dict[str, torch.Tensor]]] = field(default_factory=list)  # (step being trained, batch)
    completions: list[tuple[int, dict]] = field(default_factory=list)  # (step, TRL's completions log) at each log


class CompletionsLog(TrainerCallback):
    """Records TRL's completions log (prompts, completions, rewards, advantages) at every logging step."""

    def __init__(self, trainer, run: Run):
        self.trainer, self.run = trainer, run

    def on_log(self, args, state, control, logs=None, **kwargs):
        completions = {k: list(v) if not isinstance(v, dict) else {n: list(c) for n, c in v.items()}
                       for k, v in self.trainer._logs.items()}  # fmt: skip
        self.run.completions.append((state.global_step, completions))


def build(model_dir, output_dir, package=grpo_plus, rewards=(length_reward, digit_reward), **settings):
    return saved_model_trainer(model_dir, output_dir, rewards, package, **settings)


def train(model_dir, output_dir, resume_from=None, package=grpo_plus, **settings) -> Run:
    trainer = build(model_dir, output_dir, package=package, **settings)
    run = Run({}, [], trained=record_trained_batches(trainer))
    trainer.add_callback(CompletionsLog(trainer, run))
    trainer.train(resume_from_checkpoint=None if resume_from is None else str(resume_from))
    run.weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    run.log_history = [
        {k: v for k, v in entry.items() if k not in TIMINGS}
        for entry in trainer.state.log_history
        if "train_runtime" not in entry
    ]
    return run


def assert_same_trajectory(resumed: Run, whole: Run, from_step: int) -> None:
    """Bit for bit: weights, every log entry, every micro-batch trained after `from_step`, every completions log."""
    assert max_weight_diff(whole.weights, resumed.weights) == 0.0
    assert resumed.log_history == whole.log_history
    expected = [(step, batch) for step, batch in whole.trained if step > from_step]
    assert [step for step, _ in resumed.trained] == [step for step, _ in expected]
    for (step, got), (_, want) in zip(resumed.trained, expected, strict=True):
        assert got.keys() == want.keys(), step
        for key in want:
            assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), (step, key)
    assert resumed.completions == [(step, logs) for step, logs in whole.completions if step > from_step]


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, tmp_path_factory):
    """Each case's uninterrupted run, a checkpoint after every step (computed when a test first asks)."""
    runs = {}

    def get(case: str, package=grpo_plus) -> tuple[Run, Path]:
        key = (case, package.__name__)
        if key not in runs:
            out = tmp_path_factory.mktemp(f"{case}-{package.__name__}")
            settings = {**CASES[case], "save_strategy": "steps", "save_steps": 1}
            runs[key] = train(tiny_model_dir, out, package=package, **settings), out
        return runs[key]

    return get


def resume_every_step(model_dir, tmp_path, case, uninterrupted, package=grpo_plus, steps=None) -> dict[int, Run]:
    whole, out = uninterrupted(case, package)
    resumed = {}
    for step in steps or range(1, CASES[case]["max_steps"]):
        resumed[step] = train(model_dir, tmp_path / f"from-{step}", out / f"checkpoint-{step}", package, **CASES[case])
    return resumed


@pytest.mark.parametrize("case", list(CASES))
def test_resume_at_every_step_continues_the_uninterrupted_run(tiny_model_dir, tmp_path, uninterrupted, case, caplog):
    whole, _ = uninterrupted(case)
    with caplog.at_level(logging.WARNING):
        resumed = resume_every_step(tiny_model_dir, tmp_path, case, uninterrupted)
    for step, run in resumed.items():
        assert_same_trajectory(run, whole, from_step=step)
    assert "falls inside a generation batch" not in caplog.text and "starts afresh" not in caplog.text
    logs = [entry for entry in whole.log_history if "loss" in entry]
    if case == "dynamic_sampling":
        assert max(entry["dynamic_sampling/rounds"] for entry in logs if "dynamic_sampling/rounds" in entry) > 1
    if case == "selective_rollout":
        assert sum(entry.get("selective_rollout/skipped", 0) for entry in logs) > 0, "nothing skipped: vacuous"


def test_stock_trl_diverges_inside_a_generation_batch_and_grpo_plus_does_not(tiny_model_dir, tmp_path, uninterrupted):
    """The same comparison on stock TRL: exact from a checkpoint between generation batches (step 2), not from one
    inside (step 1: 0.13 away; from step 3, 0.019), where TRL starts with an empty buffer and generates a new batch."""
    whole, _ = uninterrupted("buffered", trl)
    resumed = resume_every_step(tiny_model_dir, tmp_path, "buffered", uninterrupted, package=trl, steps=(1, 2))
    assert_same_trajectory(resumed[2], whole, from_step=2)
    assert max_weight_diff(whole.weights, resumed[1].weights) > 1e-2
    with pytest.raises(AssertionError):
        assert_same_trajectory(resumed[1], whole, from_step=1)


# ---- crash checkpoints --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("phase", "case", "at_step"),
    [
        ("second_micro_batch", "num_iterations", 3),
        ("generation", "buffered", 2),
        ("training_pass", "buffered", 2),
        ("refill_round", "dynamic_sampling", 2),
    ],
    ids=["training_pass_inside_a_batch", "generation_of_a_batch", "training_pass_of_a_new_batch", "refill_round"],
)
def test_a_crash_checkpoint_resumes_to_the_uninterrupted_trajectory(
    tiny_model_dir, tmp_path, uninterrupted, phase, case, at_step
):
    """Crashes after `at_step` steps, in the next step: in its second micro-batch's backward (inside a generation
    batch and a logging window: the micro-step counter has moved), in its generation of a new batch (the RNG has
    moved), in its first micro-batch's backward right after that generation (the buffer holds the new batch) or in a
    dynamic-sampling refill round (the refill stream has moved). The crash checkpoint holds what the scheduled
    checkpoint of that step holds, to the bit, and resuming from it is the uninterrupted run."""
    whole, scheduled = uninterrupted(case)
    settings = {**CASES[case], "save_strategy": "steps", "save_steps": 100}
    trainer = build(tiny_model_dir, tmp_path / "run", **settings)

    crash_in(phase, trainer, at_step)
    with pytest.raises(Crash):
        trainer.train()
    crash_checkpoint, scheduled = tmp_path / "run" / f"checkpoint-{at_step}", scheduled / f"checkpoint-{at_step}"
    for name in (SHARED_FILE, PROCESS_FILE.format(0)):
        assert (crash_checkpoint / name).exists() == (scheduled / name).exists(), name
        if (scheduled / name).exists():
            saved, expected = (
                without_timings(torch.load(d / name, weights_only=True)) for d in (crash_checkpoint, scheduled)
            )
            assert same(saved, expected), name
    resumed = train(tiny_model_dir, tmp_path / "resumed", crash_checkpoint, **CASES[case])
    assert_same_trajectory(resumed, whole, from_step=at_step)


def without_timings(saved: dict) -> dict:
    """A training state file's content less the wall-clock metrics waiting to be logged."""
    window = saved["parts"].get("logging_window")
    if window is not None:
        window["metrics"] = {k: v for k, v in window["metrics"].items() if k not in TIMINGS}
    return saved


# ---- the protocol: parts a feature or a user adds, what cannot be saved, old and foreign checkpoints ----------------


class CountingReward:
    """A reward that changes with how often it was called (a curriculum, say): state that shapes the trajectory,
    checkpointed through the stateful-part protocol."""

    checkpoint_name = "counting_reward"

    def __init__(self):
        self.__name__, self.calls = "counting_reward", 0

    def __call__(self, completions, **kwargs):
        self.calls += 1
        return [float(len(text_of(c)) % (self.calls % 3 + 2)) for c in completions]

    def state_dict(self):
        return {"calls": self.calls}

    def load_state_dict(self, state):
        self.calls = state["calls"]


class UncheckpointedCountingReward(CountingReward):
    checkpoint_name = None  # not a stateful part: its state is not saved


def test_a_user_reward_with_the_protocol_is_saved_and_restored(tiny_model_dir, tmp_path):
    whole = train(tiny_model_dir, tmp_path / "whole", rewards=[CountingReward()], max_steps=3, save_strategy="steps",
                  save_steps=1)  # fmt: skip
    checkpoint = tmp_path / "whole" / "checkpoint-1"
    resumed = train(tiny_model_dir, tmp_path / "resumed", checkpoint, rewards=[CountingReward()], max_steps=3)
    assert_same_trajectory(resumed, whole, from_step=1)
    forgotten = train(tiny_model_dir, tmp_path / "forgot", checkpoint, rewards=[UncheckpointedCountingReward()],
                      max_steps=3)  # fmt: skip
    assert max_weight_diff(whole.weights, forgotten.weights) > 1e-3, "the reward's state made no difference"


def test_a_reference_model_that_training_moves_is_restored(tiny_model_dir, tmp_path):
    """sync_ref_model mixes the policy into the reference model every step; TRL does not checkpoint it (stock TRL
    resumed here ends 7.6e-2 away, even between generation batches)."""
    settings = dict(beta=0.1, sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5, max_steps=3)
    whole = train(tiny_model_dir, tmp_path / "whole", save_strategy="steps", save_steps=1, **settings)
    checkpoint = tmp_path / "whole" / "checkpoint-1"
    saved = torch.load(checkpoint / SHARED_FILE, weights_only=True)["parts"]["reference_model"]["weights"]
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
    assert max_weight_diff(saved, initial) > 1e-3, "the reference model did not move: the test would be vacuous"
    resumed = train(tiny_model_dir, tmp_path / "resumed", checkpoint, **settings)
    assert_same_trajectory(resumed, whole, from_step=1)


# beta moves every step toward a target the run's KL is far from (PPO's adaptive KL coefficient, grpo_plus.algorithms.estimators)
ADAPTIVE_KL = dict(beta=0.05, adaptive_kl_target=1e-4, adaptive_kl_horizon=64, kl_estimator="k2", learning_rate=0.5)


def test_the_adaptive_kl_coefficient_is_a_part_and_resumes_exactly(tiny_model_dir, tmp_path, caplog):
    """The moving beta is saved through the stateful-part protocol; a run resumed from checkpoint-1 ends on the
    uninterrupted run's weights, logs (the logged `beta` included) and beta. Without it (the part's state removed
    from the checkpoint) beta restarts from 0.05 and the run ends elsewhere."""
    settings = dict(**ADAPTIVE_KL, max_steps=3)
    whole = train(tiny_model_dir, tmp_path / "whole", save_strategy="steps", save_steps=1, **settings)
    betas = [entry["beta"] for entry in whole.log_history if "beta" in entry]
    assert len(set(betas)) == 3 and 0.05 not in betas, "beta did not move every step: the test would be vacuous"
    checkpoint = tmp_path / "whole" / "checkpoint-1"
    saved = torch.load(checkpoint / SHARED_FILE, weights_only=True)
    assert saved["parts"]["adaptive_kl_controller"]["value"] == betas[0]
    resumed = train(tiny_model_dir, tmp_path / "resumed", checkpoint, **settings)
    assert_same_trajectory(resumed, whole, from_step=1)

    del saved["parts"]["adaptive_kl_controller"]
    torch.save(saved, checkpoint / SHARED_FILE)
    with caplog.at_level(logging.WARNING, logger="grpo_plus.run.state"):
        forgotten = train(tiny_model_dir, tmp_path / "forgot", checkpoint, **settings)
    assert "holds no state for 'adaptive_kl_controller': it starts afresh" in caplog.text
    assert [entry["beta"] for entry in forgotten.log_history if "beta" in entry] != betas[1:]
    assert max_weight_diff(whole.weights, forgotten.weights) > 1e-4, "the coefficient's state made no difference"


def test_two_parts_with_one_name_are_refused_when_the_trainer_is_built(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match=r"share the checkpoint_name \['counting_reward'\]"):
        build(tiny_model_dir, tmp_path, rewards=[CountingReward(), CountingReward()])


class Part:
    def __init__(self, name, state, scope=None):
        self.checkpoint_name, self.state = name, state
        if scope is not None:
            self.checkpoint_scope = scope

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.state = state


def save_parts(folder, parts, num_processes=1):
    TrainingState(lambda: parts, 0, num_processes).save(folder, writes_shared=True, wait_for_everyone=lambda: None)


def restore_parts(folder, parts, num_processes=1):
    TrainingState(lambda: parts, 0, num_processes).restore_from(folder)


def test_a_state_that_cannot_be_saved_is_left_out_saying_so(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="grpo_plus.run.state"):
        save_parts(tmp_path, [Part("ok", {"x": torch.arange(3)}), Part("odd", {"handle": object()})])
    assert "Not saving the state of 'odd'" in caplog.text and "odd['handle'] is a object" in caplog.text
    ok, odd = Part("ok", None), Part("odd", None)
    with caplog.at_level(logging.WARNING, logger="grpo_plus.run.state"):
        restore_parts(tmp_path, [ok, odd])
    assert torch.equal(ok.state["x"], torch.arange(3)) and odd.state is None
    assert f"{tmp_path} holds no state for 'odd': it starts afresh" in caplog.text


def test_another_number_of_processes_restores_only_the_shared_state(tmp_path, caplog):
    save_parts(tmp_path, [Part("history", {"n": 1}), Part("buffer", {"rows": 2}, scope="process")], num_processes=2)
    history, buffer = Part("history", None), Part("buffer", None, scope="process")
    with caplog.at_level(logging.WARNING, logger="grpo_plus.run.state"):
        restore_parts(tmp_path, [history, buffer], num_processes=1)
    assert history.state == {"n": 1} and buffer.state is None
    assert "was written by 2 processes; this run has 1, so each process's own state (buffer) is not" in caplog.text


def test_a_state_file_of_another_format_version_is_refused_clearly(tmp_path):
    save_parts(tmp_path, [Part("history", {"n": 1})])
    saved = torch.load(tmp_path / SHARED_FILE, weights_only=True)
    torch.save({**saved, "version": 99}, tmp_path / SHARED_FILE)
    with pytest.raises(CheckpointError, match="training state format version 99; this grpo_plus reads version 1"):
        restore_parts(tmp_path, [Part("history", None)])


def test_a_checkpoint_without_training_state_resumes_as_before_and_says_where_it_cannot_be_exact(
    tiny_model_dir, tmp_path, uninterrupted, caplog
):
    """Checkpoints of stock TRL and of grpo_plus before its training-state files: the dynamic-sampling and
    selective-rollout JSON files are still read; inside a generation batch the resume cannot be exact (no buffer)."""
    _, out = uninterrupted("buffered")
    trainer = build(tiny_model_dir, tmp_path / "run", **CASES["buffered"], dynamic_sampling=True)
    for step in (1, 2):
        old = tmp_path / f"checkpoint-{step}"
        shutil.copytree(out / f"checkpoint-{step}", old)
        for file in old.glob("grpo_plus_state*.pt"):
            file.unlink()
        (old / "dynamic_sampling_state.json").write_text('{"refill_draws": 5}')
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="grpo_plus.run.state"):
            trainer._training_state.restore_from(old)
        assert trainer._dynamic_sampling.refill_draws_made == 5
        assert ("falls inside a generation batch" in caplog.text) == (step == 1), step
        assert "starts afresh" not in caplog.text


def test_a_buffer_of_another_split_is_not_restored_saying_so(tiny_model_dir, tmp_path, uninterrupted, caplog):
    _, out = uninterrupted("buffered")
    trainer = build(tiny_model_dir, tmp_path, steps_per_generation=2, gradient_accumulation_steps=2)
    with caplog.at_level(logging.WARNING, logger="grpo_plus.run.state"):
        trainer._training_state.restore_from(out / "checkpoint-1")
    assert "made with steps_per_generation=4 and 4 micro-steps per batch" in caplog.text
    assert "this run has 2 and 2, so it cannot continue it" in caplog.text
    assert trainer._step == 0 and trainer._buffered_inputs is None


def test_the_buffer_is_saved_bit_for_bit_and_compactly(tiny_model_dir, tmp_path):
    trainer = build(tiny_model_dir, tmp_path, **BUFFERED, max_steps=1, save_strategy="steps", save_steps=1)
    trainer.train()
    saved = torch.load(tmp_path / "checkpoint-1" / PROCESS_FILE.format(0), weights_only=True)
    buffer = saved["parts"]["generation_buffer"]
    assert buffer["step"] == trainer._step == 2
    assert same(buffer["micro_batches"], trainer._buffered_inputs)  # 3 of its 4 micro-batches are still to train
    tensor_bytes = sum(t.numel() * t.element_size() for b in trainer._buffered_inputs for t in b.values()
                       if isinstance(t, torch.Tensor))  # fmt: skip
    part_bytes = len(pickled(buffer))
    assert tensor_bytes < part_bytes < tensor_bytes + 8_000, "more than the buffer's tensors and their headers"


def pickled(value) -> bytes:
    stream = io.BytesIO()
    torch.save(value, stream)
    return stream.getvalue()


# ---- nothing that shapes the trajectory is left out ---------------------------------------------------------------

# What each stateful part covers of the trainer's attributes that change from one step to the next.
COVERED = {
    "generation_buffer": {"_step", "_buffered_inputs"},
    "logging_window": {"_tr_loss", "_globalstep_last_logged", "_total_loss_scalar", "_metrics", "_logs"},
    "adaptive_entropy": {"entropy_coef", "_last_world_entropy", "_entropy_window_stats"},
    "dynamic_sampling": {"_dynamic_sampling"},
    "selective_rollout": {"_selective_rollout"},
    "health_guard": {"_health"},
    "adaptive_kl_controller": {"_kl_coefficient"},
}
# Attributes that change between steps without shaping what comes next, and why.
TRANSIENT = {
    "_rewards_per_func": "the last generation round's rewards, used within that round",
    "_current_train_step_time": "wall-clock time",
    "_crash_checkpoint": "the step-end snapshot itself",
    "_zero_waste": "per-forward position counters and the fallbacks already announced",
}


def fingerprint(value, depth=0, held=frozenset()):
    """A comparable summary of a value: tensors by content, containers element-wise, grpo_plus's own helper objects by
    their attributes, anything else by identity. A helper object the trainer holds as an attribute of its own (`held`:
    their ids) met inside another one (e.g. the micro-batch loss's zero-waste pass), by identity: it is judged as that
    attribute."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), pickled(value.detach().cpu()))
    if isinstance(value, (int, float, str, bool, type(None))):
        return value
    if depth > 5:
        return ("deep", id(value))
    if isinstance(value, (list, tuple, deque)):
        return tuple(fingerprint(item, depth + 1, held) for item in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), fingerprint(v, depth + 1, held)) for k, v in value.items()))
    if type(value).__module__.startswith("grpo_plus") and hasattr(value, "__dict__"):
        if depth and id(value) in held:
            return ("held", id(value))
        attributes = {k: v for k, v in vars(value).items() if k != "trainer"}
        return (type(value).__name__, fingerprint(attributes, depth + 1, held))
    return ("object", id(value))


def test_every_attribute_that_changes_between_steps_is_a_stateful_part_or_transient(tiny_model_dir, tmp_path):
    """A new feature (or TRL release) keeping state on the trainer fails here until it implements the stateful-part
    protocol (or is shown transient): resume cannot forget it."""
    settings = dict(**BUFFERED, max_steps=5, logging_steps=2, dynamic_sampling=True, selective_rollout=True)
    trainer = build(
        tiny_model_dir, tmp_path, rewards=[half_dead_reward], **settings, **ADAPTIVE_ENTROPY, **ADAPTIVE_KL
    )
    snapshots = []

    class Snapshot(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            held = frozenset(id(value) for value in vars(trainer).values())
            snapshots.append({name: fingerprint(value, 0, held) for name, value in vars(trainer).items()})

    trainer.add_callback(Snapshot())
    trainer.train()
    changed = {name for a, b in zip(snapshots, snapshots[1:], strict=False) for name in a if a[name] != b.get(name)}
    parts = {part.checkpoint_name for part in stateful_parts(trainer)}
    covered = set().union(*(COVERED[name] for name in parts if name in COVERED))
    assert changed - covered - set(TRANSIENT) == set()
    assert {
        "_step",
        "_buffered_inputs",
        "_metrics",
        "entropy_coef",
        "_selective_rollout",
        "_kl_coefficient",
    } <= changed


def test_a_trl_without_the_state_grpo_plus_checkpoints_is_named():
    trl_like = SimpleNamespace(_step=0, _metrics={}, _logs={}, use_adaptive_entropy=True, entropy_coef=0.1)
    with pytest.raises(TRLCompatibilityError, match="GRPOTrainer has no _buffered_inputs, _last_world_entropy, _entr"):
        check_state_attributes(trl_like)


def test_the_size_benchmark_smoke_run_reports_what_a_checkpoint_gains(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # it imports benchmarks/harness/, as run from there
    spec = importlib.util.spec_from_file_location("resume_state", ROOT / "benchmarks" / "resume_state.py")
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    monkeypatch.setattr(sys, "argv", ["resume_state.py", "--smoke", "--json", str(tmp_path / "sizes.json")])
    benchmark.main()
    (tiny,) = json.loads((tmp_path / "sizes.json").read_text())
    assert tiny["added_bytes"] == sum(tiny["files"].values()) > sum(tiny["parts"].values())
    assert set(tiny["parts"]) == {"generation_buffer", "logging_window", "rng", "health_guard"}
    assert tiny["buffered_rows"] == 16 and tiny["parts"]["generation_buffer"] > tiny["buffered_tensor_bytes"]
    assert 0 < tiny["added_fraction_of_trl_checkpoint"] < 0.2
