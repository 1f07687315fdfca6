"""Held-out accuracy during training: a callback that evaluates a trainer between its optimizer steps, outside their
timing and without touching the random numbers the trainer draws."""

from __future__ import annotations

import os
import time

from transformers import TrainerCallback


class HeldOutEval(TrainerCallback):
    """Greedy held-out accuracy of one trainer before training and every `every` steps (and after the last), against
    the summed step times of its `timer` (harness.timing.StepTimer, in lock-step: it holds the RngStates). Added after
    the timer, so it runs outside the timed step; the random state is put back after each evaluation, so evaluating
    changes nothing the trainer draws. `scorers`: the (correctness, format) reward functions; `label`: the name the
    progress lines print."""

    def __init__(self, name: str, timer, dataset, tokenizer, every: int, scorers: tuple, max_new_tokens: int,
                 label: str | None = None):  # fmt: skip
        self.name, self.timer, self.rng, self.dataset, self.tokenizer = name, timer, timer.rng, dataset, tokenizer
        self.every, self.scorers, self.max_new_tokens, self.points = every, scorers, max_new_tokens, []
        self.label = label or name

    def _evaluate(self, model, step: int) -> None:
        from grpo_plus.app import tasks

        key = f"{self.name}/eval"
        self.rng.save(key)
        start = time.perf_counter()
        correctness, format_reward = self.scorers
        result = tasks.evaluate(
            model, self.tokenizer, self.dataset, max_new_tokens=self.max_new_tokens, progress=False,
            correctness=correctness, format=format_reward,
        )  # fmt: skip
        self.rng.restore(key)
        self.points.append(
            {
                "step": step,
                "train_seconds": sum(self.timer.step),
                "accuracy": result["accuracy"],
                "format_rate": result["format_rate"],
                "eval_seconds": time.perf_counter() - start,
                "load_average": os.getloadavg()[0],  # the machine's 1-minute load (shared machine)
            }
        )
        print(
            f"  {self.label:11s} step {step:3d}  training {sum(self.timer.step) / 60:5.2f} min  "
            f"held-out accuracy {result['accuracy']:.3f}",
            flush=True,
        )

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._evaluate(model, 0)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.every == 0 or state.global_step >= state.max_steps:
            self._evaluate(model, state.global_step)
