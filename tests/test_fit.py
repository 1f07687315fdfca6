"""`grpo-plus fit` and the trainer's fit check count the configured objective: every field the loss reads reaches the
counting trainer, from a list derived from the registries and TRL's source (`objective_fields`)."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys

import pytest
import torch

import grpo_plus
from grpo_plus import fit
from grpo_plus.compat.loss import trl_loss_fields
from grpo_plus.fit.spec import objective_fields

needs_cpu_logps = pytest.mark.floor("cpu_logps")
# The shortcuts skip tiles of TRL's fused LM head (TRL >= 1.15); TRL 1.14 computes full logits, and its activation
# offloading needs CUDA streams (tests/test_long_completions.py counts the same way).
needs_fused_lm_head = pytest.mark.floor("fused_lm_head")

# What a config says that a count reads from elsewhere than `spec.loss` (so the loss path may read it freely).
READ_ELSEWHERE = {
    "bf16": "FitSpec.mixed_precision",
    "fp16": "FitSpec.mixed_precision",
    "report_to": "TRL's metrics logging (no memory of the pass)",
}
# What grpo_plus's trainer reads when it wires its training pass (its settings are read once) for parts a count never
# runs: a count has no sampler to correct and runs the training forward, not the no-grad passes after the split.
READ_FOR_WHAT_A_COUNT_SKIPS = {
    "gradient_accumulation_steps": "whether the sampler correction may come from the training forward (on-policy)",
    "num_iterations": "whether the sampler correction may come from the training forward (on-policy)",
    "gradient_checkpointing_kwargs": "the no-grad old / reference passes after the split, with checkpointing off",
    "vllm_importance_sampling_mode": "TRL's vLLM correction (no sampler in a count)",
    "vllm_importance_sampling_clip_min": "TRL's vLLM correction (no sampler in a count)",
    "vllm_importance_sampling_clip_max": "TRL's vLLM correction (no sampler in a count)",
}
# An objective far from the defaults: every axis, an option, the KL term, the entropy and off-policy masks.
OBJECTIVE = dict(
    policy_loss="kl_cov", kl_cov_ratio=0.01, kl_estimator="k1", beta=0.04, adaptive_kl_target=0.1,
    advantage_estimator="rloo", scale_rewards="none", entropy_coef=0.01, top_entropy_quantile=0.8,
    off_policy_mask_threshold=0.5, epsilon_high=0.28,
)  # fmt: skip


@pytest.fixture
def own_counting_trainers():
    """Counting trainers built for this test alone (a real pass leaves CPU tensors in a trainer's state, e.g. the
    adaptive KL window, that a later fake count must not meet)."""
    fit.count._TRAINERS.clear()
    yield
    fit.count._TRAINERS.clear()


def spec_of(tmp_path, **objective) -> fit.FitSpec:
    args = grpo_plus.GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", per_device_train_batch_size=4,
        num_generations=4, max_completion_length=16, **objective,
    )  # fmt: skip
    spec = fit.FitSpec.from_config(args, fit.known_config("tiny-qwen2"), torch.float32, None, False, 12)
    return spec.replace(mixed_precision="no")


class _Recorder:
    """Stands in for an object and records the attribute names read from it (the settings groups it holds too)."""

    def __init__(self, target, names: set[str]):
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_names", names)

    def __getattr__(self, name):
        self._names.add(name)
        value = getattr(self._target, name)
        return _Recorder(value, self._names) if dataclasses.is_dataclass(value) else value


def fields_the_loss_reads(trainer, spec: fit.FitSpec, side: str) -> set[str]:
    """The GRPOConfig fields the counting trainer reads while it computes one micro-batch's loss for real: from its
    config, its own attributes (TRL keeps many under the field's name) and grpo_plus's settings groups. grpo_plus's
    trainer reads its loss settings once, when it wires its training pass: that wiring is recorded too."""
    names: set[str] = set()
    cls, saved = type(trainer), dict(trainer.__dict__)

    def getattribute(self, name):
        names.add(name)
        return object.__getattribute__(self, name)

    trainer.__class__ = type(f"Recording{cls.__name__}", (cls,), {"__getattribute__": getattribute})
    for holder in ("args", "plus"):
        if holder in saved:
            trainer.__dict__[holder] = _Recorder(saved[holder], names)
    try:
        if hasattr(trainer, "_wire_training_pass"):
            trainer._wire_training_pass()
        fit.measure_pass(spec, side, layers=1, real=True, lm_head="cpu")
    finally:
        trainer.__class__ = cls
        trainer.__dict__.update({holder: saved[holder] for holder in ("args", "plus") if holder in saved})
    return names & {f.name for f in dataclasses.fields(grpo_plus.GRPOConfig)}


def test_the_objective_fields_come_from_the_registries_and_trls_loss():
    """policy_loss and kl_estimator (once left out), every registered policy loss's options, and what TRL's own
    `_compute_loss` reads (found in TRL's source: epsilon through `self.epsilon_low`, the entropy bonus's fields)."""
    fields = set(objective_fields())
    for registry in grpo_plus.objective.REGISTRIES:
        assert registry.field in fields
    assert {"clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "kl_cov_coef", "dual_clip"} <= fields
    assert {"epsilon", "epsilon_high", "beta", "delta", "entropy_coef", "use_bias_correction_kl"} <= trl_loss_fields()
    assert trl_loss_fields() <= fields


def test_a_loss_option_registered_later_is_counted(tmp_path):
    """A policy loss registered by the user adds its options to what is counted, without an edit to the fit."""
    from grpo_plus.objective import POLICY_LOSSES, Option

    assert "scale" not in objective_fields()
    POLICY_LOSSES.register("scaled_test", lambda ctx: None, traits={"options": {"scale": Option(1.0)}})
    assert "scale" not in objective_fields()  # not a GRPOConfig field: nothing a config could set
    assert "clip_cov_ratio" in objective_fields()


@needs_cpu_logps
@pytest.mark.parametrize("side", fit.SIDES)
def test_every_field_the_loss_reads_reaches_the_counting_trainer(tmp_path, side, own_counting_trainers):
    """Run the counting trainer's loss for real and record every config field it reads: each one is in the spec's
    objective (and set on the counting trainer as the config has it) or read from elsewhere on purpose. A field the
    loss reads but the count leaves out fails here."""
    spec = fit.for_side(spec_of(tmp_path, **OBJECTIVE), side)
    trainer = fit.counting_trainer(side, spec)
    read = fields_the_loss_reads(trainer, spec, side)
    assert {"loss_type", "importance_sampling_level", "top_entropy_quantile"} <= read  # it sees the loss path
    assert read - set(spec.loss) - set(READ_ELSEWHERE) - set(READ_FOR_WHAT_A_COUNT_SKIPS) == set()
    own = ("max_completion_length", "steps_per_generation", "use_vllm")  # the counting trainer's own run
    for name, value in spec.loss.items():
        if name not in own:
            assert getattr(trainer.args, name) == value, name


@needs_cpu_logps
def test_the_count_follows_the_configured_objective(tmp_path):
    """The KL term and kl_cov's penalty are counted (they allocate per-token tensors the default objective does not),
    and the spec carries the names it was given."""
    default, configured = spec_of(tmp_path), spec_of(tmp_path, **OBJECTIVE)
    assert (configured.loss["policy_loss"], configured.loss["kl_estimator"]) == ("kl_cov", "k1")
    counts = {name: fit.measure_pass(spec, "grpo_plus", layers=1) for name, spec in
              (("default", default), ("configured", configured))}  # fmt: skip
    assert counts["configured"].peak > counts["default"].peak


# ---- the fit answers fast with the same answers -------------------------------------------------------------------


def tiny(**changes) -> fit.FitSpec:
    config = fit.known_config("tiny-qwen2", max_position_embeddings=32768)
    spec = fit.FitSpec(
        model_config=config.to_dict(), weights_dtype="bfloat16", rows=2, num_generations=2, generation_rows=2,
        prompt_tokens=12, completion_tokens=9000, lora=dict(r=4, lora_alpha=8, lora_dropout=0.0,
        target_modules="all-linear"), gradient_checkpointing=True, loss={"loss_type": "dapo"},
    )  # fmt: skip
    return spec.replace(**changes)


def without_shortcuts(monkeypatch) -> None:
    """The count as it was before it was made fast: every tile of TRL's LM head, host copies of small tensors as fake
    tensors computed twice, every operator on real inputs checked by running it fake first."""
    from grpo_plus.fit import memory

    monkeypatch.setattr(memory, "_distinct_steps", lambda *args: range(*args))
    monkeypatch.setattr(memory, "_kept_mlp_tiles", lambda count: set(range(count)))
    monkeypatch.setattr(memory, "_to_host", lambda kwargs: False)
    monkeypatch.setattr(memory, "_output_bound", lambda func, args: None)


@needs_cpu_logps
@needs_fused_lm_head
@pytest.mark.parametrize("side", fit.SIDES)
@pytest.mark.parametrize("options", [False, True], ids=["plain", "memory-options"])
@pytest.mark.engine  # a heavy memory count (moved out of make test: its 10-minute budget)
def test_the_shortcuts_count_what_the_full_count_counts(side, options, monkeypatch):
    """TRL's LM head over 5 token tiles (18K positions) counted on its distinct tiles only, and the packing's CPU work
    on real values: the device counts are the full count's, byte for byte, on both sides, with and without
    activation offloading and the tiled MLP."""
    spec = fit.with_memory_options(tiny(), side) if options else fit.for_side(tiny(), side)
    fast = fit.measure_pass(spec, side, layers=2)
    without_shortcuts(monkeypatch)
    full = fit.measure_pass(spec, side, layers=2)
    device = ("saved", "after_forward", "forward_peak", "peak", "after_backward", "items_faked")
    assert {name: getattr(fast, name) for name in device} == {name: getattr(full, name) for name in device}
    assert fast.peak > 0


DEVICE_COUNTS = ("saved", "after_forward", "forward_peak", "peak", "after_backward", "host_peak", "items_faked")


def wide_mlp(**changes) -> fit.FitSpec:
    """A pass whose MLP tiles bind: a 16,384-wide MLP, 4 rows of 9,012 positions (36,048 per forward)."""
    config = fit.known_config("tiny-qwen2", max_position_embeddings=32768)
    config.intermediate_size = 16384
    return fit.for_side(tiny(model_config=config.to_dict(), rows=4, padded_prompts=False, **changes), "grpo_plus")


@needs_cpu_logps
@needs_fused_lm_head
@pytest.mark.parametrize(
    "changes",
    [
        dict(tiled_mlp_tokens=3000),  # 13 tiles, the last of 48 positions
        dict(tiled_mlp_tokens=4506, weights_dtype="float32"),  # 8 tiles, every one full
        dict(tiled_mlp_tokens=3000, gradient_checkpointing=False),  # the tiles' own checkpoints alone
        dict(tiled_mlp_tokens=3000, activation_offloading=True, gradient_checkpointing=False),  # inputs offloaded
    ],
    ids=["partial-last", "all-full-fp32", "no-checkpointing", "offloaded"],
)
@pytest.mark.engine  # a heavy memory count (moved out of make test: its 10-minute budget)
def test_a_tiled_mlp_counted_on_four_tiles_counts_what_every_tile_counts(changes, monkeypatch):
    """grpo_plus's tiled MLP counted on its first two and last two tiles (the others leave nothing behind: they write
    into buffers the first tile allocated): every count of the pass, device and host, is the full count's, byte for
    byte."""
    from grpo_plus.fit import memory

    spec = wide_mlp(**changes)
    fast = fit.measure_pass(spec, "grpo_plus", layers=2)
    monkeypatch.setattr(memory, "_kept_mlp_tiles", lambda count: set(range(count)))
    full = fit.measure_pass(spec, "grpo_plus", layers=2)
    assert {name: getattr(fast, name) for name in DEVICE_COUNTS} == {
        name: getattr(full, name) for name in DEVICE_COUNTS
    }


@needs_cpu_logps
@needs_fused_lm_head
@pytest.mark.engine  # a heavy memory count (moved out of make test: its 10-minute budget)
def test_a_tiled_mlp_counted_on_fewer_tiles_counts_less(monkeypatch):
    """Negative controls of the test above: without the second tile the forward's peak is missed (the first tile's
    output is still alive while the second runs), without the one before the last the backward's."""
    from grpo_plus.fit import memory

    spec = wide_mlp(tiled_mlp_tokens=3000)
    full = fit.measure_pass(spec, "grpo_plus", layers=2)
    monkeypatch.setattr(memory, "_kept_mlp_tiles", lambda count: {0, count - 1})
    assert fit.measure_pass(spec, "grpo_plus", layers=2).forward_peak < full.forward_peak
    monkeypatch.setattr(memory, "_kept_mlp_tiles", lambda count: {0, 1, count - 1})
    assert fit.measure_pass(spec, "grpo_plus", layers=2).peak < full.peak


