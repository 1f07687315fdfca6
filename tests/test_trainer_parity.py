"""Drop-in parity: stock trl.GRPOTrainer and grpo_plus.GRPOTrainer train to the same weights and logs.

grpo_plus generates with its zero-waste loop (each prompt prefilled once, finished rows out of the decode batch) in
every run here, checked by `assert_same_run`, so equal weights also show it sampled stock TRL's completions.

The runs use plain SGD: its update is the gradient times the learning rate, so equal weights show equal gradients.
Adam divides each coordinate by its own gradient scale, which hides a gradient off by a constant factor and, on
coordinates whose gradient is near zero, turns float32 rounding noise (~1e-7, e.g. from computing the same
log-probs in another layout, as the zero-waste pass does) into weight differences of ~1e-5.
"""

import math

import pytest
import torch
import trl
from helpers.models import prompt_dataset, save_tiny_model, tiny_run_kwargs
from helpers.probes import ForwardLog, max_weight_diff
from helpers.rewards import constant_reward, digit_reward, half_dead_or_none_reward, half_dead_reward, length_reward
from peft import LoraConfig
from transformers import AutoModelForCausalLM

import grpo_plus
from grpo_plus.algorithms.loss_metrics import TRAINED_ROWS_ENTROPY
from grpo_plus.compat.versions import version_gap

pytestmark = [
    pytest.mark.slow,
    # TRL 1.15 on CPU (where these tests train): stock TRL itself cannot train, so there is nothing to compare
    # against (tests/test_losses_parity.py still checks its _compute_loss against the core).
    pytest.mark.floor("cpu_logps"),
]


def train(
    tiny_model_dir, tmp_path, package, reward_funcs=(length_reward, digit_reward), peft_config=None, **overrides
):
    """Train the tiny model with `package`'s GRPOConfig/GRPOTrainer; returns (state_dict, log_history, forwards)."""
    overrides = {"optim": "sgd", "learning_rate": 0.5, **overrides}
    args = package.GRPOConfig(**tiny_run_kwargs(tmp_path / package.__name__, **overrides))
    # Same global RNG state for both trainers from here: TRL 1.14 draws a new LoRA adapter's initial weights before
    # its own set_seed, so they would otherwise depend on what ran earlier in the process.
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    trainer = package.GRPOTrainer(
        model=model,
        reward_funcs=list(reward_funcs),
        args=args,
        train_dataset=prompt_dataset(16),
        peft_config=peft_config,
    )
    forwards = ForwardLog(model)
    trainer.train()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, trainer.state.log_history, forwards


