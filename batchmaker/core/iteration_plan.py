"""The iteration plan: one decoder iteration as the runner reads it, planned by the manager
(core/sequence_queue.py) and run by a worker (exec/iterations.py). Plain arrays and a few ints,
so that it packs into bytes and goes to another process unchanged (`to_bytes`, `from_bytes`):
the ranks of a model-parallel decoder all run the plan rank 0 planned.

Per token [T]: the token (-1: the slot's last sampled token, which stays on the device), its
position, its cache slot (block * block_size + offset) and its sequence slot. Per sequence [S]:
where its tokens start in the flat batch (query_start [S + 1]), its context length (its new
tokens included) and its block table. Per sample [N]: which token's hidden state goes through the
LM head, the slot its token goes to, and the sampler's settings (seed, counter: which token of its
sequence it is, top_k, temperature, top_p).
"""
import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

class GraphShape(NamedTuple):
    """The shape of the CUDA graph an iteration replays (core/iteration_shapes.py)."""

    tokens: int
    seqs: int  # (and samples: every padded sequence has a sample row)
    bound: int | None  # a host bound on every context (it picks the attention launch); None: the table's width
    decode: bool  # one token a sequence: a decode graph


COPY_MODES = ("layers", "before", "side")  # swap-ins: before each layer's attention, whole before the
# iteration (it replays a CUDA graph), or on the side (their turns wait; the iteration does not)


@dataclass(frozen=True, slots=True, eq=False)
class Copies:
    """The iteration's copies between the worker's GPU blocks and its host chunks (the host tier):
    swap_in_host [n] -> swap_in_blocks [n, blocks per chunk] as `mode` says; swap_out_blocks
    [m, blocks per chunk] -> swap_out_host [m], on the side."""

    swap_in_host: np.ndarray
    swap_in_blocks: np.ndarray
    swap_out_blocks: np.ndarray
    swap_out_host: np.ndarray
    mode: str

    def __post_init__(self):
        assert self.mode in COPY_MODES, self.mode
        assert self.swap_in_blocks.ndim == self.swap_out_blocks.ndim == 2, "blocks per chunk: [n, blocks] arrays"


# the arrays in packing order, with their dtypes and ranks (every one C-contiguous once packed)
ARRAYS = {"tokens": np.int64, "positions": np.int64, "kv_slots": np.int64, "token_slots": np.int64,
          "query_start": np.int32, "context_lens": np.int32, "block_tables": np.int32,
          "sample_token": np.int64, "sample_slots": np.int64, "seeds": np.int64, "counters": np.int64,
          "top_k": np.int64, "temperature": np.float32, "top_p": np.float32}
_DIMS = {"tokens": "T", "positions": "T", "kv_slots": "T", "token_slots": "T", "query_start": "S+1",
         "context_lens": "S", "block_tables": "SxW", "sample_token": "N", "sample_slots": "N", "seeds": "N",
         "counters": "N", "top_k": "N", "temperature": "N", "top_p": "N"}
_COPY_ARRAYS = ("swap_in_host", "swap_in_blocks", "swap_out_blocks", "swap_out_host")


def array_shapes(num_tokens: int, num_seqs: int, num_samples: int, width: int) -> dict[str, tuple[int, ...]]:
    """The shape of each array of a plan with this many tokens, sequences and samples (block
    tables `width` blocks wide)."""
    dims = {"T": (num_tokens,), "S+1": (num_seqs + 1,), "S": (num_seqs,), "SxW": (num_seqs, width),
            "N": (num_samples,)}
    return {name: dims[dim] for name, dim in _DIMS.items()}


