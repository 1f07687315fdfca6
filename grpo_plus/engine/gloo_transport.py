"""Weight transfer into a vLLM server over a private gloo group: the transport of `grpo-plus vllm-serve` where CUDA
is not (vLLM's CPU build), both ends of it.

vLLM's five weight-transfer backends (0.31: nccl, ipc, sparse_nccl, sharded_rdt, nccl_m2n) all need CUDA, but its
weight-transfer engine is pluggable (`WeightTransferEngineFactory.register_engine`) and the server's
`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`, `/finish_weight_update` endpoints call
whatever engine the server was started with (`--weight-transfer-config '{"backend": "gloo"}'`). Here:

- the server's side, `GlooWeightTransferEngine` (`gloo_engine_class()`): vLLM's NCCL engine (its init/update infos, the names, dtypes and
  shapes of each update) with the group made by `stateless_init_torch_distributed_process_group(backend="gloo")`, the
  tensors received one by one by gloo's broadcast, loaded through grpo_plus's layerwise reload (`reload.model_reload`:
  the same mending as the colocated engine: a tied LM head processed again, a partly loaded layer refused), and
  what the reload took sent back to the trainer at `/finish_weight_update` (so the trainer can check the sync);
- the trainer's side: `open_trainer_group`, `send_weights`, `receive_report` (used by `server.ServerClient`).

gloo's broadcast copies float32 and bfloat16 tensors bit for bit. vLLM's own `update_weights` ends with
`torch.accelerator.synchronize()`, which raises on a CPU; gloo's broadcast has finished when it returns, so the
override here does not call it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from .reload import ReloadReport, model_reload

logger = logging.getLogger(__name__)

BACKEND = "gloo"
# What the server sends back after each update: loaded elements, layers loaded, layers left unloaded, tied layers
# processed again, whether the reload finished (1) or raised (0).
_REPORT_FIELDS = 5


def register_gloo_engine() -> None:
    """Register `GlooWeightTransferEngine` under "gloo" in vLLM's factory (idempotent: a second call does nothing).

    Called in the server's process before vLLM starts; its engine-core and worker processes fork from it and inherit
    the registry (vLLM's default `VLLM_WORKER_MULTIPROC_METHOD=fork`)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, gloo_engine_class())


def gloo_engine_class() -> type:
    """`GlooWeightTransferEngine`, built on first use (this module imports without vLLM)."""
    global _ENGINE_CLASS
    if _ENGINE_CLASS is None:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        _ENGINE_CLASS = type("GlooWeightTransferEngine", (_GlooEngineMethods, NCCLWeightTransferEngine), {})
    return _ENGINE_CLASS


_ENGINE_CLASS: type | None = None


class _GlooEngineMethods:
    """What `GlooWeightTransferEngine` (vLLM's NCCL weight-transfer engine over a gloo group) changes of vLLM's
    `NCCLWeightTransferEngine` (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._reload = None
        self._report: ReloadReport | None = None

    def init_transfer_engine(self, init_info) -> None:
        """Join the trainer's gloo group: rank = this worker's rank across data-parallel groups + `rank_offset` (as
        vLLM's `worker_init_process_group` numbers NCCL ranks)."""
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        parallel = self.parallel_config
        rank = parallel.data_parallel_index * parallel.world_size + parallel.rank + init_info.rank_offset
        self.model_update_group = stateless_init_torch_distributed_process_group(
            init_info.master_address, init_info.master_port, rank, init_info.world_size, backend=BACKEND
        )

    def start_weight_update(self) -> None:
        """Begin the layerwise reload (`reload.model_reload`) the update's tensors load into."""
        self._report = ReloadReport()
        self._reload = model_reload(self.model, self.model_config, self._report)
        self._reload.__enter__()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """vLLM's `update_weights` without its `torch.accelerator.synchronize()` (it raises on a CPU; gloo's
        broadcast is complete when it returns)."""
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info) -> None:
        """Each announced tensor, broadcast by the trainer (rank 0), loaded into the model."""
        for name, dtype_name, shape in zip(
            update_info.names, update_info.dtype_names, update_info.shapes, strict=True
        ):
            weight = torch.empty(shape, dtype=getattr(torch, dtype_name))
            self.model_update_group.broadcast(weight, root=0).wait()
            self.model.load_weights([(name, weight)])

    def finish_weight_update(self) -> None:
        """Finish the reload (vLLM's processing of what is left; a tied LM head processed again) and send the trainer
        what it took, also when the reload raised (the trainer waits for it)."""
        reload, self._reload = self._reload, None
        report = self._report
        finished = 0
        try:
            reload.__exit__(None, None, None)
            finished = 1
        finally:
            if self.model_update_group is not None:
                sent = torch.tensor(
                    [report.loaded_elements, len(report.loaded_layers), len(report.unloaded_layers),
                     len(report.tied_layers), finished], dtype=torch.int64,
                )  # fmt: skip
                self.model_update_group.broadcast(sent, root=1).wait()
            if report.unloaded_layers:
                logger.info("weight update: %d layers received nothing", len(report.unloaded_layers))

    def shutdown(self) -> None:
        self.model_update_group = None


# ---- the trainer's side ---------------------------------------------------------------------------------------------


def open_trainer_group(host: str, port: int, world_size: int):
    """The trainer's end (rank 0) of the gloo group the server's workers join at `/init_weight_transfer_engine`.

    Rank 0 holds the group's store, made here on a socket bound to `port`: torch's rendezvous would not make it in a
    process launched by torchrun / `accelerate launch`, whose environment (TORCHELASTIC_USE_AGENT_STORE) makes it
    connect to the launcher's store instead, and wait there forever."""
    import socket

    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    listen = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listen.bind(("", port))
    listen.listen()
    return stateless_init_torch_distributed_process_group(
        host, port, 0, world_size, backend=BACKEND, listen_socket=listen
    )


def send_weights(group, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[str], int]:
    """Broadcast each tensor from rank 0, in order (the server announced their names, dtypes, shapes); returns the
    names sent and their elements."""
    names, elements = [], 0
    for name, tensor in _contiguous(named_tensors):
        group.broadcast(tensor, root=0).wait()
        names.append(name)
        elements += tensor.numel()
    return names, elements


def _contiguous(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in named_tensors:
        yield name, tensor.detach().to("cpu").contiguous()


def receive_report(group) -> tuple[ReloadReport, bool]:
    """What the server's reload took at the end of an update (`GlooWeightTransferEngine.finish_weight_update`), and
    whether it finished: a report holding counts (the layer lists hold placeholders, one per layer)."""
    received = torch.zeros(_REPORT_FIELDS, dtype=torch.int64)
    group.broadcast(received, root=1).wait()
    elements, loaded, unloaded, tied, finished = received.tolist()
    report = ReloadReport(
        loaded_layers=[f"<layer {i}>" for i in range(loaded)],
        loaded_elements=elements,
        unloaded_layers=[f"<layer {i}>" for i in range(unloaded)],
        tied_layers=[f"<tied {i}>" for i in range(tied)],
    )
    return report, bool(finished)
