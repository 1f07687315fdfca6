"""torch's private APIs the fit count stands on (grpo_plus.fit), tested with torch 2.13: fake tensors, the dispatcher's
modes and keys, operator schemas, storages' identities, and a stand-in accelerator registered from Python.

None of these is public: torch may move or change any of them in a release, so a count that breaks on a new torch
breaks here, one small function or constant per fact.

The stand-in accelerator. A CPU-only torch cannot run autograd on fake `cuda` tensors (every autograd node records the
CUDA stream of its inputs, and a CPU build has no CUDA device guard: the process aborts), so there a count runs on
`fakegpu`: torch's PrivateUse1 backend registered from Python, with CUDA's autocast policy for the operators that
allocate the big tensors (matrix products in the autocast dtype), and no-op streams and events, so TRL's activation
offloading runs its own code with its streams. A CPU tensor mixed into an operation on `fakegpu` fails as it would on a
GPU (`FakeTensorDeviceMismatchError`).
"""

from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map

__all__ = [
    "FAKE_ACCELERATOR",
    "FUSED_BACKWARD_OPS",
    "LOWER_PRECISION_OPS",
    "SHAPE_NEEDS_VALUES",
    "FakeTensor",
    "FakeTensorMode",
    "TorchDispatchMode",
    "fake_accelerator",
    "fake_from_meta",
    "is_fake",
    "new_fake_mode",
    "no_dispatch_modes",
    "storage_identity",
    "tree_leaves",
    "tree_map",
    "written_arguments",
]


# ---- fake tensors and the dispatcher (torch._subclasses.fake_tensor, torch.utils._python_dispatch, _pytree) ----------

# What a fake operator raises when its output's shape depends on its inputs' values (nonzero, unique, boolean
# indexing) or when it reads a value (`.item()`): torch._subclasses.fake_tensor's exceptions in torch 2.13.
SHAPE_NEEDS_VALUES = (DynamicOutputShapeException, DataDependentOutputException)


def new_fake_mode() -> FakeTensorMode:
    """A FakeTensorMode for a count: real CPU inputs allowed (converted to fake tensors as they come)."""
    return FakeTensorMode(allow_non_fake_inputs=True)


def is_fake(value) -> bool:
    return isinstance(value, FakeTensor)


def fake_from_meta(fake_mode: FakeTensorMode, tensor: torch.Tensor, device: torch.device) -> FakeTensor:
    """A fake tensor of `tensor`'s shape, strides and dtype on `device` (`fake_tensor_converter.from_meta_and_device`:
    what a meta model's parameter becomes on the counted device, without a copy of any data)."""
    return fake_mode.fake_tensor_converter.from_meta_and_device(fake_mode, tensor.to("meta"), device)


def no_dispatch_modes() -> contextlib.AbstractContextManager:
    """Within the block no dispatch mode (fake, counting) is active: operators run on real CPU tensors as plain torch
    (`torch.utils._python_dispatch._disable_current_modes`)."""
    return _disable_current_modes()


def written_arguments(func) -> list[tuple[int, str]]:
    """(position, name) of the arguments operator `func` writes (mutates in place), from its schema's alias
    annotations (`OpOverload._schema`; `Tensor(a!)`)."""
    schema = getattr(func, "_schema", None)
    arguments = schema.arguments if schema is not None else []
    return [
        (index, argument.name) for index, argument in enumerate(arguments)
        if argument.alias_info is not None and argument.alias_info.is_write
    ]  # fmt: skip


def storage_identity(storage: torch.UntypedStorage) -> int:
    """What tells storages apart, fake ones included (a fake storage's `data_ptr()` is 0): the address of its C++
    object (`UntypedStorage._cdata`), the same for every tensor that views it."""
    return storage._cdata


# ---- the stand-in accelerator (torch.utils.backend_registration, PrivateUse1 dispatch keys) --------------------------

