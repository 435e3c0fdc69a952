"""A rank of a tensor-parallel decoder other than rank 0 (exec/tensor_group.py starts it): a process
that builds its shard, then runs every plan rank 0 sends it, in order, until told to stop.

Its start-up repeats rank 0's worker's, step for step, since each step with collectives must pair
up with rank 0's: the group forms, then (CUDA) the attention kernels compile and the decode graphs
are captured, then the runner measures what rank 0 measures (the same forwards). On a GPU a plan
is launched as rank 0 launches it (the same graph replays), without waiting for the device; the
host keeps a few iterations in flight and retires them in order. Its lifeline ends the process
when rank 0's goes (exec/rank_lifeline.py).
"""
from collections import deque
from datetime import timedelta

import torch
import torch.distributed as dist

from batchmaker.exec.rank_lifeline import Lifeline
from batchmaker.exec.tensor_group import PLAN, START_TIMEOUT_S, FollowerSpec, connect, disconnect, serving_timeouts

IN_FLIGHT = 3  # iterations a rank queues ahead of its device (rank 0 runs at most two ahead of its own)


def follower_main(spec: FollowerSpec, pipe) -> None:
    """Build this rank's part, start up as rank 0 does, then run every plan it is sent until STOP,
    its pipe closes, or a plan fails here (the group is broken then: rank 0 finds this rank gone)."""
    from batchmaker.cells.decoder_cell import DecoderCell
    from batchmaker.core.cell_type import CellType
    from batchmaker.exec.graphs import Graphs
    from batchmaker.exec.iterations import IterationRunner
    lifeline = Lifeline(pipe)
    torch.set_num_threads(spec.threads)
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore(spec.host, spec.port, spec.size, is_master=False, timeout=timedelta(seconds=START_TIMEOUT_S))
    lm = spec.source.build(device, spec.cut)
    cell = DecoderCell(lm, spec.kv, spec.parallel[0], spec.source, spec.parallel[1])
    cell_type = CellType(spec.name, cell, 0, spec.batch_sizes)
    runner = IterationRunner(cell_type, cell, device, Graphs(device, enabled=spec.graphs), spec.num_blocks)
    groups = connect(lm, store, spec.rank, spec.size, device, spec.kv.one_shot)
    try:
        with torch.inference_mode():
            if device.type == "cuda":
                _follow_on_gpu(runner, cell_type, pipe, groups)
            else:
                runner.measure()
                while (plan := _next_plan(pipe)) is not None:
                    runner.execute(_task(cell_type, plan))
        lifeline.stopped.set()
    finally:
        runner.graphs.drop()  # (their captured collectives hold the communicator)
        disconnect(lm, device, broken=not lifeline.stopped.is_set())


def _follow_on_gpu(runner, cell_type, pipe, groups: list) -> None:
    """As a CUDA worker starts (exec/worker.py CUDAWorker) and launches, on a stream of its own."""
    runner.stream = stream = torch.cuda.Stream(runner.device)
    with torch.cuda.stream(stream):
        runner.compile_kernels()
        stream.synchronize()
        runner.warm_up()  # (nothing without graphs)
        stream.synchronize()
        runner.measure()
        serving_timeouts(groups, runner.device)
        in_flight: deque = deque()
        while (plan := _next_plan(pipe)) is not None:
            task = _task(cell_type, plan)
            runner.launch(task)
            done = torch.cuda.Event()
            done.record(stream)
            in_flight.append((task, done))
            while in_flight and (len(in_flight) > IN_FLIGHT or in_flight[0][1].query()):
                task, done = in_flight.popleft()
                done.synchronize()
                runner.finish(task)  # (gives its landing region back)


def _next_plan(pipe):
    """The next plan from rank 0, or None: STOP, or rank 0 gone."""
    from batchmaker.core.iteration_plan import IterationPlan
    try:
        message = pipe.recv_bytes()
    except (EOFError, OSError):
        return None
    return IterationPlan.from_bytes(memoryview(message)[1:]) if message[:1] == PLAN else None  # (a view: no copy)


def _task(cell_type, plan):
    """A plan as the runner takes it (the manager's handle on its copies made here: nobody waits on it)."""
    from batchmaker.core.cache_plan import CachePlan
    from batchmaker.core.task import IterationTask
    c = plan.copies
    handle = None if c is None else CachePlan(c.swap_in_host, c.swap_in_blocks, c.swap_out_blocks, c.swap_out_host,
                                              deferred=c.mode == "side")
    return IterationTask(None, cell_type, 0, plan.num_tokens, plan=plan, cache_plan=handle)
