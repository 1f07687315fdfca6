"""grpo_plus on vLLM's real engine, colocate mode: the weight sync, and stock TRL's numbers with every saving on.

One engine for the module (conftest.py). Stock TRL gets grpo_plus's weight sync (`reload_on_sync`), without which it
cannot sync on vLLM's CPU build at all (first test); then both trainers draw the same completions from vLLM (seeded
sampling, same weights) and must train to the same weights, in float32 with SGD (tests/test_trainer_parity.py says
why SGD). The runs have dead groups (`half_dead_reward`) and groups of 4 completions sharing a prompt, so the
zero-waste pass skips rows and computes prompts once, and every run checks that it did.

The runs compared are one generation batch of both prompts of `prompt_dataset(2)`, "1+1=" scored alike whatever vLLM
samples (a dead group) and "2+4=" whose rows alternate 0 / 1 (`odd_prompts_dead_reward`), trained in two optimizer
steps (`steps_per_generation=2`; the second off-policy). One generation, because the engine computes in bfloat16 (TRL
leaves vLLM's dtype on "auto"): after a second sync, weights 1e-7 apart (the zero-waste pass computes in another
layout) would round to different bfloat16 values in a few places, and the two samplers' log-probs, the importance
sampling weights TRL derives from them, would differ by ~1e-3.
"""

from __future__ import annotations

import math

import pytest
import torch
import trl
from helpers.engine import StepRecorder, engine_logprobs, fresh_engine_logprobs
from helpers.models import prompt_dataset, save_tiny_model, tiny_run_kwargs
from helpers.probes import ForwardLog, max_weight_diff, record_trained_batches, trl_sampling_metrics
from helpers.rewards import odd_prompts_dead_reward
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer

import grpo_plus
from grpo_plus.engine import SyncChecker, reload_on_sync

# The settings every trainer of the module passes to TRL's vLLM engine (one engine: they must agree).
VLLM = dict(
    use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3, per_device_train_batch_size=4,
    steps_per_generation=2,
)  # fmt: skip
# Logged values that depend on wall time, not on what was computed.
TIMINGS = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama whose heads vLLM's CPU attention takes (head size 32), saved with its tokenizer."""
    return str(save_tiny_model(tmp_path_factory.mktemp("vllm-model"), hidden_size=128))


def build(package, model_dir, output_dir, *, reward_funcs=(odd_prompts_dead_reward,), peft_config=None, **overrides):
    """`package`'s trainer on a fresh float32 load of `model_dir`, generating with the module's engine."""
    settings = {"optim": "sgd", "learning_rate": 0.5, **VLLM, **overrides}
    args = package.GRPOConfig(**tiny_run_kwargs(output_dir, **settings))
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = package.GRPOTrainer(
        model=model,
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        reward_funcs=list(reward_funcs),
        args=args,
        train_dataset=prompt_dataset(2),  # every step: one dead group ("1+1=") and one live group ("2+4=")
        peft_config=peft_config,
    )
    # grpo_plus's trainer has it already (LoRA merged out of place); stock TRL gets the reload around its own stream
    # (LoRA merged into the base in place): in float32 both send the engine the same sums
    reload_on_sync(trainer.vllm_generation, lora_merge_in_place=True)
    return trainer


def train(package, model_dir, output_dir, **overrides):
    """(final weights, log history, trained micro-batches, the model's forward calls outside the sync checks) of a
    run."""
    trainer = build(package, model_dir, output_dir, **overrides)
    batches = record_trained_batches(trainer)
    forwards = ForwardLog(trainer.model)
    trainer.train()
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    forwards.checked = sum(receipt.trainer_positions for receipt in trainer.vllm_generation.sync_log.receipts)
    return weights, trainer.state.log_history, batches, forwards


