"""The built-in arithmetic task: deterministic generation, disjoint splits, correct answers, rewards, evaluation."""

from __future__ import annotations

import re

import pytest

from grpo_plus.app import tasks
from grpo_plus.app.tasks import (
    LEVELS,
    correctness_reward,
    format_reward,
    generate_problems,
    get_level,
    make_dataset,
    parse_answer,
)

SMALL_SIZES = {"train": 40, "test": 20}


def solve(question: str) -> int:
    """Answer a generated question from its text alone, independently of the generator."""
    numbers = [int(n) for n in re.findall(r"\d+", question)]
    if any(name in question for name in ("has", "gives", "gets")):  # word problems: one operation, two numbers
        assert len(numbers) == 2, question
        return numbers[0] - numbers[1] if "gives" in question else numbers[0] + numbers[1]
    text = question.replace("plus", "+").replace("minus", "-")
    expression = re.search(r"\d+(?:\s*[-+]\s*\d+)+", text).group(0)
    total, sign = 0, 1
    for token in re.findall(r"\d+|[-+]", expression):
        if token in "+-":
            sign = 1 if token == "+" else -1
        else:
            total += sign * int(token)
    return total


def assistant(text: str) -> list[dict[str, str]]:
    """A conversational completion as TRL passes it to reward functions."""
    return [{"role": "assistant", "content": text}]


# ---------------------------------------------------------------- generation


@pytest.mark.parametrize("level", list(LEVELS))
@pytest.mark.parametrize("split", ["train", "test"])
def test_same_seed_same_dataset(level: str, split: str) -> None:
    first = make_dataset(split, level, SMALL_SIZES[split], seed=3)
    second = make_dataset(split, level, SMALL_SIZES[split], seed=3)
    assert first.to_list() == second.to_list()
    assert make_dataset(split, level, SMALL_SIZES[split], seed=4)["question"] != first["question"]


@pytest.mark.parametrize("level", list(LEVELS))
def test_splits_never_share_arithmetic(level: str) -> None:
    train = generate_problems(level, "train", None, seed=0)
    test = generate_problems(level, "test", None, seed=0)
    assert not {p.expression for p in train} & {p.expression for p in test}
    assert not {p.question for p in train} & {p.question for p in test}


def test_split_is_the_same_across_levels_and_seeds() -> None:
    """A held-out sum stays held out whichever level or seed trains: e.g. add-1d and word-add-1d agree."""
    held_out = {p.expression for p in generate_problems("add-1d", "test", None, seed=0)}
    for seed in range(3):
        train = generate_problems("word-add-1d", "train", 100, seed=seed)
        assert not held_out & {p.expression for p in train}


@pytest.mark.parametrize("level", list(LEVELS))
def test_answers_are_correct(level: str) -> None:
    dataset = make_dataset("train", level, SMALL_SIZES["train"], seed=1)
    for question, answer in zip(dataset["question"], dataset["answer"], strict=True):
        assert isinstance(answer, int)
        assert answer == solve(question), question


@pytest.mark.parametrize("level", list(LEVELS))
def test_dataset_has_trl_columns(level: str) -> None:
    dataset = make_dataset("test", level, 5, seed=0)
    assert {"prompt", "answer", "level"} <= set(dataset.column_names)
    assert len(dataset) == 5 and set(dataset["level"]) == {level}
    for prompt, question in zip(dataset["prompt"], dataset["question"], strict=True):
        assert prompt[-1]["role"] == "user"
        assert prompt[-1]["content"] == f"{question}\n{tasks.INSTRUCTION}"


def test_questions_are_unique_within_a_split() -> None:
    questions = make_dataset("train", "add-1d", 150, seed=0)["question"]
    assert len(set(questions)) == len(questions)


def test_system_prompt_is_optional() -> None:
    prompt = make_dataset("test", "add-1d", 1, system_prompt="Be brief.")["prompt"][0]
    assert prompt[0] == {"role": "system", "content": "Be brief."} and prompt[1]["role"] == "user"


def test_default_size_is_capped_by_a_small_pool_but_an_explicit_one_is_not() -> None:
    pool = len(make_dataset("test", "sub-1d"))  # 16 held-out differences x 3 phrasings
    assert 0 < pool < tasks.DEFAULT_SIZES["test"]
    with pytest.raises(ValueError, match=f"only {pool} distinct test problems"):
        make_dataset("test", "sub-1d", size=pool + 1)


def test_levels_by_name_position_and_string_digit() -> None:
    names = list(LEVELS)
    assert get_level(1).name == names[0] == tasks.DEMO_LEVEL
    assert get_level("3").name == names[2]
    assert get_level(" Word-Mixed ").name == "word-mixed"
    assert tasks.BENCHMARK_LEVEL in LEVELS


