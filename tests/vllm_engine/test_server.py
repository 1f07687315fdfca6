"""vLLM server mode on the real engine: `grpo-plus vllm-serve` (vLLM's CPU build, the gloo weight transfer) and
trainers with `vllm_mode="server"` against it (grpo_plus.engine.server, grpo_plus.engine.gloo_transport).

One server for the module, started as a user starts it (`grpo-plus vllm-serve --model <embedded model> --dtype
float32 ...` in a subprocess, on a free port), serving the embedded model (SmolLM2-135M-Instruct, float32). Every
trainer's first sync loads its own weights into it; sampling is seeded per request (`generation_kwargs={"seed": 0}`),
so two trainers holding the same weights draw the same completions.

- a 1-process grpo_plus trainer trains against it, and after a sync the server's log-probs of a fixed probe are the
  trained model's at the float32 floor (that of the untouched checkpoint: server vs transformers), not before;
  every sync is checked for coverage and elements (`vllm_sync_check="every"`: the server reports what its reload
  took); a stream that leaves a tensor out fails the check;
- stock TRL in server mode (through grpo_plus's gloo client: TRL 1.16's client refuses any device but CUDA, so the
  harness gives stock TRL `grpo_plus.engine.server.server_client`) trains the same completions to the same losses and
  weights as grpo_plus (zero-waste pass on);
- a 2-process trainer (accelerate launch, gloo) against the same server trains to the 1-process run's weights;
- partial rollouts against it: rows carry across steps with the server's log-probs under each token's weights, and
  a run resumed with rows in flight ends at the uninterrupted run's weights (each row's request seeded);
- LoRA on a bfloat16 base: four syncs leave the frozen base bit-identical, the server serves PEFT's merge (float32
  reference), and a stream that fails midway leaves nothing merged (TRL's in-place stream leaves its merge in).

The log-prob probe of `vllm_sync_check` needs the engine in the trainer's process: it does not run in server mode.
"""

from __future__ import annotations

import copy

import pytest
import requests
import torch
import trl
from helpers.engine import StepRecorder
from helpers.probes import TRAIN_TINY, accelerate_launch, free_port, max_weight_diff, run_python, train_tiny_flags
from helpers.server import SERVER_NOISE, checkout_env, float32_model, server_config, server_trainer
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import grpo_plus
from grpo_plus.engine import SyncCheckError

PROBE = "3+4=7 12+5=17 9+9=18 40+2=42 6+1=7 33+3=36 1+1=2"
SEEDED = '{"seed": 0}'  # one seed per request: the same weights draw the same completions
# |server - transformers| of the probe's log-probs, float32 on both sides, measured on the untouched checkpoint:
# 3.0e-5 at most (different kernels); after a sync the same, before it the training's change (~1e-2).
FLOAT32_FLOOR = 1e-4


def probe_ids(model_dir) -> list[int]:
    return AutoTokenizer.from_pretrained(model_dir)(PROBE)["input_ids"]


def server_logps(url: str, model_dir: str, ids: list[int]) -> torch.Tensor:
    """The server's log-probs of `ids[1:]`, each given the tokens before it (OpenAI completions, prompt_logprobs)."""
    payload = {"model": model_dir, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 0.0}
    choice = requests.post(f"{url}/v1/completions", json=payload, timeout=120).json()["choices"][0]
    return torch.tensor([choice["prompt_logprobs"][i][str(t)]["logprob"] for i, t in enumerate(ids) if i > 0])


def model_logps(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)


