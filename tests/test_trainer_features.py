"""The trainer end to end: DDP, PEFT / 4-bit, kill-and-resume, user modes from YAML and plugins."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from helpers.floors import skip_below_floor
from helpers.models import tiny_trainer
from helpers.probes import (
    TRAIN_TINY,
    accelerate_launch,
    kill_after_checkpoint,
    max_weight_diff,
    run_python,
    train_tiny_flags,
)
from helpers.rewards import length_reward
from peft import LoraConfig, PeftModel, prepare_model_for_kbit_training
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

from grpo_plus.run.checkpoints import is_complete_checkpoint, last_complete_checkpoint

pytestmark = pytest.mark.slow


@pytest.mark.engine  # DDP processes: make test-engines
def test_ddp_two_processes_match_one_process(tiny_model_dir, tmp_path):
    """DAPO on 2 gloo processes x 4 sequences ends where 1 process x 8 sequences ends.

    Sampling is made row-deterministic (helpers.probes.RowSeededSampler), so both runs see identical completions.
    SGD keeps the comparison linear in the gradient: Adam's m/sqrt(v) would turn float-rounding noise in
    near-zero gradient entries into full-size steps. What remains is float32 summation order (all-reduce vs one
    sum over the batch), ~1e-7 relative per step, hence the 1e-5 tolerance on weights that move by ~1e-2.
    """
    common = dict(num_generations=4, max_steps=3, optim="sgd", loss_type="dapo", epsilon_high=0.28)
    one = train_tiny_flags(tiny_model_dir, tmp_path / "one", per_device_train_batch_size=8, **common)
    two = train_tiny_flags(tiny_model_dir, tmp_path / "two", per_device_train_batch_size=4, **common)
    run_python(TRAIN_TINY, *one, "--row_seeded_sampling", "--dump_weights", tmp_path / "one.safetensors")
    result = run_python(
        TRAIN_TINY,
        *two,
        "--row_seeded_sampling",
        "--dump_weights",
        tmp_path / "two.safetensors",
        launcher=accelerate_launch(2),
    )
    assert result.stdout.count("FINISHED global_step=3") == 2, "expected two ranks to finish"
    one_w, two_w = load_file(tmp_path / "one.safetensors"), load_file(tmp_path / "two.safetensors")
    initial = load_file(Path(tiny_model_dir) / "model.safetensors")
    assert max_weight_diff(one_w, initial) > 1e-3
    assert max_weight_diff(one_w, two_w) <= 1e-5


def test_lora_changes_only_adapter_weights(tiny_model_dir, tmp_path):
    trainer = tiny_trainer(
        tmp_path,
        length_reward,
        model=AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
        loss_type="dr_grpo",
        epsilon_high=0.28,
    )
    before = {k: v.clone() for k, v in trainer.model.named_parameters()}
    trainer.train()
    after = dict(trainer.model.named_parameters())
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed, "nothing trained"
    assert all("lora_" in k for k in changed), sorted(changed - {k for k in changed if "lora_" in k})
    assert all(not after[k].requires_grad for k in after if "lora_" not in k)


def test_qlora_4bit_trains_and_saves_an_adapter_that_loads_back(tiny_model_dir, tmp_path):
    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, quantization_config=quantization, dtype=torch.float32)
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    trainer = tiny_trainer(
        tmp_path,
        length_reward,
        model=model,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False),
        max_steps=1,
        loss_type="dapo",
        importance_sampling_level="sequence_token",
    )
    trainer.train()
    assert trainer.state.global_step == 1
    trainer.save_model(str(tmp_path / "adapter"))
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert saved and all("lora_" in k for k in saved)
    trained = {k: v for k, v in trainer.model.state_dict().items() if "lora_" in k}

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    reloaded = PeftModel.from_pretrained(base, tmp_path / "adapter")
    for key, value in reloaded.state_dict().items():
        if "lora_" in key:
            assert torch.equal(value, trained[key].float()), key  # saved and loaded: bit for bit
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tokenizer("1+2=", return_tensors="pt")
    generated = reloaded.generate(**ids, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] > ids["input_ids"].shape[1]


@pytest.mark.engine  # a run killed and resumed in processes: make test-engines
def test_kill_after_checkpoint_then_resume(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    args = train_tiny_flags(
        tiny_model_dir,
        out,
        max_steps=12,
        save_strategy="steps",
        save_steps=2,
        loss_type="dapo",
        epsilon_high=0.28,
        dual_clip=3.0,
        scale_rewards="batch",
    )
    kill_after_checkpoint([sys.executable, TRAIN_TINY, *args, "--step_delay", "0.4"], out / "checkpoint-4")
    assert not (out / "checkpoint-12").exists(), "the run finished before it could be killed"
    killed_at = last_complete_checkpoint(out)
    killed_step = int(killed_at.rsplit("-", 1)[1])
    assert 4 <= killed_step < 12

    result = run_python(TRAIN_TINY, *args, "--resume", "--dump_logs", tmp_path / "logs.json")
    assert "FINISHED global_step=12" in result.stdout
    assert f"FIRST_STEP={killed_step + 1}" in result.stdout, "did not resume from the last complete checkpoint"
    logs = json.loads((tmp_path / "logs.json").read_text())
    assert [entry["step"] for entry in logs if "loss" in entry] == list(range(1, 13))
    final = out / "checkpoint-12"
    assert json.loads((final / "trainer_state.json").read_text())["global_step"] == 12
    saved_args = torch.load(final / "training_args.bin", weights_only=False)
    assert (saved_args.loss_type, saved_args.epsilon_high, saved_args.dual_clip, saved_args.scale_rewards) == (
        "dapo",
        0.28,
        3.0,
        "batch",
    )
    for checkpoint in sorted(out.glob("checkpoint-*")):
        assert is_complete_checkpoint(checkpoint), checkpoint
        assert load_file(checkpoint / "model.safetensors")


def test_incomplete_checkpoint_is_skipped(tmp_path):
    for step in (2, 4):
        (tmp_path / f"checkpoint-{step}").mkdir()
    (tmp_path / "checkpoint-2" / "trainer_state.json").write_text('{"global_step": 2}')
    (tmp_path / "checkpoint-4" / "trainer_state.json").write_text('{"global_st')  # killed mid-write
    assert last_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-2")
    assert last_complete_checkpoint(tmp_path / "missing") is None


PLUGIN = """
import os
import torch
from grpo_plus import register_advantage_normalizer, register_loss_type


