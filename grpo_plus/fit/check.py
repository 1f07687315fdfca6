"""The trainer's fit check (`GRPOConfig.fit_check`): before step 1 on a CUDA device, the worst step of this run counted
in a child process (`python -m grpo_plus.fit`, `grpo_plus.fit.__main__`) against the device's free memory.

The trainer imports this module alone: it loads no counting code (fake tensors, the counter, the searches), which
runs in the child; the child's answer comes back as JSON (`report_of`, `estimate_from_report`)."""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
from collections.abc import Mapping

import torch

from .results import GIB, PassMemory, StepEstimate
from .spec import FitSpec, image_count_blocker

logger = logging.getLogger(__name__)

# Tensor memory a 24 GB card leaves after the CUDA context, cuBLAS workspaces and allocator slack.
CARD_RESERVE_GIB = 2.0
# When the trainer checks a real device: what max_memory_allocated does not see, kept free on top of the count.
DEFAULT_RESERVE_GIB = 1.0
FRAGMENTATION = 0.05  # share of the counted peak the caching allocator may hold in blocks it cannot reuse


class FitCheckError(RuntimeError):
    """The worst step of this config does not fit the device's free memory (GRPOConfig.fit_check='error')."""


def card_budget(spec: FitSpec, card_bytes: int, reserve_bytes: int) -> int:
    """What the training side may use of a card of `card_bytes`: all of it but the reserve and, with colocated vLLM,
    the engine's share (`vllm_gpu_memory_utilization` of the card's total, which vLLM sizes its KV cache to fill)."""
    return int(card_bytes * (1 - spec.vllm_memory_fraction) - reserve_bytes)


def engine_weights(spec: FitSpec, card_bytes: int) -> tuple[str, int]:
    """(format, bytes) of a colocated vLLM engine's weights on a card of `card_bytes`: bfloat16, or fp8 where
    `vllm_quantization` asks for it or picks it for a 4-bit base ('auto', grpo_plus.engine.precision; a GPU that runs
    vLLM's fp8 assumed)."""
    from ..engine.precision import VLLM_QUANTIZATION_AUTO, quantization_by_memory, served_weight_bytes

    sizes = served_weight_bytes(spec.config())
    chosen = spec.vllm_quantization
    if chosen == VLLM_QUANTIZATION_AUTO:
        engine = spec.vllm_memory_fraction * card_bytes
        chosen = quantization_by_memory(sizes["bfloat16"], engine, fp8_runs=True) if spec.four_bit else None
    return ("fp8", sizes["fp8"]) if chosen == "fp8" else ("bfloat16", sizes["bfloat16"])


def device_budget(device: torch.device, reserve_gib: float = DEFAULT_RESERVE_GIB) -> tuple[int, int]:
    """(bytes the run may still use on `device`: free memory plus what tensors hold now, less the reserve;
    bytes its tensors hold now)."""
    free, _ = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    return int(free + allocated - reserve_gib * GIB), allocated


def fits_message(estimate_: StepEstimate, budget: int, device: str) -> str:
    parts = ", ".join(f"{name} {value / GIB:.2f}" for name, value in estimate_.parts().items())
    return (
        f"the worst step (every completion {estimate_.spec.completion_tokens} tokens, every row alive) needs "
        f"{estimate_.total * (1 + FRAGMENTATION) / GIB:.2f} GiB on {device} ({parts} GiB, plus "
        f"{FRAGMENTATION:.0%} for allocator fragmentation); {budget / GIB:.2f} GiB are there"
    )


