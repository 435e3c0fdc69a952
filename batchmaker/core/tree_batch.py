"""Many SST/PTB bracket strings parsed at once, with numpy over their bytes (parse_trees' batch
path, batchmaker/core/tree_input.py, which keeps the one-by-one path and the reference parser).

The strings are joined as UTF-8 and split into tokens where brackets and runs of text start; the
depth after each token is a cumulative sum; a string that breaks a rule of the reference is left
to the one-by-one path (which words the error). The trees are read off the ")"s (a stable sort by
depth finds each subtree's sibling) and words are hashed by CRC-32, equal to zlib.crc32, for all
words at once (a table gather per byte, an XOR-reduce per word: the register is linear).
`TreeArrays` is the result of either path.
"""
import zlib
from dataclasses import dataclass

import numpy as np

FIRST_WORD_ID = 3  # ids 0..2 (PAD, BOS, EOS in the other models) are never a word's


@dataclass(frozen=True, slots=True)
class TreeArrays:
    """Trees as arrays. Tree t has n_t = num_leaves[t] leaves and n_t - 1 internal nodes,
    numbered in post-order: leaves 0..n_t-1 left to right, then internal nodes n_t..2n_t-2, each
    after its children (the root is the last node). tokens: the leaves' ids, tree after tree;
    children: [sum(n_t - 1), 2] int64, the (left, right) numbers of each internal node, tree after tree."""

    num_leaves: np.ndarray
    tokens: np.ndarray
    children: np.ndarray

    def tree(self, t: int) -> tuple[int, np.ndarray, np.ndarray]:
        """Tree t's (num_leaves, tokens, children), as _tree_to_arrays gives them."""
        leaf_at = int(self.num_leaves[:t].sum())
        n = int(self.num_leaves[t])
        return n, self.tokens[leaf_at:leaf_at + n], self.children[leaf_at - t:leaf_at - t + n - 1]

    def concat(self, other: "TreeArrays") -> "TreeArrays":
        return TreeArrays(np.concatenate((self.num_leaves, other.num_leaves)),
                          np.concatenate((self.tokens, other.tokens)), np.concatenate((self.children, other.children)))

    def take(self, order: np.ndarray) -> "TreeArrays":
        """The trees at `order`, in that order."""
        n = self.num_leaves
        leaf_at = np.cumsum(n) - n
        return TreeArrays(n[order], self.tokens[ranges(leaf_at[order], n[order])],
                          self.children[ranges(leaf_at[order] - order, n[order] - 1)])


def ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """start..start+count-1 for each (start, count), concatenated."""
    ends = np.cumsum(counts)
    return np.repeat(starts - ends + counts, counts) + np.arange(ends[-1] if len(ends) else 0)


_OPEN, _CLOSE = ord("("), ord(")")
IS_SPACE = np.zeros(256, dtype=bool)  # per byte: is it one _tokens splits on
IS_SPACE[list(b"\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f ")] = True
_MAX_HASHED = 64  # longer words are hashed one by one (zlib): the tables below stop there


