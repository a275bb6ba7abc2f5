"""The tensor-parallel group a model runner belongs to, and the two collectives its model needs.

Each tensor-parallel worker is one rank of its own torch.distributed world (one world per engine
core, so data-parallel cores never share a group). The engine core hosts the rendezvous store on
localhost (a free port chosen by the OS) and the workers join it; gloo carries the collectives on
CPU, nccl on CUDA.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

# How long a collective may wait for a peer before it fails. A dead peer usually breaks the
# connection at once; this bounds the wait when a peer hangs instead (stopped, swapping).
COLLECTIVE_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class TensorParallelGroup:
    rank: int
    size: int

    @property
    def is_driver(self) -> bool:
        """Rank 0 samples and answers the engine core; the other ranks only compute their shards."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's partial `x`, in place."""
        dist.all_reduce(x)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` (equal shapes) concatenated along the last dimension, in rank order."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


def init_tensor_parallel(rank: int, size: int, store_port: int, device: torch.device) -> TensorParallelGroup:
    """Joins the engine core's store at 127.0.0.1:store_port and forms this rank's group."""
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timeout)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    return TensorParallelGroup(rank, size)


def start_store() -> dist.TCPStore:
    """The rendezvous store, held by the engine core on a free localhost port (`store.port`)."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
