"""Memory in real bytes: stock TRL against grpo_plus, one fresh process per configuration, on the same rows.

    .venv/bin/python benchmarks/memory_real.py [--quick] [--lengths 1024 2048 4096] [--json PATH]

Each configuration (side x completion length x grpo_plus setting) runs in a child process of its own: set-up (the
model, TRL's or grpo_plus's trainer, the micro-batch, the LoRA gradients allocated as from the second micro-batch on, a
short warm-up pass so that one-time allocations are out of the way), then one training pass of the micro-batch
(`_compute_loss` forward + backward, the trainer's own). What is reported is the pass's *step increment*: the most
bytes the process held during the pass above what it held right before it.

- On a CPU: the peak RSS. The kernel's high-water mark (VmHWM) is reset to the current RSS through
  /proc/self/clear_refs ("5") right before the pass, and glibc's malloc is pinned (`MALLOC_MMAP_THRESHOLD_=65536`,
  `MALLOC_TRIM_THRESHOLD_=0`) so that every large block is its own mapping, returned when freed, and fills every block
  it hands out (`MALLOC_PERTURB_=165`) so that its pages are resident from the allocation on (a page of `torch.empty`
  is not until it is written): RSS follows what is allocated, as a GPU caching allocator's "allocated" does.
- On a GPU (`--device cuda`): `torch.cuda.max_memory_allocated` and `max_memory_reserved` over the pass, less the
  allocation before it.

The model: Qwen2-shaped, float32, built locally from a config (random weights, no download): hidden 512, 8 layers,
8 query / 2 KV heads, MLP 2816, vocabulary 32,000; LoRA r=16 on every linear layer, gradient checkpointing
(non-reentrant), SDPA attention. The micro-batch: 8 rows, groups of 4 sharing a 64-token prompt, every completion L
tokens (no EOS), every advantage non-zero (the worst step). TRL's fused LM head folds its tiles in torch without
Triton (CPU): it is run with 4,096 vocabulary columns per tile on both sides (TRL's default 32,768 makes one
[4096 x 32000] float32 tile and its temporaries the largest thing in the pass on a CPU; on a GPU the fold is a
Triton kernel that allocates nothing). `--trl-lm-head-tile` keeps TRL's 32,768 instead: what a CPU user gets, and
where grpo_plus's `lm_head_tile_columns="auto"` narrows its own tile (the variant "grpo_plus, TRL's LM-head tile"
turns that off).

Same work: every child prints the gradient norm of the LoRA weights after the pass (float32): equal to 6 significant
digits on every side. Beside each real peak, `grpo_plus.fit`'s count of the same pass on fake tensors (the CPU fold
of the LM head counted), and the gap.

Results: docs/guide/results/memory_real.json (and --quick: outputs/bench-memory-real/).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from pathlib import Path

from harness.flags import arguments
from harness.process import PINNED_MALLOC as PINNED
from harness.process import child_result, launch_child, reset_peak_rss, status_kib
from harness.report import ROOT, markdown_table, write_report

MIB = 2**20
# Every large block its own mapping, returned when freed; MALLOC_PERTURB_ fills each block when allocated, so its pages
# count in the RSS from then on, as a GPU's max_memory_allocated counts an allocation (an untouched page of
# torch.empty never enters the RSS: a buffer filled tile by tile would count only as far as it is filled).
PINNED_MALLOC = {**PINNED, "MALLOC_PERTURB_": "165"}
LM_HEAD_CHUNK = 4096  # TRL's vocabulary columns per LM-head tile on both sides (see the module docstring)

MODEL = dict(
    model_type="qwen2", hidden_size=512, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=8,
    num_key_value_heads=2, vocab_size=32000, rope_theta=1000000.0, tie_word_embeddings=True,
    max_position_embeddings=32768, rms_norm_eps=1e-6, use_sliding_window=False, pad_token_id=0, eos_token_id=1,
    bos_token_id=2,
)  # fmt: skip
QUICK_MODEL = {**MODEL, "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2, "vocab_size": 4096}
ROWS, GROUP, PROMPT = 8, 4, 64
LORA = dict(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")

# label: (side, grpo_plus settings beyond the defaults)
VARIANTS: dict[str, tuple[str, dict]] = {
    "TRL": ("trl", {}),
    "grpo_plus default": ("grpo_plus", {}),
    "grpo_plus, tiled MLP off": ("grpo_plus", {"tiled_mlp_tokens": None}),
    "grpo_plus + tiled_mlp_tokens=4096": ("grpo_plus", {"tiled_mlp_tokens": 4096}),
    "grpo_plus, TRL's LM-head tile": ("grpo_plus", {"lm_head_tile_columns": None}),
}


def fit_spec(model: dict, length: int, changes: dict):
    """The bench's pass as a `grpo_plus.fit.FitSpec` (what the child builds and the counter counts)."""
    from grpo_plus import fit
    from grpo_plus.long_completions.settings import LongCompletionSettings

    defaults = LongCompletionSettings()
    settings = {"tiled_mlp_tokens": defaults.tiled_mlp_tokens, "lm_head_tile_columns": defaults.lm_head_tile_columns,
                **changes}  # fmt: skip
    return fit.FitSpec(
        model_config=model, weights_dtype="float32", rows=ROWS, num_generations=GROUP, generation_rows=ROWS,
        prompt_tokens=PROMPT, completion_tokens=length, lora=dict(LORA), gradient_checkpointing=True,
        mixed_precision="no", attn_implementation="sdpa", padded_prompts=False, **settings,
    )  # fmt: skip


