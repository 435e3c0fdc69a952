"""Admission in bulk (batchmaker/core/admission.py, core/tree_input.py, batchmaker/structured.py)
gives the same results and the same typed failures as the one-request checks; the engine's
request accounting stays exact; the light future keeps concurrent.futures' reading contract."""
import concurrent.futures
import itertools
import random
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchmaker import BadRequestError, CancelledError, Engine, EngineConfig, EngineStoppedError, build_model
from batchmaker.core.admission import check_token_lists, check_tokens, in_range
from batchmaker.core.tree_input import MAX_DEPTH, _tree_to_arrays, parse_tree, parse_trees
from batchmaker.errors import DeadlineExceededError, OverloadedError
from batchmaker.core.request import ResultRows
from batchmaker.future import RequestFuture, resolve_rows
from helpers import wait_idle
from reference import lstm_reference
from chain_toys import chain_model

VOCAB = 100
SMALL = dict(vocab=VOCAB, embed=8, hidden=8)


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint8, np.uint64])
def test_in_range_equals_min_and_max(dtype):
    rng = np.random.default_rng(0)
    info = np.iinfo(dtype)
    for _ in range(300):
        n = int(rng.integers(1, 40))
        low, high = max(int(info.min), -5), min(int(info.max), 300)
        array = rng.integers(low, high, size=n, endpoint=True).astype(dtype)
        for bound in (1, 7, 100, 256, 2**63, 2**70):
            assert in_range(array, bound) == (int(array.min()) >= 0 and int(array.max()) < bound), (array, bound)
        assert in_range(array, None) == (int(array.min()) >= 0)
    for a in np.array([np.iinfo(np.int64).min, -1, 0, np.iinfo(np.int64).max], dtype=np.int64):
        assert in_range(np.array([a]), 2**63) == (a >= 0)
        assert in_range(np.array([a]), 10) == (0 <= a < 10)


GOOD_TOKENS = [[5], [0, VOCAB - 1, 3], (4, 5), np.array([1, 2, 3]), np.array([7], dtype=np.int32),
               torch.tensor([9, 8, 7]), [np.int64(3), 4], [0, 1, 1, 0]]
BAD_TOKENS = [[], [VOCAB], [-1], [1, 2, VOCAB + 5], [1.5], [True, False], [True, 5], [5, 1, False], ["a"], [[1, 2]],
              "abc", 5, None, {"a": 1}, [2**70], torch.tensor([1.0, 2.0]), np.array([2**63], dtype=np.uint64),
              np.array([], dtype=int), [1, None]]
token_values = st.one_of(st.integers(-3, VOCAB + 3), st.booleans(), st.floats(allow_nan=False), st.text(max_size=2),
                         st.none(), st.integers(2**62, 2**70))
token_lists = st.one_of(st.lists(st.integers(0, VOCAB - 1), max_size=6), st.lists(token_values, max_size=6),
                        st.sampled_from(GOOD_TOKENS + BAD_TOKENS))


@settings(max_examples=200, deadline=None)
@given(st.lists(token_lists, min_size=1, max_size=12))
def test_checking_many_token_lists_equals_checking_each(values):
    flat, lengths, errors = check_token_lists(values, VOCAB, "tokens")
    good = []
    for i, v in enumerate(values):
        try:
            good.append(check_tokens(v, VOCAB))
            assert i not in errors
        except BadRequestError as e:
            assert str(errors[i]) == str(e)  # the same message as the one-request check
    assert lengths.tolist() == [len(g) for g in good]
    assert flat.dtype == np.int64 and flat.tolist() == [t for g in good for t in g.tolist()]


def trees():
    return st.recursive(st.integers(0, VOCAB - 1) | st.sampled_from(["a", "b", "good", "'s", "é", "8\xa01"]),
                        lambda sub: st.tuples(sub, sub), max_leaves=24)


def to_brackets(tree) -> str:
    if isinstance(tree, tuple):
        return f"(0 {to_brackets(tree[0])} {to_brackets(tree[1])})"
    return f"(0 {tree})"


def mutate(rng: random.Random, text: str) -> str:
    s = list(text)
    for _ in range(rng.randint(0, 3)):
        i = rng.randrange(len(s) + 1)
        if rng.random() < 0.4 and s:
            del s[min(i, len(s) - 1)]
        else:
            s.insert(i, rng.choice(["(", ")", " ", "a", "\t", "(2 x)", ")(", "(1 ", "(2 x y)",
                                    "(2 (2 a) (2 b) (2 c))"]))
    return "".join(s)


