"""Speculative rollouts without a draft model (grpo_plus.speculative): greedy decoding gives the same tokens, sampling
the same distribution (a chi-squared test, with a wrong acceptance rule as its negative control), drafts are taken and
kept, what cannot work is refused or stepped aside from, and a trainer step with speculation trains as one without."""

from __future__ import annotations

import pytest
import torch
from helpers.histograms import homogeneity_p_values
from helpers.models import make_tokenizer, tiny_config
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, LogitsProcessor, LogitsProcessorList

import grpo_plus
from grpo_plus.config import ConfigError
from grpo_plus.speculative import SpeculationStats, SpeculativeDecoder, SpeculativeSettings, verify
from grpo_plus.speculative.drafting import ngram_drafts
from grpo_plus.zero_waste.generation import generate

needs_loop = pytest.mark.floor("zero_waste_generation")
SPECULATION = SpeculativeDecoder(SpeculativeSettings(enabled=True))


def tiny_model(family: str, seed: int = 0, lora: bool = False):
    tokenizer = make_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, len(tokenizer)), dtype=torch.float32)
    if lora:  # B initialized randomly too, so the adapter changes the logits
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
        model = get_peft_model(model, config)
    return model.eval(), tokenizer


def repetitive_batch(vocab_size: int, group: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Three prompts that repeat a 4-token phrase (so the prompt and the siblings hold n-gram matches), each `group`
    times, left-padded."""
    generator = torch.Generator().manual_seed(0)
    phrases = torch.randint(3, vocab_size, (3, 4), generator=generator)
    ids = torch.cat([phrases.repeat(1, 3), phrases[:, :2]], dim=1)
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0  # one prompt shorter: left padding
    return ids.repeat_interleave(group, dim=0), mask.repeat_interleave(group, dim=0)


def greedy_config(tokenizer, **overrides) -> GenerationConfig:
    settings = dict(
        max_new_tokens=24,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=[tokenizer.eos_token_id],
        repetition_penalty=1.1,
        disable_compile=True,
    )
    return GenerationConfig(**{**settings, **overrides})


# ---------------------------------------------------------------------------------------------------- greedy: same ids


def greedy_with_and_without_speculation(model, tokenizer):
    """Greedy decoding of `repetitive_batch` without and with speculation, checked equal: (prompt ids, sequences,
    the speculative call's GenerationStats)."""
    ids, mask = repetitive_batch(len(tokenizer))
    config = greedy_config(tokenizer)
    reference, plain = generate(model, input_ids=ids, attention_mask=mask, generation_config=config)
    ours, stats = generate(
        model, input_ids=ids, attention_mask=mask, generation_config=config, speculation=SPECULATION
    )
    assert plain.fallback is None and stats.fallback is None and stats.speculation.fallback is None
    assert torch.equal(ours, reference)
    return ids, reference, stats


@needs_loop
@pytest.mark.parametrize(("family", "lora"), [("llama", False), ("qwen3", False), ("qwen2", False), ("llama", True)])
def test_greedy_tokens_are_the_same_with_drafts_kept(family, lora):
    model, tokenizer = tiny_model(family, lora=lora)
    ids, reference, stats = greedy_with_and_without_speculation(model, tokenizer)
    counts = stats.speculation
    assert counts.accepted > 0  # drafts were kept: the test exercises speculation
    assert counts.tokens == counts.accepted + counts.row_forwards and counts.tokens_per_row_forward > 1
    assert stats.positions > 0 and stats.full_positions == len(ids) * (reference.shape[1] - 1)


@needs_loop
@pytest.mark.parametrize("lora", [False, True])
def test_greedy_tokens_are_the_same_on_a_4bit_base(tiny_model_dir_bnb, lora):
    """A bitsandbytes nf4 base (QLoRA's: the trainer's own model generates), with and without LoRA on it: a verify
    forward of k + 1 positions per row goes through the 4-bit kernels with other shapes than one token per row, and
    gives the same greedy tokens."""
    from transformers import AutoTokenizer, BitsAndBytesConfig

    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir_bnb, quantization_config=quantization)
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)
        config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
        model = get_peft_model(model, config)
    model.eval()
    assert any(type(module).__name__ == "Linear4bit" for module in model.modules())
    _, _, stats = greedy_with_and_without_speculation(model, AutoTokenizer.from_pretrained(tiny_model_dir_bnb))
    assert stats.speculation.accepted > 0  # drafts were kept: the verify forwards ran through the 4-bit layers


