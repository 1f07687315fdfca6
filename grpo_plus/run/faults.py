"""Crashes and resumes: the checkpoint written when training stops on an error, and what a resume does first.

A crash checkpoint is exactly the state after the last completed optimizer step: weights, optimizer, scheduler and
data position are untouched until the next step's optimizer update, and the trainer's stateful parts (random number
generators, generation buffer, sampling state, logging window: grpo_plus.run.state), which the next step has
already advanced, are written as they were when that step ended, from a snapshot taken then. Resuming from it ends
at the uninterrupted run's weights. When the error came during or after an optimizer
update (the weights may be half-updated, the step not yet counted), nothing is written.

`finish_without_training` covers a resume from a checkpoint that is already at max_steps (a run killed during its
final evaluation or push): nothing is left to train, so it loads that checkpoint and returns at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import TrainerCallback, TrainerState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, TrainOutput

from .checkpoints import check_adapter_matches, is_complete_checkpoint, resolve_checkpoint
from .state import StatefulPart, load_state_dicts, state_dicts

logger = logging.getLogger(__name__)


class CrashCheckpoint(TrainerCallback):
    """Tracks where the current optimizer step stands, so that a crash can be checkpointed exactly (or not at all).

    `parts()` are the trainer's stateful parts (grpo_plus.run.state): at the end of every step it takes their
    snapshot; a crash checkpoint puts them back to it while the checkpoint is written, so it holds what a checkpoint
    written at that step's end would have held (random number generators, generation buffer, sampling state, ...)."""

    def __init__(self, trainer: Any, parts: Callable[[], list[StatefulPart]]):
        self.trainer, self.parts = trainer, parts
        self.step_end: dict[str, Any] | None = None  # every part's state when the last step ended
        self.updating = False  # between an optimizer update and the end of its step (logged, evaluated, saved)

    def on_train_begin(self, args, state, control, **kwargs):
        self.step_end, self.updating = None, False

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.updating = True

    def step_finished(self) -> None:
        """Called after a step was logged, evaluated and saved: the point a checkpoint of this step describes."""
        self.step_end = state_dicts(self.parts())
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
            "number generators, data position, generation buffer), so resuming from it (resume_from_checkpoint=True, "
            "--resume_from_checkpoint true in the recipes) continues as the uninterrupted run would have.",
            folder,
            step,
        )

    def _save_as_at_step_end(self) -> None:
        parts = self.parts()
        at_crash = state_dicts(parts)
        load_state_dicts(parts, self.step_end)
        try:
            self.trainer._save_checkpoint(self.trainer.model, trial=None)
        finally:
            load_state_dicts(parts, at_crash)


def prepare_resume(trainer: Any, resume_from_checkpoint: str | bool | None) -> str | None:
    """The checkpoint to resume from (checked: undamaged, same adapter shape), or None."""
    checkpoint = resolve_checkpoint(resume_from_checkpoint, trainer.args.output_dir)
    if checkpoint is None:
        return None
    check_adapter_matches(checkpoint, trainer.model)
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
