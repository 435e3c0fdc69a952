"""Cells batch row-independently; LSTM and Seq2Seq unfolders + cells match plain-PyTorch references."""
import pytest
import torch

from batchmaker.cells import LSTMCell, Seq2SeqDecoderCell, TreeInternalCell, TreeLeafCell, load_weights, save_weights
from batchmaker.errors import BadRequestError
from batchmaker.registry import build_model, registered_models
from batchmaker.unfolders.seq2seq import BOS, EOS
from helpers import sharp_seq2seq
from reference import EagerGraph, lstm_reference, run_eagerly, seq2seq_reference

SMALL = dict(vocab=50, embed=12, hidden=16)
TOL = 1e-5


def random_inputs(cell, batch: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    out = {}
    for name, spec in cell.signature.inputs.items():
        if spec.is_integer:
            out[name] = torch.randint(0, spec.high, (batch, *spec.shape), generator=gen)
        else:
            out[name] = torch.randn((batch, *spec.shape), generator=gen, dtype=spec.dtype)
    return out


CELLS = {
    "lstm": lambda: LSTMCell(**SMALL),
    "decoder": lambda: Seq2SeqDecoderCell(**SMALL),
    "leaf": lambda: TreeLeafCell(**SMALL),
    "internal": lambda: TreeInternalCell(16),
}


@pytest.mark.parametrize("name", CELLS)
def test_batched_forward_equals_per_row(name):
    cell, gen = CELLS[name](), torch.Generator().manual_seed(1)
    inputs = random_inputs(cell, 7, gen)
    with torch.no_grad():
        batched = cell(**inputs)
        rows = [cell(**{k: v[b : b + 1] for k, v in inputs.items()}) for b in range(7)]
    assert set(batched) == set(cell.signature.outputs)
    for out, spec in cell.signature.outputs.items():
        assert batched[out].shape == (7, *spec.shape) and batched[out].dtype == spec.dtype
        per_row = torch.cat([r[out] for r in rows])
        if spec.is_integer:
            assert torch.equal(batched[out], per_row)
        else:
            torch.testing.assert_close(batched[out], per_row, atol=TOL, rtol=0)


@pytest.mark.parametrize("name", CELLS)
def test_seeded_init(name):
    make = CELLS[name]
    torch.manual_seed(123)  # the global RNG must not matter
    a = make().state_dict()
    torch.manual_seed(456)
    b = make().state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    other = (TreeInternalCell(16, seed=1) if name == "internal" else type(make())(**SMALL, seed=1)).state_dict()
    assert all(not torch.equal(a[k], other[k]) for k in a)
    assert all(float(v.abs().max()) <= 0.1 for v in a.values())


def test_dtype_argument():
    cell = LSTMCell(**SMALL, dtype=torch.float64)
    assert cell.signature.outputs["h"].dtype == torch.float64
    out = cell(**random_inputs(cell, 3, torch.Generator().manual_seed(0)))
    assert out["h"].dtype == torch.float64
    assert build_model("lstm", **SMALL, dtype="bf16").cells["lstm"].signature.inputs["c"].dtype == torch.bfloat16


def test_registry_and_settings():
    assert {"lstm", "seq2seq", "treelstm"} <= set(registered_models())
    lstm = build_model("lstm", **SMALL, max_batch=512)
    assert lstm.batch_sizes["lstm"] == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    s2s = build_model("seq2seq", **SMALL)
    assert s2s.priorities["decoder"] > s2s.priorities["encoder"]
    assert max(s2s.batch_sizes["encoder"]) == 512 and max(s2s.batch_sizes["decoder"]) == 256
    assert build_model("lstm", **SMALL, max_batch=48).batch_sizes["lstm"] == (1, 2, 4, 8, 16, 32, 48)


def test_weights_round_trip(tmp_path):
    path = tmp_path / "s2s.pt"
    a, b = build_model("seq2seq", **SMALL, seed=0), build_model("seq2seq", **SMALL, seed=7)
    save_weights(a.cells, path)
    load_weights(b.cells, path)
    for name in a.cells:
        sa, sb = a.cells[name].state_dict(), b.cells[name].state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    c = build_model("seq2seq", **SMALL, weights=str(path))
    assert torch.equal(c.cells["decoder"].out.weight, a.cells["decoder"].out.weight)


def test_weights_mismatch(tmp_path):
    model = build_model("seq2seq", **SMALL)
    cases = {
        "missing cells ['decoder']": {"encoder": model.cells["encoder"].state_dict()},
        "unexpected cells ['extra']": {**{n: c.state_dict() for n, c in model.cells.items()}, "extra": {}},
        "decoder.out.weight: shape": {n: c.state_dict() for n, c in build_model("seq2seq", vocab=60, embed=12,
                                                                                 hidden=16).cells.items()},
        "missing tensors of 'encoder'": {"encoder": {}, "decoder": model.cells["decoder"].state_dict()},
        "expected a dict": [1, 2],
    }
    for message, saved in cases.items():
        torch.save(saved, tmp_path / "w.pt")
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
            load_weights(model.cells, tmp_path / "w.pt")


@pytest.mark.parametrize("length", [1, 2, 9, 40])
def test_lstm_matches_reference(length):
    model = build_model("lstm", **SMALL, seed=3)
    tokens = torch.randint(0, 50, (length,), generator=torch.Generator().manual_seed(length)).tolist()
    graph = EagerGraph(model)
    got = run_eagerly(model, {"tokens": tokens}, graph)
    assert graph.count["lstm"] == length
    torch.testing.assert_close(got["h"], lstm_reference(model, {"tokens": tokens})["h"], atol=TOL, rtol=0)


def test_seq2seq_matches_reference():
    num_early_eos = 0
    for seed in range(8):
        model = sharp_seq2seq(seed)
        tokens = torch.randint(0, 8, (seed + 3,), generator=torch.Generator().manual_seed(seed)).tolist()
        for inputs in ({"tokens": tokens}, {"tokens": tokens, "max_len": 3}):
            got = run_eagerly(model, inputs)
            assert got == seq2seq_reference(model, inputs, model_max_len=20)
            assert all(isinstance(t, int) for t in got["tokens"])
            assert len(got["tokens"]) <= inputs.get("max_len", 20)
            assert EOS not in got["tokens"][:-1]
            num_early_eos += len(got["tokens"]) < inputs.get("max_len", 20)
    assert num_early_eos >= 2  # the EOS path was exercised, not only max_len


def test_seq2seq_stops_at_eos():
    model = build_model("seq2seq", **SMALL)
    with torch.no_grad():
        model.cells["decoder"].out.bias[EOS] = 100.0  # the decoder now always says EOS
    graph = EagerGraph(model)
    assert run_eagerly(model, {"tokens": [5, 6, 7]}, graph) == {"tokens": [EOS]}
    assert graph.count == {"encoder": 3, "decoder": 1}
    assert BOS != EOS


BAD_SEQUENCES = [
    {},
    {"tokens": [1, 2], "extra": 1},
    {"tokens": []},
    {"tokens": [1, 2.5]},
    {"tokens": [1, "a"]},
    {"tokens": [True]},
    {"tokens": [1, 50]},
    {"tokens": [-1]},
    {"tokens": "abc"},
    {"tokens": [[1, 2]]},
]


@pytest.mark.parametrize("model_name", ["lstm", "seq2seq"])
@pytest.mark.parametrize("inputs", BAD_SEQUENCES, ids=str)
def test_bad_sequences_rejected_before_any_node(model_name, inputs):
    model = build_model(model_name, **SMALL)
    graph = EagerGraph(model)
    with pytest.raises(BadRequestError):
        run_eagerly(model, inputs, graph)
    assert graph.num_nodes == 0


@pytest.mark.parametrize("max_len", [0, 51, 2.0, "3", None])
def test_bad_max_len(max_len):
    model = build_model("seq2seq", **SMALL)
    graph = EagerGraph(model)
    with pytest.raises(BadRequestError, match="max_len"):
        run_eagerly(model, {"tokens": [3], "max_len": max_len}, graph)
    assert graph.num_nodes == 0


def test_unfolders_fit_the_real_graph_builder():
    from batchmaker.core.graph import to_networkx

    from reference import real_graph_builder

    lstm = build_model("lstm", **SMALL, structured=False)
    g = real_graph_builder(lstm)
    out = lstm.unfold({"tokens": [3, 4, 5]}, g)
    graph = to_networkx(g.new_nodes)
    assert len(g.new_nodes) == 3 and out["h"].node is g.new_nodes[-1]  # one node per token, in a chain
    assert list(graph.edges) == [(g.new_nodes[0].id, g.new_nodes[1].id), (g.new_nodes[1].id, g.new_nodes[2].id)]
    assert [n.inputs["token"] for n in g.new_nodes] == [3, 4, 5]

    s2s = build_model("seq2seq", **SMALL, structured=False)
    g = real_graph_builder(s2s)
    steps = s2s.unfold({"tokens": [3, 4]}, g)
    ref = steps.send(None)  # the first decoder token
    assert [n.cell_type.name for n in g.new_nodes] == ["encoder", "encoder", "decoder"]
    assert ref.node is g.new_nodes[-1] and ref.output == "token"
    assert steps.send(7).node.inputs["token"].node is ref.node  # the next step reads the token on the device
    with pytest.raises(StopIteration) as stop:
        steps.send(EOS)
    assert stop.value.value == {"tokens": [7, EOS]}
