"""`IterationRunner`: one decoder iteration (core/task.IterationTask) on one worker, and the paged
KV cache it reads and writes.

Token-wise work (embeddings, projections, MLPs, norms) runs on the flat batch of the iteration's
tokens; attention runs per sequence over its own blocks (kernels/paged_attention.py: a Triton
kernel on CUDA, its PyTorch twin on the CPU) after the new tokens' K/V are written to the cache
(ORCA's selective batching). Only the sequences that sample go through the LM head; the sampled
tokens are written to `last_token[slot]` on the device (the next iteration's input) and copied
to the host in the same launch.

The runner runs what the plan says (core/iteration_plan.py): on CUDA every launch is one copy of
a packed int64 buffer from pinned memory, then the work, replaying the CUDA graph of the plan's
`graph` shape (padded to it: core/iteration_shapes.py; captured the second time a shape comes,
exec/graphs.py) or eagerly; the plan's copies to and from the host tier go as its `copies.mode`
says (exec/kv_swap.py). A batch of decodes beside prompt chunks attends in two launches from
work lists packed with the rest (kernels/attention_work.py). A pipeline stage runs its layers
between its receive and its send (exec/stage_exchange.py), and its stage 0 gets the tokens back
(and their log-probabilities, when asked) from the last stage instead of sampling them.
"""
import math
import time

import numpy as np
import torch

from batchmaker.core.iteration_plan import IterationPlan
from batchmaker.core.iteration_shapes import GraphShape, GraphShapes, graph_key, pad, pad_alone
from batchmaker.core.task import IterationTask
from batchmaker.core.decoder_facts import DecoderFacts
from batchmaker.errors import RankFailedError
from batchmaker.exec.chunk_costs import measure_chunk_costs
from batchmaker.exec.iteration_buffers import Packed
from batchmaker.exec.iteration_record import IterationRecord
from batchmaker.exec.kv_cache import KVCache
from batchmaker.cells.pipeline import PendingTokens
from batchmaker.exec.kv_swap import HostTier
from batchmaker.exec.sampling import chunk_rows, sample_rows
from batchmaker.exec.stage_exchange import StageExchange
from batchmaker.exec.staging import Landing
from batchmaker.kernels import attention_work
from batchmaker.kernels.attention_variants import compile_variants
from batchmaker.kernels.skinny_routes import settle_routes


