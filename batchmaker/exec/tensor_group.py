"""The processes of a tensor-parallel decoder (issue 31; ORCA's intra-layer parallelism): rank 0
is the engine's own worker; ranks 1..N-1 are processes the engine starts (exec/tensor_rank.py), or
that a launcher started on this host or others (torchrun: exec/tensor_launch.py),
each building its own shard of the model from the model's `DecoderSource` on its own device (the
CPU, or the r-th GPU after rank 0's), with its own KV cache of its kv heads and its own runner.

One scheduler: rank 0's manager plans every iteration (core/sequence_queue.py) and, before running
it, sends its plan (core/iteration_plan.py, as bytes) to every other rank down a pipe of its own;
each rank runs the same plan, and the collectives inside the model keep them in lockstep. The
control channel never touches a device: a plan is one write per rank (1-135 KB into a 1 MiB pipe
buffer: rank 0 does not wait for a reader), sent before rank 0 queues its own launch, so every
rank's host work overlaps. A pipe, measured against ZeroMQ PUB/SUB, a polled shared-memory ring
and a gloo broadcast (bench/plan_channel.py, docs/architecture.md), is as fast to the last rank
as any for decode plans, blocks its rank without spinning and tells it when rank 0 is gone.
Every rank samples the same tokens from the same gathered logits; rank 0's are the engine's.

The group is a process group of its own over a TCPStore on a port rank 0 binds (gloo on CPUs,
NCCL on GPUs), not torch.distributed's default one: several groups can live in one process,
beside whatever else uses torch.distributed there. A pipeline whose stages are tensor-parallel
(cells/stage_shards.py) has, besides, a group per stage of its shards, for their collectives. On
GPUs the collectives run inside the decode CUDA graphs: every rank captures the same graphs in the
same order (the same start-up, then the same plans), so the captured collectives pair up when
replayed.

Failure: rank 0's watcher thread breaks the group when a rank dies (its process sentinel, at
once) or hangs (an iteration sent to the ranks has not finished within `hang_s`, HANG_S at least:
`_watch`). Breaking makes every collective waiting for a rank return: on GPUs the group's one-shot
all-reduce is stopped and its communicators aborted; on CPUs only a closed connection ends a gloo
wait (its abort and shutdown leave it to TIMEOUT_S), so the other ranks are ended: the processes
the engine started are killed, and ranks a launcher started have their connection shut (each
exits then: exec/tensor_rank.py). The iterations that ran meanwhile fail with RankFailedError,
and so does every later one, at once, as does any iteration that fails on rank 0. A follower
exits when rank 0's process goes (its lifeline), even from inside a collective.
"""
import logging
import multiprocessing.connection
import os
import socket
import threading
import time
from collections import deque
from contextlib import nullcontext as _nothing
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from batchmaker.errors import RankFailedError

log = logging.getLogger("batchmaker")

PLAN, STOP = b"p", b"s"
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
TIMEOUT_S = 30.0  # a collective waits this long for the other ranks once the group serves (gloo: from when it
# forms; NCCL: from the first plan): 10 s timed out a healthy rank 1 once on the 2-core machine at a load of ~6
# (rank 0 measuring chunk costs, tests/test_tensor_parallel_engine.py, 2026-11-26). A dead rank is seen at once
# (the watcher) and a hung one after HANG_S; this bounds only a hung rank the watcher cannot end (a launched
# rank that is frozen, on CPUs)
HANG_S = 8.0  # an iteration not finished this long after its plan went out breaks the group (a rank hung), so
# that its requests fail within the 10 s: the slowest healthy one in tests/ took 0.31 s from its plan to
# its tokens on the 2-core machine (4 gloo ranks, tests/test_tensor_pipeline.py); rank 0 raises it for a model
# whose measured iterations are slow (`expect_iterations_within`)
HANG_MARGIN = 20  # x the slowest iteration the measured chunk costs predict
WATCH_S = 0.5  # the watcher looks at the iterations in flight this often
END_TIMEOUT_S = 10.0  # a group's teardown
PIPE_BYTES = 1 << 20  # a plan pipe's buffer: past the default 64 KiB (a Llama-2-7B mixed iteration's plan is 135 KB)
# rank 0 waits for each rank in turn to read its plan (to three ranks: 0.64 ms to send, 0.26 widened, p50;
# bench/plan_channel.py)
START_TIMEOUT_S = 120.0  # the ranks' processes start, import torch and build their parts within this


