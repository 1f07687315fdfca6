"""kill -9 a recipe run at a chosen phase of its work, then rerun it with --resume_from_checkpoint true.

    python tests/scripts/kill_recipe.py --out DIR --phases generation scoring ... -- <recipes/grpo_lora.py flags>

Imports everything once, then forks one child per run (a fresh recipe process, minus the import time): the reference
run (no kill), and for each phase a run that SIGKILLs itself there (no cleanup, no crash handler: kill -9) and the
resumed run. Each run's output_dir is DIR/<phase>; the Hub is faked (access check passes, a push is recorded). Prints
one JSON line per phase: how the killed run ended, the resumed run's exit status, the optimizer steps it ran, pushes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the recipes load rewards from helpers.rewards

import transformers  # noqa: E402
from torch.optim.optimizer import register_optimizer_step_post_hook  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

import grpo_plus.app.hub  # noqa: E402
from grpo_plus import GRPOTrainer  # noqa: E402

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "grpo_lora.py"
PHASES = ("generation", "scoring", "training_pass", "optimizer", "checkpoint_save", "final_evaluation", "push")


def kill_me() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class Watch(TrainerCallback):
    """Knows whether training has begun and how many steps are done; records the steps this run completes."""

    trainer = None
    training = False

    def __init__(self, log: Path):
        self.log = log

    def on_train_begin(self, args, state, control, **kwargs):
        Watch.training = True

    def on_step_end(self, args, state, control, **kwargs):
        with self.log.open("a") as f:
            f.write(f"{state.global_step}\n")


def install(phase: str | None, kill_step: int, last_step: int, record: Path) -> None:
    """Fake the Hub; make this process SIGKILL itself in `phase` (during step kill_step + 1, or at the end)."""
    grpo_plus.app.hub.check_hub_access = lambda repo_id, token=None: f"alice/{repo_id.split('/')[-1]}"

    def push_adapter(output_dir, repo_id, **kwargs):
        if phase == "push":
            kill_me()
        with (record / "pushes").open("a") as f:
            f.write(json.dumps({"repo_id": repo_id, "private": kwargs.get("private")}) + "\n")
        return f"https://huggingface.co/{repo_id}"

    grpo_plus.app.hub.push_adapter = push_adapter
    init = GRPOTrainer.__init__

    def watched_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        Watch.trainer = self
        self.add_callback(Watch(record / "steps"))

    GRPOTrainer.__init__ = watched_init

    def in_step() -> bool:  # in the step after kill_step, inside train()
        return Watch.training and Watch.trainer.state.global_step == kill_step

    def after_original(cls, name, condition):
        original = getattr(cls, name)

        def wrapped(*args, **kwargs):
            result = original(*args, **kwargs)
            if condition():
                kill_me()
            return result

        setattr(cls, name, wrapped)

    if phase == "generation":  # the completions are sampled, not yet scored
        after_original(transformers.GenerationMixin, "generate", in_step)
    elif phase == "scoring":
        after_original(GRPOTrainer, "_calculate_rewards", in_step)
    elif phase == "training_pass":  # in the middle of backward, some gradients accumulated
        compute_loss = GRPOTrainer._compute_loss

        def killing_compute_loss(self, model, inputs):
            loss = compute_loss(self, model, inputs)
            if in_step():
                loss.register_hook(lambda grad: kill_me())
            return loss

        GRPOTrainer._compute_loss = killing_compute_loss
    elif phase == "optimizer":  # the weights are updated, nothing about the step is saved yet
        register_optimizer_step_post_hook(lambda *a: kill_me() if in_step() else None)
    elif phase == "checkpoint_save":  # the last checkpoint's weights and optimizer are written, trainer_state is not
        after_original(
            transformers.Trainer,
            "_save_optimizer_and_scheduler",
            lambda: Watch.trainer.state.global_step == last_step,
        )


def run(argv: list[str], phase: str | None, kill_step: int, last_step: int, record: Path) -> int:
    """Run the recipe in a forked child; its exit status (negative: the signal that ended it)."""
    record.mkdir(parents=True, exist_ok=True)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            install(phase, kill_step, last_step, record)
            spec = importlib.util.spec_from_file_location("grpo_lora", RECIPE)
            recipe = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(recipe)
            if phase == "final_evaluation":
                evaluate = recipe.evaluate_held_out
                recipe.evaluate_held_out = lambda *a, **k: kill_me() if "after" in a else evaluate(*a, **k)
            recipe.main(argv)
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.is_file() else []


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
    parser.add_argument("--kill_step", type=int, default=2, help="kill during the step after this many steps")
    parser.add_argument("--last_step", type=int, default=4, help="the run's max_steps")
    parser.add_argument("recipe_flags", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    flags = [flag for flag in args.recipe_flags if flag != "--"]

    def recipe_argv(name: str, *extra: str) -> list[str]:
        return [*flags, "--output_dir", str(args.out / name), *extra]

    reference = run(recipe_argv("reference"), None, args.kill_step, args.last_step, args.out / "reference.record")
    print(json.dumps({"phase": "reference", "exit": reference}), flush=True)
    for phase in args.phases:
        record = args.out / f"{phase}.record"
        killed = run(recipe_argv(phase), phase, args.kill_step, args.last_step, record / "killed")
        resumed = run(
            recipe_argv(phase, "--resume_from_checkpoint", "true"),
            None,
            args.kill_step,
            args.last_step,
            record / "resumed",
        )
        result = {
            "phase": phase,
            "killed_exit": killed,
            "steps_before_kill": [int(s) for s in lines(record / "killed" / "steps")],
            "resumed_exit": resumed,
            "resumed_steps": [int(s) for s in lines(record / "resumed" / "steps")],
            "pushes_after_resume": len(lines(record / "resumed" / "pushes")),
        }
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
