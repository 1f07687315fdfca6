"""Counting a training step's memory per device without running it: fake tensors on a fake accelerator.

The big tensors of a count are FakeTensors (`torch._subclasses.fake_tensor`): shape, dtype and device, no data, so a
7B model's training pass at 30K tokens runs in seconds on a CPU, operator by operator through TRL's, transformers'
and grpo_plus's own code. `MemoryCounter` (a `TorchDispatchMode`) sees every operator and adds up the storages each
one allocates, per device, from their creation until a weakref finalizer sees them freed: `peak` is the most bytes
alive at once on the accelerator, `host_peak` on the CPU (what activation offloading moves there).

The accelerator is CUDA where this torch has it, else a stand-in registered from Python, `fakegpu`
(`grpo_plus.compat.torch`, with the other private torch APIs a count stands on).

What a fake count does not see, by construction: the GPU allocator's block rounding and fragmentation, the CUDA
context, cuBLAS / attention workspaces, and kernels that allocate differently from their meta functions. Where a
kernel is chosen at run time the count makes CUDA's choice: scaled-dot-product attention as torch picks it on an H100
(`grpo_plus.fit.attention`); TRL's fused LM head folds each logits tile in a Triton kernel that allocates nothing.

Values: an operator on fake tensors has none. The small tensors a training pass reads (token ids, masks, advantages,
index lists) carry a real CPU "shadow" that every small operator also computes, so data-dependent code (which rows
are alive, where a prompt ends, `.item()`) takes the branch it takes on real data. A value read from a big tensor
(a metric of the log-probs) reads 0.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator

import torch

from ..compat import lm_head as trl_lm_head
from ..compat.torch import (
    FUSED_BACKWARD_OPS,
    SHAPE_NEEDS_VALUES,
    FakeTensor,
    FakeTensorMode,
    TorchDispatchMode,
    fake_from_meta,
    is_fake,
    no_dispatch_modes,
    storage_identity,
    tree_leaves,
    tree_map,
    written_arguments,
)

# Operators on at most this many elements are also computed on their shadows (real CPU values).
SHADOW_LIMIT = 2**22


# ---- counting -------------------------------------------------------------------------------------------------------


def _storage(tensor: torch.Tensor):
    """(identity, bytes, storage) of a tensor's storage, or None for tensors without one."""
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return storage_identity(storage), storage.nbytes(), storage


