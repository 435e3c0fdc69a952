"""Decoder-Transformer serving (batchmaker/generation.py, core/sequences.py, exec/iterations.py):
greedy tokens identical to HF transformers run one request at a time, with random prompt lengths
and arrival times; running out of KV blocks (suspend, recompute, same tokens); cancel mid-stream;
edge cases; seeded sampling independent of batching; an LSTM and a Llama in one engine."""
import random
import time

import numpy as np
import pytest
import torch

from batchmaker import Engine
from batchmaker.errors import BadRequestError, CancelledError
from batchmaker.registry import build_model

transformers = pytest.importorskip("transformers")

from batchmaker.cells.decoder_config import PRESETS, to_hf  # noqa: E402
from reference import lstm_reference  # noqa: E402

HF = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "opt": ("OPTConfig", "OPTForCausalLM")}


@pytest.fixture(scope="module", params=["llama", "opt"])
def checkpoint(request, tmp_path_factory):
    """A HF model with seeded random weights, saved as users have them; (family, dir, hf model)."""
    family = request.param
    config_class, model_class = (getattr(transformers, n) for n in HF[family])
    torch.manual_seed(7)
    hf = model_class(config_class(**to_hf(PRESETS[f"tiny-{family}"])))
    hf.eval()
    path = tmp_path_factory.mktemp(family)
    hf.save_pretrained(path)
    return family, str(path), hf


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """The reference: one request alone, the whole sequence re-run through HF for every token."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


def drive(engine, arrivals: list[tuple[str, dict]], rng: random.Random, timeout: float = 120.0):
    """Submit each request at a random manager turn that did something, stepping the engine
    between (arrival times vary); returns the futures in order."""
    futures, pending = [], list(arrivals)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        while pending and rng.random() < 0.4:
            model, inputs = pending.pop(0)
            futures.append(engine.submit(model, inputs))
        if not pending and all(f.done() for f in futures):
            return futures
        step(engine)
    raise AssertionError("requests did not finish")


def step(engine) -> None:
    """One manager turn that did something, or 50 ms of idle ones (CPU workers run tasks on
    their own threads)."""
    deadline = time.monotonic() + 0.05
    while not engine.step() and time.monotonic() < deadline:
        time.sleep(0.0002)


def run_until(engine, predicate, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        step(engine)


def engine_for(path: str, family: str, **options):
    model = build_model(family, checkpoint=path, **options)
    return Engine([model]).start(thread=False), model


def assert_sent_at_once_equal_hf(hf, path, attention=None, family: str = "llama", **options) -> None:
    """Six prompts of mixed lengths submitted together to an engine serving the checkpoint at
    `path` as `family` with `options` (tensor_parallel=2, ...; its runners' attention replaced by
    `attention` where given): every greedy token equals transformers' for each prompt alone."""
    rng = random.Random(5)
    requests = [{"tokens": [rng.randrange(4, 512) for _ in range(length)], "max_new_tokens": 6, "ignore_eos": True}
                for length in (3, 70, 17, 40, 1, 33)]
    engine = Engine([build_model(family, checkpoint=str(path), max_tokens=48, **options)]).start(thread=False)
    try:
        if attention is not None:
            for runner in engine.workers[0].iterations.values():
                runner.attention = attention
        futures = [engine.submit(family, inputs) for inputs in requests]
        run_until(engine, lambda: all(f.done() for f in futures))
        for future, inputs in zip(futures, requests):
            assert future.result(0).outputs["tokens"] == hf_greedy(hf, inputs["tokens"], 6)
    finally:
        engine.stop()


def test_greedy_equals_hf_with_random_arrivals(checkpoint):
    family, path, hf = checkpoint
    engine, _ = engine_for(path, family, max_tokens=24, num_blocks=64)
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 500) for _ in range(rng.randint(1, 40))] for _ in range(10)]
    lengths = [rng.randint(1, 12) for _ in prompts]
    try:
        futures = drive(engine, [(family, {"tokens": p, "max_new_tokens": n, "ignore_eos": True})
                                 for p, n in zip(prompts, lengths)], rng)
        for f, p, n in zip(futures, prompts, lengths):
            out = f.result(0).outputs
            assert out["tokens"] == hf_greedy(hf, p, n)
            assert out["finish_reason"] == "length"
        queue = engine.structured[family].queue
        assert all(q.blocks.num_used == 0 and q.num_active == 0 for q in queue.sequences.values())
    finally:
        engine.stop()


