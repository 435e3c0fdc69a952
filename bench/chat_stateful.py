"""Multi-turn chat with each conversation's KV cache kept across turns (Pensieve, thesis ch. 3):
the ShareGPT-like workload of bench/chat.py as conversations. Each conversation starts at a
Poisson arrival; each turn is sent once the previous reply is back plus an exponential user
reaction time (mean 60 s in ShareGPT; compressed here by --compress, stated in the results).
In one run, with the same weights and the same GPU KV budget:

  stateless   every turn sends its whole history (no conversation: the cache is not kept)
  gpu         turns name their conversation; the cache lives in GPU blocks only
  gpu+cpu     ... and in a host tier (pinned memory) behind them (eviction: Pensieve's value)
  gpu+cpu-lru the same with LRU eviction (recomputed tokens compared at the highest rate)
  prefix      every turn sends its whole history, as stateless, to an engine with automatic prefix
              caching (issue 32): the cached context is found by its tokens, GPU blocks only
  prefix+cpu  ... and the host tier behind them (Pensieve's value eviction), as gpu+cpu

Per system and conversation rate: output tokens/s, normalized latency (latency / output tokens)
p50/p90 over all turns and over conversations of >= 5 turns, and the time to first token of turns
back to a history in GPU blocks against turns copied in from the host (`first_token`). Then, on
an idle engine, one turn's latency (max_new_tokens 1: its prefill) after a context of L tokens
served from each tier.

    python bench/chat.py --stateful --device cuda:0 --preset llama-2-7b --dtype bf16
"""
import gc
import heapq
import queue
import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from bench.common import triton_compiles
from bench.workload import conversation_draws

SYSTEMS = {"stateless": dict(host_bytes=0), "gpu": dict(host_bytes=0), "gpu+cpu": dict(eviction="value"),
           "gpu+cpu-lru": dict(eviction="lru"), "prefix": dict(host_bytes=0, prefix_caching=True),
           "prefix+cpu": dict(eviction="value", prefix_caching=True)}
STATEFUL = ("gpu", "gpu+cpu", "gpu+cpu-lru")  # the systems whose turns name their conversation


@dataclass
class Script:
    start: float  # seconds after the run starts
    turns: list  # (new prompt tokens, output tokens, reaction seconds before this turn)


def scripts(n: int, rate: float, reaction: float, max_context: int, vocab: int, seed: int) -> list[Script]:
    return [Script(start, [(ids.tolist(), answer, wait) for ids, answer, wait in turns])
            for start, turns in conversation_draws(n, rate, reaction, max_context, vocab, seed)]