def _on_host(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu"


class MemoryCounter(TorchDispatchMode):
    """Bytes of the storages operators allocate while active, live now and the most ever live at once, on the
    accelerator (`live`, `peak`) and on the host (`host_live`, `host_peak`). Storages that existed before counting
    began (weights, inputs) are not counted.

    With a `fake_mode`, operators over fake tensors, and factory operators aimed at a non-CPU device, run fake; small
    operators also run on their inputs' shadows (module docstring). Without one it counts real compute, on whatever
    device it runs, as the accelerator's (`live`, `peak`).
    """

    def __init__(self, fake_mode: FakeTensorMode | None = None):
        super().__init__()
        self.fake_mode = fake_mode
        self.live = self.peak = 0
        self.host_live = self.host_peak = 0
        self.sizes: dict[int, tuple[int, bool]] = {}  # storage identity -> (bytes, on host)
        self.items_faked = 0  # values read from tensors without a shadow
        self.on_release: list = []  # callbacks taking the identity of a storage that was freed
        self.all_fake = False
        self.describe: dict[int, str] | None = None  # storage identity -> what made it (set to a dict to record)
        self.at_peak: list[tuple[int, str]] = []  # (bytes, what made it) of what was alive at the peak, if recorded

    # -- bookkeeping --

    def _release(self, key: int, nbytes: int, host: bool) -> None:
        if self.describe is not None:
            self.describe.pop(key, None)
        if host:
            self.host_live -= nbytes
        else:
            self.live -= nbytes
        self.sizes.pop(key, None)
        for callback in self.on_release:
            callback(key)

    def _record(self, outputs, inputs, func=None) -> None:
        input_keys = {key[0] for key in map(_storage, inputs) if key is not None}
        for tensor in tree_leaves(outputs):
            if not isinstance(tensor, torch.Tensor):
                continue
            key = _storage(tensor)
            if key is None or key[0] in input_keys or key[0] in self.sizes:
                continue  # a view, an in-place result, or a storage that existed before counting began
            identity, nbytes, storage = key
            host = _on_host(tensor) and self.fake_mode is not None  # counting real compute: the CPU is the device
            self.sizes[identity] = (nbytes, host)
            if host:
                self.host_live += nbytes
                self.host_peak = max(self.host_peak, self.host_live)
            else:
                self.live += nbytes
                if self.describe is not None:
                    self.describe[identity] = f"{func} {tuple(tensor.shape)} {tensor.dtype}"
                if self.live > self.peak and self.describe is not None:
                    self.at_peak = sorted(
                        ((self.sizes[key][0], text) for key, text in self.describe.items()), reverse=True
                    )
                self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._release, identity, nbytes, host)

    # -- dispatch --

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if self.fake_mode is None:
            outputs = func(*args, **kwargs)
            self._record(outputs, tensors, func)
            return outputs
        any_fake = any(is_fake(t) for t in tensors)
        if func is torch.ops.aten._local_scalar_dense.default and any_fake:
            return self._item(args[0])
        if func is torch.ops.aten._to_copy.default and any_fake and not self.all_fake and _to_host(kwargs):
            shadow = self._shadow_of(args[0])
            if shadow is not None and args[0].numel() <= SHADOW_LIMIT:
                # A small tensor copied to the host is its real values there: what the code then does with it on the
                # CPU (index lists, masks: grpo_plus's packing) runs as plain CPU operators, not fake ones twice.
                outputs = func(shadow, *args[1:], **kwargs)
                self._record(outputs, tensors, func)
                return outputs
        if func in FUSED_BACKWARD_OPS and any_fake:
            with self.fake_mode:
                outputs = torch.empty_like(args[0])  # the fused kernel's one output (grad_input, grad_output's shape)
        elif any_fake or self.all_fake or _aims_at_accelerator(kwargs) or self._too_large_for_real(func, args, kwargs):
            outputs = self._run_fake(func, args, kwargs, tensors)
        else:
            outputs = func(*args, **kwargs)
        self._record(outputs, tensors, func)
        return outputs

    def _too_large_for_real(self, func, args, kwargs) -> bool:
        """Whether an operator on real CPU inputs would make a tensor too large to compute here (e.g. a dense
        [width x width] mask at 30K tokens): bounded from the inputs' shapes where the operator says how (views,
        elementwise operators, what makes no more than it reads), else its fake outputs are checked first; then it
        runs fake."""
        bound = _output_bound(func, args)
        if bound is not None:
            return bound > SHADOW_LIMIT
        fake_args, fake_kwargs = tree_map(
            lambda v: self.fake_mode.from_tensor(v) if isinstance(v, torch.Tensor) else v, (args, kwargs)
        )
        try:
            with self.fake_mode:
                probe = func(*fake_args, **fake_kwargs)
        except SHAPE_NEEDS_VALUES:
            return False
        except Exception:  # an operator fake tensors cannot run (a real-only Python object): run it for real
            return False
        return any(isinstance(t, torch.Tensor) and t.numel() > SHADOW_LIMIT for t in tree_leaves(probe))

    def _run_fake(self, func, args, kwargs, tensors):
        if all(is_fake(t) for t in tensors):
            fake_args, fake_kwargs = args, kwargs
        else:
            fake_args, fake_kwargs = tree_map(self._to_fake, (args, kwargs))
        try:
            with self.fake_mode:
                outputs = func(*fake_args, **fake_kwargs)
        except SHAPE_NEEDS_VALUES:
            return self._run_data_dependent(func, args, kwargs)
        self._shadow(func, args, kwargs, outputs, tensors)
        return outputs

    def _to_fake(self, value):
        if isinstance(value, torch.Tensor) and not is_fake(value):
            fake = self.fake_mode.from_tensor(value)
            if value.numel() <= SHADOW_LIMIT:
                fake._shadow = value
            return fake
        return value

    # -- shadows: the real values of small tensors --

    @staticmethod
    def _shadow_of(value):
        if isinstance(value, FakeTensor):
            return getattr(value, "_shadow", None)
        return value if isinstance(value, torch.Tensor) else None

    def _shadow_inputs(self, args, kwargs):
        """(args, kwargs) with every tensor replaced by its real value and devices by the CPU, or None when some
        tensor has no shadow or is too large."""
        missing = False

        def real(value):
            nonlocal missing
            if isinstance(value, torch.Tensor):
                shadow = self._shadow_of(value)
                if shadow is None or value.numel() > SHADOW_LIMIT:
                    missing = True
                return shadow
            if isinstance(value, torch.device) and value.type != "cpu":
                return torch.device("cpu")
            return value

        real_args, real_kwargs = tree_map(real, (args, kwargs))
        if real_kwargs.get("device") is not None:
            real_kwargs["device"] = "cpu"
        real_kwargs.pop("pin_memory", None)
        return None if missing else (real_args, real_kwargs)

    def _shadow(self, func, args, kwargs, outputs, tensors) -> None:
        """Compute `func` on the shadows of its inputs and attach the results to the fake outputs."""
        mutated = _mutated_arguments(func, args, kwargs)
        if any(self._shadow_of(t) is None or t.numel() > SHADOW_LIMIT for t in tensors):
            inputs = None  # an activation: no values (the common case, decided without walking the arguments)
        else:
            fake_outputs = [t for t in tree_leaves(outputs) if isinstance(t, FakeTensor)]
            if not fake_outputs and not mutated:
                return
            inputs = None if any(t.numel() > SHADOW_LIMIT for t in fake_outputs) else self._shadow_inputs(args, kwargs)
        if inputs is None:
            for tensor in mutated:  # its values are unknown from now on
                if is_fake(tensor):
                    tensor._shadow = None
            return
        real_outputs = func(*inputs[0], **inputs[1])
        for fake, real in zip(tree_leaves(outputs), tree_leaves(real_outputs), strict=False):
            if isinstance(fake, FakeTensor) and isinstance(real, torch.Tensor):
                fake._shadow = real

    def _run_data_dependent(self, func, args, kwargs):
        """An operator whose output shape depends on values (nonzero, unique, boolean indexing): computed on the
        shadows when there are some, else on zeros of small fake inputs, masks all True (as zeros make them: nothing
        is NaN, every element is selected, the largest selection); its outputs become fake tensors on the device of
        its input."""
        inputs = self._shadow_inputs(args, kwargs)
        if inputs is None:

            def zeros(value):
                if not is_fake(value):
                    return value
                if value.numel() > SHADOW_LIMIT:
                    raise RuntimeError(f"{func} needs the values of a large fake tensor {tuple(value.shape)}")
                self.items_faked += 1
                if value.dtype == torch.bool:  # e.g. TRL's nanmin: x[~isnan(x)] of an x without values
                    return torch.ones(value.shape, dtype=torch.bool)
                return torch.zeros(value.shape, dtype=value.dtype)

            inputs = tree_map(zeros, (args, kwargs))
        real_outputs = func(*inputs[0], **inputs[1])
        device = next((t.device for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)), "cpu")

        def to_fake(value):
            if not isinstance(value, torch.Tensor):
                return value
            with self.fake_mode:
                fake = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=device)
            fake._shadow = value
            return fake

        return tree_map(to_fake, real_outputs)

    def _item(self, tensor):
        shadow = self._shadow_of(tensor)
        if shadow is not None:
            return shadow.item()
        self.items_faked += 1
        return False if tensor.dtype == torch.bool else 0

    @contextlib.contextmanager
    def faking(self) -> Iterator[None]:
        """Inside this block every operator runs fake, also on real inputs and for new CPU tensors."""
        previous, self.all_fake = self.all_fake, self.fake_mode is not None
        try:
            yield
        finally:
            self.all_fake = previous


