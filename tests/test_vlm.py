"""Vision-language models: TRL's VLM GRPO tests (`TestGRPOTrainerVLM` in TRL's tests/test_grpo_trainer.py), run on
tiny local VLMs of each family TRL tests, with stock TRL and grpo_plus training to the same weights; the zero-waste
training pass on image batches (each prompt and its images computed once per group, dead rows skipped), exact against
TRL's own forward, with the saving counted (token positions, vision-tower patches).

Runs use plain SGD in float32 (see tests/test_trainer_parity.py for why not Adam)."""

from __future__ import annotations

import logging
import tempfile

import pytest
import torch
import trl
from helpers.probes import max_weight_diff

import grpo_plus
from grpo_plus.app.testing import tiny_run_kwargs
from grpo_plus.app.tiny_vlms import VLM_FAMILIES, VisionLog, image_dataset, make_vlm, save_tiny_vlm, vision_tower
from grpo_plus.compat.model import FORWARD_INPUT_KEYS
from grpo_plus.zero_waste.images import RowImages

pytestmark = [
    pytest.mark.floor("cpu_logps"),
    # The tiny VLMs' processors are transformers 5's PIL ones, and the savings' floor is 5.24 (docs/guide/versions.md).
    pytest.mark.floor("image_prompts"),
    # Each group's prompt and pictures computed once in the training pass is the shared prompt (trl >= 1.15); on TRL
    # 1.14 the pass computes image batches TRL's way (same weights, checked by hand: docs/guide/versions.md).
    pytest.mark.floor("shared_prompt"),
]
needs_fused_lm_head = pytest.mark.floor("fused_lm_head")


@pytest.fixture(autouse=True)
def in_tmp_path(tmp_path, monkeypatch):
    """Trainers here write to relative output dirs (completions logs, checkpoints): keep them out of the repository."""
    monkeypatch.chdir(tmp_path)


def distinct_characters_reward(completions, **kwargs):
    """TRL's VLM tests reward the completion's length; a random tiny model rarely ends a completion early, so every
    group would tie. Distinct characters vary within a group: most groups train, some tie (dead rows)."""
    return [float(len(set(completion[0]["content"]))) for completion in completions]


class GradientLog:
    """Which trainable parameters ever received a non-zero gradient."""

    def __init__(self, model):
        self.nonzero: dict[str, bool] = {}
        for name, param in model.named_parameters():
            if param.requires_grad:
                self.nonzero[name] = False
                param.register_post_accumulate_grad_hook(self._hook(name))

    def _hook(self, name):
        def record(param):
            self.nonzero[name] |= bool(param.grad is not None and param.grad.abs().max() > 0)

        return record


_SAVED: dict[str, tuple] = {}


def saved_vlm(family: str):
    """A fresh float32 load of the tiny `family` VLM saved once per session (TRL loads its reference model from the
    model's path), and its processor."""
    from transformers import AutoModelForImageTextToText

    if family not in _SAVED:
        path = tempfile.mkdtemp(prefix=f"tiny-{family}-")
        _SAVED[family] = (path, save_tiny_vlm(path, family))
    path, processor = _SAVED[family]
    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32), processor


def train(package, family, dataset=None, peft_config=None, **overrides):
    """`package`'s GRPOTrainer on a fresh tiny `family` VLM (same seed for both packages); returns (trainer,
    GradientLog, VisionLog)."""
    settings = dict(
        per_device_train_batch_size=4, num_generations=2, max_completion_length=8, max_steps=2,
        optim="sgd", learning_rate=0.1,
    )  # fmt: skip
    args = package.GRPOConfig(**tiny_run_kwargs(f"unused-{package.__name__}", **{**settings, **overrides}))
    model, processor = saved_vlm(family)
    torch.manual_seed(args.seed)
    trainer = package.GRPOTrainer(
        model=model,
        processing_class=processor,
        reward_funcs=distinct_characters_reward,
        args=args,
        train_dataset=dataset if dataset is not None else image_dataset(4),
        peft_config=peft_config,
    )
    gradients, vision = GradientLog(trainer.model), VisionLog(trainer.model)
    trainer.train()
    return trainer, gradients, vision


def assert_same_run(family, **kwargs):
    """Stock TRL and grpo_plus train `family` to the same weights, which moved; TRL's own check that every parameter
    trains holds (as gradients: SGD on a random tiny model moves some by less than float32 resolves). Returns both
    runs' (trainer, GradientLog, VisionLog)."""
    initial = {name: param.detach().clone() for name, param in make_vlm(family)[0].named_parameters()}
    stock = train(trl, family, **kwargs)
    plus = train(grpo_plus, family, **kwargs)
    for trainer, _, _ in (stock, plus):
        assert trainer.state.log_history[-1]["train_loss"] is not None
    stock_weights = dict(stock[0].model.named_parameters())
    plus_weights = dict(plus[0].model.named_parameters())
    if kwargs.get("peft_config") is not None:  # LoRA's B matrices start at zero
        initial = {name: torch.zeros_like(param) for name, param in stock_weights.items() if "lora_B" in name}
    moved = max_weight_diff(initial, stock_weights)
    assert moved > 1e-3, "training did not change the weights: the comparison would be vacuous"
    diff = max_weight_diff(stock_weights, plus_weights)
    assert diff <= 5e-8, f"max |w_trl - w_grpo_plus| = {diff}"  # worst 1.5e-8: 3.4x
    assert_every_parameter_trains(plus[1], family)
    assert stock[1].nonzero == plus[1].nonzero
    return stock, plus


