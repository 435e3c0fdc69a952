"""The synthetic WMT-15 length model matches the thesis' numbers (mean 24, p99 < 100, max 330)."""
import numpy as np
import pytest

from batchmaker.data import MAX_LENGTH, wmt_lengths, wmt_sentences


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lengths_match_the_paper(seed):
    lengths = wmt_lengths(100_000, seed)
    assert lengths.dtype == np.int64 and lengths.shape == (100_000,)
    assert abs(lengths.mean() - 24) <= 1.5
    assert np.percentile(lengths, 99) < 100
    assert lengths.min() >= 1 and lengths.max() <= MAX_LENGTH == 330
    assert lengths.max() > 200  # a real tail, not a truncated bell


def test_lengths_deterministic_per_seed():
    assert np.array_equal(wmt_lengths(1000, 7), wmt_lengths(1000, 7))
    assert not np.array_equal(wmt_lengths(1000, 7), wmt_lengths(1000, 8))


def test_sentences():
    sentences = wmt_sentences(500, vocab=100, seed=3)
    assert [len(s) for s in sentences] == wmt_lengths(500, 3).tolist()
    flat = [t for s in sentences for t in s]
    assert all(isinstance(t, int) for t in flat)
    assert min(flat) >= 3 and max(flat) < 100
    assert sentences == wmt_sentences(500, vocab=100, seed=3)
    assert sentences != wmt_sentences(500, vocab=100, seed=4)


def test_sentences_need_room_for_reserved_ids():
    with pytest.raises(ValueError):
        wmt_sentences(1, vocab=3)
