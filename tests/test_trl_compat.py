"""grpo_plus.compat.versions (and the vLLM seam): the tested TRL window, the warning outside it, the hooked-method signature check."""

from __future__ import annotations

import re
import subprocess
import types
import warnings
from pathlib import Path

import pytest
import torch
import trl
import trl.trainer.utils as trl_utils
from helpers.models import prompt_dataset, tiny_trainer
from helpers.rewards import length_reward
from packaging.version import Version
from transformers import AutoModelForCausalLM

import grpo_plus
from grpo_plus.compat import versions as trl_versions
from grpo_plus.compat import vllm as trl_vllm
from grpo_plus.compat.loss import logps_unavailable_reason
from grpo_plus.compat.model import uses_continuous_batching
from grpo_plus.compat.versions import (
    HOOKED_METHODS,
    TESTED_TRL_MINORS,
    TRLCompatibilityError,
    UntestedTRLVersionWarning,
    VersionFloor,
    check_hooked_methods,
    check_trl_compatibility,
    is_tested_trl_version,
)

ROOT = Path(__file__).resolve().parents[1]
TESTED_TEXT = "1.14.x, 1.15.x, 1.16.x"


@pytest.fixture(autouse=True)
def fresh_warning_state(monkeypatch):
    """Each test sees the once-per-version warning afresh."""
    monkeypatch.setattr(trl_versions, "_warned_versions", set())


def build_trainer(tiny_model_dir, tmp_path, package=grpo_plus):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return tiny_trainer(tmp_path, length_reward, model=model, dataset=prompt_dataset(4), package=package)


# ------------------------------------------------------------------------------------------------ the version window


def test_installed_trl_is_in_the_window_and_passes_silently():
    assert is_tested_trl_version(trl.__version__), trl.__version__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_trl_compatibility()


@pytest.mark.parametrize("version", ["1.14.0", "1.14.2", "1.15.0", "1.16.0", "1.16.3", "1.16.0.dev0"])
def test_tested_versions(version):
    assert is_tested_trl_version(version)


@pytest.mark.parametrize("version", ["1.13.0", "1.17.0", "2.16.0", "0.16.0"])
def test_untested_version_warns_once_naming_the_tested_versions(version):
    with pytest.warns(UntestedTRLVersionWarning, match=re.escape(f"tested with TRL {TESTED_TEXT}; TRL {version}")):
        check_trl_compatibility(trl_version=version)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_trl_compatibility(trl_version=version)  # once per process is enough