def _to_host(kwargs) -> bool:
    device = kwargs.get("device")
    return device is not None and torch.device(device).type == "cpu"


# Operators whose outputs hold no more elements than their tensor inputs together (times the index width for nonzero).
_NO_LARGER = {
    getattr(getattr(torch.ops.aten, name), overload)
    for name in ("nonzero", "clone", "_to_copy", "amax", "amin", "any", "all", "sum", "masked_select", "fill_",
                 "copy_", "index_put_", "lift_fresh", "unique_dim", "_unique2", "cumsum", "cat")
    for overload in getattr(torch.ops.aten, name).overloads()
}  # fmt: skip


def _output_bound(func, args) -> int | None:
    """At most how many elements `func` makes from `args` (real CPU tensors), known from their shapes alone; None when
    only running it (fake) would tell."""
    tensors = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor)]
    if not tensors:  # a factory: its size comes from its arguments
        if func.overloadpacket in _SIZED_FACTORIES:
            return math.prod(args[0])
        if func.overloadpacket is torch.ops.aten.arange and all(isinstance(a, int | float) for a in args):
            start, end, step = (0, *args, 1)[-3:] if len(args) < 3 else args
            return max(math.ceil((end - start) / step), 0) if step else None
        return None
    if func is torch.ops.aten._local_scalar_dense.default:
        return 0  # a Python number
    if func.is_view:
        return 0
    if torch.Tag.pointwise in func.tags:
        shape = torch.broadcast_shapes(*(t.shape for t in tensors))
        return int(torch.Size(shape).numel())
    if func in _NO_LARGER:
        return sum(t.numel() for t in tensors) * max(max((t.dim() for t in tensors), default=1), 1)
    if func is torch.ops.aten.index.Tensor:
        return _index_bound(*args[:2])
    return None