def converse(engine, model: str, work: list[Script], stateful: bool, stop_at: float = float("inf"),
             drain: float = 30.0) -> tuple[list, float]:
    """Runs the conversations, sending no turn after `stop_at` seconds; the turns in flight then
    have `drain` seconds to finish, and those that do not are cancelled and recorded with their
    latency so far (a lower bound). Returns one record per turn (send and finish times from the
    start) and the span."""
    done: queue.Queue = queue.Queue()
    due = [(s.start, i, 0) for i, s in enumerate(work)]
    heapq.heapify(due)
    ids, history, records = [None] * len(work), [[] for _ in work], []
    first: dict[tuple[int, int], float] = {}  # (conversation, turn) -> its first token's time
    left = 0
    start = time.perf_counter()
    deadline = start + stop_at + drain
    flight = {}
    while left or (due and due[0][0] <= stop_at):
        now = time.perf_counter() - start
        while due and due[0][0] <= min(now, stop_at):
            left += 1
            _, i, t = heapq.heappop(due)
            tokens, answer, _ = work[i].turns[t]
            inputs = {"max_new_tokens": answer, "ignore_eos": True}
            if stateful:
                inputs.update(tokens=tokens, conversation=ids[i] or True)
            else:
                inputs.update(tokens=history[i] + tokens)
            f = engine.submit(model, inputs, on_partial=lambda _, key=(i, t): first.setdefault(key, time.perf_counter()))
            flight[i] = (t, time.perf_counter(), f)
            f.add_done_callback(lambda f, i=i, t=t, sent=time.perf_counter(): done.put((i, t, sent, time.perf_counter(), f)))
        wait = (due[0][0] - (time.perf_counter() - start)) if due and due[0][0] <= stop_at else 1.0
        try:
            i, t, sent, finished, f = done.get(timeout=max(min(wait, 1.0), 0.0005))
        except queue.Empty:
            if time.perf_counter() > deadline:
                break
            continue
        if i not in flight or flight[i][0] != t:
            continue
        del flight[i]
        result = f.result()
        outputs, queued = result.outputs, result.timing.queueing  # (arrival to joining a slot: waiting for blocks)
        tokens, answer, _ = work[i].turns[t]
        assert len(outputs["tokens"]) == answer
        history[i] += tokens + outputs["tokens"]
        ids[i] = outputs.get("conversation")
        context = outputs.get("context", {})
        records.append({"conversation": i, "turn": t, "turns": len(work[i].turns), "latency": finished - sent,
                        "sent": sent - start, "finished": finished - start, "ttft": first.get((i, t), finished) - sent,
                        "queued": queued, "output": answer, "history": len(history[i]) - len(tokens) - answer, **context})
        left -= 1
        if t + 1 < len(work[i].turns):
            heapq.heappush(due, (finished - start + work[i].turns[t + 1][2], i, t + 1))
    span = time.perf_counter() - start
    for i, (t, sent, f) in flight.items():  # overloaded: cancelled, latency so far
        engine.cancel(f.request_id)
        tokens, answer, _ = work[i].turns[t]
        records.append({"conversation": i, "turn": t, "turns": len(work[i].turns), "latency": span - (sent - start),
                        "sent": sent - start, "finished": float("inf"), "output": answer, "history": len(history[i]),
                        "unfinished": True})
    for _, _, f in flight.values():
        try:
            f.result(60)
        except Exception:
            pass
    if stateful:
        for cid in ids:
            if cid is not None:
                engine.submit(model, {"conversation": cid, "end": True}).result(60)
    return records, span


def summarize(system: str, rate: float, records: list, window: tuple[float, float], stats: dict | None) -> dict:
    """Over the steady window (a, b) of the run: output tokens of the turns finished in it per
    second, and the normalized latency of the turns sent in it."""
    a, b = window

    def part(rows):
        norm = np.array([r["latency"] / r["output"] for r in rows if a <= r["sent"] < b])
        tokens = sum(r["output"] for r in rows if a <= r["finished"] < b)
        return {"turns": len(norm), "tokens_per_s": tokens / (b - a),
                "unfinished": sum(1 for r in rows if r.get("unfinished") and a <= r["sent"] < b),
                "norm_latency_p50_ms": float(np.percentile(norm, 50) * 1e3) if len(norm) else None,
                "norm_latency_p90_ms": float(np.percentile(norm, 90) * 1e3) if len(norm) else None}
    row = {"system": system, "conversations_per_s": rate, "window_s": [a, b], **part(records),
           "first_token": first_token(records, window)}
    long = [r for r in records if r["turns"] >= 5]
    if long:
        row["five_turns_or_more"] = part(long)
    for key in ("cached", "swapped_in", "recomputed"):
        row[f"history_{key}"] = int(sum(r.get(key, 0) for r in records))
    row["history_tokens"] = int(sum(r["history"] for r in records))
    if stats is not None:
        row["cache_stats"] = stats
    return row


def first_token(records: list, window: tuple[float, float]) -> dict:
    """Time to the first token of the turns sent in the window that came back to a cached
    history: all from GPU blocks, against those with some of it copied in from the host tier
    (none recomputed), under the run's own load: the swap-in target's ratio. Twice: queueing
    included (`*_p50_ms`), and from joining a slot on (`*_prefill_p50_ms`: the turn's prefill with
    its copies in, without the wait for blocks before it). (Histories copied in tend to be older,
    not longer; the medians compare them as they come.)"""
    a, b = window
    turns = [r for r in records if a <= r["sent"] < b and r.get("history") and "ttft" in r and not r.get("unfinished")]
    hit = [r for r in turns if r.get("cached") and not r.get("swapped_in") and not r.get("recomputed")]
    swapped = [r for r in turns if r.get("swapped_in") and not r.get("recomputed")]
    out = {"gpu_hit_turns": len(hit), "swapped_in_turns": len(swapped)}
    for name, value in (("", lambda r: r["ttft"]), ("_prefill", lambda r: r["ttft"] - (r.get("queued") or 0.0))):
        hits, swaps = [value(r) for r in hit], [value(r) for r in swapped]
        out[f"gpu_hit{name}_p50_ms"] = float(np.median(hits) * 1e3) if hits else None
        out[f"swapped_in{name}_p50_ms"] = float(np.median(swaps) * 1e3) if swaps else None
        out[f"swapped_in_over_hit{name}"] = out[f"swapped_in{name}_p50_ms"] / out[f"gpu_hit{name}_p50_ms"] \
            if hits and swaps else None
    return out


