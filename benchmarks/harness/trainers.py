"""Stock TRL's and grpo_plus's trainers on the same work from the same seed, each timed and counted, and the demo
config run by both in lock-step.

A side is a dict: its `trainer`; its `timer` (harness.timing.StepTimer: each optimizer step, wall and CPU time, and
in lock-step the hand-over); `forwards` (grpo_plus.app.testing.ForwardLog: the token positions of every forward of
its model, with gradient or without); `prepare` (the seconds of each `_prepare_inputs` call: generation and scoring,
when a batch is generated). A benchmark adds what else it records to its sides.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from harness.lockstep import Baton, RngStates, train_in_lockstep
from harness.timing import StepTimer, alternating, wrap_timed

ROOT = Path(__file__).resolve().parents[2]
SIDES = ("trl", "ours")  # stock TRL, grpo_plus; a side named otherwise is a grpo_plus variant
DEMO_CONFIG = ROOT / "recipes" / "configs" / "demo_cpu.yaml"


def package(side: str):
    """The package a side trains with: `trl` for stock TRL's side, `grpo_plus` for every other."""
    import importlib

    return importlib.import_module("trl" if side == "trl" else "grpo_plus")


# The colocated vLLM every benchmark that runs the engine uses (vllm_colocate, vllm_lora_sync, partial_rollouts --vllm).
VLLM_SETTINGS = dict(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3)


def demo_settings(steps: int) -> dict:
    """GRPOConfig fields of the demo config, for a `steps`-step run that saves nothing."""
    import yaml

    from grpo_plus import GRPOConfig

    raw = yaml.safe_load(DEMO_CONFIG.read_text())
    fields = set(GRPOConfig.__dataclass_fields__)
    settings = {key: value for key, value in raw.items() if key in fields}
    settings.update(max_steps=steps, save_strategy="no", logging_steps=1, disable_tqdm=True)
    settings["output_dir"] = str(ROOT / "outputs" / "bench-train-pass")
    return settings


def model_path(smoke: bool, folder, model: str | None = None, **tiny) -> str:
    """The model a benchmark runs: with `smoke`, grpo_plus.app.testing's random tiny model saved into `folder` (the
    numbers then mean nothing: the script runs; `tiny`: its sizes, e.g. hidden_size=128 for vLLM's CPU attention,
    which takes heads of 32 and wider); else `model` (a name or a path), by default the embedded
    SmolLM2-135M-Instruct."""
    if smoke:
        from grpo_plus.app.testing import save_tiny_model

        return str(save_tiny_model(Path(folder) / "tiny", **tiny))
    from grpo_plus.app.embedded import resolve_model

    return resolve_model(model or "smollm2-135m-instruct")


def embedded_model_or_none() -> str | None:
    """The embedded SmolLM2-135M-Instruct's folder, or None, saying why, where the package shipping it is missing
    (the benchmark then skips its cases)."""
    try:
        return model_path(False, None)
    except ImportError as error:
        print(f"SmolLM2-135M-Instruct cases skipped: the embedded model is unavailable ({str(error).splitlines()[0]})")
        return None


def demo_lora():
    """The demo's adapter: LoRA r=16 (alpha 32) on every linear layer, no dropout."""
    from peft import LoraConfig

    return LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")


def build_trainers(make, sides=SIDES, baton=None, rng=None, seed: int = 0) -> dict[str, dict]:
    """One side per name of `sides`: the seed set (model and LoRA initializations draw random numbers: the same for
    every side), then `make(name, package, callbacks)` builds the trainer of that package with those callbacks (its
    StepTimer, which hands `baton` on in lock-step); its forwards counted and its `_prepare_inputs` timed."""
    from transformers import set_seed

    from grpo_plus.app.testing import ForwardLog

    built = {}
    for name in sides:
        set_seed(seed)
        timer = StepTimer(name, baton, rng)
        trainer = make(name, package(name), [timer])
        built[name] = dict(trainer=trainer, timer=timer, forwards=ForwardLog(trainer.model), prepare=[])
        wrap_timed(trainer, "_prepare_inputs", built[name]["prepare"])
    return built


def run_in_lockstep(make, sides=SIDES, prepare=None, seed: int = 0) -> dict[str, dict]:
    """Build the sides (build_trainers) and train them in one process in lock-step (harness.lockstep: the first side's
    step 1, the next side's, ..., then step 2), each with its own random state, so that in float32 they sample the same
    completions and machine load hits them alike; `prepare(built)` runs once all are built; `seed` seeds the building
    and the training. Returns the sides."""
    baton, rng = Baton(list(sides)), RngStates()
    built = build_trainers(make, sides, baton, rng, seed=seed)
    if prepare is not None:
        prepare(built)
    train_in_lockstep({name: side["trainer"] for name, side in built.items()}, baton, seed=seed)
    return built


