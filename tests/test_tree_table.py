"""The tree node table (batchmaker/core/tree_table.py) against a recursive reference, without
torch: the tasks a Forest forms are run by a fake worker over a dict of pool rows (a leaf writes
a hash of its token, an internal node a hash of what its index reads), and every root's fetched
rows must hold the reference's values. Two specs: the TreeLSTM's (every node keeps h and c, leaf
and internal indices share the write columns) and a general one (parents read different outputs
of left and right children, an output nobody reads, roots return an output only some children
keep, two pools, write columns that do not line up). With cancels and compactions on the way, and
every pool row given back at the end."""
import random

import numpy as np
import pytest

from batchmaker.core.cell_type import CellType, Layout
from batchmaker.core.rows import RowAllocator
from batchmaker.core.trees import INTERNAL, LEAF, Forest, TreeGroup, TreeSpec
from batchmaker.core.waiting import Chunk


class Future:
    def __init__(self):
        self._done = False


def cell(name: str, inputs: list, values: list, outputs: list) -> CellType:
    return CellType(name, None, 0, (1, 2, 4, 8, 16), Layout.of(inputs, values, outputs))


SPECS = {
    "treelstm": lambda: TreeSpec(cell("leaf", ["token"], ["token"], ["h", "c"]),
                                 cell("internal", ["h_l", "c_l", "h_r", "c_r"], [], ["h", "c"]),
                                 "token", {"h_l": "h", "c_l": "c"}, {"h_r": "h", "c_r": "c"}, {"h": "h"}),
    "general": lambda: TreeSpec(cell("leaf", ["token"], ["token"], ["b", "z", "a"]),
                                cell("internal", ["r_b", "l_a", "r_a"], [], ["a", "b", "z"]),
                                "token", {"l_a": "a"}, {"r_b": "b", "r_a": "a"}, {"res": "b"}),
}


def random_tree(rng: random.Random, leaves: int):
    if leaves == 1:
        return rng.randrange(3, 1000)
    k = rng.randrange(1, leaves)
    return (random_tree(rng, k), random_tree(rng, leaves - k))


def to_nodes(tree) -> np.ndarray:
    """[2n - 1, 3] (token, left, right): leaves first, then internal nodes in post-order."""
    leaves, pairs = [], []

    def walk(t):
        if isinstance(t, int):
            leaves.append(t)
            return ("leaf", len(leaves) - 1)
        a, b = walk(t[0]), walk(t[1])
        pairs.append((a, b))
        return ("pair", len(pairs) - 1)

    walk(tree)
    n = len(leaves)
    number = lambda ref: ref[1] if ref[0] == "leaf" else n + ref[1]
    rows = [(tok, -1, -1) for tok in leaves] + [(-1, number(a), number(b)) for a, b in pairs]
    return np.array(rows, dtype=np.int64).reshape(-1, 3)


def reference(spec: TreeSpec, tree) -> dict:
    """Each output of the tree's root: a leaf writes hash(token, y), an internal node
    hash(the values its inputs read, in slot order, y)."""
    if isinstance(tree, int):
        return {y: hash((tree, y)) for y in spec.leaf.layout.writes}
    left, right = reference(spec, tree[0]), reference(spec, tree[1])
    reads = sorted(spec.internal.layout.reads.items(), key=lambda kv: kv[1])
    got = tuple(left[spec.left[x]] if x in spec.left else right[spec.right[x]] for x, _ in reads)
    return {y: hash((got, y)) for y in spec.internal.layout.writes}


def run(task, kind: int, spec: TreeSpec, pools: dict, memory: dict) -> dict:
    """The fake worker: reads, then writes; the fetched rows' values. memory: (pool, row) -> value."""
    cell_type = spec.leaf if kind == LEAF else spec.internal
    layout, index = cell_type.layout, task.index
    assert index.shape == (layout.num_slices, task.batch) and index.flags.c_contiguous
    reads = sorted(layout.reads.items(), key=lambda kv: kv[1])
    out = {}
    for lane in range(task.batch):
        if kind == LEAF:
            assert all(index[slot, lane] == 0 for _, slot in reads)
            token = int(index[layout.values[spec.token], lane])
            out[lane] = {y: hash((token, y)) for y in layout.writes}
        else:
            read_of = {**spec.left, **spec.right}  # input -> the child output it reads
            got = tuple(memory[id(pools[read_of[x]]), int(index[slot, lane])] for x, slot in reads)
            out[lane] = {y: hash((got, y)) for y in layout.writes}
    for lane, values in out.items():
        for y, slot in layout.writes.items():
            memory[id(pools[y]), int(index[slot, lane])] = values[y]
    return {y: [memory[id(pools[y]), int(index[layout.writes[y], lane])] for lane in lanes] for y, lanes in task.fetch.items()}


def form_and_run(forest, kind: int, epoch: int, spec: TreeSpec, memory: dict, results: dict) -> None:
    pools = forest.groups[0].pools
    for task in forest.form(kind, 0, 3, epoch):
        fetched = run(task, kind, spec, pools, memory)
        if task.info is not None:
            for i, owner in enumerate(task.info[0]):  # (the roots' lanes, in fetch order)
                results[id(owner)] = {y: values[i] for y, values in fetched.items()}


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_trees_formed_from_the_node_table_compute_the_reference(name, seed, monkeypatch):
    monkeypatch.setattr(TreeGroup, "min_dead_to_compact", 64)
    rng = random.Random(seed)
    spec = SPECS[name]()
    pools = {"a": RowAllocator(), "b": RowAllocator(), "z": RowAllocator()}
    pools = {"h": pools["a"], "c": pools["a"], "token": pools["b"], "a": pools["a"], "b": pools["b"], "z": pools["z"],
             **{x: pools["a"] for x in ("h_l", "c_l", "h_r", "c_r", "r_b", "l_a", "r_a")}}
    forest = Forest(spec, {0: pools})
    memory, results, trees, epoch = {}, {}, {}, 0
    for wave in range(6):
        batch = [random_tree(rng, rng.choice([1, 2, 3, 7, 20])) for _ in range(rng.randrange(1, 12))]
        owners = [Future() for _ in batch]
        trees.update({id(o): (o, t) for o, t in zip(owners, batch)})
        nodes = [to_nodes(t) for t in batch]
        sizes = np.array([len(x) for x in nodes], dtype=np.int64)
        priorities = np.array([rng.choice([0, 0, 1]) for _ in batch], dtype=np.int64)
        chunk = Chunk.of(np.array(owners, dtype=object), {"leaves": (sizes + 1) // 2, "priority": priorities},
                         np.concatenate(nodes), sizes)
        forest.add(priorities, chunk)
        if wave % 2:
            owners[0]._done = True  # (cancelled: dropped at the next form, its rows freed)
            epoch += 1
        for _ in range(rng.randrange(1, 6)):
            for kind in (INTERNAL, LEAF):
                form_and_run(forest, kind, epoch, spec, memory, results)
    while forest.queues[LEAF].num_ready or forest.queues[INTERNAL].num_ready:
        form_and_run(forest, INTERNAL if forest.queues[INTERNAL].num_ready else LEAF, epoch, spec, memory, results)
    finished = [key for key, (o, _) in trees.items() if not o._done]
    assert sorted(results) == sorted(finished)
    for key in finished:
        want = reference(spec, trees[key][1])
        assert results[key] == {y: want[y] for y in spec.outputs.values()}
    assert forest.groups[0].num_compactions >= 1
    assert all(p.num_used == 0 for p in pools.values())  # (every row given back; scratch rows not counted)
