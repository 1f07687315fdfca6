"""Routing replay on a tiny mixture of experts: a bf16 sampler against a float32 trainer, with replay off and on.

    .venv/bin/python benchmarks/routing_replay.py [--layers 4] [--experts 8] [--init-std 0.1] [--rounds 4] [--steps 6]
        [--repeats 1] [--json FILE]

The model: a random Qwen3-MoE of grpo_plus.app.testing's tiny family made wider (hidden 64, `--layers` layers,
`--experts` experts of width 32, top 2), its weights drawn with std `--init-std` (0.1: at transformers' 0.02 the
experts' outputs are so small against the residual stream that a flip hardly moves a log-prob). Part 1, the mismatch:
a bf16 copy generates (grpo_plus's generator, experts recorded) `--rounds` batches of 16 completions (4 prompts x 4,
at most 24 tokens, sampling at temperature 1); the float32 model computes the completions' log-probs with replay off
and on. Printed per setting: route flips (share of completion tokens whose experts in the float32 forward differ from
the sampler's in some layer), and the sampler/trainer KL, mean over tokens of k3 = r - 1 - log r with r = p_trainer /
p_sampler (the sampler's log-probs: the bf16 model's forward over the same sequences along its own recorded experts).
Part 2, the cost: `--steps` optimizer steps of grpo_plus's trainer in float32 (8 rows, 2 prompts x 4, 12 tokens,
gradient checkpointing) with routing off, `routing_receipt` and `routing_replay`, one trainer each, in lock-step
(harness.lockstep); printed: the median step time and its ratio to routing off (wall and the thread's CPU time, the
first step left out), each the median over `--repeats` runs (each with its trainers built anew), with every run's
ratio beside it.
--smoke: 2 layers, 1 round, 2 steps (checks the script runs; the numbers mean nothing).
"""

from __future__ import annotations

import copy
import statistics
import sys
import tempfile
from pathlib import Path

from harness.flags import arguments
from harness.lockstep import Baton, RngStates, train_in_lockstep
from harness.report import markdown_table, start_report, write_report
from harness.timing import StepTimer

PROMPTS = ["1+2=", "3+4=", "12+5=", "7+7="]
SETTINGS = {"off": {}, "receipt": {"routing_receipt": True}, "replay": {"routing_replay": True}}


def moe_model(layers: int, experts: int, init_std: float = 0.02):
    import torch
    from transformers import AutoModelForCausalLM

    from grpo_plus.app.testing import make_tokenizer, tiny_config

    tokenizer = make_tokenizer()
    torch.manual_seed(0)
    config = tiny_config("qwen3_moe", len(tokenizer), hidden_size=64, num_hidden_layers=layers, num_experts=experts,
                         moe_intermediate_size=32, head_dim=16, initializer_range=init_std)  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval(), tokenizer


def completion_logps(model, sequences, prompt_mask, routes, replay: bool):
    """(log-probs of the completion tokens, route tally) of one forward over the sequences, routed by the records."""
    import torch

    from grpo_plus.routing.replay import RouteReplay, RouteTally, completion_plan

    width = prompt_mask.shape[1]
    completion = sequences[:, width:]
    mask = torch.cat([prompt_mask, torch.ones_like(completion)], dim=1)
    tally = RouteTally()
    with torch.no_grad(), RouteReplay(replay).planned(model, completion_plan(routes, width), tally):
        logits = model(input_ids=sequences, attention_mask=mask).logits.float()
    logps = torch.log_softmax(logits[:, width - 1 : -1], dim=-1).gather(2, completion[..., None]).squeeze(2)
    return logps, tally


def mismatch(layers: int, experts: int, rounds: int, init_std: float) -> dict[str, dict[str, float]]:
    """Route flips and the sampler/trainer k3 KL of a bf16 sampler against the float32 model, replay off and on."""
    import torch

    from grpo_plus.routing.replay import NO_ROUTE
    from grpo_plus.zero_waste.generation import generate

    trainer_model, tokenizer = moe_model(layers, experts, init_std)
    sampler = copy.deepcopy(trainer_model).to(torch.bfloat16)
    totals = {name: {"tokens": 0, "flips": 0, "k3": 0.0} for name in ("off", "replay")}
    for round_index in range(rounds):
        torch.manual_seed(round_index)
        batch = tokenizer([p for p in PROMPTS for _ in range(4)], return_tensors="pt", padding=True,
                          padding_side="left")  # fmt: skip
        sequences, stats = generate(
            sampler, record_routes=True, input_ids=batch.input_ids, attention_mask=batch.attention_mask,
            do_sample=True, max_new_tokens=24, pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )  # fmt: skip
        routes = stats.routes
        sampler_logps, _ = completion_logps(sampler, sequences, batch.attention_mask, routes, replay=True)
        scored = routes[..., 0, 0] != NO_ROUTE  # tokens fed in while sampling: their experts are recorded
        scored = torch.cat([torch.ones_like(scored[:, :1]), scored[:, :-1]], dim=1)  # predicted from a recorded one
        for name in totals:
            logps, tally = completion_logps(trainer_model, sequences, batch.attention_mask, routes, name == "replay")
            log_ratio = (logps - sampler_logps)[scored]
            totals[name]["k3"] += float((log_ratio.exp() - 1 - log_ratio).sum())
            totals[name]["tokens"] += int(tally.tokens)
            totals[name]["flips"] += int(tally.route_flips)
            totals[name]["scored"] = totals[name].get("scored", 0) + int(scored.sum())
    return {
        name: {"route_flips": t["flips"] / t["tokens"], "k3_kl": t["k3"] / t["scored"], "tokens": t["tokens"]}
        for name, t in totals.items()
    }


