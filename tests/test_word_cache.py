"""The tree parser's word cache: CRCs of a batch's words, looked up by exact keys, equal to
zlib.crc32 on first sight and on every later one, at every length (keyed up to 15 bytes, longer
ones hashed each time), with bytes that a key's masking could confuse (NULs), and in a table so
small that words keep taking each other's slots."""
import random
import zlib

import numpy as np
import pytest

from batchmaker.core.tree_batch import _crc32_words
from batchmaker.core.word_cache import MAX_KEYED, WordCache


def batch(words: list[bytes]) -> tuple[bytes, np.ndarray, np.ndarray]:
    data = b" ".join(words)
    lengths = np.array([len(w) for w in words], dtype=np.int64)
    starts = np.cumsum(lengths + 1) - lengths - 1
    return data, starts, lengths


def crcs(cache: WordCache, words: list[bytes]) -> list[int]:
    data, starts, lengths = batch(words)
    buf = np.frombuffer(data, dtype=np.uint8)
    got = cache.crc32(data, starts, lengths, lambda at: _crc32_words(data, buf, starts[at], lengths[at]))
    assert got.dtype == np.uint32
    return got.tolist()


def words_of(rng: random.Random, n: int) -> list[bytes]:
    alphabet = [b"a", b"b", b"\x00", b"\xc3\xa9", b"-", b"'"]
    return [b"".join(rng.choice(alphabet) for _ in range(rng.choice([1, 2, 7, 8, 9, 14, 15, 16, 17, 30, 70])))
            for _ in range(n)]


@pytest.mark.parametrize("max_one_by_one", [0, 64, 10**6])  # vectorized misses, mixed, one by one
def test_cached_crcs_equal_zlib_on_every_sight(max_one_by_one):
    rng = random.Random(max_one_by_one)
    cache = WordCache(max_one_by_one=max_one_by_one)
    vocabulary = words_of(rng, 600) + [b"a", b"a\x00", b"a\x00\x00", b"\x00", b"x" * MAX_KEYED, b"x" * (MAX_KEYED + 1)]
    for _ in range(12):
        words = [rng.choice(vocabulary) for _ in range(rng.choice([1, 50, 400]))]
        assert crcs(cache, words) == [zlib.crc32(w) for w in words]
    assert np.count_nonzero(cache.table[:, 1]) > 100  # (keyed words took slots)


def test_words_differing_only_past_their_length_or_in_length_are_distinct():
    cache = WordCache(max_one_by_one=0)
    words = [b"ab", b"ab\x00", b"ab\x00\x00\x00\x00\x00\x00", b"ab\x00\x00\x00\x00\x00\x00\x00", b"abcdefgh", b"abcdefgh\x00"]
    for _ in range(3):
        assert crcs(cache, words * 50) == [zlib.crc32(w) for w in words * 50]


def test_words_taking_each_others_slots_stay_right():
    rng = random.Random(1)
    cache = WordCache(bits=4, max_one_by_one=8)
    vocabulary = words_of(rng, 100)
    for _ in range(10):
        words = [rng.choice(vocabulary) for _ in range(60)]
        assert crcs(cache, words) == [zlib.crc32(w) for w in words]