def assert_same_run(
    tiny_model_dir, tmp_path, reward_funcs=(length_reward, digit_reward), peft_config=None, **overrides
):
    """Both trainers end with the same weights and log the same values; returns both logs and ForwardLogs."""
    trl_weights, trl_logs, trl_forwards = train(tiny_model_dir, tmp_path, trl, reward_funcs, peft_config, **overrides)
    our_weights, our_logs, our_forwards = train(
        tiny_model_dir, tmp_path, grpo_plus, reward_funcs, peft_config, **overrides
    )
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    if peft_config is not None:  # LoRA's B matrices start at zero, so they show whether training moved anything
        initial = {k: torch.zeros_like(v) for k, v in trl_weights.items() if "lora_B" in k}
    moved = max_weight_diff(initial, trl_weights)
    assert moved > 1e-3, "training did not change the weights: the comparison would be vacuous"
    diff = max_weight_diff(trl_weights, our_weights)
    # float32, another layout of the same sums: worst 1.2e-7 (threads 1-2, TRL 1.14-1.16; docs/notes.md): 3.4x
    assert diff <= 4e-7, f"max |w_trl - w_grpo_plus| = {diff}"
    assert len(trl_logs) == len(our_logs)
    # transformers 4.x, or dropout in the forward: grpo_plus generates with TRL's loop, and logs why.
    dropout = peft_config is not None and peft_config.lora_dropout > 0
    key = "zero_waste/generation_positions_frac"
    generated = [entry[key] for entry in our_logs if key in entry]
    if version_gap("zero_waste_generation") is None and not dropout:
        assert generated and max(generated) < 1.0, "grpo_plus's zero-waste generation did not run"
    elif dropout:  # logged as 1.0 where the trainer saw the dropout; absent where transformers 4.x decided first
        assert all(value == 1.0 for value in generated), "zero-waste generation ran with dropout on"
    for trl_entry, our_entry in zip(trl_logs, our_logs, strict=True):
        for key, value in trl_entry.items():
            if key in ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"):
                continue
            assert key in our_entry, f"grpo_plus did not log TRL's metric {key!r}"
            if key == "entropy" and our_entry[key] is None:  # unknown (documented): rows were skipped in the window
                assert our_entry["zero_waste/rows_computed_frac"] < 1.0, "entropy missing though no row was skipped"
                continue
            if isinstance(value, float) and not math.isnan(value):
                assert our_entry[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key
    return trl_logs, our_logs, trl_forwards, our_forwards


@pytest.mark.parametrize("clip_higher", [False, True])
@pytest.mark.parametrize("importance_sampling_level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_builtin_modes_match_stock_trl(tiny_model_dir, tmp_path, loss_type, importance_sampling_level, clip_higher):
    # steps_per_generation (4) != gradient_accumulation_steps (2): the second optimizer step trains off-policy,
    # so importance ratios move away from 1 and the clipping branches run. A sequence's mean ratio moves far less
    # than single tokens' (GSPO clips at ~3e-4), so the sequence level gets a GSPO-sized epsilon.
    epsilon = 0.2 if importance_sampling_level == "token" else 0.003
    logs, _, _, _ = assert_same_run(
        tiny_model_dir,
        tmp_path,
        loss_type=loss_type,
        importance_sampling_level=importance_sampling_level,
        epsilon=epsilon,
        epsilon_high=1.4 * epsilon if clip_higher else None,
        gradient_accumulation_steps=2,
        steps_per_generation=4,
        learning_rate=1.0,
    )
    assert any(entry.get("clip_ratio/region_mean", 0) > 0 for entry in logs), "clipping never triggered"


@pytest.mark.parametrize(
    "overrides",
    [
        dict(loss_type="dapo", gradient_accumulation_steps=2, num_iterations=2),
        dict(loss_type="grpo", gradient_accumulation_steps=3, steps_per_generation=2, per_device_train_batch_size=8),
        dict(loss_type="dapo", beta=0.1, epsilon_high=0.28),
        dict(loss_type="dr_grpo", scale_rewards="batch", delta=1.5),
        dict(loss_type="bnpo", scale_rewards="none", mask_truncated_completions=True),
        dict(loss_type="dapo", entropy_coef=0.01, top_entropy_quantile=0.5),
        dict(loss_type="grpo", use_adaptive_entropy=True, entropy_target=10.0, gradient_accumulation_steps=2),
        dict(loss_type="dapo", off_policy_mask_threshold=0.01, steps_per_generation=4, gradient_accumulation_steps=2),
        dict(loss_type="cispo", epsilon_high=5.0),
        dict(loss_type="sapo"),
        # values TRL trains with that grpo_plus warns about (never refuses): negative epsilon, negative beta,
        # top_entropy_quantile above 1, delta not above 1; off-policy steps so the clip bounds act
        dict(loss_type="dapo", epsilon=-0.05, epsilon_high=0.3, beta=-0.02, top_entropy_quantile=1.5,
             steps_per_generation=4, gradient_accumulation_steps=2),
        dict(loss_type="grpo", delta=1.0, steps_per_generation=4, gradient_accumulation_steps=2),
    ],
    ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()),
)  # fmt: skip
@pytest.mark.filterwarnings("ignore:.*TRL accepts this; training goes on:UserWarning")  # asserted in test_config
def test_other_trl_settings_match_stock_trl(tiny_model_dir, tmp_path, overrides):
    assert_same_run(tiny_model_dir, tmp_path, **overrides)


@pytest.mark.filterwarnings("ignore:.*TRL accepts this; training goes on:UserWarning")  # asserted in test_config
def test_zero_iterations_end_without_a_step_as_in_stock_trl(tiny_model_dir, tmp_path):
    """num_iterations=0: TRL runs no optimizer step (each batch is trained on 0 times); grpo_plus warns and does the
    same."""
    for package in (trl, grpo_plus):
        weights, logs, _ = train(tiny_model_dir, tmp_path / package.__name__, package, num_iterations=0)
        assert max_weight_diff(AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict(), weights) == 0.0
        assert [entry.get("step") for entry in logs] == [0] and "loss" not in logs[0], package.__name__


@pytest.mark.parametrize(
    "overrides",
    [
        dict(loss_type="dapo", per_device_train_batch_size=8, gradient_accumulation_steps=2),
        dict(loss_type="grpo", importance_sampling_level="sequence", steps_per_generation=4,
             gradient_accumulation_steps=2, per_device_train_batch_size=8, epsilon_high=0.28),
        dict(loss_type="bnpo", num_iterations=2, per_device_train_batch_size=16, importance_sampling_level="sequence_token"),
        dict(loss_type="dr_grpo", per_device_train_batch_size=16, mask_truncated_completions=True,
             max_completion_length=12, dual_clip=3.0),
    ],
    ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()),
)  # fmt: skip
def test_zero_waste_pass_matches_stock_trl_where_it_skips(tiny_model_dir, tmp_path, overrides):
    """Half the prompts get a constant reward: their rows are skipped, groups share prompts, yet TRL's run results.

    Settings stock TRL lacks (dual_clip, sequence_token) are compared with the same grpo_plus run, savings off.
    """
    if "dual_clip" in overrides or overrides.get("importance_sampling_level") == "sequence_token":
        full_logs, our_logs, full, saved = assert_zero_waste_run_unchanged(tiny_model_dir, tmp_path, **overrides)
    else:
        full_logs, our_logs, full, saved = assert_same_run(
            tiny_model_dir, tmp_path, reward_funcs=(half_dead_reward,), **overrides
        )
    assert any(entry.get("frac_reward_zero_std", 0) > 0 for entry in full_logs), "no dead group: nothing to skip"
    assert any(entry.get("zero_waste/rows_computed_frac", 1) < 1 for entry in our_logs), "no row was skipped"
    # Token positions of the forwards that carried gradient: the full pass against the zero-waste pass.
    assert saved.training_positions < 0.7 * full.training_positions, (
        saved.training_positions,
        full.training_positions,
    )