def lm_head_tile(job: dict):
    """TRL's LM-head tile width inside the block: the job's (LM_HEAD_CHUNK unless it says otherwise; None: TRL's
    own)."""
    from grpo_plus.compat.lm_head import fused_lm_head_columns

    chunk = job.get("lm_head_chunk", LM_HEAD_CHUNK)
    return fused_lm_head_columns(chunk) if chunk else contextlib.nullcontext()


# ---- the child: one configuration ---------------------------------------------------------------------------------


def run_child(job: dict) -> dict:
    """Set up, then one training pass; the step increment, its time and the gradient norm."""
    with lm_head_tile(job):
        return measure(job)


def measure(job: dict) -> dict:
    import torch
    import transformers

    from grpo_plus.fit import for_side
    from grpo_plus.fit.count import build_policy, counting_trainer, synthetic_micro_batch

    transformers.logging.set_verbosity_error()
    device = job["device"]
    spec = for_side(fit_spec(job["model"], job["length"], job["changes"]), job["side"])  # TRL: none of grpo_plus's
    trainer = counting_trainer(job["side"], spec)
    model = build_policy(spec, None).to(device)
    trainable = [p for p in model.parameters() if p.requires_grad]

    def batch(length: int) -> dict:
        vocab = spec.model_config["vocab_size"]
        data = synthetic_micro_batch(ROWS, GROUP, PROMPT, length, vocab, seed=job["seed"])
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in data.items()}

    def step(inputs: dict) -> None:
        loss = trainer._compute_loss(model, dict(inputs))
        loss.backward()

    step(batch(16))  # warm-up: lazy initializations, thread pools
    for param in trainable:
        param.grad = torch.zeros_like(param)  # allocated, as from the second micro-batch on
    inputs = batch(job["length"])
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before_allocated, before_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    else:
        reset_peak_rss()
        before = status_kib("VmRSS")
    began = time.perf_counter()
    step(inputs)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - began
    result: dict = {"seconds": seconds}
    if cuda:
        result["increment"] = torch.cuda.max_memory_allocated() - before_allocated
        result["reserved_increment"] = torch.cuda.max_memory_reserved() - before_reserved
    else:
        result["increment"] = (status_kib("VmHWM") - before) * 1024
        result["rss_before"] = before * 1024
    result["grad_norm"] = float(torch.linalg.vector_norm(torch.stack([p.grad.double().norm() for p in trainable])))
    result["tiled_calls"] = sum(getattr(m.__dict__.get("forward"), "tiled_calls", 0) for m in model.modules())
    return result


# ---- the counter's figure for the same pass --------------------------------------------------------------------------


def counted(job: dict) -> int:
    """`grpo_plus.fit`'s count of the child's pass (at 1 and 2 decoder layers, extended to the depth), with the CPU
    fold of the LM head at the bench's tile width."""

    from grpo_plus import fit

    spec = fit_spec(job["model"], job["length"], job["changes"])
    with lm_head_tile(job):
        points = [fit.measure_pass(spec, job["side"], layers, lm_head="cpu") for layers in (1, 2)]
    return fit.extrapolate(points, spec.layers).peak


# ---- the parent ------------------------------------------------------------------------------------------------------


