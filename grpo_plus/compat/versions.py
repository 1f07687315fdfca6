"""The TRL versions grpo_plus is tested with, what the installed versions allow (the floors the docs promise), and
the private TRL methods grpo_plus hooks, checked when a trainer is built so a changed method fails loudly.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from dataclasses import dataclass

import transformers
import trl
from packaging.version import Version

from .model import FORWARD_INPUT_KEYS

__all__ = [
    "CAPABILITY_FLOORS",
    "HOOKED_METHODS",
    "HookedMethod",
    "RENAMES_TRL_STILL_USES",
    "SAVING_VERSION_FLOORS",
    "TESTED_TRL_MINORS",
    "TRLCompatibilityError",
    "TRL_ADAPTIVE_ENTROPY_ATTRIBUTES",
    "TRL_STATE_ATTRIBUTES",
    "UntestedTRLVersionWarning",
    "VERSION_FLOORS",
    "VersionFloor",
    "agentic_unavailable_reason",
    "check_hooked_methods",
    "check_state_attributes",
    "check_trl_compatibility",
    "ignore_renames_trl_still_uses",
    "is_tested_trl_version",
    "loop_keeps_running_loss_on_trainer",
    "tested_trl_versions_text",
    "version_gap",
]


# transformers 5.2x renamed gradient checkpointing to activation checkpointing and warns (FutureWarning) on the old
# names, which TRL 1.14-1.16 and PEFT still use: TRL's GRPOConfig defaults `gradient_checkpointing=True` (so every
# GRPOConfig warns), `model.is_gradient_checkpointing` is read by TRL at every generation step
# (`unwrap_model_for_generation`, `disable_gradient_checkpointing`) and by PEFT's `get_peft_model`, and TRL turns
# checkpointing off and on around generation with `gradient_checkpointing_disable` / `_enable`; a checkpoint save
# re-arms the warnings, so `make demo` printed one after every save. Neither is the user's to fix (transformers 4.x,
# which grpo_plus supports, has no activation_checkpointing field), nor grpo_plus's: only these messages, only from
# the transformers modules that raise them, are silenced.
RENAMES_TRL_STILL_USES = (
    (
        r"`(is_gradient_checkpointing|gradient_checkpointing_enable|gradient_checkpointing_disable)` is deprecated",
        r"transformers\.modeling_utils",
    ),
    (r"`gradient_checkpointing(_kwargs)?` is deprecated", r"transformers\.training_args"),
)


def ignore_renames_trl_still_uses() -> None:
    """Silence transformers' FutureWarnings about the old gradient-checkpointing names that TRL and PEFT read."""
    for message, module in RENAMES_TRL_STILL_USES:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning, module=module)


# The TRL minors `make test-matrix` runs the parity tests against (every patch release of each). pyproject.toml caps
# TRL below the next minor; tests/test_trl_compat.py checks that the cap, this list and the Makefile agree.
TESTED_TRL_MINORS = ("1.14", "1.15", "1.16")


# ---- What the installed versions allow: what the docs promise ----------------------------------------------------
@functools.cache
def installed_version(package: str) -> Version:
    """`package`'s installed version, read from its metadata once per process (the floors are asked every training
    step, and each read parses the installed distributions' metadata files: 5 ms a time)."""
    from importlib.metadata import version

    return Version(version(package))


@dataclass(frozen=True)
class VersionFloor:
    """A saving or capability the docs (Tested versions) say is on from `package` >= `minimum` on, and off below it,
    `because`; with `since`, off only from `since` up to `minimum` (an older line had it another way).

    Above the floor a saving that stands aside is a defect, not a fact of the environment: the tests decide what
    to expect from these floors alone (`version_gap`), never from what the installed code happens to detect, so a
    release that breaks a saving fails them instead of turning the saving off with a log line."""

    name: str
    package: str
    minimum: str
    because: str
    since: str | None = None

    def gap(self) -> str | None:
        """Why the installed `package` is below the floor, or None when the saving must be on."""
        installed = installed_version(self.package)
        if installed >= Version(self.minimum) or (self.since is not None and installed < Version(self.since)):
            return None
        if self.since is None:
            return f"{self.package} {installed} < {self.minimum}: {self.because}"
        return f"{self.package} {self.since} <= {installed} < {self.minimum}: {self.because}"


