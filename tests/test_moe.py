"""Mixture-of-experts models (issue 53): tiny Qwen3-MoE, OLMoE, Mixtral and gpt-oss (4 experts, top 2, random init)
train stock TRL's weights in float32 with grpo_plus's savings on, the router's auxiliary (load-balancing) loss on and
off; the zero-advantage rows stand aside only where that loss reads them (shown with its numbers); a config with
`output_router_logits=True` generates (stock TRL fails there) and trains; LoRA reaches attention and experts; the
memory count runs the experts as the real pass does, to the byte."""

from __future__ import annotations

import logging

import pytest
import torch
import trl
from datasets import Dataset
from helpers.models import make_tokenizer, save_tiny_model, tiny_config, tiny_trainer
from helpers.probes import ForwardLog, max_weight_diff
from helpers.rewards import half_dead_reward
from helpers.tolerances import float32_bound
from peft import LoraConfig
from transformers import AutoModelForCausalLM
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

import grpo_plus
from grpo_plus.app.testing import MOE_FAMILIES
from grpo_plus.compat.moe import expert_counts, is_moe, recorded_router_logits, router_logits_off
from grpo_plus.compat.versions import SAVING_VERSION_FLOORS, version_gap
from grpo_plus.zero_waste import rows as zero_waste_rows
from grpo_plus.zero_waste.rows import weighted_load_balancing_loss

pytestmark = pytest.mark.floor("cpu_logps")
# Weights after two SGD steps in float32: the worst gap measured over the four families, aux loss on and off, full
# and LoRA, is 1.7e-8 on AVX-512 (gpt-oss, ragged prompts; one float32 ulp of a weight in [0.25, 0.5) is 3.0e-8) and
# 1.2e-7 on AVX2 (threads 1-2, eight training seeds; 6.0e-8 at the tests' seed), docs/notes.md, Tolerances.
WEIGHTS_BOUND = float32_bound(avx512=3e-8, avx2=3e-7)
# The aux loss grpo_plus computes over packed rows against TRL's over every row: worst measured 2.4e-7 (one float32 ulp
# of 2.0 is 2.4e-7: the sums run in another order); 4 ulps.
AUX_BOUND = 1e-6
LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# transformers 5's MoE layout (an experts module of 3D weights, the router's logits recorded): below these floors
# (docs/guide/versions.md) the experts are nn.Linear MLPs and the packed aux loss stands aside
needs_router_recorder = pytest.mark.floor("moe_router_logits")
needs_expert_weights = pytest.mark.floor("moe_experts")


def moe_model(family: str, **overrides):
    tokenizer = make_tokenizer()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, len(tokenizer), **overrides), dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def ragged_prompts() -> Dataset:
    """Prompts of 8 different lengths (left padding in every batch: where transformers' generate passes a mask), odd
    first digits dead under `half_dead_reward`."""
    return Dataset.from_list([{"prompt": f"{k % 9 + 1}" + "+2" * k + "="} for k in range(1, 9)])


def train(package, family: str, output_dir, lora: bool = False, dataset=None, overrides=None, **settings):
    """Two SGD steps of `package`'s trainer on a tiny `family` MoE in float32 (8 rows: 2 prompts x 4, half the groups
    dead); returns the trainer and a log of the model's forwards."""
    model, tokenizer = moe_model(family, **(overrides or {}))
    peft_config = LoraConfig(**LORA, target_parameters=EXPERT_PARAMETERS) if lora else None
    trainer = tiny_trainer(
        output_dir, [half_dead_reward], model=model, tokenizer=tokenizer, package=package, peft_config=peft_config,
        dataset=dataset, per_device_train_batch_size=8, max_completion_length=12, optim="sgd", learning_rate=0.5,
        **settings,
    )  # fmt: skip
    forwards = ForwardLog(trainer.model)
    trainer.train()
    return trainer, forwards


def logged(trainer, key: str) -> list:
    return [entry.get(key) for entry in trainer.state.log_history if "loss" in entry]


