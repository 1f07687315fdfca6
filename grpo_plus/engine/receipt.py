"""Sync receipts: after a weight sync into the colocated engine, before it generates from the new weights, proof that it
serves the trainer's weights (`GRPOConfig.vllm_sync_check`: "every" sync, the "first" only, or "off").

A sync that goes wrong does not raise: the engine keeps generating, from the wrong weights, and the trainer trains on
those samples. A receipt checks what is cheap to check exactly, then what only numbers can show:

1. the stream: every trainer tensor that can change since the last sync was sent (a LoRA layer with an applied
   adapter, a module left trainable, every weight in a full sync), named from the trainer's own modules, not from the
   stream's logic;
2. the engine took what was sent: as many checkpoint elements as were streamed (a transport that loads nothing, or a
   name vLLM drops, takes fewer), and after a full sync no layer kept its previous weights;
3. the prefix cache was reset: a fixed sequence one KV-cache block long, read at every check, is read again with
   vLLM's prefix cache, and none of it may come from there (a cached block holds keys and values computed with the
   weights before the sync);
4. the log-probs: the engine's and the trainer's log-probs of a fixed probe sequence agree within what the dtypes
   allow: mean |difference| over its positions at most `bound`, which is `FLOAT32_BOUND` where both sides compute
   in float32 and otherwise `FLOOR_FACTOR` times the trainer's own precision floor: the mean |difference| between
   its log-probs without autocast and under autocast to the other side's reduced precision (for weights already in
   bfloat16, to float16), measured once and again whenever the bound would fail (training sharpens the model, and
   the floor grows with it). Measured: the engine's difference is up to 2.1 times that floor (docs/guide/vllm.md, "Sync
   receipts"). A quantized engine (fp8) gets `LOW_PRECISION_BOUNDS`.

The sequences are fixed pseudo-random ordinary tokens of the vocabulary (drawn with a private generator, once). The
engine reads them with greedy decoding, which draws no random numbers, so the completions TRL samples afterwards are
the ones it would have sampled without the check. The trainer computes the probe with its model in eval mode (no
dropout) under the trainer's own autocast, every process alike (under ZeRO-3 / FSDP each forward gathers weights on
every rank).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from .reload import ReloadReport, SyncCheckError

logger = logging.getLogger(__name__)

SYNC_CHECK_MODES = ("every", "first", "off")
PROBE_TOKENS = 16  # the log-prob probe: 15 scored positions (the trainer's forward is the check's main cost)
# Mean |engine - trainer| log-prob a correct sync stays under where both compute in float32 (measured: 1e-7 on the
# tests' tiny Llama, 1e-5 on SmolLM2-135M, both on vLLM's CPU build).
FLOAT32_BOUND = 1e-3
# The bound elsewhere: this many times the trainer's own precision floor (engine / floor measured up to 2.1).
FLOOR_FACTOR = 5.0
# A quantized engine (fp8 and other online methods: not on vLLM's CPU build, not measured here), and a floor that
# overflowed in float16, by the least precise dtype either side computes in: wide enough for what a correct sync
# shows (SmolLM2-135M, bfloat16 engine: 0.05-0.07), so they catch gross disagreement only (the structural checks
# catch omissions exactly whatever the dtype).
LOW_PRECISION_BOUNDS = {"float16": 0.15, "bfloat16": 0.3, "quantized": 0.6}
PRECISION_ORDER = ("float32", "float16", "bfloat16", "quantized")


@dataclass
class StreamRecord:
    """What one sync streamed: the names, the elements, and whether it was a full stream (every weight)."""

    names: list[str] = field(default_factory=list)
    elements: int = 0
    full: bool = True


@dataclass
class SyncReceipt:
    """One sync's proof: what was streamed and loaded, the probe's agreement, what the check took."""

    sync: int
    streamed_tensors: int
    streamed_elements: int
    loaded_elements: int
    cached_tokens: int | None  # None: max_model_len leaves no room for one KV-cache block, the cache is not checked
    mean_abs_difference: float
    max_abs_difference: float
    bound: float
    precision: str
    seconds: float
    trainer_positions: int  # token positions the trainer's model computed for this check (the probe, its floor)


def precision_class(dtype: torch.dtype | None, quantization: str | None = None) -> str:
    """One side's precision, computing in `dtype` (an engine with a quantization method: "quantized")."""
    if quantization:
        return "quantized"
    return {torch.float16: "float16", torch.bfloat16: "bfloat16"}.get(dtype, "float32")


