"""The cell-rows each system computes per request, from the datasets alone (bench/policy_bound.py's
cross-check): no server runs, every batch is formed as the system forms it at saturation.

- Bucketing: requests in arrival order, filed in buckets of `width`, each bucket cut into
  batches of `batch` (the last one partial). Packed (ATen, cuDNN), the encoder computes each
  request's own steps; padded, a batch costs rows x its longest. The Seq2Seq decoder runs every
  row of a batch for its longest decode: eager B x steps; as CUDA graphs its batch padded to a
  power of two for whole chunks of steps.
- The engine: eager (a CPU worker), each request's own steps. As CUDA graphs, a chain joins a
  round's lanes at the round's start and every lane runs all k steps of a round; with the group
  full (saturation) k = `round_steps` and the lanes are a captured size, so a request of n steps
  computes ceil(n / k) * k rows (a lower bound: lanes padded to a power of two add more).
- Graph batching: `cap` trees in arrival order per batch, each node once (LevelPlan), levels
  padded to the graphs' sizes on a GPU. The engine computes each node once (on a GPU a task's
  rows padded to a power of two; at saturation tasks are full).
"""
import math

import numpy as np

from baselines.tree_plan import LevelPlan
from baselines.tree_steps import level_sizes


def bucket_batches(lengths: np.ndarray, width: int, batch: int) -> list[np.ndarray]:
    """Request indices per batch: arrival order within each bucket, cut every `batch`."""
    keys = (lengths - 1) // width
    out = []
    for key in np.unique(keys):
        members = np.flatnonzero(keys == key)
        out += [members[i:i + batch] for i in range(0, len(members), batch)]
    return out


def next_power_of_two(n: int, cap: int) -> int:
    return min(cap, 1 << max(0, (n - 1).bit_length())) if n <= cap else n


def bucketing_rows(lengths: np.ndarray, limits: np.ndarray | None, width: int, batch: int,
                   chunk: int = 4) -> dict:
    """Per cell: needed, computed (this CPU), graphed (a GPU), padded rows, summed over requests."""
    enc = "lstm" if limits is None else "encoder"
    out = {enc: dict(needed=int(lengths.sum()), computed=int(lengths.sum()), graphed=int(lengths.sum()), padded=0)}
    if limits is not None:
        out["decoder"] = dict(needed=int(limits.sum()), computed=0, graphed=0, padded=0)
    for members in bucket_batches(lengths, width, batch):
        b = len(members)
        out[enc]["padded"] += b * int(lengths[members].max())
        if limits is not None:
            steps = int(limits[members].max())
            d = out["decoder"]
            d["computed"] += b * steps
            d["padded"] += b * steps
            d["graphed"] += next_power_of_two(b, batch) * math.ceil(steps / chunk) * chunk
    return out


def engine_rows(needs: dict[str, np.ndarray], round_steps: int) -> dict:
    """Per chain cell: eager, each request's own steps; graphed at saturation, whole rounds."""
    rounds = {cell: int((np.ceil(n / round_steps) * round_steps).sum()) for cell, n in needs.items()}
    return {cell: dict(needed=int(n.sum()), computed=int(n.sum()), graphed=rounds[cell], padded=rounds[cell])
            for cell, n in needs.items()}


def graph_batching_rows(trees: list[tuple], cap: int, max_level: int = 4096) -> dict:
    """trees: (num_leaves, tokens, children) per tree, in arrival order; batches of `cap`."""
    sizes = level_sizes(max_level)
    pad = lambda n: next(s for s in sizes if s >= n)  # noqa: E731
    leaves = internal = graphed = 0
    for i in range(0, len(trees), cap):
        plan = LevelPlan(trees[i:i + cap], max_level=sizes[-1])
        leaves += plan.num_leaves
        internal += sum(count for _, count, _ in plan.levels)
        graphed += sum(pad(count) for _, count, _ in plan.levels)
    return {"leaf": dict(needed=leaves, computed=leaves, graphed=leaves, padded=leaves),
            "internal": dict(needed=internal, computed=internal, graphed=graphed, padded=internal)}


def tree_engine_rows(needs: dict[str, np.ndarray]) -> dict:
    return {cell: dict(needed=int(n.sum()), computed=int(n.sum()), graphed=int(n.sum()), padded=int(n.sum()))
            for cell, n in needs.items()}
