"""TRL 1.16's own code as the oracle: its `_compute_loss` and advantage block, run on given tensors.

`trl_policy_loss` calls `trl.GRPOTrainer._compute_loss` unbound on a minimal stand-in trainer whose model
"forward" returns the caller's log-prob tensor, so the loss, gradient and metrics are TRL's, not a re-typing.
`trl_advantages` runs the advantage block of `GRPOTrainer._generate_and_score_completions` (TRL keeps it
inline in a 600-line method, so the test takes that block from the syntax tree of TRL's installed source and runs it).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from types import SimpleNamespace

import torch
import trl.trainer.grpo_trainer as grpo_module
from trl import GRPOTrainer
from trl.trainer.utils import nanstd

from grpo_plus.app.testing import StandInTrainer


def trl_policy_loss(
    logps, old_logps, advantages, mask, *, ref_logps=None, num_items_in_batch=None, entropies=None, **settings
):
    """TRL's loss and logged metrics for these tensors; `logps` should require grad for gradient checks.

    `entropies` (B, T) feed TRL's entropy mask when `top_entropy_quantile` < 1 is among the settings.
    """
    stand_in = StandInTrainer(logps, entropies=entropies, **settings)
    batch, length = mask.shape
    inputs = {
        "prompt_ids": torch.zeros(batch, 1, dtype=torch.long),
        "prompt_mask": torch.ones(batch, 1, dtype=torch.long),
        "completion_ids": torch.zeros(batch, length, dtype=torch.long),
        "completion_mask": mask,
        "advantages": advantages,
        "old_per_token_logps": old_logps,
    }
    if ref_logps is not None:
        inputs["ref_per_token_logps"] = ref_logps
    if num_items_in_batch is not None:
        inputs["num_items_in_batch"] = torch.as_tensor(num_items_in_batch)
    loss = GRPOTrainer._compute_loss(stand_in, None, inputs)
    metrics = {name: values[-1] for name, values in stand_in._metrics["train"].items()}
    return loss, metrics


def trl_entropy_mask(entropies, mask, top_entropy_quantile):
    """The mask TRL's `get_high_entropy_mask` gives `_compute_loss` for this `top_entropy_quantile` (one process)."""
    stand_in = StandInTrainer(entropies, entropies=entropies, top_entropy_quantile=top_entropy_quantile)
    return stand_in.get_high_entropy_mask(entropies, mask, 1 - top_entropy_quantile)


def _assigns(statement: ast.stmt, name: str) -> bool:
    return isinstance(statement, ast.Assign) and any(
        isinstance(target, ast.Name) and target.id == name for target in statement.targets
    )


def _advantage_block() -> ast.Module:
    """The statements of `_generate_and_score_completions` from `unscorable_mask = ...` up to (not including)
    `process_slice = ...`, found in TRL's syntax tree (comments and formatting do not matter)."""
    source = textwrap.dedent(inspect.getsource(GRPOTrainer._generate_and_score_completions))
    body = ast.parse(source).body[0].body
    start = next(i for i, statement in enumerate(body) if _assigns(statement, "unscorable_mask"))
    end = next(i for i, statement in enumerate(body) if _assigns(statement, "process_slice"))
    return ast.Module(body=body[start:end], type_ignores=[])


_ADVANTAGE_BLOCK = compile(_advantage_block(), "<trl advantage block>", "exec")


def trl_advantages(rewards_per_func, num_generations, scale_rewards="group", reward_weights=None):
    """TRL's advantages for per-function rewards (num_completions, num_funcs), NaN = reward func returned None."""
    num_funcs = rewards_per_func.shape[1]
    weights = torch.ones(num_funcs) if reward_weights is None else torch.as_tensor(reward_weights)
    stand_in = SimpleNamespace(
        multi_objective_aggregation="sum_then_normalize",
        reward_weights=weights.to(rewards_per_func.dtype),
        scale_rewards=scale_rewards,
        reward_funcs=[None] * num_funcs,
    )
    scope = {
        "self": stand_in,
        "torch": torch,
        "nanstd": nanstd,
        "rewards_per_func": rewards_per_func,
        "num_generations": num_generations,
        "device": rewards_per_func.device,
    }
    exec(_ADVANTAGE_BLOCK, vars(grpo_module) | scope, scope)
    return scope["advantages"]
