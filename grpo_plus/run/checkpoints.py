"""Checkpoints: find the one to resume from (skipping one a crash left half-written or damaged), check it fits the
model being trained, and keep secrets and local paths out of what the trainer writes."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import struct
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
# transformers' Trainer writes trainer_state.json last, after weights, optimizer, scheduler and RNG states.
_WRITTEN_LAST = "trainer_state.json"
# What torch.save writes (a zip archive since torch 1.6): optimizer, scheduler, RNG states, scaler, training args,
# grpo_plus's training state (grpo_plus.run.state).
_TORCH_FILES = re.compile(
    r"^(optimizer\.pt|scheduler\.pt|scaler\.pt|rng_state(_\d+)?\.pth|grpo_plus_state(_\d+)?\.pt|.*\.bin)$"
)
# The adapter settings that decide the shape and placement of the trained weights.
_ADAPTER_SHAPE_KEYS = ("peft_type", "r", "lora_alpha", "target_modules", "modules_to_save", "use_dora", "use_rslora")
# Hub cache layout: .../models--{org}--{name}/snapshots/{revision}
_HUB_CACHE_SNAPSHOT = re.compile(r"models--(?P<org>[^/\\]+?)--(?P<name>[^/\\]+)[/\\]snapshots[/\\][^/\\]+[/\\]?$")
# Local folders whose Hub id is known (the embedded model's cache folder): what public_model_name returns for them.
_KNOWN_HUB_IDS: dict[str, str] = {}


class CheckpointError(ValueError):
    """A checkpoint cannot be resumed from: missing, damaged, or from a different model or adapter."""


# ---- finding a checkpoint to resume from --------------------------------------------------------------------------


def is_complete_checkpoint(path: str | Path) -> bool:
    """True when the checkpoint's last-written file exists and parses (cheap: see `checkpoint_problem` for more)."""
    state = Path(path) / _WRITTEN_LAST
    try:
        json.loads(state.read_text())
    except (OSError, ValueError):
        return False
    return True


def checkpoint_problem(path: str | Path) -> str | None:
    """Why `path` cannot be resumed from (naming the file), or None. Reads headers, not tensors: seconds at most."""
    path = Path(path)
    if not path.is_dir():
        return f"{path} is not a folder"
    if not is_complete_checkpoint(path):
        return f"{path / _WRITTEN_LAST} is missing or cut short (the run stopped while saving this checkpoint)"
    for file in sorted(path.iterdir()):
        problem = _file_problem(file)
        if problem is not None:
            return f"{file} {problem}"
    return None


def _file_problem(file: Path) -> str | None:
    if not file.is_file():
        return None
    if file.suffix == ".safetensors":
        return _safetensors_problem(file)
    if file.suffix == ".json":
        try:
            json.loads(file.read_text())
        except (OSError, ValueError) as error:
            return f"is not valid JSON ({'empty' if not file.stat().st_size else error})"
        if file.name == "selective_rollout_state.json":
            from ..sampling.selective_rollout import state_problem

            problem = state_problem(json.loads(file.read_text()))
            return None if problem is None else f"is not a valid selective-rollout state ({problem})"
        return None
    if _TORCH_FILES.match(file.name):
        return None if zipfile.is_zipfile(file) else "is cut short or damaged (not a complete torch.save archive)"
    return None


def _safetensors_problem(file: Path) -> str | None:
    """A safetensors file is an 8-byte header length, a JSON header giving every tensor's byte range, then the data."""
    size = file.stat().st_size
    try:
        with file.open("rb") as f:
            (header_length,) = struct.unpack("<Q", f.read(8))
            if header_length > size - 8:
                raise ValueError
            header = json.loads(f.read(header_length))
    except (OSError, ValueError, struct.error):
        return "is cut short or damaged (no readable safetensors header)"
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if size < 8 + header_length + end:
        return f"is cut short: its header lists {8 + header_length + end} bytes, the file has {size}"
    return None