def graph_counters(runner) -> dict:
    """Iterations run, those that replayed (or captured) a CUDA graph, captures and their wall
    time, Triton's compiles and theirs: a snapshot, subtracted from a later one for what a run
    cost."""
    compiles = triton_compiles()
    return {"runner_iterations": runner.num_iterations, "graph_iterations": runner.num_graph_iterations,
            "graph_captures": runner.graphs.num_captures, "graph_capture_s": runner.graphs.capture_s,
            "triton_compiles": compiles.count, "triton_compile_s": compiles.seconds}


def engine_counters(engine, gen) -> dict:
    """What the whole run (all its turns) cost the engine: iterations, tokens, manager time."""
    stats = engine.stats()
    iterations = tokens = 0
    for key, n in stats["batch_sizes"].items():  # "cell:tokens" -> iterations
        iterations += n
        tokens += n * int(key.rsplit(":", 1)[1])
    graphs = graph_counters(next(iter(engine.workers[0].iterations.values())))
    return {"time_s": time.perf_counter(), "iterations": iterations, "tokens": tokens, **graphs,
            "suspended": gen.queue.num_suspended, **gen.queue.counters, **{f"{k}_ms": v for k, v in stats["stage_ms"].items()}}


def engine_delta(before: dict, after: dict) -> dict:
    delta = {k: after[k] - before[k] for k in after}
    n = max(delta["iterations"], 1)
    delta["tokens_per_iteration"] = delta["tokens"] / n
    delta["running_per_iteration"] = delta.pop("running") / max(delta["planned"], 1)
    delta["idle_held_per_iteration"] = delta.pop("idle_held") / max(delta["planned"], 1)  # blocks
    delta["idle_locked_per_iteration"] = delta.pop("idle_locked") / max(delta["planned"], 1)  # by copies out
    delta["ms_per_iteration"] = delta.pop("time_s") * 1e3 / n
    delta["manager_ms_per_iteration"] = sum(delta[f"{k}_ms"] for k in ("admit", "complete", "schedule")) / n
    return delta


def tier_latency(engine, model: str, contexts: list[int], prompt: int, vocab: int, repeats: int = 5,
                 profile: bool = False, trace_dir: str | None = None) -> list[dict]:
    """One turn's latency (max_new_tokens 1) after a context of L tokens kept on the GPU, copied
    back from the host, or recomputed; and a stateless request of the whole L + prompt tokens.
    The engine is stepped here (started with thread=False), so the cache is moved between steps.
    profile: one more turn per tier under torch.profiler (bench/turn_profile.py), summarized (and
    its whole trace written to trace_dir, if given)."""
    gen = engine.structured[model]
    runner = next(iter(engine.workers[0].iterations.values()))
    rng = np.random.default_rng(0)
    rows = []

    def turn(inputs):
        start = time.perf_counter()
        f = engine.submit(model, {**inputs, "max_new_tokens": 1, "ignore_eos": True})
        while not f.done():
            with torch.profiler.record_function("engine.step"):
                engine.step()
        return time.perf_counter() - start, f.result().outputs

    def sample(context, tier, measure=lambda fn: (fn(), None)):
        first = rng.integers(1, vocab, context - 1).tolist()
        new = rng.integers(1, vocab, prompt).tolist()
        if tier == "stateless":
            (took, _), summary = measure(lambda: turn({"tokens": first + [5] + new}))
            return took, summary
        _, out = turn({"tokens": first, "conversation": True})
        cid = out["conversation"]
        _demote(gen, runner, cid, tier)
        (took, out), summary = measure(lambda: turn({"tokens": new, "conversation": cid}))
        assert out["context"]["cached" if tier == "gpu" else "swapped_in" if tier == "host" else "recomputed"] > 0
        f = engine.submit(model, {"conversation": cid, "end": True})
        while not f.done():
            engine.step()
        return took, summary

    for context in contexts:
        for tier in ("gpu", "host", "recompute", "stateless"):
            seconds = [sample(context, tier)[0] for _ in range(repeats)]
            rows.append({"context": context, "prompt": prompt, "tier": tier, "latency_ms": float(np.median(seconds) * 1e3),
                         "samples_ms": [s * 1e3 for s in seconds]})
            if tier == "host" and runner.device.type == "cuda":  # the bound: the bytes' copy alone
                rows[-1]["copy_in_alone_ms"] = _copy_in_ms(runner, context)
            if profile and runner.device.type == "cuda":
                from bench.turn_profile import profiled
                path = None if trace_dir is None else f"{trace_dir}/turn-{context}-{tier}.json.gz"
                rows[-1]["profile"] = sample(context, tier, lambda fn: profiled(fn, path))[1]
            print(rows[-1], flush=True)
    return rows


