"""Zero-waste generation: transformers' `model.generate` results with each prompt prefilled once and finished rows
out of the decode batch; TRL's own generation wherever that would not hold."""

from __future__ import annotations

import logging

import pytest
import torch
import trl
from datasets import Dataset
from helpers.models import make_tokenizer, tiny_config, tiny_trainer
from helpers.probes import ForwardLog
from peft import LoraConfig, get_peft_model
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)

import grpo_plus
from grpo_plus.compat.versions import version_gap
from grpo_plus.zero_waste import generation
from grpo_plus.zero_waste.generation import (
    GenerationStats,
    distinct_rows,
    generate,
    generation_blocker,
    transformers_blocker,
)

# PEFT warns that it switches GPT-2's Conv1D layers to fan_in_fan_out, which is what they need.
pytestmark = pytest.mark.filterwarnings("ignore:fan_in_fan_out is set to False:UserWarning")
# Where the docs say zero-waste generation is on (compat.versions.SAVING_VERSION_FLOORS), its tests run and must pass.
needs_loop = pytest.mark.floor("zero_waste_generation")
FAMILIES = ("llama", "qwen2", "gpt2")  # rotary positions (llama, qwen2) and learned absolute ones (gpt2)
G, NEW_TOKENS = 4, 10
PROMPT_LENGTHS = (9, 5, 7)  # one batch, left-padded to the longest


def tiny_model(family: str, lora: bool = False, seed: int = 0):
    tokenizer = make_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, len(tokenizer)), dtype=torch.float32)
    if lora:  # B initialized randomly too, so the adapter changes the logits
        model = get_peft_model(
            model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
        )
    return model.eval(), tokenizer


