"""`grpo-plus` command line: compare configurations, list what is registered, check a config fits, push an adapter,
serve a model to trainers in vLLM server mode."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from ..plugins import PluginError
from .hub import DEFAULT_COMMIT_MESSAGE, HubAccessError


def _compare(args: argparse.Namespace) -> int:
    from .compare import (
        check_configuration,
        markdown_table,
        parse_configuration,
        run_configuration,
        summary_rows,
        write_report,
    )

    configurations = [parse_configuration(spec) for spec in args.configs]
    for name, overrides in configurations:
        check_configuration(name, overrides)
    results = []
    title = f"GRPO configurations on {args.task_level} ({args.model}, {args.max_steps} steps)"
    for name, overrides in configurations:
        for seed in args.seeds:
            print(f"== {name} (seed {seed}): {overrides}", flush=True)
            results.append(
                run_configuration(
                    name,
                    overrides,
                    seed=seed,
                    output_dir=Path(args.output_dir) / "runs" / f"{name}-seed{seed}",
                    model=args.model,
                    task_level=args.task_level,
                    max_steps=args.max_steps,
                    eval_every=args.eval_every,
                    eval_size=args.eval_size,
                    max_cpu_minutes=args.max_cpu_minutes,
                    lora_r=args.lora_r,
                )
            )
            # After every run, so a comparison stopped part-way keeps what it measured.
            files = write_report(results, args.output_dir, title)
    print("\n" + markdown_table(summary_rows(results)))
    print(f"\nReport: {files['markdown']}  curves: {files['png']}")
    return 0


def _list(args: argparse.Namespace) -> int:
    from ..compat.loss import TRL_NATIVE_LOSS_TYPES
    from ..objective import REGISTRIES
    from ..plugins import load_plugins
    from .compare import PRESETS

    load_plugins(args.plugins)
    for registry in REGISTRIES:
        print(f"{registry.field}:")
        for entry in registry.entries():
            name = entry.name + (f" ({', '.join(entry.aliases)})" if entry.aliases else "")
            print(f"  {name:<30} {entry.doc.splitlines()[0] if entry.doc else ''}")
            notes = [note for note in _notes(registry.field, entry) if note]
            if notes:
                print(f"  {'':<30} [{'; '.join(notes)}]")
        if registry.field == "loss_type":
            print(f"  {'TRL computes:':<30} {', '.join(TRL_NATIVE_LOSS_TYPES)}")
    print("compare presets:", ", ".join(PRESETS))
    return 0


def _notes(field: str, entry) -> list[str]:
    """What a user combining this method needs to know: its paper, what it reads, where the savings stop."""
    from ..objective import PAPER, SPLIT_INVARIANT, ZERO_ADVANTAGE_ROWS_CONTRIBUTE_NOTHING

    notes = [entry.trait(PAPER, "")]
    if field == "advantage_estimator":
        use = entry.trait("scale_rewards")
        notes.append(
            {"ignored": "scale_rewards ignored (scales itself)", "std": "divided by the std scale_rewards names"}.get(
                use, ""
            )
        )
        notes += [f"needs {need}" for need in entry.requires]
    if field == "policy_loss":
        if not entry.trait(SPLIT_INVARIANT):
            notes.append("not split-invariant (picks tokens per micro-batch)")
        if not entry.trait(ZERO_ADVANTAGE_ROWS_CONTRIBUTE_NOTHING):
            notes.append("reads zero-advantage rows (no zero-waste row skipping)")
        options = entry.trait("options") or {}
        if options:
            notes.append("options: " + ", ".join(f"{name}={option.default}" for name, option in options.items()))
    return notes


def _push(args: argparse.Namespace) -> int:
    from .hub import PushSettings, check_hub_access

    repo_id = check_hub_access(args.repo_id)  # token (HF_TOKEN or the cached login) and write permission first
    settings = PushSettings(args.output_dir, repo_id, args.private, args.revision, args.commit_message)
    print(f"Pushed the LoRA adapter in {args.output_dir} to {settings.push()}")
    return 0


# YAML keys of a recipe config that are not GRPOConfig fields (TRL's ModelConfig, the recipes' ScriptArguments).
_MODEL_KEYS = ("model_name_or_path", "model_revision", "dtype", "torch_dtype", "attn_implementation", "use_peft",
               "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_target_parameters",
               "lora_modules_to_save", "lora_task_type", "use_rslora", "use_dora", "load_in_4bit", "load_in_8bit",
               "bnb_4bit_quant_type", "use_bnb_nested_quant", "trust_remote_code")  # fmt: skip


def fit_spec_from_yaml(path: Path, prompt_tokens: int, model_config_path: str | None = None,
                       equal_prompts: bool = False, images_per_prompt: int | None = None,
                       image_size: int | None = None):  # fmt: skip
    """A FitSpec from a recipe config YAML: its GRPOConfig fields through grpo_plus.GRPOConfig (TRL's defaults for the
    rest), its model fields as TRL's ModelConfig reads them, the model's shape from a local config.json, the Hub cache
    or grpo_plus.fit.KNOWN_SHAPES (nothing is downloaded). A vision-language model's prompts carry
    `images_per_prompt` pictures (1 by default) of `image_size` pixels square (default: the recipe's `image_size`,
    else 448), resized as its processor does within the recipe's `image_max_pixels`."""
    import tempfile

    import yaml
    from transformers import AutoConfig

    from ..config import GRPOConfig
    from ..fit import DEFAULT_IMAGE_SIZE, FitSpec, image_count_blocker, known_config, lora_fields, resized_image
    from .recipe import ScriptArguments

    settings = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(settings, dict):
        raise ValueError(f"{path}: expected a YAML mapping of settings")
    name = str(settings.get("model_name_or_path", ""))
    config = None
    if model_config_path:
        config = AutoConfig.from_pretrained(model_config_path)
    else:
        config = known_config(name)
        if config is None:
            try:
                config = AutoConfig.from_pretrained(name, local_files_only=True)
            except (OSError, ValueError) as error:
                from ..fit import KNOWN_MODELS

                raise ValueError(
                    f"{path}: model_name_or_path={name!r} has no config.json here (not a local folder, not in the Hub "
                    f"cache) and is not one of grpo_plus's known shapes ({', '.join(KNOWN_MODELS)}); pass "
                    "--model-config PATH/TO/config.json"
                ) from error
    config._attn_implementation = settings.get("attn_implementation") or "sdpa"
    script_keys = {f.name for f in dataclasses.fields(ScriptArguments)}
    training = {k: v for k, v in settings.items() if k not in _MODEL_KEYS and k not in script_keys}
    training.update(output_dir=tempfile.mkdtemp(prefix="grpo-plus-fit-"), use_cpu=True, report_to="none",
                    push_to_hub=False)  # fmt: skip
    args = GRPOConfig(**training)
    dtype_name = settings.get("dtype") or settings.get("torch_dtype") or "auto"
    if dtype_name == "auto":
        dtype_name = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "bfloat16")
    import torch

    dtype = getattr(torch, str(dtype_name).removeprefix("torch."))
    lora = None
    if settings.get("use_peft", "lora_r" in settings):
        lora = lora_fields(settings.get("lora_r", 16), settings.get("lora_alpha", 32),
                           settings.get("lora_dropout", 0.05), settings.get("lora_target_modules"),
                           settings.get("lora_target_parameters"))  # fmt: skip
    four_bit = bool(settings.get("load_in_4bit") or "bnb_4bit_quant_type" in settings)
    spec = FitSpec.from_config(args, config, dtype, lora, four_bit, prompt_tokens)
    spec = spec.replace(padded_prompts=not equal_prompts)
    if spec.vision_language:
        blocker = image_count_blocker(spec.model_config)
        if blocker is not None:
            raise ValueError(f"{path}: {blocker}; its pictures cannot be counted yet")
        side = image_size or settings.get("image_size") or DEFAULT_IMAGE_SIZE
        size = resized_image(spec.model_config, side, side, settings.get("image_max_pixels"))
        spec = spec.replace(images_per_prompt=1 if images_per_prompt is None else images_per_prompt, image_size=size)
    elif images_per_prompt or image_size:
        raise ValueError(f"{path}: --images-per-prompt / --image-size need a vision-language model, not "
                         f"{spec.model_config.get('model_type')!r}")  # fmt: skip
    return spec


