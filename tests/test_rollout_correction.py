"""verl's rollout correction (`rollout_is`, `rollout_rs`, the presets, bypass mode): the pure function against verl's
own code (verl_oracle, transcribed from verl) and against an oracle written from verl's docs (algorithm_oracles), for
every option, on fixed tensors with an empty row, a one-token row and ratios beyond every bound; the GRPOConfig fields
and presets; and the trainer on a tiny model whose "sampler" (a `rollout_func`) reports its own log-probs."""

from __future__ import annotations

import copy
import os
import re
from collections import defaultdict

import algorithm_oracles as oracle
import pytest
import torch
import verl_oracle as verl
from helpers.models import make_model, make_tokenizer, prompt_dataset, tiny_run_kwargs, tiny_trainer
from helpers.probes import record_trained_batches
from trl import TrlParser

import grpo_plus.algorithms.micro_batch_loss
import grpo_plus.config
import grpo_plus.trainer
from grpo_plus import GRPOConfig, available_rejection_criteria, compute_policy_loss, rollout_correction
from grpo_plus.algorithms.rollout_correction import RolloutCorrector
from grpo_plus.algorithms.settings import PRESETS, RolloutCorrectionSettings
from grpo_plus.app.testing import ForwardLog, StandInAccelerator, length_reward
from grpo_plus.config import ConfigError, PlusSettings
from grpo_plus.objective import REJECTION_CRITERIA, register_rejection_criterion

LENGTHS = [10, 0, 1, 4, 7, 5, 10, 3]
B, T = len(LENGTHS), 10
# Gaps measured on these tensors (every option below, float32 and float64, integer / float / bool masks): grpo_plus
# and verl's own code give bit-identical weights, masks and metrics (gap 0.0); grpo_plus and the docs' oracle (float64,
# exact means) differ by at most 2.4e-8 relative, where verl takes its threshold shares in float32 (`.float()`).
# Worst over 11 runs (threads 1-2, 4 input seeds, TRL 1.14-1.16; docs/notes.md, Tolerances): against verl 0.0 (so
# exact); against the oracle weights 4.4e-16 (3.4x), metrics 2.6e-8 relative (3.9x).
ORACLE_WEIGHTS_TOL, ORACLE_METRICS_TOL = 1.5e-15, 1e-7

IS_OPTIONS = [(None, False), ("token", False), ("token", True), ("sequence", False), ("sequence", True)]
# Every criterion alone (k1: an asymmetric ratio range, and one value u = 1/u_u), then chains with per-criterion
# thresholds, duplicates and spaces (verl drops duplicates and strips).
RS_OPTIONS = [(None, None)]
RS_OPTIONS += [(name, "0.8_1.5" if name.endswith("k1") else 0.05) for name in sorted(available_rejection_criteria())]
RS_OPTIONS += [
    ("seq_sum_k1", 1.5),
    ("token_k1, seq_mean_k3", "0.6_1.5, 0.02"),
    ("seq_max_k2,token_k3,seq_max_k2", "0.1"),
    ("seq_mean_k1,token_k2,seq_sum_k3", "0.999_1.001,0.5,3"),
]


def fixed_batch(dtype=torch.float64, mask_dtype=torch.long):
    """(old, rollout, mask): rows of 10, 0, 1, 4, 7, 5, 10, 3 tokens; per-row drifts put the ratios beyond every
    threshold on both sides; row 4 holds a token whose log-ratio is 25 (beyond the +-20 safety bound) and row 6 sums
    past it; NaN and inf sit off the mask (they must never enter)."""
    g = torch.Generator().manual_seed(7)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4
    drift = torch.tensor([0.02, 0.0, -0.9, 0.6, 0.1, -0.05, 2.5, -0.3], dtype=torch.float64)
    log_ratio = drift[:, None] + 0.15 * torch.randn(B, T, generator=g, dtype=torch.float64)
    log_ratio[4, 2] = 25.0
    mask = torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]
    rollout = old - log_ratio
    rollout[1, 3], old[2, 5] = float("nan"), float("inf")  # off the mask
    return old.to(dtype), rollout.to(dtype), mask.to(mask_dtype)


def verl_correction(old, rollout, mask, **options):
    weights, corrected, metrics = verl.compute_rollout_correction_and_rejection_mask(old, rollout, mask, **options)
    return (None if weights is None else weights.batch["rollout_is_weights"]), corrected, metrics


