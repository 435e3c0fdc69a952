"""Tree parsing (nested lists, SST brackets), rejection of malformed trees, and the TreeLSTM
unfolder + cells against the recursive reference."""
import random
import re
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchmaker import Engine
from batchmaker.core.tree_input import _tree_to_arrays
from batchmaker.core.trees import TreeGroup
from batchmaker.data import read_trees
from batchmaker.errors import BadRequestError, CancelledError
from batchmaker.registry import build_model
from batchmaker.unfolders.trees import MAX_DEPTH, load_sst_sample, num_leaves, parse_tree, parse_trees, word_id
from reference import EagerGraph, run_eagerly, treelstm_reference

VOCAB = 100
SMALL = dict(vocab=VOCAB, embed=12, hidden=16)
SST_WORD = re.compile(r"\(\S+ ([^()\s]+)\)")  # "(label word)"


def w(word: str) -> int:
    return 3 + zlib.crc32(word.encode()) % (VOCAB - 3)


def test_nested_lists():
    assert parse_tree([[1, 2], 3], VOCAB) == ((1, 2), 3)
    assert parse_tree((4, (5, 6)), VOCAB) == (4, (5, 6))
    assert parse_tree(9, VOCAB) == 9
    assert parse_tree([np.int64(1), 2], VOCAB) == (1, 2)
    assert parse_tree(["It", ["'s", "good"]], VOCAB) == (w("It"), (w("'s"), w("good")))


def test_a_one_element_list_is_its_child():
    assert parse_tree([[0], [98]], VOCAB) == (0, 98)
    assert parse_tree([[[3]], [[4], [5]]], VOCAB) == (3, (4, 5))
    assert parse_tree([[5, 6]], VOCAB) == (5, 6)
    assert parse_tree([[[7]]], VOCAB) == parse_tree((7,), VOCAB) == 7
    assert parse_tree([[["a"]], [["b"], ["c"]]], VOCAB) == parse_tree("(1 (2 (3 a)) (2 (2 b) (2 c)))", VOCAB)
    with pytest.raises(BadRequestError, match="a node needs 1 or 2 children, got 3"):
        parse_tree([[1], [2, 3, 4]], VOCAB)
    with pytest.raises(BadRequestError, match="a node needs 1 or 2 children, got 0"):
        parse_tree([[[]], 1], VOCAB)


def test_bracket_strings():
    assert parse_tree("(3 (2 It) (4 (2 's) (2 good)))", VOCAB) == (w("It"), (w("'s"), w("good")))
    assert parse_tree("(2 good)", VOCAB) == w("good")
    assert parse_tree(" (S (NP (DT a))\n (VP (VB b)) ) ", VOCAB) == (w("a"), w("b"))
    assert parse_tree("(1 (2 (3 x)))", VOCAB) == w("x")


def test_word_ids_are_stable_and_skip_reserved():
    assert word_id("good", 30000) == 3 + zlib.crc32(b"good") % 29997
    assert all(3 <= word_id(s, 4) < 4 for s in ["a", "b", "é", "-LRB-"])


def test_sst_sample_parses():
    lines = load_sst_sample()
    assert len(lines) == 200
    shared = Path(__file__).parents[2] / "shared" / "data" / "sst" / "dev.txt"
    if shared.exists():
        assert lines == shared.read_text(encoding="utf-8").splitlines()[:200]
    for line in lines:
        assert num_leaves(parse_tree(line, 30000)) == len(SST_WORD.findall(line))


def test_sst_batches_parse_as_each_line():
    lines = load_sst_sample()
    shared = Path(__file__).parents[2] / "shared" / "data" / "sst" / "dev.txt"
    if shared.exists():
        lines = read_trees(shared)
    for batch in (lines[:16], lines[16:80], lines):
        arrays, good, errors = parse_trees(batch, 30000)
        assert good == list(range(len(batch))) and not errors
        for k, line in enumerate(batch):
            n, tokens, children = arrays.tree(k)
            want = _tree_to_arrays(parse_tree(line, 30000))
            assert n == want[0] and tokens.tolist() == want[1].tolist() and children.tolist() == want[2].tolist()