def launch(job: dict, threads: int) -> dict:
    env = {**os.environ, **PINNED_MALLOC, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")  # this checkout
    return launch_child(Path(__file__), job, env)


def mib(value: float) -> str:
    return f"{value / MIB:,.0f}"


def tables(rows: list[dict], labels: list[str]) -> str:
    """Ratios against stock TRL's row, or against the first variant run when `--variants` leaves TRL out."""
    trl = "TRL" if "TRL" in labels else labels[0]
    others = [label for label in labels if label != trl]
    header = ["L", f"{trl} step increment (MiB)", *(f"{label}" for label in others), "gradient norm (all sides)"]
    cells = []
    for row in rows:
        base = row[trl]
        norms = sorted({f"{row[label]['grad_norm']:.6g}" for label in labels})
        cells.append([row["length"], mib(base["increment"]),
                      *(f"{row[label]['increment'] / base['increment']:.3f}x" for label in others),
                      " / ".join(norms)])  # fmt: skip
    memory = markdown_table(header, cells)
    header = ["L", f"{trl} pass (s)", *(f"{label}" for label in others)]
    cells = [[row["length"], f"{row[trl]['seconds']:.1f}",
              *(f"{row[label]['seconds'] / row[trl]['seconds']:.3f}x" for label in others)] for row in rows]  # fmt: skip
    timing = markdown_table(header, cells)
    header = ["L", *(f"{label}: counted / real" for label in labels)]
    cells = [[row["length"], *(f"{row[label]['counted'] / row[label]['increment']:.3f}" if "counted" in row[label]
                               else "—" for label in labels)] for row in rows]  # fmt: skip
    counter = markdown_table(header, cells)
    return f"{memory}\n\n{timing}\n\n{counter}"


def recount(path: Path) -> None:
    """fit's count beside every real peak of a results file, made again with this checkout's counter."""
    report = json.loads(path.read_text())
    labels = [label for label in VARIANTS if any(label in row for row in report["results"])]
    for row in report["results"]:
        for label in labels:
            if label in row:
                side, changes = VARIANTS[label]
                job = dict(side=side, changes=changes, length=row["length"], model=report["model"],
                           lm_head_chunk=report.get("lm_head_chunk", LM_HEAD_CHUNK))  # fmt: skip
                row[label]["counted"] = counted(job)
                print(f"  L={row['length']:5d} {label:34s}: real {mib(row[label]['increment'])} MiB, counted "
                      f"{mib(row[label]['counted'])} MiB ({row[label]['counted'] / row[label]['increment']:.3f}x)")  # fmt: skip
    print("\n" + tables(report["results"], labels))
    write_report(report, path, markdown=tables(report["results"], labels))


def main() -> None:
    parser = arguments(__doc__, threads=2, json=None, quick="a 2-layer, hidden-128 model at L = 256 (CI smoke)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument(
        "--trl-lm-head-tile",
        action="store_true",
        help=f"keep TRL's LM-head tile width (32,768) instead of setting {LM_HEAD_CHUNK} on both sides",
    )
    parser.add_argument("--no-count", action="store_true", help="skip grpo_plus.fit's count beside each real peak")
    parser.add_argument(
        "--recount", metavar="JSON", help="recompute fit's count beside the real peaks of a results file"
    )
    args = parser.parse_args()
    if args.child:
        child_result(run_child(json.loads(args.child)))
        return
    if args.recount:
        recount(Path(args.recount))
        return
    model = QUICK_MODEL if args.quick else MODEL
    lengths = [256] if args.quick else args.lengths
    default_json = ROOT / ("outputs/bench-memory-real" if args.quick else "docs/guide/results") / "memory_real.json"
    output = args.json or default_json
    started = time.perf_counter()
    lm_head_chunk = None if args.trl_lm_head_tile else LM_HEAD_CHUNK
    rows = []
    for length in lengths:
        row: dict = {"length": length}
        for label in args.variants:
            side, changes = VARIANTS[label]
            job = dict(side=side, changes=changes, length=length, model=model, device=args.device, seed=0,
                       lm_head_chunk=lm_head_chunk)  # fmt: skip
            row[label] = launch(job, args.threads)
            if not args.no_count and args.device == "cpu":
                row[label]["counted"] = counted(job)
            extra = f", counted {mib(row[label]['counted'])} MiB" if "counted" in row[label] else ""
            print(f"  L={length:5d} {label:34s}: step increment {mib(row[label]['increment'])} MiB, "
                  f"{row[label]['seconds']:.1f} s, grad norm {row[label]['grad_norm']:.8g}, "
                  f"tiled MLP calls {row[label]['tiled_calls']}{extra}", flush=True)  # fmt: skip
        rows.append(row)
    markdown = tables(rows, args.variants)
    report = {"device": args.device, "model": model, "rows": ROWS, "group": GROUP, "prompt": PROMPT, "lora": LORA,
              "lm_head_chunk": lm_head_chunk, "threads": args.threads, "malloc": PINNED_MALLOC,
              "results": rows}  # fmt: skip
    print("\n" + markdown)
    write_report(report, output, markdown=markdown, started=started)


if __name__ == "__main__":
    main()