@pytest.mark.parametrize("bad", [0, len(LEVELS) + 1, "add-9d", True])
def test_unknown_level_lists_the_levels(bad: object) -> None:
    with pytest.raises(ValueError, match="add-1d"):
        get_level(bad)


def test_split_aliases_and_bad_split() -> None:
    assert make_dataset("eval", "add-1d", 3)["question"] == make_dataset("test", "add-1d", 3)["question"]
    with pytest.raises(ValueError, match="'train' or 'test'"):
        make_dataset("dev", "add-1d", 3)


# ---------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("7", 7),
        ("The answer is 7.", 7),
        ("3 + 4 = 7", 7),
        ("-5", -5),
        ("3 - 5 = -2", -2),
        ("9-4", 4),  # a binary minus is not a sign
        ("1,234", 1234),
        ("It is 1,234,567.", 1234567),
        ("3,4", 4),  # not a thousands group: two numbers
        ("The answer is **12**.", 12),
        ("7.0", 7),
        ("7.5", None),
        ("no numbers here", None),
        ("", None),
        (None, None),
        (12, None),
    ],
)
def test_parse_answer(text: object, expected: int | None) -> None:
    assert parse_answer(text) == expected


# ---------------------------------------------------------------- rewards


def test_correctness_reward_scores_the_last_number() -> None:
    completions = [
        assistant("The answer is 7."),
        assistant("The answer is 8."),
        assistant("3 + 4 = 7"),  # the model restates the question: the first number is not the answer
        assistant("7 apples? No wait, 3 + 4 = 9"),
        assistant("banana"),
        assistant(""),
        [],
        None,
    ]
    assert correctness_reward(completions, answer=[7] * len(completions)) == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_correctness_reward_accepts_plain_strings_and_string_answers() -> None:
    assert correctness_reward(["3 + 4 = 7", "12", "-3"], answer=["7", 12, -3]) == [1.0, 1.0, 1.0]
    assert correctness_reward(["7"], answer=[None]) == [0.0]


