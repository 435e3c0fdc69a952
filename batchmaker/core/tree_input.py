"""Binary trees of requests: parsed one at a time into nested pairs, or many at once into arrays.

Two input forms:
- nested lists: a leaf is an int token id in [0, vocab) or a str word; an internal node is a
  list/tuple of exactly 2 children (anything else is rejected: the tree is binary).
- a PTB/SST bracket string, e.g. "(3 (2 It) (4 (2 's) (2 good)))": every "(" is followed by a
  label (ignored), then either one word or one or two bracketed subtrees; "(label T)" is T.
  Words are separated by ASCII whitespace (non-ASCII spaces such as U+00A0 belong to words).

Words become ids by a stable hash, the same in every process and run:
    id = FIRST_WORD_ID + zlib.crc32(word as UTF-8) % (vocab - FIRST_WORD_ID)
so ids 0..2 (PAD, BOS, EOS in the other models) are never produced by a word.

`parse_tree` gives a `Tree` (an int for a leaf, a (left, right) pair otherwise): the reference.
`parse_trees` gives a whole admission batch as `TreeArrays`, for the engine and the baselines.
The bracket strings of a batch go to arrays all at once, by numpy over their bytes (words hashed
by a table-driven CRC-32); a few trees, and strings the batch rejects, one by one in one pass
over their tokens; a string rejected there goes to the reference, which words the error. All
follow the reference's rules (tested against it).
"""
import re
import zlib
from dataclasses import dataclass
from typing import Union

import numpy as np

from batchmaker.core.admission import is_int
from batchmaker.errors import BadRequestError

Tree = Union[int, tuple["Tree", "Tree"]]
MAX_DEPTH = 512  # SST trees are at most ~30 deep; nesting is never recursed on, so any bound is safe
FIRST_WORD_ID = 3


def word_id(word: str | bytes, vocab: int) -> int:
    data = word.encode("utf-8") if isinstance(word, str) else word
    return FIRST_WORD_ID + zlib.crc32(data) % (vocab - FIRST_WORD_ID)


def parse_tree(value, vocab: int, max_depth: int = MAX_DEPTH) -> Tree:
    """A request's tree (nested lists or a bracket string) -> Tree, or BadRequestError."""
    if isinstance(value, str):
        return parse_bracketed(value, vocab, max_depth)
    return _parse_nested(value, vocab, max_depth)


def _leaf(value, vocab: int) -> int:
    if isinstance(value, str):
        if not value or value.isspace():
            raise BadRequestError("tree: empty word")
        return word_id(value, vocab)
    if is_int(value):
        if not 0 <= value < vocab:
            raise BadRequestError(f"tree: token id {value} out of the vocabulary [0, {vocab})")
        return int(value)
    raise BadRequestError(f"tree: a leaf must be an int token id or a str word, got {value!r:.60}")


def _parse_nested(value, vocab: int, max_depth: int) -> Tree:
    """Iterative (an explicit stack), so that no nesting can reach Python's recursion limit."""
    if not isinstance(value, (list, tuple)):
        return _leaf(value, vocab)
    done: list[Tree] = []  # finished subtrees, children before parents
    stack = [(value, 1, False)]  # (node, depth, children pushed)
    while stack:
        node, depth, expanded = stack.pop()
        if depth > max_depth:
            raise BadRequestError(f"tree: deeper than {max_depth} levels")
        if not isinstance(node, (list, tuple)):
            done.append(_leaf(node, vocab))
        elif expanded:
            right, left = done.pop(), done.pop()
            done.append((left, right))
        else:
            if len(node) != 2:
                raise BadRequestError(f"tree: an internal node has exactly 2 children, got {len(node)}")
            stack += [(node, depth, True), (node[1], depth + 1, False), (node[0], depth + 1, False)]
    return done[0]


