"""GRPO + LoRA on one GPU, or a laptop CPU, with grpo_plus's objective.

    # the embedded CPU demo (offline, < 10 min on 2 cores): what `make demo` runs
    python recipes/grpo_lora.py --config recipes/configs/demo_cpu.yaml
    # a real run on one 24 GB GPU, pushing the adapter to the Hub
    accelerate launch --config_file recipes/accelerate_configs/single_gpu.yaml recipes/grpo_lora.py \
        --config recipes/configs/qwen2.5-1.5b_lora.yaml --push_to_hub --hub_model_id you/qwen-grpo-lora

Every GRPOConfig field (grpo_plus's and TRL's) and every TRL ModelConfig field is a flag and a YAML key.
"""

# grpo_plus first: trl imports peft, peft imports bitsandbytes, and grpo_plus keeps bitsandbytes' import-time
# notice about an optional Hub kernel out of the console (grpo_plus.compat.bitsandbytes).
from grpo_plus import GRPOTrainer
from grpo_plus.app.recipe import (
    build_trainer,
    evaluate_held_out,
    finish_run,
    load_data_and_rewards,
    load_tokenizer,
    parse_recipe_args,
    prepare_hub_push,
)

# isort: split
import torch
from transformers import AutoModelForCausalLM


def main(argv=None):
    script_args, training_args, model_args = parse_recipe_args(argv)

    # 1. Fail fast: a missing token or a repo we cannot write to costs seconds here, not after hours of training.
    hub_repo_id = prepare_hub_push(training_args)

    # 2. Policy: the base model in full or half precision, with a fresh LoRA adapter (peft_config below).
    model_path, tokenizer = load_tokenizer(model_args)
    dtype = model_args.dtype if model_args.dtype in ("auto", None) else getattr(torch, model_args.dtype)
    model = AutoModelForCausalLM.from_pretrained(
        model_path,
        revision=model_args.model_revision,
        dtype=dtype,
        attn_implementation=model_args.attn_implementation,
        trust_remote_code=training_args.trust_remote_code,
    )

    # 3. Data and verifiable rewards.
    train_dataset, test_dataset, reward_funcs = load_data_and_rewards(script_args)

    # 4. Train, measuring held-out accuracy before and after. The trainer is built (checking the dataset, the LoRA
    #    target modules and any checkpoint to resume from) before the evaluation, so bad input fails in seconds.
    trainer, resume_from_checkpoint = build_trainer(
        GRPOTrainer, model, tokenizer, reward_funcs, train_dataset, training_args, model_args
    )
    before = evaluate_held_out(trainer.model, tokenizer, test_dataset, script_args, "before")  # LoRA B = 0: the base
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)  # a PEFT model saves only the adapter
    after = evaluate_held_out(trainer.model, tokenizer, test_dataset, script_args, "after", trainer)

    # 5. Report, model card, reward plot; push the adapter and merge if asked.
    finish_run(trainer, script_args, model_path, before, after, hub_repo_id)


if __name__ == "__main__":
    main()
