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

SequenceQueue (core/sequence_queue.py) forms the iterations from them.
"""
import time

import numpy as np

from batchmaker.core.blocks import BlockTables
from batchmaker.core.waiting import Chunk

MAX_STOPS = 8  # stop token ids per request (EOS included)
_CARRIED = ("temperature", "top_k", "top_p", "seed", "stops", "first", "joined", "streams", "logprobs")  # what a
# waiting row brings


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
        self.logprobs = np.full(num_slots, -1, dtype=np.int64)  # -1: none; k >= 0: the sampled token's and the top k's
        self.top_p = np.ones(num_slots, dtype=np.float64)
        self.seed = np.zeros(num_slots, dtype=np.int64)
        self.stops = np.full((num_slots, MAX_STOPS), -1, dtype=np.int64)
        self.first = np.full(num_slots, np.nan)  # when its first token was sampled (perf_counter)
        self.joined = np.full(num_slots, np.nan)  # when it first joined a slot: its first cell (perf_counter)
        self.streams = np.zeros(num_slots, dtype=bool)  # its request takes partial outputs
        self.conversation = np.empty(num_slots, dtype=object)  # its turn's Conversation, or None
        self.skip_from = np.zeros(num_slots, dtype=np.int64)  # positions [skip_from, skip_to) are cached
        self.skip_to = np.zeros(num_slots, dtype=np.int64)
        self.restoring = np.empty(num_slots, dtype=object)  # a deferred swap-in (CachePlan) it waits for
        self.quarantine: list = []  # (CachePlan, block ids) of slots that left while their copies ran
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_active(self) -> int:
        return len(self.owner) - len(self._free)

    def join(self, owner, tokens: np.ndarray, columns: dict, order: int, history: int = 0) -> int | None:
        """A slot for a waiting request (its known tokens and settings; the first `history` of
        them its conversation's), or None if none is free."""
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
        self.prompt_len[s] = columns["prompt_len"] + history
        self.limit[s] = min(int(self.prompt_len[s] + columns["max_new"]), self.max_len)
        self.conversation[s] = columns["conversation"]
        self.restoring[s] = None
        self.skip_from[s] = self.skip_to[s] = 0
        for name in _CARRIED:
            getattr(self, name)[s] = columns[name]
        if self.joined[s] != self.joined[s]:  # (NaN: first joined now; a resumed one keeps its instant)
            self.joined[s] = time.perf_counter()
        self.active[s] = True
        return s

    def leave(self, s: int) -> None:
        plan = self.restoring[s]
        if plan is not None and not plan.finished:  # copies still write its blocks: free them later
            self.quarantine.append((plan, self.blocks.detach(s)))
        self.restoring[s] = None
        self.blocks.release(s)
        self.active[s] = False
        self.owner[s] = None
        self.conversation[s] = None
        self.serial[s] += 1
        self._free.append(s)

    def release_quarantined(self) -> None:
        """Blocks of slots that left during their copies in, once those are done."""
        running = []
        for copies, ids in self.quarantine:
            if copies.finished:
                self.blocks.give_back(ids)
            else:
                running.append((copies, ids))
        self.quarantine = running

    def waiting_row(self, s: int) -> Chunk:
        """A suspended sequence as a waiting request: its known tokens become its prompt."""
        columns = {name: getattr(self, name)[s:s + 1].copy() for name in _CARRIED}
        columns["prompt_len"] = self.prompt_len[s:s + 1].copy()
        columns["max_new"] = self.limit[s:s + 1] - self.prompt_len[s:s + 1]
        columns["priority"] = np.array([self.owner[s].priority], dtype=np.int64)
        columns["conversation"] = self.conversation[s:s + 1].copy()
        columns["history"] = np.zeros(1, dtype=np.int64)  # (its tokens are all here)
        owners = np.empty(1, dtype=object)
        owners[0] = self.owner[s]
        n = int(self.length[s])
        return Chunk.of(owners, columns, self.tokens[s, :n].copy(), np.array([n]))
