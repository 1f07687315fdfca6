"""Vision-language GRPO, zero-waste against stock TRL: training-pass token positions, vision-tower patches, time.

    .venv/bin/python benchmarks/vlm.py [--family qwen2_5_vl] [--image-size 448] [--steps 6] [--warmup 1]
                                       [--threads 1] [--json out.json]

A tiny Qwen2.5-VL built locally (grpo_plus.app.tiny_vlms: random weights, 2 + 2 layers of width 64), 448 x 448
images: 1024 vision patches, 256 image tokens per image, prompts of ~280 tokens. 2 image prompts x G = 8 completions
of <= 32 tokens per optimizer step, float32, plain SGD (equal weights then show equal gradients), reward: distinct
characters (a random model: groups rarely tie; `--half-dead`: every other group's reward is constant). Stock trl.GRPOTrainer and
grpo_plus.GRPOTrainer train in one process in lock-step (harness/lockstep.py: same random numbers, same
machine load within a step), then the weights are compared. Per side, summed over the measured steps:
  positions        token positions of the model forwards that carried gradient (the training pass)
  patches          vision-tower patches, in the training pass (with gradient) and in generation (without)
  train pass (s)   TRL's `step_time` minus `_prepare_inputs` (generation and scoring), median per step
  generation (s)   `_prepare_inputs`, median per step
Targets (issue 35): training-pass positions <= 0.3x stock TRL's, vision-tower work <= 1/G of TRL's, same weights.
"""

from __future__ import annotations

import statistics

from harness.flags import arguments
from harness.report import ROOT, side_by_side, start_report, write_report
from harness.trainers import SIDES, phase_medians, run_in_lockstep, step_logs

G = 8


def distinct_characters_reward(completions, **kwargs):
    return [float(len(set(completion[0]["content"]))) for completion in completions]


def half_dead_reward(completions, answer, **kwargs):
    """distinct_characters_reward, but a constant for odd answers: every other group is dead (no learning signal)."""
    scores = distinct_characters_reward(completions)
    return [1.0 if value % 2 else score for score, value in zip(scores, answer, strict=True)]


def vlm_trainer(args):
    """A `make` for harness.trainers: the side's trainer on a tiny VLM built from the seed."""
    from grpo_plus.app.tiny_vlms import image_dataset, make_vlm

    settings = dict(
        output_dir=str(ROOT / "outputs" / "bench-vlm"), per_device_train_batch_size=2 * G, num_generations=G,
        max_completion_length=32, max_steps=args.steps, learning_rate=0.05, optim="sgd", logging_steps=1,
        save_strategy="no", report_to="none", use_cpu=True, bf16=False, disable_tqdm=True, seed=0, temperature=1.0,
    )  # fmt: skip
    dataset = image_dataset(2 * args.steps, image_size=args.image_size)

    def make(name, package, callbacks):
        model, processor = make_vlm(args.family, image_size=args.image_size, hidden_size=64)
        return package.GRPOTrainer(
            model=model, processing_class=processor,
            reward_funcs=half_dead_reward if args.half_dead else distinct_characters_reward,
            args=package.GRPOConfig(**settings), train_dataset=dataset, callbacks=callbacks,
        )  # fmt: skip

    return make


def count_vision(built: dict) -> None:
    """Each side counts its vision tower's patches (grpo_plus.app.tiny_vlms.VisionLog) into `vision`."""
    from grpo_plus.app.tiny_vlms import VisionLog

    for side in built.values():
        side["vision"] = VisionLog(side["trainer"].model)


def main() -> None:
    parser = arguments(__doc__, steps=6, warmup=1, threads=1, json=ROOT / "outputs" / "bench-vlm" / "vlm.json")
    parser.add_argument("--family", default="qwen2_5_vl")
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--half-dead", action="store_true", help="every other group's reward is constant (dead)")
    args = parser.parse_args()
    report, started = start_report(args)
    report.update(
        family=args.family, image_size=args.image_size, group_size=G, steps=args.steps, half_dead=args.half_dead
    )

    print(f"{args.family}, {args.image_size}px images, {args.steps} lock-step optimizer steps per trainer ...")
    built = run_in_lockstep(vlm_trainer(args), prepare=count_vision)

    for name in SIDES:
        side = built[name]
        logs, phases = step_logs(side), phase_medians(side, args.warmup)
        report[name] = dict(
            positions=side["forwards"].training_positions,
            training_patches=side["vision"].training_patches,
            generation_patches=side["vision"].patches - side["vision"].training_patches,
            train_pass=phases["train_pass"],
            generation=phases["generation"],
            step=phases["step"],
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
        ("token positions, training pass", "positions", ".0f", True),
        ("vision patches, training pass", "training_patches", ".0f", True),
        ("vision patches, generation", "generation_patches", ".0f", True),
        ("training pass (s, median per step)", "train_pass", ".2f", True),
        ("generation + scoring (s, median per step)", "generation", ".2f", True),
        ("whole step (s, median per step)", "step", ".2f", True),
    ]
    table = side_by_side("per run", rows, trl_side, ours, ratio_format=".3f")
    table += (
        f"\n\nG = {G}; dead-group share {trl_side['dead_groups']:.2f}; max |w_trl - w_grpo_plus| "
        f"{report['max_weight_difference']:.1e} (weights moved up to {report['moved']:.1e})"
    )
    print("\n" + table, flush=True)
    write_report(report, args.json, markdown=table, started=started)


def initial_weights(args):
    from transformers import set_seed

    from grpo_plus.app.tiny_vlms import make_vlm

    set_seed(0)
    model, _ = make_vlm(args.family, image_size=args.image_size, hidden_size=64)
    return [param.detach() for param in model.parameters()]


if __name__ == "__main__":
    main()
