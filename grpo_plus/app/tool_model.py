"""A tiny Qwen3 that makes real tool calls, with TRL's Qwen3 chat template, built and trained here in seconds; what
the multi-turn tests and `benchmarks/multi_turn.py` both run on (like `grpo_plus.app.testing`, in the package so that
the benchmarks import it without editing `sys.path`).

The tokenizer is character-level plus Qwen3's special tokens and a few multi-character pieces (the template's tool
boilerplate, JSON keys) so prompts stay short. The model is trained briefly (teacher forcing on rendered
conversations) to answer a number with `increment` tool calls: one call for an odd number, two for an even one,
then the final number. Sampled at temperature 1 it makes well-formed calls most of the time and sometimes not, so a
batch mixes rows that stop after 0, 1 or 2 tool turns. `two_turns` builds the second turn of a tiny random model the
way TRL's tool loop builds it, for measuring a continued cache against a fresh prefill.
"""

from __future__ import annotations

import string
import time
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3Config
from trl.chat_template_utils import get_training_chat_template, qwen3_chat_template

from .testing import tiny_run_kwargs

__all__ = [
    "TurnRecorder",
    "completion_length_reward",
    "conversation",
    "increment",
    "left_pad",
    "load_tool_model",
    "make_tool_tokenizer",
    "number_prompts",
    "save_tool_model",
    "tool_model_config",
    "tool_run_settings",
    "tool_trainer",
    "train_tool_model",
    "two_turns",
]

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen3's markup and pieces of its tool boilerplate, one token each (plain added tokens: they decode to themselves).
PIECES = [
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
    "system",
    "user",
    "assistant",
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function "
    "signatures within <tools></tools> XML tags:\n<tools>\n",
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within ",
    '\n{"name": <function-name>, "arguments": <args-json-object>}\n',
    '{"type": "function", "function": {"name": "',
    '", "description": "',
    '", "parameters": {"type": "object", "properties": {',
    '{"name": "',
    '", "arguments": {',
    "increment",
    "integer",
]
CHARS = [c for c in string.printable if c not in "\x0b\x0c\r"]


