"""What the tests observe a run with: forward calls, trained groups, draws, logs and weights, and how they start
training processes (tests/scripts/train_tiny.py, accelerate launch) and kill them."""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from grpo_plus.app.testing import ForwardLog  # noqa: F401  (shared with the benchmarks)
from grpo_plus.run.checkpoints import is_complete_checkpoint

from . import models

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
TRAIN_TINY = str(SCRIPTS / "train_tiny.py")


# ---- in-process probes ---------------------------------------------------------------------------------------------


class GroupRecorder:
    """Wraps a trainer's `_compute_loss` to record what every micro-batch trained on."""

    def __init__(self, trainer, num_generations: int):
        self.batches, self.num_generations = [], num_generations
        original = trainer._compute_loss

        def recording_compute_loss(model, inputs):
            self.batches.append({k: v.detach().clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)})
            return original(model, inputs)

        trainer._compute_loss = recording_compute_loss

    def groups(self):
        """(prompt_ids, advantages) per group of consecutive rows in every recorded micro-batch."""
        g = self.num_generations
        for batch in self.batches:
            for start in range(0, batch["prompt_ids"].shape[0], g):
                yield batch["prompt_ids"][start : start + g], batch["advantages"][start : start + g]


class PoolRecorder:
    """Every handoff of a run's partial-rollout pool (grpo_plus.partial_rollouts), with a copy of the policy's weights
    at each step that generated (`weights[step]`); set `trainer` once the run's trainer is built."""

    def __init__(self, monkeypatch):
        from grpo_plus.partial_rollouts.pool import PartialRollouts

        self.handoffs, self.weights, self.trainer = [], {}, None
        original, recorded = PartialRollouts.generation_batch, self

        def recording(pool, inputs, step, metrics):
            recorded.weights[step] = {k: v.detach().clone() for k, v in recorded.trainer.model.state_dict().items()}
            handoff = original(pool, inputs, step, metrics)
            recorded.handoffs.append(handoff)
            return handoff

        monkeypatch.setattr(PartialRollouts, "generation_batch", recording)


def restore_rows_without_tokens(monkeypatch) -> None:
    """A resumed pool's rows in flight lose their tokens, log-probs and versions (each restarts from its prompt): the
    negative control of resuming with rows in flight."""
    from grpo_plus.partial_rollouts.pool import PartialRollouts

    load = PartialRollouts.load_state_dict

    def without_tokens(pool, state):
        load(pool, state)
        for row in (row for group in pool.groups for row in group.rows if not row.finished):
            row.tokens, row.logps, row.versions = [], [], []

    monkeypatch.setattr(PartialRollouts, "load_state_dict", without_tokens)


def record_trained_batches(trainer) -> list[tuple[int, dict]]:
    """Wraps the trainer's `_compute_loss`: the returned list receives (optimizer step being trained, the micro-batch's
    tensors, on CPU) for every micro-batch of the training pass."""
    trained = []
    compute_loss = trainer._compute_loss

    def recording_compute_loss(model, inputs):
        batch = {k: v.detach().cpu().clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)}
        trained.append((trainer.state.global_step + 1, batch))
        return compute_loss(model, inputs)

    trainer._compute_loss = recording_compute_loss
    return trained


def record_score_rounds(trainer) -> list[list[dict]]:
    """Wraps the trainer's `_score_round`: the returned list receives the rows of every generation round it scores."""
    rounds = []
    score_round = trainer._score_round

    def recording_score_round(inputs):
        rounds.append(inputs)
        return score_round(inputs)

    trainer._score_round = recording_score_round
    return rounds


def record_draws(trainer, on_draw=None) -> list:
    """Wraps the trainer's selective-rollout selector: the returned list receives every draw, as it is made (then
    `on_draw(draw)` is called)."""
    draws, selector = [], trainer._selective_rollout
    draw = selector.draw

    def recording_draw(num_prompts):
        result = draw(num_prompts)
        draws.append(result)
        if on_draw is not None:
            on_draw(result)
        return result

    selector.draw = recording_draw
    return draws