def test_server_serves_the_trained_model_after_each_checked_sync(server, model_dir, tmp_path):
    """Two steps (two syncs, each checked for coverage and elements); after a last sync the server's log-probs equal
    the trained model's at the float32 floor; before it (serving the previous step's weights) they do not."""
    ids = probe_ids(model_dir)
    untouched = float32_model(model_dir)
    run = server_trainer(
        grpo_plus, float32_model(model_dir), model_dir, server_config(server, tmp_path, vllm_sync_check="every")
    )
    run.train()
    log = run.vllm_generation.sync_log
    assert len(log.streams) == len(log.reloads) == 2
    assert all(r.loaded_elements == s.elements > 0 for r, s in zip(log.reloads, log.streams, strict=True))
    assert log.reloads[0].tied_layers, "the tied LM head was not processed again on the server"
    trained = model_logps(run.model, ids)
    stale = (server_logps(server, model_dir, ids) - trained).abs().max().item()
    assert stale > 30 * FLOAT32_FLOOR, f"the last step did not move the model ({stale}): the check proves nothing"
    run.vllm_generation.sync_weights()
    served = server_logps(server, model_dir, ids)
    assert (served - trained).abs().max().item() <= FLOAT32_FLOOR
    assert (served - model_logps(untouched, ids)).abs().max().item() > 30 * FLOAT32_FLOOR


def test_a_stream_leaving_a_tensor_out_fails_the_sync_check(server, model_dir, tmp_path):
    """Negative control of the coverage check: a stream without one norm weight (the server loads it, keeping the
    old norm) raises SyncCheckError naming it."""
    run = server_trainer(
        grpo_plus, float32_model(model_dir), model_dir, server_config(server, tmp_path, vllm_sync_check="every")
    )
    generation = run.vllm_generation
    stream = generation._iter_named_params
    generation._iter_named_params = lambda: ((n, t) for n, t in stream() if n != "model.norm.weight")
    with pytest.raises(SyncCheckError, match="model.norm.weight"):
        generation.sync_weights()


# TRL's defaults (dapo, its sequence_mask correction), and other objectives of the catalogue TRL has too (bnpo with
# GSPO's sequence-level ratio and a KL term to a reference model; TRL's token_truncate correction). Measured: losses
# 4.5e-6 and 6.3e-7 apart, weights 3e-8 and 6e-8. On one process and on-policy, bnpo's and GSPO's gradients equal
# dapo's token-level ones (ratio 1, the same normalizer): the KL term and the correction are what differ there.
BNPO_GSPO_KL = dict(loss_type="bnpo", importance_sampling_level="sequence", beta=0.04,
                    vllm_importance_sampling_mode="token_truncate")  # fmt: skip
OBJECTIVES = {  # name: (grpo_plus's settings, stock TRL's settings)
    "defaults": ({}, {}),
    "bnpo-gspo-kl-token_truncate": (dict(BNPO_GSPO_KL), dict(BNPO_GSPO_KL)),
    # verl's decoupled token IS (grpo_plus's rollout correction, on-policy from the training forward) against TRL's
    # token_truncate at the same cap: min(pi_old / pi_rollout, 2) on every token. With a float32 server the ratios
    # are ~1 (the cap never binds): this checks the correction runs in server mode with TRL's numbers, measured
    # losses 6.3e-7 and weights 3e-8 apart; the cap itself against verl's formula: tests/test_rollout_correction.py
    "verl-decoupled_token_is": (
        dict(rollout_correction="decoupled_token_is"),
        dict(vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=2.0),
    ),
}


