"""The pieces the recipes (recipes/*.py) share: arguments, data, rewards, held-out evaluation, the final report.

Each recipe stays a top-to-bottom script; what would otherwise be copied between them lives here.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import yaml
from trl import ModelConfig, TrlParser

from .. import rewards
from ..config import GRPOConfig, field_type_problem
from ..plugins import PluginError, import_user_module
from ..registry import quoted_with_hint
from ..run.checkpoints import CheckpointError, hub_id_of, public_model_name, register_hub_id
from ..run.validation import check_dataset
from . import real_tasks, tasks
from .embedded import EMBEDDED_HUB_ID, is_embedded_name
from .vlm import IMAGE_LEVELS, make_image_dataset

if TYPE_CHECKING:
    from .plotting import BeforeAfter  # matplotlib (the plot extra) is imported only when a plot is drawn

logger = logging.getLogger(__name__)

# "correctness" and "format" are the task's own (real_tasks.task_rewards: the built-in arithmetic's, or the verifier
# and format reward of a GSM8K / MATH / reasoning-gym dataset); the others name grpo_plus.rewards functions.
BUILTIN_REWARDS: dict[str, Callable[..., list[float]]] = {
    "correctness": tasks.correctness_reward,
    "format": tasks.format_reward,
    "accuracy": rewards.accuracy_reward,
    "gsm8k_accuracy": rewards.gsm8k_accuracy_reward,
    "reasoning_gym": rewards.reasoning_gym_reward,
    "think_format": rewards.think_format_reward,
    "think_answer_format": rewards.think_answer_format_reward,
    "answer_format": rewards.answer_format_reward,
    "gsm8k_format": rewards.gsm8k_format_reward,
    "boxed_format": rewards.boxed_format_reward,
}
TASK_REWARDS = ("correctness", "format")


@dataclass
class ScriptArguments:
    """What to train on and what to do with the result (GRPOConfig and TRL's ModelConfig hold the rest)."""

    task_level: str = field(
        default=tasks.DEMO_LEVEL,
        metadata={
            "help": f"Built-in task level: arithmetic ({', '.join(tasks.LEVELS)}) or, for recipes/grpo_vlm.py, "
            f"images ({', '.join(IMAGE_LEVELS)})."
        },
    )
    task_train_size: int | None = field(
        default=None,
        metadata={"help": "Training problems (the built-in and reasoning-gym tasks: default 256; a dataset: all)."},
    )
    task_eval_size: int | None = field(
        default=None,
        metadata={"help": "Held-out problems (the built-in and reasoning-gym tasks: default 64; a dataset: all)."},
    )
    task_seed: int = field(default=0, metadata={"help": "Seed of the generated problems (and of a held-out draw)."})
    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "A dataset instead of the built-in task: a hub id, a local folder or file (.json, .jsonl, "
            ".parquet, .csv) in TRL's, GSM8K's or MATH's format, or reasoning-gym:<task> (generated locally)."
        },
    )
    dataset_config: str | None = field(
        default=None,
        metadata={"help": "Dataset config name; for reasoning-gym:<task>, its config as field=value,field=value."},
    )
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    dataset_test_split: str | None = field(
        default=None,
        metadata={
            "help": "Held-out split (default for GSM8K / MATH data: 'test' if there is one, else rows held out of "
            "train; a TRL-format dataset needs an 'answer' column for the accuracy report)."
        },
    )
    reward_funcs: list[str] = field(
        default_factory=lambda: ["correctness", "format"],
        metadata={
            "help": "Reward functions: correctness and format (the task's own verifier and format reward), other "
            f"built-in names ({', '.join(n for n in BUILTIN_REWARDS if n not in TASK_REWARDS)}) or "
            "'package.module:function' (e.g. trl.rewards:think_format_reward)."
        },
    )
    eval_before_after: bool = field(default=True, metadata={"help": "Held-out greedy eval before and after."})
    eval_max_new_tokens: int = field(default=24, metadata={"help": "Token budget of the held-out eval."})
    eval_batch_size: int = field(default=16, metadata={"help": "Prompts per eval generation batch."})
    merge: bool = field(default=False, metadata={"help": "Also save base + adapter merged, in output_dir/merged."})
    image_size: int = field(default=448, metadata={"help": "Image task: side of the square pictures, in pixels."})
    image_max_pixels: int | None = field(
        default=None,
        metadata={"help": "Vision-language models: most pixels an image keeps (Qwen-VL: 448 x 448 = 256 tokens)."},
    )


