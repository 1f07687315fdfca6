"""Long completions: activation offloading and the tiled MLP train stock TRL's weights; the memory count runs TRL's and
grpo_plus's training pass on a fake accelerator, equals real compute, and drives the fit check and `grpo-plus fit`."""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch
import trl
from helpers.models import prompt_dataset, tiny_run_kwargs
from helpers.probes import max_weight_diff
from helpers.rewards import digit_reward, length_reward
from helpers.tolerances import float32_bound
from peft import LoraConfig
from transformers import AutoModelForCausalLM

import grpo_plus
import grpo_plus.algorithms.micro_batch_loss
import grpo_plus.trainer
from grpo_plus import fit
from grpo_plus.config import ConfigError
from grpo_plus.long_completions.tiled_mlp import TiledMLP, decoder_mlps, tile_mlps

needs_cpu_logps = pytest.mark.floor("cpu_logps")
# The count reads the values of the log-probs TRL's fused LM head returns (TRL >= 1.15); TRL 1.14 takes them from full
# logits, whose values a fake pass does not have, so branches on them are guessed and the count is not exact there.
needs_fused_lm_head = pytest.mark.floor("fused_lm_head")
LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
# The tiled MLP's LoRA gradient against the whole MLP's, float32 (the tiles sum the down projection's weight gradient
# in slices): worst over threads 1-2 and input seeds 3.3e-9 on AVX-512, 4.2e-8 on AVX2 (Qwen2); Gemma 2, which
# normalizes the MLP's output, 3.3e-9 and 7.5e-9 (docs/notes.md, Tolerances)
TILED_BOUND = float32_bound(avx512=1e-8, avx2=1.2e-7)
NORMALIZED_TILED_BOUND = float32_bound(avx512=1e-8, avx2=2.5e-8)


def train(tiny_model_dir, tmp_path, package, **overrides):
    """Train the tiny Llama with LoRA, gradient checkpointing, SGD, float32; returns (LoRA weights, logs, model)."""
    overrides = {"optim": "sgd", "learning_rate": 0.5, "gradient_checkpointing": True, "max_completion_length": 12,
                 **overrides}  # fmt: skip
    args = package.GRPOConfig(**tiny_run_kwargs(tmp_path / package.__name__, **overrides))
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    trainer = package.GRPOTrainer(
        model=model, reward_funcs=[length_reward, digit_reward], args=args, train_dataset=prompt_dataset(16),
        peft_config=LoraConfig(**LORA),
    )  # fmt: skip
    trainer.train()
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items() if "lora_" in k}
    return weights, trainer.state.log_history, trainer.model


def assert_same_weights(trl_weights: dict, our_weights: dict, tol: float) -> None:
    moved = max(v.abs().max().item() for k, v in trl_weights.items() if "lora_B" in k)
    assert moved > 1e-3, "training did not move LoRA's B matrices: the comparison would be vacuous"
    diff = max_weight_diff(trl_weights, our_weights)
    assert diff <= tol, f"max |w_trl - w_grpo_plus| = {diff}"


@needs_cpu_logps
def test_activation_offloading_trains_stock_trls_weights(tiny_model_dir, tmp_path, monkeypatch):
    """activation_offloading=True runs TRL's offloading (trl.models.activation_offloading) around each training step.
    On this CPU there is no accelerator to offload from, so the test hands the trainer TRL's manager with the CPU
    standing in for the accelerator: every saved tensor is copied out at pack time and back at unpack, through TRL's
    own code, and the run must end on stock TRL's weights (gradient checkpointing on, so the saved tensors are the
    checkpoints)."""
    from trl.models.activation_offloading import get_act_offloading_ctx_manager

    managers = []

    def host_copies(model, device, enabled):
        assert enabled
        with monkeypatch.context() as patched:
            patched.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cpu"))
            managers.append(get_act_offloading_ctx_manager(model, use_pin_memory=False, use_streams=False,
                                                           warn_if_no_head=False))  # fmt: skip
        return managers[-1]

    monkeypatch.setattr(grpo_plus.trainer, "training_step_context", host_copies)
    monkeypatch.setattr(torch.cpu, "empty_cache", lambda: None, raising=False)  # TRL calls it once bnb is imported
    trl_weights, _, _ = train(tiny_model_dir, tmp_path, trl)
    our_weights, _, _ = train(tiny_model_dir, tmp_path, grpo_plus, activation_offloading=True)
    assert managers and managers[0].tensor_id > 0, "no tensor went through the offloading hooks"
    assert_same_weights(trl_weights, our_weights, tol=1.5e-8)  # float32: worst 3.7e-9, 4x


@needs_cpu_logps
def test_tiled_mlp_trains_stock_trls_weights(tiny_model_dir, tmp_path):
    """tiled_mlp_tokens=16 (prompts + completions of 4 rows are ~100 positions): each MLP runs in slices, and under
    gradient checkpointing the layers' recomputes leave its output unwritten (counted); the weights end where stock
    TRL's do, up to float32 rounding of the sliced products."""
    trl_weights, _, _ = train(tiny_model_dir, tmp_path, trl)
    our_weights, _, model = train(tiny_model_dir, tmp_path, grpo_plus, tiled_mlp_tokens=16)
    wrappers = [mlp.forward for _, mlp in decoder_mlps(model)]
    assert wrappers and all(isinstance(w, TiledMLP) for w in wrappers)
    assert all(w.tiled_calls > 0 for w in wrappers), "no MLP ran tiled"
    assert all(w.skipped_recomputes > 0 for w in wrappers), "no checkpoint recompute skipped the MLP"
    assert_same_weights(trl_weights, our_weights, tol=1.5e-8)  # float32: worst 3.7e-9, 4x


