"""GRPO + QLoRA: a 4-bit (nf4) frozen base with a LoRA adapter, on one GPU (or CPU, slowly).

    # a 7B model on one 24 GB GPU, pushing the adapter to the Hub
    accelerate launch --config_file recipes/accelerate_configs/single_gpu.yaml recipes/grpo_qlora.py \
        --config recipes/configs/qwen2.5-7b_qlora.yaml --push_to_hub --hub_model_id you/qwen7b-grpo-qlora
    # the embedded model, 4-bit on CPU (bitsandbytes quantizes on CPU too)
    python recipes/grpo_qlora.py --config recipes/configs/demo_cpu.yaml --max_steps 5

Every GRPOConfig field (grpo_plus's and TRL's) and every TRL ModelConfig field is a flag and a YAML key.
"""

# grpo_plus first: trl imports peft, peft imports bitsandbytes, and grpo_plus keeps bitsandbytes' import-time
# notice about an optional Hub kernel out of the console (grpo_plus.compat.bitsandbytes).
from grpo_plus import GRPOTrainer
from grpo_plus.app.recipe import (
    build_trainer,
    evaluate_held_out,
    finish_run,
    four_bit_loading,
    load_data_and_rewards,
    load_tokenizer,
    parse_recipe_args,
    prepare_four_bit,
    prepare_hub_push,
)

# isort: split
from transformers import AutoModelForCausalLM


def main(argv=None):
    script_args, training_args, model_args = parse_recipe_args(argv, four_bit=True)

    # 1. Fail fast: a missing token or a repo we cannot write to costs seconds here, not after hours of training.
    hub_repo_id = prepare_hub_push(training_args)

    # 2. Policy: the base quantized to 4-bit nf4 or fp4 (bf16 compute on GPU), frozen; LoRA on top. TRL's ModelConfig
    #    flags mean what they mean in TRL's scripts: double quantization only with --use_bnb_nested_quant.
    model_path, tokenizer = load_tokenizer(model_args)
    model = AutoModelForCausalLM.from_pretrained(
        model_path,
        revision=model_args.model_revision,
        attn_implementation=model_args.attn_implementation,
        trust_remote_code=training_args.trust_remote_code,
        **four_bit_loading(model_args, training_args),
    )
    model = prepare_four_bit(model, training_args)

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
