"""The reward runner (grpo_plus.rewards.runner): reward functions in worker processes under a deadline, failures
narrowed down to the completions that cause them; every reward that comes back is the serial in-process one.

The oracles: the same function called once, in this process, on the whole batch (and stock TRL's own
`_calculate_rewards`); for a training run, the same run scored in-process by a twin of the failing reward that
returns None exactly where the failing one stalls or crashes."""

from __future__ import annotations

import asyncio
import ctypes
import faulthandler
import inspect
import logging
import os
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
import trl
from datasets import Dataset
from helpers.models import tiny_trainer
from helpers.probes import logged
from helpers.rewards import digit_reward
from helpers.tool_model import EchoEnv, counter_factory, tool_trainer

import grpo_plus
from grpo_plus.config import ConfigError
from grpo_plus.rewards import RewardRunner
from grpo_plus.rewards.settings import RewardRunnerSettings
from grpo_plus.run.state import StatefulPart
from grpo_plus.run.validation import RewardFunctionError, RewardOutputError

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="reward workers fork")
BATCH = [f"{i % 7}{'ab' * (i % 3)}{i}" for i in range(16)]  # 16 distinct completions


def kwargs_like_trl(completions, **columns) -> dict:
    """The keyword arguments TRL 1.16's `_calculate_rewards` passes a reward function, for `completions`."""
    n = len(completions)
    return dict(
        prompts=[f"p{i // 4}" for i in range(n)], completions=list(completions), completion_ids=[[i] for i in range(n)],
        answer=list(range(n)), trainer_state=None, log_extra=lambda column, values: None,
        log_metric=lambda name, value: None, **columns,
    )  # fmt: skip


def run(reward, settings: RewardRunnerSettings, calls: list[dict], seconds: list | None = None) -> list:
    """The runner's answers to `calls` of `reward` (its stand-in, as the trainer installs it); `seconds` gets how long
    each call took, from TRL's call to its answer."""
    runner = RewardRunner(settings, [reward])
    try:
        (stand_in,) = runner.wrap([reward], [reward.__name__])
        answers = []
        for call in calls:
            began = time.monotonic()
            answer = stand_in(**call)
            answers.append(asyncio.run(answer) if inspect.iscoroutine(answer) else answer)  # TRL awaits an async one
            if seconds is not None:
                seconds.append(time.monotonic() - began)
        return answers, runner.take_metrics()
    finally:
        runner.close()


# How long past reward_timeout a call may take to return. After the deadline the runner SIGKILLs the workers still
# running, asks the zygote for replacements without waiting for them, and reads what the workers it retired leave;
# the first time a kind of failure is met, a worker's end is described from the zygote's report, waited for up to 1 s
# (`_record`). Forking the first workers and narrowing failures down happen before the deadline, within the timeout.
# Measured on 2 cores at a load average of 15: 0.002-0.09 s past the deadline (7 calls of 1 s and 3 s; with stalls
# only, and with every kind of failure). The margin: that 1 s wait, and 0.5 s for a machine busier still.
DEADLINE_MARGIN = 1.5


def kept_on_time(seconds: float, timeout: float) -> bool:
    """A call in which a completion stalls ends at its deadline: not before it, and at most DEADLINE_MARGIN past it."""
    return timeout <= seconds <= timeout + DEADLINE_MARGIN


def trl_floats(rewards) -> torch.Tensor:
    """Rewards as TRL stores them (None -> NaN, float32)."""
    return torch.tensor([torch.nan if r is None else r for r in rewards], dtype=torch.float32)


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and torch.equal(a.isnan(), b.isnan())
    assert torch.equal(a.nan_to_num(0.0).view(torch.int32), b.nan_to_num(0.0).view(torch.int32))


# ---- rewards --------------------------------------------------------------------------------------------------------


def score(text: str) -> float:
    """A reward of one completion alone, with float32 rounding to keep (1/3, 1/7, ...)."""
    return (zlib.crc32(text.encode()) % 1000) / 7.0 + len(text) / 3.0


def list_reward(completions, **kwargs):
    return [score(c) if len(c) % 3 else len(c) for c in completions]  # floats and ints


def none_reward(completions, answer, **kwargs):
    return [None if a % 4 == 1 else score(c) for c, a in zip(completions, answer, strict=True)]


def tensor_reward(completions, **kwargs):
    return torch.tensor([score(c) for c in completions], dtype=torch.float64)  # TRL casts to float32