def assert_parsed_as_each(values: list, max_depth: int = MAX_DEPTH) -> None:
    """parse_trees gives each tree as parse_tree does, and each bad one parse_tree's error."""
    arrays, good, errors = parse_trees(values, VOCAB, max_depth)
    k = 0
    for i, value in enumerate(values):
        try:
            want = _tree_to_arrays(parse_tree(value, VOCAB, max_depth))
        except BadRequestError as e:
            assert str(errors[i]) == str(e)
            continue
        assert good[k] == i
        n, tokens, children = arrays.tree(k)
        assert n == want[0] and tokens.tolist() == want[1].tolist() and children.tolist() == want[2].tolist()
        k += 1
    assert k == len(good) and len(good) + len(errors) == len(values)
    assert arrays.tokens.dtype == arrays.children.dtype == np.int64


@settings(max_examples=150, deadline=None)
@given(st.lists(trees(), min_size=1, max_size=8), st.integers(0, 2**16))
def test_parsing_many_trees_equals_parsing_each(batch, seed):
    rng = random.Random(seed)
    values = []
    for tree in batch:
        words_only = all(isinstance(x, str) for x in _leaves(tree))
        values.append(mutate(rng, to_brackets(tree)) if words_only and rng.random() < 0.7 else tree)
    assert_parsed_as_each(values)


# words and labels hold anything but brackets and the ASCII spaces (U+00A0, U+2003, U+0085 and
# control characters are parts of words); words over 64 bytes are hashed apart from the others
odd_words = (st.text(st.characters(exclude_characters="() \t\n\x0b\x0c\r\x1c\x1d\x1e\x1f", exclude_categories=["Cs"]),
                     min_size=1, max_size=6)
             | st.sampled_from(["x" * 65, "é" * 40, "\x00", "8\xa01", "\u2003", "\x85"]))
SPACES = [" ", "  ", "\t", "\n ", "\r\n", "\x0b", "\x0c", "\x1c", "\x1f "]


def bracket_trees():
    """("word", label, word) | ("one", label, T) for "(label T)" | ("two", label, T1, T2)."""
    return st.recursive(st.tuples(st.just("word"), odd_words, odd_words),
                        lambda sub: (st.tuples(st.just("one"), odd_words, sub)
                                     | st.tuples(st.just("two"), odd_words, sub, sub)),
                        max_leaves=12)


def render(tree, rng: random.Random) -> str:
    """A bracket string of the tree, spaced at random (a space is needed only between label and word)."""
    space = lambda: rng.choice(SPACES) if rng.random() < 0.4 else ""  # noqa: E731
    kind, label, *children = tree
    inner = rng.choice(SPACES) + children[0] if kind == "word" else "".join(space() + render(c, rng) for c in children)
    return "(" + space() + label + inner + space() + ")"


@settings(max_examples=100, deadline=None)
@given(st.lists(bracket_trees(), min_size=16, max_size=48), st.integers(0, 2**16), st.sampled_from([3, 8, MAX_DEPTH]))
def test_parsing_a_batch_of_bracket_strings_at_once_equals_parsing_each(batch, seed, max_depth):
    rng = random.Random(seed)
    values = [render(tree, rng) for tree in batch]
    assert_parsed_as_each([mutate(rng, v) if rng.random() < 0.3 else v for v in values], max_depth)


def test_bad_strings_in_a_batch_get_the_one_request_errors():
    bad = ["", "   ", "(", ")", "(2 a", "(2 a))", "(2 a) (2 b)", "(2)", "()", "( (2 a))", "a", "(2 (2 a) (2 b) (2 c))",
           "(2 a b)", "(2 a (2 b))", "(2 (2 b) a)", "(1 " * 9 + "a" + ")" * 9, [1, 2, 3], None]
    good = ["(3 (2 It) (4 (2 's) (2 good)))", "(\ud800 word)", "(2 word )", "(1(2 a)(3 b))", "(0 " + "w" * 100 + ")",
            [1, 2]]
    assert_parsed_as_each([x for pair in zip(bad, itertools.cycle(good)) for x in pair], max_depth=8)
    assert_parsed_as_each(good * 4, max_depth=8)


def test_a_word_that_is_not_valid_unicode_fails_its_request_only():
    """A lone surrogate (possible in-process, not over msgpack) in a word: bad_request for that
    request, in the reference, in a batch, and in the engine, where the others go on."""
    good = "(3 (2 It) (4 (2 's) (2 good)))"
    for value in ("(2 \ud800)", ["\ud800", "x"]):
        with pytest.raises(BadRequestError, match="not valid Unicode"):
            parse_tree(value, VOCAB)
    arrays, ok, errors = parse_trees([good] * 20 + ["(2 \ud800)", ["x", "\ud800"]], VOCAB)
    assert ok == list(range(20)) and sorted(errors) == [20, 21]
    with Engine([build_model("treelstm", **SMALL)]) as engine:
        futures = [engine.submit("treelstm", {"tree": t}) for t in [good] * 20 + ["(2 \ud800)"] + [good] * 5]
        with pytest.raises(BadRequestError, match="not valid Unicode"):
            futures[20].result(30)
        for f in futures[:20] + futures[21:]:
            assert f.result(30).outputs["h"].shape == (SMALL["hidden"],)


