"""A mixture-of-experts model on vLLM's real engine (its CPU build, 0.31; issue 53): what it serves, and what its weight
sync does to the experts, checked by grpo_plus's sync receipt (`grpo_plus.engine.receipt`).

One engine for the module (conftest.py), in float32 (so that "the same weights" means the same log-probs to float
rounding), on a tiny Qwen3-MoE 128 wide (vLLM's CPU attention needs heads of 32+): 4 experts of width 32, top 2.
"""

from __future__ import annotations

import pytest
import torch
from helpers.engine import engine_logprobs, tiny_engine_trainer
from helpers.models import save_tiny_model
from transformers import AutoModelForCausalLM

import grpo_plus
from grpo_plus.engine import SyncCheckError, layerwise_reload

VLLM = dict(
    use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3, per_device_train_batch_size=4,
    steps_per_generation=1, optim="sgd", learning_rate=0.5, loss_type="dapo", max_steps=2, vllm_dtype="float32",
)  # fmt: skip
LORA = dict(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM", target_modules=["q_proj", "v_proj"])
PROBE_IDS = list(range(3, 40))
# float32 on both sides, the same weights: measured 4.8e-7 (the engine loaded from the checkpoint)
SAME_WEIGHTS = 1e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm-moe-model")
    return str(save_tiny_model(path, family="qwen3_moe", hidden_size=128, head_dim=32, moe_intermediate_size=32))


def model_logps(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)


def test_an_moe_is_served_but_a_weight_sync_of_its_experts_is_refused(shared_engine, model_dir, tmp_path):
    """The engine serves the Qwen3-MoE it loaded from the checkpoint as the trainer computes it. A reload of the
    experts does not take: the checkpoint's own weights, reloaded in the checkpoint's format (the names vLLM loaded
    from disk), move its log-probs (measured: by up to 0.067), because the CPU build packs the expert weights for its
    kernel when it loads the model and not again when they are reloaded. So a LoRA run (adapters on attention) stops
    at its first sync, which streams every weight: the receipt finds the engine's log-probs of its probe off the
    trainer's although every element was streamed and taken, instead of letting the engine generate from wrong
    experts."""
    from transformers.core_model_loading import revert_weight_conversion

    trainer = tiny_engine_trainer(grpo_plus, model_dir, tmp_path, VLLM, "float32", LORA)
    llm = trainer.vllm_generation.llm
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = model_logps(base, PROBE_IDS)
    assert (engine_logprobs(llm, PROBE_IDS) - expected).abs().max() <= SAME_WEIGHTS  # served from the checkpoint

    with pytest.raises(SyncCheckError, match="not the trainer's") as refused:
        trainer.train()
    assert "the engine took all" in str(refused.value) and trainer.state.global_step == 0

    checkpoint_format = revert_weight_conversion(base, dict(base.state_dict()))
    assert any(".experts.0." in name for name in checkpoint_format)  # per expert, as the checkpoint holds them
    with layerwise_reload(llm) as engine_model:
        for name, tensor in checkpoint_format.items():
            engine_model.load_weights([(name, tensor)])
    llm.reset_prefix_cache()
    assert (engine_logprobs(llm, PROBE_IDS) - expected).abs().max() > 1e-2  # the same weights, served otherwise


def test_lora_on_the_experts_is_refused_for_the_engine(model_dir):
    """PEFT's LoRA on the experts (`target_parameters`: their weights are 3D tensors) has no out-of-place merge for
    the engine: refused, naming the module (LoRA on attention alone is not)."""
    from peft import LoraConfig, get_peft_model

    from grpo_plus.engine.lora_stream import sync_blocker

    def adapted(**targets):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, **targets))

    experts = adapted(
        target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    )
    assert "model.layers.0.mlp.experts is a ParamWrapper LoRA layer" in sync_blocker(experts, False)
    assert sync_blocker(adapted(target_modules=["q_proj"]), False) is None
