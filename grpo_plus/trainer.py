"""GRPOTrainer: TRL's trainer with the policy loss and the advantages routed through grpo_plus's core.

Everything else (generation incl. vLLM, reward functions, PEFT, logging, checkpoints) is TRL's own code.
Loss types TRL implements and grpo_plus does not (cispo, sapo, luspo, vespo) run through TRL's `_compute_loss`.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import trl
from datasets import IterableDataset
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .advantages import compute_advantages
from .checkpoints import hide_local_base_model_path, without_hub_token
from .config import TRL_NATIVE_LOSS_TYPES, validate_grpo_settings
from .distributed import check_launch
from .faults import (
    CrashCheckpoint,
    finish_without_training,
    load_sampling_state,
    prepare_resume,
    save_sampling_state,
)
from .losses import (
    IMPORTANCE_SAMPLERS,
    LOSS_TYPES,
    ZERO_ADVANTAGE_ROWS_CONTRIBUTE_NOTHING,
    PolicyLossOutput,
    compute_policy_loss,
)
from .quantization import keep_4bit_trainable_on_cpu
from .sampling import concat_rows, group_rows, informative_groups, refill_prompts, select_rows, shuffle_groups
from .selective_rollout import SelectiveRollout, SelectiveRolloutSettings
from .train_pass import (
    PackedBatch,
    additive_mask,
    completion_width,
    dropout_blocker,
    forward_rows,
    row_skip_blocker,
    rows_with_gradient,
    shared_prompt_blocker,
    shared_prompt_logps,
)
from .trl_compat import FORWARD_INPUT_KEYS as _FORWARD_INPUT_KEYS
from .trl_compat import (
    TRLCompatibilityError,
    check_trl_compatibility,
    disable_gradient_checkpointing,
    get_soft_overlong_punishment,
    has_fused_lm_head,
    is_async_callable,
    logps_unavailable_reason,
    nanmax,
    nanmin,
    reference_model,
    split_tensor_dict,
)
from .validation import RewardFunctionError as RewardFunctionError  # re-exported: grpo_plus.trainer's error type
from .validation import check_dataset, guard_reward_funcs

logger = logging.getLogger(__name__)
# Generation-batch keys whose no-grad log-prob passes grpo_plus computes after the micro-batch split (see
# `_fill_deferred_logps`).
DEFERRED_LOGPS = ("old_per_token_logps", "ref_per_token_logps")


def combine_rewards(rewards_per_func: torch.Tensor, reward_weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum over reward functions ignoring NaN; NaN where every function returned None (TRL's rule)."""
    rewards = (rewards_per_func * reward_weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
    rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
    return rewards


@dataclass
class PolicyForward:
    """The training forward of one micro-batch, in TRL's (B, T) layout."""

    logps: torch.Tensor
    entropies: torch.Tensor
    aux_loss: torch.Tensor | None
    computed_rows: torch.Tensor | None  # (B,) bool when the zero-waste pass skipped rows, else None


class GRPOTrainer(trl.GRPOTrainer):
    """Drop-in for `trl.GRPOTrainer`: same arguments, same numbers for TRL's modes, plus grpo_plus's modes."""

    def __init__(self, model, reward_funcs=None, args: trl.GRPOConfig | None = None, *pos_args, **kwargs):
        check_trl_compatibility()  # an untested TRL warns; a changed private method fails here, not mid-training
        if args is not None:
            validate_grpo_settings(args)  # also accepts a plain trl.GRPOConfig
        super().__init__(model, reward_funcs, args, *pos_args, **kwargs)
        check_launch(self.accelerator.distributed_type.value, self.accelerator.num_processes)
        unavailable = logps_unavailable_reason(self.accelerator.device.type)
        if unavailable is not None:  # fail now, not with TRL's AttributeError at the first training step
            raise TRLCompatibilityError(f"grpo_plus cannot train here: {unavailable}.")
        self.dual_clip = getattr(self.args, "dual_clip", None)
        keep_4bit_trainable_on_cpu(self.model)
        self._rewards_per_func: torch.Tensor | None = None
        self.dynamic_sampling = getattr(self.args, "dynamic_sampling", False)
        self._refill_draws, self._refill_draws_made = None, 0  # the count is checkpointed: a resume continues it
        if self.dynamic_sampling and isinstance(self.train_dataset, IterableDataset):
            raise ValueError("dynamic_sampling=True needs a map-style train_dataset to draw refill prompts from.")
        self._selective_rollout = self._make_selective_rollout()
        self._selective_draw = None  # the draw whose completions are being generated and scored
        check_dataset(self.train_dataset)  # no 'prompt' column or no rows: fail now, not at the first step
        self.reward_funcs = guard_reward_funcs(self.reward_funcs, self.reward_func_names, is_async_callable)
        self._crash_checkpoint = CrashCheckpoint(self)
        self.add_callback(self._crash_checkpoint)
        if getattr(self.args, "overlong_buffer_length", None) is not None:
            self._add_reward(
                get_soft_overlong_punishment(self.max_completion_length, self.args.overlong_buffer_length),
                weight=self.args.overlong_penalty,
            )
        self._zero_waste_notes: set[tuple[str, str]] = set()
        self._positions_computed = 0
        self._row_skip_blocker = self._find_row_skip_blocker()
        self._deferring = False  # inside TRL's generation step, handing out placeholders for old/ref log-probs
        self._pending_logps: tuple[str, ...] = ()  # keys of the generation batch still holding placeholders

    def _add_reward(self, reward_func, weight: float) -> None:
        """Append a reward function the way TRL registers its own extra reward sources."""
        self.reward_funcs.append(reward_func)
        self.reward_func_names.append(getattr(reward_func, "__name__", type(reward_func).__name__))
        self.reward_processing_classes.append(None)
        self.reward_weights = torch.cat([self.reward_weights, torch.tensor([weight], dtype=torch.float32)])

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs):
        """TRL's train; `resume_from_checkpoint=True` (or "true"/"last" from a CLI) picks the newest checkpoint in
        output_dir that is complete and undamaged. A checkpoint already at the last step returns without training; an
        error or Ctrl-C writes the last completed step as a checkpoint (grpo_plus.faults)."""
        resume_from_checkpoint = prepare_resume(self, resume_from_checkpoint)
        if resume_from_checkpoint:
            self._load_selective_rollout_state(resume_from_checkpoint)
            self._refill_draws, self._refill_draws_made = None, load_sampling_state(resume_from_checkpoint)
            if (finished := finish_without_training(self, resume_from_checkpoint)) is not None:
                return finished
        try:
            return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
        except (Exception, KeyboardInterrupt):
            self._crash_checkpoint.save()
            raise

    def _maybe_log_save_evaluate(self, *args, **kwargs):
        super()._maybe_log_save_evaluate(*args, **kwargs)
        self._crash_checkpoint.step_finished()  # the state a checkpoint of this step holds, for a crash checkpoint

    def _save(self, output_dir: str | None = None, state_dict=None):
        with without_hub_token(self.args):  # training_args.bin is a pickle of args: no token in it
            super()._save(output_dir, state_dict)
        if self.args.should_save:
            base_model = getattr(self.accelerator.unwrap_model(self.model).config, "_name_or_path", "")
            hide_local_base_model_path(output_dir or self.args.output_dir, base_model)

    # ---- advantages ---------------------------------------------------------------------------------------------

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        # TRL gathers the rewards of all processes here; keep them so our normalizer sees every group whole.
        self._rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        return self._rewards_per_func

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        selective = self._selective_rollout is not None and self.model.training
        if selective:
            inputs = self._draw_selective_inputs(len(inputs))
        output = self._score_round(inputs)
        if self.dynamic_sampling and self.model.training:
            output = self._keep_informative_groups(inputs, output)
        if selective:
            self._log_selective_batch()
        return output

    def _score_round(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """TRL's generation and scoring, with the advantages recomputed by grpo_plus's normalizer."""
        normalizer = self.scale_rewards
        if normalizer not in ("group", "batch", "none"):
            self.scale_rewards = "group"  # TRL's inline advantage code rejects other names; we replace its result
        self._deferring = self._defers_logps()
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self.scale_rewards, deferred, self._deferring = normalizer, self._deferring, False
        if deferred:
            self._pending_logps = tuple(k for k in DEFERRED_LOGPS if output.get(k) is not None)
        self._record_selective_round()
        if self.multi_objective_aggregation == "sum_then_normalize":
            output["advantages"] = self._local_advantages(len(inputs))
        return output

    def _local_advantages(self, local_batch_size: int) -> torch.Tensor:
        """Advantages from the gathered rewards, sliced to this process; the completions log gets them too."""
        mode = "train" if self.model.training else "eval"
        num_generations = self.num_generations if mode == "train" else self.num_generations_eval
        rewards = combine_rewards(self._rewards_per_func, self.reward_weights)
        advantages = compute_advantages(rewards, num_generations, self.scale_rewards)
        logged = self._logs["advantages"]
        for _ in range(min(len(advantages), len(logged))):
            logged.pop()
        logged.extend(advantages.tolist())
        start = self.accelerator.process_index * local_batch_size
        return advantages[start : start + local_batch_size]

    # ---- dynamic sampling (DAPO) --------------------------------------------------------------------------------

    def _prepare_inputs(self, generation_batch):
        if self.dynamic_sampling and self.model.training:
            inputs = self._prepare_informative_inputs(generation_batch)
        else:
            inputs = super()._prepare_inputs(generation_batch)
        if self._pending_logps:  # a new generation batch was just split into micro-batches
            self._fill_deferred_logps(self._buffered_inputs if self.model.training else [inputs])
        return inputs

    def _prepare_informative_inputs(self, generation_batch):
        """TRL's buffering, but shuffling whole groups so no micro-batch holds part of a group."""
        steps_per_generation = self.args.steps_per_generation
        if self._step % (steps_per_generation * self.num_iterations) == 0 or self._buffered_inputs is None:
            batch = shuffle_groups(self._generate_and_score_completions(generation_batch), self.num_generations)
            self._buffered_inputs = split_tensor_dict(batch, steps_per_generation)
        return self._buffered_inputs[self._step % steps_per_generation]

    def _keep_informative_groups(self, inputs: list[dict[str, Any]], first_round: dict[str, Any]) -> dict[str, Any]:
        """Drop zero-variance groups, generating more prompts until this batch is full or the round limit hits."""
        num_generations, wanted = self.num_generations, len(inputs) // self.num_generations
        process = self.accelerator.process_index
        kept, kept_groups, filtered, seen, rounds, batch = [], 0, 0, 0, 0, first_round
        while True:
            rounds += 1
            rewards = combine_rewards(self._rewards_per_func, self.reward_weights)
            informative = informative_groups(rewards, num_generations, self.args.dynamic_sampling_min_std)
            local = informative[process * wanted : (process + 1) * wanted]
            if rounds == 1:
                first_round_informative = informative.float().mean().item()
            kept.append(select_rows(batch, group_rows(local, num_generations)))
            kept_groups += int(local.sum())
            filtered, seen = filtered + int((~informative).sum()), seen + informative.numel()
            fewest = int(self.accelerator.gather(torch.tensor([kept_groups], device=self.accelerator.device)).min())
            if fewest >= wanted or rounds >= self.args.max_sampling_rounds:
                break
            batch = self._score_round(self._draw_refill_inputs(len(inputs)))

        # Every process trains the same number of whole groups, a multiple of the micro-batch count.
        usable = min(fewest, wanted)
        usable -= usable % self.args.steps_per_generation
        if usable == 0:  # nothing informative enough: train on the first round, as TRL would
            output = first_round
            trained_informative = first_round_informative
        else:
            trained_informative = 1.0
            output = concat_rows(kept, self._tokenizer.pad_token_id)
            output = {k: v[: usable * num_generations] for k, v in output.items()}
            loss_mask = output["completion_mask"] * output.get("tool_mask", 1)
            output["num_items_in_batch"] = self.accelerator.gather(loss_mask.sum()).sum()
        per_step = self.args.steps_per_generation * self.num_iterations / self.current_gradient_accumulation_steps
        metrics = self._metrics["train"]
        metrics["dynamic_sampling/rounds"].append(rounds)
        metrics["dynamic_sampling/generation_calls_per_step"].append(rounds / per_step)
        metrics["dynamic_sampling/groups_filtered"].append(filtered)
        metrics["dynamic_sampling/filtered_frac"].append(filtered / seen)
        metrics["dynamic_sampling/trained_groups"].append(usable * self.accelerator.num_processes)
        metrics["dynamic_sampling/short_batch"].append(float(usable < wanted))
        metrics["dynamic_sampling/trained_informative_frac"].append(trained_informative)
        return output

    def _draw_refill_inputs(self, num_rows: int) -> list[dict[str, Any]]:
        """This process's slice of a fresh draw of prompts, each repeated num_generations times."""
        if self._selective_rollout is not None:
            return self._draw_selective_inputs(num_rows)
        groups = num_rows // self.num_generations
        if self._refill_draws is None:
            self._refill_draws = refill_prompts(
                self.train_dataset, self.num_generations, groups * self.accelerator.num_processes, self.args.seed + 1
            )
            for _ in range(self._refill_draws_made):  # after a resume: where the checkpointed run stood
                next(self._refill_draws)
        self._refill_draws_made += 1
        return self._local_rows(next(self._refill_draws), num_rows)

    def _local_rows(self, rows: list[int], num_rows: int) -> list[dict[str, Any]]:
        """This process's `num_rows` dataset rows of a draw that spans all processes."""
        start = self.accelerator.process_index * num_rows
        return [self.train_dataset[i] for i in rows[start : start + num_rows]]

    # ---- selective rollout (GRESO) ------------------------------------------------------------------------------
    # The history and decisions live in grpo_plus/selective_rollout.py. Every process holds the same history (it is
    # updated from the rewards TRL gathers from all processes) and draws the same global batch, then takes its slice.

    def _make_selective_rollout(self) -> SelectiveRollout | None:
        if not getattr(self.args, "selective_rollout", False):
            return None
        if isinstance(self.train_dataset, IterableDataset) or not hasattr(self.train_dataset, "__len__"):
            raise ValueError("selective_rollout=True needs a map-style train_dataset (rows addressed by index).")
        return SelectiveRollout(
            len(self.train_dataset),
            SelectiveRolloutSettings.from_args(self.args),
            seed=self.args.seed,
            shuffle=self.shuffle_dataset,
        )

    def _draw_selective_inputs(self, num_rows: int) -> list[dict[str, Any]]:
        """Replace a generation round's prompts with a selective draw (predicted-dead prompts skipped, the round
        kept full); the dataset row index is the prompt's identity, so reward functions see the rows unchanged."""
        num_prompts = num_rows * self.accelerator.num_processes // self.num_generations
        self._selective_draw = self._selective_rollout.draw(num_prompts)
        return self._local_rows(self._selective_draw.rows(self.num_generations), num_rows)

    def _record_selective_round(self) -> None:
        """Feed the round's gathered rewards (all processes, draw order) to the history."""
        if self._selective_draw is None or not self.model.training:
            return
        rewards = combine_rewards(self._rewards_per_func, self.reward_weights)
        self._selective_rollout.record(self._selective_draw, rewards, self.num_generations)
        self._selective_draw = None

    def _log_selective_batch(self) -> None:
        metrics = self._metrics["train"]
        for name, value in self._selective_rollout.end_batch().items():
            metrics[f"selective_rollout/{name}"].append(value)

    def _save_checkpoint(self, model, trial):
        # Written before TRL/transformers write the checkpoint, whose trainer_state.json (written last) marks it
        # complete: a complete checkpoint always holds the history its step left behind.
        folder = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        if self._selective_rollout is not None and self.args.should_save:
            self._selective_rollout.save(folder)
        if self.dynamic_sampling and self.args.should_save:
            save_sampling_state(folder, refill_draws=self._refill_draws_made)
        super()._save_checkpoint(model, trial)

    def _load_selective_rollout_state(self, checkpoint: str) -> None:
        if self._selective_rollout is not None and not self._selective_rollout.load(checkpoint):
            logger.warning("%s holds no selective-rollout history: selective rollout starts afresh.", checkpoint)

    # ---- zero-waste training pass (grpo_plus.train_pass) ----------------------------------------------------------

    def _note_fallback(self, part: str, reason: str) -> None:
        """Say once per run which part of the zero-waste pass runs in full, and why."""
        if (part, reason) not in self._zero_waste_notes:
            self._zero_waste_notes.add((part, reason))
            logger.warning("Zero-waste pass: %s computed in full, because %s.", part, reason)

    def _find_row_skip_blocker(self) -> str | None:
        """None when zero-advantage rows may be left out of the training forward, else why not."""
        if not getattr(self.args, "zero_waste_pass", True):
            return "zero_waste_pass=False"
        if self.loss_type in TRL_NATIVE_LOSS_TYPES:
            reason = f"loss_type={self.loss_type!r} is computed by TRL's own _compute_loss"
        else:
            reason = row_skip_blocker(
                beta=self.beta,
                entropy_bonus=self._entropy_bonus_enabled,
                top_entropy_quantile=self.top_entropy_quantile,
                aux_loss=self.aux_loss_enabled,
                loss_type_declared=LOSS_TYPES.entry(self.loss_type).trait(
                    ZERO_ADVANTAGE_ROWS_CONTRIBUTE_NOTHING, False
                ),
                importance_sampling_declared=IMPORTANCE_SAMPLERS.entry(self.importance_sampling_level).trait(
                    ZERO_ADVANTAGE_ROWS_CONTRIBUTE_NOTHING, False
                ),
                loss_type=self.loss_type,
                importance_sampling_level=self.importance_sampling_level,
            )
        if reason is not None:
            self._note_fallback("zero-advantage rows", reason)
        return reason

    def _live_rows(self, model, inputs, advantages, mask) -> torch.Tensor | None:
        """(B,) bool of the rows the training forward must compute, or None for every row."""
        if self._row_skip_blocker is not None or any(inputs.get(key) is not None for key in _FORWARD_INPUT_KEYS):
            return None
        if self._dropout_blocker(model) is not None:
            return None
        return rows_with_gradient(advantages, mask)

    def _micro_batch_logps(self, model, inputs, compute_entropy: bool) -> PolicyForward:
        """Log-probs of one micro-batch, computing only rows that can carry gradient (the others get their old
        log-probs, so their ratio is 1, and entropy 0). The training forward and the deferred no-grad passes both
        come here, so equal weights give bit-equal log-probs (same rows, same packs)."""
        prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
        advantages = inputs["advantages"]
        live = self._live_rows(model, inputs, advantages.reshape(advantages.shape[0], -1), mask)
        old = inputs.get("old_per_token_logps")
        fill = old.detach() if old is not None else torch.zeros(mask.shape, device=mask.device)
        forward = functools.partial(
            self._get_per_token_logps_and_entropies,
            model,
            compute_entropy=compute_entropy,
            compute_aux_loss=self.aux_loss_enabled,
            **{key: inputs.get(key) for key in _FORWARD_INPUT_KEYS},
        )
        bridge = slice(prompt_ids.size(1) - 1, prompt_ids.size(1) + 1)
        logps, entropies, aux_loss = forward_rows(
            forward, input_ids, attention_mask, completion_ids.size(1), live, fill, bridge
        )
        return PolicyForward(logps, entropies, aux_loss, None if live is None or bool(live.all()) else live)

    def _policy_forward(self, model, inputs) -> PolicyForward:
        """The micro-batch's training forward, with the zero-waste metrics."""
        self._positions_computed = 0
        policy = self._micro_batch_logps(model, inputs, compute_entropy=True)
        mode = "train" if self.model.training else "eval"
        metrics = self._metrics[mode]
        rows = 1.0 if policy.computed_rows is None else policy.computed_rows.float().mean().item()
        metrics["zero_waste/rows_computed_frac"].append(rows)
        full_positions = inputs["prompt_ids"].numel() + inputs["completion_ids"].numel()
        metrics["zero_waste/positions_frac"].append(self._positions_computed / full_positions)
        return policy

    # TRL computes old / reference log-probs inside `_generate_and_score_completions`, before the rewards and before
    # it shuffles the generation batch into micro-batches. grpo_plus defers them to right after that split and
    # computes them micro-batch by micro-batch through `_micro_batch_logps`, the training forward's own code: the
    # same weights then give bit-equal log-probs (TRL's ratio of exactly 1 and KL of exactly 0 at the reference),
    # rows without gradient are skipped there too, and every process makes one model call per micro-batch and pass.

    def _defers_logps(self) -> bool:
        return (
            getattr(self.args, "zero_waste_pass", True)
            and not self.use_vllm
            and self._dropout_blocker(self.model) is None
        )

    def _fill_deferred_logps(self, micro_batches: list[dict[str, Any]]) -> None:
        """Compute the old / reference log-probs TRL's generation step left to grpo_plus (placeholders)."""
        pending, self._pending_logps = self._pending_logps, ()
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            for inputs in micro_batches:
                if "old_per_token_logps" in pending:
                    inputs["old_per_token_logps"] = self._micro_batch_logps(self.model, inputs, False).logps
                if "ref_per_token_logps" in pending:
                    with reference_model(self) as ref_model:
                        inputs["ref_per_token_logps"] = self._micro_batch_logps(ref_model, inputs, False).logps

    def _dropout_blocker(self, model) -> str | None:
        reason = dropout_blocker(self.accelerator.unwrap_model(model))
        if reason is not None:
            self._note_fallback("the zero-waste pass (rows, padding, shared prompt)", reason)
        return reason

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **model_inputs,
    ):
        """TRL's log-probs (entropies, aux loss), without the padding after the completions and, where the model
        allows it, with each shared prompt computed once (zero-waste pass). Also serves TRL's old/ref passes."""
        if self._deferring and not torch.is_grad_enabled():  # an old/ref pass of TRL's generation step: see above
            placeholder = torch.zeros((input_ids.shape[0], logits_to_keep), device=input_ids.device)
            return placeholder, None, None
        full = functools.partial(
            super()._get_per_token_logps_and_entropies,
            model,
            batch_size=batch_size,
            compute_entropy=compute_entropy,
            compute_aux_loss=compute_aux_loss,
            **model_inputs,
        )
        if not getattr(self.args, "zero_waste_pass", True) or self._dropout_blocker(model) is not None:
            self._positions_computed += input_ids.numel()
            return full(input_ids, attention_mask, logits_to_keep)
        if any(value is not None for value in model_inputs.values()):
            self._note_fallback("the padding and the shared prompt", "the batch has multimodal inputs")
            self._positions_computed += input_ids.numel()
            return full(input_ids, attention_mask, logits_to_keep)

        prompt_width = input_ids.shape[1] - logits_to_keep
        if getattr(self.args, "zero_waste_shared_prompt", True):
            reason = self._shared_prompt_blocker(model, input_ids, attention_mask, prompt_width, compute_aux_loss)
            if reason is None:
                packed = self._shared_prompt_logps(model, input_ids, attention_mask, logits_to_keep, batch_size)
                if packed is not None:
                    logps, entropies = packed
                    return logps, entropies if compute_entropy else None, None
            else:
                self._note_fallback("the shared prompt", reason)
        width = completion_width(attention_mask[:, prompt_width:])
        end = prompt_width + width
        self._positions_computed += input_ids.shape[0] * end
        logps, entropies, aux_loss = full(input_ids[:, :end], attention_mask[:, :end], width)
        pad = functools.partial(torch.nn.functional.pad, pad=(0, logits_to_keep - width))
        return pad(logps), None if entropies is None else pad(entropies), aux_loss

    def _shared_prompt_blocker(self, model, input_ids, attention_mask, prompt_width, compute_aux_loss) -> str | None:
        if not has_fused_lm_head():
            return f"TRL {trl.__version__} has no fused LM head to score packed rows (TRL >= 1.15 has)"
        if compute_aux_loss:
            return "the router aux loss is taken over every row's tokens"
        if prompt_width == 0 or not bool(attention_mask[:, prompt_width - 1].all()):
            return "some prompt does not end in its last column (prompts are not left-padded)"
        config = self.accelerator.unwrap_model(model).config
        return shared_prompt_blocker(config, getattr(config, "_attn_implementation", None), input_ids.shape[1])

    def _shared_prompt_logps(self, model, input_ids, attention_mask, logits_to_keep, batch_size):
        """Log-probs and entropies with one prompt copy per pack; None when a chunk has no token to score."""
        unwrapped = self.accelerator.unwrap_model(model)
        eager = unwrapped.config._attn_implementation == "eager"

        def model_forward(batch: PackedBatch):
            self._positions_computed += batch.positions
            block_mask = additive_mask(batch.block_mask, unwrapped.dtype) if eager else batch.block_mask
            with self.accelerator.autocast():
                out = model(
                    input_ids=batch.input_ids,
                    attention_mask=block_mask,
                    position_ids=batch.position_ids,
                    shift_labels=batch.targets,
                    fused_lm_head=True,
                )
            return out.log_probs, out.entropy

        return shared_prompt_logps(
            model_forward,
            input_ids,
            attention_mask,
            logits_to_keep,
            batch_size,
            hidden_size=unwrapped.config.get_text_config().hidden_size,
            pad_token_id=self._tokenizer.pad_token_id or 0,
        )

    # ---- loss ---------------------------------------------------------------------------------------------------

    def _compute_loss(self, model, inputs):
        if self.loss_type in TRL_NATIVE_LOSS_TYPES:
            return super()._compute_loss(model, inputs)

        mode = "train" if self.model.training else "eval"
        completion_mask = inputs["completion_mask"]
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        advantages = inputs["advantages"]
        advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
        old_per_token_logps = inputs.get("old_per_token_logps")
        policy = self._policy_forward(model, inputs)
        per_token_logps, entropies, aux_loss = policy.logps, policy.entropies, policy.aux_loss
        old_per_token_logps = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps

        entropy_mask = None
        if self.top_entropy_quantile < 1.0:
            entropy_mask = self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)
        policy_weights = self._policy_weights(inputs, advantages, per_token_logps, old_per_token_logps, mask)
        if entropy_mask is not None:
            policy_weights = entropy_mask if policy_weights is None else policy_weights * entropy_mask
        if self.use_vllm and self.vllm_importance_sampling_correction:
            ratio = inputs["importance_sampling_ratio"]
            policy_weights = ratio if policy_weights is None else policy_weights * ratio

        accumulation_steps = self.current_gradient_accumulation_steps if mode == "train" else 1
        num_items = inputs["num_items_in_batch"]
        if mode == "train":  # TRL's count spans the generation batch; rescale it to one accumulation window
            num_items = num_items * accumulation_steps / self.args.steps_per_generation

        out = compute_policy_loss(
            per_token_logps,
            old_per_token_logps,
            advantages,
            mask,
            loss_type=self.loss_type,
            importance_sampling_level=self.importance_sampling_level,
            epsilon=self.epsilon_low,
            epsilon_high=self.epsilon_high,
            delta=self.args.delta,
            dual_clip=self.dual_clip,
            beta=self.beta,
            ref_logps=inputs.get("ref_per_token_logps"),
            use_bias_correction_kl=self.args.use_bias_correction_kl,
            max_completion_length=self.max_completion_length,
            num_items_in_batch=num_items,
            num_processes=self.accelerator.num_processes,
            gradient_accumulation_steps=accumulation_steps,
            policy_weights=policy_weights,
        )
        loss = out.loss
        if self._entropy_bonus_enabled:
            effective_mask = mask if entropy_mask is None else mask * entropy_mask
            loss = loss - self._entropy_bonus(entropies, effective_mask, accumulation_steps, mode)
            # TRL logs grpo/bnpo/dr_grpo's policy loss before the 1/S accumulation scaling, dapo's as is.
            policy_loss = out.loss.detach() * (1 if self.loss_type == "dapo" else accumulation_steps)
            self._metrics[mode]["policy_loss"].append(self.accelerator.gather(policy_loss).nanmean().item())
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation_steps
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())
        self._log_loss_metrics(out, entropies, mode, policy.computed_rows)
        return loss

    def _policy_weights(self, inputs, advantages, per_token_logps, old_per_token_logps, mask):
        """TRL's off-policy sequence mask (DeepSeek-V3.2) as a multiplier on the policy term, or None."""
        if self.off_policy_mask_threshold is None:
            return None
        return self.get_off_policy_mask(
            advantages=advantages,
            per_token_logps=per_token_logps,
            sampling_per_token_logps=inputs.get("sampling_per_token_logps", old_per_token_logps),
            mask=mask,
            off_policy_threshold=self.off_policy_mask_threshold,
        )

    def _entropy_bonus(self, entropies, effective_mask, accumulation_steps, mode) -> torch.Tensor:
        """coef * mean token entropy, with TRL's static or adaptive (Skywork-OR1) coefficient."""
        entropy = (entropies * effective_mask).sum() / effective_mask.sum().clamp(min=1.0) / accumulation_steps
        if self.use_adaptive_entropy:
            coef = self.entropy_coef if self._last_world_entropy <= self.args.entropy_target else 0.0
        else:
            coef = self.entropy_coef
        if self.use_adaptive_entropy and mode == "train":
            self._update_adaptive_entropy(entropies, effective_mask)
        if mode == "train" and self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
        return coef * entropy

    def _update_adaptive_entropy(self, entropies, effective_mask) -> None:
        stats = torch.stack([(entropies * effective_mask).sum(), effective_mask.sum()]).detach()
        window = self._entropy_window_stats
        self._entropy_window_stats = stats if window is None else window + stats
        if not self.accelerator.sync_gradients:
            return
        totals = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
        world_entropy = (totals[0] / totals[1].clamp(min=1.0)).item()
        if world_entropy <= self.args.entropy_target:
            self.entropy_coef = min(self.entropy_coef + self.args.entropy_coef_delta, self.args.entropy_coef_max)
        else:
            self.entropy_coef = max(self.entropy_coef - self.args.entropy_coef_delta, self.args.entropy_coef_min)
        self._last_world_entropy = world_entropy
        self._entropy_window_stats = None

    def _log_loss_metrics(
        self,
        out: PolicyLossOutput,
        entropies: torch.Tensor,
        mode: str,
        computed_rows: torch.Tensor | None = None,
    ) -> None:
        """TRL's metric names (global means over processes) plus grpo_plus's.

        With rows skipped by the zero-waste pass, `entropy` and `ratio/mean` average the computed rows; the clip
        fractions still count every row (a zero-advantage row is never clipped, in TRL as here).
        """
        metrics = self._metrics[mode]
        totals = out.metric_totals()
        if computed_rows is not None:
            totals["ratio/mean"] = out.total(out.importance_weights, computed_rows)
        totals["entropy"] = out.total(entropies, computed_rows)
        names = list(totals)
        reduced = self.accelerator.reduce(torch.stack([totals[n].float() for n in names]), reduction="sum")
        computed_only = ("entropy", "ratio/mean") if computed_rows is not None else ()
        for name, (total, count) in zip(names, reduced.tolist(), strict=True):
            if name in computed_only and count == 0:  # every row skipped: nothing to average
                metrics[name].append(float("nan"))
            else:
                metrics[name].append(total / max(count, 1.0))
        low, high = out.sequence_clip_fractions()
        metrics["clip_ratio/low_min"].append(nanmin(self.accelerator.gather(low.float())).item())
        metrics["clip_ratio/high_max"].append(nanmax(self.accelerator.gather(high.float())).item())