@dataclass(frozen=True, slots=True)
class _Tokens:
    """Bracket strings as UTF-8 joined by b" " (no byte of a multi-byte character is below 128,
    so splitting the bytes splits the text as _tokens does): each token's byte position, its
    first byte (b"(", b")" or the start of a label or word), the depth after it, and where each
    string's tokens start (first[-1]: the number of tokens)."""

    data: bytes
    pos: np.ndarray  # [num_tokens] int64
    kind: np.ndarray  # [num_tokens] uint8
    depth: np.ndarray  # [num_tokens] int32, summed from the first string: each string's own if those before balance
    first: np.ndarray  # [num_strings + 1] int64

    @staticmethod
    def of(parts: list[bytes]) -> "_Tokens":
        data = b" ".join(parts)
        buf = np.frombuffer(data, dtype=np.uint8)
        starts = (buf == _OPEN) | (buf == _CLOSE)  # a token starts at each bracket and each run of text
        space = buf == 32
        if (buf < 32).any():
            space = IS_SPACE[buf]
        text = ~(starts | space)
        starts[1:] |= text[1:] > text[:-1]
        starts[:1] |= text[:1]
        pos = np.flatnonzero(starts)
        kind = buf[pos]
        depth = np.cumsum((kind == _OPEN).view(np.int8) - (kind == _CLOSE).view(np.int8), dtype=np.int32)
        sizes = np.fromiter(map(len, parts), dtype=np.int64, count=len(parts)) + 1
        first = np.searchsorted(pos, np.cumsum(sizes) - sizes)
        return _Tokens(data, pos, kind, depth, np.append(first, len(pos)))

    def without(self, dropped: np.ndarray) -> "_Tokens":
        """The tokens of the strings not dropped, each string with its own depth."""
        counts = np.diff(self.first)
        keep = np.repeat(~dropped, counts)
        before = np.concatenate(([0], self.depth))[self.first[:-1]]  # the depth before each string
        depth = (self.depth - np.repeat(before, counts).astype(np.int32))[keep]
        first = np.concatenate(([0], np.cumsum(counts[~dropped])))
        return _Tokens(self.data, self.pos[keep], self.kind[keep], depth, first)

    def broken(self, max_depth: int) -> np.ndarray:
        """[num_strings] bool: the strings that break a rule of parse_bracketed ("(" label, then a
        word or subtrees, then ")"; one tree; at most max_depth deep), but "at most two subtrees in
        a bracket" (_shape checks that)."""
        kind, depth, first = self.kind, self.depth, self.first
        is_open, is_close = kind == _OPEN, kind == _CLOSE
        is_text = ~(is_open | is_close)
        label = is_text.copy()
        label[1:] &= is_open[:-1]
        label[:1] = False
        after_label = np.concatenate(([False], label[:-1]))
        next_text, next_close = np.append(is_text[1:], False), np.append(is_close[1:], False)
        # "(" is followed by a label, a label by a word or "(", a word ("(label word)") by ")"
        wrong = (is_open & ~next_text) | (label & next_close) | (is_text & ~label & ~(after_label & next_close))
        counts = np.diff(first)
        if not wrong.any() and counts.all() and depth.min(initial=0) >= 0 and depth.max(initial=0) <= max_depth \
                and np.count_nonzero(depth == 0) == len(counts) and not depth[first[1:] - 1].any():
            return np.zeros(len(counts), dtype=bool)  # depth is 0 at each string's end only: each is one tree
        before = np.concatenate(([0], depth))[first[:-1]]
        depth = depth - np.repeat(before, counts)
        last = np.zeros(len(kind), dtype=bool)
        last[first[1:][counts > 0] - 1] = True
        wrong |= (depth > max_depth) | np.where(last, depth != 0, depth < 1)
        broken = counts == 0
        broken[np.repeat(np.arange(len(counts)), counts)[wrong]] = True
        return broken


def parse_brackets(texts: list[str], vocab: int, max_depth: int) -> tuple[TreeArrays, list[int]]:
    """parse_bracketed's rules applied to all `texts` at once, with numpy over their bytes ->
    (the arrays of those that follow the rules, their positions in `texts`)."""
    try:
        parts = list(map(str.encode, texts))
    except UnicodeEncodeError:
        parts = list(map(_utf8, texts))
    tokens = _Tokens.of(parts)
    kept = np.arange(len(texts))
    broken = tokens.broken(max_depth)
    if broken.any():
        tokens, kept = tokens.without(broken), kept[~broken]
    too_wide, shape = _shape(tokens)
    if too_wide.any():
        tokens, kept = tokens.without(too_wide), kept[~too_wide]
        too_wide, shape = _shape(tokens)
    num_leaves, children, words = shape
    return TreeArrays(num_leaves, _hashed_words(tokens, words, vocab), children), kept.tolist()


def _utf8(text: str) -> bytes:
    try:
        return text.encode()
    except UnicodeEncodeError:  # a lone surrogate: b"" breaks a rule, so the reference decides
        return b""


def _shape(tokens: _Tokens) -> tuple[np.ndarray, tuple | None]:
    """The trees of strings that passed broken(), read off their ")"s -> ([num_strings] bool: a
    bracket holds three subtrees or more, (num_leaves, children as in TreeArrays, the token index
    of each word) or None if any does). A ")" after a word closes a leaf; one after a ")" closes
    "(label T)", which is T, or "(label T1 T2)", an internal node, when T2 has a sibling before it
    (the ")" before T2's at its depth is followed by "("). Nodes are numbered in ")" order."""
    kind, first = tokens.kind, tokens.first
    closes = np.flatnonzero(kind == _CLOSE)  # [num_closes]: the token index of each ")"
    holds_word = kind[closes - 1] != _CLOSE
    depth = tokens.depth[closes]
    order = np.argsort(depth.astype(np.int16) if depth.max(initial=0) < 2**15 else depth, kind="stable")
    same = depth[order[1:]] == depth[order[:-1]]
    before = np.full(len(closes), -1)  # the ")" before each at its depth (each string starts at depth 0)
    before[order[1:][same]] = order[:-1][same]
    followed_by_open = kind[np.minimum(closes + 1, len(kind) - 1)] == _OPEN  # False for the last ")", so for before -1
    has_sibling = followed_by_open[before]
    pair_at = np.flatnonzero(~holds_word[1:] & has_sibling[:-1]) + 1  # the ")"s of internal nodes
    right = pair_at - 1
    left = before[right]
    too_wide = np.zeros(len(first) - 1, dtype=bool)
    if has_sibling[left].any():
        too_wide[np.searchsorted(first, closes[pair_at[has_sibling[left]]], side="right") - 1] = True
        return too_wide, None
    word_at = np.flatnonzero(holds_word)
    words = closes[word_at] - 1
    num_leaves = np.diff(np.searchsorted(words, first))
    made = np.zeros(len(closes), dtype=np.int64)  # the ")" that made each one's node
    made[word_at], made[pair_at] = word_at, pair_at
    np.maximum.accumulate(made, out=made)  # "(label T)" is the node of the ")" just before it
    node = np.zeros(len(closes), dtype=np.int64)
    node[word_at] = ranges(0 * num_leaves, num_leaves)
    node[pair_at] = ranges(num_leaves, num_leaves - 1)
    node = node[made]
    children = np.empty((len(pair_at), 2), dtype=np.int64)
    children[:, 0], children[:, 1] = node[left], node[right]
    return too_wide, (num_leaves, children, words)