def test_out_of_blocks_suspends_and_recomputes(checkpoint):
    """Few blocks for many requests: the newest are suspended and recomputed, tokens unchanged."""
    family, path, hf = checkpoint
    engine, _ = engine_for(path, family, max_tokens=64, num_blocks=12, block_size=8)
    rng = random.Random(5)
    prompts = [[rng.randrange(1, 500) for _ in range(rng.randint(4, 20))] for _ in range(8)]
    try:
        futures = [engine.submit(family, {"tokens": p, "max_new_tokens": 20, "ignore_eos": True}) for p in prompts]
        run_until(engine, lambda: all(f.done() for f in futures))
        queue = engine.structured[family].queue
        assert queue.num_suspended > 0
        for f, p in zip(futures, prompts):
            assert f.result(0).outputs["tokens"] == hf_greedy(hf, p, 20)
        assert all(q.blocks.num_used == 0 for q in queue.sequences.values())
    finally:
        engine.stop()


def test_timing_splits_waiting_for_a_slot_from_computation(checkpoint):
    """A request's first cell is when it joins a slot (protocol: queueing = arrival to first cell,
    computation = first cell to finish): with one slot the second request waits until the first
    has finished, and its computation starts there."""
    family, path, _ = checkpoint
    engine, _ = engine_for(path, family, max_tokens=64, num_blocks=64, max_seqs=1)
    try:
        first = engine.submit(family, {"tokens": [5, 6, 7], "max_new_tokens": 6, "ignore_eos": True})
        second = engine.submit(family, {"tokens": [8, 9], "max_new_tokens": 3, "ignore_eos": True})
        run_until(engine, lambda: first.done() and second.done())
        a, b = first.result(0).timing, second.result(0).timing
        assert a.arrival <= a.first_cell < a.finish <= b.first_cell < b.finish
        assert b.queueing >= a.computation > 0
    finally:
        engine.stop()


def test_chunked_prefill_keeps_decodes_running(checkpoint):
    """A prompt longer than the token budget is prefilled in chunks, while a running request
    decodes a token in every iteration."""
    family, path, hf = checkpoint
    engine, _ = engine_for(path, family, max_tokens=8, num_blocks=64)
    try:
        short = engine.submit(family, {"tokens": [5, 6], "max_new_tokens": 12, "ignore_eos": True})
        for _ in range(3):
            step(engine)
        long_prompt = list(range(20, 60))
        long = engine.submit(family, {"tokens": long_prompt, "max_new_tokens": 3, "ignore_eos": True})
        queue = engine.structured[family].queue
        tokens_before = queue.sequences[0].planned.copy()
        run_until(engine, lambda: short.done() and long.done())
        assert short.result(0).outputs["tokens"] == hf_greedy(hf, [5, 6], 12)
        assert long.result(0).outputs["tokens"] == hf_greedy(hf, long_prompt, 3)
        assert tokens_before.sum() > 0
        sizes = engine.stats()["batch_sizes"]
        assert max(int(k.rsplit(":", 1)[1]) for k in sizes) <= 8  # never above the budget
    finally:
        engine.stop()


def test_edge_cases(checkpoint):
    family, path, hf = checkpoint
    engine, model = engine_for(path, family, num_blocks=64)
    max_len = model.cells["decoder"].lm.config.max_positions
    try:
        zero = engine.submit(family, {"tokens": [3, 4], "max_new_tokens": 0})
        one = engine.submit(family, {"tokens": [3, 4], "max_new_tokens": 1, "ignore_eos": True})
        bad = {
            "empty": engine.submit(family, {"tokens": []}),
            "too long": engine.submit(family, {"tokens": [1] * max_len}),
            "out of vocab": engine.submit(family, {"tokens": [10**6]}),
            "bools": engine.submit(family, {"tokens": [True, 5]}),
            "negative max_new": engine.submit(family, {"tokens": [1], "max_new_tokens": -1}),
            "top_p 0": engine.submit(family, {"tokens": [1], "top_p": 0.0}),
            "text without tokenizer": engine.submit(family, {"prompt": "hello"}),
            "unknown option": engine.submit(family, {"tokens": [1], "beam_width": 4}),
        }
        run_until(engine, lambda: zero.done() and one.done() and all(f.done() for f in bad.values()))
        assert zero.result(0).outputs == {"tokens": [], "finish_reason": "length"}
        assert one.result(0).outputs["tokens"] == hf_greedy(hf, [3, 4], 1)
        for what, f in bad.items():
            with pytest.raises(BadRequestError):
                f.result(0)
        # at the model's length the request stops with "length"
        near = engine.submit(family, {"tokens": [2] * (max_len - 2), "max_new_tokens": 50, "ignore_eos": True})
        run_until(engine, near.done)
        assert len(near.result(0).outputs["tokens"]) == 2
    finally:
        engine.stop()


