"""Generation requests as rows: the sequences of one decoder, and the iterations formed from them
(ORCA's iteration-level scheduling, Pensieve's unified prefill + decode batch; thesis §2.9, §3.4).

A waiting request is a chunk row (core/waiting.py): its known tokens (the prompt; after a
suspension, the prompt and what it generated) and its generation settings. Once a worker's
iteration takes it, it lives in a *slot* of that worker's `Sequences`: aligned arrays of its
tokens, lengths and sampling settings, and its block table (core/blocks.py). Its KV cache is on
that worker, so its later iterations are formed there only.

Per slot, three counts say where it is:
  target    tokens to prefill before the first sample (its known tokens when it joined)
  computed  positions whose K/V the formed iterations write
  planned   tokens that exist once the formed iterations finish (known + sampled in flight)
A sequence prefills while computed < target (chunks of the token budget: running decodes are
never stalled by a long prompt); its last chunk samples, and from then on each iteration feeds
the last sampled token (it stays on the device: the host need not know it to form the next
iteration) and samples the next. The host learns tokens when an iteration completes: finished
sequences (a stop token, max_new_tokens, the model's length) leave then, and results of
iterations formed meanwhile are dropped for them (a slot's serial tells occupants apart).

When the blocks run out, the newest sequence is suspended: its blocks are freed and it waits
again, first in line, with its known tokens as its prompt (it is recomputed; sampling is seeded
per token, so it continues as if never suspended). New sequences join only while a reserve of
blocks stays free for the running ones.
"""
import numpy as np

from batchmaker.core.blocks import BlockTables
from batchmaker.core.task import IterationTask
from batchmaker.core.waiting import Chunk, Waiting

MAX_STOPS = 8  # stop token ids per request (EOS included)
_CARRIED = ("temperature", "top_k", "top_p", "seed", "stops", "first", "streams")  # what a waiting row brings


class Sequences:
    """The running sequences of one decoder on one worker."""

    def __init__(self, num_slots: int, max_len: int, blocks: BlockTables):
        self.blocks = blocks
        self.max_len = max_len
        self.owner = np.empty(num_slots, dtype=object)
        self.serial = np.zeros(num_slots, dtype=np.int64)
        self.order = np.zeros(num_slots, dtype=np.int64)  # when it joined (the newest is suspended first)
        self.tokens = np.zeros((num_slots, max_len), dtype=np.int64)  # known tokens
        self.length = np.zeros(num_slots, dtype=np.int64)
        self.prompt_len = np.zeros(num_slots, dtype=np.int64)
        self.target = np.zeros(num_slots, dtype=np.int64)
        self.computed = np.zeros(num_slots, dtype=np.int64)
        self.planned = np.zeros(num_slots, dtype=np.int64)
        self.limit = np.zeros(num_slots, dtype=np.int64)  # planned stops here (prompt + max_new, max_len)
        self.active = np.zeros(num_slots, dtype=bool)
        self.temperature = np.zeros(num_slots, dtype=np.float64)
        self.top_k = np.zeros(num_slots, dtype=np.int64)
        self.top_p = np.ones(num_slots, dtype=np.float64)
        self.seed = np.zeros(num_slots, dtype=np.int64)
        self.stops = np.full((num_slots, MAX_STOPS), -1, dtype=np.int64)
        self.first = np.full(num_slots, np.nan)  # when its first token was sampled (perf_counter)
        self.streams = np.zeros(num_slots, dtype=bool)  # its request takes partial outputs
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_active(self) -> int:
        return len(self.owner) - len(self._free)

    def join(self, owner, tokens: np.ndarray, columns: dict, order: int) -> int | None:
        """A slot for a waiting request (its known tokens and settings), or None if none is free."""
        if not self._free:
            return None
        s = self._free.pop()
        n = len(tokens)
        self.owner[s] = owner
        self.serial[s] += 1
        self.order[s] = order
        self.tokens[s, :n] = tokens
        self.length[s] = self.target[s] = n
        self.computed[s] = 0
        self.planned[s] = n
        self.prompt_len[s] = columns["prompt_len"]
        self.limit[s] = min(int(columns["prompt_len"] + columns["max_new"]), self.max_len)
        for name in _CARRIED:
            getattr(self, name)[s] = columns[name]
        self.active[s] = True
        return s

    def leave(self, s: int) -> None:
        self.blocks.release(s)
        self.active[s] = False
        self.owner[s] = None
        self.serial[s] += 1
        self._free.append(s)

    def waiting_row(self, s: int) -> Chunk:
        """A suspended sequence as a waiting request: its known tokens become its prompt."""
        columns = {name: getattr(self, name)[s:s + 1].copy() for name in _CARRIED}
        columns["prompt_len"] = self.prompt_len[s:s + 1].copy()
        columns["max_new"] = self.limit[s:s + 1] - self.prompt_len[s:s + 1]
        columns["priority"] = np.array([self.owner[s].priority], dtype=np.int64)
        owners = np.empty(1, dtype=object)
        owners[0] = self.owner[s]
        n = int(self.length[s])
        return Chunk.of(owners, columns, self.tokens[s, :n].copy(), np.array([n]))


