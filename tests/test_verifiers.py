"""grpo_plus.rewards' verifiers: accuracy_reward scores as TRL's on TRL's own test cases, in the main thread and in any
other, where (unlike TRL's) a pathological answer cannot hang it; GSM8K's final number; reasoning-gym's own scorer;
the format rewards."""

import subprocess
import sys
import textwrap
import threading
import time

import pytest
from trl.rewards import accuracy_reward as trl_accuracy_reward
from trl.rewards import think_format_reward as trl_think_format_reward

import grpo_plus.rewards.verifiers as verifiers
from grpo_plus.rewards import (
    accuracy_reward,
    answer_format_reward,
    boxed_format_reward,
    gsm8k_accuracy_reward,
    gsm8k_format_reward,
    reasoning_gym_reward,
    think_answer_format_reward,
    think_format_reward,
)

# TRL's tests/test_rewards.py (TestAccuracyReward), inputs and expected rewards: (completions, solutions, expected).
TRL_ACCURACY_CASES = {
    "correct_answer": ([r"\boxed{\frac{63}{400}}", r"\boxed{\frac{63}{400}}"], [r"\frac{63}{400}", "63/400"], [1.0, 1.0]),
    "wrong_answer": ([r"\boxed{\frac{64}{400}}"], [r"\frac{63}{400}"], [0.0]),
    "wrong_answer_no_latex": ([r"\boxed{3}"], ["6"], [0.0]),
    "unparsable_gold": (
        ["Answer is forty two.", r"Some other content. \boxed{43}."],
        ["Answer is forty two.", "Answer is forty three."],
        [None, None],
    ),
    "in_worker_thread": ([r"\boxed{\frac{1}{3}}"], [r"\frac{1}{3}"], [1.0]),
    # TRL's docstring example and its cosine-reward tests' inputs
    "docstring": ([r"My answer is \boxed{\frac{1}{3}}", r"My answer is \boxed{\frac{1}{2}}"], [r"\frac{1}{3}"] * 2, [1.0, 0.0]),
}  # fmt: skip
PATHOLOGICAL = r"\boxed{9^{9^{9^{9}}}}"  # math-verify's comparison with 7 runs until a timeout stops it


def as_messages(contents):
    return [[{"role": "assistant", "content": content}] for content in contents]


def in_thread(func, *args, **kwargs):
    """func(*args, **kwargs) run on a thread that is not the main one (where TRL turns math-verify's timeouts off)."""
    result, errors = [], []
    thread = threading.Thread(target=lambda: _capture(result, errors, func, *args, **kwargs))
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]


def _capture(result, errors, func, *args, **kwargs):
    try:
        result.append(func(*args, **kwargs))
    except Exception as error:
        errors.append(error)


def logged_columns(func, completions, solutions):
    columns = {}
    rewards = func(completions, solutions, log_extra=lambda column, values: columns.__setitem__(column, list(values)))
    return rewards, columns


@pytest.mark.parametrize("thread", ["main", "worker"])
@pytest.mark.parametrize("case", sorted(TRL_ACCURACY_CASES))
def test_accuracy_reward_scores_and_logs_as_trls_on_trls_cases(case, thread):
    """TRL's expected rewards, and TRL's own function's rewards and logged columns on the same inputs (TRL's run on
    the main thread: with its timeouts); ours in either thread, from messages and from plain strings alike."""
    contents, solutions, expected = TRL_ACCURACY_CASES[case]
    completions = as_messages(contents)
    trl_rewards, trl_columns = logged_columns(trl_accuracy_reward, completions, solutions)
    run = (lambda *a: in_thread(logged_columns, *a)) if thread == "worker" else logged_columns
    rewards, columns = run(accuracy_reward, completions, solutions)
    assert rewards == expected == trl_rewards
    assert columns == trl_columns and set(columns) == {"solution", "gold_parsed", "answer_parsed"}
    assert run(accuracy_reward, contents, solutions)[0] == expected


