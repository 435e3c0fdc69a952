"""SequenceQueue: one decoder's iterations, planned from its running sequences (core/sequences.py)
and its waiting requests (ORCA's iteration-level scheduling, Pensieve's unified prefill + decode
batch; thesis §2.9, §3.4).

When the blocks run out, the newest sequence is suspended: its blocks are freed and it waits
again, first in line, with its known tokens as its prompt (it is recomputed; sampling is seeded
per token, so it continues as if never suspended). New sequences join only while a reserve of
blocks stays free for the running ones.

A turn of a conversation (core/conversations.py) joins with the conversation's tokens before its
prompt, and its cache: positions [skip_from, skip_to) are already there (on the GPU, or swapped in
before each layer's attention in the iteration it joins); [0, skip_from) were dropped and are
recomputed first, as a sub-request of their own that shares the sequence's blocks (Pensieve Fig.
3.8), then the prompt. When the turn finishes, its blocks stay with the conversation.
"""
import numpy as np

from batchmaker.core.cache_plan import CachePlan
from batchmaker.core.conversations import ConversationCache
from batchmaker.core.sequences import Sequences
from batchmaker.core.iteration_plan import IterationPlan
from batchmaker.core.iteration_shapes import NO_GRAPHS, GraphShapes
from batchmaker.core.task import IterationTask
from batchmaker.core.waiting import Chunk, Waiting


