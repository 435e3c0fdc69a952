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
`KVSettings.prefill_graph_tokens` tokens replay one per padded (tokens, sequences, context
bound), captured the first time each shape comes (eagerly their launches take the host ~2x the
GPU's time; a turn's cache copied in from the host then comes whole before the iteration);
longer ones run eagerly, and a turn copied in layer by layer runs in them. A batch of decodes
beside prompt chunks attends in two launches from work lists packed with the rest
(kernels/attention_work.py).
"""
import math
import time

import numpy as np
import torch

from batchmaker.core.task import IterationTask
from batchmaker.kernels import attention_work
from batchmaker.exec.kv_swap import HostTier
from batchmaker.exec.sampling import sample
from batchmaker.exec.staging import Landing, PinnedRing

PREFILL_GRAPH_MIN_TOKENS = 16  # the smallest token bucket of those graphs


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
        self._packers: dict[tuple, _Packed] = {}
        self._graph_packers: dict[tuple, _Packed] = {}
        self.num_graph_iterations = 0
        self.num_iterations = 0
        self.trace: list | None = None  # benchmarks: (tokens, context tokens read, sequences) per iteration
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
                        "context_lens": np.full(rows, end, dtype=np.int32), "block_tables": table,
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

    def _record(self, task: IterationTask) -> None:
        if self.trace is not None:
            self.trace.append((task.batch, int(task.context_lens.sum()), len(task.slots)))

    # CPU: the worker thread runs it --------------------------------------------------------------
    def execute(self, task: IterationTask) -> None:
        self._record(task)
        host = _host_arrays(task)
        t = {k: torch.from_numpy(v) for k, v in host.items()}
        greedy = not (task.temperature > 0).any()
        start = time.perf_counter()
        swap_in = self._copies(task.cache_plan, None)
        task.sampled = self._forward(t, task.max_query_len, greedy, swap_in).numpy().copy()
        task.seconds = time.perf_counter() - start
        self.num_iterations += 1

    # CUDA: the manager thread queues it on the worker's stream -----------------------------------
    def launch(self, task: IterationTask) -> None:
        self._record(task)
        greedy = not (task.temperature > 0).any()
        n = len(task.sample)
        compute = self.stream or torch.cuda.current_stream(self.device)
        timed = self.host is not None  # (the manager weighs copies in against iterations' time)
        if timed:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(compute)
        longest = int(task.context_lens.max())  # (host arrays: no device sync)
        shape = self._graph_shape(task, longest)
        swap_in = self._copies(task.cache_plan, compute, whole=shape is not None)
        if shape is not None:  # a CUDA graph per padded shape
            tokens, seqs, bound = shape
            query = 1 if task.decode_only else tokens  # (a bound on every sequence's new tokens)
            sizes = self._work_sizes(tokens, seqs, query)
            packed = self._packer(tokens, seqs, seqs, graphed=True, work=sizes)
            packed.load(self._with_work(self._padded(_host_arrays(task), tokens, seqs, seqs), tokens, query, sizes))
            key = ("iteration", self.cell_type, seqs, greedy, bound) if task.decode_only else \
                ("prefill", self.cell_type, tokens, seqs, greedy, bound)
            work = packed.work(sizes)
            out = self.graphs.run(key, lambda: self._forward(packed.tensors, query, greedy, None, bound, work), [])
            self.num_graph_iterations += 1
        else:
            sizes = self._work_sizes(task.batch, len(task.slots), task.max_query_len)
            packed = self._packer(task.batch, len(task.slots), n, work=sizes)
            arrays = self._with_work(_host_arrays(task), task.batch, task.max_query_len, sizes, exact=True)
            packed.load(arrays)
            work = packed.work(sizes, arrays.get("work_counts"))
            out = self._forward(packed.tensors, task.max_query_len, greedy, swap_in, longest, work)
        if timed:
            end.record(compute)  # (before the copy to the host: passed once the tokens have landed)
        region = self.landing.open()
        task.handle = (region, region.to_host(out[:n]), (start, end) if timed else None)
        self.num_iterations += 1

    def _work_sizes(self, num_tokens: int, num_seqs: int, max_query_len: int) -> tuple[int, int] | None:
        """The attention's item lists of an iteration of this shape, if its batch may mix decodes
        with longer queries (kernels/attention_work.py): their capacity."""
        if not attention_work.is_mixed(max_query_len, self.group, num_seqs):
            return None
        return attention_work.capacity(num_tokens, num_seqs, self.group, max_query_len)

    def _with_work(self, arrays: dict, num_tokens: int, max_query_len: int, sizes, exact: bool = False) -> dict:
        """`arrays` with the attention's item lists (padded to `sizes`; `exact`: their lengths too,
        for an eager launch of just so many programs)."""
        if sizes is None:
            return arrays
        small, large = attention_work.work_lists(arrays["query_start"], num_tokens, self.group, max_query_len)
        arrays = dict(arrays, attn_small=small, attn_large=large)
        if exact:
            arrays["work_counts"] = (len(small), len(large))
        return arrays

    def _graph_shape(self, task: IterationTask, longest: int) -> tuple[int, int, int | None] | None:
        """(tokens, sequences, context bound) of the CUDA graph that runs `task`, or None: eager.
        Decode pads its sequences to a batch bucket (one token each); an iteration with prompt
        chunks of up to `KVSettings.prefill_graph_tokens` pads its tokens to a power of two and its
        sequences to a bucket with room for one more (the padding's), and bounds the contexts by
        a power of two (each bound picks its attention launch)."""
        if not self.graphs.enabled:
            return None
        s, buckets = len(task.slots), self.cell_type.batch_sizes
        if task.decode_only:
            seqs = self.cell_type.bucket(s)
            return seqs, seqs, self._short if longest <= self._short else None
        tokens = max(PREFILL_GRAPH_MIN_TOKENS, 1 << (task.batch - 1).bit_length())
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
            region, tokens, events = task.handle
            task.sampled = tokens.numpy().copy()
            if events is not None:
                task.seconds = events[0].elapsed_time(events[1]) / 1e3
            self.landing.close(region)
            task.handle = None

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
        """`arrays` (of `_host_arrays`; None: nothing real) padded to a graph's shape. The padded
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
                work: tuple[int, int] | None = None) -> "_Packed":
        """Static device buffers of one shape: a graph's are kept for good (the graph reads their
        addresses); eager shapes are kept while they are few, since shapes repeat."""
        key = (num_tokens, num_seqs, num_samples, work)
        kept = self._graph_packers if graphed else self._packers
        packed = kept.get(key)
        if packed is None:
            if not graphed and len(self._packers) > 256:  # eager shapes of long runs
                self._packers.clear()
            packed = kept[key] = _Packed(num_tokens, num_seqs, num_samples, self.max_blocks, self.device, self.stream,
                                         work)
        return packed


