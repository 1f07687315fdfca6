"""Zero-waste training pass: TRL's per-token log-probs, computing only what can carry gradient.

Three savings, each exact (the same log-probs TRL's full forward returns, the same gradient):

- **rows**: a row whose advantage is 0 (a zero-variance group, an unscorable completion) or whose loss mask is
  empty has a per-token loss of exactly 0 with zero gradient, as long as nothing else reads it (beta = 0, no entropy
  bonus, no entropy-quantile mask, no router aux loss). Such rows are not sent through the model.
- **columns**: positions after a row's last completion token are masked in TRL's forward (log-prob 0), and no
  earlier position attends to them. They are not computed.
- **shared prompt**: the completions of a group share one prompt. It is computed once; every completion attends to
  it and to itself through a block attention mask (Prefix Grouper, arXiv 2506.05433). Position ids are TRL's.

Layout of one pack (one model row): the prompt's real tokens but the last, then for each completion a segment
``[last prompt token, completion[:-1]]`` that predicts ``completion`` (the last prompt token is repeated per segment
so that each segment's first position predicts its own first completion token).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

IGNORE_INDEX = -100
# Model families whose forward takes position_ids and a custom 4D attention mask as given, checked by the exactness
# tests (tests/test_train_pass_trainer.py; the mixture-of-experts ones, tests/test_moe.py) against TRL's own forward.
SHARED_PROMPT_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gpt2", "qwen3_moe", "olmoe", "mixtral", "gpt_oss")
SHARED_PROMPT_ATTENTION = ("sdpa", "eager")
# Forward cost of a pack of n positions, in units of one position's linear layers: n + n^2 / (ATTENTION_COST * d).
# A decoder layer spends ~21 d^2 FLOPs per position in its projections and MLP and ~4 d per (query, key) pair in
# attention; a block mask is dense, so a pack pays for every pair. Packing stops where another completion would
# cost more inside the pack than in a pack of its own.
ATTENTION_COST = 5.0
_PREFIX, _PADDING = -1, -2


def rows_with_gradient(advantages: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """(B,) bool: rows with a non-zero advantage somewhere and at least one loss token (NaN counts as non-zero)."""
    nonzero = (advantages != 0).reshape(advantages.shape[0], -1).any(dim=1)
    return nonzero & (loss_mask.sum(dim=1) > 0)


def completion_width(completion_mask: torch.Tensor) -> int:
    """Columns up to the last attended completion token of any row (at least 1)."""
    attended = completion_mask.any(dim=0).nonzero()
    return max(int(attended[-1]) + 1, 1) if attended.numel() else 1


def scatter_rows(values: torch.Tensor, rows: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """`base` (B, C) with rows `rows` replaced by `values` (n, C' <= C, zero-padded on the right); differentiable."""
    if values.shape[1] < base.shape[1]:
        values = torch.nn.functional.pad(values, (0, base.shape[1] - values.shape[1]))
    return base.index_put((rows.to(base.device),), values.to(base.dtype))


def row_skip_blocker(
    *,
    beta: float,
    entropy_bonus: bool,
    top_entropy_quantile: float,
    aux_loss: bool,
    loss_type_declared: bool,
    importance_sampling_declared: bool,
    loss_type: str,
    importance_sampling_level: str,
    policy_loss_declared: bool,
    policy_loss: str,
) -> str | None:
    """Why zero-advantage rows must be computed after all, or None when skipping them is exact."""
    if beta != 0.0:
        return f"beta={beta}: the KL term reads every row"
    if entropy_bonus:
        return "the entropy bonus reads every row"
    if top_entropy_quantile < 1.0:
        return f"top_entropy_quantile={top_entropy_quantile}: the entropy threshold is taken over every row"
    if aux_loss:
        return (
            "the router aux loss (TRL's load-balancing loss, router_aux_loss_coef) is a product of two means over every "
            "token of every row in the micro-batch: a zero-advantage row changes its value and its gradient (0.0 "
            "turns it off)"
        )
    if not loss_type_declared:
        return f"loss_type={loss_type!r} did not declare zero_advantage_rows_contribute_nothing=True at registration"
    if not importance_sampling_declared:
        return (
            f"importance_sampling_level={importance_sampling_level!r} did not declare "
            "zero_advantage_rows_contribute_nothing=True at registration"
        )
    if not policy_loss_declared:
        return (
            f"policy_loss={policy_loss!r} reads zero-advantage rows too (it did not declare "
            "zero_advantage_rows_contribute_nothing=True at registration)"
        )
    return None


def shared_prompt_blocker(
    config, attn_implementation: str | None, sequence_length: int, families: Sequence[str] = SHARED_PROMPT_FAMILIES
) -> str | None:
    """Why a (language) model cannot take the shared-prompt forward, or None when it can."""
    model_type = getattr(config, "model_type", None)
    if model_type not in families:
        return f"model_type={model_type!r} is not one of the checked families {', '.join(families)}"
    if attn_implementation not in SHARED_PROMPT_ATTENTION:
        return (
            f"attn_implementation={attn_implementation!r} does not take a custom block mask "
            f"(supported: {', '.join(SHARED_PROMPT_ATTENTION)})"
        )
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True) and window < sequence_length:
        return f"sliding_window={window} is shorter than the sequences ({sequence_length} positions)"
    return None


