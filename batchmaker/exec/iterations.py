"""`IterationRunner`: one decoder iteration (core/task.IterationTask) on one worker, and the paged
KV cache it reads and writes.

Token-wise work (embeddings, projections, MLPs, norms) runs on the flat batch of the iteration's
tokens; attention runs per sequence over its own blocks (kernels/paged_attention.py: a Triton
kernel on CUDA, its PyTorch twin on the CPU) after the new tokens' K/V are written to the cache
(ORCA's selective batching). Only the sequences that sample go through the LM head; the sampled
tokens are written to `last_token[slot]` on the device (the next iteration's input) and copied
to the host in the same launch.

On CUDA every launch is one copy of a packed int64 buffer from pinned memory, then the work:
iterations where every sequence brings one token (pure decode, the common case) replay a CUDA
graph per padded number of sequences; iterations with prompt chunks of up to
`KVSettings.prefill_graph_tokens` tokens replay one per padded (tokens: a power of two up to 128,
then a multiple of 64; sequences; context bound), captured the second time each shape comes
(exec/graphs.py; eagerly their launches take the host ~2x the GPU's time; a turn's cache copied
in from the host then comes whole before the iteration);
longer ones run eagerly, and a turn copied in layer by layer runs in them. A batch of decodes
beside prompt chunks attends in two launches from work lists packed with the rest
(kernels/attention_work.py).
"""
import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from batchmaker.core.task import IterationTask
from batchmaker.kernels import attention_work
from batchmaker.kernels.attention_variants import compile_variants
from batchmaker.exec.kv_swap import HostTier
from batchmaker.exec.sampling import sample
from batchmaker.exec.iteration_buffers import Packed, host_arrays
from batchmaker.exec.staging import Landing

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


@dataclass(slots=True)
class IterationRecord:
    """One iteration in a benchmark's trace (`IterationRunner.trace`; setting it times them all)."""
    tokens: int
    context: int  # context positions read: every sequence's, its new tokens included
    seqs: int
    graphed: bool
    seconds: float | None = None  # once finished: its span on the device (CUDA: events around it)
    pairs: int | None = None  # (query token, context position) pairs attended, causal: a prompt's FLOPs


class KVCache:
    """K and V blocks of every layer: [layers, blocks, block_size, kv heads, head dim] each."""

    def __init__(self, config, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device):
        shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks, self.block_size = num_blocks, block_size

    @staticmethod
    def bytes_per_block(config, block_size: int, dtype: torch.dtype) -> int:
        return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * dtype.itemsize


