"""The engine core's own process: a busy loop that reads messages, steps, and sends outputs.

    frontend (API process)                    engine-core process
    PUSH ── EngineCoreRequest/Fork/Abort ──►  PULL   ┐
                                                      ├─ drain inputs → EngineCore.step() → outputs
    PULL ◄── EngineCoreOutputs (per step) ──  PUSH   ┘

Both sockets are zmq over ipc; every frame is one msgspec-encoded message. The loop blocks on its
input socket while it has no work (waking every second to check that its parent still lives) and
otherwise steps as fast as the model runs, taking in whatever arrived between steps. A failure
while loading or stepping is reported as EngineCoreFailure before the process exits non-zero.
"""
from __future__ import annotations

import logging
import os
import sys
import traceback
from collections.abc import Sequence

import msgspec
import zmq

from tokenmill.child_process import lower_priority, may_raise_priority, set_niceness, start_child_process
from tokenmill.engine.messages import (
    EngineCoreAbort,
    EngineCoreFailure,
    EngineCoreFork,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreShutdown,
    decode_input,
    encode,
)
from tokenmill.runner.host_memory import freeze_startup_heap

logger = logging.getLogger("tokenmill")

IDLE_POLL_MS = 1000
# Set in an engine core's environment when it loads beside models that serve (see _load_quietly).
LOAD_QUIETLY_ENV = "TOKENMILL_LOAD_QUIETLY"


def run_engine_core(config, input_address: str, output_address: str, log_level: str = "INFO",
                    more_frontends: Sequence[tuple[str, str]] = ()) -> None:
    """Process entry point (started by core_client.MPClient as `python -m tokenmill.engine.core_proc`).
    more_frontends: (input, output) addresses of API servers 1..N-1 under --api-server-count N."""
    channels = start_child_process("core", log_level, input_address, output_address, more_frontends)
    inputs = channels.inputs
    outputs = FrontendOutputs([channels.outputs, *channels.more_outputs])
    parent = os.getppid()
    code = 0
    core = None
    try:
        from tokenmill.engine.engine_core import EngineCore

        try:
            _lower_priority(config)
            serving_niceness = _load_quietly(config)
            core = EngineCore(config)
            if serving_niceness is not None:
                logger.info("loaded; engine core niceness back to %d", set_niceness(serving_niceness))
        except BaseException as exc:
            outputs.send(EngineCoreFailure(getattr(exc, "message", None) or str(exc), type(exc).__name__))
            code = 1
            return
        # The frontend builds its tokenizer from this message: it never loads the model itself.
        outputs.send(core.ready_message(with_tokenizer=True))
        freeze_startup_heap()
        code = _busy_loop(core, inputs, outputs, parent)
    except BaseException:
        logger.exception("the engine core failed")
        try:
            outputs.send(EngineCoreFailure("the engine core failed: " + traceback.format_exc(limit=3)))
        except Exception:
            pass
        code = 1
    finally:
        if core is not None:
            try:
                core.shutdown()  # tensor-parallel workers stop with the core
            except Exception:
                logger.exception("stopping the model's workers failed")
        channels.close()
        sys.stdout.flush()
        os._exit(code)  # no atexit handlers or torch teardown: the frontend is waiting on the exit


def _lower_priority(config) -> None:
    """Before the model loads and torch starts its compute threads (which, like tensor-parallel worker
    processes, inherit the niceness of the thread that starts them)."""
    from tokenmill.config import default_engine_core_nice
    from tokenmill.runner.model_runner import resolve_device

    increment = config.engine_core_nice
    if increment is None:
        increment = default_engine_core_nice(resolve_device(config.device).type)
    if increment:
        logger.info("engine core niceness %d", lower_priority(increment))