def parse_bracketed(text: str, vocab: int, max_depth: int = MAX_DEPTH) -> Tree:
    """"(label word)" is a leaf; "(label T1)" is T1; "(label T1 T2)" is the pair (T1, T2)."""
    open_nodes: list[list] = []  # per open "(": [children, num_words]
    root = None
    expect_label = False
    for token in _tokens(text):
        if root is not None:
            raise BadRequestError(f"tree: text after the end of the tree at {token!r}")
        if expect_label:
            if token in ("(", ")"):
                raise BadRequestError("tree: expected a label after '('")
            expect_label = False
        elif token == "(":
            if len(open_nodes) == max_depth:
                raise BadRequestError(f"tree: deeper than {max_depth} levels")
            open_nodes.append([[], 0])
            expect_label = True
        elif token == ")":
            if not open_nodes:
                raise BadRequestError("tree: unbalanced ')'")
            node = _close(*open_nodes.pop())
            if open_nodes:
                open_nodes[-1][0].append(node)
            else:
                root = node
        elif not open_nodes:
            raise BadRequestError(f"tree: word {token!r} outside brackets")
        else:
            open_nodes[-1][0].append(word_id(token, vocab))
            open_nodes[-1][1] += 1
    if open_nodes:
        raise BadRequestError("tree: unbalanced '('")
    if root is None:
        raise BadRequestError("tree: empty")
    return root


def _tokens(text: str) -> list[str]:
    spaced = text.replace("(", " ( ").replace(")", " ) ")
    if spaced.isascii():
        return spaced.split()
    return [t for t in _ASCII_SPACE.split(spaced) if t]  # non-ASCII spaces (U+00A0) stay in words


_ASCII_SPACE = re.compile("[\t\n\x0b\x0c\r\x1c-\x1f ]+")  # what str.split() splits ASCII text on


def _close(children: list, num_words: int) -> Tree:
    if num_words and len(children) != 1:
        raise BadRequestError("tree: a bracket holds either one word or one or two subtrees")
    if not children:
        raise BadRequestError("tree: empty brackets")
    if len(children) > 2:
        raise BadRequestError(f"tree: a node needs 1 or 2 children, got {len(children)}")
    return children[0] if len(children) == 1 else (children[0], children[1])


def num_leaves(tree: Tree) -> int:
    count, stack = 0, [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, int):
            count += 1
        else:
            stack += node
    return count


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
        return TreeArrays(n[order], self.tokens[_ranges(leaf_at[order], n[order])],
                          self.children[_ranges(leaf_at[order] - order, n[order] - 1)])


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """start..start+count-1 for each (start, count), concatenated."""
    ends = np.cumsum(counts)
    return np.repeat(starts - ends + counts, counts) + np.arange(ends[-1] if len(ends) else 0)


def parse_trees(values: list, vocab: int, max_depth: int = MAX_DEPTH) -> tuple[TreeArrays, list[int], dict]:
    """Many requests' trees -> (arrays of the good ones, their positions in `values`,
    {position: BadRequestError} for the bad ones). The bracket strings of a batch are parsed all
    at once (_parse_brackets); small batches, nested lists and strings that break a rule one by one."""
    texts = [i for i, value in enumerate(values) if isinstance(value, str)]
    if len(texts) < _MIN_BATCH:
        return _parse_each(values, vocab, max_depth)
    batch, parsed = _parse_brackets([values[i] for i in texts], vocab, max_depth)
    if len(parsed) == len(values):
        return batch, parsed, {}
    good = [texts[j] for j in parsed]
    rest = sorted(set(range(len(values))).difference(good))
    arrays, ok, errors = _parse_each([values[i] for i in rest], vocab, max_depth)
    good += [rest[j] for j in ok]
    return batch.concat(arrays).take(np.argsort(good)), sorted(good), {rest[j]: e for j, e in errors.items()}


_MIN_BATCH = 16  # below, numpy's fixed costs exceed parsing one by one


