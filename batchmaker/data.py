"""Synthetic WMT-15 Europarl-like workloads (the real corpus is not available offline).

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