def parse_recipe_args(
    argv: list[str] | None = None, four_bit: bool = False
) -> tuple[ScriptArguments, GRPOConfig, ModelConfig]:
    """CLI flags and/or --config YAML -> (script, training, model) arguments; bad input exits with its reason.

    `four_bit`: whether the calling recipe loads the base in 4 bits (grpo_qlora.py) or not (grpo_lora.py); a
    quantization flag the recipe cannot honour is refused, naming the recipe that can."""
    argv = list(sys.argv[1:] if argv is None else argv)
    config_file = _check_config_file(argv)
    parser = _RecipeParser((ScriptArguments, GRPOConfig, ModelConfig), config_file)
    parser.set_defaults(use_peft=True)  # the recipes train LoRA adapters; an explicit `use_peft: false` is refused
    try:
        script_args, training_args, model_args = parser.parse_args_and_config(argv)
    except (ValueError, PluginError) as error:
        fail(str(error))
    _check_quantization_flags(model_args, four_bit)
    if not model_args.use_peft:
        recipe = "grpo_qlora.py" if four_bit else "grpo_lora.py"
        fail(
            f"--use_peft false: recipes/{recipe} trains a LoRA adapter (lora_* fields) and cannot honour it. For full "
            "fine-tuning, use grpo_plus.GRPOTrainer from your own script (or TRL's `trl grpo` script with the import "
            "changed)."
        )
    return script_args, training_args, model_args


class _RecipeParser(TrlParser):
    """TrlParser whose mistakes are one `error:` line: an unknown key or flag is named before any config is built
    (so a later check, such as bf16 on a CPU, cannot hide a typo), a value of the wrong type names its field
    instead of printing argparse's usage dump."""

    def __init__(self, dataclass_types, config_file: Path | None):
        super().__init__(dataclass_types)
        self.config_file, self.config_unknown = config_file, []
        self.field_types = {f.name: (cls, f.name) for cls in dataclass_types for f in fields(cls)}

    def error(self, message: str) -> NoReturn:
        fail(message)

    def set_defaults_with_config(self, **config) -> list[str]:
        for key, value in config.items():
            if key in self.field_types and (problem := field_type_problem(*self.field_types[key], value)):
                fail(f"config file {self.config_file}: {problem}")
        self.config_unknown = super().set_defaults_with_config(**config)
        return self.config_unknown

    def parse_args_into_dataclasses(self, args=None, **kwargs):
        _, cli_unknown = self.parse_known_args(args=args)
        if self.config_unknown or cli_unknown:
            fail(_unknown_arguments_message(self.config_unknown, cli_unknown))
        return super().parse_args_into_dataclasses(args=args, **kwargs)


def _check_config_file(argv: list[str]) -> Path | None:
    """The file --config names, checked to be a readable YAML mapping (TrlParser would raise a traceback)."""
    if "--config" not in argv:
        return None
    index = argv.index("--config") + 1
    if index == len(argv):
        fail("--config needs the path of a YAML file.")
    path = Path(argv[index])
    try:
        config = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        fail(f"config file {path} does not exist.")
    except OSError as error:
        fail(f"cannot read config file {path}: {error.strerror}.")
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        fail(f"config file {path} is not valid YAML{where}: {problem}.")
    if not isinstance(config, dict):
        fail(f"config file {path} must hold a YAML mapping (field: value lines); it holds {type(config).__name__}.")
    return path


def _check_quantization_flags(model_args: ModelConfig, four_bit: bool) -> None:
    if not four_bit and (model_args.load_in_4bit or model_args.load_in_8bit):
        flag = "--load_in_4bit" if model_args.load_in_4bit else "--load_in_8bit"
        fail(
            f"{flag}: recipes/grpo_lora.py trains on an unquantized base and cannot honour it. For a 4-bit base use "
            "recipes/grpo_qlora.py (same flags and configs); 8-bit bases are not supported."
        )
    if not four_bit and model_args.use_bnb_nested_quant:
        fail(
            "--use_bnb_nested_quant: recipes/grpo_lora.py trains on an unquantized base, so there is nothing to "
            "double-quantize. For a 4-bit base use recipes/grpo_qlora.py (same flags and configs)."
        )
    if four_bit and model_args.load_in_8bit:
        fail("--load_in_8bit: recipes/grpo_qlora.py quantizes the base to 4 bits (nf4 or fp4, --bnb_4bit_quant_type).")