def make_tool_tokenizer(compact: bool = True) -> PreTrainedTokenizerFast:
    """Character-level tokenizer with Qwen3's special tokens and TRL's Qwen3 chat template (tool calling);
    `compact`: the template's markup, tool boilerplate and `increment`'s schema are one token each (a 33-token
    prompt instead of 650)."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        model_input_names=["input_ids", "attention_mask"],
    )
    tokenizer.chat_template = qwen3_chat_template  # TRL recognizes it: response parsing, prefix-preserving template
    if not compact:
        tokenizer.add_tokens([AddedToken(piece, normalized=False, special=False) for piece in PIECES[:6]])
        return tokenizer
    # the rendered schema of `increment` is one token too (a BPE vocabulary would merge such a frequent string)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "0"}], tools=[increment], tokenize=False)
    schema = rendered.split("<tools>\n")[-1].split("\n</tools>")[0]
    tokenizer.add_tokens([AddedToken(piece, normalized=False, special=False) for piece in [*PIECES, schema]])
    return tokenizer


def increment(n: int) -> int:
    """Add one to a number.

    Args:
        n: The number.

    Returns:
        The number plus one.
    """
    return n + 1


def conversation(number: int, system: str | None = None) -> list[dict]:
    """What the model is taught for `number`: one increment call for an odd number, two for an even one (after a
    system prompt, if given)."""
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": str(number)})
    value = number
    for _ in range(1 if number % 2 else 2):
        call = {"type": "function", "function": {"name": "increment", "arguments": {"n": value}}}
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        value += 1
        messages.append({"role": "tool", "name": "increment", "content": str(value)})
    messages.append({"role": "assistant", "content": str(value)})
    return messages


def tool_model_config(tokenizer, **overrides) -> Qwen3Config:
    settings = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return Qwen3Config(**{**settings, **overrides})


def train_tool_model(
    tokenizer, steps: int = 100, learning_rate: float = 6e-3, seed: int = 0, system: str | None = None, **config
):
    """A tiny Qwen3 (`config` overrides `tool_model_config`) taught `conversation(n, system)` for n in 0..9 by
    `steps` full-batch Adam steps (5-10 s on one thread without a system prompt). At 100 steps, sampled at
    temperature 1, most rows call the tool once or twice and some write malformed calls."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tool_model_config(tokenizer, **config), dtype=torch.float32)
    template = get_training_chat_template(tokenizer)
    texts = [
        tokenizer.apply_chat_template(
            conversation(n, system), tools=[increment], tokenize=False, chat_template=template
        )
        for n in range(10)
    ]
    batch = tokenizer(texts, return_tensors="pt", padding=True, padding_side="right")
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    optimizer = torch.optim.Adam(model.parameters(), lr=learning_rate)
    model.train()
    for _ in range(steps):
        loss = model(**batch, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def save_tool_model(path: str | Path, steps: int = 100, compact: bool = True, **training) -> Path:
    """Build, train (`training`: `train_tool_model`'s settings) and save the tool-calling model and its tokenizer
    to `path` (loadable by from_pretrained)."""
    path = Path(path)
    tokenizer = make_tool_tokenizer(compact)
    train_tool_model(tokenizer, steps, **training).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def load_tool_model(path: str | Path):
    """(model, tokenizer) saved by `save_tool_model`, the model freshly loaded (float32)."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    tokenizer.chat_template = qwen3_chat_template
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), tokenizer


# ---- trainers on the tool model -------------------------------------------------------------------------------------


def number_prompts(count: int = 8) -> list[dict]:
    """Chat prompts asking about the numbers 0..count-1 (the model answers with increment calls)."""
    return [{"prompt": [{"role": "user", "content": str(n % 10)}]} for n in range(count)]


def completion_length_reward(completions, **kwargs) -> list[float]:
    """The number of messages in each completion (more tool turns, more reward)."""
    return [float(len(completion)) for completion in completions]


def tool_run_settings(output_dir, **overrides) -> dict:
    """GRPOConfig fields for a float32 CPU run on the tool model: 8 rows (2 prompts x 4), SGD, sampled at temperature 1."""
    tool_run = dict(per_device_train_batch_size=8, max_completion_length=128, optim="sgd", temperature=1.0)
    return tiny_run_kwargs(output_dir, **{**tool_run, **overrides})


def tool_trainer(
    package, model_dir, output_dir, *, reward_funcs=(completion_length_reward,), train_dataset=None, **kwargs
):
    """`package`'s GRPOTrainer (trl or grpo_plus) on the tool model loaded from `model_dir`. Keyword arguments that
    are GRPOConfig fields go to the config; the others (tools, environment_factory, rollout_func) to the trainer."""
    fields = set(package.GRPOConfig.__dataclass_fields__)
    config = {key: value for key, value in kwargs.items() if key in fields}
    trainer_kwargs = {key: value for key, value in kwargs.items() if key not in fields}
    model, tokenizer = load_tool_model(model_dir)
    return package.GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=list(reward_funcs) if reward_funcs is not None else None,
        args=package.GRPOConfig(**tool_run_settings(output_dir, **config)),
        train_dataset=train_dataset,
        **trainer_kwargs,
    )


class TurnRecorder:
    """Records every `_generate_single_turn` call of a trainer (its prompt ids and completion ids) and the shape of
    every forward of the model inside it (the first one of a call is the prefill), by generation round (one call of
    `_generate_and_score_completions`: the first turn, then TRL's tool turns)."""

    def __init__(self, trainer):
        self.rounds: list[list[dict]] = []
        self._shapes: list[tuple[int, int]] | None = None
        backbone = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
        backbone.base_model.register_forward_pre_hook(self._record, with_kwargs=True)
        original = trainer._generate_single_turn

        def recording(prompt_ids, *args, **kwargs):
            self._shapes = []
            start = time.perf_counter()
            completion_ids, logprobs = original(prompt_ids, *args, **kwargs)
            seconds = time.perf_counter() - start
            self.rounds[-1].append(
                # copies: TRL's tool loop edits the lists it was handed and returned
                dict(
                    prompt_ids=[list(ids) for ids in prompt_ids],
                    completion_ids=[list(ids) for ids in completion_ids],
                    forwards=self._shapes,
                    seconds=seconds,
                )
            )
            self._shapes = None
            return completion_ids, logprobs

        trainer._generate_single_turn = recording
        score = trainer._generate_and_score_completions

        def new_round(inputs):
            self.rounds.append([])
            return score(inputs)

        trainer._generate_and_score_completions = new_round

    @property
    def calls(self) -> list[dict]:
        return [call for calls in self.rounds for call in calls]

    def _record(self, module, args, kwargs):
        if self._shapes is not None:
            self._shapes.append(tuple(kwargs.get("input_ids", args[0] if args else None).shape))

    @property
    def prefill_positions(self) -> int:
        """Token positions of the prefills (the first forward of every generation call)."""
        return sum(call["forwards"][0][0] * call["forwards"][0][1] for call in self.calls)

    @property
    def positions(self) -> int:
        """Token positions of every forward inside the generation calls."""
        return sum(rows * columns for call in self.calls for rows, columns in call["forwards"])


# ---- a second turn, as TRL's tool loop builds it ---------------------------------------------------------------------


def left_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, attention mask) of `rows` left-padded to the longest, as TRL pads a generation batch."""
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
    return ids, mask


def two_turns(family: str, lora: bool):
    """A tiny random model of `family` (`grpo_plus.app.testing.tiny_config`, with a LoRA adapter if `lora`), the
    first turn of 3 prompts x 4 rows generated through a TurnCache, and the second turn's inputs built as TRL's tool
    loop builds them: 6 of the rows, each its prompt + completion (cut after EOS) + a 'tool output' of 2-4 tokens,
    left-padded. Returns (model, generation config, the TurnCache, (ids, mask))."""
    from peft import LoraConfig, get_peft_model
    from transformers import GenerationConfig

    from ..zero_waste.generation import generate
    from ..zero_waste.multi_turn import TurnCache
    from .testing import make_tokenizer, tiny_config

    tokenizer = make_tokenizer()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, len(tokenizer)), dtype=torch.float32)
    if lora:
        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    model.eval()
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    config = GenerationConfig(
        max_new_tokens=10,
        do_sample=True,
        temperature=0.9,
        pad_token_id=pad,
        eos_token_id=[eos],
        sequence_bias=[[[eos], 2.0]],  # rows end at different steps
        disable_compile=True,
    )
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, len(tokenizer), (n,), generator=generator).tolist() for n in (9, 5, 7)]
    rows = [prompt for prompt in prompts for _ in range(4)]
    ids, mask = left_pad(rows, pad)
    turns = TurnCache()
    torch.manual_seed(0)
    first, _ = generate(model, turns=turns, input_ids=ids, attention_mask=mask, generation_config=config)
    histories = []
    for row, sequence in zip(rows, first[:, ids.shape[1] :].tolist(), strict=True):
        histories.append(row + (sequence[: sequence.index(eos) + 1] if eos in sequence else sequence))
    continued = [0, 2, 3, 5, 8, 11]
    second = [histories[i] + torch.randint(3, 60, (2 + i % 3,), generator=generator).tolist() for i in continued]
    return model, config, turns, left_pad(second, pad)