def _fit(args: argparse.Namespace) -> int:
    from ..fit import GIB, card_budget, fit_report, format_report

    spec = fit_spec_from_yaml(Path(args.config), args.prompt_tokens, args.model_config, args.equal_prompts,
                              args.images_per_prompt, args.image_size)  # fmt: skip
    budget = card_budget(spec, int(args.memory_gib * GIB), int(args.reserve_gib * GIB))
    vllm = ""
    if spec.vllm_memory_fraction:
        from ..fit import engine_weights

        served, weights = engine_weights(spec, int(args.memory_gib * GIB))
        engine = spec.vllm_memory_fraction * args.memory_gib * GIB
        room = f"{(engine - weights) / GIB:.1f} GiB left for its KV cache" if weights < engine else "NO room: raise it"
        vllm = (f", {spec.vllm_memory_fraction:g} of it ({engine / GIB:.1f} GiB) for colocated vLLM: its weights "
                f"{weights / GIB:.1f} GiB in {served}, {room}")  # fmt: skip
    if budget <= 0:
        raise ValueError(
            f"--memory-gib {args.memory_gib} leaves nothing after the {args.reserve_gib} GiB reserve{vllm}"
        )
    report = fit_report(spec, budget, groups=not args.no_groups)
    print(format_report(report, f"{args.config} on a {args.memory_gib:g} GiB card{vllm}"))
    return 0


