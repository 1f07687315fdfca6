"""GRPOConfig: TRL's fields unchanged, registered names accepted, bad values rejected at construction."""

import ast
import copy
import dataclasses
import time
import warnings
from pathlib import Path

import pytest
import trl
from helpers.probes import TRAIN_TINY, run_python
from trl import TrlParser

from grpo_plus import GRPOConfig, register_advantage_normalizer, register_loss_type
from grpo_plus.config import ConfigError, PlusSettings


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
        "vllm_block_size",
        "vllm_sync_check",
        "vllm_speculative_config",
        "async_generation",
        "max_staleness",
        "weight_sync_steps",
        "partial_rollout_tokens",
        "speculative_rollouts",
        "speculative_max_draft_tokens",
        "speculative_adaptive_draft",
        "speculative_ngram_max",
        "speculative_ngram_min",
        "routing_replay",
        "routing_receipt",
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
def test_aliases_are_canonical_in_the_settings_and_the_config_keeps_them(tmp_path, field, value, canonical):
    config = make(tmp_path, **{field: value})
    settings = PlusSettings.from_config(config)
    assert getattr(settings.objective, field) == canonical
    assert settings.trl_fields[field] == canonical  # what TRL's own trainer is given
    # grpo_plus writes nothing into the config; TRL's own __post_init__ names scale_rewards' booleans
    assert getattr(config, field) == ({True: "group", False: "none"}[value] if isinstance(value, bool) else value)


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
        (dict(use_vllm=True, vllm_block_size=0), "vllm_block_size=0 is not allowed"),
        # the block size of the engine the trainer builds: none without vLLM, a server builds its own
        (dict(vllm_block_size=32), "vllm_block_size must be None without a colocated engine"),
        (dict(use_vllm=True, vllm_mode="server", vllm_block_size=32), "a server builds its own"),
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
    assert (args.loss_type, args.epsilon_high, args.dual_clip, args.scale_rewards) == ("dr_grpo", 0.28, 3.0, "global")
    settings = PlusSettings.from_config(args)
    assert (settings.objective.scale_rewards, settings.algorithms.dual_clip) == ("batch", 3.0)


@pytest.mark.engine  # its work is in a child process (moved out of make test: its 10-minute budget)
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


# ---- each field declared once, beside its settings; built once per run; the user's config never written ----------


def own_fields() -> dict[str, dataclasses.Field]:
    """GRPOConfig's fields that TRL's config does not have: grpo_plus's."""
    trl_names = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    return {f.name: f for f in dataclasses.fields(GRPOConfig) if f.name not in trl_names}


def test_every_grpo_plus_field_is_declared_once_beside_its_settings():
    """Each of GRPOConfig's own fields comes from exactly one setting of one settings group (declared in its concern's
    settings.py), with the setting's default and its help, non-empty, and no metadata TRL's parser would hand argparse
    but help and choices."""
    declared = {}
    for group in PlusSettings.groups().values():
        assert group.__module__.endswith(".settings") or group.__module__ == "grpo_plus.plugins", group
        for name, setting in group.field_names().items():
            assert name not in declared, f"{name} is declared by {declared[name][0].__name__} and {group.__name__}"
            declared[name] = (group, {f.name: f for f in group.settings()}[setting])
    own = own_fields()
    assert set(declared) == set(own)
    for name, (_, setting) in declared.items():
        assert own[name].default == setting.default, name
        assert own[name].metadata["help"].strip() and own[name].metadata["help"] == setting.metadata["help"], name
        assert set(own[name].metadata) <= {"help", "choices"}, name
    # grpo_plus's fields when they were gathered into groups (53: none lost on the way), asynchronous generation's 3,
    # speculative rollouts' 5, vllm_speculative_config, routing replay's 2, partial_rollout_tokens, vllm_block_size
    assert len(own) == 66


