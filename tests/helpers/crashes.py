"""Crashes injected into a training run at a chosen phase of a chosen step, and bit-for-bit comparison of what a
checkpoint holds: what the crash-checkpoint and resume tests use."""

from __future__ import annotations

import torch
from transformers import TrainerCallback

from .rewards import length_reward


class Crash(RuntimeError):
    pass


def crash_in(phase: str, trainer, at_step: int) -> None:
    """Make `trainer` fail in `phase` of the step after `at_step` finished steps:
    - "generation": the completions are sampled (the RNG has moved), not yet scored;
    - "scoring" / "scoring_ctrl_c": in the first reward function (an error / Ctrl-C);
    - "training_pass": in the step's first backward (part of the gradient accumulated; after a generation, the buffer
      already holds the new batch); "second_micro_batch": in its second backward (the micro-step counter has moved);
    - "refill_round": in a dynamic-sampling refill round (the refill stream has moved);
    - "optimizer": after the optimizer update, before the step is counted, logged or saved.
    """

    def now() -> bool:
        return trainer.state.global_step == at_step

    if phase == "generation":
        generate = trainer.model.generate

        def crashing_generate(*args, **kwargs):
            out = generate(*args, **kwargs)
            if now():
                raise Crash("in generation")
            return out

        trainer.model.generate = crashing_generate
    elif phase in ("scoring", "scoring_ctrl_c"):
        error = KeyboardInterrupt if phase == "scoring_ctrl_c" else Crash

        def crashing_reward(completions, **kwargs):
            if now():
                raise error("in scoring")
            return length_reward(completions)

        trainer.reward_funcs[0].func = crashing_reward
    elif phase in ("training_pass", "second_micro_batch"):
        compute_loss, backwards = trainer._compute_loss, []
        crash_at = 0 if phase == "training_pass" else 1

        def crashing_compute_loss(model, inputs):
            loss = compute_loss(model, inputs)
            if now():
                if len(backwards) == crash_at:
                    loss.register_hook(lambda grad: (_ for _ in ()).throw(Crash("in backward")))
                backwards.append(loss)
            return loss

        trainer._compute_loss = crashing_compute_loss
    elif phase == "refill_round":
        refill_rows = trainer._dynamic_sampling.refill_rows

        def crashing_refill(prompts_per_draw):
            rows = refill_rows(prompts_per_draw)
            if now():
                raise Crash("in a refill round")
            return rows

        trainer._dynamic_sampling.refill_rows = crashing_refill
    elif phase == "optimizer":

        class CrashAfterUpdate(TrainerCallback):
            def on_optimizer_step(self, args, state, control, **kwargs):
                if now():
                    raise Crash("after the optimizer update")

        trainer.add_callback(CrashAfterUpdate())
    else:
        raise ValueError(f"unknown phase {phase!r}")


def same(a, b) -> bool:
    """Equal to the bit, through nested dicts, lists and tuples of tensors, arrays and plain values."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if hasattr(a, "shape"):  # numpy's RNG state
        return bool((a == b).all())
    return a == b