@needs_router_recorder
def test_the_tiny_families_route_two_of_four_experts_and_report_their_router():
    for family in MOE_FAMILIES:
        model, _ = moe_model(family)
        assert is_moe(model.config) and expert_counts(model.config) == (4, 2)
        ids = torch.randint(3, 60, (2, 5))
        with recorded_router_logits(model) as router_logits:
            out = model(input_ids=ids, output_router_logits=True)
        assert [tuple(logits.shape) for logits in router_logits] == [(10, 4), (10, 4)], family
        # what the hooks record is what transformers' recorder hands the loss
        assert all(torch.equal(a, b) for a, b in zip(router_logits, out.router_logits, strict=True))
        assert 0 < model.config.router_aux_loss_coef and not model.config.output_router_logits
    dense, _ = AutoModelForCausalLM.from_config(tiny_config("llama", 60)), None
    assert not is_moe(dense.config) and expert_counts(dense.config) is None


def test_weighted_load_balancing_loss_counts_a_weight_as_repeated_tokens():
    """The packed forward's loss: a position of weight w is w identical tokens of transformers' own loss (value and
    gradient); negative control: the same positions at weight 1 are another number."""
    torch.manual_seed(0)
    layers = [torch.randn(6, 4, requires_grad=True) for _ in range(2)]
    weights = torch.tensor([3.0, 1.0, 1.0, 0.0, 2.0, 1.0])
    repeats = weights.long()
    ours = weighted_load_balancing_loss(layers, weights, num_experts=4, top_k=2)
    repeated = tuple(logits.repeat_interleave(repeats, dim=0) for logits in layers)
    theirs = load_balancing_loss_func(repeated, 4, 2, torch.ones(1, int(repeats.sum())))
    assert abs(ours.item() - theirs.item()) <= 1e-6 * theirs.item()
    grads = torch.autograd.grad(ours, layers)
    expected = torch.autograd.grad(theirs, layers)
    assert all(torch.allclose(a, b, rtol=0, atol=1e-7) for a, b in zip(grads, expected, strict=True))
    unweighted = weighted_load_balancing_loss(layers, torch.ones(6), num_experts=4, top_k=2)
    assert abs(unweighted.item() - theirs.item()) > 1e-3


def test_dead_rows_change_trls_aux_loss_so_they_are_computed(caplog):
    """Why zero-advantage rows go through the model while the aux loss is on: TRL's load-balancing loss is a product
    of two means over every token of every row of the micro-batch, so leaving the dead rows out changes its value and
    the router's gradient (measured: 2.001635 against 2.002356, 3,000 float32 ulps, and router gradients 96% apart
    on this batch: half its rows left out)."""
    model, tokenizer = moe_model("qwen3_moe")
    torch.manual_seed(1)
    ids = torch.randint(3, len(tokenizer), (8, 16))
    live = torch.tensor([1, 1, 1, 1, 0, 0, 0, 0], dtype=torch.bool)

    def aux_and_router_grad(rows):
        model.zero_grad()
        out = model(input_ids=ids[rows], attention_mask=torch.ones_like(ids[rows]), output_router_logits=True)
        out.aux_loss.backward()
        return out.aux_loss.item(), model.model.layers[0].mlp.gate.weight.grad.clone()

    every_value, every_grad = aux_and_router_grad(torch.ones(8, dtype=torch.bool))
    live_value, live_grad = aux_and_router_grad(live)
    assert abs(every_value - live_value) > 1e-5  # 40 float32 ulps of 2.0: no rounding
    assert (every_grad - live_grad).norm() > 0.5 * every_grad.norm()


