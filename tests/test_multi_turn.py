"""Multi-turn generation without re-prefilling (grpo_plus.zero_waste.multi_turn): TRL's tool loop, each row's cache kept from one
tool turn to the next, the same tokens as stock TRL's loop."""

from __future__ import annotations

import pytest
import torch
import trl
from datasets import Dataset
from helpers.models import make_tokenizer, tiny_config
from helpers.probes import logged, max_weight_diff
from helpers.tool_model import TurnRecorder, increment, number_prompts, tool_trainer, two_turns
from transformers import AutoModelForCausalLM, GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.cache_utils import DynamicCache

import grpo_plus
from grpo_plus.zero_waste.generation import generate
from grpo_plus.zero_waste.multi_turn import KeptRow, TurnCache

needs_loop = pytest.mark.floor("multi_turn_cache")
needs_training = pytest.mark.floor("cpu_logps")


# ------------------------------------------------------------------------------------------------ the cache, alone


class Recorder(LogitsProcessor):
    """Records the logits of every step (greedy decoding: they decide the tokens)."""

    def __init__(self):
        self.logits = []

    def __call__(self, input_ids, scores):
        self.logits.append(scores.clone())
        return scores


@needs_loop
@pytest.mark.parametrize(
    ("family", "lora"),
    [("llama", False), ("qwen3", True), ("gpt2", False), ("mistral", False)],  # mistral: a 4096-token sliding window
)
def test_a_tool_turn_continues_the_kept_cache_like_a_fresh_prefill(family, lora):
    """The second turn from the first turn's kept cache: the same sampled ids and random draws as model.generate's
    fresh prefill of the whole history, greedy logits within float noise, and only the new columns prefilled."""
    model, config, turns, (ids, mask) = two_turns(family, lora)
    kept = list(turns._current)
    for seed in range(3):
        turns._current = list(kept)
        torch.manual_seed(seed)
        reference = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        state_after_reference = torch.get_rng_state()
        torch.manual_seed(seed)
        ours, stats = generate(model, turns=turns, input_ids=ids, attention_mask=mask, generation_config=config)
        assert torch.equal(ours, reference)
        assert torch.equal(torch.get_rng_state(), state_after_reference), "the random draws were not the same"
        # each row's new columns: the tool output (2-4 tokens) and the EOS the previous turn sampled but never fed
        assert stats.prefill_positions == len(ids) * 5 and stats.full_prefill_positions == ids.numel()

    greedy = GenerationConfig(**{**config.to_dict(), "do_sample": False, "temperature": None})
    recorded = []
    for reuse in (False, True):
        turns._current = list(kept)
        recorder = Recorder()
        kwargs = dict(input_ids=ids, attention_mask=mask, generation_config=greedy)
        kwargs["logits_processor"] = LogitsProcessorList([recorder])
        if reuse:
            sequences = generate(model, turns=turns, **kwargs)[0]
        else:
            sequences = model.generate(**kwargs)
        recorded.append((sequences, recorder.logits[0]))
    (reference, reference_logits), (ours, our_logits) = recorded
    assert torch.equal(ours, reference)
    # the kept keys/values were computed one decode step at a time, TRL's in one prefill: float rounding only
    assert (our_logits - reference_logits).abs().max().item() <= 5e-7  # worst 1.3e-7 (threads 1-2): 3.7x


@needs_loop
def test_a_history_that_does_not_extend_a_kept_row_shares_only_its_common_prefix():
    """A row TRL cut short (a tool result rolled back, a completion truncated to the budget) or rebuilt differently
    continues from the longest prefix it shares with a kept row; a row sharing nothing is prefilled whole."""
    model, config, turns, (ids, mask) = two_turns("llama", lora=False)
    kept = list(turns._current)
    longest = int(mask[:, 0].nonzero()[0])  # a row without padding
    other = (longest + 1) % len(ids)
    cut = ids.clone()
    cut[other, -6:-3] = 4  # this row differs from its history 6 columns before its end
    cut[longest, 0] = 5  # this one differs at its first token: no column can be filled
    turns._current = list(kept)
    torch.manual_seed(0)
    reference = model.generate(input_ids=cut, attention_mask=mask, generation_config=config)
    torch.manual_seed(0)
    ours, stats = generate(model, turns=turns, input_ids=cut, attention_mask=mask, generation_config=config)
    assert torch.equal(ours, reference)
    assert stats.prefill_positions == stats.full_prefill_positions  # row 1 needs every column: nothing filled

    # row 0's kept cache cut to its first 6 tokens (and no other kept row sharing more): 6 columns are reused
    row = ids[0, mask[0].bool()].tolist()
    source = max(kept, key=lambda kept_row: longest_shared_prefix(kept_row.tokens.tolist(), row))
    cut_short = KeptRow(source.tokens[:6], [k[:, :6] for k in source.keys], [v[:, :6] for v in source.values])
    others = [k for k in kept if longest_shared_prefix(k.tokens.tolist(), row) <= 6]
    turns._current = [cut_short, *others]
    torch.manual_seed(0)
    reference = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    torch.manual_seed(0)
    ours, stats = generate(model, turns=turns, input_ids=ids, attention_mask=mask, generation_config=config)
    assert torch.equal(ours, reference)
    assert mask[0].all() and stats.prefill_positions == len(ids) * (len(row) - 6)


