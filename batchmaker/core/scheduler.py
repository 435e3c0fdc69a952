"""Algorithm 1 of the thesis: choose a cell type for a worker, then form up to MaxTasksToSubmit
tasks of it. Pure Python over cell queues; no torch, no numpy of its own.

A cell queue is anything with `cell_type`, `task_kind` (what it forms: a "round" queue gets
`max_round_steps` as its limit: the steps of its one round), `num_ready`, `num_running_tasks`,
`num_skips` and `form(worker_id, max_tasks, epoch) -> [Task]`: a general-path NodeQueue (core/nodes.py), a
ChainQueue (core/chains.py, chains and decode loops) or a TreeQueue (core/trees.py). The scheduler
picks the queue in O(number of cell types); forming costs each queue a few numpy passes over its
own arrays, whatever the number of requests it holds.

Starvation guard (ours, on top of Algorithm 1): a type with ready nodes that has been passed over
`max_skips` times in a row is chosen next, whatever the priorities say; among types of equal
tier and priority, the one passed over longest goes first. If the preferred type has
nothing this worker may take (all pinned elsewhere), the next candidate is tried.
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    max_tasks_to_submit: int = 5  # thesis default: locality without starving other types
    max_skips: int = 64  # schedule calls a ready type may be passed over before it is forced
    # Steps of a chain or decode round: one launch (one task for the worker and for Algorithm 1)
    # holding k steps of the same lanes. The manager's cost per round is mostly fixed, so longer
    # rounds serve more requests per host microsecond (H200, LSTM: 8 steps gave 1.6x the requests/s
    # of 5); a request arriving meanwhile waits for the round (k GPU steps, ~20 µs each) to join.
    max_round_steps: int = 10


class Scheduler:
    def __init__(self, queues: list, config: SchedulerConfig = SchedulerConfig()):
        self.config = config
        self.queues = queues
        self._queue_of = {id(q.cell_type): q for q in queues}
        self.cancel_epoch = 0  # moved by the engine when requests are cancelled or fail: queues purge

    def schedule(self, worker_id: int) -> list:
        """Tasks for a worker, in the order it must run them (empty if nothing fits it)."""
        for q in self._candidates():
            limit = self.config.max_round_steps if q.task_kind == "round" else self.config.max_tasks_to_submit
            tasks = q.form(worker_id, limit, self.cancel_epoch)
            if tasks:
                q.num_running_tasks += len(tasks)
                for other in self.queues:
                    other.num_skips = 0 if other is q or not other.num_ready else other.num_skips + 1
                return tasks
        return []

    def complete(self, task) -> None:
        """The worker ran `task`: its source applies it (frees, releases, resolves)."""
        self._queue_of[id(task.cell_type)].num_running_tasks -= 1
        task.source.complete(task)

    @property
    def num_ready(self) -> int:
        return sum(q.num_ready for q in self.queues)

    def queue_lengths(self) -> dict[str, dict[str, int]]:
        """Per cell type: ready nodes and running tasks (approximate off the manager thread)."""
        return {q.cell_type.name: {"num_ready": q.num_ready, "num_running_tasks": q.num_running_tasks}
                for q in self.queues}

    def _candidates(self) -> list:
        """Cell types in the order Algorithm 1 prefers them (lines 5-10), forced ones first."""

        def tier(q) -> int:
            if q.num_skips >= self.config.max_skips:
                return 0
            if q.num_ready >= q.cell_type.max_batch:
                return 1  # (a) a full batch is waiting
            if q.num_running_tasks == 0:
                return 2  # (b) ready nodes and nothing running
            return 3  # (c) any ready nodes

        active = [q for q in self.queues if q.num_ready]
        # among equals, the type passed over longest first (round robin instead of list order)
        return sorted(active, key=lambda q: (tier(q), -q.cell_type.priority, -q.num_skips))
