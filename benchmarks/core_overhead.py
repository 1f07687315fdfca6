"""Forward + backward cost of grpo_plus.objective.compute_policy_loss vs TRL 1.16's inline loss math.

Run from the repo root:  .venv/bin/python benchmarks/core_overhead.py [--quick] [--repeats 20] [--device cpu|cuda|all]

Contestants, each timed as forward + backward of the loss w.r.t. a (B, T) log-prob leaf, alternated within every
repetition (rotating the order) so drift in machine load hits them alike; the table shows medians:
  trl            TRL's own `GRPOTrainer._compute_loss`, called on the stand-in trainer of grpo_plus.app.testing
                 with the inputs dict prebuilt: TRL's exact inline math including the metrics it always computes.
  trl_math       TRL's loss lines alone, re-typed without metrics: the floor for any implementation.
  ours           compute_policy_loss(...).loss.backward(): loss only (metrics are lazy).
  ours+metrics   the same plus what the trainer logs: out.metrics and the per-sequence clip extremes.
  mask_chk       the mask 0/1 validation inside `ours`, timed alone.
Ratios: ours / trl (the issue's target, <= 1.10), ours+metrics / trl (like for like), ours / trl_math.
"""

from __future__ import annotations

import statistics
import time

import torch
from harness.flags import arguments
from trl import GRPOTrainer

import grpo_plus
from grpo_plus.app.testing import StandInTrainer
from grpo_plus.objective import compute_policy_loss
from grpo_plus.objective.loss import _is_binary


def make_inputs(batch: int, length: int, device: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logps = -3 * torch.rand(batch, length, generator=gen)
    old_logps = logps - 0.2 * torch.randn(batch, length, generator=gen)
    advantages = torch.randn(batch, generator=gen)
    lengths = torch.randint(length // 8, length + 1, (batch,), generator=gen)
    mask = (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).long()  # TRL's completion_mask dtype
    return [t.to(device) for t in (logps, old_logps, advantages, mask)]


def contestants(logps, old_logps, advantages, mask, loss_type: str):
    """name -> zero-argument callable doing one forward + backward."""
    num_items = mask.sum()
    settings = dict(loss_type=loss_type, importance_sampling_level="token", epsilon=0.2, epsilon_high=0.28, beta=0.0)
    leaf = logps.clone().requires_grad_()
    batch, length = mask.shape
    stand_in = StandInTrainer(leaf, **settings, max_completion_length=length)
    trl_inputs = {
        "prompt_ids": torch.zeros(batch, 1, dtype=torch.long, device=mask.device),
        "prompt_mask": torch.ones(batch, 1, dtype=torch.long, device=mask.device),
        "completion_ids": torch.zeros(batch, length, dtype=torch.long, device=mask.device),
        "completion_mask": mask,
        "advantages": advantages,
        "old_per_token_logps": old_logps,
        "num_items_in_batch": num_items,
    }

    def trl():
        leaf.grad = None
        for values in stand_in._metrics["train"].values():
            values.clear()
        GRPOTrainer._compute_loss(stand_in, None, trl_inputs).backward()

    def trl_math():  # TRL 1.16 _compute_loss, loss lines only (token level, beta=0)
        leaf.grad = None
        coef_1 = torch.exp(leaf - old_logps)
        coef_2 = torch.clamp(coef_1, 1 - 0.2, 1 + 0.28)
        adv = advantages.unsqueeze(1)
        per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)
        if loss_type == "grpo":
            loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
        else:
            loss = (per_token_loss * mask).sum() / num_items.clamp(min=1.0)
        loss.backward()

    def run_ours():
        leaf.grad = None
        out = compute_policy_loss(
            leaf, old_logps, advantages, mask, epsilon=0.2, epsilon_high=0.28, loss_type=loss_type,
            num_items_in_batch=num_items, max_completion_length=length,
        )  # fmt: skip
        out.loss.backward()
        return out

    def ours():
        run_ours()

    def ours_metrics():
        out = run_ours()
        out.metrics  # noqa: B018 - computing the metrics is the point
        low, high = out.sequence_clip_fractions()
        torch.nan_to_num(low, nan=float("inf")).min().item(), torch.nan_to_num(high, nan=-float("inf")).max().item()

    def mask_check():  # the 0/1 validation compute_policy_loss does on every call, alone (part of `ours`)
        _is_binary(mask)

    return {"trl": trl, "trl_math": trl_math, "ours": ours, "ours+metrics": ours_metrics, "mask_check": mask_check}


def bench(fns: dict, reps: int, warmup: int, device: str) -> dict[str, float]:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for rep in range(warmup + reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            sync()
            start = time.perf_counter()
            fns[name]()
            sync()
            if rep >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) * 1e3 for name, values in times.items()}


def main() -> None:
    parser = arguments(
        __doc__, repeats=20, threads=None, quick="5 repetitions after 2 warm-up runs, T=1024 only"
    )  # --threads: torch's own unless given
    parser.add_argument("--device", choices=["cpu", "cuda", "all"], default="all")
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    reps, warmup = (5, 2) if args.quick else (args.repeats, 5)
    lengths = [1024] if args.quick else [1024, 4096]
    devices = ["cpu", "cuda"] if args.device == "all" else [args.device]
    devices = [d for d in devices if d == "cpu" or torch.cuda.is_available()]

    print(f"torch {torch.__version__}, grpo_plus {grpo_plus.__version__}, intra-op threads {torch.get_num_threads()}")
    if torch.cuda.is_available():
        print(f"cuda {torch.version.cuda}, {torch.cuda.get_device_name()}")
    print(
        f"float32, B={args.batch}, token level, beta=0, epsilon 0.2/0.28; median of {reps} runs after {warmup} warm-up"
    )
    header = (
        f"{'device':6} {'loss':5} {'T':>5} | {'trl ms':>8} {'trl_math':>8} {'ours':>8} {'ours+met':>8} "
        f"{'mask_chk':>8} | {'ours/trl':>8} {'+met/trl':>8} {'ours/math':>9}"
    )
    print(header)
    print("-" * len(header))
    for device in devices:
        for length in lengths:
            for loss_type in ("dapo", "grpo"):
                fns = contestants(*make_inputs(args.batch, length, device), loss_type=loss_type)
                ms = bench(fns, reps, warmup, device)
                print(
                    f"{device:6} {loss_type:5} {length:>5} | {ms['trl']:8.3f} {ms['trl_math']:8.3f} {ms['ours']:8.3f} "
                    f"{ms['ours+metrics']:8.3f} {ms['mask_check']:8.3f} | {ms['ours'] / ms['trl']:8.3f} "
                    f"{ms['ours+metrics'] / ms['trl']:8.3f} {ms['ours'] / ms['trl_math']:9.3f}"
                )


if __name__ == "__main__":
    main()
