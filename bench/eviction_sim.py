"""Trace-driven simulation of the conversation cache's eviction (issue 12): value vs LRU, without
torch or a GPU. The chat workload of bench/chat_stateful.py (same generator, same seed: the same
conversations) is served by the REAL manager code: SequenceQueue (joins, block growth, reclaiming,
suspensions, copies out ahead of time) over Sequences, BlockTables and ConversationCache. Only the
device is faked: an iteration of N tokens takes `--iter-ms + --token-ms * N` of simulated time (a
fit of the H200 run's counters: 17 ms at 122 tokens, 10.6 ms at 76), samples token 0, and its
copies (out and in) are done when it completes. As in the benchmark, no turn is sent after the
last conversation's start, and a conversation that had its last turn stays cached until the end
(the client ends none: --end does, and --end-fraction p for a share p of the clients). Recomputed time is the profiled Cost(l) of the H200 run.

    python bench/eviction_sim.py --policies value lru value-old lru-old --host-gib 0 24 64 --seeds 0 1 2

Variants (a subclass overriding ConversationCache.value); in each, as in the engine, a
conversation with a turn waiting in line is active (T = 0: evicted last); with "-old" it is not
(the engine before this issue's fix: idle since its last reply), with "-touch" it is active from
its turn's arrival (last_active = the arrival, then T grows while it waits):
  value   Cost(l) / T, T since the conversation was last active (the engine's "value")
  lru     1 / T (the engine's "lru")
  cost    Cost(l) alone (no time term)
  hazard  Cost(l) x P(another turn | idle T): exponential reaction times of mean m and a turn
          count geometric with mean TURNS: p e^(-T/m) / (p e^(-T/m) + 1 - p), p = 1 - 1/TURNS
  oracle  Cost(l) / time until the conversation's next turn arrives (known here; ended: 0)
Each dropped chunk is counted by what its conversation does next: nothing (ended), a turn waiting
in line (waiting), a turn later (idle).
"""
import argparse
import heapq
import math
import sys
import time
from pathlib import Path

import numpy as np

from batchmaker.core.blocks import BlockTables
from batchmaker.core.conversation_cache import ConversationCache
from batchmaker.core.conversations import Conversation, Conversations
from batchmaker.core.sequence_queue import SequenceQueue
from batchmaker.core.sequences import MAX_STOPS, Sequences
from batchmaker.core.waiting import Chunk

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.workload import TURNS, conversation_draws  # noqa: E402

COST_MS = {32: .8093, 64: .8093, 128: .8093, 256: .8093, 512: .8093, 1024: .8216, 2048: .9525, 4096: 1.2151}
TOKEN_BYTES = 2 * 32 * 4096 * 2  # Llama-2-7B, bf16: K and V, 32 layers, 4096 wide


def scripts(n: int, rate: float, reaction: float, max_context: int, vocab: int, seed: int) -> list:
    """bench/chat_stateful.scripts (the same draws): (start, [(prompt length, output, reaction)])."""
    return [(start, [(len(ids), answer, wait) for ids, answer, wait in turns])
            for start, turns in conversation_draws(n, rate, reaction, max_context, vocab, seed)]