def test_tiled_mlp_stands_aside_under_dropout_and_without_grad(caplog):
    """Dropout masks drawn slice by slice are not one draw's masks: with an active dropout inside the MLP the MLP runs
    whole (said once); without grad (generation, the no-grad log-prob passes) it runs whole, as TRL's."""
    from helpers.models import make_model, make_tokenizer
    from peft import get_peft_model

    model = get_peft_model(make_model(make_tokenizer()), LoraConfig(**{**LORA, "lora_dropout": 0.1}))
    wrappers = tile_mlps(model, 4)
    ids = torch.randint(3, 20, (2, 12))
    model.train()
    with caplog.at_level(logging.WARNING, logger="grpo_plus.long_completions.tiled_mlp"):
        model(input_ids=ids).logits.sum().backward()
    assert sum(w.tiled_calls for w in wrappers) == 0
    assert "dropout is active inside the MLP" in caplog.text
    model.eval()  # dropout off: grad enabled tiles, no_grad does not
    model(input_ids=ids).logits.sum().backward()
    assert all(w.tiled_calls == 1 for w in wrappers)
    with torch.no_grad():
        model(input_ids=ids)
    assert all(w.tiled_calls == 1 for w in wrappers)


def lora_model(config, seed: int = 0, **build):
    """A model built from `config` (float32, random weights) with LoRA on every linear layer and gradient
    checkpointing."""
    from peft import get_peft_model

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **build)
    model = get_peft_model(model, LoraConfig(**LORA))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    for name, param in model.named_parameters():  # LoRA's B starts at zero: give it values so every path carries grad
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    model.train()
    return model


def lora_qwen2(seed: int = 0):
    """A 2-layer, hidden-64 Qwen2 (float32, random weights) with LoRA on every linear layer and gradient checkpointing."""
    return lora_model(fit.known_config("tiny-qwen2"), seed)


def lora_gemma2(seed: int = 0):
    """A 2-layer, hidden-64 Gemma 2: its decoder layer normalizes the MLP's output (post_feedforward_layernorm)."""
    from transformers import Gemma2Config

    config = Gemma2Config(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=32)  # fmt: skip
    return lora_model(config, seed, attn_implementation="eager")


