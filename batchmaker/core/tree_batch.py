"""Many SST/PTB bracket strings parsed at once, with numpy over their bytes (parse_trees' batch
path, batchmaker/core/tree_input.py, which keeps the one-by-one path and the reference parser).

The strings are joined as bytes; one pass classifies the bytes, and only the brackets and the
starts of runs of text (labels and words) are kept. The reference's rules then read as counts:
between two brackets lie as many runs as "(" "(" (a label), "(" ")" (a label and a word) and
")" x (none) allow, none outside the brackets; the depth after each bracket (a cumulative sum)
stays in 1..max_depth inside a string and is 0 at its last bracket only. A batch that follows
them all is checked in a few calls over its brackets; a string that breaks one is found and left
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
_SEP = b"\x1f"  # joins the strings: a space to the rules, and below every text byte but control bytes
_MAX_HASHED = 64  # longer words are hashed one by one (zlib): the tables below stop there


@dataclass(frozen=True, slots=True)
class _Brackets:
    """Bracket strings as UTF-8 joined by _SEP after one (no byte of a multi-byte character is
    below 128, so splitting the bytes splits the text as _tokens does): where its tokens (brackets
    and runs of text: labels and words) start, which are brackets, and the depth after each ")"."""

    data: bytes
    starts: np.ndarray  # [num_strings] int64: each string's first byte
    ends: np.ndarray  # [num_strings] int64: one past its last
    token_pos: np.ndarray  # [num_tokens] int64: the first byte of each token
    bracket_at: np.ndarray  # [num_brackets] int64: each bracket's token
    is_open: np.ndarray  # [num_brackets] bool
    closes: np.ndarray  # [num_closes] int64: the bracket index of each ")"
    depth: np.ndarray  # [num_closes] int64: the depth after each ")", counted from the first string

    @staticmethod
    def of(texts: list[str]) -> "_Brackets":
        try:
            parts = list(map(str.encode, texts))
        except UnicodeEncodeError:
            parts = list(map(_utf8, texts))
        sizes = np.fromiter(map(len, parts), dtype=np.int64, count=len(parts))
        data = _SEP + _SEP.join(parts)
        starts = np.cumsum(sizes + 1) - sizes
        buf = np.frombuffer(data, dtype=np.uint8)
        bracket = (buf == _OPEN) | (buf == _CLOSE)
        if buf.min() < 31:  # control bytes: some are spaces, some text
            text = ~(IS_SPACE[buf] | bracket)
        else:  # text is above b" " (and _SEP below it)
            text = (buf > 32) ^ bracket
        is_token = bracket.copy()
        is_token[1:] |= text[1:] > text[:-1]  # (data starts with _SEP: no run starts at 0)
        token_pos = np.flatnonzero(is_token)
        kind = buf[token_pos]
        bracket_at = np.flatnonzero(kind - np.uint8(_OPEN) < 2)  # "(" or ")"
        is_open = kind[bracket_at] == _OPEN
        closes = np.flatnonzero(~is_open)
        depth = closes - np.arange(1, 2 * len(closes), 2)  # opens through it, less closes through it
        return _Brackets(data, starts, starts + sizes, token_pos, bracket_at, is_open, closes, depth)

    def broken(self, max_depth: int) -> np.ndarray:
        """[num_strings] bool: the strings that break a rule (of those roots() checks)."""
        broken = self._broken_strings(max_depth)
        return broken if broken.any() else np.ones(len(broken), dtype=bool)  # (not reached: all to the one-by-one path)

    def _runs_allowed(self) -> np.ndarray:
        """[num_brackets - 1] int64: the runs of text allowed between each bracket and the next: a
        label between "(" and "(", a label and a word between "(" and ")", none after ")"."""
        o = self.is_open.view(np.int8)
        allowed = np.int8(2) - o[1:]
        allowed *= o[:-1]
        return allowed.astype(np.int64)

    def roots(self, max_depth: int) -> np.ndarray | None:
        """Each tree's last ")" (an index into closes) if every string follows the rules of
        parse_bracketed ("(" label, then a word or subtrees, then ")"; one tree; at most max_depth
        deep) but "at most two subtrees in a bracket" (_shape checks that); else None. Checked for
        the batch at once: each string is spaces, one tree, spaces, when between brackets lie the
        runs allowed and none lie outside them, depth is 0 after one ")" per string, its last
        bracket, and within 0..max_depth (its extremes are next to a ")"), and tree t begins and
        ends in string t."""
        at, closes, depth, starts = self.bracket_at, self.closes, self.depth, self.starts
        if not len(closes):
            return None
        roots = np.flatnonzero(depth == 0)
        last = closes[roots]  # each tree's last bracket
        if not (len(roots) == len(starts) and last[-1] == len(at) - 1 and at[0] == 0
                and at[-1] == len(self.token_pos) - 1 and depth.min() >= 0 and depth.max() < max_depth):
            return None
        first = np.append(0, last[:-1] + 1)  # each tree's first bracket
        runs = np.subtract(at[1:], at[:-1])
        runs -= 1
        if (np.array_equal(runs, self._runs_allowed())
                and (self.token_pos[at[first]] >= starts).all() and (self.token_pos[at[last]] < self.ends).all()):
            return roots
        return None

    def _broken_strings(self, max_depth: int) -> np.ndarray:
        """broken() string by string: a run is wrong before its string's first bracket or past
        the runs its bracket allows; a bracket is wrong with fewer runs after it than allowed, or
        where its depth (from its string's start) leaves 1..max_depth, or is not 0 at its last."""
        starts, at = self.starts, self.bracket_at
        pos = self.token_pos[at]
        string_of = np.searchsorted(starts, pos, side="right") - 1  # [num_brackets]
        first = np.searchsorted(pos, starts)
        counts = np.searchsorted(pos, self.ends) - first  # brackets per string
        broken = counts == 0
        allowed = np.append(self._runs_allowed(), 0)  # (after the last bracket: none, or it is "(", unbalanced)
        is_run = np.ones(len(self.token_pos), dtype=bool)
        is_run[at] = False
        runs = np.flatnonzero(is_run)  # [num_runs]: their tokens
        gap = np.cumsum(~is_run)[runs] - 1  # the bracket before each run (-1: none)
        after = np.maximum(gap, 0)
        run_string = np.searchsorted(starts, self.token_pos[runs], side="right") - 1
        wrong = (gap < 0) | (run_string != string_of[after]) | (runs - at[after] > allowed[after])
        broken[run_string[wrong]] = True
        broken[string_of[np.diff(at, append=len(is_run)) - 1 < allowed]] = True
        depth = np.cumsum(self.is_open.view(np.int8) * 2 - 1)
        depth -= np.repeat(np.concatenate(([0], depth))[first], counts)
        last = np.zeros(len(pos), dtype=bool)
        last[(first + counts - 1)[counts > 0]] = True
        broken[string_of[(depth > max_depth) | np.where(last, depth != 0, depth < 1)]] = True
        return broken


def _utf8(text: str) -> bytes:
    try:
        return text.encode()
    except UnicodeEncodeError:  # a lone surrogate: b"" breaks a rule, so the reference decides
        return b""


def parse_brackets(texts: list[str], vocab: int, max_depth: int) -> tuple[TreeArrays, list[int]]:
    """parse_bracketed's rules applied to all `texts` at once, with numpy over their bytes ->
    (the arrays of those that follow the rules, their positions in `texts`). A batch with
    strings that break one is parsed again without them."""
    if not texts:
        return _NO_TREES, []
    brackets = _Brackets.of(texts)
    roots = brackets.roots(max_depth)
    if roots is None:
        broken = brackets.broken(max_depth)
    else:
        broken, shape = _shape(brackets, roots, max_depth)
    if broken.any():
        kept = np.flatnonzero(~broken).tolist()
        arrays, parsed = parse_brackets([texts[i] for i in kept], vocab, max_depth)
        return arrays, [kept[j] for j in parsed]
    num_leaves, children, word_starts, word_ends = shape
    return TreeArrays(num_leaves, _hashed_words(brackets.data, word_starts, word_ends, vocab), children), \
        list(range(len(texts)))


_NO_TREES = TreeArrays(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros((0, 2), dtype=np.int64))


def _shape(brackets: _Brackets, roots: np.ndarray, max_depth: int) -> tuple[np.ndarray, tuple | None]:
    """The trees of strings that passed broken(), read off their ")"s -> ([num_strings] bool: a
    bracket holds three subtrees or more, (num_leaves, children as in TreeArrays, each word's
    first and past-the-end byte) or None if any does). A ")" after "(" closes a leaf; one after
    a ")" closes "(label T)", which is T, or "(label T1 T2)", an internal node, when T2 has a
    sibling before it (the ")" before T2's at its depth is followed by "("). Nodes are numbered
    in ")" order."""
    is_open, closes, depth = brackets.is_open, brackets.closes, brackets.depth
    holds_word = is_open[closes - 1]
    order = np.argsort(depth.astype(np.int16) if max_depth < 2**15 else depth, kind="stable")  # (a radix sort)
    by_depth = depth[order]
    before = np.empty(len(closes), dtype=np.int64)  # the ")" before each at its depth (each string starts at depth 0)
    before[order[0]] = -1
    before[order[1:]] = np.where(by_depth[1:] == by_depth[:-1], order[:-1], -1)
    followed_by_open = np.append(is_open[closes[:-1] + 1], False)  # (so for before -1 too)
    has_sibling = followed_by_open[before]
    pair_at = np.flatnonzero(~holds_word[1:] & has_sibling[:-1]) + 1  # the ")"s of internal nodes
    right = pair_at - 1
    left = before[right]
    too_wide = has_sibling[left]
    no_string = np.zeros(len(brackets.starts), dtype=bool)
    if too_wide.any():
        wide_at = brackets.token_pos[brackets.bracket_at[closes[pair_at[too_wide]]]]
        no_string[np.searchsorted(brackets.starts, wide_at, side="right") - 1] = True
        return no_string, None
    word_at = np.flatnonzero(holds_word)
    num_leaves = np.searchsorted(word_at, roots, side="right")  # through each tree, then
    num_leaves[1:] -= num_leaves[:-1].copy()
    node = np.zeros(len(closes), dtype=np.int64)  # each ")"'s node, numbered as in TreeArrays
    leaves_before = np.cumsum(num_leaves) - num_leaves  # tree t's internal nodes: n_t + (pairs before it in t)
    pairs_before = leaves_before - np.arange(len(num_leaves))
    node[word_at] = np.arange(len(word_at)) - np.repeat(leaves_before, num_leaves)
    node[pair_at] = np.arange(len(pair_at)) - np.repeat(pairs_before - num_leaves, num_leaves - 1)
    if len(word_at) + len(pair_at) < len(closes):  # "(label T)" is the node of the ")" just before it
        made = np.zeros(len(closes), dtype=np.int64)
        made[word_at], made[pair_at] = word_at, pair_at
        node = node[np.maximum.accumulate(made)]
    children = np.empty((len(pair_at), 2), dtype=np.int64)
    children[:, 0], children[:, 1] = node[left], node[right]
    leaf_closes = brackets.bracket_at[closes[word_at]]  # their tokens: each word is the one before
    return no_string, (num_leaves, children, brackets.token_pos[leaf_closes - 1], brackets.token_pos[leaf_closes])


def _hashed_words(data: bytes, starts: np.ndarray, ends: np.ndarray, vocab: int) -> np.ndarray:
    """word_id of the words at data[start:end] (ends: the ")" after each), all at once."""
    buf = np.frombuffer(data, dtype=np.uint8)
    if not (buf.take(ends - 1) > 32).all() and IS_SPACE[buf[ends - 1]].any():  # "(label word )": a word
        # ends where its run of text does
        text = ~(IS_SPACE[buf] | (buf == _OPEN) | (buf == _CLOSE))
        run_ends = np.flatnonzero(text[:-1] > text[1:]) + 1
        ends = run_ends[np.searchsorted(run_ends, starts, side="right")]
    lengths = ends - starts
    long = np.flatnonzero(lengths > _MAX_HASHED).tolist() if lengths.max(initial=0) > _MAX_HASHED else []
    crc = _crc32(buf, starts, np.where(lengths > _MAX_HASHED, 0, lengths) if long else lengths)
    for i in long:
        crc[i] = zlib.crc32(data[starts[i]:ends[i]])
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
    per_word = np.empty((len(lengths), 2), dtype=np.int64)
    per_word[:, 0], per_word[:, 1] = starts - ends + lengths, (ends - 1) * 256
    per_byte = np.repeat(per_word, lengths, axis=0)
    at = per_byte[:, 0] + flat  # each byte's position in buf
    flat *= 256
    index = per_byte[:, 1] - flat  # 256 x (bytes after it in its word)
    index += buf.take(at)
    prefix = np.zeros(len(flat) + 1, dtype=np.uint32)  # [i]: XOR of the first i contributions
    np.bitwise_xor.accumulate(_BYTE_AT_END.take(index), out=prefix[1:])
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