@pytest.fixture(scope="module")
def peaked_model_dir(tmp_path_factory):
    """The tiny model with its output logits scaled up 30x: its next-token distributions are peaked and differ from
    row to row (entropy ~1.5-2 nats, where the plain random model's are all near-uniform, ~4.44)."""
    path = save_tiny_model(tmp_path_factory.mktemp("peaked"))
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    model.save_pretrained(path)
    return str(path)


def test_entropy_is_stock_trls_or_absent_and_trls_everywhere_with_exact_entropy(peaked_model_dir, tmp_path):
    """Issue 27.3, as a TRL user met it: LoRA, rewards returning None, zero-advantage rows skipped. The logged
    `entropy` is stock TRL's number in every window where no row was skipped and None in the others (never the mean of
    the computed rows, now `zero_waste/entropy_trained_rows`, which is another number); with
    zero_waste_exact_entropy=True it is TRL's in every window. Neither changes the training (assert_same_run: the
    weights and every other metric are TRL's)."""
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
    rewards, settings = (half_dead_or_none_reward,), dict(max_steps=8)
    trl_logs, our_logs, _, _ = assert_same_run(peaked_model_dir, tmp_path, rewards, lora, **settings)
    steps = [(trl_entry, entry) for trl_entry, entry in zip(trl_logs, our_logs, strict=True) if "loss" in entry]
    skipped = [entry["zero_waste/rows_computed_frac"] < 1 for _, entry in steps]
    assert any(skipped) and not all(skipped), "the run needs windows with and without skipped rows"
    assert [entry["entropy"] is None for _, entry in steps] == skipped
    # What `entropy` showed before with rows skipped (the computed rows' mean) is not TRL's number:
    apart = [abs(e[TRAINED_ROWS_ENTROPY] - t["entropy"]) for t, e in steps if e[TRAINED_ROWS_ENTROPY] is not None]
    assert max(apart) > 1e-2, apart

    _, exact_logs, _ = train(
        peaked_model_dir, tmp_path / "exact", grpo_plus, rewards, lora, zero_waste_exact_entropy=True, **settings
    )
    for key in ("entropy", "loss", "grad_norm", "reward"):  # TRL's entropy, TRL's (unchanged) training
        ours = [entry[key] for entry in exact_logs if "loss" in entry]
        assert ours == pytest.approx([entry[key] for entry in trl_logs if "loss" in entry], rel=1e-6), key
    assert any(entry["zero_waste/rows_computed_frac"] < 1 for entry in exact_logs if "loss" in entry)


