"""DeepSpeed ZeRO-2 / ZeRO-3 on the real engine: 2 (or 3) CPU processes over gloo, the shipped accelerate configs.

DeepSpeed runs on CPU with `DS_ACCELERATOR=cpu` (its CPU accelerator; the first run JIT-compiles a communication op,
cached under TORCH_EXTENSIONS_DIR, which make test-engines sets inside the venv, so an environment pays it once) and
`--ddp_backend gloo` (without it accelerate finds no backend on a CPU-only machine and every process trains alone).

Under ZeRO-3 every model call outside generation gathers the parameters layer by layer, collectively: a process that
makes fewer calls than another leaves it waiting forever. Each run records how often each rank called the model and
the tests check they agree. Weights are compared in float32 with SGD (Adam would turn float noise into full steps).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers.probes import TRAIN_TINY, accelerate_launch, max_weight_diff, run_python, train_tiny_flags
from safetensors.torch import load_file

pytestmark = [pytest.mark.slow, pytest.mark.engine]
CONFIGS = Path(__file__).resolve().parents[1] / "recipes" / "accelerate_configs"
ENGINE_TIMEOUT = 600  # the first DeepSpeed run on a machine compiles its CPU communication op (~1-3 min)


def flags(model_dir, output_dir, **overrides) -> list[str]:
    """train_tiny.py's flags with SGD; without use_cpu, which DeepSpeed needs false (its CPU accelerator does the rest)."""
    return train_tiny_flags(model_dir, output_dir, omit=("use_cpu",), optim="sgd", **overrides)


def run(args: list[str], tmp_path: Path, name: str, zero_stage: int | str | None = None, processes: int = 2) -> dict:
    """Train with train_tiny.py: under DeepSpeed (`zero_stage` 2 or 3) or plain DDP (`"ddp"`) on `processes` ranks,
    or in one plain process (None). Returns {"weights", "forwards" (per rank), "logs", "stdout"}.
    """
    out = tmp_path / name
    args = [*args, "--dump_weights", f"{out}.safetensors", "--count_forwards", f"{out}.forwards"]
    args += ["--dump_logs", f"{out}.json"]
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    if zero_stage is None:
        launcher, args, processes = None, [*args, "--use_cpu", "true"], 1
    elif zero_stage == "ddp":
        launcher, args = accelerate_launch(processes), [*args, "--use_cpu", "true"]
    else:
        launcher = accelerate_launch(processes, config_file=CONFIGS / f"deepspeed_zero{zero_stage}.yaml")
        args = [*args, "--ddp_backend", "gloo"]
    result = run_python(TRAIN_TINY, *args, launcher=launcher, env=env, timeout=ENGINE_TIMEOUT)
    assert result.stdout.count("FINISHED") == processes, result.stdout[-2000:]
    if zero_stage in (2, 3):
        assert result.stdout.count("engine=DeepSpeedEngine") == processes, "the run did not train under DeepSpeed"
    forwards = [json.loads(Path(f"{out}.forwards.rank{rank}").read_text())["forward"] for rank in range(processes)]
    logs = json.loads(Path(f"{out}.json").read_text())
    return {"weights": load_file(f"{out}.safetensors"), "forwards": forwards, "logs": logs, "stdout": result.stdout}


def assert_same_weights(a: dict, b: dict, initial: dict | None = None, tol: float = 1e-5) -> None:
    assert a["weights"].keys() == b["weights"].keys()
    if initial is not None:
        moved = max_weight_diff(a["weights"], initial)
        assert moved > 1e-3, f"training moved the weights by {moved} only: the comparison would be vacuous"
    diff = max_weight_diff(a["weights"], b["weights"])
    assert diff <= tol, f"max weight difference {diff}"


def assert_ranks_call_the_model_equally(run_result: dict) -> None:
    forwards = run_result["forwards"]
    assert len(set(forwards)) == 1, f"model calls per rank outside generation: {forwards}"


def initial_weights(model_dir: str, peft: bool) -> dict | None:
    if peft:
        return None  # LoRA B starts at 0: `moved` is checked on the adapter against zeros by the caller
    return {f"{name}": w for name, w in load_file(Path(model_dir) / "model.safetensors").items()}


# ---- the two cases that hung grpo_plus under ZeRO-3 (data-dependent numbers of no-grad model calls) -------------


