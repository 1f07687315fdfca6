"""Asynchronous generation with a vLLM server: the server generates the next generation batches while the trainer
trains on the current one (`async_generation=True`).

TRL's loop asks for a generation batch when it needs it (`VLLMGeneration.generate`, after `sync_weights` when the step
changed), and while the server generates the trainer waits. Here, at generation k the server has already been asked
for batches k+1 .. k+d (d = `max_staleness - weight_sync_steps + 1`), each with the weights it held when asked: the
prompts come from `PromptLookahead`, a second pass over the trainer's own sampler, checked against the prompts TRL's
loop then hands over (a difference raises). Requests run one at a time on one background thread; a weight sync waits
for the request in flight, so the server's weights never change under a request. Batch k is then generated with the
weights of the last sync at or before step k - max_staleness: the same completions, losses and weights as TRL's
synchronous loop given an engine that lags that far (the oracle in tests/vllm_engine/test_async_generation.py).

TRL's sampler correction (`vllm_importance_sampling_correction`, its default) or verl's (`rollout_correction`)
corrects the off-policy batches from the sampler's log-probs, as it corrects a mismatched engine; nothing else
changes. Metrics: `async/staleness` (optimizer steps between a batch's weights and the step it is trained in),
`async/trainer_wait_seconds` (the trainer blocked on generation), `async/engine_wait_seconds` (the server idle
between two requests: waiting for weights), `async/dropped_batches`.

Several trainer processes (DDP): every process reads its share of the prompts ahead and gathers them (collectively,
in the order TRL's generation gathers its own); the main process asks the server for the whole batch and TRL's loop
hands each process its share, as it does in the synchronous loop.

A checkpoint holds the batches already generated for later steps (`state_dict`; a regular checkpoint waits for the
request in flight first, `finish_requests`), so a resumed run trains the very batches the uninterrupted run trains.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from ..engine.reload import SyncCheckError
from ..run.distributed import DATA_PARALLEL
from ..run.state import RandomState
from .settings import AsyncGenerationSettings

logger = logging.getLogger(__name__)

METRICS = ("staleness", "trainer_wait_seconds", "engine_wait_seconds", "dropped_batches")


class AsyncGenerationError(RuntimeError):
    """Asynchronous generation cannot give the trainer the batch it asked for."""


class PromptLookahead:
    """The trainer's generation batches ahead of its loop: a second dataloader built like the trainer's (TRL's
    RepeatSampler, seeded the same) read over epochs as transformers' loop reads its own (one dataloader, one pass
    per epoch), every `generate_every`-th batch (TRL generates at those)."""

    def __init__(self, make_dataloader: Callable[[], Any], generate_every: int):
        self._make_dataloader = make_dataloader
        self._generate_every = generate_every
        self._dataloader: Any = None
        self._batches: Iterator[list[dict[str, Any]]] | None = None

    def _stream(self) -> Iterator[list[dict[str, Any]]]:
        while True:
            position = -1
            for position, batch in enumerate(self._dataloader):
                if position % self._generate_every == 0:
                    yield batch
            if position < 0:
                raise AsyncGenerationError("the training dataloader is empty: there is no batch to generate ahead")

    def next_batch(self) -> list[dict[str, Any]]:
        """The rows of the next generation batch (this process's). The global random generators are left as they
        were: starting a dataloader's pass draws its base seed from torch's, which TRL's loop then draws from (the
        shuffle of each generation batch)."""
        with _generators_untouched():
            if self._batches is None:
                self._dataloader = self._make_dataloader()
                self._batches = self._stream()
            return next(self._batches)

    def resume_at(self, generations_done: int, skip_data: bool) -> None:
        """Start where a resumed run's loop starts: transformers builds a new dataloader and skips the batches of the
        current epoch already trained (none with `ignore_data_skip`), so the sampler starts afresh at that epoch."""
        with _generators_untouched():
            self._dataloader = self._make_dataloader()
            self._batches = self._stream()
            per_epoch = max(1, len(self._dataloader) // self._generate_every)
        for _ in range(generations_done % per_epoch if skip_data else 0):
            self.next_batch()


@contextlib.contextmanager
def _generators_untouched() -> Iterator[None]:
    """Every global random generator as it was on entry, on exit."""
    generators = RandomState()
    drawn_before = generators.state_dict()
    try:
        yield
    finally:
        generators.load_state_dict(drawn_before)


class RequestThread:
    """One daemon thread that runs the server requests in order (a request stalled on a dead server neither blocks
    the interpreter's exit, as a ThreadPoolExecutor's worker would, nor lets a later one overtake it)."""

    def __init__(self, name: str):
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, function: Callable[[], Any]) -> Future:
        future: Future = Future()
        self._queue.put((future, function))
        return future

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            future, function = item
            del item  # while it waits for the next request, the thread holds nothing of the last one (its trainer)
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(function())
                except BaseException as error:  # handed to the trainer, which waits on the future
                    future.set_exception(error)
            del future, function

    def close(self) -> None:
        self._queue.put(None)


@dataclass
class Batch:
    """A generation batch asked of the server: its prompts (every process's, one per group), the weights' version
    (optimizer steps) it is generated with, and its result once there."""

    index: int
    version: int
    prompts: list[list[int]]
    future: Future | None = None
    engine_wait: float = 0.0


class AsyncGeneration:
    """The pipeline of generation batches (see the module docstring). `install` wraps the `VLLMGeneration`'s
    `sync_weights` and `generate` (every process) and its client's `generate` (the main process's)."""

    checkpoint_name = "async_generation"
    checkpoint_scope = "process"  # the main process holds the batches; the others only their position
    checkpoint_missing_ok = True  # a checkpoint without them (written synchronously): the server is asked afresh

    def __init__(
        self,
        settings: AsyncGenerationSettings,
        generation: Any,
        lookahead: PromptLookahead,
        tokenize: Callable[[list[Any]], list[list[int]]],
        gather: Callable[[list[Any]], list[Any]],
        global_step: Callable[[], int],
        training: Callable[[], bool],
        metrics: Callable[[], dict[str, list[float]]],
        server_timeout: float,
        skip_data: bool = True,
    ):
        self.settings = settings
        self._generation = generation
        self._lookahead = lookahead
        self._tokenize = tokenize
        self._gather = gather
        self._global_step = global_step
        self._training = training
        self._metrics = metrics
        self._timeout = server_timeout
        self._skip_data = skip_data
        self._failure: AsyncGenerationError | None = None  # set once a request failed: nothing waits on the server
        self._client = getattr(generation, "vllm_client", None)  # the main process's; None on the others
        self._requests: RequestThread | None = None  # started at the first request, stopped by `close`
        self._lock = threading.Lock()
        self._batches: dict[int, Batch] = {}  # asked for (main process), by generation index
        self._prompts: dict[int, list[list[int]]] = {}  # read ahead, every process's prompts, by generation index
        self._next_index = 0  # the generation TRL's loop asks for next
        self._current = 0  # the generation being asked for
        self._read_up_to = -1  # the last generation index read ahead
        self._synced_version: int | None = None  # the optimizer steps in the server's weights
        self._engine_free_since: float | None = None
        self._sync_weights = generation.sync_weights
        self._generate = generation.generate
        self._client_generate = None if self._client is None else self._client.generate

    def install(self) -> AsyncGeneration:
        self._generation.sync_weights = self.sync_weights
        self._generation.generate = self.generate
        return self

    def _hook_client(self) -> None:
        """The client's `generate` through the pipeline, until `close`: TRL registers the client's
        `close_communicator` with atexit, so a hook left on it would keep the pipeline, and the trainer, for ever."""
        if self._client is not None and "generate" not in vars(self._client):
            self._client.generate = self.client_generate

    # ---- the hooks ---------------------------------------------------------------------------------------------------

    def sync_weights(self) -> None:
        """TRL's sync (as grpo_plus checks it), every `weight_sync_steps` optimizer steps, after the request in flight."""
        if self._failure is not None:  # the server stopped answering: a sync would wait on it for ever
            raise self._failure
        version = self._global_step()
        if self._synced_version is not None and version % self.settings.weight_sync_steps != 0:
            return  # not due: the server keeps the weights of the last sync
        if self._synced_version == version:
            return
        self.finish_requests()
        try:
            self._sync_within_timeout(version)
        except (SyncCheckError, AsyncGenerationError):
            raise
        except Exception as error:  # the server's end of the sync: HTTP, the weight-transfer group
            self._failure = self._server_failure(f"failed the weight sync of step {version}", error)
            raise self._failure from error
        self._synced_version = version

    def _sync_within_timeout(self, version: int) -> None:
        """TRL's sync; on the main process it runs on the request thread and is waited for at most the server timeout
        (TRL's client waits on a stalled server for ever). A sync that times out stays blocked on its thread (a
        daemon): the trainer stops."""
        if self._client is None:  # another process: no request to the server
            self._sync_weights()
            return
        future = self._request_thread().submit(self._sync_weights)
        try:
            future.result(timeout=self._timeout)
        except FutureTimeout:
            problem = (
                f"has not finished the weight sync of step {version} in {self._timeout:g} s (vllm_server_timeout)"
            )
            self._failure = self._server_failure(problem, None)
            raise self._failure from None

    def _request_thread(self) -> RequestThread:
        if self._requests is None:
            self._requests = RequestThread("grpo_plus-async-generation")
        return self._requests

    def generate(self, prompts, images, num_generations, profiler=None):
        """TRL's `VLLMGeneration.generate` (every process), the prompts of the batches ahead read and gathered first."""
        if not self._training():  # evaluation: TRL's, with the server's weights, after the request in flight
            self.finish_requests()
            return self._generate(prompts=prompts, images=images, num_generations=num_generations, profiler=profiler)
        if images is not None and any(image is not None for image in images):
            raise AsyncGenerationError(
                "async_generation does not take image prompts yet: set async_generation=False for this dataset"
            )
        if self._read_up_to < 0 and (done := self._global_step()) > 0:  # a resumed run: skip the steps trained
            self._lookahead.resume_at(done, self._skip_data)
            self._next_index, self._read_up_to = done, done - 1
        index = self._current = self._next_index
        self._next_index += 1
        self._hook_client()
        while self._read_up_to < index + self.settings.batches_ahead:
            self._read_up_to += 1
            rows = self._lookahead.next_batch()
            ids = self._tokenize([row["prompt"] for row in rows])
            self._prompts[self._read_up_to] = self._gather(ids)[::num_generations]
        return self._generate(prompts=prompts, images=images, num_generations=num_generations, profiler=profiler)

    def client_generate(self, prompts, features=None, **sampling) -> dict[str, Any]:
        """The main process's request for generation batch `index`: its result, asked for ahead if it was, then the
        batches up to `index + d` asked for with the server's weights."""
        if not self._training():
            return self._client_generate(prompts=prompts, features=features, **sampling)
        index = self._current
        expected = self._prompts.pop(index, None)
        if expected is not None and [list(p) for p in prompts] != expected:
            raise AsyncGenerationError(
                f"generation batch {index}: the prompts TRL's loop hands over are not those read ahead from the "
                "trainer's sampler (a dataloader that does not repeat its order, e.g. one re-seeded per epoch): "
                "set async_generation=False"
            )
        version = self._global_step()
        batch = self._batches.pop(index, None)
        dropped = 0
        if batch is not None and version - batch.version > self.settings.max_staleness:
            dropped, batch = 1, None  # never trained on: generated again with the server's weights
        if batch is None:
            batch = self._request(index, [list(p) for p in prompts], sampling)
        started = time.perf_counter()
        result = self._result(batch)
        waited = time.perf_counter() - started
        for ahead in range(index + 1, index + self.settings.batches_ahead + 1):
            if ahead not in self._batches and ahead in self._prompts:
                self._batches[ahead] = self._request(ahead, self._prompts[ahead], sampling)
        self._log(version - batch.version, waited, batch.engine_wait, dropped)
        return result

    # ---- requests ----------------------------------------------------------------------------------------------------

    def _request(self, index: int, prompts: list[list[int]], sampling: dict[str, Any]) -> Batch:
        batch = Batch(index, self._synced_version or 0, prompts)

        def run() -> dict[str, Any]:
            with self._lock:
                if self._engine_free_since is not None:
                    batch.engine_wait = max(0.0, time.perf_counter() - self._engine_free_since)
            try:
                return self._client_generate(prompts=prompts, features=None, **sampling)
            finally:
                with self._lock:
                    self._engine_free_since = time.perf_counter()

        batch.future = self._request_thread().submit(run)
        return batch

    def _result(self, batch: Batch) -> dict[str, Any]:
        """The batch's completions, waiting at most the server timeout; a dead or stalled server raises
        AsyncGenerationError naming it and what to do (the trainer writes a crash checkpoint on the way out)."""
        if self._failure is not None:
            raise self._failure
        try:
            return batch.future.result(timeout=self._timeout)
        except FutureTimeout:
            problem = f"has not answered generation batch {batch.index} in {self._timeout:g} s (vllm_server_timeout)"
            error = None
        except Exception as raised:
            problem, error = f"failed generation batch {batch.index}", raised
        self._failure = self._server_failure(problem, error)
        raise self._failure from error

    def _server_failure(self, problem: str, error: BaseException | None) -> AsyncGenerationError:
        url = getattr(self._client, "base_url", None) or "the vLLM server"
        cause = "" if error is None else f" ({type(error).__name__}: {error})"
        return AsyncGenerationError(
            f"The vLLM server at {url} {problem}{cause}: it has stopped or stalled. Restart it (`grpo-plus "
            "vllm-serve --model ...` as before) and resume from the last checkpoint "
            "(train(resume_from_checkpoint=True)): a checkpoint of the last completed step is written on the way out."
        )

    def finish_requests(self, raise_errors: bool = True, up_to: int | None = None) -> None:
        """Wait for the requests asked of the server (all, or those of generation batches up to `up_to`): a sync
        must not change the weights under one. A dead or stalled server raises AsyncGenerationError
        (`raise_errors=False`: the batch is left out, and asked for again when its step comes)."""
        for index, batch in sorted(self._batches.items()):
            if batch.future is None or (up_to is not None and index > up_to):
                continue
            try:
                self._result(batch)
            except AsyncGenerationError:
                if raise_errors:
                    raise
                del self._batches[index]

    def _log(self, staleness: int, trainer_wait: float, engine_wait: float, dropped: int) -> None:
        metrics = self._metrics()
        for name, value in zip(METRICS, (staleness, trainer_wait, engine_wait, dropped), strict=True):
            metrics[f"async/{name}"].append(float(value))

    def close(self) -> None:
        """Stop the request thread once the requests asked are done (a later request starts another), and take the
        hook off the client."""
        if self._requests is not None:
            self._requests.close()
            self._requests = None
        if self._client is not None:
            vars(self._client).pop("generate", None)

    # ---- checkpoints (grpo_plus.run.state's protocol) ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The batches generated for later steps with their results (those still in flight are left out: a resumed
        run asks for them again, with the resumed weights), and the server's weights' version. The batch the next
        step trains is waited for first: the trainer waits for it next anyway, so a crash checkpoint of this step
        holds it (with max_staleness=1, every batch generated ahead)."""
        self.finish_requests(raise_errors=False, up_to=self._global_step())
        kept = []
        for batch in sorted(self._batches.values(), key=lambda b: b.index):
            if batch.future is not None and batch.future.done() and batch.future.exception() is None:
                kept.append(
                    {"index": batch.index, "version": batch.version, "prompts": batch.prompts,
                     "result": batch.future.result(), "engine_wait": batch.engine_wait}
                )  # fmt: skip
        return {"version": 1, "synced_version": self._synced_version, "batches": kept}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != 1:
            raise ValueError(f"async_generation: a checkpoint state of version {state.get('version')} (1 expected)")
        self._synced_version = None  # the resumed trainer's first sync loads its weights into the server
        self._batches = {}
        for saved in state["batches"]:
            future: Future = Future()
            future.set_result(saved["result"])
            self._batches[saved["index"]] = Batch(
                saved["index"], saved["version"], saved["prompts"], future, saved["engine_wait"]
            )


def trainer_blocker(
    num_processes: int,
    distributed_type: str,
    generate_every: int,
    gradient_accumulation_steps: int,
    tools: bool,
    rollout_func: bool,
) -> str | None:
    """Why the trainer TRL built cannot generate asynchronously, or None."""
    if num_processes > 1 and distributed_type not in DATA_PARALLEL:
        return (
            f"async_generation over several processes runs with DDP (accelerate's {' / '.join(DATA_PARALLEL)}), "
            f"not {distributed_type}: sharded weights (DeepSpeed, FSDP) are gathered for each sync collectively, and "
            "that path is not tested with requests in flight yet. Launch with DDP, or set async_generation=False"
        )
    if generate_every != gradient_accumulation_steps:
        return (
            "async_generation needs one generation batch per optimizer step (steps_per_generation x num_iterations "
            f"= {generate_every}, gradient_accumulation_steps = {gradient_accumulation_steps}): staleness is "
            "counted in optimizer steps. Leave steps_per_generation unset and num_iterations=1, or set "
            "async_generation=False"
        )
    if tools or rollout_func:
        return (
            f"async_generation does not run a {'tool loop' if tools else 'rollout_func'} (each turn's request "
            "depends on the last one's answer): set async_generation=False"
        )
    return None