class IterationRunner:
    def __init__(self, cell_type, module, device: torch.device, graphs, num_blocks: int):
        from batchmaker.kernels import paged_attention as kernels
        self.cell_type = cell_type
        self.module = module  # a DecoderCell (cells/decoder_cell.py)
        self.lm = module.lm
        self.config = self.lm.config
        self.device = device
        self.graphs = graphs
        dtype = next(self.lm.parameters()).dtype
        self.cache = KVCache(self.config, num_blocks, module.block_size, dtype, device)
        self.max_blocks = -(-self.config.max_positions // module.block_size)
        self.scratch_slot = module.max_seqs  # padded sequences' last token lives here
        self.last_token = torch.zeros(module.max_seqs + 1, dtype=torch.int64, device=device)
        self.scale = self.config.head_dim ** -0.5
        self.group = self.config.num_heads // self.config.num_kv_heads
        cuda = device.type == "cuda"
        self.kernels = kernels
        self.attention = kernels.paged_attention if cuda else kernels.reference_paged_attention
        self._short = kernels.SHORT_CONTEXT_LEN  # decode graphs for contexts up to it: one attention launch
        self.stream = None  # the CUDA worker's stream
        self.landing = Landing(1 << 16) if cuda else None
        self._packers: dict[tuple, Packed] = {}
        self._graph_packers: dict[tuple, Packed] = {}
        self.num_graph_iterations = 0
        self.num_iterations = 0
        self.trace: list[IterationRecord] | None = None  # benchmarks: a record per iteration
        kv = module.kv
        self.chunk_tokens = max(kv.chunk_tokens // module.block_size, 1) * module.block_size
        host_bytes = kv.host_bytes if kv.host_bytes is not None else (8 << 30 if cuda else 32 << 20)
        host_chunks = HostTier.num_chunks_for(host_bytes, self.config, self.chunk_tokens, dtype)
        max_chunks = -(-self.max_blocks * module.block_size // self.chunk_tokens)
        self.max_swap_in, self.max_swap_out = 2 * max_chunks, 32
        self.host = HostTier(self.cache, host_chunks, self.chunk_tokens, self.max_swap_in, self.max_swap_out) \
            if host_chunks else None
        self._costs = None

    @property
    def pools(self) -> dict:
        """What the manager's queue needs to know of this worker's cache (core/blocks.py,
        core/conversations.py)."""
        if self._costs is None:
            self._costs = self.chunk_costs()
            self._swap_in_seconds = self.host.measure_swap_in() if self.host else math.inf
        return {"num_blocks": self.cache.num_blocks, "host_chunks": self.host.num_chunks if self.host else 0,
                "chunk_tokens": self.chunk_tokens, "chunk_costs": self._costs, "max_swap_in": self.max_swap_in,
                "max_swap_out": self.max_swap_out, "chunk_bytes": self.host.bytes_per_chunk if self.host else 0,
                "swap_in_seconds": self._swap_in_seconds}

    def chunk_costs(self) -> np.ndarray:
        """Seconds to recompute chunk k of a context (its positions end at (k + 1) * chunk_tokens),
        measured at powers of two and interpolated (Pensieve Eq. 3.6). Each measurement recomputes
        up to 16 such chunks in one iteration (the time per chunk of a batch: one alone would time
        the host's launches, the same at every position). Runs on free blocks, before serving."""
        ct, bs = self.chunk_tokens, self.module.block_size
        ends = (np.arange(-(-self.config.max_positions // ct)) + 1) * ct
        points = [ct]
        while points[-1] * 2 <= min(ends[-1], (self.cache.num_blocks - 1) * bs):
            points.append(points[-1] * 2)
        seconds = []
        with torch.inference_mode():
            for end in [points[0]] + points:  # (the first run warms up)
                n_blocks = -(-end // bs)
                rows = max(1, min(16, self.module.max_seqs, (self.cache.num_blocks - 1) // n_blocks))
                table = np.zeros((rows, self.max_blocks), dtype=np.int64)
                table[:, :n_blocks] = 1 + np.arange(rows * n_blocks).reshape(rows, n_blocks)
                positions = np.tile(np.arange(end - ct, end), rows)
                row = np.repeat(np.arange(rows), ct)
                host = {"tokens": np.zeros(rows * ct, dtype=np.int64), "positions": positions,
                        "kv_slots": table[row, positions // bs] * bs + positions % bs,
                        "token_slots": np.full(rows * ct, self.scratch_slot),
                        "query_start": (np.arange(rows + 1) * ct).astype(np.int32),
                        "context_lens": np.full(rows, end, dtype=np.int32), "block_tables": table.astype(np.int32),
                        "sample_token": np.arange(1, rows + 1) * ct - 1, "sample_slots": np.full(rows, self.scratch_slot),
                        "seeds": np.zeros(rows, dtype=np.int64), "counters": np.zeros(rows, dtype=np.int64),
                        "top_k": np.zeros(rows, dtype=np.int64), "temperature": np.zeros(rows, dtype=np.float32),
                        "top_p": np.ones(rows, dtype=np.float32)}
                t = {k: torch.from_numpy(np.ascontiguousarray(v)).to(self.device) for k, v in host.items()}
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                start = time.perf_counter()
                self._forward(t, ct, True, None)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                seconds.append((time.perf_counter() - start) / rows)
        return np.maximum.accumulate(np.interp(ends, points, seconds[1:]))

    # the computation ---------------------------------------------------------------------------
    def _forward(self, t: dict, max_query_len: int, greedy_only: bool, swap_in,
                 max_context_len: int | None = None, work: tuple | None = None) -> torch.Tensor:
        """The iteration on tensors already on the device; returns the sampled tokens [N].
        max_context_len: a host bound on every context (it picks the attention launch; None: the
        block tables' width); work: the attention's item lists (kernels/attention_work.py)."""
        tokens = torch.where(t["tokens"] >= 0, t["tokens"], self.last_token[t["token_slots"]])
        attend = self.kernels.PagedAttend(
            self.cache.k, self.cache.v, t["kv_slots"], t["block_tables"], t["query_start"], t["context_lens"],
            max_query_len, self.scale, max_context_len=max_context_len,
            before_layer=None if swap_in is None else swap_in.before_attention, attention=self.attention, work=work)
        hidden = self.lm(tokens, t["positions"], attend)
        logits = self.lm.head(hidden.index_select(0, t["sample_token"]))
        chosen = sample(logits, t["temperature"], t["top_k"], t["top_p"], t["seeds"], t["counters"], greedy_only)
        self.last_token.index_copy_(0, t["sample_slots"], chosen)
        return chosen

    def _record(self, task: IterationTask, graphed: bool) -> "IterationRecord | None":
        if self.trace is None:
            return None
        queries = np.diff(task.query_start)  # token i of a sequence's q new ones sees context - (q - 1 - i)
        pairs = int((queries * task.context_lens - queries * (queries - 1) // 2).sum())
        self.trace.append(IterationRecord(task.batch, int(task.context_lens.sum()), len(task.slots), graphed,
                                          pairs=pairs))
        return self.trace[-1]

    # CPU: the worker thread runs it --------------------------------------------------------------
    def execute(self, task: IterationTask) -> None:
        record = self._record(task, False)
        host = host_arrays(task)
        t = {k: torch.from_numpy(v) for k, v in host.items()}
        greedy = not (task.temperature > 0).any()
        start = time.perf_counter()
        swap_in = self._copies(task.cache_plan, None)
        task.sampled = self._forward(t, task.max_query_len, greedy, swap_in).numpy().copy()
        task.seconds = time.perf_counter() - start
        if record is not None:
            record.seconds = task.seconds
        self.num_iterations += 1

    # CUDA: the manager thread queues it on the worker's stream -----------------------------------
    def launch(self, task: IterationTask) -> None:
        longest = int(task.context_lens.max())  # (host arrays: no device sync)
        shape = self._graph_shape(task, longest)
        record = self._record(task, shape is not None)
        greedy = not (task.temperature > 0).any()
        n = len(task.sample)
        compute = self.stream or torch.cuda.current_stream(self.device)
        timed = self.host is not None or record is not None  # (the manager weighs copies in against iterations' time)
        if timed:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(compute)
        swap_in = self._copies(task.cache_plan, compute, whole=shape is not None)
        if shape is not None:  # a CUDA graph per padded shape
            tokens, seqs, bound = shape
            query = 1 if task.decode_only else tokens  # (a bound on every sequence's new tokens)
            sizes = self._work_sizes(tokens, seqs, query)
            packed = self._packer(tokens, seqs, seqs, graphed=True, work=sizes)
            packed.load(self._with_work(self._padded(host_arrays(task), tokens, seqs, seqs), tokens, query, sizes))
            key = ("iteration", self.cell_type, seqs, greedy, bound) if task.decode_only else \
                ("prefill", self.cell_type, tokens, seqs, greedy, bound)
            work = packed.work(sizes)
            out = self.graphs.run(key, lambda: self._forward(packed.tensors, query, greedy, None, bound, work), [])
            self.num_graph_iterations += 1
        else:
            sizes = self._work_sizes(task.batch, len(task.slots), task.max_query_len)
            packed = self._packer(task.batch, len(task.slots), n, work=sizes)
            arrays = self._with_work(host_arrays(task), task.batch, task.max_query_len, sizes, exact=True)
            packed.load(arrays)
            work = packed.work(sizes, arrays.get("work_counts"))
            out = self._forward(packed.tensors, task.max_query_len, greedy, swap_in, longest, work)
        if timed:
            end.record(compute)  # (before the copy to the host: passed once the tokens have landed)
        region = self.landing.open()
        task.handle = (region, region.to_host(out[:n]), (start, end) if timed else None, record)
        self.num_iterations += 1

    def _work_sizes(self, num_tokens: int, num_seqs: int, max_query_len: int) -> tuple[int, int] | None:
        """The attention's item lists of an iteration of this shape, if its batch may mix decodes
        with longer queries (kernels/attention_work.py): their capacity."""
        if not attention_work.is_mixed(max_query_len, self.group, num_seqs):
            return None
        return attention_work.capacity(num_tokens, num_seqs, self.group, max_query_len)

    def _with_work(self, arrays: dict, num_tokens: int, max_query_len: int, sizes, exact: bool = False) -> dict:
        """`arrays` with the attention's item lists, as long as they are (at most `sizes`: the
        packer fills the rest with -1); `exact`: their lengths too, for an eager launch of just so
        many programs."""
        if sizes is None:
            return arrays
        small, large = attention_work.work_lists(arrays["query_start"], num_tokens, self.group, max_query_len)
        if len(small) > sizes[0] or len(large) > sizes[1]:  # (capacity bounds every batch: a bug if not)
            raise ValueError(f"{len(small)}, {len(large)} attention items overflow lists of {sizes}")
        arrays = dict(arrays, attn_small=small, attn_large=large)
        if exact:
            arrays["work_counts"] = (len(small), len(large))
        return arrays

    def _graph_shape(self, task: IterationTask, longest: int) -> tuple[int, int, int | None] | None:
        """(tokens, sequences, context bound) of the CUDA graph that runs `task`, or None: eager.
        Decode pads its sequences to a batch bucket (one token each); an iteration with prompt
        chunks of up to `KVSettings.prefill_graph_tokens` pads its tokens (`prefill_tokens`) and its
        sequences to a bucket with room for one more (the padding's), and bounds the contexts by
        a power of two (each bound picks its attention launch)."""
        if not self.graphs.enabled:
            return None
        s, buckets = len(task.slots), self.cell_type.batch_sizes
        if task.decode_only:
            seqs = self.cell_type.bucket(s)
            return seqs, seqs, self._short if longest <= self._short else None
        tokens = prefill_tokens(task.batch)
        with_padding = s + (tokens > task.batch)
        if tokens > self.module.kv.prefill_graph_tokens or with_padding > min(buckets[-1], self.module.max_seqs):
            return None
        bound = max(self._short, 1 << (longest - 1).bit_length())
        return tokens, self.cell_type.bucket(with_padding), None if bound >= self.max_blocks * self.module.block_size else bound

    def _copies(self, plan, compute_stream, whole: bool = False):
        """Start the iteration's copies out (on the side) and in; returns the copy in layer by
        layer, if any. `whole`: the iteration runs as a graph, so a copy in that would go layer by
        layer goes whole before it instead (the iteration waits for it: cheaper than an eager
        iteration's launches, which take the host ~2x the GPU's time)."""
        if plan is None or self.host is None:
            return None
        if len(plan.swap_out_host):
            self.host.swap_out(plan, compute_stream)
        if not len(plan.swap_in_host):
            return None
        if plan.deferred or whole:
            self.host.restore(plan, compute_stream)
            if not plan.deferred:
                compute_stream.wait_event(plan.done)
            return None
        return self.host.swap_in(plan, compute_stream)

    def finish(self, task: IterationTask) -> None:
        if task.handle is not None:
            region, tokens, events, record = task.handle
            task.sampled = tokens.numpy().copy()
            if events is not None:
                task.seconds = events[0].elapsed_time(events[1]) / 1e3
            if record is not None:
                record.seconds = task.seconds
            self.landing.close(region)
            task.handle = None

    def compile_kernels(self) -> None:
        """Compile every attention variant this model can launch now, not mid-serving
        (kernels/attention_variants.py; CUDA workers call it at start, graphs or not). Contexts
        reach the block table's width (an unbounded launch's bound), a block past max_positions."""
        compile_variants(self.cache.k[0], self.cache.v[0], self.config.num_heads, self.max_blocks,
                         max(self.config.max_positions, self.max_blocks * self.module.block_size))

    def warm_up(self) -> None:
        """Capture the decode graphs of every bucket now (padded sequences only touch scratch)."""
        if not self.graphs.enabled:
            return
        for bucket in self.cell_type.batch_sizes:
            if bucket > self.module.max_seqs:
                break
            packed = self._packer(bucket, bucket, bucket, graphed=True)
            packed.load(self._padded(None, bucket, bucket, bucket))
            for greedy in (True, False):
                for bound in (self._short, None):  # decode at short contexts: one attention launch
                    self.graphs.capture(("iteration", self.cell_type, bucket, greedy, bound),
                                        lambda: self._forward(packed.tensors, 1, greedy, None, bound), [], warm=True)

    def _padded(self, arrays: dict | None, num_tokens: int, num_seqs: int, num_samples: int) -> dict:
        """`arrays` (of `host_arrays`; None: nothing real) padded to a graph's shape. The padded
        sequences take the padded tokens, one each and the rest to the first, at positions 0, 1,
        ... of the scratch block (0): they read the scratch slot's last token and write only
        scratch. Padded samples read row 0 and go greedily to the scratch slot."""
        t, s, n = (0, 0, 0) if arrays is None else \
            (len(arrays["tokens"]), len(arrays["context_lens"]), len(arrays["sample_slots"]))
        p, q, m = num_tokens - t, num_seqs - s, num_samples - n
        if p < 0 or q < 0 or m < 0 or (p and not q):
            raise ValueError(f"cannot pad {t} tokens, {s} sequences, {n} samples to {num_tokens}, {num_seqs}, "
                             f"{num_samples}")
        counts = (np.arange(q) < p).astype(np.int64)
        if q:
            counts[0] += p - min(p, q)
        positions = np.zeros(p, dtype=np.int64)
        positions[:counts[0] if q else 0] = np.arange(counts[0] if q else 0)
        ends = t + np.cumsum(counts)
        pad = {"tokens": np.full(p, -1), "positions": positions, "kv_slots": positions % self.module.block_size,
               "token_slots": np.full(p, self.scratch_slot),
               "query_start": ends if arrays is not None else np.concatenate([[0], ends]),
               "context_lens": np.maximum(counts, 1), "block_tables": np.zeros((q, self.max_blocks), dtype=np.int64),
               "sample_token": np.zeros(m, dtype=np.int64), "sample_slots": np.full(m, self.scratch_slot),
               "seeds": np.zeros(m, dtype=np.int64), "counters": np.zeros(m, dtype=np.int64),
               "top_k": np.zeros(m, dtype=np.int64), "temperature": np.zeros(m, dtype=np.float32),
               "top_p": np.ones(m, dtype=np.float32)}
        if arrays is None:
            return pad
        return {k: np.concatenate([arrays[k], pad[k].astype(arrays[k].dtype, copy=False)]) for k in pad}

    def _packer(self, num_tokens: int, num_seqs: int, num_samples: int, graphed: bool = False,
                work: tuple[int, int] | None = None) -> Packed:
        """Static device buffers of one shape: a graph's are kept for good (the graph reads their
        addresses); eager shapes are kept while they are few, since shapes repeat."""
        key = (num_tokens, num_seqs, num_samples, work)
        kept = self._graph_packers if graphed else self._packers
        packed = kept.get(key)
        if packed is None:
            if not graphed and len(self._packers) > 256:  # eager shapes of long runs
                self._packers.clear()
            packed = kept[key] = Packed(num_tokens, num_seqs, num_samples, self.max_blocks, self.device, self.stream,
                                         work)
        return packed
