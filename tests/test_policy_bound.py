"""Cell-rows (bench/baselines/cell_rows.py, the engine's stats()["cell_rows"]) are exact on small
hand-made inputs, and bench/policy_bound.py's bound and bench/policy_analytic.py's counts are the
arithmetic they claim. CPU only, seconds."""
import sys
from pathlib import Path

import numpy as np
import pytest

from batchmaker import Engine, EngineConfig, build_model
from batchmaker.unfolders.trees import parse_trees

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import policy_analytic as analytic  # noqa: E402
import policy_bound  # noqa: E402
from baselines import BucketingLSTM, BucketingSeq2Seq, GraphBatchingTreeLSTM  # noqa: E402
from baselines.cell_rows import CellRows  # noqa: E402
from baselines.trees import tree_tuples  # noqa: E402

SMALL = dict(vocab=500, embed=24, hidden=32)
COLS = ("launches", "computed", "graphed", "padded")


def rows_of(counts: dict, cell: str) -> tuple:
    return tuple(counts[cell][c] for c in COLS)


def one_batch(server, model_name, inputs):
    """Everything submitted before the loop starts, so that one bucket is one batch."""
    futures = [server.submit(model_name, i) for i in inputs]
    with server:
        for f in futures:
            f.result(60)
    return server.stats()["cell_rows"]


def test_cell_rows_adds_by_kind():
    rows = CellRows()
    rows.add("lstm", 5, 8, 8, 10)
    rows.add("lstm", 1, 2, 3, 4)
    rows.add("leaf", 1, 7, 7, 7)
    assert rows.as_dict() == {"lstm": dict(zip(COLS, (6, 10, 11, 14))), "leaf": dict(zip(COLS, (1, 7, 7, 7)))}


def test_bucketing_lstm_packed_computes_the_needed_rows():
    server = BucketingLSTM(build_model("lstm", **SMALL), width=10, max_batch=8)
    counts = one_batch(server, "lstm", [{"tokens": [5, 6, 7]}, {"tokens": [5, 6, 7, 8, 9]}])
    # one batch of lengths 3 and 5: 5 steps; packed 3 + 5 = 8 rows; padded 2 x 5 = 10
    assert rows_of(counts, "lstm") == (5, 8, 8, 10)


def test_bucketing_seq2seq_decodes_every_row_to_the_longest():
    model = build_model("seq2seq", **SMALL, max_len=8)
    server = BucketingSeq2Seq(model, width=10, max_batch=8, max_len=8, chunk=4)
    counts = one_batch(server, "seq2seq", [{"tokens": [5, 6, 7], "max_len": 3},
                                           {"tokens": [5, 6, 7, 8, 9], "max_len": 5},
                                           {"tokens": [4, 4], "max_len": 2}])
    assert rows_of(counts, "encoder") == (5, 10, 10, 15)
    # eager on the CPU: 3 rows x 5 steps; as graphs: 3 rows padded to 4, 5 steps to 2 chunks of 4
    assert rows_of(counts, "decoder") == (5, 15, 4 * 8, 15)
    paper = BucketingSeq2Seq(build_model("seq2seq", **SMALL, max_len=8), width=10, max_batch=8, max_len=8,
                             graphs=False)
    counts = one_batch(paper, "seq2seq", [{"tokens": [5, 6, 7], "max_len": 3}, {"tokens": [5, 6], "max_len": 5}])
    assert rows_of(counts, "decoder") == (5, 10, 10, 10)  # no graphs anywhere: graphed = eager


def test_graph_batching_counts_each_node_once_and_pads_levels_for_graphs():
    trees = [[1, [2, 3]], [[1, 2], [3, 4]], 5]
    server = GraphBatchingTreeLSTM(build_model("treelstm", **SMALL), max_trees=8)
    counts = one_batch(server, "treelstm", [{"tree": t} for t in trees])
    # leaves 3 + 4 + 1 = 8 in one call; internal nodes by height: {(2 3), (1 2), (3 4)} then {root, root}
    assert rows_of(counts, "leaf") == (1, 8, 8, 8)
    assert rows_of(counts, "internal") == (2, 5, 4 + 2, 5)  # graphed: 3 nodes padded to 4, 2 to 2


def engine_rows(model, inputs, name):
    engine = Engine([model], EngineConfig())
    with engine:
        for f in [engine.submit(model.name, i) for i in inputs]:
            f.result(60)
        return {k.rpartition("/")[2]: v for k, v in engine.stats()["cell_rows"].items()}


