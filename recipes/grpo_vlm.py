"""GRPO on a vision-language model (Qwen2-VL / Qwen2.5-VL, Gemma 3, Idefics3, LLaVA, ...) with a LoRA adapter, its
base in 4 bits (nf4, QLoRA) with `load_in_4bit: true` or as is.

    # Qwen2.5-VL-3B, 4-bit base + LoRA on the language model, on one 24 GB GPU
    accelerate launch --config_file recipes/accelerate_configs/single_gpu.yaml recipes/grpo_vlm.py \
        --config recipes/configs/qwen2.5-vl-3b_qlora.yaml

The built-in task (`task_level: count-shapes`) asks how many shapes a generated picture holds; your own dataset
(`dataset_name`) needs TRL's layout: a conversational "prompt" with image placeholders and the pictures in an "image"
(or "images") column. Every GRPOConfig field (grpo_plus's and TRL's) and every TRL ModelConfig field is a flag and a
YAML key. Qwen-VL processors need torchvision in transformers 5; without it the recipe builds the same processor
without its video part (grpo_plus.app.vlm.load_processor). No held-out evaluation: the arithmetic recipes' greedy
evaluation reads text prompts only.
"""

# grpo_plus first: trl imports peft, peft imports bitsandbytes, and grpo_plus keeps bitsandbytes' import-time
# notice about an optional Hub kernel out of the console (grpo_plus.compat.bitsandbytes).
from grpo_plus import GRPOTrainer
from grpo_plus.app.recipe import (
    build_trainer,
    fail,
    finish_run,
    four_bit_loading,
    load_data_and_rewards,
    parse_recipe_args,
    prepare_four_bit,
    prepare_hub_push,
)
from grpo_plus.app.vlm import load_processor

# isort: split
import torch
from transformers import AutoModelForImageTextToText


def main(argv=None):
    script_args, training_args, model_args = parse_recipe_args(argv, four_bit=True)

    # 1. Fail fast: a missing token or a repo we cannot write to costs seconds here, not after hours of training.
    hub_repo_id = prepare_hub_push(training_args)

    # 2. Policy: the base (quantized to 4 bits with --load_in_4bit, else in its dtype), frozen; LoRA on top.
    model_path = model_args.model_name_or_path
    try:
        processor = load_processor(model_path, model_args.model_revision, script_args.image_max_pixels)
    except (OSError, ValueError, ImportError) as error:
        fail(f"cannot load the processor of {model_path!r}: {error}")
    if model_args.load_in_4bit:
        loading = four_bit_loading(model_args, training_args)
    else:
        loading = dict(
            dtype=model_args.dtype if model_args.dtype in ("auto", None) else getattr(torch, model_args.dtype)
        )
    try:
        model = AutoModelForImageTextToText.from_pretrained(
            model_path,
            revision=model_args.model_revision,
            attn_implementation=model_args.attn_implementation,
            trust_remote_code=training_args.trust_remote_code,
            **loading,
        )
    except (OSError, ValueError) as error:
        fail(f"cannot load model {model_path!r}: {error}")
    if model_args.load_in_4bit:
        model = prepare_four_bit(model, training_args)

    # 3. Data (pictures and questions) and verifiable rewards.
    train_dataset, _, reward_funcs = load_data_and_rewards(script_args)

    # 4. Train. The trainer is built (checking the dataset, the LoRA target modules and any checkpoint to resume
    #    from) before training, so bad input fails in seconds.
    trainer, resume_from_checkpoint = build_trainer(
        GRPOTrainer, model, processor, reward_funcs, train_dataset, training_args, model_args
    )
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)  # a PEFT model saves only the adapter

    # 5. Report, model card, reward plot; push the adapter and merge if asked.
    finish_run(trainer, script_args, model_path, None, None, hub_repo_id)


if __name__ == "__main__":
    main()