def assert_every_parameter_trains(gradients: GradientLog, family: str):
    """TRL's check: every trainable parameter gets a gradient (LLaVA's CLIP post-layernorm feeds only the pooled
    output, which LLaVA does not read)."""
    assert gradients.nonzero, "no trainable parameter"
    for name, nonzero in gradients.nonzero.items():
        if family in ("llava", "llava_next") and "post_layernorm" in name:
            assert not nonzero, f"{name} expected frozen by LLaVA's design, but trained"
        else:
            assert nonzero, f"Parameter {name} got no gradient."


# ---- TRL's TestGRPOTrainerVLM, on local models, against stock TRL ------------------------------------------------


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_train_vlm(family):
    stock, plus = assert_same_run(family)
    logs = plus[0].state.log_history
    # grpo_plus generated TRL's completions (same weights) with each image encoded once per group (G=2) ...
    assert [entry["zero_waste/generation_images_frac"] for entry in logs if "loss" in entry] == [0.5, 0.5]
    # ... and its training pass computed each live group's prompt and images once (dead groups: not at all)
    assert all(entry["zero_waste/images_frac"] <= 0.5 for entry in logs if "loss" in entry)
    # The zero-waste training pass encoded fewer image patches than TRL's run (each group's image once).
    assert plus[2].patches < stock[2].patches, (plus[2].patches, stock[2].patches)


def test_train_vlm_with_pad_to_multiple_of():
    """Gemma 3 passes token_type_ids, which TRL pads along with the prompts."""
    assert_same_run("gemma3", pad_to_multiple_of=7)


def test_train_vlm_beta_non_zero():
    stock, plus = assert_same_run("qwen2_5_vl", beta=0.1)
    assert any("kl" in entry for entry in plus[0].state.log_history)


def test_train_vlm_peft():
    from peft import LoraConfig

    # LoRA's A matrices get a gradient once B (initialised at zero) has moved: a step more.
    stock, plus = assert_same_run(
        "qwen2_5_vl", peft_config=LoraConfig(target_modules=["q_proj", "v_proj"]), max_steps=3
    )
    for trainer, _, _ in (stock, plus):
        trained = [name for name, param in trainer.model.named_parameters() if param.requires_grad]
        assert trained and all("lora_" in name for name in trained), "only the adapter should train"


def test_train_vlm_and_importance_sampling():
    """steps_per_generation=2: TRL computes old log-probs (grpo_plus after the micro-batch split)."""
    assert_same_run("qwen2_5_vl", steps_per_generation=2)


def test_train_vlm_multi_image():
    stock, plus = assert_same_run("qwen2_5_vl", dataset=image_dataset(4, images_per_prompt=2))
    assert plus[2].patches < stock[2].patches


def test_train_vlm_log_multimodal_false():
    trainer, _, _ = train(grpo_plus, "gemma3", log_completions=True, log_multimodal=False)
    assert len(trainer._logs["images"]) == 0


# ---- the zero-waste training pass on image batches ---------------------------------------------------------------

G = 4


def generated_batch(family: str, images_per_prompt: int = 1, num_prompts: int = 2, **settings):
    """A grpo_plus trainer on a tiny `family` VLM and one generation batch of `num_prompts` image prompts x G
    completions, generated and scored by stock TRL's code (rows in TRL's order: each prompt's G rows together)."""
    model, processor = make_vlm(family)
    args = grpo_plus.GRPOConfig(
        **tiny_run_kwargs("unused", per_device_train_batch_size=G * num_prompts, num_generations=G,
                          max_completion_length=10, **settings)
    )  # fmt: skip
    dataset = image_dataset(num_prompts, images_per_prompt=images_per_prompt)
    trainer = grpo_plus.GRPOTrainer(
        model=model, processing_class=processor, reward_funcs=distinct_characters_reward, args=args,
        train_dataset=dataset,
    )  # fmt: skip
    trainer.model.train()
    torch.manual_seed(0)
    rows = [dataset[i] for i in range(num_prompts) for _ in range(G)]
    return trainer, trl.GRPOTrainer._generate_and_score_completions(trainer, rows)