def logged(trainer, key: str) -> list:
    """The values of `key` in the trainer's log history, in order."""
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def sampling_metric(entry: dict, name: str):
    """TRL's `sampling/*` metric `name` in a log entry, or where grpo_plus logged it over the rows its training forward
    computed (on-policy, zero-advantage rows left out: `sampling/trained_rows/*`); None where neither is."""
    return entry.get(name, entry.get(name.replace("sampling/", "sampling/trained_rows/", 1)))


def logged_sampling(trainer, name: str) -> list:
    """`sampling_metric` of every log entry of the trainer that has it, in order."""
    values = (sampling_metric(entry, name) for entry in trainer.state.log_history)
    return [value for value in values if value is not None]


def record_policy_weights(monkeypatch) -> list[dict]:
    """Every call of grpo_plus's trainer's `compute_policy_loss` (its micro-batch loss's): its log-probs, old log-probs,
    mask and policy weights (the sampler correction's ratio or weights, times any other weight)."""
    import grpo_plus.algorithms.micro_batch_loss
    from grpo_plus import compute_policy_loss

    calls = []

    def recording(logps, old_logps, advantages, mask, **kwargs):
        weights = kwargs.get("policy_weights")
        weights = None if weights is None else weights.detach().cpu().clone()
        calls.append(
            dict(
                logps=logps.detach().cpu().clone(),
                old=old_logps.cpu().clone(),
                mask=mask.cpu().clone(),
                weights=weights,
            )
        )
        return compute_policy_loss(logps, old_logps, advantages, mask, **kwargs)

    monkeypatch.setattr(grpo_plus.algorithms.micro_batch_loss, "compute_policy_loss", recording)
    return calls


def trl_sampling_metrics(batches: list[dict], mode: str, rows=None) -> dict[str, float]:
    """TRL's `sampling/*` metrics of one generation batch (its micro-batches as stock TRL trained them, one process),
    written from TRL's description: |old - sampler| log-prob over the completion tokens the sampler scored (mean, max),
    the importance-sampling ratio over those tokens (token modes) or the sequences (min, mean, max). `rows(batch)`:
    the (B,) rows to cover (None: every row)."""
    deltas, ratios = [], []
    for batch in batches:
        keep = torch.ones(batch["completion_mask"].shape[0], dtype=torch.bool) if rows is None else rows(batch)
        mask = batch["completion_mask"].bool() & keep[:, None]
        delta = (batch["old_per_token_logps"] - batch["sampling_per_token_logps"]).abs()
        deltas.append(delta[mask & ~delta.isnan()])
        ratio = batch["importance_sampling_ratio"]
        ratios.append(ratio[keep].flatten() if mode.startswith("sequence") else ratio[mask])
    delta, ratio = torch.cat(deltas).double(), torch.cat(ratios).double()
    return {
        "sampling/sampling_logp_difference/mean": delta.mean().item(),
        "sampling/sampling_logp_difference/max": delta.max().item(),
        "sampling/importance_sampling_ratio/min": ratio.min().item(),
        "sampling/importance_sampling_ratio/mean": ratio.mean().item(),
        "sampling/importance_sampling_ratio/max": ratio.max().item(),
    }


@contextmanager
def kept_unchanged(folder: str | Path, what: str):
    """Asserts that no file under `folder` was added, removed or changed in the block: for what fixtures share
    between tests (a test that wrote there would make the others depend on test order)."""

    def digests() -> dict[str, str]:
        files = sorted(p for p in Path(folder).rglob("*") if p.is_file())
        return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}

    before = digests()
    yield
    assert digests() == before, f"a test changed {what} in {folder}, which other tests share"


def max_weight_diff(a: dict, b: dict) -> float:
    """Largest |a - b| over the tensors of `a` (state dicts or weight files)."""
    return max((a[k] - b[k]).abs().max().item() for k in a)


