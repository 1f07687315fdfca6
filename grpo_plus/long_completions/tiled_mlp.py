"""Tiled MLP: each decoder layer's MLP computed, and its backward recomputed, a few thousand token positions at a time.

At long sequences the largest tensors of a training step are one layer's MLP intermediates ([tokens, intermediate
size], ~6x the hidden size): the backward of a checkpointed layer holds several of them at once (the gate and up
projections, the activation, their product, its gradients). A dense MLP works on each position alone, so it can run on
slices of the positions (Arctic Long Sequence Training's TiledMLP; Unsloth's tiled MLP): an autograd function
(`_TiledMLPFunction`) runs the slices without grad in forward and saves only the MLP's input; its backward recomputes
one slice at a time with grad, writes the slice's input gradient and adds its weights' gradient, so at most one
slice's intermediates are alive.

Exact: every position goes through the same operators with the same weights; the only difference is how the matrix
products are blocked (a LoRA weight's gradient sums the slices' contributions in slice order), which moves float32
results by rounding (tests/test_long_completions.py measures it against stock TRL). It costs no extra MLP forward
under gradient checkpointing: the layer's recompute in backward only needs the MLP's input (the function's backward
recomputes the slices anyway), so where nothing the layer saves is computed from the MLP's output (the output only
goes through a residual addition: Llama, Qwen, Mistral; checked on the autograd graph of the first tiled forward,
`output_only_added`) the recompute leaves the output unwritten. Where a layer normalizes the MLP's output (Gemma 2 and
3) the recompute runs the slices: one more MLP forward per step, as nested `torch.utils.checkpoint`s cost. Without
gradient checkpointing it costs one more MLP forward per step (the slices' recompute). Parameters still sharded when
the MLP is called (FSDP2 DTensors) get their gradients through the engine's hooks: there each slice runs under its own
nested non-reentrant `torch.utils.checkpoint` instead (one more MLP forward per step). Under DeepSpeed ZeRO-3 it
stands aside (said once): ZeRO-3 gathers each projection's weights at each call, so ranks tiling different numbers of
positions would make different numbers of collective gathers and hang.

It applies where grad is enabled (the training forward): generation and the no-grad log-prob passes run the MLP whole,
as TRL does. It stands aside while a dropout inside the MLP is active (LoRA dropout on its projections): masks drawn
slice by slice are not the masks of one draw over all positions.

On by default (`tiled_mlp_tokens="auto"`): a training forward of more than `AUTO_MIN_TOKENS` token positions (rows x
sequence of one micro-batch) runs its MLPs in tiles of `AUTO_TILE_TOKENS`; a smaller one runs them whole (two tiles at
least; below that the saving is small). Measured (`make bench-memory-real`, docs/guide/memory.md): the step increment
falls to ~0.6x stock TRL's at the same gradient and the same time.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable

import torch
from torch.utils.checkpoint import checkpoint

logger = logging.getLogger(__name__)

# What tiled_mlp_tokens="auto" (its default: long_completions/settings.py) means (measured: docs/guide/memory.md).
AUTO_TILE_TOKENS = 4096
AUTO_MIN_TOKENS = 8192


def decoder_mlps(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every decoder layer's dense MLP: a `mlp` beside a `self_attn`, of a class named *MLP (mixture
    of experts blocks are not: their router reads every position)."""
    found = []
    for name, module in model.named_modules():
        mlp = getattr(module, "mlp", None)
        if hasattr(module, "self_attn") and isinstance(mlp, torch.nn.Module) and type(mlp).__name__.endswith("MLP"):
            found.append((f"{name}.mlp" if name else "mlp", mlp))
    return found


def active_dropout(module: torch.nn.Module) -> str | None:
    """The first dropout inside `module` that would draw a mask now, or None."""
    for name, child in module.named_modules():
        if isinstance(child, torch.nn.modules.dropout._DropoutNd) and child.training and child.p > 0:
            return f"{name}: p={child.p}"
    return None


_noted: set[str] = set()


def note_once(reason: str) -> None:
    """Say once per process why an MLP runs whole."""
    if reason not in _noted:
        _noted.add(reason)
        logger.warning("tiled_mlp_tokens: the MLP runs whole, because %s.", reason)


