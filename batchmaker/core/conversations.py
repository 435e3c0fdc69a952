"""Conversations across turns (Pensieve; thesis §3.4.3): the layer beside the iteration planner
that keeps each conversation's tokens and, per worker, its KV cache between turns. It is the one
writer of `Conversation` fields. No torch here.

Its callers and calls:
  admission (batchmaker/generation.py)  `of_request` (a new, or a known idle, conversation), `match`
      and `anonymous` (a stateless request's: automatic prefix caching), `begin` a turn,
      `add_prompt` (a turn that generates nothing), `end`, `sweep` (expiry), `stats`
  the planner (core/sequence_queue.py)  `route` waiting turns to the worker holding their cache,
      `poll`, `held` / `reclaimable` / `copies_fit` before a turn joins, `join` (its cached blocks
      become the sequence's), `cached_here` and `prefix_hit` (a sequence reading blocks others
      computed: prefix caching, core/block_index.py), `reclaim` blocks for a sequence, `suspend`,
      `finish` (the blocks stay with the conversation), `fail` and `withdraw` (a failed,
      cancelled or expired turn),
      `copies` (the iteration's copies to and from the host tier), `timed` (iteration times)
The cached blocks themselves, per worker, are rows of a ConversationCache (core/conversation_cache.py).
"""
import secrets
import time
from dataclasses import dataclass, field

import numpy as np

from batchmaker.core.cache_plan import CachePlan
from batchmaker.core.conversation_cache import ConversationCache
from batchmaker.core.prefix_index import PrefixIndex
from batchmaker.errors import BadRequestError, UnknownConversationError

_NONE = np.zeros(0, dtype=np.int64)


@dataclass(slots=True, eq=False)
class Conversation:
    """One conversation (the manager's record): its tokens so far and where its cache lives."""

    id: str
    tokens: np.ndarray = field(default_factory=lambda: _NONE)  # every prompt and reply, in order
    worker: int | None = None  # its KV cache's worker (set by its first turn)
    row: int = -1  # its row in that worker's ConversationCache
    turn: object = None  # the future of its turn being served (admitted, not finished)
    touched: float = 0.0  # when a turn last came (time.monotonic; conversations expire)
    turns: int = 0
    computed: int = 0  # leading positions of `tokens` some turn computed (a turn of max_new_tokens 0 only adds
    # its prompt, which the next turn computes)
    restored: tuple = (0, 0, 0)  # the running turn's context: positions on the GPU, swapped in, recomputed
    anonymous: bool = False  # made for a stateless request (automatic prefix caching): found by its tokens, not its id
    shared: int = 0  # the running turn's leading positions read from blocks other requests computed (prefix caching)

    @property
    def busy(self) -> bool:
        return self.turn is not None and not self.turn._done