# Factories whose first argument is the output's shape.
_SIZED_FACTORIES = {torch.ops.aten.full, torch.ops.aten.ones, torch.ops.aten.zeros, torch.ops.aten.empty}


def _index_bound(source: torch.Tensor, indices: list) -> int:
    """At most how many elements `source[indices]` (advanced indexing) makes: the integer indices broadcast
    together, times each boolean mask's size (its true elements, at most), times the dimensions not indexed."""
    dim, rest, masks, shapes = 0, 1, 1, []
    for index in indices:
        if index is None:  # a whole dimension
            rest *= source.shape[dim]
            dim += 1
        elif index.dtype in (torch.bool, torch.uint8):
            masks *= index.numel()
            dim += index.dim()
        else:
            shapes.append(index.shape)
            dim += 1
    rest *= math.prod(source.shape[dim:])
    return int(torch.Size(torch.broadcast_shapes(*shapes)).numel()) * masks * rest


def _aims_at_accelerator(kwargs) -> bool:
    device = kwargs.get("device")
    return device is not None and torch.device(device).type != "cpu"


_WRITTEN: dict = {}  # operator -> (index, name) of the arguments it writes


def _mutated_arguments(func, args, kwargs) -> list[torch.Tensor]:
    if func not in _WRITTEN:
        _WRITTEN[func] = written_arguments(func)
    mutated = []
    for index, name in _WRITTEN[func]:
        value = args[index] if index < len(args) else kwargs.get(name)
        mutated.extend(t for t in tree_leaves(value) if isinstance(t, torch.Tensor))
    return mutated


class SavedBytes:
    """`saved_tensors_hooks` adding up the distinct storages autograd saves that the counter saw allocated, as long as
    they live (a branch of the graph dropped before backward frees what it saved). Accelerator storages only."""

    def __init__(self, counter: MemoryCounter):
        self.counter, self.sizes, self.bytes = counter, {}, 0
        counter.on_release.append(self._released)

    def pack(self, tensor):
        key = _storage(tensor)
        if key is not None and key[0] in self.counter.sizes and key[0] not in self.sizes:
            nbytes, host = self.counter.sizes[key[0]]
            if not host:
                self.sizes[key[0]] = nbytes
                self.bytes += nbytes
        return tensor

    @staticmethod
    def unpack(tensor):
        return tensor

    def _released(self, key: int) -> None:
        self.bytes -= self.sizes.pop(key, 0)