@needs_cpu_logps
@needs_fused_lm_head  # TRL 1.14's activation offloading needs CUDA streams
@pytest.mark.engine  # a heavy memory count (moved out of make test: its 10-minute budget)
def test_activation_offloading_lets_go_of_the_layer_input_before_the_mlp_tiles(monkeypatch):
    """With activation offloading, the layer's recompute brings its input back to the device, and TRL's offloader holds
    it until the autograd node that asked for it is done: the tiled MLP has a one-element node ask first, so the input
    is let go before the tiles' backward and the pass peaks where it peaks without offloading (to 8 bytes). Negative control:
    without that node the tiles' backward asks, and the input is held through every tile."""
    from grpo_plus.long_completions import tiled_mlp

    plain = fit.measure_pass(wide_mlp(tiled_mlp_tokens=3000), "grpo_plus", layers=2)
    offloaded = fit.measure_pass(wide_mlp(tiled_mlp_tokens=3000, activation_offloading=True), "grpo_plus", layers=2)
    assert offloaded.saved == 0 and offloaded.host_peak > plain.host_peak  # the checkpoints did go to the host
    assert 0 <= offloaded.peak - plain.peak <= 8  # measured: 8 bytes (a scalar the offloading pass keeps)
    monkeypatch.setattr(tiled_mlp._RecomputeFirst, "apply", lambda out, x: out)
    held = fit.measure_pass(wide_mlp(tiled_mlp_tokens=3000, activation_offloading=True), "grpo_plus", layers=2)
    assert held.peak - plain.peak > 2**20  # measured: the layer's input, [4 x 9012 x 64] float32 (8.8 MiB)