SAVING_VERSION_FLOORS = {
    floor.name: floor
    for floor in (
        VersionFloor(
            "zero_waste_generation", "transformers", "5.0.0",
            "the decoding loop mirrors transformers 5's (`_prefill`, `next_sequence_length`); 4.x generates with TRL's "
            "own loop",
        ),
        VersionFloor(
            "multi_turn_cache", "transformers", "5.0.0",
            "tool turns continue each row's cache inside zero-waste generation's decoding loop",
        ),
        VersionFloor(
            "shared_prompt", "trl", "1.15.0",
            "TRL 1.14 has no fused LM head to score the packed shared-prompt rows",
        ),
        VersionFloor(
            "image_prompts", "transformers", "5.24.0",
            "the savings on image prompts read transformers 5.24's VLM internals (Qwen-VL's `get_rope_index` with "
            "`mm_token_type_ids`, Gemma 3's `block_sequence_ids`, generate encoding pixels before its loop); older "
            "ones compute image prompts TRL's way",
        ),
        VersionFloor(
            "moe_router_logits", "transformers", "5.0.0",
            "the packed router aux loss records each MoE layer's router logits where transformers 5's output "
            "recorder finds them (`_can_record_outputs`); on 4.x, with the aux loss on, the shared prompt is "
            "computed in full",
        ),
    )
}  # fmt: skip


# What TRL itself can do with the installed versions (not grpo_plus savings): the tests that need it skip below these
# floors, and nowhere else (tests/helpers/floors.py).
CAPABILITY_FLOORS = {
    floor.name: floor
    for floor in (
        VersionFloor(
            "cpu_logps", "trl", "1.16.0",
            "TRL 1.15 computes training log-probs only with its fused LM head's Triton kernel, which runs on "
            "CUDA/XPU, not CPU (1.14 computes full logits, 1.16 added a plain-torch fallback)",
            since="1.15.0",
        ),
        VersionFloor(
            "fused_lm_head", "trl", "1.15.0",
            "TRL 1.14 computes full logits; the memory count (`grpo-plus fit`, benchmarks/memory.py) follows TRL's "
            "fused LM head",
        ),
        VersionFloor(
            "generation_config_eos", "trl", "1.14.2",
            "TRL 1.14.0 ends completions at the tokenizer's eos token only, not at every eos id of the model's "
            "generation config",
        ),
        VersionFloor(
            "group_size_per_call", "trl", "1.14.2",
            "TRL 1.14.0's `_generate_single_turn` takes no group size: its server path sends one prompt per group, "
            "so partial rollouts against a vLLM server (every row its own request) are refused there",
        ),
        VersionFloor(
            "offloading_count", "trl", "1.16.0",
            "TRL 1.14-1.15's activation offloading moves CUDA/XPU/NPU tensors only and makes CUDA streams, so the "
            "count's stand-in accelerator (a machine without CUDA) cannot run it; 1.16 offloads from any accelerator",
        ),
        VersionFloor(
            "moe_experts", "transformers", "5.0.0",
            "transformers 4.x builds each expert as its own MLP of `nn.Linear` layers and the router as an "
            "`nn.Linear`; grpo_plus's MoE support follows 5.x's experts module of 3D weights (LoRA on the experts "
            "through `target_parameters`, the QLoRA recipe keeping the experts in their dtype, `grpo-plus fit`'s "
            "count, which refuses MoE models below it)",
        ),
        VersionFloor("tools", "transformers", "5.0.0", "TRL refuses `tools` below it (chat-template response parsing)"),
        VersionFloor(
            "environment_factory", "transformers", "5.2.0",
            "TRL refuses `environment_factory` below it (chat-template response parsing)",
        ),
    )
}  # fmt: skip


VERSION_FLOORS = {**SAVING_VERSION_FLOORS, **CAPABILITY_FLOORS}


def version_gap(name: str) -> str | None:
    """Why the docs say `name` (a key of SAVING_VERSION_FLOORS or CAPABILITY_FLOORS) is off with the installed
    versions, or None where they say it is on. Savings without a floor are on with every supported version."""
    return VERSION_FLOORS[name].gap()


class UntestedTRLVersionWarning(UserWarning):
    """The installed TRL is outside the versions grpo_plus is tested with."""


class TRLCompatibilityError(RuntimeError):
    """A private TRL method grpo_plus hooks no longer takes the arguments grpo_plus passes."""


