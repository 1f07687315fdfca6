"""Small, local building blocks that the test suite and the benchmarks both run on: a character-level tokenizer, tiny
random models, a prompt dataset and the GRPOConfig settings of a seconds-long CPU run, two reward functions, a counter
of the token positions a model computes, and a stand-in trainer on which TRL's own `_compute_loss` runs on given
tensors. Nothing is downloaded. It lives in the package (like `transformers.testing_utils`) so that `benchmarks/` can
import it without editing `sys.path`.
"""

from __future__ import annotations

import gc
import math
import string
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import torch
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPTNeoXConfig,
    GptOssConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    OlmoeConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)
from trl import GRPOTrainer

__all__ = [
    "ForwardLog",
    "StandInAccelerator",
    "StandInTrainer",
    "digit_reward",
    "length_reward",
    "make_model",
    "make_tokenizer",
    "MOE_FAMILIES",
    "prompt_dataset",
    "save_tiny_model",
    "text_of",
    "tiny_config",
    "tiny_run_kwargs",
    "word_level_tokenizer",
]

# ---- tiny models, tokenizer, data and run settings -----------------------------------------------------------------

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>"]
CHARS = string.ascii_letters + string.digits + " .,:;!?+-*/=()<>'\"#\n"
CHAT_TEMPLATE = (
    "{% for message in messages %}<{{ message['role'][0] }}>{{ message['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<a>{% endif %}"
)


def word_level_tokenizer(vocab: dict[str, int], pre_tokenizer, decoder=None, **kwargs) -> PreTrainedTokenizerFast:
    """A tokenizer mapping each piece `pre_tokenizer` cuts to its id in `vocab` (which holds <pad>, <eos>, <bos>;
    anything else becomes <pad>). `kwargs` go to PreTrainedTokenizerFast (e.g. `extra_special_tokens`)."""
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizer
    if decoder is not None:
        backend.decoder = decoder
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<pad>",
        # What causal-LM tokenizers declare; transformers 4.x would otherwise add token_type_ids, which generate rejects.
        model_input_names=["input_ids", "attention_mask"],
        **kwargs,
    )


def make_tokenizer(**kwargs) -> PreTrainedTokenizerFast:
    """A character-level tokenizer with pad/eos/bos and a minimal chat template (`kwargs`: see
    `word_level_tokenizer`)."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + list(dict.fromkeys(CHARS)))}
    split = pre_tokenizers.Split(pattern="", behavior="isolated")
    tokenizer = word_level_tokenizer(vocab, split, decoders.Fuse(), **kwargs)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_model(
    tokenizer: PreTrainedTokenizerFast, seed: int = 0, hidden_size: int = 32, layers: int = 2, tied: bool = False
):
    """A randomly initialised Llama small enough to train in milliseconds (`tied`: one matrix for the input embedding
    and the LM head, as SmolLM2, Qwen2.5-0.5B to 3B and Llama-3.2 have)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=tied,
    )
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


# Mixture-of-experts families transformers has, as tiny test models: 4 experts, 2 routed per token.
MOE_FAMILIES = ("qwen3_moe", "olmoe", "mixtral", "gpt_oss")


def tiny_config(family: str, vocab_size: int, **overrides):
    """A two-layer model of `family` (llama, mistral, qwen2, qwen3: rotary positions; gpt2: learned absolute ones;
    the mixture-of-experts `MOE_FAMILIES`: 4 experts of width 16, top 2, each family's own router aux-loss
    coefficient, `output_router_logits` False, as the released configs declare them)."""
    common = dict(vocab_size=vocab_size, tie_word_embeddings=False, pad_token_id=0)
    if family == "gpt2":
        no_dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, **no_dropout, **common, **overrides)
    classes = {
        "llama": LlamaConfig,
        "mistral": MistralConfig,
        "qwen2": Qwen2Config,
        "qwen3": Qwen3Config,
        "gpt_neox": GPTNeoXConfig,  # not a checked family: its forward is not proven to take a block mask as given
        "qwen3_moe": Qwen3MoeConfig,
        "olmoe": OlmoeConfig,
        "mixtral": MixtralConfig,
        "gpt_oss": GptOssConfig,
    }
    sizes = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    if family in MOE_FAMILIES:
        experts = "num_experts" if family in ("qwen3_moe", "olmoe") else "num_local_experts"
        sizes |= {experts: 4, "num_experts_per_tok": 2, "intermediate_size": 16}
        if family == "qwen3_moe":
            sizes |= dict(moe_intermediate_size=16, head_dim=8)
        if family == "olmoe":  # its config defaults to OLMoE-1B-7B's token ids, outside a tiny vocabulary
            sizes |= dict(eos_token_id=None, bos_token_id=None)
        if family == "gpt_oss":  # one sliding-window layer (wider than any test sequence), one full; no YaRN scaling
            sizes |= dict(
                head_dim=8, layer_types=["sliding_attention", "full_attention"], sliding_window=64,
                rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
            )  # fmt: skip
    return classes[family](**{**sizes, "max_position_embeddings": 64, **overrides}, **common)


