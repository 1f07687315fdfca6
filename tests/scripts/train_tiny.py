"""Train a tiny local model with grpo_plus (or stock TRL) from the command line; used by subprocess tests.

accelerate launch --num_processes 2 tests/scripts/train_tiny.py --model_dir DIR --output_dir OUT [GRPOConfig flags]
python tests/scripts/train_tiny.py --config run.yaml
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from helpers.engine import StepRecorder  # noqa: E402
from helpers.fsdp_on_cpu import force_fsdp_on_cpu  # noqa: E402
from helpers.models import prompt_dataset  # noqa: E402
from helpers.probes import (  # noqa: E402
    GroupRecorder,
    record_draws,
    record_trained_batches,
    restore_rows_without_tokens,
    use_row_seeded_sampling,
)
from helpers.rewards import (  # noqa: E402
    constant_reward,
    digit_reward,
    half_dead_reward,
    length_reward,
    odd_prompts_constant_reward,
    odd_prompts_dead_reward,
)
from helpers.server import lagging_server  # noqa: E402
from peft import LoraConfig  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import TrlParser  # noqa: E402

from grpo_plus import GRPOConfig, GRPOTrainer  # noqa: E402


@dataclass
class TinyArgs:
    model_dir: str = field(metadata={"help": "Directory of a tiny model (helpers.models.save_tiny_model)."})
    num_prompts: int = field(default=16)
    row_seeded_sampling: bool = field(default=False, metadata={"help": "Deterministic per-row sampling."})
    dump_weights: str | None = field(default=None, metadata={"help": "Write the final weights here (safetensors)."})
    dump_logs: str | None = field(default=None, metadata={"help": "Write the log history here (json)."})
    resume: bool = field(default=False, metadata={"help": "Resume from the last complete checkpoint."})
    stock_trl: bool = field(default=False, metadata={"help": "Use trl.GRPOTrainer instead of grpo_plus's."})
    step_delay: float = field(default=0.0, metadata={"help": "Sleep this long after each optimizer step."})
    peft: bool = field(default=False, metadata={"help": "Train a LoRA adapter."})
    reward: str = field(
        default="length_digit", metadata={"help": "length_digit | odd_constant | constant | half_dead | odd_dead"}
    )
    record_groups: str | None = field(default=None, metadata={"help": "Write per-group checks here (json, per rank)."})
    record_draws: str | None = field(
        default=None, metadata={"help": "Append every selective-rollout draw here (json lines, per rank)."}
    )
    prompts: str | None = field(
        default=None, metadata={"help": "Train on these prompts ('|'-separated) instead of prompt_dataset."}
    )
    count_forwards: str | None = field(
        default=None, metadata={"help": "Write how often this rank called the model outside generation (json)."}
    )
    record_batches: str | None = field(
        default=None, metadata={"help": "Write every micro-batch trained on, with its step, here (torch, per rank)."}
    )
    force_fsdp_on_cpu: bool = field(
        default=False,
        metadata={
            "help": "Test harness only: run accelerate's FSDP on CPU processes over gloo (see force_fsdp_on_cpu)."
        },
    )
    watchdog: float = field(
        default=0.0,
        metadata={
            "help": "If training (and gathering the weights) has not ended this many seconds after it started, "
            "print every thread's stack and exit 1: a rank stuck in a collective fails instead of hanging."
        },
    )
    skip_dead_anchor: bool = field(
        default=False,
        metadata={
            "help": "Negative control: a micro-batch with no live row makes no model call (see skip_dead_anchor)."
        },
    )
    lagging_server: str | None = field(
        default=None,
        metadata={"help": "'max_staleness,weight_sync_steps': the synchronous oracle of async_generation, each sync "
                  "loading the weights of the step it lags to (helpers.server.lagging_server)."},
    )  # fmt: skip
    record_generated: str | None = field(
        default=None,
        metadata={"help": "Write every generation batch's tensors (completion ids, sampler log-probs) here (torch, "
                  "per rank)."},
    )  # fmt: skip
    forget_rows_in_flight: bool = field(
        default=False,
        metadata={"help": "Negative control: a resumed partial-rollouts pool's rows in flight lose their tokens "
                  "(helpers.probes.restore_rows_without_tokens)."},
    )  # fmt: skip
    vllm_logps: str | None = field(
        default=None,
        metadata={"help": "After training, sync the colocated vLLM engine and write the sampled tokens of the first "
                  "prompt with the engine's and the model's log-probs here (json, per rank)."},
    )  # fmt: skip


def count_forwards(model) -> dict:
    """Counts the model's forward calls outside `generate` (there TRL gathers ZeRO-3 parameters once per batch; every
    other call gathers them layer by layer, collectively, so each rank must make the same number)."""
    counts = {"forward": 0, "generating": 0}
    model.register_forward_pre_hook(lambda *_: counts.update(forward=counts["forward"] + (not counts["generating"])))
    generate = model.generate

    def counted_generate(*args, **kwargs):
        counts["generating"] += 1
        try:
            return generate(*args, **kwargs)
        finally:
            counts["generating"] -= 1

    model.generate = counted_generate
    return counts


def skip_dead_anchor() -> None:
    """Break grpo_plus on purpose (negative control): a micro-batch whose rows are all dead makes no model call (its
    loss is a zero with a graph of its own) instead of the one-position anchor call. A rank holding only dead rows
    then skips forwards the others make: under FSDP2 / ZeRO-3 the collectives stop matching."""
    import grpo_plus.zero_waste.training_pass

    forward_rows = grpo_plus.zero_waste.training_pass.forward_rows

    def forward_rows_skipping(forward, input_ids, attention_mask, width, live, fill, bridge):
        if live is not None and not bool(live.any()):
            return fill + torch.zeros((), requires_grad=True), torch.zeros_like(fill), None
        return forward_rows(forward, input_ids, attention_mask, width, live, fill, bridge)

    grpo_plus.zero_waste.training_pass.forward_rows = forward_rows_skipping


def gathered_weights(trainer) -> dict:
    """Every trained parameter, whole: under ZeRO-3 / FSDP each rank holds a shard (gathering is collective)."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    params = dict(model.named_parameters())
    if getattr(trainer, "is_deepspeed_enabled", False) and trainer.accelerator.state.deepspeed_plugin.zero_stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(params.values())):
            return {name: p.detach().clone().contiguous() for name, p in params.items()}
    # FSDP2 holds DTensor shards; full_tensor() gathers them (collectively)
    return {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().contiguous() for name, p in params.items()
    }


