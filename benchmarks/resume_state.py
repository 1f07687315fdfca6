"""What trajectory-exact resume adds to a checkpoint: bytes per part and per file, against the checkpoint stock TRL
writes for the same run, and the time to write them.

Run from the repo root:  .venv/bin/python benchmarks/resume_state.py [--smoke] [--json PATH]

Each case trains one optimizer step with grpo_plus and with stock trl.GRPOTrainer (same model, data, config, seed)
and saves a checkpoint there, which lies inside a generation batch when steps_per_generation > gradient accumulation
(the generation buffer then holds the batch's remaining micro-batches). Cases:
  tiny         the random 2-layer Llama of tests/helpers/models.py, 4 rows x 4 micro-batches (--smoke runs only it)
  demo         SmolLM2-135M-Instruct + LoRA r=16 all-linear on the add-1d task: recipes/configs/demo_cpu.yaml's
               batch (16 rows, 8 generations, <= 20 new tokens), one micro-batch per generation batch
  demo-buffer  the same with steps_per_generation=4, gradient_accumulation_steps=2: 64 rows buffered
The smollm cases are skipped, saying why, when the embedded model is unavailable.

A part's bytes are those of torch.save of its state alone; the files hold every part plus a small header.
"""

from __future__ import annotations

import io
import tempfile
import time
from pathlib import Path

import torch
import trl
from harness.flags import arguments
from harness.report import write_report
from harness.trainers import embedded_model_or_none

import grpo_plus
from grpo_plus.run.state import PROCESS_FILE, SHARED_FILE, stateful_parts

DEMO = dict(
    per_device_train_batch_size=16,
    num_generations=8,
    max_completion_length=20,
    temperature=0.7,
    loss_type="dapo",
    epsilon_high=0.28,
    learning_rate=3e-4,
)
CASES = {
    "tiny": dict(steps_per_generation=4, gradient_accumulation_steps=1),
    "demo": DEMO,
    "demo-buffer": dict(DEMO, steps_per_generation=4, gradient_accumulation_steps=2),
}


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def state_bytes(state) -> int:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.tell()


def make_trainer(package, case: str, output_dir: Path, model_path: str | None):
    from grpo_plus.app.testing import (
        digit_reward,
        length_reward,
        make_model,
        make_tokenizer,
        prompt_dataset,
        tiny_run_kwargs,
    )

    settings = dict(CASES[case], max_steps=1, save_strategy="steps", save_steps=1)
    if case == "tiny":
        tokenizer = make_tokenizer()
        model, peft, data, rewards = make_model(tokenizer), None, prompt_dataset(8), [length_reward, digit_reward]
    else:
        from peft import LoraConfig
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from grpo_plus.app import tasks

        tokenizer = AutoTokenizer.from_pretrained(model_path)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        peft = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
        data = tasks.make_dataset("train", "add-1d", seed=0)
        rewards = [tasks.correctness_reward, tasks.format_reward]
        settings["reward_weights"] = [1.0, 0.5]
    args = package.GRPOConfig(**tiny_run_kwargs(output_dir, **settings))
    return package.GRPOTrainer(
        model=model, processing_class=tokenizer, reward_funcs=rewards, args=args, train_dataset=data, peft_config=peft
    )


def measure(case: str, model_path: str | None) -> dict:
    result: dict = {"case": case}
    with tempfile.TemporaryDirectory() as tmp:
        for name, package in (("trl", trl), ("grpo_plus", grpo_plus)):
            out = Path(tmp) / name
            trainer = make_trainer(package, case, out, model_path)
            trainer.train()
            checkpoint = out / "checkpoint-1"
            result[f"{name}_checkpoint_bytes"] = folder_bytes(checkpoint)
            if package is grpo_plus:
                files = {f.name: f.stat().st_size for f in (checkpoint / SHARED_FILE, checkpoint / PROCESS_FILE.format(0))
                         if f.is_file()}  # fmt: skip
                result["files"] = files
                result["added_bytes"] = sum(files.values())
                result["parts"] = {
                    part.checkpoint_name: state_bytes(part.state_dict()) for part in stateful_parts(trainer)
                }
                # the buffer as saved: none when the generation batch is used up (the next step generates)
                saved = [p for p in stateful_parts(trainer) if p.checkpoint_name == "generation_buffer"]
                buffered = saved[0].state_dict()["micro_batches"] or []
                result["buffered_rows"] = sum(b["completion_ids"].shape[0] for b in buffered)
                result["buffered_tensor_bytes"] = sum(
                    v.numel() * v.element_size() for b in buffered for v in b.values() if isinstance(v, torch.Tensor)
                )
                start = time.perf_counter()
                trainer._training_state.save(Path(tmp) / "again", True, lambda: None)
                result["write_seconds"] = time.perf_counter() - start
    result["added_fraction_of_trl_checkpoint"] = result["added_bytes"] / result["trl_checkpoint_bytes"]
    return result


def main() -> None:
    args = arguments(__doc__, json=None, smoke="the tiny case only (seconds)").parse_args()
    torch.set_num_threads(1)
    cases = ["tiny"]
    model_path = None if args.smoke else embedded_model_or_none()
    if model_path is not None:
        cases += ["demo", "demo-buffer"]
    results = [measure(case, model_path) for case in cases]
    for r in results:
        parts = ", ".join(f"{name} {size:,}" for name, size in sorted(r["parts"].items()))
        print(
            f"{r['case']:12} adds {r['added_bytes']:>9,} bytes ({', '.join(f'{k} {v:,}' for k, v in r['files'].items())}) "
            f"to stock TRL's {r['trl_checkpoint_bytes']:,}-byte checkpoint: "
            f"{100 * r['added_fraction_of_trl_checkpoint']:.2f}%; written in {1000 * r['write_seconds']:.1f} ms"
        )
        print(
            f"{'':12} buffer saved: {r['buffered_rows']} rows, {r['buffered_tensor_bytes']:,} tensor bytes; parts: {parts}"
        )
    if args.json:
        write_report(results, args.json)


if __name__ == "__main__":
    main()
