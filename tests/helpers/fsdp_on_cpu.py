"""accelerate's FSDP on CPU processes over gloo, for the tests only (tests/test_fsdp.py).

Used by tests/scripts/train_tiny.py (`--force_fsdp_on_cpu`) and tests/scripts/under_fsdp_on_cpu.py (any script, e.g.
a recipe). Nothing in grpo_plus does this: a user's CPU launch keeps accelerate's behaviour (and grpo_plus's warning
that FSDP was dropped).
"""

from __future__ import annotations


def force_fsdp_on_cpu() -> None:
    """Make accelerate run FSDP on CPU processes (gloo): TEST HARNESS ONLY, nothing in grpo_plus does this.

    accelerate runs FSDP on GPUs only: `accelerate launch --cpu --use_fsdp` is refused, without `use_cpu` every CPU
    process trains alone, and with it (`Accelerator(cpu=True, fsdp_plugin=...)`, the Trainer's `use_cpu`) accelerate
    drops the plugin and runs plain DDP (its state keeps `MULTI_CPU`). PyTorch's FSDP2 (`fully_shard`) itself runs
    over gloo, so the tests set accelerate's state to FSDP right after accelerate built it as multi-CPU: both
    `AcceleratorState` and `PartialState` (the former alone is reverted by the next `AcceleratorState()`, which
    copies `PartialState`'s fields), with the plugin the config asked for. From there accelerate's own FSDP2 path
    (`fsdp2_prepare_model`: `fully_shard` per decoder layer and on the root, DTensor parameters) runs unchanged.
    """
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    init = AcceleratorState.__init__

    def init_keeping_fsdp(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.fsdp_plugin = fsdp_plugin
            self.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    AcceleratorState.__init__ = init_keeping_fsdp