def assert_zero_waste_run_unchanged(tiny_model_dir, tmp_path, **overrides):
    """For settings stock TRL lacks: grpo_plus with the zero-waste pass equals grpo_plus without it."""
    full_weights, full_logs, full = train(
        tiny_model_dir, tmp_path / "full", grpo_plus, (half_dead_reward,), zero_waste_pass=False, **overrides
    )
    our_weights, our_logs, saved = train(
        tiny_model_dir, tmp_path / "saved", grpo_plus, (half_dead_reward,), **overrides
    )
    diff = max_weight_diff(full_weights, our_weights)
    assert diff <= 1.5e-8, f"max |w_full - w_zero_waste| = {diff}"  # worst 3.7e-9: 4x
    for full_entry, our_entry in zip(full_logs, our_logs, strict=True):
        if "loss" in full_entry:
            assert our_entry["loss"] == full_entry["loss"]  # bit for bit in every run
    return full_logs, our_logs, full, saved


# ---- drop-in fidelity where users run it: LoRA dropout, beta > 0 at the reference, bf16 ----------------------------


def test_lora_dropout_matches_stock_trl(tiny_model_dir, tmp_path):
    """TRL's CLI trains LoRA with dropout 0.05. Dropout draws its masks from the global RNG per position, so a
    forward over fewer rows or one prompt copy per group would draw other masks: the zero-waste pass steps aside
    (logged), so does zero-waste generation (TRL generates in training mode, dropout on), and the run stays TRL's,
    masks, gradients and sampled completions included."""
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05, target_modules="all-linear")
    _, our_logs, _, _ = assert_same_run(
        tiny_model_dir,
        tmp_path,
        reward_funcs=(half_dead_reward,),
        peft_config=lora,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        max_steps=3,
    )
    assert all(entry.get("zero_waste/rows_computed_frac", 1) == 1 for entry in our_logs)