@dataclass
class PackedBatch:
    """Model inputs for packed groups plus where each scored position goes in TRL's (rows, completion) layout."""

    input_ids: torch.Tensor  # (n, L)
    position_ids: torch.Tensor  # (n, L)
    # (n, 1, L, L) bool, True where a query may attend a key; None where `mask_free` (it would be [packs x width x
    # width] of nothing worth knowing, gigabytes at long completions)
    block_mask: torch.Tensor | None
    targets: torch.Tensor  # (n, L): the token each position predicts, IGNORE_INDEX where nothing is scored
    source: tuple[torch.Tensor, torch.Tensor]  # (pack, position) of every scored position
    destination: tuple[torch.Tensor, torch.Tensor]  # (row, completion column) of the same positions
    shares_prompts: bool = True  # some pack holds two or more completions after its prompt
    # Every pack is one row's tokens without a gap, then padding: causal attention alone is TRL's masked attention for
    # every real position (the padding comes after them), so the forward needs no mask at all.
    mask_free: bool = False
    # (n, L) each: the (row, column) of TRL's `cat(prompt, completion)` layout each position repeats (padding repeats
    # its pack's last position); models whose positions are not column indices (M-RoPE) read theirs from there.
    origin: tuple[torch.Tensor, torch.Tensor] | None = None
    prompt_rows: torch.Tensor | None = None  # (n,): the row whose prompt (and images) each pack carries
    # (n, L) float, packed with `through_last_token`: how many tokens of TRL's forward each position stands for (its
    # attention mask, times the completions sharing a prompt position; 0 on padding), the load-balancing loss's weights
    router_weights: torch.Tensor | None = None
    padding: torch.Tensor | None = None  # (n, L) bool: the positions after each pack's last one

    @property
    def positions(self) -> int:
        """Token positions the model computes for this batch (padding included)."""
        return self.input_ids.numel()


def pack_cost(positions: int, hidden_size: int) -> float:
    """Relative forward cost of one pack: linear layers per position plus dense block-mask attention."""
    return positions + positions * positions / (ATTENTION_COST * hidden_size)


def plan_packs(prefix_length: int, completion_lengths: Sequence[int], hidden_size: int) -> list[list[int]]:
    """Split one group's completions (indices into `completion_lengths`) into packs that share a prefix copy."""
    packs: list[list[int]] = []
    current: list[int] = []
    size = prefix_length
    for index, length in enumerate(completion_lengths):
        marginal = pack_cost(size + length, hidden_size) - pack_cost(size, hidden_size)
        if current and marginal > pack_cost(prefix_length + length, hidden_size):
            packs.append(current)
            current, size = [], prefix_length
        current.append(index)
        size += length
    if current:
        packs.append(current)
    return packs


