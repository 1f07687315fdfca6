"""How well the embedded SmolLM2-135M-Instruct does on candidate reasoning-gym tasks before any training: which task
could GRPO teach it in minutes on a CPU (sampled success neither ~0, nothing to reinforce, nor near 1).

    .venv/bin/python benchmarks/reasoning_gym_baselines.py [--model PATH] [--prompts 20] [--samples 4]
        [--json docs/guide/results/reasoning_gym_baselines.json] [--smoke]

Each candidate is a recipe's held-out split (grpo_plus.app.real_tasks.reasoning_gym_datasets, seed 0, `--prompts`
questions or fewer where the task has fewer, the recipe's prompt and instruction) scored by the recipe's reward
(grpo_plus.rewards.reasoning_gym_reward: the task's own `score_answer` on the reply's <answer> tag, else its final
number). Printed per task: greedy accuracy (the recipes' held-out evaluation, tasks.evaluate), the share of sampled
replies scoring 1.0 (`--samples` per prompt, temperature 0.7, what GRPO's groups would see), and the share of replies
holding an <answer> tag.
--smoke: the random tiny model of grpo_plus.app.testing, 4 prompts (checks the script runs; the numbers mean nothing).
"""

from __future__ import annotations

import sys
import tempfile
import time

from harness.flags import arguments
from harness.report import write_report
from harness.trainers import model_path

# (task, --dataset_config, most held-out prompts): small numbers, where a 135M model has a chance. One-digit products
# have only ~15 distinct held-out questions.
CANDIDATES = (
    ("chain_sum", "min_terms=2,max_terms=2,min_digits=1,max_digits=1", None),
    ("products", "min_terms=2,max_terms=2,min_digits=1,max_digits=1", 12),
    ("chain_sum", "min_terms=3,max_terms=3,min_digits=1,max_digits=1", None),
)
MAX_NEW_TOKENS = 32


def sampled_replies(model, tokenizer, prompts, samples: int, seed: int) -> list[str]:
    """`samples` replies per prompt at temperature 0.7 (prompts in order, each one's replies together)."""
    import torch

    torch.manual_seed(seed)
    texts = tokenizer.apply_chat_template(prompts, add_generation_prompt=True, tokenize=False)
    tokenizer.padding_side = "left"
    encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.inference_mode():
        output = model.generate(
            **encoded, max_new_tokens=MAX_NEW_TOKENS, do_sample=True, temperature=0.7, top_p=1.0, top_k=0,
            num_return_sequences=samples, pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
    return tokenizer.batch_decode(output[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True)


def measure(model, tokenizer, task: str, config: str, prompts: int, samples: int) -> dict:
    from grpo_plus.app import real_tasks, tasks
    from grpo_plus.rewards import answer_format_reward, reasoning_gym_reward

    _, held_out = real_tasks.reasoning_gym_datasets(f"reasoning-gym:{task}", config, 1, prompts, seed=0)
    start = time.perf_counter()
    greedy = tasks.evaluate(
        model, tokenizer, held_out, max_new_tokens=MAX_NEW_TOKENS, progress=False,
        correctness=reasoning_gym_reward, format=answer_format_reward,
    )  # fmt: skip
    replies = sampled_replies(model, tokenizer, list(held_out["prompt"]), samples, seed=0)
    sources = [source for source in held_out["reasoning_gym"] for _ in range(samples)]
    scores = reasoning_gym_reward(replies, reasoning_gym=sources)
    tags = answer_format_reward(replies)
    return {
        "task": task,
        "dataset_config": config,
        "prompts": len(held_out),
        "greedy_accuracy": round(greedy["accuracy"], 3),
        "sampled_success": round(sum(score == 1.0 for score in scores) / len(scores), 3),
        "sampled_answer_tag": round(sum(tag > 0 for tag in tags) / len(tags), 3),
        "samples_per_prompt": samples,
        "seconds": round(time.perf_counter() - start, 1),
        "example_reply": replies[0][:120],
    }


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__, json=None, smoke="the random tiny model, 4 prompts (the script runs)")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--samples", type=int, default=4)
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    if args.smoke:
        args.prompts, args.samples = 4, 2
    path = model_path(args.smoke, tempfile.mkdtemp() if args.smoke else None, args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rows = []
    for task, config, most in CANDIDATES:
        row = measure(model, tokenizer, task, config, min(args.prompts, most or args.prompts), args.samples)
        rows.append(row)
        print(
            f"{task:10s} {config:52s} greedy {row['greedy_accuracy']:.3f}  sampled {row['sampled_success']:.3f}  "
            f"<answer> tag {row['sampled_answer_tag']:.3f}  ({row['seconds']} s)",
            flush=True,
        )
    if args.json is not None and not args.smoke:
        result = {"model": args.model, "max_new_tokens": MAX_NEW_TOKENS, "temperature": 0.7, "tasks": rows}
        write_report(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