class RowSeededSampler:
    """Logits processor: Gumbel-max sampling whose noise depends only on (seed, call, global row, position).

    Two runs that split the same generation batch differently across processes (or micro-batches) then draw
    identical completions, so their training can be compared weight for weight.
    """

    def __init__(self, seed: int, row_offset: int = 0):
        self.seed, self.row_offset, self.calls = seed, row_offset, 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        chosen = []
        for row in range(scores.shape[0]):
            generator = torch.Generator().manual_seed(
                hash((self.seed, self.calls, self.row_offset + row, input_ids.shape[1])) % (2**31)
            )
            uniform = torch.rand(scores.shape[1], generator=generator).clamp(1e-10, 1 - 1e-10)
            chosen.append(torch.argmax(scores[row].float() - torch.log(-torch.log(uniform))))
        one_hot = torch.full_like(scores, float("-inf"))
        one_hot[torch.arange(scores.shape[0]), torch.stack(chosen)] = 0.0
        return one_hot


def use_row_seeded_sampling(model, seed: int, row_offset: int = 0) -> RowSeededSampler:
    """Make `model.generate` sample with a RowSeededSampler (after TRL's temperature/top-k processors)."""
    sampler = RowSeededSampler(seed, row_offset)
    original_generate = model.generate

    def generate(*args, **kwargs):
        config = kwargs.get("generation_config")
        if config is None or config.do_sample:  # greedy decoding (ReMax's baseline) stays argmax
            kwargs["logits_processor"] = [*kwargs.get("logits_processor", []), sampler]
        try:
            return original_generate(*args, **kwargs)
        finally:
            sampler.calls += 1

    model.generate = generate
    return sampler


# ---- training processes --------------------------------------------------------------------------------------------


def accelerate_launch(num_processes: int = 2, config_file: str | Path | None = None) -> list[str]:
    """`accelerate launch` for several CPU processes: with `config_file` (e.g. a shipped DeepSpeed config) as it says;
    without, over gloo: --multi_gpu starts torchrun's launcher, which falls back to CPU (--cpu would run a single
    process). On a free port, not torchrun's 29500: CI runs the engine tests beside make test-vllm, whose colocated
    engines take 29500 when it is free (TRL's `ensure_master_addr_port`)."""
    accelerate = str(Path(sys.executable).parent / "accelerate")
    port = ["--main_process_port", str(free_port())]
    if config_file is not None:
        return [accelerate, "launch", "--config_file", str(config_file), "--num_processes", str(num_processes),
                "--mixed_precision", "no", *port]  # fmt: skip
    return [accelerate, "launch", "--multi_gpu", "--num_processes", str(num_processes), "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no", *port]  # fmt: skip


def free_port() -> int:
    """A TCP port free now on this machine (the system's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_python(*args, launcher=None, env=None, cwd=None, timeout: float = 300, check: bool = True):
    """Run `python *args` (or `*launcher, *args`, e.g. accelerate_launch(2)) to its end and return the completed
    process; with `check`, it must have exited 0."""
    command = [*(launcher or [sys.executable]), *map(str, args)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    if check:
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]
    return result


def train_tiny_flags(model_dir, output_dir, *, omit=(), **overrides) -> list[str]:
    """tests/scripts/train_tiny.py's command line for the model saved in `model_dir`, trained with
    tiny_run_kwargs(output_dir, **overrides) less the fields in `omit`."""
    settings = models.tiny_run_kwargs(output_dir, **overrides)
    for key in ("disable_tqdm", *omit):
        settings.pop(key)
    flags = ["--model_dir", str(model_dir)]
    for key, value in settings.items():
        flags += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    return flags


def kill_after_checkpoint(command: list[str], checkpoint: Path, timeout: float = 240) -> str:
    """Run `command`, SIGKILL it as soon as `checkpoint` is complete (kill -9: no cleanup, no crash handler); returns
    what it printed."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout
    while not is_complete_checkpoint(checkpoint):
        assert process.poll() is None, process.stdout.read()[-3000:]
        assert time.monotonic() < deadline, f"no {checkpoint.name} in time"
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    output, _ = process.communicate()
    assert process.returncode == -signal.SIGKILL
    return output


