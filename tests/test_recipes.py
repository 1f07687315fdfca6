"""The recipes end to end on a tiny local model: LoRA and QLoRA runs, adapter reload, card, Hub push, bad input."""

import importlib.util
import json
import sys
import time
from pathlib import Path

import huggingface_hub
import pytest
import torch
from huggingface_hub.hf_api import RepoUrl
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

import grpo_plus.app.hub
import grpo_plus.app.recipe
from grpo_plus.app.recipe import parse_recipe_args
from grpo_plus.run.checkpoints import last_complete_checkpoint
from grpo_plus.run.validation import RewardFunctionError

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
ADAPTER_PUSH = {"adapter_config.json", "adapter_model.safetensors", "README.md", "reward_curve.png"}


def load_recipe(name: str):
    spec = importlib.util.spec_from_file_location(name, RECIPES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_flags(model_dir, output_dir, *extra):
    return [
        "--model_name_or_path", str(model_dir), "--output_dir", str(output_dir), "--use_cpu", "true", "--bf16",
        "false", "--gradient_checkpointing", "false", "--max_steps", "2", "--per_device_train_batch_size", "4",
        "--num_generations", "4", "--max_completion_length", "8", "--learning_rate", "0.01", "--report_to", "none",
        "--lora_r", "4", "--lora_alpha", "8", "--lora_target_modules", "all-linear", "--task_eval_size", "8",
        "--eval_max_new_tokens", "4", "--logging_steps", "1", "--save_strategy", "steps", "--save_steps", "1",
        "--disable_tqdm", "true", *extra,
    ]  # fmt: skip


def assert_adapter_reloads_and_generates(model_dir, output_dir):
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, output_dir)
    assert any("lora_" in name for name, _ in model.named_parameters())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer("1+2=", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=3, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] > ids["input_ids"].shape[1]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["grpo_lora", "grpo_qlora"])