BAD_TREES = [
    "", "   ", "(", ")", "(2 a", "(2 a))", "(2 a) (2 b)", "(2)", "()", "( (2 a))", "a",
    "(2 (2 a) (2 b) (2 c))", "(2 a b)", "(2 a (2 b))",
    [], [1, 2, 3], [1.5], [None], [-1], [True], [VOCAB], [1, ""], [1, [2, []]], {"a": 1}, None, 2.0,
    [True, 5], [5, False],  # no bools
    [[1], []], [[[]]], [[1, 2, 3]], [[1], [2], [3]], [[1, 2], [3], 4],  # a list holds 1 or 2 children
]


@pytest.mark.parametrize("tree", BAD_TREES, ids=repr)
def test_malformed_trees_rejected_before_any_node(tree):
    with pytest.raises(BadRequestError, match="tree"):
        parse_tree(tree, VOCAB)
    model = build_model("treelstm", **SMALL)
    graph = EagerGraph(model)
    with pytest.raises(BadRequestError):
        run_eagerly(model, {"tree": tree}, graph)
    assert graph.num_nodes == 0


@pytest.mark.parametrize("inputs", [{}, {"tree": [1, 2], "tokens": [1]}, [1, 2]], ids=repr)
def test_bad_request_keys(inputs):
    with pytest.raises(BadRequestError):
        run_eagerly(build_model("treelstm", **SMALL), inputs)


def comb(depth: int):
    """A left comb: `depth` levels, one leaf per level plus one at the bottom."""
    tree = 1
    for _ in range(depth - 1):
        tree = [tree, 2]
    return tree


def test_depth_limit():
    model = build_model("treelstm", **SMALL)
    for form in (comb(MAX_DEPTH), "(1 " * MAX_DEPTH + "a" + ")" * MAX_DEPTH):
        graph = EagerGraph(model)
        run_eagerly(model, {"tree": form}, graph)  # the deepest allowed tree unfolds (recursion is fine)
        assert graph.num_nodes == (2 * MAX_DEPTH - 1 if isinstance(form, list) else 1)
    for form in (comb(MAX_DEPTH + 1), "(1 " * (MAX_DEPTH + 1) + "a" + ")" * (MAX_DEPTH + 1)):
        with pytest.raises(BadRequestError, match="deeper"):
            parse_tree(form, VOCAB)


def unary_chain(depth: int, leaf=3):
    """`depth` levels: depth - 1 nested 1-element lists around a leaf."""
    tree = leaf
    for _ in range(depth - 1):
        tree = [tree]
    return tree


def test_depth_limit_counts_one_element_lists():
    model = build_model("treelstm", **SMALL)
    graph = EagerGraph(model)
    run_eagerly(model, {"tree": [unary_chain(MAX_DEPTH - 1), 4]}, graph)  # the deepest allowed
    assert graph.count == {"leaf": 2, "internal": 1}
    for depth in (MAX_DEPTH + 1, 100_000):  # far past Python's recursion limit: rejected, not a RecursionError
        with pytest.raises(BadRequestError, match=f"deeper than {MAX_DEPTH} levels"):
            parse_tree(unary_chain(depth), VOCAB)
        with pytest.raises(BadRequestError, match=f"deeper than {MAX_DEPTH} levels"):
            run_eagerly(model, {"tree": [1, unary_chain(depth)]}, EagerGraph(model))


def test_sst_trees_match_reference():
    model = build_model("treelstm", vocab=30000, embed=12, hidden=16, seed=5)
    for line in load_sst_sample()[:25]:
        graph = EagerGraph(model)
        got = run_eagerly(model, {"tree": line}, graph)
        n = len(SST_WORD.findall(line))
        assert graph.count == {"leaf": n, "internal": n - 1}
        torch.testing.assert_close(got["h"], treelstm_reference(model, {"tree": line})["h"], atol=1e-5, rtol=0)


def test_sst_trees_of_mixed_priorities_in_the_engine_match_reference():
    model = build_model("treelstm", vocab=30000, embed=12, hidden=16, seed=5)
    lines = load_sst_sample()[:48]
    with Engine([model]) as engine:
        futures = [engine.submit("treelstm", {"tree": line}, priority=i % 3) for i, line in enumerate(lines)]
        for line, f in zip(lines, futures):
            want = treelstm_reference(model, {"tree": line})["h"]
            torch.testing.assert_close(f.result(30).outputs["h"], want, atol=1e-5, rtol=0)


def test_single_leaf_tree():
    model = build_model("treelstm", **SMALL)
    got = run_eagerly(model, {"tree": 7})
    torch.testing.assert_close(got["h"], treelstm_reference(model, {"tree": 7})["h"], atol=1e-5, rtol=0)


