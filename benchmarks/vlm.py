"""Vision-language GRPO, zero-waste against stock TRL: training-pass token positions, vision-tower patches, time.

    .venv/bin/python benchmarks/vlm.py [--family qwen2_5_vl] [--image-size 448] [--steps 6] [--warmup 1]
                                       [--threads 1] [--json out.json]

A tiny Qwen2.5-VL built locally (grpo_plus.app.tiny_vlms: random weights, 2 + 2 layers of width 64), 448 x 448
images: 1024 vision patches, 256 image tokens per image, prompts of ~280 tokens. 2 image prompts x G = 8 completions
of <= 32 tokens per optimizer step, float32, plain SGD (equal weights then show equal gradients), reward: distinct
characters (a random model: groups rarely tie; `--half-dead`: every other group's reward is constant). Stock trl.GRPOTrainer and
grpo_plus.GRPOTrainer train in one process in lock-step (benchmarks/lockstep.py: same random numbers, same machine
load within a step), then the weights are compared. Per side, summed over the measured steps:
  positions        token positions of the model forwards that carried gradient (the training pass)
  patches          vision-tower patches, in the training pass (with gradient) and in generation (without)
  train pass (s)   TRL's `step_time` minus `_prepare_inputs` (generation and scoring), median per step
  generation (s)   `_prepare_inputs`, median per step
Targets (issue 35): training-pass positions <= 0.3x stock TRL's, vision-tower work <= 1/G of TRL's, same weights.
"""

from __future__ import annotations

import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIDES = ("trl", "ours")
G = 8


def distinct_characters_reward(completions, **kwargs):
    return [float(len(set(completion[0]["content"]))) for completion in completions]


def half_dead_reward(completions, answer, **kwargs):
    """distinct_characters_reward, but a constant for odd answers: every other group is dead (no learning signal)."""
    scores = distinct_characters_reward(completions)
    return [1.0 if value % 2 else score for score, value in zip(scores, answer, strict=True)]


def build_trainers(args, baton, rng) -> dict:
    import trl
    from lockstep import StepTimer
    from train_pass import wrap_timed
    from transformers import set_seed

    import grpo_plus
    from grpo_plus.app.testing import ForwardLog
    from grpo_plus.app.tiny_vlms import VisionLog, image_dataset, make_vlm

    settings = dict(
        output_dir=str(ROOT / "outputs" / "bench-vlm"), per_device_train_batch_size=2 * G, num_generations=G,
        max_completion_length=32, max_steps=args.steps, learning_rate=0.05, optim="sgd", logging_steps=1,
        save_strategy="no", report_to="none", use_cpu=True, bf16=False, disable_tqdm=True, seed=0, temperature=1.0,
    )  # fmt: skip
    dataset = image_dataset(2 * args.steps, image_size=args.image_size)
    classes = {"trl": (trl.GRPOConfig, trl.GRPOTrainer), "ours": (grpo_plus.GRPOConfig, grpo_plus.GRPOTrainer)}
    built = {}
    for name in SIDES:
        set_seed(0)
        model, processor = make_vlm(args.family, image_size=args.image_size, hidden_size=64)
        config_cls, trainer_cls = classes[name]
        timer = StepTimer(name, baton, rng)
        trainer = trainer_cls(
            model=model, processing_class=processor,
            reward_funcs=half_dead_reward if args.half_dead else distinct_characters_reward,
            args=config_cls(**settings), train_dataset=dataset, callbacks=[timer],
        )  # fmt: skip
        built[name] = dict(
            trainer=trainer,
            timer=timer,
            forwards=ForwardLog(trainer.model),
            vision=VisionLog(trainer.model),
            prepare=[],
        )
        wrap_timed(trainer, "_prepare_inputs", built[name]["prepare"])
    return built


def main() -> None:
    from lockstep import Baton, RngStates, lockstep_arguments, start_report, train_in_lockstep, write_report

    parser = lockstep_arguments(__doc__, steps=6, repeats=1, json_path=ROOT / "outputs" / "bench-vlm" / "vlm.json")
    parser.add_argument("--family", default="qwen2_5_vl")
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--half-dead", action="store_true", help="every other group's reward is constant (dead)")
    parser.set_defaults(warmup=1)
    args = parser.parse_args()
    report, started = start_report(args)
    report.update(
        family=args.family, image_size=args.image_size, group_size=G, steps=args.steps, half_dead=args.half_dead
    )

    baton, rng = Baton(list(SIDES)), RngStates()
    built = build_trainers(args, baton, rng)
    print(f"{args.family}, {args.image_size}px images, {args.steps} lock-step optimizer steps per trainer ...")
    train_in_lockstep({name: built[name]["trainer"] for name in SIDES}, baton)

    measured = slice(args.warmup, None)
    for name in SIDES:
        side = built[name]
        logs = [entry for entry in side["trainer"].state.log_history if "step_time" in entry]
        train_pass = [entry["step_time"] - prepare for entry, prepare in zip(logs, side["prepare"], strict=True)]
        report[name] = dict(
            positions=side["forwards"].training_positions,
            training_patches=side["vision"].training_patches,
            generation_patches=side["vision"].patches - side["vision"].training_patches,
            train_pass=statistics.median(train_pass[measured]),
            generation=statistics.median(side["prepare"][measured]),
            step=statistics.median(side["timer"].step[measured]),
            losses=[entry["loss"] for entry in logs],
            dead_groups=statistics.fmean(entry["frac_reward_zero_std"] for entry in logs),
        )
    trl_model, our_model = (built[name]["trainer"].model for name in SIDES)
    our_weights = dict(our_model.named_parameters())
    report["max_weight_difference"] = max(
        (param - our_weights[name]).abs().max().item() for name, param in trl_model.named_parameters()
    )
    report["moved"] = max(
        (param - initial).abs().max().item()
        for (_, param), initial in zip(trl_model.named_parameters(), initial_weights(args), strict=True)
    )
    trl_side, ours = report["trl"], report["ours"]
    rows = [
        ("token positions, training pass", "positions", "{:.0f}"),
        ("vision patches, training pass", "training_patches", "{:.0f}"),
        ("vision patches, generation", "generation_patches", "{:.0f}"),
        ("training pass (s, median per step)", "train_pass", "{:.2f}"),
        ("generation + scoring (s, median per step)", "generation", "{:.2f}"),
        ("whole step (s, median per step)", "step", "{:.2f}"),
    ]
    lines = ["", "| per run | stock TRL | grpo_plus | ratio |", "|---|---|---|---|"]
    for label, key, fmt in rows:
        ratio = ours[key] / trl_side[key] if trl_side[key] else float("nan")
        lines.append(f"| {label} | {fmt.format(trl_side[key])} | {fmt.format(ours[key])} | **{ratio:.3f}** |")
    lines.append(
        f"\nG = {G}; dead-group share {trl_side['dead_groups']:.2f}; max |w_trl - w_grpo_plus| "
        f"{report['max_weight_difference']:.1e} (weights moved up to {report['moved']:.1e})"
    )
    print("\n".join(lines), flush=True)
    write_report(report, started, args.json)


def initial_weights(args):
    from transformers import set_seed

    from grpo_plus.app.tiny_vlms import make_vlm

    set_seed(0)
    model, _ = make_vlm(args.family, image_size=args.image_size, hidden_size=64)
    return [param.detach() for param in model.parameters()]


if __name__ == "__main__":
    main()
