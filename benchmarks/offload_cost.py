"""What activation offloading and the tiled MLP cost in time, on this CPU: the training pass with each, against without.

    .venv/bin/python benchmarks/offload_cost.py [--lengths 512 2048] [--rows 4] [--repeats 3] [--smoke]

The training pass is grpo_plus's `_compute_loss` forward + backward of one micro-batch (synthetic, every completion
full length, every group with signal) on the embedded model's architecture (SmolLM2-135M, random fp32 weights, LoRA
r=16 on every linear layer, dropout 0) with gradient checkpointing, in four variants run in turn, `--repeats` rounds
with the order reversed every second round, medians reported with their ratio to the plain pass:

  plain                      grpo_plus as configured by default (zero-waste pass on)
  activation offloading      TRL's offloading (trl.models.activation_offloading) with the CPU standing in for the
                             accelerator: every saved tensor is copied out at pack time and back at unpack, synchronously
                             (no side stream on a CPU, no pinned memory). On a GPU the copies run on a side stream while
                             the forward and backward compute, so this is an upper bound of what it adds there.
  tiled MLP                  one more MLP forward per layer and step (the slices are recomputed for backward);
                             slices of `--tiled-tokens` (256, so that these short sequences are tiled at all: the
                             extra forward does not depend on the slice size)
  both

Why a CPU number at all: it is the copy and bookkeeping cost without the overlap a GPU gives, and the extra compute
of the tiled MLP, measured here where every run of this project is measured. `make bench-gpu`'s `long` case measures
both on a GPU (the `ours_long` side).
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time

import torch
from harness.flags import arguments
from harness.report import ROOT, markdown_table, write_report
from harness.timing import alternating

from grpo_plus import fit

VARIANTS = {
    "plain": {},
    "activation offloading": {"offload": True},
    "tiled MLP": {"tiled": True},
    "both": {"offload": True, "tiled": True},
}


def host_offloading(model):
    """TRL's offloading context with the CPU standing in for the accelerator (what the exactness test runs)."""
    from trl.models.activation_offloading import get_act_offloading_ctx_manager

    original = torch.accelerator.current_accelerator
    torch.accelerator.current_accelerator = lambda *args, **kwargs: torch.device("cpu")
    if not hasattr(torch.cpu, "empty_cache"):  # TRL calls it once bitsandbytes is imported
        torch.cpu.empty_cache = lambda: None
    try:
        return get_act_offloading_ctx_manager(model, use_pin_memory=False, use_streams=False, warn_if_no_head=False)
    finally:
        torch.accelerator.current_accelerator = original


def timed_pass(trainer, model, batch: dict, offload: bool) -> tuple[float, int]:
    """Seconds of one forward + backward, and how many tensors the offloading hooks packed."""
    context = host_offloading(model) if offload else contextlib.nullcontext()
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    with context:
        trainer._compute_loss(model, dict(batch)).backward()
    seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    gc.collect()
    return seconds, getattr(context, "tensor_id", 0)


def main() -> None:
    json_path = ROOT / "outputs" / "bench-offload" / "offload_cost.json"
    parser = arguments(__doc__, repeats=5, json=json_path, smoke="a tiny model, one length, one round (for the tests)")
    parser.add_argument("--lengths", nargs="+", type=int, default=[256, 512])
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--tiled-tokens", type=int, default=256, help="small enough that these sequences are tiled")
    args = parser.parse_args()

    import transformers

    transformers.logging.set_verbosity_error()
    model_config = fit.known_config("tiny-qwen2" if args.smoke else "smollm2-135m")
    if args.smoke:
        args.lengths, args.repeats, args.tiled_tokens = [32], 1, 32
    lora = dict(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")
    rows = []
    for length in args.lengths:
        spec = fit.FitSpec(
            model_config=model_config.to_dict(), weights_dtype="float32", rows=args.rows, num_generations=args.rows,
            generation_rows=args.rows, prompt_tokens=56, completion_tokens=length, lora=lora, mixed_precision="no",
            loss={"loss_type": "dapo", "epsilon_high": 0.28},
        )  # fmt: skip
        from grpo_plus.long_completions.tiled_mlp import tile_mlps

        trainer = fit.counting_trainer("grpo_plus", spec)
        models = {False: fit.build_policy(spec, None), True: fit.build_policy(spec, None)}  # the same weights (seed)
        wrappers = tile_mlps(models[True], args.tiled_tokens)
        batch = fit.synthetic_micro_batch(args.rows, args.rows, spec.prompt_tokens, length, model_config.vocab_size)
        times: dict[str, list[float]] = {name: [] for name in VARIANTS}
        packed = {}
        for _, name in alternating(VARIANTS, args.repeats):
            variant = VARIANTS[name]
            model = models[bool(variant.get("tiled"))]
            seconds, packed[name] = timed_pass(trainer, model, batch, bool(variant.get("offload")))
            times[name].append(seconds)
        del models
        medians = {name: statistics.median(values) for name, values in times.items()}
        row = {"completion_tokens": length, "rows": args.rows, "seconds": medians, "tensors_offloaded": packed,
               "tiled_calls": sum(wrapper.tiled_calls for wrapper in wrappers)}  # fmt: skip
        rows.append(row)
        print(f"{length} tokens x {args.rows} rows: " + ", ".join(
            f"{name} {seconds:.2f} s ({seconds / medians['plain']:.2f}x)" for name, seconds in medians.items()),
            flush=True)  # fmt: skip
    header = [
        "completion tokens",
        *(f"{name} (s)" for name in VARIANTS),
        *(f"{name} / plain" for name in list(VARIANTS)[1:]),
    ]
    cells = [[row["completion_tokens"], *(f"{row['seconds'][name]:.2f}" for name in VARIANTS),
              *(f"{row['seconds'][name] / row['seconds']['plain']:.2f}" for name in list(VARIANTS)[1:])]
             for row in rows]  # fmt: skip
    table = markdown_table(header, cells)
    print("\n" + table)
    report = {"torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows}
    write_report(report, args.json, markdown=table)


if __name__ == "__main__":
    main()