def array_reward(completions, **kwargs):
    return np.array([score(c) for c in completions], dtype=np.float32)


def generator_reward(completions, **kwargs):
    return (score(c) for c in completions)


async def async_reward(completions, **kwargs):
    await asyncio.sleep(0)
    return [score(c) for c in completions]


def batch_rank_reward(completions, **kwargs):
    """Scores a completion by its rank within the call: splitting the call changes it (whole-batch functions)."""
    order = sorted(range(len(completions)), key=lambda i: score(completions[i]))
    return [float(order.index(i)) for i in range(len(completions))]


def kind(text: str) -> str:
    """What `failing_reward` does on a completion: a property of the completion alone, as narrowing assumes."""
    return {0: "stall", 1: "exit", 2: "segfault", 3: "raise"}.get(zlib.crc32(text.encode()) % 9, "ok")


def failing_reward(completions, **kwargs):
    """Stalls, ends its process (os._exit, a segfault) or raises on some completions; scores the others."""
    for text in completions:
        if kind(text) == "stall":
            time.sleep(3600)
        if kind(text) == "exit":
            os._exit(3)
        if kind(text) == "segfault":
            faulthandler.disable()  # pytest's handler, inherited by the worker, would print the crash's stack
            ctypes.string_at(0)
        if kind(text) == "raise":
            raise ValueError(f"cannot score {text!r}")
    return [score(text) for text in completions]


def failing_reward_twin(completions, **kwargs):
    """The serial oracle of `failing_reward`: None where it fails, its score elsewhere."""
    return [None if kind(text) != "ok" else score(text) for text in completions]


FAILING = [text for text in BATCH if kind(text) != "ok"]


def test_the_batch_holds_every_kind_of_failure():
    assert sorted({kind(text) for text in BATCH}) == ["exit", "ok", "raise", "segfault", "stall"]


# ---- unit: the runner against one in-process call -------------------------------------------------------------------


@pytest.mark.parametrize(
    "reward", [list_reward, none_reward, tensor_reward, array_reward, generator_reward, async_reward]
)
def test_split_across_workers_the_rewards_are_one_in_process_calls_bit_for_bit(reward):
    """Two workers, each scoring half of the call: what comes back is what one call returns, as TRL stores it."""
    calls = [kwargs_like_trl(BATCH), kwargs_like_trl(BATCH[:5])]
    answers, metrics = run(reward, RewardRunnerSettings(workers=2), calls)
    for call, answer in zip(calls, answers, strict=True):
        expected = reward(**call)
        expected = asyncio.run(expected) if inspect.iscoroutine(expected) else expected
        assert_bitwise_equal(trl_floats(answer), trl_floats(list(expected)))
    assert metrics[f"rewards/{reward.__name__}/timeouts"] == metrics[f"rewards/{reward.__name__}/errors"] == 0


def test_a_batch_dependent_reward_differs_when_split_unless_named_whole_batch():
    """The negative control of splitting: a reward that ranks completions within the call is changed by it; named in
    reward_whole_batch it is called on the whole batch and equals the in-process call."""
    call = kwargs_like_trl(BATCH)
    expected = trl_floats(batch_rank_reward(**call))
    (split,), _ = run(batch_rank_reward, RewardRunnerSettings(workers=2), [call])
    assert not torch.equal(trl_floats(split), expected)
    settings = RewardRunnerSettings(workers=2, whole_batch=("batch_rank_reward",))
    (whole,), _ = run(batch_rank_reward, settings, [call])
    assert_bitwise_equal(trl_floats(whole), expected)


