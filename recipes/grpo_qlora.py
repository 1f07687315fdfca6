"""GRPO + QLoRA: a 4-bit (nf4) frozen base with a LoRA adapter, on one GPU (or CPU, slowly).

    # a 7B model on one 24 GB GPU, pushing the adapter to the Hub
    accelerate launch --config_file recipes/accelerate_configs/single_gpu.yaml recipes/grpo_qlora.py \
        --config recipes/configs/qwen2.5-7b_qlora.yaml --push_to_hub --hub_model_id you/qwen7b-grpo-qlora
    # the embedded model, 4-bit on CPU (bitsandbytes quantizes on CPU too)
    python recipes/grpo_qlora.py --config recipes/configs/demo_cpu.yaml --max_steps 5

Every GRPOConfig field (grpo_plus's and TRL's) and every TRL ModelConfig field is a flag and a YAML key.
"""

# grpo_plus first: trl imports peft, peft imports bitsandbytes, and grpo_plus keeps bitsandbytes' import-time
# notice about an optional Hub kernel out of the console (grpo_plus.quantization).
from grpo_plus import GRPOTrainer
from grpo_plus.app.recipe import (
    check_before_training,
    evaluate_held_out,
    exit_on_bad_input,
    finish_run,
    load_data_and_rewards,
    load_tokenizer,
    parse_recipe_args,
    prepare_hub_push,
)
from grpo_plus.quantization import keep_4bit_trainable_on_cpu

# isort: split
import os

import torch
from accelerate import PartialState
from peft import prepare_model_for_kbit_training
from transformers import AutoModelForCausalLM, BitsAndBytesConfig
from transformers.integrations import is_deepspeed_zero3_enabled
from trl import get_peft_config


def main(argv=None):
    script_args, training_args, model_args = parse_recipe_args(argv, four_bit=True)

    # 1. Fail fast: a missing token or a repo we cannot write to costs seconds here, not after hours of training.
    hub_repo_id = prepare_hub_push(training_args)

    # 2. Policy: the base quantized to 4-bit nf4 or fp4 (bf16 compute on GPU), frozen; LoRA on top. TRL's ModelConfig
    #    flags mean what they mean in TRL's scripts: double quantization only with --use_bnb_nested_quant.
    model_path, tokenizer = load_tokenizer(model_args)
    on_gpu = torch.cuda.is_available() and not training_args.use_cpu
    compute_dtype = torch.bfloat16 if on_gpu else torch.float32
    # ZeRO-3 / FSDP shard every weight: the 4-bit ones must be stored in the other parameters' dtype, and placing the
    # model on a device is the engine's job.
    sharded = is_deepspeed_zero3_enabled() or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    quantization_config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=model_args.bnb_4bit_quant_type,  # nf4 unless --bnb_4bit_quant_type fp4
        bnb_4bit_use_double_quant=model_args.use_bnb_nested_quant,  # the 7B config sets it
        bnb_4bit_compute_dtype=compute_dtype,
        bnb_4bit_quant_storage=model_args.bnb_4bit_quant_storage or (compute_dtype if sharded else "uint8"),
    )
    model = AutoModelForCausalLM.from_pretrained(
        model_path,
        revision=model_args.model_revision,
        dtype=compute_dtype,
        quantization_config=quantization_config,
        device_map={"": PartialState().local_process_index} if on_gpu and not sharded else None,  # a GPU per rank
        attn_implementation=model_args.attn_implementation,
        trust_remote_code=training_args.trust_remote_code,
    )
    # Casts norms to fp32 and makes inputs require grads, so gradient checkpointing works through a frozen base.
    model = prepare_model_for_kbit_training(
        model,
        use_gradient_checkpointing=training_args.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False},
    )
    keep_4bit_trainable_on_cpu(model)  # CPU only: stops bitsandbytes repacking 4-bit weights into a no-grad layout

    # 3. Data and verifiable rewards.
    train_dataset, test_dataset, reward_funcs = load_data_and_rewards(script_args)

    # 4. Train, measuring held-out accuracy before and after. The trainer is built (checking the dataset, the LoRA
    #    target modules and any checkpoint to resume from) before the evaluation, so bad input fails in seconds.
    with exit_on_bad_input():
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward_funcs,
            args=training_args,
            train_dataset=train_dataset,
            processing_class=tokenizer,
            peft_config=get_peft_config(model_args),
        )
    resume_from_checkpoint = check_before_training(trainer, training_args, model_args)
    before = evaluate_held_out(trainer.model, tokenizer, test_dataset, script_args, "before")  # LoRA B = 0: the base
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)  # a PEFT model saves only the adapter
    after = evaluate_held_out(trainer.model, tokenizer, test_dataset, script_args, "after", trainer)

    # 5. Report, model card, reward plot; push the adapter and merge if asked.
    finish_run(trainer, script_args, model_path, before, after, hub_repo_id)


if __name__ == "__main__":
    main()
