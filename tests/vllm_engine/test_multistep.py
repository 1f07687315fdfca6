"""Many weight syncs on vLLM's real engine: stock TRL's numbers at every step, and an engine that is the trainer.

Issue 39: after the first real sync, runs left stock TRL's numbers. Two causes, both covered here:

- the engine served a stale LM head. SmolLM2, Qwen2.5-0.5B to 3B and Llama-3.2 tie the head to the input embedding;
  vLLM's CPU build packs the head's weight for its GEMM kernel when the engine starts, and its layerwise reload only
  loads the embedding (the head receives nothing and is not processed again), so the head kept the checkpoint's
  weights while the embedding moved on. grpo_plus's reload processes a tied layer again (`engine.reload`). Stock TRL
  with the same reload had the same stale head.
- in a bfloat16 engine (TRL's default: vLLM's dtype "auto"), trainer weights that differ by float32 rounding (the
  zero-waste pass computes in another layout; so does stock TRL with another micro-batch size) round to different
  bfloat16 values, the two engines' log-probs differ at bfloat16's scale, and the importance-sampling ratios TRL
  derives from them (a sequence's is the exponential of a sum over its tokens) and the samples part. That is TRL's
  own noise floor, not a divergence of grpo_plus's (docs/guide/vllm.md, "Exactness"; `make bench-vllm-divergence`).

So the runs here use a float32 engine (`vllm_dtype="float32"`, stock TRL given the same engine), where the engine's
log-probs are the trainer's to float32 rounding: a tiny tied Llama, full model and LoRA, zero-waste pass on and off,
4 optimizer steps of one generation each (4 syncs, 3 of them after training moved the weights), SGD (Adam would turn
float32 noise on ~0 gradients into learning-rate-sized steps). At every step: the same completions, losses, importance-
sampling ratios and weights as stock TRL, and an engine whose log-probs of the sampled tokens are the trainer's.
"""

from __future__ import annotations

import math

import pytest
import torch
import trl
from helpers.engine import StepRecorder, engine_settings
from helpers.models import prompt_dataset, save_tiny_model, tiny_run_kwargs
from helpers.probes import (
    PoolRecorder,
    logged_sampling,
    record_policy_weights,
    record_trained_batches,
    restore_rows_without_tokens,
)
from helpers.rewards import alternating_reward, odd_prompts_dead_reward
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer

import grpo_plus
from grpo_plus.engine import SyncCheckError, reload_on_sync

STEPS = 4
VLLM = dict(
    use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3, per_device_train_batch_size=8,
    steps_per_generation=1, max_steps=STEPS, optim="sgd", learning_rate=0.5, loss_type="dapo",
)  # fmt: skip
LORA = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM")
# Measured here (float32 engine, CPU build), the largest over the four runs: weights of grpo_plus and stock TRL 6.0e-8
# apart, old and sampler log-probs 1.7e-6, importance-sampling ratios 3.1e-6, logged metrics 2.4e-5 relative (the
# zero-waste pass computes in another layout; without it the full model's runs are bit-identical); the engine's
# log-probs of the sampled tokens 2e-7 from the trainer's (mean).
WEIGHTS_ATOL = 2e-7
LOGPS_ATOL = 5e-6
RATIO_ATOL = 1e-5
METRICS_RTOL, METRICS_ATOL = 5e-5, 1e-6
ENGINE_TRAINER_BOUND = 1e-6
# Values in the log that say how long something took, not what was computed.
TIMINGS = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama with tied input and output embeddings, 128 wide (vLLM's CPU attention takes heads of 32+)."""
    return str(save_tiny_model(tmp_path_factory.mktemp("vllm-tied-model"), hidden_size=128, tied=True))


def build(package, model_dir, output_dir, lora: bool, num_prompts=2, reward=odd_prompts_dead_reward, **overrides):
    settings = {**VLLM, **overrides}
    if package is grpo_plus:
        settings["vllm_dtype"] = "float32"
    args = package.GRPOConfig(**tiny_run_kwargs(output_dir, **settings))
    torch.manual_seed(args.seed)
    with engine_settings(vllm_dtype="float32"):  # stock TRL: the same float32 engine
        trainer = package.GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
            processing_class=AutoTokenizer.from_pretrained(model_dir),
            reward_funcs=[reward],
            args=args,
            # 2 prompts: every step one dead group ("1+1=") and one live group ("2+4="), each step an epoch
            train_dataset=prompt_dataset(num_prompts),
            peft_config=LORA if lora else None,
        )
    reload_on_sync(trainer.vllm_generation, lora_merge_in_place=True)  # stock TRL's own stream (ours has it already)
    return trainer


