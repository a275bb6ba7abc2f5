"""What every tokenmill child process (the engine core, a tensor-parallel worker) sets up first and
tears down last: Ctrl-C left to its parent, log lines tagged with its role, and a zmq PULL socket for
the messages it receives and a PUSH socket for those it sends."""
from __future__ import annotations

import logging
import os
import signal
from collections.abc import Sequence
from dataclasses import dataclass, field

import zmq


@dataclass
class ChildChannels:
    context: zmq.Context
    inputs: zmq.Socket  # PULL, connected to the parent's input address (and any more senders')
    outputs: zmq.Socket  # PUSH, connected to the parent's output address
    # The engine core under --api-server-count N: a PUSH socket to each further API server, in order.
    more_outputs: list[zmq.Socket] = field(default_factory=list)

    def close(self) -> None:
        """Drop unread inputs, let queued outputs go out (up to the 5 s linger), end the context."""
        self.inputs.close(0)
        for socket in (self.outputs, *self.more_outputs):
            socket.close()
        self.context.term()


def start_child_process(tag: str, log_level: str, input_address: str, output_address: str,
                        more_peers: Sequence[tuple[str, str]] = ()) -> ChildChannels:
    """more_peers: (input address, output address) of further senders/receivers (API servers 1..N-1)."""
    # Ctrl-C reaches the whole process group; the parent decides when its children stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s %(name)s[{tag}]: %(message)s")
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.connect(input_address)
    outputs = context.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, 5000)
    outputs.connect(output_address)
    more_outputs = []
    for peer_input, peer_output in more_peers:
        inputs.connect(peer_input)  # one PULL fair-queues every sender
        socket = context.socket(zmq.PUSH)
        socket.setsockopt(zmq.LINGER, 5000)
        socket.connect(peer_output)
        more_outputs.append(socket)
    return ChildChannels(context, inputs, outputs, more_outputs)


def may_raise_priority(niceness: int) -> bool:
    """Whether this process may set its niceness back down to `niceness` (CAP_SYS_NICE, or an RLIMIT_NICE that
    allows it): the condition for loading at the lowest priority and serving at the configured one."""
    import resource

    try:
        with open("/proc/self/status") as status:
            effective = next(int(line.split()[1], 16) for line in status if line.startswith("CapEff:"))
        if effective & (1 << 23):  # CAP_SYS_NICE
            return True
    except (OSError, StopIteration, ValueError):
        return False
    return 20 - resource.getrlimit(resource.RLIMIT_NICE)[0] <= niceness


def _thread_ids() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc/self/task")]
    except OSError:
        return [0]  # no per-thread view: 0 is this process


def set_niceness(niceness: int, idle: bool = False) -> int:
    """Set every thread of this process (torch's compute threads included) to `niceness` under the normal
    scheduling policy, or (idle) to SCHED_IDLE, which runs only when no normal thread wants the CPU (where
    the platform has it). Threads started later inherit it. Returns the niceness now in force."""
    policy = getattr(os, "SCHED_IDLE", None) if idle else getattr(os, "SCHED_OTHER", None)
    for thread_id in _thread_ids():
        try:
            if policy is not None:
                os.sched_setscheduler(thread_id, policy, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, thread_id, niceness)
        except OSError:
            pass  # a thread that ended meanwhile, or a priority this process may not take
    return os.getpriority(os.PRIO_PROCESS, 0)


def lower_priority(increment: int) -> int:
    """Add `increment` to the niceness of every thread of this process (as `nice -n increment` would
    for a process started with it), capped at 19; threads and processes it starts later inherit it.
    Returns the niceness now in force. Raising niceness needs no privilege; where the OS refuses (or
    has no per-thread niceness), the process keeps its priority."""
    # On Linux niceness is per thread: the zmq I/O threads already run, so each is set by its id
    # (elsewhere PRIO_PROCESS 0 is the whole process).
    return set_niceness(min(19, os.getpriority(os.PRIO_PROCESS, 0) + increment))
