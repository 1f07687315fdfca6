"""Real tasks for the recipes: GSM8K- and MATH-format data (local files or a hub id) and reasoning-gym's procedurally
generated tasks, each with its own verifier as the reward and a held-out split.

The format of a dataset is read from its columns (`data_format`); the recipes' "correctness" and "format" rewards are
the format's verifier and format reward (`task_rewards`), and the held-out evaluation scores with the same verifier:

    format          columns                                    correctness (grpo_plus.rewards)   format
    TRL's           prompt (+ answer: an integer)              the built-in last-number check    the built-in one
    GSM8K           question, answer ending "#### <number>"    gsm8k_accuracy_reward             gsm8k_format_reward
    MATH            problem, solution with \\boxed{}             accuracy_reward (math-verify)     boxed_format_reward
    reasoning-gym   generated: --dataset_name reasoning-gym:<task>   reasoning_gym_reward (its score_answer)
                                                                                                 answer_format_reward
A `prompt` column is kept as is: a TRL-format dataset whose `answer` ends in "#### N" is scored as GSM8K, one with a
`solution` and no `answer` as MATH. GSM8K and MATH rows get a chat prompt: the question and an instruction asking for
the answer the verifier reads. reasoning-gym tasks are generated here by the `reasoning-gym` package (nothing is
downloaded); train and held-out questions never overlap (a stable hash of the question decides the split).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..rewards import verifiers
from . import tasks

REASONING_GYM_PREFIX = "reasoning-gym:"
TASKS_EXTRA = 'pip install "grpo-plus[tasks]"'
GSM8K_INSTRUCTION = 'Solve the problem step by step, then end your reply with "#### <number>".'
MATH_INSTRUCTION = "Solve the problem step by step, then put your final answer within \\boxed{}."
REASONING_GYM_INSTRUCTION = "Give your final answer as <answer>X</answer>."
# Local files load_dataset reads by their suffix (a folder of them, or a hub id, goes to load_dataset as is).
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
# Held out of a GSM8K / MATH dataset that has no test split, when --task_eval_size does not say.
DEFAULT_HELD_OUT = 64


@dataclasses.dataclass(frozen=True)
class DataFormat:
    """A dataset format the recipes read: its name, what its prompt comes from, its verifier and format reward."""

    name: str
    prompt_column: str | None
    instruction: str | None
    correctness: Callable[..., list]
    format: Callable[..., list]


FORMATS: dict[str, DataFormat] = {
    fmt.name: fmt
    for fmt in (
        DataFormat("trl", "prompt", None, tasks.correctness_reward, tasks.format_reward),
        DataFormat(
            "gsm8k", "question", GSM8K_INSTRUCTION, verifiers.gsm8k_accuracy_reward, verifiers.gsm8k_format_reward
        ),
        DataFormat("math", "problem", MATH_INSTRUCTION, verifiers.accuracy_reward, verifiers.boxed_format_reward),
        DataFormat(
            "reasoning-gym",
            "question",
            REASONING_GYM_INSTRUCTION,
            verifiers.reasoning_gym_reward,
            verifiers.answer_format_reward,
        ),
    )
}
ACCEPTED_FORMATS = (
    "TRL's (a 'prompt' column: a string or chat messages), GSM8K's ('question' and 'answer' ending in "
    "'#### <number>'), MATH's ('problem' and 'solution' with \\boxed{...}); or --dataset_name "
    f"{REASONING_GYM_PREFIX}<task> for a generated reasoning-gym task"
)


# ---- formats ----------------------------------------------------------------------------------------------------


def data_format(dataset: Any, name: str = "dataset") -> DataFormat:
    """The format of `dataset`, read from its columns (see the module's table); ValueError naming the columns found
    and the formats accepted when it is in none."""
    columns = list(dataset.column_names)
    present = set(columns)
    if "reasoning_gym" in present:
        return FORMATS["reasoning-gym"]
    first_answer = _first_value(dataset, "answer") if "answer" in present else None
    if isinstance(first_answer, str) and "####" in first_answer and present & {"prompt", "question"}:
        return FORMATS["gsm8k"]
    if "solution" in present and ("problem" in present or ("prompt" in present and "answer" not in present)):
        return FORMATS["math"]
    if "prompt" in present:
        return FORMATS["trl"]
    hint = ""
    if {"question", "answer"} <= present:
        hint = f" Its 'answer' column does not end in '#### <number>' as GSM8K's does (first row: {first_answer!r})."
    raise ValueError(
        f"{name} has no 'prompt' column and is in no other format the recipes read (columns: {columns}).{hint} "
        f"Formats read: {ACCEPTED_FORMATS}."
    )


def _first_value(dataset: Any, column: str) -> Any:
    """The column's first value (None for an empty dataset)."""
    return dataset[0][column] if len(dataset) else None


def task_rewards(dataset: Any) -> tuple[Callable[..., list], Callable[..., list]]:
    """(correctness, format): the verifier and format reward of the dataset's format, what the recipes' reward names
    "correctness" and "format" stand for."""
    fmt = data_format(dataset)
    return fmt.correctness, fmt.format


def evaluation_rewards(dataset: Any) -> tuple[Callable[..., list], Callable[..., list]] | None:
    """The rewards a held-out evaluation scores `dataset` with; None when it cannot be scored (TRL's format without
    an 'answer' column)."""
    try:
        fmt = data_format(dataset)
    except ValueError:
        return None
    if fmt.name == "trl" and "answer" not in dataset.column_names:
        return None
    return fmt.correctness, fmt.format


def with_prompts(dataset: Any, fmt: DataFormat) -> Any:
    """`dataset` with a conversational 'prompt' column (the question and the format's instruction), unless it has one;
    every other column is kept (the verifiers read them)."""
    if "prompt" in dataset.column_names:
        return dataset
    source, instruction = fmt.prompt_column, fmt.instruction

    def add_prompt(row: dict[str, Any]) -> dict[str, Any]:
        return {"prompt": [{"role": "user", "content": f"{row[source]}\n{instruction}"}]}

    return dataset.map(add_prompt, keep_in_memory=True)


# ---- files and hub datasets ---------------------------------------------------------------------------------------


def load_dataset_dict(name: str, config: str | None):
    """`datasets.load_dataset` on a hub id, a local folder, or one local file (.json, .jsonl, .parquet, .csv: its
    rows are the train split); ValueError with the reason."""
    from datasets import DatasetDict, load_dataset

    path = Path(name).expanduser()
    try:
        if path.is_file():
            builder = FILE_BUILDERS.get(path.suffix.lower())
            if builder is None:
                raise ValueError(
                    f"cannot load dataset {name!r}: a {path.suffix or 'suffix-less'} file is none of the file types "
                    f"read ({', '.join(FILE_BUILDERS)}); or pass the folder holding the files, or a hub id."
                )
            return load_dataset(builder, data_files={"train": str(path)})
        loaded = load_dataset(name, config)
    except ValueError as error:
        if str(error).startswith("cannot load dataset"):
            raise
        raise ValueError(f"cannot load dataset {name!r}: {error}") from error
    except Exception as error:  # datasets raises many types, and a bare StopIteration for an empty JSON Lines file
        reason = str(error) or f"{type(error).__name__} (is a data file empty?)"
        raise ValueError(f"cannot load dataset {name!r}: {reason}") from error
    return loaded if isinstance(loaded, DatasetDict) else DatasetDict({"train": loaded})


def held_out_split(loaded, test_split: str | None, eval_size: int | None, seed: int) -> tuple[Any, Any, str]:
    """(train rows, held-out rows, where the held-out rows came from) for a GSM8K / MATH dataset: --dataset_test_split
    if given, else its 'test' split, else `eval_size` (default DEFAULT_HELD_OUT, at most a quarter) of its train rows,
    drawn with `seed` and removed from training."""
    train = loaded["train"]
    if test_split is not None:
        return train, loaded[test_split], f"split {test_split!r}"
    if "test" in loaded:
        return train, loaded["test"], "split 'test'"
    size = min(eval_size if eval_size is not None else DEFAULT_HELD_OUT, len(train) // 4)
    if size < 1:
        return train, None, "none (too few rows to hold any out)"
    parts = train.train_test_split(test_size=size, seed=seed)
    return parts["train"], parts["test"], f"{size} train rows held out (seed {seed})"


# ---- reasoning-gym ------------------------------------------------------------------------------------------------


def is_reasoning_gym(name: str | None) -> bool:
    """True for --dataset_name reasoning-gym:<task>."""
    return isinstance(name, str) and name.startswith(REASONING_GYM_PREFIX)


def reasoning_gym_task(name: str) -> str:
    """The task of a `reasoning-gym:<task>` name, checked to exist; ValueError listing a few allowed names."""
    task = name[len(REASONING_GYM_PREFIX) :].strip()
    names = sorted(_reasoning_gym_registry())
    if task not in names:
        close = difflib.get_close_matches(task, names, n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        examples = ", ".join(
            n for n in ("basic_arithmetic", "chain_sum", "gcd", "leg_counting", "products") if n in names
        )
        raise ValueError(
            f"--dataset_name {name}: reasoning-gym has no task {task!r}.{hint} Its tasks include {examples} "
            f'({len(names)} in all: `python -c "import reasoning_gym.factory as f; print(sorted(f.DATASETS))"`).'
        )
    return task


def _reasoning_gym_registry() -> dict[str, tuple]:
    """reasoning-gym's task registry (task name -> (dataset class, config class))."""
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError as error:
        raise ValueError(f"reasoning-gym tasks need the reasoning-gym package: {TASKS_EXTRA}.") from error
    return DATASETS


def reasoning_gym_config(task: str, text: str | None) -> dict[str, Any]:
    """--dataset_config for a reasoning-gym task: "field=value,field=value" over the task's config fields (values are
    Python literals, else strings); ValueError naming the fields allowed. Its seed and size come from --task_seed
    and the sizes."""
    fields = {field.name: field for field in dataclasses.fields(_reasoning_gym_registry()[task][1])}
    allowed = [name for name in fields if name not in ("seed", "size")]
    overrides: dict[str, Any] = {}
    for item in [part.strip() for part in (text or "").split(",") if part.strip()]:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in allowed:
            what = f"{key!r} is not a field of its config" if sep else f"{item!r} is not field=value"
            if key in ("seed", "size"):
                what = f"{key!r} comes from --task_seed / --task_train_size / --task_eval_size"
            raise ValueError(
                f"--dataset_config for reasoning-gym:{task}: {what}. Its fields: {', '.join(allowed)} "
                '(e.g. --dataset_config "' + ",".join(f"{n}={fields[n].default!r}" for n in allowed[:2]) + '").'
            )
        overrides[key] = _literal(value.strip())
    return overrides


def _literal(text: str) -> Any:
    """A Python literal ("2", "True", "('+', '-')"), else the text itself."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def reasoning_gym_datasets(
    name: str, config_text: str | None, train_size: int | None, eval_size: int | None, seed: int
) -> tuple[Any, Any]:
    """(train, held-out) `datasets.Dataset`s of a reasoning-gym task, generated locally: conversational 'prompt',
    'question', 'answer' (the task's oracle answer, a string) and 'reasoning_gym' (JSON naming the entry, what
    `grpo_plus.rewards.reasoning_gym_reward` scores with). Items are drawn in index order from one dataset seeded
    with `seed`; a question goes to the held-out side when its stable hash says so (tasks.split_of), and held-out
    questions are distinct. Training questions may repeat when the task has fewer distinct ones than asked for."""
    from datasets import Dataset

    task = reasoning_gym_task(name)
    overrides = reasoning_gym_config(task, config_text)
    n_train = tasks.DEFAULT_SIZES["train"] if train_size is None else train_size
    n_test = tasks.DEFAULT_SIZES["test"] if eval_size is None else eval_size
    if n_train < 1 or n_test < 0:
        raise ValueError(f"reasoning-gym:{task}: --task_train_size must be >= 1 and --task_eval_size >= 0.")
    config = {**overrides, "seed": seed, "size": 10 * (n_train + n_test) + 1000}
    dataset = _reasoning_gym_dataset(task, config)
    rows: dict[str, list[dict[str, Any]]] = {"train": [], "test": []}
    seen_test: set[str] = set()
    for index in range(config["size"]):
        if len(rows["train"]) >= n_train and len(rows["test"]) >= n_test:
            break
        entry = dataset[index]
        question = entry["question"]
        side = tasks.split_of(question)
        wanted = n_train if side == "train" else n_test
        if len(rows[side]) >= wanted or (side == "test" and question in seen_test):
            continue
        if side == "test":
            seen_test.add(question)
        source = json.dumps({"task": task, "config": config, "index": index})
        rows[side].append(
            {
                "prompt": [{"role": "user", "content": f"{question}\n{REASONING_GYM_INSTRUCTION}"}],
                "question": question,
                "answer": None if entry["answer"] is None else str(entry["answer"]),
                "reasoning_gym": source,
            }
        )
    if len(rows["test"]) < n_test or len(rows["train"]) < n_train:
        raise ValueError(
            f"reasoning-gym:{task} with {overrides or 'its default config'} gave {len(rows['train'])} training "
            f"questions and {len(rows['test'])} distinct held-out ones in {config['size']} draws; asked for "
            f"{n_train} and {n_test}. Ask for fewer (--task_train_size, --task_eval_size) or widen the task "
            "(--dataset_config)."
        )
    return (Dataset.from_list(rows["train"]), Dataset.from_list(rows["test"]) if n_test else None)


def _reasoning_gym_dataset(task: str, config: dict[str, Any]):
    """reasoning-gym's dataset object, a bad config value turned into a ValueError (reasoning-gym asserts)."""
    import reasoning_gym

    try:
        return reasoning_gym.create_dataset(task, **config)
    except (AssertionError, TypeError, ValueError) as error:
        raise ValueError(
            f"reasoning-gym:{task} refuses its config {config}: {error or type(error).__name__}"
        ) from error


def describe(args: Any) -> dict[str, Any] | None:
    """What the model card says about a real task (None for the built-in task or a TRL-format dataset)."""
    name = args.dataset_name
    if is_reasoning_gym(name):
        return {
            "name": f"reasoning-gym {name[len(REASONING_GYM_PREFIX) :]}",
            "config": args.dataset_config or "the task's defaults",
            "instruction": REASONING_GYM_INSTRUCTION,
            "rewards": ", ".join(args.reward_funcs),
            "held-out split": "questions never in training (hash split)",
        }
    return None
