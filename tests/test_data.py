"""The synthetic WMT-15 length model matches the thesis' numbers (mean 24, p99 < 100, max 330); the
Fig. 2.11 variants, the Moses and tree-file readers and the Fig. 2.15 identical trees."""
import numpy as np
import pytest

from batchmaker.data import (LENGTH_VARIANTS, MAX_LENGTH, complete_trees, read_moses, read_parallel, read_trees,
                             variant_lengths, variant_sentences, wmt_lengths, wmt_sentences)
from batchmaker.unfolders.trees import num_leaves, parse_tree, word_id


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


# variants, readers and the fixed-tree dataset ----------------------------------------------------


def test_length_variants_match_fig_2_11():
    wmt = wmt_lengths(20_000, 5)
    assert np.array_equal(variant_lengths(20_000, "wmt", 5), wmt)
    assert set(variant_lengths(100, "all24").tolist()) == {24}
    for cap in (50, 100):
        lengths = variant_lengths(20_000, f"max{cap}", 5)
        assert lengths.max() == cap and np.array_equal(lengths, np.minimum(wmt, cap))
    with pytest.raises(ValueError):
        variant_lengths(10, "max7")
    assert set(LENGTH_VARIANTS) == {"wmt", "all24", "max50", "max100"}


def test_variant_sentences_keep_tokens_and_lengths():
    cut = variant_sentences(300, vocab=100, variant="max50", seed=2)
    full = wmt_sentences(300, vocab=100, seed=2)
    assert all(c == f[:50] for c, f in zip(cut, full))
    fixed = variant_sentences(50, vocab=100, variant="all24", seed=2)
    assert all(len(s) == 24 and min(s) >= 3 and max(s) < 100 for s in fixed)


def test_read_moses_and_parallel(tmp_path):
    de, en = tmp_path / "europarl.de", tmp_path / "europarl.en"
    de.write_text("Guten Morgen , Welt\n\nein  zwei\n", encoding="utf-8")
    en.write_text("Good morning , world\nnothing here\n\n", encoding="utf-8")
    sentences = read_moses(de, vocab=1000)
    assert [len(s) for s in sentences] == [4, 0, 2]
    assert sentences[0][0] == word_id("Guten", 1000) and all(3 <= t < 1000 for t in sentences[0])
    assert read_moses(de, vocab=1000, max_length=2)[0] == sentences[0][:2]
    assert read_parallel(de, en, vocab=1000) == [(sentences[0], 4)]  # empty sides dropped
    en.write_text("one line\n", encoding="utf-8")
    with pytest.raises(ValueError):
        read_parallel(de, en, vocab=1000)


def test_read_trees(tmp_path):
    path = tmp_path / "trees.txt"
    path.write_text("(3 (2 It) (3 good))\n\n  (1 bad)  \n", encoding="utf-8")
    assert read_trees(path) == ["(3 (2 It) (3 good))", "(1 bad)"]


def test_complete_trees_are_identical_in_shape():
    trees = complete_trees(20, vocab=100, num_leaves=16, seed=1)
    assert len(trees) == 20 and trees == complete_trees(20, vocab=100, num_leaves=16, seed=1)
    for t in trees:
        parsed = parse_tree(t, 100)
        assert num_leaves(parsed) == 16
        assert str(parsed).count("(") == 15  # 15 internal nodes: 31 cells per tree
    with pytest.raises(ValueError):
        complete_trees(1, vocab=100, num_leaves=12)