@needs_cpu_logps
def test_activation_offloading_is_counted_or_refused_by_name(monkeypatch):
    """Above the `offloading_count` floor (or on CUDA) TRL's activation offloading runs in the count and the checkpoints
    it saves go to the host; below it (TRL 1.14-1.15 without CUDA: their offloading leaves the stand-in accelerator's
    tensors where they are) the count refuses it by name instead of counting a pass that offloaded nothing, and the
    memory options leave it out. Negative control: with the floor said to apply, the refusal and the left-out option."""
    from grpo_plus.fit import spec as fit_spec

    offloaded_spec = fit.for_side(tiny(activation_offloading=True), "grpo_plus")
    if fit_spec.offloading_uncountable() is None:
        plain = fit.measure_pass(fit.for_side(tiny(), "grpo_plus"), "grpo_plus", layers=2)
        offloaded = fit.measure_pass(offloaded_spec, "grpo_plus", layers=2)
        assert offloaded.saved == 0 < plain.saved and offloaded.host_peak > plain.host_peak
        assert fit.with_memory_options(tiny(), "grpo_plus").activation_offloading
    monkeypatch.setattr(
        fit_spec, "version_gap", lambda name: "trl 1.15.0 < 1.16.0: below" if name == "offloading_count" else None
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="cannot count activation_offloading=True here: trl 1.15.0 < 1.16.0"):
        fit.measure_pass(offloaded_spec, "grpo_plus", layers=2)
    with pytest.raises(ValueError, match="with TRL >= 1.16, or without activation_offloading"):
        fit.fit_report(offloaded_spec, 2**40, groups=False, parallel=False)
    assert not fit.with_memory_options(tiny(), "grpo_plus").activation_offloading


