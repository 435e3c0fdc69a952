"""Conversations through the engine (batchmaker/generation.py, core/conversations.py,
exec/kv_swap.py) with a tiny Llama and OPT on the CPU, fp32: every turn's greedy tokens equal
HF transformers run on the whole history at once, while the cache is small enough that turns are
served from GPU blocks, swapped back from the host tier, and partly or entirely recomputed."""
import random
import time
import types

import numpy as np
import pytest

from batchmaker.errors import BadRequestError, UnknownConversationError
from test_generation import checkpoint, engine_for, hf_greedy, run_until, step  # noqa: F401 (a fixture)


def converse(engine, family: str, scripts: list[list[tuple[list[int], int]]], rng: random.Random) -> list:
    """Runs the conversations' turns (each sent once the previous reply is back, conversations
    interleaved); returns per conversation [(full prompt, reply outputs)]."""
    ids = [None] * len(scripts)
    history = [[] for _ in scripts]
    done = [[] for _ in scripts]
    running = {}
    while any(len(d) < len(s) for d, s in zip(done, scripts)):
        for i, script in enumerate(scripts):
            t = len(done[i])
            if i in running or t == len(script) or rng.random() < 0.5:
                continue
            prompt, max_new = script[t]
            inputs = {"tokens": prompt, "max_new_tokens": max_new, "conversation": ids[i] or True}
            running[i] = (engine.submit(family, inputs), history[i] + prompt)
        step(engine)
        for i, (f, full) in list(running.items()):
            if f.done():
                outputs = f.result().outputs
                ids[i] = outputs["conversation"]
                history[i] = full + outputs["tokens"]
                done[i].append((full, outputs))
                del running[i]
    return done


def test_turns_equal_hf_on_the_whole_history_through_every_tier(checkpoint):
    family, path, hf = checkpoint
    # 24 blocks of 16 positions for the GPU tier, 10 chunks of 32 for the host: far less than the
    # conversations' contexts, so their caches are copied out, dropped and recomputed
    engine, model = engine_for(path, family, num_blocks=25, max_seqs=4, host_bytes=10 * 2 * 2 * 32 * 2 * 16 * 4,
                               max_tokens=48)
    rng = random.Random(11)
    vocab = 512
    scripts = [[([rng.randrange(vocab) for _ in range(rng.randrange(3, 40))], rng.randrange(1, 12))
                for _ in range(rng.randrange(3, 6))] for _ in range(10)]
    try:
        turns = converse(engine, family, scripts, rng)
        for conversation in turns:
            for full, outputs in conversation:
                assert outputs["tokens"] == hf_greedy(hf, full, len(outputs["tokens"]))
                assert outputs["finish_reason"] == "length"
        stats = engine.stats()["conversations"][family]
        assert stats["gpu_hit_tokens"] > 0 and stats["host_hit_tokens"] > 0 and stats["recomputed_tokens"] > 0
        context = stats["gpu_hit_tokens"] + stats["host_hit_tokens"] + stats["recomputed_tokens"]
        assert stats["host_hit_rate"] == pytest.approx(stats["host_hit_tokens"] / context)
        assert stats["gpu_hit_rate"] + stats["host_hit_rate"] + stats["recomputed_rate"] == pytest.approx(1.0)
        c = model.cells["decoder"].lm.config  # K and V x layers x 32 positions x kv heads x head dim x fp32
        per_chunk = 2 * c.num_layers * 32 * c.num_kv_heads * c.head_dim * 4
        assert stats["chunks_in"] > 0 and stats["bytes_in"] == stats["chunks_in"] * per_chunk
        assert stats["bytes_out"] == stats["chunks_out"] * per_chunk
        context = [o["context"] for c in turns for _, o in c[1:]]
        assert sum(c["cached"] + c["swapped_in"] + c["recomputed"] for c in context) == \
            stats["gpu_hit_tokens"] + stats["host_hit_tokens"] + stats["recomputed_tokens"]
        for cache in engine.structured[family].caches.values():
            cache.check()
    finally:
        engine.stop()


