"""What a decode step and a re-sent row cost in vLLM's engine, by the engine's dtype and KV-cache block size.

    .venvs/vllm/bin/python benchmarks/vllm_decode_cost.py [--cases auto:128,float32:128,float32:32] [--tokens 64]
                                                        [--smoke] [--json out.json]          (make bench-vllm-decode)

Why partial rollouts with vLLM save what they save (docs/guide/async-generation.md): a step's generation waits for its
longest completion, and the rows that ended early no longer cost vLLM anything; what the long tail costs is what a
decode step costs with few rows beside many. Partial rollouts re-send every row as its own request at each chunk,
its prompt followed by its tokens, so what they pay is what vLLM's prefix cache does not hold (whole blocks only).

For each case (the engine's dtype, "auto" being vLLM's choice, and its block size), a fresh engine (its own process,
the embedded SmolLM2-135M-Instruct; --smoke: the random tiny model, the numbers then mean nothing) measures, each
--repeats times (the median kept):
- ms per decode step with 1 row and with 16 rows (16 requests of two prompts, --tokens tokens each, EOS ignored);
- seconds to prefill 16 rows of a prompt and 2 x --tokens more tokens (two prompts; the rows' own tokens differ), and
  to send the same 16 rows again with the prefix cache holding what the first call computed (one new token each):
  what a chunk pays for re-sending its rows.
The engine takes TRL's colocated settings (processed log-probs, `max_num_batched_tokens=4096`).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from harness.flags import arguments  # noqa: E402
from harness.report import ROOT, markdown_table, start_report, write_report  # noqa: E402
from harness.trainers import model_path  # noqa: E402

ROWS = 16
PROMPT_TOKENS = 96
PROMPT = "Compute the following chain of sums step by step and give the final answer. " * 3


def measure(model: str, dtype: str, block_size: int, tokens: int, repeats: int) -> dict:
    """One case, in this process (a fresh engine): the figures of the module docstring."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process, as TRL's colocated one
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, block_size=block_size, max_num_seqs=ROWS, seed=0,
              max_num_batched_tokens=4096, logprobs_mode="processed_logprobs", gpu_memory_utilization=0.3)  # fmt: skip
    tokenizer = llm.get_tokenizer()
    # at most PROMPT_TOKENS (the embedded model's prompts are 68 tokens; the tiny model's tokenizer makes more)
    prompts = [
        tokenizer(f"{PROMPT} Problem {i}: 3 + 4 + 17 + 22 - 5 = ?")["input_ids"][-PROMPT_TOKENS:] for i in range(2)
    ]
    # rows as a chunk re-sends them: a prompt followed by 2 x `tokens` tokens (what they are does not change a prefill)
    filler = tokenizer(PROMPT * 8)["input_ids"][: 2 * tokens]
    rows = [prompts[i % 2] + filler[i:] + filler[:i] for i in range(ROWS)]

    def generate(rows: list[list[int]], max_tokens: int) -> tuple[float, list]:
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True, logprobs=0)
        started = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in rows], params, use_tqdm=False)
        return time.perf_counter() - started, outputs

    generate(prompts[:1], 8)  # warm-up
    figures: dict[str, list[float]] = {"decode_ms_1_row": [], f"decode_ms_{ROWS}_rows": [], "prefill_s": [],
                                       "resend_s": []}  # fmt: skip
    for _ in range(repeats):
        for count, key in ((1, "decode_ms_1_row"), (ROWS, f"decode_ms_{ROWS}_rows")):
            llm.reset_prefix_cache()
            seconds, _ = generate([prompts[i % 2] for i in range(count)], tokens)
            figures[key].append(1000 * seconds / tokens)
        llm.reset_prefix_cache()
        figures["prefill_s"].append(generate(rows, 1)[0])
        figures["resend_s"].append(generate(rows, 1)[0])
    built = llm.llm_engine.vllm_config
    return {
        "dtype": str(built.model_config.dtype),
        "block_size": built.cache_config.block_size,
        "row_tokens": len(rows[0]),
        **{key: statistics.median(values) for key, values in figures.items()},
        "runs": figures,
    }


def run_case(model: str, case: str, args) -> dict:
    """`case` ("dtype:block_size") measured by a new process (one engine per process)."""
    dtype, block_size = case.split(":")
    command = [sys.executable, __file__, "--one", model, dtype, block_size, str(args.tokens), str(args.repeats)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"case {case} failed:\n{done.stderr[-4000:]}")
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"  {case:14s} {json.dumps({k: v for k, v in figures.items() if k != 'runs'})}", flush=True)
    return {"case": case, **figures}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--one"]:  # a case's own process
        model, dtype, block_size, tokens, repeats = argv[1:]
        print(json.dumps(measure(model, dtype, int(block_size), int(tokens), int(repeats))))
        return 0
    parser = arguments(__doc__, smoke="the random tiny model, one repeat, 8 tokens", repeats=2, threads=1,
                       json=ROOT / "outputs" / "bench-vllm-decode" / "vllm_decode_cost.json")  # fmt: skip
    parser.add_argument("--cases", default="auto:128,float32:128,float32:32", help="dtype:block_size, comma-separated")
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args(argv)
    if args.smoke:
        args.repeats, args.tokens = 1, 8
    report, started = start_report(args, versions=("torch", "vllm"))
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    model = model_path(args.smoke, tempfile.mkdtemp(prefix="bench-decode-"), hidden_size=128)
    cases = [run_case(model, case, args) for case in args.cases.split(",")]
    rows = [
        [c["case"], c["dtype"].removeprefix("torch."), c["block_size"], f"{c['decode_ms_1_row']:.0f}",
         f"{c[f'decode_ms_{ROWS}_rows']:.0f}", f"{c['prefill_s']:.2f}", f"{c['resend_s']:.2f}"]
        for c in cases
    ]  # fmt: skip
    header = ["case", "dtype", "block size", "ms / decode step, 1 row", f"ms / decode step, {ROWS} rows",
              f"prefill {ROWS} rows (s)", "the same rows re-sent (s)"]  # fmt: skip
    markdown = markdown_table(header, rows)
    print(markdown)
    settings = {k: str(v) for k, v in vars(args).items()}
    write_report({**report, "settings": settings, "cases": cases}, args.json, markdown, started=started)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
