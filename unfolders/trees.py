"""Binary trees for the TreeLSTM: parse a request's tree into nested pairs of token ids.

Two input forms:
- nested lists: a leaf is an int token id in [0, vocab) or a str word; an internal node is a
  list/tuple of exactly 2 children; a 1-element list stands for its only child.
- a PTB/SST bracket string, e.g. "(3 (2 It) (4 (2 's) (2 good)))": every "(" is followed by a
  label (ignored), then either one word or one or two bracketed subtrees.

Words become ids by a stable hash, the same in every process and run:
    id = FIRST_WORD_ID + zlib.crc32(word as UTF-8) % (vocab - FIRST_WORD_ID)
so ids 0..2 (PAD, BOS, EOS in the other models) are never produced by a word.

The parsed tree (`Tree`) is an int for a leaf, or a (left, right) tuple for an internal node.
Nesting deeper than MAX_DEPTH is rejected, which also bounds recursion when unfolding.
"""
import re
import zlib
from pathlib import Path
from typing import Union

from batchmaker.errors import BadRequestError
from batchmaker.unfolders.common import is_int

Tree = Union[int, tuple["Tree", "Tree"]]
MAX_DEPTH = 512  # SST trees are at most ~30 deep; 512 stays far below Python's recursion limit
FIRST_WORD_ID = 3
_TOKEN = re.compile(r"\(|\)|[^\s()]+")


def word_id(word: str, vocab: int) -> int:
    return FIRST_WORD_ID + zlib.crc32(word.encode("utf-8")) % (vocab - FIRST_WORD_ID)


def parse_tree(value, vocab: int, max_depth: int = MAX_DEPTH) -> Tree:
    """A request's tree (nested lists or a bracket string) -> Tree, or BadRequestError."""
    if isinstance(value, str):
        return parse_bracketed(value, vocab, max_depth)
    return _parse_nested(value, vocab, max_depth, depth=1)


def _parse_nested(value, vocab: int, max_depth: int, depth: int) -> Tree:
    if depth > max_depth:
        raise BadRequestError(f"tree: deeper than {max_depth} levels")
    if isinstance(value, str):
        if not value or value.isspace():
            raise BadRequestError("tree: empty word")
        return word_id(value, vocab)
    if is_int(value):
        if not 0 <= value < vocab:
            raise BadRequestError(f"tree: token id {value} out of the vocabulary [0, {vocab})")
        return int(value)
    if not isinstance(value, (list, tuple)):
        raise BadRequestError(f"tree: a leaf must be an int token id or a str word, got {value!r}")
    if len(value) == 1:
        return _parse_nested(value[0], vocab, max_depth, depth + 1)
    if len(value) != 2:
        raise BadRequestError(f"tree: a node needs 1 or 2 children, got {len(value)}")
    return (_parse_nested(value[0], vocab, max_depth, depth + 1),
            _parse_nested(value[1], vocab, max_depth, depth + 1))


def parse_bracketed(text: str, vocab: int, max_depth: int = MAX_DEPTH) -> Tree:
    """"(label word)" is a leaf; "(label T1)" is T1; "(label T1 T2)" is the pair (T1, T2)."""
    open_nodes: list[list] = []  # per open "(": [children, num_words]
    root = None
    expect_label = False
    for token in _TOKEN.findall(text):
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


def _close(children: list, num_words: int) -> Tree:
    if num_words and len(children) != 1:
        raise BadRequestError("tree: a bracket holds either one word or one or two subtrees")
    if not children:
        raise BadRequestError("tree: empty brackets")
    if len(children) > 2:
        raise BadRequestError(f"tree: a node needs 1 or 2 children, got {len(children)}")
    return children[0] if len(children) == 1 else (children[0], children[1])


def num_leaves(tree: Tree) -> int:
    return 1 if isinstance(tree, int) else num_leaves(tree[0]) + num_leaves(tree[1])


def load_sst_sample() -> list[str]:
    """The first 200 trees of the SST dev split, one bracket string each (see data/README.md)."""
    path = Path(__file__).parent / "data" / "sst_dev_sample.txt"
    return path.read_text(encoding="utf-8").splitlines()