# The reports below count about a hundred passes and generations, each some 2,000 operators on fake tensors whatever
# their shapes: with LoRA on one projection (an adapter still goes to the children in the spec's JSON) an estimate
# takes 1.3 s of CPU, with LoRA on every linear layer 2.2 s (measured).
CHEAP_LORA = fit.lora_fields(4, 8, 0.0, ["q_proj"])


@needs_cpu_logps
@needs_fused_lm_head  # with every memory option: TRL 1.14's activation offloading needs CUDA streams
@pytest.mark.engine  # whole reports counted in child processes (a minute or more on this 2-core machine)
def test_the_report_counts_trls_side_in_a_child_process_with_the_same_answers(monkeypatch, tmp_path):
    """`grpo-plus fit`'s report with TRL's side counted in a child process (the default) is the serial report, answer
    for answer (both sides' parts, the fixes of an over-budget config, the longest completions); a child that fails,
    after reading its spec or before, raises with its exit code and its last words instead of a report with a side
    missing. Here, within `remembered_counts`: grpo_plus's side, counted in this process by every report, is counted
    once; TRL's side in a child counts afresh."""
    import sys

    config = fit.known_config("tiny-qwen2", max_position_embeddings=16 + fit.LENGTH_STEP)  # one length
    spec = tiny(model_config=config.to_dict(), rows=64, num_generations=8, generation_rows=64, prompt_tokens=16,
                completion_tokens=128, gradient_checkpointing=False, weights_dtype="float32",
                lora=CHEAP_LORA)  # fmt: skip
    budget = int(0.292 * fit.GIB)  # TRL's worst step 0.295 GiB, grpo_plus's 0.288
    with fit.count.remembered_counts():
        serial = fit.fit_report(spec, budget, groups=False, parallel=False)
        child = fit.fit_report(spec, budget, groups=False)
        assert any(serial.fixes.values())  # over the budget on a side: its fixes are counted too
        for side in fit.SIDES:
            assert child.at_settings[side].parts() == serial.at_settings[side].parts()
        assert (child.fixes, child.longest, child.largest_group) == (
            serial.fixes,
            serial.longest,
            serial.largest_group,
        )
        reads_then_fails = tmp_path / "python"  # reads its spec, then fails without an answer
        reads_then_fails.write_text("#!/bin/sh\ncat > /dev/null\necho 'no count here' >&2\nexit 3\n")
        reads_then_fails.chmod(0o755)
        monkeypatch.setattr(sys, "executable", str(reads_then_fails))
        with pytest.raises(RuntimeError, match="TRL's side in a child process failed \\(exit 3\\):\nno count here"):
            fit.fit_report(spec, budget, groups=False)
        monkeypatch.setattr(sys, "executable", "/bin/false")  # ends at once: maybe before its spec is written
        with pytest.raises(RuntimeError, match="TRL's side in a child process failed \\(exit 1\\)"):
            fit.fit_report(spec, budget, groups=False)