@dataclass
class FollowerSpec:
    """What a rank needs to build its part (sent to its process once)."""
    rank: int
    size: int
    host: str  # the group's store
    port: int
    threads: int  # torch's threads, as rank 0 has (a collective waits for the slowest rank)
    source: object  # cells/decoder_source.DecoderSource: the rank builds its part from it
    cut: object  # what it holds (cells/tensor_parallel.TensorCut, cells/pipeline.StageCut)
    parallel: tuple  # (tensor_parallel, pipeline_parallel)
    device: str  # the rank's
    kv: object  # the cell's KVSettings
    name: str  # the cell type's name
    batch_sizes: tuple
    num_blocks: int  # rank 0's: the plans' block ids are its
    graphs: bool  # CUDA graphs, as rank 0's worker has them (and so its captures)


def process_group(store, rank: int, size: int, device: torch.device):
    """The group's own process group over `store`: gloo on CPUs, NCCL on GPUs (its first
    collective waits for slow starts: the ranks' processes import torch and build their shards)."""
    for key, value in NO_MULTICAST.items():
        os.environ.setdefault(key, value)
    store = dist.PrefixStore("batchmaker-group", store)  # (a launcher's store holds its own keys too)
    if device.type == "cpu":
        group = dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=START_TIMEOUT_S))
        group.barrier().wait()  # (every rank built its part)
        group.set_timeout(timedelta(seconds=TIMEOUT_S))
        return group
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")  # a timeout aborts the communicator, not the process
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timedelta(seconds=START_TIMEOUT_S)
    group = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, size, options)
    with torch.cuda.device(device):
        ready = torch.ones(1, device=device)
        group.allreduce([ready]).wait()
        torch.cuda.synchronize(device)
    return group


def connect(lm, store, rank: int, size: int, device: torch.device, one_shot_allowed: bool = True) -> list:
    """Join this rank's part to its group (every rank calls it, in the same order): the process
    group of all the ranks (a tensor-parallel shard's collectives; a pipeline's sends and
    receives); with both, its stage's own group of its shards (their collectives); for a
    pipeline's first and last stages the tokens' own group of those two ranks; for a
    tensor-parallel shard on GPUs of one host the one-shot all-reduce where it measures faster
    than NCCL (exec/one_shot.py). Returns the process groups.

    A stage's group is made over the store under a prefix of its own, by its shards only: the
    groups here are built directly on a store, not by torch.distributed's `new_group` (which
    needs its default group, and every rank of the world to call it for every subgroup), so the
    stages' groups form at once, each by its members, with no order to agree across stages."""
    from batchmaker.exec import one_shot
    world, shards_store = process_group(store, rank, size, device), store
    stage = lm.pp
    if stage is None:
        lm.tp.group = world
    else:
        stage.group = world
        if lm.tp is not None:  # (rank = stage * shards + shard)
            shards_store = dist.PrefixStore(f"stage-{stage.stage}", store)
            lm.tp.group = process_group(shards_store, stage.shard, stage.shards, device)
        if stage.receives_tokens or stage.sends_tokens:
            stage.back = process_group(dist.PrefixStore("tokens", store), int(stage.sends_tokens), 2, device)
    if lm.tp is not None:
        dtype = next(lm.parameters()).dtype
        with torch.cuda.device(device) if device.type == "cuda" else _nothing():
            lm.tp.one_shot = one_shot.join(shards_store, lm.tp.rank, lm.tp.size, device, lm.tp.group, dtype,
                                           one_shot_allowed)
    return groups(lm)


