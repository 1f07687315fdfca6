"""Every agentic setup stock TRL 1.16 trains, grpo_plus trains the same way (float32, same weights), and each check
grpo_plus adds on top of TRL fires only where TRL fails too: environments (one, or a dict routing rows by an
'environment' column, owning the data and the reward), a rollout function, iterable datasets."""

from __future__ import annotations

import os

import pytest
import torch
import trl
from datasets import Dataset
from helpers.probes import logged, max_weight_diff
from helpers.tool_model import EchoEnv, counter_factory, number_prompts, tool_trainer

import grpo_plus
from grpo_plus.run.validation import DatasetError, RewardOutputError

pytestmark = [
    pytest.mark.floor("cpu_logps"),
    pytest.mark.filterwarnings("ignore:You are using:UserWarning"),  # TRL's "experimental feature" warnings
]
SHORT = dict(max_completion_length=64)
# TRL itself refuses environments below transformers 5.2 (ImportError when the trainer is built): nothing to compare.
needs_environments = pytest.mark.floor("environment_factory")


def generator_reward(completions, **kwargs):
    return (float(len(c)) for c in completions)  # an iterator: TRL reads it into a list


def echo_reward(completions, environments, **kwargs):
    """Scores EchoEnv rollouts by their number of messages; None for the others (CounterEnv scores its own)."""
    return [
        float(len(c)) if isinstance(env, EchoEnv) else None for c, env in zip(completions, environments, strict=True)
    ]


def environments():
    """A fresh dict environment_factory: one that owns its reward (counter), one that does not (echo)."""
    return {"counter": counter_factory(), "echo": EchoEnv}


def both(tool_model_dir, tmp_path, **setup):
    """Stock TRL's and grpo_plus's trainers on the tool model, each trained (2 steps unless `max_steps` says
    otherwise) from the same seed: (TRL's, grpo_plus's), each with the completions it trained on."""
    trained = []
    for package in (trl, grpo_plus):
        kwargs = {key: value() if callable(value) and key == "environment_factory" else value
                  for key, value in setup.items()}  # fmt: skip
        trainer = tool_trainer(package, tool_model_dir, tmp_path / package.__name__, **kwargs)
        batches, score = [], trainer._generate_and_score_completions

        def recording(inputs, score=score, batches=batches):
            output = score(inputs)
            batches.append({k: v.clone() for k, v in output.items() if k.endswith(("_ids", "_mask"))})
            return output

        trainer._generate_and_score_completions = recording
        trainer.train()
        trained.append((trainer, batches))
    return trained


def assert_trained_alike(trained, *keys: str):
    (theirs, their_batches), (ours, our_batches) = trained
    assert len(our_batches) == len(their_batches) == theirs.args.max_steps
    for a, b in zip(their_batches, our_batches, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for key in ("loss", "reward", *keys):
        assert logged(ours, key) == logged(theirs, key), key
    assert max_weight_diff(theirs.model.state_dict(), ours.model.state_dict()) <= 2e-7  # worst 6.0e-8 (2 threads)
    return ours


@needs_environments
def test_a_dataset_of_environment_names_with_environment_owned_rewards_trains_like_trl(tool_model_dir, tmp_path):
    """The issue's case: each row only names its environment (the prompt comes from `reset()`), the counter owns its
    reward, the echo environment is scored by a reward function that returns None for counter rollouts."""
    dataset = Dataset.from_dict({"environment": ["counter", "echo"] * 4})
    trained = both(
        tool_model_dir, tmp_path, train_dataset=dataset, reward_funcs=[echo_reward],
        environment_factory=environments, num_generations=2, **SHORT,
    )  # fmt: skip
    ours = assert_trained_alike(trained, "rewards/CounterEnv/mean", "rewards/echo_reward/mean", "tools/call_frequency")
    assert all(frequency > 0 for frequency in logged(ours, "tools/call_frequency"))
    # every batch mixed both environments: both reward sources scored some rollouts of each step
    assert all(value is not None for value in logged(ours, "rewards/CounterEnv/mean"))
    assert all(value is not None for value in logged(ours, "rewards/echo_reward/mean"))
    assert any(fraction < 1 for fraction in logged(ours, "zero_waste/positions_frac"))  # the saving ran, exactly


@needs_environments
def test_environment_rewards_called_directly_answer_like_trls(tool_model_dir, tmp_path):
    """TRL's own suite (test_environment_owned_reward_mixed_environments) calls the environment reward it appends as
    `func(environments=[...])`, without completions: grpo_plus's reward check must keep that call contract."""
    dataset = Dataset.from_dict({"environment": ["counter", "echo"] * 4})
    answers = []
    for package in (trl, grpo_plus):
        trainer = tool_trainer(
            package, tool_model_dir, tmp_path / package.__name__, train_dataset=dataset, reward_funcs=[echo_reward],
            environment_factory=environments(), num_generations=2, **SHORT,
        )  # fmt: skip
        assert trainer.reward_func_names == ["echo_reward", "CounterEnv"]
        counter, echo = trainer.environment_factories["counter"](), EchoEnv()
        answers.append(trainer.reward_funcs[-1](environments=[counter, echo, counter]))
    assert answers[1] == answers[0] == [0.0, None, 0.0]


@needs_environments
def test_one_environment_owning_data_and_reward_trains_without_dataset_or_reward_funcs(tool_model_dir, tmp_path):
    trained = both(
        tool_model_dir, tmp_path, train_dataset=None, reward_funcs=None, environment_factory=counter_factory,
        max_steps=1, **SHORT,
    )  # fmt: skip
    ours = assert_trained_alike(trained, "rewards/CounterEnv/mean")
    assert any(fraction < 1 for fraction in logged(ours, "zero_waste/generation_prefill_positions_frac"))


@needs_environments
def test_one_environment_completing_dataset_prompts_trains_like_trl(tool_model_dir, tmp_path):
    """`reset()`'s observation is appended to each row's prompt; the reward function returns an iterator, which TRL
    reads into a list (grpo_plus's output check accepts it)."""
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": "Count from "}]}] * 8)
    trained = both(
        tool_model_dir, tmp_path, environment_factory=counter_factory, train_dataset=dataset,
        reward_funcs=[generator_reward], max_steps=1, **SHORT,
    )  # fmt: skip
    assert_trained_alike(trained, "rewards/CounterEnv/mean", "rewards/generator_reward/mean")


@needs_environments
def test_an_iterable_dataset_of_environment_names_trains_like_trl(tool_model_dir, tmp_path):
    """A streamed dataset (no length, TRL repeats it into groups itself) of environment names."""
    dataset = Dataset.from_dict({"environment": ["counter", "echo"] * 4}).to_iterable_dataset()
    trained = both(
        tool_model_dir, tmp_path, train_dataset=dataset, reward_funcs=[echo_reward],
        environment_factory=environments, num_generations=2, max_steps=1, **SHORT,
    )  # fmt: skip
    assert_trained_alike(trained, "rewards/CounterEnv/mean")


def random_rollout(prompts, trainer):
    """A rollout function as TRL documents it: ids of the prompts, sampled completions (the trainer's torch random
    state), their log-probs, an environment mask (a 3-token 'observation' in the middle is not trained on) and an
    extra field the reward function reads."""
    tokenizer = trainer.processing_class
    texts = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in prompts]
    prompt_ids = tokenizer(texts)["input_ids"]
    digits = tokenizer.convert_tokens_to_ids(list("0123456789"))
    completions, masks = [], []
    for _ in prompts:
        length = int(torch.randint(4, 9, ()))
        completions.append([digits[int(i)] for i in torch.randint(0, 10, (length,))] + [tokenizer.eos_token_id])
        masks.append([1, 1, 0, 0, 0] + [1] * (length - 4))
    return {
        "prompt_ids": prompt_ids,
        "completion_ids": completions,
        "logprobs": [[0.0] * len(ids) for ids in completions],
        "env_mask": masks,
        "observed": [len(ids) for ids in completions],
    }


