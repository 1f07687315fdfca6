"""The zero-waste training pass inside a GRPOTrainer: which savings apply, the training forward, TRL's no-grad
log-prob passes (deferred to the micro-batch split), and the `zero_waste/*` metrics.

The computation is pure torch in `grpo_plus.zero_waste.rows`; this module decides, per call, what may be saved and keeps
the run's state (fallback notes, placeholders handed to TRL, the positions counter). `trainer.py` wires it in and hands
it what it reads: the run's settings once (`PassSettings`, with what TRL resolved: `TRLTrainingSettings`), TRL's own
log-prob method as a callable, the accelerator (its `unwrap_model` and `autocast`), and per call the model, the
reference model, the metrics and, inside one of TRL's generation steps, that step's `GenerationRound` (made by
`generation_step`, handed back by the trainer to the calls TRL makes inside the step). Calls go one way: the trainer
calls the pass, the pass calls TRL's method, never the trainer.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import trl

from ..compat.lm_head import fused_lm_head_forward, has_fused_lm_head
from ..compat.loss import TRL_NATIVE_LOSS_TYPES, TRLTrainingSettings
from ..compat.model import FORWARD_INPUT_KEYS, disable_gradient_checkpointing
from ..compat.moe import expert_counts, is_moe, recorded_router_logits
from ..compat.versions import version_gap
from ..objective import IMPORTANCE_SAMPLERS, LOSS_TYPES, POLICY_LOSSES, ZERO_ADVANTAGE_ROWS_CONTRIBUTE_NOTHING
from ..routing.replay import ROUTES_KEY, RoundRoutes, RouteReplay, RouteTally, completion_plan, fit_routes, packed_plan
from .generation import GenerationStats
from .images import (
    RowImages,
    bidirectional_blocks,
    image_prompts_blocker,
    rope_positions,
    shared_prompt_vlm_blocker,
    vlm_text_families,
)
from .rows import (
    SHARED_PROMPT_FAMILIES,
    PackedBatch,
    additive_mask,
    completion_width,
    dropout_blocker,
    fill_skipped_entropies,
    forward_rows,
    row_skip_blocker,
    rows_with_gradient,
    shared_prompt_blocker,
    shared_prompt_logps,
    weighted_load_balancing_loss,
)

logger = logging.getLogger(__name__)
# Generation-batch keys of TRL's no-grad log-prob passes, which grpo_plus computes after the micro-batch split.
DEFERRED_LOGPS = ("old_per_token_logps", "ref_per_token_logps")


@dataclass
class PolicyForward:
    """The log-probs of one micro-batch, in TRL's (B, T) layout."""

    logps: torch.Tensor
    entropies: torch.Tensor | None
    aux_loss: torch.Tensor | None
    trained_rows: torch.Tensor | None = None  # (B,) bool, the rows with gradient, when rows may be skipped, else None
    entropies_of_every_row: bool = True  # False when skipped rows hold 0 instead of their entropy

    @property
    def computed_rows(self) -> torch.Tensor | None:
        """(B,) bool: the rows whose log-probs were computed, when some were skipped, else None."""
        live = self.trained_rows
        return None if live is None or bool(live.all()) else live


@dataclass(frozen=True)
class GenerationRound:
    """One of TRL's generation steps as the zero-waste pass sees it: made by `ZeroWastePass.generation_step`, handed by
    the trainer to the calls TRL makes inside the step (its `generate` calls, its log-prob passes) and back with the
    step's generation batch (`ZeroWastePass.finish_round`). `deferring`: TRL's no-grad old / reference passes get
    placeholders (computed after the micro-batch split); `routes`: the experts grpo_plus's generator records in the
    step (routing replay or its receipt), else None."""

    deferring: bool
    routes: RoundRoutes | None = None


