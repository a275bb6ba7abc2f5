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

import zmq

from tokenmill.child_process import start_child_process
from tokenmill.engine.messages import (EngineCoreAbort, EngineCoreFailure, EngineCoreFork, EngineCoreRequest,
                                       EngineCoreShutdown, decode_input, encode)

logger = logging.getLogger("tokenmill")

IDLE_POLL_MS = 1000


def run_engine_core(config, input_address: str, output_address: str, log_level: str = "INFO") -> None:
    """Process entry point (started by core_client.MPClient as `python -m tokenmill.engine.core_proc`)."""
    channels = start_child_process("core", log_level, input_address, output_address)
    inputs, outputs = channels.inputs, channels.outputs
    parent = os.getppid()
    code = 0
    core = None
    try:
        from tokenmill.engine.engine_core import EngineCore

        try:
            core = EngineCore(config)
        except BaseException as exc:
            outputs.send(encode(EngineCoreFailure(getattr(exc, "message", None) or str(exc),
                                                  type(exc).__name__)))
            code = 1
            return
        # The frontend builds its tokenizer from this message: it never loads the model itself.
        outputs.send(encode(core.ready_message(with_tokenizer=True)))
        code = _busy_loop(core, inputs, outputs, parent)
    except BaseException:
        logger.exception("the engine core failed")
        try:
            outputs.send(encode(EngineCoreFailure("the engine core failed: " + traceback.format_exc(limit=3))))
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


def _busy_loop(core, inputs: zmq.Socket, outputs: zmq.Socket, parent: int) -> int:
    while True:
        changed = False
        timeout = 0 if core.has_unfinished_requests() else IDLE_POLL_MS
        while inputs.poll(timeout):
            message = decode_input(inputs.recv())
            if isinstance(message, EngineCoreShutdown):
                return 0
            _handle(core, message)
            changed = True
            timeout = 0
        if os.getppid() != parent:
            logger.warning("the frontend process is gone; the engine core exits")
            return 1
        if not changed and not core.has_unfinished_requests():
            continue
        # An idle core after an abort still reports, so gauges show the freed blocks.
        outputs.send(encode(core.step()))


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