@pytest.mark.parametrize("objective", list(OBJECTIVES))
def test_stock_trl_in_server_mode_trains_the_same_completions_to_the_same_weights(
    server, model_dir, tmp_path, objective
):
    """grpo_plus (zero-waste pass on) and stock TRL, both in server mode against the one server: the same completions
    (seeded sampling, the same synced weights), the same losses and weights after two steps, at TRL's defaults and with
    other objectives and corrections both have."""
    runs = {}
    for package in (trl, grpo_plus):
        ours, theirs = OBJECTIVES[objective]
        config = server_config(server, tmp_path / package.__name__, **(theirs if package is trl else ours))
        run = server_trainer(package, float32_model(model_dir), model_dir, config)
        recorder = StepRecorder(run)
        run.train()
        losses = [h["loss"] for h in run.state.log_history if "loss" in h]
        runs[package.__name__] = (recorder, losses)
        corrected_by_verl = any(key.startswith("rollout_corr/") for h in run.state.log_history for key in h)
        assert corrected_by_verl == (package is grpo_plus and "rollout_correction" in ours)  # not TRL's then
    (stock, stock_losses), (plus, plus_losses) = runs["trl"], runs["grpo_plus"]
    for ours, theirs in zip(plus.generated, stock.generated, strict=True):
        assert torch.equal(ours["completion_ids"], theirs["completion_ids"])
    assert any(loss != 0 for loss in stock_losses)
    # float32, different batching of the forward (the zero-waste pass computes the trained rows only): measured
    # 4.5e-6 .. 1.27e-5 over runs on a loss of 0.0896 (relative 5e-5 .. 1.4e-4; 1e-5 failed once)
    print("loss gap", max(abs(a - b) for a, b in zip(plus_losses, stock_losses, strict=True)))
    assert plus_losses == pytest.approx(stock_losses, abs=3e-5)
    moved = max_weight_diff(stock.weights[-1], dict(float32_model(model_dir).named_parameters()))
    assert moved > 5e-5  # measured 1.2e-4
    print("weight gap", max_weight_diff(plus.weights[-1], stock.weights[-1]), "moved", moved)
    assert max_weight_diff(plus.weights[-1], stock.weights[-1]) <= 1e-6


PARTIAL_SEEDED = dict(partial_rollout_tokens=3, per_device_train_batch_size=8, max_steps=4, learning_rate=0.05,
                      save_strategy="steps", save_steps=1)  # fmt: skip


def partial_server_run(server, model_dir, output_dir, resume=None):
    """Partial rollouts against the server (chunks of 3 tokens, completions of at most 8, 2 groups a step, 8 prompts:
    the 4 steps are one epoch), sampling seeded (`generation_kwargs={"seed": 0}`: each row's request of each chunk
    its own seed), a checkpoint per step: (trainer, its StepRecorder; the final weights are the trainer's)."""
    from helpers.rewards import alternating_reward

    config = server_config(server, output_dir, **PARTIAL_SEEDED)
    trainer = server_trainer(grpo_plus, float32_model(model_dir), model_dir, config, num_prompts=8,
                             reward=alternating_reward)  # fmt: skip
    record = StepRecorder(trainer, keep_weights=False)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, record


@pytest.fixture(scope="module")
def seeded_partial_run(server, model_dir, tmp_path_factory):
    """`partial_server_run` from the start, every handoff of its pool recorded: (trainer, record, pool)."""
    from helpers.probes import PoolRecorder

    with pytest.MonkeyPatch.context() as patch:
        pool = PoolRecorder(patch)
        original = grpo_plus.GRPOTrainer._start_partial_rollouts

        def recorded(trainer):
            pool.trainer = trainer
            return original(trainer)

        patch.setattr(grpo_plus.GRPOTrainer, "_start_partial_rollouts", recorded)
        trainer, record = partial_server_run(server, model_dir, tmp_path_factory.mktemp("partial"))
    yield trainer, record, pool


