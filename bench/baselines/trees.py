"""TreeLSTM baselines: graph batching (DyNet / TensorFlow Fold style) and the fixed-tree ideal.

Graph batching takes up to max_trees queued trees, merges their graphs and runs them level by
level: all leaves in one leaf-cell call, then the internal nodes of each height (1 + the taller
child) in one internal-cell call each; the whole batch returns at the end. As a competent user
writes it (each a documented choice):
- trees are parsed in bulk at admission by the engine's own batch parser (`parse_trees`);
- the level plan is numpy over the batch's nodes (tree_plan.py), not a Python loop per node;
- the cells are the engine's own fused kernels, each level a CUDA graph (tree_steps.py);
- two batches in flight: the host plans and copies the next batch while the device runs one;
- the tree cap is tuned (bench/treebank.py --tune keeps the sweep); its unit is trees, the
  engine's b_max counts cells per task, so equal caps do not mean equal batches.

The fixed-tree ideal (Fig. 2.15) serves only complete binary trees of `num_leaves` leaves: no
per-node host work at all; leaves of the batch in one call, then each level pairs neighbours by
a reshape (log2(num_leaves) + 1 cell calls per batch).
"""
import copy
from collections import deque

import numpy as np
import torch

from batchmaker.core.admission import check_keys
from batchmaker.errors import BadRequestError
from batchmaker.unfolders.trees import Tree, parse_tree, parse_trees
from .server import BatchServer, DeviceHandle, Pending, host_buffer, to_device
from .tree_plan import LevelPlan
from .tree_steps import TreeSteps


class _TreeServer(BatchServer):
    model_name = "treelstm"

    def __init__(self, model, device="cpu", max_trees: int = 64, max_in_flight: int = 1):
        super().__init__(device, max_in_flight)
        self.leaf = copy.deepcopy(model.cells["leaf"]).to(self.device).eval()
        self.internal = copy.deepcopy(model.cells["internal"]).to(self.device).eval()
        self.vocab = self.leaf.embedding.num_embeddings
        self.max_trees = max_trees
        self.queue: deque = deque()

    def config(self) -> dict:
        return {**super().config(), "max_trees": self.max_trees}

    def admit(self, requests: list[Pending]) -> None:
        """Every request's tree parsed in one call: parsed = (num_leaves, tokens, children)."""
        good = []
        for r in requests:
            try:
                check_keys(r.inputs, ["tree"])
                good.append(r)
            except BadRequestError as e:
                self.fail(r, e)
        arrays, ok, errors = parse_trees([r.inputs["tree"] for r in good], self.vocab)
        for i, e in errors.items():
            self.fail(good[i], e)
        for r, parsed in zip([good[i] for i in ok], tree_tuples(arrays)):
            r.parsed = parsed
            self.queue.append(r)

    def next_batch(self) -> list[Pending]:
        q = self.queue
        return [q.popleft() for _ in range(min(len(q), self.max_trees))]

    def is_ready(self, handle: DeviceHandle) -> bool:
        return handle.ready()

    def collect(self, handle: DeviceHandle) -> list[dict]:
        return [{"h": row} for row in handle.wait().unbind(0)]

    def _to_host(self, h: torch.Tensor) -> DeviceHandle:
        out = host_buffer(tuple(h.shape), h.dtype, self.device)
        out.copy_(h, non_blocking=True)
        return DeviceHandle(out, self.device)


class GraphBatchingTreeLSTM(_TreeServer):
    name = "graph-batching"

    def __init__(self, model, device="cpu", max_trees: int = 64, max_in_flight: int = 2, graphs: bool = True):
        super().__init__(model, device, max_trees, max_in_flight)
        self.steps = TreeSteps(self.leaf, self.internal, self.device, rows=max_trees * 128 + 2, graphs=graphs)
        self.graphed = graphs  # (on a GPU: internal levels padded to the graphs' sizes)

    def config(self) -> dict:
        return {**super().config(), "plan": "numpy over the batch's nodes", "parse": "bulk (parse_trees)",
                "steps": self.steps.config()}

    def launch(self, batch: list[Pending]) -> DeviceHandle:
        steps = self.steps
        pad = steps.pad if steps.graphs else None
        plan = LevelPlan([r.parsed for r in batch], pad=pad, scratch=steps.scratch, max_level=steps.max_level)
        if plan.num_rows + 1 > steps.capacity:
            steps.ensure_rows(plan.num_rows)
            plan = LevelPlan([r.parsed for r in batch], pad=pad, scratch=steps.scratch, max_level=steps.max_level)
        self._count(plan)
        return self._to_host(steps.run(plan, to_device(plan.index, self.device)))

    def _count(self, plan: LevelPlan) -> None:
        """The batch's cell-rows: its leaves in one call, each level at its (padded) size."""
        leaves = plan.num_leaves
        self.cell_rows.add("leaf", 1, leaves, leaves, leaves)
        pad = self.steps.pad
        nodes = sum(count for _, count, _ in plan.levels)
        graphed = sum(pad(count) for _, count, _ in plan.levels) if self.graphed else nodes
        self.cell_rows.add("internal", len(plan.levels), sum(size for _, _, size in plan.levels), graphed, nodes)


class FixedTreeIdeal(_TreeServer):
    name = "ideal"

    def __init__(self, model, device="cpu", max_trees: int = 64, num_leaves: int = 16, max_in_flight: int = 2):
        super().__init__(model, device, max_trees, max_in_flight)
        self.num_leaves = num_leaves

    def admit(self, requests: list[Pending]) -> None:
        for r in requests:
            try:
                check_keys(r.inputs, ["tree"])
                leaves = complete_leaves(parse_tree(r.inputs["tree"], self.vocab))
                if leaves is None or len(leaves) != self.num_leaves:
                    raise BadRequestError(f"the ideal serves only complete binary trees of {self.num_leaves} leaves")
            except BadRequestError as e:
                self.fail(r, e)
                continue
            r.parsed = leaves
            self.queue.append(r)

    def launch(self, batch: list[Pending]) -> DeviceHandle:
        tokens = to_device(np.asarray([r.parsed for r in batch], dtype=np.int64).reshape(-1), self.device)
        out = self.leaf(token=tokens)  # [B * leaves, hidden]; a tree's leaves are adjacent, in order
        h, c = out["h"], out["c"]
        while h.shape[0] > len(batch):
            h2, c2 = h.view(-1, 2, h.shape[-1]), c.view(-1, 2, c.shape[-1])  # neighbours pair up
            out = self.internal(h_l=h2[:, 0], c_l=c2[:, 0], h_r=h2[:, 1], c_r=c2[:, 1])
            h, c = out["h"], out["c"]
        return self._to_host(h)


def tree_tuples(arrays) -> list[tuple]:
    """(num_leaves, tokens, children) per tree of a parse_trees batch (views of its arrays)."""
    n = arrays.num_leaves
    leaf_at = np.cumsum(n) - n
    child_at = leaf_at - np.arange(len(n))
    return [(count, arrays.tokens[a:a + count], arrays.children[b:b + count - 1])
            for count, a, b in zip(n.tolist(), leaf_at.tolist(), child_at.tolist())]


def complete_leaves(tree: Tree) -> list[int] | None:
    """The leaves left to right if `tree` is a complete binary tree, else None."""
    if isinstance(tree, int):
        return [tree]
    left, right = complete_leaves(tree[0]), complete_leaves(tree[1])
    if left is None or right is None or len(left) != len(right):
        return None
    return left + right