def groups(lm) -> list:
    """The process groups a part's collectives and sends use (each once)."""
    found = [lm.tp and lm.tp.group, lm.pp and lm.pp.group, lm.pp and lm.pp.back]
    return [g for i, g in enumerate(found) if g is not None and all(g is not f for f in found[:i])]


def disconnect(lm, device: torch.device, broken: bool) -> None:
    """Undo `connect` (after the last kernel that uses the group)."""
    for group in groups(lm):
        end_group(group, device, broken)
    if lm.pp is not None:
        lm.pp.group = lm.pp.back = None
    if lm.tp is not None:
        lm.tp.group = None
        if getattr(lm.tp, "one_shot", None) is not None:
            lm.tp.one_shot.close()
            lm.tp.one_shot = None


def widen(pipe) -> None:
    """Raise a plan pipe's buffer to PIPE_BYTES (Linux; elsewhere, or past the user's pipe quota, it
    keeps its own: plans still arrive, rank 0 just waits longer for a big one)."""
    import fcntl
    try:
        fcntl.fcntl(pipe.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except (AttributeError, OSError):
        pass


class TensorGroup:
    """Rank 0's side: starts the other ranks, sends them each plan, stops them."""

    def __init__(self, cell, name: str, batch_sizes: tuple, num_blocks: int, device: torch.device, graphs: bool):
        from batchmaker.launch import launched
        self.size, self.lm = cell.ranks, cell.lm  # (rank 0's part)
        self.processes, self.pipes, self.broken = [], [], None
        self.groups, self.device, self._closing = [], torch.device(device), False
        self._lock = threading.Lock()  # (the watcher and the manager both may break the group)
        self.hang_s = HANG_S  # (`expect_iterations_within`)
        self._sent: deque[float] = deque()  # when each plan in flight went out, oldest first
        self._serving = False  # (a first plan went out: start-up is over on every rank)

        def spec(rank: int, host: str, port: int) -> FollowerSpec:
            from batchmaker.cells.tensor_parallel import rank_device
            return FollowerSpec(rank, self.size, host, port, torch.get_num_threads(), cell.source, cell.cut(rank),
                                (cell.tensor_parallel, cell.pipeline_parallel), str(rank_device(device, rank)), cell.kv,
                                name, tuple(batch_sizes), num_blocks, graphs)
        try:
            launch = launched()
            store = self._join(launch, spec) if launch is not None else self._start(spec)
            self.groups = connect(self.lm, store, 0, self.size, self.device, cell.kv.one_shot)
        except BaseException:
            self.close()
            raise
        self._watcher = threading.Thread(target=self._watch, name="batchmaker-rank-watcher", daemon=True)
        self._watcher.start()

    def _start(self, spec):
        """The other ranks as processes of this host, a pipe each; returns the group's store."""
        from batchmaker.exec.tensor_rank import follower_main
        store = dist.TCPStore("127.0.0.1", 0, self.size, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=START_TIMEOUT_S))
        context = torch.multiprocessing.get_context("spawn")
        for rank in range(1, self.size):
            receive, send = context.Pipe(duplex=False)
            widen(send)
            process = context.Process(target=follower_main, args=(spec(rank, "127.0.0.1", store.port), receive),
                                      name=f"batchmaker-rank-{rank}", daemon=True)
            process.start()
            receive.close()  # (the rank holds its end: its pipe closes when this process goes)
            self.processes.append(process)
            self.pipes.append(send)
        return store

    def _join(self, launch, spec):
        """The other ranks a launcher started (exec/tensor_launch.py), a connection each."""
        from batchmaker.exec.tensor_launch import accept_ranks, launcher_store
        if launch.rank != 0 or launch.size != self.size:
            raise ValueError(f"{self.size} ranks: under a launcher (WORLD_SIZE={launch.size}, RANK={launch.rank}) "
                             f"the world is the group: rank 0 serves, with tensor_parallel x pipeline_parallel "
                             f"equal to WORLD_SIZE")
        store = launcher_store(launch)
        self.pipes = accept_ranks(launch, store, lambda rank: spec(rank, launch.master_addr, launch.master_port))
        return store

    def _watch(self) -> None:
        """Break the group as soon as a rank ends while the group serves (its process's sentinel,
        or, for ranks a launcher started, its connection, which it never writes to, becomes
        ready), or once an iteration sent to the ranks has not finished within `hang_s` (a rank
        hung, or waits for one that did)."""
        ends = {p.sentinel: p.name for p in self.processes} or {c: f"rank {r + 1}" for r, c in enumerate(self.pipes)}
        while not self._closing and self.broken is None:
            try:
                ended = multiprocessing.connection.wait(list(ends), WATCH_S)
            except (OSError, ValueError):  # (a connection closed under it: the group is closing)
                ended = list(ends)
            if self._closing:
                return
            if ended:
                return self.abort(f"ranks exited: {', '.join(ends[e] for e in ended)}")
            waited = self._oldest_wait()
            if waited > self.hang_s:
                return self.abort(f"an iteration has not finished after {waited:.1f} s (the bound: {self.hang_s:g} s): "
                                  f"a rank hung")

    def _oldest_wait(self) -> float:
        """Seconds since the oldest plan in flight went out (0: none in flight)."""
        try:
            return time.monotonic() - self._sent[0]
        except IndexError:  # (none; or the manager retired the last one meanwhile)
            return 0.0

    def expect_iterations_within(self, seconds: float) -> None:
        """Start-up measured that an iteration may take up to `seconds` (rank 0's runner, from its
        chunk costs): a slow model (a large one on CPUs) is not taken for a hung one."""
        self.hang_s = max(HANG_S, HANG_MARGIN * seconds)

    def done(self) -> None:
        """The oldest iteration sent finished here (the manager thread, in order)."""
        if self._sent:
            self._sent.popleft()

    def abort(self, reason: str) -> None:
        """Mark the group broken and make every collective waiting for a rank return (their
        iterations' results are garbage: `check` fails them): on GPUs stop the one-shot
        all-reduce and abort the communicators, then end the other ranks; on CPUs end them
        (their connections closing is what ends a gloo wait)."""
        with self._lock:
            if self.broken is not None:
                return
            self.broken = reason
            log.error("the tensor-parallel group broke: %s", reason)
            if self.device.type == "cuda":
                self._abort_communicators()
            self._end_ranks()

    def _abort_communicators(self) -> None:
        one_shot = getattr(self.lm.tp, "one_shot", None) if self.lm.tp is not None else None
        if one_shot is not None:  # (first: NCCL's abort waits behind a stream still polling)
            one_shot.stop()
        aborts = [threading.Thread(target=_abort, args=(group,), name="batchmaker-group-abort", daemon=True)
                  for group in self.groups]  # (at once: one communicator's abort may wait for a
        for thread in aborts:  # kernel of another's, stuck until that one is aborted too)
            thread.start()
        deadline = time.monotonic() + END_TIMEOUT_S
        for thread in aborts:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _end_ranks(self) -> None:
        """Kill the ranks this group started; shut the connections of ranks a launcher started
        (each exits once its connection to rank 0 closes: exec/tensor_rank.py). A launched rank
        that is frozen (stopped, or its host gone) cannot be ended from here: on CPUs a collective
        waiting for it returns at TIMEOUT_S."""
        for process in self.processes:
            process.kill()
        for connection in () if self.processes else self.pipes:
            _shut(connection)

    def check(self) -> None:
        """Raise RankFailedError if the group broke (an iteration that ran meanwhile computed garbage)."""
        if self.broken is not None:
            raise RankFailedError(f"the tensor-parallel group is broken: {self.broken}")

    def send(self, plan) -> None:
        """Every other rank runs `plan` next (call before running it here)."""
        self.check()
        if self._exited():
            self.fail("a rank exited")
        if not self._serving:
            self._serving = True
            serving_timeouts(self.groups, self.device)
        message = PLAN + plan.to_bytes()
        try:
            for pipe in self.pipes:
                pipe.send_bytes(message)
        except OSError as e:
            self.fail(f"a rank stopped reading its plans: {e}")
        self._sent.append(time.monotonic())

    def fail(self, reason: str) -> None:
        """The group cannot go on (a rank died or hung, or an iteration failed midway): stop its
        ranks, and fail this and every later iteration at once. A started rank that exited is the
        reason (a collective it left may fail here, a connection closed, before the watcher wakes)."""
        if dead := self._exited(within=WATCH_S):
            reason = f"ranks exited: {', '.join(dead)}"
        self.abort(reason)
        self.close()
        raise RankFailedError(f"the tensor-parallel group is broken: {self.broken}")

    def _exited(self, within: float = 0.0) -> list[str]:
        """The started ranks that exited, or do within `within` s (killed, one closes its sockets first)."""
        ended = multiprocessing.connection.wait([p.sentinel for p in self.processes], within) if self.processes else ()
        return [p.name for p in self.processes if p.sentinel in ended]

    def close(self) -> None:
        """Stop every other rank (they exit once they read STOP, or when their pipe closes); the
        group's teardown runs here while the ranks run theirs (NCCL's pairs up)."""
        self._closing = True
        for pipe in self.pipes:
            try:
                pipe.send_bytes(STOP)
            except OSError:
                pass
            pipe.close()
        if self.groups:
            disconnect(self.lm, self.device, self.broken is not None)
            self.groups = []
        for process in self.processes:
            process.join(5.0 if self.broken is None else 0.5)
            if process.is_alive():
                process.kill()
                process.join(5.0)
        self.pipes, self.processes = [], []


