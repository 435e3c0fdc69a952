"""Automatic prefix caching (`prefix_caching=True`): a stateless request's context is kept like a
conversation's, and a later request whose prompt continues it exactly takes its cache
(core/prefix_index.py); a prompt that starts with whole blocks computed before, by any request,
reads them (core/block_index.py). Tokens are those without it (greedy, fp32, every token): a
prompt diverging inside a cached context reads its whole blocks before the divergence only;
requests sharing a system prompt, at once and in waves, read its blocks; the hits show on
/metrics."""
import random

import numpy as np
import pytest
from test_generation import checkpoint, engine_for, hf_greedy, run_until  # noqa: F401 (a fixture)

from batchmaker import Engine
from batchmaker.core.prefix_index import PrefixIndex
from batchmaker.registry import build_model


class Conv:
    def __init__(self, tokens):
        self.tokens = np.asarray(tokens, dtype=np.int64)


def test_the_index_finds_the_longest_exact_proper_prefix():
    index = PrefixIndex()
    short, long_, other = Conv(range(20)), Conv(range(40)), Conv(list(range(39)) + [7])
    for c in (short, long_, other):
        index.add(c)
    prompt = np.arange(50)
    assert index.find(prompt) is long_
    assert index.find(np.arange(40)) is short  # (a context must leave a token to compute)
    assert index.find(np.array(list(range(39)) + [7, 1])) is other
    assert index.find(np.array([1, 2, 3])) is None
    changed = prompt.copy()
    changed[3] = 99  # (diverges inside every filed context: none is a prefix)
    assert index.find(changed) is None
    index.remove(long_)
    assert index.find(prompt) is short and len(index) == 2


def answers(engine, requests: list) -> list:
    """Each request's outputs, all submitted at once, the engine stepped until they are done."""
    futures = [engine.submit("llama", inputs) for inputs in requests]
    while not all(f.done() for f in futures):
        engine.step()
    return [f.result(0).outputs for f in futures]


def chat(engine, rng: random.Random, turns: int, system: list) -> list:
    """A stateless client: every turn resends the whole history (its prompts and the replies)."""
    history, replies = list(system), []
    for _ in range(turns):
        history += [rng.randrange(3, 500) for _ in range(rng.randint(3, 40))]
        out, = answers(engine, [{"tokens": history, "max_new_tokens": rng.randint(2, 12), "ignore_eos": True}])
        replies.append((out["tokens"], out.get("context")))
        history += out["tokens"]
    return replies


@pytest.mark.parametrize("seed", [0, 1])
def test_tokens_equal_without_it_and_later_turns_hit_the_cache(seed):
    def run(prefix_caching: bool) -> list:
        engine = Engine([build_model("llama", seed=3, max_tokens=48, prefix_caching=prefix_caching)]).start(thread=False)
        try:
            rng = random.Random(seed)
            system = [rng.randrange(3, 500) for _ in range(37)]
            return [chat(engine, random.Random(seed + k), 4, system) for k in range(3)]
        finally:
            engine.stop()
    on, off = run(True), run(False)
    assert [[t for t, _ in talk] for talk in on] == [[t for t, _ in talk] for talk in off]
    assert all(context is None for talk in off for _, context in talk)
    later = [context for talk in on for _, context in talk[1:]]
    assert all(c["cached"] + c["swapped_in"] > 0 for c in later)  # (each later turn continued its own context)
    assert "conversation" not in str(on)  # (stateless replies name no conversation)


@pytest.fixture
def engines():
    """An engine with prefix caching and one without, on the same weights (driven by `answers`)."""
    pair = [Engine([build_model("llama", seed=3, max_tokens=48, prefix_caching=on)]).start(thread=False)
            for on in (True, False)]
    yield pair
    for engine in pair:
        engine.stop()


def test_a_prompt_diverging_inside_a_cached_context_is_computed_afresh(engines):
    engine, reference = engines
    rng = random.Random(5)
    base = [rng.randrange(3, 500) for _ in range(60)]
    prompts = [base[:40]]  # (cached with its reply)
    for cut in (0, 15, 16, 17, 39):
        prompts.append(base[:cut] + [(base[cut] + 1) % 500 + 3] + base[cut + 1:])
    prompts.append(base)  # (continues the first only if its reply matched: it does not here)
    got, want = [], []
    for prompt in prompts:
        for eng, out in ((engine, got), (reference, want)):
            out += answers(eng, [{"tokens": prompt, "max_new_tokens": 5, "ignore_eos": True}])
    assert [g["tokens"] for g in got] == [w["tokens"] for w in want]
    assert all(g["context"]["cached"] + g["context"]["swapped_in"] == 0 for g in got[1:])  # (no context continued)
    # the whole 16-token blocks before the divergence are read from the cache (the first's 2 filed)
    assert [g["context"].get("shared", 0) for g in got[1:]] == [0, 0, 16, 16, 32, 32]


def test_requests_at_once_with_one_prefix_are_each_served_right(engines):
    engine, reference = engines
    rng = random.Random(9)
    shared = [rng.randrange(3, 500) for _ in range(33)]
    grown = shared + answers(engine, [{"tokens": shared, "max_new_tokens": 4, "ignore_eos": True}])[0]["tokens"]
    batch = [{"tokens": grown + [rng.randrange(3, 500) for _ in range(rng.randint(1, 9))], "max_new_tokens": 6,
              "ignore_eos": True} for _ in range(4)]
    results = [answers(eng, batch) for eng in (engine, reference)]
    assert [r["tokens"] for r in results[0]] == [r["tokens"] for r in results[1]]
    hits = [r["context"]["cached"] + r["context"]["swapped_in"] > 0 for r in results[0]]
    assert hits.count(True) == 1  # (one takes the cached context, its 36 positions ...)
    assert sorted(r["context"].get("shared", 0) for r in results[0]) == [0, 32, 32, 32]  # (... the others its 2 blocks)