def group_rows_by_prompt(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, row_keys: torch.Tensor | None = None
) -> list[list[int]]:
    """Rows with identical prompts (same tokens at the same attended columns, and the same `row_keys` entry, e.g. the
    same images), in order of first appearance."""
    keys = prompt_ids.masked_fill(prompt_mask == 0, -1)
    if row_keys is not None:
        keys = torch.cat([keys, row_keys.to(keys.dtype).unsqueeze(1)], dim=1)
    _, inverse = torch.unique(keys, dim=0, return_inverse=True)
    groups: dict[int, list[int]] = {}
    for row, key in enumerate(inverse.tolist()):
        groups.setdefault(key, []).append(row)
    return list(groups.values())


def pack_shared_prompts(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    hidden_size: int,
    pad_token_id: int = 0,
    row_keys: torch.Tensor | None = None,
    prompt_blocks: torch.Tensor | None = None,
    through_last_token: bool = False,
) -> PackedBatch:
    """Pack every row of a (left-padded prompt, right-padded completion) batch, one prompt copy per pack.

    Needs every prompt's last column attended (left padding). Position ids are column indices of TRL's
    `cat(prompt, completion)` layout, which is what TRL's forward uses when it passes none. Rows share a pack only if
    their `row_keys` (B,) entries are equal too (a VLM's rows: the same images). `prompt_blocks` (B, prompt width):
    an id per prompt column, -1 or a block whose positions attend each other both ways (Gemma 3's image tokens).
    `through_last_token`: each segment also holds its completion's last token (it predicts nothing, but TRL's forward
    routes it: a router's load-balancing loss counts it), and the batch carries `router_weights`.
    """
    completion_mask_cpu = completion_mask.detach().cpu()
    prompt_mask_cpu = prompt_mask.detach().cpu()
    prompt_ids_cpu, completion_ids_cpu = prompt_ids.detach().cpu(), completion_ids.detach().cpu()
    attended = completion_mask_cpu.bool()
    # Each row's length: one past its last attended column (0 for a row with none), for all rows at once.
    ends = torch.where(attended, torch.arange(1, attended.shape[1] + 1), 0)
    lengths = ends.amax(dim=1).tolist() if ends.shape[1] else [0] * ends.shape[0]

    keys_cpu = None if row_keys is None else row_keys.detach().cpu()
    blocks_cpu = None if prompt_blocks is None else prompt_blocks.detach().cpu()
    packs: list[_Pack] = []
    for rows in group_rows_by_prompt(prompt_ids_cpu, prompt_mask_cpu, keys_cpu):
        rows = [r for r in rows if lengths[r] > 0]  # nothing scored, nothing to compute (TRL returns zeros)
        if not rows:
            continue
        prefix_columns = prompt_mask_cpu[rows[0], :-1].nonzero().squeeze(1)
        for pack_rows in plan_packs(len(prefix_columns), [lengths[r] for r in rows], hidden_size):
            prompt_row = rows[pack_rows[0]]
            pack = _Pack(prompt_row=prompt_row)
            prompt_blocks_row = None if blocks_cpu is None else blocks_cpu[prompt_row, prefix_columns]
            pack.add_prefix(prompt_ids_cpu[prompt_row, prefix_columns], prefix_columns, prompt_blocks_row)
            pack_completions(pack, torch.tensor([rows[i] for i in pack_rows]), lengths, prompt_ids_cpu,
                             completion_ids_cpu, attended, through_last_token)  # fmt: skip
            packs.append(pack)
    batch = _stack_packs(packs, pad_token_id, prompt_ids.device, bidirectional_blocks=blocks_cpu is not None)
    if through_last_token:
        batch.router_weights = _router_weights(packs, batch.input_ids.shape, prompt_ids.device)
    return batch


