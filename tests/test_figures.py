"""Every figure README.md and the docs quote from a benchmark's results file (docs/guide/results/*.json) is recomputed
here from that file and must read the same on the page: a benchmark re-run whose numbers moved fails until the page
says the new ones, and a figure edited by hand fails until its results file agrees.

Each `Quote` is a piece of a page with `{}` where its figures stand (whitespace-insensitive, so prose may wrap), the
results file, and how the figures are computed from it, formatted as the page prints them. The negative control: every
quote stops matching when its results file's numbers change (each by its own factor)."""

from __future__ import annotations

import json
import math
import re
import statistics
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "guide" / "results"
MIB, GIB = 2**20, 2**30


@dataclass(frozen=True)
class Quote:
    page: str  # relative to the repository
    text: str  # the page's text, `{}` where each figure stands
    results: str  # the file in docs/guide/results
    figures: Callable[[dict], tuple]  # the figures as the page prints them, from the file's JSON

    def expected(self, data: dict) -> str:
        return self.text.format(*self.figures(data))

    @property
    def id(self) -> str:
        return f"{self.page}: {self.text[:60]}"


def flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


@cache
def page_text(page: str) -> str:
    return flat((ROOT / page).read_text(encoding="utf-8"))


@cache
def results(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def sci(value: float) -> str:
    """1.6e-6, as the prose writes a small number (one decimal, no exponent padding)."""
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def mib(value: float) -> str:
    return f"{value / MIB:,.0f}"


# ---- docs/guide/vllm.md and README.md: results/vllm.json ------------------------------------------------------------


def demo(data: dict, side: str) -> dict:
    return data["demo_vllm"][side]


def demo_row(key: str, spec: str, ratio: str = ".2f") -> Callable[[dict], tuple]:
    def figures(data: dict) -> tuple:
        trl, ours = demo(data, "trl")[key], demo(data, "ours")[key]
        return format(trl, spec), format(ours, spec), format(ours / trl, ratio) if ours else "0"

    return figures


def receipts(data: dict) -> tuple:
    rows = data["sync_check_receipts"]
    means = [row["mean"] for row in rows]
    bounds = sorted({f"{row['bound']:.3f}" for row in rows})
    bound = bounds[0] if len(bounds) == 1 else f"{bounds[0]}-{bounds[-1]}"
    return (
        len(rows),
        f"{min(means):.3f}",
        f"{max(means):.3f}",
        bound,
        f"{max(row['mean'] / row['bound'] for row in rows):.2f}",
        f"{statistics.median(r['seconds'] for r in rows):.2f}",
    )


def mean_length(data: dict, side: str) -> str:
    return f"{statistics.fmean(demo(data, side)['completion_lengths']):.1f}"


def async_seed(seed: str) -> Callable[[dict], tuple]:
    def figures(data: dict) -> tuple:
        s = data["summary"][seed]
        return (
            seed, f"{s['sync_step']:.2f}", f"{s['generation']:.2f}", f"{s['sync']:.2f}", f"{s['training']:.2f}",
            f"{s['async_step']:.2f}", f"{s['async_over_sync_step']:.2f}", f"{s['async_over_limit']:.2f}",
            f"{s['overlap_limit']:.2f}", f"{s['accuracy']['sync']:.3f}", f"{s['accuracy']['async']:.3f}",
            f"{s['accuracy_per_minute_ratio']:.2f}",
        )  # fmt: skip

    return figures


ASYNC_PAGE, ASYNC = "docs/guide/async-generation.md", "async_generation.json"
ASYNC_SEED = (
    "seed {}: TRL's loop {} s a step (generation {} s, weight sync {} s, the rest {} s); asynchronous {} s a step, {}x "
    "TRL's step and {}x the overlap's limit ({} s); held-out accuracy after 30 steps {} (TRL's loop) and {} "
    "(asynchronous), {}x the accuracy per training minute."
)
VLLM_PAGE, VLLM = "docs/guide/vllm.md", "vllm.json"
QUOTES = [
    Quote(ASYNC_PAGE, ASYNC_SEED, ASYNC, async_seed("0")),
    Quote(ASYNC_PAGE, ASYNC_SEED, ASYNC, async_seed("1")),
    Quote(ASYNC_PAGE, ASYNC_SEED, ASYNC, async_seed("2")),
    Quote(VLLM_PAGE, "| whole step (s) | {} | {} | **{}** |", VLLM, demo_row("step", ".2f")),
    Quote(
        VLLM_PAGE,
        "| vLLM generation + scoring + old log-probs (s) | {} | {} | {} |",
        VLLM,
        demo_row("generation", ".2f"),
    ),
    Quote(VLLM_PAGE, "| training pass (s) | {} | {} | {} |", VLLM, demo_row("train_pass", ".2f")),
    Quote(
        VLLM_PAGE, "| token positions in the training forward | {} | {} | {} |", VLLM, demo_row("positions", ",.0f")
    ),
    Quote(
        VLLM_PAGE,
        "| token positions in a no-grad pass (TRL's old log-probs) | {} | {} | {} |",
        VLLM,
        demo_row("no_grad_positions", ",.0f"),
    ),
    Quote(
        VLLM_PAGE,
        "| weight sync (s) | {} | {} | {} |",
        VLLM,
        lambda d: (
            f"{d['sync_seconds']['trl']:.3f}",
            f"{d['sync_seconds']['ours']:.3f}",
            f"{d['sync_seconds']['ours'] / d['sync_seconds']['trl']:.2f}",
        ),
    ),
    Quote(
        VLLM_PAGE,
        "| sync check (s, share of grpo_plus's step) | - | {} ({}) | |",
        VLLM,
        lambda d: (f"{d['sync_check_cost']['cost']:.3f}", f"{d['sync_check_share_of_step']:.1%}"),
    ),
    Quote(
        VLLM_PAGE,
        "from [`results/vllm.json`](results/vllm.json) ({} minutes of wall time",
        VLLM,
        lambda d: (f"{d['wall_minutes']:.1f}",),
    ),
    Quote(VLLM_PAGE, "The engine started in {} s", VLLM, lambda d: (f"{d['engine_start_seconds']:.0f}",)),
    Quote(
        VLLM_PAGE,
        "the same completion ids; losses {} apart",
        VLLM,
        lambda d: (sci(abs(demo(d, "trl")["losses"][0] - demo(d, "ours")["losses"][0])),),
    ),
    Quote(
        VLLM_PAGE,
        "(mean completion length over the 10 steps {} for TRL, {} for grpo_plus; {} of the groups dead",
        VLLM,
        lambda d: (mean_length(d, "trl"), mean_length(d, "ours"), f"{demo(d, 'ours')['dead_groups']:.0%}"),
    ),
    Quote(
        VLLM_PAGE,
        "| SmolLM2-135M + LoRA r=16 (`make bench-vllm`, training steps) | {} | {}-{} | {} (floor: not in "
        "the results file) | {} | {} s |",
        VLLM,
        receipts,
    ),
    Quote(
        "README.md",
        "whole demo step **{}×** stock TRL + vLLM (training pass {}×, generation {}×: on-policy no "
        "old-log-prob pass, where TRL's covers {} positions a step) on vLLM's CPU build, the sync check included ({} of "
        "the step)",
        VLLM,
        lambda d: (
            *(f"{demo(d, 'ours')[k] / demo(d, 'trl')[k]:.2f}" for k in ("step", "train_pass", "generation")),
            f"{demo(d, 'trl')['no_grad_positions']:,.0f}",
            f"{d['sync_check_share_of_step']:.1%}",
        ),
    ),
]


# ---- docs/guide/vllm.md and README.md: results/vllm_lora_sync.json --------------------------------------------------


def sync(data: dict, dtype: str, side: str) -> dict:
    return data["syncs"][dtype][side]


def sync_row(dtype: str, key: str, scale: float, spec: str) -> Callable[[dict], tuple]:
    def figures(data: dict) -> tuple:
        trl, ours = sync(data, dtype, "trl")[key], sync(data, dtype, "ours")[key]
        return format(trl / scale, spec), format(ours / scale, spec), f"{ours / trl:.2f}"

    return figures


def first_sync(trl: dict, ours: dict) -> tuple:
    return (
        f"{trl['first_seconds']:.3f}",
        f"{trl['first_bytes'] / MIB:.0f}",
        f"{ours['first_seconds']:.3f}",
        f"{ours['first_bytes'] / MIB:.0f}",
        f"{ours['first_seconds'] / trl['first_seconds']:.2f}",
        f"{ours['first_bytes'] / trl['first_bytes']:.2f}",
    )


LORA = "vllm_lora_sync.json"
QUOTES += [
    Quote(VLLM_PAGE, "| float32 base: seconds | {} | {} | **{}** |", LORA, sync_row("float32", "seconds", 1, ".3f")),
    Quote(
        VLLM_PAGE, "| float32 base: MiB streamed | {} | {} | **{}** |", LORA, sync_row("float32", "bytes", MIB, ".0f")
    ),
    Quote(VLLM_PAGE, "| bfloat16 base: seconds | {} | {} | **{}** |", LORA, sync_row("bfloat16", "seconds", 1, ".3f")),
    Quote(
        VLLM_PAGE,
        "| bfloat16 base: MiB streamed | {} | {} | **{}** |",
        LORA,
        sync_row("bfloat16", "bytes", MIB, ".0f"),
    ),
    Quote(
        VLLM_PAGE,
        "| nf4 base: seconds / MiB | cannot start (bitsandbytes) | {} / {} | |",
        LORA,
        lambda d: (f"{sync(d, 'nf4', 'ours')['seconds']:.3f}", f"{sync(d, 'nf4', 'ours')['bytes'] / MIB:.0f}"),
    ),
    Quote(
        VLLM_PAGE,
        "| first sync (full), float32 base: seconds / MiB | {} / {} | {} / {} | {} / {} |",
        LORA,
        lambda d: first_sync(sync(d, "float32", "trl"), sync(d, "float32", "ours")),
    ),
    Quote(
        VLLM_PAGE,
        "| frozen base moved after 8 syncs, bfloat16 (largest change) | {} | {} | |",
        LORA,
        lambda d: (sci(sync(d, "bfloat16", "trl")["base_moved"]), f"{sync(d, 'bfloat16', 'ours')['base_moved']:g}"),
    ),
    Quote(
        VLLM_PAGE,
        "| frozen base moved after 8 syncs, float32 | {} | {} | |",
        LORA,
        lambda d: (sci(sync(d, "float32", "trl")["base_moved"]), f"{sync(d, 'float32', 'ours')['base_moved']:g}"),
    ),
    Quote(
        VLLM_PAGE,
        "| engine vs trainer, mean abs log-prob difference, float32 / bfloat16 / nf4 | {} / {} / - | {} / {} / {} |",
        LORA,
        lambda d: (
            *(f"{sync(d, t, 'trl')['logp_gap']:.4f}" for t in ("float32", "bfloat16")),
            *(f"{sync(d, t, 'ours')['logp_gap']:.4f}" for t in ("float32", "bfloat16", "nf4")),
        ),
    ),
    Quote(
        VLLM_PAGE,
        "vLLM's LoRA generates in {} s against {} s for merged weights (**{}× slower**",
        LORA,
        lambda d: (
            f"{d['vllm_lora']['vllm_lora_generation']:.2f}",
            f"{d['vllm_lora']['merged_generation']:.2f}",
            f"{d['vllm_lora']['vllm_lora_generation'] / d['vllm_lora']['merged_generation']:.1f}",
        ),
    ),
    Quote(
        VLLM_PAGE,
        "loading the adapter takes {} s per sync",
        LORA,
        lambda d: (f"{d['vllm_lora']['vllm_lora_adapter_load']:.2f}",),
    ),
    Quote(
        "README.md",
        "per sync {}× TRL's time and {}× its bytes (float32 base), {}× (bfloat16)",
        LORA,
        lambda d: (
            sync_row("float32", "seconds", 1, "")(d)[2],
            sync_row("float32", "bytes", 1, "")(d)[2],
            sync_row("bfloat16", "seconds", 1, "")(d)[2],
        ),
    ),
    Quote(
        "README.md",
        "where TRL's merge/unmerge moves it ({} after 8 bf16 syncs)",
        LORA,
        lambda d: (sci(sync(d, "bfloat16", "trl")["base_moved"]),),
    ),
]


# ---- docs/guide/vllm.md: results/vllm_divergence_*.json -------------------------------------------------------------


def divergence_row(run: str) -> Callable[[dict], tuple]:
    def figures(data: dict) -> tuple:
        cells = [
            f"{s['loss']:.6f} · {'same' if s['same_completions'] else 'other'} · {s['weights_from_reference']:.0e} · "
            f"{s['sampler_trainer']:.1e}"
            for s in data["runs"][run]
        ]
        return (run, *cells)

    return figures


for dtype in ("bfloat16", "float32"):
    for run in results(f"vllm_divergence_{dtype}.json")["runs"]:
        QUOTES.append(
            Quote(VLLM_PAGE, "| {} | {} | {} | {} | {} |", f"vllm_divergence_{dtype}.json", divergence_row(run))
        )


# ---- docs/guide/rewards.md and README.md: results/reward_runner.json --------------------------------------------------


def stalled_figures(data: dict) -> tuple:
    stalled = data["stalled"]
    met = [step for step in stalled["steps"] if step["stalled_completions"]]
    return (
        f"{min(s['step_time_trl'] for s in stalled['steps']):.3f}",
        f"{max(s['step_time_trl'] for s in stalled['steps']):.3f}",
        f"{min(s['step_time_ours'] for s in met):.3f}",
        f"{max(s['step_time_ours'] for s in met):.3f}",
        len(met),
        min(s["stalled_completions"] for s in met),
        max(s["stalled_completions"] for s in met),
        f"{min(s['overhead_over_timeout'] for s in met):.3f}",
        f"{stalled['max_overhead_over_timeout']:.3f}",
        f"{stalled['median_overhead_over_timeout']:.3f}",
        f"{min(s['reward_seconds_over_timeout'] for s in met):.3f}",
        f"{stalled['max_reward_seconds_over_timeout']:.3f}",
    )


REWARDS = "reward_runner.json"
QUOTES += [
    Quote(
        "docs/guide/rewards.md",
        "`reward_timeout=2`: step time | {}-{} s | {}-{} s on the {} steps that met a stall ({}-{} "
        "of 8 completions stalled) | (step time - stock TRL's) / `reward_timeout`: {}-{}, median {} (target: at most "
        "1.05); the reward call alone {}-{} x the timeout |",
        REWARDS,
        stalled_figures,
    ),
    Quote(
        "docs/guide/rewards.md",
        "reward seconds per step | {} s (median of steps 2-6) | {} s | {} (target: at most 0.6); the step time {} |",
        REWARDS,
        lambda d: (
            f"{statistics.median(d['cpu']['reward_seconds_trl'][1:]):.3f}",
            f"{statistics.median(d['cpu']['reward_seconds_ours'][1:]):.3f}",
            f"{d['cpu']['reward_ratio']:.2f}",
            f"{d['cpu']['step_ratio']:.2f}",
        ),
    ),
    Quote(
        "docs/guide/rewards.md",
        "milliseconds per call | {} | {} |",
        REWARDS,
        lambda d: (f"{d['fast']['median_ms_trl']:.2f}", f"{d['fast']['median_ms_ours']:.2f}"),
    ),
    Quote(
        "README.md",
        "a stalled reward costs a step **{}-{}×** `reward_timeout` (median {}; target ≤ 1.05); a CPU-heavy "
        "reward takes **{}×** the serial time with 2 workers",
        REWARDS,
        lambda d: (*stalled_figures(d)[7:10], f"{d['cpu']['reward_ratio']:.2f}"),
    ),
]


# ---- docs/guide/benchmarks.md: results/fit_speed.json --------------------------------------------------------------


def fit_speed_row(config: str) -> Callable[[dict], tuple]:
    def figures(data: dict) -> tuple:
        run = data["configs"][config]
        old, new = run["old"]["count_seconds"], run["new"]["count_seconds"]
        answers = run["new"]["answers"]
        return (
            config,
            f"{old:.0f}",
            f"{new:.0f}",
            f"{old / new:.1f}",
            f"{run['new']['user_wall_seconds']:.0f}",
            "yes" if run["same_answers"] else "no",
            answers["longest"]["trl"],
            answers["longest"]["grpo_plus"],
            answers["largest_group"]["trl"],
            answers["largest_group"]["grpo_plus"],
        )

    return figures


QUOTES += [
    Quote(
        "docs/guide/benchmarks.md",
        "| `{}.yaml` | {} | {} | {}x | {} | {} | {} / {} | {} / {} |",
        "fit_speed.json",
        fit_speed_row(config),
    )
    for config in results("fit_speed.json")["configs"]
]


# ---- docs/guide/tasks.md and README.md: reasoning_gym_baselines.json, learning_per_minute.json ----------------------

QUOTES += [
    Quote(
        "docs/guide/tasks.md",
        "| `{}` | `{}` | {} | {} | {} | {} |",
        "reasoning_gym_baselines.json",
        lambda d, i=i: (
            d["tasks"][i]["task"],
            d["tasks"][i]["dataset_config"],
            d["tasks"][i]["prompts"]
            if d["tasks"][i]["task"] != "products"
            else f"{d['tasks'][i]['prompts']} (all it has)",
            *(f"{d['tasks'][i][k]:.3f}" for k in ("greedy_accuracy", "sampled_success", "sampled_answer_tag")),
        ),
    )
    for i in range(len(results("reasoning_gym_baselines.json")["tasks"]))
]


def learning(data: dict) -> dict:
    return data["summary"]


def equal_clock(data: dict, side: str) -> dict:
    clock = learning(data)["equal_wall_clock"]
    return {key: clock[key][side] for key in ("accuracy", "evaluated_at_step", "steps_done")}


LEARNING = "learning_per_minute.json"
TASKS_PAGE = "docs/guide/tasks.md"
QUOTES += [
    Quote(
        TASKS_PAGE,
        "[results/learning_per_minute.json](results/learning_per_minute.json), {} minutes of wall time",
        LEARNING,
        lambda d: (f"{d['wall_minutes']:.1f}",),
    ),
    Quote(
        TASKS_PAGE,
        "| training minutes for 30 steps | {} | {} (**{}x**) |",
        LEARNING,
        lambda d: (
            f"{learning(d)['training_minutes']['trl']:.2f}",
            f"{learning(d)['training_minutes']['ours']:.2f}",
            f"{learning(d)['training_time_ratio']:.2f}",
        ),
    ),
    Quote(
        TASKS_PAGE,
        "| median step (s) | {} | {} ({}x) |",
        LEARNING,
        lambda d: (
            f"{learning(d)['median_step_seconds']['trl']:.2f}",
            f"{learning(d)['median_step_seconds']['ours']:.2f}",
            f"{learning(d)['step_time_ratio']:.2f}",
        ),
    ),
    Quote(
        TASKS_PAGE,
        "| held-out accuracy before training | {} | {} |",
        LEARNING,
        lambda d: tuple(f"{learning(d)['accuracy_before'][s]:.3f}" for s in ("trl", "ours")),
    ),
    Quote(
        TASKS_PAGE,
        "| held-out accuracy after 30 steps | {} | {} |",
        LEARNING,
        lambda d: tuple(f"{learning(d)['accuracy_after'][s]:.3f}" for s in ("trl", "ours")),
    ),
    Quote(
        TASKS_PAGE,
        "| held-out accuracy at {} training minutes | {} ({} steps done, last evaluated at step {}) | **{}** ({} "
        "steps) |",
        LEARNING,
        lambda d: (
            f"{learning(d)['equal_wall_clock']['minutes']:.2f}",
            f"{equal_clock(d, 'trl')['accuracy']:.3f}",
            equal_clock(d, "trl")["steps_done"],
            equal_clock(d, "trl")["evaluated_at_step"],
            f"{equal_clock(d, 'ours')['accuracy']:.3f}",
            equal_clock(d, "ours")["steps_done"],
        ),
    ),
    Quote(
        TASKS_PAGE,
        "| training minutes to first reach {} (the best both reached, step 20) | {} | **{}** |",
        LEARNING,
        lambda d: (
            f"{learning(d)['best_accuracy_both_reached']:.3f}",
            *(f"{learning(d)['minutes_to_reach_it'][s]:.2f}" for s in ("trl", "ours")),
        ),
    ),
    Quote(
        "README.md",
        "the same 30 steps in **{}×** the training minutes ({} → {} min); at {} minutes held-out accuracy {} "
        "for grpo_plus, {} for stock TRL (still at its start); the best accuracy both reach ({}) in {} minutes against {}",
        LEARNING,
        lambda d: (
            f"{learning(d)['training_time_ratio']:.2f}",
            *(f"{learning(d)['training_minutes'][s]:.1f}" for s in ("trl", "ours")),
            f"{learning(d)['equal_wall_clock']['minutes']:.1f}",
            f"{equal_clock(d, 'ours')['accuracy']:.3f}",
            f"{equal_clock(d, 'trl')['accuracy']:.3f}",
            f"{learning(d)['best_accuracy_both_reached']:.3f}",
            *(f"{learning(d)['minutes_to_reach_it'][s]:.1f}" for s in ("ours", "trl")),
        ),
    ),
]


# ---- docs/guide/memory.md and README.md: results/memory_real*.json ---------------------------------------------------


def positions_and_tiles(data: dict, row: dict) -> tuple[str, int]:
    """A row's training-forward positions (rows x (prompt + L)) and the tiled MLP's 4,096-position tiles over them."""
    positions = data["rows"] * (data["prompt"] + row["length"])
    return f"{positions:,}", math.ceil(positions / 4096)


def counted_over_real(data: dict) -> list[float]:
    return [
        run["counted"] / run["increment"] for row in data["results"] for run in (row["TRL"], row["grpo_plus default"])
    ]


def memory_row(index: int) -> Callable[[dict], tuple]:
    def figures(data: dict) -> tuple:
        row = data["results"][index]
        trl, ours = row["TRL"], row["grpo_plus default"]
        return (
            f"{row['length']:,}",
            mib(trl["increment"]),
            f"{ours['increment'] / trl['increment']:.3f}",
            *positions_and_tiles(data, row),
            f"{trl['grad_norm']:.8g}",
            f"{ours['grad_norm']:.8g}",
            f"{trl['counted'] / trl['increment']:.3f}",
            f"{ours['counted'] / ours['increment']:.3f}",
        )

    return figures


MEMORY_PAGE, MEMORY = "docs/guide/memory.md", "memory_real.json"
QUOTES += [
    Quote(
        MEMORY_PAGE,
        "| {} | {} MiB | **{}x** ({} positions: tiled, {} tiles) | {} / {} | {}, {} |",
        MEMORY,
        memory_row(0),
    ),
    Quote(MEMORY_PAGE, "| {} | {} MiB | **{}x** ({} positions: {} tiles) | {} / {} | {}, {} |", MEMORY, memory_row(1)),
    Quote(MEMORY_PAGE, "| {} | {} MiB | **{}x** ({} positions: {} tiles) | {} / {} | {}, {} |", MEMORY, memory_row(2)),
    Quote(
        MEMORY_PAGE,
        "the same passes read {} / {}, {} / {} and {} / {} MiB (its counts: {}-{} of them)",
        "memory_real_rss_without_perturb.json",
        lambda d: (
            *(mib(row[side]["increment"]) for row in d["results"] for side in ("TRL", "grpo_plus default")),
            f"{min(counted_over_real(d)):.3f}",
            f"{max(counted_over_real(d)):.3f}",
        ),
    ),
    Quote(
        "README.md",
        "step increment **{}×** stock TRL at 4,096-token completions, **{}×** at 2,048, **{}×** at 1,024",
        MEMORY,
        lambda d: tuple(
            f"{r['grpo_plus default']['increment'] / r['TRL']['increment']:.2f}" for r in d["results"][::-1]
        ),
    ),
]


def step_time_row(index: int) -> Callable[[dict], tuple]:
    def figures(data: dict) -> tuple:
        row = data["results"][index]
        tiled, whole = row["grpo_plus default"], row["grpo_plus, tiled MLP off"]
        return (
            f"{row['length']:,}",
            *positions_and_tiles(data, row),
            f"{tiled['seconds']:.1f}",
            mib(tiled["increment"]),
            f"{whole['seconds']:.1f}",
            mib(whole["increment"]),
            f"{tiled['seconds'] / whole['seconds']:.2f}",
            f"{tiled['increment'] / whole['increment']:.2f}",
            f"{tiled['grad_norm']:.8g}" if f"{tiled['grad_norm']:.8g}" == f"{whole['grad_norm']:.8g}" else "differ",
        )

    return figures


def tile_row(variant: str) -> Callable[[dict], tuple]:
    def figures(data: dict) -> tuple:
        (row,) = data["results"]
        run = row[variant]
        return (
            mib(run["increment"]),
            f"{run['increment'] / row['TRL']['increment']:.3f}",
            f"{run['seconds']:.1f}",
            f"{run['grad_norm']:.8g}",
            f"{run['counted'] / run['increment']:.3f}",
        )

    return figures


TILE = "memory_real_trl_lm_head_tile.json"
QUOTES += [
    Quote(
        MEMORY_PAGE,
        "| {} | {} ({} tiles) | {} s, {} MiB | {} s, {} MiB | **{}x** | {}x | {} |",
        "memory_real_step_time.json",
        step_time_row(i),
    )
    for i in range(len(results("memory_real_step_time.json")["results"]))
] + [
    Quote(MEMORY_PAGE, "| stock TRL | {} MiB | {}x | {} s | {} | {} |", TILE, tile_row("TRL")),
    Quote(
        MEMORY_PAGE, "| grpo_plus default | {} MiB | **{}x** | {} s | {} | {} |", TILE, tile_row("grpo_plus default")
    ),
    Quote(
        MEMORY_PAGE,
        "| grpo_plus, `lm_head_tile_columns=None` | {} MiB | {}x | {} s | {} | {} |",
        TILE,
        tile_row("grpo_plus, TRL's LM-head tile"),
    ),
    Quote(
        "README.md",
        "with TRL's own 32,768-column tile on a CPU, **{}×** at 1,024",
        TILE,
        lambda d: (f"{d['results'][0]['grpo_plus default']['increment'] / d['results'][0]['TRL']['increment']:.2f}",),
    ),
    Quote(
        MEMORY_PAGE,
        "`grpo_plus.fit` counts every real peak above within {}% ({}-{} of it",
        MEMORY,
        lambda d: (
            f"{100 * (1 - min(counted_over_real(d))):.1f}",
            f"{min(counted_over_real(d)):.3f}",
            f"{max(counted_over_real(d)):.3f}",
        ),
    ),
    Quote(
        "README.md",
        "`grpo-plus fit`'s count within {}% of every real peak",
        MEMORY,
        lambda d: (f"{100 * (1 - min(counted_over_real(d))):.1f}",),
    ),
]


# ---- docs/guide/long-completions.md and README.md: results/memory_counted.json ----------------------------------------


def fit_row(index: int) -> Callable[[dict], tuple]:
    def figures(data: dict) -> tuple:
        row = data["fit"][index]
        trl, ours = row["trl"], row["grpo_plus"]
        batch = f"its batch ({row['rows']} rows)" if row["batch"] == "its batch" else row["batch"]
        binds = "context window" if ours["longest"] == row["context_limit"] else ours["binding"]
        return (
            row["config"],
            batch,
            f"{trl['at_settings'] / GIB:.2f}",
            f"{ours['at_settings'] / GIB:.2f}",
            trl["longest"],
            ours["longest"],
            f"{ours['longest'] / trl['longest']:.2f}",
            binds,
        )

    return figures


COUNTED = "memory_counted.json"
ROUTING = "routing_replay.json"


def routing_row(setting: str):
    def figures(data: dict) -> tuple:
        row = data["mismatch"][setting]
        return f"{row['route_flips']:.4f}", sci(row["k3_kl"]), f"{row['tokens']:,}"

    return figures


QUOTES += [
    Quote("docs/guide/moe.md", "| off | {} | {} | {} |", ROUTING, routing_row("off")),
    Quote("docs/guide/moe.md", "| on | {} | {} | {} |", ROUTING, routing_row("replay")),
]

QUOTES += [
    Quote("docs/guide/long-completions.md", "| `{}.yaml` | {} | {} / {} | {} | {} | {}x | {} |", COUNTED, fit_row(i))
    for i in range(len(results(COUNTED)["fit"]))
]


def longest(data: dict, config: str) -> tuple[int, int]:
    row = next(r for r in data["fit"] if r["config"] == config and r["batch"] == "its batch")
    return row["trl"]["longest"], row["grpo_plus"]["longest"]


QUOTES.append(
    Quote(
        "README.md",
        "Qwen2.5-1.5B LoRA **{:,} → {:,}** tokens (≥ {}×: the context window binds), 7B QLoRA **{:,} → {:,}** "
        "(**{}×**)",
        COUNTED,
        lambda d: (
            *longest(d, "qwen2.5-1.5b_lora"),
            f"{longest(d, 'qwen2.5-1.5b_lora')[1] / longest(d, 'qwen2.5-1.5b_lora')[0]:.2f}",
            *longest(d, "qwen2.5-7b_qlora"),
            f"{longest(d, 'qwen2.5-7b_qlora')[1] / longest(d, 'qwen2.5-7b_qlora')[0]:.2f}",
        ),
    )
)


ROUTING_STEPS = "routing_replay_steps.json"


def routing_step_row(setting: str):
    def figures(data: dict) -> tuple:
        row = data["step_time"][setting]
        return (
            setting,
            f"{row['wall_s']:.3f}",
            f"{row['wall_over_off']:.3f}",
            f"{row['cpu_s']:.3f}",
            f"{row['cpu_over_off']:.3f}",
        )

    return figures


def routing_step_runs(setting: str):
    def figures(data: dict) -> tuple:
        return (*routing_step_row(setting)(data), " ".join(f"{run[setting]['wall_over_off']:.3f}x"
                                                            for run in data["step_time_runs"]))  # fmt: skip

    return figures


QUOTES += [
    Quote("docs/guide/moe.md", "| {} | {} | {}x | {} | {}x | {} |", ROUTING_STEPS, routing_step_runs(setting))
    for setting in ("off", "receipt", "replay")
]


ASYNC_MISMATCH = "async_generation_mismatch.json"
MISMATCH_KEYS = ("sampling_logp_difference/mean", "sampling_logp_difference/max", "importance_sampling_ratio/min",
                 "importance_sampling_ratio/mean", "importance_sampling_ratio/max")  # fmt: skip


def mismatch_row(side: str):
    def gap(x: float) -> str:
        return f"{x:.2g}" if abs(x) < 0.01 else f"{x:.3g}"

    def ratio(x: float) -> str:
        return f"{x:.5f}" if abs(x - 1) < 1e-3 else f"{x:.3f}"

    def figures(data: dict) -> tuple:
        metrics = data["summary"]["0"]["mismatch"][side]
        values = [metrics[f"sampling/{key}"] for key in MISMATCH_KEYS]
        return (*map(gap, values[:2]), *map(ratio, values[2:]))

    return figures


QUOTES += [
    Quote("docs/guide/async-generation.md", "| TRL's loop (on-policy) | {} | {} | {} | {} | {} |", ASYNC_MISMATCH,
          mismatch_row("sync")),
    Quote("docs/guide/async-generation.md", "| asynchronous, `max_staleness=1` | {} | {} | {} | {} | {} |",
          ASYNC_MISMATCH, mismatch_row("async")),
]  # fmt: skip


PARTIAL_LEARNING = "partial_rollouts_learning.json"


def partial_learning_row(step: int):
    def figures(data: dict) -> tuple:
        sides = data["learning"]["sides"]
        return tuple(
            figure
            for side in ("ours", "partial")
            for figure in (
                f"{sides[side]['reward_mean'][step]:.3f}",
                f"{sides[side]['reward_low'][step]:.2f}",
                f"{sides[side]['reward_high'][step]:.2f}",
            )
        )

    return figures


def partial_learning_accuracy(data: dict) -> tuple:
    sides = data["learning"]["sides"]
    return tuple(f"{accuracy:.3f}" for side in ("ours", "partial") for accuracy in sides[side]["held_out_accuracy"])


QUOTES += [
    Quote("docs/guide/async-generation.md", f"| {step} | {{}} ({{}}-{{}}) | {{}} ({{}}-{{}}) |", PARTIAL_LEARNING,
          partial_learning_row(step))
    for step in (0, 4, 8, 12, 15)
] + [
    Quote("docs/guide/async-generation.md",
          "| held-out accuracy after step 16, seeds 0 / 1 / 2 | {} / {} / {} | {} / {} / {} |", PARTIAL_LEARNING,
          partial_learning_accuracy),
]  # fmt: skip


def partial_row(data: dict) -> tuple:
    run = data["summary"]["0"]
    medians, accuracy = run["medians"], run["held_out_accuracy"]
    return (
        0, *(f"{medians[side]['generation']:.2f}" for side in ("trl", "ours", "partial")),
        f"{run['generation_ratio_vs_trl']:.2f}", f"{run['generation_ratio_vs_ours']:.2f}",
        *(f"{medians[side]['step']:.2f}" for side in ("trl", "ours", "partial")),
        *(f"{accuracy[side]:.3f}" for side in ("trl", "ours", "partial")),
    )  # fmt: skip


QUOTES.append(
    Quote(
        "docs/guide/async-generation.md",
        "| {} | {} | {} | {} | {}x | **{}x** | {} | {} | {} | {} / {} / {} |",
        "partial_rollouts.json",
        partial_row,
    )
)
PARTIAL_VLLM = "partial_rollouts_vllm.json"


def partial_vllm_row(data: dict) -> tuple:
    run = data["summary"]["0"]
    medians, accuracy = run["medians"], run["held_out_accuracy"]
    return (
        0, f"{medians['ours']['generation']:.2f}", f"{medians['partial']['generation']:.2f}",
        f"{run['generation_ratio_vs_ours']:.2f}", f"{medians['ours']['step']:.2f}", f"{medians['partial']['step']:.2f}",
        f"{accuracy['ours']:.3f}", f"{accuracy['partial']:.3f}",
    )  # fmt: skip


def partial_vllm_totals(data: dict) -> tuple:
    (run,) = data["runs"]
    partial, ours = (sum(run[side]["generation_seconds"]) for side in ("partial", "ours"))
    return (
        f"{data['summary']['0']['generation_ratio_vs_ours']:.2f}",
        f"{partial / ours:.2f}",
        f"{partial:.0f}",
        f"{ours:.0f}",
    )


QUOTES += [
    Quote("docs/guide/async-generation.md", "| {} | {} | {} | **{}x** | {} | {} | {} / {} |", PARTIAL_VLLM,
          partial_vllm_row),
    Quote("README.md", "with colocated vLLM on this CPU {}x (its decode steps", PARTIAL_VLLM,
          lambda data: (f"{data['summary']['0']['generation_ratio_vs_ours']:.2f}",)),
    Quote("docs/guide/async-generation.md", "partial rollouts there take {}x the synchronous generation (median per "
          "step), {}x in total over the 8 steps ({} s against {} s)", PARTIAL_VLLM, partial_vllm_totals),
]  # fmt: skip
DECODE_COST = "vllm_decode_cost.json"


def decode_case(index: int) -> Callable[[dict], tuple]:
    def figures(data: dict) -> tuple:
        case = data["cases"][index]
        return (
            case["case"], case["dtype"].removeprefix("torch."), case["block_size"], f"{case['decode_ms_1_row']:.0f}",
            f"{case['decode_ms_16_rows']:.0f}", f"{case['prefill_s']:.2f}", f"{case['resend_s']:.2f}",
        )  # fmt: skip

    return figures


def decode_cost_findings(data: dict) -> tuple:
    auto, float32_128, float32_32 = data["cases"]
    return (
        f"{float32_32['decode_ms_1_row'] / float32_32['decode_ms_16_rows']:.2f}",
        f"{float32_128['resend_s']:.2f}", f"{float32_32['resend_s']:.2f}", f"{float32_32['prefill_s']:.2f}",
        f"{auto['decode_ms_16_rows']:.0f}", f"{float32_128['decode_ms_16_rows']:.0f}",
    )  # fmt: skip


QUOTES += [
    *(Quote("docs/guide/async-generation.md", "| {} | {} | {} | {} | {} | {} | {} |", DECODE_COST, decode_case(i))
      for i in range(3)),
    Quote("docs/guide/async-generation.md", "in float32 a step with 1 row costs {} of a step with 16", DECODE_COST,
          lambda data: decode_cost_findings(data)[:1]),
    Quote("docs/guide/async-generation.md", "a chunk re-sent its rows in {} s, with 32-token blocks in {} s (a prefill "
          "of the same rows: {} s)", DECODE_COST, lambda data: decode_cost_findings(data)[1:4]),
    Quote("docs/guide/async-generation.md", "computes a bfloat16 step with 16 rows in {} ms against {} ms in float32",
          DECODE_COST, lambda data: decode_cost_findings(data)[4:]),
]  # fmt: skip
QUOTES.append(
    Quote(
        "README.md",
        "measured on one seed: generation {}x the synchronous run's per step",
        "partial_rollouts.json",
        lambda data: (f"{data['summary']['0']['generation_ratio_vs_ours']:.2f}",),
    )
)


def speculative_case(index: int) -> Callable[[dict], tuple]:
    def figures(data: dict) -> tuple:
        case = data["cases"][index]
        plain, ours = case["plain"], case["speculative"]
        return (
            case["task"], f"{case['new_tokens']:,}", f"{plain['seconds']:.1f}", f"{ours['seconds']:.1f}",
            f"{ours['seconds'] / plain['seconds']:.2f}", f"{plain['forwards']:,}", f"{ours['forwards']:,}",
            f"{plain['positions']:,}", f"{ours['positions']:,}", f"{ours['tokens_per_row_forward']:.2f}",
            f"{ours['acceptance_rate']:.2f}", f"{plain['mean_length']:.0f}", f"{ours['mean_length']:.0f}",
            f"{case['speedup_tokens_per_second']:.2f}",
        )  # fmt: skip

    return figures


SPECULATIVE_ROW = "| {} | {} | {} | {} | {} | {} / {} | {} / {} | {} | {} | {} / {} | **{}** |"
QUOTES += [
    Quote("docs/guide/speculative-rollouts.md", SPECULATIVE_ROW, name, speculative_case(index))
    for name in ("speculative_rollouts.json", "speculative_rollouts_1024.json")
    for index in range(2)
] + [
    Quote(
        "docs/guide/speculative-rollouts.md", SPECULATIVE_ROW, "speculative_rollouts_gsm8k.json", speculative_case(0)
    )
]

SPECULATIVE_ACCURACY = "speculative_accuracy.json"


def speculative_accuracy_row(index: int) -> Callable[[dict], tuple]:
    """One evaluated step of the accuracy part: each side's accuracy per seed and mean, and whether each side's mean
    lies within the other side's seeds (recomputed from the per-seed accuracies)."""

    def figures(data: dict) -> tuple:
        row = data["summary"]["per_step"][index]
        plain, ours = row["plain"]["per_seed"], row["speculative"]["per_seed"]

        def within(value: float, seeds: list[float]) -> str:
            return "yes" if min(seeds) - 1e-12 <= value <= max(seeds) + 1e-12 else "**no**"

        return (
            row["step"], " / ".join(f"{a:.3f}" for a in plain), " / ".join(f"{a:.3f}" for a in ours),
            f"{statistics.fmean(plain):.3f}", f"{statistics.fmean(ours):.3f}",
            within(statistics.fmean(ours), plain), within(statistics.fmean(plain), ours),
        )  # fmt: skip

    return figures


QUOTES += [
    Quote(
        "docs/guide/speculative-rollouts.md",
        "| {} | {} | {} | {} | {} | {} | {} |",
        SPECULATIVE_ACCURACY,
        speculative_accuracy_row(index),
    )  # fmt: skip
    for index in range(len(results(SPECULATIVE_ACCURACY)["summary"]["per_step"]))
]
QUOTES.append(
    Quote(
        "docs/guide/speculative-rollouts.md",
        "the speculative side kept {} of its drafted tokens ({} tokens per row forward); the mean training reward was"
        " {} plain, {} speculative",
        SPECULATIVE_ACCURACY,
        lambda data: (
            f"{data['summary']['speculative_acceptance_rate']:.2f}",
            f"{data['summary']['speculative_tokens_per_row_forward']:.2f}",
            *(f"{data['summary']['mean_reward'][side]:.3f}" for side in ("plain", "speculative")),
        ),
    )
)


def step_4_outside(data: dict) -> tuple:
    row = data["summary"]["per_step"][1]
    ours = row["speculative"]["per_seed"]
    return row["step"], f"{statistics.fmean(row['plain']['per_seed']):.3f}", f"{min(ours):.3f}", f"{max(ours):.3f}"


QUOTES.append(
    Quote(
        "docs/guide/speculative-rollouts.md",
        "but not at step {} ({} against speculation's {}-{})",
        SPECULATIVE_ACCURACY,
        step_4_outside,
    )
)

# ---- the checks --------------------------------------------------------------------------------------------------------


def mismatch(quote: Quote, data: dict) -> str | None:
    """None if the page says what `data` says; else the expected text and the page's line that starts like it."""
    expected = flat(quote.expected(data))
    if expected in page_text(quote.page):
        return None
    start = flat(quote.text.split("{}")[0]).strip() or expected[:40]
    lines = [line for line in (ROOT / quote.page).read_text(encoding="utf-8").splitlines() if start in flat(line)]
    return f"{quote.page} should read, from results/{quote.results}:\n  {expected}\nit has:\n  " + "\n  ".join(
        lines or ["(no line with " + repr(start) + ")"]
    )


def moved(value, path: str = ""):
    """`value` (a results file's JSON) with every number moved by its own factor, 1.1-1.5 (ratios of two figures move
    too), drawn from its place in the file and `path`'s start: what a re-run that changed every figure would write."""
    if isinstance(value, dict):
        return {key: moved(item, f"{path}/{key}") for key, item in value.items()}
    if isinstance(value, list):
        return [moved(item, f"{path}/{i}") for i, item in enumerate(value)]
    if isinstance(value, bool) or not isinstance(value, int | float):
        return value
    factor = 1.1 + 0.4 * (zlib.crc32(path.encode()) % 1000) / 1000
    return value * factor if isinstance(value, float) else round(value * factor)


@pytest.mark.parametrize("quote", QUOTES, ids=lambda quote: quote.id)
def test_the_page_quotes_its_results_file(quote):
    problem = mismatch(quote, results(quote.results))
    assert problem is None, problem


@pytest.mark.parametrize("quote", QUOTES, ids=lambda quote: quote.id)
def test_a_moved_figure_fails_the_quote(quote):
    """The negative control: with the results file's numbers changed, the same check fails (with one of three sets of
    changes: a ratio of two moved figures can round to the same digits once)."""
    assert any(mismatch(quote, moved(results(quote.results), f"run{run}")) is not None for run in range(3))


def test_every_results_file_the_docs_link_is_checked():
    linked = set()
    for page in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]:
        linked |= set(re.findall(r"results/([\w.-]+\.json)", page.read_text(encoding="utf-8")))
    assert linked - {quote.results for quote in QUOTES} == set()
