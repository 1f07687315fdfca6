"""GRPOTrainer: TRL's trainer with grpo_plus's capabilities wired in.

Each override is a few lines that call the concern folder holding the capability: the micro-batch loss around the
objective, the published algorithms and verl's rollout correction (`algorithms`), the zero-waste pass and generation
(`zero_waste`), speculative rollouts (`speculative`), partial rollouts (`partial_rollouts`), dynamic sampling and
selective rollout (`sampling`), long completions (`long_completions`), crashes, resuming and input checks (`run`), the
vLLM engine (`engine`), the reward runner (`rewards`); what TRL resolved and TRL's private protocols are read through
`compat`. Each helper gets what it needs, not the trainer. Everything else (TRL's generation around `model.generate`,
vLLM, reward functions, PEFT, logging, checkpoints) is TRL's own code. Loss types grpo_plus does not aggregate itself
(cispo, sapo, luspo, vespo) run through TRL's `_compute_loss`."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from pathlib import Path
from typing import Any

import torch
import trl
from accelerate.utils import gather_object
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .algorithms.estimators import KLCoefficient, estimator_inputs, greedy_rewards, local_advantages
from .algorithms.micro_batch_loss import MicroBatchLoss
from .algorithms.rollout_correction import OnPolicyCorrection, RolloutCorrector, sampler_blocker
from .async_generation import AsyncGeneration, PromptLookahead, trainer_blocker
from .compat.bitsandbytes import keep_4bit_trainable_on_cpu
from .compat.loss import (
    TRL_NATIVE_LOSS_TYPES,
    TRL_SCALE_REWARDS,
    logps_unavailable_reason,
    trl_logps_and_entropies,
    trl_loss_methods,
    trl_sampler_correction_off,
    trl_training_settings,
)
from .compat.model import (
    completion_eos_token_ids,
    environment_routing,
    greedy_completions,
    reference_model,
    trl_pad_token_id,
    uses_continuous_batching,
)
from .compat.moe import experts_converted_on_resume, router_logits_off
from .compat.rewards import get_soft_overlong_punishment, is_async_callable
from .compat.versions import TRLCompatibilityError, check_trl_compatibility
from .config import PlusSettings
from .engine.precision import engine_precision, sleep_mode_blocker
from .engine.receipt import SyncReceipt, log_receipts
from .engine.server import server_client, server_sync
from .engine.speculation import engine_speculation
from .engine.sync import reload_on_sync
from .fit.check import memory_settings
from .long_completions.lm_head_tiles import size_lm_head_tiles
from .long_completions.offloading import training_step_context
from .long_completions.tiled_mlp import tile_mlps
from .objective import combine_rewards
from .partial_rollouts import PartialRollouts, chunk_decoder, engine_chunk_decoder, partial_rollouts_blocker
from .rewards.runner import RewardRunner
from .run.checkpoints import hide_local_base_model_path, without_hub_token
from .run.distributed import check_launch, gather_rows, whole_model_for_generation
from .run.faults import CrashCheckpoint, finish_without_training, prepare_resume
from .run.health import TrainingHealthError as TrainingHealthError  # re-exported: what health_check="stop" raises
from .run.health import TrainingHealthGuard
from .run.state import TrainingState, carry_running_loss, stateful_parts
from .run.validation import RewardFunctionError as RewardFunctionError  # re-exported: grpo_plus.trainer's error type
from .run.validation import check_dataset, guard_reward_funcs
from .sampling.dynamic_sampling import DynamicSampling
from .sampling.rounds import BatchLayout, buffered_by_group, generation_batch
from .sampling.selective_rollout import SelectiveRollout
from .speculative import SpeculativeDecoder
from .zero_waste.generation import generate_patched, generation_blocker
from .zero_waste.multi_turn import TurnCache
from .zero_waste.training_pass import GenerationRound, PassSettings, ZeroWastePass

logger = logging.getLogger(__name__)


class GRPOTrainer(trl.GRPOTrainer):
    """Drop-in for `trl.GRPOTrainer`: same arguments, same numbers for TRL's modes, plus grpo_plus's modes."""

    def __init__(self, model, reward_funcs=None, args: trl.GRPOConfig | None = None, *pos_args, **kwargs):
        check_trl_compatibility()  # an untested TRL warns; a changed private method fails here, not mid-training
        # The run's settings, checked once: those GRPOConfig built (a plain trl.GRPOConfig: built here; none: TRL's
        # default one, the defaults); TRL gets the config with its own fields canonical (PlusSettings.trl_config).
        self.plus = plus = PlusSettings.from_config(args) if args is not None else PlusSettings()
        if args is not None and (reason := sleep_mode_blocker(args)) is not None:  # before TRL starts vLLM
            raise ValueError(reason)
        # Before TRL loads the model: the reward workers fork from a process that holds little (grpo_plus.rewards)
        self._reward_runner = RewardRunner(plus.rewards, reward_funcs)
        try:
            # the colocated engine's precision (a 4-bit base: not TRL's "bitsandbytes") and speculative decoding; a
            # server reached over the transport it reports (grpo_plus.engine.server: gloo off CUDA)
            with (
                engine_precision(args, plus.vllm.quantization, plus.vllm.dtype, plus.vllm.block_size),
                engine_speculation(args, plus.vllm.speculative_config), server_client(args),
            ):  # fmt: skip
                super().__init__(model, reward_funcs, plus.trl_config(args), *pos_args, **kwargs)
        except BaseException:
            self._reward_runner.close()
            raise
        check_launch(self.accelerator.distributed_type.value, self.accelerator.num_processes)
        if (unavailable := logps_unavailable_reason(self.accelerator.device.type)) is not None:  # not at the 1st step
            raise TRLCompatibilityError(f"grpo_plus cannot train here: {unavailable}.")
        prompt_required, environment_names = environment_routing(self)
        # what TRL's first step would fail on (no prompt, no environment to route to, no rows): fail now
        check_dataset(self.train_dataset, prompt_required=prompt_required, environment_names=environment_names)
        reports_logps, has_rollout_func = self.use_vllm or plus.partial_rollouts.enabled, self.rollout_func is not None
        if self.plus.rollout.active and (reason := sampler_blocker(reports_logps, has_rollout_func)):
            raise ValueError(f"grpo_plus cannot correct this sampler: {reason}.")
        if self.use_vllm:  # weights reach the colocated engine through vLLM's reload, LoRA merged out of place
            self._sync_weights_checked()
        self._async_generation = self._start_async_generation() if plus.async_generation.enabled else None
        self._partial_rollouts = self._start_partial_rollouts() if plus.partial_rollouts.enabled else None
        self._kl_coefficient = KLCoefficient(self.beta, self.plus.algorithms)
        keep_4bit_trainable_on_cpu(self.model)
        self._rewards_per_func: torch.Tensor | None = None  # the last round's rewards, gathered from all processes
        self._dynamic_sampling = DynamicSampling.for_dataset(
            self.plus.dynamic_sampling, self.train_dataset, self.num_generations, seed=self.args.seed + 1)  # fmt: skip
        self._selective_rollout = SelectiveRollout.for_dataset(
            self.plus.selective_rollout, self.train_dataset, self.args.seed, self.shuffle_dataset)  # fmt: skip
        self._turn_cache: TurnCache | None = None  # a round's tool-turn caches (grpo_plus.zero_waste.multi_turn)
        self._generation_round: GenerationRound | None = None  # inside TRL's generation step, handed to the pass
        # the decoding loop handed to grpo_plus's generator (grpo_plus.speculative), or None
        self._speculation = SpeculativeDecoder(plus.speculative) if plus.speculative.enabled else None
        self._batch_layout = BatchLayout(  # a generation batch's groups and micro-batches (grpo_plus.sampling.rounds)
            self.num_generations, self.args.steps_per_generation, self.num_iterations, trl_pad_token_id(self)
        )
        self.reward_funcs = guard_reward_funcs(self.reward_funcs, self.reward_func_names, is_async_callable)
        self.reward_funcs = self._reward_runner.wrap(self.reward_funcs, self.reward_func_names)
        if (overlong := self.plus.overlong).buffer_length is not None:
            punishment = get_soft_overlong_punishment(self.max_completion_length, overlong.buffer_length)
            self._add_reward(punishment, weight=overlong.penalty)
        self._wire_training_pass()
        if (reason := self._zero_waste.routing_blocker(self.model)) is not None:  # grpo_plus.routing
            raise ValueError(f"routing_replay / routing_receipt cannot follow this model's experts: {reason}.")
        parts = functools.partial(stateful_parts, self)  # looked up when used: every part a feature adds counts
        self._training_state = TrainingState(parts, self.accelerator.process_index, self.accelerator.num_processes)
        self._crash_checkpoint = CrashCheckpoint(self, parts)
        self._health = TrainingHealthGuard(self.plus.health)  # reads each log; with "stop", ends train() (below)
        for callback in (self._training_state, self._crash_checkpoint, self._health):
            self.add_callback(callback)
        self._long_completions_setup()

    def _wire_training_pass(self, **pass_settings) -> None:
        """The zero-waste pass, the sampler corrections and the micro-batch loss, each handed what it reads: the run's
        settings and what TRL resolved, built here once (`pass_settings` replace `PassSettings` fields: the pass a run
        built with them would have), TRL's methods as callables, the accelerator."""
        plus, rollout, trl_settings = self.plus, self.plus.rollout, trl_training_settings(self)
        settings = PassSettings(
            enabled=plus.zero_waste.training_pass, shared_prompt=plus.zero_waste.shared_prompt, trl=trl_settings,
            exact_entropy=plus.zero_waste.exact_entropy, old_logps=rollout.old_logps_source,
            row_skip_blocker=rollout.row_skip_blocker(), correction_blocker=rollout.in_loss_blocker(),
            policy_loss=plus.algorithms.policy_loss, routing=plus.routing.mode,
        )  # fmt: skip
        settings = dataclasses.replace(settings, **pass_settings)
        accelerator = self.accelerator
        self._zero_waste = ZeroWastePass(settings, trl_logps_and_entropies(self), accelerator)
        trained_rows_only = self._zero_waste.row_skip_blocker is None
        self._rollout_correction = RolloutCorrector(rollout, plus.algorithms.policy_loss, trained_rows_only)
        on_policy = OnPolicyCorrection(self._rollout_correction, trl_settings.sampler, trained_rows_only)
        self._on_policy_correction = on_policy
        self._loss = MicroBatchLoss(
            trl_settings, trl_loss_methods(self), plus.algorithms, plus.algorithms.dual_clip, self._kl_coefficient,
            self._zero_waste, self._rollout_correction, on_policy, accelerator,
        )  # fmt: skip

    # ---- long completions: offloading, tiled MLP, the fit check (grpo_plus.long_completions, grpo_plus.fit) ----------

    def _long_completions_setup(self) -> None:
        policy, device = self.accelerator.unwrap_model(self.model), self.accelerator.device
        settings = memory_settings(self.args, policy, self.train_dataset, self.processing_class, device, self.plus)
        if settings["tiled_mlp_tokens"]:
            tile_mlps(policy, settings["tiled_mlp_tokens"])
        size_lm_head_tiles(policy, self.plus.long_completions.lm_head_tile_columns)
        self._offload_step = training_step_context(self.model, device, settings["activation_offloading"])

    def training_step(self, *args, **kwargs):
        # as TRL's SFTTrainer wraps its training step (activation_offloading); routing replay's hooks through backward
        with self._offload_step, self._zero_waste.routes_held(self.model):
            return super().training_step(*args, **kwargs)

    def _sync_weights_checked(self) -> None:
        """Every sync into the colocated engine through vLLM's reload, checked as `vllm_sync_check` says (grpo_plus.engine:
        the probe's forward runs on the whole model, under the trainer's autocast, after the stream)."""
        if self.vllm_generation.mode == "server":  # the server loads the weights: the LoRA stream, coverage checks
            server_sync(self.vllm_generation, sync_check=self.plus.vllm.sync_check)
            return
        reload_on_sync(
            self.vllm_generation, sync_check=self.plus.vllm.sync_check,
            inference=functools.partial(whole_model_for_generation, self.model, self, gather=True),
            autocast=self.accelerator.autocast, on_receipt=self._log_sync_receipt,
        )  # fmt: skip

    def _start_async_generation(self) -> AsyncGeneration:
        """The server generates ahead of the trainer (grpo_plus.async_generation), handed what it reads."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        if reason := trainer_blocker(
            self.accelerator.num_processes, self.accelerator.distributed_type.name, generate_every,
            self.args.gradient_accumulation_steps,
            bool(getattr(self, "tools", None)), getattr(self, "rollout_func", None) is not None,
        ):  # fmt: skip
            raise ValueError(reason)
        return AsyncGeneration(
            self.plus.async_generation, self.vllm_generation,
            PromptLookahead(self.get_train_dataloader, generate_every),
            tokenize=lambda prompts: self._tokenize_prompts(prompts)[0], gather=gather_object,
            global_step=lambda: self.state.global_step, training=lambda: self.model.training,
            metrics=lambda: self._metrics["train"], server_timeout=self.args.vllm_server_timeout,
            skip_data=not self.args.ignore_data_skip,
        ).install()  # fmt: skip

    def _start_partial_rollouts(self) -> PartialRollouts:
        """The pool of groups in flight (grpo_plus.partial_rollouts), handed what it reads, or ValueError."""
        tools, rollout_func = bool(getattr(self, "tools", None)), getattr(self, "rollout_func", None) is not None
        why = generation_blocker(use_vllm=False, continuous_batching=uses_continuous_batching(self))  # its generator
        if reason := partial_rollouts_blocker(self.accelerator, self.args, tools, rollout_func, why):
            raise ValueError(reason)
        reader = PromptLookahead(self.get_train_dataloader, self.args.steps_per_generation * self.num_iterations)
        decode = (engine_chunk_decoder(self._generate_single_turn, self.vllm_generation) if self.use_vllm  # either mode
                  else chunk_decoder(self._generate_single_turn, self.generation_config, self.num_generations))  # fmt: skip
        return PartialRollouts(self.plus.partial_rollouts, self.num_generations, self.max_completion_length,
            completion_eos_token_ids(self), reader, lambda prompts: self._tokenize_prompts(prompts)[0], decode,
            skip_data=not self.args.ignore_data_skip, num_processes=self.accelerator.num_processes)  # fmt: skip

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
    _load_from_checkpoint = experts_converted_on_resume()  # an MoE's experts, saved per expert (grpo_plus.compat.moe)

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
            if self._async_generation is not None:  # the batches asked for beyond the last step: the server free
                self._async_generation.finish_requests(raise_errors=False)
        except (Exception, KeyboardInterrupt):
            self._crash_checkpoint.save()
            raise
        finally:
            self._reward_runner.stop_workers()  # a later evaluate() or train() forks them again
            if self._async_generation is not None:  # its request thread holds nothing past the run
                self._async_generation.close()
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
        if self._async_generation is not None:  # the batches asked for ahead are kept whole (async_generation)
            self._async_generation.finish_requests(raise_errors=False)
        self._training_state.save(folder, self.args.should_save, self.accelerator.wait_for_everyone)
        super()._save_checkpoint(model, trial)

    # ---- generation, rewards, advantages ---------------------------------------------------------------------------

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        # TRL gathers the rewards of all processes here; keep them so our normalizer sees every group whole.
        self._rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        sink = self._metrics["train" if self.model.training else "eval"]  # rewards/<name>/timeouts, ... (rewards)
        self._reward_runner.log_metrics(sink, self.accelerator.gather, self.accelerator.device)
        return self._rewards_per_func

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        dynamic, selective, partial = self._dynamic_sampling, self._selective_rollout, self._partial_rollouts
        if self.model.training and partial is not None:  # the groups the pool completed (grpo_plus.partial_rollouts)
            handoff = partial.generation_batch(inputs, self.state.global_step, self._metrics["train"])
            with partial.handing_over(handoff):
                output = self._score_round(handoff.inputs)
        elif self.model.training and (dynamic is not None or selective is not None):  # grpo_plus.sampling.rounds
            output = generation_batch(
                inputs, self._score_round, self._round_rewards, self.train_dataset, self._batch_layout, dynamic,
                selective, self.accelerator, self.current_gradient_accumulation_steps, self._metrics["train"],
            )  # fmt: skip
        else:
            output = self._score_round(inputs)
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
        training, accelerator = self.model.training, self.accelerator
        batch_size = self.args.per_device_train_batch_size if training else self.args.per_device_eval_batch_size
        return self._rollout_correction.correct_generation_batch(
            output, old_logps_pass=lambda: self._zero_waste.old_logps_of_every_row(output, batch_size, self.model),
            gather_rows=functools.partial(gather_rows, accelerator), process_index=accelerator.process_index,
            count_tokens=lambda mask: accelerator.gather(mask.sum()).sum(),
            metrics=self._metrics["train" if training else "eval"],
        )  # fmt: skip

    def _score_round(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """TRL's generation and scoring, with the advantages recomputed by grpo_plus's normalizer."""
        normalizer = self.scale_rewards
        if normalizer not in TRL_SCALE_REWARDS:
            self.scale_rewards = "group"  # TRL's inline advantage code rejects other names; we replace its result
        try:
            trl_correction_off = functools.partial(trl_sampler_correction_off, self)
            # an MoE config with output_router_logits=True generates with them off (transformers' loss fails there)
            generation = self._zero_waste.generation_step(self.model, trl_correction_off)
            with generation as generation_round, self._tool_turns(), router_logits_off(self.model):
                self._generation_round = generation_round  # TRL calls our overrides inside: they hand it on
                output = super()._generate_and_score_completions(inputs)
                self._zero_waste.finish_round(generation_round, output)
        finally:
            self.scale_rewards, self._generation_round = normalizer, None
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
        """ReMax's baseline (grpo_plus.algorithms.estimators.greedy_rewards): TRL's own generation, greedy, scored by
        TRL's own `_calculate_rewards`."""
        mode = "train" if self.model.training else "eval"
        num_generations = self.num_generations if mode == "train" else self.num_generations_eval
        return greedy_rewards(
            inputs, num_generations, functools.partial(greedy_completions, self), super()._calculate_rewards,
            self.reward_weights, self._metrics[mode], self.state,
        )  # fmt: skip

    def _prepare_inputs(self, generation_batch):
        if self._dynamic_sampling is not None and self.model.training:  # micro-batches of whole groups (sampling)
            generate = functools.partial(self._generate_and_score_completions, generation_batch)
            self._buffered_inputs = buffered_by_group(self._step, self._buffered_inputs, generate, self._batch_layout)
            inputs = self._buffered_inputs[self._step % self.args.steps_per_generation]
        else:
            inputs = super()._prepare_inputs(generation_batch)
        if self._zero_waste.pending:  # a new generation batch was just split into micro-batches
            micro_batches = self._buffered_inputs if self.model.training else [inputs]
            self._zero_waste.fill_deferred(micro_batches, self.model, functools.partial(reference_model, self))
        return inputs

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

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, *args, chunk=None, **kwargs):
        """TRL's generation, its `model.generate` call prefilling each distinct prompt once (a tool turn: only what
        the previous turn did not compute; image prompts: each image encoded once) and decoding only unfinished rows
        (grpo_plus.zero_waste.generation) where that samples what transformers' own loop samples. `chunk`: a partial
        rollout's (its tokens' sampler log-probs, the step's kept caches); a handoff is replayed (partial_rollouts)."""
        if self._partial_rollouts is not None and self._partial_rollouts.handing is not None:
            return self._partial_rollouts.handing.replay(prompt_ids)
        trl_generation = functools.partial(super()._generate_single_turn, prompt_ids, images, multimodal_fields)
        if not self.plus.zero_waste.generation:
            return trl_generation(*args, **kwargs)
        reason = generation_blocker(use_vllm=self.use_vllm, continuous_batching=uses_continuous_batching(self))
        if (speculation := self._speculation) is not None and reason is not None:
            speculation.note(reason)
        if reason is not None:
            self._zero_waste.note_fallback("generation", reason)
            return trl_generation(*args, **kwargs)
        model = self.accelerator.unwrap_model(self.model_wrapped)
        metrics = self._metrics["train" if self.model.training else "eval"]
        num_images = None if images is None else [len(row) if row else 0 for row in images]
        generation_round = self._generation_round  # None outside TRL's generation step (ReMax's greedy baseline)

        def record(stats) -> None:
            self._zero_waste.record_generation(stats, metrics, generation_round)
            if speculation is not None:
                speculation.record(stats, metrics)
            if chunk is not None:
                chunk.record(stats)

        with generate_patched(
            model, record, self._turn_cache if chunk is None else chunk.turns, num_images, speculation,
            self._zero_waste.records_routes, record_logps=chunk is not None,
        ):  # fmt: skip
            return trl_generation(*args, **kwargs)

    # ---- the zero-waste pass (grpo_plus.zero_waste.training_pass) -----------------------------------------------------------------

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        """TRL's log-probs (entropies, aux loss), computing only what the zero-waste pass cannot skip, for TRL's callers
        (its no-grad old / reference passes get placeholders, filled after the micro-batch split; its own loss types)."""
        return self._zero_waste.logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, *args, generation_round=self._generation_round, **kwargs
        )

    # ---- loss (grpo_plus.algorithms.micro_batch_loss) --------------------------------------------------------------

    def _compute_loss(self, model, inputs):
        if self.loss_type in TRL_NATIVE_LOSS_TYPES:
            return super()._compute_loss(model, inputs)
        training = self.model.training
        accumulation_steps = self.current_gradient_accumulation_steps if training else 1
        return self._loss(model, inputs, training, accumulation_steps, self._metrics["train" if training else "eval"])
