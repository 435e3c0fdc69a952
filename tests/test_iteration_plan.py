"""The iteration plan (core/iteration_plan.py) as bytes: what one process plans, another runs,
unchanged (the ranks of a model-parallel decoder all run the plan rank 0 made); and the graph
shapes and padding (core/iteration_shapes.py). No torch."""
import numpy as np
import pytest

from batchmaker.core.iteration_plan import ARRAYS, COPY_MODES, Copies, GraphShape, IterationPlan
from batchmaker.core.iteration_shapes import NO_GRAPHS, GraphShapes, graph_key, pad, pad_alone, prefill_tokens


def random_plan(rng: np.random.Generator, copies: bool, graph: bool) -> IterationPlan:
    s = int(rng.integers(1, 9))
    counts = rng.integers(1, 6, s)
    t, n = int(counts.sum()), int(rng.integers(0, s + 1))
    query_start = np.concatenate([[0], np.cumsum(counts)])
    per_chunk, n_in, n_out = int(rng.integers(1, 4)), int(rng.integers(0, 5)), int(rng.integers(0, 5))
    return IterationPlan.of(
        tokens=rng.integers(-1, 1000, t), positions=rng.integers(0, 4096, t), kv_slots=rng.integers(0, 1 << 40, t),
        token_slots=rng.integers(0, 64, t), query_start=query_start, context_lens=rng.integers(1, 4096, s),
        block_tables=rng.integers(0, 1 << 30, (s, int(rng.integers(1, 300)))), sample_token=rng.integers(0, t, n),
        sample_slots=rng.integers(0, 64, n), seeds=rng.integers(-(1 << 62), 1 << 62, n), counters=rng.integers(0, 4096, n),
        top_k=rng.integers(0, 50, n), temperature=rng.random(n) * 2, top_p=rng.random(n),
        max_query_len=int(counts.max()), decode_only=bool(rng.integers(2)), greedy=bool(rng.integers(2)),
        logprobs=int(rng.integers(-1, 21)), graph=GraphShape(int(rng.integers(16, 512)), int(rng.integers(1, 64)), [None, 512, 1024][int(rng.integers(3))],
                         bool(rng.integers(2))) if graph else None,
        copies=Copies(rng.integers(0, 100, n_in), rng.integers(0, 1000, (n_in, per_chunk)),
                      rng.integers(0, 1000, (n_out, per_chunk)), rng.integers(0, 100, n_out),
                      COPY_MODES[int(rng.integers(3))]) if copies else None)


def assert_same(a: IterationPlan, b: IterationPlan) -> None:
    for name, dtype in ARRAYS.items():
        x, y = getattr(a, name), getattr(b, name)
        assert y.dtype == dtype and x.shape == y.shape and np.array_equal(x, y), name
    assert (a.max_query_len, a.decode_only, a.greedy, a.logprobs, a.graph) == \
        (b.max_query_len, b.decode_only, b.greedy, b.logprobs, b.graph)
    assert (a.copies is None) == (b.copies is None)
    if a.copies is not None:
        assert a.copies.mode == b.copies.mode
        for name in ("swap_in_host", "swap_in_blocks", "swap_out_blocks", "swap_out_host"):
            x, y = getattr(a.copies, name), getattr(b.copies, name)
            assert x.shape == y.shape and np.array_equal(x, y), name


@pytest.mark.parametrize("seed", range(24))
def test_a_plan_comes_back_from_its_bytes_as_it_was(seed):
    rng = np.random.default_rng(seed)
    plan = random_plan(rng, copies=seed % 2 == 0, graph=seed % 3 == 0)
    back = IterationPlan.from_bytes(plan.to_bytes())
    assert_same(plan, back)
    assert all(a.flags.aligned for a in back.arrays().values())  # (every array starts on 8 bytes)
    back.tokens[0] = 7  # (writable: a receiving rank may pad it in place or hand it to torch)
    assert IterationPlan.from_bytes(back.to_bytes()).tokens[0] == 7


def test_an_empty_sample_list_and_copies_without_swap_ins():
    plan = random_plan(np.random.default_rng(0), copies=False, graph=False)
    z = np.zeros(0)
    plan = IterationPlan.of(**{**plan.arrays(), **dict.fromkeys(("sample_token", "sample_slots", "seeds", "counters",
                                                                 "top_k", "temperature", "top_p"), z)},
                            copies=Copies(z, z.reshape(0, 2), np.arange(4).reshape(2, 2), np.array([5, 6]), "side"))
    assert_same(plan, IterationPlan.from_bytes(plan.to_bytes()))