def _unknown_arguments_message(config_unknown: list[str], cli_unknown: list[str]) -> str:
    """Name every unknown config key and flag with the closest field (TrlParser leaves them over as '--name value')."""
    known = {f.name for cls in (ScriptArguments, GRPOConfig, ModelConfig) for f in fields(cls)}

    def described(strings: list[str], prefix: str) -> str:
        names = [s[2:].split("=", 1)[0] for s in strings if s.startswith("--")]
        return ", ".join(quoted_with_hint(name, known, prefix) for name in names)

    def plural(noun: str, strings: list[str]) -> str:
        return noun + ("s" if sum(s.startswith("--") for s in strings) > 1 else "")

    problems = []
    if config_unknown:
        problems.append(f"{plural('unknown key', config_unknown)} in the config file: {described(config_unknown, '')}")
    if any(s.startswith("--") for s in cli_unknown):
        problems.append(f"{plural('unknown flag', cli_unknown)}: {described(cli_unknown, '--')}")
    elif cli_unknown:
        problems.append(f"unexpected argument: {' '.join(cli_unknown)}")
    return (
        "; ".join(problems) + ". Every recipe, GRPOConfig and ModelConfig field is a flag and a config key (--help)."
    )


def prepare_hub_push(training_args: GRPOConfig) -> str | None:
    """With --push_to_hub: check token and write permission now (seconds, not after training); return the repo id.

    The Trainer's own push is switched off: it would upload the whole output_dir; the recipes push the adapter only.
    """
    if not training_args.push_to_hub:
        return None
    from .hub import HubAccessError, check_hub_access

    repo = training_args.hub_model_id or training_args.output_dir.rstrip("/").split("/")[-1]
    try:
        repo_id = check_hub_access(repo, training_args.hub_token)
    except HubAccessError as error:
        fail(str(error))
    training_args.push_to_hub = False
    return repo_id


def load_tokenizer(model_args: ModelConfig) -> tuple[str, Any]:
    """(local path or hub id of the model, its tokenizer); the embedded name resolves to its cached conversion."""
    from transformers import AutoTokenizer

    from .embedded import resolve_model

    try:
        model_path = resolve_model(model_args.model_name_or_path)
        tokenizer = AutoTokenizer.from_pretrained(model_path, revision=model_args.model_revision)
    except (OSError, ValueError, ImportError) as error:
        fail(f"cannot load model {model_args.model_name_or_path!r}: {error}")
    if is_embedded_name(model_args.model_name_or_path):
        register_hub_id(model_path, EMBEDDED_HUB_ID)  # model cards and adapter configs name it, not its cache folder
    return model_path, tokenizer


def load_data_and_rewards(args: ScriptArguments):
    """(train dataset, held-out dataset or None, reward functions), or exit with the reason."""
    try:
        train, test = load_datasets(args)
        return train, test, resolve_reward_funcs(args.reward_funcs, train)
    except ValueError as error:
        fail(str(error))


def resolve_reward_funcs(names: list[str], dataset=None) -> list[Callable[..., list[float]]]:
    """Built-in reward names or 'module:function' references -> callables. With the training `dataset`, "correctness"
    and "format" are its format's verifier and format reward (real_tasks.task_rewards); without, the built-in
    task's."""
    task_funcs = dict(zip(TASK_REWARDS, real_tasks.task_rewards(dataset), strict=True)) if dataset is not None else {}
    funcs = []
    for name in names:
        if name in BUILTIN_REWARDS:
            funcs.append(task_funcs.get(name, BUILTIN_REWARDS[name]))
            continue
        module_name, _, attr = name.partition(":")
        if not attr:
            raise ValueError(
                f"reward_funcs: {name!r} is neither a built-in reward ({', '.join(BUILTIN_REWARDS)}) "
                "nor a 'package.module:function' reference."
            )
        try:
            funcs.append(getattr(import_user_module(module_name), attr))
        except (ImportError, AttributeError) as error:
            raise ValueError(f"reward_funcs: cannot load {name!r}: {error}") from error
    return funcs


