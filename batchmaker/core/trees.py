"""Trees as rows of arrays (the Tree form, batchmaker/forms.py): one node table per worker.

Trees wait whole, as parsed arrays (batchmaker/core/tree_input.TreeArrays), until a worker's
leaf task needs more leaves; then all their nodes join that worker's `TreeGroup` (a tree never
moves: its internal nodes read their children's rows in place), each node's task index column
written then (batchmaker/core/tree_table.py). A node is ready when its children are submitted
(tasks on one worker run in order), so each task releases its parents with a few numpy passes;
leaves and internal nodes wait in FIFOs per request priority. A task's index is one gather of
its nodes' rows; the rows of children are freed once their parent is submitted, a root's
outputs are copied to the host in its own task's launch.
"""
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from batchmaker.core.cell_type import CellType
from batchmaker.core.chains import Finisher
from batchmaker.core.rows import RowAllocator
from batchmaker.core.task import StepTask
from batchmaker.core.tree_batch import ranges
from batchmaker.core.tree_table import LEFT, SIDE, TREE, UP, NodeTable
from batchmaker.core.waiting import Chunk, Waiting
from batchmaker.errors import CellError

LEAF, INTERNAL = 0, 1


@dataclass(eq=False)
class TreeSpec:
    leaf: CellType
    internal: CellType
    token: str  # the leaf cell's integer input
    left: dict[str, str]  # internal input -> child output
    right: dict[str, str]
    outputs: dict[str, str]  # result key -> root output
    finisher: Finisher | None = None

    @property
    def kept(self) -> tuple[str, ...]:
        """Outputs every node keeps in rows: what parents read and what the root hands back."""
        return tuple(dict.fromkeys([*self.left.values(), *self.right.values(), *self.outputs.values()]))


class TreeQueue:
    """One of the two cell types of a Tree form, as the scheduler sees it; the two share a Forest."""

    task_kind = "step"

    def __init__(self, forest: "Forest", kind: int):
        self.forest, self.kind = forest, kind
        self.cell_type = forest.spec.internal if kind == INTERNAL else forest.spec.leaf
        self.num_running_tasks = 0
        self.num_skips = 0

    @property
    def num_ready(self) -> int:
        f = self.forest
        ready = sum(g.num_ready[self.kind] for g in f.groups.values())
        return ready + (f.num_waiting_leaves if self.kind == LEAF else 0)

    def form(self, worker_id: int, max_tasks: int, epoch: int) -> list[StepTask]:
        return self.forest.form(self.kind, worker_id, max_tasks, epoch)

    def complete(self, task: StepTask) -> None:
        self.forest.groups[task.worker_id].complete(task)


class Forest:
    """Trees waiting to start, and a TreeGroup per worker."""

    def __init__(self, spec: TreeSpec, pools: dict[int, dict[str, RowAllocator]]):
        self.spec = spec
        self.waiting = Waiting()
        self.num_waiting_leaves = 0
        self.groups = {w: TreeGroup(spec, w, p) for w, p in pools.items()}
        self.queues = (TreeQueue(self, LEAF), TreeQueue(self, INTERNAL))
        self.cancel_epoch = 0

    def add(self, priorities: np.ndarray, chunk: Chunk) -> None:
        """Parsed trees: chunk.steps holds per tree its nodes [2n - 1, 3] (token, left, right)."""
        self.waiting.add(priorities, chunk)
        self.num_waiting_leaves += int(chunk.columns["leaves"].sum())

    def form(self, kind: int, worker_id: int, max_tasks: int, epoch: int) -> list[StepTask]:
        if epoch != self.cancel_epoch:
            self.cancel_epoch = epoch
            for group in self.groups.values():
                group.purge()
            for chunk in self.waiting.purge():
                self.num_waiting_leaves -= int(chunk.columns["leaves"].sum())
        group = self.groups[worker_id]
        cell_type = self.spec.leaf if kind == LEAF else self.spec.internal
        tasks = []
        if kind == LEAF and len(self.waiting):  # the leaves of every task formed now, in one join
            wanted = max_tasks * cell_type.max_batch - group.num_ready[LEAF]
            if wanted > 0:
                self._start_trees(group, wanted)
        while len(tasks) < max_tasks:
            if not group.num_ready[kind] or (tasks and group.num_ready[kind] < cell_type.min_batch):
                break
            tasks.append(group.form(kind))
        return tasks

    def _start_trees(self, group: "TreeGroup", leaves_wanted: int) -> None:
        """Move waiting trees into the group until it has enough leaves for a full task."""
        chunk = self.waiting.take(leaves_wanted, weights="leaves")
        if chunk is not None:
            self.num_waiting_leaves -= int(chunk.columns["leaves"].sum())
            group.join(chunk)


