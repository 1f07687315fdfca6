"""Built-in verifiable task: procedurally generated arithmetic (word) problems, with TRL reward functions.

`make_dataset(split, level, size, seed)` returns a `datasets.Dataset` whose "prompt" column is conversational
(what `trl.GRPOTrainer` expects) and whose "answer" column holds the integer answer, which TRL hands to
`correctness_reward` as a keyword argument. Generation is seeded and deterministic. Train and held-out
("test") problems never share their arithmetic: a stable hash of the expression ("3+4") decides the split,
the same way in every level, so a model trained on any level never sees a held-out sum. `correctness_reward`
scores the last number of the reply and `format_reward` gives partial credit; why, and how hard each level is
for the embedded SmolLM2-135M-Instruct: docs/notes.md.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..rewards.verifiers import NUMBER

ANSWER_PREFIX = "The answer is"
INSTRUCTION = f'Show the calculation, then end your reply with "{ANSWER_PREFIX} <number>."'
# None keeps the model's own default system prompt (SmolLM2's chat template adds one).
SYSTEM_PROMPT: str | None = None

DEMO_LEVEL = "add-1d"
BENCHMARK_LEVEL = "word-mixed"
SPLITS = ("train", "test")
_SPLIT_ALIASES = {"heldout": "test", "held-out": "test", "eval": "test", "validation": "test"}
HELD_OUT_PERCENT = 25
DEFAULT_SIZES = {"train": 256, "test": 64}
# Consecutive rejected draws after which a split's pool of distinct questions counts as exhausted.
_MAX_MISSES = 20_000

# A number as the model writes it (the verifiers' reading: a sign only when it is not a binary minus, thousands commas,
# decimals; a sentence's final period is not a decimal point).
_NUMBER = NUMBER
_BARE_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?\.?")
# "3 + 4 = 7", "12 - 5 = 7", "2 + 3 + 4 = 9": numbers joined by operators, then "=" and a number.
_CALCULATION = re.compile(r"\d\s*(?:[-+*/×−]\s*\d[\d,]*\s*)+=\s*-?\d")
_ANSWER_LINE = re.compile(
    re.escape(ANSWER_PREFIX) + r":?\s*\**\s*-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?\s*\**\s*\.?$", re.IGNORECASE
)
SHORT_REPLY_WORDS = 12


@dataclass(frozen=True)
class Problem:
    """One generated problem: the question, its integer answer and the arithmetic it encodes ("3+4")."""

    question: str
    answer: int
    expression: str


@dataclass(frozen=True)
class Level:
    """A difficulty tier: its name, what it contains, and a sampler of problems."""

    name: str
    description: str
    sample: Callable[[random.Random], Problem]


# ---------------------------------------------------------------- problem samplers

_NAMES = ("Tom", "Anna", "Ben", "Mia", "Sam", "Lily", "Max", "Emma", "Leo", "Zoe")
_ITEMS = ("apples", "books", "marbles", "pencils", "stickers", "cookies", "coins", "cards", "shells", "toys")
_SUM_TEMPLATES = ("What is {a} + {b}?", "Calculate {a} + {b}.", "What is {a} plus {b}?")
_DIFFERENCE_TEMPLATES = ("What is {a} - {b}?", "Calculate {a} - {b}.", "What is {a} minus {b}?")
_WORD_SUM_TEMPLATES = (
    "{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?",
    "{name} has {a} red {item} and {b} blue {item}. How many {item} does {name} have in total?",
)
_WORD_DIFFERENCE_TEMPLATE = "{name} has {a} {item} and gives {b} away. How many {item} does {name} have left?"


def _sum(a: int, b: int, rng: random.Random) -> Problem:
    """a + b in one of the plain phrasings."""
    return Problem(rng.choice(_SUM_TEMPLATES).format(a=a, b=b), a + b, f"{a}+{b}")


def _sample_add_1d(rng: random.Random) -> Problem:
    """a + b, a and b in 1..9."""
    return _sum(rng.randint(1, 9), rng.randint(1, 9), rng)


def _sample_sub_1d(rng: random.Random) -> Problem:
    """a - b with 1 <= b < a <= 9 (positive answers)."""
    a = rng.randint(2, 9)
    b = rng.randint(1, a - 1)
    return Problem(rng.choice(_DIFFERENCE_TEMPLATES).format(a=a, b=b), a - b, f"{a}-{b}")


def _sample_add_3_1d(rng: random.Random) -> Problem:
    """a + b + c, all in 1..9."""
    a, b, c = (rng.randint(1, 9) for _ in range(3))
    text = rng.choice(("What is {a} + {b} + {c}?", "Calculate {a} + {b} + {c}."))
    return Problem(text.format(a=a, b=b, c=c), a + b + c, f"{a}+{b}+{c}")


def _sample_add_2d(rng: random.Random) -> Problem:
    """a + b, a and b in 10..99."""
    return _sum(rng.randint(10, 99), rng.randint(10, 99), rng)


def _sample_add_sub_1d(rng: random.Random) -> Problem:
    """a + b - c, all in 1..9, answer >= 0."""
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    c = rng.randint(1, min(9, a + b))
    text = rng.choice(("What is {a} + {b} - {c}?", "Calculate {a} + {b} - {c}."))
    return Problem(text.format(a=a, b=b, c=c), a + b - c, f"{a}+{b}-{c}")


def _word_sum(a: int, b: int, rng: random.Random) -> Problem:
    """A story about getting more of something."""
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    return Problem(rng.choice(_WORD_SUM_TEMPLATES).format(name=name, item=item, a=a, b=b), a + b, f"{a}+{b}")


def _sample_word_add_1d(rng: random.Random) -> Problem:
    """Word problem: a + b, a and b in 1..9."""
    return _word_sum(rng.randint(1, 9), rng.randint(1, 9), rng)


def _sample_word_mixed(rng: random.Random) -> Problem:
    """Word problem: a + b or a - b with numbers up to 20 (answers >= 1)."""
    if rng.random() < 0.5:
        return _word_sum(rng.randint(2, 20), rng.randint(1, 20), rng)
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a = rng.randint(2, 20)
    b = rng.randint(1, a - 1)
    return Problem(_WORD_DIFFERENCE_TEMPLATE.format(name=name, item=item, a=a, b=b), a - b, f"{a}-{b}")


# Ordered from easiest to hardest for the embedded model (see the table above); ints index this order from 1.
LEVELS: dict[str, Level] = {
    level.name: level
    for level in (
        Level("add-1d", "a + b with a, b in 1..9", _sample_add_1d),
        Level("word-add-1d", "word problems adding two numbers in 1..9", _sample_word_add_1d),
        Level("sub-1d", "a - b with 1 <= b < a <= 9", _sample_sub_1d),
        Level("word-mixed", "word problems adding or subtracting numbers up to 20", _sample_word_mixed),
        Level("add-3-1d", "a + b + c with a, b, c in 1..9", _sample_add_3_1d),
        Level("add-2d", "a + b with a, b in 10..99", _sample_add_2d),
        Level("add-sub-1d", "a + b - c with a, b, c in 1..9", _sample_add_sub_1d),
    )
}


def get_level(level: str | int) -> Level:
    """Look a level up by name or by its 1-based position in LEVELS."""
    names = list(LEVELS)
    if isinstance(level, int) and not isinstance(level, bool):
        if 1 <= level <= len(names):
            return LEVELS[names[level - 1]]
        raise ValueError(f"Level {level} is out of range 1..{len(names)}; levels: {', '.join(names)}.")
    if isinstance(level, str):
        key = level.strip().lower()
        if key in LEVELS:
            return LEVELS[key]
        if key.isdigit():
            return get_level(int(key))  # "3" from a command line
    raise ValueError(f"Unknown level {level!r}; levels: {', '.join(names)} (or 1..{len(names)}).")


def normalize_split(split: str) -> str:
    """Map a split name (or an alias such as "eval") to "train" or "test"."""
    key = str(split).strip().lower()
    key = _SPLIT_ALIASES.get(key, key)
    if key not in SPLITS:
        raise ValueError(f"Unknown split {split!r}; use 'train' or 'test' (aliases: {', '.join(_SPLIT_ALIASES)}).")
    return key


def split_of(expression: str) -> str:
    """The split an arithmetic expression belongs to, by a stable hash (not Python's salted hash())."""
    bucket = int(hashlib.sha256(expression.encode()).hexdigest(), 16) % 100
    return "test" if bucket < HELD_OUT_PERCENT else "train"


def format_prompt(question: str, system_prompt: str | None = SYSTEM_PROMPT) -> list[dict[str, str]]:
    """The conversational prompt for one question: optional system message, then question + instruction."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return messages + [{"role": "user", "content": f"{question}\n{INSTRUCTION}"}]


def generate_problems(level: str | int, split: str, size: int | None = None, seed: int = 0) -> list[Problem]:
    """`size` distinct problems of `level` in `split` (None: as many as DEFAULT_SIZES allows the pool)."""
    lvl, split = get_level(level), normalize_split(split)
    target = DEFAULT_SIZES[split] if size is None else size
    if target < 0:
        raise ValueError(f"size must be >= 0, got {size}.")
    # A string seed is hashed with SHA-512 by `random`, so this is reproducible across processes and platforms.
    rng = random.Random(f"{lvl.name}:{split}:{seed}")
    seen: set[str] = set()
    problems: list[Problem] = []
    misses = 0
    while len(problems) < target and misses < _MAX_MISSES:
        problem = lvl.sample(rng)
        if problem.question in seen or split_of(problem.expression) != split:
            misses += 1
            continue
        misses = 0
        seen.add(problem.question)
        problems.append(problem)
    if size is not None and len(problems) < size:
        raise ValueError(
            f"Level {lvl.name!r} has only {len(problems)} distinct {split} problems; asked for {size}. "
            "Ask for fewer (training reuses prompts across epochs anyway) or pick a larger level."
        )
    return problems


def make_dataset(
    split: str = "train",
    level: str | int = DEMO_LEVEL,
    size: int | None = None,
    seed: int = 0,
    system_prompt: str | None = SYSTEM_PROMPT,
):
    """A `datasets.Dataset` of problems with "prompt" (conversational), "answer" (int), "level", "question"."""
    from datasets import Dataset

    lvl = get_level(level)
    problems = generate_problems(lvl.name, split, size, seed)
    return Dataset.from_dict(
        {
            "prompt": [format_prompt(p.question, system_prompt) for p in problems],
            "answer": [p.answer for p in problems],
            "level": [lvl.name] * len(problems),
            "question": [p.question for p in problems],
        }
    )


# ---------------------------------------------------------------- parsing and rewards


def completion_text(completion: Any) -> str:
    """The text of one completion: a string, a message dict, or a list of messages / content parts."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        # A message {"role", "content"} or a content part {"type": "text", "text"}.
        return completion_text(completion.get("content", completion.get("text")))
    if isinstance(completion, Sequence) and not isinstance(completion, (bytes, bytearray)):
        return "".join(completion_text(part) for part in completion)
    return ""  # None or anything else: scored as an empty reply, never an exception mid-training


def parse_answer(text: str) -> int | None:
    """The last number in `text` as an int; None if there is none or it is not a whole number."""
    if not isinstance(text, str):
        return None
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    value = float(matches[-1].replace(",", ""))
    return int(value) if value.is_integer() else None


def format_score(text: str) -> float:
    """1.0: the calculation, then "The answer is N." (what the prompt asks for); 0.5: the answer line alone, a bare
    number, or a short reply ending in a number; else 0.

    Full credit needs the working: paying 1.0 for "The answer is N." alone taught the demo model to drop the
    calculation and guess (held-out accuracy fell 0.56 -> 0.46 while the format rate went to 1.0).
    """
    text = text.strip() if isinstance(text, str) else ""
    if not text:
        return 0.0
    if _ANSWER_LINE.search(text):
        return 1.0 if _CALCULATION.search(text) else 0.5
    if _BARE_NUMBER.fullmatch(text):
        return 0.5
    words = text.split()
    if len(words) <= SHORT_REPLY_WORDS and _BARE_NUMBER.fullmatch(words[-1].rstrip("!")):
        return 0.5
    return 0.0


def _matches(text: str, answer: Any) -> bool:
    """True if the last number of `text` equals `answer` (an int or an int-like string)."""
    try:
        expected = int(str(answer).strip().replace(",", ""))
    except (TypeError, ValueError):
        return False
    return parse_answer(text) == expected


def correctness_reward(completions: list[Any], answer: Iterable[Any], **kwargs: Any) -> list[float]:
    """TRL reward function: 1.0 when the last number of the reply equals the answer, else 0.0."""
    return [float(_matches(completion_text(c), a)) for c, a in zip(completions, answer, strict=True)]


def format_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """TRL reward function: the answer-format score of each reply (see `format_score`)."""
    return [format_score(completion_text(c)) for c in completions]


# ---------------------------------------------------------------- held-out evaluation


def evaluate(
    model: Any,
    tokenizer: Any,
    dataset: Any,
    batch_size: int = 16,
    max_new_tokens: int = 24,
    progress: bool = True,
    return_completions: bool = False,
    zero_waste: bool = True,
    correctness: Callable[..., list] | None = None,
    format: Callable[..., list] | None = None,
) -> dict[str, Any]:
    """Greedy accuracy and format rate of `model` on `dataset` (a "prompt" column and what the rewards read), in
    batches.

    `correctness` / `format`: TRL reward functions scoring the replies (default: this task's `correctness_reward` on
    the "answer" column and `format_reward`); they get the dataset's other columns as keywords, as in training, and
    replies to chat prompts as [{"role": "assistant", "content": ...}]. Accuracy: the share of replies `correctness`
    gives full marks (1.0) among those it scores (None: unscorable, left out). `zero_waste`: replies that ended leave
    the decode batch (grpo_plus.zero_waste.generation; the same replies as `model.generate`, which runs when it is False or the
    model is not a transformers model)."""
    from tqdm.auto import tqdm

    correctness, format = correctness or correctness_reward, format or format_reward
    prompts = list(dataset["prompt"])
    columns = {name: list(dataset[name]) for name in dataset.column_names if name != "prompt"}
    if not prompts:
        raise ValueError("evaluate() got an empty dataset.")
    completions: list[str] = []
    was_training, padding_side, pad_token = model.training, tokenizer.padding_side, tokenizer.pad_token
    # Decoder-only generation needs left padding so every prompt ends where generation starts.
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.eval()
    try:
        starts = range(0, len(prompts), batch_size)
        for start in tqdm(starts, desc="Evaluating", unit="batch", disable=not progress):
            batch = prompts[start : start + batch_size]
            completions += _generate_greedy(model, tokenizer, batch, max_new_tokens, zero_waste)
    finally:
        model.train(was_training)
        tokenizer.padding_side, tokenizer.pad_token = padding_side, pad_token
    replies = (
        completions if isinstance(prompts[0], str) else [[{"role": "assistant", "content": c}] for c in completions]
    )
    correct = [score for score in correctness(completions=replies, **columns) if score is not None]
    formats = format(completions=replies, **columns)
    result: dict[str, Any] = {
        "accuracy": sum(score == 1.0 for score in correct) / max(1, len(correct)),
        "format_rate": sum(f == 1.0 for f in formats) / len(formats),
        "format_reward": sum(formats) / len(formats),
        "n": len(correct),
    }
    if return_completions:
        result["completions"] = completions
    return result


def _generate_greedy(
    model: Any, tokenizer: Any, prompts: list[Any], max_new_tokens: int, zero_waste: bool
) -> list[str]:
    """Greedy replies to a batch of conversational (or plain-text) prompts."""
    import torch

    from ..zero_waste.generation import generate

    if isinstance(prompts[0], str):
        texts = prompts
    else:
        texts = tokenizer.apply_chat_template(prompts, add_generation_prompt=True, tokenize=False)
    # The chat template already wrote any BOS token; adding special tokens again would double it.
    encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    settings = dict(**encoded, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    with torch.inference_mode():
        output = generate(model, **settings)[0] if zero_waste else model.generate(**settings)
    new_tokens = output[:, encoded["input_ids"].shape[1] :]
    return tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
