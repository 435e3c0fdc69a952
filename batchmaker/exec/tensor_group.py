"""The processes of a tensor-parallel decoder (issue 31; ORCA's intra-layer parallelism): rank 0
is the engine's own worker; ranks 1..N-1 are processes the engine starts, each with its shard of
the model (cells/tensor_parallel.py), its own KV cache of its kv heads and its own runner.

One scheduler: rank 0's manager plans every iteration (core/sequence_queue.py) and, before running
it, sends its plan (core/iteration_plan.py, as bytes) to every other rank down a pipe of its own;
each rank runs the same plan, and the collectives inside the model keep them in lockstep. The
control channel never touches a device: a plan is one write per rank (a few kB). Every rank
samples the same tokens from the same gathered logits; rank 0's are the engine's.

Failure: a rank that died is seen before the next plan is sent (its process is gone), a rank that
hangs by the collectives' timeout; either way the iteration's requests fail (and so does every
later one) instead of hanging. A rank whose pipe closes (rank 0 stopped or died) exits.
"""
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

PLAN, STOP = b"p", b"s"
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class RankFailure(RuntimeError):
    """A rank of a tensor-parallel group died or stopped answering."""


@dataclass
class FollowerSpec:
    """What a rank needs to build its part (sent to its process once)."""
    rank: int
    size: int
    init_method: str
    device: str
    config: object  # the whole model's DecoderConfig
    state: dict  # this rank's slices (cells/tensor_parallel.shard_state), on the CPU
    kv: object  # the cell's KVSettings
    name: str  # the cell type's name
    batch_sizes: tuple
    num_blocks: int  # rank 0's: the plans' block ids are its
    timeout_s: float


def start_group(rank: int, size: int, init_method: str, timeout_s: float) -> None:
    for key, value in NO_MULTICAST.items():
        os.environ.setdefault(key, value)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TensorGroup:
    """Rank 0's side: starts the other ranks, sends them each plan, stops them."""

    def __init__(self, cell, name: str, batch_sizes: tuple, num_blocks: int, timeout_s: float = 10.0):
        from batchmaker.cells.tensor_parallel import shard_decoder, shard_state
        size, full = cell.tensor_parallel, cell.lm
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        state = {k: v.detach().cpu() for k, v in full.state_dict().items()}
        context = torch.multiprocessing.get_context("spawn")
        self.processes, self.pipes = [], []
        for rank in range(1, size):
            receive, send = context.Pipe(duplex=False)
            spec = FollowerSpec(rank, size, init_method, "cpu", full.config, shard_state(state, full.config, rank, size),
                                cell.kv, name, tuple(batch_sizes), num_blocks, timeout_s)
            process = context.Process(target=follower_main, args=(spec, receive), name=f"batchmaker-rank-{rank}",
                                      daemon=True)
            process.start()
            receive.close()  # (the rank holds its end: its pipe closes when this process goes)
            self.processes.append(process)
            self.pipes.append(send)
        try:
            start_group(0, size, init_method, timeout_s)
        except Exception:
            self.close()
            raise
        self.lm = shard_decoder(full, 0, size)  # rank 0's part
        self.size = size

    def send(self, plan) -> None:
        """Every other rank runs `plan` next (call before running it here)."""
        dead = [p.name for p in self.processes if not p.is_alive()]
        if dead:
            raise RankFailure(f"tensor-parallel ranks exited: {', '.join(dead)}")
        message = PLAN + plan.to_bytes()
        try:
            for pipe in self.pipes:
                pipe.send_bytes(message)
        except OSError as e:
            raise RankFailure(f"a tensor-parallel rank stopped reading its plans: {e}") from e

    def close(self) -> None:
        """Stop every other rank (they exit once they read STOP, or when their pipe closes)."""
        for pipe in self.pipes:
            try:
                pipe.send_bytes(STOP)
            except OSError:
                pass
            pipe.close()
        for process in self.processes:
            process.join(5.0)
            if process.is_alive():
                process.kill()
                process.join(5.0)
        self.pipes, self.processes = [], []
        if dist.is_initialized():
            dist.destroy_process_group()


def follower_main(spec: FollowerSpec, pipe) -> None:
    """A rank's process: build its part, measure what rank 0 measures (the same forwards: their
    collectives pair up), then run every plan it is sent until STOP or its pipe closes."""
    from batchmaker.cells.decoder import empty_decoder, materialize
    from batchmaker.cells.decoder_cell import DecoderCell
    from batchmaker.cells.tensor_parallel import TensorParallel, install, shard_config
    from batchmaker.core.cache_plan import CachePlan
    from batchmaker.core.cell_type import CellType
    from batchmaker.core.iteration_plan import IterationPlan
    from batchmaker.core.task import IterationTask
    from batchmaker.exec.graphs import Graphs
    from batchmaker.exec.iterations import IterationRunner
    torch.set_num_threads(1)
    start_group(spec.rank, spec.size, spec.init_method, spec.timeout_s)
    device = torch.device(spec.device)
    try:
        lm = materialize(empty_decoder(shard_config(spec.config, spec.size)), spec.state, device)
        cell = DecoderCell(install(lm, TensorParallel(spec.rank, spec.size, spec.config.vocab_size), spec.config),
                           spec.kv)
        cell_type = CellType(spec.name, cell, 0, spec.batch_sizes)
        runner = IterationRunner(cell_type, cell, device, Graphs(device, enabled=False), spec.num_blocks)
        with torch.inference_mode():
            runner.measure()
            while True:
                try:
                    message = pipe.recv_bytes()
                except (EOFError, OSError):
                    break  # rank 0 is gone
                if message[:1] != PLAN:
                    break
                plan = IterationPlan.from_bytes(message[1:])
                copies = plan.copies
                handle = None if copies is None else CachePlan(
                    copies.swap_in_host, copies.swap_in_blocks, copies.swap_out_blocks, copies.swap_out_host,
                    deferred=copies.mode == "side")
                runner.execute(IterationTask(None, cell_type, 0, plan.num_tokens, plan=plan, cache_plan=handle))
    finally:
        dist.destroy_process_group()
