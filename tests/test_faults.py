"""Faults: a reward function's error keeps its type; bad datasets and reward outputs are named at once; a crash
checkpoint is the state after the last finished step; damaged or mismatched checkpoints are refused or skipped;
resuming a finished run does not train; no token or local path is written; kill -9 anywhere resumes exactly."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import trl
from datasets import Dataset
from helpers.crashes import Crash, crash_in, same
from helpers.models import saved_model_trainer
from helpers.probes import SCRIPTS, kept_unchanged, logged, max_weight_diff, run_python
from helpers.rewards import digit_reward, half_dead_reward, length_reward
from peft import LoraConfig
from safetensors.torch import load_file
from transformers import TrainerCallback

import grpo_plus
from grpo_plus.run.checkpoints import CheckpointError, checkpoint_problem, last_complete_checkpoint
from grpo_plus.run.validation import DatasetError, RewardFunctionError, RewardOutputError


def build(
    model_dir, output_dir, rewards=(length_reward, digit_reward), package=grpo_plus, peft=None, data=None, **args
):
    """A trainer on the tiny model: 4 steps, checkpoints every 2, unless `args` say otherwise."""
    settings = {"max_steps": 4, "save_strategy": "steps", "save_steps": 2, **args}
    return saved_model_trainer(model_dir, output_dir, rewards, package, dataset=data, peft_config=peft, **settings)


def weights(trainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters() if p.requires_grad}


class StepCounter(TrainerCallback):
    def __init__(self):
        self.steps = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


# ---- a failing reward function keeps its exception type (issue 16.3) ------------------------------------------------


def no_answer_reward(completions, **kwargs):
    raise ValueError("no answer found")


@pytest.mark.parametrize("package", [trl, grpo_plus], ids=["stock_trl", "grpo_plus"])
def test_a_failing_reward_raises_its_own_type_as_stock_trl_does(tiny_model_dir, tmp_path, package):
    trainer = build(tiny_model_dir, tmp_path, rewards=[no_answer_reward], package=package, save_strategy="no")
    try:
        trainer.train()
    except ValueError as error:  # what a script written against stock TRL catches
        caught = error
    assert str(caught) == "no answer found"
    if package is grpo_plus:
        assert isinstance(caught, RewardFunctionError)  # and what a grpo_plus script catches
        (note,) = caught.__notes__
        assert note.startswith("Reward function 'no_answer_reward' raised ValueError, called with 4 completions")
        assert "the first was '" in note and "answer" in note  # the dataset columns it is passed


class ScoringError(Exception):
    def __init__(self, code: int):
        super().__init__(f"scorer failed with code {code}")
        self.code = code


@pytest.mark.parametrize(
    "error",
    [KeyError("answer"), ScoringError(7), OSError(2, "No such file", "scores.db"), ZeroDivisionError("division")],
    ids=lambda e: type(e).__name__,
)
def test_the_raised_error_is_the_original_plus_a_note(error):
    from grpo_plus.run.validation import GuardedReward

    def reward(completions, **kwargs):
        raise error

    with pytest.raises(type(error)) as caught:
        GuardedReward(reward, "reward")(prompts=["p"], completions=["c1", "c2"], answer=[1, 2])
    assert isinstance(caught.value, RewardFunctionError)
    assert str(caught.value) == str(error) and caught.value.args == error.args
    assert getattr(caught.value, "code", None) == getattr(error, "code", None)
    assert caught.value.__traceback__ is not None and "raise error" in "".join(
        __import__("traceback").format_tb(caught.value.__traceback__)
    )
    assert "'c1'" in caught.value.__notes__[-1]


# ---- bad reward outputs and datasets are named when the trainer meets them (issue 18.4, 18.5) ---------------------


def strings_reward(completions, **kwargs):
    return ["good" for _ in completions]


def scalar_reward(completions, **kwargs):
    return 0.5


def none_reward(completions, **kwargs):
    return None


@pytest.mark.parametrize(
    ("reward", "what"),
    [(strings_reward, "item 0 is str 'good'"), (scalar_reward, "it returned float 0.5"), (none_reward, "NoneType")],
)
def test_a_reward_function_returning_the_wrong_thing_is_named(tiny_model_dir, tmp_path, reward, what):
    trainer = build(tiny_model_dir, tmp_path, rewards=[reward], save_strategy="no")
    with pytest.raises(RewardOutputError, match=f"Reward function '{reward.__name__}' must return a list of 4"):
        trainer.train()
    with pytest.raises(RewardOutputError, match=what):
        trainer.train()


def test_accepted_reward_outputs_pass_the_check():
    import numpy as np

    from grpo_plus.run.validation import GuardedReward

    for output in ([1.0, None], [True, 0], np.array([0.5, 1.0]), torch.tensor([0.5, 1.0]), [torch.tensor(1.0), 2]):
        assert GuardedReward(lambda completions, out=output, **kw: out, "r")(completions=["a", "b"]) is output


def test_a_guarded_reward_keeps_the_wrapped_functions_call_contract():
    """A call without completions (TRL's own suite calls its environment reward as `func(environments=[...])`) gets
    exactly its arguments through and the function's own result back; a scoring call is still checked."""
    import inspect

    from grpo_plus.run.validation import GuardedReward

    calls = []

    def environment_reward(environments, **kwargs):
        calls.append((environments, kwargs))
        return [1.0 if env == "scored" else None for env in environments]

    guarded = GuardedReward(environment_reward, "environment_reward")
    assert guarded(environments=["scored", "plain"]) == [1.0, None]
    assert guarded(["scored"]) == [1.0]  # by position, as the function takes it
    assert calls == [(["scored", "plain"], {}), (["scored"], {})]  # nothing added (no prompts=None, completions=None)
    assert inspect.signature(guarded) == inspect.signature(environment_reward)
    with pytest.raises(RewardOutputError, match="must return a list of 1 rewards"):
        guarded(environments=["scored", "plain"], completions=["c"])


def infinite_reward(completions, **kwargs):
    return [float("inf")] * len(completions)


def test_all_infinite_rewards_warn_once_naming_the_function(tiny_model_dir, tmp_path, caplog):
    trainer = build(tiny_model_dir, tmp_path, rewards=[infinite_reward], save_strategy="no", max_steps=2)
    with caplog.at_level(logging.WARNING, logger="grpo_plus.run.validation"):
        trainer.train()
    warnings = [r.getMessage() for r in caplog.records if r.name == "grpo_plus.run.validation"]
    warnings = [message for message in warnings if "infinite_reward" in message]
    assert len(warnings) == 1 and "+-inf for 4 of 4 completions" in warnings[0] and "trains nothing" in warnings[0]
    assert logged(trainer, "loss") == [0.0, 0.0]


@pytest.mark.parametrize(
    ("dataset", "match"),
    [
        (
            Dataset.from_list([{"question": "1+1=", "answer": 2}]),
            r"has no 'prompt' column \(columns: \['question', 'ans",
        ),
        (Dataset.from_list([{"prompt": "1+1="}]).select([]), r"is empty \(0 rows\)"),
    ],
    ids=["no_prompt_column", "empty"],
)
def test_a_dataset_that_cannot_train_fails_when_the_trainer_is_built(tiny_model_dir, tmp_path, dataset, match):
    with pytest.raises(DatasetError, match=f"train_dataset {match}"):
        build(tiny_model_dir, tmp_path, data=dataset)


# ---- crash checkpoints: the state after the last finished step, or nothing (issue 16.4) -----------------------------


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, tmp_path_factory):
    """4 steps, a checkpoint after every one: the weights every resumed run must end at, and step 3's checkpoint."""
    out = tmp_path_factory.mktemp("uninterrupted")
    trainer = build(tiny_model_dir, out, save_steps=1)
    trainer.train()
    with kept_unchanged(out, "the uninterrupted run"):
        yield weights(trainer), out / "checkpoint-3"


