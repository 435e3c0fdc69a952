"""The KV caches of idle conversations on one worker, in two tiers (Pensieve; thesis §3.4.3), as
rows of arrays. No torch here: this is the bookkeeping; the worker moves the bytes
(batchmaker/exec/kv_swap.py). The conversations layer (core/conversations.py) drives it.

When a turn of a conversation finishes, its sequence's KV blocks stay with the conversation
instead of going back to the free stack. A conversation's cached context is cut into chunks of
`chunk_tokens` positions (whole KV blocks), and it is always evicted from its leading end, so
chunk k of a conversation with c cached positions is in one of three places:

  [0, dropped)        gone: recomputed from the conversation's tokens when it resumes
  [dropped, hosted)   copied to a host chunk (`host`); GPU blocks may still be held (lazily
                      reclaimed) once the copy is `ready`
  [hosted, chunks)    on the GPU only

Below `swap_threshold` of free GPU blocks, the idle conversations' lowest-valued GPU-only chunks
are copied to the host ahead of time (a few per iteration, never in an iteration that swaps in);
their blocks are reclaimed when a sequence needs blocks. When the host is full, its lowest-valued
chunks are dropped; when the GPU has nothing reclaimable left, GPU chunks are dropped (with the
host chunks before them). A chunk's value is Cost(l) / T (Eq. 3.4-3.6): the cost of recomputing
32 tokens at context position l (profiled per model at start-up), over the time since the
conversation was last active (0 while a turn of it waits in line). Cost grows with l, so the
cheapest chunk of a conversation is its leading one and choosing the lowest values across all
conversations keeps the order above. "lru" sets Cost = 1: the least recently active go first.
"""
import math

import numpy as np

from batchmaker.core.blocks import BlockTables
from batchmaker.core.cache_plan import CachePlan
from batchmaker.core.host_chunks import HostChunks

MIN_RECLAIM = 64  # blocks (at most 2% of them) reclaimed at a time: one pass per batch, not per block


