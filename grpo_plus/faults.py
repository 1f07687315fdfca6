"""Crashes and resumes: the checkpoint written when training stops on an error, and what a resume does first.

A crash checkpoint is exactly the state after the last completed optimizer step: weights, optimizer, scheduler and
data position are untouched until the next step's optimizer update, and the random number generators (which the
next step's generation has already advanced) are written as they were when that step ended, from a snapshot taken
then. Resuming from it ends at the uninterrupted run's weights. When the error came during or after an optimizer
update (the weights may be half-updated, the step not yet counted), nothing is written.

`finish_without_training` covers a resume from a checkpoint that is already at max_steps (a run killed during its
final evaluation or push): nothing is left to train, so it loads that checkpoint and returns at once.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import TrainerCallback, TrainerState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, TrainOutput

from .checkpoints import (
    CheckpointError,
    check_adapter_matches,
    checkpoint_step,
    is_complete_checkpoint,
    resolve_checkpoint,
)

logger = logging.getLogger(__name__)
SAMPLING_STATE_FILE = "dynamic_sampling_state.json"  # in the checkpoints of a dynamic-sampling run
# Accelerator RNGs transformers saves with a checkpoint (CUDA, and the other backends it knows).
_DEVICE_RNG_MODULES = ("cuda", "xpu", "npu", "hpu", "mlu", "musa")


def capture_rng_states() -> dict[str, Any]:
    """Every global RNG a checkpoint records: Python, NumPy, torch CPU, each initialized accelerator's devices."""
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    for name in _DEVICE_RNG_MODULES:
        module = getattr(torch, name, None)
        if module is not None and _initialized(module):
            states[name] = module.random.get_rng_state_all()
    return states


def restore_rng_states(states: dict[str, Any]) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.random.set_rng_state(states["cpu"])
    for name in _DEVICE_RNG_MODULES:
        if name in states:
            getattr(torch, name).random.set_rng_state_all(states[name])


def _initialized(module: Any) -> bool:
    is_initialized = getattr(module, "is_initialized", None)
    return (
        callable(is_initialized) and is_initialized() and hasattr(getattr(module, "random", None), "get_rng_state_all")
    )


class CrashCheckpoint(TrainerCallback):
    """Tracks where the current optimizer step stands, so that a crash can be checkpointed exactly (or not at all)."""

    def __init__(self, trainer: Any):
        self.trainer = trainer
        self.step_end: dict[str, Any] | None = None  # what changed since the last step ended, as it was then
        self.updating = False  # between an optimizer update and the end of its step (logged, evaluated, saved)

    def on_train_begin(self, args, state, control, **kwargs):
        self.step_end, self.updating = None, False

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.updating = True

    def step_finished(self) -> None:
        """Called after a step was logged, evaluated and saved: the point a checkpoint of this step describes."""
        selective = self.trainer._selective_rollout
        self.step_end = {
            "rng": capture_rng_states(),
            "selective_rollout": None if selective is None else selective.state_dict(),
            "refill_draws": _refill_draws(self.trainer),
        }
        self.updating = False

    def save(self) -> None:
        """After an error or Ctrl-C inside train(): write checkpoint-N for the last completed step N, if it is
        missing and can be written exactly. Single process only (saving is collective; the others may be stuck)."""
        trainer = self.trainer
        step, args = trainer.state.global_step, trainer.args
        if args.save_strategy == "no" or step == 0 or trainer.accelerator.num_processes > 1 or self.step_end is None:
            return
        if self.updating:
            logger.warning(
                "Training stopped during or right after step %d's optimizer update, before the step was complete: "
                "the weights may be part-way through the update, so no checkpoint was written for it. Resume from "
                "the last checkpoint in %s.",
                step + 1,
                args.output_dir,
            )
            return
        folder = Path(trainer._get_output_dir(trial=None)) / f"{PREFIX_CHECKPOINT_DIR}-{step}"
        if is_complete_checkpoint(folder):
            return
        try:
            self._save_as_at_step_end()
        except Exception:
            logger.exception("Could not save a checkpoint after the error.")
            return
        logger.warning(
            "Training stopped by an error; saved %s: the state after step %d (weights, optimizer, scheduler, random "
            "number generators, data position), so resuming from it (resume_from_checkpoint=True, "
            "--resume_from_checkpoint true in the recipes) continues as the uninterrupted run would have.",
            folder,
            step,
        )

    def _save_as_at_step_end(self) -> None:
        trainer, saved = self.trainer, self.step_end
        crash_rng, crash_refill_draws = capture_rng_states(), _refill_draws(trainer)
        selective = trainer._selective_rollout
        crash_selective = None if selective is None else selective.state_dict()
        restore_rng_states(saved["rng"])
        _set_refill_draws(trainer, saved["refill_draws"])
        if selective is not None:
            selective.load_state_dict(saved["selective_rollout"])
        try:
            trainer._save_checkpoint(trainer.model, trial=None)
        finally:
            restore_rng_states(crash_rng)
            _set_refill_draws(trainer, crash_refill_draws)
            if selective is not None:
                selective.load_state_dict(crash_selective)