@pytest.mark.parametrize(
    ("family", "aux_loss", "lora"),
    [
        ("qwen3_moe", True, False),
        ("olmoe", False, True),
        pytest.param("olmoe", True, False, marks=pytest.mark.engine),
        pytest.param("mixtral", True, True, marks=pytest.mark.engine),
        pytest.param("mixtral", False, False, marks=pytest.mark.engine),
        pytest.param("gpt_oss", True, False, marks=pytest.mark.engine),
        pytest.param("gpt_oss", False, True, marks=pytest.mark.engine),
        pytest.param("qwen3_moe", False, False, marks=pytest.mark.engine),
    ],
)
def test_moe_trains_stock_trls_weights_with_the_savings_on(family, aux_loss, lora, tmp_path, caplog):
    """Aux loss on (the model's own coefficient, TRL's default) or off (router_aux_loss_coef=0.0): grpo_plus ends at
    TRL's weights and logs TRL's aux loss. With it on, each shared prompt is still computed once (the loss counts each
    packed position for the rows it stands for) and only the zero-advantage rows stand aside, saying why; with it off
    every saving runs. LoRA: attention through target_modules, the experts' 3D weights through target_parameters."""
    coefficient = None if aux_loss else 0.0
    with caplog.at_level(logging.WARNING, logger="grpo_plus"):
        ours, our_forwards = train(grpo_plus, family, tmp_path / "ours", lora, router_aux_loss_coef=coefficient)
    theirs, their_forwards = train(trl, family, tmp_path / "trl", lora, router_aux_loss_coef=coefficient)
    assert ours.aux_loss_enabled == aux_loss == theirs.aux_loss_enabled
    assert max_weight_diff(theirs.model.state_dict(), ours.model.state_dict()) <= WEIGHTS_BOUND
    if lora and version_gap("moe_experts") is None:  # every adapter trained: attention's and the experts'
        adapters = {name for name in ours.model.state_dict() if "lora_B" in name}
        assert any("experts" in name for name in adapters) and any("q_proj" in name for name in adapters)
    if aux_loss:
        for a, b in zip(logged(ours, "aux_loss"), logged(theirs, "aux_loss"), strict=True):
            assert abs(a - b) <= AUX_BOUND
    else:
        assert logged(ours, "aux_loss") == [None, None]
    below_floors = [gap for gap in map(version_gap, SAVING_VERSION_FLOORS) if gap is not None]
    notes = [r.getMessage() for r in caplog.records if "computed in full" in r.getMessage()]
    notes = [note for note in notes if not any(gap in note for gap in below_floors)]  # what the floors rule out
    if aux_loss:
        assert len(notes) == 1 and "zero-advantage rows" in notes[0] and "router aux loss" in notes[0], notes
    else:
        assert notes == []
    rows = logged(ours, "zero_waste/rows_computed_frac")
    assert (rows == [1.0, 1.0]) == aux_loss and all(r < 1 for r in rows) != aux_loss
    packed = [call for call in our_forwards.calls if call["grad"] and call["mask_dims"] == 4]
    packing = version_gap("shared_prompt") is None and not (aux_loss and version_gap("moe_router_logits"))
    assert bool(packed) == packing, "no shared prompt was packed"
    if packed or not aux_loss:  # prompts computed once, or dead rows skipped
        assert our_forwards.training_positions < their_forwards.training_positions
    # zero-waste generation: each of the 2 prompts prefilled once for its 4 completions (where the versions allow it)
    if version_gap("zero_waste_generation") is None:
        assert logged(ours, "zero_waste/generation_prefill_positions_frac") == [2 / 8, 2 / 8]


@pytest.mark.floor("shared_prompt", "moe_router_logits")
def test_packed_aux_loss_without_its_weights_is_not_trls(monkeypatch, tmp_path):
    """Negative control of the packed aux loss: every packed position counted once (a shared prompt once, not once
    per completion) logs another aux loss than TRL's."""
    monkeypatch.setattr(zero_waste_rows, "_router_weights", lambda packs, shape, device: torch.ones(shape))
    ours, _ = train(grpo_plus, "qwen3_moe", tmp_path / "ours")
    theirs, _ = train(trl, "qwen3_moe", tmp_path / "trl")
    assert max(abs(a - b) for a, b in zip(logged(ours, "aux_loss"), logged(theirs, "aux_loss"), strict=True)) > 1e-3


