"""Real tasks in the recipes: GSM8K- and MATH-format local files and reasoning-gym's generated tasks, each scored by its
own verifier with a held-out split, and bad input as one line. Nothing is downloaded: the files are written here in
those datasets' exact formats, reasoning-gym generates its tasks locally."""

import json

import datasets
import pytest
from test_recipes import error_line, load_recipe, tiny_flags

from grpo_plus.app import real_tasks
from grpo_plus.app.recipe import ScriptArguments, load_data_and_rewards, parse_recipe_args
from grpo_plus.rewards import (
    accuracy_reward,
    answer_format_reward,
    boxed_format_reward,
    gsm8k_accuracy_reward,
    gsm8k_format_reward,
    reasoning_gym_reward,
    think_answer_format_reward,
)


def gsm8k_rows(n: int) -> list[dict]:
    """Rows in GSM8K's format: the worked answer with <<calculator>> marks, the number after "####"."""
    return [
        {
            "question": f"Ann has {i + 2} boxes of {i + 3} pens and gives away {i} pens. How many pens are left?",
            "answer": f"Ann has {i + 2} * {i + 3} = <<{i + 2}*{i + 3}={(i + 2) * (i + 3)}>>{(i + 2) * (i + 3)} pens.\n"
            f"She has {(i + 2) * (i + 3)} - {i} = <<{(i + 2) * (i + 3)}-{i}={(i + 2) * (i + 3) - i}>>"
            f"{(i + 2) * (i + 3) - i} pens left.\n#### {(i + 2) * (i + 3) - i}",
        }
        for i in range(n)
    ]


def expected_gsm8k(question: str) -> int:
    """The answer worked out from the question's numbers (independent of the answer column)."""
    words = question.split()
    boxes, pens, given = int(words[2]), int(words[5]), int(words[10])
    return boxes * pens - given


# Rows in MATH's format (problem, level, type, solution whose final answer is \boxed{}), and each final answer.
MATH_ROWS = [
    ("What is $\\frac{1}{2} + \\frac{1}{4}$?", "We have $\\frac{1}{2} + \\frac{1}{4} = \\frac{2}{4} + \\frac{1}{4} = "
     "\\boxed{\\frac{3}{4}}$.", "\\frac{3}{4}"),
    ("Solve $2x + 3 = 11$ for $x$.", "Subtracting 3 gives $2x = 8$, so $x = \\boxed{4}$.", "4"),
    ("Compute $\\sqrt{49} + 1$.", "Since $\\sqrt{49} = 7$, the sum is $\\boxed{8}$.", "8"),
    ("What is $3^2$?", "$3^2 = 3 \\cdot 3 = \\boxed{9}$.", "9"),
]  # fmt: skip


def math_dataset(rows) -> datasets.Dataset:
    problems, solutions, _ = zip(*rows, strict=True)
    n = len(rows)
    return datasets.Dataset.from_dict(
        {"problem": list(problems), "level": ["Level 1"] * n, "type": ["Algebra"] * n, "solution": list(solutions)}
    )


def write_jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def replies(texts):
    return [[{"role": "assistant", "content": text}] for text in texts]


def test_a_gsm8k_file_gets_prompts_a_held_out_split_and_its_verifier(tmp_path):
    """One .jsonl file, no test split: --task_eval_size rows are held out of training (seeded), every row gets a chat
    prompt asking for "#### <number>", and the rewards are GSM8K's verifier and format reward."""
    rows = gsm8k_rows(12)
    write_jsonl(tmp_path / "gsm8k.jsonl", rows)
    args = ScriptArguments(dataset_name=str(tmp_path / "gsm8k.jsonl"), task_eval_size=3)
    train, test, funcs = load_data_and_rewards(args)
    assert funcs == [gsm8k_accuracy_reward, gsm8k_format_reward]
    assert (len(train), len(test)) == (9, 3)
    assert sorted(list(train["question"]) + list(test["question"])) == sorted(row["question"] for row in rows)
    assert not set(train["question"]) & set(test["question"])
    for row in train:
        assert row["prompt"] == [{"role": "user", "content": f"{row['question']}\n{real_tasks.GSM8K_INSTRUCTION}"}]
    for split in (train, test):
        right = [f"... so {expected_gsm8k(q)} pens.\n#### {expected_gsm8k(q)}" for q in split["question"]]
        wrong = [f"#### {expected_gsm8k(q) + 1}" for q in split["question"]]
        assert funcs[0](replies(right), answer=split["answer"]) == [1.0] * len(split)
        assert funcs[0](replies(wrong), answer=split["answer"]) == [0.0] * len(split)
    assert real_tasks.evaluation_rewards(test) == (gsm8k_accuracy_reward, gsm8k_format_reward)
    assert list(load_data_and_rewards(args)[1]["question"]) == list(test["question"])  # seeded by --task_seed