def _refill_draws(trainer: Any) -> int:
    sampling = getattr(trainer, "_dynamic_sampling", None)
    return 0 if sampling is None else sampling.refill_draws_made


def _set_refill_draws(trainer: Any, count: int) -> None:
    """Set the count a checkpoint records (the refill stream itself is not touched)."""
    sampling = getattr(trainer, "_dynamic_sampling", None)
    if sampling is not None:
        sampling.refill_draws_made = count


def save_sampling_state(folder: str | Path, refill_draws: int) -> None:
    """How many refill draws dynamic sampling made, so a resumed run draws the same refill prompts next."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f"{SAMPLING_STATE_FILE}.partial"
    partial.write_text(json.dumps({"refill_draws": refill_draws}))
    partial.replace(folder / SAMPLING_STATE_FILE)


def load_sampling_state(checkpoint: str | Path) -> int:
    """The refill draws made before `checkpoint` (0 for a checkpoint of a run without dynamic sampling)."""
    path = Path(checkpoint) / SAMPLING_STATE_FILE
    if not path.is_file():
        return 0
    refill_draws = json.loads(path.read_text()).get("refill_draws")
    if not isinstance(refill_draws, int) or refill_draws < 0:
        raise CheckpointError(f"{path}: refill_draws must be an integer >= 0, found {refill_draws!r}.")
    return refill_draws


def prepare_resume(trainer: Any, resume_from_checkpoint: str | bool | None) -> str | None:
    """The checkpoint to resume from (checked: undamaged, same adapter shape), or None; says when the resumed run
    cannot end exactly where the uninterrupted one would have."""
    checkpoint = resolve_checkpoint(resume_from_checkpoint, trainer.args.output_dir)
    if checkpoint is None:
        return None
    check_adapter_matches(checkpoint, trainer.model)
    args = trainer.args
    generate_every = args.steps_per_generation * trainer.num_iterations
    if (checkpoint_step(checkpoint) * args.gradient_accumulation_steps) % generate_every:
        logger.warning(
            "Resuming from %s, which falls inside a generation batch (steps_per_generation=%d, num_iterations=%d, "
            "gradient_accumulation_steps=%d): TRL generates a new batch on resume instead of the rest of the old "
            "one, so the resumed run will not end at the weights an uninterrupted run would have reached.",
            checkpoint,
            args.steps_per_generation,
            trainer.num_iterations,
            args.gradient_accumulation_steps,
        )
    return checkpoint


def finish_without_training(trainer: Any, checkpoint: str) -> TrainOutput | None:
    """If `checkpoint` already reached the run's last step: load it and return train()'s result without training
    (stock TRL would train one more step and overwrite the final weights). None when there is training left."""
    state = TrainerState.load_from_json(str(Path(checkpoint) / "trainer_state.json"))
    args = trainer.args
    if args.max_steps > 0:
        last_step = args.max_steps
    elif state.num_train_epochs == args.num_train_epochs:
        last_step = state.max_steps
    else:
        return None
    if state.global_step < last_step:
        return None
    if trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
        logger.warning(
            "%s is already at the last step (%d), but under DeepSpeed/FSDP the weights are loaded by the training "
            "loop itself: resuming as TRL does, which runs one more step.",
            checkpoint,
            last_step,
        )
        return None
    trainer._load_from_checkpoint(checkpoint)
    trainer.state = state
    logger.warning(
        "%s is already at the last step (global_step=%d, max_steps=%d): nothing left to train. Loaded its weights "
        "and returned from train() without an optimizer step.",
        checkpoint,
        state.global_step,
        last_step,
    )
    losses = [entry["train_loss"] for entry in state.log_history if "train_loss" in entry]
    return TrainOutput(state.global_step, losses[-1] if losses else 0.0, {})