def test_format_reward_gives_partial_credit() -> None:
    completions = [
        "7",
        "The answer is 7.",
        "3 + 4 = 7\nThe answer is 7.",
        "the answer is: **7**",
        "3 + 4 = 7",  # short and ends in a number: half credit, room to rise
        "Here is the calculation: 3 + 4:",  # ends in a colon, not an answer
        "To add 3 and 4 you put three things next to four things and count them all which gives 7",  # too long
        "The answer is N.",
        "",
        None,
        42,
    ]
    # Full credit needs the calculation and the answer line; the answer alone is a guess and gets half.
    expected = [0.5, 0.5, 1.0, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert format_reward([assistant(c) if isinstance(c, str) else c for c in completions]) == expected
    assert format_reward(completions) == expected


def test_rewards_take_trl_keyword_arguments() -> None:
    """TRL passes prompts, completion ids, every extra dataset column and its own hooks as keywords."""
    dataset = make_dataset("train", "add-1d", 2)
    completions = [assistant(f"The answer is {a}.") for a in dataset["answer"]]
    kwargs = {
        "prompts": dataset["prompt"],
        "completion_ids": [[1, 2], [3]],
        "answer": dataset["answer"],
        "level": dataset["level"],
        "question": dataset["question"],
        "trainer_state": None,
        "log_extra": lambda *a, **k: None,
        "log_metric": lambda *a, **k: None,
    }
    assert correctness_reward(completions=completions, **kwargs) == [1.0, 1.0]
    assert format_reward(completions=completions, **kwargs) == [0.5, 0.5]


def test_content_parts_are_read() -> None:
    completion = [{"role": "assistant", "content": [{"type": "text", "text": "The answer is 5."}]}]
    assert correctness_reward([completion], answer=[5]) == [1.0]


# ---------------------------------------------------------------- evaluation


class EchoModel:
    """Stands in for a causal LM: "generates" the text registered for each prompt, padded like HF does."""

    def __init__(self, tokenizer, replies: dict[str, str]) -> None:
        import torch

        self.tokenizer, self.replies, self.training, self.device = tokenizer, replies, True, torch.device("cpu")
        self.calls: list[dict] = []

    def eval(self) -> None:
        self.training = False

    def train(self, mode: bool = True) -> None:
        self.training = mode

    def generate(self, input_ids, attention_mask, max_new_tokens, do_sample, pad_token_id):
        import torch

        self.calls.append({"padding_side": self.tokenizer.padding_side, "do_sample": do_sample})
        prompts = self.tokenizer.batch_decode(input_ids, skip_special_tokens=True)
        replies = [next(r for q, r in self.replies.items() if q in p) for p in prompts]
        new = [self.tokenizer(r, add_special_tokens=False)["input_ids"][:max_new_tokens] for r in replies]
        width = max(map(len, new))
        new = [ids + [pad_token_id] * (width - len(ids)) for ids in new]
        return torch.cat([input_ids, torch.tensor(new)], dim=1)


def test_evaluate_scores_greedy_replies_in_batches() -> None:
    from helpers.models import make_tokenizer

    tokenizer = make_tokenizer()
    dataset = make_dataset("test", "add-1d", 5, seed=0)
    questions, answers = dataset["question"], dataset["answer"]
    replies = {
        questions[0]: f"2 + 3 = {answers[0]}\nThe answer is {answers[0]}.",  # right, formatted
        questions[1]: f"x = {answers[1]}",  # right, half format
        questions[2]: f"The answer is {answers[2] + 1}.",  # wrong, formatted
        questions[3]: "no idea",
        questions[4]: str(answers[4]),  # right, bare number
    }
    model = EchoModel(tokenizer, replies)
    result = tasks.evaluate(
        model, tokenizer, dataset, batch_size=2, max_new_tokens=32, progress=False, return_completions=True
    )
    assert result["accuracy"] == pytest.approx(3 / 5)
    assert result["format_rate"] == pytest.approx(1 / 5)
    assert result["format_reward"] == pytest.approx(2.5 / 5)
    assert result["n"] == 5 and len(result["completions"]) == 5
    assert len(model.calls) == 3 and all(c == {"padding_side": "left", "do_sample": False} for c in model.calls)
    assert tokenizer.padding_side == "right" and model.training  # restored


def test_evaluate_runs_a_real_tiny_model() -> None:
    from helpers.models import make_model, make_tokenizer

    tokenizer = make_tokenizer()
    model = make_model(tokenizer)
    dataset = make_dataset("test", "add-1d", 3)
    result = tasks.evaluate(model, tokenizer, dataset, max_new_tokens=4, progress=False)
    assert set(result) == {"accuracy", "format_rate", "format_reward", "n"} and result["n"] == 3
    # its figures score model.generate's own greedy replies (zero_waste=False) with the task's reward functions
    plain = tasks.evaluate(
        model, tokenizer, dataset, max_new_tokens=4, progress=False, zero_waste=False, return_completions=True
    )
    assert len(plain["completions"]) == 3 and all(plain["completions"])
    assert result["accuracy"] == sum(tasks.correctness_reward(plain["completions"], dataset["answer"])) / 3
    assert result["format_reward"] == pytest.approx(sum(tasks.format_reward(plain["completions"])) / 3)


def test_evaluate_rejects_an_empty_dataset() -> None:
    from helpers.models import make_model, make_tokenizer

    tokenizer = make_tokenizer()
    with pytest.raises(ValueError, match="empty"):
        tasks.evaluate(make_model(tokenizer), tokenizer, make_dataset("test", "add-1d", 0), progress=False)


def test_evaluate_generates_model_generates_replies_with_fewer_positions() -> None:
    """Held-out evaluation through grpo_plus's generation: the same greedy replies as `model.generate`, and the
    replies that ended early are not decoded further."""
    import torch
    from helpers.models import make_model, make_tokenizer
    from helpers.probes import ForwardLog

    from grpo_plus.compat.versions import version_gap

    tokenizer = make_tokenizer()
    model = make_model(tokenizer, seed=3)
    dataset = make_dataset("test", "add-1d", 8)
    # A random model never picks EOS: make EOS win wherever the first reply's character at the first column where
    # the replies differ would win (ties go to the lower id), so replies end at different lengths.
    replies = tasks.evaluate(model, tokenizer, dataset, max_new_tokens=12, progress=False, return_completions=True)
    replies = replies["completions"]
    column = next(i for i, chars in enumerate(zip(*replies, strict=False)) if len(set(chars)) > 1)
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id] = model.lm_head.weight[
            tokenizer.convert_tokens_to_ids(replies[0][column])
        ]
    forwards = ForwardLog(model)
    results = {}
    for zero_waste in (False, True):
        forwards.clear()
        result = tasks.evaluate(
            model,
            tokenizer,
            dataset,
            max_new_tokens=12,
            progress=False,
            return_completions=True,
            zero_waste=zero_waste,
        )
        results[zero_waste] = (result["completions"], forwards.positions)
    (plain, plain_positions), (ours, our_positions) = results[False], results[True]
    assert ours == plain
    assert len({len(tokenizer(reply)["input_ids"]) for reply in plain}) > 1, "every reply ran to the token limit"
    if version_gap("zero_waste_generation") is None:
        assert our_positions < plain_positions
