"""Everything a run's future depends on beyond what transformers checkpoints, saved and restored through one protocol,
so that a run resumed from checkpoint-k, in a fresh process, continues the very trajectory of the uninterrupted run.

transformers' Trainer already checkpoints the weights, optimizer, scheduler, its global RNG states and the data
position (on resume it skips k x gradient_accumulation_steps batches of the epoch, then restores the RNGs). What is
left lives in the trainer's stateful parts. A stateful part is any object with

    checkpoint_name: str                 stable, unique in the trainer: where its state is kept in a checkpoint
    state_dict() -> dict                 a snapshot of what the part's future depends on: tensors, numbers, strings,
                                         None, lists, tuples and dicts with string keys; later training must not
                                         change what it returned (copy containers; tensors may be shared if nothing
                                         modifies them in place)
    load_state_dict(state: dict) -> None put the part back exactly there; ValueError for a state it cannot take

and, optionally, `checkpoint_scope = "process"` when its state differs between processes (the default, "shared",
is the same state on every process, saved once), and `checkpoint_missing_ok = True` when starting afresh from a
checkpoint that holds no state for it changes nothing a user would miss (no warning then). `stateful_parts` finds the trainer's parts: its own attributes,
reward functions and callbacks that implement the protocol (selective rollout, dynamic sampling, a user's stateful
reward), plus the adapters below for the state TRL and transformers keep in trainer attributes. So a new stateful
feature is saved, restored and kept right in crash checkpoints by implementing the protocol, with no other wiring.

A checkpoint holds `grpo_plus_state_<process index>.pt` (each process's own parts) and, when there are shared parts,
`grpo_plus_state.pt` (written by the process that saves the model), both torch.save archives, written atomically before
transformers writes trainer_state.json (which marks the checkpoint complete), read back with `weights_only=True`.
"""

from __future__ import annotations

import json
import logging
import os
import random
from collections import defaultdict, deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from transformers import TrainerCallback

from ..compat.versions import check_state_attributes, loop_keeps_running_loss_on_trainer
from .checkpoints import CheckpointError, checkpoint_step

logger = logging.getLogger(__name__)

FORMAT = "grpo_plus.run.state"
FORMAT_VERSION = 1
SHARED_FILE = "grpo_plus_state.pt"
PROCESS_FILE = "grpo_plus_state_{}.pt"  # .format(process index)
SHARED, PROCESS = "shared", "process"
# Files of checkpoints written before grpo_plus_state*.pt (one part each, JSON), still read when a checkpoint has no
# grpo_plus_state files.
LEGACY_SELECTIVE_ROLLOUT_FILE = "selective_rollout_state.json"
LEGACY_DYNAMIC_SAMPLING_FILE = "dynamic_sampling_state.json"
LEGACY_ADAPTIVE_ENTROPY_FILE = "entropy_ctrl_state.json"  # TRL writes it for use_adaptive_entropy
# Accelerator RNGs with a `get_rng_state_all` (transformers saves CUDA, NPU, HPU, MLU, MUSA; not XPU nor MPS).
_DEVICE_RNG_MODULES = ("cuda", "xpu", "npu", "hpu", "mlu", "musa")


@runtime_checkable
class StatefulPart(Protocol):
    """A part of the trainer whose state a checkpoint must hold (see the module docstring)."""

    checkpoint_name: str

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def scope_of(part: StatefulPart) -> str:
    return getattr(part, "checkpoint_scope", SHARED)


def state_dicts(parts: Iterable[StatefulPart]) -> dict[str, dict[str, Any]]:
    """Every part's state, by checkpoint name."""
    return {part.checkpoint_name: part.state_dict() for part in parts}


def load_state_dicts(parts: Iterable[StatefulPart], states: dict[str, dict[str, Any]]) -> None:
    """Load each part's state from `states` (parts without one are left as they are)."""
    for part in parts:
        if part.checkpoint_name in states:
            part.load_state_dict(states[part.checkpoint_name])


# ---- the parts a GRPOTrainer has ------------------------------------------------------------------------------------