def pack_completions(pack: _Pack, rows: torch.Tensor, lengths: list[int], prompt_ids: torch.Tensor,
                     completion_ids: torch.Tensor, attended: torch.Tensor,
                     through_last_token: bool = False) -> None:  # fmt: skip
    """Append the completions of TRL rows `rows` to `pack`, one segment each, in order: a segment is the prompt's last
    token and the completion but its last token (what predicts each completion token; `through_last_token`: that
    token too, predicting nothing), at the positions of TRL's layout, its scored tokens as targets. All rows at once:
    a [rows, longest] block, cut to each row's length."""
    extra = int(through_last_token)
    width = max(lengths[row] for row in rows.tolist())
    columns = torch.arange(width + extra)
    segment_lengths = torch.tensor([lengths[row] + extra for row in rows.tolist()])
    inside = columns < segment_lengths.unsqueeze(1)  # each segment's positions
    inputs = torch.cat([prompt_ids[rows, -1:], completion_ids[rows, : width - 1 + extra]], dim=1)
    keys = torch.cat([torch.ones(len(rows), 1, dtype=torch.bool), attended[rows, : width - 1 + extra]], dim=1)
    scored = attended[rows, :width]  # within each row's length by definition of the length
    targets = completion_ids[rows, :width].masked_fill(~scored, IGNORE_INDEX)
    if extra:  # the last token predicts nothing
        scored = torch.nn.functional.pad(scored, (0, 1))
        targets = torch.nn.functional.pad(targets, (0, 1), value=IGNORE_INDEX)
    segments = torch.arange(pack.completions, pack.completions + len(rows)).unsqueeze(1).expand(-1, width + extra)
    positions = (prompt_ids.shape[1] - 1 + columns).expand(len(rows), -1)
    scored_rows, scored_columns = scored.nonzero(as_tuple=True)
    pack.token_ids.append(inputs[inside])
    pack.position_ids.append(positions[inside])
    pack.segments.append(segments[inside])
    pack.attended.append(keys[inside])
    pack.targets.append(targets[inside])
    pack.destination_rows.append(rows[scored_rows])
    pack.destination_columns.append(scored_columns)
    pack.origin_rows.append(rows.unsqueeze(1).expand(-1, width + extra)[inside])
    pack.blocks.append(torch.full((int(inside.sum()),), -1))  # completions attend causally
    pack.completions += len(rows)


@dataclass
class _Pack:
    """One model row under construction: the shared prefix, then one segment per completion."""

    token_ids: list[torch.Tensor] = field(default_factory=list)
    position_ids: list[torch.Tensor] = field(default_factory=list)
    segments: list[torch.Tensor] = field(default_factory=list)  # _PREFIX, or the completion's index in the pack
    attended: list[torch.Tensor] = field(default_factory=list)  # keys TRL's 2D attention mask attends
    targets: list[torch.Tensor] = field(default_factory=list)  # the token each position predicts, or IGNORE_INDEX
    destination_rows: list[torch.Tensor] = field(default_factory=list)  # TRL row of each scored position
    destination_columns: list[torch.Tensor] = field(default_factory=list)  # TRL completion column of each
    origin_rows: list[torch.Tensor] = field(default_factory=list)  # TRL row each position repeats (its column: the id)
    blocks: list[torch.Tensor] = field(default_factory=list)  # bidirectional block of each position, -1 for none
    prompt_row: int = 0
    completions: int = 0  # completion segments in the pack

    def add_prefix(self, token_ids: torch.Tensor, position_ids: torch.Tensor, blocks: torch.Tensor | None) -> None:
        """The shared prompt (of TRL row `prompt_row`): every position attended, none scored; `blocks` its
        positions' bidirectional blocks, None for none."""
        self.token_ids.append(token_ids)
        self.position_ids.append(position_ids)
        self.segments.append(torch.full((len(token_ids),), _PREFIX))
        self.attended.append(torch.ones(len(token_ids), dtype=torch.bool))
        self.targets.append(torch.full((len(token_ids),), IGNORE_INDEX))
        self.origin_rows.append(torch.full((len(token_ids),), self.prompt_row))
        self.blocks.append(torch.full((len(token_ids),), -1) if blocks is None else blocks)

    def __len__(self) -> int:
        return sum(len(ids) for ids in self.token_ids)


