"""The shipped recipe configs keep grpo_plus's savings on (issue 28).

Each config in recipes/configs is run by its recipe for one step on a tiny local model (only the model, the device,
the step count and the completion length are overridden): it must train without dropout, so that the zero-waste
training pass and zero-waste generation both run, and the log must name no part that fell back to TRL's full
computation. With the old `lora_dropout: 0.05` both savings stood aside in exactly the runs the recipes advertise.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import pytest
from helpers.floors import skip_below_floor

from grpo_plus.compat.versions import version_gap
from grpo_plus.zero_waste.rows import dropout_blocker

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
CONFIGS = sorted((RECIPES / "configs").glob("*.yaml"))


def load_recipe(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", RECIPES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def recipe_of(config: Path) -> str:
    """The recipe a shipped config is for (its header names it)."""
    return "grpo_vlm" if "-vl-" in config.name else "grpo_qlora" if "qlora" in config.name else "grpo_lora"


def run_one_step(config: Path, model_dir: str, output_dir: Path, monkeypatch):
    """Run `config` with its recipe for one optimizer step on the tiny model; return the trainer it built."""
    recipe = load_recipe(recipe_of(config))
    built = []

    class RecordingTrainer(recipe.GRPOTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(recipe, "GRPOTrainer", RecordingTrainer)
    recipe.main(
        [
            "--config", str(config), "--model_name_or_path", model_dir, "--output_dir", str(output_dir),
            "--use_cpu", "true", "--bf16", "false", "--max_steps", "1", "--max_completion_length", "8",
            "--eval_before_after", "false", "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true",
            *(["--image_size", "56", "--image_max_pixels", str(56 * 56)] if recipe_of(config) == "grpo_vlm" else []),
        ]
    )  # fmt: skip
    (trainer,) = built
    return trainer


@pytest.mark.parametrize("config", CONFIGS, ids=lambda path: path.name)
def test_shipped_config_trains_with_the_savings_on(config, request, tmp_path, monkeypatch, caplog):
    if recipe_of(config) == "grpo_vlm":  # the tiny VLM's processor and the savings on images
        skip_below_floor("image_prompts")
    fixture = {"grpo_vlm": "tiny_vlm_dir_bnb", "grpo_qlora": "tiny_model_dir_bnb"}.get(
        recipe_of(config), "tiny_model_dir"
    )
    if config.name.startswith("olmoe"):  # a mixture of experts: its LoRA targets the experts' parameters
        skip_below_floor("moe_experts")  # transformers 5's experts module, which target_parameters reaches
        fixture = "tiny_moe_dir_bnb"
    model_dir = request.getfixturevalue(fixture)
    with caplog.at_level(logging.WARNING, logger="grpo_plus"):
        trainer = run_one_step(config, model_dir, tmp_path / "run", monkeypatch)
    # Only what the docs say the installed versions rule out may fall back (the oldest supported TRL / transformers).
    version_reasons = [
        gap for gap in map(version_gap, ("zero_waste_generation", "shared_prompt", "moe_router_logits")) if gap
    ]
    fallbacks = [record.getMessage() for record in caplog.records if "computed in full" in record.getMessage()]
    assert [message for message in fallbacks if not any(reason in message for reason in version_reasons)] == []
    assert trainer._zero_waste.row_skip_blocker is None  # zero-advantage rows are skipped
    trainer.model.train()  # the mode the training forward and TRL's generation run in
    assert dropout_blocker(trainer.accelerator.unwrap_model(trainer.model)) is None
    (step,) = [entry for entry in trainer.state.log_history if "zero_waste/positions_frac" in entry]
    if version_gap("shared_prompt") is None:
        assert step["zero_waste/positions_frac"] < 1  # the training pass computed fewer positions than TRL's
    if version_gap("zero_waste_generation") is None:
        assert step["zero_waste/generation_positions_frac"] < 1  # and so did generation (one prefill per prompt)
    if config.name.startswith("olmoe"):  # LoRA on attention and on every layer's experts (PEFT's target_parameters)
        adapters = [name for name, param in trainer.model.named_parameters() if param.requires_grad]
        assert any(".experts." in name for name in adapters) and any("q_proj" in name for name in adapters)
    if recipe_of(config) == "grpo_vlm":  # each group's pictures encoded once, in generation and in the training pass
        assert step["zero_waste/generation_images_frac"] < 1 and step["zero_waste/images_frac"] < 1