def chunk_costs(chunk_tokens: int = 32, max_positions: int = 4096) -> np.ndarray:
    ends = (np.arange(max_positions // chunk_tokens) + 1) * chunk_tokens
    points = sorted(COST_MS)
    return np.maximum.accumulate(np.interp(ends, points, [COST_MS[p] * 1e-3 for p in points]))


class SimCache(ConversationCache):
    """The engine's cache with a variant value function and a record of what each drop hit."""

    def __init__(self, *args, variant: str = "value", reaction: float = 6.0, **kwargs):
        self.variant, _, self.mode = variant.partition("-")
        self.reaction = reaction
        super().__init__(*args, policy="lru" if self.variant == "lru" else "value", **kwargs)
        self.drops = {"ended": 0, "waiting": 0, "idle": 0}  # chunks dropped, by what comes next

    def _grow_rows(self, n: int) -> None:
        have = len(getattr(self, "cached", ()))
        super()._grow_rows(n)
        self.due = np.concatenate([getattr(self, "due", np.zeros(0)), np.full(n - have, math.inf)])

    def wait(self, r: int, waiting: bool = True) -> None:
        if not self.mode:  # (-old, -touch: a turn in line does not make its conversation active)
            super().wait(r, waiting)

    def value(self, rows, chunks, now):
        if self.variant == "cost":
            value = self.cost[chunks]
        elif self.variant == "oracle":
            value = self.cost[chunks] / np.maximum(self.due[rows] - now, 1e-6)
        elif self.variant == "hazard":
            p, stay = 1 - 1 / TURNS, np.exp(-(now - self.last_active[rows]) / self.reaction)
            value = self.cost[chunks] * p * stay / (p * stay + 1 - p)
        else:
            return super().value(rows, chunks, now)
        return value * np.where(self.waiting[rows], 1e9, 1.0)

    def _drop_through(self, r: int, k: int) -> int:
        before = int(self.dropped[r])
        freed = super()._drop_through(r, k)
        what = "ended" if self.due[r] == math.inf else "waiting" if self.due[r] <= self.clock() else "idle"
        self.drops[what] += int(self.dropped[r]) - before
        return freed


class Turn:  # what the queue needs of a request's future
    def __init__(self, i: int, t: int, now: float):
        self.request_id, self.priority, self.arrival, self.on_partial, self._done = (i, t), 0, now, None, False


class CellType:
    name, priority, batch_sizes = "gen/decoder", 0, (1,)

    def __init__(self, max_batch: int):
        self.max_batch = max_batch


def simulate(args, variant: str, host_gib: float, seed: int) -> dict:
    touch = variant.endswith("-touch")
    blocks = BlockTables(int(args.kv_gib * 2**30 // (TOKEN_BYTES * 16)), 16, args.max_seqs, args.max_len)
    seqs = Sequences(args.max_seqs, args.max_len, blocks)
    now = [0.0]
    host_chunks = int(host_gib * 2**30 // (TOKEN_BYTES * 32))
    cache = SimCache(blocks, host_chunks, 32, chunk_costs(32, args.max_len), variant=variant,
                     reaction=60.0 / args.compress, clock=lambda: now[0], max_out_rows=args.swap_out_rows)
    work = scripts(int(args.rate * args.arrival_seconds), args.rate, 60.0 / args.compress, args.max_len, 32000, seed)
    stop = work[-1][0]
    convs = [Conversation(f"c{i}") for i in range(len(work))]
    ends = np.random.default_rng(seed + 7).random(len(work)) < (1.0 if args.end else args.end_fraction)
    due = [(start, i, 0) for i, (start, _) in enumerate(work)]
    heapq.heapify(due)
    turns = [0]

    class Finisher:
        def tokens(self, q, slots, tokens, done, stopped):
            for s in slots[done].tolist():
                owner = q.owner[s]
                owner._done = True
                i, t = owner.request_id
                c = convs[i]
                nxt = t + 1 < len(work[i][1]) and now[0] + work[i][1][t + 1][2] <= stop
                if nxt:
                    heapq.heappush(due, (now[0] + work[i][1][t + 1][2], i, t + 1))
                if c.row >= 0:  # (retired by the queue just before this call)
                    cache.due[c.row] = now[0] + work[i][1][t + 1][2] if nxt else math.inf
                    if not nxt and ends[i]:
                        layer.end(c)

        def fail(self, owners, error):
            raise error

    layer = Conversations({0: cache})
    queue = SequenceQueue(CellType(args.max_tokens), {0: seqs}, Finisher(), 0.1, layer)
    wall, iterations = time.perf_counter(), 0
    while True:
        while due and due[0][0] <= now[0]:
            _, i, t = heapq.heappop(due)
            c, (new, answer, _) = convs[i], work[i][1][t]
            owner = Turn(i, t, now[0])
            layer.begin(c, owner)
            if c.row >= 0:
                cache.due[c.row] = now[0]  # (waiting: the oracle keeps it)
                if touch:
                    cache.last_active[c.row] = now[0]
            hist = len(c.tokens)
            turns[0] += 1
            row = {"prompt_len": new, "max_new": answer, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0,
                   "stops": [-1] * MAX_STOPS, "priority": 0, "first": math.nan, "joined": math.nan, "streams": False,
                   "history": hist}
            columns = {k: np.array([v]) for k, v in row.items()}
            columns["conversation"] = np.empty(1, dtype=object)
            columns["conversation"][0] = c
            owners = np.empty(1, dtype=object)
            owners[0] = owner
            queue.add(columns["priority"], Chunk.of(owners, columns, np.ones(new, dtype=np.int64), np.array([new])))
        tasks = queue.form(0, 1, 0)
        if not tasks:
            if not due:
                break
            now[0] = max(now[0], due[0][0])
            continue
        task = tasks[0]
        iterations += 1
        now[0] += (args.iter_ms + args.token_ms * task.batch) * 1e-3
        task.sampled = np.zeros(len(task.sample), dtype=np.int64)
        if task.cache_plan is not None:
            task.cache_plan.done = True
        queue.complete(task)
    s = cache.stats
    hist = s["gpu_hit_tokens"] + s["host_hit_tokens"] + s["recomputed_tokens"]
    return {"variant": variant, "host_gib": host_gib, "seed": seed, "ended": float(ends.mean()), "turns": turns[0],
            "history": hist,
            "recomputed": s["recomputed_tokens"], "fraction": s["recomputed_tokens"] / max(hist, 1),
            "recomputed_s": s["recomputed_seconds"], "host_hit": s["host_hit_tokens"] / max(hist, 1),
            "gpu_hit": s["gpu_hit_tokens"] / max(hist, 1), **{f"dropped_{k}": v * 32 for k, v in cache.drops.items()},
            "suspended": queue.num_suspended, "span_s": now[0], "iterations": iterations,
            "wall_s": time.perf_counter() - wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policies", nargs="+", default=["value", "lru"])
    ap.add_argument("--host-gib", nargs="+", type=float, default=[64.0])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--rate", type=float, default=9.0, help="conversations started per second")
    ap.add_argument("--arrival-seconds", type=float, default=90.0)
    ap.add_argument("--compress", type=float, default=10.0, help="reaction time: mean 60 s / this")
    ap.add_argument("--kv-gib", type=float, default=40.0)
    ap.add_argument("--max-tokens", type=int, default=512, help="tokens per iteration")
    ap.add_argument("--max-seqs", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--swap-out-rows", type=int, default=4)
    ap.add_argument("--iter-ms", type=float, default=6.0)
    ap.add_argument("--token-ms", type=float, default=0.09)
    ap.add_argument("--end", action="store_true", help="clients end a conversation after its last turn")
    ap.add_argument("--end-fraction", type=float, default=0.0,
                    help="the share of clients (drawn per conversation) that end theirs (--end: all of them)")
    args = ap.parse_args()
    print("variant host_gib seed turns history recomputed fraction recomputed_s host_hit gpu_hit "
          "dropped_ended dropped_waiting dropped_idle suspended span_s wall_s")
    for host in args.host_gib:
        for seed in args.seeds:
            for variant in args.policies:
                r = simulate(args, variant, host, seed)
                print(" ".join(f"{v:.4f}" if isinstance(v, float) else str(v) for k, v in r.items()
                               if k != "iterations"), flush=True)


if __name__ == "__main__":
    main()
