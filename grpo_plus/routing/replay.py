"""Routing replay: the sampler's experts for each completion token, used again in the training-side forwards.

What is recorded (grpo_plus's generator, `grpo_plus.zero_waste.generation`): at each decoding step, the top-k experts
every MoE layer's router chose for the token fed in, i.e. completion token t_j at step j. The last token of a
completion is never fed in while sampling (it predicts nothing), so it has no record. The generator hands them back
as `routes` (B, completion width, layers, k), -1 where no record; grpo_plus puts them in the generation batch under
`ROUTES_KEY`, split and shuffled with the rows.

What is replayed: a model call gets a `RoutePlan` (each input position's recorded experts or -1) as a keyword
argument of its decoder stack (`REPLAY_ARGUMENT`), which transformers 5 passes to every decoder layer and from there to
its attention: a pre-hook on the attention takes it out and hands it to the layer's router, whose forward hook
replaces the router's choice at the recorded positions by the recorded experts, with the combine weights the router's
own formula gives them from its current logits (`grpo_plus.compat.moe.combine_weights_at`: the router's gradient
flows). A gradient-checkpointing recompute calls the layer's forward with the keyword arguments it was first called
with, so the recompute routes as the forward did. Positions without a record (prompt tokens, the last token,
padding) route as the router decides.

The receipt: for the recorded positions of the training forward, whether the experts handed to each layer's experts
module (`routing/route_flips`) and the router's own top-k (`routing/router_flips`) differ from the sampler's in at
least one layer, as a share of the recorded completion tokens.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ..compat.moe import MoeLayer, combine_weights_at, moe_layers, replay_blocker

ROUTES_KEY = "routes"
REPLAY_ARGUMENT = "routing_replay"
NO_ROUTE = -1


@dataclass
class RouteTally:
    """Recorded completion tokens a training forward computed, and how many of them flipped (tensors: summed on the
    device, read once per step)."""

    tokens: int | torch.Tensor = 0
    router_flips: int | torch.Tensor = 0  # the training router's own top-k differs in some layer
    route_flips: int | torch.Tensor = 0  # the experts the experts modules received differ in some layer

    def log(self, metrics: dict[str, list]) -> None:
        counts = (self.tokens, self.route_flips, self.router_flips)
        if isinstance(self.tokens, torch.Tensor):  # one read from the device, not three
            counts = torch.stack([torch.as_tensor(count, device=self.tokens.device) for count in counts]).tolist()
        tokens, route_flips, router_flips = (int(count) for count in counts)
        if tokens:
            metrics["routing/route_flips"].append(route_flips / tokens)
            metrics["routing/router_flips"].append(router_flips / tokens)


@dataclass
class RoutePlan:
    """One model call's recorded experts, flattened as the routers see the tokens (row-major (rows x columns))."""

    experts: torch.Tensor  # (layers, tokens, k) long (made so once per call, not per layer), NO_ROUTE: none
    replay: bool
    tally: RouteTally | None = None
    recorded: torch.Tensor = field(init=False)  # (tokens,) bool
    router_flips: torch.Tensor = field(init=False)
    route_flips: torch.Tensor = field(init=False)
    _sorted: torch.Tensor | None = field(default=None, init=False)  # the records sorted along k (the receipt's)
    _seen: set = field(default_factory=set, init=False)  # (part, layer) already tallied: a recompute is not counted

    def __post_init__(self) -> None:
        self.recorded = (self.experts >= 0).all(dim=-1).all(dim=0)
        if self.tally is not None:
            self.router_flips = torch.zeros_like(self.recorded)
            self.route_flips = torch.zeros_like(self.recorded)
            self._sorted = self.experts.sort(dim=-1).values  # every layer's at once

    def note(self, part: str, layer: int, chosen: torch.Tensor) -> torch.Tensor | None:
        """OR into `part`'s flips where `chosen` (tokens, k) is another set of experts than the recorded one; returns
        where it is (None: not tallied, a recompute or no tally)."""
        if self.tally is None or (part, layer) in self._seen:
            return None
        differs = (chosen.sort(dim=-1).values != self._sorted[layer]).any(dim=-1) & self.recorded
        self.noted(part, layer, differs)
        return differs

    def noted(self, part: str, layer: int, differs: torch.Tensor | None) -> None:
        """OR `differs` (tokens,) bool, known without comparing (None: differs nowhere), into `part`'s flips."""
        if self.tally is None or (part, layer) in self._seen:
            return
        self._seen.add((part, layer))
        if differs is not None:
            flips = self.router_flips if part == "router" else self.route_flips
            flips |= differs

    def close(self) -> None:
        """Add this call's counts to its tally."""
        if self.tally is not None:
            self.tally.tokens = self.tally.tokens + self.recorded.sum()
            self.tally.router_flips = self.tally.router_flips + self.router_flips.sum()
            self.tally.route_flips = self.tally.route_flips + self.route_flips.sum()