def test_kl_at_the_reference_is_exactly_zero_as_in_stock_trl(tiny_model_dir, tmp_path):
    """beta > 0, LoRA at init (policy == reference), every group's rewards equal: TRL's gradient is exactly 0 and
    Adam leaves the weights where they are. grpo_plus computes the reference log-probs micro-batch by micro-batch
    with the training forward's own packing, so equal weights give bit-equal log-probs and the same zero
    gradient, while the shared-prompt saving runs (the micro-batches hold 2 groups, shuffled across 2 steps)."""
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
    settings = dict(
        beta=0.04,
        optim="adamw_torch",
        learning_rate=1e-2,
        max_steps=3,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
    )
    for package in (trl, grpo_plus):
        weights, logs, forwards = train(
            tiny_model_dir, tmp_path / package.__name__, package, (constant_reward,), lora, **settings
        )
        lora_b = max(v.abs().max().item() for k, v in weights.items() if "lora_B" in k)
        assert lora_b == 0.0, f"{package.__name__}: LoRA B moved to {lora_b} with a zero-advantage, zero-KL objective"
        assert [entry["kl"] for entry in logs if "kl" in entry] == [0.0] * 3, package.__name__
    if (
        version_gap("shared_prompt") is None
    ):  # TRL 1.14 has no fused LM head: prompts are not shared there, the rest still holds
        packed = [call for call in forwards.calls if call["mask_dims"] == 4]  # shared-prompt packs' block mask
        assert any(call["grad"] for call in packed) and any(not call["grad"] for call in packed), forwards.calls


def test_bf16_gradient_is_within_trls_own_noise_floor(tiny_model_dir, tmp_path, monkeypatch):
    """Under bf16 autocast (TRL's default, on CPU too) any change of batch layout moves the gradient by bf16 rounding
    steps: TRL's own does when the same batch is cut into other micro-batches (dapo is invariant to the split in
    exact arithmetic). grpo_plus with every saving on (dead rows out, padding cut, one prompt copy per group) changes
    the layout more than one such cut, and lands within 1.5x of the largest of them, and well inside bf16's own
    error (TRL bf16 against TRL float32). One SGD step at lr 1: the weight change is the gradient.

    Measured (tiny Llama, 16 rows, torch 2.13 CPU): TRL vs TRL split 8x2 / 4x4 / 2x8: 1.12e-3 / 1.20e-3 / 1.43e-3,
    grpo_plus vs TRL 1.81e-3, TRL bf16 vs float32 3.55e-3 (relative L2 norm of the gradient difference).
    """
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    runs: list = []

    def gradient(package, per_device_train_batch_size=16, **overrides):
        # transformers 4.x's TrainingArguments(bf16=True) exports ACCELERATE_MIXED_PRECISION=bf16 into the process
        # environment, and a later bf16=False run here still autocasts: each run starts without it.
        monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
        settings = {"bf16": True, "loss_type": "dapo", "max_steps": 1, "learning_rate": 1.0, **overrides}
        settings["gradient_accumulation_steps"] = 16 // per_device_train_batch_size
        weights, logs, _ = train(
            tiny_model_dir, tmp_path / str(len(runs)), package, (half_dead_reward,),
            per_device_train_batch_size=per_device_train_batch_size, **settings,
        )  # fmt: skip
        runs.append(logs)
        return torch.cat([(initial[k] - weights[k]).flatten() for k in initial])

    trl_bf16 = gradient(trl)

    def difference(other: torch.Tensor) -> float:
        return ((other - trl_bf16).norm() / trl_bf16.norm()).item()

    floor = max(difference(gradient(trl, per_device_train_batch_size=size)) for size in (8, 4, 2))
    bf16_error = difference(gradient(trl, bf16=False))
    ours = difference(gradient(grpo_plus))
    saved = runs[-1][0]
    assert saved["zero_waste/positions_frac"] < 0.7 and saved["zero_waste/rows_computed_frac"] < 1, saved
    print(
        f"bf16 gradient vs TRL: TRL's other splits up to {floor:.2e}, grpo_plus {ours:.2e}, float32 {bf16_error:.2e}"
    )
    assert 0 < floor < bf16_error, "the noise floor is not bf16 rounding: the comparison would mean nothing"
    assert ours <= 1.5 * floor, f"grpo_plus {ours:.3e} vs TRL's own layout noise {floor:.3e}"
    assert ours <= 0.75 * bf16_error, f"grpo_plus {ours:.3e} vs bf16's own error {bf16_error:.3e}"
