"""The LoRA and QLoRA recipes with `--use_vllm true`, unchanged, on vLLM's real engine (colocate mode).

The QLoRA recipe loads its base in 4 bits (nf4); stock TRL would ask vLLM for in-flight bitsandbytes, which vLLM 0.31
refuses at start. grpo_plus's trainer asks for the engine's dtype instead and syncs the dequantized base with the
adapters merged out of place, so the recipe trains; both recipes must leave an adapter that loads back, a reward
plot, and log TRL's sampler/trainer metrics (the engine generated). One engine for the module (conftest.py): both
recipes ask vLLM for the same settings.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from helpers.models import save_tiny_model
from helpers.probes import sampling_metric
from peft import PeftModel
from transformers import AutoModelForCausalLM

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def load_recipe(name: str):
    spec = importlib.util.spec_from_file_location(name, RECIPES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """128 wide: bitsandbytes' 4-bit blocks are 64, vLLM's CPU attention wants heads of 32+."""
    return str(save_tiny_model(tmp_path_factory.mktemp("vllm-recipe-model"), hidden_size=128))


@pytest.mark.parametrize("recipe", ["grpo_lora", "grpo_qlora"])
def test_recipe_trains_with_vllm(shared_engine, model_dir, tmp_path, recipe):
    out = tmp_path / "run"
    flags = [
        "--model_name_or_path", model_dir, "--output_dir", str(out), "--use_cpu", "true", "--bf16", "false",
        "--gradient_checkpointing", "false", "--max_steps", "2", "--per_device_train_batch_size", "4",
        "--num_generations", "4", "--max_completion_length", "8", "--learning_rate", "0.01", "--report_to", "none",
        "--lora_r", "4", "--lora_alpha", "8", "--lora_target_modules", "all-linear", "--task_eval_size", "4",
        "--eval_max_new_tokens", "4", "--logging_steps", "1", "--save_strategy", "steps", "--save_steps", "2", "--disable_tqdm", "true",
        "--use_vllm", "true", "--vllm_mode", "colocate", "--vllm_gpu_memory_utilization", "0.3",
    ]  # fmt: skip
    load_recipe(recipe).main(flags)  # (not under capsys: vLLM's engine start needs sys.stdout's file descriptor)
    logs = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())["log_history"]
    assert [entry["step"] for entry in logs if "loss" in entry] == [1, 2]
    # the engine (bfloat16) against the trainer on the sampled tokens: measured at most 5.1e-3 (grpo_lora's step 2)
    differences = [
        sampling_metric(entry, "sampling/sampling_logp_difference/mean") for entry in logs if "loss" in entry
    ]
    assert None not in differences
    assert max(differences) < 0.015, differences
    # every sync checked before the engine generated from it (grpo_plus's sync receipts)
    assert all("vllm_sync/probe_logp_difference/mean" in entry for entry in logs if "loss" in entry)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), out)
    assert any("lora_" in name for name, _ in model.named_parameters())
    assert shared_engine.starts == 1
