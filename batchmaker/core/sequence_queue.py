"""SequenceQueue: one decoder's iterations, planned from its running sequences (core/sequences.py)
and its waiting requests (ORCA's iteration-level scheduling, Pensieve's unified prefill + decode
batch; thesis §2.9, §3.4). `form` plans one iteration per call (an IterationTask whose `plan` is
core/iteration_plan.IterationPlan); `complete` takes its sampled tokens.

An iteration takes, within the token budget: every running decode (one token each, oldest
first), then the next prompt chunks of sequences still prefilling, then new requests joining free
slots, in chunks of what the budget leaves (a long prompt never stalls the running decodes). A
waiting request joins only while a reserve of blocks stays free for the running ones. When the
blocks run out, blocks of idle conversations are reclaimed, then the newest sequence is
suspended: its blocks are freed and it waits again, first in line, with its known tokens as its
prompt (it is recomputed; sampling is seeded per token, so it continues as if never suspended).

Turns of conversations go through the conversations layer (core/conversations.py): it routes a
turn to the worker holding its cache, and when the turn joins, its cached blocks become the
sequence's: positions [skip_from, skip_to) are already there (on the GPU, or copied in from the
host), [0, skip_from) were dropped and are recomputed first, as a sub-request of their own that
shares the sequence's blocks (Pensieve Fig. 3.8), then the prompt. With prefix caching, a
sequence without a cache of its own starts with the longest run of whole blocks its tokens start
with that any sequence computed (core/block_index.py; filed at a prompt's first sample and when a
conversation's turn finishes), shared read only: it computes from the position after them (a
restored turn too, where its dropped leading chunks are such blocks).
"""
import numpy as np

from batchmaker.core.cache_plan import CachePlan
from batchmaker.core.conversations import Conversations
from batchmaker.core.iteration_plan import IterationPlan
from batchmaker.core.iteration_shapes import NO_GRAPHS, GraphShapes
from batchmaker.core.sequences import Sequences
from batchmaker.core.task import IterationTask
from batchmaker.core.waiting import Chunk, Waiting
from batchmaker.errors import CellError

_NO_BLOCKS = np.zeros(0, dtype=np.int32)


