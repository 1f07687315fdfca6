"""GRPOTrainer: TRL's trainer with grpo_plus's capabilities wired in.

Each override is a few lines that call the module holding the capability: the objective (`objective`), what the
published algorithms need around it (`algorithms`), verl's rollout correction of the sampler/trainer mismatch
(`sampler_mismatch`), the zero-waste pass (`zero_waste`, `train_pass`), zero-waste generation (`generation`), dynamic
sampling (`sampling`), selective rollout (`selective_rollout`), crashes and resuming (`faults`, `checkpoints`,
`training_state`), input checks (`validation`, `distributed`). Everything else
(TRL's generation around `model.generate`, vLLM, reward functions, PEFT, logging, checkpoints) is TRL's own code. Loss
types grpo_plus does not aggregate itself (cispo, sapo, luspo, vespo) run through TRL's `_compute_loss`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from pathlib import Path
from typing import Any

import torch
import trl
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .algorithms.estimators import KLCoefficient, estimator_inputs, greedy_rewards, local_advantages
from .algorithms.loss_metrics import log_loss_metrics
from .algorithms.rollout_correction import (
    OnPolicyCorrection,
    RolloutCorrector,
    TRLSamplerCorrection,
    sampler_blocker,
    sampler_logps,
)
from .compat.bitsandbytes import keep_4bit_trainable_on_cpu
from .compat.loss import (
    TRL_NATIVE_LOSS_TYPES,
    TRL_SCALE_REWARDS,
    entropy_bonus,
    logps_unavailable_reason,
    policy_weights,
    split_tensor_dict,
)
from .compat.model import environment_routing, uses_continuous_batching
from .compat.rewards import get_soft_overlong_punishment, is_async_callable
from .compat.versions import TRLCompatibilityError, check_trl_compatibility
from .config import PlusSettings
from .engine.precision import engine_precision, sleep_mode_blocker
from .engine.receipt import SyncReceipt, log_receipts
from .engine.server import server_client, server_sync
from .engine.sync import reload_on_sync
from .fit.check import check_before_training
from .long_completions.lm_head_tiles import size_lm_head_tiles
from .long_completions.offloading import training_step_context
from .long_completions.tiled_mlp import tile_mlps
from .objective import combine_rewards, compute_policy_loss
from .rewards.runner import RewardRunner
from .run.checkpoints import hide_local_base_model_path, without_hub_token
from .run.distributed import check_launch, whole_model_for_generation
from .run.faults import CrashCheckpoint, finish_without_training, prepare_resume
from .run.health import TrainingHealthError as TrainingHealthError  # re-exported: what health_check="stop" raises
from .run.health import TrainingHealthGuard
from .run.state import TrainingState, carry_running_loss, stateful_parts
from .run.validation import RewardFunctionError as RewardFunctionError  # re-exported: grpo_plus.trainer's error type
from .run.validation import check_dataset, guard_reward_funcs
from .sampling.dynamic_sampling import DynamicSampling, shuffle_groups
from .sampling.selective_rollout import SelectiveRollout
from .zero_waste.generation import generate_patched, generation_blocker
from .zero_waste.multi_turn import TurnCache
from .zero_waste.training_pass import ZeroWastePass

logger = logging.getLogger(__name__)


class GRPOTrainer(trl.GRPOTrainer):
    """Drop-in for `trl.GRPOTrainer`: same arguments, same numbers for TRL's modes, plus grpo_plus's modes."""

    def __init__(self, model, reward_funcs=None, args: trl.GRPOConfig | None = None, *pos_args, **kwargs):
        check_trl_compatibility()  # an untested TRL warns; a changed private method fails here, not mid-training
        # The run's settings, checked once: those GRPOConfig built (a plain trl.GRPOConfig: built here); TRL gets the
        # config with its own fields canonical (PlusSettings.trl_config), the user's object unchanged.
        # (no config: TRL builds its default one, whose settings are the defaults)
        self.plus = plus = PlusSettings.from_config(args) if args is not None else PlusSettings()
        if args is not None and (reason := sleep_mode_blocker(args)) is not None:  # before TRL starts vLLM
            raise ValueError(reason)
        # Before TRL loads the model: the reward workers fork from a process that holds little (grpo_plus.rewards)
        self._reward_runner = RewardRunner(plus.rewards, reward_funcs)
        try:
            # the colocated engine's precision (a 4-bit base: not TRL's "bitsandbytes"); a server reached over the
            # transport it reports (grpo_plus.engine.server: gloo off CUDA)
            with engine_precision(args, plus.vllm.quantization, plus.vllm.dtype), server_client(args):
                super().__init__(model, reward_funcs, plus.trl_config(args), *pos_args, **kwargs)
        except BaseException:
            self._reward_runner.close()
            raise
        check_launch(self.accelerator.distributed_type.value, self.accelerator.num_processes)
        unavailable = logps_unavailable_reason(self.accelerator.device.type)
        if unavailable is not None:  # fail now, not with TRL's AttributeError at the first training step
            raise TRLCompatibilityError(f"grpo_plus cannot train here: {unavailable}.")
        prompt_required, environment_names = environment_routing(self)
        # what TRL's first step would fail on (no prompt, no environment to route to, no rows): fail now
        check_dataset(self.train_dataset, prompt_required=prompt_required, environment_names=environment_names)
        has_rollout_func = getattr(self, "rollout_func", None) is not None
        if self.plus.rollout.active and (reason := sampler_blocker(self.use_vllm, has_rollout_func)):
            raise ValueError(f"grpo_plus cannot correct this sampler: {reason}.")
        if self.use_vllm:  # weights reach the colocated engine through vLLM's reload, LoRA merged out of place
            self._sync_weights_checked()
        self.dual_clip = self.plus.algorithms.dual_clip
        self._kl_coefficient = KLCoefficient(self.beta, self.plus.algorithms)
        keep_4bit_trainable_on_cpu(self.model)
        self._rewards_per_func: torch.Tensor | None = None  # the last round's rewards, gathered from all processes
        self._dynamic_sampling = DynamicSampling.for_dataset(
            self.plus.dynamic_sampling, self.train_dataset, self.num_generations, seed=self.args.seed + 1
        )
        self._selective_rollout = SelectiveRollout.for_dataset(
            self.plus.selective_rollout, self.train_dataset, self.args.seed, self.shuffle_dataset
        )
        self._selective_draw = None  # the draw whose completions are being generated and scored
        self._turn_cache: TurnCache | None = (
            None  # the caches of a round's tool turns (grpo_plus.zero_waste.multi_turn)
        )
        self.reward_funcs = guard_reward_funcs(self.reward_funcs, self.reward_func_names, is_async_callable)
        self.reward_funcs = self._reward_runner.wrap(self.reward_funcs, self.reward_func_names)
        if (overlong := self.plus.overlong).buffer_length is not None:
            punishment = get_soft_overlong_punishment(self.max_completion_length, overlong.buffer_length)
            self._add_reward(punishment, weight=overlong.penalty)
        rollout, zero_waste = self.plus.rollout, self.plus.zero_waste
        self._zero_waste = ZeroWastePass(
            self, zero_waste.training_pass, zero_waste.shared_prompt, zero_waste.exact_entropy,
            old_logps=rollout.old_logps_source, row_skip_blocker=rollout.row_skip_blocker(),
            correction_blocker=rollout.in_loss_blocker(),
        )  # fmt: skip
        trained_rows_only = self._zero_waste.row_skip_blocker is None
        self._rollout_correction = RolloutCorrector(rollout, self.plus.algorithms.policy_loss, trained_rows_only)
        trl_correction = TRLSamplerCorrection(
            self.vllm_importance_sampling_mode,
            self.vllm_importance_sampling_clip_min,
            self.vllm_importance_sampling_clip_max,
        )
        self._on_policy_correction = OnPolicyCorrection(self._rollout_correction, trl_correction, trained_rows_only)
        parts = functools.partial(stateful_parts, self)  # looked up when used: every part a feature adds counts
        self._training_state = TrainingState(parts, self.accelerator.process_index, self.accelerator.num_processes)
        self._crash_checkpoint = CrashCheckpoint(self, parts)
        self.add_callback(self._training_state)
        self.add_callback(self._crash_checkpoint)
        self._health = TrainingHealthGuard(self.plus.health)  # reads each log; with "stop", ends train() (below)
        self.add_callback(self._health)
        self._long_completions_setup()

    # ---- long completions: offloading, tiled MLP, the fit check (grpo_plus.long_completions.offloading, tiled_mlp, fit) ----------------

    def _long_completions_setup(self) -> None:
        policy = self.accelerator.unwrap_model(self.model)
        device = self.accelerator.device
        long_completions = self.plus.long_completions
        settings = {
            "tiled_mlp_tokens": long_completions.tiled_mlp_tokens,
            "activation_offloading": long_completions.activation_offloading,
        }
        if self.plus.fit.check != "off" and device.type == "cuda":  # fit_check="auto" may turn more on: logged there
            counted = check_before_training(self.args, policy, self.train_dataset, self.processing_class, device,
                                            self.plus.fit.check, self.plus)  # fmt: skip
            settings |= counted.turned_on if counted is not None else {}
        if settings["tiled_mlp_tokens"]:
            tile_mlps(policy, settings["tiled_mlp_tokens"])
        size_lm_head_tiles(policy, long_completions.lm_head_tile_columns)
        self._offload_step = training_step_context(self.model, device, settings["activation_offloading"])

    def training_step(self, *args, **kwargs):
        with self._offload_step:  # as TRL's SFTTrainer wraps its training step (activation_offloading)
            return super().training_step(*args, **kwargs)

    def _sync_weights_checked(self) -> None:
        """Every sync into the colocated engine through vLLM's reload, checked as `vllm_sync_check` says (grpo_plus.engine:
        the probe's forward runs on the whole model, under the trainer's autocast, after the stream)."""
        if self.vllm_generation.mode == "server":  # the server loads the weights: the LoRA stream, coverage checks
            server_sync(self.vllm_generation, sync_check=self.plus.vllm.sync_check)
            return
        reload_on_sync(
            self.vllm_generation,
            sync_check=self.plus.vllm.sync_check,
            inference=functools.partial(whole_model_for_generation, self.model, self, gather=True),
            autocast=self.accelerator.autocast,
            on_receipt=self._log_sync_receipt,
        )

    def _log_sync_receipt(self, receipt: SyncReceipt) -> None:
        """A checked weight sync's figures, logged with the step that generates from it (`vllm_sync/*`)."""
        log_receipts([receipt], self._metrics["train" if self.model.training else "eval"])

    def _add_reward(self, reward_func, weight: float) -> None:
        """Append a reward function the way TRL registers its own extra reward sources."""
        self.reward_funcs.append(reward_func)
        self.reward_func_names.append(getattr(reward_func, "__name__", type(reward_func).__name__))
        self.reward_processing_classes.append(None)
        self.reward_weights = torch.cat([self.reward_weights, torch.tensor([weight], dtype=torch.float32)])

    # ---- training, checkpoints, crashes (grpo_plus.run.faults) -----------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs):
        """TRL's train; `resume_from_checkpoint=True` (or "true"/"last" from a CLI) picks the newest checkpoint in
        output_dir that is complete and undamaged. A checkpoint already at the last step returns without training; an
        error or Ctrl-C writes the last completed step as a checkpoint (grpo_plus.run.faults)."""
        resume_from_checkpoint = prepare_resume(self, resume_from_checkpoint)
        if resume_from_checkpoint:
            if (finished := finish_without_training(self, resume_from_checkpoint)) is not None:
                return finished
            self._training_state.restore_from(resume_from_checkpoint)  # what transformers does not restore
        try:
            output = super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
        except (Exception, KeyboardInterrupt):
            self._crash_checkpoint.save()
            raise
        finally:
            self._reward_runner.stop_workers()  # a later evaluate() or train() forks them again
        self._health.raise_if_stopped()  # health_check="stop": the step's checkpoint is saved, the run ends here
        return output

    def _maybe_log_save_evaluate(self, tr_loss, *args, **kwargs):
        carry_running_loss(self, tr_loss)  # transformers 4.x: a loss restored from inside a logging window
        # After the optimizer step, before it is logged and saved: the adaptive KL coefficient moves once per step.
        self._kl_coefficient.end_step(lambda t: self.accelerator.reduce(t, reduction="sum"), self._metrics["train"])
        super()._maybe_log_save_evaluate(tr_loss, *args, **kwargs)
        self._crash_checkpoint.step_finished()  # the state a checkpoint of this step holds, for a crash checkpoint

    def _save(self, output_dir: str | None = None, state_dict=None):
        with without_hub_token(self.args):  # training_args.bin is a pickle of args: no token in it
            super()._save(output_dir, state_dict)
        if self.args.should_save:
            base_model = getattr(self.accelerator.unwrap_model(self.model).config, "_name_or_path", "")
            hide_local_base_model_path(output_dir or self.args.output_dir, base_model)

    def _save_checkpoint(self, model, trial):
        # Written before TRL/transformers write the checkpoint, whose trainer_state.json (written last) marks it
        # complete: a complete checkpoint always holds the training state its step left behind.
        folder = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        self._training_state.save(folder, self.args.should_save, self.accelerator.wait_for_everyone)
        super()._save_checkpoint(model, trial)

    # ---- generation, rewards, advantages ---------------------------------------------------------------------------

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        # TRL gathers the rewards of all processes here; keep them so our normalizer sees every group whole.
        self._rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        # the reward runner's rewards/<name>/timeouts, /errors, /seconds, from every process (grpo_plus.rewards)
        sink = self._metrics["train" if self.model.training else "eval"]
        self._reward_runner.log_metrics(sink, self.accelerator.gather, self.accelerator.device)
        return self._rewards_per_func

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        selective = self._selective_rollout is not None and self.model.training
        if selective:
            inputs = self._draw_selective_inputs(len(inputs))
        output = self._score_round(inputs)
        if self._dynamic_sampling is not None and self.model.training:
            output = self._keep_informative_groups(inputs, output)
        if selective:
            for name, value in self._selective_rollout.end_batch().items():
                self._metrics["train"][f"selective_rollout/{name}"].append(value)
        in_loss = self._zero_waste.correction_in_loss  # on-policy: the sampler correction from the training forward
        if self._rollout_correction.decoupled and not in_loss:
            output = self._correct_generation_batch(output)
        parts = self.args.steps_per_generation if self.model.training else 1  # the micro-batches it is split into
        self._on_policy_correction.start(parts if in_loss else None)
        return output

    # ---- verl's rollout correction (grpo_plus.algorithms.rollout_correction) ----------------------------------------------------

    def _correct_generation_batch(self, output: dict[str, Any]) -> dict[str, Any]:
        """Decoupled mode: the old log-probs of every row (TRL's, else one no-grad pass), the IS weights and the mask
        after rejection over every process's generation batch, its metrics logged."""
        training = self.model.training
        batch_size = self.args.per_device_train_batch_size if training else self.args.per_device_eval_batch_size
        accelerator = self.accelerator
        return self._rollout_correction.correct_generation_batch(
            output,
            old_logps_pass=lambda: self._zero_waste.old_logps_of_every_row(output, batch_size),
            gather_rows=self._gather_rows,
            process_index=accelerator.process_index,
            count_tokens=lambda mask: accelerator.gather(mask.sum()).sum(),
            metrics=self._metrics["train" if training else "eval"],
        )

    def _gather_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """(B, T) rows of every process, padded to the widest, stacked in process order."""
        return self.accelerator.gather(self.accelerator.pad_across_processes(rows, dim=1))

    def _score_round(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """TRL's generation and scoring, with the advantages recomputed by grpo_plus's normalizer."""
        normalizer = self.scale_rewards
        if normalizer not in TRL_SCALE_REWARDS:
            self.scale_rewards = "group"  # TRL's inline advantage code rejects other names; we replace its result
        try:
            with self._zero_waste.generation_step() as record_placeholders, self._tool_turns():
                output = super()._generate_and_score_completions(inputs)
                record_placeholders(output)
        finally:
            self.scale_rewards = normalizer
        if self._selective_draw is not None and self.model.training:  # the history learns from every round
            self._selective_rollout.record(self._selective_draw, self._round_rewards(), self.num_generations)
            self._selective_draw = None
        if self.multi_objective_aggregation == "sum_then_normalize":
            output["advantages"] = self._round_advantages(inputs, output)
        return output

    def _round_advantages(self, inputs: list[dict[str, Any]], output: dict[str, Any]) -> torch.Tensor:
        """The estimator's advantages from every process's rewards (grpo_plus.algorithms.estimators), this process's rows."""
        algorithms, start = self.plus.algorithms, self.accelerator.process_index * len(inputs)
        needed = estimator_inputs(algorithms, output, self.accelerator.gather, lambda: self._greedy_rewards(inputs))
        num_generations = self.num_generations if self.model.training else self.num_generations_eval
        return local_advantages(
            self._round_rewards(), num_generations, self.scale_rewards, algorithms.advantage_estimator,
            self._logs["advantages"], slice(start, start + len(inputs)), output["completion_ids"].shape[1], **needed,
        )  # fmt: skip

    def _round_rewards(self) -> torch.Tensor:
        """The last round's weighted rewards, every process's completions, NaN where no function scored."""
        return combine_rewards(self._rewards_per_func, self.reward_weights)

    def _greedy_rewards(self, inputs: list[dict[str, Any]]) -> torch.Tensor:
        """ReMax's baseline (grpo_plus.algorithms.estimators.greedy_rewards), scored by TRL's own `_calculate_rewards`."""
        mode = "train" if self.model.training else "eval"
        num_generations = self.num_generations if mode == "train" else self.num_generations_eval
        return greedy_rewards(self, inputs, num_generations, super()._calculate_rewards, self._metrics[mode])

    def _prepare_inputs(self, generation_batch):
        if self._dynamic_sampling is not None and self.model.training:
            inputs = self._prepare_informative_inputs(generation_batch)
        else:
            inputs = super()._prepare_inputs(generation_batch)
        if self._zero_waste.pending:  # a new generation batch was just split into micro-batches
            self._zero_waste.fill_deferred(self._buffered_inputs if self.model.training else [inputs])
        return inputs

    # ---- dynamic sampling (DAPO, grpo_plus.sampling.dynamic_sampling) ---------------------------------------------------------------

    def _prepare_informative_inputs(self, generation_batch):
        """TRL's buffering, but shuffling whole groups so no micro-batch holds part of a group."""
        steps_per_generation = self.args.steps_per_generation
        if self._step % (steps_per_generation * self.num_iterations) == 0 or self._buffered_inputs is None:
            batch = shuffle_groups(self._generate_and_score_completions(generation_batch), self.num_generations)
            self._buffered_inputs = split_tensor_dict(batch, steps_per_generation)
        return self._buffered_inputs[self._step % steps_per_generation]

    def _keep_informative_groups(self, inputs: list[dict[str, Any]], first_round: dict[str, Any]) -> dict[str, Any]:
        """Drop zero-variance groups, generating more prompts until this batch is full or the round limit hits."""
        device = self.accelerator.device
        output, stats = self._dynamic_sampling.collect(
            first_round,
            wanted=len(inputs) // self.num_generations,
            process_index=self.accelerator.process_index,
            round_rewards=self._round_rewards,
            next_round=lambda: self._score_round(self._draw_refill_inputs(len(inputs))),
            fewest_across_processes=lambda n: int(self.accelerator.gather(torch.tensor([n], device=device)).min()),
            loss_tokens_across_processes=lambda mask: self.accelerator.gather(mask.sum()).sum(),
            pad_token_id=self._tokenizer.pad_token_id,
            micro_batches=self.args.steps_per_generation,
        )
        per_step = self.args.steps_per_generation * self.num_iterations / self.current_gradient_accumulation_steps
        self._dynamic_sampling.log(stats, self._metrics["train"], per_step, self.accelerator.num_processes)
        return output

    def _draw_refill_inputs(self, num_rows: int) -> list[dict[str, Any]]:
        """This process's slice of a fresh draw of prompts, each repeated num_generations times."""
        if self._selective_rollout is not None:
            return self._draw_selective_inputs(num_rows)
        prompts_per_draw = num_rows // self.num_generations * self.accelerator.num_processes
        return self._local_rows(self._dynamic_sampling.refill_rows(prompts_per_draw), num_rows)

    def _local_rows(self, rows: list[int], num_rows: int) -> list[dict[str, Any]]:
        """This process's `num_rows` dataset rows of a draw that spans all processes."""
        start = self.accelerator.process_index * num_rows
        return [self.train_dataset[i] for i in rows[start : start + num_rows]]

    # ---- selective rollout (GRESO, grpo_plus.sampling.selective_rollout) ------------------------------------------------------
    # Every process holds the same history (it is updated from the rewards TRL gathers from all processes) and draws
    # the same global batch, then takes its slice.

    def _draw_selective_inputs(self, num_rows: int) -> list[dict[str, Any]]:
        """Replace a generation round's prompts with a selective draw (predicted-dead prompts skipped, the round
        kept full); the dataset row index is the prompt's identity, so reward functions see the rows unchanged."""
        num_prompts = num_rows * self.accelerator.num_processes // self.num_generations
        self._selective_draw = self._selective_rollout.draw(num_prompts)
        return self._local_rows(self._selective_draw.rows(self.num_generations), num_rows)

    # ---- zero-waste generation (grpo_plus.zero_waste.generation) -------------------------------------------------------------

    @contextlib.contextmanager
    def _tool_turns(self):
        """A round of TRL's generation; with tools, its tool turns continue each row's cache instead of prefilling
        the history again (grpo_plus.zero_waste.multi_turn): TRL's tool loop calls `_generate_single_turn` once per turn."""
        self._turn_cache = TurnCache() if getattr(self, "tools", None) and self.plus.zero_waste.generation else None
        try:
            yield
        finally:
            self._turn_cache = None

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, *args, **kwargs):
        """TRL's generation, its `model.generate` call prefilling each distinct prompt once (a tool turn: only what
        the previous turn did not compute; image prompts: each image encoded once) and decoding only unfinished rows
        (grpo_plus.zero_waste.generation) where that samples what transformers' own loop samples."""
        trl_generation = functools.partial(super()._generate_single_turn, prompt_ids, images, multimodal_fields)
        if not self.plus.zero_waste.generation:
            return trl_generation(*args, **kwargs)
        reason = generation_blocker(use_vllm=self.use_vllm, continuous_batching=uses_continuous_batching(self))
        if reason is not None:
            self._zero_waste.note_fallback("generation", reason)
            return trl_generation(*args, **kwargs)
        model = self.accelerator.unwrap_model(self.model_wrapped)
        metrics = self._metrics["train" if self.model.training else "eval"]
        num_images = None if images is None else [len(row) if row else 0 for row in images]
        record = functools.partial(self._zero_waste.record_generation, metrics=metrics)
        with generate_patched(model, record, self._turn_cache, num_images):
            return trl_generation(*args, **kwargs)

    # ---- the zero-waste pass (grpo_plus.zero_waste.training_pass) -----------------------------------------------------------------

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
        """TRL's log-probs (entropies, aux loss), computing only what the zero-waste pass cannot skip. Also serves
        TRL's no-grad old / reference passes (with placeholders, filled after the micro-batch split)."""
        full = functools.partial(
            super()._get_per_token_logps_and_entropies,
            model,
            batch_size=batch_size,
            compute_entropy=compute_entropy,
            compute_aux_loss=compute_aux_loss,
        )
        return self._zero_waste.logps_and_entropies(
            full, model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
            model_inputs,
        )  # fmt: skip

    # ---- loss (grpo_plus.objective) -------------------------------------------------------------------------------

    def _compute_loss(self, model, inputs):
        if self.loss_type in TRL_NATIVE_LOSS_TYPES:
            return super()._compute_loss(model, inputs)

        mode = "train" if self.model.training else "eval"
        mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
        advantages = inputs["advantages"]
        advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
        correction = self._rollout_correction
        if correction.bypass:  # the sampler's log-probs are the old ones (rows left out of the forward keep them)
            inputs = {**inputs, "old_per_token_logps": torch.nan_to_num(sampler_logps(inputs), nan=0.0)}
        policy = self._zero_waste.policy_forward(model, inputs, self._metrics[mode])
        logps, entropies = policy.logps, policy.entropies
        correction_weights = None
        if self._on_policy_correction.active:  # the sampler correction from this forward: no old-log-prob pass ran
            inputs, corrected = self._on_policy_correction.loss_inputs(
                logps, inputs, mask, policy.computed_rows, self.accelerator.gather, self._gather_rows,
                self._metrics[mode],
            )  # fmt: skip
            old_logps, correction_weights, mask = corrected.old_logps, corrected.weights, corrected.mask
        elif correction.active:  # verl's IS weights and rejection (grpo_plus.algorithms.rollout_correction)
            reduce_sum = functools.partial(self.accelerator.reduce, reduction="sum")
            corrected = correction.loss_inputs(
                logps, inputs, mask, policy.computed_rows, reduce_sum, self._metrics[mode]
            )
            old_logps, correction_weights, mask = corrected.old_logps, corrected.weights, corrected.mask
        else:
            old_logps = inputs.get("old_per_token_logps")
            old_logps = logps.detach() if old_logps is None else old_logps

        entropy_mask, weights = policy_weights(self, inputs, advantages, logps, old_logps, entropies, mask)
        if correction_weights is not None:
            weights = correction_weights if weights is None else weights * correction_weights

        accumulation_steps = self.current_gradient_accumulation_steps if mode == "train" else 1
        num_items = inputs["num_items_in_batch"]
        if mode == "train":  # TRL's count spans the generation batch; rescale it to one accumulation window
            num_items = num_items * accumulation_steps / self.args.steps_per_generation
        algorithms = self.plus.algorithms
        out = compute_policy_loss(
            logps,
            old_logps,
            advantages,
            mask,
            loss_type=self.loss_type,
            importance_sampling_level=self.importance_sampling_level,
            policy_loss=algorithms.policy_loss,
            kl_estimator=algorithms.kl_estimator,
            policy_loss_options=algorithms.policy_loss_options,
            epsilon=self.epsilon_low,
            epsilon_high=self.epsilon_high,
            delta=self.args.delta,
            dual_clip=self.dual_clip,
            beta=self._kl_coefficient.value,
            ref_logps=inputs.get("ref_per_token_logps"),
            use_bias_correction_kl=self.args.use_bias_correction_kl,
            max_completion_length=self.max_completion_length,
            num_items_in_batch=num_items,
            num_processes=self.accelerator.num_processes,
            gradient_accumulation_steps=accumulation_steps,
            policy_weights=weights,
        )
        loss = out.loss
        if mode == "train":
            self._kl_coefficient.record(out)
        if self._entropy_bonus_enabled:
            loss = loss - entropy_bonus(self, entropies, mask if entropy_mask is None else mask * entropy_mask, mode)
            # TRL logs grpo/bnpo/dr_grpo's policy loss before the 1/S accumulation scaling, dapo's as is.
            policy_loss = out.loss.detach() * (1 if self.loss_type == "dapo" else accumulation_steps)
            self._metrics[mode]["policy_loss"].append(self.accelerator.gather(policy_loss).nanmean().item())
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * policy.aux_loss / accumulation_steps
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(policy.aux_loss).mean().item())
        log_loss_metrics(
            self._metrics[mode], self.accelerator, out, entropies, policy.trained_rows, policy.entropies_of_every_row
        )
        return loss
