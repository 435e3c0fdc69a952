"""A worker's tree nodes as one int64 table [capacity, W]: a row per node, filled once when its
tree joins, so that forming a task is one gather of its nodes' rows (batchmaker/core/trees.py;
numpy's take along the first axis of a [capacity, W] table costs about a quarter of a gather of
columns from a [W, capacity] one, and a fifth of W gathers from 1-D arrays).

A node's row holds, in its columns:
  UP, SIDE   where the node's parent and sibling are, as offsets from the node (0 for a root: it
             is its own "parent" and "sibling"); a tree's nodes stay next to each other, so a
             compaction moves rows without renumbering anything in them
  TREE       the node's slot in the tree table
  LEFT       1 for a left child
  INNER      1 for an internal node
  INDEX...   the node's column of its cell type's task index [S, batch] (Layout): the rows it
             reads (its children's), its token, the rows it writes
Pool rows are taken when a tree joins, for every node at once: a non-root node keeps rows for
the outputs its parent reads, a root for the outputs its request gets back; an output no one
reads is written to its pool's scratch row. So a tree holds pool rows for all its nodes from its
join to its parent's task (before, they were taken when a node's task was formed: up to ~2x
fewer rows held at once, for one gather and one allocation more per output and task).
"""
import numpy as np

from batchmaker.core.rows import RowAllocator

UP, SIDE, TREE, LEFT, INNER = range(5)
INDEX = 5  # the first row of the task index