def test_engine_computes_a_requests_own_rows():
    counts = engine_rows(build_model("lstm", **SMALL), [{"tokens": list(range(3, 26))}], "lstm")
    # 23 steps: rounds of 10, 10, 3; the eager CPU worker computes exactly them, graphs pad nothing
    # (a batch of 1 is a captured size) and every lane steps to the round's end
    assert rows_of(counts, "lstm") == (23, 23, 23, 23)


def test_engine_round_lanes_past_their_end_count_only_when_padded():
    inputs = [{"tokens": [5, 6, 7]}, {"tokens": [5, 6, 7, 8, 9]}, {"tokens": [4, 4, 4, 4, 4]}]
    counts = engine_rows(build_model("lstm", **SMALL), inputs, "lstm")
    launches, computed, graphed, padded = rows_of(counts, "lstm")
    assert computed == 13  # 3 + 5 + 5: what the requests need
    assert padded == 3 * launches and padded >= 15  # every lane every step of its round
    assert graphed == 4 * launches  # 3 lanes padded to the captured size 4


def test_engine_tree_rows_are_its_nodes():
    trees = [[1, [2, 3]], [[1, 2], [3, 4]], 5]
    counts = engine_rows(build_model("treelstm", **SMALL), [{"tree": t} for t in trees], "treelstm")
    assert counts["leaf"]["computed"] == 8 and counts["internal"]["computed"] == 5
    assert counts["leaf"]["graphed"] >= 8 and counts["internal"]["graphed"] >= 5


def test_per_request_and_bound():
    point = lambda needed, computed, graphed: {  # noqa: E731
        "num_offered": 2, "needed": {"enc": needed, "dec": needed},
        "cell_rows": {"enc": dict(launches=4, computed=computed, graphed=graphed, padded=graphed),
                      "dec": dict(launches=2, computed=2 * computed, graphed=2 * graphed, padded=2 * graphed)}}
    ours = policy_bound.per_request([point(8, 8, 10)])
    theirs = policy_bound.per_request([point(8, 10, 12), point(8, 10, 12)])
    assert ours["enc"]["computed"] == 4 and ours["enc"]["needed"] == 4 and ours["dec"]["computed"] == 8
    assert ours["enc"]["padding"]["graphed"] == pytest.approx(0.2)
    assert ours["enc"]["mean_rows_per_launch"] == 2
    b = policy_bound.bound(ours, theirs, {"w": {"enc": 1, "dec": 3}})
    assert b["computed"]["enc"] == pytest.approx(10 / 8) and b["computed"]["dec"] == pytest.approx(10 / 8)
    # weighted: (1 * 5 + 3 * 10) / (1 * 4 + 3 * 8)
    assert b["computed"]["weighted_w"] == pytest.approx(35 / 28)
    assert b["graphed"]["enc"] == pytest.approx(12 / 10)


def test_macs_per_row():
    w = policy_bound.macs_per_row("seq2seq", hidden=32, embed=24, vocab=500)
    assert w["encoder"] == 4 * 32 * (24 + 32)
    assert w["decoder"] == 4 * 32 * (24 + 32) + 500 * 32


def test_analytic_bucketing():
    lengths = np.array([3, 5, 12, 4])
    limits = np.array([3, 5, 12, 9])
    r = analytic.bucketing_rows(lengths, limits, width=10, batch=2, chunk=4)
    # bucket 0: [3, 5] then [4]; bucket 1: [12]
    assert r["encoder"] == dict(needed=24, computed=24, graphed=24, padded=2 * 5 + 4 + 12)
    assert r["decoder"]["computed"] == 2 * 5 + 9 + 12
    assert r["decoder"]["graphed"] == 2 * 8 + 1 * 12 + 1 * 12
    e = analytic.engine_rows({"lstm": lengths}, round_steps=10)
    assert e["lstm"]["computed"] == 24 and e["lstm"]["graphed"] == e["lstm"]["padded"] == 10 + 10 + 20 + 10


def test_analytic_graph_batching_matches_its_server_count():
    trees = [[1, [2, 3]], [[1, 2], [3, 4]], 5]
    arrays, ok, _ = parse_trees(trees, 500)
    r = analytic.graph_batching_rows(tree_tuples(arrays), cap=8)
    assert r["leaf"]["computed"] == 8 and r["internal"]["computed"] == 5 and r["internal"]["graphed"] == 6
    assert analytic.next_power_of_two(3, 512) == 4 and analytic.next_power_of_two(512, 512) == 512
