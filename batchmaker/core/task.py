"""Tasks: one batched execution on one worker, as the manager planned it (no torch here).

Each kind of task has its own plan, and the worker has one runner per kind:
  StepTask   one step of a cell over a batch of rows (tree frontiers; general-path nodes are
             planned into one by the worker, since their host values need torch)
  RoundTask  k steps of a cell over the same lanes (chains and decode loops), launched at once
  NodeTask   general-path nodes (batchmaker/core/graph.py), planned by the worker
`source` formed the task and completes it: `source.complete(task)` on the manager thread once the
worker has run it (`task.error` set if the cell raised).
"""
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from batchmaker.core.cell_type import CellType


@dataclass(slots=True, eq=False)
class Task:
    source: Any  # formed it; completes it
    cell_type: CellType
    worker_id: int
    batch: int  # rows of the batch (before padding)
    error: BaseException | None = field(default=None, init=False)  # set when the cell raised
    handle: Any = field(default=None, init=False)  # the runner's launch state

    @property
    def num_steps(self) -> int:
        return 1


@dataclass(slots=True, eq=False)
class StepTask(Task):
    """index: int64 [layout.num_slices, batch] (batchmaker/core/cell_type.Layout); fetch: output ->
    lanes whose values the host needs after the step (copied out in the same launch)."""

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


@dataclass(slots=True, eq=False)
class NodeTask(Task):
    nodes: list = field(default_factory=list)  # general-path Nodes, planned by the worker


@dataclass(slots=True, eq=False)
class IterationTask(Task):
    """One iteration of a decoder over a flat batch of `batch` tokens: prompt chunks of some
    sequences and one decode token of others (ORCA's iteration-level scheduling with selective
    batching). Sequence i owns tokens query_start[i]..query_start[i+1]-1, the last positions of its
    context of context_lens[i] positions; token-wise work runs on the flat batch, attention per
    sequence over its blocks (block_tables[i]).

    tokens: int64 [T], -1 where the token is the slot's last sampled one (it stays on the device)
    positions, kv_slots, token_slots: int64 [T]: position, cache slot, sequence slot of each token
    sample: int64 [N]: the sequences that sample a token this iteration (indices into slots);
      sample_index [N]: which generated token it is (where it goes; the seeded sampler's counter)
    decode_only: every sequence brings one token (the case CUDA graphs cover)
    """

    slots: np.ndarray = None
    serials: np.ndarray = None
    owners: np.ndarray = None
    query_start: np.ndarray = None
    context_lens: np.ndarray = None
    block_tables: np.ndarray = None
    tokens: np.ndarray = None
    positions: np.ndarray = None
    kv_slots: np.ndarray = None
    token_slots: np.ndarray = None
    sample: np.ndarray = None
    sample_index: np.ndarray = None
    temperature: np.ndarray = None
    top_k: np.ndarray = None
    top_p: np.ndarray = None
    seeds: np.ndarray = None
    max_query_len: int = 1
    decode_only: bool = False
    cache_plan: Any = None  # a CachePlan (core/conversations.py): copies to and from the host tier
    sampled: np.ndarray = None  # int64 [N], filled when the task finished
    seconds: float = math.nan  # how long the iteration ran (its runner measures it where it can)