def relative_gap(ours: dict, theirs: dict) -> float:
    assert set(ours) == set(theirs), f"metric names differ: {sorted(set(ours) ^ set(theirs))}"
    return max(abs(ours[k] - theirs[k]) / max(1.0, abs(theirs[k])) for k in ours)


def assert_equal_results(ours, theirs, mask, weights_tol=0.0, metrics_tol=0.0):
    weights, corrected, metrics = ours
    their_weights, their_corrected, their_metrics = theirs
    assert (weights is None) == (their_weights is None)
    if weights is not None:  # on the mask; off it grpo_plus's are 0 (verl's are NaN where a log-prob there is NaN)
        on_mask = mask.bool()
        their_weights = torch.as_tensor(their_weights, dtype=weights.dtype)
        torch.testing.assert_close(weights[on_mask], their_weights[on_mask], atol=weights_tol, rtol=0)
        assert (weights[~on_mask] == 0).all()
    assert corrected.tolist() == torch.as_tensor(their_corrected).tolist()
    assert relative_gap(metrics, their_metrics) <= metrics_tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("rollout_is", "normalize"), IS_OPTIONS)
def test_every_option_equals_verls_own_code(dtype, rollout_is, normalize):
    """Weights, mask (its dtype too) and every metric, for each IS level and each rejection option (measured: 0.0)."""
    for mask_dtype in (torch.long, torch.float32, torch.bool):
        old, rollout, mask = fixed_batch(dtype, mask_dtype)
        for rollout_rs, threshold in RS_OPTIONS:
            options = dict(
                rollout_is=rollout_is, rollout_is_threshold=2.0, rollout_is_batch_normalize=normalize,
                rollout_rs=rollout_rs, rollout_rs_threshold=threshold,
            )  # fmt: skip
            ours = rollout_correction(old, rollout, mask, **options)
            theirs = verl_correction(old, rollout, mask, **options)
            assert_equal_results(ours, theirs, mask)
            assert ours.response_mask.dtype == theirs[1].dtype == mask.dtype


@pytest.mark.parametrize(("rollout_is", "normalize"), IS_OPTIONS)
def test_every_option_equals_the_docs_formulas(rollout_is, normalize):
    """The same options against algorithm_oracles.rollout_correction (plain Python from docs/algo/rollout_corr.md)."""
    old, rollout, mask = fixed_batch()
    for rollout_rs, threshold in RS_OPTIONS:
        ours = rollout_correction(
            old, rollout, mask, rollout_is=rollout_is, rollout_is_threshold=3.0,
            rollout_is_batch_normalize=normalize, rollout_rs=rollout_rs, rollout_rs_threshold=threshold,
        )  # fmt: skip
        docs = oracle.rollout_correction(
            old.tolist(), rollout.tolist(), mask.tolist(), rollout_is, 3.0, normalize, rollout_rs, threshold
        )
        assert_equal_results(ours, docs, mask, ORACLE_WEIGHTS_TOL, ORACLE_METRICS_TOL)


def test_the_batch_exercises_every_branch():
    """The fixed batch is not trivially inside every bound: weights truncated and bounded, both kinds of rejection,
    and sequence statistics past the safety bound (without them the comparisons above would prove little)."""
    old, rollout, mask = fixed_batch(mask_dtype=torch.bool)
    token = rollout_correction(old, rollout, mask, rollout_is="token", rollout_rs="token_k1", rollout_rs_threshold=1.5)
    sequence = rollout_correction(
        old, rollout, mask, rollout_is="sequence", rollout_rs="seq_sum_k3", rollout_rs_threshold=1
    )
    # a float32 metric: worst 2.4e-8 relative, 4.2x
    assert token.metrics["rollout_corr/rollout_is_max"] == pytest.approx(
        torch.exp(torch.tensor(20.0)).item(), rel=1e-7
    )
    assert 0 < token.metrics["rollout_corr/rollout_is_ratio_fraction_high"] < 1
    assert 0 < token.metrics["rollout_corr/rollout_is_ratio_fraction_low"] < 1
    assert 0 < token.metrics["rollout_corr/rollout_rs_token_k1_masked_fraction"] < 1
    assert 0 < sequence.metrics["rollout_corr/rollout_rs_seq_sum_k3_seq_masked_fraction"] < 1
    assert token.weights.max() == 2.0 and (token.weights[mask] < 2.0).any()  # truncated, not all
    assert (token.weights[~mask] == 0).all() and not torch.isnan(token.weights).any()
    kept_rows = sequence.response_mask.any(-1)
    assert kept_rows[0] and not kept_rows[6]  # the row summing past the bound is rejected whole


