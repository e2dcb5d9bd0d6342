"""Tensor parallelism over the devices of one host (torch.distributed: NCCL on CUDA, gloo on
CPU): who this rank is, its collectives, and which slice of each weight it holds.

Megatron-style sharding: the QKV and gate/up projections are split by output rows
(column-parallel), the O and down projections by input columns (row-parallel, their
outputs summed by an all-reduce); the embedding and the LM head are split over the
vocabulary (a token's embedding row lives on one rank: the others add zeros; the logits
are gathered whole on every rank, so every rank samples the same tokens). KV heads are
split across ranks, and replicated when there are fewer KV heads than ranks."""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist



@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: object | None = None  # the torch.distributed process group (None: one rank)
    control: object | None = None  # a gloo group for rank 0's step inputs (it may wait idle for hours)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on each rank -> [..., size * n], rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' values, on every rank."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t[0])

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's bytes (`data` there, ignored elsewhere) on every rank, over the control group:
        one broadcast of a fixed-size frame (an 8-byte length, then the bytes), and a second
        one only for what does not fit in it."""
        frame = torch.zeros(BROADCAST_FRAME_BYTES, dtype=torch.uint8)
        if self.rank == 0:
            head = len(data).to_bytes(8, "little") + data[:BROADCAST_FRAME_BYTES - 8]
            frame[:len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        dist.broadcast(frame, src=0, group=self.control)
        length = int.from_bytes(bytes(frame[:8].numpy()), "little")
        body = bytes(frame[8:8 + min(length, BROADCAST_FRAME_BYTES - 8)].numpy())
        rest = length - len(body)
        if rest > 0:
            tail = (torch.frombuffer(bytearray(data[len(body):]), dtype=torch.uint8) if self.rank == 0
                    else torch.empty(rest, dtype=torch.uint8))
            dist.broadcast(tail, src=0, group=self.control)
            body += bytes(tail.numpy())
        return body

    def broadcast_int(self, value: int) -> int:
        """Rank 0's value on every rank."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.broadcast(t, src=0, group=self.control)
        return int(t[0])


SINGLE = TensorParallel()


def init_tensor_parallel(rank: int, size: int, device: torch.device, init_method: str) -> TensorParallel:
    """Join the process group of `size` ranks (this one `rank`) at `init_method` (tcp://host:port)."""
    if size == 1:
        return SINGLE
    if device.type == "cuda":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (deployment docs)
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                device_id=device if device.type == "cuda" else None)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return TensorParallel(rank, size, dist.group.WORLD, control)


CONTROL_TIMEOUT = timedelta(days=365)  # the other ranks wait for rank 0's next step, however idle the server
BROADCAST_FRAME_BYTES = 4096  # a step's inputs fit in one broadcast unless new prompts are long


def local_init_method() -> str:
    """A rendezvous for ranks on this host: tcp://127.0.0.1 and a free port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _rank_main(target: Callable, rank: int, size: int, init_method: str, args: tuple, results) -> None:
    try:
        results.put((rank, target(rank, size, init_method, *args), None))
    except BaseException:  # noqa: BLE001 - handed to run_on_ranks
        results.put((rank, None, traceback.format_exc()))


def run_on_ranks(target: Callable, size: int, args: tuple = (), timeout: float = 600.0) -> list:
    """target(rank, size, init_method, *args) in `size` spawned processes (a module-level
    function: benchmarks and tests); returns their results by rank, or raises with the
    traceback of a rank that failed."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_method = local_init_method()
    procs = [ctx.Process(target=_rank_main, args=(target, r, size, init_method, args, results), daemon=True)
             for r in range(size)]
    for proc in procs:
        proc.start()
    got: dict[int, object] = {}
    try:
        for _ in procs:
            rank, value, error = results.get(timeout=timeout)
            if error is not None:
                raise RuntimeError(f"rank {rank} failed:\n{error}")
            got[rank] = value
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    return [got[r] for r in range(size)]