def worst_precision(*classes: str) -> str:
    return max(classes, key=PRECISION_ORDER.index)


def probe_token_ids(vocab_size: int, excluded: set[int], length: int, seed: int = 0) -> list[int]:
    """`length` token ids drawn uniformly from range(vocab_size) minus `excluded` (special and multimodal tokens), with a
    private generator: the global random state is not touched."""
    allowed = torch.tensor([i for i in range(vocab_size) if i not in excluded])
    generator = torch.Generator().manual_seed(seed)
    return allowed[torch.randint(len(allowed), (length,), generator=generator)].tolist()


def excluded_token_ids(tokenizer: Any, config: Any) -> set[int]:
    """Ids the probe leaves out: the tokenizer's special tokens and every `*_token_id` / `*_token_index` the model's
    config names (image, video, audio placeholders a forward without pixels cannot take)."""
    text_tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
    excluded = set(getattr(text_tokenizer, "all_special_ids", []) or [])
    for cfg in {id(config): config, id(config.get_text_config()): config.get_text_config()}.values():
        for key, value in vars(cfg).items():
            if key.endswith(("_token_id", "_token_index", "_token_ids")):
                values = value if isinstance(value, (list, tuple)) else [value]
                excluded.update(v for v in values if isinstance(v, int))
    return excluded


def changing_tensor_names(model: torch.nn.Module, rename: Callable[[str], str], full: bool) -> set[str]:
    """The engine names of the trainer's tensors that can change between syncs (all of them for a full sync), read
    from the trainer's modules: a LoRA layer with an applied adapter sends its base layer's `weight`, the active copy
    of a `modules_to_save` module its parameters under the original name, any other trainable parameter itself. A
    tensor tied to another (an LM head tied to the input embedding) goes once, under its first name."""
    from accelerate.utils import is_peft_model

    if not is_peft_model(model):
        return {rename(name) for name, param in model.named_parameters() if full or param.requires_grad}
    from peft.tuners.lora import LoraLayer
    from peft.utils.other import ModulesToSaveWrapper

    names: set[str] = set()
    seen: set[int] = set()
    inside: tuple[str, ...] = ()  # LoRA layers and modules_to_save wrappers: their own parameters are not the engine's

    def add(path: str, params, wanted: Callable[[torch.nn.Parameter], bool]) -> None:
        for name, param in params:
            if id(param) not in seen:
                seen.add(id(param))
                if wanted(param):
                    names.add(rename(f"{path}.{name}" if path else name))

    for path, module in model.get_base_model().named_modules():
        if path.startswith(inside):
            continue
        if isinstance(module, LoraLayer):
            inside += (f"{path}.",)
            applied = [a for a in module.active_adapters if a in module.lora_A or a in module.lora_embedding_A]
            changing = bool(applied) and not module.disable_adapters and not module.merged
            add(path, module.get_base_layer().named_parameters(), lambda param, changing=changing: full or changing)
        elif isinstance(module, ModulesToSaveWrapper):
            inside += (f"{path}.",)
            add(path, module.original_module.named_parameters(), lambda param: True)
        else:
            add(path, module.named_parameters(recurse=False), lambda param: full or param.requires_grad)
    return names


def check_stream(sync: int, model: torch.nn.Module, rename: Callable[[str], str], streamed: StreamRecord) -> None:
    """SyncCheckError if sync number `sync` left out a tensor of `model` that can change (all, for a full stream)."""
    expected = changing_tensor_names(model, rename, streamed.full)
    missing = sorted(expected - set(streamed.names))
    if missing:
        raise SyncCheckError(
            f"weight sync {sync}: the stream left out {len(missing)} of the trainer's tensors that can change "
            f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}): the engine would keep serving their "
            "previous values."
        )