def test_trainer_construction_warns_about_an_untested_trl(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(trl, "__version__", "1.17.0")
    monkeypatch.setattr("grpo_plus.trainer.logps_unavailable_reason", lambda device_type: None)  # TRL 1.15 on CPU
    with pytest.warns(UntestedTRLVersionWarning, match=re.escape(TESTED_TEXT)):
        build_trainer(tiny_model_dir, tmp_path)


def test_window_agrees_with_pyproject_and_makefile():
    """The TRL pin, the tested minors and the minors `make test-matrix` installs are the same window."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    (trl_requirement,) = re.findall(r'"trl([^"]*)"', pyproject)
    assert trl_requirement == f">={TESTED_TRL_MINORS[0]}.0,<{trl_versions._next_minor(TESTED_TRL_MINORS[-1])}"
    (makefile_minors,) = re.findall(r"^TRL_MINORS\s*\?=\s*(.+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert tuple(makefile_minors.split()) == TESTED_TRL_MINORS


def test_every_tested_minor_runs_once_in_ci():
    """make test runs the lock's TRL minor (constraints.txt) and the matrix every other tested minor: each tested
    minor is run, none twice (the matrix leaving out the lock's minor is what saves CI the duplicate run)."""
    (lock_trl,) = re.findall(r"^trl==(\d+\.\d+)\.", (ROOT / "constraints.txt").read_text(), re.MULTILINE)
    assert lock_trl in TESTED_TRL_MINORS
    plan = subprocess.run(
        ["make", "-s", "-p", "-n", "--no-print-directory", "lint"], cwd=ROOT, capture_output=True, text=True
    ).stdout
    (matrix_envs,) = re.findall(r"^MATRIX_ENVS := (.+)$", plan, re.MULTILINE)
    matrix_minors = [env.removeprefix("trl-") for env in matrix_envs.split() if env.startswith("trl-")]
    assert sorted([lock_trl, *matrix_minors]) == sorted(TESTED_TRL_MINORS)


def test_newest_runs_the_suite_unless_every_newest_release_is_the_locks(tmp_path):
    """The Makefile's `is_the_lock`: newest's packages (torch, the machine's own, and grpo_plus left out) equal to the
    lock's pins, in any order, and it has nothing new to test; one package released since, and it runs the suite."""
    lock = tmp_path / "constraints.txt"
    lock.write_text("# the lock\naccelerate==1.15.0\nfilelock==4.3.1\ntrl==1.16.0\n")
    (tmp_path / "newest").mkdir()

    def is_the_lock(freeze: str) -> bool:
        uv = tmp_path / "uv"  # stands in for `uv pip freeze --exclude-editable`
        uv.write_text(f"#!/bin/sh\nprintf '{freeze}'\n")
        uv.chmod(0o755)
        written = "grep -v '^#' $(LOCK) | LC_ALL=C sort -f > $(MATRIX_DIR)/newest/lock.txt"  # as the install writes it
        probe = f"probe: ; @{written}; if $(call is_the_lock,newest); then echo same; else echo differs; fi"
        done = subprocess.run(
            ["make", "-s", "--no-print-directory", "--eval", probe, "probe", f"LOCK={lock}", f"MATRIX_DIR={tmp_path}",
             f"UV={uv}"], cwd=ROOT, capture_output=True, text=True,
        )  # fmt: skip
        assert done.returncode == 0 and done.stdout in ("same\n", "differs\n"), done.stderr
        return done.stdout == "same\n"

    assert is_the_lock("trl==1.16.0\\ntorch==2.13.0+cpu\\naccelerate==1.15.0\\ngrpo-plus==0.1.0\\nfilelock==4.3.1\\n")
    assert not is_the_lock("trl==1.16.0\\naccelerate==1.15.0\\nfilelock==4.3.2\\n")  # a release since the lock
    assert not is_the_lock("trl==1.16.0\\naccelerate==1.15.0\\n")  # a package the lock pins is gone


# ------------------------------------------------------------------------------------------------ hooked signatures


def test_installed_trl_hooks_have_the_expected_signatures():
    check_hooked_methods()


class _LogpsLike114(trl.GRPOTrainer):
    def _get_per_token_logps_and_entropies(self, model, *args, batch_size=None, compute_aux_loss=False, **kwargs):
        raise NotImplementedError


class _LogpsLike115(trl.GRPOTrainer):
    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        pixel_values=None,
        image_grid_thw=None,
        num_images=None,
        pixel_attention_mask=None,
        spatial_shapes=None,
        num_tiles=None,
        image_sizes=None,
        token_type_ids=None,
        mm_token_type_ids=None,
        image_position_ids=None,
    ):
        raise NotImplementedError


@pytest.mark.parametrize("trainer_class", [_LogpsLike114, _LogpsLike115], ids=["trl-1.14-style", "trl-1.15-style"])
def test_both_log_prob_signatures_are_accepted(trainer_class):
    check_hooked_methods(trainer_class, trl_version="1.16.0")


class _GenerateLike1140(trl.GRPOTrainer):
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, has_tool_images=False):
        raise NotImplementedError


class _GenerateLike1142(trl.GRPOTrainer):
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        raise NotImplementedError


@pytest.mark.parametrize(
    "trainer_class", [_GenerateLike1140, _GenerateLike1142], ids=["trl-1.14.0-style", "trl-1.14.2+-style"]
)
def test_both_generation_signatures_are_accepted(trainer_class):
    """grpo_plus's override reads the first three parameters and passes the rest on, whatever they are."""
    check_hooked_methods(trainer_class, trl_version="1.16.0")