def save_tiny_model(path: str | Path, seed: int = 0, family: str | None = None, **kwargs) -> Path:
    """Write a tiny model + tokenizer to `path`, loadable by `from_pretrained(path)`: `make_model`'s Llama, or with
    `family` a `tiny_config` model of that family (`kwargs`: its config overrides)."""
    path = Path(path)
    tokenizer = make_tokenizer()
    if family is None:
        model = make_model(tokenizer, seed=seed, **kwargs)
    else:
        torch.manual_seed(seed)
        config = tiny_config(family, len(tokenizer), **kwargs)
        config.eos_token_id, config.bos_token_id = tokenizer.eos_token_id, tokenizer.bos_token_id
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def load_with_base(path: str | Path, base: str):
    """The causal LM saved in `path` with its weights in `base`: "float32", "bfloat16", or "nf4" (bitsandbytes 4-bit
    NormalFloat, computing in float32): the bases a LoRA / QLoRA sync is tested and measured on."""
    if base == "nf4":
        from transformers import BitsAndBytesConfig

        quantization = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
        )
        return AutoModelForCausalLM.from_pretrained(path, quantization_config=quantization, dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, base))


def prompt_dataset(num_prompts: int = 8, conversational: bool = False) -> Dataset:
    """Short prompts with an integer `answer` column."""
    rows = []
    for i in range(num_prompts):
        a, b = i % 5 + 1, (3 * i) % 4 + 1
        text = f"{a}+{b}="
        prompt = [{"role": "user", "content": text}] if conversational else text
        rows.append({"prompt": prompt, "answer": a + b})
    return Dataset.from_list(rows)


def tiny_run_kwargs(output_dir, **overrides) -> dict:
    """GRPOConfig kwargs for a seconds-long CPU run on the tiny model."""
    kwargs = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=2,
        learning_rate=0.05,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=0,
        use_cpu=True,
        bf16=False,
        disable_tqdm=True,
    )
    kwargs.update(overrides)
    return kwargs


# ---- rewards ---------------------------------------------------------------------------------------------------------


def text_of(message) -> str:
    """A prompt or completion as text (standard: the string; conversational: the last message's content)."""
    return message if isinstance(message, str) else message[-1]["content"]