@needs_loop
def test_greedy_rows_ending_at_different_steps_and_the_length_limit():
    """EOS ends some rows early (pad after it) and max_new_tokens cuts the others, as without speculation."""
    model, tokenizer = tiny_model("llama")
    ids, mask = repetitive_batch(len(tokenizer))
    for bias in (0.0, 0.05, 0.1, 0.15, 0.2):
        config = greedy_config(tokenizer, max_new_tokens=13, sequence_bias=[[[tokenizer.eos_token_id], bias]])
        reference, _ = generate(model, input_ids=ids, attention_mask=mask, generation_config=config)
        ended = (reference[:, ids.shape[1] :] == tokenizer.eos_token_id).any(1)
        if 0 < int(ended.sum()) < len(ids):
            break
    else:
        pytest.fail("no EOS bias ended some rows but not all")
    ours, stats = generate(
        model, input_ids=ids, attention_mask=mask, generation_config=config, speculation=SPECULATION
    )
    assert torch.equal(ours, reference)
    assert reference.shape[1] - ids.shape[1] <= 13
    assert stats.speculation.accepted > 0


@needs_loop
def test_the_adaptive_draft_length_drafts_less_where_drafts_are_refused_and_changes_no_token():
    model, tokenizer = tiny_model("llama")
    ids, mask = repetitive_batch(len(tokenizer))
    kwargs = dict(input_ids=ids, attention_mask=mask, generation_config=greedy_config(tokenizer))
    fixed = SpeculativeDecoder(SpeculativeSettings(enabled=True, adaptive_draft=False))
    reference, every_k = generate(model, speculation=fixed, **kwargs)
    ours, adaptive = generate(model, speculation=SPECULATION, **kwargs)
    assert torch.equal(ours, reference)
    every_k, adaptive = every_k.speculation, adaptive.speculation
    assert every_k.acceptance_rate < 0.5  # mostly refused here (measured: 0.14 with k = 4 every time)
    assert adaptive.drafted < every_k.drafted and adaptive.acceptance_rate > every_k.acceptance_rate


@needs_loop
def test_stop_strings_end_rows_where_they_end_without_speculation():
    """A stop string (StopStringCriteria; `stop_strings=` itself needs generate's `tokenizer=`, which transformers 5.24
    does not hand a custom decoding loop) ends each row at the token completing it, pad after, as without drafts."""
    from transformers import StoppingCriteriaList
    from transformers.generation.stopping_criteria import StopStringCriteria

    model, tokenizer = tiny_model("llama")
    ids, mask = repetitive_batch(len(tokenizer))
    kept = 0
    for stop in ("p(", "7v"):
        kwargs = dict(input_ids=ids, attention_mask=mask, generation_config=greedy_config(tokenizer))
        reference, _ = generate(
            model, stopping_criteria=StoppingCriteriaList([StopStringCriteria(tokenizer, [stop])]), **kwargs
        )
        criteria = StoppingCriteriaList([StopStringCriteria(tokenizer, [stop])])
        ours, stats = generate(model, stopping_criteria=criteria, speculation=SPECULATION, **kwargs)
        assert torch.equal(ours, reference)
        assert any(tokenizer.decode(row[ids.shape[1] :]).split("<pad>")[0].endswith(stop) for row in ours)
        kept += stats.speculation.accepted
    assert kept > 0