# ---- patches that make a count see what a GPU run does ----------------------------------------------------------------


def _distinct_steps(*args) -> range | list[int]:
    """`range(*args)`, of which only the first two steps and the last when it has more than three: the steps a tile
    loop's memory can tell apart (the first tile, a tile after a full one, the last, possibly partial, tile)."""
    steps = range(*args)
    return steps if len(steps) <= 3 else [steps[0], steps[1], steps[-1]]


@contextlib.contextmanager
def distinct_tiles(module, enabled: bool = True) -> Iterator[None]:
    """Within the block, the tile loops of `module` (`for start in range(0, n, tile)`) run their distinct tiles only.

    In a fake count a tile's operators allocate the same bytes as every other full tile's and free them before the
    next tile but one (what a tile makes is dropped when the next tile rebinds its names), and the work the skipped
    tiles do is their values, which a fake count has none of: the peak over the first two tiles and the last is the
    peak over all of them, at a fraction of the operators (TRL's chunked LM head: tokens / 4096 x vocabulary / chunk
    tiles, forward and backward). Only for fake counts: real compute needs every tile's values."""
    if not enabled:
        yield
        return
    module.range = _distinct_steps  # shadows the builtin for the module's own loops
    try:
        yield
    finally:
        del module.range


def _kept_mlp_tiles(count: int) -> set[int]:
    """The tiles of a tiled MLP that a fake count runs (`distinct_mlp_tiles`): the first two and the last two."""
    return {0, 1, count - 2, count - 1}


@contextlib.contextmanager
def distinct_mlp_tiles(enabled: bool = True) -> Iterator[None]:
    """Within the block, grpo_plus's tiled MLP (`grpo_plus.long_completions.tiled_mlp`) computes four of its tiles, forward and backward:
    the first two and the last two. A tile writes its output (forward) and its input's gradient (backward) into a
    buffer allocated once and adds its weights' gradient into the first tile's: what a full tile allocates it frees
    before the next, the same bytes for every full tile, so the peak is met at the first two tiles (the first allocates
    the buffers) or the last two (the last may be partial). At 270K positions (G = 426 on the 1.5B recipe) that is 4
    tiles of 66. Only for fake counts: real compute needs every tile's values."""
    if not enabled:
        yield
        return
    from ..long_completions import tiled_mlp

    original = tiled_mlp.tile_indices
    tiled_mlp.tile_indices = lambda count: sorted(_kept_mlp_tiles(count) & set(range(count)))
    try:
        yield
    finally:
        tiled_mlp.tile_indices = original


@contextlib.contextmanager
def fused_lm_head_counting(counter: MemoryCounter, lm_head: str = "cuda") -> Iterator[None]:
    """TRL's chunked log-prob function (TRL >= 1.15) with its [4096 x chunk] tile buffers fake, and, `lm_head="cuda"`,
    its fold replaced by nothing: on a GPU the fold is a Triton kernel, which allocates nothing (the torch fallback
    allocates fp32 temporaries of the tile; `lm_head="cpu"` counts those). `trl_lm_head.lm_head_folds_in_torch` answers
    for the device counted, so grpo_plus's tile width (`lm_head_tile_columns`) is the one that device would get."""

    def counted_step(kernel) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(counter.faking())
        stack.enter_context(distinct_tiles(kernel, counter.fake_mode is not None))
        return stack

    def allocates_nothing(*args, **kwargs):
        return None

    with trl_lm_head.lm_head_kernel_patched(counted_step, allocates_nothing if lm_head == "cuda" else None) as patched:
        if not patched:  # TRL 1.14: no fused LM head
            yield
            return
        # The tile width grpo_plus.long_completions.lm_head_tiles picks depends on who folds the tiles: the device
        # counted, not the stand-in.
        folds_in_torch = trl_lm_head.lm_head_folds_in_torch
        trl_lm_head.lm_head_folds_in_torch = lambda device: lm_head == "cpu"
        try:
            yield
        finally:
            trl_lm_head.lm_head_folds_in_torch = folds_in_torch