def trees():
    return st.recursive(st.integers(0, VOCAB - 1) | st.sampled_from(["a", "b", "good", "'s"]),
                        lambda sub: st.tuples(sub, sub), max_leaves=24)


def to_brackets(tree) -> str:
    if isinstance(tree, tuple):
        return f"(0 {to_brackets(tree[0])} {to_brackets(tree[1])})"
    return f"(0 {tree})"


def word_trees():
    """At least one pair: a top-level str would be a bracket string."""
    subtrees = st.recursive(st.sampled_from(["a", "b", "good", "'s"]), lambda sub: st.tuples(sub, sub), max_leaves=12)
    return st.tuples(subtrees, subtrees)


@settings(max_examples=60, deadline=None)
@given(trees())
def test_random_trees(tree):
    model = build_model("treelstm", **SMALL, seed=2)
    if isinstance(tree, str):
        tree = (tree, tree)  # a top-level str is a bracket string
    nested = parse_tree(tree, VOCAB)
    if all(not isinstance(leaf, int) for leaf in _leaves(tree)):
        assert parse_tree(to_brackets(tree), VOCAB) == nested  # same tree, two spellings
    graph = EagerGraph(model)
    got = run_eagerly(model, {"tree": tree}, graph)
    assert graph.count["leaf"] == num_leaves(nested) and graph.count["internal"] == num_leaves(nested) - 1
    torch.testing.assert_close(got["h"], treelstm_reference(model, {"tree": tree})["h"], atol=1e-5, rtol=0)


def spellings(tree, rng) -> tuple:
    """One tree three ways: plain nested pairs; with 1-element lists wrapped around subtrees at
    random; a bracket string with unary brackets at the same places."""
    if isinstance(tree, tuple):
        (plain_l, nested_l, brackets_l), (plain_r, nested_r, brackets_r) = (spellings(t, rng) for t in tree)
        plain, nested, brackets = [plain_l, plain_r], [nested_l, nested_r], f"(0 {brackets_l} {brackets_r})"
    else:
        plain, nested, brackets = tree, tree, f"(0 {tree})"
    for _ in range(rng.choice([0, 0, 1, 2])):
        nested, brackets = [nested], f"(1 {brackets})"
    return plain, nested, brackets


@settings(max_examples=60, deadline=None)
@given(word_trees(), st.integers(0, 2**16))
def test_one_element_lists_parse_as_unary_brackets(tree, seed):
    plain, nested, brackets = spellings(tree, random.Random(seed))
    assert parse_tree(nested, VOCAB) == parse_tree(brackets, VOCAB) == parse_tree(plain, VOCAB)
    arrays, good, errors = parse_trees([nested, brackets, plain] * 6, VOCAB)  # 18: the batch parser too
    assert good == list(range(18)) and not errors
    first = arrays.tree(0)
    for k in range(1, 18):
        assert all(np.array_equal(a, b) for a, b in zip(arrays.tree(k), first))


@pytest.mark.parametrize("structured", [True, False])
def test_one_element_lists_answer_as_their_child_in_the_engine(structured):
    model = build_model("treelstm", **SMALL, seed=3, structured=structured)
    forms = [[[["It"]], [["'s"], [[["good"]]]]], ["It", ["'s", "good"]], "(3 (1 (2 It)) (4 (2 's) (1 (1 (2 good)))))"]
    leaves = [[[["x"]]], ["x"], "(1 (2 (3 x)))"]
    with Engine([model]) as engine:  # one at a time: the same batches, so the same bits
        got = [engine.infer("treelstm", {"tree": form}, timeout=30)["h"] for form in forms]
        leaf = [engine.infer("treelstm", {"tree": form}, timeout=30)["h"] for form in leaves]
    assert all(torch.equal(h, got[0]) for h in got[1:]) and all(torch.equal(h, leaf[0]) for h in leaf[1:])
    torch.testing.assert_close(got[0], treelstm_reference(model, {"tree": forms[1]})["h"], atol=1e-5, rtol=0)
    torch.testing.assert_close(leaf[0], treelstm_reference(model, {"tree": "(2 x)"})["h"], atol=1e-5, rtol=0)


def _leaves(tree):
    return [x for t in tree for x in _leaves(t)] if isinstance(tree, tuple) else [tree]