def test_stalls_crashes_and_errors_are_narrowed_to_the_completions_that_cause_them(caplog):
    """Every completion that stalls, ends its worker (os._exit, segfault) or raises gets None; every other one gets
    the serial reward; each kind is counted and warned about once, naming the function and a completion. A second
    call works on the workers that replaced those stopped or ended."""
    calls = [kwargs_like_trl(BATCH), kwargs_like_trl([text for text in BATCH if kind(text) != "stall"])]
    settings = RewardRunnerSettings(timeout=3.0, workers=2, on_error="none")
    seconds = []
    with caplog.at_level(logging.WARNING, logger="grpo_plus.rewards.runner"):
        answers, metrics = run(failing_reward, settings, calls, seconds)
    assert kept_on_time(seconds[0], settings.timeout), seconds  # narrowing 4 stalls down to 1 completion each
    for call, answer in zip(calls, answers, strict=True):
        assert_bitwise_equal(trl_floats(answer), trl_floats(failing_reward_twin(**call)))
    stalls = sum(kind(text) == "stall" for text in BATCH)
    assert metrics["rewards/failing_reward/timeouts"] == stalls
    assert metrics["rewards/failing_reward/errors"] == 2 * (len(FAILING) - stalls)
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 3  # timeout, error, crash: once each over both calls
    assert all(w.startswith("Reward function 'failing_reward' ") for w in warnings)
    assert any("did not return within reward_timeout=3 s on completion" in w for w in warnings)
    assert any("raised ValueError: cannot score" in w for w in warnings)
    assert any("ended its worker process (" in w for w in warnings)
    assert all(any(repr(text) in w for text in FAILING) for w in warnings)


def test_a_stalled_call_returns_at_its_deadline_and_a_late_one_is_caught():
    """reward_timeout is kept on time: a call in which one completion sleeps forever returns at its deadline (plus
    DEADLINE_MARGIN). The negative control: a runner that waits 4x the timeout fails the same check."""
    call = kwargs_like_trl([text for text in BATCH if kind(text) in ("ok", "stall")][:8])
    assert any(kind(text) == "stall" for text in call["completions"])
    timeout, seconds = 1.0, []
    answers, _ = run(
        failing_reward, RewardRunnerSettings(timeout=timeout, workers=2, on_error="none"), [call], seconds
    )
    assert_bitwise_equal(trl_floats(answers[0]), trl_floats(failing_reward_twin(**call)))
    assert kept_on_time(seconds[0], timeout), seconds
    late = RewardRunnerSettings(timeout=4 * timeout, workers=2, on_error="none")  # the deadline a late runner keeps
    run(failing_reward, late, [call], seconds)
    assert not kept_on_time(seconds[1], timeout), seconds


def test_in_process_errors_are_narrowed_too():
    """reward_workers=0, reward_on_error='none': no worker, TRL's call first; on an exception, halves called again
    until the completions that raise are alone."""
    batch = [text for text in BATCH if kind(text) in ("ok", "raise")]

    def raising_reward(completions, **kwargs):
        if any(kind(text) == "raise" for text in completions):
            raise KeyError("no score")
        return [score(text) for text in completions]

    (answer,), metrics = run(raising_reward, RewardRunnerSettings(on_error="none"), [kwargs_like_trl(batch)])
    assert_bitwise_equal(trl_floats(answer), trl_floats(failing_reward_twin(completions=batch)))
    assert metrics["rewards/raising_reward/errors"] == sum(kind(text) == "raise" for text in batch) > 0


def test_with_reward_on_error_raise_the_functions_exception_is_raised_and_the_pool_survives():
    """TRL's behaviour: the exception of the function, its own type plus RewardFunctionError, with notes naming the
    completions and the worker's traceback. A crash still gives None (that is what the workers are for)."""

    def reward(completions, **kwargs):
        if "boom" in completions:
            raise ValueError("cannot score boom")
        if "exit" in completions:
            os._exit(7)
        return [1.0] * len(completions)

    runner = RewardRunner(RewardRunnerSettings(workers=2), [reward])
    try:
        (stand_in,) = runner.wrap([reward], ["reward"])
        with pytest.raises(ValueError, match="cannot score boom") as caught:
            stand_in(**kwargs_like_trl(["a", "b", "c", "boom"]))
        assert isinstance(caught.value, RewardFunctionError)
        assert "Reward function 'reward' raised ValueError" in caught.value.__notes__[0]
        assert "In the reward worker process" in caught.value.__notes__[-1] and "raise ValueError" in str(
            caught.value.__notes__[-1]
        )
        assert stand_in(**kwargs_like_trl(["a", "exit", "c", "d"])) == [1.0, None, 1.0, 1.0]
        assert stand_in(**kwargs_like_trl(["a", "b"])) == [1.0, 1.0]
    finally:
        runner.close()


def test_a_wrong_output_is_named_as_in_process():
    def short_reward(completions, **kwargs):
        return [1.0]

    with pytest.raises(RewardOutputError, match="'short_reward' must return a list of 2 rewards"):
        run(short_reward, RewardRunnerSettings(workers=2), [kwargs_like_trl(["a", "b", "c", "d"])])


