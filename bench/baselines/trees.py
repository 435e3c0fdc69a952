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
from batchmaker.unfolders.trees import Tree, parse_tree, parse_trees
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
        request.parsed = self.parse(request.inputs["tree"])
        self.queue.append(request)

    def parse(self, tree):
        """The engine's own parser (batchmaker/core/tree_input.py): (num_leaves, tokens, children)."""
        arrays, _, errors = parse_trees([tree], self.vocab)
        if errors:
            raise errors[0]
        return arrays.tree(0)

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

    Trees come as (num_leaves, tokens, children) (batchmaker/core/tree_input.TreeArrays.tree):
    nodes numbered leaves first, then internal nodes in post-order. index: int64 [num_leaves +
    2 * num_internal]: the leaf tokens, then per level the left children's node numbers followed
    by the right children's; levels: (start, stop, left, right) with nodes [start, stop) and
    their children at index[left:...] and index[right:...]. Heights come from one pass over each
    tree's internal nodes (children before parents): the per-node host work of graph batching.
    """

    def __init__(self, trees: list[tuple]):
        tokens, by_height, root_keys = [], [], []
        for n, leaf_tokens, children in trees:
            first_leaf = len(tokens)
            tokens += leaf_tokens.tolist()
            keys = [(0, first_leaf + i) for i in range(n)]  # node -> (height, position within it)
            for left, right in children.tolist():
                a, b = keys[left], keys[right]
                height = max(a[0], b[0]) + 1
                if len(by_height) < height:
                    by_height.append([])
                by_height[height - 1].append((a, b))
                keys.append((height, len(by_height[height - 1]) - 1))
            root_keys.append(keys[-1])
        self.num_leaves = len(tokens)
        offsets = np.cumsum([self.num_leaves] + [len(level) for level in by_height])
        number = lambda key: key[1] if key[0] == 0 else offsets[key[0] - 1] + key[1]  # noqa: E731
        parts, self.levels, pos = [np.asarray(tokens, dtype=np.int64)], [], self.num_leaves
        for height, level in enumerate(by_height):
            parts.append(np.asarray([number(k) for k, _ in level] + [number(k) for _, k in level], dtype=np.int64))
            start = offsets[height]
            self.levels.append((int(start), int(start + len(level)), pos, pos + len(level)))
            pos += 2 * len(level)
        self.index = np.concatenate(parts)
        self.num_nodes = int(offsets[-1])
        self.roots = np.asarray([number(k) for k in root_keys], dtype=np.int64)


class FixedTreeIdeal(_TreeServer):
    name = "ideal"

    def __init__(self, model, device="cpu", max_trees: int = 64, num_leaves: int = 16):
        super().__init__(model, device, max_trees)
        self.num_leaves = num_leaves

    def parse(self, tree):
        leaves = complete_leaves(parse_tree(tree, self.vocab))
        if leaves is None or len(leaves) != self.num_leaves:
            raise BadRequestError(f"the ideal serves only complete binary trees of {self.num_leaves} leaves")
        return leaves

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
