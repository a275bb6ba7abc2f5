"""Where the engine core's model runs: in its own process (`UniprocExecutor`, tensor-parallel size 1)
or as N tensor-parallel workers (`MultiprocExecutor`), each a ModelRunner on its shard.

    engine core (this process)                       worker processes (runner/worker.py)
    TCPStore on a free localhost port  ◄── join ──   rank 0 .. N-1: one torch.distributed group
    PUSH ── WorkerStep(SchedulerOutput) ─────────►   PULL  (the same encoded frame to every rank)
    PULL ◄── WorkerStepDone(ModelRunnerOutput) ───   PUSH  (rank 0 only; any rank: WorkerFailure)

Every frame is a msgspec message of `core/sched_output.py`; the workers hold their own input batch,
updated by the same deltas, so their batches agree without ever sending live objects. Waiting for a
worker never blocks without looking: every POLL_MS the executor checks that each worker is alive,
and a dead or failed worker makes `execute` raise (the engine core's fault path then ends every
request). Workers fork from a server process that imported torch and the model code once (multiprocessing's
forkserver, started with the first worker and kept for this process's life), so a worker costs a fork and its
shard's load rather than a fresh interpreter's imports. Workers die with the process that started them (each
watches a pipe from this process, which the kernel closes when this process ends), and `shutdown` asks, then
terminates, then kills them.
"""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import shutil
import tempfile
import time
import weakref
from typing import Optional

import msgspec
import zmq

from tokenmill.config import EngineConfig, usable_cpu_count
from tokenmill.core.sched_output import (
    ModelRunnerOutput,
    SchedulerOutput,
    WorkerFailure,
    WorkerInitCache,
    WorkerMessage,
    WorkerReady,
    WorkerShutdown,
    WorkerStep,
    WorkerStepDone,
)
from tokenmill.errors import EngineDeadError, EngineFailedError, ModelLoadError
from tokenmill.runner.host_memory import MemoryReport, process_rss_bytes

logger = logging.getLogger("tokenmill")

POLL_MS = 100  # how often a wait for workers looks at their processes
SHUTDOWN_WAIT_S = 5.0
DEAD_PEER_GRACE_S = 0.5  # after a worker reports a failure, how long to look for a peer that died first

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(WorkerMessage)


class UniprocExecutor:
    """Today's engine: one ModelRunner in the engine core's process."""

    def __init__(self, config: EngineConfig, source, device, max_model_len: int, draft_source=None) -> None:
        from tokenmill.runner.model_runner import ModelRunner

        self.runner = ModelRunner(config, source.hf_config, source.architecture, device, max_model_len)
        self.runner.load_checkpoint(source, draft_source)
        self.linear_layers = self.runner.linear_layers
        self.bytes_per_block = self.runner.kv_spec.bytes_per_block
        self.num_kv_blocks = self.runner.kv_cache_capacity(config)
        self.kv_windows = self.runner.kv_layout.windows

    def initialize_cache(self, num_blocks: int, num_host_blocks: int, max_model_len: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)
        if num_host_blocks:
            self.runner.initialize_host_cache(num_host_blocks)
        self.runner.max_model_len = max_model_len

    def warm_up(self, max_num_batched_tokens: int) -> MemoryReport:
        return self.runner.warm_up(max_num_batched_tokens)

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(output)

    def shutdown(self) -> None:
        pass