class NodeTable:
    def __init__(self, spec, pools: dict[str, RowAllocator], capacity: int = 1024):
        self.spec, self.pools = spec, pools
        self.layouts = (spec.leaf.layout, spec.internal.layout)  # by kind: LEAF, INTERNAL
        width = INDEX + max(layout.num_slices for layout in self.layouts)
        self.data = np.zeros((capacity, width), dtype=np.int64)
        self.submitted = np.zeros(capacity, dtype=bool)  # a task holding the node was formed
        self.num_nodes = 0  # the used prefix of the rows
        self.by_root = tuple(dict.fromkeys(spec.outputs.values()))
        self.kept = spec.kept  # outputs parents read (of a left or a right child) and roots give back
        # a child's output that its kind never writes is read from row 0 (zeros), and never freed
        self.all_written = all(y in layout.writes for y in self.kept for layout in self.layouts)
        self.children_rows = _by_pool(pools, _distinct_reads(spec))  # what an internal task frees
        self.root_rows = tuple(_by_pool(pools, {layout.writes[y]: y for y in self.by_root if y in layout.writes})
                               for layout in self.layouts)  # what a root's own task frees, by kind

    def add(self, nodes: np.ndarray, sizes: np.ndarray, trees: np.ndarray) -> tuple[int, np.ndarray]:
        """Trees' nodes [N, 3] (token, left, right; children numbered within the tree, -1 for a
        leaf's), `sizes` nodes per tree, tree slots `trees` -> (the first new id, the new leaves' ids)."""
        total = len(nodes)
        self._reserve(total)
        base = self.num_nodes
        cols = np.zeros((self.data.shape[1], total), dtype=np.int64)  # [W, N]: filled a column at a time, then copied in
        is_inner = nodes[:, 1] >= 0
        inner, leaves = np.flatnonzero(is_inner), np.flatnonzero(~is_inner)
        ends = np.cumsum(sizes)
        tree_start = np.repeat(ends - sizes, sizes)[inner]
        left, right = tree_start + nodes[inner, 1], tree_start + nodes[inner, 2]  # within the new rows
        cols[UP, left], cols[UP, right] = inner - left, inner - right
        cols[SIDE, left], cols[SIDE, right] = right - left, left - right
        cols[LEFT, left] = 1
        cols[INNER, inner] = 1
        cols[TREE] = np.repeat(trees, sizes)
        rows = self._take_rows(total, (leaves, inner), (left, right, ends - 1))  # (post-order: a root is last)
        leaf, internal = self.layouts
        cols[INDEX + leaf.values[self.spec.token], leaves] = nodes[leaves, 0]
        for layout, ids in ((leaf, leaves), (internal, inner)):
            for y, slot in layout.writes.items():
                cols[INDEX + slot, ids] = rows[y][ids] if y in rows else self.pools[y].scratch_row
        for side, children in ((self.spec.left, left), (self.spec.right, right)):
            for x, y in side.items():
                cols[INDEX + internal.reads[x], inner] = rows[y][children]
        self.data[base:base + total] = cols.T
        self.submitted[base:base + total] = False
        self.num_nodes += total
        return base, base + leaves

    def _take_rows(self, total: int, by_kind: tuple, by_role: tuple) -> dict[str, np.ndarray]:
        """Each kept output -> [N] rows: taken where a node keeps it (a left child what its parent
        reads of a left child, a right child likewise, a root what its request gets back), the
        scratch row where a node writes it and nobody reads it, 0 where the node's kind does not
        write it."""
        spec, rows = self.spec, {}
        for y in self.kept:
            pool = self.pools[y]
            kept_by = [y in spec.left.values(), y in spec.right.values(), y in self.by_root]
            written = [ids for layout, ids in zip(self.layouts, by_kind) if y in layout.writes]
            if all(kept_by) and len(written) == 2:
                rows[y] = pool.alloc_many(total)  # every node keeps it (the TreeLSTM's h)
                continue
            rows[y] = out = np.zeros(total, dtype=np.int64)
            keeps, writes = np.zeros(total, dtype=bool), np.zeros(total, dtype=bool)
            for ids in written:
                out[ids] = pool.scratch_row
                writes[ids] = True
            for ids, is_kept in zip(by_role, kept_by):
                keeps[ids] = is_kept
            at = np.flatnonzero(keeps & writes)
            out[at] = pool.alloc_many(len(at))
        return rows

    def free_children_rows(self, index: np.ndarray) -> None:
        """An internal task was formed: its children's rows (read by its index) go back."""
        for pool, slots in self.children_rows:
            rows = index[slots].ravel()
            pool.free_many(rows if self.all_written else rows[rows != 0])

    def free_root_rows(self, kind: int, index: np.ndarray, lanes: np.ndarray) -> None:
        for pool, slots in self.root_rows[kind]:
            pool.free_many(index[slots][..., lanes].ravel())

    def free_held_rows(self, ids: np.ndarray) -> None:
        """Dropped nodes: give back the rows they still hold (those whose parent, or for a root
        the node itself, has no task yet)."""
        ids = ids[~self.submitted[ids + self.data[ids, UP]]]
        internal = self.data[ids, INNER] != 0
        for kind, of_kind in enumerate((ids[~internal], ids[internal])):
            for y, slot in self.layouts[kind].writes.items():
                if y in self.kept:
                    rows = self.data[of_kind, INDEX + slot]
                    self.pools[y].free_many(rows[(rows != 0) & (rows != self.pools[y].scratch_row)])

    def _reserve(self, more: int) -> None:
        need = self.num_nodes + more
        if need <= len(self.data):
            return
        cap = max(need, 2 * len(self.data))
        used = self.num_nodes  # (what lies past it is set by the add that uses it)
        data, submitted = np.empty((cap, self.data.shape[1]), dtype=np.int64), np.empty(cap, dtype=bool)
        data[:used], submitted[:used] = self.data[:used], self.submitted[:used]
        self.data, self.submitted = data, submitted

    def compact(self, kept: np.ndarray) -> None:
        """Keep the nodes `kept` (whole trees, ascending), moved to the front."""
        m = len(kept)
        self.data[:m] = self.data.take(kept, axis=0)
        self.submitted[:m] = self.submitted[kept]
        self.num_nodes = m


def _distinct_reads(spec) -> dict[int, str]:
    """Internal index slot -> output, one slot per (side, child output) that a parent reads."""
    reads, seen = {}, set()
    layout = spec.internal.layout
    for side, inputs in (("left", spec.left), ("right", spec.right)):
        for x, y in inputs.items():
            if (side, y) not in seen:
                seen.add((side, y))
                reads[layout.reads[x]] = y
    return reads


def _by_pool(pools: dict, slots: dict[int, str]) -> list[tuple[RowAllocator, object]]:
    """Task index slots grouped by the pool of their output: [(pool, a slice if they are
    contiguous (a view of the index), else a list)]."""
    groups: dict[int, tuple] = {}
    for slot, y in sorted(slots.items()):
        pool = pools[y]
        groups.setdefault(id(pool), (pool, []))[1].append(slot)
    plan = []
    for pool, group in groups.values():
        contiguous = group == list(range(group[0], group[-1] + 1))
        plan.append((pool, slice(group[0], group[-1] + 1) if contiguous else group))
    return plan
