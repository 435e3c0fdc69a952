"""Binary trees of requests: parsed one at a time into nested pairs, or many at once into arrays.

Two input forms:
- nested lists: a leaf is an int token id in [0, vocab) or a str word; an internal node is a
  list/tuple of 2 children, and a 1-element list/tuple is its child (as "(label T)" below), so
  `[[[3]], [[4], [5]]]` is the tree `[3, [4, 5]]`; any other length is rejected (the tree is binary).
- a PTB/SST bracket string, e.g. "(3 (2 It) (4 (2 's) (2 good)))": every "(" is followed by a
  label (ignored), then either one word or one or two bracketed subtrees; "(label T)" is T.
  Words are separated by ASCII whitespace (non-ASCII spaces such as U+00A0 belong to words).

Words become ids by a stable hash, the same in every process and run:
    id = FIRST_WORD_ID + zlib.crc32(word as UTF-8) % (vocab - FIRST_WORD_ID)
so ids 0..2 (PAD, BOS, EOS in the other models) are never produced by a word.

`parse_tree` gives a `Tree` (an int for a leaf, a (left, right) pair otherwise): the reference.
`parse_trees` gives a whole admission batch as `TreeArrays`, for the engine and the baselines.
The bracket strings of a batch go to arrays all at once, by numpy over their bytes (words hashed
by CRC-32 for all words at once: batchmaker/core/tree_batch.py); a few trees, and strings the batch rejects, one by one in one pass
over their tokens; a string rejected there goes to the reference, which words the error. All
follow the reference's rules (tested against it).
"""
import re
import zlib
from typing import Union

import numpy as np

from batchmaker.core.admission import is_int
from batchmaker.core.tree_batch import FIRST_WORD_ID, TreeArrays, parse_brackets
from batchmaker.errors import BadRequestError

Tree = Union[int, tuple["Tree", "Tree"]]
MAX_DEPTH = 512  # SST trees are at most ~30 deep; nesting is never recursed on, so any bound is safe


def word_id(word: str | bytes, vocab: int) -> int:
    try:
        data = word.encode("utf-8") if isinstance(word, str) else word
    except UnicodeEncodeError:  # a lone surrogate (possible in-process only): the request's own error
        raise BadRequestError(f"tree: word {word!r:.40} is not valid Unicode text") from None
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
        elif len(node) == 1:  # a 1-element list is its child: the child's subtree takes its place in `done`
            stack.append((node[0], depth + 1, False))
        elif len(node) == 2:
            stack += [(node, depth, True), (node[1], depth + 1, False), (node[0], depth + 1, False)]
        else:
            raise BadRequestError(f"tree: a node needs 1 or 2 children, got {len(node)}")
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


def parse_trees(values: list, vocab: int, max_depth: int = MAX_DEPTH) -> tuple[TreeArrays, list[int], dict]:
    """Many requests' trees -> (arrays of the good ones, their positions in `values`,
    {position: BadRequestError} for the bad ones). The bracket strings of a batch are parsed all
    at once (batchmaker/core/tree_batch.py); small batches, nested lists and strings that break a rule one by one."""
    if set(map(type, values)) == {str}:  # (the common case, without a pass in Python)
        texts = range(len(values))
    else:
        texts = [i for i, value in enumerate(values) if isinstance(value, str)]
    if len(texts) < _MIN_BATCH:
        return _parse_each(values, vocab, max_depth)
    strings = values if len(texts) == len(values) else [values[i] for i in texts]
    batch, parsed = parse_brackets(strings, vocab, max_depth)
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