def _hashed_words(tokens: _Tokens, words: np.ndarray, vocab: int) -> np.ndarray:
    """word_id of the words at these token indices (each followed by its ")"), all at once."""
    buf = np.frombuffer(tokens.data, dtype=np.uint8)
    starts, ends = tokens.pos[words], tokens.pos[words + 1]
    if IS_SPACE[buf[ends - 1]].any():  # "(label word )": a word ends where its run of text does
        text = ~(IS_SPACE[buf] | (buf == _OPEN) | (buf == _CLOSE))
        run_ends = np.flatnonzero(text[:-1] > text[1:]) + 1
        ends = run_ends[np.searchsorted(run_ends, starts, side="right")]
    lengths = ends - starts
    long = np.flatnonzero(lengths > _MAX_HASHED)
    crc = _crc32(buf, starts, np.where(lengths > _MAX_HASHED, 0, lengths))
    for i in long.tolist():
        crc[i] = zlib.crc32(tokens.data[starts[i]:ends[i]])
    return FIRST_WORD_ID + crc.astype(np.int64) % (vocab - FIRST_WORD_ID)


def _crc32(buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """zlib.crc32 of each buf[start:start + length] (length <= _MAX_HASHED), for all words in a
    few numpy calls, whatever their lengths. CRC-32's register is linear over GF(2) in its
    initial value and its bytes, so a word's register is the XOR, over its bytes, of what each
    byte alone leaves in a zero register followed by the zero bytes that come after it in the
    word (`_BYTE_AT_END[k * 256 + byte]`), XOR what the all-ones initial register becomes after
    as many zero bytes as the word has (`_ONES_AFTER[n]`): a gather per byte, and each word's
    XOR from one prefix XOR over all bytes (before: a numpy pass per byte position)."""
    ends = np.cumsum(lengths)  # in the flat list of every word's bytes
    flat = np.arange(ends[-1] if len(ends) else 0)
    at = flat + np.repeat(starts - ends + lengths, lengths)  # each byte's position in buf
    after = np.repeat(ends - 1, lengths) - flat  # bytes after it in its word
    prefix = np.zeros(len(flat) + 1, dtype=np.uint32)  # [i]: XOR of the first i contributions
    np.bitwise_xor.accumulate(_BYTE_AT_END.take(after * 256 + buf.take(at)), out=prefix[1:])
    return ~(prefix.take(ends) ^ prefix.take(ends - lengths) ^ _ONES_AFTER.take(lengths))


def _crc_tables() -> tuple[np.ndarray, np.ndarray]:
    """From the byte table of reflected CRC-32 (zlib's): [k * 256 + byte]: a zero register after
    the byte and k zero bytes; [n]: the all-ones register after n zero bytes."""
    table = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        table = np.where(table & 1, (table >> 1) ^ np.uint32(0xEDB88320), table >> 1)
    step = lambda r: table[r & 0xFF] ^ (r >> 8)  # one zero byte
    at_end = [table]
    for _ in range(_MAX_HASHED):
        at_end.append(step(at_end[-1]))
    ones = [np.uint32(0xFFFFFFFF)]
    for _ in range(_MAX_HASHED + 1):
        ones.append(step(np.array(ones[-1], dtype=np.uint32)))
    return np.concatenate(at_end), np.array(ones, dtype=np.uint32)


_BYTE_AT_END, _ONES_AFTER = _crc_tables()