def logps_call(trainer, batch, method, **kwargs):
    """`method` (TRL's or grpo_plus's `_get_per_token_logps_and_entropies`) on the batch, with its image inputs."""
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    images = {key: batch.get(key) for key in FORWARD_INPUT_KEYS}
    return method(trainer, trainer.model, input_ids, attention_mask, batch["completion_ids"].shape[1], **images,
                  **kwargs)  # fmt: skip


@needs_fused_lm_head
@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_shared_prompt_logps_equal_trl_forward_with_each_image_encoded_once(family):
    """Every row's log-probs and entropies equal stock TRL's forward; each group's prompt (image tokens included) is
    computed once and each image encoded once."""
    trainer, batch = generated_batch(family)
    vision = VisionLog(trainer.model)
    reference_logps, reference_entropies, _ = logps_call(
        trainer, batch, trl.GRPOTrainer._get_per_token_logps_and_entropies, compute_entropy=True
    )
    trl_patches, vision.patches = vision.patches, 0
    trainer._zero_waste.positions = 0
    logps, entropies, _ = logps_call(
        trainer, batch, grpo_plus.GRPOTrainer._get_per_token_logps_and_entropies, compute_entropy=True
    )
    mask = batch["completion_mask"].bool()
    assert mask.sum() > 0 and reference_logps[mask].abs().min() > 0
    # float32, another layout: worst 4.8e-7 (threads 1-2): 3.1x
    torch.testing.assert_close(logps[mask], reference_logps[mask], atol=1.5e-6, rtol=0)
    torch.testing.assert_close(entropies[mask], reference_entropies[mask], atol=1.5e-6, rtol=0)
    assert vision.patches * G == trl_patches, (vision.patches, trl_patches)  # two prompts, each image once
    prompt_width = batch["prompt_ids"].shape[1]
    full_positions = batch["prompt_ids"].numel() + batch["completion_ids"].numel()
    # one prompt copy per group, not G: at most the two prompts plus every completion (and its repeated last prompt
    # token)
    assert trainer._zero_waste.positions <= 2 * prompt_width + batch["completion_ids"].numel() + 2 * G
    assert trainer._zero_waste.positions < 0.6 * full_positions


@needs_fused_lm_head
def test_gemma3_packed_forward_keeps_bidirectional_attention_inside_images(monkeypatch):
    """Negative control: Gemma 3's image tokens attend each other both ways; packs without those pairs would not be
    TRL's forward (this is what the previous test would catch)."""
    trainer, batch = generated_batch("gemma3")
    reference, _, _ = logps_call(trainer, batch, trl.GRPOTrainer._get_per_token_logps_and_entropies)
    monkeypatch.setattr("grpo_plus.zero_waste.training_pass.bidirectional_blocks", lambda config, images: None)
    causal_only, _, _ = logps_call(trainer, batch, grpo_plus.GRPOTrainer._get_per_token_logps_and_entropies)
    mask = batch["completion_mask"].bool()
    assert (causal_only - reference)[mask].abs().max() > 1e-3


@needs_fused_lm_head
@pytest.mark.parametrize("family", ["qwen2_vl", "idefics3", "llava_next"])
def test_no_grad_chunks_keep_image_rows_and_match_trl(family):
    """TRL's no-grad passes chunk rows (batch_size): each chunk gets its rows' images, two prompts per chunk."""
    trainer, batch = generated_batch(family, num_prompts=3)
    with torch.no_grad():
        reference, _, _ = logps_call(
            trainer, batch, trl.GRPOTrainer._get_per_token_logps_and_entropies, batch_size=2 * G
        )
        logps, _, _ = logps_call(
            trainer, batch, grpo_plus.GRPOTrainer._get_per_token_logps_and_entropies, batch_size=2 * G
        )
    mask = batch["completion_mask"].bool()
    torch.testing.assert_close(logps[mask], reference[mask], atol=1.5e-6, rtol=0)  # worst 4.8e-7: 3.1x


def loss_and_grads(trainer, inputs):
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {name: param.grad.clone() for name, param in trainer.model.named_parameters() if param.grad is not None}
    return loss.detach(), grads


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3", "llava"])
def test_dead_rows_are_skipped_with_their_images_and_the_gradient_is_trls(family):
    """A group with advantage 0 is not computed (nor its images encoded); the loss and gradient equal the full pass."""
    trainer, batch = generated_batch(family, num_prompts=3, images_per_prompt=2 if family == "qwen2_5_vl" else 1)
    batch["advantages"] = torch.linspace(-1.0, 1.0, 3 * G)
    batch["advantages"][G : 2 * G] = 0.0  # the middle group is dead
    trainer.current_gradient_accumulation_steps = 1
    trainer._wire_training_pass(enabled=False, shared_prompt=False)
    vision = VisionLog(trainer.model)
    full_loss, full_grads = loss_and_grads(trainer, batch)
    full_patches, vision.patches = vision.patches, 0
    trainer._wire_training_pass(enabled=True, shared_prompt=True)
    loss, grads = loss_and_grads(trainer, batch)
    torch.testing.assert_close(loss, full_loss, atol=0, rtol=0)  # bit for bit in every run
    assert grads.keys() == full_grads.keys() and any("vision" in n or "visual" in n for n in grads)
    for name in full_grads:
        torch.testing.assert_close(grads[name], full_grads[name], atol=1e-7, rtol=0, msg=name)  # worst 3.0e-8: 3.4x
    assert vision.patches * 3 * G == full_patches * 2, (vision.patches, full_patches)  # two live groups, once each


