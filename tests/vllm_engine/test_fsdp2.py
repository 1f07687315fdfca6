"""FSDP2 with colocated vLLM, on the real engines: 2 CPU processes over gloo, each with its own engine.

accelerate runs FSDP on GPUs only; as in tests/test_fsdp.py the shipped FSDP2 config is launched with `--use_cpu
true` and the test harness sets accelerate's state to FSDP (`--force_fsdp_on_cpu`, tests/helpers/fsdp_on_cpu.py: test
code only). Each process holds a shard of every weight (DTensor); TRL's sync makes each parameter whole
(`full_tensor()`, collectively: every process takes part) before the push; with LoRA grpo_plus's out-of-place stream
unshards the model for the push (`grpo_plus.run.distributed.fsdp2_unsharded`) and sends copies of the weights it does not
merge (FSDP2 frees the whole weights when it reshards, while vLLM may still hold them). grpo_plus loads either stream
through vLLM's reload, checking every sync. After training each rank's engine must sample with the trained weights.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from helpers.models import save_tiny_model
from helpers.probes import TRAIN_TINY, accelerate_launch, run_python, train_tiny_flags
from transformers import AutoModelForCausalLM

# |engine - model| of the sampled tokens' log-probs on each rank after training (bfloat16 engine, tiny Llama): the
# bound of tests/vllm_engine/test_zero3.py; measured here 9.5e-3 (full), 1.4e-3 (LoRA).
ENGINE_MODEL_BOUND = 0.012
FSDP2 = Path(__file__).resolve().parents[2] / "recipes" / "accelerate_configs" / "fsdp.yaml"


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_fsdp2_gathers_the_trained_weights_into_each_ranks_engine(tmp_path, lora):
    """With LoRA, grpo_plus's out-of-place stream (not TRL's in-place merge: no warning) leaves the base bit-identical."""
    model_dir = save_tiny_model(tmp_path / "model", hidden_size=128)
    out = tmp_path / "run"
    flags = train_tiny_flags(
        model_dir, out, optim="sgd", learning_rate=2.0 if not lora else 8.0, max_steps=3, use_vllm=True, vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.3, loss_type="dapo",
    )  # fmt: skip
    flags += ["--reward", "odd_dead", "--prompts", "2+4=|4+2=", "--force_fsdp_on_cpu", "--watchdog", "600"]
    flags += ["--dump_logs", f"{out}.json", "--vllm_logps", f"{out}.logps"]
    if lora:
        flags += ["--peft", "true", "--dump_weights", f"{out}.safetensors"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    result = run_python(TRAIN_TINY, *flags, launcher=accelerate_launch(2, config_file=FSDP2), env=env, timeout=900)
    assert result.stdout.count("engine=FSDP") == 2, "the run did not train under FSDP2: " + result.stdout[-2000:]
    logs = json.loads(Path(f"{out}.json").read_text())
    assert any(entry.get("grad_norm", 0) > 0 for entry in logs), "nothing trained: the check below proves nothing"
    initial = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if lora:
        from safetensors.torch import load_file

        assert "LoRA with FSDP1" not in result.stdout + result.stderr, "TRL's in-place stream ran"
        trained = load_file(f"{out}.safetensors")
        base = {k.removeprefix("base_model.model.").replace(".base_layer", ""): v for k, v in trained.items()}
        start = initial.state_dict()
        adapters = [k for k in base if "lora_" in k]
        assert adapters and max(base[k].abs().max().item() for k in adapters if "lora_B" in k) > 0
        frozen = [k for k in base if "lora_" not in k]
        assert frozen and all(torch.equal(base[k], start[k]) for k in frozen), "the frozen base moved"
    for rank in range(2):
        sampled = json.loads(Path(f"{out}.logps.rank{rank}").read_text())
        engine, model = torch.tensor(sampled["engine"]), torch.tensor(sampled["model"])
        with torch.no_grad():
            logits = initial(torch.tensor([sampled["prompt"] + sampled["tokens"]])).logits
        start = len(sampled["prompt"]) - 1
        tokens = torch.tensor(sampled["tokens"]).unsqueeze(1)
        untrained = logits[0, start:-1].log_softmax(-1).gather(1, tokens).squeeze(1)
        # every sync (3 steps and the final push) checked on this rank before its engine generated, none failed
        assert len(sampled["receipts"]) == 4 and all(mean <= bound for mean, bound in sampled["receipts"])
        assert (engine - model).abs().max() < ENGINE_MODEL_BOUND, (
            f"rank {rank}: the engine is not on the trained weights"
        )
        # an engine left on the untrained weights would be this far from the model
        assert (model - untrained).abs().max() > 10 * ENGINE_MODEL_BOUND, f"rank {rank}: training moved too little"
