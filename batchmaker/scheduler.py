"""Algorithm 1 of the thesis: choose a cell type for an idle worker, then form up to
MaxTasksToSubmit batched tasks of it. Pure Python over Node/Subgraph data; no torch calls.

Starvation guarantee (ours, on top of Algorithm 1): within a cell type and request priority,
subgraphs are served in the order they became ready (FIFO scan); across types, a type with ready
nodes that has been passed over `max_skips` times in a row is chosen next, whatever the
priorities say. Request priorities (a per-request field) order subgraphs *within* a cell type:
a task is filled from the highest-priority level first, so a busy high level can delay a low one.

Chains (batchmaker/chain.py) count one ready node each while they wait or run; a task of a chain
cell type is one step of the worker's chain group, which waiting chains join (highest priority
first) up to the type's max batch. A round of up to MaxTasksToSubmit steps is formed at once;
chains that end inside it drop out of its later steps.
"""
import heapq
import itertools
from dataclasses import dataclass, field

import numpy as np

from batchmaker.chain import ChainGroup, ChainStep
from batchmaker.graph import Node, Subgraph
from batchmaker.model import CellType
from batchmaker.task import Task

_arrivals = itertools.count()


@dataclass(frozen=True)
class SchedulerConfig:
    max_tasks_to_submit: int = 5  # thesis default: locality without starving other types
    max_skips: int = 64  # schedule calls a ready type may be passed over before it is forced


@dataclass(slots=True, eq=False)
class CellQueue:
    cell_type: CellType
    # request priority -> {subgraph id: subgraph} in FIFO order; levels kept highest first
    levels: dict[int, dict[int, Subgraph]] = field(default_factory=dict)
    num_ready: int = 0  # ready nodes, chains included
    num_running_tasks: int = 0
    num_skips: int = 0
    waiting: list = field(default_factory=list)  # heap of (-priority, arrival, chain subgraph)
    groups: dict[int, ChainGroup] = field(default_factory=dict)  # worker id -> its chain group
    num_chains: int = 0  # chains waiting or running (part of num_ready)
    num_dead: int = 0  # entries of `waiting` whose chain was dropped (purged when they are half)
    prefer_chains: bool = True  # alternates when a type has both chains and plain nodes


