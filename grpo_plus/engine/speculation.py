"""vLLM's own speculative decoding in the colocated engine (`vllm_speculative_config`): the dict handed to the
`vllm.LLM(...)` TRL builds, and vLLM's refusal of it reported under the field's name.

TRL 1.14-1.16 builds the colocated engine without a `speculative_config` (its `GRPOConfig` has no such field; only
`trl vllm-serve --speculative_config` passes one, to a server). vLLM's n-gram method drafts each request's next tokens
from its own prompt and output and verifies them in one forward: greedy completions are the same tokens as without it
(vLLM's CPU build 0.31 runs it: tests/vllm_engine/test_speculative.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..compat.vllm import vllm_engine_factory


class EngineSpeculationError(ValueError):
    """vLLM refused `vllm_speculative_config` when the colocated engine was built."""


@contextmanager
def engine_speculation(args: Any, speculative_config: dict | None) -> Iterator[None]:
    """While TRL builds its trainer from `args`: the colocated engine gets `speculative_config`
    (vllm_speculative_config), and an error vLLM raises building an engine with it names the field."""
    colocated = getattr(args, "use_vllm", False) and getattr(args, "vllm_mode", "colocate") == "colocate"
    if speculative_config is None or not colocated:
        yield
        return
    module, name = vllm_engine_factory()
    build = getattr(module, name)

    def build_with_speculation(**kwargs):
        try:
            return build(**kwargs, speculative_config=dict(speculative_config))
        except Exception as error:
            raise EngineSpeculationError(
                f"vLLM could not build the colocated engine with vllm_speculative_config="
                f"{json.dumps(speculative_config)}: {type(error).__name__}: {error}. Fix or unset "
                "vllm_speculative_config (vLLM's speculative_config: vllm.config.SpeculativeConfig)."
            ) from error

    setattr(module, name, build_with_speculation)
    try:
        yield
    finally:
        setattr(module, name, build)
