"""CRC-32 of words seen before, looked up for a whole batch of words at once (the tree parser's
word ids, batchmaker/core/tree_batch.py).

A word of at most 15 bytes is its own key, exactly: its bytes as two little-endian uint64 (read
at the word's start through an unaligned view of the batch's bytes, bytes past the word masked
off) with its length in the top byte of the second. Keys live in a direct-mapped table (a slot
per multiplicative hash of the key; a later word takes a slot from an earlier one) of records
(first key, second key, CRC: one cache line per word looked up), so a batch's words are found by
one gather of records and checked against both keys: ~20 numpy calls whatever their
lengths, where the table-driven CRC costs about four per byte position of the longest word. A
word missed (new, longer than 15 bytes, or evicted) is hashed by zlib one by one, or, when a
batch has many, by the caller's vectorized CRC, and takes its slot.
"""
import threading
import zlib

import numpy as np

MAX_KEYED = 15  # bytes: the length rides in the second key's top byte
# [n] for a word of n bytes (n <= 255): the masks of its bytes in the two keys, and its length byte
_LOW = np.array([(1 << (8 * min(n, 8))) - 1 for n in range(256)], dtype=np.uint64)
_HIGH = np.array([(1 << (8 * min(max(n - 8, 0), 8))) - 1 for n in range(256)], dtype=np.uint64)
_LENGTH = np.array([n << 56 for n in range(256)], dtype=np.uint64)
_ODD = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xC2B2AE3D27D4EB4F))


class WordCache:
    def __init__(self, bits: int = 17, max_one_by_one: int = 64):
        self.shift = np.uint64(64 - bits)  # a slot is the top `bits` bits of the mixed key
        # [slot]: (first key, second key, CRC); an empty slot's second key 0 matches no word (length byte >= 1)
        self.table = np.zeros((1 << bits, 3), dtype=np.uint64)
        self.max_one_by_one = max_one_by_one  # more misses than this: the caller's vectorized CRC
        self.lock = threading.Lock()  # (a slot's three entries change together)

    def crc32(self, data: bytes, starts: np.ndarray, lengths: np.ndarray, hash_many) -> np.ndarray:
        """zlib.crc32 of each data[start:start + length] -> uint32 [n]; hash_many(indices) gives
        those of the words at `indices` (for many misses at once)."""
        u64 = np.ndarray((len(data) + 9,), dtype="<u8", buffer=data + bytes(16), strides=(1,))  # [i]: the 8 bytes at i
        n = np.minimum(lengths, 255)  # (a word longer than MAX_KEYED never matches a key: its length byte says >= 16)
        first = u64[starts] & _LOW[n]
        second = (u64[starts + 8] & _HIGH[n]) | _LENGTH[n]
        slots = ((first ^ second * _ODD[1]) * _ODD[0] >> self.shift).astype(np.intp)
        with self.lock:
            records = self.table.take(slots, axis=0)  # [n, 3]
            hit = (records[:, 0] == first) & (records[:, 1] == second)
            crc = np.where(hit, records[:, 2], np.uint64(0)).astype(np.uint32)
            missed = np.flatnonzero(~hit)
            if len(missed):
                crc[missed] = found = self._hash(data, starts[missed], lengths[missed], missed, hash_many)
                keyed = missed[lengths[missed] <= MAX_KEYED]
                self.table[slots[keyed]] = np.stack((first[keyed], second[keyed], crc[keyed].astype(np.uint64)), axis=1)
        return crc

    def _hash(self, data: bytes, starts: np.ndarray, lengths: np.ndarray, missed: np.ndarray, hash_many) -> np.ndarray:
        if len(missed) > self.max_one_by_one:
            return hash_many(missed)
        return np.array([zlib.crc32(data[a:a + n]) for a, n in zip(starts.tolist(), lengths.tolist())], dtype=np.uint32)
