"""The processes of a tensor-parallel decoder (issue 31; ORCA's intra-layer parallelism): rank 0
is the engine's own worker; ranks 1..N-1 are processes the engine starts, each with its shard of
the model (cells/tensor_parallel.py), its own KV cache of its kv heads and its own runner.

One scheduler: rank 0's manager plans every iteration (core/sequence_queue.py) and, before running
it, sends its plan (core/iteration_plan.py, as bytes) to every other rank down a pipe of its own;
each rank runs the same plan, and the collectives inside the model keep them in lockstep. The
control channel never touches a device: a plan is one write per rank (a few kB). Every rank
samples the same tokens from the same gathered logits; rank 0's are the engine's.

The group is a process group of its own (a TCPStore on a port rank 0 binds, gloo), not
torch.distributed's default one: several groups can live in one process, beside whatever else
uses torch.distributed there.

Failure: a rank that died is seen before the next plan is sent (its process is gone), a rank that
hangs by the collectives' timeout. After any failed iteration the group is broken (its ranks may
be left inside a collective that nothing pairs up with any more): its ranks are stopped, and this
and every later iteration fail at once with RankFailure instead of hanging. A rank whose pipe
closes (rank 0 stopped or died) exits; a rank whose iteration raises exits too.
"""
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

PLAN, STOP = b"p", b"s"
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
TIMEOUT_S = 10.0  # a collective waits this long for the other ranks (and their first one for them to start)
START_TIMEOUT_S = 120.0  # the ranks' processes start, import torch and build their parts within this


class RankFailure(RuntimeError):
    """A rank of a tensor-parallel group died or stopped answering."""


@dataclass
class FollowerSpec:
    """What a rank needs to build its part (sent to its process once)."""
    rank: int
    size: int
    port: int  # rank 0's store
    threads: int  # torch's threads, as rank 0 has (a collective waits for the slowest rank)
    config: object  # the whole model's DecoderConfig
    state: dict  # this rank's slices (cells/tensor_parallel.shard_state), on the CPU
    kv: object  # the cell's KVSettings
    name: str  # the cell type's name
    batch_sizes: tuple
    num_blocks: int  # rank 0's: the plans' block ids are its


def process_group(store, rank: int, size: int):
    """The group's own gloo process group over `store` (its first collectives wait for slow starts)."""
    for key, value in NO_MULTICAST.items():
        os.environ.setdefault(key, value)
    group = dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=START_TIMEOUT_S))
    group.barrier().wait()  # (every rank built its part)
    group.set_timeout(timedelta(seconds=TIMEOUT_S))
    return group