@pytest.mark.parametrize("phase", ["generation", "scoring", "scoring_ctrl_c", "training_pass", "optimizer"])
def test_crash_checkpoint_resumes_to_the_uninterrupted_weights(tiny_model_dir, tmp_path, uninterrupted, phase, caplog):
    final_weights, step_3 = uninterrupted
    trainer = build(tiny_model_dir, tmp_path)  # checkpoints at steps 2 and 4
    crash_in(phase, trainer, at_step=3)
    with pytest.raises((Crash, KeyboardInterrupt)), caplog.at_level(logging.WARNING, logger="grpo_plus.run.faults"):
        trainer.train()
    if phase == "optimizer":  # the weights may be half-updated: no checkpoint-3, a message saying why
        assert not (tmp_path / "checkpoint-3").exists()
        assert "step 4's optimizer update" in caplog.text and "no checkpoint was written" in caplog.text
        assert last_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-2")
    else:  # checkpoint-3 is what an uninterrupted run saves after step 3, to the bit
        assert "saved" in caplog.text and "checkpoint-3" in caplog.text
        crash_checkpoint = tmp_path / "checkpoint-3"
        for name in ("rng_state.pth", "optimizer.pt", "scheduler.pt"):
            saved, expected = (torch.load(d / name, weights_only=False) for d in (crash_checkpoint, step_3))
            assert same(saved, expected), name
        assert same(load_file(step_3 / "model.safetensors"), load_file(crash_checkpoint / "model.safetensors"))
    resumed = build(tiny_model_dir, tmp_path)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 4
    assert max_weight_diff(final_weights, weights(resumed)) == 0.0