def run(package, model_dir, output_dir, lora: bool, **overrides):
    trainer = build(package, model_dir, output_dir, lora, **overrides)
    record = StepRecorder(trainer)
    record.trained = record_trained_batches(trainer)
    trainer.train()
    return trainer, record


@pytest.fixture(scope="module")
def stock_runs(shared_engine, model_dir, tmp_path_factory):
    """Stock TRL's runs (full model and LoRA), each trained once for the module."""
    runs = {}

    def stock(lora: bool):
        if lora not in runs:
            runs[lora] = run(trl, model_dir, tmp_path_factory.mktemp("trl"), lora)
        return runs[lora]

    return stock


def losses_and_ratios(trainer) -> list[dict[str, float]]:
    return [
        {
            k: v
            for k, v in entry.items()
            if isinstance(v, float) and k not in TIMINGS and not k.startswith("vllm_sync/")
        }
        for entry in trainer.state.log_history
        if "loss" in entry
    ]


@pytest.mark.parametrize("zero_waste", [True, False], ids=["zero-waste", "no-zero-waste"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_every_step_matches_stock_trl(shared_engine, stock_runs, model_dir, tmp_path, monkeypatch, lora, zero_waste):
    """On-policy (one generation batch per optimizer step) with the zero-waste pass on, grpo_plus computes no old
    log-probs at generation: its importance-sampling ratio is the training forward's, checked in the loss."""
    theirs, their_record = stock_runs(lora)
    in_loss = record_policy_weights(monkeypatch)
    ours, our_record = run(grpo_plus, model_dir, tmp_path, lora, zero_waste_pass=zero_waste)
    assert len(our_record.generated) == len(their_record.generated) == STEPS
    gaps = {"logps": 0.0, "ratio": 0.0, "weights": 0.0, "metrics": 0.0}
    for step, (a, b) in enumerate(zip(their_record.generated, our_record.generated, strict=True), start=1):
        assert torch.equal(a["completion_ids"], b["completion_ids"]), f"step {step}: vLLM sampled other completions"
        mask = a["completion_mask"].bool()
        assert ("old_per_token_logps" in b) == (not zero_waste)  # on-policy, the saving on: no old-log-prob pass
        for key in ("old_per_token_logps", "sampling_per_token_logps"):
            if key in b:
                gaps["logps"] = max(gaps["logps"], (a[key][mask] - b[key][mask]).abs().max().item())
                assert (a[key][mask] - b[key][mask]).abs().max() <= LOGPS_ATOL, f"step {step}: {key}"
        if not zero_waste:
            ratio = (a["importance_sampling_ratio"] - b["importance_sampling_ratio"]).abs().max().item()
            gaps["ratio"] = max(gaps["ratio"], ratio)
            assert ratio <= RATIO_ATOL, f"step {step}: importance-sampling ratio"
    if zero_waste:  # the ratio in the loss, on the rows the forward computed (the others have advantage 0)
        assert len(in_loss) == len(their_record.trained) == STEPS
        for step, ((_, a), call) in enumerate(zip(their_record.trained, in_loss, strict=True), start=1):
            live = (a["advantages"] != 0) & a["completion_mask"].bool().any(-1)
            ratio = (a["importance_sampling_ratio"][live] - call["weights"][live]).abs().max().item()
            gaps["ratio"] = max(gaps["ratio"], ratio)
            assert ratio <= RATIO_ATOL, f"step {step}: importance-sampling ratio"
    for step, (a, b) in enumerate(zip(their_record.weights, our_record.weights, strict=True), start=1):
        assert a.keys() == b.keys()
        diff = max((a[k] - b[k]).abs().max().item() for k in a)
        gaps["weights"] = max(gaps["weights"], diff)
        assert diff <= WEIGHTS_ATOL, f"step {step}: max |w_trl - w_grpo_plus| = {diff}"
    initial = their_record.weights[0]
    final = their_record.weights[-1]
    assert max((initial[k] - final[k]).abs().max().item() for k in initial) > 1e-2, "training barely moved the weights"
    for step, (a, b) in enumerate(zip(losses_and_ratios(theirs), losses_and_ratios(ours), strict=True), start=1):
        for key, value in a.items():
            if math.isnan(value) or (key == "entropy" and b.get(key) is None):  # rows skipped: zero-waste.md
                continue
            if key.startswith("sampling/") and key not in b:  # over the rows computed, on-policy: bounded below
                assert key.replace("sampling/", "sampling/trained_rows/") in b, f"step {step}: {key}"
                continue
            gaps["metrics"] = max(gaps["metrics"], abs(b[key] - value) / max(abs(value), METRICS_ATOL / METRICS_RTOL))
            assert b[key] == pytest.approx(value, rel=METRICS_RTOL, abs=METRICS_ATOL), f"step {step}: {key}"
    print("largest gaps:", gaps)
    for trainer in (theirs, ours):  # the engine is the trainer at every step, LM head included
        differences = logged_sampling(trainer, "sampling/sampling_logp_difference/mean")
        assert len(differences) == STEPS and max(differences) <= ENGINE_TRAINER_BOUND, differences
    receipts = ours.vllm_generation.sync_log.receipts
    assert len(receipts) == STEPS and all(r.precision == "float32 on both sides" for r in receipts)


def test_a_stale_tied_head_is_what_the_engine_served_without_the_fix(shared_engine, model_dir, tmp_path, monkeypatch):
    """The negative control: with the tied head left as vLLM's reload leaves it, stock TRL's engine drifts from its
    trainer from the first sync after the embedding moved, and grpo_plus's sync check stops the run there."""
    import grpo_plus.engine.reload as reload

    # The engine is shared by the session: a test before this one may have left a trained head in it. Start from this
    # model's own head, as a freshly started engine would, so that only the syncs below can make it stale.
    build(grpo_plus, model_dir, tmp_path / "start", lora=False).vllm_generation.sync_weights()
    monkeypatch.setattr(reload, "reprocess_tied_layer", lambda name, layer: None)
    theirs, _ = run(trl, model_dir, tmp_path / "trl", lora=False)
    differences = [entry["sampling/sampling_logp_difference/mean"] for entry in losses_and_ratios(theirs)]
    assert differences[0] <= ENGINE_TRAINER_BOUND and max(differences[1:]) > 1e3 * ENGINE_TRAINER_BOUND, differences
    with pytest.raises(SyncCheckError, match="weight sync 2: the engine's log-probs"):
        run(grpo_plus, model_dir, tmp_path / "ours", lora=False)
    monkeypatch.undo()
    build(grpo_plus, model_dir, tmp_path / "mend", lora=False).vllm_generation.sync_weights()  # whole for the next


# ---- partial rollouts on the engine (grpo_plus.partial_rollouts with colocated vLLM) -------------------------------
# Completions of at most 8 tokens (tiny_run_kwargs) in chunks of 3: a step hands its two groups after their third chunk,
# when the groups read ahead hold 6 tokens; those continue at the next step under the new weights.
CHUNK = 3
# 8 prompts: the 4 steps are one epoch (a run resumed inside an epoch samples the uninterrupted run's prompts); every
# group informative, so every step moves the weights and a carried token's version matters
PROMPTS = dict(num_prompts=8, reward=alternating_reward)
PARTIAL = dict(partial_rollout_tokens=CHUNK, save_strategy="steps", save_steps=1, **PROMPTS)


def largest(differences: torch.Tensor) -> float:
    return differences.abs().max().item() if differences.numel() else 0.0


def partial_run(model_dir, output_dir, resume=None, **overrides):
    """grpo_plus's full-model run on the float32 engine: (trainer, its StepRecorder)."""
    trainer = build(grpo_plus, model_dir, output_dir, lora=False, **overrides)
    record = StepRecorder(trainer)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, record


@pytest.fixture(scope="module")
def chunked_run(shared_engine, model_dir, tmp_path_factory):
    """A run whose rows carry across steps (chunks of 3 tokens), a checkpoint per step: (trainer, record, pool, the
    engine's requests of each chunk: (prompt tokens, of them read from vLLM's prefix cache) per row)."""
    requests = []
    with pytest.MonkeyPatch.context() as patch:
        pool = PoolRecorder(patch)
        trainer = build(grpo_plus, model_dir, tmp_path_factory.mktemp("partial"), lora=False, **PARTIAL)
        pool.trainer = trainer
        llm, generate = trainer.vllm_generation.llm, trainer.vllm_generation.llm.generate

        def counting(prompts, sampling_params=None, **kwargs):
            outputs = generate(prompts, sampling_params, **kwargs)
            if getattr(sampling_params, "logprobs", None) == 0:  # a chunk (TRL's request; not a sync check's probe)
                requests.append([(len(o.prompt_token_ids), o.num_cached_tokens or 0) for o in outputs])
            return outputs

        patch.setattr(llm, "generate", counting)
        record = StepRecorder(trainer)
        trainer.train()
    return trainer, record, pool, requests


def test_partial_rollouts_with_a_whole_chunk_train_as_without_the_setting(
    shared_engine, chunked_run, model_dir, tmp_path
):
    """A chunk of max_completion_length + 1 tokens: every row ends in the step's first chunk, one engine call of the
    step's rows, as TRL's own: the same completions, losses and weights at every step as the run without the setting
    (float32, 0.0 apart). The negative control: chunks of 3 tokens hand other completions and end elsewhere."""
    plain_trainer, plain = partial_run(model_dir, tmp_path / "plain", **PROMPTS)
    whole_trainer, whole = partial_run(model_dir, tmp_path / "whole", partial_rollout_tokens=9, **PROMPTS)
    assert len(plain.generated) == len(whole.generated) == STEPS
    for step, (a, b) in enumerate(zip(plain.generated, whole.generated, strict=True)):
        assert torch.equal(a["completion_ids"], b["completion_ids"]), f"step {step}: other completions"
        assert torch.equal(a["sampling_per_token_logps"], b["sampling_per_token_logps"]), f"step {step}"
    losses = [[e["loss"] for e in t.state.log_history if "loss" in e] for t in (plain_trainer, whole_trainer)]
    assert len(losses[0]) == STEPS and losses[0] == losses[1]
    gap = max(
        max((a[k] - b[k]).abs().max().item() for k in a) for a, b in zip(plain.weights, whole.weights, strict=True)
    )
    print(f"whole chunk against no setting: largest weight gap {gap}")
    assert gap == 0.0
    _, chunked, _, _ = chunked_run
    assert any(
        not torch.equal(a["completion_ids"], b["completion_ids"])
        for a, b in zip(plain.generated, chunked.generated, strict=True)
    )
    moved = max((plain.weights[-1][k] - chunked.weights[-1][k]).abs().max().item() for k in plain.weights[-1])
    print(f"chunks of {CHUNK} against no setting: final weights {moved} apart")
    assert moved > 1e-3


def test_partial_rollouts_on_the_engine_carry_rows_with_vllms_log_probs(shared_engine, chunked_run, model_dir):
    """Chunks of 3 tokens: rows carry across steps, each handoff is TRL's batch of complete groups of one prompt, the
    logged token ages are the recorded versions' lags, and every token's sampler log-prob handed to TRL
    (`sampling_per_token_logps`) is the engine's log-prob of it under the weights of its recorded version: scored
    again by the engine loaded with those weights (the negative control: the weights of the step that trains it)."""
    from helpers.engine import engine_logprobs

    from grpo_plus.compat.model import completion_eos_token_ids

    trainer, record, pool, requests = chunked_run
    size, group, limit = VLLM["per_device_train_batch_size"], 4, trainer.max_completion_length
    eos = set(completion_eos_token_ids(trainer))
    assert len(pool.handoffs) == len(record.generated) == STEPS
    for handoff, batch in zip(pool.handoffs, record.generated, strict=True):
        assert len(handoff.rows) == batch["completion_ids"].shape[0] == size
        for start in range(0, size, group):
            assert len({str(row["prompt"]) for row in handoff.inputs[start : start + group]}) == 1
        for i, row in enumerate(handoff.rows):
            assert row.finished and (row.tokens[-1] in eos or len(row.tokens) == limit)
            assert batch["completion_ids"][i, : len(row.tokens)].tolist() == row.tokens
            assert batch["sampling_per_token_logps"][i, : len(row.tokens)].tolist() == row.logps
    ages = [age for handoff in pool.handoffs for age in handoff.token_ages()]
    assert max(ages) == 1 and min(ages) == 0, "no row carried across steps: the chunk did not bite"
    assert any(len(set(row.versions)) > 1 for handoff in pool.handoffs for row in handoff.rows)  # two samplers a row
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    for handoff, entry in zip(pool.handoffs, logs, strict=True):
        old = [age for age in handoff.token_ages() if age > 0]
        assert entry["partial_rollouts/stale_token_frac"] == pytest.approx(
            len(old) / len(handoff.token_ages()), abs=1e-7
        )
        assert entry["partial_rollouts/stale_token_age_max"] == max(old, default=0)
    # the engine's log-probs of each token under the weights of its version (temperature 1: processed = raw)
    llm, model = trainer.vllm_generation.llm, trainer.model
    gap, wrong_gap = 0.0, 0.0
    for version in sorted({v for handoff in pool.handoffs for row in handoff.rows for v in row.versions}):
        model.load_state_dict(pool.weights[version])
        trainer.vllm_generation.sync_weights()
        for handoff in pool.handoffs:
            for row in handoff.rows:
                scored = engine_logprobs(llm, row.prompt_ids + row.tokens)[-len(row.tokens) :]
                scored -= torch.tensor(row.logps)
                mine = torch.tensor([v == version for v in row.versions])
                gap = max(gap, largest(scored[mine]))
                if handoff.step == version:  # tokens of older versions scored with this step's weights
                    wrong_gap = max(wrong_gap, largest(scored[~mine]))
    prompt_tokens = sum(n for call in requests for n, _ in call)
    cached = sum(c for call in requests for _, c in call)
    # vLLM's CPU build caches prefixes in blocks of 128 tokens: these rows (< 30 tokens) never fill one, so the
    # chunks re-send their prefixes uncached here (docs/guide/async-generation.md measures a longer run)
    print(
        f"engine scores vs handed log-probs: {gap:.3g}; with the training step's weights {wrong_gap:.3g}; "
        f"{len(requests)} engine calls, {prompt_tokens} prompt tokens, {cached} read from the prefix cache"
    )
    # measured 0.0 (the float32 engine's decode and its prefill of the same tokens agree here); bound: one float32
    # ulp at the log-probs' size (~4)
    assert gap <= 4.8e-7, gap
    assert wrong_gap > 1e-3, wrong_gap


def test_partial_rollouts_on_the_engine_resume_with_rows_in_flight(
    shared_engine, chunked_run, model_dir, tmp_path, monkeypatch
):
    """Resumed from checkpoint-1, whose pool holds rows in flight: the same completions at every later step and the
    uninterrupted run's weights, 0.0 apart (colocated vLLM samples from the torch random state the checkpoint holds).
    The negative control: the rows in flight restored without their tokens end elsewhere."""
    from grpo_plus.run.state import SHARED_FILE

    trainer, whole, _, _ = chunked_run
    checkpoint = f"{trainer.args.output_dir}/checkpoint-1"
    saved = torch.load(f"{checkpoint}/{SHARED_FILE}", weights_only=True)
    in_flight = [row for g in saved["parts"]["partial_rollouts"]["groups"] for row in g["rows"]]
    assert any(not row["finished"] and row["tokens"] for row in in_flight), "no row in flight: nothing is tested"
    _, resumed = partial_run(model_dir, tmp_path / "resumed", resume=checkpoint, **PARTIAL)
    assert len(resumed.generated) == STEPS - 1
    for a, b in zip(whole.generated[1:], resumed.generated, strict=True):
        assert torch.equal(a["completion_ids"], b["completion_ids"])
    gap = max((whole.weights[-1][k] - resumed.weights[-1][k]).abs().max().item() for k in whole.weights[-1])
    print(f"resumed with rows in flight: final weights {gap} from the uninterrupted run's")
    assert gap == 0.0
    restore_rows_without_tokens(monkeypatch)
    _, forgotten = partial_run(model_dir, tmp_path / "forgotten", resume=checkpoint, **PARTIAL)
    assert max((whole.weights[-1][k] - forgotten.weights[-1][k]).abs().max().item() for k in whole.weights[-1]) > 1e-3