@needs_cpu_logps
@needs_fused_lm_head
@pytest.mark.engine  # whole reports counted in child processes (a minute or more on this 2-core machine)
def test_the_report_split_into_jobs_has_the_serial_answers(monkeypatch):
    """With the largest-G searches, on four or more CPUs: each side's worst step and longest completion, and its
    largest G, are four jobs (three children; on two or three CPUs TRL's side is one child, as the test above runs it),
    merged into the serial report's answers, fixes and largest G included. Within `remembered_counts`, as the test
    above: the job counted in this process reuses the serial report's counts, the children count afresh."""
    import os

    config = fit.known_config("tiny-qwen2", max_position_embeddings=16 + fit.LENGTH_STEP)
    spec = tiny(model_config=config.to_dict(), rows=8, num_generations=4, generation_rows=8, prompt_tokens=16,
                completion_tokens=32, gradient_checkpointing=False, weights_dtype="float32",
                lora=CHEAP_LORA)  # fmt: skip
    budget = int(0.03 * fit.GIB)
    started: list = []
    start = fit.search._start_side_report
    with fit.count.remembered_counts():
        serial = fit.fit_report(spec, budget, parallel=False)
        monkeypatch.setattr(fit.search, "_start_side_report", lambda *args: started.append(args[2:]) or start(*args))
        monkeypatch.setattr(os, "cpu_count", lambda: 4)
        jobs = fit.fit_report(spec, budget)
    assert started == [("trl", ("settings",)), ("trl", ("groups",)), ("grpo_plus", ("groups",))]
    assert serial.largest_group == {"trl": 10, "grpo_plus": 12}  # not the same on both sides: a swap would show
    for side in fit.SIDES:
        assert jobs.at_settings[side].parts() == serial.at_settings[side].parts()
    assert (jobs.fixes, jobs.longest, jobs.largest_group) == (serial.fixes, serial.longest, serial.largest_group)