def _stack_packs(packs: list[_Pack], pad_token_id: int, device, bidirectional_blocks: bool = False) -> PackedBatch:
    width = max((len(p) for p in packs), default=0)
    n = len(packs)
    input_ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    position_ids = torch.zeros((n, width), dtype=torch.long)
    origin_rows = torch.zeros((n, width), dtype=torch.long)
    origin_columns = torch.zeros((n, width), dtype=torch.long)
    segments = torch.full((n, width), _PADDING, dtype=torch.long)
    blocks = torch.full((n, width), -1, dtype=torch.long)
    valid = torch.zeros((n, width), dtype=torch.bool)
    targets = torch.full((n, width), IGNORE_INDEX, dtype=torch.long)
    source_pack, source_position, destination_row, destination_col = [], [], [], []
    for index, pack in enumerate(packs):
        length = len(pack)
        input_ids[index, :length] = torch.cat(pack.token_ids)
        position_ids[index, :length] = torch.cat(pack.position_ids)
        origin_columns[index, :length] = position_ids[index, :length]
        origin_rows[index, :length] = torch.cat(pack.origin_rows)
        origin_rows[index, length:], origin_columns[index, length:] = (
            origin_rows[index, length - 1],
            origin_columns[index, length - 1],
        )
        # Padding continues the positions: to transformers, a position that restarts would mark a packed sequence.
        position_ids[index, length:] = position_ids[index, length - 1] + 1 + torch.arange(width - length)
        segments[index, :length] = torch.cat(pack.segments)
        blocks[index, :length] = torch.cat(pack.blocks)
        valid[index, :length] = torch.cat(pack.attended)
        pack_targets = torch.cat(pack.targets)
        targets[index, :length] = pack_targets
        scored = (pack_targets != IGNORE_INDEX).nonzero().squeeze(1)
        source_pack.append(torch.full((len(scored),), index))
        source_position.append(scored)
        destination_row.append(torch.cat(pack.destination_rows))
        destination_col.append(torch.cat(pack.destination_columns))
    shares_prompts = any(pack.completions > 1 for pack in packs)  # the prefix and 2+ completion segments
    mask_free = not shares_prompts and not bidirectional_blocks and bool((valid | (segments == _PADDING)).all())
    block_mask = None if mask_free else block_attention_mask(segments, valid, blocks).to(device)

    def flat(parts: list[torch.Tensor]) -> torch.Tensor:
        return (torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)).to(device)

    return PackedBatch(
        input_ids=input_ids.to(device),
        position_ids=position_ids.to(device),
        block_mask=block_mask,
        targets=targets.to(device),
        source=(flat(source_pack), flat(source_position)),
        destination=(flat(destination_row), flat(destination_col)),
        shares_prompts=shares_prompts,
        mask_free=mask_free,
        origin=(origin_rows.to(device), origin_columns.to(device)),
        prompt_rows=torch.tensor([pack.prompt_row for pack in packs], dtype=torch.long, device=device),
        padding=(segments == _PADDING).to(device),
    )


def _router_weights(packs: list[_Pack], shape: torch.Size, device) -> torch.Tensor:
    """(n, L) float: each packed position's weight in TRL's load-balancing loss (see `PackedBatch.router_weights`)."""
    weights = torch.zeros(shape, dtype=torch.float32)
    for index, pack in enumerate(packs):
        segments, attended = torch.cat(pack.segments), torch.cat(pack.attended)
        weights[index, : len(pack)] = torch.where(segments == _PREFIX, float(pack.completions), attended.float())
    return weights.to(device)


