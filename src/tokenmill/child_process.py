"""What every tokenmill child process (the engine core, a tensor-parallel worker) sets up first and
tears down last: Ctrl-C left to its parent, log lines tagged with its role, and a zmq PULL socket for
the messages it receives and a PUSH socket for those it sends."""
from __future__ import annotations

import logging
import signal
from dataclasses import dataclass

import zmq


@dataclass
class ChildChannels:
    context: zmq.Context
    inputs: zmq.Socket  # PULL, connected to the parent's input address
    outputs: zmq.Socket  # PUSH, connected to the parent's output address

    def close(self) -> None:
        """Drop unread inputs, let queued outputs go out (up to the 5 s linger), end the context."""
        self.inputs.close(0)
        self.outputs.close()
        self.context.term()


def start_child_process(tag: str, log_level: str, input_address: str, output_address: str) -> ChildChannels:
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
    return ChildChannels(context, inputs, outputs)