def test_a_math_folder_of_parquet_files_uses_its_test_split_and_math_verify(tmp_path):
    math_dataset(MATH_ROWS[:3]).to_parquet(tmp_path / "train.parquet")
    math_dataset(MATH_ROWS[3:]).to_parquet(tmp_path / "test.parquet")
    train, test, funcs = load_data_and_rewards(ScriptArguments(dataset_name=str(tmp_path)))
    assert funcs == [accuracy_reward, boxed_format_reward]
    assert (len(train), len(test)) == (3, 1) and list(test["problem"]) == [MATH_ROWS[3][0]]
    assert train[1]["prompt"][0]["content"] == f"{MATH_ROWS[1][0]}\n{real_tasks.MATH_INSTRUCTION}"
    right = replies([f"So the answer is $\\boxed{{{answer}}}$." for _, _, answer in MATH_ROWS[:3]])
    assert funcs[0](right, solution=train["solution"]) == [1.0, 1.0, 1.0]
    assert funcs[0](replies(["$\\boxed{5}$"] * 3), solution=train["solution"]) == [0.0, 0.0, 0.0]
    assert real_tasks.evaluation_rewards(test) == (accuracy_reward, boxed_format_reward)


def test_a_trl_format_dataset_keeps_the_built_in_rewards_unless_its_answers_say_otherwise():
    from grpo_plus.app import tasks

    prompts = [[{"role": "user", "content": "1+1?"}]]
    trl_format = datasets.Dataset.from_dict({"prompt": prompts, "answer": [2]})
    assert real_tasks.task_rewards(trl_format) == (tasks.correctness_reward, tasks.format_reward)
    gsm8k_answers = datasets.Dataset.from_dict({"prompt": prompts, "answer": ["1 + 1 = 2\n#### 2"]})
    assert real_tasks.task_rewards(gsm8k_answers)[0] is gsm8k_accuracy_reward
    solutions = datasets.Dataset.from_dict({"prompt": prompts, "solution": ["$\\boxed{2}$"]})
    assert real_tasks.task_rewards(solutions)[0] is accuracy_reward
    assert real_tasks.evaluation_rewards(datasets.Dataset.from_dict({"prompt": prompts})) is None


def test_recipe_flags_name_a_reasoning_gym_task_generated_locally(tmp_path, monkeypatch):
    """`--dataset_name reasoning-gym:chain_sum` is a task, never a path or hub id (datasets.load_dataset is not
    called); its questions come from reasoning-gym with the flags' config, size and seed; train and held-out questions
    never overlap; the reward is the task's own scorer: the oracle answer (checked here by evaluating the expression)
    scores 1.0, another number 0.0."""
    import reasoning_gym

    def no_download(*args, **kwargs):
        raise AssertionError("reasoning-gym:<task> was read as a dataset to load")

    monkeypatch.setattr(datasets, "load_dataset", no_download)

    def load(seed: int):
        script_args, _, _ = parse_recipe_args([
            "--dataset_name", "reasoning-gym:chain_sum", "--dataset_config", "min_terms=2,max_terms=3,max_digits=1",
            "--task_train_size", "24", "--task_eval_size", "8", "--task_seed", str(seed),
            "--use_cpu", "true", "--bf16", "false", "--output_dir", str(tmp_path),
        ])  # fmt: skip
        assert script_args.dataset_name == "reasoning-gym:chain_sum"
        return load_data_and_rewards(script_args)

    train, test, funcs = load(seed=3)
    assert funcs == [reasoning_gym_reward, answer_format_reward]
    assert (len(train), len(test)) == (24, 8)
    assert len(set(test["question"])) == 8 and not set(train["question"]) & set(test["question"])
    for split in (train, test):
        expressions = [question.split(":", 1)[1].rstrip("= ").strip() for question in split["question"]]
        assert all(len(expression.split()) in (3, 5) for expression in expressions)  # 2 or 3 one-digit terms
        answers = list(split["answer"])
        assert answers == [str(eval(expression)) for expression in expressions]  # digits, + and - only
        sources = split["reasoning_gym"]
        assert funcs[0](replies([f"<answer>{a}</answer>" for a in answers]), reasoning_gym=sources) == [1.0] * len(
            split
        )
        assert funcs[0](replies([f"= {int(a) + 1}" for a in answers]), reasoning_gym=sources) == [0.0] * len(split)
    source = json.loads(train[0]["reasoning_gym"])
    regenerated = reasoning_gym.create_dataset("chain_sum", **source["config"])[source["index"]]
    assert regenerated["question"] == train[0]["question"]
    assert list(load(seed=3)[0]["question"]) == list(train["question"])
    assert list(load(seed=4)[0]["question"]) != list(train["question"])


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--dataset_name", "reasoning-gym:chain_sums"],
         "reasoning-gym has no task 'chain_sums'. Did you mean chain_sum"),
        (["--dataset_name", "reasoning-gym:chain_sum", "--dataset_config", "max_term=2"],
         "'max_term' is not a field of its config. Its fields: min_terms, max_terms, min_digits"),
        (["--dataset_name", "reasoning-gym:chain_sum", "--dataset_config", "max_terms=0"],
         "reasoning-gym:chain_sum refuses its config"),
    ],
    ids=["unknown_task", "unknown_config_field", "bad_config_value"],
)  # fmt: skip
def test_reasoning_gym_mistakes_are_one_line(tiny_model_dir, tmp_path, capsys, flags, expected):
    line = error_line(capsys, *tiny_flags(tiny_model_dir, tmp_path / "out", *flags))
    assert expected in line
    if "unknown_task" in expected:
        assert "basic_arithmetic, chain_sum, gcd" in line


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("data.jsonl", '{"q": "1+1", "a": 2}\n', "columns: ['q', 'a']"),
        ("data.jsonl", '{"question": "1+1", "answer": 2}\n', "does not end in '#### <number>' as GSM8K's does"),
        ("data.txt", "1+1=2\n", "a .txt file is none of the file types read (.json, .jsonl, .parquet, .csv)"),
    ],
    ids=["unknown_columns", "answer_without_marks", "unknown_file_type"],
)
def test_data_in_no_known_format_is_one_line_naming_what_was_found_and_what_is_read(
    tiny_model_dir, tmp_path, capsys, name, content, expected
):
    (tmp_path / name).write_text(content)
    line = error_line(capsys, *tiny_flags(tiny_model_dir, tmp_path / "out", "--dataset_name", tmp_path / name))
    assert expected in line
    if "columns" in expected:
        assert "GSM8K's ('question' and 'answer' ending in '#### <number>')" in line and "MATH's" in line