@pytest.mark.parametrize("family", ["mixtral", pytest.param("gpt_oss", marks=pytest.mark.engine)])
def test_a_config_with_router_logits_on_generates_and_trains(family, tmp_path):
    """`output_router_logits=True` in the config: stock TRL fails at the first generation (transformers' loss over
    the router's logits of the new token against the whole sequence's mask); grpo_plus generates with them off and
    trains TRL's weights (TRL's run made with the field off, which changes nothing else: TRL asks for the logits in the
    training forward itself), the config left as the user set it."""
    with pytest.raises(RuntimeError, match="must match the size"):
        train(trl, family, tmp_path / "trl_on", dataset=ragged_prompts(), overrides=dict(output_router_logits=True))
    ours, _ = train(grpo_plus, family, tmp_path / "ours", dataset=ragged_prompts(),
                    overrides=dict(output_router_logits=True))  # fmt: skip
    theirs, _ = train(trl, family, tmp_path / "trl", dataset=ragged_prompts())
    assert ours.model.config.output_router_logits is True
    assert max_weight_diff(theirs.model.state_dict(), ours.model.state_dict()) <= WEIGHTS_BOUND
    for a, b in zip(logged(ours, "aux_loss"), logged(theirs, "aux_loss"), strict=True):
        assert abs(a - b) <= AUX_BOUND


def test_router_logits_off_restores_the_config():
    model, _ = moe_model("mixtral", output_router_logits=True)
    with router_logits_off(model):
        assert model.config.output_router_logits is False
    assert model.config.output_router_logits is True
    dense = AutoModelForCausalLM.from_config(tiny_config("llama", 60))
    with router_logits_off(dense):  # nothing to switch
        assert not hasattr(dense.config, "output_router_logits")


@needs_expert_weights
def test_the_qlora_recipe_keeps_the_experts_in_their_dtype(monkeypatch):
    """recipes/grpo_qlora.py's preparation of a 4-bit base: bitsandbytes leaves an MoE's experts unquantized (bf16),
    and they stay bf16 and frozen while the norms go to fp32 as PEFT prepares them. Negative control: PEFT's own
    preparation casts the experts to fp32, doubling nearly all of the model's bytes."""
    from peft import prepare_model_for_kbit_training

    from grpo_plus.app.recipe import prepare_four_bit

    def bf16_model():
        model, _ = moe_model("olmoe")
        return model.to(torch.bfloat16)

    args = grpo_plus.GRPOConfig(output_dir="unused", use_cpu=True, gradient_checkpointing=True)
    prepared = prepare_four_bit(bf16_model(), args)
    experts = prepared.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == experts.down_proj.dtype == torch.bfloat16
    assert not experts.gate_up_proj.requires_grad
    assert prepared.model.layers[0].input_layernorm.weight.dtype == torch.float32
    assert "model.layers.0.mlp.experts.gate_up_proj" in dict(prepared.named_parameters())
    plain = prepare_model_for_kbit_training(bf16_model())
    assert plain.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.float32


# ---- the memory count (grpo_plus.fit) ----------------------------------------------------------------------------


def moe_spec(family: str = "qwen3_moe", lora=None, **config_overrides):
    from grpo_plus import fit

    config = tiny_config(family, 512, max_position_embeddings=4096, **config_overrides)
    return fit.FitSpec(
        model_config=config.to_dict(), weights_dtype="bfloat16", rows=4, num_generations=2, generation_rows=4,
        prompt_tokens=12, completion_tokens=40, lora=lora, gradient_checkpointing=False, mixed_precision="no",
        loss={"loss_type": "dapo"}, padded_prompts=False,
    )  # fmt: skip


def test_below_the_expert_floor_the_count_refuses_an_moe_by_name(monkeypatch):
    """transformers 4.x's experts (nn.Linear MLPs) are not what the count follows: below the `moe_experts` floor
    `grpo-plus fit` refuses an MoE model, naming the floor's reason, and still counts a dense one. Control: at the
    floor the same MoE spec builds its config."""
    from grpo_plus import fit
    from grpo_plus.fit import spec as fit_spec

    if version_gap("moe_experts") is None:
        assert fit.static_bytes(moe_spec())["trainable"] > 0
    reason = "transformers 4.56.2 < 5.0.0: below"
    monkeypatch.setattr(fit_spec, "version_gap", lambda name: reason if name == "moe_experts" else None)
    with pytest.raises(ValueError, match="cannot count the mixture-of-experts model 'qwen3_moe': transformers 4.56.2"):
        fit.static_bytes(moe_spec(num_experts=6))  # not cached above
    assert is_moe(moe_spec().config())  # its shapes are still read (the report's header)
    dense = moe_spec().replace(model_config=tiny_config("llama", 512).to_dict())
    assert fit.static_bytes(dense)["trainable"] > 0