@needs_loop
def test_tool_turns_run_speculation_without_keeping_the_caches():
    from grpo_plus.zero_waste.multi_turn import TurnCache

    model, tokenizer = tiny_model("llama")
    ids, mask = repetitive_batch(len(tokenizer))
    kwargs = dict(input_ids=ids, attention_mask=mask, generation_config=greedy_config(tokenizer))
    reference, _ = generate(model, **kwargs)
    ours, stats = generate(model, turns=TurnCache(), speculation=SPECULATION, **kwargs)
    assert torch.equal(ours, reference)
    assert stats.speculation.accepted > 0 and "holes" in stats.turns_blocker


# ------------------------------------------------------------------------------------------- sampling: same distribution

VOCAB, NEW, GROUP, CALLS = 8, 5, 16, 40  # tokens 0 (pad) and 1 (EOS) and 6 others; 640 completions per side


def peaked_model(seed: int = 0):
    """A tiny Llama over 8 tokens whose next-token distributions are peaked but not one-hot, so drafts are often kept
    and often refused."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, pad_token_id=0, eos_token_id=1, tie_word_embeddings=False,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def sampling_config(**overrides) -> GenerationConfig:
    settings = dict(
        max_new_tokens=NEW,
        do_sample=True,
        pad_token_id=0,
        eos_token_id=[1],
        temperature=0.9,
        top_k=6,
        top_p=0.97,
        repetition_penalty=1.3,
        disable_compile=True,
    )
    return GenerationConfig(**{**settings, **overrides})


def histograms(model, speculation, seed: int) -> tuple[torch.Tensor, SpeculationStats]:
    """(NEW, VOCAB) counts of each token at each completion position over CALLS x GROUP completions of one prompt."""
    ids = torch.tensor([[2, 3, 4, 2, 3, 4, 2, 3]]).repeat(GROUP, 1)
    counts, totals = torch.zeros(NEW, VOCAB), SpeculationStats()
    torch.manual_seed(seed)
    for _ in range(CALLS):
        out, stats = generate(
            model, input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=sampling_config(),
            speculation=speculation,
        )  # fmt: skip
        completions = torch.nn.functional.pad(out[:, ids.shape[1] :], (0, NEW - (out.shape[1] - ids.shape[1])))
        counts += torch.nn.functional.one_hot(completions, VOCAB).sum(0)
        if stats.speculation is not None:
            totals.drafted += stats.speculation.drafted
            totals.accepted += stats.speculation.accepted
    return counts, totals


def keep_every_draft(draft_probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The negative control's acceptance rule: keeps every drafted token, whatever its probability."""
    return torch.ones_like(draft_probs, dtype=torch.bool)


@needs_loop
def test_sampled_tokens_have_the_distribution_of_one_token_decoding():
    model = peaked_model()
    reference, _ = histograms(model, None, seed=1)
    ours, counts = histograms(model, SPECULATION, seed=2)
    # drafts kept for over 5% of the tokens, and refused too (measured: 214 kept of 1,570 drafted, 3,200 tokens)
    assert counts.accepted > 0.05 * (CALLS * GROUP * NEW) and counts.accepted < counts.drafted
    p_values = homogeneity_p_values(reference, ours)
    assert float(p_values.min()) > 0.01 / NEW, p_values  # Bonferroni over the positions, 1% family-wise
    # negative control: keeping every draft skews the distribution, which the same test sees
    wrong, _ = histograms(model, SpeculativeDecoder(SpeculativeSettings(enabled=True), accept=keep_every_draft), 3)
    assert float(homogeneity_p_values(reference, wrong).min()) < 1e-6


def test_verify_greedy_keeps_drafts_up_to_the_first_that_is_not_the_argmax():
    scores = torch.tensor([[[0.0, 5, 1], [0, 1, 5], [9, 0, 0]], [[0, 0, 5], [5, 0, 0], [0, 5, 0]]])
    drafts = torch.tensor([[1, 2], [1, 0]])
    kept, following = verify(scores, drafts, torch.tensor([2, 2]), do_sample=False)
    assert kept.tolist() == [2, 0] and following.tolist() == [0, 2]  # row 0: both kept, bonus 0; row 1: 2 replaces 1
    kept, following = verify(scores, drafts, torch.tensor([1, 0]), do_sample=False)
    assert kept.tolist() == [1, 0] and following.tolist() == [2, 2]  # a row's draft length bounds what it keeps