class TreeGroup:
    """The nodes of the trees one worker runs (batchmaker/core/tree_table.py: a row per node,
    compacted when four fifths are dead); a task's plan never keeps node ids past its
    formation."""

    min_dead_to_compact = 16384  # (a compaction moves the live trees' rows: at most 1 per 4 dead ones)
    dead_per_live = 4

    def __init__(self, spec: TreeSpec, worker_id: int, pools: dict[str, RowAllocator]):
        self.spec = spec
        self.worker_id = worker_id
        self.pools = pools
        self.nodes = NodeTable(spec, pools)
        self.owner = np.empty(64, dtype=object)  # the tree table: its request,
        self.first_cell = np.zeros(64)  # when its first node joined,
        self.priority = np.zeros(64, dtype=np.int64)  # its request's priority,
        self.size = np.zeros(64, dtype=np.int64)  # its nodes,
        self.start = np.zeros(64, dtype=np.int64)  # its first node's id (leaves first: TreeArrays' order)
        self.live = np.zeros(64, dtype=bool)
        self.num_prioritized = 0  # live trees of a priority other than 0
        self._free_trees = list(range(63, -1, -1))
        self.num_compactions = 0
        self.fifos = ({}, {})  # kind -> priority -> deque of node-id arrays (only live trees' nodes)
        self.num_ready = [0, 0]

    # admission ------------------------------------------------------------------------------
    def join(self, chunk: Chunk) -> None:
        sizes = chunk.lengths  # 2n - 1 nodes per tree
        num_live = int(self.size[self.live].sum())  # (nodes of finished or dropped trees: the rest)
        if self.nodes.num_nodes - num_live > max(self.min_dead_to_compact, self.dead_per_live * num_live):
            self._compact()
        trees = self._tree_slots(len(chunk))
        self.owner[trees] = chunk.owners
        self.first_cell[trees] = time.perf_counter()
        self.priority[trees] = chunk.columns["priority"]
        self.num_prioritized += int(np.count_nonzero(self.priority[trees]))
        self.size[trees] = sizes
        self.live[trees] = True
        nodes = chunk.values.reshape(-1, 3)
        self.start[trees] = self.nodes.add(nodes, sizes, trees) + np.cumsum(sizes) - sizes
        self._enqueue(LEAF, self.start[trees[0]] + np.flatnonzero(nodes[:, 1] < 0))

    def _tree_slots(self, n: int) -> np.ndarray:
        while len(self._free_trees) < n:
            cap = len(self.live)
            self._free_trees[:0] = range(2 * cap - 1, cap - 1, -1)
            self.owner = np.concatenate([self.owner, np.empty(cap, dtype=object)])
            for name in ("first_cell", "priority", "size", "start", "live"):
                old = getattr(self, name)
                setattr(self, name, np.concatenate([old, np.zeros(cap, dtype=old.dtype)]))
        slots = self._free_trees[len(self._free_trees) - n:]
        del self._free_trees[len(self._free_trees) - n:]
        return np.asarray(slots, dtype=np.int64)

    def _compact(self) -> None:
        """Drop the nodes of finished trees: the live trees' rows, tree by tree, move to the
        front (a tree's rows hold no node ids, only offsets); ready node ids move with their tree."""
        trees = np.flatnonzero(self.live)
        trees = trees[np.argsort(self.start[trees])]
        sizes = self.size[trees]
        shift = np.zeros(len(self.live), dtype=np.int64)
        shift[trees] = np.cumsum(sizes) - sizes - self.start[trees]
        tree_of = self.nodes.data[:, TREE]
        for fifos in self.fifos:
            for level, queue in fifos.items():
                ids = np.concatenate(list(queue)) if queue else np.zeros(0, dtype=np.int64)
                fifos[level] = deque([ids + shift[tree_of[ids]]] if len(ids) else [])
        self.nodes.compact(ranges(self.start[trees], sizes))
        self.start[trees] += shift[trees]
        self.num_compactions += 1

    # forming a task -------------------------------------------------------------------------
    def form(self, kind: int) -> StepTask:
        """A task of up to max_batch ready nodes of `kind`: their rows gathered (the index is
        columns of them), then the parents that this task makes ready (a node is ready once
        both its children are in formed tasks; a parent whose children are both in this task is
        released by its left child only)."""
        nodes = self.nodes
        cell_type = self.spec.internal if kind == INTERNAL else self.spec.leaf
        ids = self._take(kind, cell_type.max_batch)
        cols = nodes.data.take(ids, axis=0).T.copy()  # [W, n]: each column of the table contiguous
        index = nodes.index(kind, cols)  # [S, n] (a view)
        trees, up = cols[TREE], cols[UP]
        task = StepTask(self, cell_type, self.worker_id, len(ids), index=index, owners=self.owner.take(trees))
        submitted, siblings = nodes.submitted, ids + cols[SIDE]
        before = submitted.take(siblings)
        submitted[ids] = True
        releases = np.logical_or(before, np.logical_and(submitted.take(siblings), cols[LEFT]))  # (never a root)
        ready = (ids + up)[releases]
        if len(ready):
            ready.sort()
            self._enqueue(INTERNAL, ready)
        if kind == INTERNAL:
            nodes.free_children_rows(index)
        is_root = up == 0
        if np.count_nonzero(is_root):
            lanes = np.flatnonzero(is_root)
            task.fetch = {out: lanes for out in self.spec.outputs.values()}
            finished = trees[lanes]
            task.info = (self.owner[finished], self.first_cell[finished])
            nodes.free_root_rows(kind, index, lanes)
            self._finish_trees(finished)
        return task

    def _take(self, kind: int, limit: int) -> np.ndarray:
        """Up to `limit` ready node ids of `kind`, highest priority first, FIFO within."""
        fifos, parts, want = self.fifos[kind], [], limit
        for level, queue in list(fifos.items()):
            while queue and want:
                ids = queue.popleft()
                if len(ids) > want:
                    queue.appendleft(ids[want:])
                    ids = ids[:want]
                parts.append(ids)
                want -= len(ids)
            if not queue and level != 0:
                del fifos[level]
            if not want:
                break
        ids = np.concatenate(parts) if len(parts) != 1 else parts[0]
        self.num_ready[kind] -= len(ids)
        return ids

    def _enqueue(self, kind: int, ids: np.ndarray) -> None:
        """Nodes of live trees become ready (all at priority 0 while no live tree has another)."""
        fifos = self.fifos[kind]
        if self.num_prioritized:
            priorities = self.priority[self.nodes.data[ids, TREE]]
            levels = [int(priorities[0])] if (priorities == priorities[0]).all() else np.unique(priorities).tolist()
        else:
            priorities, levels = None, [0]
        for level in levels:
            part = ids if len(levels) == 1 else ids[priorities == level]
            if level not in fifos:
                fifos[level] = deque()
                self.fifos = tuple(dict(sorted(f.items(), reverse=True)) if f is fifos else f for f in self.fifos)
                fifos = self.fifos[kind]
            fifos[level].append(part)
        self.num_ready[kind] += len(ids)

    def _finish_trees(self, trees: np.ndarray) -> None:
        self.live[trees] = False
        self.owner[trees] = None
        if self.num_prioritized:
            self.num_prioritized -= int(np.count_nonzero(self.priority[trees]))
        self._free_trees += trees.tolist()

    # completion and dropping ----------------------------------------------------------------
    def complete(self, task: StepTask) -> None:
        finisher = self.spec.finisher
        if task.error is not None:  # every tree the task touched fails (later tasks of it run on garbage)
            owners = {id(o): o for o in task.owners if not o._done}
            finisher.fail(list(owners.values()), CellError(f"cell {task.cell_type.name} failed: {task.error!r}"))
            return
        if task.info is not None:
            owners, first_cell = task.info
            finisher.resolve(owners, {key: task.fetched[out] for key, out in self.spec.outputs.items()}, first_cell)

    def purge(self) -> None:
        """Drop the trees whose future is done (cancelled, expired, failed): their ready nodes
        leave the FIFOs, their rows are freed."""
        trees = np.flatnonzero(self.live)
        if not len(trees):
            return
        done = np.fromiter((o._done for o in self.owner[trees]), dtype=bool, count=len(trees))
        if not done.any():
            return
        is_dropped = np.zeros(len(self.live), dtype=bool)
        is_dropped[trees[done]] = True
        tree_of = self.nodes.data[:, TREE]
        for kind, fifos in enumerate(self.fifos):
            for level, queue in fifos.items():
                ids = np.concatenate(list(queue)) if queue else np.zeros(0, dtype=np.int64)
                kept = ids[~is_dropped[tree_of[ids]]]
                self.num_ready[kind] -= len(ids) - len(kept)
                fifos[level] = deque([kept] if len(kept) else [])
        dropped, sizes = trees[done], self.size[trees[done]]
        ids = ranges(self.start[dropped], sizes)
        is_inner = ranges(0 * sizes, sizes) >= np.repeat((sizes + 1) // 2, sizes)  # (leaves first in each tree)
        self.nodes.free_held_rows(ids, is_inner)
        self._finish_trees(dropped)