def assert_same_run(model_dir, tmp_path, **overrides):
    """Stock TRL and grpo_plus, both on the engine: same completions, weights, losses and logged metrics; returns
    grpo_plus's log history and forward calls, and stock TRL's trained micro-batches. (A `sampling/*` metric grpo_plus
    logs over the rows its forward computed, `sampling/trained_rows/*`, is the caller's to check.)"""
    trl_weights, trl_logs, trl_batches, trl_forwards = train(trl, model_dir, tmp_path / "trl", **overrides)
    our_weights, our_logs, our_batches, our_forwards = train(grpo_plus, model_dir, tmp_path / "plus", **overrides)
    assert len(trl_batches) == len(our_batches)
    for (_, theirs), (_, ours) in zip(trl_batches, our_batches, strict=True):
        assert torch.equal(theirs["completion_ids"], ours["completion_ids"]), "vLLM sampled other completions"
        assert torch.equal(theirs["prompt_ids"], ours["prompt_ids"])
    initial = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    if overrides.get("peft_config") is not None:  # LoRA's B matrices start at zero
        initial = {k: torch.zeros_like(v) for k, v in trl_weights.items() if "lora_B" in k}
    assert max_weight_diff(initial, trl_weights) > 1e-3, "training did not move the weights: a vacuous comparison"
    diff = max_weight_diff(trl_weights, our_weights)
    assert diff <= 1e-5, f"max |w_trl - w_grpo_plus| = {diff}"
    for theirs, ours in zip(trl_logs, our_logs, strict=True):
        for key, value in theirs.items():
            if key in TIMINGS or not isinstance(value, float) or math.isnan(value):
                continue
            if key == "entropy" and ours.get(key) is None:  # rows were skipped (documented in zero-waste.md)
                continue
            if key.startswith("sampling/") and key not in ours:  # on-policy: from the forward, its rows
                assert key.replace("sampling/", "sampling/trained_rows/") in ours, key
                continue
            assert ours[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    rows = [entry["zero_waste/rows_computed_frac"] for entry in our_logs if "zero_waste/rows_computed_frac" in entry]
    positions = [entry["zero_waste/positions_frac"] for entry in our_logs if "zero_waste/positions_frac" in entry]
    assert rows and min(rows) < 1.0, "the zero-waste pass skipped no dead row"
    assert positions and max(positions) < 1.0, "the zero-waste pass computed every position"
    # The model's own count: the training forward and the no-grad old log-prob pass (TRL's, during generation, for the
    # importance-sampling ratio) both computed fewer positions than stock TRL's.
    assert our_forwards.training_positions < trl_forwards.training_positions
    # (grpo_plus's sync checks compute a probe with the model: counted apart)
    no_grad = [log.positions - log.training_positions - log.checked for log in (trl_forwards, our_forwards)]
    assert our_forwards.checked > 0 and trl_forwards.checked == 0
    assert no_grad[0] > 0 and no_grad[1] < no_grad[0], f"no-grad positions, TRL vs grpo_plus: {no_grad}"
    return our_logs, our_forwards, trl_batches


@pytest.mark.floor("vllm_cpu_bf16_repacking")
def test_trl_loads_into_repacked_weights_and_reload_syncs(shared_engine, model_dir, tmp_path):
    """On the CPU build TRL's own sync fails (the linear weights it loads into were repacked and dropped); through
    vLLM's reload the engine then serves the trainer's weights: bit for bit what an engine started from a checkpoint
    of them serves (vLLM's normal loader), and far from what it served before."""
    trainer = trl.GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        reward_funcs=[odd_prompts_dead_reward],
        args=trl.GRPOConfig(**tiny_run_kwargs(tmp_path, **VLLM)),
        train_dataset=prompt_dataset(8),
    )
    generation, model = trainer.vllm_generation, trainer.model
    with pytest.raises(AttributeError, match="weight_loader"):
        generation.sync_weights()

    # TRL leaves vLLM's dtype on "auto": bfloat16 on CPU for a float32 checkpoint.
    assert generation.llm.llm_engine.model_config.dtype == torch.bfloat16
    log = reload_on_sync(generation, sync_check="every")
    generation.sync_weights()
    probe, _ = SyncChecker("every", generation.llm, model, trainer.processing_class).sequences()
    first = engine_logprobs(generation.llm, probe)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1.25)  # sharper: every log-prob moves
    generation.sync_weights()
    second = engine_logprobs(generation.llm, probe)
    assert len(log.receipts) == 2  # both syncs checked against the trainer, within the bfloat16 bound
    # the engine serves exactly what an engine started from a checkpoint of those weights serves
    model.save_pretrained(tmp_path / "checkpoint")
    trainer.processing_class.save_pretrained(tmp_path / "checkpoint")
    assert torch.equal(second, fresh_engine_logprobs(tmp_path / "checkpoint", probe, shared_engine.kwargs))
    assert (second - first).abs().mean() > 10 * log.receipts[1].bound  # an engine left on the first weights fails


