"""Chains and decode loops as rows of arrays (the Chain and DecodeLoop forms, batchmaker/forms.py):
a model's stages and, per stage, the queue the scheduler sees.

Requests of a stage wait in a `Waiting` queue (shared, or pinned to the worker that holds their
state from the previous stage). Per worker, a `ChainGroup` (core/chain_group.py) holds up to
max_batch running requests in slots and forms the rounds.
"""
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from batchmaker.core.cell_type import CellType
from batchmaker.core.chain_group import ChainGroup
from batchmaker.core.rows import RowAllocator
from batchmaker.core.task import RoundTask
from batchmaker.core.waiting import Chunk, Waiting



class Finisher(Protocol):
    """The engine's side of a last stage: resolves requests (manager thread)."""

    def resolve(self, owners: np.ndarray, outputs: dict[str, Any], first_cell: np.ndarray) -> None: ...

    def fail(self, owners: list, error: BaseException) -> None: ...

    def stream(self, owner, partial: dict) -> None: ...


@dataclass(eq=False)
class Stage:
    """One Chain or DecodeLoop of a model, as the manager runs it."""

    cell_type: CellType
    position: int  # among the model's stages
    carry: dict[str, str]  # input -> the previous step's output it takes
    step_inputs: tuple[str, ...] = ()  # chain: inputs taking one host value per step
    start: dict[str, int] = field(default_factory=dict)  # decode: carried input -> value at step 0
    stop: tuple[str, int] | None = None  # decode: (output, value) that ends a row
    collect: dict[str, str] = field(default_factory=dict)  # decode: result key -> output
    outputs: dict[str, str] = field(default_factory=dict)  # chain, last stage: result key -> output
    init: dict[str, str] = field(default_factory=dict)  # carried input -> previous stage's output
    next: "ChainQueue | None" = None  # the next stage's queue
    finisher: Finisher | None = None  # the last stage's

    @property
    def is_decode(self) -> bool:
        return self.stop is not None

    @property
    def kept(self) -> tuple[str, ...]:
        """Outputs that get rows: carried ones, fetched ones, those the next stage starts from."""
        out = [*self.carry.values(), *self.outputs.values()]
        if self.next is not None:
            out += self.next.stage.init.values()
        return tuple(dict.fromkeys(out))


class ChainQueue:
    """A stage's cell type as the scheduler sees it: waiting requests and a group per worker."""

    task_kind = "round"  # form() gets SchedulerConfig.max_round_steps: steps of its one round

    def __init__(self, stage: Stage, pools: dict[int, dict[str, RowAllocator]]):
        self.stage = stage
        self.cell_type = stage.cell_type
        self.shared = Waiting()  # first stage: any worker may take them
        self.pinned = {w: Waiting() for w in pools}  # later stages: their state is on that worker
        self.groups = {w: ChainGroup(stage, w, p) for w, p in pools.items()}
        self.num_running_tasks = 0
        self.num_skips = 0
        self.cancel_epoch = 0

    @property
    def num_ready(self) -> int:
        """Requests waiting or running with steps left (each counts as one ready node)."""
        return len(self.shared) + sum(len(p) for p in self.pinned.values()) + sum(
            g.num_stepping for g in self.groups.values())

    def add(self, priorities: np.ndarray, chunk: Chunk, worker_id: int | None = None) -> None:
        (self.shared if worker_id is None else self.pinned[worker_id]).add(priorities, chunk)

    def form(self, worker_id: int, max_steps: int, epoch: int) -> list[RoundTask]:
        if epoch != self.cancel_epoch:  # requests were cancelled or failed: drop them, free their rows
            self.cancel_epoch = epoch
            self.purge()
        task = self.groups[worker_id].form((self.pinned[worker_id], self.shared), max_steps)
        return [] if task is None else [task]

    def complete(self, task: RoundTask) -> None:
        self.groups[task.worker_id].complete(task)

    def purge(self) -> None:
        for worker_id, group in self.groups.items():
            group.purge()
            for chunk in self.pinned[worker_id].purge():
                group.free_init(chunk)
        self.shared.purge()

    @property
    def num_rows_held(self) -> int:
        return sum(g.num_live for g in self.groups.values())
