"""The benchmark baselines (bench/baselines) give the engine's outputs and the plain references' for
the same weights, in every variant the runners use (the strong and the paper's bucketing, graph
batching with and without padded levels, the ablation), and reject bad requests one by one.
On a CUDA machine the same tests run the baselines' GPU paths (two batches in flight, CUDA graphs,
fused tree kernels)."""
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from batchmaker import BadRequestError, Engine, build_model
from batchmaker.data import complete_trees
from batchmaker.unfolders.trees import load_sst_sample, parse_tree, parse_trees
from reference import lstm_reference, seq2seq_reference, treelstm_reference
from helpers import sharp_seq2seq

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from baselines import (BucketingLSTM, BucketingSeq2Seq, Buckets, FixedTreeIdeal,  # noqa: E402
                       GraphBatchingTreeLSTM, LevelPlan, complete_leaves)
from baselines.request_level import RequestLevelEngine  # noqa: E402
from baselines.tree_steps import TreeSteps, level_sizes  # noqa: E402

SMALL = dict(vocab=500, embed=24, hidden=32)
DEVICES = ["cpu"] + (["cuda:0"] if torch.cuda.is_available() else [])


def serve_all(server, model_name, inputs):
    """Submit everything at once, so batches fill and buckets mix."""
    with server:
        futures = [server.submit(model_name, i) for i in inputs]
        return [f.result(60).outputs for f in futures]


def close(got, want, atol=1e-5):
    return (got.float().cpu() - want.float().cpu()).abs().max() <= atol


class Item:
    def __init__(self, name, arrival):
        self.name, self.arrival = name, arrival


def test_bucket_picks():
    items = [Item(n, t) for t, n in enumerate([3, 14, 15, 16, 35, 5])]  # name = length, arrival = order
    picked = {}
    for pick in ("oldest", "fullest", "round-robin"):
        buckets = Buckets(width=10, max_batch=2, pick=pick)
        for item in items:
            buckets.add(item.name, item)
        picked[pick] = [[i.name for i in buckets.next_batch()] for _ in range(5)]
    assert picked["oldest"] == [[3, 5], [14, 15], [16], [35], []]
    assert picked["fullest"] == [[14, 15], [3, 5], [16], [35], []]  # 3 queued in bucket 1 beat the older bucket 0
    assert picked["round-robin"] == [[3, 5], [14, 15], [35], [16], []]
    with pytest.raises(ValueError):
        Buckets(10, 2, pick="random")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", [dict(pick="oldest", max_in_flight=2), dict(pick="round-robin", max_in_flight=1)])
def test_bucketing_lstm_matches_engine_and_reference(device, variant):
    model = build_model("lstm", **SMALL, max_batch=16)
    rng = random.Random(0)
    inputs = [{"tokens": [rng.randrange(500) for _ in range(rng.randint(1, 45))]} for _ in range(60)]
    got = serve_all(BucketingLSTM(model, device, max_batch=16, **variant), "lstm", inputs)
    with Engine([model]) as engine:
        from_engine = [f.result(30).outputs for f in [engine.submit("lstm", i) for i in inputs]]
    for inp, out, eng in zip(inputs, got, from_engine):
        assert close(out["h"], lstm_reference(model, inp)["h"], 1e-5 if device == "cpu" else 1e-4)
        assert close(out["h"], eng["h"], 1e-5 if device == "cpu" else 1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", [dict(pick="fullest", max_in_flight=2, chunk=3), dict(pick="round-robin", max_in_flight=1)])
def test_bucketing_seq2seq_matches_reference(device, variant, no_tf32):
    model = sharp_seq2seq(seed=3)  # decodes vary in length and reach EOS
    rng = random.Random(1)
    inputs = [{"tokens": [rng.randrange(8) for _ in range(rng.randint(1, 25))], "max_len": rng.randint(1, 20)}
              for _ in range(40)]
    got = serve_all(BucketingSeq2Seq(model, device, max_batch=8, max_len=20, **variant), "seq2seq", inputs)
    assert got == [seq2seq_reference(model, i, model_max_len=20) for i in inputs]
    assert any(len(g["tokens"]) < i["max_len"] for g, i in zip(got, inputs))  # EOS cut some short


def test_bucketing_rejects_bad_requests_one_by_one():
    model = build_model("lstm", **SMALL)
    bad = [{"tokens": []}, {"tokens": [1, 999]}, {"tokens": [1], "x": 2}, {"tokens": "abc"}, {"tokens": [True, 3]}]
    with BucketingLSTM(model) as server:
        futures = [server.submit("lstm", i) for i in bad + [{"tokens": [4, 5]}]]
        assert all(isinstance(f.exception(10), BadRequestError) for f in futures[:-1])
        assert close(futures[-1].result(10).outputs["h"], lstm_reference(model, {"tokens": [4, 5]})["h"])
        assert isinstance(server.submit("treelstm", {"tree": 1}).exception(5), KeyError)


def sst_trees(n, seed):
    rng = random.Random(seed)
    return [rng.choice(load_sst_sample()) for _ in range(n)] + [7, [[1, 2], [[3, 4], 5]]]


@pytest.mark.parametrize("device", DEVICES)
def test_graph_batching_matches_reference(device):
    sizes = SMALL if device == "cpu" else dict(SMALL, embed=32)  # (the fused kernels take multiples of 16)
    model = build_model("treelstm", **sizes, dtype="fp16" if device != "cpu" else "fp32")
    inputs = [{"tree": t} for t in sst_trees(70, 2)]
    got = serve_all(GraphBatchingTreeLSTM(model, device, max_trees=16), "treelstm", inputs)
    for inp, out in zip(inputs, got):
        assert close(out["h"], treelstm_reference(model, inp)["h"], 1e-5 if device == "cpu" else 2e-2)


def test_padded_levels_and_a_grown_pool_give_the_same_roots():
    """The CUDA-graph path's plans (levels padded to fixed sizes, split at a maximum, padding writing
    a scratch row) run through the cells' PyTorch twins on the CPU: the same roots as unpadded."""
    model = build_model("treelstm", **SMALL)
    arrays, _, _ = parse_trees(sst_trees(40, 5), 500)
    batch = [arrays.tree(t) for t in range(len(arrays.num_leaves))]
    steps = TreeSteps(model.cells["leaf"], model.cells["internal"], torch.device("cpu"), rows=8, graphs=False)
    roots = {}
    for label, pad, max_level in (("plain", None, None), ("padded", steps.pad, 8)):
        plan = LevelPlan(batch, pad=pad, scratch=steps.scratch, max_level=max_level)
        steps.ensure_rows(plan.num_rows)
        plan = LevelPlan(batch, pad=pad, scratch=steps.scratch, max_level=max_level)
        with torch.inference_mode():
            roots[label] = steps.run(plan, torch.from_numpy(plan.index)).clone()
    assert close(roots["plain"], roots["padded"], 1e-6)  # (matmuls of other sizes sum in another order)
    want = torch.stack([treelstm_reference(model, {"tree": t})["h"] for t in sst_trees(40, 5)])
    assert close(roots["plain"], want)
    assert level_sizes(1024) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 768, 1024]


