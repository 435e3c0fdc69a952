"""The engine's counters as one dict (`Engine.stats`), for benchmarks, leak checks and the server's
stats reply: requests, rows and KV blocks in use, the cell queues, tasks and batch sizes, the
manager's stage timers, latency percentiles. Read from any thread; approximate while busy.
"""
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from batchmaker.engine import Engine


def engine_stats(engine: "Engine") -> dict[str, Any]:
    processor = engine.processor
    offloaded = engine.blocks.stats()  # model -> its block worker's counters (batchmaker/block_worker.py)
    return {
        "num_live_requests": len(engine.accounting.live) + sum(o["waiting"] + o["running"] for o in offloaded.values()),
        "num_queued_requests": engine.num_accepted - engine.accounting.num_finished,  # accepted, not finished
        "max_requests": engine.config.max_requests,
        "num_live_nodes": (processor.num_live_nodes if processor else 0) + _num_live_structured(engine),
        "num_ready_nodes": engine.scheduler.num_ready if engine.scheduler else 0,
        "cell_queues": engine.scheduler.queue_lengths() if engine.scheduler else {},
        "num_rows_used": [w.memory.num_rows_used for w in engine.workers],
        "kv_blocks_used": {name: [q.blocks.num_used for q in s.queue.sequences.values()]
                           for name, s in engine.structured.items() if getattr(s, "queue", None)},
        "kv_blocks_free": {name: [q.blocks.num_free for q in s.queue.sequences.values()]
                           for name, s in engine.structured.items() if getattr(s, "queue", None)},
        "sequences": {name: _sequences(s.queue) for name, s in engine.structured.items() if getattr(s, "queue", None)}
        | {name: {"running": o["running"], "waiting": o["waiting"]} for name, o in offloaded.items()},
        "conversations": {name: s.conversation_stats() for name, s in engine.structured.items()
                          if hasattr(s, "conversation_stats")},
        "num_tasks_in_flight": [w.num_in_flight for w in engine.workers],
        "num_gathers_skipped": sum(w.num_gathers_skipped for w in engine.workers),
        "num_tasks": engine.num_tasks,
        "batch_sizes": {f"{k[0]}:{k[1]}": v for k, v in sorted(dict(engine.batch_sizes).items())},
        "cell_rows": cell_rows(engine),
        "stage_ms": {k: v / 1e6 for k, v in engine.stage_ns.items()},
        "latency_ms": {name: percentiles(list(lat)) for name, lat in engine.accounting.latencies.items()}
        | {name: o["latency_ms"] for name, o in offloaded.items()},
        "offloaded": offloaded,  # model -> waiting, running, block, num_blocks, num_tokens, block_sizes
        "broken": engine.broken(),  # model -> why its tensor-parallel group broke
    }


def cell_rows(engine: "Engine") -> dict[str, dict[str, int]]:
    """Per cell type, rows x steps of its tasks (bench/baselines/cell_rows.py's columns): cell
    steps launched; rows computed on these workers (a CPU worker steps a round's lanes while they
    step, a CUDA worker every lane of the batch padded to its graph's size, or unpadded without
    graphs, for every step of the round); as CUDA graphs would run them; every lane every step."""
    types = {ct.name: ct for cts in engine.cell_types.values() for ct in cts.values()}
    devices = {w.device.type for w in engine.workers if hasattr(w, "device")}
    graphs = engine.config.cuda_graphs and "cuda" in devices
    out: dict[str, dict[str, int]] = {}
    for (name, rows), steps in list(engine.batch_sizes.items()):
        c = out.setdefault(name, {"launches": 0, "computed": 0, "graphed": 0, "padded": 0})
        c["launches"] += steps
        ct = types.get(name)
        c["graphed"] += (ct.bucket(rows) if ct is not None and rows <= ct.max_batch else rows) * steps
        c["padded"] += rows * steps
    for name, c in out.items():
        cpu = engine.num_rows[name]
        c["computed"] = c["graphed"] if graphs else c["padded"] if "cuda" in devices else cpu
    return out


def _sequences(queue) -> dict[str, int]:
    """A decoder's requests running in slots and waiting to join (suspended ones wait again)."""
    waiting = len(queue.waiting) + sum(len(w) for w in queue.pinned.values())
    return {"running": sum(q.num_active for q in queue.sequences.values()), "waiting": waiting}


def _num_live_structured(engine: "Engine") -> int:
    processor = engine.processor
    general = len(processor.requests) if processor else 0
    return max(0, len(engine.accounting.live) - general)


def percentiles(values: list[float]) -> dict[str, float | int]:
    if not values:
        return {"count": 0}
    values.sort()
    at = lambda q: values[min(len(values) - 1, int(q * len(values)))] * 1e3  # noqa: E731
    return {"count": len(values), "p50": at(0.5), "p90": at(0.9), "p99": at(0.99)}