def test_uses_continuous_batching_reads_either_trl_attribute():
    trainer = types.SimpleNamespace(use_transformers_continuous_batching=False)
    assert not uses_continuous_batching(trainer)
    trainer.use_transformers_continuous_batching = True
    assert uses_continuous_batching(trainer)
    assert uses_continuous_batching(types.SimpleNamespace(use_transformers_paged=True))
    assert not uses_continuous_batching(types.SimpleNamespace())


def _changed(name, function):
    return type("ChangedTRLTrainer", (trl.GRPOTrainer,), {name: function})


CHANGED_HOOKS = {
    "_compute_loss-extra-parameter": ("_compute_loss", lambda self, model, inputs, num_items_in_batch: None),
    "_prepare_inputs-renamed": ("_prepare_inputs", lambda self, inputs: None),
    "_calculate_rewards-dropped-parameter": ("_calculate_rewards", lambda self, inputs, prompts, completions: None),
    "_generate_and_score_completions-keyword-only": (
        "_generate_and_score_completions",
        lambda self, *, inputs: None,
    ),
    "logps-no-logits_to_keep": (
        "_get_per_token_logps_and_entropies",
        lambda self, model, input_ids, attention_mask, batch_size=None, compute_entropy=False, **kw: None,
    ),
    "logps-no-compute_entropy": (
        "_get_per_token_logps_and_entropies",
        lambda self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_aux_loss=False: None,
    ),
    "generate-reordered": (
        "_generate_single_turn",
        lambda self, prompt_ids, multimodal_fields, images, num_generations: None,
    ),
    "generate-keyword-only": ("_generate_single_turn", lambda self, prompt_ids, *, images, multimodal_fields: None),
    "logps-reordered": (
        "_get_per_token_logps_and_entropies",
        lambda self, model, attention_mask, input_ids, logits_to_keep, **kwargs: None,
    ),
}


@pytest.mark.parametrize("case", CHANGED_HOOKS)
def test_changed_hook_signature_raises_naming_method_and_versions(case):
    name, function = CHANGED_HOOKS[case]
    with pytest.raises(TRLCompatibilityError, match=re.escape(f"GRPOTrainer.{name} changed")) as error:
        check_hooked_methods(_changed(name, function), trl_version="1.17.0")
    assert TESTED_TEXT in str(error.value) and "TRL 1.17.0" in str(error.value)


def test_missing_hook_raises(monkeypatch):
    monkeypatch.delattr(trl.GRPOTrainer, "_calculate_rewards")
    with pytest.raises(TRLCompatibilityError, match="_calculate_rewards changed \\(it does not exist\\)"):
        check_hooked_methods()


