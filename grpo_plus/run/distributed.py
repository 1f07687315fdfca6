"""What accelerate was asked to run against what it runs: a launch that would silently train wrong fails at start.

grpo_plus goes beyond one GPU through accelerate (DDP, DeepSpeed, FSDP) exactly as TRL does. Two launches exit 0
while training something else than asked:
- DeepSpeed (or DDP without `--use_cpu`) on a machine where accelerate finds no distributed backend (CPU only):
  every launched process trains alone, on its own data, with its own weights;
- FSDP with `use_cpu`: accelerate drops the FSDP plugin and runs plain DDP.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

logger = logging.getLogger(__name__)

# accelerate's DistributedType values for DDP (and one process): every trainer process holds whole weights, and
# generating or syncing them takes no collective (sharded weights, DeepSpeed and FSDP, are gathered collectively).
DATA_PARALLEL = ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA",
                 "MULTI_HPU", "MULTI_NEURON")  # fmt: skip


def _zero_stage(accelerator: Any) -> int | None:
    """DeepSpeed's ZeRO stage where accelerate runs DeepSpeed, else None."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return plugin.zero_stage if accelerator.distributed_type.name == "DEEPSPEED" and plugin is not None else None


def whole_weights_on_every_process(accelerator: Any) -> bool:
    """Whether every process holds whole weights, so generating from them takes no collective: one process, DDP, or
    DeepSpeed ZeRO-1/2 (which shard optimizer states and gradients only); not ZeRO-3 or FSDP (sharded weights)."""
    stage = _zero_stage(accelerator)
    return stage < 3 if stage is not None else accelerator.distributed_type.name in DATA_PARALLEL


def layout_name(accelerator: Any) -> str:
    """accelerate's distributed type, with DeepSpeed's ZeRO stage ("MULTI_GPU", "DEEPSPEED (ZeRO-3)", ...)."""
    stage, kind = _zero_stage(accelerator), accelerator.distributed_type.name
    return kind if stage is None else f"{kind} (ZeRO-{stage})"


class LaunchError(RuntimeError):
    """accelerate launched several processes that would not train together."""


def _flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() in ("1", "true", "yes")


def check_launch(distributed_type: str, num_processes: int) -> None:
    """Raise LaunchError where the launched processes would each train alone; warn where accelerate runs another
    engine than the config asks for. `distributed_type` and `num_processes` are the accelerator's."""
    launched = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if launched > 1 and num_processes == 1:
        raise LaunchError(
            f"accelerate launched {launched} processes, but each of the {launched} launched processes would train "
            "alone: accelerate found no distributed backend on this machine. On a CPU-only machine set "
            "--ddp_backend gloo (GRPOConfig.ddp_backend), and for DeepSpeed also DS_ACCELERATOR=cpu; with plain DDP "
            "pass --use_cpu true."
        )
    asked = "FSDP" if _flag("ACCELERATE_USE_FSDP") else "DEEPSPEED" if _flag("ACCELERATE_USE_DEEPSPEED") else None
    if asked is not None and asked not in distributed_type.upper():
        logger.warning(
            "The accelerate config asks for %s, but accelerate runs %s (%d processes): %s",
            asked,
            distributed_type,
            num_processes,
            "FSDP runs on GPUs only; with use_cpu accelerate drops it and runs plain DDP."
            if asked == "FSDP"
            else "DeepSpeed needs use_cpu: false in the accelerate config (on CPU: DS_ACCELERATOR=cpu).",
        )


def fsdp2_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of `model` that PyTorch's FSDP2 (`fully_shard`) sharded (none elsewhere, FSDP1 included)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover  (public from torch 2.6; grpo_plus needs 2.8)
        return []
    return [module for module in model.modules() if isinstance(module, FSDPModule)]


@contextmanager
def fsdp2_unsharded(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """`model` with every FSDP2-sharded parameter whole on this rank while inside (`FSDPModule.unshard`, resharded on
    exit), for code that reads the weights outside a forward (the out-of-place LoRA stream). Collective: every rank
    must enter, and FSDP2 all-gathers module by module in the same order on each. Elsewhere `model` as is."""
    modules = fsdp2_modules(model)
    for module in modules:
        module.unshard()
    try:
        yield model
    finally:
        for module in modules:
            module.reshard()


@contextmanager
def whole_model_for_generation(model: Any, trainer: Any = None, gather: bool | None = None) -> Iterator[Any]:
    """`model` with whole parameters on this rank, for generation outside TRL's step (held-out evaluation) and other
    forwards outside the training forward (the vLLM sync check's probe).

    Under DeepSpeed ZeRO-3 each rank holds a shard of every weight: a trained model goes through TRL's
    `unwrap_model_for_generation` (it gathers the shards once and lifts the engine's per-layer hooks, unless `gather`
    is False; None: the trainer's `ds3_gather_for_generation`), a model partitioned at load (`zero3_init_flag`) and
    not yet in an engine is gathered whole. Gathering is collective: every rank must enter. Elsewhere the model is
    yielded as is.
    """
    if trainer is not None:
        from ..compat.model import unwrap_model_for_generation

        if gather is None:
            gather = getattr(trainer.args, "ds3_gather_for_generation", True)
        with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator, gather) as unwrapped:
            yield unwrapped
        return
    partitioned = [p for p in model.parameters() if hasattr(p, "ds_id")]
    if not partitioned:
        yield model
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned):
        yield model


def gather_rows(accelerator: Any, rows: torch.Tensor) -> torch.Tensor:
    """(B, T) rows of every process, padded to the widest, stacked in process order (collective)."""
    return accelerator.gather(accelerator.pad_across_processes(rows, dim=1))