def _parse_each(values: list, vocab: int, max_depth: int) -> tuple[TreeArrays, list[int], dict]:
    """parse_trees one tree at a time: bracket strings in one pass over their tokens each."""
    counts, tokens, children, good, errors = [], [], [], [], {}
    ids = _word_ids.setdefault(vocab, {})
    if len(ids) > _MAX_CACHED:  # words come from clients: bound what is remembered
        ids.clear()
    for i, value in enumerate(values):
        try:
            if isinstance(value, str):
                try:
                    n = _bracketed_arrays(value, max_depth, ids, vocab, tokens, children)
                except BadRequestError:  # the reference parser words the error (or disagrees: then it wins)
                    n = _append(_tree_to_arrays(parse_tree(value, vocab, max_depth)), tokens, children)
            else:
                n = _append(_tree_to_arrays(parse_tree(value, vocab, max_depth)), tokens, children)
            counts.append(n)
            good.append(i)
        except BadRequestError as e:
            errors[i] = e
    num_leaves = np.array(counts, dtype=np.int64)
    children = np.array(children, dtype=np.int64).reshape(-1, 2)
    internal = children < 0  # the k-th internal node of a tree with n leaves is node n + k
    leaves_of = np.repeat(num_leaves, np.maximum(num_leaves - 1, 0))[:, None]
    children = np.where(internal, leaves_of + ~children, children)
    return TreeArrays(num_leaves, np.array(tokens, dtype=np.int64), children), good, errors


def _append(parsed: tuple, tokens: list, children: list) -> int:
    """Append one tree's arrays (numbered as TreeArrays) as parse_trees collects them."""
    n, leaf_tokens, pairs = parsed
    tokens += leaf_tokens.tolist()
    children += np.where(pairs >= n, ~(pairs - n), pairs).ravel().tolist()
    return n