def test_level_plan_numbers_rows_by_height():
    arrays, _, _ = parse_trees([[[1, 2], 3], 4, [5, 6]], 10)
    plan = LevelPlan([arrays.tree(t) for t in range(3)])
    assert plan.num_leaves == 6 and plan.num_rows == 10  # row 0, 6 leaves, 3 internal nodes
    assert plan.index[:6].tolist() == [1, 2, 3, 4, 5, 6]
    assert plan.levels == [(6, 2, 2), (12, 1, 1)]  # height 1: two nodes; height 2: one
    assert plan.index[6:12].tolist() == [1, 5, 2, 6, 7, 8]  # (left rows, right rows, own rows)
    assert plan.index[12:].tolist() == [7, 3, 9]
    assert plan.roots.tolist() == [9, 4, 8]
    padded = LevelPlan([arrays.tree(t) for t in range(3)], pad=lambda n: 4, scratch=99)
    assert padded.levels == [(6, 2, 4), (18, 1, 4)]
    assert padded.index[6:18].tolist() == [1, 5, 0, 0, 2, 6, 0, 0, 7, 8, 99, 99]  # inputs pad with row 0
    assert padded.index[18:].tolist() == [7, 0, 0, 0, 3, 0, 0, 0, 9, 99, 99, 99]


def test_fixed_tree_ideal_matches_reference_and_rejects_other_shapes():
    model = build_model("treelstm", **SMALL)
    inputs = [{"tree": t} for t in complete_trees(20, vocab=500, num_leaves=16, seed=1)]
    got = serve_all(FixedTreeIdeal(model, max_trees=8), "treelstm", inputs)
    for inp, out in zip(inputs, got):
        assert close(out["h"], treelstm_reference(model, inp)["h"])
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
        assert close(out["h"], treelstm_reference(model, {"tree": tree})["h"], 1e-4)


@pytest.mark.parametrize("kind", ["lstm", "treelstm"])
def test_request_level_ablation_gives_the_engines_outputs_one_batch_at_a_time(kind):
    model = build_model(kind, **SMALL)
    rng = random.Random(4)
    if kind == "lstm":
        inputs = [{"tokens": [rng.randrange(500) for _ in range(rng.randint(1, 30))]} for _ in range(50)]
    else:
        inputs = [{"tree": t} for t in sst_trees(40, 6)]
    gate = RequestLevelEngine(Engine([model]), kind, width=10 if kind == "lstm" else None, max_batch=8)
    got = serve_all(gate, kind, inputs)
    reference = lstm_reference if kind == "lstm" else treelstm_reference
    for inp, out in zip(inputs, got):
        assert close(out["h"], reference(model, inp)["h"])
    assert gate.num_batches >= len(inputs) / 8
    with RequestLevelEngine(Engine([model]), kind) as gate:
        assert isinstance(gate.submit(kind, {"nope": 1}).exception(10), BadRequestError)


def test_outputs_do_not_share_a_reused_buffer():
    """Rows handed out by one batch stay what they were after later batches (host buffers are per batch)."""
    model = build_model("lstm", **SMALL)
    with BucketingLSTM(model, max_batch=4) as server:
        first = server.submit("lstm", {"tokens": [3, 4, 5]}).result(10).outputs["h"].clone()
        kept = server.submit("lstm", {"tokens": [3, 4, 5]}).result(10).outputs["h"]
        for _ in range(5):
            server.submit("lstm", {"tokens": list(np.arange(1, 9))}).result(10)
        assert torch.equal(kept, first)