@pytest.mark.parametrize("side", [pytest.param("trl", marks=pytest.mark.engine), "grpo_plus"])
@needs_expert_weights
def test_the_count_runs_the_experts_as_the_real_pass_does(side):
    """The training pass of a tiny Qwen3-MoE (bf16, every activation kept for backward, prompts of one length: no
    mask, the CPU's attention kernel is the count's) counted on the fake accelerator allocates what the same pass
    computed for real on the CPU, to the byte, at top-2 and at top-1: the activations of the experts each token is
    routed to. Negative control: top-1 saves fewer bytes than top-2 (measured: 120,640 fewer of 744,432 on
    grpo_plus's side; the count follows the routing, it does not assume every expert or one)."""
    from grpo_plus import fit

    counts = ("saved", "after_forward", "forward_peak", "peak")
    saved = {}
    for top_k in (2, 1):
        spec = moe_spec(num_experts_per_tok=top_k)
        real = fit.measure_pass(spec, side, layers=2, real=True, lm_head="cpu")
        fake = fit.measure_pass(spec, side, layers=2, lm_head="cpu")
        assert [getattr(fake, name) for name in counts] == [getattr(real, name) for name in counts], top_k
        saved[top_k] = fake.saved
    assert saved[1] < saved[2]


@needs_expert_weights
def test_the_count_holds_every_expert_and_the_router():
    """The resident bytes of a count (`static_bytes`) are the real model's: every expert of every layer and the router
    (bf16, all trainable), and with LoRA on attention and experts, the adapters PEFT makes. Doubling the experts adds
    exactly their weights and the router's extra rows. 4-bit: the router and the experts are not quantized (they are no
    `nn.Linear`), counted in their dtype; a rule by parameter name (2D `.weight`) counted the router as nf4."""
    from peft import get_peft_model

    from grpo_plus import fit
    from grpo_plus.fit.count import nf4_bytes

    def real_bytes(spec, trainable_only=False):
        model = AutoModelForCausalLM.from_config(spec.config(), dtype=torch.bfloat16)
        if spec.lora is not None:
            model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **spec.lora))
        params = [p for p in model.parameters() if p.requires_grad or not trainable_only]
        return sum(p.numel() * p.element_size() for p in params)

    spec = moe_spec()
    assert fit.static_bytes(spec)["trainable"] == real_bytes(spec)
    wider = moe_spec(num_experts=8)
    layers, hidden, width = 2, 32, 16
    experts_and_router = layers * 4 * (3 * hidden * width + hidden) * 2  # 4 more experts, 4 more router rows; bf16
    assert fit.static_bytes(wider)["trainable"] - fit.static_bytes(spec)["trainable"] == experts_and_router
    lora = fit.lora_fields(4, 8, 0.0, LORA["target_modules"], EXPERT_PARAMETERS)
    adapted = fit.static_bytes(moe_spec(lora=lora))
    assert adapted["trainable"] == real_bytes(moe_spec(lora=lora), trainable_only=True)
    assert adapted["weights"] + adapted["trainable"] == real_bytes(moe_spec(lora=lora))

    four_bit = fit.static_bytes(moe_spec(lora=lora).replace(four_bit=True))
    model = AutoModelForCausalLM.from_config(spec.config(), dtype=torch.float32)
    linear = {id(m.weight) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in n}
    experts = {id(p) for n, p in model.named_parameters() if ".experts." in n}
    expected = sum(
        nf4_bytes(p.numel()) if id(p) in linear else p.numel() * (2 if id(p) in experts else 4)
        for p in model.parameters()
    )
    assert four_bit["weights"] == expected
    router = model.model.layers[0].mlp.gate.weight
    assert id(router) not in linear and router.dim() == 2  # what the name rule took for a quantized weight