def test_verify_draws_the_refused_position_from_p_without_the_draft():
    """One position, p = (0.5, 0.3, 0.2), draft 0: the token there must be p's (0 with 0.5: kept; else 1 or 2 in 3:2)."""
    torch.manual_seed(0)
    scores = torch.tensor([0.5, 0.3, 0.2]).log().expand(20000, 2, 3)
    drafts = torch.zeros(20000, 1, dtype=torch.long)
    kept, following = verify(scores, drafts, torch.ones(20000, dtype=torch.long), do_sample=True)
    token = torch.where(kept == 1, drafts[:, 0], following)
    frequencies = torch.bincount(token, minlength=3) / 20000.0
    assert torch.allclose(frequencies, torch.tensor([0.5, 0.3, 0.2]), atol=0.015), frequencies  # ~4 sigma
    assert not bool(((kept == 0) & (following == 0)).any())  # a refused draft is never drawn again


def test_drafts_come_from_the_prompt_own_text_and_siblings():
    # rows 0 and 1 share a prompt [5 6 7 5]; row 1 is ahead: "... 5 6 7 8 9"; row 0 ends in "6 7": its sibling continues
    sequences = torch.tensor([[5, 6, 7, 5, 6, 7, 0, 0], [5, 6, 7, 5, 6, 7, 8, 9], [4, 4, 4, 4, 3, 0, 0, 0]])
    start, end = torch.tensor([0, 0, 0]), torch.tensor([6, 8, 5])
    drafts, lengths = ngram_drafts(
        sequences, start, end, torch.tensor([0, 2]), torch.tensor([0, 0, 1]), torch.tensor([3, 3]), 3, 1
    )
    assert lengths.tolist() == [2, 0]  # row 0: "5 6 7" is followed by "8 9" in row 1 (the longest continuation)
    assert drafts[0, :2].tolist() == [8, 9]
    # without the sibling, the prompt's own "5 6 7" is followed by "5 6 7" (budget 3)
    drafts, lengths = ngram_drafts(
        sequences[:1], start[:1], end[:1], torch.tensor([0]), torch.tensor([0]), torch.tensor([3]), 3, 1
    )
    assert lengths.tolist() == [3] and drafts[0].tolist() == [5, 6, 7]


# ------------------------------------------------------------------------------------------- refused, or stood aside


class Bump(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores


@needs_loop
def test_an_unknown_logits_processor_makes_the_loop_step_aside_with_the_same_tokens():
    model, tokenizer = tiny_model("llama")
    ids, mask = repetitive_batch(len(tokenizer))
    kwargs = dict(input_ids=ids, attention_mask=mask, generation_config=greedy_config(tokenizer, max_new_tokens=6))
    reference, _ = generate(model, logits_processor=LogitsProcessorList([Bump()]), **kwargs)
    ours, stats = generate(model, logits_processor=LogitsProcessorList([Bump()]), speculation=SPECULATION, **kwargs)
    assert torch.equal(ours, reference)
    assert stats.fallback is None and "Bump" in stats.speculation.fallback


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        (dict(speculative_rollouts=True, use_vllm=True), "vllm_speculative_config={'method': 'ngram'"),
        (dict(speculative_rollouts=True, zero_waste_generation=False), "zero_waste_generation"),
        (dict(speculative_rollouts=True, generation_kwargs={"num_beams": 2}), "beam"),
        (dict(speculative_max_draft_tokens=0), "speculative_max_draft_tokens"),
        (dict(speculative_ngram_min=4, speculative_ngram_max=3), "speculative_ngram_max"),
        (dict(speculative_rollouts="yes"), "speculative_rollouts"),
    ],
)
def test_what_cannot_work_is_refused_at_construction(tmp_path, kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment):
        grpo_plus.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", **kwargs)


