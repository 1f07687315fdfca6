"""A `grpo-plus vllm-serve` server on the real engine for a test module, and trainers in server mode against it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import trl
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers.models import prompt_dataset, tiny_run_kwargs
from helpers.probes import free_port
from helpers.rewards import odd_prompts_dead_reward

REPO = Path(__file__).resolve().parents[2]
# A server's requests that a loaded engine takes in other steps from one run to the next (n completions split into n
# requests, or one request per row): its float32 log-probs then move at rounding level, the tokens the same. The bound
# for that case; a wrong lag or weight moves them by ~1e-3 (tests/vllm_engine/test_async_generation.py's control).
SERVER_NOISE = 1e-5
START_TIMEOUT = 600


def checkout_env() -> dict[str, str]:
    """The environment with this checkout's grpo_plus first on the path (for the subprocesses)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


class ServerURL(str):
    """A server's base URL, with its process (`process`: the leader of its process group)."""

    process: subprocess.Popen

    def signal(self, number: int) -> None:
        """Send `number` to every process of the server (vLLM's engine core and workers included)."""
        os.killpg(self.process.pid, number)


@contextlib.contextmanager
def running_server(model_dir: str, log_dir: Path, *extra: str) -> Iterator[ServerURL]:
    """`grpo-plus vllm-serve` in a subprocess (the console script's entry point, this checkout's grpo_plus) serving
    `model_dir` in float32, torn down on exit; yields its base URL (a ServerURL)."""
    import requests

    port = free_port()
    log = log_dir / "server.log"
    command = [
        sys.executable, "-c", "import sys; from grpo_plus.app.cli import main; sys.exit(main())",
        "vllm-serve", "--model", model_dir, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--max_model_len", "512", "--enforce_eager", *extra,
    ]  # fmt: skip
    env = checkout_env()
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = ServerURL(f"http://127.0.0.1:{port}")
    url.process = process
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            assert process.poll() is None, f"the server exited ({process.returncode}):\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"the server did not start:\n{log.read_text()[-4000:]}"
            try:
                if requests.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(2)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGCONT)  # a test may have stopped it
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


def server_config(url: str, output_dir, **overrides) -> dict:
    """A seconds-long float32 run in server mode against `url` (its own weight-transfer port), sampling seeded per
    request (`generation_kwargs={"seed": 0}`): the same weights draw the same completions."""
    settings = {"optim": "sgd", "learning_rate": 1e-3, **overrides}
    return tiny_run_kwargs(
        output_dir, use_vllm=True, vllm_mode="server", vllm_server_base_url=str(url), vllm_group_port=free_port(),
        generation_kwargs={"seed": 0}, **settings,
    )  # fmt: skip


def server_trainer(package, model, model_dir, config: dict, peft_config=None, num_prompts: int = 2, reward=None):
    """`package`'s GRPOTrainer in server mode (stock TRL given grpo_plus's gloo client: TRL 1.16's refuses a CPU)."""
    from grpo_plus.engine.server import server_client

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    args = package.GRPOConfig(**config)
    with server_client(args) if package is trl else contextlib.nullcontext():
        return package.GRPOTrainer(
            model=model, processing_class=tokenizer, reward_funcs=[reward or odd_prompts_dead_reward], args=args,
            train_dataset=prompt_dataset(num_prompts), peft_config=peft_config,
        )  # fmt: skip


def float32_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def lag(step: int, max_staleness: int, weight_sync_steps: int) -> int:
    """The step whose weights generate batch `step` (from the definition: asked `max_staleness - weight_sync_steps
    + 1` generations ahead, with the weights of the last sync, syncs every `weight_sync_steps` steps)."""
    ahead = max_staleness - weight_sync_steps + 1
    return 0 if step < ahead else weight_sync_steps * ((step - ahead) // weight_sync_steps)


def lagging_server(trainer, max_staleness: int, weight_sync_steps: int) -> None:
    """The oracle's server: each sync of TRL's synchronous loop loads the weights of step `lag(step)`."""
    generation, model = trainer.vllm_generation, trainer.model
    sync = generation.sync_weights
    history: dict[int, dict[str, torch.Tensor]] = {}

    def trainable() -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}

    def load(weights: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in weights:
                    p.copy_(weights[name])

    def lagged_sync() -> None:
        step = trainer.state.global_step
        history[step] = current = trainable()
        load(history[lag(step, max_staleness, weight_sync_steps)])
        try:
            sync()
        finally:
            load(current)

    generation.sync_weights = lagged_sync