def serving_timeouts(groups: list, device: torch.device) -> None:
    """Start-up is over (every rank built its part, compiled, captured and measured): NCCL's
    collectives wait TIMEOUT_S from now on, not START_TIMEOUT_S (gloo's were lowered when its
    group formed). A backstop only: the watcher breaks a hung group sooner, and collectives
    replayed inside CUDA graphs are not timed by NCCL at all."""
    if device.type != "cuda":
        return
    for group in groups:
        try:
            group._set_default_timeout(timedelta(seconds=TIMEOUT_S))  # (as torch.distributed's _set_pg_timeout)
        except (AttributeError, RuntimeError) as e:
            log.warning("keeping the tensor-parallel group's start-up timeout: %s: %s", type(e).__name__, e)


def _shut(connection) -> None:
    """Shut a launched rank's connection down both ways (its fd stays open until `close`, so a
    thread still using it meets a shut socket, never a reused fd)."""
    try:
        with socket.socket(fileno=os.dup(connection.fileno())) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # (closed already)
        pass


def _abort(group) -> None:
    try:
        group.abort()
    except Exception as e:
        log.warning("aborting the tensor-parallel group: %s: %s", type(e).__name__, e)


def end_group(group, device: torch.device, broken: bool = False) -> None:
    """Release a process group, waiting at most END_TIMEOUT_S: NCCL's orderly shutdown pairs up
    with the other ranks' (a rank that is gone never comes), a broken group's communicators are
    aborted instead. A teardown that does not end in time is left to the process's exit."""
    def end():
        try:
            group.abort() if broken and device.type == "cuda" else group.shutdown()
        except Exception as e:
            log.warning("ending the tensor-parallel group: %s: %s", type(e).__name__, e)
    thread = threading.Thread(target=end, name="batchmaker-group-end", daemon=True)
    thread.start()
    thread.join(END_TIMEOUT_S)
    if thread.is_alive():
        log.warning("the tensor-parallel group did not end within %.0f s; left to the process's exit", END_TIMEOUT_S)