def _host_arrays(task: IterationTask) -> dict[str, np.ndarray]:
    """The task's plan as the arrays the computation reads (sequence-level ones per sampled row)."""
    sample_token = task.query_start[task.sample + 1] - 1
    return {"tokens": task.tokens, "positions": task.positions, "kv_slots": task.kv_slots,
            "token_slots": task.token_slots, "query_start": task.query_start.astype(np.int32),
            "context_lens": task.context_lens.astype(np.int32), "block_tables": task.block_tables,
            "sample_token": sample_token, "sample_slots": task.slots[task.sample], "seeds": task.seeds,
            "counters": task.sample_index, "top_k": task.top_k,
            "temperature": task.temperature.astype(np.float32), "top_p": task.top_p.astype(np.float32)}


_NARROW = {"query_start": np.int32, "context_lens": np.int32, "block_tables": np.int32,
           "temperature": np.float32, "top_p": np.float32, "attn_small": np.int32,
           "attn_large": np.int32}  # 4-byte columns, two per int64 word
_TORCH = {np.int32: torch.int32, np.float32: torch.float32}


class _Packed:
    """One pinned int64 buffer per launch (a ring) copied to one static device buffer, viewed as
    the named tensors of `_host_arrays` (padded by `IterationRunner._padded` for a graph)."""

    def __init__(self, num_tokens: int, num_seqs: int, num_samples: int, max_blocks: int, device, stream,
                 work: tuple[int, int] | None = None):
        sizes = {"tokens": num_tokens, "positions": num_tokens, "kv_slots": num_tokens, "token_slots": num_tokens,
                 "query_start": num_seqs + 1, "context_lens": num_seqs, "block_tables": num_seqs * max_blocks,
                 "sample_token": num_samples, "sample_slots": num_samples, "seeds": num_samples,
                 "counters": num_samples, "top_k": num_samples, "temperature": num_samples, "top_p": num_samples}
        if work is not None:  # the attention's item lists, -1 after the last
            sizes.update(attn_small=work[0], attn_large=work[1])
        self.columns, at = {}, 0
        for name, size in sizes.items():
            words = -(-size // 2) if name in _NARROW else size
            self.columns[name] = (at, size, words)
            at += words
        self.size = at
        self.device_buffer = torch.zeros(at, dtype=torch.int64, device=device)
        self.ring = PinnedRing(at, stream)
        self.tensors = {}
        for name, (start, size, words) in self.columns.items():
            view = self.device_buffer[start:start + words]
            if name in _NARROW:
                view = view.view(_TORCH[_NARROW[name]])[:size]
            self.tensors[name] = view
        self.tensors["block_tables"] = self.tensors["block_tables"].view(num_seqs, max_blocks)

    def load(self, arrays: dict) -> None:
        """Copy the arrays (of `_host_arrays`, padded to this shape where it is a graph's)."""
        host = self.ring.next()
        for name, (start, size, words) in self.columns.items():
            dest = host[start:start + words]
            if name in _NARROW:
                dest = dest.view(_NARROW[name])[:size]
            if name.startswith("attn_"):  # (item lists: as many as there are, -1 after)
                dest[len(arrays[name]):] = -1
                dest = dest[:len(arrays[name])]
            dest[:] = arrays[name].reshape(-1)
        self.ring.copy_to(self.device_buffer, self.size)

    def work(self, sizes: tuple[int, int] | None, counts: tuple[int, int] | None = None) -> tuple | None:
        """The attention's item lists on the device: whole (a graph's launches cover the capacity),
        or their first `counts` (an eager launch covers just the items there are)."""
        if sizes is None:
            return None
        small, large = self.tensors["attn_small"], self.tensors["attn_large"]
        return (small, large) if counts is None else (small[:counts[0]], large[:counts[1]])
