"""The batch tree parser (batchmaker/core/tree_batch.py, through parse_trees) against a plain
recursive-descent parser written from the grammar alone: the same trees, word ids and node
numbering on random trees with words as SST spells them (escapes, quotes, accents, no-break
spaces inside words), and the same verdict, good or bad, on damaged strings."""
import random
import re
import zlib

import numpy as np
import pytest

from batchmaker.core.tree_batch import FIRST_WORD_ID, parse_brackets
from batchmaker.core.tree_input import MAX_DEPTH, parse_trees
from batchmaker.errors import BadRequestError
from batchmaker.unfolders.trees import load_sst_sample

VOCAB = 32000
SPACE = re.compile("[\t\n\x0b\x0c\r\x1c-\x1f ]+")  # ASCII whitespace as str.split() knows it
SST_WORDS = ["The", "Rock", "'s", "-LRB-", "-RRB-", "\\/", "\\*\\*\\*", "writer\\/director", "``", "''", "...", "--",
             "André", "Talancón", "García", "naïve", "é", "8\xa01", "\u2003", "\x85", "日本", "a", "x" * 70, ","]
SPACES = [" ", "  ", "\t", "\n", "\r\n", "\x0b", "\x1f "]


class Bad(Exception):
    pass


def reference(text: str, vocab: int = VOCAB, max_depth: int = MAX_DEPTH):
    """text -> (num_leaves, tokens, children) numbered as TreeArrays: leaves left to right, then
    internal nodes in post-order; Bad if the text breaks the grammar."""
    tokens = [t for t in SPACE.split(text.replace("(", " ( ").replace(")", " ) ")) if t]
    pos = 0

    def node(depth):  # "(" label (word | node | node node) ")" -> a leaf's word or (left, right)
        nonlocal pos
        if depth > max_depth or tokens[pos:pos + 1] != ["("] or pos + 1 >= len(tokens) or tokens[pos + 1] in "()":
            raise Bad
        pos += 2
        if pos < len(tokens) and tokens[pos] not in "()":
            pos += 1
            if tokens[pos:pos + 1] != [")"]:
                raise Bad
            pos += 1
            return tokens[pos - 2]
        children = []
        while pos < len(tokens) and tokens[pos] == "(":
            children.append(node(depth + 1))
        if not 1 <= len(children) <= 2 or tokens[pos:pos + 1] != [")"]:
            raise Bad
        pos += 1
        return children[0] if len(children) == 1 else tuple(children)

    tree = node(1)
    if pos != len(tokens):
        raise Bad
    words, pairs = [], []

    def number(t):  # leaves get 0.., internal nodes -1, -2, ... in post-order (renumbered below)
        if isinstance(t, str):
            words.append(t)
            return len(words) - 1
        left, right = number(t[0]), number(t[1])
        pairs.append((left, right))
        return -len(pairs)

    number(tree)
    n = len(words)
    ids = [FIRST_WORD_ID + zlib.crc32(w.encode()) % (vocab - FIRST_WORD_ID) for w in words]
    return n, ids, [[c if c >= 0 else n - 1 - c for c in pair] for pair in pairs]


def render(rng: random.Random, depth: int = 0) -> str:
    """A random tree in SST's bracket form, spaced at random where spaces are optional."""
    space = lambda: rng.choice(SPACES) if rng.random() < 0.2 else ""  # noqa: E731
    label = rng.choice("01234")
    if depth > 6 or rng.random() < 0.35:
        return f"({space()}{label}{rng.choice(SPACES) if rng.random() < 0.2 else ' '}{rng.choice(SST_WORDS)}{space()})"
    kids = [render(rng, depth + 1) for _ in range(2 if rng.random() < 0.9 else 1)]
    return f"({space()}{label} " + space().join(kids) + f"{space()})"


def damage(rng: random.Random, text: str) -> str:
    s = list(text)
    for _ in range(rng.randint(1, 2)):
        i = rng.randrange(len(s) + 1)
        if rng.random() < 0.4 and s:
            del s[min(i, len(s) - 1)]
        else:
            s.insert(i, rng.choice(["(", ")", " ", "w", "(2 x)", ")(", "(1 ", "(2 x y)", "(2 (2 a) (2 b) (2 c))"]))
    return "".join(s)


def assert_as_reference(texts: list[str], max_depth: int = MAX_DEPTH) -> None:
    arrays, good, errors = parse_trees(texts, VOCAB, max_depth)
    assert sorted(good + list(errors)) == list(range(len(texts)))
    assert all(isinstance(e, BadRequestError) for e in errors.values())
    k = 0
    for i, text in enumerate(texts):
        try:
            want = reference(text, VOCAB, max_depth)
        except Bad:
            assert i in errors, text
            continue
        assert good[k] == i, text
        n, tokens, children = arrays.tree(k)
        assert (n, tokens.tolist(), children.tolist()) == want, text
        k += 1


@pytest.mark.parametrize("seed", range(12))
def test_random_sst_like_trees_parse_as_the_recursive_reference(seed):
    rng = random.Random(seed)
    texts = [render(rng) for _ in range(rng.choice([16, 40, 130]))]
    assert_as_reference(texts)
    assert parse_brackets(texts, VOCAB, MAX_DEPTH)[1] == list(range(len(texts)))  # none left to the one-by-one path
    damaged = [damage(rng, t) if rng.random() < 0.3 else t for t in texts]
    assert_as_reference(damaged, max_depth=rng.choice([4, 8, MAX_DEPTH]))


def test_the_shipped_sst_sample_parses_as_the_recursive_reference():
    sample = load_sst_sample()
    assert_as_reference(sample)
    assert parse_brackets(sample, VOCAB, MAX_DEPTH)[1] == list(range(len(sample)))
    assert_as_reference(sample[::-1] + ["(2 a) (2 b)", "", "(2 (2 a) (2 b)", "(2 a\x1f)"])


def test_a_string_spread_over_two_joined_ones_is_two_bad_requests():
    """The batch joins its strings: a tree begun in one and finished in the next is neither."""
    good = "(3 (2 It) (4 (2 's) (2 good)))"
    texts = [good] * 20 + ["(2 a) (2 (2 b)", "(2 c))"] + [good] * 3
    arrays, ok, errors = parse_trees(texts, VOCAB)
    assert sorted(errors) == [20, 21] and ok == [i for i in range(25) if i not in (20, 21)]
    assert np.array_equal(arrays.num_leaves, [3] * 23)
