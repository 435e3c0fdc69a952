"""TreeLSTM baselines: graph batching (DyNet / TensorFlow Fold style) and the fixed-tree ideal.

Graph batching takes up to max_trees queued trees, merges their graphs and runs them level by
level: all leaves in one leaf-cell call, then the internal nodes of each height (1 + the taller
child) in one internal-cell call each; the whole batch returns at the end. A node's batch is
bounded by what the merged trees hold at that height (the paper's "max batch 64" counts trees).

The fixed-tree ideal (Fig. 2.15) serves only complete binary trees of `num_leaves` leaves: no
per-node host work at all; leaves of the batch in one call, then each level pairs neighbours by
a reshape (log2(num_leaves) + 1 cell calls per batch).
Both run the engine's own TreeLeafCell / TreeInternalCell modules (same weights).
"""
import copy
from collections import deque

import numpy as np
import torch

from batchmaker.errors import BadRequestError
from batchmaker.unfolders.common import check_keys
from batchmaker.unfolders.trees import Tree, parse_tree
from .server import BatchServer, Pending


class _TreeServer(BatchServer):
    model_name = "treelstm"

    def __init__(self, model, device="cpu", max_trees: int = 64):
        super().__init__(device)
        self.leaf = copy.deepcopy(model.cells["leaf"]).to(self.device).eval()
        self.internal = copy.deepcopy(model.cells["internal"]).to(self.device).eval()
        self.vocab = self.leaf.embedding.num_embeddings
        self.max_trees = max_trees
        self.queue: deque = deque()

    def admit(self, request: Pending) -> None:
        check_keys(request.inputs, required=["tree"])
        request.parsed = parse_tree(request.inputs["tree"], self.vocab)
        self.queue.append(request)

    def next_batch(self) -> list[Pending]:
        return [self.queue.popleft() for _ in range(min(len(self.queue), self.max_trees))]

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(array)
        return t.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else t


class GraphBatchingTreeLSTM(_TreeServer):
    name = "graph-batching"

    @torch.inference_mode()
    def run(self, batch: list[Pending]) -> list[dict]:
        plan = LevelPlan([r.parsed for r in batch])
        index = self.to_device(plan.index)  # one copy: leaf tokens, then (left, right) per level
        hidden = self.internal.gates.in_features // 2
        h = torch.empty(plan.num_nodes, hidden, dtype=self.leaf.iou.weight.dtype, device=self.device)
        c = torch.empty_like(h)
        out = self.leaf(token=index[:plan.num_leaves])
        h[:plan.num_leaves], c[:plan.num_leaves] = out["h"], out["c"]
        for start, stop, left, right in plan.levels:  # nodes [start, stop) of one height
            li, ri = index[left:left + stop - start], index[right:right + stop - start]
            out = self.internal(h_l=h[li], c_l=c[li], h_r=h[ri], c_r=c[ri])
            h[start:stop], c[start:stop] = out["h"], out["c"]
        roots = h[self.to_device(plan.roots)].cpu()
        return [{"h": row} for row in roots]


class LevelPlan:
    """Node numbering of merged trees: leaves first, then internal nodes grouped by height.

    index: int64 [num_leaves + 2 * num_internal]: the leaf tokens, then per level the left
    children's node numbers followed by the right children's; levels: (start, stop, left, right)
    with nodes [start, stop) and their children at index[left:...] and index[right:...].
    """

    def __init__(self, trees: list[Tree]):
        self.tokens: list[int] = []
        by_height: list[list[tuple]] = []  # height - 1 -> [(left key, right key)]
        root_keys = [self._visit(t, by_height) for t in trees]
        self.num_leaves = len(self.tokens)
        offsets = np.cumsum([self.num_leaves] + [len(level) for level in by_height])
        number = lambda key: key[1] if key[0] == 0 else offsets[key[0] - 1] + key[1]  # noqa: E731
        parts, self.levels, pos = [np.asarray(self.tokens, dtype=np.int64)], [], self.num_leaves
        for height, level in enumerate(by_height):
            left = [number(k) for k, _ in level]
            right = [number(k) for _, k in level]
            parts.append(np.asarray(left + right, dtype=np.int64))
            start = offsets[height]
            self.levels.append((int(start), int(start + len(level)), pos, pos + len(level)))
            pos += 2 * len(level)
        self.index = np.concatenate(parts)
        self.num_nodes = int(offsets[-1])
        self.roots = np.asarray([number(k) for k in root_keys], dtype=np.int64)

    def _visit(self, tree: Tree, by_height: list) -> tuple[int, int]:
        """Post-order; returns the node's key (height, position within that height)."""
        if isinstance(tree, int):
            self.tokens.append(tree)
            return 0, len(self.tokens) - 1
        left, right = self._visit(tree[0], by_height), self._visit(tree[1], by_height)
        height = max(left[0], right[0]) + 1
        if len(by_height) < height:
            by_height.append([])
        by_height[height - 1].append((left, right))
        return height, len(by_height[height - 1]) - 1


class FixedTreeIdeal(_TreeServer):
    name = "ideal"

    def __init__(self, model, device="cpu", max_trees: int = 64, num_leaves: int = 16):
        super().__init__(model, device, max_trees)
        self.num_leaves = num_leaves

    def admit(self, request: Pending) -> None:
        super().admit(request)
        leaves = complete_leaves(request.parsed)
        if leaves is None or len(leaves) != self.num_leaves:
            self.queue.pop()
            raise BadRequestError(f"the ideal serves only complete binary trees of {self.num_leaves} leaves")
        request.parsed = leaves

    @torch.inference_mode()
    def run(self, batch: list[Pending]) -> list[dict]:
        tokens = self.to_device(np.asarray([r.parsed for r in batch], dtype=np.int64).reshape(-1))
        out = self.leaf(token=tokens)  # [B * leaves, hidden]; a tree's leaves are adjacent, in order
        h, c = out["h"], out["c"]
        while h.shape[0] > len(batch):
            h2, c2 = h.view(-1, 2, h.shape[-1]), c.view(-1, 2, c.shape[-1])  # neighbours pair up
            out = self.internal(h_l=h2[:, 0], c_l=c2[:, 0], h_r=h2[:, 1], c_r=c2[:, 1])
            h, c = out["h"], out["c"]
        return [{"h": row} for row in h.cpu()]


def complete_leaves(tree: Tree) -> list[int] | None:
    """The leaves left to right if `tree` is a complete binary tree, else None."""
    if isinstance(tree, int):
        return [tree]
    left, right = complete_leaves(tree[0]), complete_leaves(tree[1])
    if left is None or right is None or len(left) != len(right):
        return None
    return left + right