def weighted_load_balancing_loss(
    router_logits: Sequence[torch.Tensor], weights: torch.Tensor, num_experts: int, top_k: int
) -> torch.Tensor:
    """transformers' `load_balancing_loss_func` (5.x, every MoE family: the Switch Transformer loss over all layers,
    `num_experts * sum_e f_e * P_e`, f_e the share of routed (token, slot) pairs that chose expert e and P_e the mean
    router probability of e, both averaged over every attended token of every layer) with each position weighted by
    `weights` (flattened like the router's (tokens, experts) rows) instead of an attention mask of 0 / 1: a position
    of weight w counts as w identical tokens. `router_logits`: one (tokens, experts) tensor per MoE layer."""
    flat = weights.reshape(-1).float()
    tokens_per_expert = flat.new_zeros(num_experts)
    router_probs = flat.new_zeros(num_experts)
    total = flat.new_zeros(())
    for layer_logits in router_logits:
        probs = torch.nn.functional.softmax(layer_logits.to(flat.device), dim=-1)
        _, chosen = torch.topk(probs, top_k, dim=-1)
        tokens_per_expert = tokens_per_expert.scatter_add(0, chosen.reshape(-1), flat.repeat_interleave(top_k))
        router_probs = router_probs + (probs.float() * flat.unsqueeze(-1)).sum(dim=0)
        total = total + flat.sum()
    return torch.sum((tokens_per_expert / total) * (router_probs / total)) * num_experts


def block_attention_mask(
    segments: torch.Tensor, valid: torch.Tensor, blocks: torch.Tensor | None = None
) -> torch.Tensor:
    """(n, 1, L, L) bool: causal, a segment sees the prefix and itself, only attended keys; padding sees itself.

    `segments` holds -1 for prefix positions, k for completion segment k, -2 for padding; `valid` marks keys TRL's
    2D attention mask attends (a masked token inside a completion stays invisible, as in TRL's forward). `blocks`
    (n, L), -1 or a block id: positions of one block also see the later positions of their block (Gemma 3's
    bidirectional attention inside an image, transformers' `block_sequence_ids`).
    """
    width = segments.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    if blocks is not None:
        same_block = (blocks.unsqueeze(2) == blocks.unsqueeze(1)) & (blocks.unsqueeze(2) >= 0)
        causal = causal | same_block
    query, key = segments.unsqueeze(2), segments.unsqueeze(1)
    visible = (key == query) | (key == _PREFIX)
    mask = causal & visible & valid.unsqueeze(1) & (query != _PADDING)
    mask |= torch.eye(width, dtype=torch.bool) & (query == _PADDING)  # a padded query attends itself: no NaN
    return mask.unsqueeze(1)