def _copy_in_ms(runner, context: int, repeats: int = 5) -> float:
    """One pinned host buffer of `context` positions' K/V copied to the GPU at once (median ms):
    the least time a restored turn's swap-in can take on this machine's host link."""
    nbytes = runner.host.bytes_per_chunk // runner.chunk_tokens * context
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=runner.device)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def _demote(gen, runner, cid: str, tier: str) -> None:
    """Move an idle conversation's cache to `tier` (between the engine's steps)."""
    conversation = gen.conversations[cid]
    cache = gen.caches[conversation.worker]
    if tier == "recompute":
        cache.demote(conversation.row, drop=True)
    elif tier == "host":
        plan = cache.demote(conversation.row)
        cuda = runner.device.type == "cuda"
        runner.host.swap_out(plan, (runner.stream or torch.cuda.current_stream(runner.device)) if cuda else None)
        if cuda:
            plan.done.synchronize()
        cache.poll()
        cache.release_copied(conversation.row)


def run(args, model, config, write_results) -> None:
    from batchmaker import Engine, EngineConfig
    cell = model.cells["decoder"]
    base_kv = cell.kv
    rates = [float(r) for r in args.conversation_rates.split(",")]
    reaction = 60.0 / args.compress
    rows, tiers = [], []
    payload = {"preset": args.preset, "dtype": args.dtype, "kv_gpu_blocks": cell.kv.num_blocks,
               "block_size": cell.block_size, "host_gib": args.host_gib, "arrival_seconds": args.arrival_seconds,
               "reaction_mean_s": reaction, "reaction_compression": args.compress, "max_tokens": args.max_tokens,
               "swap_out_rows": args.swap_out_rows or base_kv.swap_out_rows,
               "rows": rows, "tier_latency": tiers}

    def save() -> None:
        def plot(fig):
            for k, (key, title) in enumerate([(None, "all turns"), ("five_turns_or_more", ">= 5 turns")]):
                ax = fig.add_subplot(1, 2, k + 1)
                for system in dict.fromkeys(r["system"] for r in rows):
                    parts = [r[key] if key else r for r in rows if r["system"] == system and (key is None or key in r)]
                    pts = sorted((p["tokens_per_s"], p["norm_latency_p90_ms"]) for p in parts
                                 if p["norm_latency_p90_ms"] is not None)
                    if pts:
                        ax.plot(*zip(*pts), marker="o", label=system)
                ax.set_xlabel("output tokens/s")
                ax.set_ylabel("normalized latency p90 (ms/token)")
                ax.set_yscale("log")
                ax.set_title(f"{args.preset}: {title}")
                ax.legend()
        print(write_results(f"chat-stateful-{args.preset}", args.device, payload, plot), flush=True)

    for system in args.stateful_systems:
        cell.kv = replace(base_kv, **SYSTEMS[system], **({} if "host_bytes" in SYSTEMS[system] else
                                                          {"host_bytes": int(args.host_gib * 2**30)}),
                          **({"swap_out_rows": args.swap_out_rows} if args.swap_out_rows else {}))
        engine = Engine([model], EngineConfig(devices=(args.device,))).start()
        try:
            gen = engine.structured["llama"]
            for rate in rates if system != "gpu+cpu-lru" else rates[-1:]:
                n = int(rate * args.arrival_seconds)
                work = scripts(n, rate, reaction, config.max_positions, config.vocab_size, args.seed)
                stop = work[-1].start
                before = engine_counters(engine, gen)
                records, span = converse(engine, "llama", work, stateful=system in STATEFUL, stop_at=stop)
                stats = gen.conversation_stats() if system != "stateless" else None
                if gen.caches and "chunk_cost_ms" not in payload and system.endswith("cpu"):
                    cost = next(iter(gen.caches.values())).cost  # the value policy's Cost(l), profiled
                    payload["chunk_cost_ms"] = {int((k + 1) * cell.kv.chunk_tokens): float(cost[k] * 1e3)
                                                for k in (0, 1, 3, 7, 15, 31, 63, 127) if k < len(cost)}
                rows.append(summarize(system, rate, records, (args.warm_fraction * stop, stop), stats))
                rows[-1]["engine"] = engine_delta(before, engine_counters(engine, gen))
                host = next(iter(engine.workers[0].iterations.values())).host
                if host is not None:  # host time issuing copies
                    rows[-1]["copies"] = dict(host.counters)
                    host.counters = dict.fromkeys(host.counters, 0)
                print({k: v for k, v in rows[-1].items() if k != "cache_stats"}, stats, flush=True)
                for cache in gen.caches.values():  # reset the counters between rates
                    cache.stats = dict.fromkeys(cache.stats, 0)
            save()
        finally:
            engine.stop()
        del engine, gen  # (before the next engine takes the memory)
        gc.collect()
        torch.cuda.empty_cache()
        getattr(torch._C, "_host_emptyCache", lambda: None)()  # (the host tier's pinned memory too)
        if system == "gpu+cpu" and args.tier_contexts:
            engine = Engine([model], EngineConfig(devices=(args.device,))).start(thread=False)
            try:
                contexts = [int(c) for c in args.tier_contexts.split(",")]
                tiers += tier_latency(engine, "llama", contexts, args.tier_prompt, config.vocab_size,
                                      profile=args.tier_profile or args.tier_trace is not None,
                                      trace_dir=args.tier_trace)
                save()
            finally:
                engine.stop()
            del engine
            gc.collect()
            torch.cuda.empty_cache()
            getattr(torch._C, "_host_emptyCache", lambda: None)()
    cell.kv = base_kv