def observed_reward(completions, observed, **kwargs):
    return [float(n % 3) for n in observed]


def test_a_rollout_function_with_an_environment_mask_trains_like_trl(tool_model_dir, tmp_path):
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    trained = both(
        tool_model_dir, tmp_path, train_dataset=Dataset.from_list(number_prompts(8)),
        reward_funcs=[observed_reward], rollout_func=random_rollout, max_steps=1, **SHORT,
    )  # fmt: skip
    (_, batches), _ = trained
    assert all((batch["tool_mask"] == 0).any() for batch in batches)  # the env mask reached the loss mask
    assert_trained_alike(trained)


# ------------------------------------------------------------------------------------------------ the checks


def short_reward(completions, **kwargs):
    return [1.0] * (len(completions) - 1)


@pytest.mark.parametrize(
    ("case", "setup", "trl_error", "our_error", "at_construction"),
    [
        (
            "no prompt column, no environment",
            dict(train_dataset=Dataset.from_dict({"question": ["1", "2"] * 4})),
            KeyError,
            (DatasetError, "has no 'prompt' column"),
            True,
        ),
        pytest.param(
            "a dict of environments, no environment column",
            dict(train_dataset=Dataset.from_dict({"prompt": ["1", "2"] * 4}), environment_factory=environments),
            ValueError,
            (DatasetError, r"no 'environment' column .* one of \['counter', 'echo'\]"),
            True,
            marks=needs_environments,
            id="a dict of environments, no environment column",
        ),
        (
            "a reward function returning too few rewards",
            dict(train_dataset=Dataset.from_list(number_prompts(8)), reward_funcs=[short_reward]),
            ValueError,
            (RewardOutputError, "must return a list of 8 rewards"),
            False,
        ),
    ],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_each_check_fails_exactly_where_trl_fails(tool_model_dir, tmp_path, case, setup, trl_error, our_error,
                                                  at_construction):  # fmt: skip
    """TRL's failure (at its first step) against grpo_plus's (when the trainer is built, or at the same step with a
    clearer message). Where TRL trains, grpo_plus trains: the tests above."""
    setup = {
        "train_dataset": Dataset.from_list(number_prompts(8)),
        **setup,
        "max_steps": 1,
        "max_completion_length": 8,
    }

    def build(package):
        kwargs = {k: v() if k == "environment_factory" else v for k, v in setup.items()}
        return tool_trainer(package, tool_model_dir, tmp_path / package.__name__, **kwargs)

    with pytest.raises(trl_error):
        build(trl).train()
    error_type, match = our_error
    with pytest.raises(error_type, match=match):
        build(grpo_plus).train()  # a construction-time error fires before train
    if at_construction:
        with pytest.raises(error_type):
            build(grpo_plus)


def test_environment_routing_reads_trls_attributes():
    """What TRL 1.14-1.16 keep of `environment_factory`: none, one (every row's prompt may come from `reset()`), or
    a dict (rows routed by their 'environment' column)."""
    from types import SimpleNamespace

    from grpo_plus.compat.model import environment_routing

    assert environment_routing(SimpleNamespace()) == (True, None)
    assert environment_routing(SimpleNamespace(environment_factories=None)) == (True, None)
    single = SimpleNamespace(environment_factories={None: object}, _multi_environment=False)
    assert environment_routing(single) == (False, None)
    routed = SimpleNamespace(environment_factories={"a": object, "b": object}, _multi_environment=True)
    assert environment_routing(routed) == (False, ("a", "b"))