@pytest.mark.slow
@pytest.mark.parametrize("task", ["gsm8k", "math", "reasoning-gym"])
def test_recipe_trains_on_a_real_task_and_evaluates_it_held_out(tiny_model_dir, tmp_path, capsys, task):
    """One step of recipes/grpo_lora.py on each real task: the task's verifier and format reward are what the trainer
    logs, the held-out evaluation runs on the held-out split and the model card names the task."""
    if task == "gsm8k":
        write_jsonl(tmp_path / "gsm8k.jsonl", gsm8k_rows(8))
        data, rewards = ["--dataset_name", tmp_path / "gsm8k.jsonl"], ("gsm8k_accuracy_reward", "gsm8k_format_reward")
    elif task == "math":
        write_jsonl(tmp_path / "math.jsonl", [{"problem": p, "solution": s} for p, s, _ in MATH_ROWS * 2])
        data, rewards = ["--dataset_name", tmp_path / "math.jsonl"], ("accuracy_reward", "boxed_format_reward")
    else:
        data = ["--dataset_name", "reasoning-gym:chain_sum", "--dataset_config", "max_terms=2,max_digits=1",
                "--task_train_size", "8"]  # fmt: skip
        rewards = ("reasoning_gym_reward", "answer_format_reward")
    out = tmp_path / "run"
    flags = tiny_flags(tiny_model_dir, out, *data, "--task_eval_size", "2", "--max_steps", "1")
    load_recipe("grpo_lora").main([str(flag) for flag in flags])
    printed = capsys.readouterr().out
    assert "Held-out evaluation before training (2 prompts" in printed and "Held-out results" in printed
    logged = json.loads((out / "checkpoint-1" / "trainer_state.json").read_text())["log_history"][0]
    assert all(f"rewards/{name}/mean" in logged for name in rewards), sorted(logged)
    if task == "reasoning-gym":
        assert "reasoning-gym chain_sum" in (out / "README.md").read_text()


def test_trls_reward_functions_and_the_verifiers_resolve_by_name():
    import trl.rewards

    from grpo_plus.app.recipe import resolve_reward_funcs

    names = ["trl.rewards:think_format_reward", "trl.rewards:accuracy_reward", "accuracy", "think_answer_format"]
    funcs = resolve_reward_funcs(names)
    assert funcs[:2] == [trl.rewards.think_format_reward, trl.rewards.accuracy_reward]
    assert funcs[2:] == [accuracy_reward, think_answer_format_reward]