def test_rows_whose_images_cannot_be_told_apart_are_computed_in_full(caplog, monkeypatch):
    """Image inputs of a layout RowImages does not know (here: one pixel tensor too many for the rows' image count):
    no row is skipped and TRL's forward gets every row and every input unchanged, and the note says why."""
    trainer, batch = generated_batch("llava")
    batch["pixel_values"] = torch.cat([batch["pixel_values"], batch["pixel_values"][:1]])
    batch["advantages"] = torch.zeros(2 * G)
    calls = []

    def trl_forward(self, model, input_ids, attention_mask, logits_to_keep, **kwargs):
        calls.append((input_ids.shape, kwargs["pixel_values"].shape))
        return torch.zeros(input_ids.shape[0], logits_to_keep), None, None

    monkeypatch.setattr(trl.GRPOTrainer, "_get_per_token_logps_and_entropies", trl_forward)
    with caplog.at_level(logging.WARNING, logger="grpo_plus.zero_waste.training_pass"):
        policy = trainer._zero_waste.micro_batch_logps(trainer.model, batch, compute_entropy=False)
    assert policy.trained_rows is None
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    assert calls == [(input_ids.shape, batch["pixel_values"].shape)]
    assert any("pixel_values has 9 entries for 8 rows" in record.getMessage() for record in caplog.records)


def test_row_images_select_is_trls_contiguous_slicing_for_any_rows():
    """RowImages cuts each layout per row: the rows (1, 0) of a two-image-per-row Qwen batch are row 1's patches and
    grids, then row 0's."""
    grid = torch.tensor([[1, 2, 2], [1, 4, 2], [1, 2, 4], [1, 2, 2]])
    pixel_values = torch.arange(24, dtype=torch.float32).unsqueeze(1)  # 4 + 8 + 8 + 4 patch rows
    images = RowImages.from_inputs(
        {"pixel_values": pixel_values, "image_grid_thw": grid, "num_images": [2, 2],
         "mm_token_type_ids": torch.tensor([[0, 1, 1], [1, 1, 0]])}, 2
    )  # fmt: skip
    selected = images.select(torch.tensor([1, 0]), columns=slice(0, 2))
    assert selected["pixel_values"].squeeze(1).tolist() == list(range(12, 24)) + list(range(0, 12))
    assert selected["image_grid_thw"].tolist() == [[1, 2, 4], [1, 2, 2], [1, 2, 2], [1, 4, 2]]
    assert selected["num_images"] == [2, 2]
    assert selected["mm_token_type_ids"].tolist() == [[1, 1], [0, 1]]
    assert images.row_keys().tolist() == [0, 1]
    per_row = RowImages.from_inputs({"pixel_values": torch.zeros(3, 2, 4), "num_images": [2, 2, 2]}, 3)
    assert per_row.row_keys().tolist() == [0, 0, 0]  # Idefics3's layout: one padded tensor per row
    assert RowImages.from_inputs({"pixel_values": torch.zeros(5, 4), "num_images": [1, 1]}, 2).startswith(
        "pixel_values has 5 entries"
    )


# ---- zero-waste generation of image prompts ----------------------------------------------------------------------


def generation_inputs(family: str, num_prompts: int = 2, images_per_prompt: int = 1):
    """(model in eval mode, generate's inputs for num_prompts image prompts x G rows as TRL builds them, each row's
    image count, tokenizer)."""
    from trl.data_utils import apply_chat_template, prepare_multimodal_messages

    model, processor = make_vlm(family)
    dataset = image_dataset(num_prompts, images_per_prompt=images_per_prompt)
    rows = [dataset[i] for i in range(num_prompts) for _ in range(G)]
    images = [row["images"] if images_per_prompt > 1 else [row["image"]] for row in rows]
    prompts = [
        prepare_multimodal_messages(row["prompt"], images=row_images)
        for row, row_images in zip(rows, images, strict=True)
    ]
    texts = [apply_chat_template({"prompt": prompt}, processor)["prompt"] for prompt in prompts]
    inputs = processor(images=images, text=texts, padding=True, return_tensors="pt")
    return model.eval(), dict(inputs), [len(row) for row in images], processor.tokenizer


def sampling_settings(tokenizer):
    from transformers import GenerationConfig

    return GenerationConfig(
        max_new_tokens=8, do_sample=True, temperature=0.7, top_k=30, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=[tokenizer.eos_token_id], sequence_bias=[[[tokenizer.eos_token_id], 2.0]], disable_compile=True,
    )  # fmt: skip