def test_tree_graph_shape_in_the_real_graph_builder():
    from batchmaker.core.graph import to_networkx

    from reference import real_graph_builder

    model = build_model("treelstm", **SMALL, structured=False)
    assert model.priorities["internal"] > model.priorities["leaf"] and max(model.batch_sizes["leaf"]) == 64
    g = real_graph_builder(model)
    out = model.unfold({"tree": [[1, 2], [3, [4, 5]]]}, g)
    graph = to_networkx(g.new_nodes)
    cells = [graph.nodes[n]["cell"] for n in graph]
    assert cells.count("leaf") == 5 and cells.count("internal") == 4
    assert all(graph.in_degree(n) == (2 if graph.nodes[n]["cell"] == "internal" else 0) for n in graph)
    assert out["h"].node is g.new_nodes[-1]  # post-order: the root comes last


def test_trees_still_running_when_finished_ones_are_compacted_away_match_reference(monkeypatch):
    """The node table compacted many times while other trees run (some at another priority):
    the live trees' nodes, links, rows and ready queues are renumbered, not changed."""
    monkeypatch.setattr(TreeGroup, "min_dead_to_compact", 256)
    model = build_model("treelstm", vocab=30000, embed=12, hidden=16, seed=5)
    lines = load_sst_sample()
    want = {line: treelstm_reference(model, {"tree": line})["h"] for line in lines}
    engine = Engine([model]).start(thread=False)
    try:
        futures = []
        for wave in range(12):
            for i, line in enumerate(lines[wave % 4 * 50:(wave % 4 + 1) * 50]):
                futures.append((line, engine.submit("treelstm", {"tree": line}, priority=int(i % 7 == 0))))
            engine.step()
            engine.cancel(futures[-3][1].request_id)  # (a started tree dropped: its nodes' counts and rows)
            steps = 0
            while sum(f.done() for _, f in futures) < len(futures) - 30:  # (the next wave joins running trees)
                engine.step()
                steps += 1
                assert steps < 10000, "trees never finish"
        for _ in range(10000):
            if all(f.done() for _, f in futures):
                break
            engine.step()
        assert engine.structured["treelstm"].forest.groups[0].num_compactions >= 5
        for line, f in futures:
            if f.exception() is None:
                torch.testing.assert_close(f.result().outputs["h"], want[line], atol=1e-5, rtol=0)
        engine.step()  # (the inline worker reports its last task one turn late)
        stats = engine.stats()
        assert stats["num_ready_nodes"] == 0 and stats["num_rows_used"] == [0] and stats["num_live_requests"] == 0
        assert sum(isinstance(f.exception(), CancelledError) for _, f in futures) >= 6
    finally:
        engine.stop()


def test_a_tree_task_never_writes_a_row_it_reads(monkeypatch):
    """A fused cell reads and writes rows in one kernel: the rows a task's nodes write are never
    the rows it reads (its children's, freed only once the task's own rows are taken)."""
    from batchmaker.exec.steps import StepRunner
    execute, seen = StepRunner.execute, []

    def checked(self, task):
        layout = task.cell_type.layout
        reads = task.index[list(layout.reads.values())].ravel() if layout.reads else np.zeros(0, dtype=np.int64)
        writes = task.index[list(layout.writes.values())].ravel()
        seen.append(len(np.intersect1d(reads[reads != 0], writes)))
        return execute(self, task)

    monkeypatch.setattr(StepRunner, "execute", checked)
    model = build_model("treelstm", vocab=30000, embed=12, hidden=16, seed=5, max_batch=16)
    with Engine([model]) as engine:
        futures = [engine.submit("treelstm", {"tree": line}) for line in load_sst_sample()[:60]]
        for f in futures:
            f.result(30)
    assert len(seen) > 20 and not any(seen)


def test_batch_crc32_equals_zlib_at_every_length():
    """The tree parser's CRC-32 of many words at once (a byte table per distance from the word's
    end, XOR-reduced per word) against zlib, at every length it takes, NULs and high bytes included."""
    from batchmaker.core.tree_batch import _MAX_HASHED, _crc32

    rng = random.Random(7)
    words = [bytes(rng.randrange(256) for _ in range(n)) for n in range(_MAX_HASHED + 1) for _ in range(20)]
    rng.shuffle(words)
    lengths = np.array([len(w) for w in words], dtype=np.int64)
    got = _crc32(np.frombuffer(b"".join(words), dtype=np.uint8), np.cumsum(lengths) - lengths, lengths)
    assert got.tolist() == [zlib.crc32(w) for w in words]