def start(engine, family: str, tokens: list[int], max_new: int) -> dict:
    """A conversation's first turn, run to its reply."""
    f = engine.submit(family, {"tokens": tokens, "max_new_tokens": max_new, "conversation": True})
    run_until(engine, f.done)
    return f.result().outputs


def test_conversation_errors_and_ending(checkpoint):
    family, path, hf = checkpoint
    engine, model = engine_for(path, family, num_blocks=40)
    try:
        cid = start(engine, family, [1, 2, 3], 2)["conversation"]
        # a second turn while one runs, an unknown id, a bad value: typed errors, nothing else lost
        a = engine.submit(family, {"tokens": [4], "max_new_tokens": 30, "conversation": cid, "ignore_eos": True})
        b = engine.submit(family, {"tokens": [5], "max_new_tokens": 2, "conversation": cid})
        c = engine.submit(family, {"tokens": [5], "conversation": "nope"})
        d = engine.submit(family, {"tokens": [5], "conversation": 7})
        e = engine.submit(family, {"end": True, "conversation": "nope"})
        run_until(engine, lambda: all(x.done() for x in (a, b, c, d, e)))
        assert len(a.result().outputs["tokens"]) == 30
        with pytest.raises(BadRequestError, match="running"):
            b.result()
        with pytest.raises(UnknownConversationError, match="nope"):
            c.result()
        with pytest.raises(BadRequestError, match="conversation"):
            d.result()
        with pytest.raises(UnknownConversationError):
            e.result()
        # a full conversation: the prompt does not fit after what was said
        g = engine.submit(family, {"tokens": [1] * 230, "conversation": cid})
        run_until(engine, g.done)
        with pytest.raises(BadRequestError, match="after the conversation's"):
            g.result()
        end = engine.submit(family, {"end": True, "conversation": cid})
        run_until(engine, end.done)
        assert end.result().outputs == {"conversation": cid, "ended": True, "turns": 2}
        h = engine.submit(family, {"tokens": [1], "conversation": cid})
        run_until(engine, h.done)
        with pytest.raises(UnknownConversationError):
            h.result()
        run_until(engine, lambda: engine.stats()["kv_blocks_used"][family] == [0])
        for cache in engine.structured[family].caches.values():
            cache.check()
            assert cache.num_held == 0
    finally:
        engine.stop()


def test_a_cancelled_turn_leaves_the_conversation_as_before(checkpoint):
    family, path, hf = checkpoint
    engine, model = engine_for(path, family, num_blocks=40)
    try:
        outputs = start(engine, family, [7, 8, 9], 3)
        cid, first = outputs["conversation"], outputs["tokens"]
        g = engine.submit(family, {"tokens": [3], "max_new_tokens": 100, "ignore_eos": True, "conversation": cid})
        run_until(engine, lambda: engine.stats()["kv_blocks_used"][family][0] > 1)
        engine.cancel(g.request_id)
        run_until(engine, g.done)
        h = engine.submit(family, {"tokens": [5, 6], "max_new_tokens": 4, "conversation": cid})
        run_until(engine, h.done)
        assert h.result().outputs["tokens"] == hf_greedy(hf, [7, 8, 9] + first + [5, 6], 4)
        # (the cancelled turn took the cache: the history is recomputed, all but the last token)
        assert h.result().outputs["context"] == {"cached": 0, "swapped_in": 0, "recomputed": 3 + 3 - 1}
    finally:
        engine.stop()