@dataclass(frozen=True)
class HookedMethod:
    """A private method of `trl.GRPOTrainer` (or of the transformers Trainer under it) that grpo_plus relies on.

    `overridden`: grpo_plus.GRPOTrainer defines it (TRL calls grpo_plus's version); otherwise grpo_plus only calls
    TRL's. `check` says what must still hold in TRL for that to work:
    - "exact": TRL calls grpo_plus's override, which takes exactly `positional`, so TRL's parameters must be exactly
      those (a new parameter would be passed to an override that does not take it);
    - "accepts": grpo_plus calls TRL's method with `positional` (by position) and `keywords`, so TRL's signature must
      accept that call (an override that forwards whatever TRL passes, or a plain call);
    - "leading": TRL calls grpo_plus's override, which reads the leading `positional` parameters and hands any
      further ones to TRL's method unchanged, so TRL's parameters must start with exactly those;
    - "exists": the override forwards `*args, **kwargs` untouched: the method must only still exist.
    """

    name: str
    positional: tuple[str, ...] = ()
    keywords: tuple[str, ...] = ()
    check: str = "exact"
    overridden: bool = True


HOOKED_METHODS = (
    HookedMethod("_compute_loss", ("model", "inputs")),
    HookedMethod("_prepare_inputs", ("generation_batch",)),
    # The reward runner (grpo_plus.rewards.runner) also relies on how it calls each reward function: see
    # TRL_SHARED_REWARD_KWARGS and reward_call_problem.
    HookedMethod("_calculate_rewards", ("inputs", "prompts", "completions", "completion_ids_list")),
    HookedMethod("_generate_and_score_completions", ("inputs",)),
    # 1.14.0: (..., multimodal_fields, has_tool_images=False); 1.14.2+: (..., multimodal_fields, num_generations,
    # has_tool_images=False). The zero-waste generation override reads the first three and passes the rest on.
    HookedMethod("_generate_single_turn", ("prompt_ids", "images", "multimodal_fields"), check="leading"),
    # 1.14: (model, *args, batch_size=None, compute_aux_loss=False, **kwargs); 1.15+: every argument spelled out.
    # grpo_plus's override (the zero-waste pass) takes any keyword TRL passes and calls TRL's method this way.
    HookedMethod(
        "_get_per_token_logps_and_entropies",
        ("model", "input_ids", "attention_mask", "logits_to_keep"),
        ("batch_size", "compute_entropy", "compute_aux_loss", *FORWARD_INPUT_KEYS),
        check="accepts",
    ),
    HookedMethod("_save_checkpoint", ("model", "trial")),  # TRL's, over transformers': extra training state
    HookedMethod("_save", ("output_dir", "state_dict")),  # transformers': no Hub token, no local base-model path
    HookedMethod("_maybe_log_save_evaluate", check="exists"),  # transformers': a step is complete after it
    # transformers': a full fine-tune's checkpoint loaded through its weight conversion (grpo_plus.compat.moe),
    # what it loaded reported by transformers' own warnings
    HookedMethod("_load_from_checkpoint", ("resume_from_checkpoint", "model")),
    HookedMethod("_issue_warnings_after_load", ("load_result",), check="accepts", overridden=False),
    # ReMax's greedy baseline generates through TRL's own _generate (1.9-1.16: returns prompt_ids, completion_ids,
    # tool_mask, completions, ...), with TRL's generation_config switched to greedy for the call.
    HookedMethod("_generate", ("prompts",), check="accepts", overridden=False),
    # Asynchronous generation reads the prompts of later batches ahead with TRL's own tokenization (1.14-1.16: returns
    # prompt_ids, images, multimodal_fields).
    HookedMethod("_tokenize_prompts", ("prompts",), check="accepts", overridden=False),
)


# TRL trainer attributes holding training state that grpo_plus checkpoints (grpo_plus.run.state); TRL 1.14-1.16
# all set them in GRPOTrainer.__init__ (the adaptive-entropy ones with use_adaptive_entropy).
TRL_STATE_ATTRIBUTES = ("_step", "_buffered_inputs", "_metrics", "_logs")


TRL_ADAPTIVE_ENTROPY_ATTRIBUTES = ("entropy_coef", "_last_world_entropy", "_entropy_window_stats")


def check_state_attributes(trainer: trl.GRPOTrainer) -> None:
    """Raise TRLCompatibilityError if TRL no longer keeps the training state grpo_plus checkpoints where it looks."""
    names = TRL_STATE_ATTRIBUTES + (
        TRL_ADAPTIVE_ENTROPY_ATTRIBUTES if getattr(trainer, "use_adaptive_entropy", False) else ()
    )
    missing = [name for name in names if not hasattr(trainer, name)]
    if missing:
        raise TRLCompatibilityError(
            f"grpo_plus cannot checkpoint this TRL {trl.__version__}'s training state: GRPOTrainer has no "
            f"{', '.join(missing)}. grpo_plus works with TRL {tested_trl_versions_text()}."
        )


def tested_trl_versions_text() -> str:
    """'1.14.x, 1.15.x, 1.16.x'"""
    return ", ".join(f"{minor}.x" for minor in TESTED_TRL_MINORS)