@contextlib.contextmanager
def storage_addresses() -> Iterator[None]:
    """Fake storages have no address (`data_ptr()` is 0 for all of them); code that tells storages apart by address
    (TRL's activation offloading deduplicates saved tensors and skips parameters that way) gets each fake storage's
    identity instead; `Tensor.record_stream` on a fake tensor does nothing (there is no allocator to tell)."""
    original, original_record_stream = torch.UntypedStorage.data_ptr, torch.Tensor.record_stream

    def data_ptr(self):
        return storage_identity(self) if self.device.type == "meta" else original(self)

    def record_stream(self, stream):  # the stand-in's streams order nothing: nothing to record
        if not is_fake(self):
            return original_record_stream(self, stream)
        return None

    torch.UntypedStorage.data_ptr, torch.Tensor.record_stream = data_ptr, record_stream
    try:
        yield
    finally:
        torch.UntypedStorage.data_ptr, torch.Tensor.record_stream = original, original_record_stream


def _counted_on_device(counter: MemoryCounter, real: torch.Tensor, device) -> torch.Tensor:
    """A fake tensor on `device` with `real`'s values as its shadow, counted as an allocation there."""
    with counter.fake_mode:
        fake = torch.empty_strided(real.shape, real.stride(), dtype=real.dtype, device=device)
    fake._shadow = real
    counter._record(fake, [], torch.tensor)
    return fake


def on_values(counter: MemoryCounter, function):
    """`function` that, called on fake tensors that all have their values (shadows), runs on those values as plain CPU
    code and returns its tensors as fake ones on the fake tensors' device, counted there; else as it is.

    For index arithmetic that loops in Python over rows and reads values one by one (Qwen-VL's `get_rope_index`: a
    `tolist` and a dozen small operators per row, 24 of the 36 s of a count at G = 128 on the VLM recipe): on values it
    is plain torch. What the count then does not see are its small per-row temporaries (index lists of one row, freed
    before the forward that follows); its outputs it does see."""

    def run(*args, **kwargs):
        tensors = [value for value in tree_leaves((args, kwargs)) if isinstance(value, torch.Tensor)]
        fakes = [value for value in tensors if is_fake(value)]
        if counter.fake_mode is None or not fakes or any(counter._shadow_of(value) is None for value in tensors):
            return function(*args, **kwargs)
        device = fakes[0].device
        real_args, real_kwargs = tree_map(
            lambda value: counter._shadow_of(value) if isinstance(value, torch.Tensor) else value, (args, kwargs)
        )
        with no_dispatch_modes():
            outputs = function(*real_args, **real_kwargs)
        return tree_map(
            lambda value: _counted_on_device(counter, value, device) if isinstance(value, torch.Tensor) else value,
            outputs,
        )

    return run


@contextlib.contextmanager
def tensors_from_data(counter: MemoryCounter) -> Iterator[None]:
    """`torch.tensor(data, device=accelerator)` and `accelerator_tensor.new_tensor(data)` build their tensor outside
    torch's dispatch (on the CPU, then copied), which a fake accelerator cannot take: within this block it becomes a
    fake tensor on that device with the data as its shadow (transformers' KV cache starts from
    `torch.tensor([], device=...)`; grpo_plus's adaptive KL coefficient appends a count with `new_tensor`)."""
    original, original_new_tensor = torch.tensor, torch.Tensor.new_tensor

    def values(data):
        """Fake scalars in `data` (a list of 0-dim tensors, e.g. Qwen-VL's M-RoPE offsets) as their values."""
        return tree_map(lambda value: counter._item(value) if is_fake(value) else value, data)

    def tensor(data, *args, device=None, **kwargs):
        if device is None or torch.device(device).type == "cpu" or counter.fake_mode is None:
            return original(data, *args, device=device, **kwargs)
        return _counted_on_device(counter, original(values(data), *args, **kwargs), device)

    def new_tensor(self, data, *args, dtype=None, device=None, **kwargs):
        device = self.device if device is None else torch.device(device)
        if device.type == "cpu" or counter.fake_mode is None or not is_fake(self):
            return original_new_tensor(self, data, *args, dtype=dtype, device=device, **kwargs)
        real = original(data, dtype=self.dtype if dtype is None else dtype, **kwargs)
        return _counted_on_device(counter, real, device)

    torch.tensor, torch.Tensor.new_tensor = tensor, new_tensor
    try:
        yield
    finally:
        torch.tensor, torch.Tensor.new_tensor = original, original_new_tensor