def demo_trainer(settings: dict, dataset=None, reward_funcs=None, model_dir=None, side_settings=None):
    """A `make` for build_trainers: the demo's run (the embedded SmolLM2-135M-Instruct in float32 + demo_lora(),
    one-digit sums, correctness + format rewards) with GRPOConfig `settings`, unless given a `dataset`, `reward_funcs`
    and a model directory (`model_dir`, with its tokenizer); `side_settings` (side name -> GRPOConfig fields) adds a
    side's own fields to `settings`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_plus.app import tasks

    path = model_dir or model_path(False, None)
    tokenizer = AutoTokenizer.from_pretrained(path)
    dataset = tasks.make_dataset("train", "add-1d", seed=0) if dataset is None else dataset
    reward_funcs = [tasks.correctness_reward, tasks.format_reward] if reward_funcs is None else reward_funcs

    def make(name, package, callbacks):
        return package.GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
            reward_funcs=reward_funcs,
            args=package.GRPOConfig(**settings | (side_settings or {}).get(name, {})),
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=demo_lora(),
            callbacks=callbacks,
        )

    return make


def step_logs(side: dict) -> list[dict]:
    """The trainer's log entries of its optimizer steps (logging_steps=1), in order."""
    return [entry for entry in side["trainer"].state.log_history if "step_time" in entry]


def phase_medians(side: dict, warmup: int) -> dict:
    """Medians per optimizer step after the first `warmup` steps: the whole `step` (its timer), `train_pass` (TRL's
    `step_time`, its training_step, less `_prepare_inputs`) and `generation` (`_prepare_inputs`: generation and
    scoring)."""
    train_pass = [
        entry["step_time"] - prepare for entry, prepare in zip(step_logs(side), side["prepare"], strict=True)
    ]
    measured = slice(warmup, None)
    return dict(
        step=statistics.median(side["timer"].step[measured]),
        train_pass=statistics.median(train_pass[measured]),
        generation=statistics.median(side["prepare"][measured]),
    )


def run_demo_steps(steps: int, warmup: int, settings: dict | None = None, prepare=None) -> dict:
    """Both trainers in lock-step on the demo config (or its GRPOConfig `settings`); per side the phase medians, the
    token positions per step with gradient and without, the losses, completion lengths and dead-group share; the
    largest loss difference and whether the completions had the same lengths; the trainers (`trainers`)."""
    built = run_in_lockstep(demo_trainer(demo_settings(steps) if settings is None else settings), prepare=prepare)
    result = {}
    for name, side in built.items():
        logs, forwards = step_logs(side), side["forwards"]
        result[name] = dict(
            **phase_medians(side, warmup),
            positions=forwards.training_positions / len(logs),
            no_grad_positions=(forwards.positions - forwards.training_positions) / len(logs),
            losses=[entry["loss"] for entry in logs],
            completion_lengths=[entry["completions/mean_length"] for entry in logs],
            dead_groups=statistics.fmean(entry["frac_reward_zero_std"] for entry in logs),
        )
    trl_losses, our_losses = result["trl"]["losses"], result["ours"]["losses"]
    result["max_loss_difference"] = max(abs(a - b) for a, b in zip(trl_losses, our_losses, strict=True))
    result["same_completions"] = result["trl"]["completion_lengths"] == result["ours"]["completion_lengths"]
    result["trainers"] = {name: side["trainer"] for name, side in built.items()}
    return result


def on_the_same_weights(trainers: dict) -> None:
    """Ready trainers (name -> trainer, stock TRL's first) to time their training pass alone: every model given the
    first one's weights, one micro-batch per optimizer step, training mode."""
    first, *others = trainers.values()
    for trainer in others:
        trainer.model.load_state_dict(first.model.state_dict())
    for trainer in trainers.values():
        trainer.current_gradient_accumulation_steps = 1
        trainer.model.train()


def time_training_pass(trainers: dict, inputs: dict, repeats: int, forwards: dict, before=None, after=None) -> dict:
    """The training pass alone (`_compute_loss`, forward + backward) of each trainer (name -> trainer; two names may
    share one) on the micro-batch `inputs`, `repeats` times in alternating order: name -> the seconds of each pass.
    Each pass starts with no gradients and its `forwards` (name -> ForwardLog) cleared; `before(name, trainer)` runs
    before it, `after(name, trainer, loss)` after it."""
    import time

    seconds = {name: [] for name in trainers}
    for _, name in alternating(trainers, repeats):
        trainer = trainers[name]
        if before is not None:
            before(name, trainer)
        forwards[name].clear()
        trainer.model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        loss = trainer._compute_loss(trainer.model, dict(inputs))
        loss.backward()
        seconds[name].append(time.perf_counter() - start)
        if after is not None:
            after(name, trainer, loss)
    return seconds
