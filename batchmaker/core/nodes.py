"""The general path's queue of one cell type: subgraphs of requests unfolded node by node
(`unfold(inputs, g)` functions and generators, batchmaker/core/graph.py), batched as thesis
Algorithm 1's FormBatchedTask does. Pure Python over Node/Subgraph objects.

Within a request priority, subgraphs are served in the order they became ready (FIFO scan); a
task is filled from the highest priority level first, so a busy high level can delay a low one.
"""
from dataclasses import dataclass, field
from typing import ClassVar

from batchmaker.core.cell_type import CellType
from batchmaker.core.task import NodeTask


@dataclass(slots=True, eq=False)
class NodeQueue:
    task_kind: ClassVar[str] = "node"
    cell_type: CellType
    processor: object = None  # the RequestProcessor: told of submits and completions
    # request priority -> {subgraph id: subgraph} in FIFO order; levels kept highest first
    levels: dict = field(default_factory=dict)
    num_ready: int = 0
    num_running_tasks: int = 0
    num_skips: int = 0

    def enqueue(self, subgraph) -> None:
        """A subgraph whose external inputs are all satisfied joins the queue."""
        subgraph.ready.extend(n for n in subgraph.nodes if n.num_pending == 0 and not n.is_submitted)
        level = self.levels.get(subgraph.priority)
        if level is None:
            level = {}
            self.levels = dict(sorted({**self.levels, subgraph.priority: level}.items(), reverse=True))
        level[subgraph.id] = subgraph
        self.num_ready += len(subgraph.ready)

    def drop(self, subgraph) -> None:
        """Forget a subgraph of a failed or cancelled request."""
        level = self.levels.get(subgraph.priority)
        if level is not None and level.pop(subgraph.id, None) is not None:
            self.num_ready -= len(subgraph.ready)
            self._prune(subgraph.priority)
        subgraph.ready.clear()

    def form(self, worker_id: int, max_tasks: int, epoch: int) -> list[NodeTask]:
        tasks: list[NodeTask] = []
        while len(tasks) < max_tasks:
            nodes = self._take(worker_id)
            rows = sum(n.num_rows for n in nodes)
            if rows and (rows >= self.cell_type.min_batch or not tasks):
                tasks.append(self._submit(worker_id, nodes))
            else:
                for node in reversed(nodes):  # too few for a task: back to the fronts of their queues
                    node.subgraph.ready.appendleft(node)
                break
        return tasks

    def complete(self, task: NodeTask) -> None:
        """Unpin subgraphs with no task left in flight, then apply the task to its requests."""
        for sg in _distinct_subgraphs(task.nodes):
            sg.num_tasks_in_flight -= 1
            if sg.num_tasks_in_flight == 0:
                sg.pinned = None
        self.processor.complete(task)

    def _take(self, worker_id: int) -> list:
        """FormBatchedTask: ready nodes of subgraphs not pinned elsewhere, oldest first."""
        nodes: list = []
        rows, limit = 0, self.cell_type.max_batch
        for level in self.levels.values():
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

    def _submit(self, worker_id: int, nodes: list) -> NodeTask:
        """Pin the task's subgraphs and release same-subgraph successors (tasks on one worker
        run in submission order, so they may go into the next task)."""
        self.num_ready -= len(nodes)
        for node in nodes:
            node.is_submitted = True
            node.worker_id = worker_id
            sg = node.subgraph
            sg.num_unsubmitted -= 1
            for succ in node.internal_successors:
                succ.num_pending -= 1
                if succ.num_pending == 0:
                    sg.ready.append(succ)
                    self.num_ready += 1
        for sg in _distinct_subgraphs(nodes):
            sg.pinned = worker_id
            sg.num_tasks_in_flight += 1
            if sg.num_unsubmitted == 0:
                del self.levels[sg.priority][sg.id]
                self._prune(sg.priority)
        task = NodeTask(self, self.cell_type, worker_id, sum(n.num_rows for n in nodes), nodes=nodes)
        self.processor.on_submit(task)
        return task

    def _prune(self, priority: int) -> None:
        """Drop an emptied priority level (the default level 0 stays: it is almost always used)."""
        if priority != 0 and not self.levels[priority]:
            del self.levels[priority]


def _distinct_subgraphs(nodes: list) -> list:
    return list({id(n.subgraph): n.subgraph for n in nodes}.values())