def test_accuracy_reward_off_the_main_thread_never_hangs_where_trls_does(monkeypatch):
    """A row math-verify cannot finish scores 0.0 once the helper process passes the row deadline (1 s here), and the
    rows after it are scored by a new helper. The negative control: TRL's function, called the same way (a thread
    that is not the main one), is still computing 7 s after it started, where its main-thread timeout (5 s) would have
    stopped it; it runs in a child process so that it can be stopped (it holds the GIL: that process cannot even
    print)."""
    negative_control = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import threading
            from trl.rewards import accuracy_reward
            thread = threading.Thread(target=accuracy_reward, args=([[{{"content": {PATHOLOGICAL!r}}}]], ["7"]))
            print("started", flush=True)
            thread.start()
            thread.join()
            print("returned", flush=True)
        """)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        assert negative_control.stdout.readline().strip() == "started"
        started = time.monotonic()
        monkeypatch.setattr(verifiers, "ROW_DEADLINE_SECONDS", 1)
        helper = verifiers._helper()
        restarts = helper.restarts
        completions = as_messages([r"\boxed{7}", PATHOLOGICAL, r"\boxed{7}", r"\boxed{8}"])
        assert in_thread(accuracy_reward, completions, ["7"] * 4) == [1.0, 0.0, 1.0, 0.0]
        assert helper.restarts == restarts + 1
        assert in_thread(accuracy_reward, completions[:1], ["7"]) == [1.0]  # the new helper keeps serving
        with pytest.raises(subprocess.TimeoutExpired):
            negative_control.wait(timeout=max(0.0, started + 7 - time.monotonic()))
    finally:
        negative_control.kill()
        negative_control.wait()


def test_accuracy_reward_helper_is_not_shared_with_a_forked_child(monkeypatch):
    """A forked process (a DataLoader worker, a runner's worker) starts a helper of its own instead of writing into its
    parent's pipes, and leaves the parent's running (here the fork is played by another process id)."""
    helper = verifiers._helper()
    in_thread(accuracy_reward, [r"\boxed{1}"], ["1"])
    parents = helper.process
    real_pid = verifiers.os.getpid()
    monkeypatch.setattr(verifiers.os, "getpid", lambda: real_pid + 1)
    assert in_thread(accuracy_reward, [r"\boxed{2}"], ["2"]) == [1.0]
    assert helper.process is not parents and parents.poll() is None
    helper.stop()
    monkeypatch.undo()
    parents.kill()
    parents.wait()


GSM8K_ANSWER = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72"


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("48 + 24 = 72\n#### 72", 1.0),
        ("She sold 72 clips.", 1.0),  # no "####": the last number
        ("#### 72.00", 1.0),
        ("#### $72", 1.0),
        ("#### 72 clips, not 70", 1.0),  # the number right after the last "####"
        ("#### 70\nso 72", 0.0),
        ("48 + 24 = 71", 0.0),
        ("no number at all", 0.0),
        ("", 0.0),
    ],
)
def test_gsm8k_accuracy_reward_reads_the_number_after_the_marks(reply, expected):
    assert gsm8k_accuracy_reward(as_messages([reply]), [GSM8K_ANSWER]) == [expected]
    assert gsm8k_accuracy_reward([reply], [GSM8K_ANSWER]) == [expected]


def test_gsm8k_accuracy_reward_reads_commas_and_signs_and_skips_answers_without_a_number():
    replies = ["#### 1,234", "the total is -5", "#### 7", "#### 3"]
    assert gsm8k_accuracy_reward(replies, ["#### 1234", "x\n#### -5", "seven", 3]) == [1.0, 1.0, None, 1.0]


@pytest.mark.parametrize(
    ("reply", "gsm8k", "answer", "think_answer", "boxed"),
    [
        ("<think>add</think>\n<answer>7</answer>", 0.0, 1.0, 1.0, 0.0),
        ("<think>add</think><answer>7</answer> because", 0.0, 0.5, 0.0, 0.0),
        ("<answer>7</answer>", 0.0, 1.0, 0.5, 0.0),
        ("<think>a</think><think>b</think><answer>7</answer>", 0.0, 1.0, 0.5, 0.0),
        ("<answer> </answer>", 0.0, 0.0, 0.0, 0.0),
        ("3 + 4 = 7\n#### 7", 1.0, 0.0, 0.0, 0.0),
        ("3 + 4 = 7", 0.5, 0.0, 0.0, 0.0),
        ("so $\\boxed{\\frac{1}{2}}$", 0.0, 0.0, 0.0, 1.0),
        ("\\boxed{}", 0.0, 0.0, 0.0, 0.0),
    ],
)
def test_format_rewards(reply, gsm8k, answer, think_answer, boxed):
    completions = as_messages([reply])
    assert gsm8k_format_reward(completions) == [gsm8k]
    assert answer_format_reward(completions) == [answer]
    assert think_answer_format_reward(completions) == [think_answer]
    assert boxed_format_reward(completions) == [boxed]


def test_think_format_reward_is_trls():
    assert think_format_reward is trl_think_format_reward


def test_reasoning_gym_reward_is_the_tasks_own_score_answer():
    """Entries generated locally by reasoning-gym; the reward regenerates each from its JSON source and scores with
    the task's own `score_answer`: tagged answers as reasoning-gym's `extract_answer` reads them, untagged numeric
    replies by their last number."""
    import json

    import reasoning_gym
    from reasoning_gym.utils import extract_answer

    config = {"min_terms": 2, "max_terms": 3, "max_digits": 2, "seed": 5, "size": 20}
    dataset = reasoning_gym.create_dataset("chain_sum", **config)
    sources = [json.dumps({"task": "chain_sum", "config": config, "index": i}) for i in range(6)]
    entries = [dataset[i] for i in range(6)]
    replies = [
        f"<answer>{entries[0]['answer']}</answer>",
        f"Thinking... <answer> {entries[1]['answer']} </answer>",
        f"<answer>{int(entries[2]['answer']) + 1}</answer>",
        f"The result: {entries[3]['question'].split(':')[-1]} {entries[4]['answer']}",  # the wrong number last
        f"{entries[4]['question'].split(':')[-1]} {entries[4]['answer']}",
        f"<answer>x {entries[5]['answer']}</answer>",  # partial credit, reasoning-gym's own
    ]
    expected = [
        dataset.score_answer(extract_answer(reply), entry) for reply, entry in zip(replies, entries, strict=True)
    ]
    expected[3] = dataset.score_answer(entries[4]["answer"], entries[3])
    expected[4] = 1.0
    rewards = reasoning_gym_reward(as_messages(replies), sources)
    assert rewards == expected
    assert rewards[:3] == [1.0, 1.0, 0.0] and 0.0 < rewards[5] < 1.0
    assert (entries[3]["answer"] == entries[4]["answer"]) == (rewards[3] == 1.0)


def test_every_reward_pickles_by_reference_for_worker_processes():
    """A process pool sends reward functions by pickle: each one is a module-level name, found again as itself."""
    import pickle

    import grpo_plus.rewards
    from grpo_plus.rewards import verifiers

    for name in grpo_plus.rewards.__all__:
        func = getattr(grpo_plus.rewards, name)
        if (
            getattr(func, "__module__", None) != verifiers.__name__
            and func is not grpo_plus.rewards.think_format_reward
        ):
            continue  # the runner's names: classes and settings, not reward functions
        assert pickle.loads(pickle.dumps(func)) is func, name