@dataclass(frozen=True)
class PassSettings:
    """What the zero-waste pass reads of the run, built once by the trainer. `enabled` / `shared_prompt` /
    `exact_entropy` are GRPOConfig's `zero_waste_pass` / `zero_waste_shared_prompt` / `zero_waste_exact_entropy`.
    `old_logps` says where the old log-probs come from (the rollout correction's `old_logps_source`): "trl" (as TRL
    decides), "generation" (every row, at generation, before the rewards: never deferred) or "none" (the sampler's are
    the old ones: TRL's old-log-prob pass never runs). `row_skip_blocker`: another capability's reason to compute every
    row of the training forward, or None. `correction_blocker`: the decoupled rollout correction's reason to need every
    row before the first loss (so its old log-probs come from a pass at generation even on-policy), or None.
    `policy_loss`: the run's (`grpo_plus.objective.POLICY_LOSSES`). `trl`: what TRL's trainer resolved (its loss
    settings, vLLM correction, batch layout, mixed precision, pad token)."""

    enabled: bool
    shared_prompt: bool
    trl: TRLTrainingSettings
    exact_entropy: bool = False
    old_logps: str = "trl"
    row_skip_blocker: str | None = None
    correction_blocker: str | None = None
    policy_loss: str = "ppo_clip"
    # routing replay (grpo_plus.routing): "replay" (the sampler's experts used in every forward of the completions),
    # "receipt" (recorded and compared, not used) or None
    routing: str | None = None


