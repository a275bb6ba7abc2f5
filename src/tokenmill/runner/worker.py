"""A tensor-parallel worker: one ModelRunner on one rank's shard, stepped by the engine core's messages.

Started by `engine/executor.MultiprocExecutor` (`worker_main`, forked from a multiprocessing forkserver
that has imported this module). It joins the rank group, loads its shard, reports `WorkerReady`, then loops:
`WorkerInitCache` (allocate the KV cache), `WorkerStep` (execute; rank 0 answers with the
ModelRunnerOutput), `WorkerShutdown`. Any failure is reported as `WorkerFailure` before the process
exits non-zero. It dies with the engine core: a thread watches a pipe whose write end only the core holds
and exits the process at EOF, and while idle the loop also checks its parent (the forkserver, which exits
with the core) every second.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import traceback

import msgspec
import zmq

from tokenmill.child_process import start_child_process
from tokenmill.core.sched_output import (
    WorkerFailure,
    WorkerInitCache,
    WorkerInput,
    WorkerReady,
    WorkerShutdown,
    WorkerStep,
    WorkerStepDone,
)
from tokenmill.runner.host_memory import freeze_startup_heap

logger = logging.getLogger("tokenmill")

IDLE_POLL_MS = 1000

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(WorkerInput)


def _exit_with_parent(lifeline) -> None:
    """Exit when the engine core's end of the lifeline pipe closes: it has exited (however it ended: the kernel
    closes its pipes) or given up on us. A thread, so it works while the main thread sits in a step or
    a collective; per process, unlike PR_SET_PDEATHSIG, which fires when the parent *thread* exits."""
    def watch() -> None:
        try:
            while True:
                lifeline.recv_bytes()
        except (EOFError, OSError):
            pass
        os._exit(1)

    threading.Thread(target=watch, name="tokenmill-lifeline", daemon=True).start()


def run_worker(config, rank: int, size: int, store_port: int, input_address: str, output_address: str,
               max_model_len: int, log_level: str, source, draft_source=None) -> None:
    """source: the core's model, for the weights only, as plain data (loader.ModelSource.for_weights);
    draft_source: a draft model's, the same way (speculative decoding), or None."""
    parent = os.getppid()
    channels = start_child_process(f"tp{rank}", log_level, input_address, output_address)
    inputs, outputs = channels.inputs, channels.outputs
    code = 0
    try:
        runner = _load(config, source, draft_source, rank, size, store_port, max_model_len)
        outputs.send(_encoder.encode(WorkerReady(rank, runner.kv_cache_capacity(config),
                                                 runner.kv_spec.bytes_per_block, runner.linear_layers,
                                                 list(runner.kv_layout.windows))))
        freeze_startup_heap()
        _loop(runner, inputs, outputs, parent)
    except BaseException as exc:
        logger.exception("tensor-parallel worker %d failed", rank)
        code = 1
        message = getattr(exc, "message", None) or str(exc) or traceback.format_exc(limit=3)
        try:
            outputs.send(_encoder.encode(WorkerFailure(rank, message, type(exc).__name__)))
        except Exception:
            pass
    finally:
        channels.close()
        sys.stdout.flush()
        os._exit(code)  # no torch.distributed teardown: a peer may be gone


def _load(config, source, draft_source, rank: int, size: int, store_port: int, max_model_len: int):
    import torch

    from tokenmill.distributed.parallel_state import init_tensor_parallel
    from tokenmill.runner.model_runner import ModelRunner, resolve_device

    device = resolve_device(config.device)
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    tp = init_tensor_parallel(rank, size, store_port, device)
    source = source.model_source()
    runner = ModelRunner(config, source.hf_config, source.architecture, device, max_model_len, tp)
    runner.load_checkpoint(source, draft_source.model_source() if draft_source is not None else None)
    return runner


def _loop(runner, inputs: zmq.Socket, outputs: zmq.Socket, parent: int) -> None:
    driver = runner.tp is None or runner.tp.is_driver
    while True:
        if not inputs.poll(IDLE_POLL_MS):
            if os.getppid() != parent:
                logger.warning("the engine core is gone; the worker exits")
                return
            continue
        message = _decoder.decode(inputs.recv())
        if isinstance(message, WorkerShutdown):
            return
        if isinstance(message, WorkerInitCache):
            runner.initialize_kv_cache(message.num_blocks)
            if message.num_host_blocks:
                runner.initialize_host_cache(message.num_host_blocks)
            runner.max_model_len = message.max_model_len
        elif isinstance(message, WorkerStep):
            result = runner.execute(message.scheduler_output)
            if driver:
                outputs.send(_encoder.encode(WorkerStepDone(result)))


def worker_main(lifeline, args: tuple) -> None:
    """The forked worker's entry point: lifeline, the read end of the core's pipe; args, run_worker's."""
    _exit_with_parent(lifeline)
    run_worker(*args)
