"""Tasks: one batched execution on one worker, as the manager planned it (no torch here).

Each kind of task has its own plan, and the worker has one runner per kind (`Task.kind`):
  StepTask       one step of a cell over a batch of rows (tree frontiers; general-path nodes are
                 planned into one by the worker, since their host values need torch)
  RoundTask      k steps of a cell over the same lanes (chains and decode loops), launched at once
  NodeTask       general-path nodes (batchmaker/core/graph.py), planned by the worker
  IterationTask  one decoder iteration (its plan: core/iteration_plan.py)
`source` formed the task and completes it: `source.complete(task)` on the manager thread once the
worker has run it (`task.error` set if the cell raised).
"""
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from batchmaker.core.cell_type import CellType
from batchmaker.core.iteration_plan import IterationPlan


@dataclass(slots=True, eq=False)
class Task:
    kind: ClassVar[str]  # which runner of a worker runs it (with the cell type: exec/worker.py)
    source: Any  # formed it; completes it
    cell_type: CellType
    worker_id: int
    batch: int  # rows of the batch (before padding)
    error: BaseException | None = field(default=None, init=False)  # set when the cell raised
    handle: Any = field(default=None, init=False)  # the runner's launch state

    @property
    def num_steps(self) -> int:
        return 1

    @property
    def num_rows(self) -> int:
        """Rows x steps its steps need (before padding to a graph's batch size)."""
        return self.batch * self.num_steps


@dataclass(slots=True, eq=False)
class StepTask(Task):
    """index: int64 [layout.num_slices, batch] (batchmaker/core/cell_type.Layout); fetch: output ->
    lanes whose values the host needs after the step (copied out in the same launch)."""

    kind = "step"

    index: np.ndarray = None
    fetch: dict[str, np.ndarray] = field(default_factory=dict)
    fetched: dict[str, Any] = field(default_factory=dict)  # output -> host values [len(lanes), ...]
    owners: Any = None  # who a failure fails: the source's record of each lane's request
    info: Any = None  # what the source needs back at completion
    value_only: tuple[str, ...] = ()  # integer inputs whose rows are all 0: their values suffice
    staged: list = field(default_factory=list)  # general path: (input, rows, host values) copied in first
    reuse: dict[str, str] = field(default_factory=dict)  # input -> previous task's output with its rows


@dataclass(slots=True, eq=False)
class RoundTask(Task):
    """k steps over the same `batch` lanes (sorted so that lanes [0, num_active[j]) step at step j).

    index: int64 [k, layout.num_slices, batch]: per step, the rows each lane reads and writes and
      its host values (inactive lanes read row 0 and value 0, write the pool's scratch row)
    carry: input -> the output of the previous step it takes; a runner that keeps the batch on
      the device between steps reads carried inputs from the index only at step 0
    saved: the outputs written to rows (the others are not kept)
    last: [batch] each lane's last active step; its writes at that step are what later tasks read
    record: outputs the host gets at every step ([k, batch] each, in `recorded`)
    fetch: output -> rows of the pool copied to the host after the round (in `fetched`)
    """

    kind = "round"

    index: np.ndarray = None
    num_active: np.ndarray = None
    last: np.ndarray = None
    carry: dict[str, str] = field(default_factory=dict)
    saved: tuple[str, ...] = ()  # outputs whose writes matter (the others' slices are ignored)
    record: tuple[str, ...] = ()
    owners: np.ndarray = None  # object [batch]: each lane's request
    fetch: dict[str, np.ndarray] = field(default_factory=dict)
    recorded: dict[str, Any] = field(default_factory=dict)
    fetched: dict[str, Any] = field(default_factory=dict)
    info: Any = None

    @property
    def num_steps(self) -> int:
        return len(self.index)

    @property
    def num_rows(self) -> int:
        """Lanes x steps while they step (a lane past its last step computes only when padded)."""
        return int(self.num_active.sum())


@dataclass(slots=True, eq=False)
class NodeTask(Task):
    kind = "node"
    nodes: list = field(default_factory=list)  # general-path Nodes, planned by the worker


@dataclass(slots=True, eq=False)
class IterationTask(Task):
    """One iteration of a decoder over a flat batch of `batch` tokens: prompt chunks of some
    sequences and one decode token of others (ORCA's iteration-level scheduling with selective
    batching). `plan` (core/iteration_plan.py) is what the worker runs; the rest is the manager's:
    each sequence's slot, its occupant's serial and future ([S], in the plan's order), and which
    of them sample this iteration (`sample`: indices into slots [N]; the plan's samples in order).
    """

    kind = "iteration"

    plan: IterationPlan = None
    slots: np.ndarray = None
    serials: np.ndarray = None
    owners: np.ndarray = None
    sample: np.ndarray = None
    cache_plan: Any = None  # the manager's handle on the plan's copies (core/cache_plan.py): the worker sets `done`
    sampled: np.ndarray = None  # int64 [N], filled when the task finished
    logprobs: tuple = None  # with plan.logprobs >= 0: the sampled tokens' [N] and the top k's ids and values [N, k]
    seconds: float = math.nan  # how long the iteration ran (its runner measures it where it can)
