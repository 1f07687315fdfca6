"""TRL's vLLM generation (`trl.generation.vllm_generation.VLLMGeneration`, the same in 1.14.0-1.16.0): its colocate
sync, the engine and client factories it looks up.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import trl

from .common import attribute_set

__all__ = [
    "COLOCATE_SYNC_METHODS",
    "COLOCATE_WEIGHT_STREAM",
    "ENGINE_MAX_TOKENS",
    "VLLM_CLIENT_FACTORY",
    "VLLM_CLIENT_MODULE",
    "VLLM_ENGINE_FACTORY",
    "VLLM_ENGINE_MODULE",
    "colocate_distribution",
    "colocate_weight_stream_name",
    "colocated_model_runner",
    "engine_max_tokens",
    "kernel_scan_guard",
    "vllm_engine_factory",
]


# ---- vLLM (TRL's `trl.generation.vllm_generation.VLLMGeneration`, the same in 1.14.0-1.16.0) -------------------------
# Its colocate sync, `sync_weights()`, is `for name, param in self._iter_named_params(): <model runner>.model.
# load_weights([(name, param)])` with the model runner at `llm.llm_engine.model_executor.driver_worker.model_runner`
# (vLLM's V1 engine in-process), then `llm.reset_prefix_cache()`; names go through `_fix_param_name_to_vllm`.
# grpo_plus replaces the stream on the instance, and wraps `sync_weights` there to check each sync after it.
COLOCATE_WEIGHT_STREAM = "_iter_named_params"


COLOCATE_SYNC_METHODS = (COLOCATE_WEIGHT_STREAM, "sync_weights", "_fix_param_name_to_vllm")


def colocate_weight_stream_name() -> str:
    """The `VLLMGeneration` method that streams (name, tensor) pairs to the colocated engine at each sync (it gathers
    ZeRO-3 / FSDP shards and merges PEFT adapters); raises TRLCompatibilityError if this TRL lacks it or another
    method of COLOCATE_SYNC_METHODS."""
    from trl.generation.vllm_generation import VLLMGeneration

    # here, not at the top: `grpo-plus vllm-serve`'s processes import this module (the gloo plugin) and not the
    # versions module's TRL trainer imports (~15 s per process on a CPU)
    from .versions import TRLCompatibilityError, tested_trl_versions_text

    missing = [name for name in COLOCATE_SYNC_METHODS if not callable(getattr(VLLMGeneration, name, None))]
    if missing:
        raise TRLCompatibilityError(
            f"grpo_plus cannot sync weights into vLLM with TRL {trl.__version__}: VLLMGeneration has no "
            f"{', '.join(missing)}. grpo_plus works with TRL {tested_trl_versions_text()}."
        )
    return COLOCATE_WEIGHT_STREAM


def colocated_model_runner(llm):
    """The model runner of a colocated `vllm.LLM`, where TRL's colocate sync finds the model."""
    return llm.llm_engine.model_executor.driver_worker.model_runner


def colocate_distribution(generation):
    """TRL's `DistributedBackend` of a `VLLMGeneration`: `gather_params(params)` (ZeRO-3's gather, a no-op elsewhere),
    `is_fsdp`, `fsdp_version` (1 or 2 under FSDP, else None; TRL 1.14-1.16), the same object TRL's own weight stream
    uses."""
    return generation._dist


# Its `generate(prompts, images, num_generations)` reads `self.max_completion_length` at every call as the request's
# `max_tokens`, asks for `self.logprobs` log-probs per token (GRPOTrainer passes 0: the sampled token's only) and, in
# colocate mode, sends each prompt as its own request (n=1, `num_generations` unused); TRL starts the colocated engine
# with logprobs_mode="processed_logprobs" (after temperature, top-p, top-k: what the token was drawn from).
ENGINE_MAX_TOKENS = "max_completion_length"


@contextmanager
def engine_max_tokens(generation, max_tokens: int) -> Iterator[None]:
    """Inside the block, every request TRL's `VLLMGeneration` (`generation`) sends asks for at most `max_tokens`
    tokens."""
    with attribute_set(generation, ENGINE_MAX_TOKENS, max_tokens):
        yield


# TRL builds the colocated engine with `LLM(...)` looked up in this module's namespace (VLLMGeneration._init_vllm),
# passing quantization="bitsandbytes" when the model has 4-bit bitsandbytes layers.
VLLM_ENGINE_MODULE, VLLM_ENGINE_FACTORY = "trl.generation.vllm_generation", "LLM"


# TRL's server mode connects with `VLLMClient(...)` looked up in this module's namespace (VLLMGeneration._init_vllm),
# then calls its `init_communicator(device)`, which refuses any device but CUDA.
VLLM_CLIENT_MODULE, VLLM_CLIENT_FACTORY = "trl.generation.vllm_generation", "VLLMClient"


def vllm_engine_factory():
    """(module, attribute name) where TRL looks up the class it builds the colocated vLLM engine with."""
    import importlib

    return importlib.import_module(VLLM_ENGINE_MODULE), VLLM_ENGINE_FACTORY


# vLLM 0.31's CPU worker, as it starts, points Triton kernels at its CPU overrides (`register_triton_kernel_overrides`
# -> `vllm.triton_utils.dispatcher._rebind_kernels`) by scanning every attribute of every imported module and calling
# `vars(value).get("kernel")` on each value with a `__dict__`. llvmlite's library handle (`llvmlite.binding.ffi.lib`,
# a `_lib_wrapper`) forwards unknown attributes to its ctypes library, `__dict__` included, wrapped in a
# `_lib_fn_wrapper` that has no `.get`: once numba is imported (vLLM's own n-gram proposer imports it), every later
# engine start in the process fails with "AttributeError: '_lib_fn_wrapper' object has no attribute 'get'".
LLVMLITE_LIBRARY_MODULE, LLVMLITE_LIBRARY_CLASS = "llvmlite.binding.ffi", "_lib_wrapper"


@contextmanager
def kernel_scan_guard() -> Iterator[None]:
    """While a vLLM engine starts: llvmlite's library handle answers dunder lookups (`__dict__`) itself, with an
    AttributeError, instead of forwarding them to its ctypes library, so vLLM's kernel scan passes over it. A no-op
    where llvmlite is not imported."""
    library_class = getattr(sys.modules.get(LLVMLITE_LIBRARY_MODULE), LLVMLITE_LIBRARY_CLASS, None)
    forward = vars(library_class).get("__getattr__") if library_class is not None else None
    if forward is None:
        yield
        return

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return forward(self, name)

    library_class.__getattr__ = __getattr__
    try:
        yield
    finally:
        library_class.__getattr__ = forward
