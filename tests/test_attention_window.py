"""The attention twin's sliding window and soft cap (Mistral's, Gemma's; issue 33) against a
float64 dense computation written from their definitions: a query at position p sees positions
p - window + 1 .. p, and its scores are cap * tanh(s / cap) before the mask."""
import pytest
import torch
from test_paged_attention import make_case

from batchmaker.kernels.paged_attention import PagedAttend, reference_paged_attention


def dense(q, k, v, scale, window, softcap):
    """q [n, Hq, D] at positions ctx - n ..; k, v [ctx, Hkv, D] -> float64 [n, Hq, D], one query at a time."""
    n, ctx = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, dim=1), v.double().repeat_interleave(group, dim=1)
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i in range(n):
        p = ctx - n + i
        first = 0 if window is None else max(0, p - window + 1)
        scores = torch.einsum("hd,chd->hc", q[i].double(), k[first:p + 1]) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        out[i] = torch.einsum("hc,chd->hd", scores.softmax(-1), v[first:p + 1])
    return out


def contexts(case):
    """Each sequence's (first query token, n, K [ctx, Hkv, D], V), read back through its block table."""
    _, k_cache, v_cache, block_tables, query_start, context_lens = case.args[:6]
    starts, block_size = query_start.tolist(), k_cache.shape[1]
    for s, ctx in enumerate(context_lens.tolist()):
        blocks = block_tables[s, :-(-ctx // block_size)].long()
        yield starts[s], starts[s + 1] - starts[s], k_cache[blocks].flatten(0, 1)[:ctx], v_cache[blocks].flatten(0, 1)[:ctx]


@pytest.mark.parametrize("window, softcap", [(1, None), (5, None), (16, None), (None, 0.5), (7, 2.0), (200, 1.0)])
@pytest.mark.parametrize("seed", range(4))
def test_window_and_softcap_match_their_definitions(window, softcap, seed):
    # decodes (n = 1, the batched path) and prompt chunks after earlier context, windows shorter and longer
    case = make_case([1, 1, 9, 0, 24, 1], [1, 30, 40, 6, 24, 61], 2, 2, 32, 8, seed=seed)
    scale = case.args[7] * 3  # (scores of a few units: the cap binds)
    got = reference_paged_attention(*case.args[:7], scale, window=window, softcap=softcap)
    for first, n, k, v in contexts(case):
        if n:
            want = dense(case.q[first:first + n], k, v, scale, window, softcap)
            torch.testing.assert_close(got[first:first + n].double(), want, rtol=1e-5, atol=1e-5)
    assert not got[case.num_real:].any()
    if window in (5, 16) or softcap == 0.5:  # (these bind here: without them the output differs)
        plain = reference_paged_attention(*case.args[:7], scale)
        assert (plain[:case.num_real] - got[:case.num_real]).abs().max() > 1e-3


def test_paged_attend_passes_each_layers_window_and_the_cap_only_where_set():
    seen = []

    def attention(*args, **kw):
        seen.append({k: kw[k] for k in ("window", "softcap") if k in kw})
        return reference_paged_attention(*args, **kw)
    case = make_case([1, 3], [9, 20], 2, 2, 32, 8)
    q, k_cache, v_cache, block_tables, query_start, context_lens, n, scale = case.args
    caches = k_cache.expand(2, *k_cache.shape).clone(), v_cache.expand(2, *v_cache.shape).clone()
    slots = torch.arange(4)
    attend = PagedAttend(*caches, slots, block_tables, query_start, context_lens, n, scale, attention=attention)
    attend.attend_cached(0, q)
    attend.windows, attend.softcap = (4, 0), 30.0
    attend.attend_cached(0, q)
    attend.attend_cached(1, q)
    assert seen == [{}, {"window": 4, "softcap": 30.0}, {"softcap": 30.0}]
