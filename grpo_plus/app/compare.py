"""Run several named GRPO configurations on the same task, seeds and budget; report curves and a table.

`grpo-plus compare` (grpo_plus/app/cli.py) and benchmarks/sample_efficiency.py are built on `run_configuration`.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from . import tasks
from .embedded import EMBEDDED_MODEL_NAME, resolve_model
from .recipe import resolve_reward_funcs

# Named configurations: GRPOConfig overrides on top of BASE_SETTINGS.
PRESETS: dict[str, dict[str, Any]] = {
    "grpo": dict(loss_type="grpo", scale_rewards="group"),
    "dr_grpo": dict(loss_type="dr_grpo", scale_rewards="none"),
    "dapo_clip_higher": dict(loss_type="dapo", epsilon_high=0.28),
    "dapo_dynamic_sampling": dict(loss_type="dapo", epsilon_high=0.28, dynamic_sampling=True),
    # GSPO's ratio only differs from 1 off-policy: two optimizer steps per generation batch.
    "gspo": dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4,
                 steps_per_generation=2),
    # Advantage estimators (verl's names), each against "grpo": only the baseline / scale changes.
    "rloo": dict(loss_type="grpo", advantage_estimator="rloo", scale_rewards="none"),
    "reinforce_plus_plus": dict(loss_type="grpo", advantage_estimator="reinforce_plus_plus"),
    "reinforce_plus_plus_baseline": dict(loss_type="grpo", advantage_estimator="reinforce_plus_plus_baseline"),
    "grpo_passk": dict(loss_type="grpo", advantage_estimator="grpo_passk", scale_rewards="none"),
    "opo": dict(loss_type="grpo", advantage_estimator="opo", scale_rewards="none"),
    "remax": dict(loss_type="grpo", advantage_estimator="remax", scale_rewards="none"),
    "gpg": dict(loss_type="dapo", advantage_estimator="gpg", policy_loss="gpg", scale_rewards="none"),
    # Policy losses. On-policy (one optimizer step per generation batch) every ratio is 1 and GMPO's gradient is
    # GRPO's, so the ratio-based ones take two steps per generation batch, as gspo does.
    "gmpo": dict(loss_type="grpo", policy_loss="gmpo", epsilon=0.4, epsilon_high=0.4, steps_per_generation=2),
    "clip_cov": dict(loss_type="grpo", policy_loss="clip_cov", steps_per_generation=2),
    "kl_cov": dict(loss_type="grpo", policy_loss="kl_cov", steps_per_generation=2),
    "cispo": dict(loss_type="dapo", policy_loss="cispo", epsilon_high=5.0, steps_per_generation=2),
    "sapo": dict(loss_type="grpo", policy_loss="sapo", steps_per_generation=2),
    "grpo_two_steps": dict(loss_type="grpo", scale_rewards="group", steps_per_generation=2),
}  # fmt: skip
# What `grpo-plus compare` runs when no --configs are given (the algorithm presets are chosen by name).
DEFAULT_PRESETS = ("grpo", "dr_grpo", "dapo_clip_higher", "dapo_dynamic_sampling", "gspo")

# A CPU-sized run of the embedded model: 2 prompts x 8 completions per optimizer step, LoRA r=16.
BASE_SETTINGS: dict[str, Any] = dict(
    per_device_train_batch_size=16,
    num_generations=8,
    max_completion_length=24,
    temperature=0.7,
    learning_rate=3e-4,
    lr_scheduler_type="constant",
    reward_weights=[1.0, 0.5],
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    use_cpu=True,
    bf16=False,
    gradient_checkpointing=False,
    disable_tqdm=True,
)


@dataclass
class RunResult:
    """One configuration x seed: its Trainer log history and held-out accuracy over training."""

    name: str
    seed: int
    log_history: list[dict[str, Any]]
    wall_seconds: float
    train_cpu_minutes: float
    extra: dict[str, Any] = field(default_factory=dict)

    def evals(self) -> list[dict[str, Any]]:
        return [entry for entry in self.log_history if "eval_accuracy" in entry]

    def mean_of(self, key: str) -> float | None:
        values = [entry[key] for entry in self.log_history if isinstance(entry.get(key), (int, float))]
        return statistics.fmean(values) if values else None


class HeldOutCurve(TrainerCallback):
    """Logs held-out greedy accuracy every `every` steps against training CPU time; stops at a CPU budget.

    CPU time is this process's (all threads), minus the time spent evaluating, so "accuracy per CPU-minute"
    counts training work only.
    """

    def __init__(self, dataset, tokenizer, every: int, max_new_tokens: int, max_cpu_minutes: float | None = None):
        self.dataset, self.tokenizer, self.every, self.max_new_tokens = dataset, tokenizer, every, max_new_tokens
        self.max_cpu_minutes = max_cpu_minutes
        self.start = self.eval_cpu = 0.0

    def cpu_minutes(self) -> float:
        return (time.process_time() - self.start - self.eval_cpu) / 60

    def _evaluate(self, model, state) -> None:
        before = time.process_time()
        result = tasks.evaluate(
            model, self.tokenizer, self.dataset, max_new_tokens=self.max_new_tokens, progress=False
        )
        self.eval_cpu += time.process_time() - before
        state.log_history.append(
            {
                "step": state.global_step,
                "eval_accuracy": result["accuracy"],
                "eval_format_rate": result["format_rate"],
                "train_cpu_minutes": self.cpu_minutes(),
            }
        )

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.start, self.eval_cpu = time.process_time(), 0.0
        self._evaluate(model, state)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        over_budget = self.max_cpu_minutes is not None and self.cpu_minutes() >= self.max_cpu_minutes
        if over_budget:
            control.should_training_stop = True
        if over_budget or state.global_step % self.every == 0 or state.global_step >= state.max_steps:
            self._evaluate(model, state)


def run_configuration(
    name: str,
    overrides: Mapping[str, Any],
    *,
    seed: int,
    output_dir: str | Path,
    model: str = EMBEDDED_MODEL_NAME,
    task_level: str = tasks.BENCHMARK_LEVEL,
    max_steps: int = 12,
    eval_every: int = 4,
    eval_size: int | None = 32,
    max_cpu_minutes: float | None = None,
    stock_trl: bool = False,
    lora_r: int = 16,
    reward_funcs: Sequence[str] = ("correctness", "format"),
    train_size: int | None = None,
) -> RunResult:
    """Train one configuration with LoRA on the built-in task; held-out accuracy is logged along the way."""
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if stock_trl:
        from trl import GRPOConfig, GRPOTrainer
    else:
        from ..config import GRPOConfig
        from ..trainer import GRPOTrainer

    path = resolve_model(model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    train = tasks.make_dataset("train", task_level, size=train_size, seed=seed)  # None: the level's whole split
    held_out = tasks.make_dataset("test", task_level, size=eval_size)
    settings = {**BASE_SETTINGS, **overrides, "seed": seed, "max_steps": max_steps, "output_dir": str(output_dir)}
    if list(reward_funcs) != ["correctness", "format"]:
        settings.pop("reward_weights")  # BASE_SETTINGS' weights are for the two default rewards
    curve = HeldOutCurve(held_out, tokenizer, eval_every, settings["max_completion_length"], max_cpu_minutes)
    trainer = GRPOTrainer(
        model=policy,
        reward_funcs=resolve_reward_funcs(list(reward_funcs)),
        args=GRPOConfig(**settings),
        train_dataset=train,
        processing_class=tokenizer,
        peft_config=LoraConfig(r=lora_r, lora_alpha=2 * lora_r, target_modules="all-linear", task_type="CAUSAL_LM"),
        callbacks=[curve],
    )
    started = time.perf_counter()
    trainer.train()
    return RunResult(name, seed, trainer.state.log_history, time.perf_counter() - started, curve.cpu_minutes())


def parse_configuration(spec: str) -> tuple[str, dict[str, Any]]:
    """'dapo_clip_higher' or 'name:preset+key=value,key=value' -> (name, GRPOConfig overrides)."""
    name, _, rest = spec.partition(":")
    if not rest:
        if name not in PRESETS:
            raise ValueError(f"Unknown configuration {name!r}; presets: {', '.join(PRESETS)} (or name:key=value,...).")
        return name, dict(PRESETS[name])
    base, _, assignments = rest.rpartition("+") if "+" in rest else ("", "", rest)
    if base and base not in PRESETS:
        raise ValueError(f"Configuration {spec!r}: unknown preset {base!r}; presets: {', '.join(PRESETS)}.")
    overrides = dict(PRESETS[base]) if base else {}
    for assignment in filter(None, assignments.split(",")):
        key, _, value = assignment.partition("=")
        overrides[key.strip()] = _literal(value.strip())
    return name, overrides


def check_configuration(name: str, overrides: Mapping[str, Any]) -> None:
    """Build the GRPOConfig a run would use, so a bad field or value fails before any configuration trains."""
    import dataclasses

    from ..config import GRPOConfig
    from ..registry import did_you_mean

    fields = [f.name for f in dataclasses.fields(GRPOConfig)]
    for key in overrides:
        if key not in fields:
            raise ValueError(f"Configuration {name!r}: {key!r} is not a GRPOConfig field.{did_you_mean(key, fields)}")
    try:
        GRPOConfig(**{**BASE_SETTINGS, **overrides, "output_dir": "unused", "max_steps": 1})
    except ValueError as error:
        raise ValueError(f"Configuration {name!r}: {error}") from error


def _literal(value: str) -> Any:
    """JSON numbers, booleans, null and lists as such; anything else as the string itself."""
    try:
        return json.loads(value)
    except ValueError:
        return value


def summary_rows(results: Sequence[RunResult]) -> list[dict[str, Any]]:
    """One row per configuration, averaged over seeds."""
    rows = []
    for name in dict.fromkeys(r.name for r in results):
        runs = [r for r in results if r.name == name]

        def mean(values):
            values = [v for v in values if v is not None]
            return statistics.fmean(values) if values else float("nan")

        rows.append(
            {
                "configuration": name,
                "seeds": len(runs),
                "held-out acc before": mean(r.evals()[0]["eval_accuracy"] for r in runs if r.evals()),
                "held-out acc after": mean(r.evals()[-1]["eval_accuracy"] for r in runs if r.evals()),
                "mean reward": mean(r.mean_of("reward") for r in runs),
                "completion length": mean(r.mean_of("completions/mean_length") for r in runs),
                "clip fraction": mean(r.mean_of("clip_ratio/region_mean") for r in runs),
                "zero-std groups": mean(r.mean_of("frac_reward_zero_std") for r in runs),
                "train CPU min": mean(r.train_cpu_minutes for r in runs),
            }
        )
    return rows


def markdown_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """GitHub markdown table of `summary_rows`."""
    headers = list(rows[0])
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in rows:
        cells = [f"{v:.3f}" if isinstance(v, float) else str(v) for v in row.values()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_report(results: Sequence[RunResult], output_dir: str | Path, title: str) -> dict[str, Path]:
    """compare.png (curves per configuration), compare.md (table), runs.json (raw log histories)."""
    from .plotting import plot_comparison

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    histories = {f"{r.name} (seed {r.seed})" if _many_seeds(results) else r.name: r.log_history for r in results}
    png = output_dir / "compare.png"
    plot_comparison(histories, png, title=title)
    md = output_dir / "compare.md"
    md.write_text(f"# {title}\n\n{markdown_table(summary_rows(results))}\n\n![curves](compare.png)\n")
    raw = output_dir / "runs.json"
    raw.write_text(json.dumps([r.__dict__ for r in results], default=str))
    return {"png": png, "markdown": md, "runs": raw}


def _many_seeds(results: Sequence[RunResult]) -> bool:
    return len({r.seed for r in results}) > 1
