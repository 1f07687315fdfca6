"""What the vLLM engine tests share: runs recorded step by step, stock TRL given grpo_plus's engine settings or TRL's
own LoRA stream, and a reference engine started fresh from a checkpoint (vLLM's normal loader, not the reload)."""

from __future__ import annotations

import json
import os
import sys
import types
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import TrainerCallback

SCORE_CHECKPOINT = str(Path(__file__).resolve().parents[1] / "scripts" / "score_checkpoint.py")


class StepRecorder(TrainerCallback):
    """Per optimizer step of a trainer: its trainable weights after the step (copies; `keep_weights=False`: none), and
    the batches it generated (`_generate_and_score_completions`' tensors, on CPU)."""

    def __init__(self, trainer, keep_weights: bool = True):
        self.weights: list[dict[str, torch.Tensor]] = []
        self.generated: list[dict[str, torch.Tensor]] = []
        self.trainer, self.keep_weights = trainer, keep_weights
        generate = trainer._generate_and_score_completions

        def recording_generate(inputs):
            output = generate(inputs)
            self.generated.append({k: v.detach().cpu().clone() for k, v in output.items() if torch.is_tensor(v)})
            return output

        trainer._generate_and_score_completions = recording_generate
        trainer.add_callback(self)

    def on_step_end(self, args, state, control, **kwargs):
        if not self.keep_weights:  # a copy of the model per step: gigabytes over a run of the embedded model
            return
        model = self.trainer.model
        self.weights.append({k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad})


@contextmanager
def engine_settings(**fields):
    """While stock TRL builds its trainer: its colocated engine gets grpo_plus's `vllm_dtype` / `vllm_quantization`
    (`fields`), so both sides of a comparison run on one engine of the same precision."""
    from grpo_plus.engine.precision import engine_precision

    args = types.SimpleNamespace(use_vllm=True, vllm_mode="colocate")
    with engine_precision(args, fields.get("vllm_quantization", "auto"), fields.get("vllm_dtype", "auto")):
        yield


def use_trl_stream(trainer) -> None:
    """Give a grpo_plus trainer TRL's own LoRA stream (merge into the base, stream, unmerge), still through vLLM's
    reload and unchecked: what TRL does to the base, on a base stock TRL cannot start vLLM with (4-bit)."""
    from grpo_plus.engine import reload_on_sync

    generation = trainer.vllm_generation
    for name in ("_iter_named_params", "sync_weights"):
        generation.__dict__.pop(name, None)  # back to TRL's methods
    generation.sync_log = None
    reload_on_sync(generation, lora_merge_in_place=True)


def fresh_engine_logprobs(model_dir, token_ids: list[int], engine_args: dict, timeout: float = 600):
    """The log-probs of `token_ids[1:]` (each given the tokens before it) from a vLLM engine started in a new process,
    with the colocated engine's arguments (`engine_args`, e.g. the shared engine's `kwargs`), from the checkpoint in
    `model_dir` loaded by vLLM's normal loader: a path other than the reload a sync goes through, so a bug the two
    share shows."""
    import subprocess

    out = Path(model_dir) / "fresh_engine_logprobs.json"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    command = [
        sys.executable,
        SCORE_CHECKPOINT,
        str(model_dir),
        json.dumps(token_ids),
        json.dumps(engine_args),
        str(out),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return torch.tensor(json.loads(out.read_text()))


def engine_logprobs(llm, token_ids: list[int]) -> torch.Tensor:
    """The colocated engine's log-probs of `token_ids[1:]`, greedy (no random numbers drawn)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    out = llm.generate([{"prompt_token_ids": token_ids}], params, use_tqdm=False)[0]
    return torch.tensor([lp[t].logprob for t, lp in zip(token_ids[1:], out.prompt_logprobs[1:], strict=True)])


def tiny_engine_trainer(
    package, model_dir: str, output_dir, config: dict, base: str = "float32", lora: dict | None = None
):
    """`package`'s GRPOTrainer (grpo_plus or trl) on the tiny model saved at `model_dir` loaded with a `base` dtype
    ("float32", "bfloat16", "nf4"), `odd_prompts_dead_reward` on two prompts, LoRA where `lora` gives its settings."""
    from peft import LoraConfig
    from transformers import AutoTokenizer

    from grpo_plus.app.testing import load_with_base
    from helpers.models import prompt_dataset, tiny_run_kwargs
    from helpers.rewards import odd_prompts_dead_reward

    return package.GRPOTrainer(
        model=load_with_base(model_dir, base),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        reward_funcs=[odd_prompts_dead_reward],
        args=package.GRPOConfig(**tiny_run_kwargs(output_dir, **config)),
        train_dataset=prompt_dataset(2),
        peft_config=None if lora is None else LoraConfig(**lora),
    )
