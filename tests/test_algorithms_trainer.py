"""The published algorithms inside grpo_plus.GRPOTrainer: the estimator sees every completion's length, ReMax's greedy
baseline is a greedy generation's reward, cispo / sapo equal TRL's own losses in training, the zero-waste pass is exact
for each policy loss that declares it, bad combinations fail at config time, and `grpo-plus list` / `compare` know
every method. (The adaptive KL coefficient's exact resume is tested in test_resume.py.)"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
import torch
import trl
from helpers.models import prompt_dataset, tiny_trainer
from helpers.probes import max_weight_diff
from helpers.rewards import digit_reward, half_dead_reward, length_reward
from helpers.tolerances import float32_bound
from test_train_pass_trainer import assert_same_gradient, loss_and_grads, make_trainer, micro_batch, set_zero_waste
from test_trainer_parity import train
from transformers import AutoModelForCausalLM, AutoTokenizer

import grpo_plus
from grpo_plus import compute_advantages
from grpo_plus.app.cli import main
from grpo_plus.app.compare import PRESETS, check_configuration
from grpo_plus.config import ConfigError, PlusSettings
from grpo_plus.objective import POLICY_LOSSES, ZERO_ADVANTAGE_ROWS_CONTRIBUTE_NOTHING

pytestmark = pytest.mark.floor("cpu_logps")
G = 4
# The zero-waste pass against the full pass in a float32 model, per policy loss: worst gradient gap over threads 1-2
# and eight input seeds 1.9e-8 on AVX-512 (gmpo), 7.5e-8 on AVX2 (sapo); the losses bit for bit on AVX-512, up to one
# float32 ulp apart on AVX2 (relative 1.1e-7): docs/notes.md, Tolerances
ALGORITHM_GRADIENT_BOUND = float32_bound(avx512=6e-8, avx2=2e-7)
ALGORITHM_LOSS_BOUND = float32_bound(avx512=0.0, avx2=3e-7)


def trainer_on(tiny_model_dir, tmp_path, rewards=(length_reward, digit_reward), **settings):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    trainer = tiny_trainer(
        tmp_path, list(rewards), model=model, tokenizer=AutoTokenizer.from_pretrained(tiny_model_dir), **settings
    )
    trainer.model.train()
    return trainer


def one_round(trainer, num_prompts=2):
    rows = [prompt_dataset(8)[i] for i in range(num_prompts) for _ in range(G)]
    return rows, trainer._generate_and_score_completions(rows)


# ---- the estimator's inputs ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("estimator", ["opo", "reinforce_plus_plus"])
def test_length_aware_estimators_see_every_completions_loss_tokens(tiny_model_dir, tmp_path, estimator):
    trainer = trainer_on(
        tiny_model_dir, tmp_path, advantage_estimator=estimator, scale_rewards="none", per_device_train_batch_size=8,
        mask_truncated_completions=True, max_completion_length=6,
    )  # fmt: skip
    _, output = one_round(trainer)
    rewards = grpo_plus.objective.combine_rewards(trainer._rewards_per_func, trainer.reward_weights)
    mask = output["completion_mask"]
    assert 0 < mask.sum(1).min() < mask.sum(1).max() or (mask.sum(1) == 0).any()  # lengths differ: the test bites
    expected = compute_advantages(rewards, G, "none", estimator=estimator, completion_mask=mask)
    torch.testing.assert_close(output["advantages"], expected, atol=0, rtol=0)
    assert not torch.allclose(expected, compute_advantages(rewards, G, "none"))


def test_remax_baseline_is_the_reward_of_a_greedy_completion(tiny_model_dir, tmp_path):
    """One greedy completion per prompt through TRL's generation (zero-waste generation included), scored by the
    reward functions; the sampled completions, their logged metrics and the token count are those of a plain round."""
    trainer = trainer_on(
        tiny_model_dir, tmp_path, advantage_estimator="remax", scale_rewards="none", per_device_train_batch_size=8
    )
    calls = []
    generate = trainer.model.generate
    trainer.model.generate = lambda *a, **k: calls.append(k.get("generation_config")) or generate(*a, **k)
    rows, output = one_round(trainer)
    assert [c.do_sample for c in calls] == [True, False]  # the round's sampling, then one greedy pass
    tokenizer = trainer.processing_class
    greedy_rewards = []
    for row in rows[::G]:  # the baseline, independently: transformers' greedy decoding of each prompt alone
        ids = tokenizer(row["prompt"], return_tensors="pt")
        out = generate(**ids, do_sample=False, max_new_tokens=trainer.max_completion_length,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        text = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
        greedy_rewards.append(length_reward([text])[0] + digit_reward([text])[0])
    rewards = grpo_plus.objective.combine_rewards(trainer._rewards_per_func, trainer.reward_weights)
    expected = rewards - torch.tensor(greedy_rewards).repeat_interleave(G)
    torch.testing.assert_close(output["advantages"], expected, atol=0, rtol=0)
    # logged through float32: worst 2.0e-8 relative, 3x
    assert trainer._metrics["train"]["remax/greedy_reward"] == [pytest.approx(sum(greedy_rewards) / 2, rel=6e-8)]
    assert len(trainer._metrics["train"]["completions/mean_length"]) == 1  # the greedy pass is not logged as samples
    assert trainer.state.num_input_tokens_seen == int(output["prompt_mask"].sum() + output["completion_mask"].sum())


def test_remax_needs_whole_groups_per_process_and_transformers_generation(tmp_path):
    with pytest.raises(ConfigError, match=r"needs per_device_train_batch_size \* steps_per_generation \(3 \* 2 = 6\)"):
        make_config(tmp_path, advantage_estimator="remax", per_device_train_batch_size=3, num_generations=4,
                    steps_per_generation=2)  # fmt: skip
    with pytest.raises(ConfigError, match=r"per_device_eval_batch_size \(6\) to be a multiple .* \(4\)"):
        make_config(tmp_path, advantage_estimator="remax", eval_strategy="steps", per_device_eval_batch_size=6,
                    num_generations=4)  # fmt: skip
    with pytest.raises(ConfigError, match="cannot be combined with use_vllm=True"):
        make_config(tmp_path, advantage_estimator="remax", use_vllm=True)


# ---- policy losses in training -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_cispo_computed_by_grpo_plus_trains_as_trls_cispo_with_rows_skipped(tiny_model_dir, tmp_path):
    """policy_loss='cispo' + loss_type='dapo' is TRL's loss_type='cispo': same weights after off-policy steps (the cap
    hit), while grpo_plus's zero-waste pass skips the dead groups' rows TRL computes."""
    settings = dict(epsilon_high=1.02, gradient_accumulation_steps=2, steps_per_generation=4, learning_rate=1.0)
    trl_weights, trl_logs, _ = train(tiny_model_dir, tmp_path / "trl", trl, (half_dead_reward,), loss_type="cispo",
                                     **settings)  # fmt: skip
    our_weights, our_logs, _ = train(tiny_model_dir, tmp_path / "ours", grpo_plus, (half_dead_reward,),
                                     loss_type="dapo", policy_loss="cispo", **settings)  # fmt: skip
    assert max_weight_diff(trl_weights, our_weights) <= 2e-8  # worst 5.6e-9: 3.6x
    assert any(entry.get("cispo_clip_ratio", 0) > 0 for entry in trl_logs), "the cap never hit"
    for trl_entry, our_entry in zip(trl_logs, our_logs, strict=True):
        for key in ("loss", "cispo_clip_ratio", "reward"):
            if key in trl_entry:
                assert our_entry[key] == pytest.approx(trl_entry[key], rel=1e-6, abs=1e-8), (
                    key
                )  # worst 3.6e-7 relative: 2.8x
    assert any(entry.get("zero_waste/rows_computed_frac", 1) < 1 for entry in our_logs), "no row was skipped"


@pytest.fixture(scope="module")
def micro_batch_trainer():
    trainer = make_trainer(loss_type="dapo", dtype=torch.float32)
    return trainer, micro_batch(trainer)


def with_algorithm(trainer, **algorithm):
    """The trainer as if built with these algorithm settings (settings are read once, at construction)."""
    options = {k: algorithm.pop(k) for k in list(algorithm) if k.startswith(("clip_cov", "kl_cov", "sapo"))}
    chosen = dataclasses.replace(trainer.plus.algorithms, **algorithm, policy_loss_options=options)
    trainer.plus = dataclasses.replace(trainer.plus, algorithms=chosen)
    return trainer


@pytest.mark.parametrize("policy_loss", ["gmpo", "gpg", "cispo", "sapo", "clip_cov", "kl_cov"])
def test_zero_waste_pass_is_exact_for_each_policy_loss_that_declares_it(micro_batch_trainer, policy_loss):
    """Declared: the pass skips the dead rows and the gradient is the full pass's. Not declared (Clip-Cov, KL-Cov):
    the pass computes every row, and says why."""
    trainer, inputs = micro_batch_trainer
    options = {"clip_cov": dict(clip_cov_ratio=0.3, clip_cov_lb=0.0), "kl_cov": dict(kl_cov_ratio=0.3)}
    with_algorithm(trainer, policy_loss=policy_loss, **options.get(policy_loss, {}))
    declared = POLICY_LOSSES.entry(policy_loss).trait(ZERO_ADVANTAGE_ROWS_CONTRIBUTE_NOTHING)
    set_zero_waste(trainer, on=False)
    torch.manual_seed(0)
    full = loss_and_grads(trainer, inputs)
    set_zero_waste(trainer, on=True)
    torch.manual_seed(0)
    saved = loss_and_grads(trainer, inputs)
    skipped = trainer._metrics["train"]["zero_waste/rows_computed_frac"][-1] < 1
    assert skipped == declared
    if declared:
        assert_same_gradient(full, saved, tol=ALGORITHM_GRADIENT_BOUND, loss_rel_tol=ALGORITHM_LOSS_BOUND)
    else:
        assert f"policy_loss={policy_loss!r} reads zero-advantage rows" in trainer._zero_waste.row_skip_blocker
    with_algorithm(trainer, policy_loss="ppo_clip")
    set_zero_waste(trainer, on=True)


def test_sapo_in_the_trainer_is_trls_sapo_with_the_configured_temperatures(micro_batch_trainer):
    trainer, inputs = micro_batch_trainer
    with_algorithm(trainer, policy_loss="sapo", sapo_temperature_pos=0.5, sapo_temperature_neg=2.0)
    trainer.loss_type = "grpo"
    set_zero_waste(trainer, on=False)
    ours = loss_and_grads(trainer, inputs)
    trainer.loss_type, trainer.args.sapo_temperature_pos, trainer.args.sapo_temperature_neg = "sapo", 0.5, 2.0
    trainer.model.zero_grad(set_to_none=True)
    trl_loss = trl.GRPOTrainer._compute_loss(trainer, trainer.model, inputs)
    trl_loss.backward()
    theirs = (trl_loss.item(), {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None})
    assert_same_gradient(theirs, ours, tol=0.0)  # bit for bit in every run
    trainer.loss_type = "dapo"
    with_algorithm(trainer, policy_loss="ppo_clip")
    set_zero_waste(trainer, on=True)


# ---- config-time errors ------------------------------------------------------------------------------------------


def make_config(tmp_path, **kwargs):
    return grpo_plus.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(advantage_estimator="rlo"), r"advantage_estimator='rlo' is not registered. Did you mean 'rloo'\?"),
        (dict(policy_loss="gmp"), r"policy_loss='gmp' is not registered. Did you mean 'gmpo'\?"),
        (dict(kl_estimator="k4"), r"kl_estimator='k4' is not registered.*Allowed: abs, abs\+, k1"),
        (dict(loss_type="cispo", policy_loss="gmpo"), "TRL computes that loss itself.*policy_loss='cispo' with"),
        (dict(loss_type="sapo", kl_estimator="k1", beta=0.1), "kl_estimator='k1' cannot be combined with loss_type"),
        (dict(policy_loss="gmpo", importance_sampling_level="sequence"), "defined for token only"),
        (dict(policy_loss="cispo", delta=2.0), "delta=2.0 cannot be combined with policy_loss='cispo'"),
        (dict(policy_loss="clip_cov", clip_cov_lb=6.0), r"clip_cov_lb=6.0 is not allowed.*below clip_cov_ub=5.0"),
        (dict(policy_loss="kl_cov", kl_cov_ratio=0.0), "kl_cov_ratio=0.0 is not allowed"),
        (dict(advantage_estimator="rloo", multi_objective_aggregation="normalize_then_sum"), "sum_then_normalize"),
        (dict(adaptive_kl_target=0.1), r"adaptive_kl_target=0.1 needs beta > 0 \(got beta=0.0\)"),
        (dict(adaptive_kl_target=0.1, beta=0.1, adaptive_kl_horizon=0), "adaptive_kl_horizon=0 is not allowed"),
        (dict(adaptive_kl_target=0.1, beta=0.1, loss_type="cispo"), "adaptive_kl_target cannot be combined"),
    ],
)
def test_bad_names_and_combinations_fail_at_config_time(tmp_path, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        make_config(tmp_path, **kwargs)


def test_a_registered_normalizer_with_another_estimator_fails_at_config_time(tmp_path):
    grpo_plus.register_advantage_normalizer("halved_test")(lambda grouped, eps: grouped / 2)
    make_config(tmp_path, scale_rewards="halved_test")  # fine with grpo
    with pytest.raises(ConfigError, match="scale_rewards='halved_test' cannot be combined with advantage_estimator"):
        make_config(tmp_path, scale_rewards="halved_test", advantage_estimator="opo")


def test_aliases_are_canonicalized(tmp_path):
    config = make_config(tmp_path, kl_estimator="mse", beta=0.1)
    assert PlusSettings.from_config(config).algorithms.kl_estimator == "k2" and config.kl_estimator == "mse"


# ---- grpo-plus list / compare ----------------------------------------------------------------------------------------


def test_list_shows_every_method_with_its_formula_and_paper(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for field in ("advantage_estimator:", "policy_loss:", "kl_estimator:", "loss_type:", "scale_rewards:"):
        assert field in out
    assert "rloo" in out and "A_i = r_i - mean_{j != i}(r_j)" in out and "https://arxiv.org/abs/2402.14740" in out
    assert "gmpo" in out and "https://arxiv.org/abs/2507.20673" in out
    assert "scale_rewards ignored" in out  # which estimators scale themselves
    assert "not split-invariant" in out  # Clip-Cov / KL-Cov


@pytest.mark.parametrize("preset", ["rloo", "reinforce_plus_plus", "gmpo", "clip_cov", "kl_cov", "remax", "cispo"])
def test_compare_presets_for_the_new_methods_are_valid_configs(preset):
    check_configuration(preset, PRESETS[preset])


def test_remax_cost_benchmark_smoke(tmp_path, capsys, monkeypatch):
    """benchmarks/remax_cost.py runs (in process: the tiny model, 2 rounds) and reports both estimators and the ratio."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "remax_cost.py"
    monkeypatch.syspath_prepend(str(path.parent))  # it imports benchmarks/harness/, as run from there
    spec = importlib.util.spec_from_file_location("remax_cost", path)
    remax_cost = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(remax_cost)
    assert remax_cost.main(["--smoke", "--json", str(tmp_path / "remax.json")]) == 0
    report = json.loads((tmp_path / "remax.json").read_text())
    assert [len(report["rounds"][name]["wall"]) for name in ("grpo", "remax")] == [2, 2]
    assert report["summary"]["remax_over_grpo_cpu"] > 0
    assert "remax / grpo: wall" in capsys.readouterr().out