def length_reward(completions, **kwargs) -> list[float]:
    """Longer completions score higher, with ties: some groups have zero variance, others do not."""
    return [float(min(len(text_of(c)), 8) // 4) for c in completions]


def digit_reward(completions, **kwargs) -> list[float]:
    """Fraction of characters that are digits."""
    texts = [text_of(c) for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in texts]


# ---- what a run computed, and TRL's loss on given tensors ------------------------------------------------------------


class ForwardLog:
    """Records what every call of a model's backbone received (generation, no-grad passes and training forwards)."""

    def __init__(self, model):
        self.calls: list[dict] = []
        backbone = model.get_base_model() if hasattr(model, "get_base_model") else model
        backbone.base_model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask")
        self.calls.append(
            {
                "shape": tuple(input_ids.shape),
                "mask_dims": None if mask is None else mask.dim(),
                "grad": torch.is_grad_enabled(),
            }
        )

    @property
    def positions(self) -> int:
        """Token positions computed over all recorded calls."""
        return sum(math.prod(call["shape"]) for call in self.calls)

    @property
    def training_positions(self) -> int:
        """Token positions of the forwards that carried gradient (the training pass)."""
        return sum(math.prod(call["shape"]) for call in self.calls if call["grad"])

    def clear(self) -> None:
        self.calls.clear()


class StandInAccelerator:
    num_processes = 1
    sync_gradients = True

    @staticmethod
    def reduce(x, reduction="sum"):
        return x

    @staticmethod
    def gather(x):
        return x

    gather_for_metrics = gather

    @staticmethod
    def pad_across_processes(x, dim=0, pad_index=0):
        return x


class StandInTrainer:
    """Just the attributes TRL's `GRPOTrainer._compute_loss` reads, its model "forward" returning the given log-probs:
    `trl.GRPOTrainer._compute_loss(StandInTrainer(logps, **settings), None, inputs)` is TRL's own loss on those tensors."""

    get_off_policy_mask = staticmethod(GRPOTrainer.get_off_policy_mask)
    get_high_entropy_mask = GRPOTrainer.get_high_entropy_mask

    def __init__(self, logps, entropies=None, **settings):
        self._logps = logps
        self._entropies = torch.zeros_like(logps.detach()) if entropies is None else entropies
        self.loss_type = settings.get("loss_type", "dapo")
        self.importance_sampling_level = settings.get("importance_sampling_level", "token")
        self.epsilon_low = settings.get("epsilon", 0.2)
        eps_high = settings.get("epsilon_high")
        self.epsilon_high = self.epsilon_low if eps_high is None else eps_high
        self.beta = settings.get("beta", 0.0)
        self.max_completion_length = settings.get("max_completion_length")
        self.current_gradient_accumulation_steps = settings.get("gradient_accumulation_steps", 1)
        self.top_entropy_quantile = settings.get("top_entropy_quantile", 1.0)
        self.off_policy_mask_threshold = settings.get("off_policy_mask_threshold")
        self.use_vllm = False
        self.vllm_importance_sampling_correction = False
        self.aux_loss_enabled = False
        self._entropy_bonus_enabled = False
        self.accelerator = StandInAccelerator()
        self.accelerator.num_processes = settings.get("num_processes", 1)
        self.model = SimpleNamespace(training=settings.get("training", True))
        self.args = SimpleNamespace(
            delta=settings.get("delta"),
            use_bias_correction_kl=settings.get("use_bias_correction_kl", True),
            steps_per_generation=settings.get("steps_per_generation", settings.get("gradient_accumulation_steps", 1)),
            sapo_temperature_pos=settings.get("sapo_temperature_pos", 1.0),
            sapo_temperature_neg=settings.get("sapo_temperature_neg", 1.05),
        )
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        return self._logps, self._entropies, None


# ---- vLLM --------------------------------------------------------------------------------------------------------------


class SharedVLLMEngine:
    """`vllm.LLM` as TRL calls it, started once: every later call with the same arguments gets the same engine (TRL
    starts one per trainer, 10-90 s on a CPU; tests and benchmarks build several trainers of one model). A trainer's
    first weight sync loads its own weights, so it generates from its own model."""

    def __init__(self):
        from vllm import LLM

        self._llm_class = LLM
        self.llm = None
        self.kwargs: dict | None = None
        self.starts = 0
        self.start_seconds: float | None = None  # how long the engine took to start

    def __call__(self, **kwargs):
        if self.llm is None:
            from ..compat.vllm import kernel_scan_guard

            started = time.perf_counter()
            with kernel_scan_guard():  # stock TRL's trainers (the tests' oracle) start it without grpo_plus's guard
                self.llm, self.kwargs = self._llm_class(**kwargs), kwargs
            self.start_seconds = time.perf_counter() - started
            self.starts += 1
            return self.llm
        changed = {k: (self.kwargs.get(k), v) for k, v in kwargs.items() if self.kwargs.get(k) != v}
        assert not changed, (
            f"a trainer asks vLLM for other engine settings than the shared engine's (was, now): {changed}"
        )
        return self.llm

    def close(self) -> None:
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
            gc.collect()


@contextmanager
def shared_vllm_engine(engine: SharedVLLMEngine | None = None):
    """Every TRL trainer built inside (colocate mode) generates with one `SharedVLLMEngine` (`engine`, or a new one),
    closed on exit."""
    import trl.generation.vllm_generation as vllm_generation

    engine = SharedVLLMEngine() if engine is None else engine
    original = vllm_generation.LLM
    vllm_generation.LLM = engine
    try:
        yield engine
    finally:
        vllm_generation.LLM = original
        engine.close()