def test_partial_rollouts_carry_rows_across_steps_with_the_servers_log_probs(seeded_partial_run, model_dir):
    """Partial rollouts against a server: every row is its own request, rows carry into the next step and continue
    under the weights synced then, each handoff is TRL's batch of complete groups whose rows differ (each row's request
    its own seed: one seed for all would draw one completion per group), and each token's sampler log-prob is the
    server's under the weights of its recorded version: the oracle, the float32 model loaded with those weights,
    within the server's float32 floor (the negative control: the weights of the step that trains the token, a step's
    SGD away)."""
    _, _, pool = seeded_partial_run
    assert len(pool.handoffs) == 4
    ages = [age for handoff in pool.handoffs for age in handoff.token_ages()]
    assert max(ages) == 1 and min(ages) == 0, "no row carried across steps: the chunk did not bite"
    assert any(len(set(row.versions)) > 1 for handoff in pool.handoffs for row in handoff.rows)
    for handoff in pool.handoffs:
        assert len(handoff.rows) == 8
        for start in (0, 4):
            group = handoff.rows[start : start + 4]
            assert len({str(row.prompt_ids) for row in group}) == 1 and len({str(row.tokens) for row in group}) > 1
    model = float32_model(model_dir)
    gap, wrong_gap = 0.0, 0.0
    for handoff in pool.handoffs:
        for row in handoff.rows:
            logps, versions = torch.tensor(row.logps), torch.tensor(row.versions)
            for version in set(row.versions):
                model.load_state_dict(pool.weights[version])
                oracle = model_logps(model, row.prompt_ids + row.tokens)[-len(row.tokens) :]  # temperature 1
                mine = versions == version
                gap = max(gap, (oracle - logps)[mine].abs().max().item())
            if (versions != handoff.step).any():
                model.load_state_dict(pool.weights[handoff.step])
                wrong = model_logps(model, row.prompt_ids + row.tokens)[-len(row.tokens) :]
                wrong_gap = max(wrong_gap, (wrong - logps)[versions != handoff.step].abs().max().item())
    print(f"server log-probs against the oracle {gap:.3g}; with the training step's weights {wrong_gap:.3g}")
    assert gap <= FLOAT32_FLOOR, gap
    assert wrong_gap > 10 * FLOAT32_FLOOR, wrong_gap


def test_seeded_requests_draw_from_the_models_distribution(server, model_dir, tmp_path):
    """What partial rollouts send a server with a seed (`seeded_requests`: each prompt its own request and seed,
    `row_seed` of the run's seed and the row): 300 rows of one prompt draw their first token as the model's
    distribution says (chi-squared goodness of fit, the categories expected under 5 times pooled; p > 1e-3). The
    negative control: TRL's one seed for every prompt draws one token 300 times and fails the test. The server
    serves the untouched checkpoint first (a trainer's sync: other tests leave their trained weights in it)."""
    from helpers.histograms import goodness_of_fit_p_value

    from grpo_plus.engine.server import seeded_requests
    from grpo_plus.partial_rollouts.pool import row_seed

    model = float32_model(model_dir)
    generation = server_trainer(grpo_plus, model, model_dir, server_config(server, tmp_path)).vllm_generation
    generation.sync_weights()
    client = generation.vllm_client
    ids, rows = AutoTokenizer.from_pretrained(model_dir)("I like")["input_ids"], 300  # a next token of many choices
    sampling = dict(n=1, temperature=1.0, max_tokens=1, logprobs=0, generation_kwargs={"seed": 0})
    with seeded_requests(generation, [row_seed(0, r, 0) for r in range(rows)]):
        seeded = client.generate(prompts=[ids] * rows, **sampling)["completion_ids"]
    one_seed = client.generate(prompts=[ids] * rows, **sampling)["completion_ids"]  # TRL's request
    with torch.no_grad():
        probabilities = model(torch.tensor([ids])).logits[0, -1].float().softmax(-1)
    vocab = probabilities.numel()
    counts = [torch.bincount(torch.tensor([row[0] for row in drawn]), minlength=vocab) for drawn in (seeded, one_seed)]
    p_seeded, p_one_seed = (goodness_of_fit_p_value(c, probabilities) for c in counts)
    print(f"first tokens: {len(set(r[0] for r in seeded))} distinct, p = {p_seeded:.3g}; one seed: "
          f"{len(set(r[0] for r in one_seed))} distinct, p = {p_one_seed:.3g}")  # fmt: skip
    assert p_seeded > 1e-3, p_seeded
    assert len({row[0] for row in one_seed}) == 1 and p_one_seed < 1e-6, p_one_seed