def test_a_field_declared_twice_is_refused():
    """The negative control of the check above: composing the same group twice names the field declared twice."""
    from grpo_plus.run.settings import HealthSettings
    from grpo_plus.settings import config_fields

    twice = "GRPOConfig field health_check is declared by HealthSettings and HealthSettings"
    with pytest.raises(TypeError, match=twice):
        config_fields("Twice", [HealthSettings, HealthSettings], __name__)


def test_every_field_has_its_help_on_the_command_line(capsys):
    """TRL's parser (the recipes' and `trl grpo`'s) lists every grpo_plus field with its help."""
    with pytest.raises(SystemExit):
        TrlParser((GRPOConfig,)).parse_args_and_config(["--help"])
    listed = " ".join(capsys.readouterr().out.split())
    for name, f in own_fields().items():
        assert f"--{name}" in listed, name
        assert " ".join(f.metadata["help"].split())[:60].replace("%", "%%") in listed.replace("%", "%%"), name


def test_a_plain_trl_config_gets_the_declared_defaults():
    """One default per setting: a TRL script's own trl.GRPOConfig gets every group's declared defaults, as GRPOConfig
    does (the trainer once fell back to other values: max_sampling_rounds 1 vs 4, overlong_penalty 0 vs 1,
    dynamic_sampling_min_std 0 vs 1e-4)."""
    plain = PlusSettings.from_config(trl.GRPOConfig(output_dir="unused", use_cpu=True, bf16=False, report_to="none"))
    ours = PlusSettings.from_config(GRPOConfig(output_dir="unused", use_cpu=True, bf16=False, report_to="none"))
    for attribute, group in PlusSettings.groups().items():
        assert getattr(plain, attribute) == getattr(ours, attribute) == group(), attribute
    assert plain == ours
    defaults = (plain.dynamic_sampling.max_rounds, plain.dynamic_sampling.min_std, plain.overlong.penalty)
    assert defaults == (4, 1e-4, 1.0)
    assert plain.long_completions.tiled_mlp_tokens == "auto" and plain.rewards.whole_batch == ()


def test_each_field_reaches_its_group():
    changed = GRPOConfig(
        output_dir="unused", use_cpu=True, bf16=False, report_to="none", max_sampling_rounds=2,
        dynamic_sampling_min_std=0.5, selective_rollout_history=7, zero_waste_shared_prompt=False,
        tiled_mlp_tokens="4096", lm_head_tile_columns="none", reward_whole_batch=["ranked"], fit_check="off",
        vllm_dtype="float32", health_check="stop", overlong_buffer_length=8, max_completion_length=16,
    )  # fmt: skip
    settings = PlusSettings.from_config(changed)
    assert (settings.dynamic_sampling.max_rounds, settings.dynamic_sampling.min_std) == (2, 0.5)
    # selective rollout's dead-group threshold is dynamic sampling's field, read there
    assert settings.selective_rollout.history == 7 and settings.selective_rollout.min_std == 0.5
    assert settings.zero_waste.shared_prompt is False and settings.zero_waste.training_pass is True
    assert (settings.long_completions.tiled_mlp_tokens, settings.long_completions.lm_head_tile_columns) == (4096, None)
    assert (settings.rewards.whole_batch, settings.fit.check, settings.vllm.dtype) == (("ranked",), "off", "float32")
    assert (settings.health.check, settings.overlong.buffer_length) == ("stop", 8)
    for loss in ("clip_cov", "kl_cov"):  # a policy loss's options are read from the fields of the same names
        options = dict(clip_cov_ratio=1e-3, clip_cov_lb=0.5, clip_cov_ub=2.0, kl_cov_ratio=1e-3, kl_cov_coef=0.5)
        chosen = PlusSettings.from_config(make("unused", policy_loss=loss, **options))
        assert chosen.algorithms.policy_loss_options == {k: v for k, v in options.items() if k.startswith(loss)}


