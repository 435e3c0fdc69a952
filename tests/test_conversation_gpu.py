"""Conversations on a GPU (exec/kv_swap.py: copies out on a side stream, copies in layer by
layer before each layer's attention) against HF transformers on the whole history, fp32 with TF32
off, under the near-tie rule of tests/test_generation_gpu.py; and a turn restored from the host
tier equal, token for token, to the same turn served from the GPU tier."""
import math
import random

import pytest
import torch

from helpers import needs_gpu

transformers = pytest.importorskip("transformers")

from batchmaker import Engine, EngineConfig  # noqa: E402
from batchmaker.registry import build_model  # noqa: E402
from test_conversation_generation import converse  # noqa: E402
from test_generation_gpu import CONFIG, NEAR_TIE, checkpoint, hf_reference, near_tie_or_equal  # noqa: E402,F401

pytestmark = [pytest.mark.gpu, needs_gpu]


def gpu_engine(path: str, **options):
    torch.backends.cuda.matmul.allow_tf32 = False
    model = build_model("llama", checkpoint=path, device="cuda:0", dtype="float32", **options)
    return Engine([model], EngineConfig(devices=("cuda:0",))).start(thread=False)


def finish(engine, f):
    while not f.done():
        engine.step()
    return f.result().outputs


def test_turns_follow_hf_through_every_tier_on_the_gpu(checkpoint):
    path, hf = checkpoint
    hf = hf.to("cuda:0").float()
    per_chunk = 2 * CONFIG.num_layers * 32 * CONFIG.num_kv_heads * CONFIG.head_dim * 4
    engine = gpu_engine(path, num_blocks=61, max_seqs=8, host_bytes=12 * per_chunk, max_tokens=96)
    rng = random.Random(5)
    scripts = [[([rng.randrange(CONFIG.vocab_size) for _ in range(rng.randrange(3, 90))], rng.randrange(1, 24))
                for _ in range(rng.randrange(3, 6))] for _ in range(12)]
    try:
        turns = converse(engine, "llama", scripts, rng)
        stats = engine.stats()["conversations"]["llama"]
        print(stats)
        assert stats["gpu_hit_tokens"] > 0 and stats["host_hit_tokens"] > 0 and stats["recomputed_tokens"] > 0
        identical = 0
        for conversation in turns:
            for full, outputs in conversation:
                ref, logits = hf_reference(hf, full, len(outputs["tokens"]))
                same, ok = near_tie_or_equal(outputs["tokens"], ref, logits, NEAR_TIE)
                assert ok, (full, outputs)
                identical += same
        print(f"{identical} of {sum(map(len, turns))} turns identical to HF")
        for cache in engine.structured["llama"].caches.values():
            cache.check()
    finally:
        engine.stop()


@pytest.mark.parametrize("context,busy,copy_seconds", [(40, False, None), (300, False, None), (300, True, 0.0),
                                                       (300, True, math.inf)])
def test_a_turn_from_the_host_tier_equals_the_gpu_hit(checkpoint, context, busy, copy_seconds):
    """Alone, a restored turn's chunks are copied in layer by layer as it runs; beside other
    work (`busy`), too where the copies hide under the iteration (`copy_seconds` per chunk, set
    here to force each decision), else all at once on the side stream before it is prefilled
    (HostTier.restore, deferred). An iteration that runs as a CUDA graph takes a layer-by-layer
    copy whole before it (HostTier.restore, not deferred)."""
    from bench.chat_stateful import _demote
    path, _ = checkpoint
    engine = gpu_engine(path, num_blocks=200, host_bytes=64 << 20)
    gen = engine.structured["llama"]
    runner = next(iter(engine.workers[0].iterations.values()))
    if copy_seconds is not None:
        for cache in gen.caches.values():
            cache.swap_in_seconds = copy_seconds
    rng = random.Random(context)
    first = [rng.randrange(CONFIG.vocab_size) for _ in range(context)]
    new = [rng.randrange(CONFIG.vocab_size) for _ in range(17)]
    filler = {"tokens": first[:20], "max_new_tokens": 30, "ignore_eos": True}
    restored = []  # per whole copy in: deferred (the turn waits) or not (the graphed iteration waits)
    restore = runner.host.restore
    runner.host.restore = lambda plan, stream: (restored.append(bool(plan.deferred)), restore(plan, stream))
    try:
        replies = {}
        for tier in ("gpu", "host", "recompute"):
            cid = finish(engine, engine.submit("llama", {"tokens": first, "max_new_tokens": 5, "conversation": True,
                                                        "ignore_eos": True}))["conversation"]
            _demote(gen, runner, cid, tier)
            other = engine.submit("llama", filler) if busy else None
            if busy:
                engine.step()  # (the filler runs when the turn comes)
            replies[tier] = finish(engine, engine.submit("llama", {"tokens": new, "max_new_tokens": 12,
                                                                  "conversation": cid, "ignore_eos": True}))
            if other is not None:
                finish(engine, other)
        assert any(restored) == (busy and copy_seconds == math.inf)
        if runner.graphs.enabled:  # (these iterations are small: graphed, so every copy in goes whole)
            assert restored == [busy and copy_seconds == math.inf]
        positions = context + 5 - 1
        assert replies["gpu"]["context"] == {"cached": positions, "swapped_in": 0, "recomputed": 0}
        assert replies["host"]["context"] == {"cached": 0, "swapped_in": positions, "recomputed": 0}
        assert replies["recompute"]["context"] == {"cached": 0, "swapped_in": 0, "recomputed": positions}
        assert replies["host"]["tokens"] == replies["gpu"]["tokens"]  # the same K/V, bit for bit
    finally:
        engine.stop()