def add_arguments(ap) -> None:
    ap.add_argument("--stateful", action="store_true", help="multi-turn conversations (this module)")
    ap.add_argument("--stateful-systems", nargs="+", default=["stateless", "gpu", "gpu+cpu", "gpu+cpu-lru"],
                    choices=list(SYSTEMS))
    ap.add_argument("--arrival-seconds", type=float, default=60.0,
                    help="conversations start for this long at each rate; no turn is sent after")
    ap.add_argument("--warm-fraction", type=float, default=0.4, help="of the arrivals, before measuring")
    ap.add_argument("--conversation-rates", default="0.5,1,2", help="conversations started per second")
    ap.add_argument("--compress", type=float, default=10.0, help="reaction time: mean 60 s / this")
    ap.add_argument("--kv-gib", type=float, default=40.0, help="the GPU tier (Pensieve's evaluation: 40 GB)")
    ap.add_argument("--host-gib", type=float, default=40.0, help="the host tier, pinned")
    ap.add_argument("--tier-contexts", default="1024,2048", help="contexts of the per-tier turn latency")
    ap.add_argument("--tier-prompt", type=int, default=64)
    ap.add_argument("--tier-profile", action="store_true", help="one more turn per tier under torch.profiler")
    ap.add_argument("--tier-trace", default=None, help="a folder for those turns' whole traces (implies --tier-profile)")
    ap.add_argument("--swap-out-rows", type=int, default=None, help="conversations per copy-out plan (KVSettings)")