def test_the_plan_casts_its_arrays_and_has_no_mutable_fields():
    plan = random_plan(np.random.default_rng(1), copies=False, graph=False)
    assert all(getattr(plan, name).dtype == dtype for name, dtype in ARRAYS.items())
    with pytest.raises(AttributeError):
        plan.tokens = plan.positions  # (frozen: the runner and other ranks read what the planner made)


# the shapes (core/iteration_shapes.py) -------------------------------------------------------------

SHAPES = GraphShapes(batch_sizes=(1, 2, 4, 8, 16, 32), max_seqs=16, prefill_graph_tokens=512, short_context=512,
                     table_width=4096)


def test_which_graph_runs_an_iteration():
    assert NO_GRAPHS.of(3, 3, True, 9) is None  # (CPU workers: every iteration eagerly)
    assert SHAPES.of(3, 3, True, 100) == GraphShape(4, 4, 512, True)  # decode: sequences to a bucket
    assert SHAPES.of(9, 9, True, 3000) == GraphShape(16, 16, None, True)  # past the short bound: the table's width
    assert SHAPES.of(2, 9, False, 30) == GraphShape(16, 4, 512, False)  # 7 padded tokens: a padded sequence too
    assert SHAPES.of(3, 16, False, 600) == GraphShape(16, 4, 1024, False)  # no padded tokens, contexts to 1024
    assert SHAPES.of(16, 20, False, 30) is None  # a padded sequence would exceed max_seqs
    assert SHAPES.of(1, 513, False, 30) is None  # prompt chunks past prefill_graph_tokens: eagerly
    assert [prefill_tokens(n) for n in (1, 17, 128, 129, 300)] == [16, 32, 128, 192, 320]
    assert SHAPES.decode_buckets == [1, 2, 4, 8, 16]
    assert graph_key("t", GraphShape(4, 4, 512, True), True) == ("iteration", "t", 4, True, 512)
    assert graph_key("t", GraphShape(16, 4, None, False), False) == ("prefill", "t", 16, 4, False, None)


def test_padding_leaves_the_real_rows_first_and_writes_only_scratch():
    rng = np.random.default_rng(3)
    plan = random_plan(rng, copies=True, graph=False)
    shape = GraphShape(plan.num_tokens + 5, plan.num_seqs + 2, 512, False)
    padded = pad(plan, shape, scratch_slot=99, block_size=16)
    t, s, n = plan.num_tokens, plan.num_seqs, plan.num_samples
    assert (padded.num_tokens, padded.num_seqs, padded.num_samples) == (shape.tokens, shape.seqs, shape.seqs)
    for name in ARRAYS:  # the real rows, unchanged, first
        real = getattr(plan, name)
        assert np.array_equal(getattr(padded, name)[:len(real)], real), name
    assert (padded.kv_slots[t:] < 16).all() and (padded.token_slots[t:] == 99).all()  # the scratch block and slot
    assert (padded.block_tables[s:] == 0).all() and (padded.sample_slots[n:] == 99).all()
    assert padded.query_start[-1] == shape.tokens and (np.diff(padded.query_start) >= 1).all()
    assert padded.graph == shape and padded.max_query_len == shape.tokens and padded.copies is plan.copies
    with pytest.raises(ValueError, match="cannot pad"):
        pad(plan, GraphShape(t + 1, s, None, False), 99, 16)  # a padded token needs a padded sequence
    alone = pad_alone(GraphShape(4, 4, None, True), 99, 16, 8)
    assert alone.query_start.tolist() == [0, 1, 2, 3, 4] and alone.block_tables.shape == (4, 8)


def test_block_tables_travel_up_to_their_last_block():
    plan = random_plan(np.random.default_rng(9), copies=False, graph=False)
    tables = np.zeros_like(plan.block_tables)
    tables[0, 3] = 7  # (a zero before it: kept)
    plan = IterationPlan.of(**{**plan.arrays(), "block_tables": tables})
    assert len(plan.to_bytes()) < len(random_plan(np.random.default_rng(9), copies=False, graph=False).to_bytes())
    assert_same(plan, IterationPlan.from_bytes(plan.to_bytes()))