@needs_loop
def test_kept_rows_keep_only_real_tokens_and_the_longest_prefix_wins():
    cache = DynamicCache()
    keys = torch.arange(2 * 1 * 4 * 2, dtype=torch.float32).reshape(2, 1, 4, 2)
    cache.update(keys, -keys, 0)
    turns = TurnCache()
    sequences = torch.tensor([[0, 7, 8, 9, 1], [5, 6, 7, 8, 2]])  # the last column was sampled, not fed
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    turns.keep(cache, torch.tensor([0, 1]), sequences, mask)
    first, second = turns._current
    assert first.tokens.tolist() == [7, 8, 9] and torch.equal(first.keys[0], keys[0, :, 1:])
    assert second.tokens.tolist() == [5, 6, 7, 8] and torch.equal(second.values[0], -keys[1])

    fresh = DynamicCache()
    ids = torch.tensor([[3, 5, 6, 7, 8, 2, 4], [0, 0, 7, 8, 9, 1, 4], [0, 0, 0, 0, 0, 0, 9]])
    new_mask = (ids != 0).long()
    new_mask[0, 0] = 1
    filled = turns.restore(fresh, ids, new_mask)
    # row 0 shares nothing (its first token is 3), so only columns every row has kept are filled: none
    assert filled == 0 and fresh.get_seq_length() == 0

    fresh = DynamicCache()
    filled = turns.restore(fresh, ids[1:], new_mask[1:])  # a new call: it reads what the last call kept
    assert filled == 0  # nothing was kept by the call before (restore started a new call)
    turns._current = [first, second]
    filled = turns.restore(fresh, ids[1:], new_mask[1:])
    # row 0 (7 8 9 1 4) extends kept row 0 (7 8 9): new tokens 1 4; row 1 is one token: it must be fed
    assert filled == 5
    assert torch.equal(fresh.layers[0].keys[0, :, 2:5], keys[0, :, 1:])
    assert not fresh.layers[0].keys[1].any()  # padding columns hold zeros (masked)


# ------------------------------------------------------------------------------------------------ in the trainer


def longest_shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def expected_prefill_positions(calls: list[dict]) -> int:
    """What grpo_plus prefills for the generation calls of one round: the first call, each distinct prompt once; a
    later call, per distinct row, the tokens after the longest prefix it shares with a row the previous call generated
    (its input and completion but the last token, sampled and never fed), padded to the longest of them."""
    total, previous = 0, None
    for call in calls:
        rows = call["prompt_ids"]
        new = max(len(row) for row in rows)
        if previous is not None:
            kept = [p + c[:-1] for p, c in zip(previous["prompt_ids"], previous["completion_ids"], strict=True)]
            shared = [min(max(longest_shared_prefix(k, row) for k in kept), len(row) - 1) for row in rows]
            new = max(len(row) - s for row, s in zip(rows, shared, strict=True))
        total += len({tuple(row) for row in rows}) * new
        previous = call
    return total


def train_with_tools(package, tool_model_dir, output_dir, **settings):
    trainer = tool_trainer(
        package, tool_model_dir, output_dir, train_dataset=Dataset.from_list(number_prompts(8)), tools=[increment],
        **settings,
    )  # fmt: skip
    batches = []
    score = trainer._generate_and_score_completions

    def recording(inputs):
        output = score(inputs)
        batches.append({k: v.clone() for k, v in output.items() if k.endswith(("_ids", "_mask"))})
        return output

    trainer._generate_and_score_completions = recording
    recorder = TurnRecorder(trainer)
    trainer.train()
    return trainer, recorder, batches


