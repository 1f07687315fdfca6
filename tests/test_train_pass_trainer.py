"""Zero-waste training pass in grpo_plus.GRPOTrainer: the same gradient and log-probs as TRL's full forward, with fewer
positions computed; the fallbacks to the full forward, each named."""

from __future__ import annotations

import functools
import logging
import math

import pytest
import torch
import trl
from helpers.models import make_tokenizer, prompt_dataset, tiny_config, tiny_trainer
from helpers.probes import ForwardLog
from helpers.tolerances import float32_bound
from transformers import AutoModelForCausalLM

import grpo_plus
from grpo_plus import GRPOTrainer
from grpo_plus.algorithms.loss_metrics import TRAINED_ROWS_ENTROPY
from grpo_plus.compat.model import reference_model
from grpo_plus.compat.versions import version_gap
from grpo_plus.zero_waste.rows import pack_shared_prompts, rows_with_gradient

G, GROUPS, PROMPT_WIDTH, COMPLETION_WIDTH = 4, 4, 12, 10
# The shared-prompt forward scores packed rows through TRL's fused LM head (TRL >= 1.15); on TRL 1.14 only rows and
# padding are skipped.
HAS_FUSED_LM_HEAD = version_gap("shared_prompt") is None  # what the docs promise, not what TRL is detected to have
needs_fused_lm_head = pytest.mark.floor("shared_prompt")
# Every test here runs a training forward on CPU, which TRL 1.15 cannot do (its log-prob kernel is Triton-only).
pytestmark = pytest.mark.floor("cpu_logps")


def make_trainer(
    family: str = "llama",
    attn: str = "sdpa",
    config_overrides=None,
    dtype=torch.float64,
    peft_config=None,
    model_config=None,
    **args,
) -> GRPOTrainer:
    """A grpo_plus trainer around a tiny model (`family`, or `model_config`); the tests feed `_compute_loss`
    hand-made micro-batches."""
    tokenizer = make_tokenizer()
    torch.manual_seed(0)
    config = model_config or tiny_config(family, len(tokenizer), **(config_overrides or {}))
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    settings = dict(
        per_device_train_batch_size=G * GROUPS,
        num_generations=G,
        max_completion_length=COMPLETION_WIDTH,
        epsilon_high=0.28,
        temperature=0.7,
    )
    trainer = tiny_trainer(
        "unused",
        [lambda completions, **kw: [0.0] * len(completions)],
        model=model,
        tokenizer=tokenizer,
        dataset=prompt_dataset(4),
        peft_config=peft_config,
        **{**settings, **args},
    )
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def micro_batch(trainer: GRPOTrainer, seed: int = 0, dead_groups=(0, 2), off_policy: float = 0.3) -> dict:
    """GROUPS groups of G rows: left-padded prompts of different lengths, ragged completions, half the groups dead
    (advantage 0), one unscorable row (advantage 0) in a live group, old log-probs off-policy by `off_policy`."""
    generator = torch.Generator().manual_seed(seed)
    vocab = trainer.model.config.vocab_size
    prompt_ids = torch.zeros(G * GROUPS, PROMPT_WIDTH, dtype=torch.long)
    prompt_mask = torch.zeros_like(prompt_ids)
    for group in range(GROUPS):
        length = PROMPT_WIDTH - 3 * (group % 3)
        tokens = torch.randint(3, vocab, (length,), generator=generator)
        rows = slice(group * G, (group + 1) * G)
        prompt_ids[rows, PROMPT_WIDTH - length :] = tokens
        prompt_mask[rows, PROMPT_WIDTH - length :] = 1
    lengths = torch.randint(1, COMPLETION_WIDTH, (G * GROUPS,), generator=generator)
    lengths[-1] = COMPLETION_WIDTH - 2  # the widest row still leaves padding columns after it
    completion_mask = (torch.arange(COMPLETION_WIDTH) < lengths.unsqueeze(1)).long()
    completion_ids = torch.randint(3, vocab, (G * GROUPS, COMPLETION_WIDTH), generator=generator) * completion_mask
    advantages = torch.randn(G * GROUPS, generator=generator, dtype=trainer.model.dtype)
    for group in dead_groups:
        advantages[group * G : (group + 1) * G] = 0.0
    advantages[G + 1] = 0.0  # an unscorable completion inside a live group
    with torch.no_grad():
        logps, _, _ = trl_full_pass(trainer, prompt_ids, prompt_mask, completion_ids, completion_mask)
    noise = off_policy * torch.randn(logps.shape, generator=generator, dtype=logps.dtype)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": advantages,
        "old_per_token_logps": (logps + noise) * completion_mask,
        "num_items_in_batch": completion_mask.sum().to(trainer.model.dtype),
    }