def grouped_batch(vocab_size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """len(PROMPT_LENGTHS) prompts of different lengths, each repeated G times (TRL's layout), left-padded."""
    generator = torch.Generator().manual_seed(seed)
    width = max(PROMPT_LENGTHS)
    ids = torch.zeros(len(PROMPT_LENGTHS), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(PROMPT_LENGTHS):
        ids[row, width - length :] = torch.randint(3, vocab_size, (length,), generator=generator)
        mask[row, width - length :] = 1
    return ids.repeat_interleave(G, dim=0), mask.repeat_interleave(G, dim=0)


def sampling_config(tokenizer, **overrides) -> GenerationConfig:
    """TRL's generation settings (its GRPOConfig fields) plus an EOS bias so that rows end at different steps."""
    settings = dict(
        max_new_tokens=NEW_TOKENS,
        do_sample=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id],
        temperature=0.7,
        top_p=0.95,
        top_k=30,
        min_p=0.01,
        repetition_penalty=1.1,
        sequence_bias=[[[tokenizer.eos_token_id], 1.5]],  # a generation_kwargs entry in TRL's config
        disable_compile=True,
    )
    settings.update(overrides)
    return GenerationConfig(**settings)


def both(model, seed: int = 0, **kwargs) -> tuple[torch.Tensor, torch.Tensor, GenerationStats]:
    """model.generate's and grpo_plus's sequences from the same random state; also checks both consumed the same
    random numbers (the state after is the same)."""
    torch.manual_seed(seed)
    reference = model.generate(**kwargs)
    state_after_reference = torch.get_rng_state()
    torch.manual_seed(seed)
    ours, stats = generate(model, **kwargs)
    assert torch.equal(torch.get_rng_state(), state_after_reference), "the random draws were not the same"
    return reference, ours, stats


def finish_lengths(sequences: torch.Tensor, prompt_width: int, eos_token_id: int) -> set[int]:
    """Distinct numbers of new tokens up to and including each row's first EOS."""
    completions = sequences[:, prompt_width:]
    ends = [(row == eos_token_id).nonzero() for row in completions]
    return {int(end[0]) + 1 if len(end) else completions.shape[1] for end in ends}


# ------------------------------------------------------------------------------------------------ the loop itself


@needs_loop
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("family", FAMILIES)
def test_sampled_ids_are_model_generates(family, lora):
    model, tokenizer = tiny_model(family, lora)
    ids, mask = grouped_batch(len(tokenizer))
    config = sampling_config(tokenizer)
    for seed in range(3):
        reference, ours, stats = both(model, seed, input_ids=ids, attention_mask=mask, generation_config=config)
        assert torch.equal(ours, reference)
        assert stats.fallback is None
        # rows ended at different steps, so the decode batch shrank; each prompt was prefilled once
        assert len(finish_lengths(reference, ids.shape[1], tokenizer.eos_token_id)) > 1
        decoded = stats.positions - len(PROMPT_LENGTHS) * ids.shape[1]
        assert decoded < (reference.shape[1] - ids.shape[1] - 1) * len(ids)
        assert stats.full_positions == len(ids) * (reference.shape[1] - 1)


@needs_loop
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_ids_are_model_generates_without_repeated_prompts(family):
    """Held-out evaluation's case: distinct prompts, greedy; only finished rows are saved."""
    model, tokenizer = tiny_model(family, lora=True)
    ids, mask = grouped_batch(len(tokenizer))
    ids, mask = ids[::G], mask[::G]
    greedy = dict(do_sample=False, temperature=None, top_p=None, top_k=None, min_p=None)
    for eos_bias in (0.0, 0.1, 0.2, 0.3):  # greedy rows of a random model end together unless EOS is near a tie
        config = sampling_config(tokenizer, sequence_bias=[[[tokenizer.eos_token_id], eos_bias]], **greedy)
        reference = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        if len(finish_lengths(reference, ids.shape[1], tokenizer.eos_token_id)) > 1:
            break
    else:
        pytest.fail("no EOS bias made the greedy rows end at different steps")
    ours, stats = generate(model, input_ids=ids, attention_mask=mask, generation_config=config)
    assert torch.equal(ours, reference)
    assert stats.positions < stats.full_positions


class StopAfterToken(StoppingCriteria):
    """Ends a row at `token` without being an EOS criterion: transformers' loop then keeps sampling for the row."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


@needs_loop
def test_rows_ended_without_an_eos_criterion_keep_sampling_like_model_generate():
    model, tokenizer = tiny_model("llama", lora=True)
    model.config.eos_token_id = model.generation_config.eos_token_id = None  # no EOS stopping criterion at all
    ids, mask = grouped_batch(len(tokenizer))
    stop = 40
    config = sampling_config(tokenizer, eos_token_id=None, sequence_bias=[[[stop], 1.5]])
    criteria = StoppingCriteriaList([StopAfterToken(stop)])
    kwargs = dict(input_ids=ids, attention_mask=mask, generation_config=config, stopping_criteria=criteria)
    reference, ours, stats = both(model, **kwargs)
    assert torch.equal(ours, reference)
    completions = reference[:, ids.shape[1] :]
    stopped_early = [row for row in completions.tolist() if stop in row[:-1]]
    assert stopped_early and any(row[row.index(stop) + 1] != tokenizer.pad_token_id for row in stopped_early)
    assert stats.positions - len(PROMPT_LENGTHS) * ids.shape[1] == len(ids) * (completions.shape[1] - 1)


class ForcedTokens(LogitsProcessor):
    """Teacher forcing: records the logits each row gets, then makes `tokens[:, step]` the only choice."""

    def __init__(self, tokens: torch.Tensor):
        self.tokens, self.logits = tokens, []

    def __call__(self, input_ids, scores):
        self.logits.append(scores.clone())
        forced = torch.full_like(scores, float("-inf"))
        step = len(self.logits) - 1
        return forced.scatter(1, self.tokens[:, step : step + 1], 0.0)


@needs_loop
@pytest.mark.parametrize("family", FAMILIES)
def test_per_step_logits_are_model_generates_under_teacher_forcing(family):
    """The same forced tokens (rows ending with EOS at different steps) through both loops: every unfinished row's
    logits at every step agree to float32 noise."""
    model, tokenizer = tiny_model(family, lora=True)
    ids, mask = grouped_batch(len(tokenizer))
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, len(tokenizer), (len(ids), NEW_TOKENS), generator=generator)
    ends = torch.randint(1, NEW_TOKENS, (len(ids),), generator=generator)
    tokens[torch.arange(len(ids)), ends] = tokenizer.eos_token_id
    config = sampling_config(tokenizer, do_sample=False, temperature=None, top_p=None, top_k=None, min_p=None)
    config.repetition_penalty, config.sequence_bias = None, None
    recorded = {}
    for name in ("reference", "ours"):
        forced = ForcedTokens(tokens)
        kwargs = dict(input_ids=ids, attention_mask=mask, generation_config=config)
        kwargs["logits_processor"] = LogitsProcessorList([forced])
        sequences = model.generate(**kwargs) if name == "reference" else generate(model, **kwargs)[0]
        recorded[name] = (sequences, torch.stack(forced.logits))
    (reference, reference_logits), (ours, our_logits) = recorded["reference"], recorded["ours"]
    assert torch.equal(ours, reference)
    assert reference.shape[1] - ids.shape[1] == int(ends.max()) + 1
    for step in range(len(reference_logits)):
        unfinished = ends >= step  # rows that have not emitted their EOS before this step
        diff = (our_logits[step][unfinished] - reference_logits[step][unfinished]).abs().max().item()
        assert diff <= 5e-7, (step, diff)  # float32: worst 1.5e-7 (threads 1-2): 3.4x
    assert not torch.equal(our_logits[-1], reference_logits[-1])  # finished rows were not computed


def test_distinct_rows_keep_the_order_of_first_appearance():
    ids = torch.tensor([[0, 5, 6], [1, 2, 3], [0, 5, 6], [1, 2, 3], [0, 0, 6]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1], [0, 0, 1]])
    first, prompt_of_row = distinct_rows(ids, mask)
    assert first.tolist() == [0, 1, 4]
    assert prompt_of_row.tolist() == [0, 1, 0, 1, 2]
    # the same tokens under another mask are another prompt
    first, prompt_of_row = distinct_rows(torch.tensor([[5, 6], [5, 6]]), torch.tensor([[1, 1], [0, 1]]))
    assert first.tolist() == [0, 1] and prompt_of_row.tolist() == [0, 1]


# ------------------------------------------------------------------------------------------------ fallbacks


@pytest.mark.parametrize(
    "case, reason",
    [
        # on transformers 4.x the loop never runs, for the last case's reason, which comes first
        pytest.param("beams", "generation mode is beam_sample", marks=needs_loop),
        pytest.param("static_cache", "cannot be copied by row", marks=needs_loop),
        pytest.param("unknown_input", "model inputs token_type_ids", marks=needs_loop),
        pytest.param("scores", "return_dict_in_generate", marks=needs_loop),
        pytest.param("lockstep", "DeepSpeed ZeRO-3 / FSDP", marks=needs_loop),
        # TRL generates with the model in training mode: LoRA dropout (TRL's CLI: 0.05) is active then
        pytest.param("dropout", "dropout is active", marks=needs_loop),
        ("old_transformers", "decodes with another loop"),
    ],
)
def test_fallbacks_run_model_generate_unchanged(case, reason, monkeypatch):
    model, tokenizer = tiny_model("gpt2")
    ids, mask = grouped_batch(len(tokenizer))
    config = sampling_config(tokenizer)
    kwargs = dict(input_ids=ids, attention_mask=mask, generation_config=config)
    if case == "beams":
        config.num_beams = 2
    elif case == "static_cache":
        config.cache_implementation = "static"
    elif case == "unknown_input":  # a model input the loop does not split by row (as if it knew no token types)
        kwargs["token_type_ids"] = torch.zeros_like(ids)
        monkeypatch.setattr(generation, "ROW_INPUTS", ("attention_mask", "position_ids"))
    elif case == "scores":
        config.return_dict_in_generate, config.output_scores = True, True
    elif case == "dropout":
        model.transformer.drop.p = 0.1
        model.train()
    elif case == "lockstep":
        monkeypatch.setattr(generation, "processes_in_lockstep", lambda model: True)
    elif case == "old_transformers":  # transformers 4.x decodes with another loop (the matrix's oldest env has one)
        monkeypatch.setattr(generation, "transformers_blocker", lambda: "transformers 4.56 decodes with another loop")
    if case in ("dropout", "lockstep", "old_transformers"):  # decided before generate runs: the loop is never entered
        monkeypatch.setattr(generation, "decode_rows", lambda *args: pytest.fail("grpo_plus's loop ran"))
    reference, ours, stats = both(model, **kwargs)
    if case == "scores":
        reference, ours = reference.sequences, ours.sequences
    assert torch.equal(ours, reference)
    assert reason in stats.fallback
    assert stats.positions_frac == 1.0


@needs_loop
def test_token_type_ids_are_split_by_row_like_the_mask():
    """A per-token model input (GPT-2's token type embeddings; Gemma 3's image tokens) follows each row: the same ids as
    model.generate, each prompt prefilled once."""
    model, tokenizer = tiny_model("gpt2")
    ids, mask = grouped_batch(len(tokenizer))
    token_types = (torch.arange(ids.shape[1]) % 2).expand_as(ids).clone() * mask
    reference, ours, stats = both(
        model,
        input_ids=ids,
        attention_mask=mask,
        token_type_ids=token_types,
        generation_config=sampling_config(tokenizer),
    )
    assert stats.fallback is None and torch.equal(ours, reference)
    assert stats.prefill_positions * G == stats.full_prefill_positions


@needs_loop
def test_installed_transformers_runs_the_loop():
    assert transformers_blocker() is None


@pytest.mark.parametrize(
    "flags, reason",
    [
        (dict(use_vllm=True), "vLLM"),
        (dict(continuous_batching=True), "continuous batching"),
    ],
)
def test_generation_blocker_names_each_reason(flags, reason):
    settings = dict(use_vllm=False, continuous_batching=False) | flags
    assert reason in generation_blocker(**settings)


# ------------------------------------------------------------------------------------------------ in the trainer


class LengthReward:
    """Scores a completion by its length and records every batch of completions it scored."""

    __name__ = "length"

    def __init__(self):
        self.completions = []

    def __call__(self, completions, **kwargs):
        self.completions.append(list(completions))
        return [float(len(c)) for c in completions]


def generation_trainer(tmp_path, package=grpo_plus, peft_config=None, reward=None, **overrides):
    """`package`'s trainer on prompts of different lengths, with TRL's sampling settings and a generation_kwargs entry."""
    model, tokenizer = tiny_model("llama")
    settings = dict(
        per_device_train_batch_size=8,
        num_generations=G,
        max_completion_length=NEW_TOKENS,
        learning_rate=0.1,
        optim="sgd",
        temperature=0.7,
        top_k=30,
        generation_kwargs={"sequence_bias": [[[tokenizer.eos_token_id], 1.5]]},
    )
    rows = [{"prompt": "1+2=" + "9" * (i % 3)} for i in range(8)]  # prompts of different lengths in one batch
    return tiny_trainer(
        tmp_path,
        [reward or LengthReward()],
        model=model,
        tokenizer=tokenizer,
        dataset=Dataset.from_list(rows),
        peft_config=peft_config,
        package=package,
        **{**settings, **overrides},
    )


@needs_loop
@pytest.mark.slow
@pytest.mark.floor("cpu_logps")
def test_trainer_generates_stock_trls_completions_with_lora(tmp_path):
    """Two training steps of stock TRL and grpo_plus (LoRA, left-padded prompts of different lengths, EOS at
    different steps): the same completions, the same weights, and grpo_plus computed fewer positions."""
    runs = {}
    for package in (trl, grpo_plus):
        reward = LengthReward()
        trainer = generation_trainer(
            tmp_path / package.__name__, package, LoraConfig(r=4, lora_alpha=8), reward=reward
        )
        forwards = ForwardLog(trainer.model)
        trainer.train()
        weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items() if "lora" in k}
        runs[package.__name__] = (reward.completions, weights, forwards, trainer.state.log_history)
    (trl_completions, trl_weights, trl_forwards, _), (ours, our_weights, our_forwards, logs) = runs.values()
    assert ours == trl_completions
    assert len({len(c) for batch in ours for c in batch}) > 1, "every completion had the same length"
    assert max((trl_weights[k] - our_weights[k]).abs().max().item() for k in trl_weights) <= 3e-8  # worst 7.5e-9
    generated = [call for call in our_forwards.calls if not call["grad"]]
    assert sum(call["shape"][0] * call["shape"][1] for call in generated) < 0.6 * sum(
        call["shape"][0] * call["shape"][1] for call in trl_forwards.calls if not call["grad"]
    )
    fractions = [entry["zero_waste/generation_positions_frac"] for entry in logs if "loss" in entry]
    assert fractions and all(f < 0.6 for f in fractions)


def no_generation_outputs(trainer, prompt_ids):
    return [[trainer.processing_class.eos_token_id]] * len(prompt_ids), None


@pytest.mark.parametrize(
    "setting, reason",
    [
        ("use_vllm", "vLLM"),
        ("continuous_batching", "continuous batching"),
        ("zero_waste_generation=False", None),
    ],
)
def test_trainer_falls_back_to_trls_generation(tmp_path, monkeypatch, caplog, setting, reason):
    """Where grpo_plus's loop does not apply, TRL's `_generate_single_turn` runs with `model.generate` untouched,
    and the reason is logged once."""
    # Nothing here trains, so TRL 1.15's missing CPU log-prob kernel does not matter.
    monkeypatch.setattr("grpo_plus.trainer.logps_unavailable_reason", lambda device_type: None)
    trainer = generation_trainer(tmp_path, zero_waste_generation=setting != "zero_waste_generation=False")
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    patched_during_trl_call = []

    def trl_generation(self, prompt_ids, images, multimodal_fields, *args, **kwargs):
        patched_during_trl_call.append("generate" in model.__dict__)
        return no_generation_outputs(self, prompt_ids)

    monkeypatch.setattr(trl.GRPOTrainer, "_generate_single_turn", trl_generation)
    images, fields = None, {}
    if setting == "use_vllm":
        trainer.use_vllm = True
    elif setting == "continuous_batching":
        trainer.use_transformers_continuous_batching = True
    prompt_ids = [[5, 6, 7]] * G
    with caplog.at_level(logging.WARNING, logger="grpo_plus.trainer"):
        for _ in range(2):
            trainer._generate_single_turn(prompt_ids, images, fields, G)
    assert patched_during_trl_call == [False, False]
    notes = [r.getMessage() for r in caplog.records if "generation computed in full" in r.getMessage()]
    if reason is None:
        assert notes == []
    else:
        assert len(notes) == 1 and reason in notes[0], notes

    # control: with nothing in the way, TRL's method runs with grpo_plus's generate installed
    if reason is not None and version_gap("zero_waste_generation") is None:
        trainer.use_vllm = trainer.use_transformers_continuous_batching = False
        trainer._generate_single_turn(prompt_ids, None, {}, G)
        assert patched_during_trl_call[-1] is True
    assert "generate" not in model.__dict__  # removed again after the call