def load_datasets(args: ScriptArguments):
    """(train, held-out or None): the built-in task, a reasoning-gym task, or the user's dataset in one of the formats
    real_tasks reads (a GSM8K / MATH one gets prompts and a held-out split), its 'prompt' column checked."""
    if args.dataset_name is None and args.task_level in IMAGE_LEVELS:
        sizes = dict(level=args.task_level, seed=args.task_seed, image_size=args.image_size)
        train = make_image_dataset("train", size=args.task_train_size, **sizes)
        return train, make_image_dataset("test", size=args.task_eval_size, **sizes)
    if args.dataset_name is None:
        train = tasks.make_dataset("train", args.task_level, size=args.task_train_size, seed=args.task_seed)
        test = tasks.make_dataset("test", args.task_level, size=args.task_eval_size, seed=args.task_seed)
        return train, test
    if real_tasks.is_reasoning_gym(args.dataset_name):
        return real_tasks.reasoning_gym_datasets(
            args.dataset_name, args.dataset_config, args.task_train_size, args.task_eval_size, args.task_seed
        )
    loaded = real_tasks.load_dataset_dict(args.dataset_name, args.dataset_config)
    for split in [args.dataset_train_split, *([args.dataset_test_split] if args.dataset_test_split else [])]:
        if split not in loaded:
            raise ValueError(f"{args.dataset_name} has no split {split!r}; it has {sorted(loaded)}.")
    train_name = f"{args.dataset_name}[{args.dataset_train_split!r}]"
    check_dataset(loaded[args.dataset_train_split], name=train_name, prompt_required=False)  # empty: one line
    fmt = real_tasks.data_format(loaded[args.dataset_train_split], name=train_name)
    if fmt.name == "trl":
        train = loaded[args.dataset_train_split]
        test = loaded[args.dataset_test_split] if args.dataset_test_split else None
    else:
        splits = {"train": loaded[args.dataset_train_split], **{k: v for k, v in loaded.items() if k == "test"}}
        if args.dataset_test_split:
            splits[args.dataset_test_split] = loaded[args.dataset_test_split]
        train, test, source = real_tasks.held_out_split(
            splits, args.dataset_test_split, args.task_eval_size, args.task_seed
        )
        logger.info("%s: %s format, held-out rows from %s", args.dataset_name, fmt.name, source)
        train, test = real_tasks.with_prompts(train, fmt), None if test is None else real_tasks.with_prompts(test, fmt)
    train = train.select(range(min(args.task_train_size, len(train)))) if args.task_train_size else train
    if test is not None and args.task_eval_size is not None:
        test = test.select(range(min(args.task_eval_size, len(test))))
    check_dataset(train, name=train_name)
    if test is not None:
        check_dataset(test, name=f"{args.dataset_name}[held-out]")
    return train, test


@contextlib.contextmanager
def exit_on_bad_input(*errors: type[BaseException]) -> Iterator[None]:
    """Turn the given errors (by default: a bad value, dataset, LoRA target or checkpoint) into one `error:` line."""
    caught = errors or (ValueError, PluginError)
    try:
        yield
    except caught as error:
        fail(str(error))


def build_trainer(trainer_class, model, processing_class, reward_funcs, train_dataset, training_args, model_args):
    """The recipe's `trainer_class` with a LoRA adapter as `model_args` say, built and checked (the dataset, the LoRA
    target modules, any checkpoint to resume from) before anything long runs: bad input exits with one line.
    Returns (trainer, the checkpoint to resume from or None)."""
    from trl import get_peft_config

    with exit_on_bad_input():
        trainer = trainer_class(
            model=model,
            reward_funcs=reward_funcs,
            args=training_args,
            train_dataset=train_dataset,
            processing_class=processing_class,
            peft_config=get_peft_config(model_args),
        )
    return trainer, check_before_training(trainer, training_args, model_args)


