"""The out-of-place LoRA stream for vLLM (`grpo_plus.engine.lora_stream`), outside the engine: TRL's in-place merge and unmerge
move a bfloat16 and a 4-bit base where ours leaves it bit-identical; our stream sends TRL's names and, on a float32
base, TRL's very tensors; what a partial sync sends; what it refuses; the precision the engine serves a 4-bit base in.
On the real engine: tests/vllm_engine/test_lora_sync.py."""

from __future__ import annotations

import types
from contextlib import nullcontext

import pytest
import torch
from helpers.models import make_model, make_tokenizer, save_tiny_model
from peft import IA3Config, LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from grpo_plus.engine.lora_stream import LoraSyncError, LoraWeightStream
from grpo_plus.engine.precision import (
    ENGINE_WEIGHT_SHARE,
    engine_quantization,
    quantization_by_memory,
    served_weight_bytes,
)

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}  # vLLM's Llama


def peft_model(base: str = "float32", tmp_path=None, **lora):
    """A tiny Llama 128 wide (bitsandbytes' 4-bit blocks are 64) with LoRA adapters whose B is not zero."""
    if base == "nf4":
        path = save_tiny_model(tmp_path / "model", hidden_size=128)
        quantization = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
        )  # nf4 stated: the default, fp4, has no CPU kernel in bitsandbytes 0.46 (the oldest environment)
        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=quantization, dtype=torch.float32)
    else:
        model = make_model(make_tokenizer(), hidden_size=128).to(getattr(torch, base))
    settings = dict(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0) | lora
    model = get_peft_model(model, LoraConfig(**settings))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    return model


def stream(model, dtype=torch.bfloat16, **kwargs) -> LoraWeightStream:
    settings = dict(engine_ties_embeddings=False, packed_modules=PACKED) | kwargs
    return LoraWeightStream(model, dtype, **settings)


def base_state(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}


def trl_stream(model):
    """TRL 1.16's own colocate stream (`VLLMGeneration._iter_named_params`: merge_adapter, every weight, unmerge) on
    one process."""
    from trl.generation.vllm_generation import VLLMGeneration

    generation = types.SimpleNamespace(
        model=model, _dist=types.SimpleNamespace(gather_params=lambda params: nullcontext(), is_fsdp=False)
    )
    generation._fix_param_name_to_vllm = lambda *args, **kwargs: VLLMGeneration._fix_param_name_to_vllm(
        generation, *args, **kwargs
    )
    return VLLMGeneration._iter_named_params(generation)


@pytest.mark.parametrize("base", ["bfloat16", "nf4"])
def test_trl_merge_and_unmerge_move_the_base_ours_leaves_it_bit_identical(tmp_path, base):
    """20 syncs: TRL's merge/unmerge cycle rounds the base in its own storage each time (a 4-bit base: dequantized,
    summed, quantized again), ours only reads it."""
    ours, theirs = peft_model(base, tmp_path / "ours"), peft_model(base, tmp_path / "theirs")
    before = base_state(ours)
    assert before.keys() == base_state(theirs).keys()
    for _ in range(20):
        for _ in stream(ours)():
            pass
        for _ in trl_stream(theirs):
            pass
    assert all(torch.equal(before[k], v) for k, v in base_state(ours).items()), "our sync moved the frozen base"
    moved = [k for k, v in base_state(theirs).items() if not torch.equal(before[k], v)]
    assert moved, "TRL's merge and unmerge left the base as it was: the check above could not fail"


@pytest.mark.parametrize("lora", [{}, dict(use_rslora=True), dict(use_dora=True), dict(modules_to_save=["lm_head"])])
def test_a_float32_model_streams_trls_names_and_tensors(lora):
    """Where TRL's in-place merge is exact (a float32 base), our stream sends the same names and the same tensors: the
    merged LoRA layers (rsLoRA's and DoRA's scaling, a modules_to_save copy) and everything else."""
    model = peft_model("float32", **lora)
    if "modules_to_save" in lora:
        with torch.no_grad():
            model.base_model.model.lm_head.modules_to_save["default"].weight.mul_(1.5)
    ours = dict(stream(model, torch.float32)())
    theirs = {name: tensor.clone() for name, tensor in trl_stream(model)}
    assert list(ours) == list(theirs)
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=0)