@contextlib.contextmanager
def readable_values() -> Iterator[None]:
    """transformers treats every FakeTensor as traced (torch.compile / export) and then never reads its values, e.g.
    never skips an all-ones attention mask. A fake tensor with a shadow has values: it is read like a real one."""
    import transformers.masking_utils as masking_utils
    import transformers.modeling_utils as modeling_utils

    original = getattr(masking_utils, "is_tracing", None)
    if original is None:  # transformers 4.56 has no is_tracing: only jit / fx / dynamo count as tracing there
        yield
        return

    def is_tracing(tensor=None) -> bool:
        if tensor is not None and getattr(tensor, "_shadow", None) is not None:
            return original(None)
        return original(tensor)

    modules = [module for module in (masking_utils, modeling_utils) if getattr(module, "is_tracing", None) is original]
    for module in modules:
        module.is_tracing = is_tracing
    try:
        yield
    finally:
        for module in modules:
            module.is_tracing = original


@contextlib.contextmanager
def accelerator_autocast(trainer, device_type: str, mixed: str) -> Iterator[None]:
    """The trainer's `accelerator.autocast()` (TRL's forward enters it) on `device_type`, in `mixed` precision ("bf16",
    "fp16" or "no"; accelerate's state is one per process, shared by every trainer in it, so it is not read here)."""
    accelerator = trainer.accelerator
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed)
    original = accelerator.autocast

    def autocast(*args, **kwargs):
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=dtype)

    accelerator.autocast = autocast
    try:
        yield
    finally:
        accelerator.autocast = original


# ---- fake models and inputs ----------------------------------------------------------------------------------------


def fake_parameters(model: torch.nn.Module, fake_mode: FakeTensorMode, device: str) -> torch.nn.Module:
    """Replace every parameter and buffer (built on `meta`) by a fake tensor on `device` (tied weights stay tied)."""
    converted: dict[int, torch.Tensor] = {}
    target = torch.device(device)

    def fake(tensor):
        return fake_from_meta(fake_mode, tensor, target)

    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                if id(param) not in converted:
                    converted[id(param)] = torch.nn.Parameter(fake(param.detach()), requires_grad=param.requires_grad)
                module._parameters[name] = converted[id(param)]
        for name, buffer in list(module._buffers.items()):
            if buffer is not None:
                if id(buffer) not in converted:
                    value = fake(buffer)
                    if buffer.device.type != "meta" and buffer.numel() <= SHADOW_LIMIT:
                        value._shadow = buffer.detach().cpu()
                    converted[id(buffer)] = value
                module._buffers[name] = converted[id(buffer)]
    return model


def fake_inputs(inputs: dict, fake_mode: FakeTensorMode, device: str) -> dict:
    """A micro-batch's tensors as fake tensors on `device`, each with its real values as shadow."""

    def convert(value):
        if not isinstance(value, torch.Tensor):
            return value
        # A broadcast value (stride 0, e.g. pixels that read zeros) stands for a tensor of its shape on the device.
        stride = value.stride() if 0 not in value.stride() else torch.empty(value.shape, device="meta").stride()
        with fake_mode:
            fake = torch.empty_strided(value.shape, stride, dtype=value.dtype, device=device)
        fake._shadow = value
        return fake

    return {name: convert(value) for name, value in inputs.items()}