def test_zero3_same_prompt_on_one_rank_finishes_with_stock_trls_weights(tiny_model_dir, tmp_path):
    """One rank's two groups share a prompt (its no-grad pass once merged them into one model call), the other's
    do not: stock TRL makes 2 calls on each rank, grpo_plus now too, and both end at the same weights."""
    common = flags(
        tiny_model_dir, tmp_path / "out", num_generations=2, per_device_train_batch_size=2, steps_per_generation=2,
        max_steps=3, learning_rate=0.5, shuffle_dataset=False,
    )  # fmt: skip
    prompts = ["--prompts", "1+1=|1+1=|1+1=|2+1="]
    stock = run([*common, *prompts, "--stock_trl"], tmp_path, "stock", zero_stage=3)
    ours = run([*common, *prompts], tmp_path, "ours", zero_stage=3)
    assert_ranks_call_the_model_equally(stock)
    assert_ranks_call_the_model_equally(ours)
    assert ours["forwards"] == stock["forwards"]
    initial = initial_weights(tiny_model_dir, peft=False)
    assert_same_weights(stock, ours, initial=initial)


def test_zero3_three_processes_distinct_prompts(tiny_model_dir, tmp_path):
    """3 ranks, 16 distinct prompts, G = 6: the no-grad pass once made 1/2/1 calls where TRL makes 2/2/2."""
    common = flags(
        tiny_model_dir, tmp_path / "out", num_generations=6, per_device_train_batch_size=2, steps_per_generation=2,
        max_steps=2, learning_rate=0.5, max_completion_length=6,
    )  # fmt: skip
    stock = run([*common, "--stock_trl"], tmp_path, "stock", zero_stage=3, processes=3)
    ours = run(common, tmp_path, "ours", zero_stage=3, processes=3)
    assert_ranks_call_the_model_equally(ours)
    assert ours["forwards"] == stock["forwards"]
    assert_same_weights(stock, ours, initial=initial_weights(tiny_model_dir, peft=False))


# ---- ZeRO-2 / ZeRO-3 x full fine-tuning / LoRA x loss types, against one plain process ---------------------------


@pytest.mark.parametrize(
    ("zero_stage", "peft", "overrides"),
    [
        (2, False, dict(loss_type="dapo", epsilon_high=0.28)),
        (3, False, dict(loss_type="grpo", steps_per_generation=2, gradient_accumulation_steps=2, num_iterations=2)),
        (2, True, dict(loss_type="dr_grpo", importance_sampling_level="sequence")),
        (3, True, dict(loss_type="dapo", beta=0.04, num_iterations=2)),
    ],
    ids=["zero2-full-dapo", "zero3-full-grpo", "zero2-lora-dr_grpo", "zero3-lora-dapo-beta"],
)
def test_engine_matches_one_process(tiny_model_dir, tmp_path, zero_stage, peft, overrides):
    """2 ranks x 4 rows under DeepSpeed end where 1 plain process x 8 rows ends (row-seeded sampling: both draw the
    same completions), with the zero-waste pass on (half the groups are dead, so rows are skipped)."""
    extra = ["--row_seeded_sampling", "--reward", "half_dead", *(["--peft"] if peft else [])]
    settings = dict(num_generations=4, max_steps=3, learning_rate=0.5 if not peft else 2.0, **overrides)
    one = run(
        [*flags(tiny_model_dir, tmp_path / "one", per_device_train_batch_size=8, **settings), *extra], tmp_path, "one"
    )
    two = run(
        [*flags(tiny_model_dir, tmp_path / "two", per_device_train_batch_size=4, **settings), *extra],
        tmp_path,
        "two",
        zero_stage=zero_stage,
    )
    assert_ranks_call_the_model_equally(two)
    if peft:
        lora_b = max(w.abs().max().item() for name, w in one["weights"].items() if "lora_B" in name)
        assert lora_b > 1e-3, "the adapter did not train"
    assert_same_weights(one, two, initial=initial_weights(tiny_model_dir, peft))


def test_zero3_bnpo_matches_stock_trl(tiny_model_dir, tmp_path):
    """bnpo normalizes by each micro-batch's own token count, so it is compared with stock TRL on the same engine."""
    common = flags(tiny_model_dir, tmp_path / "out", num_generations=4, per_device_train_batch_size=4,
                   loss_type="bnpo", max_steps=3, learning_rate=0.5)  # fmt: skip
    extra = ["--row_seeded_sampling", "--reward", "half_dead"]
    stock = run([*common, *extra, "--stock_trl"], tmp_path, "stock", zero_stage=3)
    ours = run([*common, *extra], tmp_path, "ours", zero_stage=3)
    assert_ranks_call_the_model_equally(ours)
    assert_same_weights(stock, ours, initial=initial_weights(tiny_model_dir, peft=False))


