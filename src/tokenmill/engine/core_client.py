"""How a frontend reaches its engine core: in-process, or in a process of its own.

Both clients take the same messages (`messages.py`) and return the core's `EngineCoreOutputs`:
- `InprocClient`: the core lives in the caller's process and steps when asked (offline LLM, tests).
  With message_roundtrip every message is encoded and decoded as if it had crossed processes.
- `MPClient`: the core runs `core_proc.run_engine_core` in a spawned process, reached over two zmq
  sockets; a receiver thread hands each decoded output message (or the news of the process's death)
  to a callback. `tokenmill serve` uses it.
"""
from __future__ import annotations

import logging
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Callable, Optional

import zmq

from tokenmill.engine.messages import (
    EngineCoreAbort,
    EngineCoreFailure,
    EngineCoreFork,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    EngineCoreShutdown,
    decode_output,
    encode,
    roundtrip,
)
from tokenmill.errors import EngineDeadError, ModelLoadError

logger = logging.getLogger("tokenmill")

POLL_MS = 100  # how often the receiver looks at the core process while no output arrives


class InprocClient:
    def __init__(self, config, source=None, message_roundtrip: bool = False) -> None:
        from tokenmill.engine.engine_core import EngineCore

        self.core = EngineCore(config, source, message_roundtrip)
        self.ready: EngineCoreReady = self.core.ready_message()
        self._roundtrip = message_roundtrip

    def _send(self, message):
        return roundtrip(message, type(message)) if self._roundtrip else message

    def add_request(self, message: EngineCoreRequest) -> None:
        self.core.add_request(self._send(message))

    def fork(self, message: EngineCoreFork) -> None:
        self.core.fork(self._send(message))

    def abort(self, message: EngineCoreAbort) -> None:
        if message.request_ids:
            self.core.abort(self._send(message))

    def get_output(self) -> EngineCoreOutputs:
        return self._send(self.core.step())

    def shutdown(self) -> None:
        self.core.shutdown()