@needs_cpu_logps
@needs_fused_lm_head
def test_offloading_counts_a_saved_tensor_with_broadcast_strides(monkeypatch):
    """Activation offloading without gradient checkpointing, float32: autograd saves the efficient attention kernel's
    expanded block-mask bias (broadcast strides), whose storage TRL copies into host memory it pins; the stand-in
    accelerator has no pinned allocator, so the count uses pageable host memory (the same bytes) and counts what moves
    to the host. This is the count `grpo-plus fit` makes for the fix "activation_offloading=True" of an over-budget
    config without gradient checkpointing. Negative control: with pinned host memory the count fails."""
    import grpo_plus.long_completions.offloading

    spec = tiny(gradient_checkpointing=False, activation_offloading=True, weights_dtype="float32", rows=8,
                num_generations=4, generation_rows=8, completion_tokens=32, mixed_precision="no")  # fmt: skip
    kernels: list = []
    counted = fit.measure_pass(spec, "grpo_plus", 1, kernels=kernels)
    assert kernels == ["efficient"] and counted.host_peak > 0
    pinned = grpo_plus.long_completions.offloading.offloading_context
    monkeypatch.setattr(
        grpo_plus.long_completions.offloading,
        "offloading_context",
        lambda model, device, pin_memory: pinned(model, device),
    )
    with pytest.raises(NotImplementedError, match="getPinnedMemoryAllocator"):
        fit.measure_pass(spec, "grpo_plus", 1)


def test_index_bound_is_at_least_what_indexing_makes():
    """The shortcut that runs an advanced index on real CPU values without a fake probe first bounds its output from
    the shapes: never below the elements it makes, for integer, boolean and mixed indices (exact where no mask)."""
    from grpo_plus.fit.memory import _index_bound

    generator = torch.Generator().manual_seed(0)
    source = torch.zeros(5, 6, 7)
    mask = torch.rand(5, 6, generator=generator) > 0.5
    rows, columns = torch.tensor([0, 4, 2]), torch.tensor([[1], [3]])
    for indices in ([rows], [None, rows], [mask], [rows, columns], [None, None, rows], [None, columns, rows]):
        made = source[tuple(slice(None) if index is None else index for index in indices)].numel()
        bound = _index_bound(source, indices)
        assert bound >= made
        if not any(index is not None and index.dtype == torch.bool for index in indices):
            assert bound == made