# ---- resuming a full fine-tune (grpo_plus.compat.checkpoint) -----------------------------------------------------


@needs_expert_weights
@pytest.mark.parametrize("shard", [None, "20KB"])
def test_a_checkpoint_saved_per_expert_loads_into_the_fused_experts(shard, tmp_path):
    """`save_pretrained` writes each expert's weights under its own names (one file, or shards with an index); loaded
    through transformers' conversion every weight of the live model is the saved one, in place (the parameter objects
    kept). Negative control: `load_state_dict(..., strict=False)` on the saved names, what transformers' Trainer does,
    leaves the experts as they were. A checkpoint whose names are the model's is left to transformers (None)."""
    from safetensors.torch import load_file

    from grpo_plus.compat.moe import converted_checkpoint_load

    trained, _ = moe_model("qwen3_moe")
    with torch.no_grad():
        for parameter in trained.parameters():
            parameter.add_(torch.randn_like(parameter))
    trained.save_pretrained(tmp_path, **({} if shard is None else {"max_shard_size": shard}))
    assert (tmp_path / "model.safetensors.index.json").is_file() == (shard is not None)
    live, _ = moe_model("qwen3_moe")
    before = dict(live.named_parameters())
    result = converted_checkpoint_load(live, str(tmp_path))
    assert result is not None and not result.missing_keys
    assert all(parameter is before[name] for name, parameter in live.named_parameters())
    assert max_weight_diff(trained.state_dict(), live.state_dict()) == 0.0
    if shard is None:
        stock, _ = moe_model("qwen3_moe")
        stock.load_state_dict(load_file(str(tmp_path / "model.safetensors")), False)
        assert max_weight_diff(trained.state_dict(), stock.state_dict()) > 0.1
    dense = save_tiny_model(tmp_path / "dense")
    assert converted_checkpoint_load(AutoModelForCausalLM.from_pretrained(dense), str(dense)) is None
    assert converted_checkpoint_load(torch.nn.Linear(2, 2), str(tmp_path)) is None  # not a transformers model


@pytest.mark.engine  # three short training runs
@needs_expert_weights
def test_a_full_fine_tune_resumes_with_its_experts(tmp_path, monkeypatch):
    """A full fine-tune of a tiny Qwen3-MoE (float32, SGD), resumed from a mid-run checkpoint by a fresh trainer, ends at
    the uninterrupted run's weights (0.0), the experts included: the checkpoint's per-expert weights are loaded through
    transformers' conversion. Negative control: loaded as transformers' Trainer loads them (the saved names into the
    model's state dict, strict=False) the resumed run keeps the experts it was built with and ends elsewhere
    (measured 2.9e-4)."""
    from test_resume import train as resumable_run

    from grpo_plus.compat import moe

    model_dir = str(save_tiny_model(tmp_path / "model", family="qwen3_moe"))
    settings = dict(steps_per_generation=4, gradient_accumulation_steps=2, max_steps=4, rewards=[half_dead_reward],
                    optim="sgd", learning_rate=0.5)  # fmt: skip
    whole = resumable_run(model_dir, tmp_path / "whole", save_strategy="steps", save_steps=1, **settings)
    for step in (1, 2):  # inside a generation batch, between two
        resumed = resumable_run(model_dir, tmp_path / f"from-{step}", tmp_path / "whole" / f"checkpoint-{step}",
                                **settings)  # fmt: skip
        assert max_weight_diff(whole.weights, resumed.weights) == 0.0, step
    monkeypatch.setattr(moe, "converted_checkpoint_load", lambda model, folder: None)
    unconverted = resumable_run(model_dir, tmp_path / "unconverted", tmp_path / "whole" / "checkpoint-2", **settings)
    assert max_weight_diff(whole.weights, unconverted.weights) > 1e-5  # measured 2.9e-4
