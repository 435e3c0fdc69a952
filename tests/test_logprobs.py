"""Log-probabilities of generated tokens (`"logprobs": k`): each token's and its k most likely
alternatives', under the model's own distribution (before temperature and the cuts), equal to
transformers' log-softmax at every step; greedy or sampled, batched beside requests that do not
ask (their replies unchanged), streamed and whole alike, and the same on two ranks, through two
pipeline stages (the last stage sends them back to stage 0 with the tokens: cells/pipeline.py)."""
import random

import pytest
import torch

from batchmaker import Engine
from batchmaker.errors import BadRequestError
from batchmaker.registry import build_model
from test_generation import drive

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from batchmaker.cells.decoder_config import PRESETS, to_hf
    torch.manual_seed(6)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**dict(to_hf(PRESETS["tiny-llama"]),
                                                                        initializer_range=0.1))).eval()
    path = tmp_path_factory.mktemp("logprobs")
    hf.save_pretrained(path)
    return str(path), hf


def hf_logprobs(hf, prompt: list, generated: list) -> torch.Tensor:
    """log-softmax [len(generated), vocab] of the logits that chose each generated token."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits.float(), -1)


def serve(model, requests: list, streams: bool = False) -> list:
    engine = Engine([model]).start(thread=False)
    try:
        partials = [[] for _ in requests]
        if streams:
            futures = [engine.submit("llama", inputs, on_partial=partials[i].append)
                       for i, (_, inputs) in enumerate(requests)]
            while not all(f.done() for f in futures):
                engine.step()
        else:
            futures = drive(engine, requests, random.Random(0))
        return [(f.result(0).outputs, p) for f, p in zip(futures, partials)]
    finally:
        engine.stop()


REQUESTS = [("llama", {"tokens": [5, 9, 17, 3], "max_new_tokens": 8, "logprobs": 3, "ignore_eos": True}),
            ("llama", {"tokens": [7] * 40, "max_new_tokens": 6, "ignore_eos": True}),  # (asks nothing)
            ("llama", {"tokens": [11, 2, 30], "max_new_tokens": 7, "logprobs": 0, "temperature": 0.8, "seed": 4,
                       "ignore_eos": True}),
            ("llama", {"tokens": list(range(1, 70)), "max_new_tokens": 5, "logprobs": 20, "ignore_eos": True}),
            ("llama", {"tokens": [40, 41], "max_new_tokens": 6, "logprobs": 5, "temperature": 1.2, "top_k": 30,
                       "top_p": 0.9, "seed": 9, "ignore_eos": True})]


def test_logprobs_equal_transformers_greedy_and_sampled(tiny):
    path, hf = tiny
    replies = serve(build_model("llama", checkpoint=path, max_tokens=48), REQUESTS)
    for (outputs, _), (_, inputs) in zip(replies, REQUESTS):
        k = inputs.get("logprobs", -1)
        if k < 0:
            assert "logprobs" not in outputs and "top_logprobs" not in outputs
            continue
        want = hf_logprobs(hf, inputs["tokens"], outputs["tokens"])
        chosen = want.gather(1, torch.tensor(outputs["tokens"])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(outputs["logprobs"]), chosen, atol=1e-4, rtol=1e-4)
        assert len(outputs["top_logprobs"]) == len(outputs["tokens"])
        for step, top in enumerate(outputs["top_logprobs"]):
            assert len(top) == k
            values = want[step].topk(k).values if k else torch.zeros(0)
            torch.testing.assert_close(torch.tensor([v for _, v in top]), values, atol=1e-4, rtol=1e-4)
            assert all(abs(want[step, i] - v) < 1e-4 for i, v in top)  # (each id's own log-probability)
        if "temperature" not in inputs:  # greedy: the chosen token is the most likely
            assert all(lp == pytest.approx(top[0][1], abs=1e-6) for lp, top in zip(outputs["logprobs"],
                                                                                      outputs["top_logprobs"]) if top)


def test_streamed_logprobs_are_the_replys(tiny):
    path, _ = tiny
    for outputs, partials in serve(build_model("llama", checkpoint=path, max_tokens=48), REQUESTS, streams=True):
        if "logprobs" in outputs:
            assert [lp for p in partials for lp in p["logprobs"]] == outputs["logprobs"]
            assert [t for p in partials for t in p["top_logprobs"]] == outputs["top_logprobs"]
        else:
            assert all("logprobs" not in p for p in partials)


@pytest.fixture(scope="module")
def one_process(tiny):
    return serve(build_model("llama", checkpoint=tiny[0], max_tokens=48), REQUESTS)


@pytest.mark.parametrize("parallel", [dict(tensor_parallel=2), dict(pipeline_parallel=2)])  # (both: test_tensor_pipeline)
def test_ranks_give_the_logprobs_of_one_process(tiny, one_process, parallel):
    """Greedy and sampled, top_logprobs included, beside a request that asks none, arriving at
    random (continuous batching): the same tokens, the same top ids, values within 1e-5 (fp32)."""
    many = serve(build_model("llama", checkpoint=tiny[0], max_tokens=48, **parallel), REQUESTS)
    for (a, _), (b, _) in zip(one_process, many):
        assert_same_logprobs(a, b)


def assert_same_logprobs(a: dict, b: dict) -> None:
    """Two replies' tokens and top ids equal, their log-probabilities within 1e-5 (fp32 reduced in another order)."""
    assert a["tokens"] == b["tokens"] and ("logprobs" in a) == ("logprobs" in b)
    if "logprobs" in a:
        torch.testing.assert_close(torch.tensor(b["logprobs"]), torch.tensor(a["logprobs"]), atol=1e-5, rtol=1e-5)
        assert [[i for i, _ in top] for top in b["top_logprobs"]] == [[i for i, _ in top] for top in a["top_logprobs"]]
        values = [torch.tensor([[v for _, v in top] for top in reply["top_logprobs"]]) for reply in (a, b)]
        torch.testing.assert_close(values[1], values[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("value", [21, -2, "3", 1.5, True])
def test_a_logprobs_the_engine_cannot_give_is_a_bad_request(value):
    engine = Engine([build_model("llama")]).start(thread=False)
    try:
        f = engine.submit("llama", {"tokens": [1, 2], "logprobs": value})
        while not f.done():
            engine.step()
        with pytest.raises(BadRequestError, match="logprobs"):
            f.result(0)
    finally:
        engine.stop()