@pytest.mark.parametrize("seed", range(8))
def test_the_search_is_exact_on_any_increasing_cost(seed):
    """`largest_within` against a full scan, on increasing costs with plateaus, jumps and bends (what a count's steps
    look like): the same n, and it is never asked for a count twice."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(200):
        high = int(torch.randint(2, 600, (1,), generator=generator))
        steps = torch.rand(high, generator=generator) * (torch.rand(high, generator=generator) < 0.7)
        steps += (torch.rand(high, generator=generator) < 0.02) * 50  # a jump: another term binds
        costs = (steps.cumsum(0) + torch.arange(high) ** 2 * float(torch.rand(1, generator=generator)) / high).tolist()
        budget = float(torch.rand(1, generator=generator)) * costs[-1] * 1.1
        asked: list[int] = []
        found = fit.largest_within(
            lambda n, asked=asked, costs=costs: asked.append(n) or costs[n - 1], budget, 1, high
        )
        assert found == max((n for n in range(1, high + 1) if costs[n - 1] <= budget), default=0)
        assert len(asked) == len(set(asked))


# What counts (the counter on fake tensors, the attention kernels, the counts, the searches, the private torch APIs
# under them): it loads in the child process that counts, never in a training process.
COUNTING_MODULES = {
    "grpo_plus.fit.memory", "grpo_plus.fit.attention", "grpo_plus.fit.count", "grpo_plus.fit.search",
    "grpo_plus.compat.torch",
}  # fmt: skip


def modules_loaded_by(statement: str) -> set[str]:
    """The modules a fresh Python process holds after `statement`."""
    code = f"import json, sys; {statement}; print(json.dumps(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(json.loads(result.stdout.strip().splitlines()[-1]))


@pytest.mark.slow  # two fresh Python processes
@pytest.mark.engine  # its work is in child processes it starts (two imports, 17 s): make test-engines
def test_the_trainer_imports_the_fit_check_and_none_of_the_counting_code():
    """Importing the trainer loads the fit check (grpo_plus.fit.check) and none of the counting code. Negative control:
    reading a counting name of grpo_plus.fit (what the CLI and the benchmarks do) loads all of it. torch 2.13 loads
    torch._subclasses.fake_tensor with `import torch` itself, so that module tells nothing here."""
    trainer = modules_loaded_by("import grpo_plus.trainer")
    assert "grpo_plus.fit.check" in trainer
    assert trainer & COUNTING_MODULES == set()
    assert modules_loaded_by("from grpo_plus.fit import fit_report") >= COUNTING_MODULES


@needs_cpu_logps
def test_a_count_keeps_the_training_codes_notes_to_itself(monkeypatch, caplog):
    """A count runs training code, which notes its fallbacks once per process (here the tiled MLP under LoRA dropout
    runs whole); the count (`fit.measure_pass`) logs none of it. Negative control: the same pass counted without the
    count's `quiet` (the function it wraps) logs the note."""
    import logging

    from grpo_plus.long_completions import tiled_mlp

    spec = fit.for_side(
        tiny(completion_tokens=20, tiled_mlp_tokens=16, lora=fit.lora_fields(4, 8, 0.05, "all-linear")), "grpo_plus"
    )
    note = "tiled_mlp_tokens: the MLP runs whole, because dropout is active inside the MLP"
    for measure, logged in ((fit.measure_pass, False), (fit.count.measure_pass.__wrapped__, True)):
        monkeypatch.setattr(tiled_mlp, "_noted", set())  # never said yet in this process
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            measure(spec, "grpo_plus", layers=1)
        assert (note in caplog.text) is logged, caplog.text


@pytest.mark.slow  # two Python processes counting (~35 s of CPU)
@needs_cpu_logps
@needs_fused_lm_head  # the report searches with every memory option: TRL 1.14's activation offloading needs CUDA streams
@pytest.mark.engine  # its work is in child processes it starts (grpo-plus fit and its child, 20 s): make test-engines
def test_grpo_plus_fit_ends_with_its_report_without_the_trainers_notes(tmp_path):
    """`grpo-plus fit` on a config whose training pass a training run would note (LoRA dropout: the zero-waste pass
    computes rows in full, the tiled MLP runs whole; once per process each): what it prints, stdout and stderr
    together, ends with the report's last line and holds none of those notes, which belong to a training run, not to a
    count (the count runs the same code and takes the same fallbacks). Negative control: the notes are what a training
    pass of the count's trainer logs (measured before the fix: both printed above the report; with LoRA on the MLP's
    gate projection alone, as here, a count without `quiet` logs both, and makes fewer operators than with LoRA on
    every linear layer)."""
    fit.known_config("tiny-qwen2", max_position_embeddings=16 + fit.LENGTH_STEP).save_pretrained(tmp_path / "m")
    (tmp_path / "run.yaml").write_text(
        f"model_name_or_path: {tmp_path / 'm'}\ndtype: float32\nuse_peft: true\nlora_r: 4\nlora_alpha: 8\n"
        "lora_dropout: 0.05\nlora_target_modules: [gate_proj]\nbf16: false\nper_device_train_batch_size: 8\n"
        "num_generations: 4\nmax_completion_length: 32\nloss_type: dapo\ngradient_checkpointing: false\n"
        "tiled_mlp_tokens: 64\n"
    )
    command = [sys.executable, "-m", "grpo_plus.app.cli", "fit", "--config", str(tmp_path / "run.yaml"),
               "--prompt-tokens", "16", "--no-groups"]  # fmt: skip
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
    assert result.returncode == 0, result.stdout
    for note in ("Zero-waste pass: the zero-waste pass", "tiled_mlp_tokens: the MLP runs whole"):
        assert note not in result.stdout, result.stdout
    last = result.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"longest completion: TRL \d+ tokens, grpo_plus \d+ tokens \([\d.]+x\)", last), result.stdout