def stateful_parts(trainer: Any) -> list[StatefulPart]:
    """The trainer's stateful parts: adapters for TRL's and transformers' state, then every attribute, reward function
    and callback implementing the protocol. Raises ValueError when two parts claim the same checkpoint name."""
    check_state_attributes(trainer)
    parts: list[StatefulPart] = [GenerationBuffer(trainer), LoggingWindow(trainer), RandomState()]
    if getattr(trainer, "use_adaptive_entropy", False):
        parts.append(AdaptiveEntropy(trainer))
    if getattr(trainer.args, "sync_ref_model", False) and getattr(trainer, "ref_model", None) is not None:
        if _zero3_partitioned(trainer.ref_model):  # each rank holds a shard; gathering it is collective
            _warn_once(
                "sync_ref_model under DeepSpeed ZeRO-3: the reference model's weights are partitioned across "
                "processes and are not checkpointed, so a resumed run restarts from the initial reference model."
            )
        else:
            parts.append(ReferenceModel(trainer.ref_model))
    rewards = [getattr(reward, "func", reward) for reward in trainer.reward_funcs]  # GuardedReward wraps the function
    candidates = [*vars(trainer).values(), *rewards, *trainer.callback_handler.callbacks]
    seen = {id(part) for part in parts}
    for candidate in candidates:
        if _is_part(candidate) and id(candidate) not in seen:
            seen.add(id(candidate))
            parts.append(candidate)
    names = [part.checkpoint_name for part in parts]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(
            f"Two stateful parts of the trainer share the checkpoint_name {duplicates}: names must be unique."
        )
    return parts


def _is_part(value: Any) -> bool:
    """An object (not a class) with the protocol; `checkpoint_name = None` opts a subclass out. The name is looked at
    first: the crash checkpoint asks this of every trainer attribute each step, and a protocol check costs 40 us."""
    if not isinstance(getattr(value, "checkpoint_name", None), str) or isinstance(value, type):
        return False
    return isinstance(value, StatefulPart)


