"""GRPOConfig: TRL's fields unchanged, registered names accepted, bad values rejected at construction."""

import dataclasses
import time
import warnings

import pytest
import trl
from helpers.probes import TRAIN_TINY, run_python
from trl import TrlParser

from grpo_plus import GRPOConfig, register_advantage_normalizer, register_loss_type
from grpo_plus.config import ConfigError


def make(tmp_path, **kwargs) -> GRPOConfig:
    return GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", **kwargs)


def test_every_trl_field_keeps_name_and_default(tmp_path):
    ours = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    for trl_field in dataclasses.fields(trl.GRPOConfig):
        assert trl_field.name in ours
        assert ours[trl_field.name].default == trl_field.default, trl_field.name
    assert {f.name for f in dataclasses.fields(GRPOConfig)} - {f.name for f in dataclasses.fields(trl.GRPOConfig)} <= {
        "dual_clip",
        "plugins",
        "dynamic_sampling",
        "dynamic_sampling_min_std",
        "max_sampling_rounds",
        "overlong_buffer_length",
        "overlong_penalty",
        "zero_waste_pass",
        "zero_waste_shared_prompt",
        "zero_waste_generation",
        "zero_waste_exact_entropy",
        "health_check",
        "health_patience_steps",
        "health_zero_std_frac",
        "health_truncated_frac",
        "health_entropy_collapse_frac",
        "selective_rollout",
        "selective_rollout_explore_solved",
        "selective_rollout_explore_unsolved",
        "selective_rollout_explore_min",
        "selective_rollout_explore_max",
        "selective_rollout_explore_step",
        "selective_rollout_target_dead_frac",
        "selective_rollout_history",
        "advantage_estimator",
        "policy_loss",
        "kl_estimator",
        "adaptive_kl_target",
        "adaptive_kl_horizon",
        "clip_cov_ratio",
        "clip_cov_lb",
        "clip_cov_ub",
        "kl_cov_ratio",
        "kl_cov_coef",
        "selective_rollout_solved_reward",
        "activation_offloading",
        "tiled_mlp_tokens",
        "lm_head_tile_columns",
        "fit_check",
        "vllm_quantization",
        "vllm_dtype",
        "vllm_sync_check",
        "reward_timeout",
        "reward_workers",
        "reward_on_error",
        "reward_whole_batch",
        "rollout_correction",
        "rollout_is",
        "rollout_is_threshold",
        "rollout_is_batch_normalize",
        "rollout_rs",
        "rollout_rs_threshold",
        "rollout_bypass_mode",
    }
    assert isinstance(make(tmp_path), trl.GRPOConfig)


@pytest.mark.parametrize(
    ("field", "value", "canonical"),
    [
        ("scale_rewards", "local", "group"),
        ("scale_rewards", "global", "batch"),
        ("scale_rewards", True, "group"),
        ("scale_rewards", False, "none"),
        ("scale_rewards", "false", "none"),
        ("loss_type", "dr_grpo", "dr_grpo"),
        ("importance_sampling_level", "sequence_token", "sequence_token"),
    ],
)
def test_aliases_are_canonicalized(tmp_path, field, value, canonical):
    assert getattr(make(tmp_path, **{field: value}), field) == canonical


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        (dict(loss_type="dapoo"), "loss_type='dapoo' is not registered. Did you mean 'dapo'?"),
        (
            dict(importance_sampling_level="sequense"),
            "importance_sampling_level='sequense' is not registered. Did you mean 'sequence'?",
        ),
        (dict(scale_rewards="groups"), "scale_rewards='groups' is not registered. Did you mean 'group'?"),
        (dict(dual_clip=0.5), "dual_clip=0.5 is not allowed"),
        (dict(vllm_quantization="bitsandbytes"), "vllm_quantization='bitsandbytes' is not allowed"),
        (dict(vllm_dtype="fp32"), "vllm_dtype='fp32' is not allowed"),
        (dict(vllm_sync_check="always"), "vllm_sync_check='always' is not allowed"),
        (dict(reward_workers=-1), "reward_workers=-1 is not allowed"),
        (dict(reward_workers=2, reward_timeout=0), "reward_timeout=0 is not allowed"),
        (dict(reward_workers=2, reward_timeout=float("inf")), "reward_timeout=inf is not allowed"),
        (
            dict(reward_on_error="skip"),
            "reward_on_error='skip' is not allowed: reward_on_error must be one of 'raise'",
        ),
        # a thread cannot be killed: a timeout needs worker processes
        (dict(reward_timeout=5), "reward_timeout=5 needs reward_workers >= 1"),
        # what TRL itself fails on (TRL 1.16: its sampler's negative length; torch.quantile's q = 1.5)
        (dict(num_iterations=-1), "num_iterations=-1 is not allowed"),
        (dict(top_entropy_quantile=-0.5), "top_entropy_quantile=-0.5 is not allowed"),
        (dict(loss_type="dr_grpo", max_completion_length=None), "max_completion_length=None is not allowed"),
        (dict(loss_type="cispo", dual_clip=3.0), "dual_clip cannot be combined with loss_type='cispo'"),
        (
            dict(loss_type="sapo", importance_sampling_level="sequence_token"),
            "cannot be combined with loss_type='sapo'",
        ),
    ],
)
def test_bad_values_fail_at_construction(tmp_path, kwargs, fragment):
    with pytest.raises(ConfigError) as error:
        make(tmp_path, **kwargs)
    assert fragment in str(error.value)


