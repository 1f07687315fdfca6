"""A mixture-of-experts model on vLLM's real engine (its CPU build, 0.31; issue 53): a LoRA step synced, each sync
checked by grpo_plus's sync receipt (`grpo_plus.engine.receipt`), and the reload's repacking of the experts for the
CPU kernel (`grpo_plus.engine.reload.cpu_experts_left_unpacked`).

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
from grpo_plus.engine import layerwise_reload
from grpo_plus.engine import reload as reload_module

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


def reload_checkpoint_weights(llm, model) -> None:
    """`model`'s weights into the engine through vLLM's reload (grpo_plus's, as every sync), in the checkpoint's format
    (each expert's weights under its own names, as vLLM loaded them from disk)."""
    from transformers.core_model_loading import revert_weight_conversion

    checkpoint_format = revert_weight_conversion(model, dict(model.state_dict()))
    assert any(".experts.0." in name for name in checkpoint_format)
    with layerwise_reload(llm) as engine_model:
        for name, tensor in checkpoint_format.items():
            engine_model.load_weights([(name, tensor)])
    llm.reset_prefix_cache()


def test_a_lora_step_on_an_moe_syncs_and_its_receipts_check(shared_engine, model_dir, tmp_path, monkeypatch):
    """The engine serves the Qwen3-MoE it loaded from the checkpoint as the trainer computes it; two LoRA steps
    (adapters on attention), each followed by a sync (the first streams every weight, the experts included), pass
    every receipt (a failed one raises SyncCheckError: the engine's log-probs of a probe within float32 rounding of the
    trainer's, every element streamed and taken), and the checkpoint's own weights reloaded give back the checkpoint's
    log-probs. Negative control: without packing the reloaded experts again for vLLM's CPU kernel
    (`cpu_experts_left_unpacked`), the same reload moves the engine's log-probs (measured: by up to 0.067), and a run
    would stop at its first sync."""
    trainer = tiny_engine_trainer(grpo_plus, model_dir, tmp_path, VLLM, "float32", LORA)
    llm = trainer.vllm_generation.llm
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = model_logps(base, PROBE_IDS)
    assert (engine_logprobs(llm, PROBE_IDS) - expected).abs().max() <= SAME_WEIGHTS  # served from the checkpoint
    adapters = {k: v.detach().clone() for k, v in trainer.model.named_parameters() if v.requires_grad}
    trainer.train()
    moved = max((adapters[k] - v).abs().max().item() for k, v in trainer.model.named_parameters() if k in adapters)
    assert moved > 1e-3, "training did not move the adapters: the syncs carried nothing"
    receipts = trainer.vllm_generation.sync_log.receipts
    assert len(receipts) == VLLM["max_steps"] and all(r.loaded_elements == r.streamed_elements for r in receipts)

    reload_checkpoint_weights(llm, base)
    assert (engine_logprobs(llm, PROBE_IDS) - expected).abs().max() <= SAME_WEIGHTS
    monkeypatch.setattr(reload_module, "cpu_experts_left_unpacked", lambda model, loaded: [])
    reload_checkpoint_weights(llm, base)
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


def test_the_cpu_build_refuses_to_return_routed_experts(model_dir, monkeypatch):
    """Why routing replay is refused with `use_vllm=True` (grpo_plus.routing.settings): vLLM's routed-experts output
    (`enable_return_routed_experts`, `CompletionOutput.routed_experts`) is wired to Model Runner V2 only, which needs
    Triton with a CPU backend, and the CPU build finds none, so its engine config fails before any model is loaded.
    The day the installed build returns them, this fails (and replay with vLLM can be built). Control: the same engine
    arguments without the routed experts make a config."""
    import vllm.envs
    from vllm.engine.arg_utils import EngineArgs
    from vllm.triton_utils import HAS_TRITON

    def engine_config(**extra):
        return EngineArgs(model=model_dir, dtype="float32", max_model_len=64, **extra).create_engine_config()

    assert engine_config().model_config.get_num_experts() == 4  # the MoE's own config makes an engine config
    assert not HAS_TRITON
    with pytest.raises(ValueError, match="AuxOutput Connector requires Model Runner V2"):
        engine_config(enable_return_routed_experts=True)
    # vLLM's VLLM_USE_V2_MODEL_RUNNER=1, set on its envs module (an engine started earlier in the process caches them)
    monkeypatch.setattr(vllm.envs, "VLLM_USE_V2_MODEL_RUNNER", True, raising=False)
    with pytest.raises(ValueError, match="Model Runner V2 requires Triton"):
        engine_config(enable_return_routed_experts=True)