# ---- grpo_plus's own features under ZeRO-3 -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reward", "overrides"),
    [
        ("odd_dead", dict(selective_rollout=True, selective_rollout_explore_solved=0.05,
                          selective_rollout_explore_min=0.05, num_prompts=4, max_steps=6)),
        ("half_dead", dict(loss_type="dapo")),
        ("half_dead", dict(loss_type="dapo", zero_waste_exact_entropy=True)),
    ],
    ids=["selective-rollout", "all-dead-micro-batch", "all-dead-micro-batch-exact-entropy"],
)  # fmt: skip
def test_zero3_features_match_one_process(tiny_model_dir, tmp_path, reward, overrides):
    """Selective rollout (same draws on every rank) and a rank whose whole micro-batch is dead (one anchor call keeps
    it in step; with exact entropy, one more no-grad call on every rank) finish under ZeRO-3 at one process's
    weights."""
    overrides = dict(overrides)
    num_prompts = overrides.pop("num_prompts", 16)
    extra = ["--row_seeded_sampling", "--reward", reward, "--num_prompts", str(num_prompts)]
    settings = dict(num_generations=4, max_steps=overrides.pop("max_steps", 4), learning_rate=0.5, **overrides)
    one = run(
        [*flags(tiny_model_dir, tmp_path / "one", per_device_train_batch_size=8, **settings), *extra], tmp_path, "one"
    )
    two_args = [*flags(tiny_model_dir, tmp_path / "two", per_device_train_batch_size=4, **settings), *extra]
    if reward == "half_dead":
        two_args += ["--record_groups", str(tmp_path / "groups")]
    two = run(two_args, tmp_path, "two", zero_stage=3)
    assert_ranks_call_the_model_equally(two)
    if reward == "half_dead":
        ranks = [json.loads((tmp_path / f"groups.rank{rank}").read_text()) for rank in (0, 1)]
        mixed = [a["any_advantage"] != b["any_advantage"] for a, b in zip(*ranks, strict=True)]
        assert any(mixed), f"no step had one rank all dead and the other live: {ranks}"
    else:
        assert any(entry.get("selective_rollout/skipped", 0) > 0 for entry in two["logs"]), "nothing was skipped"
    assert_same_weights(one, two, initial=initial_weights(tiny_model_dir, peft=False))
    if overrides.get("zero_waste_exact_entropy"):  # every row's entropy, whichever rank skipped which rows
        entropies = [[entry["entropy"] for entry in result["logs"] if "loss" in entry] for result in (one, two)]
        assert None not in entropies[0] and entropies[1] == pytest.approx(entropies[0], rel=1e-5)


def test_zero3_dynamic_sampling_matches_ddp(tiny_model_dir, tmp_path):
    """Dynamic sampling keeps, on each rank, the informative groups it drew and trims every rank to the fewest:
    which groups train depends on the rank count, so ZeRO-3 is compared with DDP on the same 2 ranks. Refill
    rounds (agreed across ranks) run; both engines end at the same weights."""
    settings = dict(num_generations=4, per_device_train_batch_size=8, max_steps=3, learning_rate=0.5,
                    dynamic_sampling=True, max_sampling_rounds=3, loss_type="dapo")  # fmt: skip
    extra = ["--row_seeded_sampling", "--reward", "half_dead"]
    ddp = run([*flags(tiny_model_dir, tmp_path / "ddp", **settings), *extra], tmp_path, "ddp", zero_stage="ddp")
    zero3 = run([*flags(tiny_model_dir, tmp_path / "zero3", **settings), *extra], tmp_path, "zero3", zero_stage=3)
    assert_ranks_call_the_model_equally(zero3)
    assert any(entry.get("dynamic_sampling/rounds", 1) > 1 for entry in zero3["logs"]), "no refill round ran"
    assert_same_weights(ddp, zero3, initial=initial_weights(tiny_model_dir, peft=False))


def test_zero3_remax_matches_one_process(tiny_model_dir, tmp_path):
    """ReMax's greedy baseline: one extra generation per prompt of each rank's whole groups. Every rank makes the same
    number of model calls, and 2 ranks x 4 rows under ZeRO-3 end where 1 plain process x 8 rows ends: the estimator
    does not depend on how many processes share the batch (the baseline is greedy, so which process generates it does
    not matter; row-seeded sampling leaves greedy decoding alone)."""
    settings = dict(num_generations=4, max_steps=4, learning_rate=0.5, advantage_estimator="remax", loss_type="dapo")
    extra = ["--row_seeded_sampling", "--reward", "half_dead"]
    one = run(
        [*flags(tiny_model_dir, tmp_path / "one", per_device_train_batch_size=8, **settings), *extra], tmp_path, "one"
    )
    two_args = [*flags(tiny_model_dir, tmp_path / "two", per_device_train_batch_size=4, **settings), *extra]
    two = run(two_args, tmp_path, "two", zero_stage=3)
    assert_ranks_call_the_model_equally(two)
    assert any("remax/greedy_reward" in entry for entry in two["logs"]), "no greedy baseline was generated"
    assert_same_weights(one, two, initial=initial_weights(tiny_model_dir, peft=False))


