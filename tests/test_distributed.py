"""Launch checks: accelerate configs that would silently train something else than asked."""

import logging

import pytest

from grpo_plus.run.distributed import LaunchError, check_launch


def test_processes_that_would_each_train_alone_stop_at_start(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(LaunchError, match="each of the 2 launched processes would train alone.*--ddp_backend gloo"):
        check_launch("DEEPSPEED", num_processes=1)
    check_launch("MULTI_CPU", num_processes=2)  # a real 2-process run passes


@pytest.mark.parametrize(
    ("variable", "runs", "expected"),
    [("ACCELERATE_USE_FSDP", "MULTI_CPU", "asks for FSDP, but accelerate runs MULTI_CPU"),
     ("ACCELERATE_USE_DEEPSPEED", "MULTI_CPU", "asks for DEEPSPEED, but accelerate runs MULTI_CPU")],
)  # fmt: skip
def test_an_engine_accelerate_dropped_is_named(monkeypatch, caplog, variable, runs, expected):
    monkeypatch.setenv(variable, "true")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with caplog.at_level(logging.WARNING, logger="grpo_plus.run.distributed"):
        check_launch(runs, num_processes=2)
    assert expected in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="grpo_plus.run.distributed"):
        check_launch("FSDP" if variable == "ACCELERATE_USE_FSDP" else "DEEPSPEED", num_processes=2)
    assert caplog.text == ""