class SequenceQueue:
    """The scheduler's queue of one decoder cell type: the waiting requests and, per worker, its
    running sequences. `form` plans one iteration per call (the scheduler's task)."""

    forms_rounds = False

    def __init__(self, cell_type, sequences: dict[int, Sequences], finisher, reserve: float = 0.1):
        self.cell_type = cell_type
        self.sequences = sequences  # worker id -> Sequences
        self.finisher = finisher  # resolves, streams and fails requests (batchmaker/generation.py)
        self.waiting = Waiting()
        self.num_running_tasks = 0
        self.num_skips = 0
        self.num_suspended = 0
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
            ready += int(running.sum()) + int((q.target - q.computed)[running & (q.computed < q.target)].sum())
        return ready

    @property
    def waiting_tokens(self) -> int:
        return sum(int(c.bounds[-1] - c.bounds[0]) for level in self.waiting.levels.values() for c in level)

    def add(self, priorities: np.ndarray, chunk: Chunk) -> None:
        self.waiting.add(priorities, chunk)

    # forming ----------------------------------------------------------------------------------
    def form(self, worker_id: int, max_tasks: int, epoch: int) -> list[IterationTask]:
        q = self.sequences[worker_id]
        if epoch != self._epoch:
            self._purge(epoch)
        budget = self.cell_type.max_batch
        plan: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (slots, tokens each, occupants' serials)
        # running decodes first, one token each: only those entering a new block are grown one by one
        decoding = np.flatnonzero(q.active & (q.computed >= q.target) & (q.planned < q.limit))
        decoding = decoding[np.argsort(q.order[decoding], kind="stable")][:budget]
        needs = q.blocks.blocks_for(q.computed[decoding] + 1) > q.blocks.count[decoding]
        grown = [s for s in decoding[needs].tolist() if q.active[s] and self._grow(q, worker_id, s, int(q.computed[s]) + 1)]
        decodes = np.concatenate([decoding[~needs], np.array(grown, dtype=np.int64)])
        decodes = decodes[q.active[decodes]]  # (growing may have suspended some)
        plan.append((decodes, np.ones(len(decodes), dtype=np.int64), q.serial[decodes].copy()))
        budget -= len(decodes)
        # prompts being prefilled, then new arrivals, in chunks of what the budget leaves
        prefilling = np.flatnonzero(q.active & (q.computed < q.target))
        for s in prefilling[np.argsort(q.order[prefilling], kind="stable")].tolist():
            if budget <= 0:
                break
            n = min(budget, int(q.target[s] - q.computed[s]))
            if q.active[s] and self._grow(q, worker_id, s, int(q.computed[s]) + n):
                plan.append(_one(s, n, q))
                budget -= n
        while budget > 0 and self.waiting and q._free:
            s = self._join(q, worker_id)
            if s is None:
                break
            n = min(budget, int(q.target[s]))
            q.blocks.grow(s, n)
            plan.append(_one(s, n, q))
            budget -= n
        slots, counts, serials = (np.concatenate(column) for column in zip(*plan))
        # a sequence suspended by a later one's blocks leaves the plan (its slot may have a new occupant)
        keep = q.active[slots] & (q.serial[slots] == serials)
        slots, counts = slots[keep], counts[keep]
        return [self._task(q, worker_id, slots, counts)] if len(slots) else []

    def _join(self, q: Sequences, worker_id: int) -> int | None:
        """The first waiting request joins a slot if its prompt's blocks leave the reserve free
        (or nothing else runs here)."""
        chunk = self.waiting.take(1)
        need = q.blocks.blocks_for(int(chunk.lengths[0]) + 1)
        if q.num_active and q.blocks.num_free - need < self._reserve[worker_id]:
            self.waiting.push_front(int(chunk.columns["priority"][0]), chunk)
            return None
        self._joined += 1
        columns = {k: v[0] for k, v in chunk.columns.items()}
        return q.join(chunk.owners[0], chunk.values, columns, self._joined)

    def _grow(self, q: Sequences, worker_id: int, s: int, num_tokens: int) -> bool:
        """Blocks for `s` up to `num_tokens` positions, suspending the newest sequences while
        they run out; False if `s` itself was suspended."""
        while not q.blocks.grow(s, num_tokens):
            victim = int(np.flatnonzero(q.active)[np.argmax(q.order[q.active])])
            self.suspend(q, victim)
            if victim == s:
                return False
        return True

    def suspend(self, q: Sequences, s: int) -> None:
        """Free `s`'s blocks; it waits again, first in line, to be recomputed from its known tokens."""
        row = q.waiting_row(s)
        self.waiting.push_front(int(row.columns["priority"][0]), row)
        q.leave(s)
        self.num_suspended += 1

    def _task(self, q: Sequences, worker_id: int, slots: np.ndarray, counts: np.ndarray) -> IterationTask:
        starts = q.computed[slots].copy()
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
        q.computed[slots] = ends
        q.planned[ss] += 1
        return IterationTask(self, self.cell_type, worker_id, total, slots=slots, serials=q.serial[slots].copy(),
                             owners=q.owner[slots].copy(), query_start=query_start, context_lens=ends,
                             block_tables=q.blocks.table[slots], tokens=tokens, positions=positions,
                             kv_slots=kv_slots, token_slots=token_slots, sample=sample, sample_index=sample_index,
                             temperature=q.temperature[ss], top_k=q.top_k[ss], top_p=q.top_p[ss], seeds=q.seed[ss],
                             max_query_len=int(counts.max()), decode_only=bool(decode.all()))

    # completion (manager thread) ----------------------------------------------------------------
    def complete(self, task: IterationTask) -> None:
        q = self.sequences[task.worker_id]
        if task.error is not None:
            owners = [o for o, s, serial in zip(task.owners, task.slots, task.serials) if q.serial[s] == serial]
            for s, serial in zip(task.slots.tolist(), task.serials.tolist()):
                if q.serial[s] == serial:
                    q.leave(s)
            self.finisher.fail(owners, task.error)
            return
        slots = task.slots[task.sample]
        current = q.serial[slots] == task.serials[task.sample]
        slots, index, tokens = slots[current], task.sample_index[current], task.sampled[current]
        if not len(slots):
            return
        q.tokens[slots, index] = tokens
        q.length[slots] = index + 1
        stopped = (q.stops[slots] == tokens[:, None]).any(1)
        done = stopped | (index + 1 >= q.limit[slots])
        self.finisher.tokens(q, slots, tokens, done, stopped)
        for s in slots[done].tolist():
            q.leave(s)

    def _purge(self, epoch: int) -> None:
        """Cancelled or expired requests leave their slots (and blocks) and the waiting line."""
        self._epoch = epoch
        self.waiting.purge()
        for q in self.sequences.values():
            active = np.flatnonzero(q.active)
            done = np.fromiter((o._done for o in q.owner[active]), dtype=bool, count=len(active))
            for s in active[done].tolist():
                q.leave(s)


def _one(s: int, n: int, q: Sequences) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One sequence's part of an iteration's plan."""
    return np.array([s]), np.array([n]), q.serial[s:s + 1].copy()