def is_tested_trl_version(version: str) -> bool:
    """True if `version` (e.g. '1.16.0', '1.15.0.dev0') belongs to a tested TRL minor."""
    release = Version(version).release
    return ".".join(str(part) for part in release[:2]) in TESTED_TRL_MINORS


def _signature_problem(method, expected: HookedMethod) -> str | None:
    """Why `method` does not fit `expected`, or None if it does."""
    if expected.check == "exists":
        return None
    parameters = list(inspect.signature(method).parameters.values())[1:]  # drop self
    if expected.check in ("exact", "leading"):
        names = tuple(p.name for p in parameters)
        leading = expected.check == "leading"
        read = parameters[: len(expected.positional)] if leading else parameters
        if tuple(p.name for p in read) != expected.positional or any(
            p.kind is not p.POSITIONAL_OR_KEYWORD for p in read
        ):
            takes = ", ".join([*expected.positional, *(["..."] if leading else [])])
            return f"its parameters are ({', '.join(names)}), grpo_plus's override takes ({takes})"
        return None
    try:
        inspect.signature(method).bind(None, *expected.positional, **dict.fromkeys(expected.keywords))
    except TypeError as error:
        call = ", ".join([*expected.positional, *(f"{k}=..." for k in expected.keywords)])
        return f"it cannot be called as ({call}): {error}"
    # Positional arguments land by position: the named parameters they fill must mean what grpo_plus passes
    # (TRL 1.14 takes all but `model` through *args, which is fine).
    positional_kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    named = tuple(p.name for p in parameters if p.kind in positional_kinds)[: len(expected.positional)]
    if named != expected.positional[: len(named)]:
        return f"its leading parameters are ({', '.join(named)}), grpo_plus passes ({', '.join(expected.positional)})"
    return None


def check_hooked_methods(trainer_class: type | None = None, trl_version: str | None = None) -> None:
    """Raise TRLCompatibilityError if a hooked method of TRL's GRPOTrainer changed its signature."""
    trainer_class = trl.GRPOTrainer if trainer_class is None else trainer_class
    trl_version = trl.__version__ if trl_version is None else trl_version
    for expected in HOOKED_METHODS:
        method = getattr(trainer_class, expected.name, None)
        problem = "it does not exist" if method is None else _signature_problem(method, expected)
        if problem is not None:
            raise TRLCompatibilityError(
                f"grpo_plus cannot run on TRL {trl_version}: GRPOTrainer.{expected.name} changed ({problem}). "
                f"grpo_plus works with TRL {tested_trl_versions_text()}: "
                f'pip install "trl>={TESTED_TRL_MINORS[0]},<{_next_minor(TESTED_TRL_MINORS[-1])}"'
            )


_warned_versions: set[str] = set()


def check_trl_compatibility(trainer_class: type | None = None, trl_version: str | None = None) -> None:
    """Warn once per process about a TRL outside the tested minors; raise if a hooked method's signature changed."""
    trl_version = trl.__version__ if trl_version is None else trl_version
    if not is_tested_trl_version(trl_version) and trl_version not in _warned_versions:
        _warned_versions.add(trl_version)
        warnings.warn(
            f"grpo_plus is tested with TRL {tested_trl_versions_text()}; TRL {trl_version} is installed. grpo_plus "
            "hooks private GRPOTrainer methods, so check results against stock TRL, or install a tested version: "
            f'pip install "trl>={TESTED_TRL_MINORS[0]},<{_next_minor(TESTED_TRL_MINORS[-1])}"',
            UntestedTRLVersionWarning,
            stacklevel=3,
        )
    check_hooked_methods(trainer_class, trl_version)


def _next_minor(minor: str) -> str:
    major, minor_number = minor.split(".")
    return f"{major}.{int(minor_number) + 1}"


def agentic_unavailable_reason(*, environments: bool = False) -> str | None:
    """Why TRL refuses tools (or, with `environments`, an `environment_factory`) with this transformers, or None.

    TRL 1.14-1.16 raise ImportError at construction below the documented floors (CAPABILITY_FLOORS' `tools` and
    `environment_factory`); grpo_plus adds nothing there and fails the same way."""
    return version_gap("environment_factory" if environments else "tools")


@functools.cache
def loop_keeps_running_loss_on_trainer() -> bool:
    """Whether transformers' training loop keeps its running loss on the trainer (`self._tr_loss`, transformers >= 5)
    rather than in a local variable of `_inner_training_loop` (4.x), which it passes to `_maybe_log_save_evaluate`."""
    return "self._tr_loss" in inspect.getsource(transformers.Trainer._inner_training_loop)