def trl_full_pass(trainer, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """Stock TRL's log-prob computation on the whole micro-batch (the oracle)."""
    import trl

    return trl.GRPOTrainer._get_per_token_logps_and_entropies(
        trainer,
        trainer.model,
        torch.cat([prompt_ids, completion_ids], dim=1),
        torch.cat([prompt_mask, completion_mask], dim=1),
        completion_ids.shape[1],
        compute_entropy=True,
    )


def set_zero_waste(trainer: GRPOTrainer, on: bool, shared_prompt: bool = True, exact_entropy: bool = False) -> None:
    """As if built with zero_waste_pass=on, zero_waste_shared_prompt=shared_prompt, zero_waste_exact_entropy=
    exact_entropy (settings are read once, at construction: the pass and the loss are wired again, from the trainer's
    settings as they are now)."""
    trainer._wire_training_pass(enabled=on, shared_prompt=shared_prompt, exact_entropy=exact_entropy)


def loss_and_grads(trainer: GRPOTrainer, inputs: dict) -> tuple[float, dict[str, torch.Tensor]]:
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.item(), grads


# float32: the zero-waste pass sums the rows in another layout; the worst gap over threads 1-2 and input seeds is
# 2.4e-9 on AVX-512 and 6.0e-8 on AVX2 (two ulps of a gradient in [0.25, 0.5)), docs/notes.md, Tolerances
GRADIENT_BOUND = float32_bound(avx512=8e-9, avx2=1.5e-7)


def assert_same_gradient(
    full: tuple[float, dict], saved: tuple[float, dict], tol: float = GRADIENT_BOUND, loss_rel_tol: float = 0.0
) -> None:
    """The same loss (bit for bit in every run measured of a float64 model; `loss_rel_tol` where the rows' sum is a
    float32 one) and gradients within `tol`."""
    assert abs(saved[0] - full[0]) <= loss_rel_tol * abs(full[0]), f"losses {saved[0]} and {full[0]}"
    assert full[1].keys() == saved[1].keys()
    moved = max(g.abs().max().item() for g in full[1].values())
    assert moved > 1e-3, "the full pass has no gradient: the comparison would be vacuous"
    diff = max((full[1][name] - saved[1][name]).abs().max().item() for name in full[1])
    assert diff <= tol, f"max gradient difference {diff}"


def assert_saved_pass_matches_full(trainer: GRPOTrainer, inputs: dict) -> tuple[tuple[float, dict], ForwardLog]:
    """The gradient with zero waste on equals the full pass; returns the full pass and what the saved one computed."""
    set_zero_waste(trainer, on=False)
    full = loss_and_grads(trainer, inputs)
    set_zero_waste(trainer, on=True)
    log = ForwardLog(trainer.model)
    saved = loss_and_grads(trainer, inputs)
    assert_same_gradient(full, saved)
    return full, log


# ---- exactness ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("importance_sampling_level", ["token", "sequence", "sequence_token"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_gradient_equals_full_pass(family, loss_type, importance_sampling_level):
    trainer = make_trainer(family, loss_type=loss_type, importance_sampling_level=importance_sampling_level)
    inputs = micro_batch(trainer)
    set_zero_waste(trainer, on=False)
    log = ForwardLog(trainer.model)
    full = loss_and_grads(trainer, inputs)
    full_positions = log.positions
    assert full_positions == G * GROUPS * (PROMPT_WIDTH + COMPLETION_WIDTH)
    log.clear()

    set_zero_waste(trainer, on=True)
    saved = loss_and_grads(trainer, inputs)
    assert_same_gradient(full, saved)
    # One model call over fewer positions than TRL's: dead rows, padding and (with a block mask) repeated prompts
    # were not computed.
    assert [call["mask_dims"] for call in log.calls] == [4 if HAS_FUSED_LM_HEAD else 2]
    assert log.positions < (0.5 if HAS_FUSED_LM_HEAD else 0.7) * full_positions, (log.positions, full_positions)


@pytest.mark.parametrize("setting", ["lora", "gradient_checkpointing"])
def test_gradient_equals_full_pass_with_lora_and_gradient_checkpointing(setting):
    """The recipes' settings: a LoRA adapter on all linear layers, checkpointed layers (QLoRA / 1.5B recipes)."""
    from peft import LoraConfig

    if setting == "lora":
        trainer = make_trainer(peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    else:
        trainer = make_trainer(gradient_checkpointing=True)
    inputs = micro_batch(trainer)
    full, log = assert_saved_pass_matches_full(trainer, inputs)
    assert log.calls and log.calls[0]["mask_dims"] == (4 if HAS_FUSED_LM_HEAD else 2)
    if setting == "lora":
        assert all("lora_" in name for name in full[1]), "only the adapter should train"


@needs_fused_lm_head
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gpt2"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_shared_prompt_logps_equal_trl_forward(family, attn):
    """Per-token log-probs and entropies of every row, packed, equal stock TRL's full forward."""
    # Eager attention in float64 makes TRL's own forward NaN on left-padded rows (transformers adds the float64
    # minimum, then takes the softmax in float32: a fully masked padding query is all -inf), so eager runs float32.
    # float64: bit for bit in every run measured; float32: worst 4.8e-7 (threads 1-2, TRL 1.14-1.16): 3.1x
    dtype, tol = (torch.float32, 1.5e-6) if attn == "eager" else (torch.float64, 0.0)
    trainer = make_trainer(family, attn, dtype=dtype)
    inputs = micro_batch(trainer)
    parts = [inputs[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")]
    reference_logps, reference_entropies, _ = trl_full_pass(trainer, *parts)
    log = ForwardLog(trainer.model)
    logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
        trainer.model,
        torch.cat([parts[0], parts[2]], dim=1),
        torch.cat([parts[1], parts[3]], dim=1),
        COMPLETION_WIDTH,
        compute_entropy=True,
    )
    assert [call["mask_dims"] for call in log.calls] == [4], "the shared-prompt forward did not run"
    assert reference_logps.abs().sum() > 0
    torch.testing.assert_close(logps, reference_logps, atol=tol, rtol=0)
    torch.testing.assert_close(entropies, reference_entropies, atol=tol, rtol=0)


@needs_fused_lm_head
def test_old_logps_pass_shares_prompts_and_honours_batch_size():
    """TRL's no-grad passes call the same method with batch_size: chunks keep groups whole and match TRL."""
    trainer = make_trainer()
    inputs = micro_batch(trainer)
    parts = [inputs[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")]
    reference, _, _ = trl_full_pass(trainer, *parts)
    log = ForwardLog(trainer.model)
    with torch.no_grad():
        logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model,
            torch.cat([parts[0], parts[2]], dim=1),
            torch.cat([parts[1], parts[3]], dim=1),
            COMPLETION_WIDTH,
            batch_size=2 * G,
        )
    assert entropies is None
    assert len(log.calls) == 2 and all(call["mask_dims"] == 4 for call in log.calls)
    torch.testing.assert_close(logps, reference, atol=0, rtol=0)  # bit for bit in every run


@needs_fused_lm_head
def test_no_grad_pass_calls_the_model_once_per_trl_chunk_whatever_the_prompts():
    """Under ZeRO-3 / FSDP every model call gathers parameters collectively: the number of calls may depend on the
    row count only. Four rows with one prompt (two groups of G = 2 on this rank, as in the case that once hung) in
    chunks of 2 rows: two calls, as TRL makes, not one merged pack."""
    trainer = make_trainer(num_generations=2, per_device_train_batch_size=2)
    inputs = micro_batch(trainer)
    rows = [0, 1, 2, 3]  # one group of micro_batch: the same prompt on every row
    ids = torch.cat([inputs["prompt_ids"][rows], inputs["completion_ids"][rows]], dim=1)
    mask = torch.cat([inputs["prompt_mask"][rows], inputs["completion_mask"][rows]], dim=1)
    log = ForwardLog(trainer.model)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, COMPLETION_WIDTH, 2)
    assert [call["mask_dims"] for call in log.calls] == [4, 4]
    reference, _, _ = trl_full_pass(
        trainer, *(inputs[k][rows] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask"))
    )
    torch.testing.assert_close(logps, reference, atol=0, rtol=0)  # bit for bit in every run


@needs_fused_lm_head
def test_rows_that_share_no_prompt_are_not_packed():
    """One row from each of 4 groups (TRL's row shuffle spreads groups over micro-batches): no pack would share its
    prompt, so a block mask would only cost (a dense S x S mask, expanded key/value heads). The rows have padding
    (left-padded prompts, ragged completions), which would make TRL's forward build a [rows, 1, S, S] mask: each row
    runs as its own tokens without a gap, with no attention mask at all, and its log-probs are TRL's. (Full attention
    heads: with grouped-query heads in float32 the per-row forward keeps its mask, see the next test.)"""
    trainer = make_trainer(config_overrides={"num_key_value_heads": 4})
    inputs = micro_batch(trainer)
    rows = [0, G, 2 * G, 3 * G]
    parts = [inputs[k][rows] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")]
    log = ForwardLog(trainer.model)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([parts[0], parts[2]], 1), torch.cat([parts[1], parts[3]], 1), COMPLETION_WIDTH
        )
    assert [call["mask_dims"] for call in log.calls] == [None]
    assert log.positions < len(rows) * (PROMPT_WIDTH + COMPLETION_WIDTH)
    reference, _, _ = trl_full_pass(trainer, *parts)
    torch.testing.assert_close(logps, reference, atol=0, rtol=0)  # bit for bit in every run


@needs_fused_lm_head
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_padded_rows_that_share_no_prompt_train_without_a_mask_with_trls_gradient(family):
    """The same spread-out rows in the training forward: no attention mask reaches the model, and the gradient (every
    group live) is the full pass's. With grouped-query heads in float32 (no autocast) transformers would ask SDPA for
    grouped-query attention without a mask, which CUDA runs only in the math kernel (every score in memory): there
    the per-row forward keeps TRL's mask."""
    for kv_heads, mask_dims in ((4, None), (2, 2)):
        trainer = make_trainer(family, config_overrides={"num_key_value_heads": kv_heads})
        inputs = micro_batch(trainer, dead_groups=())
        rows = [0, G + 2, 2 * G, 3 * G + 1]
        inputs = {k: v[rows] if k != "num_items_in_batch" else v for k, v in inputs.items()}
        inputs["num_items_in_batch"] = inputs["completion_mask"].sum().to(trainer.model.dtype)
        _, log = assert_saved_pass_matches_full(trainer, inputs)
        assert [call["mask_dims"] for call in log.calls if call["grad"]] == [mask_dims], kv_heads


def shuffled_micro_batches(trainer: GRPOTrainer, count: int, **kwargs) -> list[dict]:
    """`micro_batch` rows shuffled as TRL shuffles a generation batch, cut into `count` micro-batches."""
    batch = micro_batch(trainer, **kwargs)
    batch.pop("num_items_in_batch")
    order = torch.randperm(G * GROUPS, generator=torch.Generator().manual_seed(1))
    batch = {key: value[order] for key, value in batch.items()}
    size = G * GROUPS // count
    return [{key: value[i * size : (i + 1) * size] for key, value in batch.items()} for i in range(count)]


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_deferred_logps_equal_the_training_forward_bit_for_bit(beta):
    """Old / reference log-probs are computed after TRL's shuffle and split, micro-batch by micro-batch, through the
    training forward's own code: at equal weights they equal the training forward's log-probs to the bit (TRL's
    ratio of exactly 1 and KL of exactly 0), with one model call per micro-batch and pass, dead or not."""
    from peft import LoraConfig

    # With beta > 0 the reference is the policy with its LoRA adapter off: at init (B = 0) the same function.
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear") if beta else None
    trainer = make_trainer(dtype=torch.float32, beta=beta, peft_config=lora)
    micro_batches = shuffled_micro_batches(trainer, count=4, off_policy=0.0)
    micro_batches[0]["advantages"] = torch.zeros_like(micro_batches[0]["advantages"])  # an all-dead micro-batch
    passes = ("old_per_token_logps", "ref_per_token_logps") if beta else ("old_per_token_logps",)
    for inputs in micro_batches:
        inputs.update({key: torch.zeros_like(inputs["old_per_token_logps"]) for key in passes})  # placeholders
    trainer._zero_waste.pending = passes
    log = ForwardLog(trainer.model)
    trainer._zero_waste.fill_deferred(micro_batches, trainer.model, functools.partial(reference_model, trainer))
    assert len(log.calls) == len(passes) * len(micro_batches) and not any(call["grad"] for call in log.calls)
    assert trainer._zero_waste.pending == ()
    for inputs in micro_batches:
        policy = trainer._zero_waste.micro_batch_logps(trainer.model, inputs, compute_entropy=True)
        live = torch.ones(len(inputs["advantages"]), dtype=torch.bool)
        if policy.computed_rows is not None:
            live = policy.computed_rows
        for key in passes:
            assert torch.equal(policy.logps[live], inputs[key][live]), key
        assert (beta > 0) == bool(live.all()), "rows are skipped exactly when the KL term does not read them"


def test_dropout_turns_every_saving_off(caplog):
    """LoRA dropout (TRL's CLI default 0.05) draws masks per position: the full forward runs, in TRL's shape."""
    from peft import LoraConfig

    trainer = make_trainer(peft_config=LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05, target_modules="all-linear"))
    inputs = micro_batch(trainer)
    log = ForwardLog(trainer.model)
    with caplog.at_level(logging.WARNING, logger="grpo_plus.trainer"):
        trainer._compute_loss(trainer.model, inputs)
    assert log.positions == G * GROUPS * (PROMPT_WIDTH + COMPLETION_WIDTH), "not TRL's full forward"
    assert "dropout is active in the training forward" in caplog.text and "lora_dropout" in caplog.text
    assert not trainer._zero_waste.defers_logps(trainer.model), (
        "the no-grad passes must draw their masks where TRL draws them"
    )
    trainer.model.eval()  # no dropout in eval mode: the savings apply again
    log.clear()
    trainer._compute_loss(trainer.model, inputs)
    assert log.positions < G * GROUPS * (PROMPT_WIDTH + COMPLETION_WIDTH)


def test_all_dead_micro_batch_still_backpropagates_a_zero_gradient():
    trainer = make_trainer()
    inputs = micro_batch(trainer, dead_groups=range(GROUPS))
    inputs["advantages"].zero_()
    log = ForwardLog(trainer.model)
    loss, grads = loss_and_grads(trainer, inputs)
    assert loss == 0.0
    # Every parameter takes part in backward (DDP's all-reduce needs it), with exactly zero gradient.
    assert set(grads) == {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert all(g.abs().max() == 0 for g in grads.values())
    assert log.positions <= 2, "an all-dead micro-batch should cost one position"
    metrics = trainer._metrics["train"]
    assert math.isnan(metrics["entropy"][-1]) and math.isnan(metrics["ratio/mean"][-1]), "no row was computed"
    assert metrics["zero_waste/rows_computed_frac"][-1] == 0.0


def test_sequence_level_tensors_and_metrics_match_full_pass():
    """Clip fractions (TRL's metrics) are unchanged by skipping; TRL's `entropy` (every row) is unknown, the trained
    rows' entropy is logged apart; with exact_entropy the skipped rows' entropies are computed and `entropy` is TRL's."""
    trainer = make_trainer(importance_sampling_level="sequence", epsilon=0.05, epsilon_high=0.05)
    with torch.no_grad():  # peaked next-token distributions: entropies that differ from row to row
        trainer.model.lm_head.weight.mul_(30.0)
    inputs = micro_batch(trainer, off_policy=1.0)
    metrics = {}
    for on, exact in ((False, False), (True, False), (True, True)):
        set_zero_waste(trainer, on=on, exact_entropy=exact)
        trainer._metrics["train"].clear()
        trainer._compute_loss(trainer.model, inputs)
        metrics[on, exact] = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    full, skipped, exact = metrics[False, False], metrics[True, False], metrics[True, True]
    assert full["clip_ratio/region_mean"] > 0, "nothing was clipped: the comparison would be vacuous"
    for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/high_max"):
        assert skipped[name] == full[name], name
    live = rows_with_gradient(inputs["advantages"], inputs["completion_mask"])
    assert skipped["zero_waste/rows_computed_frac"] == live.float().mean().item()
    assert not live.all()
    parts = [inputs[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")]
    _, entropies, _ = trl_full_pass(trainer, *parts)
    mask = inputs["completion_mask"]
    trls = (entropies * mask).sum() / mask.sum()
    trained = (entropies[live] * mask[live]).sum() / mask[live].sum()
    assert abs(trained - trls) > 1e-3, "the trained rows' entropy is TRL's: the test would not tell them apart"
    # logged through float32: worst 2.7e-8 (every row) and 9.7e-8 (trained rows) relative: 3.7x, 3.1x
    assert full["entropy"] == pytest.approx(trls.item(), rel=1e-7) and TRAINED_ROWS_ENTROPY not in full
    assert math.isnan(skipped["entropy"]) and skipped[TRAINED_ROWS_ENTROPY] == pytest.approx(trained.item(), rel=3e-7)
    assert exact["entropy"] == pytest.approx(trls.item(), rel=1e-7)
    assert exact[TRAINED_ROWS_ENTROPY] == pytest.approx(trained.item(), rel=3e-7)


@pytest.mark.parametrize("dead_groups", [(), (0, 2), range(GROUPS)], ids=["none_dead", "half_dead", "all_dead"])
def test_exact_entropy_makes_one_more_no_grad_call_whatever_the_rows(dead_groups):
    """Under ZeRO-3 / FSDP every model call gathers parameters collectively: with exact_entropy the training forward
    makes exactly two calls (the trained rows with gradient, the skipped rows without) whatever rows are dead, and
    the gradient stays the full pass's."""
    trainer = make_trainer()
    inputs = micro_batch(trainer, dead_groups=dead_groups)
    if len(dead_groups) == GROUPS:
        inputs["advantages"].zero_()
    if not dead_groups:  # micro_batch leaves one unscorable row: score it, so that every row is live
        inputs["advantages"][G + 1] = 0.5
    trainer._metrics["train"].clear()
    set_zero_waste(trainer, on=False)
    full = loss_and_grads(trainer, inputs)
    set_zero_waste(trainer, on=True, exact_entropy=True)
    log = ForwardLog(trainer.model)
    saved = loss_and_grads(trainer, inputs)
    assert [call["grad"] for call in log.calls] == [True, False]
    if dead_groups == range(GROUPS):
        assert saved[0] == 0.0 and all(g.abs().max() == 0 for g in saved[1].values())
    else:
        assert_same_gradient(full, saved)
    full_entropy, exact_entropy = trainer._metrics["train"]["entropy"]  # TRL's mean over every row, both times
    assert exact_entropy == full_entropy  # bit for bit in every run


# ---- fallbacks ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, reason",
    [
        (dict(beta=0.1), "beta=0.1"),
        (dict(entropy_coef=0.01), "entropy bonus"),
        (dict(top_entropy_quantile=0.5), "top_entropy_quantile=0.5"),
        (dict(loss_type="my_unsafe_mode"), "did not declare"),
        (dict(loss_type="cispo"), "TRL's own _compute_loss"),
    ],
    ids=["beta", "entropy_bonus", "entropy_quantile", "undeclared_user_mode", "trl_native_loss"],
)
def test_row_skipping_falls_back_to_the_full_pass(args, reason, caplog):
    if args.get("loss_type") == "my_unsafe_mode":
        grpo_plus.register_loss_type("my_unsafe_mode", override=True)(lambda loss, ctx: loss.sum() / ctx.B)
    beta = args.pop("beta", 0.0)
    trainer = make_trainer(**args)
    inputs = micro_batch(trainer)
    if beta:  # set after construction: the tiny model has no hub id TRL could build a reference model from
        trainer.beta = beta
        inputs["ref_per_token_logps"] = inputs["old_per_token_logps"].clone()
    log = ForwardLog(trainer.model)
    with caplog.at_level(logging.WARNING, logger="grpo_plus.trainer"):
        trainer._wire_training_pass()  # as built with the trainer's settings as they are now (beta read once)
        trainer._compute_loss(trainer.model, inputs)
    assert trainer._zero_waste.row_skip_blocker is not None and reason in trainer._zero_waste.row_skip_blocker
    assert any("zero-advantage rows" in r.getMessage() and reason in r.getMessage() for r in caplog.records)
    # Every row went through the model (packed where prompts can still be shared): nothing was skipped.
    parts = [inputs[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")]
    widest = int(inputs["completion_mask"].sum(1).max())
    every_row = (
        pack_shared_prompts(*parts, 32).positions if HAS_FUSED_LM_HEAD else G * GROUPS * (PROMPT_WIDTH + widest)
    )
    assert log.positions == every_row, (log.positions, every_row)


def test_router_aux_loss_computes_every_row_with_shared_prompts(caplog):
    """A one-layer Mixtral whose config asks for the router's logits: every row goes through the model (TRL's
    load-balancing loss reads them all, tests/test_moe.py), each group's prompt once, and the aux loss is TRL's."""
    from transformers import MixtralConfig

    config = MixtralConfig(
        vocab_size=len(make_tokenizer()), hidden_size=32, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1,
        output_router_logits=True, pad_token_id=0,
    )  # fmt: skip
    trainer = make_trainer(model_config=config, dtype=torch.float32)  # grouped expert matmuls need float32
    assert trainer.aux_loss_enabled
    inputs = micro_batch(trainer)
    log = ForwardLog(trainer.model)
    with caplog.at_level(logging.WARNING, logger="grpo_plus"):
        policy = trainer._zero_waste.policy_forward(trainer.model, inputs, trainer._metrics["train"])
    # a pack per group where TRL has the fused LM head to score it; below that floor every row in full, said by name
    packed = [(GROUPS, 4)] if HAS_FUSED_LM_HEAD else [(G * GROUPS, 2)]
    assert [(call["shape"][0], call["mask_dims"]) for call in log.calls] == packed
    assert bool(policy.computed_rows is None)
    messages = " ".join(record.getMessage() for record in caplog.records)
    assert "router aux loss" in messages and "zero-advantage rows" in messages
    assert ("shared prompt computed in full" in messages) is not HAS_FUSED_LM_HEAD
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    _, _, trl_aux = trl.GRPOTrainer._get_per_token_logps_and_entropies(
        trainer, trainer.model, ids, mask, inputs["completion_ids"].shape[1], compute_aux_loss=True
    )
    assert abs(policy.aux_loss.item() - trl_aux.item()) <= 1e-6  # float32 sums in another order: 4 ulps of 2.0


@pytest.mark.parametrize(
    "family, attn, config_overrides, reason",
    [
        ("llama", "custom_sdpa", None, "attn_implementation='custom_sdpa'"),
        ("mistral", "sdpa", dict(sliding_window=8), "sliding_window=8"),
        ("gpt_neox", "sdpa", None, "model_type='gpt_neox' is not one of the checked families"),
    ],
    ids=["attention_implementation", "sliding_window", "unchecked_family"],
)
def test_unsupported_model_skips_rows_but_recomputes_prompts(family, attn, config_overrides, reason, caplog):
    if attn == "custom_sdpa":  # a user-registered attention function: grpo_plus cannot know how it reads a mask
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.masking_utils import sdpa_mask

        AttentionInterface.register("custom_sdpa", sdpa_attention_forward)
        AttentionMaskInterface.register("custom_sdpa", sdpa_mask)
    trainer = make_trainer(family, attn, config_overrides)
    inputs = micro_batch(trainer)
    with caplog.at_level(logging.WARNING, logger="grpo_plus.trainer"):
        _, log = assert_saved_pass_matches_full(trainer, inputs)
    live = int(rows_with_gradient(inputs["advantages"], inputs["completion_mask"]).sum())
    widest = int(inputs["completion_mask"].sum(1).max())
    assert [(call["shape"], call["mask_dims"]) for call in log.calls] == [((live, PROMPT_WIDTH + widest), 2)]
    if not HAS_FUSED_LM_HEAD:  # TRL 1.14 stops at the first reason: no head to score packed rows with
        reason = "has no fused LM head"
    assert any(reason in record.getMessage() and "shared prompt" in record.getMessage() for record in caplog.records)


def test_prompts_that_are_not_left_padded_are_recomputed_per_row(caplog):
    """A prompt whose last column is padding has no last token to share: the full (trimmed) forward runs."""
    trainer = make_trainer()
    inputs = micro_batch(trainer)
    rows = slice(G, 2 * G)  # group 1: 9 prompt tokens after 3 padding columns -> move the padding to the right
    inputs["prompt_ids"][rows] = inputs["prompt_ids"][rows].roll(-3, dims=1)
    inputs["prompt_mask"][rows] = inputs["prompt_mask"][rows].roll(-3, dims=1)
    with caplog.at_level(logging.WARNING, logger="grpo_plus.trainer"):
        _, log = assert_saved_pass_matches_full(trainer, inputs)
    assert [call["mask_dims"] for call in log.calls] == [2]
    reason = "not left-padded" if HAS_FUSED_LM_HEAD else "has no fused LM head"
    assert any(reason in record.getMessage() for record in caplog.records)


def test_per_token_inputs_on_a_text_model_are_cut_with_the_padding_but_prompts_not_shared(caplog):
    """Extra per-token model inputs (token_type_ids) on a text model: the padding columns after the completions are
    cut from them as from the ids; the shared prompt, which only knows what VLM families mean by them, stands aside."""
    trainer = make_trainer()
    inputs = micro_batch(trainer)
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    log = ForwardLog(trainer.model)
    with caplog.at_level(logging.WARNING, logger="grpo_plus.trainer"):
        trainer._get_per_token_logps_and_entropies(
            trainer.model, input_ids, attention_mask, COMPLETION_WIDTH, token_type_ids=torch.zeros_like(input_ids)
        )
    widest = PROMPT_WIDTH + COMPLETION_WIDTH - 2  # micro_batch leaves two padding columns after every completion
    assert [(call["shape"], call["mask_dims"]) for call in log.calls] == [((G * GROUPS, widest), 2)]
    reason = "token_type_ids and 'llama' is a text model" if HAS_FUSED_LM_HEAD else "has no fused LM head"
    assert any(reason in record.getMessage() for record in caplog.records)


def test_without_fused_lm_head_rows_and_padding_are_still_skipped(monkeypatch):
    """TRL 1.14 has no fused LM head: the shared prompt falls back, row skipping and padding trimming do not."""
    monkeypatch.setattr("grpo_plus.zero_waste.training_pass.has_fused_lm_head", lambda: False)
    trainer = make_trainer()
    inputs = micro_batch(trainer)
    log = ForwardLog(trainer.model)
    trainer._compute_loss(trainer.model, inputs)
    live = int(rows_with_gradient(inputs["advantages"], inputs["completion_mask"]).sum())
    assert [call["mask_dims"] for call in log.calls] == [2] and log.calls[0]["shape"][0] == live


def test_the_pass_calls_trls_method_never_the_trainers(monkeypatch):
    """One direction of calls: the trainer calls the pass, the pass calls TRL's own `_get_per_token_logps_and_entropies`,
    never the trainer's override (which forwards TRL's own callers to the pass), and it holds no trainer. Control: a
    call from TRL's side goes through the override to the pass and TRL's method."""
    import trl

    trainer = make_trainer()
    set_zero_waste(trainer, on=False)  # every row through TRL's method
    inputs = micro_batch(trainer)
    through_trainer, through_trl = [], []
    override, trls = trainer._get_per_token_logps_and_entropies, trl.GRPOTrainer._get_per_token_logps_and_entropies
    monkeypatch.setattr(trainer, "_get_per_token_logps_and_entropies",
                        lambda *args, **kwargs: through_trainer.append(1) or override(*args, **kwargs))  # fmt: skip
    monkeypatch.setattr(trl.GRPOTrainer, "_get_per_token_logps_and_entropies",
                        lambda *args, **kwargs: through_trl.append(1) or trls(*args, **kwargs))  # fmt: skip
    trainer._compute_loss(trainer.model, inputs)
    assert (len(through_trainer), len(through_trl)) == (0, 1)
    assert not any(isinstance(value, trl.GRPOTrainer) for value in vars(trainer._zero_waste).values())
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, COMPLETION_WIDTH)
    assert (len(through_trainer), len(through_trl)) == (1, 2)


def test_config_field_turns_it_off():
    trainer = make_trainer(zero_waste_pass=False)
    inputs = micro_batch(trainer)
    log = ForwardLog(trainer.model)
    trainer._compute_loss(trainer.model, inputs)
    assert [(call["shape"], call["mask_dims"]) for call in log.calls] == [
        ((G * GROUPS, PROMPT_WIDTH + COMPLETION_WIDTH), 2)
    ]


def test_exact_entropy_benchmark_smoke(tmp_path, benchmark_in_this_process):
    """benchmarks/exact_entropy.py --smoke, in process: every case runs, the three sides' losses are equal, exact
    entropy is TRL's, and without it `entropy` is not logged where groups were dead."""
    import exact_entropy

    rows = exact_entropy.run_cases(exact_entropy.build_sides(smoke=True, output_dir=str(tmp_path)), repeats=1)
    assert [row["dead_share"] for row in rows] == list(exact_entropy.DEAD_SHARES)
    assert all(row["max_loss_difference"] <= 1e-6 and row["exact_entropy_difference"] <= 1e-5 for row in rows), rows
    assert [row["default_entropy_logged"] for row in rows] == [share == 0 for share in exact_entropy.DEAD_SHARES]
