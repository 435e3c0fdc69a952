"""Graph batching's plan for a batch of trees, with numpy over all of the batch's nodes at once.

Trees come as the engine's parser gives them (batchmaker/core/tree_batch.TreeArrays): tree t has
n_t leaves numbered 0..n_t-1 left to right, then n_t - 1 internal nodes, each after its children.
A node's height is 0 for a leaf and 1 + its taller child's otherwise; graph batching runs all
leaves in one call and then the internal nodes of each height in one call each.

Heights come from a fixed point over all internal nodes of the batch: at pass k the nodes whose
children are both known are exactly the nodes of height k, so each pass is one numpy step over
the nodes still pending (no Python per node: DyNet and TF Fold plan in C++ for the same reason).

Rows: the plan numbers the batch's nodes as rows of a state pool, row 0 kept zero (what padding
reads), the leaves in rows 1..L in order, then the internal nodes height by height.
`index` holds, flat: the leaf tokens [L], then per level a block [3, size] of the left
children's rows, the right children's rows and the nodes' own rows, padded to `size` with
row 0 (inputs) and `scratch` (outputs) when a pad function is given (CUDA graphs have fixed
shapes); `levels` lists (offset of the block in index, number of real nodes, size).
"""
import numpy as np


def ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """start..start+count-1 for each (start, count), concatenated."""
    ends = np.cumsum(counts)
    return np.repeat(starts - ends + counts, counts) + np.arange(ends[-1] if len(ends) else 0)


class LevelPlan:
    def __init__(self, trees: list[tuple], pad=None, scratch: int = 0, max_level: int | None = None):
        """trees: (num_leaves, tokens, children) per tree; pad(n) -> the padded size of a level of n
        nodes (None: no padding); levels larger than max_level are split."""
        n = np.fromiter((t[0] for t in trees), dtype=np.int64, count=len(trees))
        tokens = np.concatenate([t[1] for t in trees])
        children = np.concatenate([t[2] for t in trees]).reshape(-1, 2)
        num_nodes = 2 * n - 1
        first = np.cumsum(num_nodes) - num_nodes  # each tree's first node, batch-wide numbering
        leaves = ranges(first, n)  # [L] batch-wide numbers of the leaves, in order
        internal = ranges(first + n, n - 1)  # [M] of the internal nodes, tree after tree
        shift = np.repeat(first, n - 1)
        left, right = children[:, 0] + shift, children[:, 1] + shift

        self.num_leaves = len(leaves)
        row = np.zeros(int(num_nodes.sum()), dtype=np.int64)
        row[leaves] = np.arange(1, self.num_leaves + 1)
        known = np.zeros(len(row), dtype=bool)
        known[leaves] = True
        parts, self.levels, self.num_heights = [tokens.astype(np.int64, copy=False)], [], 0
        offset, next_row, pending = len(tokens), self.num_leaves + 1, np.arange(len(internal))
        while len(pending):
            ready = known[left[pending]] & known[right[pending]]
            level, pending = pending[ready], pending[~ready]
            self.num_heights += 1
            nodes = internal[level]
            row[nodes] = np.arange(next_row, next_row + len(nodes))
            next_row += len(nodes)
            known[nodes] = True
            step = max_level or len(level)
            for s in range(0, len(level), step):
                part = level[s:s + step]
                count = len(part)
                size = pad(count) if pad else count
                block = np.zeros((3, size), dtype=np.int64)
                block[2, count:] = scratch
                block[0, :count], block[1, :count], block[2, :count] = row[left[part]], row[right[part]], row[internal[part]]
                parts.append(block.reshape(-1))
                self.levels.append((offset, count, size))
                offset += 3 * size
        self.index = np.concatenate(parts)
        self.num_rows = next_row  # rows used, row 0 included
        self.roots = row[first + num_nodes - 1]