def test_the_settings_values_build_the_same_settings():
    """The canonical values (what the fit check's counting child is given) are a config of the same run: normalizing
    them again changes nothing."""
    config = make(
        "unused", scale_rewards="local", kl_estimator="mse", beta=0.1, rollout_correction="bypass_pg_geo_rs",
        tiled_mlp_tokens="4096", reward_whole_batch=["ranked"], plugins=["json"],
    )  # fmt: skip
    settings = PlusSettings.from_config(config)
    again = PlusSettings.from_config(make("unused", **settings.config_values()))
    assert again == settings
    assert settings.config_values()["policy_loss"] == "gpg" and settings.config_values()["kl_estimator"] == "k2"


@pytest.fixture
def count_builds(monkeypatch):
    """Every settings build (grpo_plus.config.build_settings) from now on, by config."""
    import grpo_plus.config

    builds, build = [], grpo_plus.config.build_settings
    monkeypatch.setattr(grpo_plus.config, "build_settings", lambda config: builds.append(config) or build(config))
    return builds


def tiny_trainer(model_dir, args, **kwargs):
    from helpers.models import prompt_dataset
    from helpers.rewards import length_reward
    from transformers import AutoModelForCausalLM

    from grpo_plus import GRPOTrainer

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    return GRPOTrainer(model=model, reward_funcs=length_reward, args=args, train_dataset=prompt_dataset(4), **kwargs)


@pytest.mark.floor("cpu_logps")
def test_settings_are_built_once_per_run_and_kept_by_the_trainer(tiny_model_dir, tmp_path, count_builds):
    # A config with canonical values is handed to TRL's trainer itself, as stock TRL would take it, and TRL 1.14's
    # trainer fills in `gradient_checkpointing_kwargs` in it: changed, it is built again after the trainer, to the same
    # settings. TRL 1.15-1.16 write nothing: the trainer's settings are the config's, built once.
    trl_writes = fields_stock_trl_writes(tiny_model_dir, tmp_path)
    args = make(tmp_path, dynamic_sampling_min_std=0.25)
    trainer = tiny_trainer(tiny_model_dir, args)
    assert count_builds == [args]  # built by GRPOConfig, reused by the trainer
    if trl_writes:
        assert PlusSettings.from_config(args) == trainer.plus and count_builds == [args, args]
    else:
        assert trainer.plus is PlusSettings.from_config(args) and count_builds == [args]

    plain = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none")
    count_builds.clear()
    trainer = tiny_trainer(tiny_model_dir, plain)
    assert count_builds == [plain]  # a TRL script's config: built once, by the trainer
    if trl_writes:
        assert PlusSettings.from_config(plain) == trainer.plus and count_builds == [plain, plain]
    else:
        assert trainer.plus is PlusSettings.from_config(plain) and count_builds == [plain]

    # The negative control: a config changed after it was built is built again (the counter sees the trainer's
    # builds), and the trainer reads the value it holds now, not the one it was built with.
    args.dynamic_sampling_min_std = 0.5
    count_builds.clear()
    trainer = tiny_trainer(tiny_model_dir, args)
    assert count_builds == [args] and trainer.plus.dynamic_sampling.min_std == 0.5


class LogprobRollout:
    """A `rollout_func` that reports the sampler's log-probs (all the rollout correction needs at construction)."""

    def __call__(self, prompts, trainer):  # pragma: no cover - construction only
        raise AssertionError("not called: the trainer is only built")


def fields_stock_trl_writes(model_dir, tmp_path) -> dict:
    """The fields stock TRL's GRPOTrainer writes into the config it is handed, and what it writes (TRL 1.14 fills in
    `gradient_checkpointing_kwargs`; 1.16 writes nothing)."""
    from helpers.models import prompt_dataset
    from helpers.rewards import length_reward
    from transformers import AutoModelForCausalLM

    plain = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none")
    before = copy.deepcopy(plain.to_dict())
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    trl.GRPOTrainer(model=model, reward_funcs=length_reward, args=plain, train_dataset=prompt_dataset(4))
    return {name: value for name, value in plain.to_dict().items() if before[name] != value}


