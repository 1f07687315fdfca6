"""Tiled MLP: each decoder layer's MLP computed, and its backward recomputed, a few thousand token positions at a time.

At long sequences the largest tensors of a training step are one layer's MLP intermediates ([tokens, intermediate
size], ~6x the hidden size): the backward of a checkpointed layer holds several of them at once (the gate and up
projections, the activation, their product, its gradients). A dense MLP works on each position alone, so it can run on
slices of the positions: each slice runs under its own (nested, non-reentrant) `torch.utils.checkpoint`, which keeps
only the slice's input, and its backward recomputes the slice and frees it before the next, so at most one slice's
intermediates are alive (Arctic Long Sequence Training's TiledMLP; Unsloth's tiled MLP).

Exact: every position goes through the same operators with the same weights; the only difference is how the matrix
products are blocked (a LoRA weight's gradient sums the slices' contributions in slice order), which moves float32
results by rounding (tests/test_long_completions.py measures it against stock TRL). It costs one more forward of each
MLP per step (the checkpointed layer's recompute runs the slices, then each slice is recomputed for its backward).

It applies where grad is enabled (the training forward): generation and the no-grad log-prob passes run the MLP whole,
as TRL does. It stands aside while a dropout inside the MLP is active (LoRA dropout on its projections): masks drawn
slice by slice are not the masks of one draw over all positions.

On by default (`tiled_mlp_tokens="auto"`): a training forward of more than `AUTO_MIN_TOKENS` token positions (rows x
sequence of one micro-batch) runs its MLPs in tiles of `AUTO_TILE_TOKENS`; a smaller one runs them whole. The threshold
is measured (`make bench-memory-real`, docs/guide/memory.md): below it the saving is small and the extra MLP forward
costs more than 5% of the pass; above it the step increment falls to ~0.6x stock TRL's at the same gradient.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch.utils.checkpoint import checkpoint

logger = logging.getLogger(__name__)

# The default of GRPOConfig.tiled_mlp_tokens, and what "auto" means (measured: docs/guide/memory.md).
TILED_MLP_DEFAULT = "auto"
AUTO_TILE_TOKENS = 4096
AUTO_MIN_TOKENS = 16384


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
        self.tiled_calls = 0  # forwards that ran tiled (tests count them)

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        positions = x.numel() // x.shape[-1] if x.dim() else 0
        if args or kwargs or not torch.is_grad_enabled() or positions <= max(self.tokens, self.min_positions):
            return self.original(x, *args, **kwargs)
        dropout = active_dropout(self.mlp)
        if dropout is not None:
            self.on_fallback(f"dropout is active inside the MLP ({dropout}): masks drawn slice by slice would differ")
            return self.original(x)
        if self.on_auto is not None:
            self.on_auto(positions)
        self.tiled_calls += 1
        flat = x.reshape(positions, x.shape[-1])
        run = functools.partial(checkpoint, self.original, use_reentrant=False, preserve_rng_state=False)
        out = torch.cat(run_tiles(run, flat.split(self.tokens)))
        return out.reshape(*x.shape[:-1], out.shape[-1])


def run_tiles(run, parts: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """Each slice through `run` (its checkpointed MLP), in order. A module-level function so that a memory count can
    run only the tiles that its peak can tell apart (`grpo_plus.fit.memory.distinct_mlp_tiles`)."""
    return [run(part) for part in parts]


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
    for _, mlp in decoder_mlps(model):
        current = mlp.__dict__.get("forward")
        if isinstance(current, TiledMLP):
            current.tokens, current.min_positions, current.on_auto = tile, min_positions, on_auto
            wrappers.append(current)
            continue
        wrapper = TiledMLP(mlp, tile, on_fallback, min_positions, on_auto)
        mlp.forward = wrapper
        wrappers.append(wrapper)
    return wrappers