def completion_plan(routes: torch.Tensor, prompt_width: int) -> torch.Tensor:
    """(B, prompt_width + C, layers, k) int: `routes` (B, C, layers, k) of the completion columns after `prompt_width`
    columns without a record (what a forward over `cat(prompt, completion)` routes)."""
    prompt = routes.new_full((routes.shape[0], prompt_width, *routes.shape[2:]), NO_ROUTE)
    return torch.cat([prompt, routes], dim=1)


def packed_plan(routes: torch.Tensor, origin: tuple[torch.Tensor, torch.Tensor], prompt_width: int,
                real: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """(n, L, layers, k): the record of each position of packed rows, from its `origin` (row, column) in TRL's
    `cat(prompt, completion)` layout; prompt positions and padding (`real` False) have none."""
    rows, columns = origin
    completion = columns - prompt_width
    inside = (completion >= 0) & (completion < routes.shape[1]) & real
    picked = routes[rows, completion.clamp(0, routes.shape[1] - 1)]
    return picked.masked_fill(~inside[..., None, None], NO_ROUTE)


class RouteReplay:
    """The hooks of one run (`replay`: use the records; else only tally them). `hooks_held(model)` keeps a model's
    hooks installed (a training step: the recompute in backward needs them), `planned(model, plan)` routes the model
    calls inside the block by `plan`."""

    def __init__(self, replay: bool):
        self.replay = replay
        self._held: dict[int, tuple[int, list]] = {}
        self._layouts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _layout(self, model: torch.nn.Module) -> tuple[torch.nn.Module, list[MoeLayer]]:
        """`model`'s decoder stack and MoE layers, found on its first use (a walk over its modules, which every
        training step would repeat otherwise): a run's model keeps its modules (PEFT wraps it before training)."""
        layout = self._layouts.get(model)
        if layout is None:
            layers = moe_layers(model)
            layout = self._layouts[model] = (_decoder_stack(model, layers), layers)
        return layout

    @staticmethod
    def blocker(model: torch.nn.Module) -> str | None:
        return replay_blocker(model)

    @contextlib.contextmanager
    def hooks_held(self, model: torch.nn.Module) -> Iterator[None]:
        """Within the block, `model`'s routers follow the plan any forward hands them: the hooks, installed by the
        first `planned` block inside it, stay until the last exit (a training step: its generation runs before any
        plan, without them; the recompute in backward, after the plans, with them)."""
        key = id(self._layout(model)[0])  # one install per model, whatever wrapper (PEFT, DDP) is handed in
        count, handles = self._held.get(key, (0, None))
        self._held[key] = (count + 1, handles)
        try:
            yield
        finally:
            count, handles = self._held.pop(key)
            if count > 1:
                self._held[key] = (count - 1, handles)
            elif handles is not None:
                for handle in handles:
                    handle.remove()

    def _install_held(self, model: torch.nn.Module) -> None:
        """Install `model`'s hooks inside a `hooks_held` block, unless they are."""
        stack, layers = self._layout(model)
        count, handles = self._held[id(stack)]
        if handles is None:
            self._held[id(stack)] = (count, _install(layers))

    @contextlib.contextmanager
    def planned(self, model: torch.nn.Module, plan: torch.Tensor, tally: RouteTally | None = None) -> Iterator[None]:
        """Within the block, each call of `model`'s decoder stack routes the next rows of `plan` (rows, width, layers,
        k): a call of n rows of `width` tokens takes n rows, in order (TRL's no-grad passes chunk the rows so). Fails
        at exit if the calls did not take every row (a layout the plan does not describe)."""
        stack, _ = self._layout(model)
        taken = 0
        plans: list[RoutePlan] = []

        def hand_plan(module, args, kwargs):
            nonlocal taken
            ids = kwargs.get("input_ids", args[0] if args else None)
            if ids is None:
                ids = kwargs["inputs_embeds"]
            rows, width = ids.shape[0], ids.shape[1]
            if plan.shape[1] != width or taken + rows > plan.shape[0]:
                raise RuntimeError(
                    f"routing replay: a model call of {rows} x {width} tokens after {taken} of the plan's "
                    f"{plan.shape[0]} x {plan.shape[1]}: the forward's layout is not the plan's"
                )
            part = plan[taken : taken + rows].to(ids.device, torch.long)
            taken += rows
            experts = part.permute(2, 0, 1, 3).reshape(part.shape[2], rows * width, part.shape[3])
            plans.append(RoutePlan(experts, self.replay, tally))
            return args, {**kwargs, REPLAY_ARGUMENT: plans[-1]}

        handle = stack.register_forward_pre_hook(hand_plan, with_kwargs=True)
        try:
            with self.hooks_held(model):
                self._install_held(model)
                yield
        finally:
            handle.remove()
        for each in plans:
            each.close()
        if taken != plan.shape[0]:
            raise RuntimeError(f"routing replay: the model calls took {taken} of the plan's {plan.shape[0]} rows")


def _decoder_stack(model: torch.nn.Module, layers: list[MoeLayer]) -> torch.nn.Module:
    """The module whose forward runs the decoder layers (its keyword arguments reach each of them); `layers`: its
    `moe_layers`."""
    first = next(module for module in model.modules() if hasattr(module, "self_attn") and
                 module.self_attn is layers[0].attention)  # fmt: skip
    for module in model.modules():
        children = getattr(module, "layers", None)
        if isinstance(children, torch.nn.ModuleList) and any(child is first for child in children):
            return module
    raise RuntimeError(f"routing replay: no decoder stack found in {type(model).__name__}")


def _install(layers: list[MoeLayer]) -> list:
    """The hooks that carry a plan from each layer's attention to its router and experts module."""
    handles = []
    for index, layer in enumerate(layers):
        # "handed": the experts tensor the router's forward gave the block, and where it differs from the records
        slot: dict = {"router": None, "experts": None, "handed": None}

        def take_plan(module, args, kwargs, slot=slot):
            slot["router"] = kwargs.pop(REPLAY_ARGUMENT, None)
            return args, kwargs

        def route(router, args, output, slot=slot, index=index):
            plan, slot["router"] = slot["router"], None
            slot["experts"] = plan
            if plan is None:
                return None
            logits, weights, chosen = output
            if logits.shape[0] != plan.experts.shape[1]:
                raise RuntimeError(
                    f"routing replay: layer {index}'s router saw {logits.shape[0]} tokens, the plan has "
                    f"{plan.experts.shape[1]}"
                )
            differs = plan.note("router", index, chosen)
            if not plan.replay:
                slot["handed"] = None if differs is None else (chosen, differs)
                return None
            recorded = plan.recorded[:, None]
            experts = torch.where(recorded, plan.experts[index].to(chosen.dtype), chosen)
            replayed = combine_weights_at(router, logits, experts, weights.dtype)
            slot["handed"] = (experts, None)  # the records wherever there is one: differs nowhere
            return logits, torch.where(recorded, replayed, weights), experts

        def received(module, args, slot=slot, index=index):
            plan, slot["experts"] = slot["experts"], None
            handed, slot["handed"] = slot["handed"] or (None, None), None
            if plan is None or len(args) <= 1:
                return
            if args[1] is handed[0]:  # the very tensor the router gave: its comparison is known
                plan.noted("experts", index, handed[1])
            else:
                plan.note("experts", index, args[1])

        handles.append(layer.attention.register_forward_pre_hook(take_plan, with_kwargs=True))
        handles.append(layer.router.register_forward_hook(route))
        handles.append(layer.experts.register_forward_pre_hook(received))
    return handles


@contextlib.contextmanager
def recorded_experts(model: torch.nn.Module, layers: list[MoeLayer] | None = None) -> Iterator[list[torch.Tensor]]:
    """Within the block, every forward of `model` appends each MoE layer's chosen experts ((tokens, k), in layer
    order) to the yielded list (the generator clears it after each step); `layers`: its `moe_layers`, if known."""
    chosen: list[torch.Tensor] = []
    handles = [
        layer.router.register_forward_hook(lambda module, args, output: chosen.append(output[2].detach()))
        for layer in (moe_layers(model) if layers is None else layers)
    ]
    try:
        yield chosen
    finally:
        for handle in handles:
            handle.remove()


class StepRoutes:
    """The experts of each decoding step of one `generate` call, assembled into (B, completion width, layers, k)."""

    def __init__(self, layers: list[MoeLayer], batch_size: int):
        """`layers`: the model's `moe_layers`."""
        self.shape = (batch_size, len(layers), layers[0].router.top_k if layers else 0)
        self.steps: list[tuple[torch.Tensor, torch.Tensor]] = []

    def add(self, rows: torch.Tensor, chosen: list[torch.Tensor]) -> None:
        """Step j's experts ((rows, k) per layer) for completion token j of `rows` (the rows fed in)."""
        self.steps.append((rows, torch.stack(chosen, dim=1).to(torch.int16)))
        chosen.clear()

    def assemble(self, width: int, device: torch.device) -> torch.Tensor:
        """(B, `width` generated tokens, layers, k), NO_ROUTE where no token was fed in."""
        batch_size, layers, top_k = self.shape
        routes = torch.full((batch_size, width, layers, top_k), NO_ROUTE, dtype=torch.int16, device=device)
        for step, (rows, chosen) in enumerate(self.steps):
            routes[rows.to(device), step] = chosen.to(device)
        return routes


class RoundRoutes:
    """The experts grpo_plus's generator recorded in one generation step, on their way from the step's `generate`
    calls to its generation batch (created per step, handed to each call that needs it; `replay`: the records are
    used, else only compared). One entry per `generate` call: its routes, or why it ran TRL's way and recorded none."""

    def __init__(self, replay: bool):
        self.replay = replay
        self.calls: list[torch.Tensor | str | None] = []

    def add(self, routes: torch.Tensor | None, fallback: str | None) -> None:
        """One `generate` call's records (`routes`), or the reason it did not run grpo_plus's loop (`fallback`)."""
        self.calls.append(routes if fallback is None else fallback)

    def attach(self, output: dict) -> None:
        """Put the step's records in its generation batch `output` (`ROUTES_KEY`, one row per completion). Where the
        step recorded none (TRL's generation ran, or tool turns called it more than once): with replay on, an error
        saying why (the user chose replay); with the receipt only, nothing is logged for the round."""
        routes = self.calls[0] if len(self.calls) == 1 else None
        rows, width = output["completion_ids"].shape
        if isinstance(routes, torch.Tensor) and routes.shape[0] == rows:
            output[ROUTES_KEY] = fit_routes(routes, width)
            return
        if self.replay:
            if isinstance(routes, str):  # generation ran TRL's way: why
                reason = routes
            elif len(self.calls) != 1:
                reason = f"generate was called {len(self.calls)} times for it (tool turns)"
            else:
                reason = "its rows are not the generation batch's"
            raise RuntimeError(
                f"routing_replay=True: this round's generation recorded no experts to replay, because {reason}"
            )

    def check_pass(self, routes: torch.Tensor | None) -> None:
        """A log-prob pass inside the generation step (`routes`: the records it was handed): with replay on, one
        without records (TRL's no-grad passes at generation, before the records are in the batch) is refused."""
        if routes is None and self.replay:
            raise RuntimeError(
                "routing_replay=True: TRL runs a no-grad log-prob pass at generation, before the recorded experts are "
                "in the batch (zero_waste_pass=False with beta > 0 or off-policy old log-probs, or a sampler "
                "correction computed at generation); keep zero_waste_pass on (it computes those passes after the "
                "split, with the records) or turn routing_replay off"
            )


def fit_routes(routes: torch.Tensor, width: int) -> torch.Tensor:
    """`routes` cut or padded (no record) to `width` completion columns."""
    if routes.shape[1] >= width:
        return routes[:, :width]
    padding = routes.new_full((routes.shape[0], width - routes.shape[1], *routes.shape[2:]), NO_ROUTE)
    return torch.cat([routes, padding], dim=1)