class IterationRunner:
    def __init__(self, cell_type, module, device: torch.device, graphs, num_blocks: int, ranks=None):
        from batchmaker.kernels import paged_attention as kernels
        self.cell_type = cell_type
        self.module = module  # a DecoderCell (cells/decoder_cell.py)
        self.ranks = ranks  # exec/tensor_group.TensorGroup: rank 0 of a tensor-parallel decoder, sends its plans
        self.lm = module.lm  # (a rank's shard under tensor parallelism, a stage of a pipeline)
        self.stage = module.lm.pp  # cells/pipeline.PipelineStage, or None
        self.config = self.lm.config
        self.device = device
        self.graphs = graphs
        self.split = module.ranks > 1  # a rank of a split decoder: its graphs must be captured (exec/graphs.py)
        dtype = next(self.lm.parameters()).dtype
        self.exchange = None if self.stage is None else StageExchange(self.stage, self.config.hidden_size, dtype, device)
        self.cache = KVCache(self.config, num_blocks, module.block_size, dtype, device)
        self.max_blocks = -(-self.config.max_positions // module.block_size)
        self.scratch_slot = module.max_seqs  # padded sequences' last token lives here
        self.last_token = torch.zeros(module.max_seqs + 1, dtype=torch.int64, device=device)
        self.scale = self.config.attention_scale
        self.sample_chunk = chunk_rows(module.config.vocab_size)  # (the whole vocabulary: the same on every rank)
        self.group = self.config.num_heads // self.config.num_kv_heads
        cuda = device.type == "cuda"
        self.kernels = kernels
        self.attention = kernels.paged_attention if cuda else kernels.reference_paged_attention
        self.unified_max: float | None = None  # split decode's phi once calibrated (calibrate_unified_max)
        self.routes: dict | None = None  # the projections' kernels once settled (compile_kernels; {}: none to route)
        self.shapes = GraphShapes(cell_type.batch_sizes, module.max_seqs, module.kv.prefill_graph_tokens,
                                  kernels.SHORT_CONTEXT_LEN, self.max_blocks * module.block_size, graphs.enabled)
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
        # (the whole model's: each rank's chunk holds its part of the K/V, so every rank keeps as many chunks)
        host_chunks = HostTier.num_chunks_for(host_bytes // module.ranks, self.config, self.chunk_tokens, dtype)
        max_chunks = -(-self.max_blocks * module.block_size // self.chunk_tokens)
        self.max_swap_in, self.max_swap_out = 2 * max_chunks, 32
        self.host = HostTier(self.cache, host_chunks, self.chunk_tokens, self.max_swap_in, self.max_swap_out) \
            if host_chunks else None

    def measure(self) -> DecoderFacts:
        """What the manager plans this worker's iterations by, measured now (at start-up, on free
        blocks, before serving): the KV cache's and the host tier's sizes, what recomputing a
        chunk costs at each position (Pensieve Eq. 3.6), what copying one in takes, and the CUDA
        graphs it replays."""
        host, ranks, costs = self.host, self.module.ranks, self.chunk_costs()
        if self.ranks is not None:  # (a whole budget of prompt chunks at the deepest positions: the slowest iteration)
            self.ranks.expect_iterations_within(max(self.cell_type.batch_sizes) / self.chunk_tokens * costs[-1])
        return DecoderFacts(self.cache.num_blocks, host.num_chunks if host else 0, self.chunk_tokens,
                            costs, self.max_swap_in, self.max_swap_out,
                            host.bytes_per_chunk * ranks if host else 0,  # (every rank copies its kv heads)
                            host.measure_swap_in() if host else math.inf, self.shapes)

    def chunk_costs(self) -> np.ndarray:
        """Seconds to recompute chunk k of a context, measured now (exec/chunk_costs.py)."""
        return measure_chunk_costs(self)

    # the computation ---------------------------------------------------------------------------
    def _forward(self, t: dict, max_query_len: int, greedy_only: bool, swap_in,
                 max_context_len: int | None = None, work: tuple | None = None, logprobs: int = -1,
                 inbox: torch.Tensor | None = None):
        """The iteration on tensors already on the device; returns the sampled tokens [N] (with
        `logprobs` >= 0: and their log-probabilities, exec/sampling.log_probabilities), or on a
        pipeline stage before the last the residual stream it hands on [2, T, H] (from `inbox`,
        what it received: `_staged`). max_context_len: a host bound on every context (it picks
        the attention launch; None: the block tables' width); work: the attention's item lists
        (kernels/attention_work.py)."""
        tokens = torch.where(t["tokens"] >= 0, t["tokens"], self.last_token[t["token_slots"]])
        attend = self.kernels.PagedAttend(
            self.cache.k, self.cache.v, t["kv_slots"], t["block_tables"], t["query_start"], t["context_lens"],
            max_query_len, self.scale, max_context_len=max_context_len,
            before_layer=None if swap_in is None else swap_in.before_attention, attention=self.attention, work=work,
            windows=self.config.attention_windows, softcap=self.config.attn_softcap, unified_max=self.unified_max)
        if self.stage is None:
            hidden = self.lm(tokens, t["positions"], attend)
        else:  # a pipeline stage
            hidden = self.stage.run(self.lm, tokens, t["positions"], attend, inbox)
            if not self.stage.last:
                return hidden
        out = sample_rows(self.lm.head, hidden, t["sample_token"], t, self.sample_chunk, greedy_only, logprobs)
        self.last_token.index_copy_(0, t["sample_slots"], out if logprobs < 0 else out[0])
        return out

    def _record(self, task: IterationTask) -> "IterationRecord | None":
        if self.trace is None:
            return None
        self.trace.append(IterationRecord.of(task))
        return self.trace[-1]

    # CPU: the worker thread runs it --------------------------------------------------------------
    def execute(self, task: IterationTask) -> None:
        record = self._record(task)
        plan = task.plan
        if self.ranks is not None:
            self.ranks.send(plan)
        t = {k: torch.from_numpy(v) for k, v in plan.arrays().items()}
        start = time.perf_counter()
        try:
            swap_in = self._copies(task, None)
            out = self._staged(lambda inbox: self._forward(t, plan.max_query_len, plan.greedy, swap_in,
                                                           logprobs=plan.logprobs, inbox=inbox),
                               plan.num_tokens, plan.num_samples, self.exchange and self.exchange.receive_tokens,
                               logprobs=plan.logprobs)
            if isinstance(out, tuple):
                out, extras = out
                task.logprobs = tuple(x.numpy().copy() for x in extras)
            if isinstance(out, PendingTokens):  # (pipeline stage 0: the next iteration runs here meanwhile)
                task.handle = out
            elif out is not None:
                task.sampled = out.numpy().copy()
        except Exception as e:
            if self.ranks is not None:  # (the other ranks may be left inside a collective: the group is done)
                self.ranks.fail(f"an iteration failed on rank 0: {type(e).__name__}: {e}")
            raise
        task.seconds = time.perf_counter() - start
        if record is not None:
            record.seconds = task.seconds
        self.num_iterations += 1

    # CUDA: the manager thread queues it on the worker's stream -----------------------------------
    def launch(self, task: IterationTask) -> None:
        if self.ranks is None:
            return self._launch(task)
        self.ranks.send(task.plan)  # (first: the other ranks' host work overlaps this one's)
        try:
            self._launch(task)
        except Exception as e:  # (the other ranks launched it: their collectives wait for this one's)
            self.ranks.fail(f"an iteration failed on rank 0: {type(e).__name__}: {e}")

    def _launch(self, task: IterationTask) -> None:
        plan, shape = task.plan, task.plan.graph
        record = self._record(task)
        compute = self.stream or torch.cuda.current_stream(self.device)
        timed = self.host is not None or record is not None  # (the manager weighs copies in against iterations' time)
        if timed:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(compute)
        swap_in = self._copies(task, compute)
        region = self.landing.open()
        tokens_back = self.exchange and self.exchange.tokens_on_side(region)  # (pipeline stage 0's)
        if shape is not None:  # a CUDA graph per padded shape
            padded = pad(plan, shape, self.scratch_slot, self.module.block_size)
            out = self._staged(lambda inbox: self._replay(padded, inbox), shape.tokens, shape.seqs, tokens_back,
                               graphed=True)
            self.num_graph_iterations += 1
        else:
            sizes = self._work_sizes(plan.num_tokens, plan.num_seqs, plan.max_query_len)
            packed = self._packer(plan.num_tokens, plan.num_seqs, plan.num_samples, work=sizes)
            arrays = self._with_work(plan.arrays(), plan.num_tokens, plan.max_query_len, sizes, exact=True)
            packed.load(arrays)
            work = packed.work(sizes, arrays.get("work_counts"))
            longest = int(plan.context_lens.max())  # (host arrays: no device sync)
            out = self._staged(lambda inbox: self._forward(packed.tensors, plan.max_query_len, plan.greedy, swap_in,
                                                           longest, work, plan.logprobs, inbox),
                               plan.num_tokens, plan.num_samples, tokens_back, logprobs=plan.logprobs)
        extras = ()
        if isinstance(out, tuple):
            out, extras = out
        if timed:
            end.record(compute)  # (before the copy to the host: passed once the tokens have landed)
        if out is not None and not isinstance(out, PendingTokens):  # (a middle stage has none)
            out = region.to_host(out[:plan.num_samples])
        task.handle = (region, out, (start, end) if timed else None, record, tuple(region.to_host(x) for x in extras))
        self.num_iterations += 1

    def _staged(self, forward, *args, **kwargs):
        """`forward(None)`; on a pipeline stage, between its receive and its send (exec/stage_exchange.py)."""
        return forward(None) if self.exchange is None else self.exchange.around(forward, *args, **kwargs)

    def _replay(self, padded: IterationPlan, inbox: torch.Tensor | None = None) -> torch.Tensor:
        """A plan padded to its graph's shape, through that graph (captured when the shape comes again)."""
        shape = padded.graph
        sizes = self._work_sizes(shape.tokens, shape.seqs, padded.max_query_len)
        packed = self._packer(shape.tokens, shape.seqs, shape.seqs, graphed=True, work=sizes)
        packed.load(self._with_work(padded.arrays(), shape.tokens, padded.max_query_len, sizes))
        work = packed.work(sizes)
        key = graph_key(self.cell_type, shape, padded.greedy)
        return self.graphs.run(key, lambda: self._forward(packed.tensors, padded.max_query_len, padded.greedy, None,
                                                          shape.bound, work, inbox=inbox), [], strict=self.split)

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

    def _copies(self, task: IterationTask, compute_stream):
        """Start the plan's copies out (on the side) and in, as its `copies.mode` says; returns the
        copy in layer by layer, if any. The host tier carries out the manager's handle on them
        (`task.cache_plan`, the same arrays) and sets its `done`."""
        copies, handle = task.plan.copies, task.cache_plan
        if copies is None or self.host is None:
            return None
        if len(copies.swap_out_host):
            self.host.swap_out(handle, compute_stream)
        if not len(copies.swap_in_host):
            return None
        if copies.mode == "layers":
            return self.host.swap_in(handle, compute_stream)
        self.host.restore(handle, compute_stream)
        if copies.mode == "before":  # (the iteration replays a graph: its layers cannot wait one by one)
            compute_stream.wait_event(handle.done)
        return None

    def close(self) -> None:
        """Stop: the group's ranks, then what holds memory (graphs and their pools, the KV cache,
        the host tier), given back now rather than when the collector gets to the engine."""
        self.graphs.drop()  # (their captured collectives hold the group's communicator)
        if self.ranks is not None:
            self.ranks.close()
        self.cache.release()
        if self.host is not None:
            self.host.release()

    def landed(self, task: IterationTask) -> bool:
        """CUDA: whether a launched (and signalled) iteration's tokens are on the host: at once,
        but on pipeline stage 0 only once they came back (or the group broke: they never will)."""
        tokens = task.handle[1] if isinstance(task.handle, tuple) else None
        return not isinstance(tokens, PendingTokens) or tokens.ready() or self.ranks.broken is not None

    def finish(self, task: IterationTask) -> None:
        if isinstance(task.handle, PendingTokens):
            self._tokens_back(task)
        if task.handle is not None:
            region, tokens, events, record, extras = task.handle
            if isinstance(tokens, PendingTokens):  # (pipeline stage 0, `landed`: not if the group broke)
                back = tokens
                tokens, extras, region = (back.buffer[:task.plan.num_samples], back.logprobs(), region) \
                    if back.ready() else (None, (), None)
            if tokens is not None:  # (a middle stage has none)
                task.sampled = tokens.numpy().copy()
            if extras:
                task.logprobs = tuple(x.numpy().copy() for x in extras)
            if events is not None:
                task.seconds = events[0].elapsed_time(events[1]) / 1e3
            if record is not None:
                record.seconds = task.seconds
            if region is not None:  # (else a copy may still land in it: left to the collector)
                self.landing.close(region)
            task.handle = None
        if self.ranks is not None:
            self.ranks.done()  # (its tokens are back: the watcher stops timing it)
            broken = self.ranks.broken
            if broken is not None and task.error is None and self.device.type == "cuda":
                task.error = RankFailedError(f"the tensor-parallel group broke while this iteration ran: {broken}")

    def _tokens_back(self, task: IterationTask) -> None:
        """CPU pipeline stage 0, once its iteration ran here: the tokens the last stage sampled
        (the manager waits at most for the stages after this one)."""
        try:
            chosen = task.handle.wait()
        except Exception as e:  # (a stage died or hung: the group is done; where the watcher broke it first,
            # its reason, not the closed connection that its abort made the wait meet)
            broken = self.ranks.broken
            task.error = RankFailedError("the pipeline's tokens did not come back: "
                                         + (broken if broken is not None else f"{type(e).__name__}: {e}"))
            self.ranks.abort(str(task.error))
        else:  # (the plans feed them: core/sequence_queue.py `stages`)
            task.sampled = chosen.numpy().copy()
            task.logprobs = tuple(x.numpy().copy() for x in task.handle.logprobs()) or None
        task.handle = None

    def compile_kernels(self) -> None:
        """Compile every attention variant this model can launch now, not mid-serving
        (kernels/attention_variants.py; CUDA workers call it at start, graphs or not). Contexts
        reach the block table's width (an unbounded launch's bound), a block past max_positions; with
        the layers' sliding windows and soft cap, where the model has them, and the calibrated
        unified maximum's split decodes, calibrated first from the cell's calibration prompts. First
        the few-token projections' routes, measured on this device (kernels/skinny_routes.py): before
        any graph is captured, since graphs bake them in."""
        self.routes = settle_routes(self.lm, self.device, self.module.kv.skinny_routes)
        if self.module.calibration_prompts:
            self.calibrate_unified_max(self.module.calibration_prompts)
        compile_variants(self.cache.k[0], self.cache.v[0], self.config.num_heads, self.max_blocks,
                         max(self.config.max_positions, self.max_blocks * self.module.block_size),
                         self.config.attention_windows, self.config.attn_softcap, self.unified_max)

    def calibrate_unified_max(self, prompts: list[list[int]]) -> float | None:
        """FlashDecoding++'s unified maximum for this model from its scores on `prompts`
        (kernels/unified_max.calibrate_lm), used by every later iteration's split decode; before
        graphs are captured (they hold it; compile_kernels calls it at a GPU worker's start). None
        (no prompts, windows, soft caps, a model split over ranks): the exact path."""
        from batchmaker.kernels.unified_max import calibrate_lm
        self.unified_max = calibrate_lm(self.lm, prompts) if self.module.ranks == 1 else None
        return self.unified_max

    def warm_up(self) -> None:
        """Capture the decode graphs of every bucket now (padded sequences only touch scratch)."""
        if not self.shapes.enabled:
            return
        assert self.routes is not None, "the projections' routes settle before graphs capture them (compile_kernels)"
        for bucket in self.shapes.decode_buckets:
            packed = self._packer(bucket, bucket, bucket, graphed=True)
            alone = pad_alone(GraphShape(bucket, bucket, None, True), self.scratch_slot, self.module.block_size,
                              self.max_blocks)
            packed.load(alone.arrays())
            for greedy in (True, False):
                for bound in (self.shapes.short_context, None):  # decode at short contexts: one attention launch
                    shape = GraphShape(bucket, bucket, bound, True)
                    self._staged(lambda inbox: self._capture(graph_key(self.cell_type, shape, greedy), lambda: self._forward(
                        packed.tensors, 1, greedy, None, bound, inbox=inbox)), bucket, bucket, graphed=True)

    def _capture(self, key, body) -> torch.Tensor:
        """Capture `body` after a warm run; returns its output of that run (a pipeline stage hands
        it on: its neighbours' warm runs wait for it)."""
        out = []
        self.graphs.capture(key, lambda: out.append(body()) or out[-1], [], warm=True, strict=self.split)
        if out or self.exchange is None:
            return out[0] if out else None
        return body()  # (not captured: the cell type runs eagerly; a stage still hands a warm run on)

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