def test_trainer_construction_fails_on_a_changed_hook_before_any_training(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(trl.GRPOTrainer, "_calculate_rewards", lambda self, inputs, prompts, completions: None)
    with pytest.raises(TRLCompatibilityError, match="GRPOTrainer._calculate_rewards changed"):
        build_trainer(tiny_model_dir, tmp_path)


def test_the_record_of_hooked_methods_is_what_grpo_plus_overrides():
    """Every private TRL / transformers trainer method grpo_plus.GRPOTrainer redefines is recorded as overridden,
    and nothing else is: a new override cannot slip past the signature check."""
    overridden = {m.name for m in HOOKED_METHODS if m.overridden}
    redefined = {
        name
        for name in vars(grpo_plus.GRPOTrainer)
        if name.startswith("_") and not name.startswith("__") and hasattr(trl.GRPOTrainer, name)
    }
    assert overridden == redefined


# ------------------------------------------------------------------------------------------------ log-prob kernel


@pytest.mark.parametrize(
    ("installed", "off"),
    [("1.14.2", False), ("1.15.0", True), ("1.15.9", True), ("1.16.0", False), ("1.17.1", False)],
)
def test_a_floor_with_a_hole_is_off_only_inside_it(monkeypatch, installed, off):
    """`cpu_logps`: TRL computes log-probs on CPU before 1.15 (full logits) and from 1.16 (a torch fallback) only."""
    monkeypatch.setattr(trl_versions, "installed_version", lambda package: Version(installed))
    gap = trl_versions.CAPABILITY_FLOORS["cpu_logps"].gap()
    assert (gap is not None) == off
    assert gap is None or gap.startswith(f"trl 1.15.0 <= {installed} < 1.16.0: TRL 1.15 computes")
    plain = VersionFloor("plain", "trl", "1.15.0", "because").gap()
    assert plain == (None if installed >= "1.15" else f"trl {installed} < 1.15.0: because")


def test_the_floors_read_each_packages_metadata_once_per_process(monkeypatch):
    """The floors are asked every training step; each read of a package's metadata parses the installed
    distributions' files (5 ms), so the installed version is read once. Negative control: the cache cleared, it is
    read again."""
    reads = []
    monkeypatch.setattr("importlib.metadata.version", lambda package: reads.append(package) or "1.16.0")
    trl_versions.installed_version.cache_clear()
    try:
        gaps = [trl_versions.CAPABILITY_FLOORS["cpu_logps"].gap() for _ in range(3)]
        assert gaps == [None] * 3 and reads == ["trl"]
        trl_versions.installed_version.cache_clear()
        trl_versions.CAPABILITY_FLOORS["cpu_logps"].gap()
        assert reads == ["trl", "trl"]
    finally:
        trl_versions.installed_version.cache_clear()  # the real versions again for the tests after this one


def test_logps_unavailable_reason_follows_trl(monkeypatch):
    monkeypatch.delattr(trl_utils, "add_fused_lm_head", raising=False)
    assert logps_unavailable_reason("cpu") is None  # 1.14: full logits, no kernel needed
    monkeypatch.setattr(trl_utils, "add_fused_lm_head", object(), raising=False)
    monkeypatch.setattr(trl_utils, "_use_triton", lambda device: False, raising=False)
    assert logps_unavailable_reason("cpu") is None  # 1.16: a plain-torch fallback
    monkeypatch.delattr(trl_utils, "_use_triton")
    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", None, raising=False)
    assert "Triton is not installed" in logps_unavailable_reason("cuda")  # 1.15 with a CPU-only torch
    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", object())
    assert "runs on CUDA/XPU, not cpu" in logps_unavailable_reason("cpu")  # 1.15 with Triton, on CPU
    assert logps_unavailable_reason("cuda") is None  # 1.15 with Triton, on a GPU


def test_logps_unavailable_reason_is_true_of_stock_trl(tiny_model_dir, tmp_path):
    """The reason the matrix skips training tests is a fact, not an assumption: stock TRL's log-prob computation
    fails exactly when a reason is given."""
    trainer = build_trainer(tiny_model_dir, tmp_path, package=trl)
    input_ids = torch.randint(3, 20, (2, 6))
    call = lambda: trainer._get_per_token_logps_and_entropies(  # noqa: E731
        trainer.model, input_ids, torch.ones_like(input_ids), 3, compute_entropy=True
    )
    if logps_unavailable_reason("cpu") is None:
        logps, entropies, _ = call()
        assert logps.shape == entropies.shape == (2, 3) and torch.isfinite(logps).all()
    else:
        with pytest.raises((AttributeError, TypeError)):
            call()


def test_trainer_construction_fails_where_trl_cannot_compute_log_probs(tiny_model_dir, tmp_path, monkeypatch):
    """TRL 1.15 on CPU: a clear error when the trainer is built, not TRL's AttributeError at the first step."""
    reason = "TRL 1.15.0 computes log-probs only with its Triton kernel, which runs on CUDA/XPU, not cpu"
    monkeypatch.setattr("grpo_plus.trainer.logps_unavailable_reason", lambda device_type: reason)
    with pytest.raises(TRLCompatibilityError, match=re.escape(f"grpo_plus cannot train here: {reason}.")):
        build_trainer(tiny_model_dir, tmp_path)


def test_transformers_renames_that_trl_and_peft_still_use_are_silenced_and_nothing_else(tmp_path):
    """transformers 5.2x warns on the old gradient-checkpointing names, which TRL's GRPOConfig default and TRL's /
    PEFT's calls use at every generation step (the demo printed it after every checkpoint save); grpo_plus silences
    exactly those messages (on older transformers there is nothing to silence)."""
    from helpers.models import make_model, make_tokenizer

    import grpo_plus.config  # noqa: F401  (imported first: importing it installs the filters under test)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trl_versions.ignore_renames_trl_still_uses()  # what importing grpo_plus.config does
        grpo_plus.GRPOConfig(output_dir=str(tmp_path), use_cpu=True)  # TRL's default gradient_checkpointing=True
        model = make_model(make_tokenizer())
        model.gradient_checkpointing_enable()
        assert model.is_gradient_checkpointing
        model.gradient_checkpointing_disable()
        warnings.warn("another deprecation", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in caught if issubclass(w.category, FutureWarning)] == ["another deprecation"]


@pytest.mark.parametrize("method", trl_vllm.COLOCATE_SYNC_METHODS)
def test_the_colocate_sync_fails_at_construction_when_trl_lacks_a_method_it_wraps(monkeypatch, method):
    """grpo_plus replaces TRL's weight stream and wraps its `sync_weights` on the `VLLMGeneration` instance (the sync
    check runs after it); a TRL without one of them fails when the trainer wires the sync, naming it."""
    from trl.generation.vllm_generation import VLLMGeneration

    assert trl_vllm.colocate_weight_stream_name() == "_iter_named_params"
    monkeypatch.delattr(VLLMGeneration, method)
    with pytest.raises(TRLCompatibilityError, match=f"VLLMGeneration has no {method}"):
        trl_vllm.colocate_weight_stream_name()


@pytest.mark.floor("fused_lm_head", "cpu_logps")  # TRL 1.16: its module imports without Triton
def test_where_the_lm_head_folds_is_read_on_every_tested_trl(monkeypatch):
    """TRL 1.16 folds the fused LM head's tiles with torch operators off CUDA/XPU (`_use_triton`); TRL 1.15 has no
    such fallback and no `_use_triton`: its Triton kernel is the only path. Reading it failed on a CUDA machine with
    TRL 1.15 (an AttributeError in the first training step, seen on an H200). TRL 1.15's module imports Triton, which a
    CPU machine lacks, so its shape (the module without `_use_triton`) stands in for it here."""
    import sys
    import types

    import trl.kernels

    from grpo_plus.compat.lm_head import lm_head_folds_in_torch

    assert lm_head_folds_in_torch(torch.device("cpu")) is True  # TRL 1.16's own module: the torch fold off CUDA
    triton_only = types.ModuleType("trl.kernels.chunked_logprob")  # TRL 1.15's: no _use_triton
    monkeypatch.setitem(sys.modules, "trl.kernels.chunked_logprob", triton_only)
    monkeypatch.setattr(trl.kernels, "chunked_logprob", triton_only, raising=False)
    assert lm_head_folds_in_torch(torch.device("cuda")) is False


def test_the_engine_reads_its_max_tokens_at_every_request():
    """Partial rollouts with colocated vLLM set the chunk's token budget on TRL's `VLLMGeneration` for one call
    (`compat.vllm.engine_max_tokens`): true only while its `generate` reads the attribute at each call, in both modes."""
    import inspect
    import types

    from trl.generation.vllm_generation import VLLMGeneration

    source = inspect.getsource(VLLMGeneration.generate)
    assert f"max_completion_length = self.{trl_vllm.ENGINE_MAX_TOKENS}" in source
    assert source.count('"max_tokens": max_completion_length') == 2  # server and colocate requests
    generation = types.SimpleNamespace(**{trl_vllm.ENGINE_MAX_TOKENS: 256})
    with trl_vllm.engine_max_tokens(generation, 3):
        assert getattr(generation, trl_vllm.ENGINE_MAX_TOKENS) == 3
    assert getattr(generation, trl_vllm.ENGINE_MAX_TOKENS) == 256