class SequenceQueue:
    """The scheduler's queue of one decoder cell type: the waiting requests and, per worker, its
    running sequences and its conversations' caches. `form` plans one iteration per call (the
    scheduler's task)."""

    task_kind = "iteration"

    def __init__(self, cell_type, sequences: dict[int, Sequences], finisher, reserve: float = 0.1,
                 caches: dict[int, ConversationCache] | None = None, shapes: dict[int, GraphShapes] | None = None):
        self.cell_type = cell_type
        self.sequences = sequences  # worker id -> Sequences
        self.shapes = shapes or {w: NO_GRAPHS for w in sequences}  # worker id -> the CUDA graphs it replays
        self.caches = caches or {}  # worker id -> ConversationCache
        self.finisher = finisher  # resolves, streams and fails requests (batchmaker/generation.py)
        self.waiting = Waiting()
        self.pinned = {w: Waiting() for w in sequences}  # turns of conversations cached on a worker
        self.num_running_tasks = 0
        self.num_skips = 0
        self.num_suspended = 0
        # what planning saw (benchmarks read them): iterations planned, running sequences summed
        # over them, joins from each line, joins refused for want of blocks or of copy slots
        # and, with conversations, the blocks idle conversations held and those of them locked by
        # copies out in flight, summed over iterations
        self.counters = dict.fromkeys(("planned", "running", "joins_pinned", "joins_waiting",
                                       "refused_blocks", "refused_copies", "idle_held", "idle_locked"), 0)
        self._reserve = {w: int(np.ceil(reserve * (q.blocks.num_blocks - 1))) for w, q in sequences.items()}
        self.iteration_seconds = dict.fromkeys(sequences, 0.0)  # per worker: a moving average of measured iterations
        self._joined = 0
        self._epoch = 0

    @property
    def num_ready(self) -> int:
        """Tokens the next iterations could take (the cell type's batch unit): waiting prompts,
        prompts left to prefill, one per decoding sequence."""
        ready = self.waiting_tokens
        for q in self.sequences.values():
            running = q.active & (q.planned < q.limit)
            prefill = running & (q.computed < q.target)
            left = q.target - q.computed - np.where(q.computed <= q.skip_from, q.skip_to - q.skip_from, 0)
            ready += int(running.sum()) + int(left[prefill].sum())
        return ready

    @property
    def waiting_tokens(self) -> int:
        lines = [self.waiting, *self.pinned.values()]
        return sum(int(c.bounds[-1] - c.bounds[0]) for w in lines for level in w.levels.values() for c in level)

    def add(self, priorities: np.ndarray, chunk: Chunk) -> None:
        worker = np.array([getattr(c, "worker", None) for c in chunk.columns["conversation"]], dtype=object)
        pinned = worker != None  # noqa: E711 (elementwise)
        if pinned.any():
            for w in set(worker[pinned].tolist()):
                here = worker == w
                self.pinned[w].add(priorities[here], chunk.select(here))
                if w in self.caches:  # their caches are active again (T = 0): evicted last
                    rows = np.fromiter((c.row for c in chunk.columns["conversation"][here]), dtype=np.int64)
                    self.caches[w].wait(rows[rows >= 0])
            chunk, priorities = chunk.select(~pinned), priorities[~pinned]
        self.waiting.add(priorities, chunk)

    # forming ----------------------------------------------------------------------------------
    def form(self, worker_id: int, max_tasks: int, epoch: int) -> list[IterationTask]:
        q = self.sequences[worker_id]
        if epoch != self._epoch:
            self._purge(epoch)
        if worker_id in self.caches:
            self.caches[worker_id].poll()
        if q.quarantine:
            q.release_quarantined()
        budget = self.cell_type.max_batch
        plan: list[tuple[np.ndarray, ...]] = []  # (slots, starts, tokens each, occupants' serials)
        incoming = CachePlan()  # this iteration's swap-ins
        # running decodes first, one token each: only those entering a new block are grown one by one
        decoding = np.flatnonzero(q.active & (q.computed >= q.target) & (q.planned < q.limit))
        decoding = decoding[np.argsort(q.order[decoding], kind="stable")][:budget]
        needs = q.blocks.blocks_for(q.computed[decoding] + 1) > q.blocks.count[decoding]
        grown = [s for s in decoding[needs].tolist() if q.active[s] and self._grow(q, worker_id, s, int(q.computed[s]) + 1)]
        decodes = np.concatenate([decoding[~needs], np.array(grown, dtype=np.int64)])
        decodes = decodes[q.active[decodes]]  # (growing may have suspended some)
        ones = np.ones(len(decodes), dtype=np.int64)
        plan.append((decodes, q.computed[decodes].copy(), ones, q.serial[decodes].copy()))
        q.computed[decodes] += 1
        budget -= len(decodes)
        # prompts being prefilled, then new arrivals, in chunks of what the budget leaves
        prefilling = np.flatnonzero(q.active & (q.computed < q.target))
        for s in prefilling[np.argsort(q.order[prefilling], kind="stable")].tolist():
            if budget <= 0:
                break
            restoring = q.restoring[s]
            if restoring is not None:  # its copies in run on the side: its prefill waits for them
                if not restoring.finished:
                    continue
                q.restoring[s] = None
            if q.active[s]:
                budget = self._prefill(q, worker_id, s, budget, plan)
        while budget > 0 and q._free and (self.waiting or self.pinned[worker_id]):
            s = self._join(q, worker_id, incoming, plan)
            if s is None:
                break
            if q.restoring[s] is not None:
                continue
            budget = self._prefill(q, worker_id, s, budget, plan)
            if not q.active[s]:  # suspended for want of blocks: no more joins now
                break
        self.counters["planned"] += 1
        self.counters["running"] += q.num_active
        if worker_id in self.caches:
            cache = self.caches[worker_id]
            self.counters["idle_held"] += cache.num_held
            self.counters["idle_locked"] += cache.num_locked
        slots, starts, counts, serials = (np.concatenate(column) for column in zip(*plan))
        # a sequence suspended by a later one's blocks leaves the plan (its slot may have a new occupant)
        keep = q.active[slots] & (q.serial[slots] == serials)
        slots, starts, counts = slots[keep], starts[keep], counts[keep]
        if not len(slots):
            return []
        return [self._task(q, worker_id, slots, starts, counts, self._copies(worker_id, incoming))]

    def _prefill(self, q: Sequences, worker_id: int, s: int, budget: int, plan: list) -> int:
        """Plan `s`'s next prompt chunks within `budget` (two where its dropped leading tokens end
        and its prompt begins); returns the budget left."""
        while budget > 0 and q.computed[s] < q.target[s]:
            start = int(q.computed[s])
            if start == q.skip_from[s]:
                start = int(q.skip_to[s])  # cached: skip to the prompt
            end = int(q.skip_from[s]) if start < q.skip_from[s] else int(q.target[s])
            n = min(budget, end - start)
            if not self._grow(q, worker_id, s, start + n):
                break
            plan.append((np.array([s]), np.array([start]), np.array([n]), q.serial[s:s + 1].copy()))
            q.computed[s] = start + n
            budget -= n
        return budget

    def _join(self, q: Sequences, worker_id: int, incoming: CachePlan, plan: list) -> int | None:
        """The first waiting request (of the shared line or of this worker's, see `_line`) joins a slot if
        its blocks leave the reserve free (or nothing else runs here). A turn whose cache comes
        back from the host is copied in layer by layer as its iteration runs, alone or where the
        copies hide under the iteration's time (`iteration_seconds`); otherwise it waits for its
        copies on the side (`restoring`: the batch does not)."""
        line = self._line(worker_id)
        chunk = line.take(1)
        columns = {k: v[0] for k, v in chunk.columns.items()}
        conversation = columns["conversation"]
        history = int(columns["history"])
        cache = self.caches.get(worker_id)
        row = conversation.row if conversation is not None and conversation.worker == worker_id else -1
        own = cache.held(row) if cache is not None else 0
        available = (cache.available() if cache is not None else q.blocks.num_free) - own
        need = q.blocks.blocks_for(history + int(chunk.lengths[0]) + 1) - own
        copies_in = cache.to_swap_in(row) + len(incoming.swap_in_host) if cache is not None else 0
        shared = any(len(entry[0]) for entry in plan)
        # copies in layer by layer must hide under the iteration they share (else they wait for the next)
        too_many = copies_in and (copies_in > cache.max_in or (
            incoming.deferred is False and shared and not cache.hides(copies_in, self.iteration_seconds[worker_id])))
        if (q.num_active and available - need < self._reserve[worker_id]) or need > available or too_many:
            line.push_front(int(columns["priority"]), chunk)
            self.counters["refused_copies" if too_many else "refused_blocks"] += 1
            return None
        self.counters["joins_pinned" if line is self.pinned[worker_id] else "joins_waiting"] += 1
        self._joined += 1
        tokens = chunk.values if not history else np.concatenate([conversation.tokens[:history], chunk.values])
        s = q.join(chunk.owners[0], tokens, columns, self._joined, history)
        if conversation is not None:
            conversation.worker = worker_id
            lost = min(history - 1, conversation.computed)
            if row < 0 and lost > 0:  # its cache went with a failed or cancelled turn
                conversation.restored = (0, 0, lost)
                if cache is not None:
                    cache.recomputed(lost)
            if row >= 0:
                recompute, swapped, cached, copies = cache.restore(row, q.blocks.table[s])
                q.blocks.count[s] = q.blocks.blocks_for(cached)
                q.skip_from[s], q.skip_to[s] = recompute, cached
                conversation.restored = (cached - recompute - swapped, swapped, recompute)
                if copies is not None:
                    if incoming.deferred is None:  # on the side, unless the copies hide under the iteration
                        incoming.deferred = shared and not cache.hides(len(copies.swap_in_host),
                                                                       self.iteration_seconds[worker_id])
                    incoming.add_swap_in(copies.swap_in_host, copies.swap_in_blocks)
                    if incoming.deferred:
                        q.restoring[s] = incoming
            conversation.row = -1
        return s

    def _line(self, worker_id: int) -> Waiting:
        """The line whose first request goes first: higher priority, then earlier arrival (turns
        of conversations cached here do not overtake older requests: long histories first would
        fill the blocks with few sequences and starve new conversations)."""
        pinned, shared = self.pinned[worker_id], self.waiting
        if not pinned or not shared:
            return pinned if pinned else shared
        (p1, a1), (p2, a2) = pinned.first(), shared.first()
        return pinned if (-p1, a1) <= (-p2, a2) else shared

    def _grow(self, q: Sequences, worker_id: int, s: int, num_tokens: int) -> bool:
        """Blocks for `s` up to `num_tokens` positions: reclaimed from idle conversations, then by
        suspending the newest sequences while they run out; False if `s` itself was suspended."""
        cache = self.caches.get(worker_id)
        while not q.blocks.grow(s, num_tokens):
            short = int(q.blocks.blocks_for(num_tokens) - q.blocks.count[s]) - q.blocks.num_free
            if cache is not None and cache.reclaim(short) > 0:
                continue
            restoring = np.array([r is not None and not r.finished for r in q.restoring], dtype=bool)
            candidates = np.flatnonzero(q.active & ~restoring)  # (copies may still write a restoring one's blocks)
            if not len(candidates):
                return False
            victim = int(candidates[np.argmax(q.order[candidates])])
            self.suspend(q, victim, worker_id)
            if victim == s:
                return False
        return True

    def suspend(self, q: Sequences, s: int, worker_id: int) -> None:
        """Free `s`'s blocks; it waits again, first in line, to be recomputed from its known tokens."""
        row = q.waiting_row(s)
        conversation = q.conversation[s]
        if conversation is not None:  # its cache goes with the blocks: all of it is recomputed
            gpu, swapped, recomputed = conversation.restored
            self.caches[worker_id].recomputed(gpu + swapped, gpu, swapped, start=recomputed)
            conversation.restored = (0, 0, gpu + swapped + recomputed)
            conversation.worker = None
        self.waiting.push_front(int(row.columns["priority"][0]), row)
        q.leave(s)
        self.num_suspended += 1

    def _copies(self, worker_id: int, incoming: CachePlan) -> CachePlan | None:
        """This iteration's copies: the joining conversations' swap-ins; or, in an iteration
        without them (swapping in goes first), ahead-of-time copies out."""
        cache = self.caches.get(worker_id)
        if len(incoming.swap_in_host):
            return incoming
        return cache.plan_swap_out() if cache is not None else None

    def _task(self, q: Sequences, worker_id: int, slots: np.ndarray, starts: np.ndarray, counts: np.ndarray,
              copies: CachePlan | None) -> IterationTask:
        query_start = np.zeros(len(slots) + 1, dtype=np.int64)
        np.cumsum(counts, out=query_start[1:])
        total = int(query_start[-1])
        token_slots = np.repeat(slots, counts)
        positions = np.arange(total) - np.repeat(query_start[:-1], counts) + np.repeat(starts, counts)
        decode = starts >= q.target[slots]  # feeds the last sampled token
        tokens = q.tokens[token_slots, np.minimum(positions, q.max_len - 1)]
        tokens[np.repeat(decode, counts)] = -1
        bs = q.blocks.block_size
        kv_slots = q.blocks.table[token_slots, positions // bs].astype(np.int64) * bs + positions % bs
        ends = starts + counts
        samples = ends >= q.target[slots]  # the last prefill chunk, or a decode
        sample = np.flatnonzero(samples)
        ss = slots[sample]
        sample_index = q.planned[ss].copy()
        q.planned[ss] += 1
        decode_only = bool(decode.all())
        graph = self.shapes[worker_id].of(len(slots), total, decode_only, int(ends.max()))
        plan = IterationPlan.of(
            tokens=tokens, positions=positions, kv_slots=kv_slots, token_slots=token_slots, query_start=query_start,
            context_lens=ends, block_tables=q.blocks.table[slots], sample_token=query_start[sample + 1] - 1,
            sample_slots=ss, seeds=q.seed[ss], counters=sample_index, top_k=q.top_k[ss], temperature=q.temperature[ss],
            top_p=q.top_p[ss], max_query_len=int(counts.max()), decode_only=decode_only,
            greedy=not (q.temperature[ss] > 0).any(), graph=graph,
            copies=None if copies is None else copies.copies(graph is not None))
        return IterationTask(self, self.cell_type, worker_id, total, plan=plan, slots=slots,
                             serials=q.serial[slots].copy(), owners=q.owner[slots].copy(), sample=sample,
                             cache_plan=copies)

    # completion (manager thread) ----------------------------------------------------------------
    def complete(self, task: IterationTask) -> None:
        q = self.sequences[task.worker_id]
        if task.seconds == task.seconds:  # (measured: not NaN)
            mean = self.iteration_seconds[task.worker_id]
            self.iteration_seconds[task.worker_id] = task.seconds if mean == 0.0 else 0.8 * mean + 0.2 * task.seconds
        if task.error is not None:
            owners = [o for o, s, serial in zip(task.owners, task.slots, task.serials) if q.serial[s] == serial]
            for s, serial in zip(task.slots.tolist(), task.serials.tolist()):
                if q.serial[s] == serial:
                    self._end_turn(q, s)
            self.finisher.fail(owners, task.error)
            return
        slots = task.slots[task.sample]
        current = q.serial[slots] == task.serials[task.sample]
        slots, index, tokens = slots[current], task.plan.counters[current], task.sampled[current]
        if not len(slots):
            return
        q.tokens[slots, index] = tokens
        q.length[slots] = index + 1
        stopped = (q.stops[slots] == tokens[:, None]).any(1)
        done = stopped | (index + 1 >= q.limit[slots])
        for s in slots[done].tolist():
            conversation = q.conversation[s]
            if conversation is not None:  # its cache stays: every position but the last sampled one
                n = int(q.length[s])
                conversation.tokens = q.tokens[s, :n].copy()
                conversation.computed = n - 1
                conversation.row = self.caches[task.worker_id].retire(q.blocks.detach(s), n - 1)
                conversation.worker = task.worker_id
                conversation.turn = None
                conversation.turns += 1
        self.finisher.tokens(q, slots, tokens, done, stopped)
        for s in slots[done].tolist():
            q.leave(s)

    def _end_turn(self, q: Sequences, s: int) -> None:
        """A turn that failed or was cancelled: the conversation is as before it, without a cache
        (unless its next turn came already)."""
        conversation = q.conversation[s]
        if conversation is not None and conversation.turn is q.owner[s]:
            conversation.turn, conversation.worker = None, None
        q.leave(s)

    def _purge(self, epoch: int) -> None:
        """Cancelled or expired requests leave their slots (and blocks) and the waiting lines."""
        self._epoch = epoch
        for line in (self.waiting, *self.pinned.values()):
            for chunk in line.purge():
                for conversation, owner in zip(chunk.columns["conversation"], chunk.owners):
                    if conversation is not None and conversation.turn is owner:
                        conversation.turn = None
                        if conversation.row >= 0 and conversation.worker in self.caches:
                            self.caches[conversation.worker].wait(conversation.row, False)
        for q in self.sequences.values():
            active = np.flatnonzero(q.active)
            done = np.fromiter((o._done for o in q.owner[active]), dtype=bool, count=len(active))
            for s in active[done].tolist():
                self._end_turn(q, s)