def count_down_proj_calls(model) -> list[int]:
    """A counter of the MLP down projections' forwards (one per tile per pass through an MLP)."""
    calls = [0]
    for name, module in model.named_modules():
        if name.endswith("mlp.down_proj"):
            module.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def lora_grad_norm(model, ids: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    logits = model(input_ids=ids).logits
    (logits.float().log_softmax(-1)[..., 0].mean()).backward()
    grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    return float(torch.linalg.vector_norm(torch.stack([g.double().norm() for g in grads]))), grads


def test_tiled_mlp_auto_default_tiles_long_micro_batches_with_the_same_gradient(caplog):
    """The default, tiled_mlp_tokens='auto': a micro-batch forward of more than AUTO_MIN_TOKENS positions runs every
    MLP in tiles (said once, with why), one of at most that many runs it whole; the LoRA gradient is the untiled
    model's: norm equal to 6 significant digits, every entry within float32 rounding of the sliced products."""
    from grpo_plus.long_completions import tiled_mlp

    assert grpo_plus.GRPOConfig(output_dir="unused", use_cpu=True).tiled_mlp_tokens == "auto"
    rows, over = 8, tiled_mlp.AUTO_MIN_TOKENS // 8 + 8  # 8 rows, 8 positions per row over the threshold
    ids = torch.randint(3, 500, (rows, over), generator=torch.Generator().manual_seed(0))
    whole_norm, whole = lora_grad_norm(lora_qwen2(), ids)
    model = lora_qwen2()
    tiled_mlp._noted.discard("auto")
    wrappers = tile_mlps(model, "auto")
    with caplog.at_level(logging.WARNING, logger="grpo_plus.long_completions.tiled_mlp"):
        tiled_norm, tiled = lora_grad_norm(model, ids)  # every layer's MLP, forward and recompute, tiled
    assert all(w.tiled_calls > 0 for w in wrappers), "the default did not tile a long micro-batch"
    assert caplog.text.count("tiled_mlp_tokens='auto'") == 1 and "turns it off" in caplog.text
    assert f"{tiled_norm:.6g}" == f"{whole_norm:.6g}"
    assert max((a - b).abs().max().item() for a, b in zip(tiled, whole, strict=True)) < TILED_BOUND
    calls = [w.tiled_calls for w in wrappers]
    model.zero_grad()
    lora_grad_norm(model, ids[:, : tiled_mlp.AUTO_MIN_TOKENS // rows])  # exactly the threshold: whole
    assert [w.tiled_calls for w in wrappers] == calls


def tiled_against_whole(build, ids: torch.Tensor, tokens: int):
    """(largest |tiled - whole| LoRA gradient entry, the wrappers, the down projections' forwards in the tiled pass)."""
    _, whole = lora_grad_norm(build(), ids)
    model = build()
    wrappers = tile_mlps(model, tokens)
    calls = count_down_proj_calls(model)
    _, tiled = lora_grad_norm(model, ids)
    return max((a - b).abs().max().item() for a, b in zip(tiled, whole, strict=True)), wrappers, calls[0]


def test_tiled_mlp_under_checkpointing_runs_each_mlp_twice_per_step_as_whole_does(monkeypatch):
    """Under gradient checkpointing an untiled MLP runs twice per step (forward, the layer's recompute); tiled, the
    layer's recompute only saves the MLP's input and leaves its output unwritten (a Qwen2 layer only adds it to the
    residual), and the backward recomputes each tile: 2 x 5 tiles, not 3 x 5, per layer, with the untiled gradient.
    Negative control: with the recompute running the tiles (as nested checkpoints did) the count is 3 x 5."""
    from grpo_plus.long_completions import tiled_mlp

    ids = torch.randint(3, 500, (8, 300), generator=torch.Generator().manual_seed(0))  # 2,400 positions: 5 tiles
    gap, wrappers, calls = tiled_against_whole(lora_qwen2, ids, 512)
    assert [(w.output_only_added, w.tiled_calls, w.skipped_recomputes) for w in wrappers] == [(True, 2, 1)] * 2
    assert calls == 2 * 5 * len(wrappers)
    assert gap < TILED_BOUND
    monkeypatch.setattr(tiled_mlp, "output_only_added", lambda output, layer_input: False)
    _, wrappers, calls = tiled_against_whole(lora_qwen2, ids, 512)
    assert calls == 3 * 5 * len(wrappers) and not any(w.skipped_recomputes for w in wrappers)


def test_tiled_mlp_recomputes_the_output_a_layer_normalizes(monkeypatch):
    """Gemma 2 normalizes the MLP's output before the residual addition (the norm saves it): the first tiled forward's
    graph shows it, so the layer's recompute runs the tiles and the gradient is the untiled one. Negative control:
    leaving that output unwritten feeds the norm's backward uninitialized memory."""
    from grpo_plus.long_completions import tiled_mlp

    ids = torch.randint(3, 500, (4, 100), generator=torch.Generator().manual_seed(0))
    gap, wrappers, calls = tiled_against_whole(lora_gemma2, ids, 64)
    assert [(w.output_only_added, w.skipped_recomputes) for w in wrappers] == [(False, 0)] * 2
    assert calls == 3 * 7 * len(wrappers)  # 400 positions: 7 tiles
    assert gap < NORMALIZED_TILED_BOUND
    monkeypatch.setattr(tiled_mlp, "output_only_added", lambda output, layer_input: True)
    gap, wrappers, _ = tiled_against_whole(lora_gemma2, ids, 64)
    assert all(w.skipped_recomputes for w in wrappers)
    assert not gap < 1e-3  # NaN or far off


def test_tiled_mlp_with_still_sharded_weights_runs_nested_checkpoints(monkeypatch):
    """Weights still sharded when the MLP is called (an FSDP2 DTensor) get their gradient through the engine's hooks:
    their tiles run under torch's nested checkpoints, with the untiled gradient and the nested checkpoints' cost
    (forward 5 tiles, the layer's recompute 4: torch stops it early before the last tile's work, backward 5)."""
    from grpo_plus.long_completions import tiled_mlp

    ids = torch.randint(3, 500, (8, 300), generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(tiled_mlp, "_sharded", lambda param: True)
    monkeypatch.setattr(tiled_mlp._TiledMLPFunction, "apply", None)  # the autograd function is not reached
    gap, wrappers, calls = tiled_against_whole(lora_qwen2, ids, 512)
    assert calls == (5 + 4 + 5) * len(wrappers) and all(w.tiled_calls == 2 for w in wrappers)
    assert gap < TILED_BOUND


def test_tiled_mlp_stands_aside_under_zero3(caplog):
    """DeepSpeed ZeRO-3 (its weights carry `ds_id`) gathers a projection's weights at each call, a collective: tiles in
    different numbers on different ranks would hang, so the MLP runs whole, said once."""

    def ds_marked(seed: int = 0):
        model = lora_qwen2(seed)
        for _, mlp in decoder_mlps(model):
            for param in mlp.parameters():
                param.ds_id = 0
        return model

    from grpo_plus.long_completions import tiled_mlp

    tiled_mlp._noted.difference_update({reason for reason in tiled_mlp._noted if "ZeRO-3" in reason})
    ids = torch.randint(3, 500, (8, 300), generator=torch.Generator().manual_seed(0))
    with caplog.at_level(logging.WARNING, logger="grpo_plus.long_completions.tiled_mlp"):
        gap, wrappers, calls = tiled_against_whole(ds_marked, ids, 512)
    assert calls == 2 * len(wrappers) and not any(w.tiled_calls for w in wrappers)
    assert caplog.text.count("DeepSpeed ZeRO-3 gathers") == 1
    assert gap == 0.0


def test_tiled_mlp_setting_is_checked_and_none_turns_it_off(tmp_path):
    """'auto', a positive integer (also as the command line gives it) or None; anything else fails at construction;
    None leaves every MLP whole."""
    from helpers.models import tiny_run_kwargs

    assert grpo_plus.GRPOConfig(**tiny_run_kwargs(tmp_path, tiled_mlp_tokens="4096"))  # the CLI's string
    with pytest.raises(ConfigError, match="tiled_mlp_tokens"):
        grpo_plus.GRPOConfig(**tiny_run_kwargs(tmp_path, tiled_mlp_tokens="big"))
    with pytest.raises(ValueError, match="not allowed"):
        tile_mlps(lora_qwen2(), -1)
    with pytest.raises(ValueError, match="needs a tiled_mlp_tokens setting that is on"):
        tile_mlps(lora_qwen2(), None)


# ---- the count on a fake accelerator ----------------------------------------------------------------------------------


def tiny_spec(**changes) -> fit.FitSpec:
    config = fit.known_config("tiny-qwen2")
    spec = fit.FitSpec(
        model_config=config.to_dict(), weights_dtype="float32", rows=8, num_generations=4, generation_rows=8,
        prompt_tokens=12, completion_tokens=40, lora=LORA, mixed_precision="no", loss={"loss_type": "dapo"},
    )  # fmt: skip
    return spec.replace(**changes)


@needs_cpu_logps
@needs_fused_lm_head
@pytest.mark.parametrize("side", fit.SIDES)
@pytest.mark.engine  # a heavy memory count (moved out of make test: its 10-minute budget)
def test_training_pass_runs_on_a_fake_accelerator(side):
    """TRL's and grpo_plus's `_compute_loss`, forward and backward, with the model on the fake accelerator (nothing on
    the CPU but what the code moves there), gradient checkpointing on; every value the pass reads is known (no value
    faked). With activation offloading (grpo_plus), TRL's manager moves what autograd saves to the host: the device
    holds less at the end of the forward, the host about what was saved."""
    spec = tiny_spec(
        gradient_checkpointing=True, completion_tokens=200, weights_dtype="bfloat16", mixed_precision="bf16"
    )
    kernels: list[str] = []
    plain = fit.measure_pass(spec, side, layers=2, kernels=kernels)
    assert plain.items_faked == 0 and plain.saved > 0 and plain.peak > plain.after_forward > plain.saved
    # Prompts of different lengths: TRL's forward builds a padding mask (the efficient kernel takes it); grpo_plus runs
    # each row without its padding and without a mask (the causal flash kernel).
    assert kernels == (["efficient"] if side == "trl" else ["flash"])
    if side == "grpo_plus":
        offloaded = fit.measure_pass(spec.replace(activation_offloading=True), side, layers=2)
        assert offloaded.items_faked == 0
        assert offloaded.after_forward < plain.after_forward - 0.25 * plain.saved  # TRL keeps <= 5 in flight
        assert offloaded.host_peak >= 0.8 * plain.saved


@needs_cpu_logps
def test_a_tensor_made_on_the_wrong_device_fails_the_fake_pass(monkeypatch):
    """The fake accelerator catches what a GPU would: a CPU tensor mixed into grpo_plus's loss path raises."""
    from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError

    original = grpo_plus.algorithms.micro_batch_loss.compute_policy_loss

    def made_on_the_cpu(logps, old_logps, advantages, mask, **kwargs):
        return original(logps, old_logps, advantages, mask * torch.ones(mask.shape), **kwargs)

    monkeypatch.setattr(grpo_plus.algorithms.micro_batch_loss, "compute_policy_loss", made_on_the_cpu)
    with pytest.raises(FakeTensorDeviceMismatchError):
        fit.measure_pass(tiny_spec(), "grpo_plus", layers=1)


@needs_cpu_logps
@needs_fused_lm_head
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("side", fit.SIDES)
@pytest.mark.engine  # a heavy memory count (moved out of make test: its 10-minute budget)
def test_fake_count_equals_real_compute(side, attention):
    """At small shapes the same pass computed for real on the CPU (random weights) allocates what the fake count
    counts, to the byte (TRL's CPU fold in the LM head on both sides; with sdpa, the count made with a CPU's attention
    kernel, `CpuAttentionKernels`, with equal prompts: no mask). Negative control: the same sdpa pass counted with the
    kernel CUDA picks (float32: the math path, every score materialized, or the memory-efficient one) is not the CPU's."""
    spec = tiny_spec(attn_implementation=attention, gradient_checkpointing=True, padded_prompts=attention == "eager")
    real = fit.measure_pass(spec, side, layers=2, real=True, lm_head="cpu")
    kernels: list = []
    fake = fit.measure_pass(spec, side, layers=2, lm_head="cpu", kernels=kernels)
    assert (fake.saved, fake.after_forward, fake.forward_peak, fake.peak) == (
        real.saved, real.after_forward, real.forward_peak, real.peak,
    )  # fmt: skip
    if attention == "sdpa":
        assert kernels == ["flash_cpu"]
        cuda_kernels: list = []
        cuda_choice = fit.measure_pass(spec, side, layers=2, kernels=cuda_kernels)
        assert "flash_cpu" not in cuda_kernels and cuda_choice.peak != real.peak


@needs_cpu_logps
@needs_fused_lm_head
def test_fake_count_of_grouped_query_heads_equals_real_compute(monkeypatch):
    """Grouped-query heads without a mask (TRL's rows of one length: transformers passes `enable_gqa=True`): this
    torch's CPU flash kernel takes the keys and values as they are, and the count, made with that kernel, allocates
    what the real pass does to the byte (without gradient checkpointing the kernel's inputs are saved for backward).
    Negative control: counted as if the kernel took them repeated to the query's heads, the count is over by the
    repeated copies (the 6.6% the count overstated bench-memory-real's peak at 4,096 tokens)."""
    from grpo_plus.fit import attention

    assert attention.cpu_flash_takes_grouped_heads()
    spec = tiny_spec(
        attn_implementation="sdpa", completion_tokens=200, padded_prompts=False, gradient_checkpointing=False
    )
    config = spec.config()
    assert config.num_key_value_heads < config.num_attention_heads
    real = fit.measure_pass(spec, "trl", layers=2, real=True, lm_head="cpu")
    fake = fit.measure_pass(spec, "trl", layers=2, lm_head="cpu")
    counts = ("saved", "after_forward", "forward_peak", "peak")
    assert [getattr(fake, name) for name in counts] == [getattr(real, name) for name in counts]
    monkeypatch.setattr(attention, "cpu_flash_takes_grouped_heads", lambda: False)
    repeated = fit.measure_pass(spec, "trl", layers=2, lm_head="cpu")
    # The kernel saves the repeated keys and values for backward in place of the grouped ones, in each of two layers.
    head_dim = config.hidden_size // config.num_attention_heads
    more_heads = config.num_attention_heads - config.num_key_value_heads
    tokens = spec.rows * (spec.prompt_length + spec.completion_tokens)
    assert repeated.saved - real.saved == 2 * 2 * tokens * more_heads * head_dim * 4


@needs_cpu_logps
@pytest.mark.engine  # a heavy memory count (moved out of make test: its 10-minute budget)
def test_depth_extrapolation_and_the_generation_count(monkeypatch):
    """Counts at 1 and 2 layers extend to 3 exactly (layers are identical); generation holds every row's keys and
    values at full length (an offloaded cache two layers of them)."""
    spec = tiny_spec(
        gradient_checkpointing=True, model_config=fit.known_config("tiny-qwen2", num_hidden_layers=3).to_dict()
    )
    points = [fit.measure_pass(spec, "grpo_plus", layers) for layers in (1, 2, 3)]
    assert fit.extrapolate(points, 3) == points[2]
    counted = {layers: fit.measure_generation(spec, layers) for layers in (1, 2)}  # counted once, for both caches
    monkeypatch.setattr(fit.count, "measure_generation", lambda spec, layers, rows=None: counted[layers])
    dynamic = fit.generation(spec)
    config = spec.config()
    head_dim = config.hidden_size // config.num_attention_heads
    one_layer = 2 * spec.generation_rows * config.num_key_value_heads * head_dim * (
        spec.prompt_tokens + spec.completion_tokens - 1
    ) * 4  # fmt: skip
    assert dynamic["kv_cache_on_device"] == 3 * one_layer
    assert fit.generation(spec.replace(offloaded_kv_cache=True))["kv_cache_on_device"] == 2 * one_layer


# ---- the fit check and grpo-plus fit ------------------------------------------------------------------------------------


def test_shipped_configs_become_fit_specs_with_their_models_shapes():
    from pathlib import Path

    from grpo_plus.app.cli import fit_spec_from_yaml

    configs = Path(__file__).resolve().parents[1] / "recipes" / "configs"
    expected = {"demo_cpu": (30, 576, False, 16, 16), "qwen2.5-0.5b_lora": (24, 896, False, 8, 32),
                "qwen2.5-1.5b_lora": (28, 1536, False, 8, 32), "qwen2.5-7b_qlora": (28, 3584, True, 4, 32),
                "olmoe-1b-7b_qlora": (16, 2048, True, 4, 32)}  # fmt: skip
    for name, (layers, hidden, four_bit, rows, generated) in expected.items():
        spec = fit_spec_from_yaml(configs / f"{name}.yaml", prompt_tokens=128)
        assert (spec.layers, spec.config().hidden_size, spec.four_bit, spec.rows, spec.generation_rows) == (
            layers, hidden, four_bit, rows, generated,
        ), name  # fmt: skip
        assert spec.lora["r"] == (16 if name in ("demo_cpu", "qwen2.5-7b_qlora", "olmoe-1b-7b_qlora") else 32)
        if name.startswith("olmoe"):  # a mixture of experts: 64 experts, 8 routed; LoRA on the experts too
            assert (spec.config().num_experts, spec.config().num_experts_per_tok) == (64, 8)
            assert spec.lora["target_parameters"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]


@pytest.mark.parametrize(("mode", "fraction"), [("colocate", 0.3), ("server", 0.0)])
def test_fit_leaves_colocated_vllm_its_share_and_counts_no_generation(tmp_path, mode, fraction):
    """With vLLM the trainer's model never generates (generation term 0); a colocated engine takes
    vllm_gpu_memory_utilization of the card, which the training side's budget leaves out; a server is elsewhere."""
    from pathlib import Path

    from grpo_plus.app.cli import fit_spec_from_yaml

    demo = Path(__file__).resolve().parents[1] / "recipes" / "configs" / "demo_cpu.yaml"
    config = tmp_path / "vllm.yaml"
    config.write_text(demo.read_text() + f"\nuse_vllm: true\nvllm_mode: {mode}\nvllm_gpu_memory_utilization: 0.3\n")
    plain, spec = (fit_spec_from_yaml(path, prompt_tokens=128) for path in (demo, config))
    assert (plain.vllm_generates, plain.vllm_memory_fraction) == (False, 0.0)
    assert (spec.vllm_generates, spec.vllm_memory_fraction) == (True, fraction)
    assert fit.generation(spec) == {"prefill": 0, "decode": 0, "kv_cache_on_device": 0, "peak": 0}
    card, reserve = 24 * fit.GIB, fit.GIB
    assert fit.card_budget(plain, card, reserve) == 23 * fit.GIB
    assert fit.card_budget(spec, card, reserve) == int(24 * (1 - fraction) * fit.GIB) - fit.GIB
    assert fit.FitSpec.from_json(spec.to_json()).vllm_memory_fraction == fraction  # what the check's child reads


@pytest.mark.parametrize("boundary", [1, 2, 37, 63, 64])
def test_the_search_finds_the_exact_boundary_of_an_increasing_cost(boundary):
    """`largest_within` (the longest-completion and largest-G searches) returns exactly the last n whose cost fits,
    for costs that are affine, or the max of two affine pieces (a binding term that takes over), in few evaluations."""
    for cost in (lambda n: 10 * n, lambda n: max(10 * n, 40 * n - 900)):
        budget = cost(boundary)
        calls: list[int] = []
        found = fit.largest_within(lambda n, cost=cost, calls=calls: calls.append(n) or cost(n), budget, 1, 64)
        assert found == boundary and len(calls) <= 8, (found, calls)
    assert fit.largest_within(lambda n: 10 * n, 5, 1, 64) == 0


def cli_fit(tmp_path, capsys, *extra) -> str:
    """`grpo-plus fit` on a config of a tiny model with a short context window (1 + 3 x 128 positions)."""
    from grpo_plus.app.cli import main

    fit.known_config("tiny-qwen2", max_position_embeddings=16 + 3 * fit.LENGTH_STEP).save_pretrained(tmp_path / "m")
    (tmp_path / "run.yaml").write_text(
        f"model_name_or_path: {tmp_path / 'm'}\ndtype: float32\nuse_peft: true\nlora_r: 4\nlora_alpha: 8\n"
        "lora_dropout: 0.0\nlora_target_modules: all-linear\nbf16: false\nper_device_train_batch_size: 64\n"
        "num_generations: 8\nmax_completion_length: 128\nloss_type: dapo\ngradient_checkpointing: false\n"
    )
    assert main(["fit", "--config", str(tmp_path / "run.yaml"), "--prompt-tokens", "16", "--no-groups", *extra]) == 0
    return capsys.readouterr().out


@pytest.mark.engine  # slow: a dozen full counts (minutes on a loaded 2-core machine); make test-engines runs it
@needs_cpu_logps
def test_cli_fit_prints_each_part_for_both_sides_and_the_longest_completions(tmp_path, capsys):
    """Both sides' parts at the config's settings, over budget with the settings that would fit, the longest completions
    with every memory option (grpo_plus's at least TRL's, the context window marked) and the last line in its form."""
    out = cli_fit(tmp_path, capsys, "--memory-gib", "0.9", "--reserve-gib", "0")
    for part in ("weights", "training pass (activations, peak)", "generation (KV cache + step)", "worst step"):
        assert part in out
    last = out.strip().splitlines()[-1]
    match = re.fullmatch(r"longest completion: TRL (\d+) tokens, grpo_plus (\d+) tokens \(([\d.]+)x\)", last)
    assert match, out
    trl_tokens, ours = int(match[1]), int(match[2])
    assert 0 < trl_tokens <= ours and float(match[3]) == pytest.approx(ours / trl_tokens, abs=0.01)


def test_the_trainer_checks_the_fit_on_a_cuda_device_with_the_runs_own_spec(tmp_path, monkeypatch):
    """Built on a CUDA device (stood in for here: the device the trainer reports), the trainer counts its own run
    before step 1: batch, G, lengths, LoRA, grpo_plus's settings, the prompts' lengths measured from its dataset, and
    the fit_check mode; on a CPU it does not."""
    import accelerate
    from helpers.models import make_model, make_tokenizer

    tokenizer = make_tokenizer()
    args = grpo_plus.GRPOConfig(**tiny_run_kwargs(tmp_path, tiled_mlp_tokens=64, gradient_accumulation_steps=2,
                                                  fit_check="error"))  # fmt: skip
    seen = []
    monkeypatch.setattr(fit.check, "device_budget", lambda device: (10 * fit.GIB, 0))
    monkeypatch.setattr(fit.check, "check_fit", lambda spec, budget, device, mode: seen.append((spec, budget, mode)))
    trainer = grpo_plus.GRPOTrainer(model=make_model(tokenizer), processing_class=tokenizer,
                                    reward_funcs=[length_reward], args=args, train_dataset=prompt_dataset(8),
                                    peft_config=LoraConfig(**LORA))  # fmt: skip
    assert seen == []  # built on the CPU: no check
    monkeypatch.setattr(accelerate.Accelerator, "device", property(lambda self: torch.device("cuda")))
    trainer._long_completions_setup()
    ((spec, budget, mode),) = seen
    assert (spec.rows, spec.num_generations, spec.generation_rows, spec.completion_tokens) == (4, 4, 8, 8)
    assert spec.lora["r"] == 4 and spec.tiled_mlp_tokens == 64 and not spec.activation_offloading
    lengths = {len(tokenizer(row["prompt"])["input_ids"]) for row in prompt_dataset(8)}
    assert spec.prompt_tokens == max(lengths) and spec.padded_prompts == (len(lengths) > 1)
    assert budget == 10 * fit.GIB and mode == "error"
    assert fit.FitSpec.from_json(spec.to_json()).to_json() == spec.to_json()  # what the child process reads


def wide_mlp_spec() -> fit.FitSpec:
    """A step whose MLP intermediates bind: a wide MLP, 8 rows of 1,012 positions (tiles of 4096: two per forward)."""
    config = fit.known_config("tiny-qwen2")
    config.intermediate_size = 8192
    return tiny_spec(model_config=config.to_dict(), completion_tokens=1000, gradient_checkpointing=True,
                     tiled_mlp_tokens=None)  # fmt: skip


@needs_cpu_logps
@needs_fused_lm_head
@pytest.mark.engine  # a heavy memory count (moved out of make test: its 10-minute budget)
def test_fit_check_auto_chooses_the_options_that_make_the_step_fit():
    """fit_check='auto''s choice: nothing where the step fits as configured, the tiled MLP alone where it is enough
    (activation offloading saves nothing here: two layers' checkpoints), None where nothing fits. Counted as the
    trainer's child counts it (`grpo_plus.fit.__main__`): within `remembered_counts`, each of the four steps once."""
    spec = wide_mlp_spec()
    with fit.count.remembered_counts():
        plain = fit.estimate(spec, "grpo_plus").total
        tiled = fit.estimate(spec.replace(tiled_mlp_tokens=4096), "grpo_plus").total
        assert tiled < 0.6 * plain  # measured: 844 against 1,593 MiB
        assert fit.automatic_options(spec, plain) == ({}, fit.estimate(spec, "grpo_plus"))
        options, result = fit.automatic_options(spec, plain - 1)
        assert options == {"tiled_mlp_tokens": 4096} and result.total == tiled
        assert fit.automatic_options(spec, tiled - 1) is None


@pytest.mark.engine  # slow: the child's counts and the refusal's search (a minute on this 2-core machine)
@needs_cpu_logps
@needs_fused_lm_head
def test_fit_check_auto_turns_on_what_makes_the_step_fit_and_refuses_with_the_numbers(caplog):
    """The trainer's check in its child process with fit_check='auto' (as on a CUDA device): a budget the plain step
    exceeds and the tiled one fits gets tiled_mlp_tokens=4096 turned on, named in the log with the new count, and
    nothing else; a budget nothing fits is refused with the numbers."""
    spec = wide_mlp_spec()
    plain = fit.estimate(spec, "grpo_plus").total
    tiled = fit.estimate(spec.replace(tiled_mlp_tokens=4096), "grpo_plus").total
    margin = 1 + fit.check.FRAGMENTATION
    with caplog.at_level(logging.WARNING, logger="grpo_plus.fit.check"):
        result = fit.check.check_fit(spec, int((tiled + plain) / 2 * margin), "cuda:0", "auto")
    assert (result.spec.tiled_mlp_tokens, result.spec.activation_offloading) == (4096, False)
    assert result.turned_on == {"tiled_mlp_tokens": 4096}
    assert result.total == tiled
    assert (
        "Turned on tiled_mlp_tokens=4096: now" in caplog.text and f"{tiled * margin / fit.GIB:.2f} GiB" in caplog.text
    )
    with pytest.raises(fit.check.FitCheckError, match=r"needs [\d.]+ GiB on cuda:0 .*; [\d.]+ GiB are there"):
        fit.check.check_fit(spec, int(tiled / 2), "cuda:0", "auto")


def test_the_trainer_turns_on_what_fit_check_auto_chose(tmp_path, monkeypatch):
    """On a CUDA device (stood in for) the trainer applies the check's choice before step 1: its decoder MLPs tiled
    and its training step offloaded, where its own settings had neither (the check stood in for by its answer)."""
    import accelerate
    from helpers.models import make_model, make_tokenizer

    tokenizer = make_tokenizer()
    args = grpo_plus.GRPOConfig(**tiny_run_kwargs(tmp_path, tiled_mlp_tokens=None, fit_check="auto"))
    trainer = grpo_plus.GRPOTrainer(model=make_model(tokenizer), processing_class=tokenizer,
                                    reward_funcs=[length_reward], args=args, train_dataset=prompt_dataset(8))  # fmt: skip
    assert decoder_mlps(trainer.model) and not any(
        isinstance(mlp.forward, TiledMLP) for _, mlp in decoder_mlps(trainer.model)
    )
    chosen = dict(tiled_mlp_tokens=4096, activation_offloading=True)
    monkeypatch.setattr(fit.check, "device_budget", lambda device: (10 * fit.GIB, 0))
    monkeypatch.setattr(fit.check, "check_fit", lambda spec, budget, device, mode: fit.StepEstimate(
        "grpo_plus", spec.replace(**chosen), 0, fit.PassMemory(0, 0, 0, 0, 0), 0, turned_on=chosen))  # fmt: skip
    offloaded = []
    monkeypatch.setattr(grpo_plus.trainer, "training_step_context", lambda model, device, on: offloaded.append(on))
    monkeypatch.setattr(accelerate.Accelerator, "device", property(lambda self: torch.device("cuda")))
    trainer._long_completions_setup()
    assert all(isinstance(mlp.forward, TiledMLP) for _, mlp in decoder_mlps(trainer.model)) and offloaded == [True]


@pytest.mark.parametrize(("field", "value", "fragment"), [
    ("fit_check", "maybe", "fit_check='maybe' is not allowed"),
    ("tiled_mlp_tokens", 0, "tiled_mlp_tokens=0 is not allowed"),
])  # fmt: skip
def test_bad_settings_fail_at_config_time(tmp_path, field, value, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        grpo_plus.GRPOConfig(**tiny_run_kwargs(tmp_path, **{field: value}))


@needs_cpu_logps
def test_offload_cost_benchmark_smoke(tmp_path, monkeypatch, benchmark_in_this_process):
    """benchmarks/offload_cost.py --smoke times every variant, and the offloading variants pack tensors."""
    import runpy
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "offload_cost.py"  # imports benchmarks/harness/
    output = tmp_path / "cost.json"
    monkeypatch.setattr(sys, "argv", [str(script), "--smoke", "--json", str(output)])
    monkeypatch.setattr(torch.cpu, "empty_cache", lambda: None, raising=False)  # left as it was after the test
    runpy.run_path(str(script), run_name="__main__")
    (row,) = json.loads(output.read_text())["rows"]
    assert set(row["seconds"]) == {"plain", "activation offloading", "tiled MLP", "both"}
    assert all(seconds > 0 for seconds in row["seconds"].values())
    assert row["tensors_offloaded"]["activation offloading"] > 0 and row["tensors_offloaded"]["plain"] == 0
    assert row["tiled_calls"] > 0


# ---- the LM head's tile (grpo_plus.long_completions.lm_head_tiles) -----------------------------------------------------------------------


def fused_head_model(vocab: int) -> torch.nn.Module:
    """A one-layer float32 Qwen2 of `vocab` tokens with TRL's fused LM head (log-probs and entropies)."""
    from trl.trainer.utils import add_fused_lm_head

    config = fit.known_config("tiny-qwen2", vocab_size=vocab, num_hidden_layers=1, hidden_size=32,
                              intermediate_size=64, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    return model


def fused_pass(model, setting, rows: int, length: int, widths: list) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(log-probs, entropies, gradients) of one fused-head forward + backward with `lm_head_tile_columns=setting`;
    `widths` receives the tile width TRL's function was called with."""
    import trl.trainer.utils as trl_utils

    from grpo_plus.long_completions.lm_head_tiles import size_lm_head_tiles

    original = trl_utils._ChunkedLogProbFunction

    class Recorded:
        @staticmethod
        def apply(*args):
            widths.append(args[5])
            return original.apply(*args)

    assert size_lm_head_tiles(model, setting)
    model.zero_grad()
    ids = torch.randint(0, model.config.vocab_size, (rows, length), generator=torch.Generator().manual_seed(1))
    trl_utils._ChunkedLogProbFunction = Recorded
    try:
        out = model(input_ids=ids, shift_labels=ids.roll(-1, 1), fused_lm_head=True)
    finally:
        trl_utils._ChunkedLogProbFunction = original
    (out.log_probs.sum() + 0.1 * out.entropy.sum()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return out.log_probs.detach(), out.entropy.detach(), grads


@needs_cpu_logps
@needs_fused_lm_head
def test_lm_head_tile_never_wider_than_the_vocabulary_bit_for_bit():
    """lm_head_tile_columns='auto' below the token threshold: a vocabulary narrower than TRL's 32,768-column tile gets
    a tile of its own width (one tile either way): log-probs, entropies and every gradient equal TRL's tile's bit for
    bit. A vocabulary wider than TRL's tile keeps TRL's width (negative control: a width of 1,024 moves the entropies
    by rounding)."""
    model = fused_head_model(vocab=2048)
    widths: list = []
    trl_tile = fused_pass(model, None, rows=4, length=64, widths=widths)
    auto = fused_pass(model, "auto", rows=4, length=64, widths=widths)
    assert widths == [32768, 2048]
    assert torch.equal(trl_tile[0], auto[0]) and torch.equal(trl_tile[1], auto[1])
    assert all(torch.equal(trl_tile[2][name], auto[2][name]) for name in trl_tile[2])
    narrow = fused_pass(model, 1024, rows=4, length=64, widths=widths)
    assert widths[-1] == 1024 and not torch.equal(trl_tile[1], narrow[1])
    from grpo_plus.long_completions.lm_head_tiles import tile_columns

    assert tile_columns("auto", vocab=151936, tokens=100, trl_columns=32768, folds_in_torch=True) == 32768


@needs_cpu_logps
@needs_fused_lm_head
@pytest.mark.engine  # a heavy memory count (moved out of make test: its 10-minute budget)
def test_lm_head_tile_auto_narrows_the_cpu_fold_of_a_long_micro_batch(caplog):
    """Where torch folds the tiles (this CPU), a forward scoring more than 8,192 positions gets 4,096-column tiles:
    the same log-probs, entropies and gradients up to float32 rounding (gaps measured: 1.9e-6 on log-probs of up to 9,
    7.2e-7 of the largest gradient entry), said once
    in the log. At 8,192 positions (negative control) TRL's tile, less the vocabulary's width. The count of such a
    pass (`grpo_plus.fit`, the CPU's fold) is smaller by the narrower tile's temporaries; on a GPU (Triton folds the
    tiles) 'auto' keeps the width."""
    import grpo_plus.long_completions.lm_head_tiles as lm_head_tiles

    lm_head_tiles._noted.clear()
    model = fused_head_model(vocab=6144)
    widths: list = []
    with caplog.at_level(logging.WARNING, logger="grpo_plus.long_completions.lm_head_tiles"):
        whole = fused_pass(model, None, rows=8, length=1101, widths=widths)  # 8 x 1,101 = 8,808 scored positions
        tiled = fused_pass(model, "auto", rows=8, length=1101, widths=widths)
        fused_pass(model, "auto", rows=8, length=1101, widths=widths)
        at_threshold = fused_pass(model, "auto", rows=8, length=1024, widths=widths)  # 8,192 positions
    assert widths == [32768, 4096, 4096, 6144]
    assert sum("lm_head_tile_columns='auto'" in r.message for r in caplog.records) == 1
    for ours, theirs in zip(tiled[:2], whole[:2], strict=True):
        assert not torch.equal(ours, theirs)  # folded over two tiles instead of one: rounding moves
        torch.testing.assert_close(ours, theirs, rtol=0, atol=4e-6)
    for name, grad in whole[2].items():
        scale = grad.abs().max().item()
        assert (tiled[2][name] - grad).abs().max().item() <= 3e-6 * max(scale, 1.0), name  # worst 9.4e-7: 3.2x
    assert at_threshold[0].shape == (8, 1024)

    spec = tiny_spec(model_config=fit.known_config("tiny-qwen2", vocab_size=6144).to_dict(), rows=8,
                     completion_tokens=1100, prompt_tokens=12, padded_prompts=False)  # fmt: skip
    counts = {setting: fit.measure_pass(spec.replace(lm_head_tile_columns=setting), "grpo_plus", 1, lm_head="cpu").peak
              for setting in (None, "auto")}  # fmt: skip
    assert counts["auto"] < counts[None]
    on_gpu = {setting: fit.measure_pass(spec.replace(lm_head_tile_columns=setting), "grpo_plus", 1).peak
              for setting in (6144, "auto")}  # fmt: skip
    assert on_gpu["auto"] == on_gpu[6144]


def test_lm_head_tile_setting_is_checked_early():
    """A bad lm_head_tile_columns fails when the config is built, naming what is allowed; strings from a command line
    or YAML read as the value they name."""
    from grpo_plus.long_completions.lm_head_tiles import check_setting

    for bad in (0, -4, "wide", 2.5, True):
        with pytest.raises(ConfigError, match="lm_head_tile_columns.*'auto', a positive number of vocabulary columns"):
            grpo_plus.GRPOConfig(output_dir="unused", use_cpu=True, lm_head_tile_columns=bad)
    assert [check_setting(value) for value in ("4096", "none", "auto", None, 512)] == [4096, None, "auto", None, 512]
