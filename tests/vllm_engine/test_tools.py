"""Tools and multi-turn generation on vLLM's real engine (colocate): TRL's tool loop generates every turn with vLLM;
stock TRL and grpo_plus must train the same tool-call batches to the same weights. One engine for the module.

The tool model (`grpo_plus.app.tool_model`, a tiny Qwen3 taught to call `increment`) with a head size vLLM's CPU
attention takes (32); one generation batch trained in two optimizer steps, as in test_colocate.py (which says why).
"""

from __future__ import annotations

import pytest
import torch
import trl
from datasets import Dataset
from helpers.probes import logged, max_weight_diff, record_trained_batches
from helpers.tool_model import increment, load_tool_model, number_prompts, save_tool_model, tool_trainer

import grpo_plus
from grpo_plus.engine import reload_on_sync

pytestmark = pytest.mark.floor("tools")

VLLM = dict(
    use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3, per_device_train_batch_size=4,
    steps_per_generation=2, max_steps=2, learning_rate=0.5, temperature=1.3,
)  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # head size 32 (vLLM's CPU attention has no kernel for the usual 16) learns the calls in 200 steps, not 100
    return str(save_tool_model(tmp_path_factory.mktemp("vllm-tool-model"), steps=200, head_dim=32))


def alternating_reward(completions, **kwargs) -> list[float]:
    """0 / 1 by row: every group has signal (sampled at temperature 1.3, its rows differ)."""
    return [float(row % 2) for row in range(len(completions))]


def train(package, model_dir, output_dir):
    torch.manual_seed(0)
    trainer = tool_trainer(
        package, model_dir, output_dir, train_dataset=Dataset.from_list(number_prompts(2)), tools=[increment],
        reward_funcs=[alternating_reward], **VLLM,
    )  # fmt: skip
    reload_on_sync(trainer.vllm_generation)  # grpo_plus's trainer has it already; stock TRL gets the same sync
    batches = record_trained_batches(trainer)
    trainer.train()
    return trainer, batches


def test_tool_turns_through_vllm_train_like_stock_trl(shared_engine, model_dir, tmp_path):
    theirs, their_batches = train(trl, model_dir, tmp_path / "trl")
    ours, our_batches = train(grpo_plus, model_dir, tmp_path / "plus")
    assert len(their_batches) == len(our_batches) == 2
    for (_, a), (_, b) in zip(their_batches, our_batches, strict=True):
        for key in ("prompt_ids", "completion_ids", "completion_mask", "tool_mask"):
            assert torch.equal(a[key], b[key]), key
    assert any(bool((batch["tool_mask"] == 0).any()) for _, batch in our_batches), "no tool output in any completion"
    assert all(frequency > 0 for frequency in logged(ours, "tools/call_frequency")), "no tool was called"
    initial, _ = load_tool_model(model_dir)
    assert max_weight_diff(initial.state_dict(), theirs.model.state_dict()) > 1e-3, "nothing trained"
    assert max_weight_diff(theirs.model.state_dict(), ours.model.state_dict()) <= 1e-5
    assert logged(ours, "loss") == pytest.approx(logged(theirs, "loss"), rel=1e-5, abs=1e-6)
