"""The host tier of a worker's KV cache (Pensieve §3.4.3): chunks of conversations' K/V copied
out of the GPU blocks ahead of time, and copied back in, layer by layer, as a turn resumes. The
manager decides what moves (core/conversations.py: a CachePlan per iteration); this moves it.

Host chunks are [2 (K, V), layers, chunks, chunk_tokens, kv heads, head dim] (pinned on CUDA),
so one layer's K (or V) of consecutive chunks is one contiguous piece, and the same piece of
every layer is one strided copy (exec/copy2d.py). On CUDA the copies run on two side streams, one
each way, through staging buffers on the device. Copies in have their own stream, of a higher
priority, so a turn's swap-in never queues behind copies out in flight (they use the other copy
engine); a copy out first waits for the copies in issued before it (the host chunks those read
may be handed out again).
  out: gather the blocks of every layer (8 chunks at a time), copy each run of consecutive host
       chunks with one call per K and V; `plan.done` is the event after the last (the manager
       lets the blocks go once it has passed)
  in, deferred (`restore`, the turn is prefilled once `plan.done` has passed): every layer of
       8 chunks at a time through the copies in's staging buffer, one strided copy per run and
       K/V, one scatter per K/V
  in, layer by layer (`swap_in`): layer l's chunks are copied to a staging buffer (two layers in
       flight), and the compute stream waits for them only just before layer l's attention, then
       scatters them into the blocks: the copy of layer l + 2 waits until layer l's buffer is
       consumed
`swap_in_seconds` (measured at start-up) is what copying one chunk in takes: the manager goes
layer by layer only where that hides under the iteration's compute.
On the CPU both are plain indexed copies.
"""
import time

import numpy as np
import torch

from batchmaker.exec.copy2d import copy_2d, copy_to_device

OUT_STAGING_CHUNKS = 8  # chunks of every layer gathered at once for copies out (128 MiB for Llama-2-7B)