def test_a_turn_of_zero_new_tokens_adds_its_prompt(checkpoint):
    """max_new_tokens 0 replies at once with no tokens and keeps the prompt in the history (e.g. a
    system prompt before the first question), first turn or later; the next turn computes it."""
    family, path, hf = checkpoint
    engine, model = engine_for(path, family, num_blocks=40)
    try:
        opening = start(engine, family, [11, 12, 13], 0)
        cid = opening["conversation"]
        assert opening["tokens"] == [] and opening["context"] == {"cached": 0, "swapped_in": 0, "recomputed": 0}

        def turn(tokens, max_new):
            f = engine.submit(family, {"tokens": tokens, "max_new_tokens": max_new, "conversation": cid})
            run_until(engine, f.done)
            return f.result().outputs
        first = turn([4, 5], 3)
        assert first["tokens"] == hf_greedy(hf, [11, 12, 13, 4, 5], 3)
        assert first["context"] == {"cached": 0, "swapped_in": 0, "recomputed": 0}  # never computed: not lost
        assert turn([6], 0)["tokens"] == []
        second = turn([7, 8], 4)
        assert second["tokens"] == hf_greedy(hf, [11, 12, 13, 4, 5] + first["tokens"] + [6, 7, 8], 4)
        assert second["context"]["cached"] == 5 + 3 - 1 and second["context"]["recomputed"] == 0
        end = engine.submit(family, {"end": True, "conversation": cid})
        run_until(engine, end.done)
        assert end.result().outputs["turns"] == 4
    finally:
        engine.stop()


def test_an_idle_conversation_expires(checkpoint):
    """Past conversation_ttl idle, a conversation is forgotten (its cache freed) when the next
    request comes: its next turn is unknown_conversation; a turn within the ttl is served."""
    family, path, hf = checkpoint
    engine, model = engine_for(path, family, num_blocks=40, conversation_ttl=2.0)
    try:
        kept = start(engine, family, [1, 2, 3], 2)["conversation"]
        gone = start(engine, family, [4, 5], 2)["conversation"]
        assert engine.stats()["conversations"][family]["conversations"] == 2
        time.sleep(1.2)
        f = engine.submit(family, {"tokens": [6], "max_new_tokens": 1, "conversation": kept})
        run_until(engine, f.done)
        assert f.result().outputs["conversation"] == kept  # (touched again)
        time.sleep(1.2)  # gone: idle > 2.4 s; kept: 1.2 s and its turn
        f = engine.submit(family, {"tokens": [7], "max_new_tokens": 1, "conversation": gone})
        run_until(engine, f.done)
        with pytest.raises(UnknownConversationError, match=gone):
            f.result()
        stats = engine.stats()["conversations"][family]
        assert stats["conversations"] == 1 and stats["gpu_blocks_cached"] == 1  # kept's 6 positions
        for cache in engine.structured[family].caches.values():
            cache.check()
    finally:
        engine.stop()


def test_chunk_costs_are_timed_prefills_per_chunk_interpolated(checkpoint, monkeypatch):
    """Cost(l) (Pensieve Eq. 3.6): one iteration of 32-token chunks ending at each power of two of
    the context, timed per chunk, interpolated between those points and flat past the last. A fake
    clock charges each forward 1 ms + 10 us per context position for each of its chunks, so the
    costs must lie on that line, whatever the number of chunks timed at once."""
    from batchmaker.exec import chunk_costs
    family, path, _ = checkpoint
    engine, _ = engine_for(path, family, num_blocks=25, max_seqs=4, max_tokens=48)
    runner = next(iter(engine.workers[0].iterations.values()))
    now, calls = [0.0], []
    forward = runner._forward

    def charged(t, *args, **kwargs):
        rows, end = len(t["context_lens"]), int(t["context_lens"][0])
        now[0] += rows * (1e-3 + 1e-5 * end)
        calls.append(end)
        return forward(t, *args, **kwargs)

    monkeypatch.setattr(runner, "_forward", charged)
    monkeypatch.setattr(chunk_costs, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    try:
        costs = runner.chunk_costs()
        ct, bs = runner.chunk_tokens, runner.module.block_size
        ends = (np.arange(len(costs)) + 1) * ct
        assert ends[-1] >= runner.config.max_positions > ends[-1] - ct  # one cost per chunk of a context
        top = ct * 2 ** int(np.log2(min(ends[-1], (runner.cache.num_blocks - 1) * bs) // ct))  # the last point
        assert top > ct
        np.testing.assert_allclose(costs, 1e-3 + 1e-5 * np.minimum(ends, top), rtol=1e-9)
        points = [ct << k for k in range(int(np.log2(top // ct)) + 1)]
        assert calls == [ct] + points  # a warm-up, then one iteration per power of two
    finally:
        engine.stop()