def step_times(layers: int, experts: int, steps: int, output_dir: Path) -> dict[str, dict[str, float]]:
    """Median step seconds (wall, the thread's CPU) of grpo_plus's trainer with routing off, the receipt and replay, the
    three in lock-step (one optimizer step each in turn, each with its own random state), the first step left out."""
    import grpo_plus
    from grpo_plus.app.testing import digit_reward, prompt_dataset, tiny_run_kwargs

    baton, rng = Baton(list(SETTINGS)), RngStates()
    timers, trainers = {}, {}
    for name, settings in SETTINGS.items():
        model, tokenizer = moe_model(layers, experts)
        model.train()
        args = tiny_run_kwargs(output_dir / name, per_device_train_batch_size=8, max_completion_length=12,
                               max_steps=steps, gradient_checkpointing=True, **settings)  # fmt: skip
        trainers[name] = grpo_plus.GRPOTrainer(
            model=model, processing_class=tokenizer, reward_funcs=[digit_reward],
            args=grpo_plus.GRPOConfig(**args), train_dataset=prompt_dataset(8),
        )  # fmt: skip
        timers[name] = StepTimer(name, baton, rng)
        trainers[name].add_callback(timers[name])
    train_in_lockstep(trainers, baton)
    result = {}
    for name, timer in timers.items():
        wall, cpu = timer.step[1:] or timer.step, timer.cpu[1:] or timer.cpu
        result[name] = {"wall_s": statistics.median(wall), "cpu_s": statistics.median(cpu), "steps": len(timer.step)}
        flips = [
            entry["routing/route_flips"]
            for entry in trainers[name].state.log_history
            if "routing/route_flips" in entry
        ]
        result[name]["route_flips"] = flips
    for name in SETTINGS:
        for kind in ("wall", "cpu"):
            result[name][f"{kind}_over_off"] = result[name][f"{kind}_s"] / result["off"][f"{kind}_s"]
    return result


def median_over_runs(runs: list[dict[str, dict]]) -> dict[str, dict[str, float]]:
    """Per setting, the median over runs of each figure (every run builds its trainers anew: their memory layout, not
    the steps, is what differs most between runs)."""
    figures = ("wall_s", "cpu_s", "wall_over_off", "cpu_over_off")
    return {name: {key: statistics.median(run[name][key] for run in runs) for key in figures} for name in runs[0]}


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__, json=None, threads=1, smoke="2 layers, 1 round, 2 steps (the script runs)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument(
        "--repeats", type=int, default=1, help="part 2 runs this many times; the table has the medians"
    )
    parser.add_argument(
        "--init-std",
        type=float,
        default=0.1,
        help="the random weights' std (transformers' initializer_range; larger: experts that differ more)",
    )
    parser.add_argument(
        "--part",
        choices=("all", "mismatch", "steps"),
        default="all",
        help="mismatch: part 1 only (its figures do not depend on the machine's load); steps: part 2",
    )
    args = parser.parse_args(argv)
    report, started = start_report(args)
    layers, rounds, steps = (2, 1, 2) if args.smoke else (args.layers, args.rounds, args.steps)
    report["settings"] = dict(layers=layers, experts=args.experts, init_std=args.init_std, rounds=rounds, steps=steps)
    tables = []
    if args.part in ("all", "mismatch"):
        report["mismatch"] = found = mismatch(layers, args.experts, rounds, args.init_std)
        rows = [[name, f"{r['route_flips']:.4f}", f"{r['k3_kl']:.3g}", r["tokens"]] for name, r in found.items()]
        tables.append(markdown_table(["replay", "route flips", "sampler/trainer k3 KL", "recorded tokens"], rows))
        print(tables[-1])
    if args.part in ("all", "steps"):
        runs = []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as scratch:
                runs.append(step_times(layers, args.experts, steps, Path(scratch)))
        report["step_time"] = timed = median_over_runs(runs)
        report["step_time_runs"] = runs
        rows = [[name, f"{t['wall_s']:.3f}", f"{t['wall_over_off']:.3f}x", f"{t['cpu_s']:.3f}",
                 f"{t['cpu_over_off']:.3f}x", " ".join(f"{run[name]['wall_over_off']:.3f}x" for run in runs)]
                for name, t in timed.items()]  # fmt: skip
        header = ["routing", "wall s/step", "vs off", "CPU s/step", "vs off", "wall vs off, each run"]
        tables.append(markdown_table(header, rows))
        print(tables[-1])
    if args.json:
        write_report(report, args.json, "\n\n".join(tables), started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