@pytest.mark.parametrize("sampling", ["dynamic_sampling", "selective_rollout"])
def test_a_crash_checkpoint_holds_the_sampling_state_of_its_step(tiny_model_dir, tmp_path, sampling):
    """Dynamic sampling draws refill prompts from a seeded stream, selective rollout draws prompts by its history; the
    crash comes after the next step drew, and the resumed run must draw what the uninterrupted one drew."""
    settings = {"rewards": [half_dead_reward], sampling: True}
    reference = build(tiny_model_dir, tmp_path / "uninterrupted", save_strategy="no", **settings)
    reference.train()
    if sampling == "dynamic_sampling":
        refills = sum(entry.get("dynamic_sampling/rounds", 1) - 1 for entry in reference.state.log_history)
        assert refills >= 2, "no refill rounds: the test would not see the refill stream"
    crashed = build(tiny_model_dir, tmp_path / "run", **settings)
    crash_in("generation", crashed, at_step=1)  # step 1 made refill draws, steps 2 and 3 make more
    with pytest.raises(Crash):
        crashed.train()
    resumed = build(tiny_model_dir, tmp_path / "run", **settings)
    resumed.train(resume_from_checkpoint=True)
    assert max_weight_diff(weights(reference), weights(resumed)) == 0.0


# ---- resume: damaged checkpoints are skipped, a mismatched adapter is named, a finished run does not train ----------


@pytest.fixture(scope="module")
def lora_run(tiny_model_dir, tmp_path_factory):
    """A 2-step LoRA run (r=4) with checkpoints 1 and 2, and its final weights."""
    out = tmp_path_factory.mktemp("lora-run")
    trainer = build(tiny_model_dir, out, max_steps=2, save_steps=1, peft=LoraConfig(r=4, target_modules="all-linear"))
    trainer.train()
    with kept_unchanged(out, "the LoRA run (tests resume from a copy)"):
        yield out, weights(trainer)