def test_partial_rollouts_against_a_server_resume_with_rows_in_flight(
    seeded_partial_run, server, model_dir, tmp_path, monkeypatch
):
    """Resumed from checkpoint-1, whose pool holds rows in flight, against the same server (whose engine's random
    state has moved on since): the same completions at every later step and the uninterrupted run's weights, 0.0
    apart, because each row's request of each chunk is seeded from the run's seed, the row and the tokens it holds.
    The negative control: the rows in flight restored without their tokens end elsewhere."""
    from helpers.probes import restore_rows_without_tokens

    from grpo_plus.run.state import SHARED_FILE

    trainer, whole, _ = seeded_partial_run
    checkpoint = f"{trainer.args.output_dir}/checkpoint-1"
    saved = torch.load(f"{checkpoint}/{SHARED_FILE}", weights_only=True)
    in_flight = [row for g in saved["parts"]["partial_rollouts"]["groups"] for row in g["rows"]]
    assert any(not row["finished"] and row["tokens"] for row in in_flight), "no row in flight: nothing is tested"
    final = dict(trainer.model.named_parameters())

    def apart(other) -> float:
        return max((final[k] - v).abs().max().item() for k, v in other.model.named_parameters())

    resumed, record = partial_server_run(server, model_dir, tmp_path / "resumed", resume=checkpoint)
    assert len(record.generated) == 3
    sampler_gap = 0.0
    for a, b in zip(whole.generated[1:], record.generated, strict=True):
        assert torch.equal(a["completion_ids"], b["completion_ids"])
        sampler_gap = max(
            sampler_gap, (a["sampling_per_token_logps"] - b["sampling_per_token_logps"]).abs().max().item()
        )
    gap = apart(resumed)
    print(
        f"resumed against the server with rows in flight: sampler log-probs {sampler_gap}, final weights {gap} apart"
    )
    if sampler_gap == 0.0:  # the server computed the same: the weights bit for bit (every run alone on the machine)
        assert gap == 0.0
    else:  # the server's float32 noise when a loaded engine batches the rows' requests otherwise (SERVER_NOISE)
        assert sampler_gap <= SERVER_NOISE and gap <= 10 * SERVER_NOISE
    restore_rows_without_tokens(monkeypatch)
    forgotten, _ = partial_server_run(server, model_dir, tmp_path / "forgotten", resume=checkpoint)
    assert apart(forgotten) > 1e-3


def test_two_processes_against_one_server_match_one_process(server, model_dir, tmp_path):
    """train_tiny.py against the server on 2 gloo processes (accelerate launch) and on 1: the same weights."""
    weights = {}
    for processes in (1, 2):
        out = tmp_path / f"p{processes}"
        flags = train_tiny_flags(
            model_dir, out, per_device_train_batch_size=4 // processes, optim="sgd", learning_rate=1e-3,
            use_vllm=True, vllm_mode="server", vllm_server_base_url=server, vllm_group_port=free_port(),
        )  # fmt: skip
        flags += ["--num_prompts", "2", "--generation_kwargs", SEEDED, "--dump_weights", f"{out}.safetensors"]
        result = run_python(
            TRAIN_TINY, *flags, launcher=accelerate_launch(processes) if processes > 1 else None, env=checkout_env(),
            timeout=600,
        )  # fmt: skip
        assert result.stdout.count("FINISHED") == processes, result.stdout[-2000:]
        weights[processes] = load_file(f"{out}.safetensors")
    initial = {k: v for k, v in float32_model(model_dir).state_dict().items() if k in weights[1]}
    assert max_weight_diff(weights[1], initial) > 1e-4, "training did not move the weights: the comparison is vacuous"
    assert max_weight_diff(weights[2], weights[1]) <= 1e-6