@dataclass(frozen=True, slots=True, eq=False)
class IterationPlan:
    tokens: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    kv_slots: np.ndarray  # int64 [T]
    token_slots: np.ndarray  # int64 [T]
    query_start: np.ndarray  # int32 [S + 1]
    context_lens: np.ndarray  # int32 [S]
    block_tables: np.ndarray  # int32 [S, blocks of the longest sequence the model allows]
    sample_token: np.ndarray  # int64 [N]: rows of the flat batch that sample
    sample_slots: np.ndarray  # int64 [N]
    seeds: np.ndarray  # int64 [N]
    counters: np.ndarray  # int64 [N]
    top_k: np.ndarray  # int64 [N]
    temperature: np.ndarray  # float32 [N]
    top_p: np.ndarray  # float32 [N]
    max_query_len: int = 1  # the most new tokens of one sequence
    decode_only: bool = False  # every sequence feeds its last sampled token (one token each)
    greedy: bool = True  # no sample needs noise (temperature 0 everywhere)
    logprobs: int = -1  # log-probabilities to return: -1 none, k >= 0 the sampled tokens' and the top k's
    graph: GraphShape | None = None  # the CUDA graph it replays, padded to its shape; None: eagerly
    copies: Copies | None = None

    @classmethod
    def of(cls, **arrays) -> "IterationPlan":
        """A plan from arrays of any integer or float dtype (cast to the plan's)."""
        cast = {k: np.ascontiguousarray(arrays.pop(k), dtype=dtype) for k, dtype in ARRAYS.items()}
        return cls(**cast, **arrays)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    @property
    def num_samples(self) -> int:
        return len(self.sample_slots)

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in ARRAYS}

    # bytes: a header of int64 words (shapes, scalars), then every array's bytes in order; block
    # tables only up to their last nonzero column (the rest is zeros: no block) ----------------------
    def to_bytes(self) -> bytes:
        c = self.copies
        graph = (-1, -1, -1, -1) if self.graph is None else \
            (self.graph.tokens, self.graph.seqs, -1 if self.graph.bound is None else self.graph.bound, self.graph.decode)
        tables = self.block_tables
        columns = np.flatnonzero(tables.any(axis=0))
        used = int(columns[-1]) + 1 if len(columns) else 0
        header = [self.num_tokens, self.num_seqs, tables.shape[1], used, self.num_samples, self.max_query_len,
                  self.decode_only, self.greedy, self.logprobs, *graph]
        parts = [getattr(self, name) if name != "block_tables" else tables[:, :used] for name in ARRAYS]
        if c is not None:
            header += [COPY_MODES.index(c.mode) + 1, len(c.swap_in_host), c.swap_in_blocks.shape[1],
                       len(c.swap_out_host), c.swap_out_blocks.shape[1]]
            parts += [np.asarray(getattr(c, name), dtype=np.int64) for name in _COPY_ARRAYS]
        else:
            header.append(0)
        head = np.array([len(header), *header], dtype=np.int64)
        return b"".join([head.tobytes(), *(_aligned(np.ascontiguousarray(p).tobytes()) for p in parts)])

    @classmethod
    def from_bytes(cls, data: bytes) -> "IterationPlan":
        data = bytearray(data)  # (one copy: the arrays are writable views of it)
        n = int(np.frombuffer(data, dtype=np.int64, count=1)[0])
        header = np.frombuffer(data, dtype=np.int64, count=n, offset=8).tolist()
        t, s, width, used, m, max_query_len, decode_only, greedy, logprobs, *rest = header
        graph = None if rest[0] < 0 else GraphShape(rest[0], rest[1], None if rest[2] < 0 else rest[2], bool(rest[3]))
        shapes = array_shapes(t, s, m, used)
        reader = _Reader(data, 8 * (n + 1))
        arrays = {name: reader.take(dtype, shapes[name]) for name, dtype in ARRAYS.items()}
        tables = np.zeros((s, width), dtype=ARRAYS["block_tables"])
        tables[:, :used] = arrays["block_tables"]
        arrays["block_tables"] = tables
        copies = None
        if rest[4]:
            mode, n_in, per_in, n_out, per_out = rest[4:9]
            copies = Copies(reader.take(np.int64, (n_in,)), reader.take(np.int64, (n_in, per_in)),
                            reader.take(np.int64, (n_out, per_out)), reader.take(np.int64, (n_out,)),
                            COPY_MODES[mode - 1])
        return cls(**arrays, max_query_len=max_query_len, decode_only=bool(decode_only), greedy=bool(greedy),
                   logprobs=logprobs, graph=graph, copies=copies)


def _aligned(data: bytes) -> bytes:
    """`data` padded to a multiple of 8 bytes, so that the next array starts aligned."""
    return data + bytes(-len(data) % 8)


class _Reader:
    """Arrays read one after another from a bytes object (views: no copies)."""

    def __init__(self, data: bytes, offset: int):
        self.data, self.offset = data, offset

    def take(self, dtype, shape: tuple) -> np.ndarray:
        count = math.prod(shape)  # (not np.prod: a third of unpacking a small plan was its overhead)
        if count == 0:  # (numpy refuses an empty read at the buffer's end)
            return np.zeros(shape, dtype=dtype)
        out = np.frombuffer(self.data, dtype=dtype, count=count, offset=self.offset).reshape(shape)
        self.offset += -(-count * out.itemsize // 8) * 8  # (every array starts on 8 bytes)
        return out