def copy_run(lora_run, tmp_path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(lora_run[0], out)
    return out


def truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (lambda c: truncate(c / "adapter_model.safetensors"), "adapter_model.safetensors is cut short"),
        (lambda c: truncate(c / "optimizer.pt"), "optimizer.pt is cut short or damaged"),
        (lambda c: truncate(c / "grpo_plus_state_0.pt"), "grpo_plus_state_0.pt is cut short or damaged"),
        (lambda c: (c / "selective_rollout_state.json").write_text(""), "selective_rollout_state.json is not valid"),
        (lambda c: (c / "trainer_state.json").unlink(), "trainer_state.json is missing or cut short"),
    ],
    ids=["adapter", "optimizer", "training_state", "legacy_selective_rollout_state", "trainer_state"],
)
def test_a_damaged_checkpoint_is_named_and_resume_falls_back(
    tiny_model_dir, tmp_path, lora_run, damage, problem, caplog
):
    out = copy_run(lora_run, tmp_path)
    damage(out / "checkpoint-2")
    assert problem in checkpoint_problem(out / "checkpoint-2")
    with caplog.at_level(logging.WARNING, logger="grpo_plus.run.checkpoints"):
        assert last_complete_checkpoint(out) == str(out / "checkpoint-1")
    assert f"Skipping checkpoint {out / 'checkpoint-2'}" in caplog.text and problem in caplog.text
    trainer = build(tiny_model_dir, out, max_steps=2, save_steps=1, peft=LoraConfig(r=4, target_modules="all-linear"))
    with pytest.raises(CheckpointError, match=f"Cannot resume from {out / 'checkpoint-2'}: .*{problem}"):
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    counter = StepCounter()
    trainer.add_callback(counter)
    trainer.train(resume_from_checkpoint=True)
    assert counter.steps == [2] and max_weight_diff(lora_run[1], weights(trainer)) == 0.0


def test_no_complete_checkpoint_is_a_clear_error(tiny_model_dir, tmp_path, lora_run):
    out = copy_run(lora_run, tmp_path)
    for checkpoint in out.glob("checkpoint-*"):
        truncate(checkpoint / "optimizer.pt")
    trainer = build(tiny_model_dir, out, max_steps=2)
    with pytest.raises(CheckpointError, match=f"{out} holds no complete checkpoint"):
        trainer.train(resume_from_checkpoint=True)


@pytest.mark.parametrize(
    ("lora", "difference"),
    [
        (LoraConfig(r=8, target_modules="all-linear"), "r: 4 in the checkpoint, 8 in this run"),
        (
            LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
            "target_modules: 14 modules (down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj) in the checkpoint, 2 modules (q_proj, v_proj) in this run",
        ),
    ],
    ids=["lora_r", "target_modules"],
)
def test_a_checkpoint_of_another_adapter_shape_says_what_differs(tiny_model_dir, tmp_path, lora_run, lora, difference):
    trainer = build(tiny_model_dir, copy_run(lora_run, tmp_path), max_steps=4, peft=lora)
    with pytest.raises(CheckpointError, match="holds an adapter with other settings than this run's") as error:
        trainer.train(resume_from_checkpoint=True)
    assert difference in str(error.value)


def test_resuming_a_finished_run_does_not_train(tiny_model_dir, tmp_path, lora_run):
    """A run killed during its final evaluation or push resumes from checkpoint-max_steps: nothing left to train."""
    out = copy_run(lora_run, tmp_path)
    trainer = build(tiny_model_dir, out, max_steps=2, save_steps=1, peft=LoraConfig(r=4, target_modules="all-linear"))
    counter = StepCounter()
    trainer.add_callback(counter)
    result = trainer.train(resume_from_checkpoint=True)
    assert counter.steps == [] and result.global_step == 2 and trainer.state.global_step == 2
    assert max_weight_diff(lora_run[1], weights(trainer)) == 0.0  # the final weights, loaded
    assert not (out / "checkpoint-3").exists()