def test_without_importance_sampling_correction_old_logps_are_deferred(shared_engine, model_dir, tmp_path):
    """Without the correction TRL computes the old log-probs only for the off-policy step (steps_per_generation 2 >
    gradient_accumulation_steps 1); grpo_plus defers them to the micro-batches, skipping dead rows there too."""
    logs, deferred, _ = assert_same_run(
        model_dir, tmp_path, loss_type="dapo", vllm_importance_sampling_correction=False
    )
    assert not any(key.startswith("sampling/") for entry in logs for key in entry)
    *_, in_generation = train(grpo_plus, model_dir, tmp_path / "corrected", loss_type="dapo")
    no_grad = [log.positions - log.training_positions - log.checked for log in (in_generation, deferred)]
    assert no_grad[1] < no_grad[0], f"old log-prob positions, during generation vs deferred: {no_grad}"


@pytest.mark.parametrize(
    "mode, clip_min, clip_max",
    [
        ("sequence_mask", None, 3.0),  # TRL's default
        ("sequence_truncate", 0.999, 1.001),
        ("token_mask", 0.9995, 1.0005),  # caps inside the sampler/trainer mismatch: some tokens are masked
        ("token_truncate", 0.9995, 1.0005),
    ],
)
def test_zero_waste_pass_matches_stock_trl_with_importance_sampling_correction(
    shared_engine, model_dir, tmp_path, mode, clip_min, clip_max
):
    logs, *_ = assert_same_run(
        model_dir,
        tmp_path,
        loss_type="dapo",
        vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_min=clip_min,
        vllm_importance_sampling_clip_max=clip_max,
    )
    lowest = min(
        entry["sampling/importance_sampling_ratio/min"]
        for entry in logs
        if "sampling/importance_sampling_ratio/min" in entry
    )
    highest = max(
        entry["sampling/importance_sampling_ratio/max"]
        for entry in logs
        if "sampling/importance_sampling_ratio/max" in entry
    )
    assert (lowest, highest) != (1.0, 1.0), "vLLM's and the trainer's log-probs agree exactly: nothing to correct"
    if mode == "token_mask":
        assert lowest == 0.0, "no token fell outside the caps: the mask did nothing"
    elif clip_min is not None and mode.endswith("truncate"):
        assert lowest == pytest.approx(clip_min) or highest == pytest.approx(clip_max), "no ratio reached a cap"