def test_negative_controls_a_wrong_correction_is_seen():
    """Each comparison above fails for a correction that is slightly wrong: the ratio the other way round, an
    asymmetric k1 range read as a range of r instead of pi_rollout / pi_old, no safety bound, no truncation."""
    old, rollout, mask = fixed_batch()
    options = dict(rollout_is="token", rollout_rs="token_k1", rollout_rs_threshold="0.8_1.5")
    reference = rollout_correction(old, rollout, mask, **options)
    swapped = rollout_correction(rollout.nan_to_num(), old.nan_to_num(), mask, **options)
    assert relative_gap(swapped.metrics, reference.metrics) > 1e-2
    assert not torch.equal(swapped.response_mask, reference.response_mask)
    as_ratio = rollout_correction(old, rollout, mask, **{**options, "rollout_rs_threshold": "0.6667_1.25"})
    assert not torch.equal(as_ratio.response_mask, reference.response_mask)
    unbounded = torch.where(mask.bool(), torch.exp(old - rollout), 0.0)
    assert (unbounded.clamp(max=2.0) - reference.weights).abs().max() == 0  # the bound acts above the cap only ...
    assert reference.metrics["rollout_corr/rollout_is_max"] < unbounded.max().item() / 100  # ... and in the metrics
    untruncated = rollout_correction(old, rollout, mask, **{**options, "rollout_is_threshold": 1e9})
    assert (untruncated.weights - reference.weights).abs().max() > 1.0


def test_errors_name_the_bad_value():
    old, rollout, mask = fixed_batch()
    for options, fragment in [
        (dict(rollout_is="geometric"), "rollout_is='geometric' is not allowed"),
        (dict(rollout_is="token", rollout_is_threshold=0), "rollout_is_threshold=0 is not allowed"),
        (dict(rollout_rs="seq_max_k1", rollout_rs_threshold=2), "Did you mean"),
        (dict(rollout_rs="token_k2"), "rollout_rs_threshold must be set"),
        (dict(rollout_rs="token_k2", rollout_rs_threshold="0.5_2"), "one upper bound"),
        (dict(rollout_rs="token_k1,token_k2", rollout_rs_threshold="1,2,3"), "has 3 entries"),
        (dict(rollout_rs="token_k1", rollout_rs_threshold="0_2"), "must be positive"),
    ]:
        with pytest.raises(ValueError, match=fragment):
            rollout_correction(old, rollout, mask, **options)
    with pytest.raises(ValueError, match="at least one token"):
        rollout_correction(old, rollout, torch.zeros_like(mask))


def test_a_registered_criterion_is_usable_by_name():
    """The rejection criteria are a registry: a criterion registered by name works in rollout_rs (here the max of
    k1, which verl does not have), with its own metrics; it is gone after the test (conftest restores registries)."""

    @register_rejection_criterion("seq_max_abs_log_ratio_test", level="sequence")
    def largest_gap(log_ratio, mask):
        return (log_ratio.abs() * mask).amax(dim=-1)

    old, rollout, mask = fixed_batch()
    result = rollout_correction(old, rollout, mask, rollout_rs="seq_max_abs_log_ratio_test", rollout_rs_threshold=0.5)
    gaps = ((old - rollout).nan_to_num().abs() * mask).amax(-1)
    assert result.response_mask.any(-1).tolist() == [
        bool(g <= 0.5) and n > 0 for g, n in zip(gaps, LENGTHS, strict=True)
    ]
    assert "rollout_corr/rollout_rs_seq_max_abs_log_ratio_test_seq_max" in result.metrics
    assert "seq_max_abs_log_ratio_test" in REJECTION_CRITERIA