def test_the_settings_default_to_off():
    config_values = SpeculativeSettings().config_values()
    assert config_values["speculative_rollouts"] is False
    with pytest.raises(ValueError, match="speculative_rollouts=True"):
        SpeculativeDecoder(SpeculativeSettings())


# ------------------------------------------------------------------------------------------------------- in a trainer


def one_step(tmp_path, name: str, replay=None, **settings):
    """One GRPO step of a fresh tiny Llama: (completions TRL's generation returned, logged metrics). `replay`: the
    completions to hand TRL instead of generating."""
    from helpers.models import tiny_trainer

    def length_reward(completions, **kwargs) -> list[float]:
        return [float(len(completion)) for completion in completions]

    trainer = tiny_trainer(
        tmp_path / name, [length_reward], max_steps=1, max_completion_length=32, learning_rate=0.0, **settings
    )
    generated = []
    generate_single_turn = trainer._generate_single_turn

    def recorded(*args, **kwargs):
        result = replay.pop(0) if replay else generate_single_turn(*args, **kwargs)
        generated.append(result)
        return result

    trainer._generate_single_turn = recorded
    trainer.train()
    return generated, trainer.state.log_history[0]


@needs_loop
def test_a_trainer_step_with_speculation(tmp_path):
    """Greedy (generation_kwargs): TRL's generation hands the trainer the same completions with speculation as
    without, and the speculative/* metrics are logged. Sampled: the loss and gradient of a step are those of a step
    without speculation trained on the same completions (the sampler's output is all the loss sees)."""
    greedy = dict(generation_kwargs={"do_sample": False})
    plain, _ = one_step(tmp_path, "greedy-plain", **greedy)
    ours, logs = one_step(tmp_path, "greedy-speculative", speculative_rollouts=True, **greedy)
    assert [completion for completion, _ in ours] == [completion for completion, _ in plain]
    assert logs["speculative/accepted"] > 0 and logs["speculative/tokens_per_row_forward"] > 1
    assert {"speculative/drafted", "speculative/forwards", "speculative/acceptance_rate"} <= set(logs)

    # sampled at a low temperature, where this random model repeats itself (so drafts are kept) and rows still differ
    sampled, logs = one_step(tmp_path, "sampled-speculative", speculative_rollouts=True, temperature=0.01)
    assert logs["speculative/accepted"] > 0 and logs["loss"] != 0 and logs["grad_norm"] > 0
    for completion_ids, _ in sampled:
        assert all(1 <= len(row) <= 32 for row in completion_ids)
    _, replayed = one_step(tmp_path, "sampled-replayed", replay=list(sampled), temperature=0.01)
    assert "speculative/accepted" not in replayed
    for key in ("loss", "grad_norm", "reward", "completions/mean_length"):
        assert replayed[key] == logs[key], key