FAKE_ACCELERATOR = "fakegpu"
# CUDA autocast's lower-precision operators (aten/src/ATen/autocast_mode.cpp, `KERNEL_CUDA(..., lower_precision_fp)`)
# that a decoder's training pass runs: the ones that make big tensors. The stand-in accelerator casts their floating
# inputs to the autocast dtype; every other operator runs as is (CUDA's fp32 list only touches small tensors here:
# norms already compute in fp32, losses are [rows, tokens]).
LOWER_PRECISION_OPS = ("mm", "matmul", "linear", "addmm", "addmv", "addbmm", "baddbmm", "bmm", "mv", "einsum")
# Pointwise backward operators that CPUs and CUDA run as one fused kernel (one output the size of the input), which
# autograd on a backend without a kernel of its own, and a fake run, decompose into every temporary (silu_backward:
# sigmoid, 1 - sigmoid, three products, ~5 tensors the size of the MLP's intermediate, the largest of a long-sequence
# backward). The stand-in passes them past autograd as themselves; the counter makes their one output.
FUSED_BACKWARD_OPS = {
    torch.ops.aten.silu_backward.default, torch.ops.aten.gelu_backward.default, torch.ops.aten.threshold_backward.default,
}  # fmt: skip


class _Event:
    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _Stream:
    """A stream that orders nothing (a fake run computes nothing)."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None) -> _Event:
        return event or _Event()

    def synchronize(self) -> None:
        pass


class _StandInModule:
    """`torch.fakegpu`: what torch, accelerate and TRL's offloading ask of an accelerator module."""

    Stream = _Stream
    Event = _Event

    def __init__(self):
        self._stream = _Stream()

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def _is_in_bad_fork(self) -> bool:
        return False

    def manual_seed_all(self, seed: int) -> None:
        pass

    def get_amp_supported_dtype(self) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16]

    def current_stream(self, device=None) -> _Stream:
        return self._stream

    def stream(self, stream) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def synchronize(self, device=None) -> None:
        pass

    def empty_cache(self) -> None:
        pass


_registered_libraries: list = []  # torch.library registrations live as long as these objects


def _register_stand_in() -> None:
    """PrivateUse1 renamed `fakegpu` with `_StandInModule` as `torch.fakegpu`
    (`_setup_privateuseone_for_python_backend`), its autocast key falling through to the kernels but for
    LOWER_PRECISION_OPS, cast first, and FUSED_BACKWARD_OPS past its autograd key as themselves."""
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend(rename=FAKE_ACCELERATOR, backend_module=_StandInModule())
    fallthrough = torch.library.Library("_", "IMPL")
    fallthrough.fallback(torch.library.fallthrough_kernel, dispatch_key="AutocastPrivateUse1")
    lower = torch.library.Library("aten", "IMPL")
    key = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)

    def cast(value, dtype):
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.device.type == FAKE_ACCELERATOR:
            return value if value.dtype in (dtype, torch.float64) else value.to(dtype)
        if isinstance(value, (list, tuple)):
            return type(value)(cast(item, dtype) for item in value)
        return value

    def lower_precision(op):
        def kernel(*args, **kwargs):
            dtype = torch.get_autocast_dtype(FAKE_ACCELERATOR)
            with torch._C._ExcludeDispatchKeyGuard(key):
                return op(*cast(args, dtype), **{name: cast(value, dtype) for name, value in kwargs.items()})

        return kernel

    for name in LOWER_PRECISION_OPS:
        packet = getattr(torch.ops.aten, name)
        for overload in packet.overloads():
            lower.impl(f"{name}.{overload}" if overload != "default" else name, lower_precision(getattr(packet, overload)),
                       "AutocastPrivateUse1")  # fmt: skip
    # The fused backward operators past autograd as themselves: for a backend without a kernel of its own, autograd
    # runs their composite decomposition before the counter (at the Python key) would see them.
    fused = torch.library.Library("aten", "IMPL")
    autograd_keys = torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradPrivateUse1)

    def as_itself(op):
        def kernel(*args, **kwargs):
            with torch._C._ExcludeDispatchKeyGuard(autograd_keys):
                return op(*args, **kwargs)

        return kernel

    for op in FUSED_BACKWARD_OPS:
        fused.impl(op.name().split("::")[1], as_itself(op), "AutogradPrivateUse1")
    _registered_libraries.extend([fallthrough, lower, fused])


def fake_accelerator() -> str:
    """The device type a count runs on: `cuda` where torch has CUDA, else the stand-in `fakegpu` (registered on first
    use). Raises RuntimeError where neither can be had (another PrivateUse1 backend, e.g. an NPU, is registered)."""
    if torch.cuda.is_available():
        return "cuda"
    name = torch._C._get_privateuse1_backend_name()
    if name == FAKE_ACCELERATOR:
        return name
    if name != "privateuseone":
        raise RuntimeError(f"cannot count on a fake accelerator: PrivateUse1 is already the {name!r} backend")
    _register_stand_in()
    return FAKE_ACCELERATOR
