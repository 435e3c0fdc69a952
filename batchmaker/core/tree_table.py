"""A worker's tree nodes as one int64 table [capacity, W]: a row per node, filled once when its
tree joins, so that forming a task is one gather of its nodes' rows (batchmaker/core/trees.py;
numpy's take along the first axis of a [capacity, W] table costs about a quarter of a gather of
columns from a [W, capacity] one, and a fifth of W gathers from 1-D arrays).

A node's row holds, in its columns:
  UP, SIDE   where the node's parent and sibling are, as offsets from the node (0 for a root: it
             is its own "parent" and "sibling"); a tree's nodes stay next to each other, so a
             compaction moves rows without renumbering anything in them
  LEFT       1 for a left child
  TREE       the node's slot in the tree table
  INDEX...   the node's column of its cell type's task index [S, batch] (Layout): the rows it
             reads (its children's), its token, the rows it writes. The leaf's index starts where
             its writes fall on the internal cell's writes of the same outputs (the TreeLSTM's h
             and c: one column each for every node, filled by one write at a join).
Pool rows are taken when a tree joins, for every node at once: a node keeps rows for the outputs
its parent reads of it, a root for the outputs its request gets back (every node every kept
output, where every kind writes it and parents read it of both sides); an output no one reads is
written to its pool's scratch row. So a tree holds pool rows for all its nodes from its join to
its parent's task (before, they were taken when a node's task was formed: up to ~2x fewer rows
held at once, for a gather and an allocation more per output and task).
"""
import numpy as np

from batchmaker.core.rows import RowAllocator

UP, SIDE, LEFT, TREE = range(4)
INDEX = 4  # the first column of the task index