@needs_loop
def test_each_drafted_position_is_processed_with_its_own_prefix():
    """The repetition penalty at drafted position j sees the row's text plus its first j drafts (checked against the
    processor applied to each prefix alone), and the per-row state transformers gives it (each row's left padding)
    follows the rows."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper

    from grpo_plus.speculative.decoding import _Rollout

    generator = torch.Generator().manual_seed(0)
    sequences = torch.randint(1, 12, (3, 14), generator=generator)
    padding = torch.tensor([0, 2, 1])
    penalty, temperature = (
        RepetitionPenaltyLogitsProcessor(2.0, prompt_ignore_length=padding),
        TemperatureLogitsWarper(0.5),
    )
    rollout = object.__new__(_Rollout)
    rollout.sequences, rollout.device = sequences, sequences.device
    rollout.per_row, rollout.id_free = LogitsProcessorList([penalty]), LogitsProcessorList([temperature])
    live, base, draft_lengths = torch.tensor([2, 0]), torch.tensor([6, 8]), torch.tensor([3, 1])
    logits = torch.randn(2, 4, 12, generator=generator)
    scores = rollout.process(live, logits, base, draft_lengths)
    for i, row in enumerate(live.tolist()):
        alone = RepetitionPenaltyLogitsProcessor(2.0, prompt_ignore_length=padding[row : row + 1])
        for j in range(int(draft_lengths[i]) + 1):
            prefix = sequences[row : row + 1, : int(base[i]) + j]
            expected = temperature(prefix, alone(prefix, logits[i, j : j + 1]))
            assert torch.equal(scores[i, j : j + 1], expected), (i, j)


@needs_loop
def test_the_benchmark_smoke_run_reports_both_sides(tmp_path, benchmark_in_this_process):
    """benchmarks/speculative_rollouts.py cannot rot: its --smoke run (the random tiny model) reports every case with
    both sides, their lengths and the speculative counts."""
    import json

    import speculative_rollouts

    output = tmp_path / "speculative.json"
    speculative_rollouts.main(["--smoke", "--tasks", "demo", "gsm8k", "--json", str(output)])
    cases = json.loads(output.read_text())["cases"]
    assert [case["task"] for case in cases] == ["demo", "gsm8k"]
    for case in cases:
        assert case["new_tokens"] == 16 and case["rows"] == 16
        plain, ours = case["plain"], case["speculative"]
        assert plain["fallback"] is None and ours["fallback"] is None
        assert 0 < plain["mean_length"] <= 16 and 0 < ours["mean_length"] <= 16 and ours["tokens_per_row_forward"] >= 1


@needs_loop
@pytest.mark.engine  # two trainers in lock-step, a few steps each
def test_the_benchmark_accuracy_part_reports_both_sides_per_evaluated_step(tmp_path, benchmark_in_this_process):
    """benchmarks/speculative_rollouts.py --part accuracy cannot rot: its --smoke run (the random tiny model, chain_sum)
    trains the plain and the speculative side in lock-step and reports held-out accuracy per evaluated step and
    seed, each side's mean against the other's seeds, and the speculative side's acceptance."""
    import json

    import speculative_rollouts

    output = tmp_path / "accuracy.json"
    speculative_rollouts.main(["--part", "accuracy", "--smoke", "--json", str(output)])
    report = json.loads(output.read_text())
    (run,) = report["runs"]
    for side in ("plain", "speculative"):
        assert [point["step"] for point in run[side]["evals"]] == [0, 1, 2]
        assert len(run[side]["rewards"]) == 2
    assert len(run["speculative"]["acceptance_rate"]) == 2 and "acceptance_rate" not in run["plain"]
    summary = report["summary"]
    assert [row["step"] for row in summary["per_step"]] == [0, 1, 2]
    # before training both sides are the same model (LoRA starts as the identity): the same held-out accuracy
    first = summary["per_step"][0]
    assert first["plain"]["per_seed"] == first["speculative"]["per_seed"]
    assert first["speculative_mean_within_plain_seeds"] and first["plain_mean_within_speculative_seeds"]
    assert summary["speculative_tokens_per_row_forward"] >= 1


def test_the_accuracy_summary_says_where_a_sides_mean_leaves_the_other_sides_seeds(benchmark_in_this_process):
    """Step 0: the speculative mean (0.5) inside plain's seeds (0.4-0.6) and the reverse; step 4: the speculative
    side's seeds all at 0.1, far below plain's 0.5-0.7: both means outside the other side's range."""
    import speculative_rollouts

    def side(accuracies, speculative=False):
        evals = [{"step": step, "accuracy": accuracy} for step, accuracy in zip((0, 4), accuracies, strict=True)]
        extra = {"acceptance_rate": [0.25], "tokens_per_row_forward": [1.5]} if speculative else {}
        return {"evals": evals, "rewards": [0.1], **extra}

    runs = [
        {"plain": side(plain), "speculative": side(ours, speculative=True)}
        for plain, ours in (((0.4, 0.5), (0.5, 0.1)), ((0.6, 0.7), (0.5, 0.1)), ((0.5, 0.6), (0.5, 0.1)))
    ]
    summary = speculative_rollouts.accuracy_summary(runs)
    first, second = summary["per_step"]
    assert first["speculative_mean_within_plain_seeds"] and first["plain_mean_within_speculative_seeds"]
    assert not second["speculative_mean_within_plain_seeds"] and not second["plain_mean_within_speculative_seeds"]
    assert second["plain"] == {"per_seed": [0.5, 0.7, 0.6], "mean": pytest.approx(0.6), "min": 0.5, "max": 0.7}
    assert not summary["speculative_within_plain_at_every_step"]
    assert summary["speculative_acceptance_rate"] == 0.25 and summary["speculative_tokens_per_row_forward"] == 1.5