class SequenceQueue:
    """The scheduler's queue of one decoder cell type: the waiting requests and, per worker, its
    running sequences."""

    task_kind = "iteration"

    def __init__(self, cell_type, sequences: dict[int, Sequences], finisher, reserve: float = 0.1,
                 turns: Conversations | None = None, shapes: dict[int, GraphShapes] | None = None,
                 stages: int = 1):
        self.cell_type = cell_type
        # ORCA's pipeline of `stages`: a sequence whose sampled token is still in flight is not
        # decoded again until it comes back, so iterations in flight hold disjoint sequences, and
        # the plan carries the token to stage 0; without a pipeline the next iteration feeds it on
        # the device. An iteration decodes at most its share of the decoding sequences, so that
        # sequences that started together still spread over the stages
        self.stages = stages
        self.exclusive = stages > 1
        self.sequences = sequences  # worker id -> Sequences
        self.turns = turns or Conversations({})  # conversations and their caches across turns
        self.shapes = shapes or dict.fromkeys(sequences, NO_GRAPHS)  # worker id -> the CUDA graphs it replays
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
        """Admitted requests join the waiting line; turns whose cache is on a worker, its line."""
        workers = self.turns.route(chunk.columns["conversation"])
        pinned = workers != None  # noqa: E711 (elementwise)
        if pinned.any():
            for w in set(workers[pinned].tolist()):
                here = workers == w
                self.pinned[w].add(priorities[here], chunk.select(here))
            chunk, priorities = chunk.select(~pinned), priorities[~pinned]
        self.waiting.add(priorities, chunk)

    # forming ----------------------------------------------------------------------------------
    def form(self, worker_id: int, max_tasks: int, epoch: int) -> list[IterationTask]:
        q = self.sequences.get(worker_id)
        if q is None:  # (a worker that does not serve this decoder: a tensor-parallel one has one)
            return []
        if epoch != self._epoch:
            self._purge(epoch)
        self.turns.poll(worker_id)
        if q.quarantine:
            q.release_quarantined()
        plan: list[tuple[np.ndarray, ...]] = []  # (slots, starts, tokens each, occupants' serials)
        incoming = CachePlan()  # this iteration's swap-ins
        budget = self._decodes(q, worker_id, self.cell_type.max_batch, plan)
        budget = self._prefills(q, worker_id, budget, plan)
        self._joins(q, worker_id, budget, plan, incoming)
        self._count(q, worker_id)
        slots, starts, counts, serials = (np.concatenate(column) for column in zip(*plan))
        # a sequence suspended by a later one's blocks leaves the plan (its slot may have a new occupant)
        keep = q.active[slots] & (q.serial[slots] == serials)
        slots, starts, counts = slots[keep], starts[keep], counts[keep]
        if not len(slots):
            return []
        return [self._task(q, worker_id, slots, starts, counts, self.turns.copies(worker_id, incoming))]

    def _decodes(self, q: Sequences, worker_id: int, budget: int, plan: list) -> int:
        """Running decodes first, oldest first, one token each (only those entering a new block
        are grown one by one); returns the budget left."""
        ready = q.active & (q.computed >= q.target) & (q.planned < q.limit)
        decoding = np.flatnonzero(ready & (q.planned == q.length) if self.exclusive else ready)
        share = -(-int(ready.sum()) // self.stages)  # (the ready ones with those in flight)
        decoding = decoding[np.argsort(q.order[decoding], kind="stable")][:min(budget, share)]
        needs = q.blocks.blocks_for(q.computed[decoding] + 1) > q.blocks.count[decoding]
        grown = [s for s in decoding[needs].tolist() if q.active[s] and self._grow(q, worker_id, s, int(q.computed[s]) + 1)]
        decodes = np.concatenate([decoding[~needs], np.array(grown, dtype=np.int64)])
        decodes = decodes[q.active[decodes]]  # (growing may have suspended some)
        plan.append((decodes, q.computed[decodes].copy(), np.ones(len(decodes), dtype=np.int64),
                     q.serial[decodes].copy()))
        q.computed[decodes] += 1
        return budget - len(decodes)

    def _prefills(self, q: Sequences, worker_id: int, budget: int, plan: list) -> int:
        """Prompts being prefilled, oldest first (a turn whose copies in run on the side waits for
        them); returns the budget left."""
        prefilling = np.flatnonzero(q.active & (q.computed < q.target))
        for s in prefilling[np.argsort(q.order[prefilling], kind="stable")].tolist():
            if budget <= 0:
                break
            restoring = q.restoring[s]
            if restoring is not None:
                if not restoring.finished:
                    continue
                q.restoring[s] = None
            if q.active[s]:
                budget = self._prefill(q, worker_id, s, budget, plan)
        return budget

    def _joins(self, q: Sequences, worker_id: int, budget: int, plan: list, incoming: CachePlan) -> None:
        """New requests join free slots while the budget and the blocks allow."""
        while budget > 0 and q._free and (self.waiting or self.pinned[worker_id]):
            s = self._join(q, worker_id, incoming, shared=any(len(entry[0]) for entry in plan))
            if s is None:
                break
            if q.restoring[s] is not None:
                continue
            budget = self._prefill(q, worker_id, s, budget, plan)
            if not q.active[s]:  # suspended for want of blocks: no more joins now
                break

    def _count(self, q: Sequences, worker_id: int) -> None:
        held, locked = self.turns.idle_blocks(worker_id)
        c = self.counters
        c["planned"] += 1
        c["running"] += q.num_active
        c["idle_held"] += held
        c["idle_locked"] += locked

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

    def _join(self, q: Sequences, worker_id: int, incoming: CachePlan, shared: bool) -> int | None:
        """The first waiting request (of the shared line or of this worker's, see `_line`) joins a
        slot if its blocks leave the reserve free (or nothing else runs here) and its copies in
        fit the iteration (`shared`: it has other sequences); else it goes back, and None."""
        line = self._line(worker_id)
        chunk = line.take(1)
        columns = {k: v[0] for k, v in chunk.columns.items()}
        conversation, history = columns["conversation"], int(columns["history"])
        tokens = chunk.values if not history else np.concatenate([conversation.tokens[:history], chunk.values])
        cached_here = self.turns.cached_here(worker_id, conversation)
        prefix = self._prefix(q, tokens, 0 if cached_here else len(tokens) - 1)
        own = self.turns.held(worker_id, conversation) + len(prefix)
        available = q.blocks.num_free + self.turns.reclaimable(worker_id) - own
        need = q.blocks.blocks_for(len(tokens) + 1) - own
        fits = self.turns.copies_fit(worker_id, conversation, incoming, shared)
        if (q.num_active and available - need < self._reserve[worker_id]) or need > available or not fits:
            line.push_front(int(columns["priority"]), chunk)
            self.counters["refused_blocks" if fits else "refused_copies"] += 1
            return None
        self.counters["joins_pinned" if line is self.pinned[worker_id] else "joins_waiting"] += 1
        self._joined += 1
        s = q.join(chunk.owners[0], tokens, columns, self._joined, history)
        if conversation is not None:
            cached = self.turns.join(worker_id, conversation, history, q.blocks.table[s], incoming, shared)
            if cached is not None:
                recompute, q.skip_to[s], q.restoring[s] = cached
                q.skip_from[s] = recompute
                q.blocks.count[s] = q.blocks.blocks_for(int(q.skip_to[s]))
                prefix = self._prefix(q, tokens, recompute)  # (its dropped leading blocks, where others hold them)
        if len(prefix):  # read only: its own positions start in a block of its own
            q.blocks.share(s, prefix)
            q.computed[s] = len(prefix) * q.blocks.block_size
            self.turns.prefix_hit(worker_id, conversation, int(q.computed[s]))
        return s

    def _prefix(self, q: Sequences, tokens: np.ndarray, positions: int) -> np.ndarray:
        """With prefix caching, the computed blocks holding the longest run of `tokens`' leading
        whole blocks within its first `positions` (a new sequence leaves its last token to
        compute; a turn restoring its own cache looks within what it would recompute)."""
        if q.blocks.index is None or positions < q.blocks.block_size:
            return _NO_BLOCKS
        return q.blocks.index.match(tokens, positions // q.blocks.block_size)

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
        while not q.blocks.grow(s, num_tokens):
            short = int(q.blocks.blocks_for(num_tokens) - q.blocks.count[s]) - q.blocks.num_free
            if self.turns.reclaim(worker_id, short) > 0:
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
        self.turns.suspend(worker_id, q.conversation[s])
        self.waiting.push_front(int(row.columns["priority"][0]), row)
        q.leave(s)
        self.num_suspended += 1

    def _task(self, q: Sequences, worker_id: int, slots: np.ndarray, starts: np.ndarray, counts: np.ndarray,
              copies: CachePlan | None) -> IterationTask:
        query_start = np.zeros(len(slots) + 1, dtype=np.int64)
        np.cumsum(counts, out=query_start[1:])
        total = int(query_start[-1])
        token_slots = np.repeat(slots, counts)
        positions = np.arange(total) - np.repeat(query_start[:-1], counts) + np.repeat(starts, counts)
        decode = starts >= q.target[slots]  # feeds the last sampled token
        tokens = q.tokens[token_slots, np.minimum(positions, q.max_len - 1)]
        if not self.exclusive:  # (a pipeline's decodes: the token came back to the host; its stage 0 samples none)
            tokens[np.repeat(decode, counts)] = -1
        bs = q.blocks.block_size
        kv_slots = q.blocks.table[token_slots, positions // bs].astype(np.int64) * bs + positions % bs
        ends = starts + counts
        sample = np.flatnonzero(ends >= q.target[slots])  # the last prefill chunk, or a decode
        ss = slots[sample]
        sample_index = q.planned[ss].copy()
        q.planned[ss] += 1
        decode_only = bool(decode.all())
        logprobs = int(q.logprobs[ss].max()) if len(ss) else -1
        graph = self.shapes[worker_id].of(len(slots), total, decode_only, int(ends.max())) if logprobs < 0 else None
        plan = IterationPlan.of(
            tokens=tokens, positions=positions, kv_slots=kv_slots, token_slots=token_slots, query_start=query_start,
            context_lens=ends, block_tables=q.blocks.table[slots], sample_token=query_start[sample + 1] - 1,
            sample_slots=ss, seeds=q.seed[ss], counters=sample_index, top_k=q.top_k[ss], temperature=q.temperature[ss],
            top_p=q.top_p[ss], max_query_len=int(counts.max()), decode_only=decode_only,
            greedy=not (q.temperature[ss] > 0).any(), logprobs=logprobs, graph=graph,
            copies=None if copies is None else copies.copies(graph is not None))
        return IterationTask(self, self.cell_type, worker_id, total, plan=plan, slots=slots,
                             serials=q.serial[slots].copy(), owners=q.owner[slots].copy(), sample=sample,
                             cache_plan=copies)

    # completion (manager thread) ----------------------------------------------------------------
    def complete(self, task: IterationTask) -> None:
        q = self.sequences[task.worker_id]
        self.turns.timed(task.worker_id, task.seconds)
        if task.error is not None:
            owners = list(task.owners[q.serial[task.slots] == task.serials])
            for s, serial in zip(task.slots.tolist(), task.serials.tolist()):
                if q.serial[s] == serial:  # (a slot may come twice: a turn's recompute and its prompt)
                    self._end_turn(q, s)
            self.finisher.fail(owners, CellError(f"cell {self.cell_type.name} failed: {task.error!r}"))
            return
        slots = task.slots[task.sample]
        current = q.serial[slots] == task.serials[task.sample]
        slots, index, tokens = slots[current], task.plan.counters[current], task.sampled[current]
        if not len(slots):
            return
        logprobs = None if task.logprobs is None else tuple(a[current] for a in task.logprobs)
        q.tokens[slots, index] = tokens
        q.length[slots] = index + 1
        for s in slots[index == q.target[slots]].tolist():  # a prompt's first sample: its blocks are computed
            q.blocks.remember(s, q.tokens[s], int(q.target[s]))
        stopped = (q.stops[slots] == tokens[:, None]).any(1)
        done = stopped | (index + 1 >= q.limit[slots])
        for s in slots[done].tolist():
            conversation = q.conversation[s]
            if conversation is not None:  # its cache stays with the conversation
                q.blocks.remember(s, q.tokens[s], int(q.length[s]) - 1)
                self.turns.finish(task.worker_id, conversation, q.tokens[s, :int(q.length[s])], q.blocks.detach(s))
        self.finisher.tokens(q, slots, tokens, done, stopped, logprobs)
        for s in slots[done].tolist():
            q.leave(s)

    def _end_turn(self, q: Sequences, s: int) -> None:
        """A turn that failed or was cancelled leaves its slot (and its blocks)."""
        self.turns.fail(q.conversation[s], q.owner[s])
        q.leave(s)

    def _purge(self, epoch: int) -> None:
        """Cancelled or expired requests leave their slots (and blocks) and the waiting lines."""
        self._epoch = epoch
        for line in (self.waiting, *self.pinned.values()):
            for chunk in line.purge():
                for conversation, owner in zip(chunk.columns["conversation"], chunk.owners):
                    self.turns.withdraw(conversation, owner)
        for q in self.sequences.values():
            active = np.flatnonzero(q.active)
            done = np.fromiter((o._done for o in q.owner[active]), dtype=bool, count=len(active))
            for s in active[done].tolist():
                self._end_turn(q, s)
