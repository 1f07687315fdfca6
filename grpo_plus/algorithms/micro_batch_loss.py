"""One micro-batch's loss in a GRPOTrainer, for the loss types grpo_plus aggregates itself: the policy's log-probs from
the zero-waste pass, the old log-probs, weights and mask the sampler corrections give (verl's rollout correction, or
either correction from the training forward on-policy), TRL's policy weights, `grpo_plus.objective.compute_policy_loss`,
TRL's entropy bonus and router aux loss, and the metrics TRL logs.

The trainer builds a `MicroBatchLoss` once and hands it what it needs: what TRL resolved (`TRLTrainingSettings`) and
TRL's loss parts bound to the trainer (`TRLLossMethods`), the algorithm settings, the KL coefficient, the zero-waste
pass, the corrections and accelerate's collectives; per call the model, the micro-batch, the mode and the metrics.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

from ..compat.loss import TRLLossMethods, TRLTrainingSettings, policy_weights
from ..objective import compute_policy_loss
from ..run.distributed import gather_rows
from .estimators import AlgorithmSettings, KLCoefficient
from .loss_metrics import log_loss_metrics
from .rollout_correction import OnPolicyCorrection, RolloutCorrector, sampler_logps

if TYPE_CHECKING:
    from ..zero_waste.training_pass import ZeroWastePass


class MicroBatchLoss:
    """One run's micro-batch loss (module docstring). `dual_clip`: GRPOConfig's; `kl`: beta for each micro-batch (fixed
    or adaptive); `correction` / `on_policy`: the run's rollout correction and the on-policy sampler correction;
    `accelerator`: the trainer's (its gather and reduce)."""

    def __init__(
        self,
        settings: TRLTrainingSettings,
        methods: TRLLossMethods,
        algorithms: AlgorithmSettings,
        dual_clip: float | None,
        kl: KLCoefficient,
        zero_waste: ZeroWastePass,
        correction: RolloutCorrector,
        on_policy: OnPolicyCorrection,
        accelerator: Any,
    ):
        self.settings, self.methods, self.algorithms, self.dual_clip = settings, methods, algorithms, dual_clip
        self.kl, self.zero_waste, self.correction, self.on_policy = kl, zero_waste, correction, on_policy
        self.accelerator = accelerator

    def __call__(
        self, model, inputs: dict[str, Any], training: bool, accumulation_steps: int, metrics: dict[str, list]
    ) -> torch.Tensor:
        """The micro-batch's contribution to the window objective; its metrics appended to `metrics`.
        `accumulation_steps`: the trainer's current gradient accumulation steps in training, 1 in evaluation."""
        settings, accelerator, correction = self.settings, self.accelerator, self.correction
        mode = "train" if training else "eval"
        mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
        advantages = inputs["advantages"]
        advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
        if correction.bypass:  # the sampler's log-probs are the old ones (rows left out of the forward keep them)
            inputs = {**inputs, "old_per_token_logps": torch.nan_to_num(sampler_logps(inputs), nan=0.0)}
        policy = self.zero_waste.policy_forward(model, inputs, metrics)
        logps, entropies = policy.logps, policy.entropies
        correction_weights = None
        if self.on_policy.active:  # the sampler correction from this forward: no old-log-prob pass ran
            every_row = functools.partial(gather_rows, accelerator)
            inputs, corrected = self.on_policy.loss_inputs(
                logps, inputs, mask, policy.computed_rows, accelerator.gather, every_row, metrics
            )
            old_logps, correction_weights, mask = corrected.old_logps, corrected.weights, corrected.mask
        elif correction.active:  # verl's IS weights and rejection (grpo_plus.algorithms.rollout_correction)
            reduce_sum = functools.partial(accelerator.reduce, reduction="sum")
            corrected = correction.loss_inputs(logps, inputs, mask, policy.computed_rows, reduce_sum, metrics)
            old_logps, correction_weights, mask = corrected.old_logps, corrected.weights, corrected.mask
        else:
            old_logps = inputs.get("old_per_token_logps")
            old_logps = logps.detach() if old_logps is None else old_logps

        entropy_mask, weights = policy_weights(
            settings, inputs, advantages, logps, old_logps, entropies, mask, self.methods
        )
        if correction_weights is not None:
            weights = correction_weights if weights is None else weights * correction_weights

        num_items = inputs["num_items_in_batch"]
        if training:  # TRL's count spans the generation batch; rescale it to one accumulation window
            num_items = num_items * accumulation_steps / settings.steps_per_generation
        algorithms = self.algorithms
        out = compute_policy_loss(
            logps,
            old_logps,
            advantages,
            mask,
            loss_type=settings.loss_type,
            importance_sampling_level=settings.importance_sampling_level,
            policy_loss=algorithms.policy_loss,
            kl_estimator=algorithms.kl_estimator,
            policy_loss_options=algorithms.policy_loss_options,
            epsilon=settings.epsilon_low,
            epsilon_high=settings.epsilon_high,
            delta=settings.delta,
            dual_clip=self.dual_clip,
            beta=self.kl.value,
            ref_logps=inputs.get("ref_per_token_logps"),
            use_bias_correction_kl=settings.use_bias_correction_kl,
            max_completion_length=settings.max_completion_length,
            num_items_in_batch=num_items,
            num_processes=accelerator.num_processes,
            gradient_accumulation_steps=accumulation_steps,
            policy_weights=weights,
        )
        loss = out.loss
        if training:
            self.kl.record(out)
        if settings.entropy_bonus:
            entropy_mask = mask if entropy_mask is None else mask * entropy_mask
            loss = loss - self.methods.entropy_bonus(entropies, entropy_mask, mode)
            # TRL logs grpo/bnpo/dr_grpo's policy loss before the 1/S accumulation scaling, dapo's as is.
            policy_loss = out.loss.detach() * (1 if settings.loss_type == "dapo" else accumulation_steps)
            metrics["policy_loss"].append(accelerator.gather(policy_loss).nanmean().item())
        if settings.aux_loss:
            loss = loss + settings.router_aux_loss_coef * policy.aux_loss / accumulation_steps
            metrics["aux_loss"].append(accelerator.gather_for_metrics(policy.aux_loss).mean().item())
        log_loss_metrics(metrics, accelerator, out, entropies, policy.trained_rows, policy.entropies_of_every_row)
        return loss