def four_bit_loading(model_args: ModelConfig, training_args: GRPOConfig) -> dict[str, Any]:
    """`from_pretrained` keyword arguments for a base quantized to 4 bits (nf4 or fp4, bf16 compute on GPU), frozen,
    as TRL's ModelConfig flags say (double quantization only with --use_bnb_nested_quant)."""
    import os

    import torch
    from accelerate import PartialState
    from transformers import BitsAndBytesConfig
    from transformers.integrations import is_deepspeed_zero3_enabled

    on_gpu = torch.cuda.is_available() and not training_args.use_cpu
    compute_dtype = torch.bfloat16 if on_gpu else torch.float32
    # ZeRO-3 / FSDP shard every weight: the 4-bit ones must be stored in the other parameters' dtype, and placing the
    # model on a device is the engine's job.
    sharded = is_deepspeed_zero3_enabled() or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    quantization_config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=model_args.bnb_4bit_quant_type,  # nf4 unless --bnb_4bit_quant_type fp4
        bnb_4bit_use_double_quant=model_args.use_bnb_nested_quant,
        bnb_4bit_compute_dtype=compute_dtype,
        bnb_4bit_quant_storage=model_args.bnb_4bit_quant_storage or (compute_dtype if sharded else "uint8"),
    )
    return dict(
        dtype=compute_dtype,
        quantization_config=quantization_config,
        device_map={"": PartialState().local_process_index} if on_gpu and not sharded else None,  # a GPU per rank
    )


def prepare_four_bit(model, training_args: GRPOConfig):
    """A 4-bit base made trainable through: norms in fp32, inputs requiring grads (so gradient checkpointing works
    through the frozen base), and on CPU the 4-bit weights kept in a layout that backpropagates. A mixture of experts
    keeps its experts' weights in their dtype (bitsandbytes does not quantize them; in fp32 they would double)."""
    from peft import prepare_model_for_kbit_training

    from ..compat.bitsandbytes import keep_4bit_trainable_on_cpu
    from ..compat.moe import expert_weights_set_aside

    with expert_weights_set_aside(model):
        model = prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=training_args.gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )
    keep_4bit_trainable_on_cpu(model)  # CPU only: stops bitsandbytes repacking 4-bit weights into a no-grad layout
    return model


def check_before_training(trainer, training_args: GRPOConfig, model_args: ModelConfig) -> str | None:
    """What can only be checked once the trainer is built, checked before the held-out evaluation and training: every
    --lora_target_modules name matches a module, and --resume_from_checkpoint designates an undamaged checkpoint of
    the same adapter shape. Returns that checkpoint (or None); a mistake exits with one error line."""
    from ..run.faults import prepare_resume

    wanted = model_args.lora_target_modules
    targeted = getattr(trainer.model, "targeted_module_names", None)
    if isinstance(wanted, list) and targeted:
        missing = [name for name in wanted if not any(m == name or m.endswith(f".{name}") for m in targeted)]
        if missing:
            found = sorted({m.rsplit(".", 1)[-1] for m in targeted})
            fail(
                f"--lora_target_modules: {', '.join(missing)} matches no module of the model (the other names matched "
                f"{', '.join(found)}). Name modules of the model (e.g. q_proj, v_proj), or use all-linear."
            )
    with exit_on_bad_input(CheckpointError):
        return prepare_resume(trainer, training_args.resume_from_checkpoint)


def evaluate_held_out(
    model, tokenizer, dataset, args: ScriptArguments, label: str, trainer=None
) -> dict[str, Any] | None:
    """Greedy held-out accuracy / format rate, when there is a held-out set with answers. Pass the trainer after
    training: under DeepSpeed ZeRO-3 its engine's weight shards are gathered for generation (every rank evaluates)."""
    scorers = None if dataset is None else real_tasks.evaluation_rewards(dataset)
    if not args.eval_before_after or scorers is None:
        return None
    from ..run.distributed import whole_model_for_generation

    print(f"\nHeld-out evaluation {label} training ({len(dataset)} prompts, greedy):", flush=True)
    with whole_model_for_generation(model, trainer) as whole_model:
        result = tasks.evaluate(
            whole_model,
            tokenizer,
            dataset,
            batch_size=args.eval_batch_size,
            max_new_tokens=args.eval_max_new_tokens,
            correctness=scorers[0],
            format=scorers[1],
        )
    return {k: v for k, v in result.items() if k != "completions"}