def _vllm_serve(args: argparse.Namespace) -> int:
    from ..engine.server import serve

    return serve(args.serve_args)


def _bool(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() == "true"


def build_parser() -> argparse.ArgumentParser:
    from ..fit import CARD_RESERVE_GIB
    from . import tasks
    from .compare import DEFAULT_PRESETS
    from .embedded import EMBEDDED_MODEL_NAME

    parser = argparse.ArgumentParser(prog="grpo-plus", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    compare = commands.add_parser(
        "compare",
        help="train several configurations on the same task/seeds/budget and write a report",
        description="Train named configurations (presets, or name:preset+key=value,key=value) with LoRA on the "
        "built-in arithmetic task, then write compare.png (reward, held-out accuracy, completion length, clip "
        "fraction per configuration) and compare.md (table). Defaults run offline on CPU.",
    )
    compare.add_argument("--configs", nargs="+", default=list(DEFAULT_PRESETS), metavar="CONFIG")
    compare.add_argument("--seeds", nargs="+", type=int, default=[0])
    compare.add_argument("--model", default=EMBEDDED_MODEL_NAME, help="model id or local path (default: embedded)")
    compare.add_argument("--task-level", default=tasks.BENCHMARK_LEVEL, choices=list(tasks.LEVELS))
    compare.add_argument("--max-steps", type=int, default=12)
    compare.add_argument("--eval-every", type=int, default=4)
    compare.add_argument("--eval-size", type=int, default=32, help="held-out prompts per evaluation")
    compare.add_argument("--max-cpu-minutes", type=float, default=None, help="stop each run at this training CPU time")
    compare.add_argument("--lora-r", type=int, default=16)
    compare.add_argument("--output-dir", default="outputs/compare")
    compare.set_defaults(run=_compare, parser=compare)

    listing = commands.add_parser(
        "list",
        help="registered advantage estimators, reward scales, policy losses, importance sampling levels, KL "
        "estimators and loss types, each with its formula and paper",
    )
    listing.add_argument("--plugins", nargs="*", default=[], help="modules to import first")
    listing.set_defaults(run=_list, parser=listing)

    fit = commands.add_parser(
        "fit",
        help="will this config fit the GPU? the worst step's peak memory, counted from the config alone",
        description="Count the worst step's peak memory (every completion at max_completion_length, every row alive) "
        "for stock TRL and grpo_plus, per part; the longest completion and the largest G that fit with every memory "
        "option; settings that make an over-budget config fit. Counted on fake tensors (no GPU, nothing downloaded).",
    )
    fit.add_argument("--config", required=True, help="a recipe config YAML (recipes/configs/*.yaml)")
    fit.add_argument("--memory-gib", type=float, default=24.0, help="the GPU's memory (default: a 24 GB card)")
    fit.add_argument("--reserve-gib", type=float, default=CARD_RESERVE_GIB,
                     help=f"kept for the CUDA context, kernel workspaces and allocator slack (default {CARD_RESERVE_GIB:g})")  # fmt: skip
    fit.add_argument("--prompt-tokens", type=int, default=128, help="the longest prompt, in tokens (default 128)")
    fit.add_argument("--equal-prompts", action="store_true",
                     help="every prompt has the same length (no padding; default: prompts differ, as in most datasets)")  # fmt: skip
    fit.add_argument("--model-config", default=None, help="a config.json for a model grpo_plus does not know")
    fit.add_argument("--images-per-prompt", type=int, default=None,
                     help="vision-language models: pictures per prompt (default 1)")  # fmt: skip
    fit.add_argument("--image-size", type=int, default=None,
                     help="vision-language models: side of the square pictures in pixels, before the processor "
                     "resizes them (default: the config's image_size, else 448: 256 image tokens for Qwen2.5-VL)")  # fmt: skip
    fit.add_argument("--no-groups", action="store_true", help="skip the largest-G search (faster)")
    fit.set_defaults(run=_fit, parser=fit)

    push = commands.add_parser(
        "push",
        help="push a saved LoRA adapter (adapter files, model card, reward plot) to the Hugging Face Hub",
        description="Push the adapter a recipe saved in OUTPUT_DIR, in one commit, as the recipe's --push_to_hub "
        "does (a failed push prints this command with the run's settings). The token comes from HF_TOKEN or "
        "`hf auth login`.",
    )
    push.add_argument("output_dir", metavar="OUTPUT_DIR")
    push.add_argument("--repo-id", required=True, help="namespace/name (or name, in the token owner's namespace)")
    push.add_argument("--private", type=_bool, default=None, help="true/false when creating the repo (default: Hub's)")
    push.add_argument("--revision", default=None, help="branch to commit to (created if missing)")
    push.add_argument("--commit-message", default=DEFAULT_COMMIT_MESSAGE)
    push.set_defaults(run=_push, parser=push)

    serve = commands.add_parser(
        "vllm-serve",
        add_help=False,
        help="serve a model to trainers with vllm_mode='server': TRL's `trl vllm-serve` (the same flags; --help lists "
        "them), on every vLLM build (weights over NCCL on CUDA, over gloo elsewhere)",
    )
    serve.add_argument("serve_args", nargs=argparse.REMAINDER)
    serve.set_defaults(run=_vllm_serve, parser=serve)
    return parser


def reject_unknown_flags(parser: argparse.ArgumentParser, unknown: list[str]) -> None:
    """argparse's 'unrecognized arguments', with the closest flag named, as the recipes do (exits 2)."""
    from ..registry import quoted_with_hint

    flags = [flag.lstrip("-") for action in parser._actions for flag in action.option_strings]
    described = [
        quoted_with_hint(arg[2:].split("=")[0], flags, "--") if arg.startswith("--") else f"'{arg}'" for arg in unknown
    ]
    parser.error(f"unrecognized arguments: {', '.join(described)}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["vllm-serve"]:  # every later argument is TRL's `trl vllm-serve` flags, --help included
        return _vllm_serve(argparse.Namespace(serve_args=argv[1:]))
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:
        reject_unknown_flags(args.parser, unknown)
    try:
        return args.run(args)
    except (ValueError, PluginError, HubAccessError) as error:
        print(f"grpo-plus {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
