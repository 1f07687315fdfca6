"""pytest plugin: the drop-in parity tests (tests/test_trainer_parity.py) on a CUDA GPU, e.g. against TRL 1.15.

    PYTHONPATH=tests python -m pytest -p gpu_parity tests/test_trainer_parity.py     (make test-gpu-parity)

TRL 1.15 computes log-probs only with a Triton kernel, so on CPU stock TRL cannot train and these tests skip there.
This plugin, loaded before the tests are collected, makes the same tests train on the GPU: the tiny runs
(tests/helpers/models.py's `tiny_run_kwargs`) get `use_cpu=False`, the `cpu_logps` floor the tests skip by no longer
applies (every supported TRL computes log-probs on CUDA) while its detector asks TRL about CUDA instead of CPU (so
a TRL that cannot still errors), and weights are compared on the CPU (the trained ones live on the GPU). Nothing
else changes: same models, seeds, settings and tolerances as on CPU, in float32.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import floors, models, probes  # tests/ is on PYTHONPATH: pytest loads -p plugins before conftest.py

import grpo_plus.compat.loss as trl_loss

_logps_unavailable_reason = trl_loss.logps_unavailable_reason
_tiny_run_kwargs = models.tiny_run_kwargs
_max_weight_diff = probes.max_weight_diff


def logps_unavailable_on_gpu(device_type: str) -> str | None:
    """The tests ask about "cpu", where they would train; here they train on CUDA."""
    return _logps_unavailable_reason("cuda")


def tiny_run_kwargs_on_gpu(output_dir, **overrides) -> dict:
    return {**_tiny_run_kwargs(output_dir, **overrides), "use_cpu": False}


def max_weight_diff_on_cpu(a: dict, b: dict) -> float:
    return _max_weight_diff({k: v.cpu() for k, v in a.items()}, {k: v.cpu() for k, v in b.items()})


# Patched before the test modules import these names (pytest loads -p plugins before collecting).
trl_loss.logps_unavailable_reason = logps_unavailable_on_gpu
models.tiny_run_kwargs = tiny_run_kwargs_on_gpu
probes.max_weight_diff = max_weight_diff_on_cpu
floors.FLOORS["cpu_logps"] = dataclasses.replace(floors.FLOORS["cpu_logps"], unmet=lambda: None)


def pytest_configure(config) -> None:
    if not torch.cuda.is_available():
        raise pytest.UsageError("-p gpu_parity runs the parity tests on a CUDA GPU, and this machine has none.")


def pytest_report_header(config) -> str:
    return f"gpu_parity: training on {torch.cuda.get_device_name(0)}"