@pytest.mark.floor("cpu_logps")
@pytest.mark.parametrize("config_cls", [GRPOConfig, trl.GRPOConfig], ids=["grpo_plus", "trl"])
def test_the_users_config_is_never_written(tiny_model_dir, tmp_path, monkeypatch, config_cls):
    """Building the settings and the trainer leaves the user's config as it was (aliases, a rollout-correction preset,
    a tile size given as a string); the run uses the canonical values, and so does TRL's own trainer."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # TRL's notice that rollout_func is experimental
    aliases = dict(scale_rewards="local", loss_type="grpo")
    ours = dict(rollout_correction="bypass_pg_geo_rs", rollout_rs=" seq_mean_k1", kl_estimator="mse", beta=0.1,
                tiled_mlp_tokens="4096")  # fmt: skip
    args = config_cls(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", **aliases,
                      **(ours if config_cls is GRPOConfig else {}))  # fmt: skip
    before = copy.deepcopy(args.to_dict())
    trainer = tiny_trainer(tiny_model_dir, args, rollout_func=LogprobRollout())
    assert args.to_dict() == before
    assert (args.scale_rewards, trainer.args.scale_rewards, trainer.scale_rewards) == ("local", "group", "group")
    # The copy holds the canonical values, and what stock TRL's own trainer writes into the config it is handed
    assert trainer.args is not args
    assert trainer.args.to_dict() == {
        **before,
        "scale_rewards": "group",
        **fields_stock_trl_writes(tiny_model_dir, tmp_path),
    }
    if config_cls is GRPOConfig:
        plus = trainer.plus
        assert (plus.algorithms.policy_loss, plus.algorithms.kl_estimator) == ("gpg", "k2")
        assert (plus.rollout.rollout_rs, plus.rollout.rollout_bypass_mode) == ("seq_mean_k1", True)
        assert plus.long_completions.tiled_mlp_tokens == 4096
        assert (args.policy_loss, args.kl_estimator, args.rollout_rs, args.tiled_mlp_tokens) == (
            "ppo_clip", "mse", " seq_mean_k1", "4096"
        )  # fmt: skip


@pytest.mark.floor("cpu_logps")
def test_a_config_with_canonical_values_is_handed_to_trl_as_it_is(tiny_model_dir, tmp_path):
    """Nothing to canonicalize: TRL's trainer gets the user's config itself, as stock TRL would."""
    args = make(tmp_path, scale_rewards="batch")
    assert tiny_trainer(tiny_model_dir, args).args is args


def raw_reads(package: Path, fields: set[str]) -> list[str]:
    """Where a module of `package` (outside the settings groups, the normalization step in config.py and the app kit)
    reads one of `fields` from a config: `args.<field>`, `self.args.<field>`, `getattr(args, "<field>", ...)`."""
    configs = {"args", "config", "training_args", "own"}
    found = []
    for path in sorted(package.rglob("*.py")):
        where = path.relative_to(package)
        if where.parts[0] == "app" or where.name == "settings.py" or where.as_posix() in ("config.py", "plugins.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Attribute) and node.attr in fields:
                base = node.value
                name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else ""
                if name in configs:
                    found.append(f"{where}:{node.lineno} {name}.{node.attr}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr":
                if len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value in fields:
                    found.append(f"{where}:{node.lineno} getattr(..., {node.args[1].value!r})")
    return found


def test_no_module_reads_a_grpo_plus_field_from_the_config():
    """The run's settings are read once, into PlusSettings, and handed over: no trainer or feature module reads one of
    grpo_plus's fields from a config. (Before the settings groups, 28 places did, in the algorithm, rollout-correction,
    vLLM, fit, reward-runner and sampling modules: this scan of that tree finds them.)"""
    import grpo_plus

    assert raw_reads(Path(grpo_plus.__file__).parent, set(own_fields())) == []