def test_row_keys_tell_one_shared_picture_from_its_view_without_reading_values(monkeypatch):
    """Rows whose pictures are the same view of the same memory (a memory count's broadcast zeros) get one key without
    comparing their pixels; equal pixels in different memory still compare equal, different pixels differ."""
    grid = torch.tensor([[1, 2, 2]] * 3)
    compared = []
    real_equal = torch.equal
    monkeypatch.setattr(
        torch, "equal", lambda a, b: (a.is_floating_point() and compared.append(1)) or real_equal(a, b)
    )

    def keys(pixel_values):
        inputs = {"pixel_values": pixel_values, "image_grid_thw": grid, "num_images": [1, 1, 1]}
        return RowImages.from_inputs(inputs, 3).row_keys().tolist()

    assert keys(torch.zeros(()).expand(12, 5)) == [0, 0, 0] and not compared  # every row the same view
    assert keys(torch.zeros(12, 5)) == [0, 0, 0] and len(compared) == 2  # equal values, different memory
    assert keys(torch.arange(60.0).view(12, 5) % 20) == [0, 0, 0]
    assert keys(torch.arange(60.0).view(12, 5)) == [0, 1, 2]


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_image_prompts_sample_model_generates_ids_with_each_prompt_prefilled_and_each_image_encoded_once(family):
    from grpo_plus.zero_waste.generation import generate

    model, inputs, num_images, tokenizer = generation_inputs(
        family, images_per_prompt=2 if family == "qwen2_vl" else 1
    )
    config = sampling_settings(tokenizer)
    vision = VisionLog(model)
    for seed in range(2):
        torch.manual_seed(seed)
        reference = model.generate(**inputs, generation_config=config)
        state_after = torch.get_rng_state()
        reference_patches, vision.patches = vision.patches, 0
        torch.manual_seed(seed)
        ours, stats = generate(model, num_images=num_images, **inputs, generation_config=config)
        assert stats.fallback is None, stats.fallback
        assert torch.equal(torch.get_rng_state(), state_after), "the random draws were not the same"
        assert torch.equal(ours, reference)
        completions = reference[:, inputs["input_ids"].shape[1] :]
        ends = {int((row == tokenizer.eos_token_id).int().argmax()) for row in completions}
        assert len(ends) > 1, "rows should end at different steps"
        assert vision.patches * G == reference_patches, (vision.patches, reference_patches)
        vision.patches = 0
        assert stats.prefill_positions * G == stats.full_prefill_positions
        assert stats.images * G == stats.full_images == G * sum(num_images[::G])


def test_images_without_a_row_count_generate_with_model_generate(caplog):
    """Image inputs whose rows cannot be told apart (no image count): transformers' own generate, and why."""
    from grpo_plus.zero_waste.generation import generate

    model, inputs, _, tokenizer = generation_inputs("gemma3")
    config = sampling_settings(tokenizer)
    torch.manual_seed(0)
    reference = model.generate(**inputs, generation_config=config)
    torch.manual_seed(0)
    ours, stats = generate(model, **inputs, generation_config=config)
    assert torch.equal(ours, reference)
    assert "no per-row image count" in stats.fallback


def test_count_shapes_pictures_hold_as_many_shapes_as_their_answer():
    """The image task's truth: each answer is the number of grid cells of its picture that hold a shape; train and
    held-out pictures differ."""
    import numpy as np

    from grpo_plus.app.vlm import make_image_dataset

    train, test = (
        make_image_dataset("train", size=12, image_size=90),
        make_image_dataset("test", size=4, image_size=90),
    )
    for row in train:
        pixels = np.asarray(row["image"]).astype(int)
        cells = [pixels[y * 30 : (y + 1) * 30, x * 30 : (x + 1) * 30] for y in range(3) for x in range(3)]
        filled = sum(int((np.abs(cell - [245, 245, 240]).sum(axis=-1) > 0).any()) for cell in cells)
        assert filled == row["answer"] and 1 <= filled <= 6
        assert row["prompt"][0]["content"][0]["type"] == "image"
    assert len({row["answer"] for row in train}) > 2
    assert not any(np.array_equal(np.asarray(a["image"]), np.asarray(b["image"])) for a in train for b in test)