def test_batch_normalization_over_processes_is_the_mean_over_every_process():
    """With `all_reduce_sum` (summing over processes), two halves of a batch normalized as two processes give the
    whole batch's weights; normalized alone, they do not (the negative control)."""
    old, rollout, mask = fixed_batch()
    halves = (slice(0, 4), slice(4, 8))
    for level in ("token", "sequence"):
        whole = rollout_correction(old, rollout, mask, rollout_is=level, rollout_is_batch_normalize=True).weights
        truncated = rollout_correction(old, rollout, mask, rollout_is=level).weights
        if level == "token":
            totals = [(truncated * mask).sum(), mask.sum().double()]
        else:
            has_tokens = (mask.sum(-1) > 0).double()
            totals = [(verl.masked_mean(truncated, mask, -1) * has_tokens).sum(), has_tokens.sum()]
        together, alone = [], []
        for half in halves:
            answers = list(totals)  # what the all-reduce returns on each process, in the order it is called
            options = dict(rollout_is=level, rollout_is_batch_normalize=True)
            together.append(
                rollout_correction(
                    old[half],
                    rollout[half],
                    mask[half],
                    **options,
                    all_reduce_sum=lambda local, answers=answers: answers.pop(0),
                ).weights
            )
            assert answers == []
            alone.append(rollout_correction(old[half], rollout[half], mask[half], **options).weights)
        torch.testing.assert_close(torch.cat(together), whole, atol=0, rtol=0)  # bit for bit in every run
        assert (torch.cat(alone) - whole).abs().max() > 1e-3


# ---- the presets and the bypass loss against verl's own code -------------------------------------------------------


def test_the_presets_are_verls():
    """Every classmethod preset of verl's RolloutCorrectionConfig, with its values; verl's bypass loss_type
    'ppo_clip' / 'reinforce' is policy_loss 'ppo_clip' / 'gpg'."""
    presets = {name for name, value in vars(verl.RolloutCorrectionConfig).items() if isinstance(value, classmethod)}
    assert set(PRESETS) == presets
    for name, preset in PRESETS.items():
        theirs = getattr(verl.RolloutCorrectionConfig, name)()
        assert preset.rollout_is == theirs.rollout_is, name
        assert preset.rollout_is_threshold == (theirs.rollout_is_threshold if theirs.rollout_is else None), name
        assert (preset.rollout_rs, preset.rollout_rs_threshold) == (theirs.rollout_rs, theirs.rollout_rs_threshold)
        assert preset.rollout_bypass_mode == theirs.bypass_mode, name
        bypass_loss = {"ppo_clip": "ppo_clip", "reinforce": "gpg"}[theirs.loss_type] if theirs.bypass_mode else None
        assert preset.policy_loss == bypass_loss, name


BYPASS_OPTIONS = [
    dict(),
    dict(rollout_rs="seq_mean_k1", rollout_rs_threshold="0.9_1.1"),
    dict(rollout_rs="token_k3,seq_max_k2", rollout_rs_threshold="0.05,0.3"),
    dict(rollout_is="token", rollout_rs="seq_mean_k1", rollout_rs_threshold="0.9_1.1"),
    dict(rollout_is="sequence", rollout_is_batch_normalize=True),
]


# verl's two bypass losses with each option (IS weights with PPO-clip are refused at config time: verl computes them for
# its metrics only).
BYPASS_CASES = [
    pytest.param(loss_type, options, id=f"{loss_type}-" + (",".join(f"{k}={v}" for k, v in options.items()) or "none"))
    for loss_type in ("ppo_clip", "reinforce")
    for options in BYPASS_OPTIONS
    if not (loss_type == "ppo_clip" and "rollout_is" in options)
]