def test_later_syncs_send_what_can_change_and_what_vllm_packs_with_it():
    """LoRA on q and v: after the first (full) sync, each sync sends q, k, v (vLLM's qkv_proj wants all three), the
    merged weights in the engine's dtype, plus any weight left trainable (here a norm); without a packing map, all."""
    model = peft_model("float32", target_modules=["q_proj", "v_proj"])
    model.base_model.model.model.norm.weight.requires_grad_(True)
    sync = stream(model)
    full = dict(sync())
    later = dict(sync())
    assert set(full) == {name for name, _ in trl_stream(model)}
    attention = {f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(2) for p in "qkv"}
    assert set(later) == attention | {"model.norm.weight"}
    assert later["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert later["model.layers.0.self_attn.k_proj.weight"].dtype == torch.float32  # unmerged: as the trainer holds it
    unknown_packing = stream(model, packed_modules=None)
    assert len(dict(unknown_packing())) == len(dict(unknown_packing())) == len(full)


def test_4bit_weights_go_dequantized_in_the_engines_dtype(tmp_path):
    """A 4-bit layer without an adapter is sent dequantized by bitsandbytes (TRL's stream sends its packed bytes
    under the weight's name)."""
    model = peft_model("nf4", tmp_path, target_modules=["q_proj"])
    sent = dict(stream(model)())
    k_proj = model.base_model.model.model.layers[0].self_attn.k_proj.weight
    assert k_proj.__class__.__name__ == "Params4bit" and k_proj.dtype == torch.uint8
    import bitsandbytes

    expected = bitsandbytes.functional.dequantize_4bit(k_proj.data, k_proj.quant_state).to(torch.bfloat16)
    assert torch.equal(sent["model.layers.0.self_attn.k_proj.weight"], expected)
    assert sent["model.layers.0.self_attn.k_proj.weight"].shape == (k_proj.quant_state.shape)
    assert dict(trl_stream(model))["model.layers.0.self_attn.k_proj.weight"].dtype == torch.uint8


def tied_model():
    tokenizer = make_tokenizer()
    model = make_model(tokenizer, hidden_size=64)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    return model


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (lambda: get_peft_model(tied_model(), LoraConfig(target_modules=["lm_head"])), "ties its input and output"),
        (
            lambda: get_peft_model(
                tied_model(), LoraConfig(target_modules=["q_proj"], modules_to_save=["embed_tokens"])
            ),
            "ties its input and output",
        ),
        (lambda: peft_model("float32", lora_bias=True), "lora_bias=True"),
        (
            lambda: get_peft_model(
                make_model(make_tokenizer()), IA3Config(target_modules=["q_proj"], feedforward_modules=[])
            ),
            "are not LoRA",
        ),
    ],
    ids=["tied-lora-head", "tied-saved-embedding", "lora-bias", "ia3"],
)
def test_what_the_sync_cannot_send_fails_when_it_is_built(make, fragment):
    with pytest.raises(LoraSyncError, match=fragment):
        stream(make(), engine_ties_embeddings=True)


def test_an_untied_engine_takes_an_adapted_lm_head():
    """The same LoRA on lm_head is fine where the engine does not tie the two ends."""
    model = get_peft_model(make_model(make_tokenizer()), LoraConfig(target_modules=["lm_head", "q_proj"]))
    assert "lm_head.weight" in dict(stream(model, engine_ties_embeddings=False)())


def test_a_4bit_base_is_served_in_bfloat16_where_it_fits_else_fp8():
    """vllm_quantization='auto' for Qwen2.5-7B's shapes (the QLoRA recipe's model) on a 24 GB card: 15.2 GB of weights
    in bfloat16 take more than half of any engine share up to 0.6, so fp8 (8.7 GB: linear layers in one byte) where
    the GPU runs it; Qwen2.5-0.5B (1 GB) stays in bfloat16."""
    from grpo_plus.fit import known_config

    card = 24e9
    seven = served_weight_bytes(known_config("qwen2.5-7b"))
    half = served_weight_bytes(known_config("qwen2.5-0.5b"))
    assert 15.0e9 < seven["bfloat16"] < 15.5e9 and 8.5e9 < seven["fp8"] < 8.9e9
    assert 0.95e9 < half["bfloat16"] < 1.0e9
    for share in (0.3, 0.45, 0.6):
        assert quantization_by_memory(seven["bfloat16"], share * card, fp8_runs=True) == "fp8"
        assert quantization_by_memory(seven["bfloat16"], share * card, fp8_runs=False) is None
        assert quantization_by_memory(half["bfloat16"], share * card, fp8_runs=True) is None
    assert quantization_by_memory(seven["bfloat16"], seven["bfloat16"] / ENGINE_WEIGHT_SHARE, fp8_runs=True) is None


