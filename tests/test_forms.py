"""The structured forms against the general path: the same built-in model served both ways (its
Chain / DecodeLoop / Tree forms, and its unfolder function: `structured=False`), with the same
weights, on random workloads with bad requests mixed in, gives the same outputs and fails the
same requests with the same error types, on one and two workers."""
import random

import pytest

from batchmaker import BadRequestError, Engine, EngineConfig, build_model
from batchmaker.unfolders.trees import load_sst_sample
from helpers import sharp_seq2seq, submit_concurrently, wait_idle

SMALL = dict(vocab=300, embed=16, hidden=16)


def workload(name: str, rng: random.Random) -> list[dict]:
    if name == "treelstm":
        sst = load_sst_sample()
        good = [{"tree": rng.choice(sst)} for _ in range(50)] + [{"tree": [[1, 2], [3, [4, 5]]]}, {"tree": 9},
                                                                 {"tree": [[[3]], [[4], [5]]]}, {"tree": [[7]]}]
        bad = [{"tree": "(1 (2 a)"}, {"tree": [[1, 2], []]}, {"tree": [1, 2, 3]}, {"tree": [True, 4]}, {"trees": "x"}]
    else:
        vocab = 8 if name == "seq2seq" else SMALL["vocab"]
        good = [{"tokens": [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]} for _ in range(70)]
        if name == "seq2seq":
            for g in good[::3]:
                g["max_len"] = rng.randint(1, 20)
        bad = [{"tokens": []}, {"tokens": [vocab]}, {"tokens": [True, 3]}, {"tokens": [1.5]}, {"tokens": "ab"},
               {"tokens": [1], "other": 2}]
        if name == "seq2seq":
            bad += [{"tokens": [1], "max_len": 0}, {"tokens": [1], "max_len": 21}]
    mixed = good + bad
    rng.shuffle(mixed)
    return mixed


def models(name: str, seed: int):
    if name == "seq2seq":
        return sharp_seq2seq(seed), sharp_seq2seq(seed, structured=False)
    size = dict(SMALL, seed=seed, max_batch=16)
    return build_model(name, **size), build_model(name, **size, structured=False)


def outcomes(model, inputs, devices, seed):
    with Engine([model], EngineConfig(devices=devices)) as engine:
        futures = submit_concurrently(engine, model.name, inputs, seed)
        results = []
        for f in futures:
            error = f.exception(60)
            results.append(type(error) if error is not None else f.result().outputs)
        wait_idle(engine)
    return results


@pytest.mark.parametrize("name", ["lstm", "seq2seq", "treelstm"])
@pytest.mark.parametrize("devices", [("cpu",), ("cpu", "cpu")])
def test_forms_equal_the_general_path(name, devices):
    seed = len(devices)
    structured, general = models(name, seed)
    assert structured.forms and not general.forms
    inputs = workload(name, random.Random(seed))
    got, want = outcomes(structured, inputs, devices, seed), outcomes(general, inputs, devices, seed + 1)
    assert [isinstance(g, type) for g in got] == [isinstance(w, type) for w in want]  # the same requests fail
    for g, w in zip(got, want):
        if isinstance(w, type):
            assert g is w is BadRequestError
        elif name == "seq2seq":
            assert g == w
        else:
            assert g.keys() == w.keys() and (g["h"] - w["h"]).abs().max() <= 1e-5
    assert sum(isinstance(w, type) for w in want) >= 5


def test_a_failing_tree_cell_fails_the_trees_of_its_task_and_the_engine_goes_on():
    model = build_model("treelstm", **SMALL, max_batch=8)
    leaf = model.cells["leaf"]
    forward = leaf.forward

    def failing(token):
        if bool((token == 7).any()):
            raise RuntimeError("planted failure")
        return forward(token)

    leaf.forward = failing
    rng = random.Random(4)
    trees = [[[rng.randrange(8, 300), rng.randrange(8, 300)], rng.randrange(8, 300)] for _ in range(40)]
    for t in trees[::5]:
        t[1] = 7
    with Engine([model]) as engine:
        futures = [engine.submit("treelstm", {"tree": t}) for t in trees]
        outcomes = [type(f.exception(30)).__name__ if f.exception(30) else "ok" for f in futures]
        assert all(o == "CellError" for o, t in zip(outcomes, trees) if t[1] == 7)
        assert "ok" in outcomes
        wait_idle(engine)
        leaf.forward = forward
        general = build_model("treelstm", **SMALL, max_batch=8, structured=False)
        with Engine([general]) as reference:
            for t, o, f in zip(trees, outcomes, futures):
                if o == "ok":
                    want = reference.infer("treelstm", {"tree": t}, timeout=30)["h"]
                    assert (f.result().outputs["h"] - want).abs().max() <= 1e-5
        assert engine.infer("treelstm", {"tree": [1, 2]}, timeout=30)["h"].shape == (SMALL["hidden"],)