def test_unknown_name_lists_what_is_allowed(tmp_path):
    with pytest.raises(ValueError, match="Allowed: bnpo, dapo, dr_grpo, grpo, cispo, sapo, luspo, vespo"):
        make(tmp_path, loss_type="ppo")


def test_custom_normalizer_incompatible_with_normalize_then_sum(tmp_path):
    @register_advantage_normalizer("rank_test")
    def rank(grouped, eps):
        return grouped.argsort(dim=1).argsort(dim=1).float() - (grouped.shape[1] - 1) / 2

    make(tmp_path, scale_rewards="rank_test")  # fine alone
    with pytest.raises(ConfigError, match="normalize_then_sum"):
        make(tmp_path, scale_rewards="rank_test", multi_objective_aggregation="normalize_then_sum")


def test_registered_loss_type_accepted_after_registration(tmp_path):
    with pytest.raises(ConfigError):
        make(tmp_path, loss_type="token_sum_test")

    @register_loss_type("token_sum_test")
    def token_sum(masked_loss, ctx):
        return masked_loss.sum() / ctx.S

    assert make(tmp_path, loss_type="token_sum_test").loss_type == "token_sum_test"


def test_trl_parser_yaml_and_flags(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(
        f"output_dir: {tmp_path}\nloss_type: dr_grpo\nepsilon_high: 0.28\ndual_clip: 3.0\nuse_cpu: true\nbf16: false\n"
    )
    (args,) = TrlParser((GRPOConfig,)).parse_args_and_config(["--config", str(config), "--scale_rewards", "global"])
    assert (args.loss_type, args.epsilon_high, args.dual_clip, args.scale_rewards) == ("dr_grpo", 0.28, 3.0, "batch")


def test_unknown_loss_type_on_the_command_line_exits_before_model_loads(tmp_path):
    started = time.monotonic()
    result = run_python(
        TRAIN_TINY,
        "--model_dir",
        tmp_path / "never-loaded",
        "--output_dir",
        tmp_path,
        "--loss_type",
        "dapoo",
        timeout=120,
        check=False,
    )
    assert result.returncode != 0
    assert "loss_type='dapoo' is not registered. Did you mean 'dapo'?" in result.stderr
    # The model dir does not exist: had the script got as far as loading it, the error would be about the path.
    assert "never-loaded" not in result.stderr
    assert time.monotonic() - started < 120


# ---- values TRL accepts but that are most likely mistakes: one warning, training goes on (issue 18.3) -------------


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        (
            dict(epsilon=0.2, epsilon_high=0.1),
            "epsilon_high=0.1 is below epsilon=0.2: the ratio is clipped to [1 - epsilon, 1 + epsilon_high] = [0.8, 1.1]",
        ),
        (dict(epsilon=1.0), "epsilon=1.0 is >= 1: the lower clip bound 1 - epsilon = 0 is not positive"),
        # grpo_plus refused these before issue 26; TRL 1.16 trains with each (tests/test_trainer_parity.py)
        (dict(epsilon=-0.1), "epsilon=-0.1 is negative: the lower clip bound 1 - epsilon = 1.1 is above 1"),
        (dict(epsilon_high=-1.0), "epsilon_high=-1.0 is negative: the upper clip bound 1 + epsilon_high = 0 is"),
        (dict(delta=1.0), "delta=1.0 is not above 1: the unclipped ratio is capped at delta"),
        (dict(delta=1.1, epsilon_high=0.28), "delta=1.1 is not above 1 + epsilon_high = 1.28; INTELLECT-2 recommends"),
        (dict(beta=-0.01), "beta=-0.01 is negative: the KL term then rewards moving away from the reference model"),
        (dict(top_entropy_quantile=1.5), "top_entropy_quantile=1.5 is above 1: like 1.0, every token keeps its"),
        (dict(num_iterations=0), "num_iterations=0: each generation batch is trained on 0 times, so the run ends"),
    ],
    ids=[
        "epsilon_high_below_epsilon",
        "epsilon_at_least_1",
        "negative_epsilon",
        "negative_epsilon_high",
        "delta_not_above_1",
        "delta_inside_the_clip_range",
        "negative_beta",
        "top_entropy_quantile_above_1",
        "zero_iterations",
    ],
)
@pytest.mark.floor("cpu_logps")
def test_values_trl_accepts_warn_once_and_build(tiny_model_dir, tmp_path, kwargs, fragment):
    from helpers.models import prompt_dataset
    from helpers.rewards import length_reward
    from transformers import AutoModelForCausalLM

    from grpo_plus import GRPOTrainer

    for config_cls in (GRPOConfig, trl.GRPOConfig):  # a grpo_plus config, and a TRL script's own config
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            args = config_cls(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", **kwargs)
            GRPOTrainer(
                model=AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                reward_funcs=length_reward,
                args=args,
                train_dataset=prompt_dataset(4),
            )
        messages = [
            str(w.message) for w in caught if issubclass(w.category, UserWarning) and "TRL accepts" in str(w.message)
        ]
        assert len(messages) == 1 and fragment in messages[0] and "TRL accepts this" in messages[0], messages
        assert caught[[str(w.message) for w in caught].index(messages[0])].filename == __file__  # points at the caller


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        (
            dict(learning_rate=[1, 2]),
            "learning_rate=[1, 2] is not allowed: learning_rate must be a number, not a list",
        ),
        (dict(max_steps=2.5), "max_steps=2.5 is not allowed: max_steps must be an integer, not a float"),
        (dict(use_cpu="false"), "use_cpu='false' is not allowed: use_cpu must be true or false, not a str"),
        (dict(epsilon_high={"low": 1}), "epsilon_high must be a number or null/None, not a dict"),
        (dict(reward_workers=1.5), "reward_workers=1.5 is not allowed: reward_workers must be an integer"),
        (dict(reward_timeout=[5]), "reward_timeout must be a number or null/None, not a list"),
    ],
)
def test_a_value_of_the_wrong_type_names_the_field(tmp_path, kwargs, fragment):
    with pytest.raises(ConfigError) as error:
        GRPOConfig(output_dir=str(tmp_path), bf16=False, report_to="none", **{"use_cpu": True, **kwargs})
    assert fragment in str(error.value)