def check_fit(spec: FitSpec, budget: int, device: str, mode: str, timeout: float = 600.0) -> StepEstimate | None:
    """The trainer's check before step 1: count the worst step of grpo_plus in a child process (a crash or a hang of
    the count can never take the run down; it runs the fake stand-in accelerator there, CUDA hidden), then warn, or
    raise FitCheckError with `mode="error"`, when it exceeds `budget`, naming settings that would fit. Returns the
    estimate (None when the count could not run: logged, training goes on)."""
    import os
    import resource
    import subprocess

    started = time.perf_counter()
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "grpo_plus.fit", "--budget", str(budget)] + (["--auto"] if mode == "auto" else [])
    try:
        result = subprocess.run(command, input=spec.to_json(), capture_output=True, text=True, timeout=timeout,
                                env=env, check=False)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as error:
        logger.warning("grpo_plus fit check could not run (%s); training goes on unchecked.", error)
        return None
    if result.returncode != 0 or not result.stdout.strip():
        tail = (result.stderr or "").strip().splitlines()[-3:]
        logger.warning("grpo_plus fit check failed (exit %s: %s); training goes on unchecked.", result.returncode,
                       " | ".join(tail))  # fmt: skip
        return None
    report = json.loads(result.stdout.strip().splitlines()[-1])
    estimate_ = estimate_from_report(spec, report)
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = cpu_after.ru_utime + cpu_after.ru_stime - cpu_before.ru_utime - cpu_before.ru_stime
    seconds = time.perf_counter() - started
    estimate_.seconds = (seconds, cpu)
    needed = estimate_.total * (1 + FRAGMENTATION)
    if needed <= budget:
        logger.info("grpo_plus fit check (%.0f s, %.0f s of CPU): %s.", seconds, cpu,
                    fits_message(estimate_, budget, device))  # fmt: skip
        return estimate_
    automatic = report.get("automatic")
    if mode == "auto" and automatic:
        turned_on = estimate_from_report(spec.replace(**automatic["options"]), automatic)
        turned_on.seconds, turned_on.turned_on = estimate_.seconds, dict(automatic["options"])
        names = ", ".join(f"{name}={value!r}" for name, value in automatic["options"].items())
        logger.warning("grpo_plus fit check (fit_check='auto'): %s. Turned on %s: now %.2f GiB (same gradient up to "
                       "float rounding; set them yourself, or fit_check='warn', to choose).",
                       fits_message(estimate_, budget, device), names,
                       turned_on.total * (1 + FRAGMENTATION) / GIB)  # fmt: skip
        return turned_on
    fixes = report.get("suggestions") or []
    advice = (f"Settings that would fit: {'; or '.join(fixes)}." if fixes else
              "No setting grpo_plus offers makes it fit: a smaller model, fewer tokens or a larger GPU.")  # fmt: skip
    message = f"grpo_plus fit check: {fits_message(estimate_, budget, device)}. {advice}"
    if mode == "auto":
        raise FitCheckError(
            f"{message} (fit_check='auto' turns on only tiled_mlp_tokens and activation_offloading, which keep the "
            "gradient, and neither nor both make it fit; 'warn' trains anyway.)"
        )
    if mode == "error":
        raise FitCheckError(message + " (fit_check='warn' trains anyway; 'off' skips the check.)")
    logger.warning("%s Training goes on; it may run out of memory when completions reach the full length.", message)
    return estimate_


def prompt_lengths(dataset, processing_class, sample: int = 256) -> list[int]:
    """The lengths, in tokens, of the prompts among the first `sample` rows of `dataset` (chat prompts through the
    chat template with the generation prompt, as TRL tokenizes them); empty when they cannot be read."""
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    lengths: list[int] = []
    try:
        rows = dataset.select(range(min(sample, len(dataset)))) if hasattr(dataset, "select") else dataset
        for index, row in enumerate(rows):
            if index >= sample:
                break
            prompt = row["prompt"]
            if isinstance(prompt, list):
                ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
                ids = ids["input_ids"] if isinstance(ids, Mapping) else ids  # transformers 5: a BatchEncoding
            else:
                ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            lengths.append(len(ids))
    except Exception as error:  # a dataset or template this cannot read: the check goes on with a typical length
        logger.info("fit check: prompts not measured (%s); assuming 128 tokens of different lengths.", error)
        return []
    return lengths