def test_the_guides_example_trains_with_each_image_encoded_once_per_group(capsys):
    """docs/guide/vlm.md's example (tests/test_docs.py runs it, above the same floors as this module): the fractions
    it prints are what its comment says."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "guide" / "vlm.md").read_text()
    code = re.search(r"<!-- docs-test: floor [\w ]+ -->\n```python\n(.*?)```", page, re.DOTALL).group(1)
    exec(compile(code, "docs/guide/vlm.md", "exec"), {})
    assert capsys.readouterr().out.strip().splitlines()[-1] == "0.25 0.25"


# ---- grpo-plus fit and the trainer's fit check on a VLM ------------------------------------------------------------


# For the tests of the count against real compute, of the tower's depth and of M-RoPE positions, not of G or of a
# picture's size: two groups of two, one 112 x 56 picture per prompt (two attention windows). The tower attends window
# by window and picture by picture, so a count's operators grow with the pictures it encodes (TRL's pass: one a row)
# and their windows: the tower test's six counts take 8 s of CPU so, 10 s with square pictures, 14 s at 8 rows in
# groups of 4 (measured).
SMALL_VLM_COUNT = dict(rows=4, group=2, image_size=(112, 56))


def vlm_fit_spec(image_size: int | tuple[int, int] = 112, rows: int = 8, group: int = 4, **changes):
    """The fit spec of the tiny Qwen2.5-VL (two text layers, a two-block vision tower), `rows` rows in groups of
    `group`, one `image_size` picture per prompt (112 x 112: 64 vision patches in four attention windows, 16 image
    tokens; 112 x 56: 32 patches in two windows, 8 tokens), LoRA on the attention projections."""
    from grpo_plus import fit

    model, _ = make_vlm("qwen2_5_vl")
    args = grpo_plus.GRPOConfig(**tiny_run_kwargs("unused", per_device_train_batch_size=rows, num_generations=group,
                                                  max_completion_length=16, bf16=False))  # fmt: skip
    lora = fit.lora_fields(4, 8, 0.0, ["q_proj", "k_proj", "v_proj", "o_proj"])
    spec = fit.FitSpec.from_config(args, model.config, torch.float32, lora, False, prompt_tokens=12)
    height, width = image_size if isinstance(image_size, tuple) else (image_size, image_size)
    spec = spec.replace(mixed_precision="no", images_per_prompt=1, image_size=(height, width))
    return spec.replace(**changes)


@pytest.mark.parametrize("side", ["trl", "grpo_plus"])
def test_the_fit_count_of_a_vlm_equals_real_compute(side):
    """The training pass of a Qwen2.5-VL micro-batch with its pictures (the vision tower, the image tokens), counted
    on fake tensors, allocates what the same pass computed for real on the CPU allocates (eager attention in both
    towers: sdpa's kernels differ between a CPU and the GPU the count stands for), but for the vision tower's window
    index: transformers builds it on the CPU (host memory on a GPU, device memory in a CPU run), a few int64 per
    image token of the pass."""
    from grpo_plus import fit

    spec = vlm_fit_spec(attn_implementation="eager", **SMALL_VLM_COUNT)
    real = fit.measure_pass(spec, side, layers=2, real=True, lm_head="cpu")
    fake = fit.measure_pass(spec, side, layers=2, lm_head="cpu")
    encoded = spec.rows if side == "trl" else spec.rows // spec.num_generations  # pictures in the pass
    window_index = 4 * encoded * spec.image_tokens * 8
    for name in ("saved", "after_forward", "forward_peak", "peak"):
        assert 0 <= getattr(real, name) - getattr(fake, name) <= window_index, name
    assert fake.peak > 1000 * window_index


@pytest.mark.parametrize("side", ["trl", "grpo_plus"])
def test_m_rope_positions_counted_on_values_count_what_the_fake_operators_count(side, monkeypatch):
    """Qwen-VL's `get_rope_index` (a Python loop over rows) run on the ids' values in a fake count: the pass's counts
    are those of running it operator by operator on fake tensors, byte for byte, and it did run on values (its (3, rows,
    length) positions put on the device as counted tensors)."""
    from grpo_plus import fit
    from grpo_plus.fit import memory

    spec = vlm_fit_spec(**SMALL_VLM_COUNT)
    fields = ("saved", "after_forward", "forward_peak", "peak", "after_backward", "host_peak", "items_faked")
    placed, counted_on_device = [], memory._counted_on_device
    monkeypatch.setattr(
        memory, "_counted_on_device", lambda *args: placed.append(args[1].shape) or counted_on_device(*args)
    )
    on_values = fit.measure_pass(spec, side, layers=2)
    assert any(len(shape) == 3 and shape[0] == 3 for shape in placed), placed
    placed.clear()
    monkeypatch.setattr(fit.count, "_rope_index_on_values", lambda model, counter: None)
    operators = fit.measure_pass(spec, side, layers=2)
    assert not any(len(shape) == 3 and shape[0] == 3 for shape in placed)
    assert {name: getattr(on_values, name) for name in fields} == {name: getattr(operators, name) for name in fields}


class TowerLog:
    """Vision patches the counted models' vision towers encode (every model `build_policy` makes)."""

    def __init__(self, monkeypatch):
        from grpo_plus import fit

        self.patches = 0
        build = fit.count.build_policy

        def logged(*args, **kwargs):
            model = build(*args, **kwargs)
            vision_tower(model).register_forward_pre_hook(self._record, with_kwargs=True)
            return model

        monkeypatch.setattr(fit.count, "build_policy", logged)

    def _record(self, module, args, kwargs):
        self.patches += (args[0] if args else kwargs["hidden_states"]).shape[0]


@pytest.mark.engine  # a heavy memory count (moved out of make test: its 10-minute budget)
def test_the_fit_of_a_vlm_counts_its_pictures_once_per_group_for_grpo_plus_and_per_row_for_trl(monkeypatch):
    """The fit of a VLM counts more than the same model without pictures (training pass and generation, both sides);
    TRL's vision tower encodes each picture G times (every row), grpo_plus's once per group, in the training pass
    and in generation; the pictures' share of the training pass's saved activations follows: G times grpo_plus's
    for TRL, within the last group's padding. Counted within `remembered_counts` (as a report counts): the estimates
    at the end reuse the one-layer counts above (every count of the loop is a first: each side's and spec's own)."""
    from grpo_plus import fit

    spec, patches = vlm_fit_spec(), 64
    text_only = spec.replace(images_per_prompt=0, image_size=(0, 0))
    tower = TowerLog(monkeypatch)
    groups = spec.rows // spec.num_generations
    encoded, saved = {}, {}
    with fit.count.remembered_counts():
        for side in fit.SIDES:
            tower.patches = 0
            with_pictures = fit.measure_pass(spec, side, layers=1)
            encoded[side] = tower.patches
            without = fit.measure_pass(text_only, side, layers=1)
            assert with_pictures.peak > without.peak
            saved[side] = with_pictures.saved - without.saved
            tower.patches = 0
            counted = fit.measure_generation(fit.for_side(spec, side), layers=1)
            assert tower.patches == (spec.generation_rows if side == "trl" else groups) * patches
            plain = fit.measure_generation(fit.for_side(text_only, side), layers=1)
            assert all(a > b for a, b in zip(counted, plain, strict=True))
        assert encoded == {"trl": spec.rows * patches, "grpo_plus": groups * patches}
        assert saved["trl"] == pytest.approx(spec.num_generations * saved["grpo_plus"], rel=5e-3)  # counted: 1.2e-3
        assert fit.estimate(spec, "grpo_plus").total > fit.estimate(text_only, "grpo_plus").total


@pytest.mark.parametrize("full_blocks", [[2, 5], [1, 3], [], list(range(6))], ids=["ends-full", "ends-windowed",
                                                                                  "windowed", "full"])  # fmt: skip
@pytest.mark.engine  # a heavy memory count (moved out of make test: its 10-minute budget)
def test_the_training_pass_counts_the_vision_tower_at_two_and_three_blocks_as_at_its_depth(full_blocks):
    """A 6-block vision tower (windowed and full attention blocks in several orders) counted at 2 and 3 blocks and
    extended to 6 counts what the whole tower counts, to the byte, on both sides (every block keeps its input for
    backward; the peak's candidates all hold every block's input)."""
    from grpo_plus import fit

    spec = vlm_fit_spec(**SMALL_VLM_COUNT)
    config = dict(spec.model_config)
    config["vision_config"] = {**config["vision_config"], "depth": 6, "fullatt_block_indexes": full_blocks}
    spec = spec.replace(model_config=config)
    for side in fit.SIDES:
        whole = fit.measure_pass(spec, side, layers=1)
        blocks = [fit.measure_pass(spec, side, layers=1, vision_blocks=n) for n in fit.count.TRAINING_VISION_BLOCKS]
        assert fit.extrapolate(blocks, 6, start=fit.count.TRAINING_VISION_BLOCKS[0]) == whole
        assert blocks[1].saved > blocks[0].saved  # the tower's blocks keep their inputs: the depth counts


@pytest.mark.engine  # a heavy memory count (moved out of make test: its 10-minute budget)
def test_generation_counts_the_vision_tower_at_two_blocks_as_at_its_depth(monkeypatch):
    """Without gradients a vision block's output replaces its input: generation counted with two vision blocks (one
    windowed, one full) counts what the whole tower (here 6 blocks, two of them full) counts, on both sides."""
    from grpo_plus import fit

    spec = vlm_fit_spec()
    config = dict(spec.model_config)
    config["vision_config"] = {**config["vision_config"], "depth": 6, "fullatt_block_indexes": [2, 5]}
    spec = spec.replace(model_config=config)
    for side in fit.SIDES:
        two = fit.measure_generation(fit.for_side(spec, side), layers=1)
        monkeypatch.setattr(fit.count, "GENERATION_VISION_BLOCKS", 6)
        whole = fit.measure_generation(fit.for_side(spec, side), layers=1)
        monkeypatch.setattr(fit.count, "GENERATION_VISION_BLOCKS", 2)
        assert two == whole


def test_the_vlm_recipe_becomes_a_fit_spec_with_its_pictures():
    """The Qwen2.5-VL-3B recipe is counted offline (a built-in shape): 36 layers, a 32-block vision tower, one
    448 x 448 picture per prompt (its image_max_pixels), 256 image tokens in each prompt; flags override them."""
    from pathlib import Path

    from grpo_plus.app.cli import fit_spec_from_yaml

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "configs" / "qwen2.5-vl-3b_qlora.yaml"
    spec = fit_spec_from_yaml(recipe, prompt_tokens=64)
    assert (spec.layers, spec.config().vision_config.depth, spec.four_bit, spec.rows) == (36, 32, True, 8)
    assert (spec.images_per_prompt, spec.image_size, spec.image_grid, spec.image_tokens) == (1, (448, 448), (32, 32),
                                                                                             256)  # fmt: skip
    assert spec.prompt_length == 64 + 255
    larger = fit_spec_from_yaml(recipe, prompt_tokens=64, images_per_prompt=2, image_size=896)
    assert (larger.images_per_prompt, larger.image_size) == (2, (448, 448))  # image_max_pixels still binds
    with pytest.raises(ValueError, match="need a vision-language model"):
        fit_spec_from_yaml(recipe.parent / "demo_cpu.yaml", prompt_tokens=64, images_per_prompt=1)


@pytest.mark.timeout(1200)  # counts a VLM's pass in child processes: 223 s on 2 loaded cores before it got cheaper
@pytest.mark.engine  # its work is in child processes it starts (the fit check's count, 31 s): make test-engines
def test_the_trainers_fit_check_counts_a_vlm_with_its_datasets_pictures(caplog, monkeypatch):
    """The trainer's fit check on a Qwen2.5-VL counts it (in its child process) with the pictures its dataset holds,
    as the processor resizes them, and raises when they do not fit: no "cannot be counted" line."""
    from grpo_plus import fit

    model, processor = make_vlm("qwen2_5_vl", image_size=112)
    args = grpo_plus.GRPOConfig(**tiny_run_kwargs("unused"))
    budget = {"bytes": 8 * fit.GIB}
    monkeypatch.setattr(fit.check, "device_budget", lambda device: (budget["bytes"], 0))
    with caplog.at_level(logging.INFO, logger="grpo_plus.fit"):
        counted = fit.check_before_training(args, model, image_dataset(2, image_size=112), processor,
                                            torch.device("cpu"), mode="error")  # fmt: skip
    assert not any("cannot be counted" in record.getMessage() for record in caplog.records)
    assert (counted.spec.images_per_prompt, counted.spec.image_size, counted.spec.image_tokens) == (1, (112, 112), 16)
    chat = processor.tokenizer.apply_chat_template(image_dataset(1)[0]["prompt"], add_generation_prompt=True)
    assert counted.spec.prompt_tokens == len(chat["input_ids"])  # one placeholder per picture, as the template writes
    assert counted.spec.prompt_length == counted.spec.prompt_tokens + 15
    assert counted.total > 0
    # Just under what the step needs with the fragmentation margin: the child's search for settings that would fit
    # ends at its first answer (half the rows: 0.8x, measured) instead of counting every fix of a budget none meets.
    budget["bytes"] = counted.total
    with pytest.raises(fit.FitCheckError, match="worst step.*Settings that would fit: "):
        fit.check_before_training(args, model, image_dataset(2, image_size=112), processor, torch.device("cpu"),
                                  mode="error")  # fmt: skip


def test_the_fit_check_says_which_vlm_families_it_cannot_count(caplog):
    """A family whose vision tower the count does not run (Gemma 3's SigLIP) is not counted as its language model
    alone: the check says why once and lets training go on."""
    from grpo_plus.fit import check_before_training

    model, processor = make_vlm("gemma3")
    args = grpo_plus.GRPOConfig(**tiny_run_kwargs("unused"))
    with caplog.at_level(logging.WARNING, logger="grpo_plus.fit"):
        result = check_before_training(args, model, image_dataset(2), processor, torch.device("cpu"), mode="error")
    assert result is None
    assert any("model_type='gemma3'" in record.getMessage() and "cannot be counted" in record.getMessage()
               for record in caplog.records)  # fmt: skip


def test_dynamic_sampling_on_image_prompts_fails_when_the_trainer_is_built():
    """Dynamic sampling cannot stitch refill rounds of image batches: the trainer says so when it is built, naming
    the dataset's image column and what to do, instead of at the first training step."""
    from grpo_plus.settings import ConfigError

    model, processor = make_vlm("qwen2_5_vl")
    args = grpo_plus.GRPOConfig(**tiny_run_kwargs("unused", per_device_train_batch_size=4, num_generations=2,
                                                  dynamic_sampling=True))  # fmt: skip
    with pytest.raises(ConfigError, match=r"dynamic_sampling=True does not support image prompts.*'image' column.*"
                       r"Set dynamic_sampling=False"):  # fmt: skip
        grpo_plus.GRPOTrainer(model=model, processing_class=processor, reward_funcs=distinct_characters_reward,
                              args=args, train_dataset=image_dataset(4))  # fmt: skip