class ConversationCache:
    """The conversations whose KV cache is on one worker: rows of arrays."""

    def __init__(self, blocks: BlockTables, host_chunks: int, chunk_tokens: int, cost: np.ndarray,
                 policy: str = "value", swap_threshold: float = 0.25, max_out: int = 32, max_in: int = 256,
                 max_out_rows: int = 4, clock=None, swap_in_seconds: float = math.inf):
        if chunk_tokens % blocks.block_size:
            raise ValueError(f"chunk_tokens {chunk_tokens} is not a multiple of the block size {blocks.block_size}")
        if policy not in ("value", "lru"):
            raise ValueError(f"eviction policy: 'value' or 'lru', got {policy!r}")
        import time
        self.clock = clock or time.monotonic
        self.blocks = blocks
        self.chunk_tokens = chunk_tokens
        self.per_chunk = chunk_tokens // blocks.block_size  # blocks per chunk
        self.max_chunks = -(-blocks.max_blocks // self.per_chunk)
        # cost[k]: recomputing chunk k (its positions end at (k + 1) * chunk_tokens); increasing (a
        # tiny ramp breaks ties), so a conversation's chunks are valued in leading-end order
        profiled = np.maximum.accumulate(np.asarray(cost, dtype=np.float64)[:self.max_chunks])
        self._cost_upto = np.concatenate([[0.0], np.cumsum(profiled)])  # recomputing chunks [0, k): [k]
        cost = np.ones(self.max_chunks) if policy == "lru" else profiled
        self.cost = cost + np.arange(len(cost)) * 1e-9 * float(cost.max())
        self.swap_threshold = swap_threshold
        self.max_out = max_out
        self.max_out_rows = max_out_rows  # conversations one copy-out plan touches (it locks their blocks)
        self.max_in = max_in  # host chunks one iteration can swap in (the worker's staging)
        self.swap_in_seconds = swap_in_seconds  # copying one chunk in (measured by the worker; inf: unknown)
        self.host_chunks = HostChunks(host_chunks)  # which host chunk ids are free
        self.pending: list[tuple[CachePlan, np.ndarray, np.ndarray]] = []  # swap-outs: plan, rows, hosted after
        self.num_held = 0  # GPU blocks held by idle conversations
        self.min_reclaim = max(1, min(MIN_RECLAIM, (blocks.num_blocks - 1) // 50))
        self.stats = {"gpu_hit_tokens": 0, "host_hit_tokens": 0, "recomputed_tokens": 0, "recomputed_seconds": 0.0,
                      "chunks_out": 0, "chunks_in": 0, "chunks_dropped": 0, "prefix_hit_tokens": 0}
        self._grow_rows(64)

    def _grow_rows(self, n: int) -> None:
        old = getattr(self, "cached", np.zeros(0, dtype=np.int64))
        have = len(old)

        def more(name, fill, shape=(), dtype=np.int64):
            column = np.full((n - have, *shape), fill, dtype=dtype)
            setattr(self, name, np.concatenate([getattr(self, name), column]) if have else column)

        for name in ("cached", "dropped", "hosted", "ready"):
            more(name, 0)
        more("last_active", 0.0, dtype=np.float64)
        more("idle", False, dtype=bool)  # holds a cache and no turn runs
        more("waiting", False, dtype=bool)  # ... and a turn of it waits in line (T = 0: active)
        more("gpu", 0, (self.max_chunks * self.per_chunk,), np.int32)  # block ids; 0: none
        more("host", -1, (self.max_chunks,))
        self.free_rows = [r for r in range(n - 1, have - 1, -1)] + getattr(self, "free_rows", [])

    # turns --------------------------------------------------------------------------------------
    def retire(self, ids: np.ndarray, cached: int) -> int:
        """A finished turn's sequence gives its blocks `ids` (those covering `cached` positions) to
        a new row; the rest go back to the free stack. Returns the row."""
        if not self.free_rows:
            self._grow_rows(2 * len(self.cached))
        r = self.free_rows.pop()
        keep = int(self.blocks.blocks_for(cached))
        self.gpu[r, :keep] = ids[:keep]
        self.num_held += keep
        self.blocks.give_back(ids[keep:])
        self.cached[r], self.dropped[r], self.hosted[r], self.ready[r] = cached, 0, 0, 0
        self.last_active[r] = self.clock()
        self.idle[r], self.waiting[r] = True, False
        return r

    def wait(self, rows, waiting: bool = True) -> None:  # a turn of these idle rows' conversations is in line
        self.waiting[rows] = waiting

    def available(self) -> int:  # blocks a sequence could get
        return self.blocks.num_free + self.reclaimable

    @property
    def reclaimable(self) -> int:
        """Blocks reclaiming idle caches would free, at least: those held, not those copies out in
        flight lock, nor a shared block's references past its first (exact if no sequence holds any)."""
        return max(self.num_held - self.num_locked - self.blocks.num_extra, 0)

    @property
    def num_blocks_held(self) -> int:  # (distinct: `num_held` counts a shared block per holder)
        held = self.gpu[self.idle]
        return len(np.unique(held[held != 0])) if self.blocks.num_extra else self.num_held

    def held(self, r: int) -> int:
        return int((self.gpu[r] != 0).sum()) if r >= 0 and self.idle[r] else 0

    @property
    def num_locked(self) -> int:
        """Blocks idle conversations hold that copies out in flight keep from being reclaimed."""
        if not self.pending:
            return 0
        n = 0
        for r in {r for _, rows, _ in self.pending for r in rows.tolist()}:
            if self.idle[r] and self.hosted[r] > self.ready[r]:
                n += int((self.gpu[r, self.ready[r] * self.per_chunk:] != 0).sum())
        return n

    def hides(self, num_chunks: int, seconds: float) -> bool:
        """Whether copying num_chunks in, layer by layer, fits under an iteration of `seconds`."""
        return num_chunks * self.swap_in_seconds <= seconds

    def to_swap_in(self, r: int) -> int:
        """Host chunks row r would copy in if it resumed now."""
        if r < 0 or not self.idle[r]:
            return 0
        chunks = np.arange(self.dropped[r], self.hosted[r])
        return int((self.gpu[r, chunks * self.per_chunk] == 0).sum())

    def restore(self, r: int, table_row: np.ndarray) -> tuple[int, int, int, CachePlan | None]:
        """Row r's cache into a sequence's table row; its blocks leave the row (which is freed).
        Blocks are taken for swapped and dropped chunks (reclaiming others' as needed; the caller
        made sure enough are available). Returns (recompute up to, positions swapped in, cached
        positions, the swap-in)."""
        self.idle[r] = False
        cached, dropped, hosted, pc = int(self.cached[r]), int(self.dropped[r]), int(self.hosted[r]), self.per_chunk
        nb = int(self.blocks.blocks_for(cached))
        ids_held = self.gpu[r].copy()
        ids = ids_held[:nb].copy()
        missing = np.flatnonzero(ids == 0)
        self.num_held -= nb - len(missing)
        self.gpu[r] = 0  # (its blocks are the sequence's now: reclaiming passes them by)
        if len(missing) > self.blocks.num_free:
            self.reclaim(len(missing) - self.blocks.num_free)
        ids[missing] = self.blocks.take(len(missing))
        table_row[:nb] = ids
        # host chunks: those whose GPU blocks were reclaimed come in; the others' copies are let go
        chunks = np.arange(dropped, hosted)
        lost = ids_held[chunks * pc] == 0
        moves = chunks[lost]
        plan = None
        if len(moves):
            index = moves[:, None] * pc + np.arange(pc)
            blocks = np.where(index < nb, table_row[index.clip(max=nb - 1)], 0).astype(np.int64)  # (past the end: scratch)
            plan = CachePlan(swap_in_host=self.host[r, moves].copy(), swap_in_blocks=blocks)
        self.host_chunks.give_back(self.host[r, dropped:hosted])
        recompute = min(dropped * self.chunk_tokens, cached)
        swapped = min(len(moves) * self.chunk_tokens, cached - recompute)
        self.recomputed(recompute)
        self.stats["host_hit_tokens"] += swapped
        self.stats["gpu_hit_tokens"] += cached - recompute - swapped
        self.stats["chunks_in"] += len(moves)
        self._clear(r)
        return recompute, swapped, cached, plan

    def recomputed(self, tokens: int, instead_of_gpu: int = 0, instead_of_host: int = 0, start: int = 0) -> None:
        """Count positions [start, start + tokens) of a context as recomputed (also after all,
        when a turn lost its cache: taking back the hits they were counted as), and their
        recompute time by the profiled Cost(l) (what the value policy minimizes; LRU too)."""
        ct, upto = self.chunk_tokens, self._cost_upto
        first, last = min(start // ct, len(upto) - 1), min(-(-(start + tokens) // ct), len(upto) - 1)
        self.stats["recomputed_seconds"] += float(upto[last] - upto[first]) if tokens > 0 else 0.0
        self.stats["recomputed_tokens"] += tokens
        self.stats["gpu_hit_tokens"] -= instead_of_gpu
        self.stats["host_hit_tokens"] -= instead_of_host

    def reread(self, tokens: int) -> None:
        """Positions [0, tokens) counted as recomputed are read from blocks others hold instead."""
        self.stats["recomputed_tokens"] -= tokens
        self.stats["recomputed_seconds"] -= float(self._cost_upto[min(tokens // self.chunk_tokens, len(self._cost_upto) - 1)])

    def forget(self, r: int) -> None:
        """Row r's conversation ended or expired: its blocks and host chunks are free."""
        if r < 0 or not self.idle[r]:
            return
        self.idle[r] = False
        held = self.gpu[r][self.gpu[r] != 0]
        self.blocks.give_back(held)
        self.num_held -= len(held)
        self.host_chunks.give_back(self.host[r, self.dropped[r]:self.hosted[r]])
        self._clear(r)

    def _clear(self, r: int) -> None:
        self.gpu[r] = 0
        self.host[r] = -1
        self.cached[r] = self.dropped[r] = self.hosted[r] = self.ready[r] = 0
        self.free_rows.append(r)

    # eviction -------------------------------------------------------------------------------------
    def value(self, rows: np.ndarray, chunks: np.ndarray, now: float) -> np.ndarray:
        return self.cost[chunks] / np.maximum(np.where(self.waiting[rows], 0.0, now - self.last_active[rows]), 1e-6)

    def _chunks(self, start: np.ndarray, stop: np.ndarray, rows: np.ndarray, limit: int | None = None,
                held: bool = False):
        """(rows, chunk indices) of the ranges [start, stop) of `rows` (with `held`: those whose GPU
        blocks are held), lowest value first; with `limit`, the `limit` lowest only (a partition,
        not a sort: this runs in iterations)."""
        counts = np.maximum(stop - start, 0)
        rr, kk = np.repeat(rows, counts), _ranges(start, counts)
        if held:
            on = self.gpu[rr, kk * self.per_chunk] != 0
            rr, kk = rr[on], kk[on]
        values = self.value(rr, kk, self.clock())
        if limit is not None and limit < len(values):
            part = np.argpartition(values, limit)[:limit]
            rr, kk, values = rr[part], kk[part], values[part]
        order = np.argsort(values, kind="stable")
        return rr[order], kk[order]

    def _num_chunks(self, rows):
        return -(-self.cached[rows] // self.chunk_tokens)

    def _num_reclaimable(self) -> int:
        rows = np.flatnonzero(self.idle & (self.ready > self.dropped))
        if not len(rows):
            return 0
        counts = self.ready[rows] - self.dropped[rows]
        kk = _ranges(self.dropped[rows], counts)
        return int((self.gpu[np.repeat(rows, counts), kk * self.per_chunk] != 0).sum()) * self.per_chunk

    def reclaim(self, need: int) -> int:
        """Free at least `need` GPU blocks if the idle conversations can give them: first those of
        chunks already copied to the host, then by dropping chunks (from the leading end).
        Returns the blocks freed. At least `min_reclaim` blocks go at a time, so that a run of
        sequences each short of a block costs one pass over the idle chunks, not one each (with
        hundreds of idle conversations a pass is ~0.5 ms on the manager thread)."""
        goal = max(need, self.min_reclaim)
        rows = np.flatnonzero(self.idle & (self.ready > self.dropped))
        freed = self._release(self.dropped[rows], self.ready[rows], rows, goal, self._free_gpu, held=True)
        if freed >= need:
            return freed
        # the GPU chunks of conversations without copies in flight, cheapest first
        rows = np.flatnonzero(self.idle & (self.ready == self.hosted) & (self._num_chunks_all() > self.hosted))
        return freed + self._release(self.hosted[rows], self._num_chunks(rows), rows, goal - freed,
                                     self._drop_through)

    def _release(self, start, stop, rows, goal: int, release, held: bool = False) -> int:
        """`release(row, chunk)` on the cheapest chunks of the ranges until `goal` blocks are
        freed: a partition of the few likely needed first (a chunk may hold fewer than its
        blocks), all of them if those fall short."""
        freed = 0
        for limit in (2 * -(-goal // self.per_chunk) + 8, None):
            rr, kk = self._chunks(start, stop, rows, limit=limit, held=held)
            for r, k in zip(rr.tolist(), kk.tolist()):
                if freed >= goal:
                    return freed
                freed += release(r, k)
            if limit is None or len(rr) < limit:
                break
        return freed

    def _num_chunks_all(self):
        return -(-self.cached // self.chunk_tokens)

    def _free_gpu(self, r: int, k: int) -> int:
        span = slice(k * self.per_chunk, (k + 1) * self.per_chunk)
        held = self.gpu[r, span][self.gpu[r, span] != 0]
        self.num_held -= len(held)
        self.gpu[r, span] = 0
        return self.blocks.give_back(held)  # (a block others hold too is not freed)

    def _drop_through(self, r: int, k: int) -> int:
        """Drop chunks [dropped, k] of row r (host copies and GPU blocks)."""
        d = int(self.dropped[r])
        if k < d:
            return 0
        freed = sum(self._free_gpu(r, j) for j in range(d, k + 1))
        hosted = int(self.hosted[r])
        self.host_chunks.give_back(self.host[r, d:min(k + 1, hosted)])
        self.host[r, d:k + 1] = -1
        self.dropped[r] = k + 1
        self.hosted[r] = max(hosted, k + 1)
        self.ready[r] = max(int(self.ready[r]), k + 1)
        self.stats["chunks_dropped"] += k + 1 - d
        return freed

    def plan_swap_out(self) -> CachePlan | None:
        """Ahead-of-time copies to the host while free blocks are below the threshold (None when
        nothing is to copy). The chunks' blocks stay held until the copies are done (`poll`, which
        the caller runs first); one plan is in flight at a time. Chunks go from the leading end,
        so no chunk of a conversation with copies in flight can be dropped: a plan takes its
        cheapest chunks from at most `max_out_rows` conversations, not one chunk each of many."""
        if self.pending:
            return None
        total = self.blocks.num_blocks - 1
        short = int(self.swap_threshold * total) - self.blocks.num_free
        if short <= 0 or self.host_chunks.num == 0:
            return None
        short -= self._num_reclaimable()
        if short <= 0:
            return None
        rows = np.flatnonzero(self.idle & (self._num_chunks_all() > self.hosted))
        want = min(self.max_out, -(-short // self.per_chunk))
        if len(rows) > self.max_out_rows:  # those of the cheapest chunks: a plan locks all their blocks
            rr, _ = self._chunks(self.hosted[rows], self._num_chunks(rows), rows, limit=want)
            rows = np.fromiter(dict.fromkeys(rr.tolist()), dtype=np.int64)[:self.max_out_rows]
        rr, kk = self._chunks(self.hosted[rows], self._num_chunks(rows), rows, limit=want)
        want = min(want, len(rr))
        if want == 0:
            return None
        rr, kk = rr[:want], kk[:want]
        if self.host_chunks.num_free < want:  # make room: drop the host's cheapest ready chunks
            rows = np.flatnonzero(self.idle & (self.ready > self.dropped))
            dr, dk = self._chunks(self.dropped[rows], self.ready[rows], rows, limit=want - self.host_chunks.num_free)
            for r, k in zip(dr.tolist(), dk.tolist()):
                if self.host_chunks.num_free >= want:
                    break
                self._drop_through(r, k)
            want = min(want, self.host_chunks.num_free)
            rr, kk = rr[:want], kk[:want]
        # (dropping host chunks may have dropped these rows' chunks too: keep those still GPU-only)
        keep = kk >= self.hosted[rr]
        rr, kk = rr[keep], kk[keep]
        if not len(rr):
            return None
        hosts = self.host_chunks.take(len(rr))
        self.host[rr, kk] = hosts
        np.maximum.at(self.hosted, rr, kk + 1)
        index = (kk[:, None] * self.per_chunk + np.arange(self.per_chunk)).clip(max=self.gpu.shape[1] - 1)
        blocks = self.gpu[rr[:, None], index].astype(np.int64)  # (0, the scratch block, past a row's end)
        plan = CachePlan(swap_out_blocks=blocks, swap_out_host=hosts)
        ends = self.hosted[np.unique(rr)].copy()
        self.pending.append((plan, np.unique(rr), ends))
        self.stats["chunks_out"] += len(rr)
        return plan

    def poll(self) -> None:
        """Copies out that finished make their chunks' blocks reclaimable."""
        while self.pending and self.pending[0][0].finished:
            _, rows, ends = self.pending.pop(0)
            live = self.idle[rows]
            self.ready[rows[live]] = np.maximum(self.ready[rows[live]], ends[live])

    def demote(self, r: int, drop: bool = False) -> CachePlan | None:
        """Send all of idle row r's GPU chunks to the host (a plan of copies out for the worker;
        then `poll` and `release_copied`), or drop its whole cache: for tests and benchmarks that
        need a turn restored from a given tier."""
        n = int(self._num_chunks(np.array([r]))[0])
        if drop:
            self._drop_through(r, n - 1)
            return None
        first = int(self.hosted[r])
        if n - first > self.host_chunks.num_free:
            raise RuntimeError(f"{n - first} host chunks wanted, {self.host_chunks.num_free} free")
        hosts = self.host_chunks.take(n - first)
        self.host[r, first:n] = hosts
        self.hosted[r] = n
        index = np.arange(first * self.per_chunk, n * self.per_chunk).clip(max=self.gpu.shape[1] - 1)
        plan = CachePlan(swap_out_blocks=self.gpu[r, index].astype(np.int64).reshape(n - first, self.per_chunk),
                         swap_out_host=hosts)
        self.pending.append((plan, np.array([r]), np.array([n])))
        return plan

    def release_copied(self, r: int) -> int:
        """Free the GPU blocks of row r's chunks whose copies on the host are complete."""
        return sum(self._free_gpu(r, k) for k in range(int(self.dropped[r]), int(self.ready[r])))

    def check(self) -> None:
        """Accounting at idle (tests): every block is free, held by one conversation, or by a
        sequence; every host chunk free or held by one conversation."""
        held = self.gpu[self.idle]
        held = held[held != 0]
        assert len(held) == self.num_held, "the held count is off"
        self.blocks.check(held)
        hosts = self.host[self.idle]
        hosts = hosts[hosts >= 0]
        assert len(np.unique(hosts)) == len(hosts) and not self.host_chunks.is_free[hosts].any()
        assert len(hosts) + int(self.host_chunks.is_free.sum()) == self.host_chunks.num == len(hosts) + self.host_chunks.num_free, \
            "a host chunk leaked"


def _ranges(start: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """start[i], start[i] + 1, ..., start[i] + counts[i] - 1, for each i, one after another."""
    return np.repeat(start - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()))