def note_auto_once(positions: int) -> None:
    """Say once per process that the default turned the tiled MLP on, and why."""
    if "auto" not in _noted:
        _noted.add("auto")
        logger.warning(
            "tiled_mlp_tokens='auto': a training forward of %d token positions (> %d) runs each decoder MLP in tiles "
            "of %d positions (same gradient up to float rounding; its MLP intermediates ~%.0fx smaller). "
            "tiled_mlp_tokens=None turns it off, an integer sets the tile.",
            positions, AUTO_MIN_TOKENS, AUTO_TILE_TOKENS, positions / AUTO_TILE_TOKENS,
        )  # fmt: skip


def tile_size(setting: int | str | None) -> tuple[int, int] | None:
    """(tile, the fewest positions a forward must have to be tiled) for a `tiled_mlp_tokens` setting, None for off:
    an integer n tiles every forward of more than n positions in tiles of n; "auto" tiles forwards of more than
    AUTO_MIN_TOKENS positions in tiles of AUTO_TILE_TOKENS."""
    if isinstance(setting, str) and setting.strip().isdigit():  # as a command line or YAML string gives it
        setting = int(setting)
    if setting is None:
        return None
    if setting == "auto":
        return AUTO_TILE_TOKENS, AUTO_MIN_TOKENS
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 1:
        raise ValueError(
            f"tiled_mlp_tokens={setting!r} is not allowed: it must be 'auto', a positive number of token positions "
            "or None"
        )
    return setting, setting


class TiledMLP:
    """The forward of one MLP, tiled over `tokens` positions at a time while grad is enabled, for an input of more
    than `min_positions` positions (`tokens` when not given; see the module)."""

    def __init__(self, mlp: torch.nn.Module, tokens: int, on_fallback=note_once, min_positions: int | None = None,
                 on_auto=None):  # fmt: skip
        self.mlp, self.tokens, self.on_fallback = mlp, tokens, on_fallback
        self.min_positions = tokens if min_positions is None else min_positions
        self.on_auto = on_auto  # called with the positions the first time a default ("auto") tiling tiles
        self.original = mlp.forward
        self.output_only_added: bool | None = None  # set by `watch_layer` after the first tiled training forward
        self.output_like: tuple[int, torch.dtype] | None = None  # (features, dtype) of the last computed output
        self.tiled_calls = 0  # forwards that ran tiled (tests count them)
        self.skipped_recomputes = 0  # checkpoint recomputes that did not run the MLP (tests count them)

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        positions = x.numel() // x.shape[-1] if x.dim() else 0
        if args or kwargs or not torch.is_grad_enabled() or positions <= max(self.tokens, self.min_positions):
            return self.original(x, *args, **kwargs)
        dropout = active_dropout(self.mlp)
        if dropout is not None:
            self.on_fallback(f"dropout is active inside the MLP ({dropout}): masks drawn slice by slice would differ")
            return self.original(x)
        if any(hasattr(param, "ds_id") for param in self.mlp.parameters()):
            # ZeRO-3 gathers a projection's weights at each of its calls, a collective: ranks whose micro-batches hold
            # different numbers of positions would run different numbers of tiles, so of gathers, and hang.
            self.on_fallback("DeepSpeed ZeRO-3 gathers the MLP's weights at each call: ranks tiling different numbers "
                             "of positions would make different numbers of gathers and hang")  # fmt: skip
            return self.original(x)
        if self.on_auto is not None:
            self.on_auto(positions)
        self.tiled_calls += 1
        flat = x.reshape(positions, x.shape[-1])
        trainable = [param for param in self.mlp.parameters() if param.requires_grad]
        if any(_sharded(param) for param in trainable):
            run = functools.partial(checkpoint, self.original, use_reentrant=False, preserve_rng_state=False)
            out = torch.cat([run(part) for part in flat.split(self.tokens)])
        else:
            skip = bool(self.output_only_added) and self.output_like is not None and _recomputing()
            self.skipped_recomputes += skip
            out = _TiledMLPFunction.apply(self.original, self.tokens, self.output_like if skip else None, flat,
                                          *trainable)  # fmt: skip
            out = _RecomputeFirst.apply(out, flat)
            self.output_like = (out.shape[-1], out.dtype)
        return out.reshape(*x.shape[:-1], out.shape[-1])