def _mark(name):
    with open(os.environ["PLUGIN_CALLS"], "a") as f:
        f.write(name + "\\n")


@register_loss_type("seq_mean_token_sum", override=True)
def seq_mean_token_sum(masked_loss, ctx):
    _mark("loss")
    return masked_loss.sum(-1).mean() / ctx.S


@register_advantage_normalizer("rank", override=True)
def rank(grouped, eps):
    _mark("advantage")
    ranks = grouped.argsort(dim=1).argsort(dim=1).to(grouped.dtype)
    return (ranks - ranks.mean(dim=1, keepdim=True)) / grouped.shape[1]
"""


@pytest.mark.engine  # its work is in a child process it starts (a training run, 10 s each): make test-engines
@pytest.mark.parametrize("discovery", ["plugins_field", "entry_point"])
def test_user_modes_train_from_yaml(tiny_model_dir, tmp_path, discovery):
    site = tmp_path / "site"
    site.mkdir()
    (site / "my_grpo_modes.py").write_text(PLUGIN)
    config = {
        "output_dir": str(tmp_path / "out"),
        "model_dir": tiny_model_dir,
        "loss_type": "seq_mean_token_sum",
        "scale_rewards": "rank",
        "per_device_train_batch_size": 4,
        "num_generations": 4,
        "max_completion_length": 8,
        "max_steps": 2,
        "learning_rate": 0.05,
        "report_to": "none",
        "save_strategy": "no",
        "use_cpu": True,
        "bf16": False,
        "dump_weights": str(tmp_path / "w.safetensors"),
    }
    if discovery == "plugins_field":
        config["plugins"] = ["my_grpo_modes"]
    else:
        dist_info = site / "my_grpo_modes-0.1.dist-info"
        dist_info.mkdir()
        (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-grpo-modes\nVersion: 0.1\n")
        (dist_info / "entry_points.txt").write_text("[grpo_plus.plugins]\nmy_modes = my_grpo_modes\n")
    yaml_lines = [f"{k}: {json.dumps(v)}" for k, v in config.items()]
    (tmp_path / "run.yaml").write_text("\n".join(yaml_lines) + "\n")
    calls = tmp_path / "calls.txt"
    env = {**os.environ, "PYTHONPATH": str(site), "PLUGIN_CALLS": str(calls)}
    run_python(TRAIN_TINY, "--config", tmp_path / "run.yaml", env=env)
    assert {"loss", "advantage"} <= set(calls.read_text().split())
    initial = load_file(Path(tiny_model_dir) / "model.safetensors")
    assert max_weight_diff(load_file(tmp_path / "w.safetensors"), initial) > 1e-4


def test_4bit_layers_stay_trainable_after_an_eval_pass_on_cpu(tiny_model_dir_bnb):
    """bitsandbytes repacks 4-bit weights for CPU inference after an eval forward; its kernel has no autograd."""
    from peft import get_peft_model

    from grpo_plus.compat.bitsandbytes import keep_4bit_trainable_on_cpu

    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
    )
    ids = torch.randint(3, 60, (2, 10), generator=torch.Generator().manual_seed(0))

    def lora_grads(eval_first: bool, fix: bool) -> tuple[dict, int]:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir_bnb, quantization_config=quantization)
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        torch.manual_seed(0)
        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
        if fix:
            keep_4bit_trainable_on_cpu(model)
        if eval_first:
            model.eval()
            with torch.no_grad():
                model(ids)
            model.train()
        packed = keep_4bit_trainable_on_cpu(model) if not fix else 0
        model(ids).logits.pow(2).mean().backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, packed

    reference, _ = lora_grads(eval_first=False, fix=False)
    fixed, _ = lora_grads(eval_first=True, fix=True)
    assert max_weight_diff(reference, fixed) == 0  # bit for bit in every run
    _, repacked = lora_grads(eval_first=True, fix=False)
    # Nothing to guard against where bitsandbytes never repacks: documented below bitsandbytes 0.49 and on a CPU
    # without AVX512-BF16; elsewhere a bitsandbytes that stopped repacking fails here, naming the floor.
    skip_below_floor("bitsandbytes_cpu_repacking", missing=None if repacked else "an eval forward repacked no layer")