def system_prompt_requests(rng: random.Random, system: list, n: int) -> list:
    return [{"tokens": system + [rng.randrange(3, 500) for _ in range(rng.randint(1, 20))],
             "max_new_tokens": rng.randint(1, 8), "ignore_eos": True} for _ in range(n)]


def hit_tokens(engine) -> int:
    return engine.stats()["conversations"]["llama"]["prefix_hit_tokens"]


def test_requests_sharing_a_system_prompt_read_its_blocks_at_once_and_in_waves(engines):
    engine, reference = engines
    rng = random.Random(11)
    system = [rng.randrange(3, 500) for _ in range(70)]  # (4 whole blocks and a bit)
    at_once = system_prompt_requests(rng, system, 12)
    waves = [system_prompt_requests(rng, system, rng.randint(2, 6)) for _ in range(4)]
    for batch in [at_once, *waves]:
        assert [r["tokens"] for r in answers(engine, batch)] == [r["tokens"] for r in answers(reference, batch)]
    hits = hit_tokens(engine)
    assert hits >= 64 * (len(at_once) - 2 + sum(len(w) for w in waves))  # (all but the first joiners of the first)
    assert hit_tokens(reference) == 0


def test_the_prefix_hits_show_on_metrics(engines):
    pytest.importorskip("prometheus_client")
    from batchmaker.serving.metrics import EngineCollector
    engine, _ = engines
    rng = random.Random(12)
    system = [rng.randrange(3, 500) for _ in range(40)]
    for batch in [system_prompt_requests(rng, system, 3) for _ in range(2)]:
        answers(engine, batch)
    samples = {s.name: s.value for family in EngineCollector(engine).collect() for s in family.samples
               if s.labels.get("model") == "llama"}
    assert samples["batchmaker_prefix_cache_hit_tokens_total"] == hit_tokens(engine) >= 32 * 3
    # at idle every used block is an idle context's, each counted once however many hold it
    assert samples["batchmaker_kv_blocks_cached"] == samples["batchmaker_kv_blocks_used"] > 0


def test_tight_caches_evict_and_suspend_around_shared_blocks_and_tokens_stay_the_same():
    """24 blocks of 16 positions and a small host tier for stateless chats that share a system
    prompt: shared blocks are held by running sequences while idle contexts' chunks are copied out,
    dropped and sequences suspended; the tokens are those of an engine without prefix caching,
    and at idle every block's references are its holders."""
    def run(prefix_caching: bool) -> list:
        model = build_model("llama", seed=3, max_tokens=48, max_seqs=4, num_blocks=25, prefix_caching=prefix_caching,
                            host_bytes=6 * 2 * 2 * 32 * 2 * 16 * 4)
        engine = Engine([model]).start(thread=False)
        try:
            rng = random.Random(21)
            system = [rng.randrange(3, 500) for _ in range(40)]
            replies, earlier = [], []
            for _ in range(4):
                batch = system_prompt_requests(rng, system, 6)
                outputs = answers(engine, batch)
                follow = [{"tokens": r["tokens"] + o["tokens"] + [5, 6, 7], "max_new_tokens": 50, "ignore_eos": True}
                          for r, o in earlier]  # (continue the contexts of the wave before, long enough to suspend)
                replies += [r["tokens"] for r in outputs + answers(engine, follow)]
                earlier = list(zip(batch[:4], outputs))
            if prefix_caching:
                stats = engine.stats()["conversations"]["llama"]
                assert stats["prefix_hit_tokens"] > 0 and stats["chunks_dropped"] > 0 and stats["host_hit_tokens"] > 0
                assert engine.structured["llama"].queue.num_suspended > 0
                for cache in engine.structured["llama"].caches.values():
                    cache.check()
            return replies
        finally:
            engine.stop()
    assert run(True) == run(False)


def test_requests_reading_shared_blocks_equal_hf_alone(checkpoint):  # noqa: F811 (the fixture)
    """Llama and OPT from HF checkpoints: waves of requests sharing a system prompt, and prompts
    diverging inside it, each equal to HF transformers run on that request alone."""
    family, path, hf = checkpoint
    engine, _ = engine_for(path, family, max_tokens=32, num_blocks=64, prefix_caching=True)
    rng = random.Random(17)
    system = [rng.randrange(1, 500) for _ in range(37)]
    try:
        for wave in range(3):
            cut = rng.randrange(len(system)) if wave else len(system)  # (later waves diverge inside it too)
            prompts = [system + [rng.randrange(1, 500) for _ in range(rng.randint(1, 9))] for _ in range(3)]
            prompts += [system[:cut] + [rng.randrange(1, 500)] + system[cut + 1:]]
            requests = [{"tokens": p, "max_new_tokens": 5, "ignore_eos": True} for p in prompts]
            outputs = [engine.submit(family, r) for r in requests]
            run_until(engine, lambda futures=outputs: all(f.done() for f in futures))
            for prompt, f in zip(prompts, outputs):
                assert f.result(0).outputs["tokens"] == hf_greedy(hf, prompt, 5)
        assert engine.stats()["conversations"][family]["prefix_hit_tokens"] >= 32 * 6
    finally:
        engine.stop()