def _sharded(param: torch.Tensor) -> bool:
    """A parameter still sharded when the MLP is called (an FSDP2 DTensor, an empty placeholder): its gradient reaches
    it through the engine's hooks, so its tiles run under torch's nested checkpoints instead."""
    return param.numel() == 0 or type(param.data).__name__ == "DTensor"


def _recomputing() -> bool:
    """Whether this forward runs inside a backward: gradient checkpointing recomputing its layer for the saved tensors
    of that layer (a training forward runs outside any backward)."""
    return torch._C._current_graph_task_id() != -1


def _autocast_state(device_type: str) -> dict:
    """What `torch.autocast` needs to re-enter the forward's autocast in backward (as torch.utils.checkpoint does)."""
    return {"device_type": device_type, "enabled": torch.is_autocast_enabled(device_type),
            "dtype": torch.get_autocast_dtype(device_type), "cache_enabled": torch.is_autocast_cache_enabled()}  # fmt: skip


def tile_indices(count: int) -> Iterable[int]:
    """The tiles a tiled MLP computes, in order: all of them (a memory count on fake tensors runs only those its peak
    can tell apart: `grpo_plus.fit.memory.distinct_mlp_tiles`)."""
    return range(count)


class _TiledMLPFunction(torch.autograd.Function):
    """y = concat_t mlp(x_t) over tiles x_t of `tokens` positions; forward without grad, backward recomputes one tile at
    a time with grad and writes dL/dx_t into its slice, summing dL/dθ over the tiles.

    Under gradient checkpointing the layer's recompute (`skip` = the output's (features, dtype)) only saves x: the
    backward recomputes the tiles anyway, and `watch_layer` found that nothing the layer saves reads the output, so the
    output is left unwritten: the MLP runs twice per step, as it does untiled (torch's nested checkpoints ran it three
    times: forward, the layer's recompute, each tile's recompute)."""

    @staticmethod
    def forward(ctx, mlp_forward, tokens: int, skip: tuple[int, torch.dtype] | None, x: torch.Tensor, *params):
        ctx.mlp_forward, ctx.tokens, ctx.autocast = mlp_forward, tokens, _autocast_state(x.device.type)
        ctx.save_for_backward(x, *params)
        if skip is not None:
            features, dtype = skip
            return x.new_empty((x.shape[0], features), dtype=dtype)
        parts = x.split(tokens)
        out = None
        for index in tile_indices(len(parts)):
            part_out = mlp_forward(parts[index])
            if out is None:
                out = x.new_empty((x.shape[0], part_out.shape[-1]), dtype=part_out.dtype)
            out[index * tokens : index * tokens + part_out.shape[0]] = part_out
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, *params = ctx.saved_tensors
        wants_x, wants = ctx.needs_input_grad[3], [i for i, need in enumerate(ctx.needs_input_grad[4:]) if need]
        grad_x = torch.empty_like(x) if wants_x else None
        grad_params: list[torch.Tensor | None] = [None] * len(params)
        parts, grad_parts = x.split(ctx.tokens), grad.split(ctx.tokens)
        # Innermost saved-tensor hooks that keep a tile's tensors as they are: a tile's graph is freed before the next
        # (activation offloading's hooks, active in backward, would copy each intermediate to the host and hold it).
        keep = torch.autograd.graph.saved_tensors_hooks(lambda tensor: tensor, lambda tensor: tensor)
        with torch.enable_grad(), torch.autocast(**ctx.autocast), keep:
            for index in tile_indices(len(parts)):
                part = parts[index].detach().requires_grad_(wants_x)
                inputs = ([part] if wants_x else []) + [params[i] for i in wants]
                grads = torch.autograd.grad(ctx.mlp_forward(part), inputs, grad_parts[index], allow_unused=True)
                if wants_x:
                    grad_x[index * ctx.tokens : index * ctx.tokens + part.shape[0]] = grads[0]
                for i, part_grad in zip(wants, grads[wants_x:], strict=True):
                    if part_grad is None:
                        continue
                    grad_params[i] = part_grad if grad_params[i] is None else grad_params[i].add_(part_grad)
        return (None, None, None, grad_x, *grad_params)