class SlowDown(TrainerCallback):
    """Gives a test time to kill the process between checkpoints."""

    def __init__(self, delay: float):
        self.delay = delay

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(self.delay)


class ReportFirstStep(TrainerCallback):
    """Prints the first optimizer step this process runs (a resumed run starts after its checkpoint)."""

    def on_step_end(self, args, state, control, **kwargs):
        if not getattr(self, "reported", False):
            print(f"FIRST_STEP={state.global_step}", flush=True)
            self.reported = True


REWARDS = {
    "length_digit": [length_reward, digit_reward],
    "odd_constant": [odd_prompts_constant_reward],
    "constant": [constant_reward],
    "half_dead": [half_dead_reward],
    "odd_dead": [odd_prompts_dead_reward],
}


def record_selective_draws(trainer, path: str) -> None:
    """Append each draw (the step it was made after, drawn and skipped rows) as a line, flushed: a killed run
    leaves every decision it made."""

    def write_line(draw):
        line = {"after_step": trainer.state.global_step, "indices": draw.indices, "skipped": draw.skipped}
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")

    record_draws(trainer, on_draw=write_line)


def write_vllm_logps(trainer, tokenizer, path: str) -> None:
    """Push the final weights into the colocated engine (collective under ZeRO-3), sample 6 tokens of the first prompt
    and write them with the engine's and the model's log-probs, and every sync check's (mean difference, bound)."""
    from vllm import SamplingParams

    generation = trainer.vllm_generation
    generation.sync_weights()
    prompt = tokenizer(trainer.train_dataset[0]["prompt"])["input_ids"]
    params = SamplingParams(max_tokens=6, temperature=1.0, logprobs=0, seed=0, ignore_eos=True)
    out = generation.llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    tokens = list(out.token_ids)
    engine = [lp[t].logprob for t, lp in zip(tokens, out.logprobs, strict=True)]
    with torch.no_grad():  # every rank calls the model once: ZeRO-3 gathers its weights collectively
        logits = trainer.model_wrapped(torch.tensor([prompt + tokens], device=trainer.accelerator.device)).logits
    model = logits[0, len(prompt) - 1 : -1].float().log_softmax(-1).gather(1, torch.tensor(tokens).unsqueeze(1))
    receipts = [(r.mean_abs_difference, r.bound) for r in generation.sync_log.receipts]  # grpo_plus's sync checks
    Path(path).write_text(json.dumps({"prompt": prompt, "tokens": tokens, "engine": engine,
                                      "model": model.squeeze(1).tolist(), "receipts": receipts}))  # fmt: skip