@pytest.mark.parametrize(
    "mode, clip_min, clip_max",
    [
        ("sequence_mask", None, 3.0),  # TRL's default
        ("sequence_truncate", 0.999, 1.001),
        ("token_mask", 0.9995, 1.0005),
        ("token_truncate", 0.9995, 1.0005),
    ],
)
def test_on_policy_the_correction_comes_from_the_training_forward(
    shared_engine, model_dir, tmp_path, mode, clip_min, clip_max
):
    """One optimizer step per generation batch (gradient_accumulation_steps = steps_per_generation = 2): stock TRL runs
    its no-grad old-log-prob pass over every row at generation for its correction; grpo_plus takes the old log-probs
    and the ratio from the training forward and runs no pass at all (its sync checks' probes aside), with stock TRL's
    completions, weights and losses. Its `sampling/*` metrics cover the rows the forward computed
    (`sampling/trained_rows/*`): TRL's formulas on those rows of TRL's own batches."""
    correction = dict(
        vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=clip_min,
        vllm_importance_sampling_clip_max=clip_max,
    )  # fmt: skip
    logs, forwards, trl_batches = assert_same_run(
        model_dir, tmp_path, loss_type="dapo", gradient_accumulation_steps=2, max_steps=1, **correction
    )
    assert forwards.positions - forwards.training_positions - forwards.checked == 0
    batches = [batch for _, batch in trl_batches]
    assert len(batches) == 2  # one generation batch, its two micro-batches in one optimizer step
    expected = trl_sampling_metrics(
        batches, mode, rows=lambda b: (b["advantages"] != 0) & b["completion_mask"].any(-1)
    )
    for name, value in expected.items():
        trained = name.replace("sampling/", "sampling/trained_rows/")
        # log-probs near -4 computed apart in float32 (a few 1e-7 each; a sequence's ratio sums up to 8 of them), against
        # differences from the bfloat16 engine of 1e-3
        assert [entry[trained] for entry in logs if trained in entry] == [pytest.approx(value, rel=1e-5, abs=1e-6)]
    ratio = torch.cat([batch["importance_sampling_ratio"].flatten() for batch in batches])
    assert ((ratio - 1).abs() > 1e-4).any(), "vLLM's and the trainer's log-probs agree: nothing to correct"


def test_lora_matches_stock_trl(shared_engine, model_dir, tmp_path):
    """TRL merges the adapters into the base for each sync (and unmerges after), grpo_plus merges them out of place
    (tests/vllm_engine/test_lora_sync.py): on a float32 base the engine gets the same weights, and samples the same."""
    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM")
    assert_same_run(model_dir, tmp_path, peft_config=lora, learning_rate=2.0)


def test_without_the_zero_waste_pass_four_steps_are_stock_trls_bit_for_bit(shared_engine, model_dir, tmp_path):
    """In the bfloat16 engine TRL gives (vLLM's "auto"), with AdamW, four generation batches (four syncs) of two
    optimizer steps each: grpo_plus with the zero-waste pass off computes what stock TRL computes, so the engine gets
    the same weights and every step is stock TRL's to the bit (the sync checks draw no random numbers). With the pass
    on, weights 1e-7 apart round to other bfloat16 values and the runs part after the first real sync:
    tests/vllm_engine/test_multistep.py compares those on a float32 engine."""
    runs = {}
    for package in (trl, grpo_plus):
        overrides = {"zero_waste_pass": False} if package is grpo_plus else {}
        trainer = build(package, model_dir, tmp_path / package.__name__, optim="adamw_torch", learning_rate=0.01,
                        max_steps=8, **overrides)  # fmt: skip
        record = StepRecorder(trainer)
        trainer.train()
        runs[package.__name__] = trainer, record
    (theirs, their_record), (ours, our_record) = runs["trl"], runs["grpo_plus"]
    assert len(our_record.weights) == 8 and len(ours.vllm_generation.sync_log.receipts) == 4
    for a, b in zip(their_record.generated, our_record.generated, strict=True):
        assert torch.equal(a["completion_ids"], b["completion_ids"])
        assert torch.equal(a["importance_sampling_ratio"], b["importance_sampling_ratio"])
    for a, b in zip(their_record.weights, our_record.weights, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)
    for a, b in zip(theirs.state.log_history, ours.state.log_history, strict=True):
        for key, value in a.items():  # metrics reduced in another order (grpo_plus's objective): float rounding apart
            if key not in TIMINGS and isinstance(value, float) and not math.isnan(value):
                assert b[key] == pytest.approx(value, rel=1e-7, abs=1e-9), key