class _RecomputeFirst(torch.autograd.Function):
    """y = out, whose backward (the node before `_TiledMLPFunction`'s) unpacks a one-element slice of the MLP's input
    first: under gradient checkpointing that runs the layer's recompute in this small node, so that what the recompute
    brings back for itself (activation offloading returns the layer's input to the device and holds it until the node
    that asked for it is done) is let go before the tiles' backward, not held through it."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x[:1, :1])  # one element: below what activation offloading moves
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.saved_tensors  # noqa: B018 (unpacking is the point: it runs the layer's recompute here)
        return grad, None


_PASS_THROUGH = frozenset(
    {"AddBackward0", "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "_RecomputeFirstBackward"}
)


def output_only_added(output: torch.Tensor, layer_input: torch.Tensor) -> bool | None:
    """Whether the tiled MLP in the autograd graph between a layer's input and `output` reaches `output` through
    additions and views only (operators that save no tensor, so a recompute may leave the MLP's output unwritten);
    None when no tiled MLP is in that graph."""
    boundary = layer_input.grad_fn
    reaches: dict = {}  # node -> whether a tiled MLP is at or behind it
    safe = True
    stack = [(output.grad_fn, False)]
    while stack:
        node, expanded = stack.pop()
        if node is None or node is boundary or (node in reaches and not expanded):
            continue
        if type(node).__name__ == "_TiledMLPFunctionBackward":
            reaches[node] = True
            continue
        children = [child for child, _ in node.next_functions if child is not None and child is not boundary]
        if not expanded:
            reaches[node] = False
            stack.append((node, True))
            stack.extend((child, False) for child in children if child not in reaches)
            continue
        reaches[node] = any(reaches.get(child, False) for child in children)
        if reaches[node] and type(node).__name__ not in _PASS_THROUGH:
            safe = False
    found = any(reaches.values())
    return safe if found else None


def watch_layer(layer: torch.nn.Module, wrapper: TiledMLP) -> None:
    """After the first training forward of `layer` that tiled its MLP, decide whether its checkpoint recompute may skip
    the MLP (`output_only_added`), then stop watching."""

    def check(module, args, kwargs, output):
        if wrapper.tiled_calls == 0 or _recomputing() or not torch.is_grad_enabled():
            return  # nothing tiled yet (a short forward), or not a training forward
        hidden = args[0] if args else kwargs.get("hidden_states")
        first = output[0] if isinstance(output, tuple) else output
        if not (isinstance(hidden, torch.Tensor) and isinstance(first, torch.Tensor)):
            handle.remove()  # a layer whose hidden states we cannot find: its recompute runs the MLP
            return
        found = output_only_added(first, hidden)
        if found is not None:
            wrapper.output_only_added = found
            if not found:
                logger.info("tiled MLP: %s saves a tensor computed from the MLP's output; its recompute runs the MLP",
                            type(module).__name__)  # fmt: skip
            handle.remove()

    handle = layer.register_forward_hook(check, with_kwargs=True)


def tile_mlps(model: torch.nn.Module, tokens: int | str, on_fallback=note_once) -> list[TiledMLP]:
    """Tile every decoder MLP of `model` (an instance attribute over its class's forward) by a `tiled_mlp_tokens`
    setting (`tile_size`); returns the wrappers. Calling it again on the same model re-tiles with the new setting."""
    size = tile_size(tokens)
    if size is None:
        raise ValueError("tile_mlps needs a tiled_mlp_tokens setting that is on ('auto' or a positive integer)")
    tile, min_positions = size
    on_auto = note_auto_once if tokens == "auto" else None
    if not decoder_mlps(model):
        if tokens == "auto":
            return []  # the default stands aside quietly where there is nothing to tile

        on_fallback(
            f"{type(model).__name__} has no dense decoder MLP (a `mlp` of a class named *MLP beside `self_attn`)"
        )
    wrappers = []
    for name, mlp in decoder_mlps(model):
        current = mlp.__dict__.get("forward")
        if isinstance(current, TiledMLP):
            current.tokens, current.min_positions, current.on_auto = tile, min_positions, on_auto
            wrappers.append(current)
            continue
        wrapper = TiledMLP(mlp, tile, on_fallback, min_positions, on_auto)
        mlp.forward = wrapper
        watch_layer(model.get_submodule(name.removesuffix("mlp").removesuffix(".")), wrapper)
        wrappers.append(wrapper)
    return wrappers