# ---- no token and no local path in what the trainer writes (issue 18.8) ---------------------------------------------


def test_no_hub_token_or_local_base_model_path_is_written(tiny_model_dir, tmp_path):
    secret = "hf_NotARealTokenButSecret"
    lora = LoraConfig(r=4, target_modules="all-linear")
    trainer = build(tiny_model_dir, tmp_path, max_steps=2, save_steps=1, hub_token=secret, peft=lora)
    trainer.train()
    trainer.save_model(str(tmp_path))
    assert trainer.args.hub_token == secret  # still there for pushing
    written = [path for path in tmp_path.rglob("*") if path.is_file()]
    assert any(path.name == "training_args.bin" for path in written)
    for path in written:
        assert secret.encode() not in path.read_bytes(), path
        assert str(tiny_model_dir).encode() not in path.read_bytes(), path
    for folder in (tmp_path, tmp_path / "checkpoint-1"):
        config = json.loads((folder / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == Path(tiny_model_dir).name


# ---- kill -9 at every phase of a step, then resume (issue 18) ---------------------------------------------------------


@pytest.mark.slow
@pytest.mark.engine  # runs killed in processes and resumed (a minute on this 2-core machine): make test-engines
def test_kill_9_at_every_phase_resumes_to_the_uninterrupted_weights(tiny_model_dir, tmp_path):
    """The recipe, killed (SIGKILL) in each phase of step 3 of 4 (checkpoints after steps 2 and 4), at the last
    checkpoint's save, in the final evaluation and in the push, then rerun with --resume_from_checkpoint true."""
    flags = [
        "--model_name_or_path", tiny_model_dir, "--use_cpu", "true", "--bf16", "false", "--gradient_checkpointing",
        "false", "--max_steps", "4", "--per_device_train_batch_size", "4", "--num_generations", "4",
        "--max_completion_length", "8", "--learning_rate", "0.01", "--report_to", "none", "--lora_r", "4",
        "--lora_alpha", "8", "--lora_target_modules", "all-linear", "--task_eval_size", "8", "--eval_max_new_tokens",
        "4", "--save_strategy", "steps", "--save_steps", "2", "--disable_tqdm", "true", "--reward_funcs",
        "helpers.rewards:length_reward", "helpers.rewards:digit_reward", "--push_to_hub", "true", "--hub_model_id", "x",
    ]  # fmt: skip
    result = run_python(SCRIPTS / "kill_recipe.py", "--out", tmp_path, "--", *flags, timeout=600)
    runs = {
        r["phase"]: r for r in map(json.loads, (line for line in result.stdout.splitlines() if line.startswith('{"')))
    }
    assert runs.pop("reference")["exit"] == 0
    reference = load_file(tmp_path / "reference" / "adapter_model.safetensors")
    step_2 = load_file(tmp_path / "reference" / "checkpoint-2" / "adapter_model.safetensors")
    assert max_weight_diff(reference, step_2) > 1e-3  # steps 3 and 4 moved the weights: the comparison can fail
    phases = {"generation", "scoring", "training_pass", "optimizer", "checkpoint_save", "final_evaluation", "push"}
    assert set(runs) == phases
    for phase, run in runs.items():
        assert run["killed_exit"] == -9, phase  # SIGKILL
        finished = phase in ("checkpoint_save", "final_evaluation", "push")
        assert run["steps_before_kill"] == ([1, 2, 3, 4] if finished else [1, 2]), phase
        assert run["resumed_exit"] == 0, phase
        # a finished run is not trained again (checkpoint-4 complete); otherwise steps 3 and 4 from checkpoint-2
        assert run["resumed_steps"] == ([] if phase in ("final_evaluation", "push") else [3, 4]), phase
        assert run["pushes_after_resume"] == 1, phase
        resumed = load_file(tmp_path / phase / "adapter_model.safetensors")
        assert max_weight_diff(reference, resumed) == 0.0, phase