def prompt_images(dataset, processing_class, sample: int = 256) -> dict:
    """FitSpec's picture fields for the prompts among the first `sample` rows of `dataset` (TRL's "image" or
    "images" column): the most pictures a prompt has, and the size the processor resizes the largest one to (its
    `image_grid_thw` in patches, as pixels); no pictures when there are none or they cannot be read."""
    from ..sampling.dynamic_sampling import image_columns

    columns = image_columns(dataset)
    if not columns:
        return {"images_per_prompt": 0, "image_size": (0, 0)}
    try:
        rows = dataset.select(range(min(sample, len(dataset))))
        per_row = [row["images"] or [] if "images" in columns else [row["image"]] for row in rows]
        pictures = [picture for row in per_row for picture in row if picture is not None]
        if not pictures:
            return {"images_per_prompt": 0, "image_size": (0, 0)}
        largest = max(pictures, key=lambda picture: picture.size[0] * picture.size[1])
        image_processor = processing_class.image_processor
        grid = image_processor(images=[largest], return_tensors="pt")["image_grid_thw"][0].tolist()
        patch = image_processor.patch_size
    except Exception as error:  # pictures or a processor this cannot read: counted without pictures, said so
        logger.warning("grpo_plus fit check: the dataset's pictures not measured (%s); counted without them.", error)
        return {"images_per_prompt": 0, "image_size": (0, 0)}
    return {"images_per_prompt": max(len(row) for row in per_row), "image_size": (grid[1] * patch, grid[2] * patch)}


def check_before_training(args, model, dataset, processing_class, device: torch.device,
                          mode: str, settings=None) -> StepEstimate | None:  # fmt: skip
    """GRPOConfig.fit_check on a CUDA device: the worst step of this trainer against the device's free memory (a
    vision-language model with its vision tower and its prompts' pictures); with fit_check='auto', its `turned_on`
    names the memory settings the trainer must turn on. `settings`: the run's (None: those of `args`)."""
    blocker = image_count_blocker(model.config.to_dict())
    if blocker is not None:
        logger.warning("grpo_plus fit check: %s cannot be counted (%s), so training goes on unchecked "
                       "(fit_check='off' skips this line).", type(model).__name__, blocker)  # fmt: skip
        return None
    lengths = prompt_lengths(dataset, processing_class)
    spec = FitSpec.from_args(args, model, max(lengths, default=128), settings)
    spec = spec.replace(padded_prompts=len(set(lengths)) != 1)
    if spec.vision_language:
        spec = spec.replace(**prompt_images(dataset, processing_class))
    budget, _ = device_budget(device)
    if spec.vllm_memory_fraction:  # the engine, started with the trainer, holds tensors of this process: not ours
        budget -= int(spec.vllm_memory_fraction * torch.cuda.mem_get_info(device)[1])
    return check_fit(spec, budget, str(device), mode)


def memory_settings(args, model, dataset, processing_class, device: torch.device, settings) -> dict:
    """The run's tiled_mlp_tokens and activation_offloading (`settings`: its PlusSettings), with what fit_check='auto'
    turns on (on a CUDA device; fit_check='off' or another device: the settings as given)."""
    chosen = {name: getattr(settings.long_completions, name) for name in ("tiled_mlp_tokens", "activation_offloading")}
    if settings.fit.check != "off" and device.type == "cuda":  # fit_check="auto" may turn more on: logged there
        counted = check_before_training(args, model, dataset, processing_class, device, settings.fit.check, settings)
        chosen |= counted.turned_on if counted is not None else {}
    return chosen


def report_of(result: StepEstimate) -> dict:
    """A count as the child writes it (one JSON line), for `estimate_from_report`."""
    return {"static": result.static, "training": dataclasses.asdict(result.training), "generation": result.generation}


def estimate_from_report(spec: FitSpec, report: dict) -> StepEstimate:
    """The child's count of `spec` (a `report_of` read back), as grpo_plus's StepEstimate."""
    return StepEstimate("grpo_plus", spec, report["static"], PassMemory(**report["training"]), report["generation"])