class Scheduler:
    def __init__(self, cell_types: list[CellType], config: SchedulerConfig = SchedulerConfig()):
        self.config = config
        self.queues = {id(ct): CellQueue(ct) for ct in cell_types}

    def enqueue(self, subgraph: Subgraph) -> None:
        """A subgraph whose external inputs are all satisfied joins its cell type's queue."""
        q = self.queues[id(subgraph.cell_type)]
        if subgraph.is_chain:
            subgraph.chain_state = "waiting"
            heapq.heappush(q.waiting, (-subgraph.priority, next(_arrivals), subgraph))
            q.num_ready += 1
            q.num_chains += 1
            return
        subgraph.ready.extend(n for n in subgraph.nodes if n.num_pending == 0 and not n.is_submitted)
        level = q.levels.get(subgraph.priority)
        if level is None:
            level = {}
            q.levels = dict(sorted({**q.levels, subgraph.priority: level}.items(), reverse=True))
        level[subgraph.id] = subgraph
        q.num_ready += len(subgraph.ready)

    def schedule(self, worker_id: int) -> list[Task]:
        """Tasks for an idle worker, in the order it must run them (empty if nothing fits it)."""
        for q in self._candidates():
            tasks = self._batch(q, worker_id)
            if tasks:
                for other in self.queues.values():
                    other.num_skips = 0 if other is q or not other.num_ready else other.num_skips + 1
                return tasks
        return []

    def complete(self, task: Task) -> None:
        """The worker finished `task`: unpin subgraphs with no task left in flight."""
        self.queues[id(task.cell_type)].num_running_tasks -= 1
        for sg in _distinct_subgraphs(task.nodes):
            sg.num_tasks_in_flight -= 1
            if sg.num_tasks_in_flight == 0:
                sg.pinned = None

    def drop(self, subgraph: Subgraph) -> None:
        """Forget a subgraph of a failed or cancelled request."""
        q = self.queues[id(subgraph.cell_type)]
        if subgraph.is_chain:
            if subgraph.chain_state == "waiting":
                q.num_ready -= 1
                q.num_chains -= 1
                q.num_dead += 1
                if 2 * q.num_dead > len(q.waiting):  # dead entries would keep their requests alive
                    subgraph.chain_state = "dropped"
                    q.waiting = [e for e in q.waiting if e[2].chain_state == "waiting"]
                    heapq.heapify(q.waiting)
                    q.num_dead = 0
            elif subgraph.chain_state == "running":  # counted until its group lets it go
                q.groups[subgraph.pinned].num_dropped += 1
            subgraph.chain_state = "dropped"
            return
        level = q.levels.get(subgraph.priority)
        if level is not None and level.pop(subgraph.id, None) is not None:
            q.num_ready -= len(subgraph.ready)
            _prune(q, subgraph.priority)
        subgraph.ready.clear()

    @property
    def num_ready(self) -> int:
        return sum(q.num_ready for q in self.queues.values())

    def queue_lengths(self) -> dict[str, dict[str, int]]:
        """Per cell type: ready nodes, queued subgraphs, running tasks (approximate off-thread)."""
        return {q.cell_type.name: {"num_ready": q.num_ready, "num_running_tasks": q.num_running_tasks,
                                   "num_subgraphs": sum(len(level) for level in list(q.levels.values())),
                                   "num_chains": q.num_chains}
                for q in self.queues.values()}

    def _candidates(self) -> list[CellQueue]:
        """Cell types in the order Algorithm 1 prefers them (lines 5-10), forced ones first."""

        def tier(q: CellQueue) -> int:
            if q.num_skips >= self.config.max_skips:
                return 0
            if q.num_ready >= q.cell_type.max_batch:
                return 1  # (a) a full batch is waiting
            if q.num_running_tasks == 0:
                return 2  # (b) ready nodes and nothing running
            return 3  # (c) any ready nodes

        active = [q for q in self.queues.values() if q.num_ready]
        return sorted(active, key=lambda q: (tier(q), -q.cell_type.priority))

    def _batch(self, q: CellQueue, worker_id: int) -> list[Task]:
        group = q.groups.get(worker_id)
        has_chains = bool(q.waiting) or (group is not None and (len(group) or group.num_dropped))
        if has_chains and (q.prefer_chains or q.num_ready == q.num_chains):
            q.prefer_chains = False
            tasks = self._chain_steps(q, worker_id)
            if tasks:
                return tasks
        q.prefer_chains = True
        return self._plain_batch(q, worker_id)

    def _chain_steps(self, q: CellQueue, worker_id: int) -> list[Task]:
        """Steps of this worker's chain group, after waiting chains join it."""
        group = q.groups.get(worker_id)
        if group is None:
            group = q.groups[worker_id] = ChainGroup(q.cell_type, worker_id)
        dropped, dropped_rows = group.leave()
        q.num_ready -= len(dropped)
        q.num_chains -= len(dropped)
        joined, room = [], q.cell_type.max_batch - len(group)
        while q.waiting and len(joined) < room:
            sg = heapq.heappop(q.waiting)[2]
            if sg.chain_state != "waiting":
                q.num_dead -= 1  # dropped while it waited
                continue
            sg.chain_state, sg.pinned, sg.num_tasks_in_flight = "running", worker_id, 1
            node = sg.nodes[0]
            node.is_submitted, node.worker_id = True, worker_id
            joined.append(node)
        group.join(joined)
        if not len(group) and not dropped:
            return []
        remaining = group.remaining
        num_steps = min(self.config.max_tasks_to_submit, int(remaining.max())) if len(group) else 1
        tasks = []
        for j in range(num_steps):
            # members with steps left at step j; chains that end early drop out of later steps
            active = np.flatnonzero(remaining > j) if j and remaining.min() <= j else None
            members = group.members if active is None else group.members[active]
            left = remaining if active is None else remaining[active]
            finishing = np.flatnonzero(left == j + 1)
            nodes = members[finishing].tolist()
            for node in nodes:
                node.subgraph.chain_state = "submitted"
            pos = (group.arrays["pos"] if active is None else group.arrays["pos"][active]) + j
            step = ChainStep(group, members, pos, len(joined) if j == 0 else 0, finishing,
                             dropped_rows if j == 0 else {}, active,
                             same_members=j > 0 and not (remaining == j).any(),  # nobody ended at j - 1
                             last_in_round=j == num_steps - 1)
            if j == 0:
                nodes += dropped
            q.num_ready -= len(finishing)
            q.num_chains -= len(finishing)
            q.num_running_tasks += 1
            tasks.append(Task(q.cell_type, worker_id, nodes, chain=step))
        group.arrays["pos"] = group.arrays["pos"] + np.minimum(remaining, num_steps)
        return tasks

    def _plain_batch(self, q: CellQueue, worker_id: int) -> list[Task]:
        tasks: list[Task] = []
        while len(tasks) < self.config.max_tasks_to_submit:
            nodes = self._form_task(q, worker_id)
            rows = sum(n.num_rows for n in nodes)
            if rows and (rows >= q.cell_type.min_batch or not tasks):
                tasks.append(self._submit(q, worker_id, nodes))
            else:
                _give_back(nodes)
                break
        return tasks

    def _form_task(self, q: CellQueue, worker_id: int) -> list[Node]:
        """FormBatchedTask: ready nodes of subgraphs not pinned elsewhere, oldest first."""
        nodes: list[Node] = []
        rows, limit = 0, q.cell_type.max_batch
        for level in q.levels.values():
            for sg in level.values():
                if sg.pinned is not None and sg.pinned != worker_id:
                    continue
                ready = sg.ready
                while ready and rows + ready[0].num_rows <= limit:
                    node = ready.popleft()
                    nodes.append(node)
                    rows += node.num_rows
                if rows == limit:
                    return nodes
        return nodes

    def _submit(self, q: CellQueue, worker_id: int, nodes: list[Node]) -> Task:
        """Pin the task's subgraphs and release same-subgraph successors (tasks on one worker
        run in submission order, so they may go into the next task)."""
        q.num_ready -= len(nodes)
        q.num_running_tasks += 1
        for node in nodes:
            node.is_submitted = True
            node.worker_id = worker_id
            sg = node.subgraph
            sg.num_unsubmitted -= 1
            for succ in node.internal_successors:
                succ.num_pending -= 1
                if succ.num_pending == 0:
                    sg.ready.append(succ)
                    q.num_ready += 1
        for sg in _distinct_subgraphs(nodes):
            sg.pinned = worker_id
            sg.num_tasks_in_flight += 1
            if sg.num_unsubmitted == 0:
                del q.levels[sg.priority][sg.id]
                _prune(q, sg.priority)
        return Task(q.cell_type, worker_id, nodes)


def _prune(q: CellQueue, priority: int) -> None:
    """Drop an emptied priority level (the default level 0 stays: it is almost always used)."""
    if priority != 0 and not q.levels[priority]:
        del q.levels[priority]


def _give_back(nodes: list[Node]) -> None:
    """Return nodes of a batch too small to submit to the fronts of their ready queues."""
    for node in reversed(nodes):
        node.subgraph.ready.appendleft(node)


def _distinct_subgraphs(nodes: list[Node]) -> list[Subgraph]:
    return list({id(n.subgraph): n.subgraph for n in nodes}.values())