def additive_mask(block_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float form eager attention adds to its scores (0 where visible, the dtype's minimum elsewhere)."""
    return torch.zeros(block_mask.shape, dtype=dtype, device=block_mask.device).masked_fill(
        ~block_mask, torch.finfo(dtype).min
    )


def unpack(values: torch.Tensor, batch: PackedBatch, shape: tuple[int, int]) -> torch.Tensor:
    """Per-position values of packed rows, (n, L), back in TRL's (rows, completion columns) layout, zeros elsewhere."""
    picked = values[batch.source]
    return picked.new_zeros(shape).index_put(batch.destination, picked)


def row_chunks(num_rows: int, max_rows: int | None) -> list[range]:
    """TRL's chunks of a no-grad pass: consecutive rows, `max_rows` at a time (all rows when None).

    The count depends only on the number of rows, never on the data, so every process makes the same number of
    model calls: under DeepSpeed ZeRO-3 / FSDP each call gathers parameters collectively, and a process that made
    fewer calls than the others would leave them waiting forever.
    """
    step = max_rows or max(num_rows, 1)
    return [range(start, min(start + step, num_rows)) for start in range(0, num_rows, step)]


def dropout_blocker(model: torch.nn.Module) -> str | None:
    """Why the model's forward draws random numbers (active dropout), or None.

    Dropout masks are drawn per position from the global RNG: a forward over fewer rows, fewer columns or one
    prompt copy per group draws different masks than TRL's full forward, so no saving is exact while it is active.
    The reason names the setting that keeps the savings: in RL, dropout also makes the policy that trains differ from
    the one that generated (and from the old / reference passes), so RL recipes usually turn it off anyway.
    """
    if not model.training:
        return None
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.training and module.p > 0:
            return (
                f"dropout is active in the training forward ({name or 'model'}: p={module.p}). "
                f"To keep the savings, train without dropout: disable_dropout=True (TRL's GRPOConfig field, "
                f"--disable_dropout true; it sets every dropout to 0, LoRA's included) or lora_dropout=0.0"
            )
    config = getattr(model, "config", None)
    attention_dropout = getattr(config, "attention_dropout", 0.0)  # functional dropout inside attention (Llama family)
    if isinstance(attention_dropout, (int, float)) and attention_dropout > 0:
        return (
            f"dropout is active in the training forward (attention_dropout={attention_dropout} in the model config). "
            f"To keep the savings, load the model with attention_dropout=0.0 (TRL's disable_dropout does not reach "
            f"it: it is not a dropout module)"
        )
    return None


# forward(input_ids, attention_mask, logits_to_keep, rows=..., columns=...): `input_ids` / `attention_mask` are the
# batch's `rows` (None: every row) and `columns` (None: every column), already cut; a forward with per-row inputs
# besides them (a VLM's images) cuts those alike.
Forward = Callable[..., tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]


def forward_rows(
    forward: Forward,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    width: int,
    live: torch.Tensor | None,
    fill: torch.Tensor,
    bridge: slice,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(log-probs, entropies, aux loss) of a (B, prompt + `width`) batch, sending only the `live` rows through
    `forward(input_ids, attention_mask, width)`; the other rows get `fill` (log-probs) and 0 (entropies).

    Exactly one `forward` call whatever `live` holds, so every process calls the model equally often. When no row
    is live, backward (and DDP's all-reduce) still needs a graph over every parameter: one position's log-prob,
    taken at the `bridge` columns of the first row, times zero.
    """
    if live is None or bool(live.all()):
        return forward(input_ids, attention_mask, width, rows=None, columns=None)
    rows = live.nonzero().squeeze(1)
    if rows.numel() == 0:
        first = torch.zeros(1, dtype=torch.long, device=input_ids.device)
        ids = input_ids[:1, bridge]
        anchor, _, _ = forward(ids, torch.ones_like(ids), 1, rows=first, columns=bridge)
        return fill + 0.0 * anchor.sum(), torch.zeros_like(fill), None
    logps, entropies, _ = forward(input_ids[rows], attention_mask[rows], width, rows=rows, columns=None)
    no_entropy = torch.zeros_like(fill)
    entropies = None if entropies is None else scatter_rows(entropies, rows, no_entropy)
    return scatter_rows(logps, rows, fill), entropies, None


def fill_skipped_entropies(
    forward: Forward,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    width: int,
    live: torch.Tensor,
    entropies: torch.Tensor,
    bridge: slice,
) -> torch.Tensor:
    """`entropies` (B, `width`) with the rows `forward_rows` skipped (not `live`) filled in by a no-grad `forward` of
    just those rows, so they hold every row's entropy as TRL's full forward computes it.

    Exactly one `forward` call whatever `live` holds (when no row was skipped, one position at the `bridge` columns),
    so every process calls the model equally often.
    """
    skipped = (~live).nonzero().squeeze(1)
    with torch.no_grad():
        if skipped.numel() == 0:
            first = torch.zeros(1, dtype=torch.long, device=input_ids.device)
            ids = input_ids[:1, bridge]
            forward(ids, torch.ones_like(ids), 1, rows=first, columns=bridge)
            return entropies
        _, skipped_entropies, _ = forward(
            input_ids[skipped], attention_mask[skipped], width, rows=skipped, columns=None
        )
    return scatter_rows(skipped_entropies, skipped, entropies)


def shared_prompt_logps(
    model_forward: Callable[[PackedBatch], tuple[torch.Tensor, torch.Tensor | None]],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    batch_size: int | None,
    hidden_size: int,
    pad_token_id: int,
    unshared_positions: int | None = None,
    mask_free: bool = True,
    row_keys: torch.Tensor | None = None,
    prompt_blocks: torch.Tensor | None = None,
    through_last_token: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
    """Per-token log-probs and entropies (B, logits_to_keep) with one prompt copy per pack, or None where packing
    does not pay: a chunk has no token to score, or the packs, padded to the widest, hold at least the
    `unshared_positions` the caller's per-row forward would compute (rows of a group spread over micro-batches).

    Where no pack shares its prompt (long completions, rows of a group spread over micro-batches) a block mask would
    only cost (a dense S x S mask per pack, and models expand grouped key/value heads for it). Then, if the rows have
    padding (left-padded prompts, ragged completions), each row runs as a pack of its own tokens without a gap and
    without any attention mask (`PackedBatch.mask_free`): TRL's forward would build a [rows, 1, S, S] mask from the
    padding, gigabytes at long completions, and kernels that take a mask instead of the causal flash kernel. Without
    padding, or with `mask_free=False` (the caller's model would then run a worse kernel), this returns None and the
    caller runs the per-row forward, which makes the same number of model calls.

    `model_forward(packed)` runs the model on one packed chunk and returns its per-position (log-probs,
    entropies or None) and its router's load-balancing loss (or None); the chunk's `origin` and `prompt_rows` index the
    rows of `input_ids`. Chunks are TRL's (`row_chunks`), one model call each; the loss returned is their mean, as
    TRL's. `row_keys`, `prompt_blocks`, `through_last_token`: see `pack_shared_prompts` (with it, a row whose
    completion is all masked still routes its prompt in TRL's forward: then None, the per-row forward counts it).
    """
    prompt_width = input_ids.shape[1] - logits_to_keep
    prompt_ids, completion_ids = input_ids[:, :prompt_width], input_ids[:, prompt_width:]
    prompt_mask, completion_mask = attention_mask[:, :prompt_width], attention_mask[:, prompt_width:]
    if through_last_token and not bool(completion_mask.any(dim=1).all()):
        return None
    batches = []
    for rows in row_chunks(input_ids.shape[0], batch_size):
        index = torch.arange(rows.start, rows.stop, device=input_ids.device)
        batch = pack_shared_prompts(
            prompt_ids[index], prompt_mask[index], completion_ids[index], completion_mask[index],
            hidden_size, pad_token_id,
            row_keys=None if row_keys is None else row_keys[index],
            prompt_blocks=None if prompt_blocks is None else prompt_blocks[index],
            through_last_token=through_last_token,
        )  # fmt: skip
        if batch.input_ids.numel() == 0:
            return None
        batch.origin = (index[batch.origin[0]], batch.origin[1])  # the chunk's rows, as rows of the whole batch
        batch.prompt_rows = index[batch.prompt_rows]
        batches.append((index, batch))
    if not any(batch.shares_prompts for _, batch in batches):
        scored_width = prompt_width + completion_width(completion_mask)
        padded = not bool(attention_mask[:, :scored_width].all())
        if not (padded and mask_free) or not all(batch.mask_free for _, batch in batches):
            return None
    elif unshared_positions is not None and sum(batch.positions for _, batch in batches) >= unshared_positions:
        return None
    logps = entropies = None
    losses = []
    for index, batch in batches:
        chunk_logps, chunk_entropies, chunk_loss = model_forward(batch)
        if chunk_loss is not None:
            losses.append(chunk_loss)
        shape = (len(index), logits_to_keep)
        logps = chunk_logps.new_zeros((input_ids.shape[0], logits_to_keep)) if logps is None else logps
        logps = logps.index_put((index,), unpack(chunk_logps, batch, shape))
        if chunk_entropies is not None:
            entropies = logps.new_zeros(logps.shape) if entropies is None else entropies
            entropies = entropies.index_put((index,), unpack(chunk_entropies, batch, shape))
    return logps, entropies, torch.stack(losses).mean() if losses else None