def test_what_reward_functions_log_reaches_trl_in_completion_order():
    """log_extra (one value per completion) and log_metric calls made in the workers are made in the trainer."""

    def logging_reward(completions, log_extra, log_metric, **kwargs):
        log_extra("length", [len(c) for c in completions])
        log_metric("calls", 1.0)
        return [0.0] * len(completions)

    extra, metrics = {}, []
    call = kwargs_like_trl(BATCH)
    call.update(log_extra=lambda column, values: extra.setdefault(column, []).extend(values),
                log_metric=lambda name, value: metrics.append((name, value)))  # fmt: skip
    run(logging_reward, RewardRunnerSettings(workers=2), [call])
    assert extra == {"length": [len(c) for c in BATCH]}
    assert metrics == [("calls", 1.0), ("calls", 1.0)]  # once per piece (documented)


def test_arguments_that_cannot_reach_a_worker_are_named():
    import threading

    call = kwargs_like_trl(["a", "b"], lock=[threading.Lock(), threading.Lock()])
    with pytest.raises(RewardFunctionError, match="cannot be sent to a reward worker process"):
        run(list_reward, RewardRunnerSettings(workers=2), [call])


def test_the_runner_refuses_what_it_cannot_run_when_the_trainer_is_built():
    class Curriculum(StatefulPart):
        checkpoint_name, version = "curriculum", 1

        def __call__(self, completions, **kwargs):
            return [0.0] * len(completions)

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    curriculum = Curriculum()
    runner = RewardRunner(RewardRunnerSettings(workers=1, whole_batch=("nope",)), [curriculum])
    try:
        with pytest.raises(ConfigError, match=r"reward_whole_batch names \['nope'\], which are not reward functions"):
            runner.wrap([curriculum], ["curriculum"])
        runner.settings = RewardRunnerSettings(workers=1)
        with pytest.raises(ConfigError, match="keeps training state that checkpoints save"):
            runner.wrap([curriculum], ["curriculum"])
    finally:
        runner.close()


def test_a_trl_that_passes_reward_functions_an_argument_the_runner_does_not_know_is_refused(monkeypatch):
    """The runner splits TRL's arguments by completion from what grpo_plus.compat.rewards records; a TRL whose `_calculate_rewards`
    passes something else is refused when the runner starts, not split wrongly."""
    from grpo_plus.compat import rewards as trl_rewards
    from grpo_plus.compat.versions import TRLCompatibilityError

    def changed(self, inputs, prompts, completions, completion_ids_list):
        reward_kwargs = {}
        reward_kwargs["trainer_state"] = self.state
        reward_kwargs["group_seed"] = 0
        return reward_kwargs

    assert trl_rewards.reward_call_problem() is None
    monkeypatch.setattr(trl.GRPOTrainer, "_calculate_rewards", changed)
    trl_rewards.reward_call_problem.cache_clear()
    try:
        with pytest.raises(TRLCompatibilityError, match="passes reward functions group_seed"):
            RewardRunner(RewardRunnerSettings(workers=1), [list_reward])
    finally:
        monkeypatch.undo()
        trl_rewards.reward_call_problem.cache_clear()


# ---- the trainer: TRL's _calculate_rewards, the run ---------------------------------------------------------


def completion_inputs(rows: int) -> tuple[list[dict], list[str], list[str], list[list[int]]]:
    """(inputs, prompts, completions, completion_ids) as TRL's _generate_and_score_completions passes them."""
    inputs = [{"prompt": f"{i % 5}+1=", "answer": i % 5 + 1} for i in range(rows)]
    completions = BATCH[:rows]
    return inputs, [row["prompt"] for row in inputs], completions, [[ord(ch) for ch in c] for c in completions]


def test_the_trainers_rewards_are_stock_trls_bit_for_bit(tmp_path):
    """grpo_plus with reward_workers=2 against stock TRL's own `_calculate_rewards` on the same completions: sync,
    async, tensor, array and None-returning reward functions, one column each."""
    rewards = [list_reward, none_reward, tensor_reward, array_reward, async_reward]
    theirs = tiny_trainer(tmp_path / "trl", rewards, package=trl)
    ours = tiny_trainer(tmp_path / "ours", rewards, reward_workers=2, reward_timeout=30.0)
    try:
        for rows in (16, 3):
            args = completion_inputs(rows)
            assert_bitwise_equal(ours._calculate_rewards(*args), theirs._calculate_rewards(*args))
    finally:
        ours._reward_runner.close()