def main() -> None:
    parser = TrlParser((GRPOConfig, TinyArgs))
    training_args, tiny_args = parser.parse_args_and_config()
    if tiny_args.force_fsdp_on_cpu:
        force_fsdp_on_cpu()
    if tiny_args.skip_dead_anchor:
        skip_dead_anchor()
    if tiny_args.forget_rows_in_flight:
        import pytest

        restore_rows_without_tokens(pytest.MonkeyPatch())
    tokenizer = AutoTokenizer.from_pretrained(tiny_args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_args.model_dir, dtype=torch.float32)
    trainer_cls = GRPOTrainer
    if tiny_args.stock_trl:
        import trl

        trainer_cls = trl.GRPOTrainer
    trainer = trainer_cls(
        model=model,
        reward_funcs=REWARDS[tiny_args.reward],
        args=training_args,
        train_dataset=Dataset.from_list([{"prompt": p} for p in tiny_args.prompts.split("|")])
        if tiny_args.prompts
        else prompt_dataset(tiny_args.num_prompts),
        processing_class=tokenizer,
        callbacks=[ReportFirstStep(), *([SlowDown(tiny_args.step_delay)] if tiny_args.step_delay else [])],
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear") if tiny_args.peft else None,
    )
    if tiny_args.row_seeded_sampling:
        local_rows = training_args.per_device_train_batch_size * training_args.steps_per_generation
        use_row_seeded_sampling(model, training_args.seed, row_offset=trainer.accelerator.process_index * local_rows)
    forwards = count_forwards(model) if tiny_args.count_forwards else None
    recorder = GroupRecorder(trainer, training_args.num_generations) if tiny_args.record_groups else None
    trained = record_trained_batches(trainer) if tiny_args.record_batches else None
    if tiny_args.record_draws:
        record_selective_draws(trainer, f"{tiny_args.record_draws}.rank{trainer.accelerator.process_index}")
    if tiny_args.lagging_server:
        lagging_server(trainer, *(int(value) for value in tiny_args.lagging_server.split(",")))
    generated = StepRecorder(trainer, keep_weights=False) if tiny_args.record_generated else None
    if tiny_args.watchdog:
        faulthandler.dump_traceback_later(tiny_args.watchdog, exit=True)
    trainer.train(resume_from_checkpoint=True if tiny_args.resume else None)
    if recorder is not None:
        groups = [
            {"same_prompt": bool((ids == ids[0]).all()), "any_advantage": bool(adv.abs().sum() > 0), "rows": len(ids)}
            for ids, adv in recorder.groups()
        ]
        Path(f"{tiny_args.record_groups}.rank{trainer.accelerator.process_index}").write_text(json.dumps(groups))
    if generated is not None:
        torch.save(generated.generated, f"{tiny_args.record_generated}.rank{trainer.accelerator.process_index}")
    if trained is not None:
        torch.save(trained, f"{tiny_args.record_batches}.rank{trainer.accelerator.process_index}")
    if forwards is not None:
        Path(f"{tiny_args.count_forwards}.rank{trainer.accelerator.process_index}").write_text(json.dumps(forwards))
    if tiny_args.vllm_logps:
        write_vllm_logps(trainer, tokenizer, f"{tiny_args.vllm_logps}.rank{trainer.accelerator.process_index}")
    weights = gathered_weights(trainer) if tiny_args.dump_weights else None
    faulthandler.cancel_dump_traceback_later()
    if trainer.accelerator.is_main_process:
        if tiny_args.dump_weights:
            save_file(weights, tiny_args.dump_weights)
        if tiny_args.dump_logs:
            Path(tiny_args.dump_logs).write_text(json.dumps(trainer.state.log_history))
    engine = type(trainer.model_wrapped).__name__
    print(f"FINISHED global_step={trainer.state.global_step} pid={os.getpid()} engine={engine}")
    # Tearing gloo down explicitly: left to interpreter exit, its threads were once destroyed mid-flight
    # ("terminate called without an active exception") and the launcher reported a failure.
    if torch.distributed.is_initialized():
        trainer.accelerator.wait_for_everyone()
        torch.distributed.destroy_process_group()
        # Still seen after that, once in a few dozen launches: gloo's threads destroyed at interpreter exit abort a
        # rank that had finished and written everything (exit -6, the launcher reports a failure). Everything is
        # written and flushed by now, so the process ends here without running the interpreter's teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