class CoreProcess:
    """`python -m tokenmill.engine.core_proc`, with multiprocessing.Process's names for what we use."""

    def __init__(self, config, input_address: str, output_address: str, log_level: str,
                 env: Optional[dict[str, str]] = None, more_frontends: Sequence[tuple[str, str]] = ()) -> None:
        self._popen = subprocess.Popen([sys.executable, "-m", "tokenmill.engine.core_proc"], stdin=subprocess.PIPE,
                                       env=env)
        self._popen.stdin.write(pickle.dumps((config, input_address, output_address, log_level,
                                              list(more_frontends))))
        self._popen.stdin.close()

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def exitcode(self):
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def join(self, timeout: Optional[float] = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        if self.is_alive():
            self._popen.terminate()

    def kill(self) -> None:
        if self.is_alive():
            self._popen.kill()


class MPClient:
    """The engine core in a child process. Construction blocks until the model is loaded (unless
    wait=False; then wait_until_ready does)."""

    # API server index stamped on requests (EngineCoreRequest.frontend): 0 for the core's own parent.
    frontend = 0

    def __init__(self, config, log_level: str = "INFO", startup_timeout_s: Optional[float] = None,
                 wait: bool = True, env: Optional[dict[str, str]] = None, api_server_count: int = 1) -> None:
        """env: the core process's environment (default: this process's). api_server_count: API servers
        that talk to this core; this client is server 0, the others attach with `frontend_addresses`."""
        self._dir = tempfile.mkdtemp(prefix="tokenmill-core-")
        self.frontend_addresses = [(f"ipc://{self._dir}/input-{i}", f"ipc://{self._dir}/output-{i}")
                                   for i in range(api_server_count)]
        input_address, output_address = self.frontend_addresses[0]
        self._bind(input_address, output_address)
        # A fresh interpreter, not a fork: the frontend may already run threads (and torch's OpenMP
        # pool). Its settings arrive pickled on stdin.
        self.process = CoreProcess(config, input_address, output_address, log_level, env,
                                   self.frontend_addresses[1:])
        self._start_state()
        if wait:
            self.wait_until_ready(startup_timeout_s)

    @property
    def run_directory(self) -> Optional[str]:
        """A private directory (0700) for this client's sockets, removed at shutdown."""
        return self._dir

    def _bind(self, input_address: str, output_address: str) -> None:
        self._context = zmq.Context()
        self._input = self._context.socket(zmq.PUSH)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.bind(input_address)
        self._output = self._context.socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(output_address)

    def _start_state(self) -> None:
        self._receiver: Optional[threading.Thread] = None
        self._stopping = threading.Event()
        self.dead: Optional[str] = None
        self.ready: Optional[EngineCoreReady] = None

    def wait_until_ready(self, timeout_s: Optional[float] = None) -> EngineCoreReady:
        """Blocks until the core has loaded its model (several cores can load at once: start them all
        with wait=False, then wait for each)."""
        try:
            self.ready = self._wait_ready(timeout_s)
        except BaseException:
            self._stopping.set()
            self._stop_process(0.0)
            self._close()
            raise
        return self.ready

    def _wait_ready(self, timeout_s: Optional[float]) -> EngineCoreReady:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if self._output.poll(POLL_MS):
                message = decode_output(self._output.recv())
                if isinstance(message, EngineCoreReady):
                    return message
                if isinstance(message, EngineCoreFailure):
                    raise ModelLoadError(message.message)
                continue
            if not self.process.is_alive():
                raise EngineDeadError(f"the engine core exited with status {self.process.exitcode} while starting")
            if deadline is not None and time.monotonic() > deadline:
                raise EngineDeadError(f"the engine core did not start within {timeout_s:.0f} s")

    # ---- sending (from one thread: the frontend's) ------------------------------------------
    def _send(self, message) -> None:
        if self.dead is not None:
            raise EngineDeadError("the engine core has stopped")
        self._input.send(encode(message))

    def add_request(self, message: EngineCoreRequest) -> None:
        message.frontend = self.frontend
        self._send(message)

    def fork(self, message: EngineCoreFork) -> None:
        self._send(message)

    def abort(self, message: EngineCoreAbort) -> None:
        if message.request_ids and self.dead is None:
            self._send(message)

    # ---- receiving ---------------------------------------------------------------------------
    def start_receiver(self, on_outputs: Callable[[EngineCoreOutputs], None],
                       on_dead: Callable[[str], None]) -> None:
        """Calls on_outputs (from the receiver thread) for each step's outputs, and on_dead once if the
        core process fails or exits on its own."""
        self._receiver = threading.Thread(target=self._receive, args=(on_outputs, on_dead),
                                          name="tokenmill-core-receiver", daemon=True)
        self._receiver.start()

    def _receive(self, on_outputs, on_dead) -> None:
        while not self._stopping.is_set():
            try:
                ready = self._output.poll(POLL_MS)
            except zmq.ZMQError:
                return
            if ready:
                message = decode_output(self._output.recv())
                if isinstance(message, EngineCoreOutputs):
                    on_outputs(message)
                elif isinstance(message, EngineCoreFailure):
                    self._declare_dead(message.message, on_dead)
                    return
            elif not self._stopping.is_set() and self.check_alive(on_dead) is not None:
                return

    def check_alive(self, on_dead) -> Optional[str]:
        """Why the core is gone (declared dead now if its process has exited), or None while it runs."""
        if self.dead is None and not self.process.is_alive():
            self._declare_dead(f"the engine core process exited with status {self.process.exitcode}", on_dead)
        return self.dead

    def _declare_dead(self, reason: str, on_dead) -> None:
        if self.dead is not None:  # the receiver thread and a health check may both notice
            return
        self.dead = reason
        logger.error("engine core died: %s", reason)
        on_dead(reason)

    # ---- stopping ----------------------------------------------------------------------------
    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Ask the core to exit, wait for it (then terminate, then kill), and release the sockets."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._stop_core(timeout_s)
        if self._receiver is not None:
            self._receiver.join(timeout=2 * POLL_MS / 1000)
        self._close()

    def _stop_core(self, timeout_s: float) -> None:
        if self.dead is None and self.process.is_alive():
            try:
                self._input.send(encode(EngineCoreShutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        self._stop_process(timeout_s)

    def _stop_process(self, timeout_s: float) -> None:
        self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)

    def _close(self) -> None:
        self._input.close(0)
        self._output.close(0)
        self._context.term()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)



class ForeignProcess:
    """The engine core as seen by an API server that did not start it (--api-server-count): alive while its
    pid exists and is not a zombie (the server that started it reaps it)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    @property
    def exitcode(self):
        return None if self.is_alive() else "unknown (it belongs to API server 0)"

    def is_alive(self) -> bool:
        try:
            with open(f"/proc/{self.pid}/stat") as stat:
                return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except (OSError, IndexError):
            return False

    def join(self, timeout: Optional[float] = None) -> None:
        pass


class AttachedClient(MPClient):
    """API server i > 0 of --api-server-count N: binds its own pair of the addresses the core was started
    with (the core connects to every pair) and talks to that core; it never starts or stops it."""

    def __init__(self, frontend: int, input_address: str, output_address: str, core_pid: int,
                 ready: EngineCoreReady) -> None:
        self._dir = None
        self.frontend = frontend
        self.frontend_addresses = []
        self._bind(input_address, output_address)
        self.process = ForeignProcess(core_pid)
        self._start_state()
        self.ready = ready

    def _stop_core(self, timeout_s: float) -> None:
        """Shutting down only closes this server's sockets: the core stays (API server 0 stops it)."""
