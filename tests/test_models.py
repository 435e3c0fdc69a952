"""Built-in models through the engine: under random concurrent arrivals, with one and several
workers, every request's outputs equal the plain-PyTorch reference run on that request alone."""
import random

import pytest
import torch

from batchmaker import BadRequestError, Engine, EngineConfig, build_model
from batchmaker.unfolders.trees import load_sst_sample
from reference import lstm_reference, seq2seq_reference, treelstm_reference
from helpers import sharp_seq2seq, submit_concurrently, wait_idle

SMALL = dict(vocab=500, embed=24, hidden=32)


def lstm_case(rng):
    model = build_model("lstm", **SMALL, max_batch=16)
    inputs = [{"tokens": [rng.randrange(500) for _ in range(rng.randint(1, 40))]} for _ in range(120)]
    return model, inputs, lstm_reference


def seq2seq_case(rng):
    model = sharp_seq2seq(seed=rng.randrange(100))  # decodes vary in length and reach EOS
    inputs = [{"tokens": [rng.randrange(8) for _ in range(rng.randint(1, 15))]} for _ in range(80)]
    for i in inputs[::3]:
        i["max_len"] = rng.randint(1, 20)
    return model, inputs, lambda m, i: seq2seq_reference(m, i, model_max_len=20)


def treelstm_case(rng):
    model = build_model("treelstm", **SMALL, max_batch=16)
    trees = load_sst_sample()
    inputs = [{"tree": rng.choice(trees)} for _ in range(60)] + [{"tree": [[1, 2], [[3, 4], 5]]}, {"tree": 7}]
    return model, inputs, treelstm_reference


def assert_same(got, want):
    assert got.keys() == want.keys()
    for k in want:
        if isinstance(want[k], torch.Tensor):
            assert (got[k] - want[k]).abs().max() <= 1e-5, k
        else:
            assert got[k] == want[k], k


@pytest.mark.parametrize("case", [lstm_case, seq2seq_case, treelstm_case])
@pytest.mark.parametrize("devices", [("cpu",), ("cpu", "cpu")])
@pytest.mark.parametrize("seed", [0, 1])
def test_batched_equals_unbatched(case, devices, seed):
    model, inputs, reference = case(random.Random(seed))
    with Engine([model], EngineConfig(devices=devices)) as engine:
        futures = submit_concurrently(engine, model.name, inputs, seed)
        for inp, f in zip(inputs, futures):
            assert_same(f.result(60).outputs, reference(model, inp))
        stats = wait_idle(engine)
    assert max(int(k.rsplit(":", 1)[1]) for k in stats["batch_sizes"]) > 1  # requests did batch


def test_three_models_share_one_engine_and_bad_requests_cost_nothing():
    models = [build_model(n, **SMALL) for n in ("lstm", "seq2seq", "treelstm")]
    with Engine(models, EngineConfig(devices=("cpu", "cpu"))) as engine:
        bad = [engine.submit("lstm", {"tokens": []}), engine.submit("lstm", {"tokens": [10 ** 6]}),
               engine.submit("treelstm", {"tree": "(1 (2 a) (3 b)"}), engine.submit("treelstm", {"tree": [1, 2, 3]}),
               engine.submit("seq2seq", {"tokens": [1], "max_len": 0}), engine.submit("lstm", {"tokens": "abc"})]
        good = [engine.submit("lstm", {"tokens": [1, 2, 3]}), engine.submit("treelstm", {"tree": "(2 (1 a) (3 b))"}),
                engine.submit("seq2seq", {"tokens": [4, 5], "max_len": 3})]
        for f in bad:
            with pytest.raises(BadRequestError):
                f.result(30)
        assert_same(good[0].result(30).outputs, lstm_reference(models[0], {"tokens": [1, 2, 3]}))
        assert_same(good[1].result(30).outputs, treelstm_reference(models[2], {"tree": "(2 (1 a) (3 b))"}))
        assert good[2].result(30).outputs == seq2seq_reference(models[1], {"tokens": [4, 5], "max_len": 3})
        wait_idle(engine)
