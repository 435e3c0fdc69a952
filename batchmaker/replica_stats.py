"""`Replicas.stats()`: the replicas' engine counters merged into the shape of `Engine.stats()`
(batchmaker/stats.py), so dashboards, leak checks and the benchmarks read one dict either way.

Counts add up across replicas; per-worker lists (rows used, tasks in flight) are joined in
replica order, so they stay per worker. What only the front knows replaces the sums: the requests
accepted and not finished (the admission bound counts those), the bound, and the latency
percentiles, measured from a request's arrival at the front to its reply there (percentiles do
not add up). `replicas` keeps each replica's own counters beside its device, pid and liveness.
"""
from typing import TYPE_CHECKING, Any

from batchmaker.stats import percentiles

if TYPE_CHECKING:
    from batchmaker.replicas import Replicas


def front_stats(replicas: "Replicas") -> dict[str, Any]:
    front = replicas.front
    return {"num_queued_requests": replicas.num_accepted - (front.num_finished if front else 0),
            "max_requests": replicas.config.engine.max_requests,
            "latency_ms": {name: percentiles(list(lat)) for name, lat in (front.latencies if front else {}).items()}}


def merge_stats(front: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """rows: per replica {"replica", "device", "pid", "alive", "failure", "num_in_flight", "engine":
    its Engine.stats() or None (failed, stopped, no answer)}."""
    engines = [row["engine"] for row in rows if row["engine"] is not None]
    merged = merge(engines) if engines else {}
    merged.update(front)
    merged["replicas"] = rows
    return merged


def merge(values: list) -> Any:
    """Dicts key by key, lists joined, numbers summed; anything else: the first value."""
    if all(isinstance(v, dict) for v in values):
        keys = dict.fromkeys(k for v in values for k in v)
        return {k: merge([v[k] for v in values if k in v]) for k in keys}
    if all(isinstance(v, list) for v in values):
        return [x for v in values for x in v]
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return sum(values)
    return values[0]
