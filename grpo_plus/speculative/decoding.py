"""The speculative decoding loop: grpo_plus's generator (one prefill per distinct prompt, finished rows out of the
forwards) with each unfinished row drafting up to k tokens (grpo_plus.speculative.drafting) and one forward verifying
every row's drafts (grpo_plus.speculative.acceptance).

Rows keep different numbers of tokens per forward. Their text is held in one (B, max_length) buffer, each row's tokens
contiguous after its prompt, so a row's prefix at any drafted position is a slice of the buffer: the logits processors
and the stopping criteria see, for each position, exactly the ids transformers' loop would hand them (grouped by length,
since some read it: max_length, min_new_tokens). The KV cache is never copied to realign rows: after a verify forward it
is cropped to the longest kept prefix, and the columns a row did not keep (holes) are masked out of its attention; each
row's positions count its own tokens, so its rotary positions skip its holes. A masked column contributes an exact zero
to the attention softmax, so a row's logits are those of its tokens alone (up to the float noise of a wider reduction).
The cache grows by the longest kept prefix per forward (at most k + 1 columns), so a row that keeps less than the others
carries holes: at worst (k + 1) x the columns of its text.

What the loop cannot reproduce exactly makes it step aside, saying why (`SpeculationStats.fallback`), and the
non-speculative loop (grpo_plus.zero_waste.generation.decode_rows) runs: a logits processor or stopping criterion that
is not a pure function of each row's ids (user-defined ones, classifier-free guidance, prefix constraints), no EOS
criterion (transformers would keep sampling finished rows), a model that takes no position ids, token-type inputs, image
prompts, attention other than sdpa / eager. With tool turns, the rows' caches are not kept for the next turn.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList
from transformers.generation import logits_process, stopping_criteria

from ..zero_waste.generation import (
    CACHE_INPUT,
    PER_TOKEN_KEYS,
    NotApplicable,
    decode_blocker,
    decode_rows,
    distinct_rows,
    prefill_prompts,
)
from .acceptance import AcceptanceRule, point_mass_acceptance, verify
from .drafting import ngram_drafts
from .settings import SpeculativeSettings

# Processors that read neither the ids nor their length: run once on every drafted position of every row together.
_ID_FREE = (
    "TemperatureLogitsWarper",
    "TopKLogitsWarper",
    "TopPLogitsWarper",
    "MinPLogitsWarper",
    "TopHLogitsWarper",
    "TypicalLogitsWarper",
    "EpsilonLogitsWarper",
    "EtaLogitsWarper",
    "LogitNormalization",
    "InfNanRemoveLogitsProcessor",
)
# Processors that are a function of each row's ids (and their length) alone: run per prefix length on the true prefixes.
_PER_ROW = (
    "RepetitionPenaltyLogitsProcessor",
    "NoRepeatNGramLogitsProcessor",
    "SequenceBiasLogitsProcessor",
    "NoBadWordsLogitsProcessor",
    "MinLengthLogitsProcessor",
    "MinNewTokensLengthLogitsProcessor",
    "ForcedBOSTokenLogitsProcessor",
    "ForcedEOSTokenLogitsProcessor",
    "SuppressTokensLogitsProcessor",
    "SuppressTokensAtBeginLogitsProcessor",
    "ExponentialDecayLengthPenalty",
)
_CRITERIA = ("MaxLengthCriteria", "EosTokenCriteria", "StopStringCriteria", "MaxTimeCriteria")
_ATTENTION = ("sdpa", "eager")
logger = logging.getLogger(__name__)


def _known(instance, module, names: tuple[str, ...]) -> bool:
    return any(type(instance) is getattr(module, name, None) for name in names)


def _for_rows(processors: LogitsProcessorList, rows: torch.Tensor) -> LogitsProcessorList:
    """`processors` for a batch of the generate call's rows `rows`: a processor holding one value per row (the
    repetition penalty's per-row count of left-padding columns to ignore, transformers 5) gets those rows' values."""
    chosen = LogitsProcessorList()
    for processor in processors:
        per_row = getattr(processor, "prompt_ignore_length", None)
        if isinstance(per_row, torch.Tensor):
            processor = copy.copy(processor)
            processor.prompt_ignore_length = per_row.to(rows.device)[rows]
        chosen.append(processor)
    return chosen


@dataclass
class SpeculationStats:
    """What the speculative loop did in one `generate` call."""

    forwards: int = 0  # verify forwards (after the prefill)
    row_forwards: int = 0  # rows through those forwards, summed
    drafted: int = 0  # drafted tokens checked
    accepted: int = 0  # drafted tokens kept
    tokens: int = 0  # tokens the verify forwards produced (kept drafts + one drawn per row per forward), before stops
    fallback: str | None = None  # why the non-speculative loop ran instead, or None

    @property
    def tokens_per_row_forward(self) -> float:
        """Tokens a row gets per forward it is in (1.0 without speculation)."""
        return self.tokens / self.row_forwards if self.row_forwards else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class SpeculativeDecoder:
    """The decoding loop handed to grpo_plus.zero_waste.generation's `generate(..., speculation=...)`. `accept`: the
    acceptance rule (speculative sampling's by default; tests hand a wrong one as a negative control)."""

    def __init__(self, settings: SpeculativeSettings, accept: AcceptanceRule = point_mass_acceptance):
        if not settings.enabled:
            raise ValueError("SpeculativeDecoder needs speculative_rollouts=True")
        self.settings, self.accept = settings, accept
        self._notes: set[str] = set()

    def note(self, reason: str) -> None:
        """Say once per run why a generation ran without speculation."""
        if reason not in self._notes:
            self._notes.add(reason)
            logger.warning("Speculative rollouts: generated without speculation, because %s.", reason)

    def record(self, stats, metrics: dict[str, list]) -> None:
        """One `generate` call's counts as `speculative/*` metrics (`stats`: its GenerationStats); why speculation
        stood aside, said once."""
        counts = stats.speculation
        if stats.fallback is not None or counts is None:
            self.note(stats.fallback or "grpo_plus's generator did not run its decoding loop")
            return
        if counts.fallback is not None:
            self.note(counts.fallback)
            return
        metrics["speculative/tokens_per_row_forward"].append(counts.tokens_per_row_forward)
        metrics["speculative/acceptance_rate"].append(counts.acceptance_rate)
        metrics["speculative/drafted"].append(float(counts.drafted))
        metrics["speculative/accepted"].append(float(counts.accepted))
        metrics["speculative/forwards"].append(float(counts.forwards))

    def blocker(self, model, logits_processor, stopping, model_kwargs, images) -> str | None:
        """Why this loop would not draw what one-token decoding draws here, or None."""
        for processor in logits_processor:
            if not _known(processor, logits_process, _ID_FREE + _PER_ROW):
                return f"the logits processor {type(processor).__name__} is not known to depend on each row's ids only"
        for criterion in stopping:
            if not _known(criterion, stopping_criteria, _CRITERIA):
                return (
                    f"the stopping criterion {type(criterion).__name__} is not known to depend on each row's ids only"
                )
        if not any(hasattr(criterion, "eos_token_id") for criterion in stopping):
            return "no EOS stopping criterion pads finished rows (transformers keeps sampling them)"
        position_ids = model_kwargs.get("position_ids")
        if position_ids is None or position_ids.dim() != 2:
            return "the model takes no (batch, length) position ids, so a row's positions cannot skip its cache holes"
        if any(model_kwargs.get(name) is not None for name in PER_TOKEN_KEYS):
            return "generate passes token-type inputs"
        if images is not None:
            return "the prompts have images"
        attention = getattr(model.config, "_attn_implementation", None)
        if attention not in _ATTENTION:
            return (
                f"attention is {attention!r}, not one of {', '.join(_ATTENTION)} (the cache holes are masked columns)"
            )
        return None

    def decode(
        self, model, input_ids, logits_processor, stopping, generation_config, model_kwargs, stats, turns, images
    ):
        """generate's decoding loop (called as grpo_plus.zero_waste.generation.decode_rows is)."""
        reason = decode_blocker(model, generation_config, model_kwargs)
        if reason is not None:
            raise NotApplicable(reason)
        stats.speculation = counts = SpeculationStats()
        counts.fallback = self.blocker(model, logits_processor, stopping, model_kwargs, images)
        if counts.fallback is not None:
            return decode_rows(
                model, input_ids, logits_processor, stopping, generation_config, model_kwargs, stats, turns, images
            )
        if turns is not None:
            stats.turns_blocker = "speculative rollouts leave masked holes in each row's cache"
        optimized_for_decode = getattr(model, "_optimize_model_for_decode", contextlib.nullcontext)
        with optimized_for_decode():
            return _Rollout(self, model, input_ids, logits_processor, stopping, generation_config, stats).run(
                model_kwargs
            )


class _Rollout:
    """One call's state: the token buffer, each row's generated length, the live rows' cache mask and positions."""

    def __init__(self, decoder, model, input_ids, logits_processor, stopping, generation_config, stats):
        self.decoder, self.model, self.stats = decoder, model, stats
        self.settings = decoder.settings
        self.logits_processor, self.stopping, self.config = logits_processor, stopping, generation_config
        self.batch_size, self.prompt_width = input_ids.shape
        self.device = input_ids.device
        width = max(int(generation_config.max_length), self.prompt_width + 1)
        self.max_new = width - self.prompt_width
        pad = generation_config._pad_token_tensor
        self.sequences = torch.full((self.batch_size, width), int(pad), dtype=torch.long, device=self.device)
        self.sequences[:, : self.prompt_width] = input_ids
        self.lengths = torch.zeros(self.batch_size, dtype=torch.long, device=self.device)  # generated tokens per row
        # each row's drafted and kept tokens so far, for its adaptive draft length
        self.row_drafted = torch.zeros(self.batch_size, dtype=torch.long, device=self.device)
        self.row_kept = torch.zeros(self.batch_size, dtype=torch.long, device=self.device)
        # asked by partial rollouts: each token's log-prob under the processed distribution it is distributed as
        self.logps = (
            torch.zeros(self.batch_size, self.max_new, dtype=torch.float32, device=self.device)
            if stats.record_logps
            else None
        )
        self.input_ids = input_ids
        split = len(logits_processor)  # the id-free tail runs on every position at once
        while split > 0 and _known(logits_processor[split - 1], logits_process, _ID_FREE):
            split -= 1
        self.per_row = LogitsProcessorList(logits_processor[:split])
        self.id_free = LogitsProcessorList(logits_processor[split:])

    def run(self, model_kwargs: dict) -> torch.Tensor:
        input_ids, stats = self.input_ids, self.stats
        prompt_mask = model_kwargs.get("attention_mask")
        _, self.group_of_row = distinct_rows(input_ids, prompt_mask)
        real_prompt = torch.ones_like(input_ids, dtype=torch.bool) if prompt_mask is None else prompt_mask.bool()
        # a row's text starts at its first real prompt column (left padding before it)
        self.start = torch.where(real_prompt.any(1), real_prompt.long().argmax(1), self.prompt_width)
        model_kwargs, logits, _ = prefill_prompts(self.model, input_ids, self.config, model_kwargs, stats, None, None)
        # after the prefill: the mask and positions grew by the first new token's column
        mask = model_kwargs.pop("attention_mask", None)
        mask = torch.ones_like(input_ids) if mask is None else mask[:, : self.prompt_width]
        positions = model_kwargs.pop("position_ids")
        next_position = positions[:, self.prompt_width]
        live = torch.arange(self.batch_size, device=self.device)
        no_drafts = torch.zeros(self.batch_size, 0, dtype=torch.long, device=self.device)
        kept, last, stopped = self.advance(live, logits[:, None], no_drafts, torch.zeros_like(live))
        counts = stats.speculation
        while True:
            alive = ~stopped
            if not bool(alive.any()):
                break
            if not bool(alive.all()):  # finished rows leave the cache
                index = alive.nonzero().squeeze(1)
                model_kwargs[CACHE_INPUT].batch_select_indices(index)
                live, mask, next_position, last = live[index], mask[index], next_position[index], last[index]
            budget = torch.minimum(self.max_new - self.lengths[live] - 1, self.draft_lengths(live)).clamp(min=0)
            drafts, draft_lengths = ngram_drafts(
                self.sequences, self.start, self.prompt_width + self.lengths, live, self.group_of_row, budget,
                self.settings.ngram_max, self.settings.ngram_min,
            )  # fmt: skip
            width = drafts.shape[1]
            block = torch.cat([last[:, None], drafts], dim=1)
            forward_mask = torch.cat([mask, mask.new_ones(len(live), width + 1)], dim=1)
            forward_positions = next_position[:, None] + torch.arange(width + 1, device=self.device)
            logits = self.forward(model_kwargs, block, forward_mask, forward_positions)
            counts.forwards += 1
            counts.row_forwards += len(live)
            counts.drafted += int(draft_lengths.sum())
            stats.positions += len(live) * (width + 1)
            kept, last, stopped = self.advance(live, logits, drafts, draft_lengths)
            self.row_drafted[live] += draft_lengths
            self.row_kept[live] += kept
            counts.accepted += int(kept.sum())
            counts.tokens += int(kept.sum()) + len(live)
            # the cache holds each row's previous token and its drafts; keep the longest kept prefix, mask the rest
            columns = mask.shape[1]
            keep = columns + 1 + int(kept[~stopped].max()) if bool((~stopped).any()) else columns + 1
            cache = model_kwargs[CACHE_INPUT]
            cache.crop(keep - cache.get_seq_length())
            offsets = torch.arange(keep - columns, device=self.device)
            mask = torch.cat([mask, (offsets <= kept[:, None]).to(mask.dtype)], dim=1)
            next_position = next_position + 1 + kept
        generated = int(self.lengths.max())
        stats.full_positions += self.batch_size * max(generated - 1, 0)
        if self.logps is not None:
            stats.sampler_logps = self.logps[:, :generated]
        return self.sequences[:, : self.prompt_width + generated]

    def draft_lengths(self, live: torch.Tensor) -> torch.Tensor:
        """How many tokens each row of `live` may draft: k, or with the adaptive draft length, 1 + the run of drafts
        the row's kept fraction so far predicts, a / (1 - a) (a estimated with a prior of 3 kept in 4), at most k."""
        k = self.settings.max_draft_tokens
        if not self.settings.adaptive_draft:
            return torch.full_like(live, k)
        rate = (self.row_kept[live] + 3).double() / (self.row_drafted[live] + 4).double()
        return (rate / (1 - rate)).floor().long().add(1).clamp(max=k)

    def forward(self, model_kwargs: dict, block, attention_mask, position_ids) -> torch.Tensor:
        """Logits (rows, width, V) float32 of every position of `block`, the cache extended by it."""
        width = block.shape[1]
        kwargs = dict(model_kwargs, attention_mask=attention_mask, position_ids=position_ids)
        if "logits_to_keep" in kwargs:
            kwargs["logits_to_keep"] = width
        inputs = self.model.prepare_inputs_for_generation(block, next_sequence_length=width, **kwargs)
        outputs = self.model(**inputs, return_dict=True)
        logits = outputs.logits[:, -width:].to(copy=True, dtype=torch.float32, device=self.device)
        del outputs
        return logits

    def advance(self, live, logits, drafts, draft_lengths):
        """Verify the drafts of rows `live` (logits (n, m + 1, V)), append what each keeps and the token after it,
        stop rows as the stopping criteria say token by token: (kept (n,), last token (n,), stopped (n,) bool)."""
        count, width = drafts.shape
        base = self.prompt_width + self.lengths[live]
        offsets = torch.arange(width, device=self.device)
        proposed = offsets < draft_lengths[:, None]
        rows, cols = proposed.nonzero(as_tuple=True)
        self.sequences[live[rows], base[rows] + cols] = drafts[rows, cols]
        scores = self.process(live, logits, base, draft_lengths)
        kept, next_tokens = verify(scores, drafts, draft_lengths, bool(self.config.do_sample), self.decoder.accept)
        self.sequences[live, base + kept] = next_tokens
        # tokens after the kept ones (refused drafts) go back to padding
        pad = int(self.config._pad_token_tensor)
        stale = (offsets[None] > kept[:, None]) & proposed
        rows, cols = stale.nonzero(as_tuple=True)
        self.sequences[live[rows], base[rows] + cols] = pad
        # the stopping criteria, token by token, on each new token's prefix
        new_tokens = kept + 1
        stop_at = torch.full((count,), -1, dtype=torch.long, device=self.device)
        pairs = torch.arange(int(new_tokens.max()), device=self.device)
        rows, cols = (pairs[None] < new_tokens[:, None]).nonzero(as_tuple=True)
        ends = base[rows] + cols + 1
        for end in torch.unique(ends).tolist():
            chosen = (ends == end).nonzero().squeeze(1)
            done = self.stopping(self.sequences[live[rows[chosen]], :end], None)
            hit = rows[chosen][done]
            first = cols[chosen][done]
            unset = (stop_at[hit] < 0) | (first < stop_at[hit])
            stop_at[hit[unset]] = first[unset]
        stopped = stop_at >= 0
        total = torch.where(stopped, stop_at + 1, new_tokens)
        after = (pairs[None] >= total[:, None]) & (pairs[None] < new_tokens[:, None])
        rows, cols = after.nonzero(as_tuple=True)
        self.sequences[live[rows], base[rows] + cols] = pad
        if self.logps is not None:
            self.record_logps(live, scores, base, total)
        self.lengths[live] += total
        return kept, next_tokens, stopped

    def record_logps(self, live, scores, base, total) -> None:
        """Each of the `total` new tokens of rows `live`: log p(token) under the processed scores of its position.
        A kept draft and the token drawn after it (from the residual on a refusal) are each distributed as p
        (grpo_plus.speculative.acceptance), the distribution one-token decoding draws from and logs."""
        rows, cols = (torch.arange(scores.shape[1], device=self.device)[None] < total[:, None]).nonzero(as_tuple=True)
        tokens = self.sequences[live[rows], base[rows] + cols]
        chosen = torch.log_softmax(scores[rows, cols], dim=-1).gather(1, tokens[:, None]).squeeze(1)
        self.logps[live[rows], base[rows] - self.prompt_width + cols] = chosen

    def process(self, live, logits, base, draft_lengths) -> torch.Tensor:
        """The processed scores (n, m + 1, V) of each row's positions 0..draft_lengths (later ones: zeros), each
        position's processors given that position's prefix."""
        scores = torch.zeros_like(logits)  # positions past a row's drafts: never read
        positions = torch.arange(logits.shape[1], device=self.device)
        rows, cols = (positions[None] <= draft_lengths[:, None]).nonzero(as_tuple=True)
        chosen = logits[rows, cols]
        if len(self.per_row):
            ends = base[rows] + cols
            for end in torch.unique(ends).tolist():
                at = (ends == end).nonzero().squeeze(1)
                batch_rows = live[rows[at]]
                processors = _for_rows(self.per_row, batch_rows)
                chosen[at] = processors(self.sequences[batch_rows, :end], chosen[at])
        if len(self.id_free):
            ends = base[rows] + cols
            chosen = self.id_free(self.sequences[live[rows], : int(ends.max())], chosen)
        scores[rows, cols] = chosen
        return scores