def test_cancel_mid_stream_frees_blocks(checkpoint):
    family, path, _ = checkpoint
    engine, _ = engine_for(path, family, num_blocks=64)
    partials = []
    try:
        f = engine.submit(family, {"tokens": [1, 2, 3], "max_new_tokens": 100, "ignore_eos": True},
                          on_partial=partials.append)
        other = engine.submit(family, {"tokens": [4, 5], "max_new_tokens": 30, "ignore_eos": True})
        run_until(engine, lambda: len(partials) >= 3)
        assert all(len(p["tokens"]) == 1 for p in partials)
        engine.cancel(f.request_id)
        run_until(engine, other.done)
        with pytest.raises(CancelledError):
            f.result(0)
        for _ in range(5):
            engine.step()
            time.sleep(0.01)
        queue = engine.structured[family].queue
        assert all(q.blocks.num_used == 0 and q.num_active == 0 for q in queue.sequences.values())
        assert len(other.result(0).outputs["tokens"]) == 30
    finally:
        engine.stop()


def test_streamed_tokens_are_the_result(checkpoint):
    family, path, _ = checkpoint
    engine, _ = engine_for(path, family, num_blocks=64)
    partials = []
    try:
        f = engine.submit(family, {"tokens": [9, 8, 7], "max_new_tokens": 9, "ignore_eos": True},
                          on_partial=partials.append)
        run_until(engine, f.done)
        assert [t for p in partials for t in p["tokens"]] == f.result(0).outputs["tokens"]
    finally:
        engine.stop()


def test_seeded_sampling_does_not_depend_on_batching():
    model = build_model("llama", num_blocks=128, max_tokens=64)
    request = {"tokens": [11, 12, 13], "max_new_tokens": 16, "temperature": 0.9, "top_k": 50, "top_p": 0.9,
               "seed": 1234, "ignore_eos": True}
    with Engine([model]) as engine:
        alone = engine.infer("llama", request, timeout=60)["tokens"]
        crowd = [engine.submit("llama", {**request, "seed": s}) for s in range(12)]
        again = engine.submit("llama", request)
        others = [f.result(60).outputs["tokens"] for f in crowd]
        assert again.result(60).outputs["tokens"] == alone
        assert len({tuple(o) for o in others}) > 1  # different seeds sample differently
        greedy = engine.infer("llama", {"tokens": [11, 12, 13], "max_new_tokens": 16, "ignore_eos": True})["tokens"]
        top1 = engine.infer("llama", {**request, "top_k": 1})["tokens"]
        assert top1 == greedy


def test_lstm_and_llama_in_one_engine_under_mixed_load():
    lstm = build_model("lstm", vocab=50, embed=8, hidden=8)
    llama = build_model("llama", num_blocks=128, max_tokens=32)
    lm = llama.cells["decoder"].lm
    rng = np.random.default_rng(0)
    with Engine([lstm, llama], ) as engine:
        jobs = []
        for i in range(24):
            if i % 2:
                tokens = rng.integers(0, 50, rng.integers(1, 10)).tolist()
                jobs.append(("lstm", tokens, engine.submit("lstm", {"tokens": tokens})))
            else:
                prompt = rng.integers(1, 500, rng.integers(1, 20)).tolist()
                jobs.append(("llama", prompt, engine.submit("llama", {"tokens": prompt, "max_new_tokens": 6,
                                                                      "ignore_eos": True})))
        for kind, prompt, f in jobs:
            out = f.result(60).outputs
            if kind == "llama":
                seq = list(prompt)
                with torch.no_grad():
                    for _ in range(6):
                        seq.append(int(lm.dense_logits(torch.tensor(seq))[-1].argmax()))
                assert out["tokens"] == seq[len(prompt):]
            else:  # the LSTM's final state, as plain PyTorch computes it for this request alone
                torch.testing.assert_close(torch.as_tensor(out["h"]), lstm_reference(lstm, {"tokens": prompt})["h"],
                                           rtol=1e-5, atol=1e-5)