def test_settings_are_read_once_with_the_fields_defaults_also_from_a_plain_trl_config():
    """One default per setting: a plain trl.GRPOConfig gets GRPOConfig's field defaults (the trainer once fell back
    to other values: max_sampling_rounds 1 vs 4, overlong_penalty 0 vs 1, dynamic_sampling_min_std 0 vs 1e-4), and
    every field GRPOConfig adds to TRL's is read into PlusSettings."""
    import dataclasses

    import trl

    from grpo_plus.config import PlusSettings

    plain = PlusSettings.from_args(trl.GRPOConfig(output_dir="unused", use_cpu=True, bf16=False, report_to="none"))
    ours = PlusSettings.from_args(GRPOConfig(output_dir="unused", use_cpu=True, bf16=False, report_to="none"))
    assert plain == ours
    assert (plain.dynamic_sampling.max_rounds, plain.dynamic_sampling.min_std, plain.overlong_penalty) == (
        4,
        1e-4,
        1.0,
    )
    own = {f.name for f in dataclasses.fields(GRPOConfig)} - {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    changed = GRPOConfig(
        output_dir="unused", use_cpu=True, bf16=False, report_to="none", max_sampling_rounds=2,
        dynamic_sampling_min_std=0.5, selective_rollout_history=7, zero_waste_shared_prompt=False,
    )  # fmt: skip
    settings = PlusSettings.from_args(changed)
    assert (settings.dynamic_sampling.max_rounds, settings.dynamic_sampling.min_std) == (2, 0.5)
    assert settings.selective.history == 7 and settings.selective.min_std == 0.5
    assert settings.zero_waste_shared_prompt is False
    read = {"dynamic_sampling", "dynamic_sampling_min_std", "max_sampling_rounds"}
    read |= {f"selective_rollout_{f.name}" for f in dataclasses.fields(settings.selective) if f.name != "min_std"}
    read |= {f.name for f in dataclasses.fields(PlusSettings)} - {
        "dynamic_sampling",
        "selective",
        "algorithms",
        "health",
        "vllm",
        "rewards",
        "rollout",
    }
    read |= {f"vllm_{f.name}" for f in dataclasses.fields(settings.vllm)}
    read |= {f.name for f in dataclasses.fields(settings.rollout)}  # named as the fields (verl's names)
    read |= {f.name for f in dataclasses.fields(settings.algorithms)} - {"policy_loss_options"}
    for loss in ("clip_cov", "kl_cov"):  # a policy loss's options are read from the fields of the same names
        options = dict(clip_cov_ratio=1e-3, clip_cov_lb=0.5, clip_cov_ub=2.0, kl_cov_ratio=1e-3, kl_cov_coef=0.5)
        chosen = PlusSettings.from_args(make("unused", policy_loss=loss, **options))
        assert chosen.algorithms.policy_loss_options == {k: v for k, v in options.items() if k.startswith(loss)}
        read |= set(chosen.algorithms.policy_loss_options)
    read |= {f"health_{f.name}" for f in dataclasses.fields(settings.health)}
    read |= {f"reward_{f.name}" for f in dataclasses.fields(settings.rewards)}
    assert own == read, f"GRPOConfig fields PlusSettings does not read: {own - read}; unknown: {read - own}"