class GenerationBuffer:
    """TRL's buffered generation batch (`_buffered_inputs`: the micro-batches of the last generation batch with their
    completions, masks, log-probs and advantages) and its micro-step counter (`_step`), which says which micro-batch
    comes next and when the next batch is generated. TRL starts a resumed trainer with neither, so inside a
    generation batch it generates anew; restored, the resumed run trains on the rest of the very same batch. A
    batch that is used up (the next micro-step generates) is not saved."""

    checkpoint_name = "generation_buffer"
    checkpoint_scope = PROCESS
    version = 1

    def __init__(self, trainer: Any):
        self.trainer = trainer
        self.steps_per_generation = trainer.args.steps_per_generation
        self.generate_every = trainer.args.steps_per_generation * trainer.num_iterations
        self.gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
        # A vLLM server samples with its own process's random state, which no checkpoint holds; a colocated engine
        # samples with the training process's torch random state, which the checkpoint restores (tests/vllm_engine).
        self.uses_vllm_server = bool(getattr(trainer, "use_vllm", False)) and trainer.args.vllm_mode == "server"

    def state_dict(self) -> dict[str, Any]:
        buffered = self.trainer._buffered_inputs
        if not self._inside_batch(self.trainer._step):  # used up: the next micro-step generates a new batch
            buffered = None
        return {
            "version": self.version,
            "step": self.trainer._step,
            "steps_per_generation": self.steps_per_generation,
            "generate_every": self.generate_every,
            "micro_batches": None if buffered is None else [dict(batch) for batch in buffered],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_version(self, state)
        saved = (state["steps_per_generation"], state["generate_every"])
        if saved != (self.steps_per_generation, self.generate_every):
            _warn_once(  # once: a resume loads the parts twice (see TrainingState)
                f"The checkpoint's generation batch was made with steps_per_generation={saved[0]} and {saved[1]} "
                "micro-steps per batch (steps_per_generation x num_iterations); this run has "
                f"{self.steps_per_generation} and {self.generate_every}, so it cannot continue it: TRL generates a "
                "new batch, and the run is not the one that was saved."
            )
            self.trainer._step, self.trainer._buffered_inputs = 0, None
            return
        device = self.trainer.accelerator.device
        batches = state["micro_batches"]
        self.trainer._step = state["step"]
        self.trainer._buffered_inputs = None if batches is None else [_to_device(b, device) for b in batches]

    def inside_generation_batch(self, global_step: int) -> bool:
        """Whether a checkpoint of optimizer step `global_step` lies inside a generation batch (TRL regenerates there
        when the buffer is not restored)."""
        return self._inside_batch(global_step * self.gradient_accumulation_steps)

    def _inside_batch(self, micro_step: int) -> bool:
        # num_iterations=0 (TRL accepts it and trains no step): no batch is ever trained on, none is inside one
        return self.generate_every != 0 and micro_step % self.generate_every != 0


class LoggingWindow:
    """What the next log entry is made of but was gathered before the checkpoint: transformers' running loss
    (`_tr_loss` since `_globalstep_last_logged`), TRL's metrics not yet averaged into a log (`_metrics["train"]`),
    its completions log (`_logs`: prompts, completions, rewards, advantages, printed with `log_completions`) and
    the token count it logs (`state.num_input_tokens_seen`, advanced at generation). A checkpoint inside a logging
    window (logging_steps > 1, or any crash checkpoint) then logs what the uninterrupted run logs."""

    checkpoint_name = "logging_window"
    checkpoint_scope = PROCESS
    version = 1

    def __init__(self, trainer: Any):
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        trainer = self.trainer
        loss = getattr(trainer, "_tr_loss", None)  # set by transformers' training loop
        return {
            "version": self.version,
            "loss": None if loss is None else loss.detach().clone(),
            "steps_since_logged": trainer.state.global_step - getattr(trainer, "_globalstep_last_logged", 0),
            "metrics": {key: list(values) for key, values in trainer._metrics["train"].items()},
            "completions": {key: _plain_copy(value) for key, value in trainer._logs.items() if _is_plain(value)},
            "tokens_seen": trainer.state.num_input_tokens_seen,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_version(self, state)
        trainer = self.trainer
        if state["loss"] is not None:
            # transformers' train() summary (train_loss) averages this call's steps: keep `_total_loss_scalar +
            # running loss` unchanged, so a loss carried over from before the checkpoint is not counted in it.
            carried = state["loss"].to(trainer.args.device)
            if loop_keeps_running_loss_on_trainer():
                previous = getattr(trainer, "_tr_loss", None)
                trainer._total_loss_scalar = (
                    getattr(trainer, "_total_loss_scalar", 0.0)
                    + (0.0 if previous is None else previous.item())
                    - carried.item()
                )
                trainer._tr_loss = carried
            else:  # transformers 4.x: the running loss is a local of its loop (0 here), see `carry_running_loss`
                trainer._total_loss_scalar = getattr(trainer, "_total_loss_scalar", 0.0) - carried.item()
                trainer._carried_running_loss = carried
        trainer._globalstep_last_logged = trainer.state.global_step - state["steps_since_logged"]
        metrics = trainer._metrics["train"]
        metrics.clear()
        metrics.update({key: list(values) for key, values in state["metrics"].items()})
        for key, saved in state["completions"].items():
            if key in trainer._logs:  # a column another TRL version keeps is left out
                _refill(trainer._logs[key], saved)
        trainer.state.num_input_tokens_seen = state["tokens_seen"]


def carry_running_loss(trainer: Any, running_loss: torch.Tensor) -> None:
    """transformers 4.x keeps the running loss in a local of its loop (`running_loss`, passed to
    `_maybe_log_save_evaluate` at the end of every step, before it logs and saves): add a loss the logging window
    restored into it, once, and keep it reachable as `trainer._tr_loss` (where transformers >= 5 keeps it) for the
    logging window to save. Nothing to do on transformers >= 5."""
    if loop_keeps_running_loss_on_trainer():
        return
    carried = trainer.__dict__.pop("_carried_running_loss", None)
    if carried is not None:
        running_loss += carried  # in place: the loop's own tensor
    trainer._tr_loss = running_loss


class RandomState:
    """The global random number generators: Python, NumPy, torch CPU and every initialized accelerator's devices.
    transformers writes most of them to rng_state*.pth and restores them at the first resumed step (after it skips
    batches, whose loading may draw numbers); this part adds the accelerators it does not save (XPU, MPS) and is
    what crash checkpoints rewind (the step in flight has drawn numbers since the last step ended)."""

    checkpoint_name = "rng"
    checkpoint_scope = PROCESS
    version = 1

    def state_dict(self) -> dict[str, Any]:
        numpy_state = np.random.get_state()
        state = {
            "version": self.version,
            "python": random.getstate(),
            "numpy": [numpy_state[0], numpy_state[1].tolist(), *numpy_state[2:]],
            "cpu": torch.random.get_rng_state(),
        }
        for name in _DEVICE_RNG_MODULES:
            module = getattr(torch, name, None)
            if module is not None and _initialized(module):
                state[name] = module.random.get_rng_state_all()
        if torch.backends.mps.is_available():
            state["mps"] = torch.mps.get_rng_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_version(self, state)
        random.setstate(_as_tuples(state["python"]))
        name, keys, *rest = state["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
        torch.random.set_rng_state(state["cpu"])
        for name in _DEVICE_RNG_MODULES:
            if name in state and _initialized(getattr(torch, name, None)):
                getattr(torch, name).random.set_rng_state_all(state[name])
        if "mps" in state and torch.backends.mps.is_available():
            torch.mps.set_rng_state(state["mps"])


class AdaptiveEntropy:
    """TRL's adaptive entropy controller (`use_adaptive_entropy`): the coefficient, the entropy it last measured and
    the open accumulation window's sums. TRL writes the first two to entropy_ctrl_state.json after
    trainer_state.json; kept here too so crash checkpoints rewind them and a complete checkpoint holds them."""

    checkpoint_name = "adaptive_entropy"
    version = 1

    def __init__(self, trainer: Any):
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        window = self.trainer._entropy_window_stats
        return {
            "version": self.version,
            "entropy_coef": float(self.trainer.entropy_coef),
            "last_world_entropy": float(self.trainer._last_world_entropy),
            "window": None if window is None else window.detach().clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_version(self, state)
        trainer = self.trainer
        trainer.entropy_coef, trainer._last_world_entropy = state["entropy_coef"], state["last_world_entropy"]
        window = state["window"]
        trainer._entropy_window_stats = None if window is None else window.to(trainer.accelerator.device)


class ReferenceModel:
    """The reference model's weights when TRL moves them during training (`sync_ref_model`: every
    `ref_model_sync_steps` steps, ref <- alpha * policy + (1 - alpha) * ref). TRL does not checkpoint them, so a
    resumed run would restart from the initial reference. As large as the model: written once, by the saving
    process. The parameters change only at a step's end (TRL's callback), so the snapshot holds references."""

    checkpoint_name = "reference_model"
    version = 1

    def __init__(self, ref_model: torch.nn.Module):
        self.ref_model = ref_model

    def state_dict(self) -> dict[str, Any]:
        return {"version": self.version, "weights": {n: p.data for n, p in self.ref_model.named_parameters()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_version(self, state)
        weights = state["weights"]
        params = dict(self.ref_model.named_parameters())
        if weights.keys() != params.keys() or any(weights[n].shape != params[n].shape for n in params):
            raise ValueError("its reference model has other parameters than this run's: resume with the same model.")
        with torch.no_grad():
            for name, param in params.items():
                if weights[name] is not param.data:
                    param.data.copy_(weights[name])


# ---- saving and restoring -------------------------------------------------------------------------------------------


class TrainingState(TrainerCallback):
    """Writes the parts' states into each checkpoint; on resume reads them (at once, so a bad file fails before
    training) and loads them when training begins (after transformers has set up its loop, whose running loss the
    logging window restores)."""

    def __init__(self, parts: Callable[[], list[StatefulPart]], process_index: int, num_processes: int):
        self.parts, self.process_index, self.num_processes = parts, process_index, num_processes
        self._pending: tuple[dict[str, dict[str, Any]], Path] | None = None
        parts()  # a part this TRL cannot provide, or two parts with one name, fail when the trainer is built

    def save(self, folder: str | Path, writes_shared: bool, wait_for_everyone: Callable[[], None]) -> None:
        """Write this process's parts (and, if `writes_shared`, the shared ones) into checkpoint `folder`; every
        process has written its file when this returns."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        parts = self.parts()
        by_scope = {SHARED: [], PROCESS: []}
        for part in parts:
            by_scope[scope_of(part)].append(part)
        _write(folder / PROCESS_FILE.format(self.process_index), PROCESS, by_scope[PROCESS], self.num_processes)
        if writes_shared and by_scope[SHARED]:
            _write(folder / SHARED_FILE, SHARED, by_scope[SHARED], self.num_processes)
        wait_for_everyone()

    def restore_from(self, checkpoint: str | Path) -> None:
        """Read what `checkpoint` holds for this run's parts, saying what cannot be restored; loaded at train begin."""
        checkpoint, parts = Path(checkpoint), self.parts()
        states, legacy = self._read(checkpoint)
        wanted = {part.checkpoint_name: part for part in parts}
        for name in sorted(set(states) - set(wanted)):
            logger.warning("%s holds state for '%s', which this run does not use: ignored.", checkpoint, name)
        missing = [part for part in parts if part.checkpoint_name not in states]
        buffer = next((p for p in parts if isinstance(p, GenerationBuffer)), None)
        if buffer is not None and buffer.uses_vllm_server:
            logger.warning(
                "Resuming from %s with a vLLM server: the rest of the saved generation batch trains exactly, but "
                "the batches generated after it differ from the uninterrupted run's, because the server's sampling random "
                "state lives inside its engine (seeded once when it starts) and cannot be saved or restored.",
                checkpoint,
            )
        if legacy:
            if buffer is not None and buffer.inside_generation_batch(checkpoint_step(checkpoint)):
                logger.warning(
                    "Resuming from %s, which falls inside a generation batch (steps_per_generation=%d, %d micro-steps "
                    "per batch, gradient_accumulation_steps=%d) and was written without grpo_plus's training state "
                    "(stock TRL, or an older grpo_plus): TRL generates a new batch instead of the rest of the old one, "
                    "so the resumed run will not end at the weights an uninterrupted run would have reached.",
                    checkpoint,
                    buffer.steps_per_generation,
                    buffer.generate_every,
                    buffer.gradient_accumulation_steps,
                )
            missing = [p for p in missing if not isinstance(p, (GenerationBuffer, LoggingWindow, RandomState))]
        for part in missing:
            if not getattr(part, "checkpoint_missing_ok", False):
                logger.warning("%s holds no state for '%s': it starts afresh.", checkpoint, part.checkpoint_name)
        self._load(parts, states, checkpoint)  # now, so that a state this run cannot take fails before training
        self._pending = (states, checkpoint)

    def on_train_begin(self, args, state, control, **kwargs):
        # Again once transformers has set up its loop (it resets the running loss the logging window carries).
        pending, self._pending = self._pending, None
        if pending is not None:
            self._load(self.parts(), *pending)

    @staticmethod
    def _load(parts: list[StatefulPart], states: dict[str, dict[str, Any]], checkpoint: Path) -> None:
        for part in parts:
            if part.checkpoint_name not in states:
                continue
            try:
                part.load_state_dict(states[part.checkpoint_name])
            except (ValueError, KeyError, TypeError) as error:
                raise CheckpointError(
                    f"{checkpoint}: the saved state of '{part.checkpoint_name}' cannot be loaded: {error}"
                ) from error

    def _read(self, checkpoint: Path) -> tuple[dict[str, dict[str, Any]], bool]:
        """(the states found, whether the checkpoint predates grpo_plus's training state files)."""
        shared_file, process_file = checkpoint / SHARED_FILE, checkpoint / PROCESS_FILE.format(self.process_index)
        if not shared_file.is_file() and not any(checkpoint.glob(PROCESS_FILE.format("*"))):
            return _read_legacy(checkpoint), True
        states: dict[str, dict[str, Any]] = {}
        if shared_file.is_file():
            states.update(_read(shared_file, SHARED)["parts"])
        if process_file.is_file():
            saved = _read(process_file, PROCESS)
            if saved["num_processes"] == self.num_processes:
                states.update(saved["parts"])
            else:
                logger.warning(
                    "%s was written by %d processes; this run has %d, so each process's own state (%s) is not "
                    "restored: a run resumed on another number of processes does not continue the saved trajectory.",
                    checkpoint,
                    saved["num_processes"],
                    self.num_processes,
                    ", ".join(sorted(saved["parts"])),
                )
        else:
            logger.warning(
                "%s holds no %s for this process: its own state is not restored.", checkpoint, process_file.name
            )
        return states, False


def _write(path: Path, scope: str, parts: list[StatefulPart], num_processes: int) -> None:
    """torch.save the parts' states to `path`, atomically (a kill leaves the old file or the new one, never half)."""
    saved = {}
    for part in parts:
        state = part.state_dict()
        problem = _plain_problem(state, part.checkpoint_name)
        if problem is not None:  # never fail a training run over a checkpoint detail: say what resume will miss
            logger.warning("Not saving the state of '%s' in %s: %s.", part.checkpoint_name, path.parent, problem)
            continue
        saved[part.checkpoint_name] = _to_cpu(state)
    payload = {"format": FORMAT, "version": FORMAT_VERSION, "scope": scope, "num_processes": num_processes}
    partial = path.with_name(f".{path.name}.partial")
    torch.save({**payload, "parts": saved}, partial)
    os.replace(partial, path)


def _read(path: Path, scope: str) -> dict[str, Any]:
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # a damaged archive, or an object a plain load refuses
        raise CheckpointError(f"{path} cannot be read: {error}") from error
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a grpo_plus training state file.")
    if saved.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has training state format version {saved.get('version')!r}; this grpo_plus reads version "
            f"{FORMAT_VERSION}. Resume with the grpo_plus version that wrote it."
        )
    if saved.get("scope") != scope or not isinstance(saved.get("parts"), dict):
        raise CheckpointError(f"{path} is damaged (scope {saved.get('scope')!r}, expected {scope!r}).")
    return saved


def _read_legacy(checkpoint: Path) -> dict[str, dict[str, Any]]:
    """The one-file-per-part JSON states of checkpoints written before grpo_plus_state*.pt, as the parts' states."""
    states: dict[str, dict[str, Any]] = {}
    selective = checkpoint / LEGACY_SELECTIVE_ROLLOUT_FILE
    if selective.is_file():
        try:
            states["selective_rollout"] = json.loads(selective.read_text())
        except ValueError as error:
            raise CheckpointError(f"{selective} cannot be loaded: {error}") from error
    sampling = checkpoint / LEGACY_DYNAMIC_SAMPLING_FILE
    if sampling.is_file():
        try:
            refill_draws = json.loads(sampling.read_text()).get("refill_draws")
        except (ValueError, AttributeError) as error:
            raise CheckpointError(f"{sampling} cannot be loaded: {error}") from error
        states["dynamic_sampling"] = {"version": 1, "refill_draws": refill_draws}
    entropy = checkpoint / LEGACY_ADAPTIVE_ENTROPY_FILE  # TRL's own, which TRL also loads
    if entropy.is_file():
        saved = json.loads(entropy.read_text())
        states["adaptive_entropy"] = {
            "version": 1,
            "entropy_coef": saved["entropy_coef"],
            "last_world_entropy": saved["last_world_entropy"],
            "window": None,
        }
    return states


# ---- helpers --------------------------------------------------------------------------------------------------------


def _check_version(part: Any, state: dict[str, Any]) -> None:
    if state.get("version") != part.version:
        raise ValueError(
            f"'{part.checkpoint_name}' state version {state.get('version')!r} is not the version this grpo_plus "
            f"reads ({part.version})."
        )


_PLAIN_SCALARS = (bool, int, float, str, type(None))


def _plain_problem(value: Any, where: str) -> str | None:
    """Why `value` cannot be saved and read back with torch.load(weights_only=True), or None."""
    if isinstance(value, (torch.Tensor, *_PLAIN_SCALARS)):
        return None
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            if (problem := _plain_problem(item, f"{where}[{index}]")) is not None:
                return problem
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"{where} has a key of type {type(key).__name__} (keys must be strings)"
            if (problem := _plain_problem(item, f"{where}[{key!r}]")) is not None:
                return problem
        return None
    return (
        f"{where} is a {type(value).__name__} (a state holds tensors, numbers, strings, None, lists, tuples and "
        "dicts with string keys)"
    )


def _is_plain(value: Any) -> bool:
    return _plain_problem(_plain_copy(value), "") is None


def _plain_copy(value: Any) -> Any:
    """Deques as lists, defaultdicts as dicts (TRL's completions log), recursively."""
    if isinstance(value, (deque, list)):
        return [_plain_copy(item) for item in value]
    if isinstance(value, (defaultdict, dict)):
        return {key: _plain_copy(item) for key, item in value.items()}
    return value


def _refill(target: Any, saved: Any) -> None:
    """Put a saved completions-log entry back into TRL's deque (or defaultdict of deques), keeping its maxlen."""
    if isinstance(target, dict):
        target.clear()
        for key, values in saved.items():
            _refill(target[key], values)
    else:
        target.clear()
        target.extend(saved)


def _to_cpu(value: Any) -> Any:
    """Tensors copied to CPU, each into storage of its own size (a micro-batch is a view of its whole batch)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(item) for item in value)
    if isinstance(value, dict):
        return {key: _to_cpu(item) for key, item in value.items()}
    return value


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, list):
        return [_to_device(item, device) for item in value]
    if isinstance(value, dict):
        return {key: _to_device(item, device) for key, item in value.items()}
    return value


def _as_tuples(value: Any) -> Any:
    """random.setstate wants the nested tuples getstate gave (a torch.load of lists and tuples keeps tuples, but a
    state that went through JSON would not)."""
    return tuple(_as_tuples(item) for item in value) if isinstance(value, (list, tuple)) else value


def _zero3_partitioned(model: torch.nn.Module) -> bool:
    return any(hasattr(param, "ds_numel") for param in model.parameters())


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


def _initialized(module: Any) -> bool:
    is_initialized = getattr(module, "is_initialized", None)
    return (
        callable(is_initialized) and is_initialized() and hasattr(getattr(module, "random", None), "get_rng_state_all")
    )
