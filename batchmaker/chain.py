"""Chains: vectorized bookkeeping for runs of steps of one cell type (issue 5).

A chain is a request's run of L steps of one cell whose carried outputs feed the next step (an
LSTM over its tokens, a Seq2Seq encoder). The unfolder adds it as ONE node (`g.add_chain`), so
admission costs O(1) Python per request instead of O(L). The scheduler runs chains of a cell type
in a chain group per worker: the members step in lockstep, new chains join at a step boundary and
finished ones leave after their last step (cellular batching), and a step costs O(1) Python plus
numpy over the group's aligned arrays instead of O(batch) Python. A round of up to
MaxTasksToSubmit steps is formed at once; chains that end inside it drop out of its later steps.

Rows (planned by the worker): each output has two rows per member, written on even ("ping") and
odd ("pong") steps; step 0 reads the member's initial rows (row 0 for a zero state, a producer's
row, or a staged host value). After the last step the row written last becomes the node's output
row; the other one is freed when that step's task completes.
"""
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from batchmaker.model import CellType

if TYPE_CHECKING:
    from batchmaker.graph import Node

EMPTY = np.zeros(0, dtype=np.int64)


@dataclass(slots=True)
class Chain:
    """What makes a node a chain: per-step host inputs and the carried inputs."""

    steps: dict[str, np.ndarray]  # step input -> int64 values [length]
    carry: dict[str, str]  # carried input -> the output of the previous step it takes
    length: int


class ChainGroup:
    """The chains of one cell type pinned to one worker. Manager thread only.

    `arrays` are aligned with `members` (an object array of chain nodes): "pos" (steps submitted),
    "length", "base" (offset of the member's step values in `flat`), and the worker's row arrays
    ("ping:<out>", "pong:<out>", "init:<input>", "stage:<input>").
    """

    def __init__(self, cell_type: CellType, worker_id: int):
        self.cell_type = cell_type
        self.worker_id = worker_id
        self.members = np.empty(0, dtype=object)
        self.arrays: dict[str, np.ndarray] = {"pos": EMPTY, "length": EMPTY, "base": EMPTY}
        self.flat: dict[str, np.ndarray] = {}  # step input -> the members' values, concatenated
        self.carry: dict[str, str] = {}  # carried input -> output (the same for every chain of a type)
        self.num_dropped = 0  # members whose request failed or was cancelled, still in `members`

    def __len__(self) -> int:
        return len(self.members)

    @property
    def remaining(self) -> np.ndarray:
        return self.arrays["length"] - self.arrays["pos"]

    def join(self, nodes: list["Node"]) -> None:
        """Append chains that start at the next step; their row arrays are filled by the worker."""
        if not nodes:
            return
        self.carry = nodes[0].chain.carry
        lengths = np.fromiter((n.chain.length for n in nodes), dtype=np.int64, count=len(nodes))
        old_lengths, old_base = self.arrays["length"], self.arrays["base"]
        # repack the values of the current members, then append the new ones
        starts = np.cumsum(old_lengths) - old_lengths
        keep = np.repeat(old_base - starts, old_lengths) + np.arange(int(old_lengths.sum()), dtype=np.int64)
        for name in nodes[0].chain.steps:
            old = self.flat.get(name, EMPTY)
            self.flat[name] = np.concatenate([old[keep], *(n.chain.steps[name] for n in nodes)])
        new_base = int(old_lengths.sum()) + np.cumsum(lengths) - lengths
        self.arrays["base"] = np.concatenate([starts, new_base])
        self.arrays["length"] = np.concatenate([old_lengths, lengths])
        self.arrays["pos"] = np.concatenate([self.arrays["pos"], np.zeros(len(nodes), dtype=np.int64)])
        for key, values in self.arrays.items():  # worker row arrays: zeros until planned
            if key not in ("pos", "length", "base"):
                self.arrays[key] = np.concatenate([values, np.zeros(len(nodes), dtype=np.int64)])
        self.members = np.concatenate([self.members, _object_array(nodes)])

    def leave(self) -> tuple[list["Node"], dict[str, np.ndarray]]:
        """Drop members that are done (all steps submitted) or dropped. Returns the dropped ones
        that still need a completion, and their row arrays (to free once the worker is past them)."""
        done = self.arrays["pos"] >= self.arrays["length"]
        dropped = np.zeros(len(self.members), dtype=bool)
        if self.num_dropped:
            dropped = np.fromiter((m.subgraph.chain_state == "dropped" for m in self.members), dtype=bool,
                                  count=len(self.members)) & ~done
            self.num_dropped = 0
        leaving = done | dropped
        if not leaving.any():
            return [], {}
        gone_nodes = self.members[dropped].tolist()
        gone_rows = {k: v[dropped] for k, v in self.arrays.items() if ":" in k}
        keep = ~leaving
        self.members = self.members[keep]
        self.arrays = {k: v[keep] for k, v in self.arrays.items()}
        return gone_nodes, gone_rows


@dataclass(slots=True, eq=False)
class ChainStep:
    """One step of a chain group: what a Task carries instead of per-node work."""

    group: ChainGroup
    members: np.ndarray  # the group's members at this step (object array, shared by a round)
    pos: np.ndarray  # each member's step index [n]
    num_joined: int = 0  # the last num_joined members start at this step
    finishing: np.ndarray = field(default_factory=lambda: EMPTY)  # positions of members ending here
    dropped_rows: dict[str, np.ndarray] = field(default_factory=dict)  # rows of members that left
    active: np.ndarray | None = None  # group positions stepping here (None: every member)
    same_members: bool = False  # the same members, in order, as the previous step of the round
    last_in_round: bool = True  # the round's last step: a worker may launch the round's steps at once

    @property
    def started(self) -> list["Node"]:
        return self.members[len(self.members) - self.num_joined:].tolist() if self.num_joined else []

    def rows(self, key: str) -> np.ndarray:
        """The group's row array `key` for the members stepping here."""
        values = self.group.arrays[key]
        return values if self.active is None else values[self.active]


def _object_array(items: list) -> np.ndarray:
    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out