def test_recipe_trains_two_steps_and_writes_adapter_card_plot(request, tmp_path, recipe, capsys):
    tiny_model_dir = request.getfixturevalue("tiny_model_dir_bnb" if recipe == "grpo_qlora" else "tiny_model_dir")
    out = tmp_path / "run"
    load_recipe(recipe).main(tiny_flags(tiny_model_dir, out, "--loss_type", "dr_grpo", "--epsilon_high", "0.28"))
    printed = capsys.readouterr().out
    assert "Held-out results" in printed and "accuracy" in printed
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["global_step"] == 2
    assert not (out / "model.safetensors").exists(), "only the adapter should be saved"
    assert_adapter_reloads_and_generates(tiny_model_dir, out)
    card = (out / "README.md").read_text()
    base_folder = Path(tiny_model_dir).name  # a local base model is named by its folder, never by its path
    for expected in (f"`{base_folder}`", "dr_grpo", "epsilon_high", "0.28", "add-1d", "accuracy", "reward_curve.png"):
        assert expected in card, expected
    assert str(tiny_model_dir) not in card and "base_model:" not in card  # not a Hub id: no Hub metadata
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == base_folder
    assert (out / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.floor("image_prompts")
@pytest.mark.parametrize("four_bit", [False, True], ids=["lora", "qlora"])
def test_vlm_recipe_trains_on_pictures_and_writes_adapter_card_plot(tiny_vlm_dir_bnb, tmp_path, four_bit):
    """recipes/grpo_vlm.py on a tiny Qwen2.5-VL (its processor built without torchvision): the count-shapes task, two
    steps, the adapter on the language model's attention only, card and plot written."""
    out = tmp_path / "run"
    flags = tiny_flags(tiny_vlm_dir_bnb, out, "--task_level", "count-shapes", "--image_size", "56",
                       "--load_in_4bit", str(four_bit).lower(), "--lora_target_modules", "q_proj", "v_proj",
                       "--lora_dropout", "0.0")  # fmt: skip
    load_recipe("grpo_vlm").main(flags)
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["global_step"] == 2
    assert all(entry.get("zero_waste/images_frac", 0) <= 0.25 for entry in state["log_history"] if "loss" in entry)
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert sorted(adapter["target_modules"]) == ["q_proj", "v_proj"]
    card = (out / "README.md").read_text()
    assert "count-shapes" in card and "image task" in card
    assert (out / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def fake_hub(monkeypatch):
    """Replace the Hub at the huggingface_hub boundary; record every write."""
    calls = {"commits": [], "uploads": []}
    monkeypatch.setattr(grpo_plus.app.hub, "_hub_offline", lambda: False)  # the suite runs offline; this Hub is fake
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_test")
    monkeypatch.setattr(
        huggingface_hub.HfApi,
        "whoami",
        lambda self, token=None, **kw: {"name": "alice", "orgs": [], "auth": {"accessToken": {"role": "write"}}},
    )
    monkeypatch.setattr(
        huggingface_hub.HfApi,
        "create_repo",
        lambda self, repo_id, **kw: RepoUrl(f"https://huggingface.co/{repo_id}"),
    )

    def create_commit(self, repo_id, operations, **kwargs):
        calls["commits"].append((repo_id, [op.path_in_repo for op in operations]))

    def forbidden_upload(self, *args, **kwargs):
        calls["uploads"].append((args, kwargs))

    monkeypatch.setattr(huggingface_hub.HfApi, "create_commit", create_commit)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", forbidden_upload)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_file", forbidden_upload)
    return calls


@pytest.mark.slow
def test_push_to_hub_sends_exactly_the_adapter_files(tiny_model_dir, tmp_path, fake_hub):
    out = tmp_path / "run"
    load_recipe("grpo_lora").main(tiny_flags(tiny_model_dir, out, "--push_to_hub", "true", "--hub_model_id", "grpo-x"))
    assert fake_hub["uploads"] == []
    assert len(fake_hub["commits"]) == 1
    repo_id, files = fake_hub["commits"][0]
    assert repo_id == "alice/grpo-x"
    assert set(files) == ADAPTER_PUSH
    assert (out / "checkpoint-2").is_dir(), "checkpoints exist locally but were not pushed"


def test_missing_token_fails_before_any_model_loads(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """Like a config error: one `error: ...` line and exit status 2, not a traceback."""
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    monkeypatch.delenv("HF_TOKEN", raising=False)

    def no_model_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the token check")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_model_loading)
    started = time.monotonic()
    with pytest.raises(SystemExit) as exit_info:
        load_recipe("grpo_lora").main(tiny_flags(tiny_model_dir, tmp_path, "--push_to_hub", "true"))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --push_to_hub needs a Hugging Face token") and "hf auth login" in err
    assert time.monotonic() - started < 30


@pytest.mark.slow
def test_failed_push_after_training_is_an_error_line_and_keeps_the_adapter(
    tiny_model_dir, tmp_path, fake_hub, monkeypatch, capsys
):
    def connection_reset(self, repo_id, operations, **kwargs):
        raise ConnectionError("Connection reset by peer")

    monkeypatch.setattr(huggingface_hub.HfApi, "create_commit", connection_reset)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        load_recipe("grpo_lora").main(
            tiny_flags(
                tiny_model_dir, out, "--push_to_hub", "true", "--hub_model_id", "x", "--hub_private_repo", "true"
            )
        )
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "\nerror: --push_to_hub needs network access" in err and "Connection reset by peer" in err
    retry = (
        f"The adapter is saved in {out}; push it later with the same settings: grpo-plus push {out} --repo-id alice/x"
    )
    assert retry + " --private true --commit-message " in err
    assert (out / "adapter_model.safetensors").is_file()


def test_unknown_model_path_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_recipe("grpo_lora").main(tiny_flags(tmp_path / "no-such-model", tmp_path / "out"))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "cannot load model" in err and "no-such-model" in err


def test_dataset_without_prompt_column_is_a_clear_error(tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text('{"question": "1+1", "answer": 2}\n{"question": "2+2", "answer": 4}\n')
    with pytest.raises(SystemExit):
        load_recipe("grpo_lora").main(tiny_flags(tiny_model_dir, tmp_path / "out", "--dataset_name", str(data)))
    err = capsys.readouterr().err
    assert "no 'prompt' column" in err and "question" in err


def test_unknown_config_key_names_the_closest_field(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text(f"output_dir: {tmp_path}\nuse_cpu: true\nbf16: false\nlossy_type: dapo\n")
    with pytest.raises(SystemExit) as exit_info:
        parse_recipe_args(["--config", str(config)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "lossy_type" in err and "did you mean 'loss_type'" in err


def test_unknown_flag_names_the_closest_field(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_recipe_args(
            ["--output_dir", str(tmp_path), "--use_cpu", "true", "--bf16", "false", "--epsilon_hgh", "0.3"]
        )
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown flag: '--epsilon_hgh' (did you mean '--epsilon_high'?)")


def test_unknown_flags_and_keys_are_all_named(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text(f"output_dir: {tmp_path}\nuse_cpu: true\nbf16: false\nlossy_type: dapo\n")
    with pytest.raises(SystemExit):
        parse_recipe_args(["--config", str(config), "--lora_rr=8", "--task_levl", "add-2d", "--zzzz", "1"])
    err = capsys.readouterr().err
    assert "unknown key in the config file: 'lossy_type' (did you mean 'loss_type'?)" in err
    assert "unknown flags: '--lora_rr' (did you mean '--lora_r'?), '--task_levl' (did you mean '--task_level'?)" in err
    assert "'--zzzz'." in err  # nothing close: named without a guess


def test_bad_grpo_value_on_the_command_line_exits_with_the_reason(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_recipe_args(["--output_dir", str(tmp_path), "--use_cpu", "true", "--loss_type", "dapoo"])
    assert "Did you mean 'dapo'?" in capsys.readouterr().err


@pytest.mark.slow
def test_raising_reward_names_the_function_and_leaves_a_resumable_checkpoint(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    flags = tiny_flags(tiny_model_dir, out, "--save_steps", "100", "--max_steps", "4", "--eval_before_after", "false")
    with pytest.raises(ZeroDivisionError, match="Reward function 'explode_at_step_3' raised ZeroDivisionError") as err:
        load_recipe("grpo_lora").main([*flags, "--reward_funcs", "correctness", "helpers.rewards:explode_at_step_3"])
    assert isinstance(err.value, RewardFunctionError)
    # save_steps=100 never fired: the checkpoint is the one saved on the crash, at the last finished step.
    assert last_complete_checkpoint(out) == str(out / "checkpoint-2")
    load_recipe("grpo_lora").main([*flags, "--resume_from_checkpoint", "true"])
    assert json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())["global_step"] == 4


@pytest.mark.parametrize("config", sorted((RECIPES / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_parse(config, tmp_path):
    # GPU configs ask for bf16; this CPU machine cannot construct them without the override.
    flags = ["--config", str(config), "--output_dir", str(tmp_path), "--use_cpu", "true", "--bf16", "false"]
    four_bit = "qlora" in config.name  # the QLoRA config's 4-bit settings are for recipes/grpo_qlora.py only
    script_args, training_args, model_args = parse_recipe_args(flags, four_bit=four_bit)
    assert model_args.use_peft and model_args.model_name_or_path
    if four_bit:
        assert model_args.use_bnb_nested_quant and model_args.bnb_4bit_quant_type == "nf4"
    assert training_args.loss_type in ("dapo", "grpo", "dr_grpo", "bnpo")


@pytest.mark.parametrize("config", sorted((RECIPES / "accelerate_configs").glob("*.yaml")), ids=lambda p: p.name)
def test_accelerate_configs_are_valid(config):
    """accelerate's own loader reads every shipped config (it rejects unknown keys); GPU configs keep use_cpu off,
    which DeepSpeed needs (with use_cpu accelerate silently drops it)."""
    from accelerate.commands.config.config_args import load_config_from_file

    settings = load_config_from_file(str(config))
    assert settings.distributed_type in ("NO", "MULTI_GPU", "DEEPSPEED", "FSDP")
    assert settings.num_machines == 1 and not settings.use_cpu
    if settings.distributed_type == "DEEPSPEED":
        assert settings.deepspeed_config["zero_stage"] == int(config.stem[-1])
    if settings.distributed_type == "FSDP":  # FSDP2, fully sharded: what tests/test_fsdp.py runs (forced onto CPU)
        assert settings.fsdp_config["fsdp_version"] == 2 and settings.fsdp_config["fsdp_reshard_after_forward"]


# ---- every mistake one `error:` line, exit status 2, before anything trains (issue 18) ------------------------------


def error_line(capsys, *argv, recipe="grpo_lora") -> str:
    """Run a recipe expecting bad input: its stderr, which must be a single `error: ...` line after exit status 2."""
    with pytest.raises(SystemExit) as exit_info:
        load_recipe(recipe).main([str(arg) for arg in argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err[-3000:]
    assert "Traceback" not in err and "usage:" not in err
    return lines[0]


@pytest.fixture
def no_model_loading(monkeypatch):
    """Fail the test if the recipe gets as far as loading a model."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was reported")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)


@pytest.mark.parametrize(
    ("config_text", "expected"),
    [
        (None, "error: config file {path} does not exist."),
        (
            "loss_type: dapo\n  epsilon: 0.2\n",
            "error: config file {path} is not valid YAML at line 3, column 10: mapping values are not allowed here.",
        ),
        (
            "- loss_type\n- dapo\n",
            "error: config file {path} must hold a YAML mapping (field: value lines); it holds list",
        ),
        (
            "use_cpu: true\nbf16: false\nlearning_rate: [1, 2]\n",
            "error: config file {path}: learning_rate=[1, 2] is not ",
        ),
        # no use_cpu on a CPU machine: TRL's bf16 check would fail first and hide the typo
        ("lossy_type: dapo\n", "error: unknown key in the config file: 'lossy_type' (did you mean 'loss_type'?)"),
    ],
    ids=["missing", "yaml_syntax", "not_a_mapping", "list_for_a_number", "unknown_key_before_bf16_check"],
)
def test_config_file_mistakes_are_one_line(tmp_path, capsys, no_model_loading, config_text, expected):
    path = tmp_path / "run.yaml"
    if config_text is not None:
        path.write_text(config_text if config_text.startswith("-") else f"output_dir: {tmp_path}\n{config_text}")
    assert error_line(capsys, "--config", path).startswith(expected.format(path=path))


def test_a_value_of_the_wrong_type_names_the_flag_without_the_usage_dump(tmp_path, capsys, no_model_loading):
    line = error_line(capsys, "--output_dir", tmp_path, "--use_cpu", "true", "--learning_rate", "fast")
    assert line == "error: argument --learning_rate/--learning-rate: invalid float value: 'fast'"


@pytest.mark.parametrize(
    ("recipe", "flag", "expected"),
    [
        ("grpo_lora", "--load_in_4bit", "error: --load_in_4bit: recipes/grpo_lora.py trains on an unquantized base"),
        ("grpo_lora", "--load_in_8bit", "error: --load_in_8bit: recipes/grpo_lora.py trains on an unquantized base"),
        ("grpo_qlora", "--load_in_8bit", "error: --load_in_8bit: recipes/grpo_qlora.py quantizes the base to 4 bits"),
        ("grpo_lora", "--use_bnb_nested_quant", "error: --use_bnb_nested_quant: recipes/grpo_lora.py trains on an"),
        ("grpo_lora", "--use_peft", "error: --use_peft false: recipes/grpo_lora.py trains a LoRA adapter"),
        ("grpo_qlora", "--use_peft", "error: --use_peft false: recipes/grpo_qlora.py trains a LoRA adapter"),
    ],
)
def test_a_quantization_flag_the_recipe_cannot_honour_fails_at_start(
    tmp_path, capsys, no_model_loading, recipe, flag, expected
):
    value = "false" if flag == "--use_peft" else "true"
    line = error_line(
        capsys, "--output_dir", tmp_path, "--use_cpu", "true", "--bf16", "false", flag, value, recipe=recipe
    )
    assert line.startswith(expected)
    if recipe == "grpo_lora" and flag == "--load_in_4bit":
        assert "use recipes/grpo_qlora.py" in line


class ModelLoaded(Exception):
    """Raised in place of loading a model, once the recipe has built everything it passes to from_pretrained."""


@pytest.mark.parametrize("nested", [True, False])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_qlora_recipe_quantizes_as_its_flags_say(tiny_model_dir, tmp_path, monkeypatch, nested, quant_type):
    """TRL's ModelConfig flags mean in the QLoRA recipe what they mean in TRL's scripts: no flag is dropped."""
    loaded = {}

    def capture(*args, **kwargs):
        loaded.update(kwargs)
        raise ModelLoaded

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", capture)
    flags = ["--use_bnb_nested_quant", str(nested).lower(), "--bnb_4bit_quant_type", quant_type]
    with pytest.raises(ModelLoaded):
        load_recipe("grpo_qlora").main(tiny_flags(tiny_model_dir, tmp_path, *flags))
    config = loaded["quantization_config"]
    assert config.load_in_4bit and config.bnb_4bit_use_double_quant is nested
    assert config.bnb_4bit_quant_type == quant_type


def test_an_empty_jsonl_dataset_is_one_line(tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("")
    line = error_line(capsys, *tiny_flags(tiny_model_dir, tmp_path / "out", "--dataset_name", data))
    assert line.startswith(f"error: cannot load dataset '{data}': ")


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (("--lora_target_modules", "no_such_proj"), "error: Target modules no_such_proj not found in the base model"),
        (("--lora_target_modules", "q_proj", "v_prj"), "error: --lora_target_modules: v_prj matches no module"),
        (("--resume_from_checkpoint", "true"), "holds no complete checkpoint"),
    ],
    ids=["lora_target_modules", "one_lora_target_module", "no_checkpoint_to_resume"],
)
def test_trainer_and_resume_mistakes_fail_before_the_held_out_evaluation(
    tiny_model_dir, tmp_path, capsys, monkeypatch, extra, expected
):
    def no_evaluation(*args, **kwargs):
        raise AssertionError("the held-out evaluation ran before the bad input was reported")

    monkeypatch.setattr(grpo_plus.app.recipe, "evaluate_held_out", no_evaluation)
    line = error_line(capsys, *tiny_flags(tiny_model_dir, tmp_path / "out", *extra))
    assert expected in line


def test_plugins_and_reward_modules_are_found_in_the_working_directory(tmp_path, monkeypatch):
    """`python recipes/grpo_lora.py --config run.yaml` from the folder holding the user's modules: the recipe's folder
    is on sys.path, the working directory is not (`python -m pytest` adds it; so the test removes it)."""
    from grpo_plus.app.recipe import resolve_reward_funcs

    (tmp_path / "my_modes_cwd.py").write_text(
        "from grpo_plus import register_loss_type\n\n"
        "@register_loss_type('cwd_sum', override=True)\ndef cwd_sum(masked_loss, ctx):\n    return masked_loss.sum()\n"
    )
    (tmp_path / "my_rewards_cwd.py").write_text(
        "def score(completions, **kwargs):\n    return [1.0] * len(completions)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    config = tmp_path / "run.yaml"
    config.write_text(
        f"output_dir: {tmp_path}\nuse_cpu: true\nbf16: false\nplugins: [my_modes_cwd]\nloss_type: cwd_sum\n"
    )
    _, training_args, _ = parse_recipe_args(["--config", str(config)])
    assert training_args.loss_type == "cwd_sum"
    assert resolve_reward_funcs(["my_rewards_cwd:score"])[0].__name__ == "score"
