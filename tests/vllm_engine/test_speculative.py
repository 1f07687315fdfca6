"""vLLM's own n-gram speculative decoding in the colocated engine (`vllm_speculative_config`) on vLLM's CPU build: the
engine TRL builds gets the config, drafts and keeps tokens, its greedy completions are the model's own greedy
completions, a training step runs on it; a config vLLM refuses fails the trainer's construction naming the field.

One engine for the module, built with the config (a second engine without it would cost another 45-90 s): the
reference for "the same tokens" is transformers' greedy decoding of the same float32 model (`vllm_dtype="float32"`).
"""

from __future__ import annotations

import pytest
import torch
from helpers.engine import tiny_engine_trainer
from helpers.models import save_tiny_model
from transformers import AutoModelForCausalLM

import grpo_plus
from grpo_plus.app.testing import SharedVLLMEngine
from grpo_plus.engine.speculation import EngineSpeculationError

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
VLLM = dict(
    use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3, per_device_train_batch_size=4,
    vllm_dtype="float32",
)  # fmt: skip
NEW_TOKENS = 24


class CountingEngine(SharedVLLMEngine):
    """The module's engine, with vLLM's statistics on (its speculative-decoding counters)."""

    def __call__(self, **kwargs):
        return super().__call__(**kwargs, disable_log_stats=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("vllm-model"), hidden_size=128))


@pytest.fixture
def torch_threads_kept():
    """vLLM's n-gram proposer runs numba kernels, whose OpenMP threading layer sets the process's OpenMP thread count
    (torch's too) to numba's (the cores) after each proposal: put torch's back after the test (through torch._C: vLLM's
    CPU worker replaces `torch.set_num_threads` with a no-op once it has bound its threads)."""
    threads = torch.get_num_threads()
    yield
    torch._C.set_num_threads(threads)


@pytest.fixture(scope="module")
def counting_engine():
    from grpo_plus.app.testing import shared_vllm_engine

    with shared_vllm_engine(CountingEngine()) as engine:
        yield engine


def build(model_dir, output_dir, **overrides):
    return tiny_engine_trainer(grpo_plus, model_dir, output_dir, {**VLLM, **overrides})


def spec_counters(llm) -> dict[str, float]:
    """vLLM's counters of drafted and kept tokens so far."""
    names = ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")
    return {m.name: m.value for m in llm.get_metrics() if m.name in names}


def test_the_colocated_engine_drafts_with_ngrams_and_keeps_the_greedy_tokens(
    counting_engine, model_dir, tmp_path, torch_threads_kept
):
    from vllm import SamplingParams

    trainer = build(model_dir, tmp_path, max_steps=1, vllm_speculative_config=NGRAM)
    assert counting_engine.kwargs["speculative_config"] == NGRAM  # what TRL's LLM(...) call was given
    llm = trainer.vllm_generation.llm
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

    trainer.train()  # TRL's sampled generation (log-probs and all) and a training step on the speculative engine
    assert trainer.state.global_step == 1 and torch.isfinite(torch.tensor(trainer.state.log_history[0]["loss"]))
    assert spec_counters(llm)["vllm:spec_decode_num_draft_tokens"] > after["vllm:spec_decode_num_draft_tokens"]


def test_a_config_vllm_refuses_fails_the_trainer_naming_the_field(model_dir, tmp_path, monkeypatch):
    """vLLM's own check (no num_speculative_tokens) surfaces from the engine vLLM would build, under the field's name."""
    import trl.generation.vllm_generation as vllm_generation
    from vllm import LLM

    monkeypatch.setattr(vllm_generation, "LLM", LLM)  # the real factory, whatever engine the module holds
    with pytest.raises(
        EngineSpeculationError, match="(?s)vllm_speculative_config.*num_speculative_tokens must be provided"
    ):
        build(model_dir, tmp_path, vllm_speculative_config={"method": "ngram"})


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