def worker_config(config: EngineConfig) -> EngineConfig:
    """A worker's settings: on CPU the workers share the machine, each with its share of the threads."""
    size = config.tensor_parallel_size
    threads = config.num_threads or usable_cpu_count()
    return dataclasses.replace(config, num_threads=max(1, threads // size))


# What a worker imports, imported once by the forkserver its workers fork from: torch, the runner and the model
# code, the loader, and transformers' config classes (the first one imports most of transformers).
WORKER_PRELOAD = ["tokenmill.runner.worker", "tokenmill.runner.model_runner", "tokenmill.model.loader",
                  "transformers.models.llama.configuration_llama"]


def _worker_context() -> multiprocessing.context.BaseContext:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(WORKER_PRELOAD)
    return context


class WorkerProcess:
    """`runner.worker.worker_main` forked from the forkserver, its settings pickled by multiprocessing. It also
    gets the read end of a pipe whose only write end this process holds: its lifeline, which reads EOF, and the
    worker exits, once this process is gone, however it ends (the kernel closes the pipe)."""

    def __init__(self, rank: int, args: tuple) -> None:
        from tokenmill.runner.worker import worker_main

        self.rank = rank
        context = _worker_context()
        lifeline, self._lifeline = context.Pipe(duplex=False)
        self._process = context.Process(target=worker_main, args=(lifeline, args), name=f"tokenmill-tp{rank}")
        self._process.start()
        lifeline.close()

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def exitcode(self) -> Optional[int]:
        return self._process.exitcode

    def is_alive(self) -> bool:
        return self._process.is_alive()

    def stop(self, timeout_s: float) -> None:
        """Wait up to timeout_s for it to exit, then cut its lifeline, then terminate, then kill."""
        for action in (None, self._close_lifeline, self._process.terminate, self._process.kill):
            if action is not None and self.is_alive():
                action()
            self._process.join(timeout_s if action is None else SHUTDOWN_WAIT_S)
            if not self.is_alive():
                break
        self._close_lifeline()

    def kill(self) -> None:
        if self.is_alive():
            self._process.kill()

    def _close_lifeline(self) -> None:
        try:
            self._lifeline.close()
        except OSError:
            pass


def _kill_workers(workers: list[WorkerProcess]) -> None:
    """Last resort (garbage collection, interpreter exit): no worker outlives its executor."""
    for worker in workers:
        worker.kill()


class MultiprocExecutor:
    """N tensor-parallel workers. Construction blocks until every worker has loaded its shard."""

    def __init__(self, config: EngineConfig, source, max_model_len: int, log_level: Optional[str] = None,
                 draft_source=None) -> None:
        """source: the core's loaded model source; each worker gets its config and weights' location (never the
        tokenizer), so none reads the config again; draft_source likewise (a draft model's, run by rank 0)."""
        from tokenmill.distributed.parallel_state import start_store

        size = config.tensor_parallel_size
        self.size = size
        self._store = start_store()  # kept open: the workers rendezvous through it
        self._dir = tempfile.mkdtemp(prefix="tokenmill-tp-")
        self._context = zmq.Context()
        self._inputs: list[zmq.Socket] = []
        for rank in range(size):
            sock = self._context.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(f"ipc://{self._dir}/input-{rank}")
            self._inputs.append(sock)
        self._output = self._context.socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        output_address = f"ipc://{self._dir}/output"
        self._output.bind(output_address)
        level = log_level or logging.getLevelName(logging.getLogger().getEffectiveLevel())
        settings = worker_config(config)
        self.workers = [WorkerProcess(rank, (settings, rank, size, self._store.port, f"ipc://{self._dir}/input-{rank}",
                                             output_address, max_model_len, level,
                                             source.for_weights(),
                                             draft_source.for_weights() if draft_source is not None else None))
                        for rank in range(size)]
        self._finalizer = weakref.finalize(self, _kill_workers, self.workers)
        self._closed = False
        self.failed: Optional[str] = None
        try:
            readies = [self._receive(WorkerReady, loading=True) for _ in range(size)]
        except BaseException:
            self.shutdown()
            raise
        self.num_kv_blocks = min(ready.num_kv_blocks for ready in readies)
        self.bytes_per_block = max(ready.bytes_per_block for ready in readies)
        self.linear_layers = min(readies, key=lambda ready: ready.rank).linear_layers
        self.kv_windows = tuple(readies[0].kv_windows)
        logger.info("tensor parallelism: %d workers (pids %s), %d KV blocks each", size,
                    ", ".join(str(worker.pid) for worker in self.workers), self.num_kv_blocks)

    def _broadcast(self, message) -> None:
        frame = _encoder.encode(message)
        for sock in self._inputs:
            sock.send(frame, copy=False)

    def _receive(self, expected: type, loading: bool = False):
        """The next message of type `expected`, raising if a worker fails or exits meanwhile."""
        while True:
            if self._output.poll(POLL_MS):
                message = _decoder.decode(self._output.recv())
                if isinstance(message, WorkerFailure):
                    self._fail(message, loading)
                if isinstance(message, expected):
                    return message
                continue
            dead = self._dead_worker()
            if dead is not None:
                self.failed = f"tensor-parallel worker {dead.rank} exited with status {dead.exitcode}"
                if loading:
                    # The forkserver's children import the starting script's main module: in a script without a
                    # guard that starts a second engine there, which fails before the worker can report. Other
                    # causes are in the worker's log, which the message points to.
                    self.failed += (" while starting (its log says why; a script that builds the engine at its top "
                                    "level needs an `if __name__ == \"__main__\":` guard)")
                raise EngineDeadError(self.failed)

    def _dead_worker(self, exclude: Optional[int] = None) -> Optional[WorkerProcess]:
        return next((worker for worker in self.workers if worker.rank != exclude and not worker.is_alive()), None)

    def _fail(self, failure: WorkerFailure, loading: bool) -> None:
        """Raise for a worker's failure, naming the root cause: when a peer died, the survivors' collectives
        fail too, and their reports may arrive before the dead process is seen to exit."""
        if failure.error_type == "ModelLoadError":
            self.failed = failure.message
            raise ModelLoadError(failure.message)
        deadline = time.monotonic() + DEAD_PEER_GRACE_S
        dead = self._dead_worker(exclude=failure.rank)  # the reporter exits after its report
        while dead is None and time.monotonic() < deadline:
            time.sleep(POLL_MS / 1000 / 4)
            dead = self._dead_worker(exclude=failure.rank)
        if dead is not None:
            self.failed = f"tensor-parallel worker {dead.rank} exited with status {dead.exitcode}"
            raise EngineDeadError(self.failed)
        self.failed = f"tensor-parallel worker {failure.rank} failed: {failure.message}"
        raise (ModelLoadError if loading else EngineFailedError)(self.failed)

    def initialize_cache(self, num_blocks: int, num_host_blocks: int, max_model_len: int) -> None:
        self._broadcast(WorkerInitCache(num_blocks, num_host_blocks, max_model_len))
        self._num_blocks = num_blocks

    def warm_up(self, max_num_batched_tokens: int) -> MemoryReport:
        """The KV cache every worker holds and the resident memory of this process and the workers; the
        weights, rotary tables and activations live in the workers and are not measured here (reported as 0)."""
        sizes = [process_rss_bytes(worker.pid) for worker in self.workers] + [process_rss_bytes()]
        rss = None if any(size is None for size in sizes) else sum(sizes)
        return MemoryReport(weights=0, buffers=0, kv_cache=self._num_blocks * self.bytes_per_block * self.size,
                            activations=0, rss=rss)

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        if self.failed is not None:
            raise EngineDeadError(self.failed)
        self._broadcast(WorkerStep(output))
        return self._receive(WorkerStepDone).output

    def shutdown(self) -> None:
        """Ask every worker to exit, then terminate and kill whatever is left; release the sockets."""
        if self._closed:
            return
        self._closed = True
        if self.failed is None:
            try:
                self._broadcast(WorkerShutdown())
            except zmq.ZMQError:
                pass
        # After a failure the others may sit in a collective that will never complete: no grace.
        deadline = time.monotonic() + (0.0 if self.failed is not None else SHUTDOWN_WAIT_S)
        for worker in self.workers:
            worker.stop(max(0.0, deadline - time.monotonic()))
        for sock in (*self._inputs, self._output):
            sock.close(0)
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)
        self._finalizer.detach()


def make_executor(config: EngineConfig, source, device, max_model_len: int, draft_source=None):
    """draft_source: a draft model's loaded source (speculative decoding), or None."""
    if config.tensor_parallel_size > 1:
        return MultiprocExecutor(config, source, max_model_len, draft_source=draft_source)
    return UniprocExecutor(config, source, device, max_model_len, draft_source)
