"""Trajectory-exact resume (issue 27.1): a run saved at any optimizer step and resumed by a fresh trainer ends at the
uninterrupted run's weights and logs, to the bit, and trains on the very completions it would have (float32, CPU).

Each case runs once uninterrupted with a checkpoint after every step, then resumes from every checkpoint. Compared:
the final weights, the whole log history (losses, rewards, every metric but timings), every micro-batch the training
pass saw (completions, masks, log-probs, advantages) and TRL's completions log at every logging step. Stock TRL,
run through the same comparison, diverges inside a generation batch (so the comparison can fail)."""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import trl
from helpers.models import prompt_dataset, tiny_trainer
from helpers.probes import max_weight_diff, record_trained_batches
from helpers.rewards import digit_reward, half_dead_reward, length_reward, odd_prompts_dead_reward
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

import grpo_plus
from grpo_plus.checkpoints import CheckpointError
from grpo_plus.training_state import PROCESS_FILE, SHARED_FILE, stateful_parts

# Wall-clock measurements: the only logged values that may differ between two runs of the same trajectory.
TIMINGS = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss"}
# steps_per_generation = 4 micro-batches per generation batch, 2 per optimizer step: a generation every 2 steps.
BUFFERED = dict(steps_per_generation=4, gradient_accumulation_steps=2)
CASES = {
    "buffered": dict(**BUFFERED, max_steps=4),
    # each generation batch trained on twice: a generation every 4 steps; logging every 2 steps, completions logged
    "num_iterations": dict(**BUFFERED, num_iterations=2, max_steps=5, logging_steps=2, log_completions=True),
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
    return tiny_trainer(
        output_dir,
        list(rewards),
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        tokenizer=AutoTokenizer.from_pretrained(model_dir),
        package=package,
        **settings,
    )


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


def resume_every_step(model_dir, tmp_path, case, uninterrupted, package=grpo_plus) -> dict[int, Run]:
    whole, out = uninterrupted(case, package)
    resumed = {}
    for step in range(1, CASES[case]["max_steps"]):
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
    inside (steps 1 and 3), where TRL starts with an empty buffer and generates a new batch."""
    whole, _ = uninterrupted("buffered", trl)
    resumed = resume_every_step(tiny_model_dir, tmp_path, "buffered", uninterrupted, package=trl)
    assert_same_trajectory(resumed[2], whole, from_step=2)
    for step in (1, 3):
        assert max_weight_diff(whole.weights, resumed[step].weights) > 1e-3, step
        with pytest.raises(AssertionError):
            assert_same_trajectory(resumed[step], whole, from_step=step)


# ---- crash checkpoints --------------------------------------------------------------------------------------------


class Crash(RuntimeError):
    pass


@pytest.mark.parametrize(
    ("phase", "case", "at_step"),
    [("training_pass", "num_iterations", 3), ("generation", "buffered", 2), ("refill_round", "dynamic_sampling", 2)],
    ids=["training_pass_inside_a_batch", "generation_of_the_next_batch", "dynamic_sampling_refill_round"],
)
def test_a_crash_checkpoint_resumes_to_the_uninterrupted_trajectory(
    tiny_model_dir, tmp_path, uninterrupted, phase, case, at_step
):
    """Crashes after `at_step` steps: in the next step's training pass (inside a generation batch, half used, and
    inside a logging window), in its generation of a new batch, or in a dynamic-sampling refill round of it. The
    crash checkpoint holds what the scheduled checkpoint of that step holds, to the bit, and resuming from it is
    the uninterrupted run."""
    whole, scheduled = uninterrupted(case)
    settings = {**CASES[case], "save_strategy": "steps", "save_steps": 100}
    trainer = build(tiny_model_dir, tmp_path / "run", **settings)

    def now() -> bool:
        return trainer.state.global_step == at_step

    if phase == "training_pass":
        compute_loss = trainer._compute_loss

        def crashing_compute_loss(model, inputs):
            loss = compute_loss(model, inputs)
            if now() and trainer._step % 2 == 1:  # the second micro-batch of the step
                loss.register_hook(lambda grad: (_ for _ in ()).throw(Crash("in backward")))
            return loss

        trainer._compute_loss = crashing_compute_loss
    elif phase == "generation":
        generate = trainer.model.generate

        def crashing_generate(*args, **kwargs):
            out = generate(*args, **kwargs)
            if now():
                raise Crash("in generation")
            return out

        trainer.model.generate = crashing_generate
    else:
        draw_refill = trainer._draw_refill_inputs

        def crashing_refill(num_rows):
            rows = draw_refill(num_rows)
            if now():
                raise Crash("in a refill round")
            return rows

        trainer._draw_refill_inputs = crashing_refill
    with pytest.raises(Crash):
        trainer.train()
    crash_checkpoint, scheduled = tmp_path / "run" / f"checkpoint-{at_step}", scheduled / f"checkpoint-{at_step}"
    for name in (SHARED_FILE, PROCESS_FILE.format(0)):
        assert (crash_checkpoint / name).exists() == (scheduled / name).exists(), name
        if (scheduled / name).exists():
            saved, expected = (without_timings(torch.load(d / name, weights_only=True)) for d in (crash_checkpoint, scheduled))
            assert same(saved, expected), name
    resumed = train(tiny_model_dir, tmp_path / "resumed", crash_checkpoint, **CASES[case])
    assert_same_trajectory(resumed, whole, from_step=at_step)


def without_timings(saved: dict) -> dict:
    """A training state file's content less the wall-clock metrics waiting to be logged."""
    window = saved["parts"].get("logging_window")
    if window is not None:
        window["metrics"] = {k: v for k, v in window["metrics"].items() if k not in TIMINGS}
    return saved


def same(a, b) -> bool:
    """Equal to the bit, through nested dicts, lists and tuples of tensors and plain values."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b