def eval_table(before: dict[str, Any] | None, after: dict[str, Any] | None) -> str:
    """A plain-text before/after table of the held-out metrics."""
    if not before or not after:
        return ""
    rows = [("metric", "before", "after", "change")]
    for key in ("accuracy", "format_rate", "format_reward"):
        if key in before and key in after:
            rows.append((key, f"{before[key]:.3f}", f"{after[key]:.3f}", f"{after[key] - before[key]:+.3f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) for row in rows]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def held_out_accuracy(before: dict[str, Any] | None, after: dict[str, Any] | None, steps: int) -> BeforeAfter | None:
    """The held-out accuracy before and after training, for the reward plot's before / after panel (None without
    both evaluations)."""
    from .plotting import BeforeAfter

    if not before or not after or "accuracy" not in before or "accuracy" not in after:
        return None
    return BeforeAfter("held-out accuracy", before["accuracy"], after["accuracy"], steps)


def task_description(args: ScriptArguments) -> dict[str, Any] | str:
    """What the model card says the run trained on."""
    if args.dataset_name is not None:
        described = real_tasks.describe(args)
        if described is not None:
            return described
        return f"dataset {args.dataset_name} (train split {args.dataset_train_split!r}), rewards {args.reward_funcs}"
    if args.task_level in IMAGE_LEVELS:
        return {
            "name": "grpo_plus built-in image task",
            "level": args.task_level,
            "instruction": tasks.INSTRUCTION,
            "rewards": ", ".join(args.reward_funcs),
        }
    return {
        "name": "grpo_plus built-in arithmetic word problems",
        "level": args.task_level,
        "instruction": tasks.INSTRUCTION,
        "rewards": ", ".join(args.reward_funcs),
        "held-out split": "problems whose arithmetic never appears in training (hash split)",
    }


def finish_run(
    trainer,
    script_args: ScriptArguments,
    base_model_path: str,
    before: dict[str, Any] | None,
    after: dict[str, Any] | None,
    hub_repo_id: str | None,
) -> None:
    """Plot, model card, optional adapter push and merge: everything after the adapter is saved."""
    from .hub import PushSettings, loss_config_from_args, merge_adapter, write_model_card
    from .plotting import plot_training_curves

    args = trainer.args
    output_dir = Path(args.output_dir)
    table = eval_table(before, after)
    if table:
        print(f"\nHeld-out results ({script_args.task_level if script_args.dataset_name is None else 'test'}):")
        print(table)
    if not trainer.accelerator.is_main_process:
        return
    base_model = public_model_name(base_model_path)  # a Hub id or a folder name, never a local path
    plot_training_curves(
        trainer.state.log_history,
        output_dir / "reward_curve.png",
        title=f"GRPO on {base_model}",
        before_after=held_out_accuracy(before, after, trainer.state.global_step),
    )
    write_model_card(
        output_dir,
        base_model=base_model,
        base_model_on_hub=hub_id_of(base_model_path) is not None,
        repo_id=hub_repo_id,
        loss_config=loss_config_from_args(args),
        task=task_description(script_args),
        eval_before=before,
        eval_after=after,
        training_args={
            "learning_rate": args.learning_rate,
            "max_steps": args.max_steps,
            "per_device_train_batch_size": args.per_device_train_batch_size,
            "max_completion_length": args.max_completion_length,
            "temperature": args.temperature,
        },
    )
    print(f"\nAdapter, model card and reward_curve.png written to {output_dir}")
    if hub_repo_id is not None:
        push = PushSettings.from_args(output_dir, hub_repo_id, args)
        print(f"Pushed the LoRA adapter to {push_or_exit(push, args.hub_token)}")
    if script_args.merge:
        merged = merge_adapter(base_model_path, output_dir, output_dir / "merged")
        print(f"Merged model saved to {merged}")


def push_or_exit(push, token: str | None) -> str:
    """Push the adapter; on failure exit with the reason and the command that retries with the same settings."""
    from .hub import HubAccessError

    try:
        return push.push(token)
    except HubAccessError as error:
        fail(f"{error}\nThe adapter is saved in {push.output_dir}; {push.retry_instructions()}")


def fail(message: str) -> NoReturn:
    """Exit with a one-line reason instead of a traceback (bad input the user can fix)."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)
