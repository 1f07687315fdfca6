"""Zero-waste training pass, pure torch: shared-prompt packing (layout, positions, targets, block mask), when packing
pays, which rows carry gradient, TRL's row chunks."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from grpo_plus.zero_waste.rows import (
    IGNORE_INDEX,
    block_attention_mask,
    pack_shared_prompts,
    plan_packs,
    row_chunks,
    rows_with_gradient,
)


def test_pack_layout_positions_targets_and_mask():
    prompt_ids = torch.tensor([[0, 5, 6, 7], [0, 5, 6, 7], [8, 9, 10, 11]])
    prompt_mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1]])
    completion_ids = torch.tensor([[20, 21, 22], [30, 0, 0], [40, 41, 0]])
    completion_mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]])
    batch = pack_shared_prompts(prompt_ids, prompt_mask, completion_ids, completion_mask, hidden_size=1024)
    # Pack 0: prompt [5, 6] once, then [7, 20, 21] -> predicts [20, 21, 22] and [7] -> predicts [30].
    assert batch.input_ids.tolist() == [[5, 6, 7, 20, 21, 7], [8, 9, 10, 11, 40, 0]]
    # Padding continues the positions (5): a position that restarts would tell transformers a sequence was packed.
    assert batch.position_ids.tolist() == [[1, 2, 3, 4, 5, 3], [0, 1, 2, 3, 4, 5]]
    ignore = IGNORE_INDEX
    assert batch.targets.tolist() == [[ignore, ignore, 20, 21, 22, 30], [ignore] * 3 + [40, 41, ignore]]
    # The second completion of the first group sees the prompt (positions 0-1) and itself, not the first completion.
    assert batch.block_mask[0, 0, 5].tolist() == [True, True, False, False, False, True]
    assert batch.block_mask[1, 0, 5].tolist() == [False] * 5 + [True]  # padding attends only itself
    assert sorted(zip(*[t.tolist() for t in batch.destination], strict=True)) == [
        (0, 0), (0, 1), (0, 2), (1, 0), (2, 0), (2, 1),
    ]  # fmt: skip


def test_rows_without_a_shared_prompt_need_no_mask_unless_a_token_inside_is_masked():
    """One completion per pack (nothing shared), each row's tokens without a gap: causal attention alone is TRL's
    masked attention, so the forward runs without a mask (`mask_free`); a masked key inside a row needs the mask."""
    prompt_ids = torch.tensor([[0, 5, 6], [8, 9, 10]])
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    completion_ids = torch.tensor([[20, 21, 0], [40, 41, 42]])
    completion_mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    batch = pack_shared_prompts(prompt_ids, prompt_mask, completion_ids, completion_mask, hidden_size=1024)
    assert not batch.shares_prompts and batch.mask_free
    assert batch.input_ids.tolist() == [[5, 6, 20, 0, 0], [8, 9, 10, 40, 41]]
    assert batch.position_ids.tolist() == [[1, 2, 3, 4, 5], [0, 1, 2, 3, 4]]
    holey = pack_shared_prompts(prompt_ids, prompt_mask, completion_ids, torch.tensor([[1, 0, 1], [1, 1, 1]]), 1024)
    assert not holey.mask_free  # the second token of the first completion is masked: its key must stay invisible
    shared = pack_shared_prompts(prompt_ids[[0, 0]], prompt_mask[[0, 0]], completion_ids[[0, 1]],
                                 completion_mask[[0, 1]], hidden_size=1024)  # fmt: skip
    assert shared.shares_prompts and not shared.mask_free


def test_masked_token_inside_a_completion_stays_invisible():
    segments = torch.tensor([[-1, 0, 0, 0]])
    valid = torch.tensor([[True, True, False, True]])
    mask = block_attention_mask(segments, valid)[0, 0]
    assert mask[3].tolist() == [True, True, False, True]


def test_packing_stops_where_attention_would_cost_more_than_a_second_prompt_copy():
    assert plan_packs(prefix_length=60, completion_lengths=[12] * 8, hidden_size=576) == [list(range(8))]
    packs = plan_packs(prefix_length=200, completion_lengths=[512] * 8, hidden_size=896)
    assert [len(p) for p in packs] == [2, 2, 2, 2]


def test_rows_with_gradient_and_chunks():
    advantages = torch.tensor([0.0, 1.0, float("nan"), -2.0])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [0, 0]])
    assert rows_with_gradient(advantages, mask).tolist() == [False, True, True, False]
    # TRL's chunks of consecutive rows: how many depends on the row count only, never on which prompts repeat.
    assert row_chunks(5, max_rows=4) == [range(0, 4), range(4, 5)]
    assert row_chunks(4, max_rows=None) == [range(0, 4)]


@pytest.mark.parametrize("through_last_token", [False, True])
def test_packing_computes_each_scored_token_from_what_trl_attends_random_batches(through_last_token):
    """An oracle from TRL's layout, on random batches (ragged completions, masked tokens inside them, left-padded
    prompts, groups sharing a prompt, every pack size the planner picks): every scored completion token is computed
    exactly once, at its TRL position, from its preceding token, seeing exactly the (position, token) pairs TRL's
    attention mask lets it see in `cat(prompt, completion)`. `through_last_token` (an MoE's load-balancing loss): the
    same, and the packed positions weighed by `router_weights` are TRL's attended (position, token) pairs of every
    row, each as often as TRL's forward routes it."""
    generator = torch.Generator().manual_seed(0)

    def draw(high: int, size=()) -> torch.Tensor:
        return torch.randint(0, high, size, generator=generator)

    for _ in range(150):
        groups, group_size, prompt_width, width = (
            int(draw(3)) + 1,
            int(draw(5)) + 1,
            int(draw(5)) + 2,
            int(draw(8)) + 1,
        )
        rows = groups * group_size
        prompt_mask = torch.ones(groups, prompt_width, dtype=torch.long)
        for group in range(groups):
            prompt_mask[group, : int(draw(prompt_width - 1))] = 0  # left padding; the last column always attended
        prompt_ids = (draw(40, (groups, prompt_width)) + 3) * prompt_mask
        prompt_ids, prompt_mask = (t.repeat_interleave(group_size, dim=0) for t in (prompt_ids, prompt_mask))
        completion_ids = draw(40, (rows, width)) + 3
        completion_mask = (torch.rand(rows, width, generator=generator) > 0.2).long()
        for row in range(rows):
            completion_mask[row, int(draw(width + 1)) :] = 0
        batch = pack_shared_prompts(prompt_ids, prompt_mask, completion_ids, completion_mask, int(draw(3000)) + 1,
                                    through_last_token=through_last_token)  # fmt: skip

        sequence, attended = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
        computed = list(zip(*[t.tolist() for t in (*batch.source, *batch.destination)], strict=True))
        assert sorted([row, column] for _, _, row, column in computed) == completion_mask.nonzero().tolist()
        causal = torch.ones(batch.input_ids.shape[1], batch.input_ids.shape[1], dtype=torch.bool).tril()
        for pack, position, row, column in computed:
            at = prompt_width + column - 1  # the TRL column whose token predicts completion[row, column]
            assert batch.input_ids[pack, position] == sequence[row, at]
            assert batch.position_ids[pack, position] == at
            assert batch.targets[pack, position] == completion_ids[row, column]
            keys = causal[position] if batch.block_mask is None else batch.block_mask[pack, 0, position]
            seen = sorted(
                zip(batch.position_ids[pack, keys].tolist(), batch.input_ids[pack, keys].tolist(), strict=True)
            )
            expected = [(j, int(sequence[row, j])) for j in range(at + 1) if attended[row, j]]
            assert seen == expected, (row, column)
        if through_last_token and bool(completion_mask.any(dim=1).all()):  # else the pass routes rows unpacked
            routed, trl_routed = Counter(), Counter()
            for pack, position in batch.router_weights.nonzero().tolist():
                key = (int(batch.position_ids[pack, position]), int(batch.input_ids[pack, position]))
                routed[key] += batch.router_weights[pack, position].item()
            for row, column in attended.nonzero().tolist():
                trl_routed[(column, int(sequence[row, column]))] += 1
            assert routed == trl_routed
