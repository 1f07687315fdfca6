"""Every TRL / transformers / bitsandbytes / torch version fact grpo_plus depends on, one module per seam.

grpo_plus overrides or calls private `trl.GRPOTrainer` methods, which TRL may change in any release. A new difference
between versions belongs in the seam it touches, as one small function or constant, so a helper TRL moves or renames
is one edit: `versions` (tested minors, floors, the hooked methods), `model` (how TRL calls the model), `loss` (TRL's
objective and its sampler correction), `lm_head` (TRL's fused LM head), `rewards` (how TRL calls reward functions),
`moe` (transformers' mixture-of-experts models: expert counts, router logits, experts resumed from a checkpoint), `vllm`
(TRL's vLLM generation), `bitsandbytes` (4-bit layers on a CPU), `torch` (the private torch APIs the fit count stands
on), `common` (what the seams share).
"""
