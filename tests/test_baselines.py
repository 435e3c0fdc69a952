"""The benchmark baselines (bench/baselines) give the same outputs as the engine and the plain
references for the same weights, and the load generator drives them like the engine."""
import random
import sys
from pathlib import Path

import pytest

from batchmaker import BadRequestError, Engine, build_model
from batchmaker.data import complete_trees
from batchmaker.unfolders.trees import load_sst_sample, parse_tree, parse_trees
from reference import lstm_reference, seq2seq_reference, treelstm_reference
from helpers import sharp_seq2seq

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from baselines import (BucketingLSTM, BucketingSeq2Seq, Buckets, FixedTreeIdeal,  # noqa: E402
                       GraphBatchingTreeLSTM, LevelPlan, complete_leaves)
from loadgen import LoadConfig, RatePoint, p90_at, run_rate  # noqa: E402

SMALL = dict(vocab=500, embed=24, hidden=32)


def serve_all(server, model_name, inputs):
    """Submit everything at once, so batches fill and buckets mix."""
    with server:
        futures = [server.submit(model_name, i) for i in inputs]
        return [f.result(30).outputs for f in futures]


def assert_close(got, want):
    assert (got - want).abs().max() <= 1e-5


def test_buckets_round_robin_by_width():
    buckets = Buckets(width=10, max_batch=2)
    for length in (1, 10, 11, 35, 5, 12, 3):
        buckets.add(length, length)
    assert [buckets.next_batch() for _ in range(6)] == [[1, 10], [11, 12], [35], [5, 3], [], []]


def test_bucketing_lstm_matches_engine_and_reference():
    model = build_model("lstm", **SMALL, max_batch=16)
    rng = random.Random(0)
    inputs = [{"tokens": [rng.randrange(500) for _ in range(rng.randint(1, 45))]} for _ in range(60)]
    got = serve_all(BucketingLSTM(model, max_batch=16), "lstm", inputs)
    with Engine([model]) as engine:
        from_engine = [f.result(30).outputs for f in [engine.submit("lstm", i) for i in inputs]]
    for inp, out, eng in zip(inputs, got, from_engine):
        assert_close(out["h"], lstm_reference(model, inp)["h"])
        assert_close(out["h"], eng["h"])


def test_bucketing_seq2seq_matches_reference():
    model = sharp_seq2seq(seed=3)  # decodes vary in length and reach EOS
    rng = random.Random(1)
    inputs = [{"tokens": [rng.randrange(8) for _ in range(rng.randint(1, 25))], "max_len": rng.randint(1, 20)}
              for _ in range(40)]
    got = serve_all(BucketingSeq2Seq(model, max_batch=8, max_len=20), "seq2seq", inputs)
    assert got == [seq2seq_reference(model, i, model_max_len=20) for i in inputs]
    assert any(len(g["tokens"]) < i["max_len"] for g, i in zip(got, inputs))  # EOS cut some short


def test_graph_batching_matches_reference():
    model = build_model("treelstm", **SMALL)
    rng = random.Random(2)
    trees = [rng.choice(load_sst_sample()) for _ in range(70)] + [7, [[1, 2], [[3, 4], 5]]]
    inputs = [{"tree": t} for t in trees]
    got = serve_all(GraphBatchingTreeLSTM(model, max_trees=16), "treelstm", inputs)
    for inp, out in zip(inputs, got):
        assert_close(out["h"], treelstm_reference(model, inp)["h"])


def test_level_plan_numbers_children_before_parents():
    arrays, _, _ = parse_trees([[[1, 2], 3], 4], 10)
    plan = LevelPlan([arrays.tree(0), arrays.tree(1)])
    assert plan.num_leaves == 4 and plan.num_nodes == 6
    assert plan.index[:4].tolist() == [1, 2, 3, 4]
    assert plan.levels == [(4, 5, 4, 5), (5, 6, 6, 7)]  # heights 1 and 2, one node each
    assert plan.index[4:].tolist() == [0, 1, 4, 2]  # (leaf 1, leaf 2), then (node 4, leaf 3)
    assert plan.roots.tolist() == [5, 3]


def test_fixed_tree_ideal_matches_reference_and_rejects_other_shapes():
    model = build_model("treelstm", **SMALL)
    inputs = [{"tree": t} for t in complete_trees(20, vocab=500, num_leaves=16, seed=1)]
    got = serve_all(FixedTreeIdeal(model, max_trees=8), "treelstm", inputs)
    for inp, out in zip(inputs, got):
        assert_close(out["h"], treelstm_reference(model, inp)["h"])
    assert complete_leaves(parse_tree([[1, 2], 3], 10)) is None
    with FixedTreeIdeal(model) as ideal:
        with pytest.raises(BadRequestError):
            ideal.submit("treelstm", {"tree": [[1, 2], 3]}).result(10)


def test_dynet_autobatching_matches_reference():
    pytest.importorskip("dynet", reason="optional: pip install dynet38")
    from baselines.dynet_treelstm import DynetTreeLSTM
    model = build_model("treelstm", **SMALL)
    trees = load_sst_sample()[:30] + [[[1, 2], 3]]
    got = serve_all(DynetTreeLSTM(model, max_trees=8), "treelstm", [{"tree": t} for t in trees])
    for tree, out in zip(trees, got):
        assert (out["h"] - treelstm_reference(model, {"tree": tree})["h"]).abs().max() <= 1e-4


def test_load_generator_drives_a_baseline():
    model = build_model("lstm", **SMALL)
    requests = [("lstm", {"tokens": [5] * n}) for n in range(1, 30)]
    with BucketingLSTM(model) as server:
        point = run_rate(server.submit, requests, rate=2000, config=LoadConfig(duration=0.01, min_requests=60, progress=False))
        bad = server.submit("treelstm", {"tree": 1})
    assert point.num_done == point.num_sent == 60 and point.num_failed == 0
    assert 0 <= point.queueing_ms["p50"] <= point.latency_ms["p99"]
    assert point.latency_ms["p50"] <= point.latency_ms["p90"] <= point.latency_ms["p99"]
    assert len(point.cdf_ms["computation"]) == 101
    assert isinstance(bad.exception(5), KeyError)


def test_p90_at_interpolates_and_refuses_unreached_loads():
    def point(throughput, p90, is_saturated=False):
        pct = {"p50": p90, "p90": p90, "p99": p90}
        return RatePoint(throughput, 1, 1, 0, throughput, is_saturated, throughput, pct, pct, pct, pct)
    points = [point(100, 2.0), point(200, 4.0), point(300, 10.0), point(350, 900.0, is_saturated=True)]
    assert p90_at(points, 150) == pytest.approx(3.0)
    assert p90_at(points, 50) == 2.0
    assert p90_at(points, 320) is None  # reached only saturated