def _bracketed_arrays(text: str, max_depth: int, ids: dict, vocab: int, tokens: list, children: list) -> int:
    """parse_bracketed's rules in one pass, appending the tree's leaf ids to `tokens` and its
    internal nodes' (left, right) to `children` (a leaf as its index, the k-th internal node
    closed as ~k); returns the number of leaves. `values` holds the finished subtrees, `marks`
    where each open bracket's children start in it. All or nothing: appends only on success."""
    words: list[str] = []
    pairs: list[int] = []
    values: list[int] = []
    marks: list[int] = []
    mark, unmark, push = marks.append, marks.pop, values.append
    it = iter(_tokens(text))
    for token in it:
        if token == "(":
            if not marks and values:
                raise BadRequestError("tree: text after the end of the tree at '('")
            label = next(it, ")")
            if label == "(" or label == ")":
                raise BadRequestError("tree: expected a label after '('")
            mark(len(values))
            if len(marks) > max_depth:
                raise BadRequestError(f"tree: deeper than {max_depth} levels")
        elif token == ")":
            if not marks:
                raise BadRequestError("tree: unbalanced ')'" if not values else "tree: text after the end of the tree at ')'")
            num_children = len(values) - unmark()
            if num_children == 2:
                pairs += values[-2:]
                values[-2:] = [~(len(pairs) // 2 - 1)]
            elif num_children != 1:
                raise BadRequestError("tree: empty brackets" if not num_children else
                                      f"tree: a node needs 1 or 2 children, got {num_children}")
        else:  # a word: alone in its bracket, "(label word)"
            if not marks:
                raise BadRequestError(f"tree: word {token!r} outside brackets" if not values else
                                      f"tree: text after the end of the tree at {token!r}")
            if len(values) != unmark() or next(it, None) != ")":
                raise BadRequestError("tree: a bracket holds either one word or one or two subtrees")
            push(len(words))
            words.append(token)
    if marks:
        raise BadRequestError("tree: unbalanced '('")
    if not values:
        raise BadRequestError("tree: empty")
    found = [ids.get(w) for w in words]
    if None in found:
        found = [i if i is not None else ids.setdefault(w, word_id(w, vocab)) for w, i in zip(words, found)]
    tokens += found
    children += pairs
    return len(words)


_word_ids: dict[int, dict[str, int]] = {}  # vocab -> word -> id, for words seen
_MAX_CACHED = 1 << 17


_OPEN, _CLOSE = ord("("), ord(")")
_IS_SPACE = np.zeros(256, dtype=bool)  # per byte: is it one _tokens splits on
_IS_SPACE[list(b"\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f ")] = True
_MAX_HASHED = 64  # longer words are hashed one by one (zlib), not one numpy pass per byte


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
            space = _IS_SPACE[buf]
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


def _parse_brackets(texts: list[str], vocab: int, max_depth: int) -> tuple[TreeArrays, list[int]]:
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
    node[word_at] = _ranges(0 * num_leaves, num_leaves)
    node[pair_at] = _ranges(num_leaves, num_leaves - 1)
    node = node[made]
    children = np.empty((len(pair_at), 2), dtype=np.int64)
    children[:, 0], children[:, 1] = node[left], node[right]
    return too_wide, (num_leaves, children, words)


def _hashed_words(tokens: _Tokens, words: np.ndarray, vocab: int) -> np.ndarray:
    """word_id of the words at these token indices (each followed by its ")"), all at once."""
    buf = np.frombuffer(tokens.data, dtype=np.uint8)
    starts, ends = tokens.pos[words], tokens.pos[words + 1]
    if _IS_SPACE[buf[ends - 1]].any():  # "(label word )": a word ends where its run of text does
        text = ~(_IS_SPACE[buf] | (buf == _OPEN) | (buf == _CLOSE))
        run_ends = np.flatnonzero(text[:-1] > text[1:]) + 1
        ends = run_ends[np.searchsorted(run_ends, starts, side="right")]
    lengths = ends - starts
    long = np.flatnonzero(lengths > _MAX_HASHED)
    crc = _crc32(buf, starts, np.where(lengths > _MAX_HASHED, 0, lengths))
    for i in long.tolist():
        crc[i] = zlib.crc32(tokens.data[starts[i]:ends[i]])
    return FIRST_WORD_ID + crc.astype(np.int64) % (vocab - FIRST_WORD_ID)


def _crc32(buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """zlib.crc32 of each buf[start:start + length], table-driven: one numpy pass per byte
    position j, over the words longer than j."""
    order = np.argsort(-lengths.astype(np.int16), kind="stable")  # the longest first
    longer = np.searchsorted(-lengths[order], -np.arange(lengths.max(initial=0)))  # [j]: how many are longer than j
    column_at = np.cumsum(longer) - longer
    # byte j of each of the longer[j] longest words, column after column
    column = buf[starts[order][_ranges(0 * longer, longer)] + np.repeat(np.arange(len(longer)), longer)]
    crc = np.full(len(order), 0xFFFFFFFF, dtype=np.uint32)
    low, shifted = crc.view(np.uint8)[0 if np.little_endian else 3::4], np.empty_like(crc)  # low: each crc's low byte
    for k, at in zip(longer.tolist(), column_at.tolist()):
        np.right_shift(crc[:k], 8, out=shifted[:k])
        np.bitwise_xor(_CRC_TABLE[low[:k] ^ column[at:at + k]], shifted[:k], out=crc[:k])
    hashed = np.empty_like(crc)
    hashed[order] = ~crc
    return hashed


def _crc_table() -> np.ndarray:
    table = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        table = np.where(table & 1, (table >> 1) ^ np.uint32(0xEDB88320), table >> 1)
    return table


_CRC_TABLE = _crc_table()


def _tree_to_arrays(tree: Tree) -> tuple[int, np.ndarray, np.ndarray]:
    """A Tree -> (num_leaves, tokens, children), numbered as in TreeArrays (iteratively)."""
    tokens: list[int] = []
    pairs: list[int] = []
    done: list[int] = []  # finished subtrees: a leaf's number, or ~k for the k-th internal node
    stack = [tree]
    while stack:
        node = stack.pop()
        if node is None:  # both children are done
            pairs += done[-2:]
            done[-2:] = [~(len(pairs) // 2 - 1)]
        elif isinstance(node, int):
            done.append(len(tokens))
            tokens.append(node)
        else:
            stack += (None, node[1], node[0])
    children = np.array(pairs, dtype=np.int64).reshape(-1, 2)
    return len(tokens), np.array(tokens, dtype=np.int64), np.where(children < 0, len(tokens) + ~children, children)