def test_what_the_engine_is_asked_for(monkeypatch):
    """'none' and a method name override TRL's request; 'auto' keeps it, except bitsandbytes for a 4-bit base, which
    becomes the engine's dtype on a CPU engine (vLLM's CPU build has no fp8 kernels), whatever the machine has."""
    assert engine_quantization("none", "bitsandbytes", "unused", 0.3) is None
    assert engine_quantization("fp8", None, "unused", 0.3) == "fp8"
    assert engine_quantization("auto", None, "unused", 0.3) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU engine, on a GPU machine too
    assert engine_quantization("auto", "bitsandbytes", "unused", 0.3) is None


@pytest.mark.parametrize(
    ("fields", "added"),
    [
        ({}, {}),  # TRL's engine arguments untouched: vLLM's dtype and block size
        ({"dtype": "float32", "block_size": 32}, {"dtype": "float32", "block_size": 32}),
    ],
)
def test_the_engine_is_built_with_the_dtype_and_block_size_asked(monkeypatch, fields, added):
    """vllm_dtype and vllm_block_size reach the colocated engine's arguments (on the real engine, the benchmark's smoke
    test reads them back from vLLM: tests/vllm_engine/test_benchmarks.py); left at their defaults, TRL's arguments
    go through as TRL builds them."""
    from grpo_plus.compat.vllm import vllm_engine_factory
    from grpo_plus.engine.precision import engine_precision

    module, name = vllm_engine_factory()
    built = []
    monkeypatch.setattr(module, name, lambda **kwargs: built.append(kwargs), raising=False)  # no vLLM in .venv
    trls = {"model": "unused", "gpu_memory_utilization": 0.3, "max_num_batched_tokens": 4096}
    with engine_precision(types.SimpleNamespace(use_vllm=True, vllm_mode="colocate"), **fields):
        getattr(module, name)(**trls)
    assert built == [{**trls, "quantization": None, **added}]


@pytest.mark.parametrize("fp8_runs", [True, False])
def test_a_4bit_base_on_a_gpu_engine_is_served_by_its_memory(tmp_path, monkeypatch, fp8_runs):
    """'auto' for a 4-bit base on a (faked) 24 GB card: Qwen2.5-7B's 15.2 GB in bfloat16 do not fit 0.3 of it, so
    fp8 where vLLM runs it (else bfloat16); Qwen2.5-0.5B stays in bfloat16."""
    from grpo_plus.engine import precision
    from grpo_plus.fit import known_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(total_memory=24e9))
    monkeypatch.setattr(precision, "_fp8_runs", lambda: fp8_runs)
    for name in ("qwen2.5-7b", "qwen2.5-0.5b"):
        known_config(name).save_pretrained(tmp_path / name)
    assert engine_quantization("auto", "bitsandbytes", str(tmp_path / "qwen2.5-7b"), 0.3) == (
        "fp8" if fp8_runs else None
    )
    assert engine_quantization("auto", "bitsandbytes", str(tmp_path / "qwen2.5-0.5b"), 0.3) is None


@pytest.fixture
def one_rank_group(tmp_path):
    """A 1-process gloo group (FSDP2 needs one), destroyed after the test."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("copy_sources", [True, False], ids=["copies", "negative-control-no-copies"])
def test_an_fsdp2_model_streams_whole_weights_that_outlive_the_reshard(one_rank_group, copy_sources):
    """Under FSDP2 the stream unshards the model (`fsdp2_unsharded`) and sends what an unsharded copy sends, bit for
    bit. vLLM may hold a streamed tensor until its layer is complete, after the stream, when FSDP2 has resharded and
    freed the whole weights: the weights sent unmerged must be copies (without, some point at freed storage, and
    vLLM's reload fails)."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from grpo_plus.run.distributed import fsdp2_unsharded

    model = peft_model("float32")
    expected = {name: tensor.clone() for name, tensor in stream(copy.deepcopy(model), torch.float32)()}
    mesh = init_device_mesh("cpu", (1,))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sent = dict(
        stream(model, torch.float32, gather=lambda params: fsdp2_unsharded(model), copy_sources=copy_sources)()
    )
    assert all(isinstance(p, DTensor) for p in model.parameters()), "the model was left unsharded"
    freed = [name for name, tensor in sent.items() if tensor.untyped_storage().size() == 0]
    if not copy_sources:
        assert freed, "nothing was freed: the copies guard nothing"
        return
    assert freed == [] and list(sent) == list(expected)
    for name in sent:
        torch.testing.assert_close(sent[name], expected[name], rtol=0, atol=0)