class Conversations:
    def __init__(self, caches: dict[int, ConversationCache], ttl: float = float("inf"), chunk_bytes=None):
        self.caches = caches  # worker id -> its idle conversations' caches
        self.by_id: dict[str, Conversation] = {}
        self.ttl = ttl  # seconds a conversation may stay idle before it is forgotten
        self.chunk_bytes = chunk_bytes or dict.fromkeys(caches, 0)  # worker id -> bytes a host chunk holds
        self.iteration_seconds = dict.fromkeys(caches, 0.0)  # per worker: a moving average of measured iterations
        self._swept = time.monotonic()
        self.prefixes = PrefixIndex()  # idle anonymous conversations, by their tokens

    # admission (generation.py) --------------------------------------------------------------------
    def of_request(self, value) -> Conversation | None:
        """A request's conversation: None, a new one (true), or a known idle one (its id)."""
        if value is None or value is False:
            return None
        if value is True:
            return Conversation(secrets.token_hex(8), touched=time.monotonic())
        if not isinstance(value, str):
            raise BadRequestError(f"conversation: expected true (start one) or a conversation id, got {value!r}")
        conversation = self.by_id.get(value)
        now = time.monotonic()
        if conversation is not None and self._expired(conversation, now):  # (between the sweeps)
            self._forget(conversation)
            conversation = None
        if conversation is None:
            raise UnknownConversationError(value, self.ttl)
        if conversation.busy:
            raise BadRequestError(f"conversation {value!r} has a turn running: send the next one after its reply")
        conversation.touched = now
        return conversation

    def match(self, prompt: np.ndarray) -> Conversation | None:
        """The idle anonymous conversation whose tokens are the longest proper prefix of a
        stateless request's `prompt` (its cache serves the request as that conversation's next
        turn), or None."""
        conversation = self.prefixes.find(prompt)
        if conversation is not None and self._expired(conversation, time.monotonic()):
            self._forget(conversation)
            return self.match(prompt)
        if conversation is not None:
            conversation.touched = time.monotonic()
        return conversation

    def anonymous(self) -> Conversation:
        """A new conversation for a stateless request: its context is kept for a request that continues it."""
        return Conversation(secrets.token_hex(8), touched=time.monotonic(), anonymous=True)

    def begin(self, conversation: Conversation, owner) -> None:
        """A turn of `conversation` was admitted (`owner`: its future); it is known from now on."""
        self.prefixes.remove(conversation)  # (busy: not to be matched until the turn ends)
        self.by_id[conversation.id] = conversation
        conversation.restored = (0, 0, 0)
        conversation.shared = 0
        conversation.turn = owner

    def add_prompt(self, conversation: Conversation, prompt: np.ndarray) -> None:
        """A turn that generates nothing: its prompt joins the history, for the next turn to compute."""
        self.by_id[conversation.id] = conversation
        conversation.restored = (0, 0, 0)
        conversation.tokens = np.concatenate([conversation.tokens, prompt])
        conversation.turns += 1

    def end(self, conversation: Conversation) -> None:
        self._forget(conversation)

    def sweep(self) -> None:
        """Conversations idle for longer than `ttl` are forgotten (at most once a second)."""
        now = time.monotonic()
        if not self.by_id or now - self._swept <= 1.0:
            return
        self._swept = now
        for conversation in list(self.by_id.values()):
            if self._expired(conversation, now):
                self._forget(conversation)

    def _expired(self, conversation: Conversation, now: float) -> bool:
        return not conversation.busy and now - conversation.touched > self.ttl

    def _forget(self, conversation: Conversation) -> None:
        if conversation.worker is not None:
            self.caches[conversation.worker].forget(conversation.row)
        conversation.row, conversation.worker = -1, None
        self.by_id.pop(conversation.id, None)
        self.prefixes.remove(conversation)

    def stats(self) -> dict:
        stats = {"conversations": len(self.by_id), "bytes_out": 0, "bytes_in": 0}
        for worker, cache in self.caches.items():
            for k, v in cache.stats.items():
                stats[k] = stats.get(k, 0) + v
            stats["bytes_out"] += cache.stats["chunks_out"] * self.chunk_bytes[worker]  # K/V copied to the host
            stats["bytes_in"] += cache.stats["chunks_in"] * self.chunk_bytes[worker]  # and back
            stats["host_chunks_used"] = stats.get("host_chunks_used", 0) + cache.host_chunks.num - cache.host_chunks.num_free
            stats["gpu_blocks_cached"] = stats.get("gpu_blocks_cached", 0) + cache.num_blocks_held
        context = sum(stats.get(f"{tier}_tokens", 0) for tier in ("gpu_hit", "host_hit", "recomputed"))
        for tier in ("gpu_hit", "host_hit", "recomputed"):  # shares of the previous turns' positions
            stats[f"{tier}_rate"] = stats.get(f"{tier}_tokens", 0) / context if context else 0.0
        return stats

    # the planner's side (sequence_queue.py) -------------------------------------------------------
    def route(self, conversations: np.ndarray) -> np.ndarray:
        """The worker holding each waiting turn's cache (None: any worker). Those caches are about
        to be used: they count as active (T = 0), so they are evicted last."""
        workers = np.array([getattr(c, "worker", None) for c in conversations], dtype=object)
        for w in set(workers[workers != None].tolist()) & self.caches.keys():  # noqa: E711 (elementwise)
            rows = np.fromiter((c.row for c in conversations[workers == w]), dtype=np.int64)
            self.caches[w].wait(rows[rows >= 0])
        return workers

    def poll(self, worker: int) -> None:
        """Copies out that finished make their chunks' blocks reclaimable."""
        if worker in self.caches:
            self.caches[worker].poll()

    def _row(self, worker: int, conversation: Conversation | None) -> int:
        """The conversation's row in `worker`'s cache, or -1."""
        return conversation.row if conversation is not None and conversation.worker == worker else -1

    def held(self, worker: int, conversation: Conversation | None) -> int:
        """GPU blocks of the conversation's cache on `worker` (a turn joining there keeps them)."""
        cache = self.caches.get(worker)
        return cache.held(self._row(worker, conversation)) if cache is not None else 0

    def reclaimable(self, worker: int) -> int:
        """Blocks idle conversations hold on `worker` that a sequence could get (not those copies
        out in flight still read)."""
        cache = self.caches.get(worker)
        return cache.reclaimable if cache is not None else 0

    def idle_blocks(self, worker: int) -> tuple[int, int]:
        """(blocks idle conversations hold, of them locked by copies out in flight) on `worker`."""
        cache = self.caches.get(worker)
        return (cache.num_held, cache.num_locked) if cache is not None else (0, 0)

    def copies_fit(self, worker: int, conversation: Conversation | None, incoming: CachePlan, shared: bool) -> bool:
        """Whether the turn's copies in fit this iteration's (`incoming`): the worker's staging
        holds them, and copies layer by layer must hide under the iteration they share (else
        they wait for the next)."""
        cache = self.caches.get(worker)
        if cache is None:
            return True
        copies_in = cache.to_swap_in(self._row(worker, conversation)) + len(incoming.swap_in_host)
        return not (copies_in and (copies_in > cache.max_in or (
            incoming.deferred is False and shared and not cache.hides(copies_in, self.iteration_seconds[worker]))))

    def join(self, worker: int, conversation: Conversation, history: int, table_row: np.ndarray,
             incoming: CachePlan, shared: bool) -> tuple[int, int, CachePlan | None] | None:
        """A turn of `conversation` joined a slot on `worker` (`table_row`: its block table). Its
        cached blocks become the table's; chunks whose GPU blocks were reclaimed get new blocks
        and a swap-in (added to `incoming`: layer by layer where the copies hide under the
        iteration, else on the side), dropped ones get new blocks to be recomputed. Returns
        (recompute up to, cached up to, the copies in it must wait for), or None: no cache here."""
        row = self._row(worker, conversation)
        cache = self.caches.get(worker)
        conversation.worker = worker
        lost = min(history - 1, conversation.computed)
        if row < 0 and lost > 0:  # its cache went with a failed or cancelled turn
            conversation.restored = (0, 0, lost)
            if cache is not None:
                cache.recomputed(lost)
        conversation.row = -1
        if row < 0:
            return None
        recompute, swapped, cached, copies = cache.restore(row, table_row)
        conversation.restored = (cached - recompute - swapped, swapped, recompute)
        if conversation.anonymous:  # (a stateless request continuing a context: a prefix cache hit)
            cache.stats["prefix_hit_tokens"] += cached - recompute
        waits = None
        if copies is not None:
            if incoming.deferred is None:  # on the side, unless the copies hide under the iteration
                incoming.deferred = shared and not cache.hides(len(copies.swap_in_host), self.iteration_seconds[worker])
            incoming.add_swap_in(copies.swap_in_host, copies.swap_in_blocks)
            waits = incoming if incoming.deferred else None
        return recompute, cached, waits

    def cached_here(self, worker: int, conversation: Conversation | None) -> bool:
        """Whether the conversation's cache is on `worker` (a turn joining there restores it)."""
        return self._row(worker, conversation) >= 0

    def prefix_hit(self, worker: int, conversation: Conversation | None, tokens: int) -> None:
        """A joining sequence's first `tokens` positions are blocks other requests computed: its
        turn recomputes fewer of its previous turns' positions, if it was to."""
        cache = self.caches.get(worker)
        if cache is not None:
            cache.stats["prefix_hit_tokens"] += tokens
        if conversation is None:
            return
        conversation.shared = tokens
        gpu, swapped, recomputed = conversation.restored
        if recomputed and cache is not None:
            cache.reread(min(tokens, recomputed))
        conversation.restored = (gpu, swapped, max(recomputed - tokens, 0))

    def reclaim(self, worker: int, short: int) -> int:
        """Blocks freed from idle conversations' caches on `worker` (at least `short` if they can)."""
        cache = self.caches.get(worker)
        return cache.reclaim(short) if cache is not None else 0

    def suspend(self, worker: int, conversation: Conversation | None) -> None:
        """The turn's sequence was suspended: its cache went with its blocks, so all of its
        context is recomputed."""
        if conversation is None:
            return
        gpu, swapped, recomputed = conversation.restored
        self.caches[worker].recomputed(gpu + swapped, gpu, swapped, start=recomputed)
        conversation.restored = (0, 0, gpu + swapped + recomputed)
        conversation.shared = 0
        conversation.worker = None

    def finish(self, worker: int, conversation: Conversation, tokens: np.ndarray, blocks: np.ndarray) -> None:
        """The turn finished with `tokens` (its whole context): its blocks stay with the
        conversation, every position but the last sampled one."""
        conversation.tokens = tokens.copy()
        conversation.computed = len(tokens) - 1
        conversation.row = self.caches[worker].retire(blocks, len(tokens) - 1)
        conversation.worker = worker
        conversation.turn = None
        conversation.turns += 1
        if conversation.anonymous:
            self.prefixes.add(conversation)

    def fail(self, conversation: Conversation | None, owner) -> None:
        """A running turn failed or was cancelled: the conversation is as before it, without a
        cache (unless its next turn came already)."""
        if conversation is not None and conversation.turn is owner:
            conversation.turn, conversation.worker = None, None
            if conversation.anonymous:  # (its tokens are as before the turn; its context is recomputed)
                self.prefixes.add(conversation)

    def withdraw(self, conversation: Conversation | None, owner) -> None:
        """A waiting turn was cancelled or expired: its cache is idle again."""
        if conversation is None or conversation.turn is not owner:
            return
        conversation.turn = None
        if conversation.row >= 0 and conversation.worker in self.caches:
            self.caches[conversation.worker].wait(conversation.row, False)
        if conversation.anonymous:
            self.prefixes.add(conversation)

    def copies(self, worker: int, incoming: CachePlan) -> CachePlan | None:
        """The iteration's copies: the joining turns' swap-ins; or, in an iteration without them
        (swapping in goes first), ahead-of-time copies out."""
        if len(incoming.swap_in_host):
            return incoming
        cache = self.caches.get(worker)
        return cache.plan_swap_out() if cache is not None else None

    def timed(self, worker: int, seconds: float) -> None:
        """An iteration on `worker` took `seconds` (what copies in layer by layer must hide under)."""
        if worker not in self.iteration_seconds or seconds != seconds:  # (not measured: NaN)
            return
        mean = self.iteration_seconds[worker]
        self.iteration_seconds[worker] = seconds if mean == 0.0 else 0.8 * mean + 0.2 * seconds
