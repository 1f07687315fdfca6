import os
import sys
import warnings
from pathlib import Path

import pytest

# Tiny models gain nothing from intra-op threads, and on a loaded 2-core machine every parallel op can stall for a
# scheduler slice waiting on a descheduled worker. Subprocesses (accelerate launch, recipes) inherit this.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Nothing in the test suite may reach a model or data hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")
warnings.filterwarnings("ignore", category=FutureWarning)
sys.path.insert(0, str(Path(__file__).resolve().parent))

# Skips only below documented floors (the hooks enforce it): see tests/helpers/floors.py.
from helpers.floors import (  # noqa: E402, F401
    pytest_configure,
    pytest_make_collect_report,
    pytest_runtest_makereport,
    pytest_runtest_setup,
)

# No test leaves process-wide state changed (the suite runs in a random order): tests/helpers/global_state.py.
from helpers.global_state import global_state_kept, process_at_session_start  # noqa: E402, F401
from helpers.models import save_tiny_model  # noqa: E402
from helpers.probes import kept_unchanged  # noqa: E402
from helpers.suite import (  # noqa: E402, F401  (the order's seed printed; the per-test timeout's backstop)
    pytest_report_collectionfinish,
    pytest_terminal_summary,
    pytest_timeout_set_timer,
)
from helpers.tool_model import save_tool_model  # noqa: E402


def pytest_report_header(config) -> str:
    """The versions under test (make test-matrix runs the suite in several environments)."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "-"

    names = ("trl", "transformers", "peft", "accelerate", "datasets", "bitsandbytes", "torch", "huggingface_hub")
    return "versions: " + ", ".join(f"{name} {installed(name)}" for name in names)


# make test-engines' and make test-vllm's tests: processes on real engines (DeepSpeed, DDP, FSDP2, vLLM), their
# durations not measured one by one (592 s and 1,028 s for the whole targets on a clean clone; one engine test took
# 425 s beside three other pytest runs); their subprocesses carry limits of 600-900 s of their own, and a vLLM module's
# first test starts its engine (60-90 s).
ENGINE_TEST_TIMEOUT = 1200


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        on_engines = item.get_closest_marker("engine") or item.get_closest_marker("vllm")
        if on_engines and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(ENGINE_TEST_TIMEOUT))


@pytest.fixture(autouse=True)
def torch_seeded_per_test(request):
    """torch's global RNG, seeded from the test's id: a test that draws from it without seeding it itself gets the
    same numbers in every order (pytest-randomly does the same for `random` and NumPy, from the order's seed)."""
    import zlib

    import torch

    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


# torch.distributed's rendezvous, as the session started with it. TRL's colocated vLLM exports RANK, WORLD_SIZE and
# MASTER_PORT (its first free candidate, 23456) for the engine it starts in the pytest process, which then listens on
# that port; a module-scoped fixture's engine sets them before any test's snapshot, so a later subprocess (a one-process
# train_tiny.py) would inherit them and fail to rendezvous: EADDRINUSE.
RENDEZVOUS_AT_SESSION_START = {
    name: os.environ.get(name)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
}


@pytest.fixture(autouse=True)
def restore_environment():
    """Undo environment variables a test left behind: transformers 4.x's TrainingArguments exports settings such as
    ACCELERATE_MIXED_PRECISION=bf16, which every later subprocess (accelerate launch, recipes) would inherit; the
    rendezvous variables go back to the session's start (RENDEZVOUS_AT_SESSION_START), whoever set them."""
    saved = dict(os.environ)
    yield
    for name, value in RENDEZVOUS_AT_SESSION_START.items():
        if value is None:
            saved.pop(name, None)
        else:
            saved[name] = value
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(autouse=True)
def restore_registries():
    """Undo modes a test registered or removed (plugins, user modes, overrides): every test starts from, and leaves,
    the built-in registries. The one way tests restore a registry (`Registry.snapshot` / `restore`)."""
    from grpo_plus.objective import REGISTRIES, REJECTION_CRITERIA

    snapshots = [(registry, registry.snapshot()) for registry in (*REGISTRIES, REJECTION_CRITERIA)]
    yield
    for registry, snapshot in snapshots:
        registry.restore(snapshot)


@pytest.fixture
def benchmark_in_this_process(monkeypatch):
    """For a benchmark run in pytest's process (a subprocess would spend most of a smoke run importing torch,
    transformers and TRL again): benchmarks/ importable, and what a benchmark sets for its own process (torch's thread
    count, transformers' verbosity) put back after the test."""
    import torch
    import transformers

    monkeypatch.syspath_prepend(Path(__file__).resolve().parents[1] / "benchmarks")
    threads, verbosity = torch.get_num_threads(), transformers.logging.get_verbosity()
    yield
    torch.set_num_threads(threads)
    transformers.logging.set_verbosity(verbosity)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama + character tokenizer saved once per session (read only)."""
    path = save_tiny_model(tmp_path_factory.mktemp("tiny-model"))
    with kept_unchanged(path, "the session's tiny model"):
        yield str(path)


@pytest.fixture(scope="session")
def tiny_model_dir_bnb(tmp_path_factory):
    """Like tiny_model_dir, but wide enough (64) for bitsandbytes' 4-bit CPU kernels (block size 64)."""
    path = save_tiny_model(tmp_path_factory.mktemp("tiny-model-64"), hidden_size=64)
    with kept_unchanged(path, "the session's 64-wide tiny model"):
        yield str(path)


@pytest.fixture(scope="session")
def tiny_moe_dir_bnb(tmp_path_factory):
    """A tiny OLMoE (4 experts, top 2; width 64 for bitsandbytes' 4-bit CPU kernels) + tokenizer, saved once."""
    path = save_tiny_model(tmp_path_factory.mktemp("tiny-moe-64"), family="olmoe", hidden_size=64)
    with kept_unchanged(path, "the session's tiny MoE"):
        yield str(path)


@pytest.fixture(scope="session")
def tiny_vlm_dir_bnb(tmp_path_factory):
    """A tiny Qwen2.5-VL (width 64, for bitsandbytes' 4-bit CPU kernels) and its processor, saved once per session."""
    from grpo_plus.app.tiny_vlms import save_tiny_vlm

    path = tmp_path_factory.mktemp("tiny-vlm-64")
    save_tiny_vlm(path, "qwen2_5_vl", hidden_size=64)
    with kept_unchanged(path, "the session's tiny VLM"):
        yield str(path)


@pytest.fixture(scope="session")
def tool_model_dir(tmp_path_factory):
    """A tiny Qwen3 with TRL's Qwen3 chat template, trained to make tool calls, built once per session (read only)."""
    path = save_tool_model(tmp_path_factory.mktemp("tool-model"))
    with kept_unchanged(path, "the session's tool-calling model"):
        yield str(path)