class HostTier:
    def __init__(self, cache, num_chunks: int, chunk_tokens: int, max_in: int, max_out: int):
        self.cache = cache  # exec/kv_cache.KVCache
        k = cache.k
        self.layers, self.block_size = k.shape[0], cache.block_size
        self.per_chunk = chunk_tokens // cache.block_size
        self.tail = tuple(k.shape[3:])  # (kv heads, head dim)
        self.device = k.device
        cuda = self.device.type == "cuda"
        self.host = torch.zeros((2, self.layers, num_chunks, chunk_tokens, *self.tail), dtype=k.dtype,
                                pin_memory=cuda)
        self.num_chunks, self.chunk_tokens = num_chunks, chunk_tokens
        self.out_stream = torch.cuda.Stream(self.device) if cuda else None
        self.in_stream = torch.cuda.Stream(self.device, priority=-1) if cuda else None  # (higher priority)
        staging = (chunk_tokens, *self.tail)
        # elements of one layer's K (or V) of a chunk
        self.chunk_size = chunk_size = chunk_tokens * int(np.prod(self.tail))
        self.out_chunks = min(max_out, OUT_STAGING_CHUNKS)  # every layer of this many chunks at a time
        self.out_buffer = torch.empty((2, self.layers * self.out_chunks * chunk_size), dtype=k.dtype,
                                      device=self.device) if cuda else None
        # copies in: two layers of max_in chunks (layer by layer), or every layer of out_chunks (deferred)
        size = 2 * max(2 * max_in, self.layers * self.out_chunks) * chunk_size
        in_storage = torch.empty(size, dtype=k.dtype, device=self.device) if cuda else None
        self.in_buffers = in_storage[:4 * max_in * chunk_size].view(2, 2, max_in, *staging) if cuda else None
        self.restore_buffer = in_storage[:2 * self.layers * self.out_chunks * chunk_size].view(2, -1) \
            if cuda else None
        self.bytes_per_chunk = 2 * self.layers * chunk_size * k.dtype.itemsize
        # (a layer-by-layer swap-in's per-layer host work is a few calls: what it needs is made here)
        self.layer_caches = (cache.k.unbind(0), cache.v.unbind(0))
        self.piece_bytes = chunk_size * k.dtype.itemsize  # one layer's K (or V) of one chunk
        self.ready = [torch.cuda.Event() for _ in range(self.layers)] if cuda else None  # copied in (per layer)
        self.consumed = [torch.cuda.Event() for _ in range(self.layers)] if cuda else None  # staging read
        # host time spent issuing copies (benchmarks): plans and runs of host chunks, each way
        self.counters = {"out_plans": 0, "out_runs": 0, "out_ms": 0.0, "in_plans": 0, "in_runs": 0, "in_ms": 0.0}

    def release(self) -> None:
        """Give the host chunks and the staging buffers back now (the runner stopped)."""
        for t in (self.host, self.out_buffer, self.in_buffers):
            if t is not None:
                t.untyped_storage().resize_(0)

    @staticmethod
    def num_chunks_for(num_bytes: int, config, chunk_tokens: int, dtype: torch.dtype) -> int:
        return num_bytes // (2 * config.num_layers * chunk_tokens * config.num_kv_heads * config.head_dim * dtype.itemsize)

    def measure_swap_in(self, max_chunks: int = 8) -> float:
        """Seconds to copy one chunk in (every layer's K and V), timed on a few (at start-up)."""
        n = max(1, min(self.num_chunks, max_chunks, self.in_buffers.shape[2] if self.in_buffers is not None else 8))
        if self.in_stream is None:
            start = time.perf_counter()
            for layer in range(self.layers):
                for kv in range(2):
                    self.host[kv, layer, :n].clone()
            return (time.perf_counter() - start) / n
        seconds, stream = 0.0, self.in_stream
        pieces = _pieces([(0, 0, n)], self.piece_bytes)
        for _ in range(2):  # (the first warms up)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            for layer in range(self.layers):
                for kv in range(2):
                    self.fetch(self.in_buffers[layer % 2, kv].data_ptr(), layer, kv, pieces, stream.cuda_stream)
            end.record(stream)
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        return seconds / n

    # out --------------------------------------------------------------------------------------
    def swap_out(self, plan, compute_stream) -> None:
        start = time.perf_counter()
        self._swap_out(plan, compute_stream)
        c = self.counters
        c["out_plans"] += 1
        c["out_runs"] += len(_runs(plan.swap_out_host))
        c["out_ms"] += (time.perf_counter() - start) * 1e3

    def _swap_out(self, plan, compute_stream) -> None:
        blocks, hosts = plan.swap_out_blocks, plan.swap_out_host
        if self.out_stream is None:
            index = torch.from_numpy(blocks.reshape(-1).astype(np.int64))
            for layer in range(self.layers):
                for kv, source in enumerate((self.cache.k[layer], self.cache.v[layer])):
                    chunks = source.index_select(0, index).view(len(hosts), self.chunk_tokens, *self.tail)
                    self.host[kv, layer].index_copy_(0, torch.from_numpy(hosts), chunks)
            plan.done = True
            return
        stream = self.out_stream
        stream.wait_stream(compute_stream)
        stream.wait_stream(self.in_stream)  # (copies in still reading host chunks this may overwrite)
        step = self.out_chunks
        for first in range(0, len(hosts), step):  # (in pieces the staging buffer holds)
            part = hosts[first:first + step]
            m = len(part)
            with torch.cuda.stream(stream):  # (the index is copied on the stream that reads it)
                index = _on_device(blocks[first:first + step], self.device)
                for kv, source in enumerate((self.cache.k, self.cache.v)):
                    staged, chunks = self._staging(self.out_buffer, kv, m)
                    torch.index_select(source, 1, index, out=staged)  # every layer's blocks at once
                    for at, host, n in _runs(part):  # a run: one contiguous piece per layer
                        copy_2d(self.host[kv, :, host:host + n], chunks[:, at:at + n], stream)
        with torch.cuda.stream(stream):
            done = torch.cuda.Event()
            done.record(stream)
        plan.done = done

    def _staging(self, buffer: torch.Tensor, kv: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A staging buffer [2, n] for K (kv 0) or V of every layer of m chunks, as blocks [layers,
        m * blocks per chunk, block size, ...] and as chunks [layers, m, chunk_tokens, ...]."""
        chunks = buffer[kv, :self.layers * m * self.chunk_size]
        chunks = chunks.view(self.layers, m, self.chunk_tokens, *self.tail)
        return chunks.view(self.layers, m * self.per_chunk, self.block_size, *self.tail), chunks

    # in ---------------------------------------------------------------------------------------
    def fetch(self, dst: int, layer: int, kv: int, pieces: list, stream: int) -> None:
        """One layer's K (kv 0) or V (kv 1) of host chunks into the staging buffer at address dst:
        one driver copy per (offset in dst, offset in the layer's host chunks, bytes) piece on the
        raw stream handle, no tensor ops (it runs once per layer)."""
        first = self.host.data_ptr() + (kv * self.layers + layer) * self.num_chunks * self.piece_bytes
        for at, host, nbytes in pieces:
            copy_to_device(dst + at, first + host, nbytes, stream)

    def swap_in(self, plan, compute_stream) -> "_SwapIn":
        """Copies in that the iteration's layers wait for, one by one."""
        start = time.perf_counter()
        copies = _SwapIn(self, plan, compute_stream)
        self._count_in(plan, (time.perf_counter() - start) * 1e3)
        return copies

    def _count_in(self, plan, ms: float) -> None:
        c = self.counters
        c["in_plans"] += 1
        c["in_runs"] += len(_runs(plan.swap_in_host))
        c["in_ms"] += ms

    def restore(self, plan, compute_stream) -> None:
        """Copies in on the side stream, every layer (its turns are prefilled in a later
        iteration, once `plan.done` has passed)."""
        start = time.perf_counter()
        self._restore(plan, compute_stream)
        self._count_in(plan, (time.perf_counter() - start) * 1e3)

    def _restore(self, plan, compute_stream) -> None:
        hosts = plan.swap_in_host
        n = len(hosts)
        if self.in_stream is None:
            _SwapIn(self, plan, None).all_layers()
            plan.done = True
            return
        stream = self.in_stream
        # (the new blocks may still be written by earlier work, and the staging buffer read by the
        # compute stream's scatters of an earlier layer-by-layer swap-in)
        stream.wait_stream(compute_stream)
        step, pc = self.out_chunks, self.per_chunk
        with torch.cuda.stream(stream):  # every layer at once, through the copies' staging buffer
            index = _on_device(plan.swap_in_blocks, self.device)
            for first in range(0, n, step):
                part = hosts[first:first + step]
                m = len(part)
                for kv, cache in enumerate((self.cache.k, self.cache.v)):
                    staged, chunks = self._staging(self.restore_buffer, kv, m)
                    for at, host, count in _runs(part):
                        copy_2d(chunks[:, at:at + count], self.host[kv, :, host:host + count], stream)
                    cache.index_copy_(1, index[first * pc:(first + m) * pc], staged)
            done = torch.cuda.Event()
            done.record(stream)
        plan.done = done


class _SwapIn:
    """One iteration's copies in; `before_attention(layer)` is called by the forward pass. Per
    layer it costs the host a handful of calls (the forward is host-bound at small batches, so
    every microsecond here is one of the turn's): views, addresses and events are made once."""

    def __init__(self, tier: HostTier, plan, compute_stream):
        self.tier = tier
        self.hosts = plan.swap_in_host
        self.n = len(self.hosts)
        self.compute = compute_stream
        if tier.in_stream is None:
            self.index = torch.from_numpy(plan.swap_in_blocks.reshape(-1).astype(np.int64))
            return
        self.index = _on_device(plan.swap_in_blocks, tier.device)
        shape = (self.n * tier.per_chunk, tier.block_size, *tier.tail)
        self.staged = [[tier.in_buffers[b, kv, :self.n].view(shape) for kv in range(2)] for b in range(2)]
        self.staged_at = [[t.data_ptr() for t in pair] for pair in self.staged]
        self.pieces = _pieces(_runs(self.hosts), tier.piece_bytes)
        self.in_handle = tier.in_stream.cuda_stream
        tier.in_stream.wait_stream(compute_stream)  # (new blocks may still be written by earlier work)
        for layer in range(min(2, tier.layers)):
            self._issue(layer)

    def _issue(self, layer: int) -> None:
        tier = self.tier
        stream = tier.in_stream
        if layer >= 2:
            stream.wait_event(tier.consumed[layer - 2])
        staged = self.staged_at[layer % 2]
        for kv in range(2):
            tier.fetch(staged[kv], layer, kv, self.pieces, self.in_handle)
        tier.ready[layer].record(stream)

    def all_layers(self) -> None:
        for layer in range(self.tier.layers):
            self.before_attention(layer)

    def before_attention(self, layer: int) -> None:
        start = time.perf_counter()
        self._before_attention(layer)
        self.tier.counters["in_ms"] += (time.perf_counter() - start) * 1e3

    def _before_attention(self, layer: int) -> None:
        tier = self.tier
        k_cache, v_cache = tier.layer_caches[0][layer], tier.layer_caches[1][layer]
        if tier.in_stream is None:
            hosts = torch.from_numpy(self.hosts)
            shape = (self.n * tier.per_chunk, tier.block_size, *tier.tail)
            for kv, cache in enumerate((k_cache, v_cache)):
                cache.index_copy_(0, self.index, tier.host[kv, layer].index_select(0, hosts).view(shape))
            return
        self.compute.wait_event(tier.ready[layer])
        staged = self.staged[layer % 2]
        k_cache.index_copy_(0, self.index, staged[0])
        v_cache.index_copy_(0, self.index, staged[1])
        tier.consumed[layer].record(self.compute)
        if layer + 2 < tier.layers:
            self._issue(layer + 2)


def _on_device(blocks: np.ndarray, device) -> torch.Tensor:
    """Block ids as an index on the device, through pinned memory: a copy from pageable memory
    would first wait for everything queued on the stream (the running iteration)."""
    return torch.from_numpy(blocks.reshape(-1).astype(np.int64)).pin_memory().to(device, non_blocking=True)


def _pieces(runs: list, piece_bytes: int) -> list[tuple[int, int, int]]:
    """Runs as (byte offset in the staging buffer, byte offset in a layer's host chunks, bytes)."""
    return [(at * piece_bytes, host * piece_bytes, count * piece_bytes) for at, host, count in runs]


def _runs(hosts: np.ndarray) -> list[tuple[int, int, int]]:
    """(position in the plan, first host chunk, count) of each run of consecutive host chunks."""
    breaks = np.flatnonzero(np.diff(hosts) != 1) + 1
    starts = np.concatenate([[0], breaks])
    counts = np.diff(np.concatenate([starts, [len(hosts)]]))
    return list(zip(starts.tolist(), hosts[starts].tolist(), counts.tolist()))