class ZeroWastePass:
    """One run's zero-waste pass (`settings`: `PassSettings`). `trl_logps` is TRL's own
    `_get_per_token_logps_and_entropies` bound to the trainer (`compat.loss.trl_logps_and_entropies`); `accelerator`
    the trainer's (its `unwrap_model`, and its `autocast` around the packed forward, as TRL's forward enters it: looked
    up at each call, as TRL looks it up)."""

    def __init__(self, settings: PassSettings, trl_logps: Callable[..., tuple], accelerator: Any):
        self.settings, self.trl_logps, self.accelerator = settings, trl_logps, accelerator
        self.enabled, self.shared_prompt = settings.enabled, settings.shared_prompt
        self.exact_entropy, self.old_logps = settings.exact_entropy, settings.old_logps
        self._notes: set[tuple[str, str]] = set()
        self.positions = 0  # token positions the model computed since the training forward began
        self.images = 0  # images (or tiles) the vision tower encoded since the training forward began
        self.pending: tuple[str, ...] = ()  # generation-batch keys still holding placeholders
        self.correction_in_loss = False  # the last generation batch's sampler correction is the training forward's
        self.row_skip_blocker = self.find_row_skip_blocker()
        self.routing = RouteReplay(settings.routing == "replay") if settings.routing else None

    def note_fallback(self, part: str, reason: str) -> None:
        """Say once per run which part of the zero-waste pass runs in full, and why."""
        if (part, reason) not in self._notes:
            self._notes.add((part, reason))
            logger.warning("Zero-waste pass: %s computed in full, because %s.", part, reason)

    def record_generation(
        self, stats: GenerationStats, metrics: dict[str, list], generation_round: GenerationRound | None = None
    ) -> None:
        """What one zero-waste generation call reports: why a part stood aside (said once), the positions computed;
        inside a generation step (`generation_round`), its recorded experts where the step records them."""
        if stats.fallback is not None:
            self.note_fallback("generation", stats.fallback)
        if stats.turns_blocker is not None:
            self.note_fallback(
                "each tool turn's (or partial-rollout chunk's) history in generation", stats.turns_blocker
            )
        if generation_round is not None and generation_round.routes is not None:
            generation_round.routes.add(stats.routes, stats.fallback)
        metrics["zero_waste/generation_positions_frac"].append(stats.positions_frac)
        metrics["zero_waste/generation_prefill_positions_frac"].append(stats.prefill_positions_frac)
        if stats.full_images:
            metrics["zero_waste/generation_images_frac"].append(stats.images / stats.full_images)

    def find_row_skip_blocker(self) -> str | None:
        """None when zero-advantage rows may be left out of the training forward, else why not."""
        settings, trl_settings = self.settings, self.settings.trl
        if not self.enabled:
            return "zero_waste_pass=False"
        if settings.row_skip_blocker is not None:
            reason = settings.row_skip_blocker
        elif trl_settings.loss_type in TRL_NATIVE_LOSS_TYPES:
            reason = f"loss_type={trl_settings.loss_type!r} is computed by TRL's own _compute_loss"
        else:
            loss_type, level = (
                LOSS_TYPES.entry(trl_settings.loss_type),
                IMPORTANCE_SAMPLERS.entry(trl_settings.importance_sampling_level),
            )
            policy_loss = POLICY_LOSSES.entry(settings.policy_loss)
            reason = row_skip_blocker(
                beta=trl_settings.beta,
                entropy_bonus=trl_settings.entropy_bonus,
                top_entropy_quantile=trl_settings.top_entropy_quantile,
                aux_loss=trl_settings.aux_loss,
                loss_type_declared=loss_type.trait(ZERO_ADVANTAGE_ROWS_CONTRIBUTE_NOTHING, False),
                importance_sampling_declared=level.trait(ZERO_ADVANTAGE_ROWS_CONTRIBUTE_NOTHING, False),
                policy_loss_declared=policy_loss.trait(ZERO_ADVANTAGE_ROWS_CONTRIBUTE_NOTHING, False),
                policy_loss=policy_loss.name,
                loss_type=trl_settings.loss_type,
                importance_sampling_level=trl_settings.importance_sampling_level,
            )
        if reason is not None:
            self.note_fallback("zero-advantage rows", reason)
        return reason

    def dropout_blocker(self, model: torch.nn.Module) -> str | None:
        reason = dropout_blocker(self.accelerator.unwrap_model(model))
        if reason is not None:
            self.note_fallback("the zero-waste pass (rows, padding, shared prompt)", reason)
        return reason

    # ---- one micro-batch --------------------------------------------------------------------------------------------

    def micro_batch_logps(
        self, model, inputs: dict[str, Any], compute_entropy: bool, route_tally: RouteTally | None = None
    ) -> PolicyForward:
        """Log-probs of one micro-batch, computing only rows that can carry gradient (the others get their old
        log-probs, so their ratio is 1, and entropy 0, or with `exact_entropy` their entropy from a no-grad forward).
        The training forward and the deferred no-grad passes both come here, so equal weights give bit-equal
        log-probs (same rows, same packs, same model calls)."""
        prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
        live = None
        model_inputs = {key: inputs.get(key) for key in FORWARD_INPUT_KEYS}
        images = self.row_images(model_inputs, input_ids.shape[0], "zero-advantage rows")
        if self.row_skip_blocker is None and not isinstance(images, tuple) and self.dropout_blocker(model) is None:
            advantages = inputs["advantages"]
            live = rows_with_gradient(advantages.reshape(advantages.shape[0], -1), mask)
        old = inputs.get("old_per_token_logps")
        fill = old.detach() if old is not None else torch.zeros(mask.shape, device=mask.device)
        routes = inputs.get(ROUTES_KEY)  # the sampler's experts (routing replay), rows and completion columns
        if routes is None and self.routing is not None and self.routing.replay:
            raise RuntimeError(
                "routing_replay=True: a micro-batch carries no recorded experts to replay (a generation batch restored "
                "from a checkpoint written with routing_replay off); resume from a checkpoint between generation "
                "batches, or with the routing_replay the checkpoint was written with"
            )

        def forward(ids, attention, width, rows=None, columns=None):
            extra = model_inputs if not isinstance(images, RowImages) else images.select(rows, columns)
            if routes is not None:  # the columns are the prompt's, then completion columns 0 .. width - 1
                extra = {**extra, "routes": (routes if rows is None else routes[rows])[:, :width]}
            return self.logps_and_entropies(
                model, ids, attention, width, compute_entropy=compute_entropy,
                compute_aux_loss=self.settings.trl.aux_loss, route_tally=route_tally, **extra,
            )  # fmt: skip

        # The no-row anchor is a row's first positions; with images, its whole prompt (image tokens need the images).
        first = 0 if isinstance(images, RowImages) and images.has_images else prompt_ids.size(1) - 1
        bridge = slice(first, prompt_ids.size(1) + 1)
        width = completion_ids.size(1)
        logps, entropies, aux_loss = forward_rows(forward, input_ids, attention_mask, width, live, fill, bridge)
        every_row = live is None or bool(live.all())
        if entropies is not None and live is not None and self.exact_entropy:
            entropies = fill_skipped_entropies(forward, input_ids, attention_mask, width, live, entropies, bridge)
            every_row = True
        return PolicyForward(logps, entropies, aux_loss, live, every_row)

    def policy_forward(self, model, inputs: dict[str, Any], metrics: dict[str, list]) -> PolicyForward:
        """The micro-batch's training forward; logs the share of rows and token positions it computed."""
        self.positions = self.images = 0
        tally = RouteTally() if inputs.get(ROUTES_KEY) is not None else None
        policy = self.micro_batch_logps(model, inputs, compute_entropy=True, route_tally=tally)
        if tally is not None:
            tally.log(metrics)
        rows = 1.0 if policy.computed_rows is None else policy.computed_rows.float().mean().item()
        metrics["zero_waste/rows_computed_frac"].append(rows)
        full_positions = inputs["prompt_ids"].numel() + inputs["completion_ids"].numel()
        metrics["zero_waste/positions_frac"].append(self.positions / full_positions)
        counts = inputs.get("num_tiles") or inputs.get("num_images")
        if counts and sum(counts):  # TRL's training forward encodes every row's images
            metrics["zero_waste/images_frac"].append(self.images / sum(counts))
        return policy

    def row_images(self, model_inputs: dict[str, Any], batch_size: int, part: str) -> RowImages | None | tuple:
        """The batch's image inputs by row; None without any; () where their rows cannot be told apart (then `part`
        is computed in full, and the note says why)."""
        if all(value is None for value in model_inputs.values()):
            return None
        images = RowImages.from_inputs(model_inputs, batch_size)
        if not isinstance(images, str) and images.has_images:
            images = image_prompts_blocker() or images
        if isinstance(images, str):
            self.note_fallback(part, images)
            return ()
        return images

    def routes_held(self, model: torch.nn.Module):
        """Around a training step (routing replay): `model`'s replay hooks stay installed through backward, where a
        gradient-checkpointing recompute routes the completions again."""
        return nullcontext() if self.routing is None else self.routing.hooks_held(model)

    def routing_blocker(self, model: torch.nn.Module) -> str | None:
        """Why routing replay (or its receipt) cannot follow `model`'s routers, or None (also None when it is off)."""
        return None if self.routing is None else self.routing.blocker(self.accelerator.unwrap_model(model))

    # ---- TRL's no-grad passes -------------------------------------------------------------------------------------
    # TRL computes old / reference log-probs inside `_generate_and_score_completions`, before the rewards and before it
    # shuffles the generation batch into micro-batches. grpo_plus hands TRL placeholders there and computes both right
    # after the split, micro-batch by micro-batch, through `micro_batch_logps`: the same weights then give bit-equal
    # log-probs (TRL's ratio of exactly 1 and KL of exactly 0 at the reference), dead rows are skipped there too, and
    # every process makes one model call per micro-batch and pass (ZeRO-3 / FSDP gather weights on every call).

    def corrects_sampler(self) -> bool:
        """Whether a sampler correction that reads the old log-probs at generation is on: TRL's vLLM one (it derives the
        sampler/trainer ratio and its `sampling/*` metrics there) or grpo_plus's decoupled rollout correction."""
        return self.settings.trl.sampler_correction or self.old_logps == "generation"

    def correction_in_loss_blocker(self, model: torch.nn.Module) -> str | None:
        """None where the sampler correction may come from the training forward (detached), so that the no-grad
        old-log-prob pass at generation does not run; else why not. The old log-probs must be the training forward's:
        training on-policy as TRL decides it (`gradient_accumulation_steps` a multiple of `steps_per_generation x
        num_iterations`: every use of a generation batch precedes the next optimizer step, TRL's own condition for
        computing no old log-probs), no active dropout (the pass draws masks of its own), the loss grpo_plus's (TRL's
        `_compute_loss` reads the ratio from the generation batch), and a correction whose numbers each micro-batch can
        give (`correction_blocker`). `model`: the policy as the trainer holds it."""
        trl_settings = self.settings.trl
        if not self.enabled:
            return "zero_waste_pass=False"
        every = trl_settings.steps_per_generation * trl_settings.num_iterations
        if trl_settings.gradient_accumulation_steps % every:
            return (
                f"training is off-policy (gradient_accumulation_steps={trl_settings.gradient_accumulation_steps} is "
                f"not a multiple of steps_per_generation x num_iterations = {every}): the old log-probs are those of "
                "the weights at generation"
            )
        if trl_settings.loss_type in TRL_NATIVE_LOSS_TYPES:
            return (
                f"loss_type={trl_settings.loss_type!r} is computed by TRL's own _compute_loss, which reads the ratio "
                "from the generation batch"
            )
        if self.settings.correction_blocker is not None:
            return self.settings.correction_blocker
        return self.dropout_blocker(model)

    def defers_logps(self, model: torch.nn.Module) -> bool:
        """Not under a sampler correction computed at generation (TRL's vLLM one derives the sampler/trainer ratio and
        its `sampling/*` metrics from the old log-probs during generation, before the rewards say which rows are dead,
        and so does grpo_plus's decoupled rollout correction: there the pass still saves padding and shared prompts,
        every row computed), unless that correction comes from the training forward (`correction_in_loss`), nor with
        active dropout (masks must be drawn where TRL draws them). Always where no old log-prob pass may run
        (`old_logps="none"`, the rollout correction's bypass mode): TRL's no-grad passes get placeholders, the old one
        is dropped and the reference one computed after the split, even with the pass off or dropout on."""
        if self.old_logps == "none":
            return True
        at_generation = self.corrects_sampler() and not self.correction_in_loss
        return self.enabled and not at_generation and self.dropout_blocker(model) is None

    @contextmanager
    def generation_step(
        self, model: torch.nn.Module, trl_sampler_correction_off: Callable[[], AbstractContextManager]
    ) -> Iterator[GenerationRound]:
        """Around TRL's `_generate_and_score_completions` (`model`: the policy as the trainer holds it): yields the
        step's `GenerationRound`, for the calls TRL makes inside it and for `finish_round` with its generation batch.
        Where the sampler correction comes from the training forward, TRL's vLLM correction is off for the call
        (inside `trl_sampler_correction_off()`: TRL then runs no old-log-prob pass, on-policy it needs none)."""
        in_loss = False
        if self.corrects_sampler():
            reason = self.correction_in_loss_blocker(model)
            if reason is not None:
                self.note_fallback("the sampler correction's old log-probs (a no-grad pass at generation)", reason)
            in_loss = reason is None
        self.correction_in_loss = in_loss
        routes = RoundRoutes(self.routing.replay) if self.routing is not None else None
        generation_round = GenerationRound(self.defers_logps(model), routes)
        trl_off = in_loss and self.settings.trl.sampler_correction
        with trl_sampler_correction_off() if trl_off else nullcontext():
            yield generation_round

    def finish_round(self, generation_round: GenerationRound, output: dict[str, Any]) -> None:
        """The step's generation batch `output`, as TRL returns it: its placeholders noted (filled after the split),
        the step's recorded experts put in it."""
        if self.old_logps == "none":  # TRL's placeholder: the sampler's log-probs are the old ones
            output.pop("old_per_token_logps", None)
        if generation_round.deferring:
            self.pending = tuple(key for key in DEFERRED_LOGPS if output.get(key) is not None)
        if generation_round.routes is not None:
            generation_round.routes.attach(output)

    @property
    def records_routes(self) -> bool:
        """Whether grpo_plus's generator records each completion token's experts (routing replay or its receipt)."""
        return self.routing is not None

    def placeholder(self, input_ids: torch.Tensor, logits_to_keep: int) -> tuple[torch.Tensor, None, None]:
        return torch.zeros((input_ids.shape[0], logits_to_keep), device=input_ids.device), None, None

    def fill_deferred(
        self,
        micro_batches: list[dict[str, Any]],
        model: torch.nn.Module,
        reference_model: Callable[[], AbstractContextManager[torch.nn.Module]],
    ) -> None:
        """Compute the old / reference log-probs of a generation batch just split into `micro_batches`, with the
        policy `model` and the model `reference_model()` yields (TRL's reference, set up as TRL sets it up)."""
        pending, self.pending = self.pending, ()
        with torch.no_grad(), disable_gradient_checkpointing(model, self.settings.trl.gradient_checkpointing_kwargs):
            for inputs in micro_batches:
                if "old_per_token_logps" in pending:
                    inputs["old_per_token_logps"] = self.micro_batch_logps(model, inputs, False).logps
                if "ref_per_token_logps" in pending:
                    with reference_model() as ref_model:
                        inputs["ref_per_token_logps"] = self.micro_batch_logps(ref_model, inputs, False).logps

    def old_logps_of_every_row(self, batch: dict[str, Any], batch_size: int, model: torch.nn.Module) -> torch.Tensor:
        """The no-grad old-log-prob pass TRL runs at generation under its vLLM correction (the policy `model`, every
        row of the generation batch `batch`, `batch_size` rows per call, its image inputs), for a correction that needs
        the old log-probs where TRL computed none (on-policy training) and cannot take them from the training forward
        (`correction_in_loss_blocker`): padding and shared prompts saved, rows not."""
        input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        model_inputs = {key: batch[key] for key in FORWARD_INPUT_KEYS if batch.get(key) is not None}
        with torch.no_grad(), disable_gradient_checkpointing(model, self.settings.trl.gradient_checkpointing_kwargs):
            logps, _, _ = self.logps_and_entropies(
                model, input_ids, attention_mask, batch["completion_ids"].size(1), batch_size=batch_size,
                routes=batch.get(ROUTES_KEY), **model_inputs,
            )  # fmt: skip
        return logps

    # ---- TRL's `_get_per_token_logps_and_entropies` --------------------------------------------------------------

    def logps_and_entropies(
        self,
        model,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None = None,
        compute_entropy: bool = False,
        compute_aux_loss: bool = False,
        routes: torch.Tensor | None = None,
        route_tally: RouteTally | None = None,
        generation_round: GenerationRound | None = None,
        **model_inputs,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """TRL's `_get_per_token_logps_and_entropies` (same arguments, same result) without the padding after the
        completions and, where the model allows it, with each shared prompt computed once (a VLM: each prompt's images
        encoded once); TRL's method (`trl_logps`) computes the rest. Called by TRL inside its generation step
        (`generation_round`, where it defers them) its no-grad passes get placeholders. `routes` (B, `logits_to_keep`,
        layers, k): the sampler's experts of the completion columns (routing replay: each forward of them routes there;
        `route_tally` counts the flips)."""
        if generation_round is not None:
            if generation_round.deferring and not torch.is_grad_enabled():
                return self.placeholder(input_ids, logits_to_keep)
            if generation_round.routes is not None:
                generation_round.routes.check_pass(routes)
        trl_full = functools.partial(
            self.trl_logps,
            model,
            batch_size=batch_size,
            compute_entropy=compute_entropy,
            compute_aux_loss=compute_aux_loss,
        )

        def full(ids, attention, width, **extra):
            if routes is None or self.routing is None:
                return trl_full(ids, attention, width, **extra)
            plan = completion_plan(fit_routes(routes, width), ids.shape[1] - width)
            with self.routing.planned(model, plan, route_tally):
                return trl_full(ids, attention, width, **extra)

        images = self.row_images(model_inputs, input_ids.shape[0], "the padding and the shared prompt")
        if not self.enabled or self.dropout_blocker(model) is not None or isinstance(images, tuple):
            self.positions += input_ids.numel()
            self.images += sum(model_inputs.get("num_tiles") or model_inputs.get("num_images") or [])
            return full(input_ids, attention_mask, logits_to_keep, **model_inputs)

        prompt_width = input_ids.shape[1] - logits_to_keep
        if self.shared_prompt:
            reason = self.shared_prompt_blocker(
                model, input_ids, attention_mask, prompt_width, compute_aux_loss, images
            )
            if reason is None:
                packed = self.shared_prompt_logps(
                    model, input_ids, attention_mask, logits_to_keep, batch_size, images, compute_aux_loss,
                    routes, route_tally,
                )  # fmt: skip
                if packed is not None:
                    logps, entropies, aux_loss = packed
                    return logps, entropies if compute_entropy else None, aux_loss
            else:
                self.note_fallback("the shared prompt", reason)
        width = completion_width(attention_mask[:, prompt_width:])
        end = prompt_width + width
        self.positions += input_ids.shape[0] * end
        extra = {} if images is None else images.select(None, slice(0, end))
        self.images += 0 if images is None else images.image_count()
        logps, entropies, aux_loss = full(input_ids[:, :end], attention_mask[:, :end], width, **extra)
        pad = functools.partial(torch.nn.functional.pad, pad=(0, logits_to_keep - width))
        return pad(logps), None if entropies is None else pad(entropies), aux_loss

    def shared_prompt_blocker(
        self, model, input_ids, attention_mask, prompt_width, compute_aux_loss, images: RowImages | None = None
    ) -> str | None:
        gap = version_gap("shared_prompt")
        if gap is not None:
            return gap
        if not has_fused_lm_head():  # above the floor: a TRL release that moved its fused LM head
            return f"TRL {trl.__version__} has no fused LM head to score packed rows"
        if compute_aux_loss and not is_moe(self.accelerator.unwrap_model(model).config):
            return "the router aux loss is asked of a model that declares no experts to weigh it over"
        if compute_aux_loss and (gap := version_gap("moe_router_logits")) is not None:
            return gap
        if prompt_width == 0 or not bool(attention_mask[:, prompt_width - 1].all()):
            return "some prompt does not end in its last column (prompts are not left-padded)"
        config = self.accelerator.unwrap_model(model).config
        text_config = config.get_text_config()
        families = SHARED_PROMPT_FAMILIES
        if text_config is config and images is not None:
            return f"the batch has inputs {', '.join(images.inputs)} and {config.model_type!r} is a text model"
        if text_config is not config:  # a vision-language model, with or without images in this batch
            reason = shared_prompt_vlm_blocker(config, input_ids[:, :prompt_width])
            if reason is not None:
                return reason
            families = vlm_text_families(config)
        attention = getattr(text_config, "_attn_implementation", None)
        return shared_prompt_blocker(text_config, attention, input_ids.shape[1], families)

    def mask_free_allowed(self, model) -> bool:
        """Whether rows may run without a mask: not in float32 with grouped-query heads, where transformers then asks
        SDPA for grouped-query attention, which on CUDA only the flash kernel takes, and flash needs fp16 / bf16 (it
        would fall back to the math kernel, every [query x key] score in memory; with a mask it repeats the key /
        value heads and takes the memory-efficient kernel, as in TRL's forward)."""
        config = model.config.get_text_config()
        heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None)
        half = self.settings.trl.half_precision or model.dtype in (torch.bfloat16, torch.float16)
        return half or kv_heads in (None, heads)

    def shared_prompt_logps(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size, images=None, compute_aux_loss=False,
        routes=None, route_tally=None,
    ):  # fmt: skip
        """Log-probs, entropies and (`compute_aux_loss`) the router's load-balancing loss with one prompt copy per pack
        (and, with `images`, each pack's prompt images encoded once); None where packing does not pay. The loss is
        TRL's exactly: every position of the packs is routed, each weighed by the tokens of TRL's forward it stands
        for (a shared prompt position by the completions sharing it), each completion's last token packed too."""
        prompt_width = input_ids.shape[1] - logits_to_keep
        accelerator = self.accelerator
        unwrapped = accelerator.unwrap_model(model)
        eager = unwrapped.config.get_text_config()._attn_implementation == "eager"
        with_images = images is not None and images.has_images
        # MoE: the model's own load-balancing loss would read the 4D block mask as a 2D one; it is computed here
        router_off = {"output_router_logits": False} if is_moe(unwrapped.config) else {}
        experts = expert_counts(unwrapped.config)
        positions = rope_positions(unwrapped, input_ids, attention_mask, images) if with_images else None
        blocks = bidirectional_blocks(unwrapped.config, images) if images is not None else None

        def model_forward(batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
            self.positions += batch.positions
            if batch.mask_free:  # one row per pack, no gap: causal attention is TRL's masked attention
                block_mask = None
            else:
                block_mask = additive_mask(batch.block_mask, unwrapped.dtype) if eager else batch.block_mask
            position_ids = batch.position_ids if positions is None else positions[:, batch.origin[0], batch.origin[1]]
            extra = images.model_inputs(batch.prompt_rows) if with_images else {}
            self.images += images.image_count(batch.prompt_rows) if with_images else 0
            recording = recorded_router_logits(unwrapped) if compute_aux_loss else nullcontext()
            replaying = nullcontext()
            if routes is not None and self.routing is not None:  # each packed completion position: its row's record
                plan = packed_plan(routes, batch.origin, prompt_width, ~batch.padding)
                replaying = self.routing.planned(model, plan, route_tally)
            with accelerator.autocast(), recording as router_logits, replaying:
                logps, entropies = fused_lm_head_forward(
                    model, batch.input_ids, block_mask, position_ids, batch.targets, **extra, **router_off
                )
            if not compute_aux_loss:
                return logps, entropies, None
            return logps, entropies, weighted_load_balancing_loss(router_logits, batch.router_weights, *experts)

        return shared_prompt_logps(
            model_forward,
            input_ids,
            attention_mask,
            logits_to_keep,
            batch_size,
            hidden_size=unwrapped.config.get_text_config().hidden_size,
            pad_token_id=self.settings.trl.pad_token_id or 0,
            unshared_positions=input_ids.shape[0]
            * (prompt_width + completion_width(attention_mask[:, prompt_width:])),
            mask_free=self.mask_free_allowed(unwrapped),
            row_keys=images.row_keys().to(input_ids.device) if with_images else None,
            prompt_blocks=None if blocks is None else blocks[:, :prompt_width],
            through_last_token=compute_aux_loss,
        )
