"""Which CUDA graph runs a decoder iteration, and the iteration padded to that graph's shape. Pure
numpy: the planner picks the shape when it forms the iteration (core/sequence_queue.py), the
runner pads to it and replays (exec/iterations.py).

Decode-only iterations (every sequence brings one token) pad their sequences to a batch bucket.
Iterations with prompt chunks of up to `prefill_graph_tokens` pad their tokens (a power of two, at
least 16, up to 128; then a multiple of 64: past ~190 tokens the projections are bound by FLOPs
and padding costs its share of them) and their sequences to a bucket with room for one padded
sequence that takes the padded tokens, and bound every context by a power of two from
`short_context` (each bound picks its attention launch). Longer iterations run eagerly.

Padded sequences take the padded tokens, one each and the rest to the first, at positions 0, 1,
... of the scratch block (0): they read the scratch slot's last token and write only scratch.
Padded samples read row 0 and go greedily to the scratch slot.
"""
from dataclasses import dataclass

import numpy as np

from batchmaker.core.cell_type import bucket_of
from batchmaker.core.iteration_plan import GraphShape, IterationPlan

PREFILL_GRAPH_MIN_TOKENS = 16  # the smallest token bucket of those graphs
PREFILL_GRAPH_POW2_TOKENS = 128  # up to here token buckets are powers of two; then multiples of
PREFILL_GRAPH_STEP = 64  # this (H200, Llama-2-7B: up to ~190 tokens the projections are bound by
# reading the weights, so padding costs little; past it by FLOPs, and 300 tokens padded to 512
# would run ~1.7x their GEMM time)


def prefill_tokens(num_tokens: int) -> int:
    """The token count a graphed iteration of `num_tokens` with prompt chunks is padded to."""
    if num_tokens <= PREFILL_GRAPH_POW2_TOKENS:
        return max(PREFILL_GRAPH_MIN_TOKENS, 1 << (num_tokens - 1).bit_length())
    return -(-num_tokens // PREFILL_GRAPH_STEP) * PREFILL_GRAPH_STEP


@dataclass(frozen=True)
class GraphShapes:
    """The graphs one worker's decoder replays (a start-up fact: `enabled` only on CUDA with graphs)."""

    batch_sizes: tuple[int, ...]  # the cell type's buckets, sorted
    max_seqs: int  # sequences one worker runs at once
    prefill_graph_tokens: int  # (KVSettings) iterations with prompt chunks up to this many tokens
    short_context: int  # decode graphs for contexts up to it (one attention launch) and beyond
    table_width: int  # positions a block table holds (blocks of the longest sequence x block size)
    enabled: bool = True

    def bucket(self, n: int) -> int:
        return bucket_of(self.batch_sizes, n, "sequences")

    @property
    def decode_buckets(self) -> list[int]:
        """The decode graphs' sequence counts (captured at start-up)."""
        return [b for b in self.batch_sizes if b <= self.max_seqs]

    def of(self, num_seqs: int, num_tokens: int, decode_only: bool, longest: int) -> GraphShape | None:
        """The shape of the graph that runs an iteration of `num_seqs` sequences, `num_tokens`
        tokens and contexts of at most `longest` positions, or None: eagerly."""
        if not self.enabled:
            return None
        if decode_only:
            seqs = self.bucket(num_seqs)
            return GraphShape(seqs, seqs, self.short_context if longest <= self.short_context else None, True)
        tokens = prefill_tokens(num_tokens)
        with_padding = num_seqs + (tokens > num_tokens)
        if tokens > self.prefill_graph_tokens or with_padding > min(self.batch_sizes[-1], self.max_seqs):
            return None
        bound = max(self.short_context, 1 << (longest - 1).bit_length())
        return GraphShape(tokens, self.bucket(with_padding), None if bound >= self.table_width else bound, False)


NO_GRAPHS = GraphShapes((1,), 1, 0, 0, 0, enabled=False)  # every iteration eagerly (CPU workers)


def graph_key(cell_type, shape: GraphShape, greedy: bool) -> tuple:
    """What exec/graphs.py keys a shape's graph by (its second item is the cell type)."""
    if shape.decode:
        return "iteration", cell_type, shape.seqs, greedy, shape.bound
    return "prefill", cell_type, shape.tokens, shape.seqs, greedy, shape.bound


def padding(num_tokens: int, num_seqs: int, num_samples: int, scratch_slot: int, block_size: int,
            table_width_blocks: int, first: int = 0) -> dict[str, np.ndarray]:
    """The padding's arrays: `num_tokens` tokens of `num_seqs` padded sequences (after `first`
    real tokens) and `num_samples` padded samples."""
    p, q, m = num_tokens, num_seqs, num_samples
    counts = (np.arange(q) < p).astype(np.int64)
    if q:
        counts[0] += p - min(p, q)
    head = int(counts[0]) if q else 0
    positions = np.zeros(p, dtype=np.int64)
    positions[:head] = np.arange(head)
    return {"tokens": np.full(p, -1), "positions": positions, "kv_slots": positions % block_size,
            "token_slots": np.full(p, scratch_slot), "query_start": first + np.cumsum(counts),
            "context_lens": np.maximum(counts, 1), "block_tables": np.zeros((q, table_width_blocks), dtype=np.int64),
            "sample_token": np.zeros(m, dtype=np.int64), "sample_slots": np.full(m, scratch_slot),
            "seeds": np.zeros(m, dtype=np.int64), "counters": np.zeros(m, dtype=np.int64),
            "top_k": np.zeros(m, dtype=np.int64), "temperature": np.zeros(m), "top_p": np.ones(m)}


def pad(plan: IterationPlan, shape: GraphShape, scratch_slot: int, block_size: int) -> IterationPlan:
    """`plan` padded to `shape`: the real sequences and samples first, unchanged."""
    t, s, n = plan.num_tokens, plan.num_seqs, plan.num_samples
    p, q, m = shape.tokens - t, shape.seqs - s, shape.seqs - n
    if p < 0 or q < 0 or m < 0 or (p and not q):
        raise ValueError(f"cannot pad {t} tokens, {s} sequences, {n} samples to {shape.tokens}, {shape.seqs}, "
                         f"{shape.seqs}")
    extra = padding(p, q, m, scratch_slot, block_size, plan.block_tables.shape[1], first=t)
    arrays = {k: np.concatenate([v, extra[k].astype(v.dtype, copy=False)]) for k, v in plan.arrays().items()}
    return IterationPlan.of(**arrays, max_query_len=1 if shape.decode else shape.tokens,
                            decode_only=plan.decode_only, greedy=plan.greedy, graph=shape, copies=plan.copies)


def pad_alone(shape: GraphShape, scratch_slot: int, block_size: int, table_width_blocks: int) -> IterationPlan:
    """A plan of padding only, in `shape` (a graph's warm-up at start-up writes only scratch)."""
    arrays = padding(shape.tokens, shape.seqs, shape.seqs, scratch_slot, block_size, table_width_blocks)
    arrays["query_start"] = np.concatenate([[0], arrays["query_start"]])
    return IterationPlan.of(**arrays, max_query_len=1 if shape.decode else shape.tokens, decode_only=shape.decode,
                            graph=shape)
