"""Partial rollouts for the long tail: the pool of groups in flight, decoded in chunks, handed over whole.

TRL's step waits for its longest completion. Here a step's generation works on a pool: the groups carried from earlier
steps plus the step's own (TRL's generation batch). Every unfinished row is decoded by at most `partial_rollout_tokens`
tokens at a time (one call of TRL's `_generate_single_turn` on all of them, each row's prompt followed by the tokens it
already has, under the current weights: grpo_plus's generator inside it, `chunk_decoder`, or TRL's vLLM, colocated
or a server, `engine_chunk_decoder`, each row its own request); after each chunk, once the pool holds as many complete
groups (all G rows ended: EOS or max_completion_length) as the step trains, generation stops and the oldest complete
groups are handed to TRL's scoring, in pool order; the rest stay in the pool. Each kept token keeps the log-prob the
sampler drew it with (the processed distribution, as vLLM's `processed_logprobs`) and the optimizer step of the
weights that drew it.

Where the carry comes from: the pool hands exactly one generation batch of groups per step, so it can carry only what
came in beyond one batch. When a chunk leaves the pool short of complete groups, the next generation batch of the
trainer's own sampler enters early (read ahead with `PromptLookahead`, the asynchronous pipeline's reader: the same
RepeatSampler, seeded the same, no random number drawn); when TRL's loop later hands that batch over, it is checked
against the one read ahead. The pool is capped (not refused): it holds at most two generation batches of groups, so at
most one batch is carried; with that cap, the groups that waited `max_staleness` steps (at most one batch of them) are
decoded to the end before anything else, and are the oldest: no token is trained more than `max_staleness` optimizer
steps after the weights that sampled it. With a chunk of at least max_completion_length tokens every row of the step's
batch ends in the first chunk: nothing is read ahead, and the generation is TRL's call, token for token.

Against a vLLM server with a seed in `generation_kwargs`, each row's request of each chunk carries its own seed,
`row_seed(seed, row serial, tokens held)`: rows of one group (one prompt) draw their own tokens, and a run draws the
same tokens whenever it asks for the same rows, resumed or not (a server's engine is seeded once, at its start).

The pool's state (each group's dataset rows, each row's prompt ids, tokens, sampler log-probs, versions and serial, the
reading position) is a stateful part (grpo_plus.run.state): saved in checkpoints atomically with the rest, restored on
resume.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..compat.common import attribute_set
from ..compat.model import single_turn_arguments
from ..compat.vllm import engine_max_tokens
from ..engine.server import seeded_requests
from ..run.distributed import layout_name, whole_weights_on_every_process
from ..zero_waste.multi_turn import TurnCache
from .settings import PartialRolloutSettings

STATE_VERSION = 2  # 2: each row's serial (its request seeds); 1 loads (its rows were never seeded)
READABLE_STATE_VERSIONS = (1, 2)
METRIC_PREFIX = "partial_rollouts/"
# The dataset columns TRL reads pictures from: image prompts are refused (a checkpoint holds the pool as plain data).
IMAGE_COLUMNS = ("image", "images")


class PartialRolloutError(RuntimeError):
    """Partial rollouts cannot give the trainer the generation batch it asked for."""


@dataclass
class Row:
    """One completion in flight: its prompt's token ids, the tokens sampled so far, each token's sampler log-prob
    (float32 values) and the optimizer step of the weights that sampled it, whether it ended, and its serial (its
    place in the order rows entered the pool: what its request seeds are drawn from)."""

    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finished: bool = False
    serial: int = 0


def row_seed(seed: int, serial: int, position: int) -> int:
    """The sampling seed of the request that continues row `serial` from `position` tokens, in a run seeded with
    `seed`: the top 63 bits of blake2b("seed:serial:position"), a fresh stream for every row and chunk (one seed for
    every request would draw the same tokens for the rows of one prompt)."""
    digest = hashlib.blake2b(f"{seed}:{serial}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # vLLM takes a signed 64-bit seed


@dataclass
class Group:
    """The G rows of one prompt: TRL's dataset rows (`inputs`), their completions, the step it entered the pool at and
    the generation batch it came from."""

    inputs: list[dict[str, Any]]
    rows: list[Row]
    entered: int
    batch: int

    @property
    def complete(self) -> bool:
        return all(row.finished for row in self.rows)


@dataclass
class Handoff:
    """The groups a step trains, oldest first: TRL's rows (`inputs`, flat), and each row's completion."""

    inputs: list[dict[str, Any]]
    rows: list[Row]
    step: int
    replayed: bool = False

    def replay(self, prompt_ids: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
        """What TRL's `_generate_single_turn` returns for these rows: (completion ids, sampler log-probs), checked
        against the prompts TRL tokenized for them; once (a second generation inside the handoff is not TRL's)."""
        if self.replayed:
            raise PartialRolloutError(
                "TRL's scoring generated twice for one handoff (a tool turn or a greedy baseline)"
            )
        self.replayed = True
        if [list(ids) for ids in prompt_ids] != [row.prompt_ids for row in self.rows]:
            raise PartialRolloutError(
                "TRL tokenized the handed-over groups' prompts into other ids than the pool decoded them from"
            )
        return [list(row.tokens) for row in self.rows], [list(row.logps) for row in self.rows]

    def token_ages(self) -> list[int]:
        """Each completion token's age at this step: optimizer steps since the weights that sampled it."""
        return [self.step - version for row in self.rows for version in row.versions]


@dataclass
class Chunk:
    """What one chunk asks of grpo_plus's generator (the trainer's `_generate_single_turn` takes it as `chunk`): each
    call's stats, with each token's sampler log-prob (`record`), and `turns`, the caches the step's earlier chunks kept
    (a row's prompt and tokens so far are not prefilled again while the weights are the same), or None."""

    turns: TurnCache | None
    stats: list = field(default_factory=list)

    def record(self, stats: Any) -> None:
        self.stats.append(stats)


# decode(prompt ids of each row, max new tokens, the step's kept caches, each row's request seed or None) -> (each row's
# new tokens, TRL's EOS cut applied; their sampler log-probs)
Decode = Callable[
    [list[list[int]], int, TurnCache | None, list[int] | None], tuple[list[list[int]], list[list[float]]]
]


def chunk_decoder(single_turn: Callable[..., tuple], generation_config: Any, num_generations: int) -> Decode:
    """`Decode` through TRL's own `_generate_single_turn` (`single_turn`: the trainer's, whose `chunk` keyword asks
    grpo_plus's generator for each token's sampler log-prob and hands it the step's kept caches), TRL's
    `generation_config` (its `max_new_tokens` the chunk's for the call), text prompts only."""
    extra_arguments = single_turn_arguments(num_generations)

    def decode(prompt_ids: list[list[int]], max_new_tokens: int, turns: TurnCache | None, seeds: list[int] | None):
        if seeds is not None:
            raise PartialRolloutError("grpo_plus's generator takes no request seeds (a vLLM server's requests do)")
        chunk = Chunk(turns)
        with attribute_set(generation_config, "max_new_tokens", max_new_tokens):
            completions, _ = single_turn(prompt_ids, None, {}, *extra_arguments, chunk=chunk)
        logps = chunk.stats[0].sampler_logps if len(chunk.stats) == 1 else None
        if logps is None:
            why = chunk.stats[0].fallback if len(chunk.stats) == 1 else f"generate was called {len(chunk.stats)} times"
            raise PartialRolloutError(f"grpo_plus's generator recorded no sampler log-probs, because {why}")
        return completions, [logps[i, : len(ids)].tolist() for i, ids in enumerate(completions)]

    return decode


def engine_chunk_decoder(single_turn: Callable[..., tuple], vllm_generation: Any) -> Decode:
    """`Decode` through TRL's own `_generate_single_turn` (`single_turn`: the trainer's) on TRL's vLLM, colocated or a
    server (`vllm_generation`, TRL's `VLLMGeneration`): every row is its own request (a group size of 1, so a server
    is sent every row, not one prompt per group), its prompt ids and the tokens it has sent as token ids, `max_tokens`
    the chunk's; each new token's log-prob is the one vLLM sampled it with (TRL asks for the sampled token's,
    processed: `compat.vllm`; `trl vllm-serve` and `grpo-plus vllm-serve` start the server so). TRL syncs the weights
    into the engine at the step's first call. Within a step the weights are the same and vLLM's prefix cache keeps
    what the step's earlier chunks computed (`turns` is grpo_plus's generator's; the engine's own cache takes its
    place here). `seeds`, a server's only: each row's request its own seed (`engine.server.seeded_requests`)."""
    extra_arguments = single_turn_arguments(1)  # a group's rows hold different tokens: never n copies of one prompt

    def decode(prompt_ids: list[list[int]], max_new_tokens: int, turns: TurnCache | None, seeds: list[int] | None):
        with engine_max_tokens(vllm_generation, max_new_tokens), seeded_requests(vllm_generation, seeds):
            completions, logps = single_turn(prompt_ids, None, {}, *extra_arguments)
        if logps is None:
            raise PartialRolloutError("TRL's vLLM generation returned no per-token log-probs (its `logprobs` is None)")
        # vLLM reports an unavailable (NaN) log-prob as None (TRL's `extract_logprobs`): NaN, as TRL maps it
        unknown = float("nan")
        return [list(ids) for ids in completions], [
            [unknown if value is None else float(value) for value in row] for row in logps
        ]

    return decode


def trainer_blocker(
    accelerator: Any, args: Any, has_tools: bool, has_rollout_func: bool, generation_blocker: str | None
) -> str | None:
    """Why a trainer cannot run partial rollouts (a sentence naming what to change), or None. `accelerator`, `args`:
    the trainer's (its processes and their kind; GRPOConfig's vLLM mode, generation batch and group size);
    `generation_blocker`: why grpo_plus's generator cannot run, which matters without vLLM only. On several processes
    each process runs its own pool over its own generation batch: no collective may sit inside a chunk, since each pool
    decodes as many chunks as its own rows need."""
    num_processes = accelerator.num_processes
    several, vllm_mode = num_processes > 1, args.vllm_mode if args.use_vllm else None
    process_rows, num_generations = args.generation_batch_size // num_processes, args.num_generations
    reasons = (
        (
            several and not whole_weights_on_every_process(accelerator),
            f"DDP or DeepSpeed ZeRO-1/2 when it runs on several processes (this run: {layout_name(accelerator)} on "
            f"{num_processes}): each process's pool decodes as many chunks as its own rows need, and sharded weights "
            "(ZeRO-3, FSDP) are gathered collectively for every forward that generates",
        ),
        (
            several and vllm_mode == "server",
            f"one trainer process against a vLLM server (this run has {num_processes}): TRL's server call gathers "
            "every process's rows into one request, while each process's pool stops after its own chunks (with "
            "several processes use colocated vLLM or grpo_plus's generator)",
        ),
        (
            several and process_rows % num_generations != 0,
            f"each process's generation batch to be whole groups (per_device_train_batch_size x "
            f"steps_per_generation = {process_rows} rows, groups of num_generations={num_generations}): each "
            "process's pool hands its own groups",
        ),
        (has_tools, "no tools: a tool loop's turns are generated in several calls"),
        (has_rollout_func, "no rollout_func: it generates instead of grpo_plus's generator"),
        (
            generation_blocker is not None and vllm_mode is None,
            f"grpo_plus's generator (or vLLM), and the generator cannot run here: {generation_blocker}",
        ),
    )
    for blocked, needs in reasons:
        if blocked:
            return f"partial_rollout_tokens needs {needs}; set partial_rollout_tokens=None"
    return None


class PartialRollouts:
    """One run's pool (`settings`: PartialRolloutSettings). `num_generations`: G; `max_completion_length`: L;
    `eos_token_ids`: what ends a completion (TRL's); `lookahead`: the trainer's generation batches read ahead
    (`grpo_plus.async_generation.PromptLookahead`); `tokenize(prompts)`: TRL's prompt ids of dataset prompts;
    `decode`: runs a chunk (`chunk_decoder`); `skip_data`: whether a resumed run skips the batches of its epoch
    already trained (not `ignore_data_skip`); `num_processes`: the run's (each process runs its own pool). With `settings.request_seed` (a server's `generation_kwargs` seed) each
    row's request of each chunk gets its own seed (`row_seed`)."""

    checkpoint_name = "partial_rollouts"
    checkpoint_scope = "shared"  # grpo_plus.run.state; each process's own ("process") when there are several

    def __init__(
        self,
        settings: PartialRolloutSettings,
        num_generations: int,
        max_completion_length: int,
        eos_token_ids: list[int],
        lookahead: Any,
        tokenize: Callable[[list[Any]], list[list[int]]],
        decode: Decode,
        skip_data: bool = True,
        num_processes: int = 1,
    ):
        self.settings, self.num_generations = settings, num_generations
        self.max_completion_length, self.eos_token_ids = max_completion_length, set(eos_token_ids)
        self._lookahead, self._tokenize, self._decode_chunk, self._skip_data = lookahead, tokenize, decode, skip_data
        if num_processes > 1:  # each process's pool holds its own rows: saved per process
            self.checkpoint_scope = "process"
        self.groups: list[Group] = []
        self.entered_rows = 0  # rows that entered the pool: the next row's serial
        self.entered_batches = 0  # generation batches that entered the pool (TRL's or read ahead)
        self.handed_batches = 0  # generation batches handed to TRL's scoring
        self.read_ahead: dict[int, list[dict[str, Any]]] = {}  # batches entered ahead of TRL's loop, until it comes
        self._read_ahead = 0  # the lookahead's position: batches it has yielded
        self._resume_at: int | None = None  # a restored pool: where the lookahead restarts
        self.handing: Handoff | None = None  # inside `handing_over`: what TRL's generation replays

    # ---- a step's generation -----------------------------------------------------------------------------------

    def generation_batch(self, inputs: list[dict[str, Any]], step: int, metrics: dict) -> Handoff:
        """The groups TRL's step `step` trains, as many as `inputs` (TRL's generation batch) holds, oldest first."""
        size = len(inputs)
        if size % self.num_generations:
            raise PartialRolloutError(
                f"a generation batch of {size} rows is not whole groups of {self.num_generations}"
            )
        needed = size // self.num_generations
        self._take_trl_batch(inputs, step)
        turns = TurnCache()  # this step's chunks: the weights are the same, each row's cache is kept for the next one
        stale = [g for g in self.groups if not g.complete and step - g.entered >= self.settings.max_staleness]
        if stale:  # waited max_staleness steps: decoded to the end before anything else
            self._decode([row for g in stale for row in g.rows], self.max_completion_length, step, turns)
        while self._complete_count() < needed:
            self._decode([row for g in self.groups for row in g.rows], self.settings.tokens, step, turns)
            if self._complete_count() < needed and len(self.groups) < 2 * needed:
                self._enter(self._next_batch_ahead(), step)
        handed = [g for g in self.groups if g.complete][:needed]
        self.groups = [g for g in self.groups if all(g is not h for h in handed)]
        self.handed_batches += 1
        handoff = Handoff([row for g in handed for row in g.inputs], [row for g in handed for row in g.rows], step)
        self._log(handoff, metrics)
        return handoff

    @contextlib.contextmanager
    def handing_over(self, handoff: Handoff) -> Iterator[None]:
        """Within the block, TRL's generation (its `_generate_single_turn`, as the trainer wires it) replays
        `handoff`: TRL's loop calls it with no room for an argument, so the handoff is held here for the block."""
        self.handing = handoff
        try:
            yield
        finally:
            self.handing = None

    def _take_trl_batch(self, inputs: list[dict[str, Any]], step: int) -> None:
        """TRL's generation batch enters the pool, unless it entered ahead: then it must be the batch read ahead."""
        if self.handed_batches == self.entered_batches:
            self._enter(inputs, step)
            return
        ahead = self.read_ahead.pop(self.handed_batches, None)
        if ahead != list(inputs):
            raise PartialRolloutError(
                f"TRL's generation batch {self.handed_batches} is not the one read ahead of it (the sampler's order "
                "changed: a resume into a later epoch, or a dataloader that does not repeat its order)"
            )

    def _enter(self, inputs: list[dict[str, Any]], step: int) -> None:
        if any(row.get(column) is not None for row in inputs for column in IMAGE_COLUMNS):
            raise PartialRolloutError("partial rollouts take text prompts only: this generation batch has images")
        if any("prompt" not in row for row in inputs):  # an environment_factory's rows: its reset() writes the prompt
            raise PartialRolloutError("partial rollouts need a 'prompt' in every row (environments are not supported)")
        prompt_ids = self._tokenize([row["prompt"] for row in inputs])
        size = self.num_generations
        for start in range(0, len(inputs), size):
            rows = [
                Row(list(ids), serial=self.entered_rows + start + i)
                for i, ids in enumerate(prompt_ids[start : start + size])
            ]
            self.groups.append(Group(list(inputs[start : start + size]), rows, step, self.entered_batches))
        self.entered_batches += 1
        self.entered_rows += len(inputs)

    def _next_batch_ahead(self) -> list[dict[str, Any]]:
        if self._resume_at is not None:  # a restored pool: the reader restarts where the resumed loop does
            self._lookahead.resume_at(self._resume_at, self._skip_data)
            self._read_ahead, self._resume_at = self._resume_at, None
        if self._read_ahead > self.entered_batches:
            raise PartialRolloutError("the prompt reader is past the batch the pool needs next")
        while self._read_ahead <= self.entered_batches:
            batch = list(self._lookahead.next_batch())
            self._read_ahead += 1
        self.read_ahead[self.entered_batches] = [dict(row) for row in batch]
        return batch

    def _decode(self, rows: list[Row], budget: int, step: int, turns: TurnCache) -> None:
        """Every unfinished row of `rows` by at most `budget` more tokens, under the weights of `step` (`turns`: the
        caches the step's earlier chunks kept)."""
        live = [row for row in rows if not row.finished]
        if not live:
            return
        limit = self.max_completion_length
        chunk = min(budget, max(limit - len(row.tokens) for row in live))
        seed = self.settings.request_seed
        seeds = None if seed is None else [row_seed(seed, row.serial, len(row.tokens)) for row in live]
        tokens, logps = self._decode_chunk([row.prompt_ids + row.tokens for row in live], chunk, turns, seeds)
        for row, new, new_logps in zip(live, tokens, logps, strict=True):
            new, new_logps = new[: limit - len(row.tokens)], new_logps[: limit - len(row.tokens)]
            row.tokens += new
            row.logps += [float(value) for value in new_logps[: len(new)]]
            row.versions += [step] * len(new)
            ended = bool(new) and new[-1] in self.eos_token_ids
            row.finished = ended or len(row.tokens) >= limit or len(new) < chunk

    def _complete_count(self) -> int:
        return sum(g.complete for g in self.groups)

    def _log(self, handoff: Handoff, metrics: dict) -> None:
        ages = handoff.token_ages()
        stale = [age for age in ages if age > 0]
        metrics[METRIC_PREFIX + "stale_token_frac"].append(len(stale) / len(ages) if ages else 0.0)
        metrics[METRIC_PREFIX + "stale_token_age_mean"].append(sum(stale) / len(stale) if stale else 0.0)
        metrics[METRIC_PREFIX + "stale_token_age_max"].append(float(max(stale, default=0)))
        metrics[METRIC_PREFIX + "carried_groups"].append(float(len(self.groups)))
        metrics[METRIC_PREFIX + "carried_tokens"].append(
            float(sum(len(r.tokens) for g in self.groups for r in g.rows))
        )

    # ---- checkpoint state --------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The pool as plain data (a snapshot: later steps do not change it)."""
        return {
            "version": STATE_VERSION,
            "num_generations": self.num_generations,
            "entered_batches": self.entered_batches,
            "entered_rows": self.entered_rows,
            "handed_batches": self.handed_batches,
            "read_ahead": [[index, [dict(row) for row in rows]] for index, rows in sorted(self.read_ahead.items())],
            "groups": [
                {
                    "inputs": [dict(row) for row in g.inputs],
                    "entered": g.entered,
                    "batch": g.batch,
                    "rows": [
                        {
                            "prompt_ids": list(r.prompt_ids),
                            "tokens": list(r.tokens),
                            "logps": list(r.logps),
                            "versions": list(r.versions),
                            "finished": r.finished,
                            "serial": r.serial,
                        }
                        for r in g.rows
                    ],
                }
                for g in self.groups
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("version") not in READABLE_STATE_VERSIONS:
            found = state.get("version") if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                f"unknown partial-rollouts state version {found!r} (this grpo_plus reads {READABLE_STATE_VERSIONS})"
            )
        if state["num_generations"] != self.num_generations:
            raise ValueError(
                f"its pool holds groups of {state['num_generations']} completions; this run's num_generations is "
                f"{self.num_generations}. Resume with the same num_generations."
            )
        # a version-1 pool's rows were never seeded (a seed was refused then): serials below 0, apart from new rows'
        unsaved = itertools.count(-1, -1)
        self.groups = [
            Group(
                [dict(row) for row in g["inputs"]],
                [Row(list(r["prompt_ids"]), list(r["tokens"]), list(r["logps"]), list(r["versions"]), r["finished"],
                     r["serial"] if "serial" in r else next(unsaved))
                 for r in g["rows"]],
                g["entered"],
                g["batch"],
            )
            for g in state["groups"]
        ]  # fmt: skip
        self.entered_batches, self.handed_batches = state["entered_batches"], state["handed_batches"]
        self.entered_rows = state.get("entered_rows", 0)
        self.read_ahead = {index: [dict(row) for row in rows] for index, rows in state["read_ahead"]}
        self._resume_at, self._read_ahead, self.handing = self.handed_batches, 0, None