def last_complete_checkpoint(output_dir: str | Path) -> str | None:
    """Newest `checkpoint-N` under `output_dir` that was fully written and is undamaged, or None."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return None
    candidates = sorted(
        (int(m.group(1)), p) for p in output_dir.iterdir() if p.is_dir() and (m := _CHECKPOINT.match(p.name))
    )
    for _, path in reversed(candidates):
        problem = checkpoint_problem(path)
        if problem is None:
            return str(path)
        logger.warning("Skipping checkpoint %s: %s.", path, problem)
    return None


def resolve_checkpoint(resume_from_checkpoint: str | bool | None, output_dir: str | Path) -> str | None:
    """The checkpoint folder `resume_from_checkpoint` designates, checked, or None for a fresh start.

    True (or "true"/"last"/"latest" from a CLI) picks the newest undamaged checkpoint in output_dir, falling back
    past damaged ones; an explicit path must itself be undamaged."""
    if isinstance(resume_from_checkpoint, str) and resume_from_checkpoint.lower() in ("true", "last", "latest"):
        resume_from_checkpoint = True
    if not resume_from_checkpoint:
        return None
    if resume_from_checkpoint is True:
        found = last_complete_checkpoint(output_dir)
        if found is None:
            raise CheckpointError(
                f"resume_from_checkpoint=True, but {output_dir} holds no complete checkpoint (no checkpoint-N folder "
                "with an undamaged trainer_state.json, weights and optimizer state). Start without "
                "resume_from_checkpoint, or give the path of a checkpoint folder."
            )
        return found
    problem = checkpoint_problem(resume_from_checkpoint)
    if problem is not None:
        raise CheckpointError(f"Cannot resume from {resume_from_checkpoint}: {problem}.")
    return str(resume_from_checkpoint)


def check_adapter_matches(checkpoint: str | Path, model: Any) -> None:
    """Refuse, saying what differs, a checkpoint whose adapter has another shape than the model's (e.g. lora_r)."""
    saved_path = Path(checkpoint) / "adapter_config.json"
    configs = getattr(model, "peft_config", None)
    if not saved_path.is_file() or not configs:
        return
    saved = json.loads(saved_path.read_text())
    current = next(iter(configs.values())).to_dict()
    differences = [
        f"{key}: {_shown(saved.get(key))} in the checkpoint, {_shown(current.get(key))} in this run"
        for key in _ADAPTER_SHAPE_KEYS
        if _comparable(saved.get(key)) != _comparable(current.get(key))
    ]
    if differences:
        raise CheckpointError(
            f"{checkpoint} holds an adapter with other settings than this run's ({'; '.join(differences)}). Resume "
            "with the settings it was trained with (--lora_r, --lora_alpha, --lora_target_modules, ...), or train "
            "into a new output_dir."
        )


def _comparable(value: Any) -> Any:
    """Lists and sets of module names compare as sorted lists (PEFT saves the set it expanded 'all-linear' to)."""
    if isinstance(value, (list, set, tuple)):
        return sorted(value)
    return value


def _shown(value: Any) -> Any:
    """Module lists by their distinct names (PEFT saves 'all-linear' as every matching module's full path)."""
    if not isinstance(value, (list, set, tuple)):
        return value
    names = sorted({str(module).rsplit(".", 1)[-1] for module in value})
    return f"{len(value)} modules ({', '.join(names)})"


def checkpoint_step(checkpoint: str | Path) -> int:
    return int(json.loads((Path(checkpoint) / _WRITTEN_LAST).read_text())["global_step"])


# ---- what the trainer writes: no token, no local path ---------------------------------------------------------------


@contextlib.contextmanager
def without_hub_token(args: Any) -> Iterator[None]:
    """args.hub_token unset while `args` is pickled (transformers saves it as training_args.bin with every model and
    checkpoint): the token stays in memory for pushing, never on disk."""
    token = getattr(args, "hub_token", None)
    if token is None:
        yield
        return
    args.hub_token = None
    try:
        yield
    finally:
        args.hub_token = token


def register_hub_id(local_path: str | os.PathLike, hub_id: str) -> None:
    """Name the Hub id a local model folder was made from (the embedded model's cache), for `public_model_name`."""
    _KNOWN_HUB_IDS[os.path.realpath(local_path)] = hub_id


def hub_id_of(name_or_path: str) -> str | None:
    """The Hub id of a base model, where known: a Hub id itself, a folder of the Hub cache, a registered folder."""
    if not name_or_path:
        return None
    if not os.path.exists(name_or_path):
        return name_or_path if re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name_or_path) else None
    real = os.path.realpath(name_or_path)
    if real in _KNOWN_HUB_IDS:
        return _KNOWN_HUB_IDS[real]
    cached = _HUB_CACHE_SNAPSHOT.search(real)
    return f"{cached['org']}/{cached['name']}" if cached else None


def public_model_name(name_or_path: str) -> str:
    """What a model card or adapter config may say about a base model: its Hub id where known, else only the
    folder's name, never a local absolute path."""
    if not name_or_path:
        return name_or_path
    return hub_id_of(name_or_path) or Path(os.path.realpath(name_or_path)).name


def hide_local_base_model_path(folder: str | Path, local_path: str) -> None:
    """Replace the base model's local path in what PEFT wrote into `folder` (adapter_config.json's
    base_model_name_or_path, its model card's base_model) with `public_model_name`, atomically per file."""
    public = public_model_name(local_path)
    if not local_path or public == local_path:
        return
    for name, old, new in (
        ("adapter_config.json", json.dumps(local_path), json.dumps(public)),
        ("README.md", local_path, public),
    ):
        file = Path(folder) / name
        if not file.is_file():
            continue
        text = file.read_text()
        if old in text:
            partial = file.with_name(f".{name}.partial")
            partial.write_text(text.replace(old, new))
            partial.replace(file)