@pytest.mark.parametrize(("loss_type", "options"), BYPASS_CASES)
def test_bypass_loss_equals_verls_bypass_mode(loss_type, options):
    """The trainer's bypass path (RolloutCorrector.loss_inputs, then compute_policy_loss with ppo_clip and verl's
    dual clip 3, or gpg with the IS weights; bnpo is verl's token-mean) against verl's compute_policy_loss_bypass_mode:
    loss, gradient and the correction's metrics."""
    policy_loss = "gpg" if loss_type == "reinforce" else "ppo_clip"
    old, sampled, mask = (t.nan_to_num(posinf=0.0) for t in fixed_batch())
    logps = old  # the training forward's log-probs; the sampler's are the old policy in bypass mode
    advantages = torch.linspace(-1.0, 1.2, B, dtype=torch.float64)
    settings = RolloutCorrectionSettings(**options, rollout_bypass_mode=True)
    corrector = RolloutCorrector(settings, policy_loss)
    logged = {}

    def ours(current):
        metrics = logged.setdefault("ours", defaultdict(list))
        inputs = {"sampling_per_token_logps": sampled}
        corrected = corrector.loss_inputs(current, inputs, mask, None, StandInAccelerator.reduce, metrics)
        return compute_policy_loss(
            current, corrected.old_logps, advantages, corrected.mask, loss_type="bnpo", policy_loss=policy_loss,
            epsilon=0.2, epsilon_high=0.28, dual_clip=3.0 if policy_loss == "ppo_clip" else None,
            policy_weights=corrected.weights,
        ).loss  # fmt: skip

    def theirs(current):
        correction = {"loss_type": loss_type, **options}
        config = verl.ActorConfig(
            clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28,
            policy_loss=verl.ActorConfig(rollout_correction=correction),
        )  # fmt: skip
        token_advantages = advantages[:, None].expand(B, T)
        loss, metrics = verl.compute_policy_loss_bypass_mode(sampled, current, token_advantages, mask, config=config)
        logged["theirs"] = metrics
        return loss

    loss, grad = grad_of(ours, logps)
    verl_loss, verl_grad = grad_of(theirs, logps)
    assert loss.item() == verl_loss.item() and verl_grad.abs().max() > 1e-3
    torch.testing.assert_close(grad, verl_grad, atol=0, rtol=0)
    ours_metrics = {name: values[-1] for name, values in logged["ours"].items()}
    theirs_metrics = {k: v for k, v in logged["theirs"].items() if k.startswith("rollout_corr/")}
    assert relative_gap(ours_metrics, theirs_metrics) <= 2e-7  # logged through float32: worst 5.3e-8, 3.8x


def grad_of(loss_fn, logps):
    leaf = logps.detach().clone().requires_grad_()
    loss = loss_fn(leaf)
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss.detach(), grad


def test_bypass_rejection_judges_only_the_rows_the_forward_computed():
    """Rows the zero-waste pass left out (zero advantage) keep their mask and stay out of the metrics; the computed
    rows get what the correction of those rows alone gives."""
    old, sampled, mask = (t.nan_to_num(posinf=0.0) for t in fixed_batch())
    options = dict(rollout_rs="token_k1", rollout_rs_threshold="0.9_1.1")
    corrector = RolloutCorrector(RolloutCorrectionSettings(**options, rollout_bypass_mode=True), "ppo_clip", True)
    computed = torch.tensor([True, True, False, True, False, True, True, True])
    metrics = defaultdict(list)
    inputs = {"sampling_per_token_logps": sampled}
    result = corrector.loss_inputs(old, inputs, mask, computed, StandInAccelerator.reduce, metrics)
    alone = rollout_correction(old, sampled, mask * computed[:, None], **options)
    assert torch.equal(result.mask[computed], alone.response_mask[computed])
    assert torch.equal(result.mask[~computed], mask[~computed])
    assert not torch.equal(result.mask[computed], mask[computed])  # something was rejected
    logged = {name: values[-1] for name, values in metrics.items()}
    assert set(logged) == {name.replace("rollout_corr/", "rollout_corr/trained_rows/") for name in alone.metrics}
    everything = rollout_correction(old, sampled, mask, **options).metrics
    kl = logged["rollout_corr/trained_rows/kl"]
    assert kl == pytest.approx(alone.metrics["rollout_corr/kl"], rel=1e-7)  # worst 3.3e-8: 3x
    assert abs(kl - everything["rollout_corr/kl"]) > 1e-3


# ---- GRPOConfig ---------------------------------------------------------------------------------------------------


def make(**kwargs) -> GRPOConfig:
    return GRPOConfig(output_dir="unused", use_cpu=True, bf16=False, report_to="none", **kwargs)