LORA = dict(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM")


def lora_trainer(server, model_dir, tmp_path, **overrides):
    from peft import LoraConfig

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    config = server_config(server, tmp_path, learning_rate=0.5, **overrides)
    return server_trainer(grpo_plus, base, model_dir, config, LoraConfig(**LORA))


def frozen_base(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" not in k}


def merged_reference(model_dir, trainer_model) -> torch.nn.Module:
    """PEFT's own merge (`merge_and_unload`) of the trainer's weights in a fresh float32 model: the trainer's bfloat16
    base weights upcast (exact), its adapters loaded into a LoRA model of the same config (a copy of the trainer's
    model would keep whatever the trainer wrapped around its modules)."""
    from peft import get_peft_model, set_peft_model_state_dict
    from peft.utils import get_peft_model_state_dict

    reference = float32_model(model_dir)
    base = trainer_model.get_base_model()
    with torch.no_grad():
        for name, param in reference.named_parameters():
            module_name, _, leaf = name.rpartition(".")
            held = base.get_submodule(module_name)
            held = held.get_base_layer() if hasattr(held, "get_base_layer") else held
            param.copy_(getattr(held, leaf).float())
    reference = get_peft_model(reference, copy.deepcopy(next(iter(trainer_model.peft_config.values()))))
    set_peft_model_state_dict(reference, get_peft_model_state_dict(trainer_model))
    return reference.merge_and_unload()


def test_lora_on_a_bfloat16_base_four_syncs_leave_the_base_and_serve_peft_merge(server, model_dir, tmp_path):
    """Four optimizer steps (four syncs) with grpo_plus's out-of-place stream: the frozen bfloat16 base bit-identical,
    the adapters moved, and after a last sync the server's log-probs are those of PEFT's merge (float32)."""
    run = lora_trainer(server, model_dir, tmp_path, max_steps=4, vllm_sync_check="every")
    before = frozen_base(run.model)
    adapters = {k: v.detach().clone() for k, v in run.model.named_parameters() if v.requires_grad}
    run.train()
    assert len(run.vllm_generation.sync_log.streams) == 4
    moved = max((adapters[k] - v).abs().max().item() for k, v in run.model.named_parameters() if k in adapters)
    assert moved > 1e-3, "training did not move the adapters"
    after = frozen_base(run.model)
    assert [k for k in before if not torch.equal(before[k], after[k])] == []
    run.vllm_generation.sync_weights()
    ids = probe_ids(model_dir)
    reference = model_logps(merged_reference(model_dir, run.model), ids)
    served = server_logps(server, model_dir, ids)
    print("LoRA: |server - PEFT merge|", (served - reference).abs().max().item(),
          "|server - untrained|", (served - model_logps(float32_model(model_dir), ids)).abs().max().item())  # fmt: skip
    assert (served - reference).abs().max().item() <= FLOAT32_FLOOR


def test_a_lora_stream_failing_midway_leaves_nothing_merged(server, model_dir, tmp_path):
    """A stream that fails after 20 tensors (in the first sync's announcing pass, before the server is asked for
    anything): grpo_plus's leaves every LoRA layer unmerged and the base bit-identical; TRL's in-place stream (its
    `merge_adapter` before the walk, `unmerge_adapter` after it, no `finally`) leaves the adapters merged."""
    from peft.tuners.lora import LoraLayer

    def fail_after(rename, count=20):
        calls = iter(range(10**9))

        def failing(name, *args, **kwargs):
            if next(calls) == count:
                raise RuntimeError("injected stream failure")
            return rename(name, *args, **kwargs)

        return failing

    run = lora_trainer(server, model_dir, tmp_path / "ours")
    before = frozen_base(run.model)
    stream = run.vllm_generation._iter_named_params
    stream.rename = fail_after(stream.rename)
    with pytest.raises(RuntimeError, match="injected"):
        run.vllm_generation.sync_weights()
    layers = [m for m in run.model.modules() if isinstance(m, LoraLayer)]
    assert layers and not any(layer.merged for layer in layers)
    after = frozen_base(run.model)
    assert all(torch.equal(before[k], after[k]) for k in before)

    stock = lora_trainer(server, model_dir, tmp_path / "trl")
    generation = stock.vllm_generation
    del generation.__dict__["_iter_named_params"]  # TRL's own (in-place) stream
    generation._fix_param_name_to_vllm = fail_after(generation._fix_param_name_to_vllm)
    with pytest.raises(RuntimeError, match="injected"):
        generation.sync_weights()
    assert any(m.merged for m in stock.model.modules() if isinstance(m, LoraLayer)), "TRL's stream unmerged after all"