def test_the_gsm8k_format_file_is_gsm8k_shaped_and_its_steps_add_up(benchmark_in_this_process):
    """benchmarks/data/gsm8k_format.jsonl (written for the benchmark): GSM8K's fields, every `<<expression=value>>`
    calculator note right, the `#### N` final answer the last note's value."""
    import re

    import speculative_rollouts

    problems = speculative_rollouts.gsm8k_problems()
    assert len(problems) == 16 and len({row["question"] for row in problems}) == 16
    for row in problems:
        assert set(row) == {"question", "answer"} and row["question"].endswith("?")
        steps, final = row["answer"].rsplit("\n#### ", 1)
        notes = re.findall(r"<<([^=<>]+)=([^<>]+)>>", steps)
        assert notes, row
        for expression, value in notes:
            assert re.fullmatch(r"[\d+\-*/() ]+", expression), expression
            assert eval(expression) == float(value), (expression, value)  # noqa: S307 (digits and operators only)
        assert final == notes[-1][1] and final.isdigit(), row


# ------------------------------------------------------------------------------------ vLLM's own (vllm_speculative_config)

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


def test_vllm_speculative_config_reaches_the_settings_from_python_and_the_command_line(tmp_path):
    """A dict, or the JSON string a command line gives (TRL's parser), is the engine's `speculative_config`."""
    from trl import TrlParser

    from grpo_plus.config import PlusSettings

    common = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", use_vllm=True)
    config = grpo_plus.GRPOConfig(**common, vllm_speculative_config=NGRAM)
    assert PlusSettings.from_config(config).vllm.speculative_config == NGRAM
    argv = [f"--{name}={value}" for name, value in common.items()]
    (parsed,) = TrlParser((grpo_plus.GRPOConfig,)).parse_args_and_config(
        argv
        + ["--vllm_speculative_config", '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}']
    )
    assert PlusSettings.from_config(parsed).vllm.speculative_config == NGRAM
    assert PlusSettings.from_config(grpo_plus.GRPOConfig(**common)).vllm.speculative_config is None


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        (dict(vllm_speculative_config=NGRAM), "None without vLLM (use_vllm=False)"),
        (
            dict(vllm_speculative_config=NGRAM, use_vllm=True, vllm_mode="server"),
            'grpo-plus vllm-serve --speculative_config \'{"method": "ngram"',
        ),
        (dict(vllm_speculative_config={"num_speculative_tokens": 4}, use_vllm=True), 'a dict with a "method"'),
        (dict(vllm_speculative_config="ngram", use_vllm=True), "a JSON object"),
        (dict(vllm_speculative_config=["ngram"], use_vllm=True), "a dict, as vLLM's speculative_config takes it"),
    ],
)
def test_a_vllm_speculative_config_that_cannot_work_is_refused_at_construction(tmp_path, kwargs, fragment):
    with pytest.raises(ConfigError, match="vllm_speculative_config") as error:
        grpo_plus.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", **kwargs)
    assert fragment in str(error.value)


def test_grpo_plus_vllm_serve_checks_its_speculative_config_before_starting_vllm():
    """`grpo-plus vllm-serve --speculative_config` (TRL's flag, handed to `vllm serve --speculative-config`): a value
    with no "method" is refused by name before any process starts."""
    from grpo_plus.engine.server import serve

    with pytest.raises(ConfigError, match='--speculative_config=.* must be a dict with a "method"'):
        serve(["--model", "unused", "--speculative_config", '{"num_speculative_tokens": 4}'])