class NodeTable:
    def __init__(self, spec, pools: dict[str, RowAllocator], capacity: int = 1024):
        self.spec, self.pools = spec, pools
        self.layouts = (spec.leaf.layout, spec.internal.layout)  # by kind: LEAF, INTERNAL
        self.starts = (INDEX + _leaf_offset(*self.layouts), INDEX)  # by kind: its index's first column
        width = max(start + layout.num_slices for start, layout in zip(self.starts, self.layouts))
        self.data = np.zeros((capacity, width), dtype=np.int64)
        self.submitted = np.zeros(capacity, dtype=bool)  # a task holding the node was formed
        self.num_nodes = 0  # the used prefix of the rows
        self.kept = spec.kept  # outputs parents read (of a left or a right child) and roots give back
        self.keeps_all = all(y in spec.left.values() and y in spec.right.values() and
                             all(y in layout.writes for layout in self.layouts) for y in self.kept)
        # a child's output that its kind never writes is read from row 0 (zeros), and never freed
        self.all_written = all(y in layout.writes for y in self.kept for layout in self.layouts)
        self.children_rows = _by_pool(pools, _distinct_reads(spec))  # what an internal task frees
        root_keeps = self.kept if self.keeps_all else tuple(dict.fromkeys(spec.outputs.values()))
        self.root_rows = tuple(_by_pool(pools, {layout.writes[y]: y for y in root_keeps if y in layout.writes})
                               for layout in self.layouts)  # what a root's own task frees, by kind
        self.sources = [tuple(_source(self.layouts[kind], spec, c - self.starts[kind]) for kind in (1, 0))
                        for c in range(INDEX, width)]  # index column -> what it holds (internal, leaf)

    def index(self, kind: int, cols: np.ndarray) -> np.ndarray:
        """Gathered nodes as columns [W, n] (C-contiguous) -> their task index [S, n] (a contiguous view)."""
        start = self.starts[kind]
        return cols[start:start + self.layouts[kind].num_slices]

    def add(self, nodes: np.ndarray, sizes: np.ndarray, trees: np.ndarray) -> np.ndarray:
        """Trees' nodes [N, 3] (token, left, right; children numbered within the tree, -1 for a
        leaf's), `sizes` nodes per tree, tree slots `trees` -> the new nodes' first id."""
        total = len(nodes)
        self._reserve(total)
        base = self.num_nodes
        block = self.data[base:base + total]  # [N, W] (a view)
        is_inner = nodes[:, 1] >= 0
        inner = np.flatnonzero(is_inner)
        first = np.repeat(np.cumsum(sizes) - sizes, sizes)  # each node's tree's first node (within the new rows)
        left, right = first + nodes[:, 1], first + nodes[:, 2]  # (a leaf's: garbage, never used)
        below_left, below_right = left[inner], right[inner]
        column = np.zeros(total, dtype=np.int64)
        column[below_left], column[below_right] = inner - below_left, inner - below_right
        block[:, UP] = column
        column[below_left], column[below_right] = below_right - below_left, below_left - below_right
        block[:, SIDE] = column
        column[:] = 0
        column[below_left] = 1
        block[:, LEFT] = column
        block[:, TREE] = np.repeat(trees, sizes)
        rows = {y: self.pools[y].alloc_many(total) for y in self.kept} if self.keeps_all else \
            self._take_rows(total, (np.flatnonzero(~is_inner), inner), (below_left, below_right, np.cumsum(sizes) - 1))
        gathered = {}

        def value(source):
            what, name, side = source
            if what == "read":
                if (name, side) not in gathered:
                    gathered[name, side] = rows[name][left if side == "left" else right]
                return gathered[name, side]
            if what == "write":
                return rows[name] if name in rows else self.pools[name].scratch_row
            return nodes[:, 0] if what == "token" else 0

        for c, (of_inner, of_leaf) in enumerate(self.sources, INDEX):
            a, b = value(of_inner), value(of_leaf)
            block[:, c] = a if a is b else np.where(is_inner, a, b)
        self.submitted[base:base + total] = False
        self.num_nodes += total
        return base

    def _take_rows(self, total: int, by_kind: tuple, by_role: tuple) -> dict[str, np.ndarray]:
        """Each kept output -> [N] rows: taken where a node keeps it (a left child what its parent
        reads of a left child, a right child likewise, a root what its request gets back), the
        scratch row where a node writes it and nobody reads it, 0 where the node's kind does not
        write it."""
        spec, rows = self.spec, {}
        for y in self.kept:
            pool = self.pools[y]
            kept_by = [y in spec.left.values(), y in spec.right.values(), y in spec.outputs.values()]
            rows[y] = out = np.zeros(total, dtype=np.int64)
            keeps, writes = np.zeros(total, dtype=bool), np.zeros(total, dtype=bool)
            for layout, ids in zip(self.layouts, by_kind):
                if y in layout.writes:
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

    def free_held_rows(self, ids: np.ndarray, is_inner: np.ndarray) -> None:
        """Dropped nodes: give back the rows they still hold (those whose parent, or for a root
        the node itself, has no task yet)."""
        held = ~self.submitted[ids + self.data[ids, UP]]
        ids, is_inner = ids[held], is_inner[held]
        for kind, of_kind in enumerate((ids[~is_inner], ids[is_inner])):
            for y, slot in self.layouts[kind].writes.items():
                if y in self.kept:
                    rows = self.data[of_kind, self.starts[kind] + slot]
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


def _leaf_offset(leaf, internal) -> int:
    """Where the leaf's index starts, from the internal's: where the outputs both write share
    their columns, if they can (else at the same column)."""
    shared = [y for y in leaf.writes if y in internal.writes]
    if shared:
        offset = internal.writes[shared[0]] - leaf.writes[shared[0]]
        if offset >= 0 and all(internal.writes[y] - leaf.writes[y] == offset for y in shared):
            return offset
    return 0


def _source(layout, spec, slot: int) -> tuple:
    """What a node of this layout holds in its index slot: ("read", output, side) of a child,
    ("write", output, None), ("token", None, None) or ("zero", None, None)."""
    for x, s in layout.reads.items():
        if s == slot and layout is spec.internal.layout:
            for side, inputs in (("left", spec.left), ("right", spec.right)):
                if x in inputs:
                    return "read", inputs[x], side
    for x, s in layout.values.items():
        if s == slot and layout is spec.leaf.layout and x == spec.token:
            return "token", None, None
    for y, s in layout.writes.items():
        if s == slot:
            return "write", y, None
    return "zero", None, None


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