def check_loaded(sync: int, streamed: StreamRecord, report: ReloadReport) -> None:
    """SyncCheckError if the engine took other than every element streamed, or a full sync left layers unloaded."""
    if report.loaded_elements != streamed.elements:
        raise SyncCheckError(
            f"weight sync {sync}: the engine took {report.loaded_elements:,} of the {streamed.elements:,} "
            f"elements streamed in {len(streamed.names)} tensors (into {len(report.loaded_layers)} layers): the "
            "transport or vLLM's loader dropped the rest, and the engine keeps their previous values."
        )
    if streamed.full and report.unloaded_layers:
        layers = report.unloaded_layers
        raise SyncCheckError(
            f"weight sync {sync}: a full sync left {len(layers)} engine layers without new weights "
            f"({', '.join(layers[:4])}{', ...' if len(layers) > 4 else ''}): they keep the weights of the previous "
            "sync."
        )


class SyncChecker:
    """Checks syncs into one colocated engine for one trainer model (`mode`: one of SYNC_CHECK_MODES).

    `model` is the trainer's model (its modules name what a sync must send), `inference` a context manager factory
    yielding the model to run the probe on (the trainer's: TRL's `unwrap_model_for_generation`, which under ZeRO-3
    gathers the weights and takes DeepSpeed's hooks off, so the probe's forward does not enter DeepSpeed's record of
    the training forward's module order), `autocast` the trainer's forward context (accelerate's `autocast()`:
    bfloat16 under bf16=True), `rename` TRL's mapping of a module path to the engine's name, `wake_kv_cache` what makes
    the engine's KV cache usable when a sleep mode released it (TRL wakes it itself before generating). The trainer's
    side and the engine's run one after the other, after the stream: with the trainer's side in a thread while the
    weights streamed, the engine once in 40 syncs of a DoRA model on a 4-bit base reported a packed layer half loaded,
    which no sequential run showed (and on a 2-core CPU the threads contend for the same cores)."""

    def __init__(
        self,
        mode: str,
        llm: Any,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        rename: Callable[[str], str] = lambda name: name,
        inference: Callable[[], AbstractContextManager[torch.nn.Module]] | None = None,
        autocast: Callable[[], AbstractContextManager] = nullcontext,
        wake_kv_cache: Callable[[], None] | None = None,
    ):
        if mode not in SYNC_CHECK_MODES:
            raise ValueError(f"vllm_sync_check={mode!r}: one of {', '.join(map(repr, SYNC_CHECK_MODES))}")
        self.mode, self.llm, self.model, self.rename = mode, llm, model, rename
        self.inference = inference or (lambda: nullcontext(model))
        self.autocast, self.wake_kv_cache = autocast, wake_kv_cache
        self.receipts: list[SyncReceipt] = []
        self.syncs = 0
        self._tokenizer = tokenizer
        self._sequences: tuple[list[int], list[int] | None] | None = None
        self._floor: float | None = None  # the trainer's precision floor, measured when first needed
        self._positions = 0  # token positions the trainer's model computed for the check under way

    # ---- the check ---------------------------------------------------------------------------------------------------

    def check(self, streamed: StreamRecord, report: ReloadReport) -> SyncReceipt | None:
        """The receipt of the sync just made (None when `mode` skips it); raises SyncCheckError naming what
        disagrees."""
        self.syncs += 1
        if not (self.mode == "every" or (self.mode == "first" and self.syncs == 1)):
            return None
        started, self._positions = time.perf_counter(), 0
        self._check_stream(streamed)
        self._check_loaded(streamed, report)
        if self.wake_kv_cache is not None:
            self.wake_kv_cache()
        probe, cache_probe = self.sequences()
        trainer = self._trainer_side()
        engine, cached = self._engine_reads(probe, cache_probe)
        difference = (engine - trainer).abs()
        mean = difference.mean().item()
        measured_before = self._floor is not None
        bound, precision = self.bound()
        if not mean <= bound and measured_before:  # the floor moves as training sharpens the model: measure again
            bound, precision = self.bound(measure_floor=True)
        if cached:
            raise SyncCheckError(
                f"weight sync {self.syncs}: the engine read {cached} tokens of a sequence it had computed before the sync "
                "from its prefix cache, whose keys and values come from the weights before the sync: the prefix cache "
                "was not reset after the sync (vLLM's `reset_prefix_cache()`), and prompts sharing a cached prefix "
                "would be generated from the old weights."
            )
        receipt = SyncReceipt(
            sync=self.syncs,
            streamed_tensors=len(streamed.names),
            streamed_elements=streamed.elements,
            loaded_elements=report.loaded_elements,
            cached_tokens=cached,
            mean_abs_difference=mean,
            max_abs_difference=difference.max().item(),
            bound=bound,
            precision=precision,
            seconds=time.perf_counter() - started,
            trainer_positions=self._positions,
        )
        if not mean <= bound:  # a NaN fails too
            worst = int(difference.argmax())
            raise SyncCheckError(
                f"weight sync {self.syncs}: the engine's log-probs of a fixed probe ({len(probe)} tokens) are not the "
                f"trainer's: mean |engine - trainer| {mean:.4g} over {difference.numel()} positions, above the bound "
                f"{bound:.3g} ({precision}), largest {difference[worst].item():.4g} at position {worst + 1}. Every "
                f"tensor that can change was streamed and the engine took all {report.loaded_elements:,} elements, so "
                "the values it serves differ: e.g. a LoRA scale applied twice or not at all, a merge into the wrong "
                "base, a layer whose processing kept old weights. The engine would generate from these weights."
            )
        self.receipts.append(receipt)
        return receipt

    def _check_stream(self, streamed: StreamRecord) -> None:
        check_stream(self.syncs, self.model, self.rename, streamed)

    def _check_loaded(self, streamed: StreamRecord, report: ReloadReport) -> None:
        check_loaded(self.syncs, streamed, report)

    # ---- the probe ---------------------------------------------------------------------------------------------------

    def _trainer_side(self) -> torch.Tensor:
        """The trainer's log-probs of the probe (its model run as `inference` yields it)."""
        probe, _ = self.sequences()
        with self.inference() as model:
            return self._trainer_logprobs(model, probe)

    def sequences(self) -> tuple[list[int], list[int] | None]:
        """(the log-prob probe, the prefix-cache probe: one KV-cache block and one token, None where max_model_len
        leaves no room for it), drawn once."""
        if self._sequences is None:
            max_len = int(self._engine_model_config().max_model_len) - 1
            block = int(self.llm.llm_engine.vllm_config.cache_config.block_size)
            config = self._unwrapped().config
            vocab = min(
                config.get_text_config().vocab_size, len(getattr(self._tokenizer, "tokenizer", self._tokenizer))
            )
            excluded = excluded_token_ids(self._tokenizer, config)
            probe = probe_token_ids(vocab, excluded, min(PROBE_TOKENS, max_len), seed=0)
            cache_probe = probe_token_ids(vocab, excluded, block + 1, seed=1) if block + 1 <= max_len else None
            self._sequences = probe, cache_probe
        return self._sequences

    def bound(self, measure_floor: bool = False) -> tuple[float, str]:
        """(the bound on the mean |difference|, how it was set) for the dtypes both sides compute in; the trainer's
        precision floor is measured the first time it is needed, and again with `measure_floor`."""
        model_config = self._engine_model_config()
        engine = precision_class(model_config.dtype, getattr(model_config, "quantization", None))
        device = self._device().type
        with self.autocast():
            autocast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        weights = self._weights_dtype()
        precision = worst_precision(engine, precision_class(autocast), precision_class(weights))
        if engine == "quantized":
            return LOW_PRECISION_BOUNDS[engine], "quantized engine"
        if precision == "float32":
            return FLOAT32_BOUND, "float32 on both sides"
        if self._floor is None or measure_floor:
            # float32 weights: against the reduced precision either side computes in; reduced weights: against the
            # other half precision, whose rounding differs (float16 keeps 3 more mantissa bits than bfloat16)
            engine_dtype = model_config.dtype if engine != "float32" else autocast
            other = {torch.bfloat16: torch.float16, torch.float16: torch.bfloat16}.get(weights, engine_dtype)
            with self.inference() as model:
                self._floor = self._precision_floor(model, other)
        if not math.isfinite(self._floor):  # float16 overflowed where bfloat16 did not: no floor to scale
            return LOW_PRECISION_BOUNDS[precision], f"{precision}, the least precise side"
        return (
            FLOAT32_BOUND + FLOOR_FACTOR * self._floor,
            f"{FLOOR_FACTOR:g} x the trainer's {precision} floor {self._floor:.3g}",
        )

    def _precision_floor(self, model: torch.nn.Module, dtype: torch.dtype) -> float:
        """Mean |difference| between the trainer's log-probs of the probe without autocast and under autocast to
        `dtype`: how far rounding alone moves them."""
        probe, _ = self.sequences()
        exact = self._trainer_logprobs(model, probe, autocast=nullcontext)
        rounded = self._trainer_logprobs(
            model, probe, autocast=lambda: torch.autocast(self._device().type, dtype=dtype)
        )
        return (exact - rounded).abs().mean().item()

    def _engine_reads(self, probe: list[int], cache_probe: list[int] | None) -> tuple[torch.Tensor, int | None]:
        """The engine's log-probs of the probe's tokens 1..L-1 (greedy: no random numbers drawn), and how many tokens
        of the cache probe it read from its prefix cache (None: no cache probe)."""
        from vllm import SamplingParams

        scored = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        prompts, params = [{"prompt_token_ids": probe}], [scored]
        if cache_probe is not None:  # read through the prefix cache, which a sync must leave empty
            prompts.append({"prompt_token_ids": cache_probe})
            params.append(SamplingParams(max_tokens=1, temperature=0.0, detokenize=False))
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        cached = None if cache_probe is None else int(outputs[1].num_cached_tokens or 0)  # the scored probe reads none
        logprobs = outputs[0].prompt_logprobs[1:]
        return torch.tensor([entry[t].logprob for t, entry in zip(probe[1:], logprobs, strict=True)]), cached

    @torch.no_grad()
    def _trainer_logprobs(self, model, probe: list[int], autocast: Callable[[], AbstractContextManager] | None = None):
        """`model`'s log-probs of the probe's tokens 1..L-1, in eval mode, under the trainer's autocast."""
        was_training = model.training
        model.eval()
        try:
            ids = torch.tensor([probe], device=self._device())
            self._positions += ids.numel()
            with (autocast or self.autocast)():
                logits = model(input_ids=ids, use_cache=False).logits[0, :-1]
            logprobs = logits.float().log_softmax(-1)
            return logprobs.gather(1, ids[0, 1:].unsqueeze(1)).squeeze(1).cpu()
        finally:
            model.train(was_training)

    # ---- engine and model facts --------------------------------------------------------------------------------------

    def _engine_model_config(self):
        return self.llm.llm_engine.model_config

    def _unwrapped(self) -> torch.nn.Module:
        model = self.model
        while isinstance(getattr(model, "module", None), torch.nn.Module):  # DDP / DeepSpeed wrappers
            model = model.module
        return model

    def _weights_dtype(self) -> torch.dtype:
        """The dtype the trainer's floating weights are computed in (a 4-bit base: its LM head's)."""
        head = self._unwrapped().get_output_embeddings()
        if head is not None and getattr(head, "weight", None) is not None and head.weight.is_floating_point():
            return head.weight.dtype
        return next(p.dtype for p in self._unwrapped().parameters() if p.is_floating_point())

    def _device(self) -> torch.device:
        return next(self._unwrapped().parameters()).device


def log_receipts(receipts: Iterable[SyncReceipt], metrics: dict[str, list]) -> None:
    """The receipts' figures under `vllm_sync/*` in the trainer's metrics."""
    for receipt in receipts:
        metrics["vllm_sync/probe_logp_difference/mean"].append(receipt.mean_abs_difference)
        metrics["vllm_sync/probe_logp_difference/max"].append(receipt.max_abs_difference)
        metrics["vllm_sync/check_seconds"].append(receipt.seconds)