def stock_twin(rewards, name: str):
    """`failing_reward_twin` under `name`, so that both runs log the same keys."""

    def twin(completions, **kwargs):
        return failing_reward_twin(completions)

    twin.__name__ = name
    return twin


def recorded_rewards(trainer) -> list[torch.Tensor]:
    """Wrap the trainer's `_calculate_rewards` to keep every call's (gathered) rewards per function."""
    calls, calculate = [], trainer._calculate_rewards

    def recording(*args):
        calls.append(calculate(*args).clone())
        return calls[-1]

    trainer._calculate_rewards = recording
    return calls


@pytest.mark.slow
def test_a_run_whose_reward_stalls_and_crashes_trains_like_the_serial_run(tmp_path):
    """The issue's "Done when": reward_workers=2, a small reward_timeout, a reward that sleeps forever on some
    completions and calls os._exit (or segfaults, or raises) on others: the run finishes its steps, logs the
    timeouts and errors, and every reward equals the serial in-process run's (a twin returning None exactly there),
    so the two runs train to the same weights, bit for bit."""
    settings = dict(max_steps=2, per_device_train_batch_size=8)
    ours = tiny_trainer(
        tmp_path / "workers", [failing_reward, digit_reward], reward_workers=2, reward_timeout=4.0,
        reward_on_error="none", **settings,
    )  # fmt: skip
    ours_calls = recorded_rewards(ours)
    ours.train()
    serial = tiny_trainer(
        tmp_path / "serial", [stock_twin(failing_reward, "failing_reward"), digit_reward], **settings
    )
    serial_calls = recorded_rewards(serial)
    serial.train()
    assert len(ours_calls) == len(serial_calls) == 2
    for a, b in zip(ours_calls, serial_calls, strict=True):
        assert_bitwise_equal(a, b)
    for name in ("loss", "reward", "rewards/failing_reward/mean", "rewards/digit_reward/mean"):
        assert logged(ours, name) == logged(serial, name), name
    for (name, a), b in zip(ours.model.state_dict().items(), serial.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    timeouts, errors = logged(ours, "rewards/failing_reward/timeouts"), logged(ours, "rewards/failing_reward/errors")
    assert sum(timeouts) > 0 and sum(errors) > 0  # the run did meet stalls and crashes
    assert sum(timeouts) + sum(errors) == sum(c[:, 0].isnan().sum().item() for c in serial_calls)
    assert logged(ours, "rewards/digit_reward/errors") == [0.0, 0.0]
    assert all(seconds > 0 for seconds in logged(ours, "rewards/digit_reward/seconds"))
    # reward_timeout kept in training: one call per step, its time in the function's calls (to the stand-in's answer)
    for stalled, seconds in zip(timeouts, logged(ours, "rewards/failing_reward/seconds"), strict=True):
        assert kept_on_time(seconds, 4.0) if stalled else seconds < 4.0, (timeouts, seconds)
    assert ours._reward_runner.worker_pids[:-1] == []  # train() ended its workers; the zygote waits for evaluate()
    ours._reward_runner.close()


def echo_reward(completions, environments, **kwargs):
    """Scores EchoEnv rollouts by their number of messages; None for the others (CounterEnv scores its own)."""
    return [float(len(c)) if isinstance(e, EchoEnv) else None for c, e in zip(completions, environments, strict=True)]


@pytest.mark.floor("environment_factory")
@pytest.mark.filterwarnings("ignore:You are using:UserWarning")
def test_environments_and_environment_owned_rewards_keep_working(tool_model_dir, tmp_path):
    """A reward function reading `environments` runs in the workers (the instances are sent with each piece); the
    environment-owned reward (CounterEnv.get_reward) stays TRL's, in the trainer. One step trains like stock TRL."""
    dataset = Dataset.from_dict({"environment": ["counter", "echo"] * 4})
    trainers = []
    for package, extra in ((trl, {}), (grpo_plus, dict(reward_workers=2))):
        trainer = tool_trainer(
            package, tool_model_dir, tmp_path / package.__name__, train_dataset=dataset, reward_funcs=[echo_reward],
            environment_factory={"counter": counter_factory(), "echo": EchoEnv}, num_generations=2,
            max_completion_length=64, max_steps=1, **extra,
        )  # fmt: skip
        trainer.train()
        trainers.append(trainer)
    theirs, ours = trainers
    ours._reward_runner.close()
    assert type(ours.reward_funcs[0]).__name__ == "RunnerReward" and ours.reward_funcs[1] is not None
    for key in ("loss", "reward", "rewards/CounterEnv/mean", "rewards/echo_reward/mean"):
        assert logged(ours, key) == logged(theirs, key), key


# ---- processes: a script's own reward functions, no orphans --------------------------------------------------------

SCRIPT = """
import os, sys, time
sys.path.insert(0, {tests!r})
with open({marker!r}, "a") as f:  # the script's top level: a worker that imported it again would write here too
    f.write(f"{{os.getpid()}}\\n")
from helpers.models import tiny_trainer

def pid_reward(completions, stall, **kwargs):  # defined in __main__, no `if __name__ == "__main__"` guard
    if any(stall):
        time.sleep(3600)
    return [float(os.getpid()) for _ in completions]

trainer = tiny_trainer({out!r}, [pid_reward], reward_workers=2, reward_timeout=600.0)
def score(stall):
    inputs = [dict(prompt="1+1=", stall=stall)] * 4
    return trainer._calculate_rewards(inputs, ["1+1="] * 4, list("abcd"), [[1]] * 4)[:, 0].tolist()
print("scored by", *sorted(set(score(False))), flush=True)
print("pids", *trainer._reward_runner.worker_pids, flush=True)
score(True)
"""


def alive(pid: int) -> bool:
    """A process that runs (a zombie waiting for its parent to read its status does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0] != "Z"
    except FileNotFoundError:
        return False


def wait_until_gone(pids: list[int], seconds: float) -> list[int]:
    end = time.monotonic() + seconds
    while any(alive(pid) for pid in pids) and time.monotonic() < end:
        time.sleep(0.1)
    return [pid for pid in pids if alive(pid)]


@pytest.mark.skipif(not Path("/proc").exists(), reason="reads /proc")
def test_closing_the_runner_ends_its_processes():
    runner = RewardRunner(RewardRunnerSettings(workers=2), [list_reward])
    (stand_in,) = runner.wrap([list_reward], ["list_reward"])
    stand_in(**kwargs_like_trl(BATCH))
    pids = runner.worker_pids
    assert len(pids) == 3 and all(alive(pid) for pid in pids)
    runner.close()
    assert wait_until_gone(pids, 5.0) == []


@pytest.mark.engine  # its work is in a child process (moved out of make test: its 10-minute budget)
@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").exists(), reason="reads /proc")
def test_a_reward_defined_in_an_unguarded_main_script_runs_in_workers_that_end_with_a_killed_trainer(tmp_path):
    """A script run as __main__ defines its reward function at the top level (no guard): the workers score with it
    without running the script again, in processes of their own; SIGKILLed while a worker stalls, the trainer
    leaves no process behind (the zygote sees its parent go, the workers die with the zygote)."""
    marker, script = tmp_path / "marker", tmp_path / "train.py"
    script.write_text(SCRIPT.format(tests=str(Path(__file__).parent), marker=str(marker), out=str(tmp_path / "out")))
    env = {**os.environ, "PYTHONPATH": str(Path(grpo_plus.__file__).parents[1])}  # this checkout's grpo_plus
    process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        lines = []
        while not (lines and lines[-1].startswith("pids")):  # past what the imports print
            lines.append(process.stdout.readline())
            assert lines[-1], f"the script ended: {lines}"
        scorers, pids = lines[-2].split()[2:], [int(pid) for pid in lines[-1].split()[1:]]
        main_pid = int(marker.read_text().split()[0])
        assert marker.read_text().split() == [str(main_pid)]  # the script ran once: no worker imported it again
        assert len(scorers) >= 1 and str(float(main_pid)) not in scorers  # the workers scored, not the trainer
        zygote, children, end = pids[-1], [], time.monotonic() + 60
        while len(children) < 2 and time.monotonic() < end:  # the workers forked again (one stalls)
            time.sleep(0.1)
            children = [int(p) for p in Path(f"/proc/{zygote}/task/{zygote}/children").read_text().split()]
        assert len(children) == 2 and all(alive(pid) for pid in [zygote, *children])
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
        assert wait_until_gone([zygote, *children], 5.0) == []
    finally:
        process.kill()