def _load_quietly(config) -> "int | None":
    """A model loaded while others serve (LOAD_QUIETLY_ENV set by the server): the load runs at the lowest CPU
    priority (SCHED_IDLE: only on cycles the serving models leave), when the process may come back to its
    niceness afterwards (CAP_SYS_NICE, or RLIMIT_NICE). Returns that niceness, or None when the load runs at
    it."""
    if not os.environ.get(LOAD_QUIETLY_ENV) or config.tensor_parallel_size > 1:
        return None  # tensor-parallel workers started meanwhile would keep the lowest priority
    serving = os.getpriority(os.PRIO_PROCESS, 0)
    if serving >= 19 or not may_raise_priority(serving):
        return None
    logger.info("loading at the lowest CPU priority (SCHED_IDLE, niceness 19) while the server's other models serve")
    set_niceness(19, idle=True)
    return serving


class FrontendOutputs:
    """Where the core's messages go: with one API server, its socket; with several, each request's outputs
    to the server that sent it (forks follow their parent), the scheduler's stats and any ready or failure
    message to every server."""

    def __init__(self, sockets: list[zmq.Socket]) -> None:
        self.sockets = sockets
        self.frontend_of: dict[str, int] = {}  # request ids of servers 1..N-1 (absent: server 0)
        self._unreachable: set[int] = set()

    def note(self, message) -> None:
        if len(self.sockets) == 1:
            return
        if isinstance(message, EngineCoreRequest) and message.frontend:
            ids = [message.request_id, *(child.request_id for child in message.fork_children or ())]
            self.frontend_of.update(dict.fromkeys(ids, message.frontend))
        elif isinstance(message, EngineCoreFork) and message.parent_id in self.frontend_of:
            frontend = self.frontend_of[message.parent_id]
            self.frontend_of.update((child.request_id, frontend) for child in message.children)
        elif isinstance(message, EngineCoreAbort):
            for request_id in message.request_ids:
                self.frontend_of.pop(request_id, None)

    def send(self, message) -> None:
        """A step's EngineCoreOutputs, split by server; anything else to every server."""
        if len(self.sockets) == 1 or not isinstance(message, EngineCoreOutputs):
            frame = encode(message)
            for index in range(len(self.sockets)):
                self._send(index, frame)
            return
        shares: list[list] = [[] for _ in self.sockets]
        for output in message.outputs:
            frontend = self.frontend_of.get(output.request_id, 0)
            if output.finish_reason is not None:
                self.frontend_of.pop(output.request_id, None)
            shares[frontend].append(output)
        for index, share in enumerate(shares):
            self._send(index, encode(msgspec.structs.replace(message, outputs=share)))

    def _send(self, index: int, frame: bytes) -> None:
        """Server 0 owns this process (its death ends the core); a further server that died must not stall
        the core once its queue is full: its messages are dropped instead."""
        if index == 0:
            self.sockets[0].send(frame)
            return
        try:
            self.sockets[index].send(frame, zmq.NOBLOCK)
        except zmq.Again:
            if index not in self._unreachable:
                self._unreachable.add(index)
                logger.error("API server %d does not take the engine core's outputs; dropping them", index)


def _busy_loop(core, inputs: zmq.Socket, outputs: FrontendOutputs, parent: int) -> int:
    while True:
        changed = False
        timeout = 0 if core.has_unfinished_requests() else IDLE_POLL_MS
        while inputs.poll(timeout):
            message = decode_input(inputs.recv())
            if isinstance(message, EngineCoreShutdown):
                return 0
            outputs.note(message)
            _handle(core, message)
            changed = True
            timeout = 0
        if os.getppid() != parent:
            logger.warning("the frontend process is gone; the engine core exits")
            return 1
        if not changed and not core.has_unfinished_requests():
            continue
        # An idle core after an abort still reports, so gauges show the freed blocks.
        outputs.send(core.step())


def _handle(core, message) -> None:
    if isinstance(message, EngineCoreRequest):
        core.add_request(message)
    elif isinstance(message, EngineCoreAbort):
        core.abort(message)
    elif isinstance(message, EngineCoreFork):
        core.fork(message)


if __name__ == "__main__":
    import pickle

    run_engine_core(*pickle.loads(sys.stdin.buffer.read()))