def _leaves(tree):
    return [x for t in tree for x in _leaves(t)] if isinstance(tree, tuple) else [tree]


def test_nesting_far_below_the_recursion_limit_is_a_bad_request():
    deep = 7
    for _ in range(5000):
        deep = [deep, 1]
    for value in (deep, "(1 " * 5000 + "a" + ")" * 5000):
        with pytest.raises(BadRequestError, match="deeper"):
            parse_tree(value, VOCAB)
        assert "deeper" in str(parse_trees([value], VOCAB)[2][0])
    with Engine([build_model("treelstm", **SMALL)]) as engine:
        with pytest.raises(BadRequestError, match="deeper"):
            engine.infer("treelstm", {"tree": deep}, timeout=10)


def test_counts_and_latencies_are_exact_after_results_failures_cancels_and_deadlines():
    model = build_model("lstm", **SMALL, max_batch=16)
    rng = random.Random(0)
    good = [{"tokens": [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]} for _ in range(60)]
    with Engine([model, chain_model(delay=0.002)]) as engine:
        futures = [engine.submit("lstm", x) for x in good]
        bad = [engine.submit("lstm", {"tokens": t}) for t in ([], [VOCAB], "abc")]
        slow = [engine.submit("chain", {"tokens": [1] * 400}) for _ in range(2)]
        late = engine.submit("chain", {"tokens": [1] * 400}, deadline=0.05)
        engine.cancel(slow[0].request_id)
        for x, f in zip(good, futures):
            assert torch.allclose(f.result(30).outputs["h"], lstm_reference(model, x)["h"], atol=1e-5)
        for f in bad:
            with pytest.raises(BadRequestError):
                f.result(30)
        with pytest.raises(CancelledError):
            slow[0].result(30)
        with pytest.raises(DeadlineExceededError):
            late.result(30)
        slow[1].result(30)
        stats = wait_idle(engine)
    assert stats["num_queued_requests"] == 0 and stats["num_live_requests"] == 0
    assert stats["latency_ms"]["lstm"]["count"] == len(good) + len(bad)
    assert stats["latency_ms"]["chain"]["count"] == 3


def test_a_finished_request_is_counted_before_its_future_resolves():
    with Engine([build_model("lstm", **SMALL)]) as engine:
        for i in range(20):
            engine.submit("lstm", {"tokens": [i + 1] * (i + 1)}).result(30)
            assert engine.stats()["num_queued_requests"] == 0


def test_overload_is_answered_at_once_and_capacity_comes_back():
    with Engine([chain_model(delay=0.002)], EngineConfig(max_requests=3)) as engine:
        futures = [engine.submit("chain", {"tokens": [1] * 20}) for _ in range(8)]
        refused = [f for f in futures if f.done() and isinstance(f.exception(), OverloadedError)]
        assert len(refused) >= 5
        for f in futures:
            if f not in refused:
                f.result(30)
        wait_idle(engine)
        assert engine.submit("chain", {"tokens": [2]}).result(30).outputs["h"].shape == (3,)


def test_concurrent_submitters_are_all_served_without_waiting_out_the_idle_timeout():
    model = build_model("lstm", **SMALL)
    with Engine([model]) as engine:
        results: list = []

        def client(seed):
            rng = random.Random(seed)
            for _ in range(40):
                time.sleep(rng.random() * 0.003)
                results.append(engine.submit("lstm", {"tokens": [rng.randrange(VOCAB)] * rng.randint(1, 8)}))

        threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for f in results:
            f.result(30)
        # one by one on an idle engine: each submit must wake the manager (a lost wake-up would
        # cost the 50 ms idle wait each time)
        start = time.perf_counter()
        for i in range(20):
            engine.submit("lstm", {"tokens": [i + 1]}).result(30)
        assert time.perf_counter() - start < 20 * 0.05 / 2
        stats = wait_idle(engine)
    assert stats["num_queued_requests"] == 0 and len(results) == 160


def test_stop_fails_requests_still_in_the_inbox_and_counts_them():
    engine = Engine([chain_model(delay=0.002)]).start()
    futures = [engine.submit("chain", {"tokens": [1] * 50}) for _ in range(30)]
    engine.stop()
    for f in futures:
        assert f.done()
        if f.exception() is not None:
            assert isinstance(f.exception(), EngineStoppedError)
    assert engine.num_accepted == engine.accounting.num_finished == 30


