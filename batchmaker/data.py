"""Benchmark data: synthetic WMT-15 Europarl-like workloads (the real corpus is not available
offline), their length-variance variants (thesis Fig. 2.11), a Moses-format parallel-text reader,
a bracketed-tree file reader and the identical-tree dataset of Fig. 2.15.

Sentence lengths follow a log-normal clipped to [1, MAX_LENGTH] and rounded to integers. The thesis
gives three numbers for its 100k sampled English sentences (§2.7, Fig. 2.10): mean length 24,
about 99% shorter than 100, longest 330. A log-normal has the right shape for sentence lengths
(right-skewed, a long thin tail) and two parameters, fitted as follows:
- SIGMA = 0.65 puts the 99th percentile at exp(MU + 2.326 * SIGMA) ~= 88 (0.6% of sentences are
  >= 100), and the expected largest of 100k draws (z ~= 4.26) at ~= 310, so the clip at 330 is
  reached only rarely instead of piling up mass there. SIGMA = 0.7 would put p99 at ~96 and the
  100k maximum at ~380 (clipped), SIGMA = 0.6 would make the tail too short (max ~250).
- MU = ln(24) - SIGMA^2 / 2 makes the mean exactly 24 before rounding and clipping (both change
  it by well under 0.1).
Token ids are uniform in [FIRST_TOKEN, vocab): ids 0..2 are PAD, BOS and EOS in the built-in models.
"""
import math

import numpy as np

MEAN_LENGTH = 24
MAX_LENGTH = 330
SIGMA = 0.65
MU = math.log(MEAN_LENGTH) - SIGMA**2 / 2
FIRST_TOKEN = 3


def wmt_lengths(n: int, seed: int = 0) -> np.ndarray:
    """n sentence lengths (int64, in [1, MAX_LENGTH]), the same for the same seed."""
    rng = np.random.default_rng(seed)
    return np.clip(np.rint(rng.lognormal(MU, SIGMA, size=n)), 1, MAX_LENGTH).astype(np.int64)


def wmt_sentences(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """n sentences of token ids in [FIRST_TOKEN, vocab), lengths from wmt_lengths(n, seed)."""
    if vocab <= FIRST_TOKEN:
        raise ValueError(f"vocab must exceed {FIRST_TOKEN} (reserved ids), got {vocab}")
    lengths = wmt_lengths(n, seed)
    rng = np.random.default_rng([seed, 1])  # a stream of its own: lengths do not depend on vocab
    tokens = rng.integers(FIRST_TOKEN, vocab, size=int(lengths.sum()))
    bounds = np.cumsum(lengths)[:-1]
    return [chunk.tolist() for chunk in np.split(tokens, bounds)]


# Length-variance variants (thesis Fig. 2.11) --------------------------------------------------
# "all24": every sentence has the WMT mean length; "max50"/"max100": WMT lengths clipped
# (truncated) to at most 50/100 tokens, as the thesis samples them "by clipping the maximum
# sequence length"; "wmt": the full length model above.
LENGTH_VARIANTS = ("wmt", "all24", "max50", "max100")


def variant_lengths(n: int, variant: str = "wmt", seed: int = 0) -> np.ndarray:
    """n lengths of a Fig. 2.11 variant; "wmt" is wmt_lengths itself."""
    if variant not in LENGTH_VARIANTS:
        raise ValueError(f"unknown length variant {variant!r}; known: {', '.join(LENGTH_VARIANTS)}")
    if variant == "all24":
        return np.full(n, MEAN_LENGTH, dtype=np.int64)
    lengths = wmt_lengths(n, seed)
    return lengths if variant == "wmt" else np.minimum(lengths, int(variant.removeprefix("max")))


def variant_sentences(n: int, vocab: int, variant: str = "wmt", seed: int = 0) -> list[list[int]]:
    """wmt_sentences(n, vocab, seed) cut to the variant's lengths (the same tokens, prefixes kept)."""
    lengths = variant_lengths(n, variant, seed)
    if variant == "all24":  # longer than many WMT sentences: draw tokens of its own
        rng = np.random.default_rng([seed, 2])
        return rng.integers(FIRST_TOKEN, max(vocab, FIRST_TOKEN + 1), size=(n, MEAN_LENGTH)).tolist()
    return [s[:k] for s, k in zip(wmt_sentences(n, vocab, seed), lengths.tolist())]


# Moses-format parallel text (e.g. europarl-v7.de-en.de / .en) ---------------------------------

def read_moses(path, vocab: int, max_length: int = MAX_LENGTH) -> list[list[int]]:
    """One sentence per line, tokens split on whitespace, each word -> an id in [FIRST_TOKEN, vocab)
    by the stable hash of batchmaker.unfolders.trees.word_id; empty lines give []; sentences longer
    than max_length are cut to it."""
    from batchmaker.unfolders.trees import word_id  # the one word hash of the project
    with open(path, encoding="utf-8") as f:
        return [[word_id(w, vocab) for w in line.split()[:max_length]] for line in f]


def read_parallel(source_path, target_path, vocab: int,
                  max_length: int = MAX_LENGTH) -> list[tuple[list[int], int]]:
    """(source ids, target length) per line pair of two aligned Moses files; pairs with an empty
    side are dropped. The target length is the Seq2Seq decode length (thesis §2.7.4)."""
    source, target = read_moses(source_path, vocab, max_length), read_moses(target_path, vocab, max_length)
    if len(source) != len(target):
        raise ValueError(f"parallel files differ in length: {len(source)} vs {len(target)} lines")
    return [(s, len(t)) for s, t in zip(source, target) if s and t]


# Trees: SST files and the identical-tree dataset of Fig. 2.15 -----------------------------------

def read_trees(path) -> list[str]:
    """Bracketed trees (PTB/SST format), one per non-empty line, as strings the TreeLSTM accepts."""
    with open(path, encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip()]


def complete_trees(n: int, vocab: int, num_leaves: int = 16, seed: int = 0) -> list:
    """n complete binary trees of num_leaves (a power of two) random word ids each, as nested
    pairs: the identical-structure dataset of Fig. 2.15 (16 leaves, 31 cells per tree)."""
    if num_leaves < 1 or num_leaves & (num_leaves - 1):
        raise ValueError(f"num_leaves must be a power of two, got {num_leaves}")
    rng = np.random.default_rng([seed, 3])
    return [_pair_up(row) for row in rng.integers(FIRST_TOKEN, vocab, size=(n, num_leaves)).tolist()]


def _pair_up(level: list):
    while len(level) > 1:
        level = [[level[i], level[i + 1]] for i in range(0, len(level), 2)]
    return level[0]
