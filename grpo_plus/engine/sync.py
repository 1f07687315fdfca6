"""Weight sync into a colocated vLLM engine that works on every vLLM build and proves itself: TRL's weight stream (or,
for a LoRA model, grpo_plus's out-of-place one), loaded through vLLM's layerwise reload (`reload`), each sync checked
before the engine generates from it (`receipt`).

The stream: for a full model TRL's own (`VLLMGeneration._iter_named_params`: ZeRO-3 / FSDP gathering, the names vLLM
expects). For a LoRA model TRL merges the adapters into the base in place for the stream and unmerges after, which
moves a bfloat16 or 4-bit base a little at every sync; grpo_plus streams `lora_stream.LoraWeightStream` instead, each
LoRA layer merged in a new tensor (ZeRO-3 gathered as TRL gathers, FSDP2 unsharded; under FSDP1 TRL's stream stays,
with a warning).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from ..compat.vllm import colocate_distribution, colocate_weight_stream_name, colocated_model_runner
from ..run.distributed import fsdp2_unsharded
from .lora_stream import LoraWeightStream
from .receipt import StreamRecord, SyncChecker, SyncReceipt
from .reload import ReloadReport, layerwise_reload

logger = logging.getLogger(__name__)


@dataclass
class SyncLog:
    """What each weight sync into the colocated engine sent, one entry per sync: seconds (the stream, vLLM's loading
    and processing), bytes and tensors streamed, what the engine took (`reloads`), the receipts of checked syncs and
    the seconds each check took; the checker itself."""

    seconds: list[float] = field(default_factory=list)
    bytes: list[int] = field(default_factory=list)
    tensors: list[int] = field(default_factory=list)
    streams: list[StreamRecord] = field(default_factory=list)
    reloads: list[ReloadReport] = field(default_factory=list)
    receipts: list[SyncReceipt] = field(default_factory=list)
    checker: SyncChecker | None = None  # what checks the syncs (None: unchecked)


def reload_on_sync(
    generation: Any,
    *,
    lora_merge_in_place: bool = False,
    sync_check: str = "off",
    inference: Callable[[], AbstractContextManager[torch.nn.Module]] | None = None,
    autocast: Callable[[], AbstractContextManager] = nullcontext,
    on_receipt: Callable[[SyncReceipt], None] | None = None,
) -> SyncLog | None:
    """Make TRL's `VLLMGeneration` (colocate mode) load every weight sync through `layerwise_reload`, a LoRA model's
    weights merged out of place (`lora_stream.LoraWeightStream`), and check syncs as `sync_check` says ("every",
    "first", "off": `receipt.SyncChecker`, the trainer's model run as `inference` yields it under `autocast`, each
    receipt handed to `on_receipt`); returns the sync's log (None in server mode).

    Works on stock TRL's object too (the tests give stock TRL the same sync). `lora_merge_in_place=True` keeps TRL's
    own stream for a LoRA model (merge into the base, stream, unmerge: what the benchmark and the tests compare with).
    Raises LoraSyncError, before any sync, for a PEFT model the out-of-place stream cannot send. Server mode is left
    as TRL runs it: the weights are loaded by the server's process (`trl vllm-serve`)."""
    if generation.mode != "colocate":
        return None
    if getattr(generation, "sync_log", None) is not None:
        return generation.sync_log
    lora = None if lora_merge_in_place else lora_stream(generation)
    stream = lora if lora is not None else getattr(generation, colocate_weight_stream_name())
    log = SyncLog()
    checker = None
    if sync_check != "off":  # (log.checker below)
        checker = SyncChecker(
            sync_check, generation.llm, generation.model, generation.processing_class,
            rename=generation._fix_param_name_to_vllm, inference=inference, autocast=autocast,
            wake_kv_cache=(lambda: generation.llm.wake_up(tags=["kv_cache"])) if generation.enable_sleep_mode else None,
        )  # fmt: skip

    def reloading_stream() -> Iterator[tuple[str, torch.Tensor]]:
        # vLLM keeps a reference to each streamed tensor until its layer is complete (most layers: within the
        # stream; a layer with padding vLLM never loads, such as a vocabulary padded to a multiple of 64: at the
        # end). The out-of-place stream's merged weights are new tensors nothing else writes. TRL's streams gathered
        # ZeRO-3 shards that it then releases by rebinding `param.data`, which leaves the referenced tensor intact,
        # and LoRA weights merged in place, which its unmerge changes: safe only for layers complete within the
        # stream (linear layers).
        started, sent = time.perf_counter(), 0
        record, report = StreamRecord(full=lora is None or lora.next_is_full_stream()), ReloadReport()
        with layerwise_reload(generation.llm, report):
            for name, tensor in stream():
                sent += tensor.numel() * tensor.element_size()
                record.names.append(name)
                record.elements += tensor.numel()
                yield name, tensor
        log.seconds.append(time.perf_counter() - started)
        log.bytes.append(sent)
        log.tensors.append(len(record.names))
        log.streams.append(record)
        log.reloads.append(report)

    setattr(generation, colocate_weight_stream_name(), reloading_stream)
    if checker is not None:
        sync_weights = generation.sync_weights

        def checked_sync_weights() -> None:
            sync_weights()  # TRL's: the stream above, then the prefix cache reset
            receipt = checker.check(log.streams[-1], log.reloads[-1])
            if receipt is not None:
                log.receipts.append(receipt)
                if on_receipt is not None:
                    on_receipt(receipt)

        generation.sync_weights = checked_sync_weights
        log.checker = checker
    generation.sync_log = log
    return log


def lora_stream(generation: Any) -> LoraWeightStream | None:
    """The out-of-place stream for `generation`'s model when it is a PEFT model (None for a full model, and under
    FSDP1, where TRL's stream stays). Under ZeRO-3 the stream gathers every parameter as TRL gathers them; under FSDP2
    it unshards every sharded module for the stream (`fsdp2_unsharded`: the whole model on each rank, as ZeRO-3's
    gather; each rank syncs its own engine, so every rank streams)."""
    if not lora_stream_wanted(generation):
        return None
    model = generation.model
    distribution = colocate_distribution(generation)
    gather = distribution.gather_params
    if distribution.is_fsdp:  # FSDP2 (lora_stream_wanted leaves FSDP1 to TRL); sharded later, when prepared
        gather = lambda params: fsdp2_unsharded(model)  # noqa: E731
    runner = colocated_model_runner(generation.llm)
    config = runner.model_config
    return LoraWeightStream(
        model,
        config.dtype,
        engine_ties_embeddings=bool(getattr(config.hf_text_config, "tie_word_embeddings", False)),
        packed_modules=getattr(runner.get_model(), "packed_modules_mapping", None),
        gather=gather,
        copy_sources=distribution.is_fsdp,
        rename=generation._fix_param_name_to_vllm,
    )


def lora_stream_wanted(generation: Any) -> bool:
    """Whether `generation`'s model is a PEFT model the out-of-place stream sends (not under FSDP1, where TRL's stream
    stays, with a warning)."""
    from accelerate.utils import is_peft_model

    if not is_peft_model(generation.model):
        return False
    distribution = colocate_distribution(generation)
    if distribution.is_fsdp and distribution.fsdp_version != 2:
        logger.warning(
            "LoRA with FSDP1 and vLLM: weights are synced by TRL's stream, which merges the adapters into the base "
            "and unmerges them at each sync (a bfloat16 or 4-bit base moves a little each time); grpo_plus's "
            "out-of-place sync runs with FSDP2 (fsdp_version: 2), DeepSpeed, DDP and one process."
        )
        return False
    return True