class TensorGroup:
    """Rank 0's side: starts the other ranks, sends them each plan, stops them."""

    def __init__(self, cell, name: str, batch_sizes: tuple, num_blocks: int):
        from batchmaker.cells.tensor_parallel import shard_decoder, shard_state
        self.size, full = cell.tensor_parallel, cell.lm
        self.processes, self.pipes, self.broken = [], [], None
        self.group = None
        try:
            store = dist.TCPStore("127.0.0.1", 0, self.size, is_master=True, wait_for_workers=False,
                                  timeout=timedelta(seconds=START_TIMEOUT_S))
            state = {k: v.detach().cpu() for k, v in full.state_dict().items()}
            context = torch.multiprocessing.get_context("spawn")
            for rank in range(1, self.size):
                receive, send = context.Pipe(duplex=False)
                part = {k: v.clone() for k, v in shard_state(state, full.config, rank, self.size).items()}  # (its own
                # storage: pickling moves a tensor's whole storage to shared memory, and rank 0's weights with it)
                spec = FollowerSpec(rank, self.size, store.port, torch.get_num_threads(), full.config, part, cell.kv,
                                    name, tuple(batch_sizes), num_blocks)
                process = context.Process(target=follower_main, args=(spec, receive),
                                          name=f"batchmaker-rank-{rank}", daemon=True)
                process.start()
                receive.close()  # (the rank holds its end: its pipe closes when this process goes)
                self.processes.append(process)
                self.pipes.append(send)
            self.lm = shard_decoder(full, 0, self.size)
            self.group = self.lm.tp.group = process_group(store, 0, self.size)
        except BaseException:
            self.close()
            raise

    def send(self, plan) -> None:
        """Every other rank runs `plan` next (call before running it here)."""
        if self.broken is not None:
            raise RankFailure(f"the tensor-parallel group is broken: {self.broken}")
        dead = [p.name for p in self.processes if not p.is_alive()]
        if dead:
            self.fail(f"ranks exited: {', '.join(dead)}")
        message = PLAN + plan.to_bytes()
        try:
            for pipe in self.pipes:
                pipe.send_bytes(message)
        except OSError as e:
            self.fail(f"a rank stopped reading its plans: {e}")

    def fail(self, reason: str) -> None:
        """The group cannot go on (a rank died or hung, or an iteration failed midway): stop its
        ranks, and fail this and every later iteration at once."""
        self.broken = reason
        self.close()
        raise RankFailure(f"the tensor-parallel group is broken: {reason}")

    def close(self) -> None:
        """Stop every other rank (they exit once they read STOP, or when their pipe closes)."""
        for pipe in self.pipes:
            try:
                pipe.send_bytes(STOP)
            except OSError:
                pass
            pipe.close()
        for process in self.processes:
            process.join(5.0 if self.broken is None else 0.5)
            if process.is_alive():
                process.kill()
                process.join(5.0)
        self.pipes, self.processes = [], []
        if self.group is not None:
            self.group.shutdown()
            self.group = None


def follower_main(spec: FollowerSpec, pipe) -> None:
    """A rank's process: build its part, measure what rank 0 measures (the same forwards: their
    collectives pair up), then run every plan it is sent until STOP, its pipe closes, or a plan
    fails here (the group is broken then: rank 0 finds this rank gone)."""
    from batchmaker.cells.decoder import empty_decoder, materialize
    from batchmaker.cells.decoder_cell import DecoderCell
    from batchmaker.cells.tensor_parallel import TensorParallel, install, shard_config
    from batchmaker.core.cell_type import CellType
    from batchmaker.exec.graphs import Graphs
    from batchmaker.exec.iterations import IterationRunner
    torch.set_num_threads(spec.threads)
    store = dist.TCPStore("127.0.0.1", spec.port, spec.size, is_master=False, timeout=timedelta(seconds=START_TIMEOUT_S))
    device = torch.device("cpu")
    lm = materialize(empty_decoder(shard_config(spec.config, spec.size)), spec.state, device)
    tp = TensorParallel(spec.rank, spec.size, spec.config.vocab_size)
    cell = DecoderCell(install(lm, tp, spec.config), spec.kv)
    cell_type = CellType(spec.name, cell, 0, spec.batch_sizes)
    runner = IterationRunner(cell_type, cell, device, Graphs(device, enabled=False), spec.num_blocks)
    tp.group = process_group(store, spec.rank, spec.size)
    try:
        with torch.inference_mode():
            runner.measure()
            while (plan := _next_plan(pipe)) is not None:
                runner.execute(_task(cell_type, plan))
    finally:
        tp.group.shutdown()


def _next_plan(pipe):
    """The next plan from rank 0, or None: STOP, or rank 0 gone."""
    from batchmaker.core.iteration_plan import IterationPlan
    try:
        message = pipe.recv_bytes()
    except (EOFError, OSError):
        return None
    return IterationPlan.from_bytes(message[1:]) if message[:1] == PLAN else None


def _task(cell_type, plan):
    """A plan as the runner takes it (the manager's handle on its copies made here: nobody waits on it)."""
    from batchmaker.core.cache_plan import CachePlan
    from batchmaker.core.task import IterationTask
    c = plan.copies
    handle = None if c is None else CachePlan(c.swap_in_host, c.swap_in_blocks, c.swap_out_blocks, c.swap_out_host,
                                              deferred=c.mode == "side")
    return IterationTask(None, cell_type, 0, plan.num_tokens, plan=plan, cache_plan=handle)
