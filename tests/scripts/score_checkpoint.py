"""Score a token sequence with a vLLM engine started from a checkpoint (vLLM's normal loader), in its own process.

    python score_checkpoint.py MODEL_DIR '[token ids]' '{engine arguments}' OUT.json

Writes the log-probs of tokens 1..L-1 (each given the tokens before it) to OUT.json. The engine arguments are those
the colocated engine was built with (`vllm.LLM(...)`), the model and the executor replaced. Run with
VLLM_ENABLE_V1_MULTIPROCESSING=0 (the engine in this process); tests/helpers/engine.py's `fresh_engine_logprobs`."""

import json
import sys


def main() -> None:
    model_dir, token_ids, engine_args, out = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
    from vllm import LLM, SamplingParams

    engine_args.pop("distributed_executor_backend", None)  # one process of its own: vLLM's default executor
    llm = LLM(**{**engine_args, "model": model_dir})
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    output = llm.generate([{"prompt_token_ids": token_ids}], params, use_tqdm=False)[0]
    scores = [entry[token].logprob for token, entry in zip(token_ids[1:], output.prompt_logprobs[1:], strict=True)]
    with open(out, "w") as f:
        json.dump(scores, f)


if __name__ == "__main__":
    main()