# Partial rollouts on two processes (tests/test_partial_rollouts_processes.py, tests/vllm_engine/test_partial_processes.py):
# per process and step 2 groups of 4, completions of at most 12 tokens decoded 3 at a time, SGD: rows carry across
# steps and every step's weights differ. 16 prompts: the 4 steps are one epoch (a resume inside an epoch is exact).
PARTIAL_PROCESSES = dict(
    per_device_train_batch_size=8, num_generations=4, max_completion_length=12, temperature=0.7, optim="sgd",
    learning_rate=0.5, max_steps=4, seed=3, partial_rollout_tokens=3, save_strategy="steps", save_steps=1,
)  # fmt: skip


def launch_partial_rollouts(
    model_dir, output_dir, *flags, resume: bool = False, forget: bool = False, env=None, deepspeed: Path | None = None
):
    """tests/scripts/train_tiny.py with PARTIAL_PROCESSES (and `flags`) on 2 processes, DDP or under the DeepSpeed
    config `deepspeed` (its CPU accelerator over gloo): the final weights and each rank's generation batches.
    `forget`: the resumed pools' rows in flight lose their tokens (the negative control)."""
    from safetensors.torch import load_file

    omit = ("use_cpu",) if deepspeed is not None else ()  # DeepSpeed's CPU accelerator: not accelerate's CPU mode
    args = [*train_tiny_flags(model_dir, output_dir, omit=omit, **PARTIAL_PROCESSES), "--num_prompts", "16", *flags]
    args += ["--dump_weights", f"{output_dir}.safetensors", "--record_generated", f"{output_dir}.generated"]
    args += [*(["--resume"] if resume else []), *(["--forget_rows_in_flight"] if forget else [])]
    if deepspeed is not None:
        args, env = [*args, "--ddp_backend", "gloo"], {**(env or os.environ), "DS_ACCELERATOR": "cpu"}
    result = run_python(TRAIN_TINY, *args, launcher=accelerate_launch(2, config_file=deepspeed), env=env, timeout=900)
    assert result.stdout.count("FINISHED") == 2, result.stdout[-2000:]
    if deepspeed is not None:
        assert result.stdout.count("engine=DeepSpeedEngine") == 2, "the run did not train under DeepSpeed"
    return {
        "weights": load_file(f"{output_dir}.safetensors"),
        "generated": [torch.load(f"{output_dir}.generated.rank{rank}", weights_only=True) for rank in (0, 1)],
    }


def check_partial_rollouts_processes(whole: dict, checkpoint: Path) -> None:
    """Each rank's generation batches are 2 whole groups (4 rows of one prompt each), the ranks generated apart, and
    at `checkpoint` both ranks' pools (each in its own file) hold rows in flight, and differ."""
    from grpo_plus.run.state import PROCESS_FILE

    for rank in (0, 1):
        assert len(whole["generated"][rank]) == PARTIAL_PROCESSES["max_steps"]
        for batch in whole["generated"][rank]:
            groups = batch["prompt_ids"].view(2, 4, -1)
            assert torch.equal(groups, groups[:, :1].expand_as(groups)) and not torch.equal(groups[0], groups[1])
    first, second = whole["generated"]
    assert not torch.equal(first[0]["completion_ids"], second[0]["completion_ids"]), "the ranks generated alike"
    pools = [
        torch.load(checkpoint / PROCESS_FILE.format(rank), weights_only=True)["parts"]["partial_rollouts"]
        for rank in (0, 1)
    ]
    for rank, pool in enumerate(pools):
        rows = [row for g in pool["groups"] for row in g["rows"]]
        assert any(not row["finished"] and row["tokens"] for row in rows), f"rank {rank}: no row in flight"
    assert pools[0]["groups"] != pools[1]["groups"], "the two processes' pools are one pool"


def same_later_completions(whole: dict, resumed: dict, first_step: int) -> None:
    """Each rank of `resumed` generated the completions `whole` generated from step `first_step` on."""
    for rank in (0, 1):
        later = whole["generated"][rank][first_step:]
        assert len(resumed["generated"][rank]) == len(later), rank
        for ours, theirs in zip(resumed["generated"][rank], later, strict=True):
            assert torch.equal(ours["completion_ids"], theirs["completion_ids"]), rank