def test_each_rank_training_alone_is_an_error(tiny_model_dir, tmp_path):
    """DeepSpeed launched on a CPU-only machine without --ddp_backend gloo: accelerate finds no backend and every
    process would train alone (exit 0, wrong batch). grpo_plus stops at start and says what to set."""
    args = flags(tiny_model_dir, tmp_path / "out", max_steps=1)
    result = run_python(
        TRAIN_TINY,
        *args,
        launcher=accelerate_launch(2, config_file=CONFIGS / "deepspeed_zero2.yaml"),
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
        timeout=ENGINE_TIMEOUT,
        check=False,
    )
    assert result.returncode != 0
    assert "each of the 2 launched processes would train alone" in result.stderr, result.stderr[-3000:]
    assert "--ddp_backend gloo" in result.stderr


@pytest.mark.floor("two_cuda_devices")
def test_fsdp_two_gpus_matches_one_process(tiny_model_dir, tmp_path):
    """The shipped FSDP2 config on 2 GPUs ends where one process ends, each rank calling the model equally often."""
    settings = dict(num_generations=4, max_steps=3, learning_rate=0.5, loss_type="dapo")
    extra = ["--row_seeded_sampling", "--reward", "half_dead"]
    one = run(
        [*flags(tiny_model_dir, tmp_path / "one", per_device_train_batch_size=8, **settings), *extra], tmp_path, "one"
    )
    out = tmp_path / "two"
    run_python(
        TRAIN_TINY,
        *flags(tiny_model_dir, out, per_device_train_batch_size=4, **settings),
        *extra,
        *["--dump_weights", f"{out}.safetensors", "--count_forwards", f"{out}.forwards", "--dump_logs", f"{out}.json"],
        launcher=accelerate_launch(2, config_file=CONFIGS / "fsdp.yaml"),
        timeout=ENGINE_TIMEOUT,
    )
    forwards = [json.loads(Path(f"{out}.forwards.rank{rank}").read_text())["forward"] for rank in (0, 1)]
    assert len(set(forwards)) == 1, forwards
    two = {"weights": load_file(f"{out}.safetensors")}
    assert_same_weights(one, two, initial=initial_weights(tiny_model_dir, peft=False))


@pytest.mark.parametrize(("recipe", "zero_stage"), [("grpo_lora", 2), ("grpo_lora", 3), ("grpo_qlora", 3)])
def test_recipe_trains_evaluates_and_saves_under_deepspeed(request, tmp_path, recipe, zero_stage):
    """The recipes with the shipped DeepSpeed configs: held-out evaluation before (weights partitioned at load under
    ZeRO-3's zero3_init_flag) and after training (inside the engine) on every rank, and a saved adapter that holds
    the trained weights. QLoRA under ZeRO-3 stores its 4-bit weights in the compute dtype (set by the recipe)."""
    tiny_model_dir = request.getfixturevalue("tiny_model_dir_bnb" if recipe == "grpo_qlora" else "tiny_model_dir")
    out = tmp_path / "run"
    recipe = Path(__file__).resolve().parents[1] / "recipes" / f"{recipe}.py"
    recipe_flags = [
        "--model_name_or_path", str(tiny_model_dir), "--output_dir", str(out), "--ddp_backend", "gloo",
        "--bf16", "false", "--max_steps", "2", "--per_device_train_batch_size", "4", "--num_generations", "4",
        "--max_completion_length", "8", "--learning_rate", "0.05", "--report_to", "none", "--lora_r", "4",
        "--lora_alpha", "8", "--lora_target_modules", "all-linear", "--task_eval_size", "8",
        "--eval_max_new_tokens", "4", "--save_strategy", "no", "--disable_tqdm", "true",
        "--reward_funcs", "helpers.rewards:length_reward", "--gradient_checkpointing", "false",
    ]  # fmt: skip
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(Path(__file__).parent)}
    result = run_python(
        recipe,
        *recipe_flags,
        launcher=accelerate_launch(2, config_file=CONFIGS / f"deepspeed_zero{zero_stage}.yaml"),
        env=env,
        timeout=ENGINE_TIMEOUT,
    )
    assert result.stdout.count("Held-out results") == 2, "every rank evaluates before and after"
    adapter = load_file(out / "adapter_model.safetensors")
    assert adapter and all(w.numel() > 0 for w in adapter.values()), "a ZeRO-3 shard was saved instead of the adapter"
    assert max(w.abs().max().item() for name, w in adapter.items() if "lora_B" in name) > 0, "the adapter is untrained"