@needs_loop
@needs_training
@pytest.mark.parametrize("sampling", ["sampled", "greedy"])
def test_tool_turns_give_stock_trls_tokens_prefilling_only_what_is_new(tool_model_dir, tmp_path, sampling):
    """Two steps of stock TRL and grpo_plus with tools on a model that makes real tool calls (float32, SGD): the same
    prompt and completion ids, completion and tool masks, losses and weights; TRL prefills prompt + history at every
    turn, grpo_plus each distinct prompt once and then only the new tokens of each turn."""
    # greedy: 4 prompts x 2 (identical) rows, so that the rows differ across prompts; a group's rows are identical,
    # so its advantages are 0 and the weights do not move: the greedy case checks the generation
    greedy = dict(generation_kwargs={"do_sample": False}, num_generations=2, max_steps=1)
    settings = {} if sampling == "sampled" else greedy
    runs = {}
    for package in (trl, grpo_plus):
        trainer, recorder, batches = train_with_tools(package, tool_model_dir, tmp_path / package.__name__, **settings)
        runs[package.__name__] = (trainer, recorder, batches)
    (trl_trainer, trl_turns, trl_batches), (ours, our_turns, our_batches) = runs.values()

    for theirs, mine in zip(trl_batches, our_batches, strict=True):
        assert theirs.keys() == mine.keys() and "tool_mask" in mine
        assert all(torch.equal(theirs[key], mine[key]) for key in theirs)
    assert [c["prompt_ids"] for c in our_turns.calls] == [c["prompt_ids"] for c in trl_turns.calls]
    assert [c["completion_ids"] for c in our_turns.calls] == [c["completion_ids"] for c in trl_turns.calls]
    assert logged(ours, "loss") == logged(trl_trainer, "loss")
    assert max_weight_diff(trl_trainer.model.state_dict(), ours.model.state_dict()) <= 4e-7  # worst 1.2e-7: 3.4x

    # real tool use: calls that were answered, and rows that went on for a second tool turn
    assert all(0 < frequency for frequency in logged(ours, "tools/call_frequency"))
    assert any(
        ((batch["tool_mask"][:, 1:] - batch["tool_mask"][:, :-1]) == -1).sum(dim=1).max() >= 2 for batch in our_batches
    ), "no row made two tool calls"
    assert max(len(calls) for calls in our_turns.rounds) >= 3  # a round of three generation calls (turns)
    # TRL: every turn prefills every row's prompt + history (its padded width); grpo_plus: what is new
    assert trl_turns.prefill_positions == sum(
        len(c["prompt_ids"]) * max(map(len, c["prompt_ids"])) for c in trl_turns.calls
    )
    assert our_turns.prefill_positions == sum(expected_prefill_positions(calls) for calls in our_turns.rounds)
    print(f"prefill positions: TRL {trl_turns.prefill_positions}, grpo_plus {our_turns.prefill_positions}")
    assert our_turns.prefill_positions < 0.25 * trl_turns.prefill_positions
    for calls in our_turns.rounds:
        prompt_length = max(map(len, calls[0]["prompt_ids"]))
        for call in calls[1:]:  # a tool turn prefills no column of any row's prompt, let alone of its history
            assert call["forwards"][0][1] <= min(map(len, call["prompt_ids"])) - prompt_length
    fractions = logged(ours, "zero_waste/generation_prefill_positions_frac")
    assert fractions and all(f < 0.5 for f in fractions)


@needs_loop
def test_a_sliding_window_cache_is_not_kept_and_says_why():
    """A sliding-window layer drops the oldest keys/values once the sequence outgrows its window (here 4 tokens):
    the next turn prefills the whole history, as TRL does."""
    tokenizer = make_tokenizer()
    torch.manual_seed(0)
    config = tiny_config("mistral", len(tokenizer), sliding_window=4)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    ids = torch.randint(3, len(tokenizer), (2, 9), generator=torch.Generator().manual_seed(0))
    generation = GenerationConfig(max_new_tokens=3, do_sample=False, pad_token_id=0, disable_compile=True)
    turns = TurnCache()
    _, stats = generate(model, turns=turns, input_ids=ids, generation_config=generation)
    assert "DynamicSlidingWindowLayer" in stats.turns_blocker and turns._current == []
    reference = model.generate(input_ids=ids, generation_config=generation)
    ours, stats = generate(model, turns=turns, input_ids=ids, generation_config=generation)
    assert torch.equal(ours, reference) and stats.prefill_positions == stats.full_prefill_positions


# ------------------------------------------------------------------------------------------------ the benchmark


@needs_loop
@needs_training
def test_multi_turn_benchmark_smoke_matches_stock_trl_and_counts_the_saving(
    tool_model_dir, tmp_path, benchmark_in_this_process
):
    """benchmarks/multi_turn.py --smoke on the session's tool model, in this process: both trainers sample the same
    completions and log the same losses, and grpo_plus's prefills are a fraction of TRL's."""
    import json

    import multi_turn

    multi_turn.main(["--smoke", "--model-dir", tool_model_dir, "--json", str(tmp_path / "out.json")])
    result = json.loads((tmp_path / "out.json").read_text())["multi_turn"]
    assert result["same_completions"] and result["max_loss_difference"] == 0.0
    assert result["trl"]["turns"] >= 2 and result["trl"]["tool_calls_per_row"] > 0
    assert result["prefill_positions_ratio"] < 0.5 and result["positions_ratio"] < 1
