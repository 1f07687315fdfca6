"""The zero-waste training pass against stock TRL: training-pass time, step time and token positions, one run.

    .venv/bin/python benchmarks/train_pass.py [--steps 12] [--warmup 2] [--repeats 5] [--threads 1]
                                              [--skip-steps] [--skip-sweep] [--json out.json]

Part 1, the demo config (recipes/configs/demo_cpu.yaml): SmolLM2-135M-Instruct (embedded) + LoRA r=16 all-linear,
one-digit sums, 2 prompts x 8 completions of <= 20 tokens per optimizer step, dapo + clip-higher, correctness +
0.5 x format rewards, seed 0. Stock trl.GRPOTrainer and grpo_plus.GRPOTrainer train in one process in lock-step
(TRL's step 1, ours, TRL's step 2, ...; benchmarks/lockstep.py), each with its own random state, so they sample
the same completions and must log the same losses (checked). Per optimizer step, after the warm-up steps:
  step        on_step_begin -> on_step_end: generation, scoring, training pass, optimizer
  train pass  TRL's `step_time` (its training_step) minus `_prepare_inputs` (generation and scoring)
  positions   token positions of the model forwards that carried gradient: the hardware-independent figure
Part 2, the sweep: the training pass alone (`_compute_loss`, forward + backward) on synthetic micro-batches of 4
groups x 8 completions, stock TRL's trainer against grpo_plus's on the same weights, alternated, median of
`--repeats`: the dead-group share (0/25/50/75%, demo lengths) and the prompt/completion length ratio (no dead
group) vary. Completion lengths are ragged (uniform between a quarter of the longest and the longest).
Targets (issue 9): training pass <= 0.5x TRL's time on the demo config, whole step <= 0.75x, identical losses.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SIDES = ("trl", "ours")
DEMO_CONFIG = ROOT / "recipes" / "configs" / "demo_cpu.yaml"


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


def build_trainers(steps: int, baton, rng, settings=None, dataset=None, reward_funcs=None, model_path=None):
    """Stock TRL's and grpo_plus's trainer, each timing its steps and passing the baton: on the demo config unless
    given GRPOConfig `settings`, a `dataset`, `reward_funcs` and a model directory (`model_path`, with its tokenizer)."""
    import torch
    import trl
    from lockstep import StepTimer
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

    import grpo_plus
    from grpo_plus.app import tasks
    from grpo_plus.app.embedded import resolve_model
    from grpo_plus.app.testing import ForwardLog

    path = model_path or resolve_model("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(path)
    dataset = tasks.make_dataset("train", "add-1d", seed=0) if dataset is None else dataset
    settings = demo_settings(steps) if settings is None else settings
    reward_funcs = [tasks.correctness_reward, tasks.format_reward] if reward_funcs is None else reward_funcs
    classes = {"trl": (trl.GRPOConfig, trl.GRPOTrainer), "ours": (grpo_plus.GRPOConfig, grpo_plus.GRPOTrainer)}

    built = {}
    for name in SIDES:
        set_seed(0)  # the LoRA init draws random numbers: the same for both
        config_cls, trainer_cls = classes[name]
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        timer = StepTimer(name, baton, rng)
        trainer = trainer_cls(
            model=model,
            reward_funcs=reward_funcs,
            args=config_cls(**settings),
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"),
            callbacks=[timer],
        )
        built[name] = dict(trainer=trainer, timer=timer, forwards=ForwardLog(trainer.model), prepare=[])
        wrap_timed(trainer, "_prepare_inputs", built[name]["prepare"])
    return built


def wrap_timed(trainer, method: str, seconds: list[float], clock=time.perf_counter) -> None:
    """Record the time of every call of `trainer.<method>` by `clock` (wall time by default; `time.thread_time`: the
    calling thread's CPU time). `_prepare_inputs`: generation and scoring, when a batch is generated."""
    original = getattr(trainer, method)

    def timed(*args, **kwargs):
        start = clock()
        try:
            return original(*args, **kwargs)
        finally:
            seconds.append(clock() - start)

    setattr(trainer, method, timed)


def run_steps(steps: int, warmup: int, settings: dict | None = None, prepare=None) -> dict:
    """Part 1: both trainers in lock-step on the demo config (or its GRPOConfig `settings`); per-step medians, ratios
    and the loss check. `prepare(trainers)` runs after both are built."""
    from lockstep import Baton, RngStates, train_in_lockstep

    baton, rng = Baton(list(SIDES)), RngStates()
    built = build_trainers(steps, baton, rng, settings=settings)
    if prepare is not None:
        prepare({name: built[name]["trainer"] for name in SIDES})
    train_in_lockstep({name: built[name]["trainer"] for name in SIDES}, baton)

    result = {}
    for name in SIDES:
        side = built[name]
        logs = [entry for entry in side["trainer"].state.log_history if "step_time" in entry]
        step_time = [entry["step_time"] for entry in logs]
        train_pass = [total - prepare for total, prepare in zip(step_time, side["prepare"], strict=True)]
        steps_measured = slice(warmup, None)
        result[name] = dict(
            step=statistics.median(side["timer"].step[steps_measured]),
            train_pass=statistics.median(train_pass[steps_measured]),
            generation=statistics.median(side["prepare"][steps_measured]),
            positions=side["forwards"].training_positions / len(logs),
            no_grad_positions=(side["forwards"].positions - side["forwards"].training_positions) / len(logs),
            losses=[entry["loss"] for entry in logs],
            completion_lengths=[entry["completions/mean_length"] for entry in logs],
            dead_groups=statistics.fmean(entry["frac_reward_zero_std"] for entry in logs),
        )
    trl_losses, our_losses = result["trl"]["losses"], result["ours"]["losses"]
    result["max_loss_difference"] = max(abs(a - b) for a, b in zip(trl_losses, our_losses, strict=True))
    result["same_completions"] = result["trl"]["completion_lengths"] == result["ours"]["completion_lengths"]
    result["trainers"] = {name: built[name]["trainer"] for name in SIDES}
    return result


def run_sweep(trainers: dict, repeats: int) -> list[dict]:
    """Part 2: `_compute_loss` forward + backward, TRL vs ours on the same weights, alternated; medians."""
    from shapes import synthetic_micro_batch

    from grpo_plus.app.testing import ForwardLog

    trl_trainer, our_trainer = trainers["trl"], trainers["ours"]
    our_trainer.model.load_state_dict(trl_trainer.model.state_dict())
    for trainer in trainers.values():
        trainer.current_gradient_accumulation_steps = 1
        trainer.model.train()
    forwards = {name: ForwardLog(trainer.model) for name, trainer in trainers.items()}
    tokenizer = our_trainer.processing_class
    cases = [(56, 20, share) for share in (0.0, 0.25, 0.5, 0.75)]
    cases += [(38, 38, 0.0), (19, 57, 0.0), (8, 128, 0.0)]
    rows = []
    for prompt_length, completion_length, dead_share in cases:
        inputs = synthetic_micro_batch(  # 4 groups x 8 rows, ragged completions
            32,
            8,
            prompt_length,
            completion_length,
            len(tokenizer),
            dead_share,
            seed=len(rows),
            ragged=True,
            first_token=10,
        )
        seconds = {name: [] for name in SIDES}
        losses = {}
        for repeat in range(repeats):
            for name in SIDES if repeat % 2 == 0 else SIDES[::-1]:
                trainer = trainers[name]
                forwards[name].clear()
                trainer.model.zero_grad(set_to_none=True)
                start = time.perf_counter()
                loss = trainer._compute_loss(trainer.model, dict(inputs))
                loss.backward()
                seconds[name].append(time.perf_counter() - start)
                losses[name] = loss.item()
        row = dict(
            prompt=prompt_length,
            completion=completion_length,
            dead_share=dead_share,
            **{f"{name}_seconds": statistics.median(seconds[name]) for name in SIDES},
            **{f"{name}_positions": forwards[name].training_positions for name in SIDES},
            loss_difference=abs(losses["trl"] - losses["ours"]),
        )
        row["time_ratio"] = row["ours_seconds"] / row["trl_seconds"]
        row["positions_ratio"] = row["ours_positions"] / row["trl_positions"]
        rows.append(row)
        print(
            f"  P={prompt_length:3d} C<={completion_length:3d} dead {dead_share:4.0%}: TRL {row['trl_seconds']:.3f} s, "
            f"ours {row['ours_seconds']:.3f} s ({row['time_ratio']:.2f}x), positions {row['trl_positions']} -> "
            f"{row['ours_positions']} ({row['positions_ratio']:.2f}x), |loss diff| {row['loss_difference']:.1e}",
            flush=True,
        )
    return rows


def main() -> None:
    from lockstep import lockstep_arguments, start_report, write_report

    json_path = ROOT / "outputs" / "bench-train-pass" / "train_pass.json"
    args = lockstep_arguments(__doc__, steps=12, repeats=5, json_path=json_path).parse_args()

    report, started = start_report(args)
    steps = 1 if args.skip_steps else args.steps
    print(f"Part 1: demo config, {steps} lock-step optimizer steps per trainer ...", flush=True)
    part1 = run_steps(steps, 0 if args.skip_steps else args.warmup)
    trainers = part1.pop("trainers")
    if not args.skip_steps:
        report["demo"] = part1
        trl_side, ours = part1["trl"], part1["ours"]
        print(
            "\n| demo config (median per step) | stock TRL | grpo_plus | ratio |\n|---|---|---|---|\n"
            f"| training pass (s) | {trl_side['train_pass']:.2f} | {ours['train_pass']:.2f} | "
            f"**{ours['train_pass'] / trl_side['train_pass']:.2f}** |\n"
            f"| whole step (s) | {trl_side['step']:.2f} | {ours['step']:.2f} | **{ours['step'] / trl_side['step']:.2f}** |\n"
            f"| generation + scoring (s) | {trl_side['generation']:.2f} | {ours['generation']:.2f} | "
            f"{ours['generation'] / trl_side['generation']:.2f} |\n"
            f"| token positions in the training forward | {trl_side['positions']:.0f} | {ours['positions']:.0f} | "
            f"**{ours['positions'] / trl_side['positions']:.2f}** |\n"
            f"\ndead-group share {trl_side['dead_groups']:.2f}; same completions: {part1['same_completions']}; "
            f"max |loss difference| over {len(trl_side['losses'])} steps: {part1['max_loss_difference']:.2e}",
            flush=True,
        )
    if not args.skip_sweep:
        print(f"\nPart 2: training pass alone, {args.repeats} repeats per case ...", flush=True)
        report["sweep"] = run_sweep(trainers, args.repeats)
        print("\n| prompt | completion (max) | dead groups | TRL (s) | grpo_plus (s) | time ratio | positions ratio |")
        print("|---|---|---|---|---|---|---|")
        for row in report["sweep"]:
            print(
                f"| {row['prompt']} | {row['completion']} | {row['dead_share']:.0%} | {row['trl_seconds']:.3f} | "
                f"{row['ours_seconds']:.3f} | {row['time_ratio']:.2f} | {row['positions_ratio']:.2f} |"
            )
    write_report(report, started, args.json)


if __name__ == "__main__":
    main()