def test_the_caller_can_drive_the_engine_with_step():
    model = build_model("lstm", **SMALL)
    engine = Engine([model]).start(thread=False)
    futures = [engine.submit("lstm", {"tokens": [i % VOCAB] * (i % 7 + 1)}) for i in range(50)]
    deadline = time.monotonic() + 60
    while not all(f.done() for f in futures) and time.monotonic() < deadline:
        if not engine.step():
            time.sleep(0.0005)  # the CPU worker's thread runs the tasks meanwhile
    for i, f in enumerate(futures):
        want = lstm_reference(model, {"tokens": [i % VOCAB] * (i % 7 + 1)})["h"]
        assert torch.allclose(f.result(0).outputs["h"], want, atol=1e-5)
    assert engine.stats()["num_rows_used"] == [0]
    engine.stop()


def test_the_request_future_reads_like_a_concurrent_future():
    f = RequestFuture(7, "m", {})
    seen, order = [], []
    f.add_done_callback(lambda x: seen.append(x.result()))
    assert not f.done() and f.running() and not f.cancel() and not f.cancelled()
    with pytest.raises(concurrent.futures.TimeoutError):
        f.result(timeout=0.01)
    waiter = threading.Thread(target=lambda: order.append(f.result(timeout=10)))
    waiter.start()
    time.sleep(0.02)
    f.set_result(42)
    waiter.join(5)
    assert f.done() and f.result() == 42 and f.exception() is None and seen == [42] and order == [42]
    f.add_done_callback(lambda x: seen.append("late"))  # runs at once on a done future
    assert seen == [42, "late"]
    g = RequestFuture(8, "m", {})
    g.add_done_callback(lambda x: 1 / 0)  # a consumer's bug is logged, not raised
    g.set_exception(BadRequestError("no"))
    with pytest.raises(BadRequestError):
        g.result()
    assert isinstance(g.exception(), BadRequestError)
    with pytest.raises(RuntimeError, match="twice"):
        g.set_result(1)


def test_futures_resolved_in_bulk_build_each_result_once_on_first_read():
    futures = [RequestFuture(i, "m", {}) for i in range(3)]
    woken, seen = [], []
    waiter = threading.Thread(target=lambda: woken.append(futures[1].result(timeout=10)))
    waiter.start()
    time.sleep(0.02)
    futures[2].add_done_callback(lambda f: seen.append(f.result()))
    h = torch.arange(6.0).view(3, 2)
    resolve_rows(futures, ResultRows({"h": h, "tokens": [[1], [2, 3], [4]]}, [1.0, 2.0, 3.0], np.array([4.0, 5.0, 6.0]), 9.0))
    waiter.join(5)
    for i, f in enumerate(futures):
        result = f.result()
        assert result is f.result()  # built once
        assert torch.equal(result.outputs["h"], h[i]) and result.outputs["tokens"] == [[1], [2, 3], [4]][i]
        t = result.timing
        assert (t.arrival, t.first_cell, t.finish) == (1.0 + i, 4.0 + i, 9.0) and type(t.first_cell) is float
    assert woken == [futures[1].result()] and seen == [futures[2].result()]
    with pytest.raises(RuntimeError, match="twice"):
        resolve_rows(futures[:1], ResultRows({"h": h}, [0.0], np.zeros(1), 0.0))


@pytest.mark.parametrize("max_len", [None, 1, 3, 0, 4, -1, True, 2.0, 2**70, "2"])
def test_decode_limits_checked_in_bulk_fail_only_their_own_request(max_len):
    """A batch mixes requests with and without max_len; a bad one fails alone with its own error."""
    model = build_model("seq2seq", **SMALL, max_len=3)
    engine = Engine([model], EngineConfig(devices=("cpu",))).start(thread=False)
    try:
        odd = {"tokens": [5, 6]} if max_len is None else {"tokens": [5, 6], "max_len": max_len}
        futures = [engine.submit("seq2seq", x) for x in ({"tokens": [5]}, {"tokens": [7], "max_len": 2}, odd,
                                                         {"tokens": [5, 6], "extra": 1})]
        while not all(f.done() for f in futures):
            engine.step()
        assert len(futures[0].result().outputs["tokens"]) <= 3 and len(futures[1].result().outputs["tokens"]) <= 2
        with pytest.raises(BadRequestError, match="unexpected"):
            futures[3].result()
        if max_len is None or (type(max_len) is int and 1 <= max_len <= 3):
            assert len(futures[2].result().outputs["tokens"]) <= (max_len or 3)
        else:
            with pytest.raises(BadRequestError, match="max_len"):
                futures[2].result()
    finally:
        engine.stop()