@pytest.mark.parametrize("name", list(PRESETS))
def test_a_preset_expands_into_the_settings(name):
    """The run's settings hold the preset's fields; the config keeps what it was given (the preset's name only)."""
    preset, config = PRESETS[name], make(rollout_correction=name)
    settings = PlusSettings.from_config(config)
    rollout = settings.rollout
    assert (rollout.rollout_is, rollout.rollout_is_threshold) == (preset.rollout_is, preset.rollout_is_threshold)
    assert (rollout.rollout_rs, rollout.rollout_rs_threshold) == (preset.rollout_rs, preset.rollout_rs_threshold)
    assert rollout.rollout_bypass_mode == preset.rollout_bypass_mode and rollout.rollout_correction == name
    assert settings.algorithms.policy_loss == (preset.policy_loss or "ppo_clip")
    assert (config.rollout_is, config.rollout_rs, config.rollout_bypass_mode, config.policy_loss) == (
        None, None, False, "ppo_clip"
    )  # fmt: skip
    # The expanded settings are a config of their own: normalizing them again changes nothing.
    assert RolloutCorrectionSettings(**{**vars(rollout)}) == rollout


def test_a_presets_thresholds_are_its_parameters():
    """verl's presets take their thresholds as parameters: the config's own values replace the preset's."""
    config = make(rollout_correction="decoupled_k3_rs_token_tis", rollout_is_threshold=3.0, rollout_rs_threshold=0.05)
    rollout = PlusSettings.from_config(config).rollout
    assert (rollout.rollout_is, rollout.rollout_is_threshold, rollout.rollout_rs_threshold) == ("token", 3.0, 0.05)
    same = make(rollout_correction="decoupled_seq_is", rollout_is="sequence")  # the preset's own value: no conflict
    assert PlusSettings.from_config(same).rollout.rollout_is == "sequence"


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        (dict(rollout_correction="decoupled_seq_iss"), "Did you mean 'decoupled_seq_is'?"),
        (dict(rollout_correction="decoupled_seq_is", rollout_is="token"), "conflicts with rollout_correction"),
        (dict(rollout_correction="decoupled_geo_rs", rollout_rs="seq_mean_k3"), "sets rollout_rs='seq_mean_k1'"),
        (dict(rollout_correction="decoupled_token_is", rollout_bypass_mode=True), "sets rollout_bypass_mode=False"),
        (dict(rollout_correction="bypass_pg_is", policy_loss="cispo"), "sets policy_loss='gpg'"),
        (dict(rollout_correction="bypass_ppo_clip", policy_loss="gpg"), "sets policy_loss='ppo_clip'"),
        (dict(rollout_correction="decoupled_geo_rs", rollout_is_threshold=3.0), "has nothing to apply to"),
        (dict(rollout_is="geometric"), "rollout_is='geometric' is not allowed"),
        (dict(rollout_is="token", rollout_is_threshold=0.0), "rollout_is_threshold=0.0 is not allowed"),
        (dict(rollout_is_threshold=3.0), "has no effect without rollout_is"),
        (dict(rollout_is_batch_normalize=True), "has no effect without rollout_is"),
        (dict(rollout_rs="seq_mean_k4", rollout_rs_threshold=1), "Did you mean"),
        (dict(rollout_rs="token_k1"), "rollout_rs_threshold must be set"),
        (dict(rollout_rs_threshold=0.1), "has no effect without rollout_rs"),
        (dict(rollout_rs="seq_max_k3", rollout_rs_threshold="0.5_2"), "one upper bound"),
        (dict(rollout_is="token", loss_type="vespo"), "cannot be combined with loss_type='vespo'"),
        (dict(rollout_bypass_mode=True, rollout_is="token"), "needs policy_loss='gpg'"),
        (
            dict(rollout_is="token", use_vllm=True, vllm_importance_sampling_mode="token_truncate"),
            "both TRL's vLLM correction",
        ),
        (dict(rollout_correction="disabled", use_vllm=True, vllm_importance_sampling_clip_max=5.0), "choose one"),
    ],
)
def test_bad_rollout_settings_fail_at_construction(kwargs, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        make(**kwargs)


def test_trls_correction_is_kept_without_ours_and_replaced_by_it():
    """TRL's vllm_importance_sampling_* keep working unchanged when no rollout_* field is set; a rollout_* setting
    turns TRL's off (TRL's mode and bounds at their defaults), so the two never stack."""
    trl_only = make(
        use_vllm=True, vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=2.0
    )
    assert "vllm_importance_sampling_correction" not in PlusSettings.from_config(trl_only).trl_fields
    assert (trl_only.vllm_importance_sampling_mode, trl_only.vllm_importance_sampling_clip_max) == (
        "token_truncate",
        2.0,
    )
    ours = make(use_vllm=True, rollout_correction="decoupled_token_is")
    assert PlusSettings.from_config(ours).trl_fields["vllm_importance_sampling_correction"] is False  # TRL's trainer
    assert ours.vllm_importance_sampling_correction is True  # the user's config as it was given
    both_off = make(use_vllm=True, rollout_is="token", vllm_importance_sampling_correction=False,
                    vllm_importance_sampling_mode="token_truncate")  # fmt: skip
    assert PlusSettings.from_config(both_off).rollout.rollout_is == "token"


def test_the_command_line_parses_the_rollout_fields(tmp_path):
    """TRL's parser: a threshold string "lower_upper" stays a string, a number a number once validated."""
    args = [
        "--output_dir", str(tmp_path), "--use_cpu", "--bf16", "false", "--report_to", "none",
        "--rollout_correction", "decoupled_seq_is_rs", "--rollout_rs_threshold", "0.6_1.6",
        "--rollout_is_threshold", "3",
    ]  # fmt: skip
    (config,) = TrlParser((GRPOConfig,)).parse_args_and_config(args=args)
    rollout = PlusSettings.from_config(config).rollout
    assert (rollout.rollout_is, rollout.rollout_is_threshold) == ("sequence", 3.0)
    assert (rollout.rollout_rs, rollout.rollout_rs_threshold) == ("seq_sum_k1", "0.6_1.6")
    with pytest.raises(SystemExit):  # argparse's choices
        TrlParser((GRPOConfig,)).parse_args_and_config(args=[*args[:6], "--rollout_is", "geometric"])


# ---- the trainer: a tiny model, a "sampler" that reports its log-probs --------------------------------------------


class StaleSampler:
    """A `rollout_func` as TRL documents it: random digit completions and the log-probs of a sampler that is a frozen
    copy of the trainer's initial weights plus noise (as an engine in another precision, one step behind from the
    second generation on); the first token of the first completion gets None (an unscored token, TRL's NaN)."""

    def __init__(self, model, noise: float = 0.05):
        self.model, self.noise = copy.deepcopy(model).eval(), noise

    def __call__(self, prompts, trainer):
        tokenizer = trainer.processing_class
        prompt_ids = tokenizer(prompts)["input_ids"]
        digits = tokenizer.convert_tokens_to_ids(list("0123456789"))
        completions, logprobs = [], []
        for prompt in prompt_ids:
            length = int(torch.randint(2, 7, ()))
            completion = [digits[int(i)] for i in torch.randint(0, 10, (length,))] + [tokenizer.eos_token_id]
            with torch.no_grad():
                logits = self.model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
            chosen = logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
            completions.append(completion)
            logprobs.append((chosen + self.noise * torch.randn(chosen.shape)).tolist())
        logprobs[0][0] = None
        return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": logprobs}


def sampled_trainer(output_dir, **settings):
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    tokenizer = make_tokenizer()
    model = make_model(tokenizer)
    return grpo_plus.GRPOTrainer(
        model=model, processing_class=tokenizer, reward_funcs=[length_reward],
        args=GRPOConfig(**tiny_run_kwargs(output_dir, **settings)), train_dataset=prompt_dataset(8),
        rollout_func=StaleSampler(model),
    )  # fmt: skip


def record_loss_arguments(monkeypatch) -> list[dict]:
    """Every call of the trainer's `compute_policy_loss` (its micro-batch loss's): its log-probs, old log-probs, mask and policy weights."""
    calls = []

    def recording(logps, old_logps, advantages, mask, **kwargs):
        weights = kwargs.get("policy_weights")
        calls.append(dict(logps=logps.detach().clone(), old=old_logps.clone(), mask=mask.clone(), weights=weights))
        return compute_policy_loss(logps, old_logps, advantages, mask, **kwargs)

    monkeypatch.setattr(grpo_plus.algorithms.micro_batch_loss, "compute_policy_loss", recording)
    return calls


def test_decoupled_mode_trains_on_verls_weights_and_mask(tmp_path, monkeypatch):
    """On-policy, two generation batches (the second from a sampler one step behind): each micro-batch carries the
    weights and mask of the correction of the trainer's old log-probs against the sampler's, the loss takes exactly
    those (the policy term times the weights, aggregated over the mask, dapo's token count recounted over it), the
    unscored token counts as matched, and the metrics are logged under verl's names."""
    options = dict(rollout_is="token", rollout_rs="token_k1", rollout_rs_threshold="0.95_1.05")
    trainer = sampled_trainer(tmp_path, **options)
    batches, calls = record_trained_batches(trainer), record_loss_arguments(monkeypatch)
    trainer.train()
    assert len(batches) == len(calls) == 2
    for (_, batch), call in zip(batches, calls, strict=True):
        mask = batch["completion_mask"]
        sampled = batch["sampling_per_token_logps"]
        expected = rollout_correction(
            batch["old_per_token_logps"], sampled.nan_to_num(0.0) + torch.isnan(sampled) * batch["old_per_token_logps"],
            mask, **options,
        )  # fmt: skip
        torch.testing.assert_close(batch["rollout_is_weights"], expected.weights, atol=0, rtol=0)
        assert torch.equal(batch["rollout_response_mask"], expected.response_mask)
        assert batch["num_items_in_batch"] == expected.response_mask.sum()
        assert torch.equal(call["weights"], batch["rollout_is_weights"]) and torch.equal(
            call["mask"], expected.response_mask
        )
        # the old log-probs are the trainer's own at generation: the training forward's, on-policy
        torch.testing.assert_close(call["old"], call["logps"], atol=3e-6, rtol=0)  # float32: worst 9.5e-7, 3.1x
        assert not torch.isnan(call["weights"]).any()
    # the correction acted: weights other than 1, tokens rejected (without it the checks above prove nothing)
    weights, kept = batches[-1][1]["rollout_is_weights"], batches[-1][1]["rollout_response_mask"]
    assert ((weights - 1).abs() > 1e-3).any() and (kept < batches[-1][1]["completion_mask"]).any()
    logged = trainer.state.log_history[0]
    assert {"rollout_corr/kl", "rollout_corr/rollout_is_mean", "rollout_corr/rollout_rs_masked_fraction"} <= set(
        logged
    )


def test_bypass_mode_runs_no_old_log_prob_pass(tmp_path, monkeypatch):
    """Two optimizer steps on one generation batch (num_iterations=2, where TRL computes old log-probs at generation):
    in bypass mode every forward of the trainer's model carries gradient, the loss's old log-probs are the sampler's,
    and policy_loss='gpg' (bypass_pg_*) takes the IS weights of the training forward against the sampler. The
    negative control, the same run in decoupled mode, makes a no-grad pass."""
    settings = dict(num_iterations=2, max_steps=2, rollout_rs_threshold="0.98_1.02")  # the preset's is +-0.1%
    trainer = sampled_trainer(tmp_path / "bypass", rollout_correction="bypass_pg_geo_rs_token_tis", **settings)
    forwards, batches, calls = (
        ForwardLog(trainer.model),
        record_trained_batches(trainer),
        record_loss_arguments(monkeypatch),
    )
    trainer.train()
    assert forwards.calls and all(call["grad"] for call in forwards.calls)
    assert all("old_per_token_logps" not in batch for _, batch in batches)
    options = trainer._rollout_correction.options
    for (_, batch), call in zip(batches, calls, strict=True):
        sampled = batch["sampling_per_token_logps"]
        known = torch.where(torch.isnan(sampled), call["logps"], sampled)
        assert torch.equal(call["old"], known)
        mask = batch["completion_mask"]
        expected = rollout_correction(call["logps"], known, mask, **options)
        torch.testing.assert_close(call["weights"], expected.weights, atol=0, rtol=0)
        assert torch.equal(call["mask"], expected.response_mask)
    assert not torch.equal(calls[0]["logps"], calls[1]["logps"])  # the second step's weights are off-policy ones
    assert calls[1]["mask"].any() and (calls[1]["mask"] < batches[1][1]["completion_mask"]).any()  # kept, rejected

    control = sampled_trainer(tmp_path / "decoupled", rollout_correction="decoupled_geo_rs_token_tis", **settings)
    control_forwards = ForwardLog(control.model)
    control.train()
    assert any(not call["grad"] for call in control_forwards.calls)


def test_a_sampler_without_log_probs_is_refused(tmp_path):
    with pytest.raises(ValueError, match="cannot correct this sampler"):
        tiny_trainer(tmp_path, [length_reward], rollout_correction="decoupled_token_is")
