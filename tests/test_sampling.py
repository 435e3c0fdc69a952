"""The seeded sampler (batchmaker/exec/sampling.py): draws follow softmax(logits / temperature)
restricted to the top-k and the top-p nucleus, and depend only on (seed, counter)."""
import torch

from batchmaker.exec.sampling import gumbel, sample

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def draws(n: int, temperature=1.0, top_k=0, top_p=1.0) -> torch.Tensor:
    logits = LOGITS.expand(n, -1)
    return sample(logits, torch.full((n,), temperature), torch.full((n,), top_k, dtype=torch.int64),
                  torch.full((n,), top_p), torch.arange(n, dtype=torch.int64) * 7919 + 3, torch.full((n,), 5))


def frequencies(tokens: torch.Tensor) -> torch.Tensor:
    return torch.bincount(tokens, minlength=len(LOGITS)).float() / len(tokens)


def test_draws_follow_the_softmax():
    n = 40000
    for temperature in (1.0, 0.5, 2.0):
        expected = torch.softmax(LOGITS / temperature, -1)
        assert torch.allclose(frequencies(draws(n, temperature)), expected, atol=0.01)


def test_top_k_and_top_p_cut_the_support():
    n = 20000
    top2 = frequencies(draws(n, top_k=2))
    assert top2[2:].sum() == 0
    assert torch.allclose(top2[:2], torch.softmax(LOGITS[:2], -1), atol=0.015)
    probs = torch.softmax(LOGITS, -1)  # 0.56, 0.21, 0.13, 0.08 ...: the 0.8 nucleus is the first three tokens
    nucleus = frequencies(draws(n, top_p=0.8))
    assert nucleus[3:].sum() == 0 and nucleus[2] > 0
    assert torch.allclose(nucleus[:3], probs[:3] / probs[:3].sum(), atol=0.015)
    assert (draws(100, top_p=1e-6) == 0).all()  # the best token always stays


def test_greedy_rows_take_the_argmax_and_noise_is_a_function_of_seed_and_counter():
    n = 8
    tokens = sample(LOGITS.expand(n, -1), torch.zeros(n), torch.zeros(n, dtype=torch.int64), torch.ones(n),
                    torch.arange(n), torch.zeros(n, dtype=torch.int64))
    assert (tokens == 0).all()
    seeds, counters = torch.tensor([1, 1, 2, -5]), torch.tensor([0, 1, 0, 0])
    a = gumbel(seeds, counters, 50)
    b = gumbel(seeds.flip(0), counters.flip(0), 50).flip(0)  # the same rows in another batch order
    assert torch.equal(a, b)
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])


def test_chunked_rows_sample_and_score_as_all_rows_at_once():
    """sample_rows: the LM head and the sampler over chunks of rows give the tokens and
    log-probabilities of one pass over every row (per-row seeds: chunking changes no draw); a
    chunk's rows stay under the memory bound, and a large vocabulary gets small chunks."""
    from batchmaker.exec.sampling import CHUNK_BYTES, SAMPLING_BYTES_PER_LOGIT, chunk_rows, log_probabilities, \
        sample_rows, sampling_bytes
    torch.manual_seed(0)
    hidden, weight = torch.randn(11, 8), torch.randn(50, 8)
    rows = torch.tensor([10, 0, 3, 3, 7, 1, 9])
    n = len(rows)
    t = {"temperature": torch.tensor([0.0, 1.0, 0.7, 1.3, 0.0, 1.0, 2.0]),
         "top_k": torch.tensor([0, 0, 5, 0, 0, 3, 0]), "top_p": torch.tensor([1.0, 0.9, 1.0, 0.5, 1.0, 1.0, 0.95]),
         "seeds": torch.arange(n) * 104729 + 11, "counters": torch.arange(n) + 3}
    head = lambda h: h @ weight.T  # noqa: E731
    logits = head(hidden[rows])
    whole = sample(logits, t["temperature"], t["top_k"], t["top_p"], t["seeds"], t["counters"])
    scores = log_probabilities(logits, whole, 4)
    for step in (1, 2, 3, 7, 100):
        assert torch.equal(sample_rows(head, hidden, rows, t, step, greedy_only=False), whole)
        chosen, got = sample_rows(head, hidden, rows, t, step, greedy_only=False, logprobs=4)
        assert torch.equal(chosen, whole)
        for a, b in zip(got, scores):
            assert torch.allclose(a, b) if a.is_floating_point() else torch.equal(a, b)
    greedy = sample_rows(head, hidden, rows, t, 2, greedy_only=True)
    assert torch.equal(greedy, logits.argmax(-1))
    assert chunk_rows(256_000) * 256_000 * SAMPLING_BYTES_PER_LOGIT <= CHUNK_BYTES
    assert chunk_rows(32_000) >= 256 and chunk_rows(256_000) < 64  # (Llama-2's whole batch in one chunk)
    assert sampling_bytes(256, 256_000) <= CHUNK_BYTES < 256 * 256_000 * SAMPLING_BYTES_PER_LOGIT
