"""The measurement protocol of bench/wmt.py and bench/treebank.py: what a point is, when a system
sustains a rate, how the sustainable throughput is found, and how repeats become spreads.

- A **point** offers one rate for `duration` seconds. Arrivals in the first `warm` seconds warm
  the system to its steady state under that load and are not measured: the point's window is
  [warm, duration). Latency percentiles are over the window's arrivals (a request still unfinished
  when the drain ends counts as infinitely late, a failed one too); the offered rate in the window
  is its scheduled arrivals over its length. The achieved throughput is the rate at which the
  system finished the window's requests: their arrival rate divided by the slope of finish
  instants against arrival instants, 1 + (growth of latency) / (time). The growth is measured
  robustly, as the median latency of the window's last fifth of arrivals minus that of its first
  fifth, over the distance between the two fifths' median arrival instants. In a steady state the
  slope is 1 and achieved = offered; a system that cannot keep up finishes them more slowly than
  they came and the slope says by how much. Two other estimates were tried and are kept in the
  point for the record, being noisier in short windows: the completions that fall inside the
  window (`completions_in_window`: a batch of 512 finishing just inside or outside moves it 5% at
  26K requests/s in 0.35 s; the estimate used when some request never finished), and a least-
  squares slope (`ls_slope`: a few starved requests of a round-robin bucket tilt it by 5-25%).
  `p90_halves_ms` (the window's first and second halves) shows whether latency was still growing.
- A system **sustains** a point when achieved >= 0.95 x offered (both in the window) and p90 <= the
  workload's SLO.
- The **sustainable throughput** is the highest offered rate it sustains: the highest sustained
  rate of the shared curve and the lowest failing rate above it bracket it, then a geometric
  bisection narrows the bracket until its top is within 5% of the rate found. A rate that fails
  below a sustained one (a stall in one short point) does not cap the search; it is listed as
  `failed_below`, and the repeats show how often that happens.
- **Repeats**: every system's curve and search is repeated (`repeats`, >= 3), the order of the
  systems shuffled in each repeat; points at the same rate in the same repeat see the same arrival
  instants (common random numbers). Spreads are min-max over repeats; a ratio's range is the
  conservative one, [min(ours) / max(theirs), max(ours) / min(theirs)].
"""
import math
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from loadgen import Trace


@dataclass(frozen=True)
class Protocol:
    duration: float = 2.0  # seconds of arrivals per point
    warm: float = 0.5  # arrivals before this are not measured (the system reaches its steady state)
    min_window_requests: int = 1000  # at low rates a point lasts until its window holds this many (the
    # achieved-vs-offered test compares counts whose edges fluctuate by ~sqrt(rate x latency))
    repeats: int = 3
    resolution: float = 1.05  # the search stops when bracket_high / rate <= this
    min_achieved: float = 0.95  # achieved / offered, in the window
    max_search_points: int = 6  # per search, beyond the shared curve
    drain_timeout: float = 10.0  # after the last arrival; the unfinished count as infinitely late
    seed: int = 0

    def duration_at(self, rate: float) -> float:
        return max(self.duration, self.warm + self.min_window_requests / rate)


@dataclass(frozen=True)
class Slo:
    p90_ms: float
    why: str


def percentiles(values_ms: np.ndarray) -> dict:
    """p50/p90/p99 without interpolation (an infinite value stays infinite), and the mean of the finite."""
    if len(values_ms) == 0:
        return {"p50": math.nan, "p90": math.nan, "p99": math.nan, "mean": math.nan}
    p50, p90, p99 = np.percentile(values_ms, [50, 90, 99], method="inverted_cdf")
    finite = values_ms[np.isfinite(values_ms)]
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99),
            "mean": float(finite.mean()) if len(finite) else math.inf}


def summarize(trace: Trace, warm: float) -> dict:
    """A point's numbers from its raw trace (module docstring); times in ms, rates in requests/s."""
    window = trace.duration - warm
    measured = trace.arrivals >= warm
    scheduled = trace.start + trace.arrivals
    latency = np.where(trace.ok, trace.done_at - scheduled, np.inf)[measured] * 1e3
    done = trace.done_at - trace.start
    with np.errstate(invalid="ignore"):
        completions = int(np.count_nonzero((done >= warm) & (done < trace.duration)))
    mid = warm + window / 2
    halves = [latency[trace.arrivals[measured] < mid], latency[trace.arrivals[measured] >= mid]]
    num = int(measured.sum())
    ok = trace.ok[measured]
    unfinished = int(np.count_nonzero(np.isnan(trace.done_at[measured])))
    arrived, finished = trace.arrivals[measured][ok], done[measured][ok]
    slope = finish_slope(arrived, finished)
    achieved = num / window / slope if unfinished == 0 and slope else completions / window
    return {
        "offered_rate": trace.rate, "duration_s": trace.duration, "warm_s": warm,
        "offered_in_window": num / window, "achieved": achieved, "finish_slope": slope,
        "completions_in_window": completions / window, "ls_slope": least_squares_slope(arrived, finished),
        "num_in_window": num,
        "num_failed": int(np.count_nonzero(~ok & ~np.isnan(trace.done_at[measured]))),
        "num_unfinished": unfinished,
        "latency_ms": percentiles(latency),
        "queueing_ms": percentiles(trace.queueing[measured][ok] * 1e3),
        "computation_ms": percentiles(trace.computation[measured][ok] * 1e3),
        "send_lag_ms": percentiles((trace.sent_at - scheduled)[measured] * 1e3),
        "p90_halves_ms": [percentiles(h)["p90"] for h in halves],
    }


def finish_slope(arrivals: np.ndarray, finishes: np.ndarray) -> float | None:
    """d(finish) / d(arrival) from the medians of the first and last fifth (arrivals sorted): 1 when
    the system keeps up, offered / capacity when it does not."""
    k = len(arrivals) // 5
    if k < 10:
        return None
    first, last = slice(0, k), slice(len(arrivals) - k, None)
    span = np.median(arrivals[last]) - np.median(arrivals[first])
    latency = finishes - arrivals
    return float(1 + (np.median(latency[last]) - np.median(latency[first])) / span) if span > 0 else None


def least_squares_slope(arrivals: np.ndarray, finishes: np.ndarray) -> float | None:
    if len(arrivals) < 2 or np.ptp(arrivals) <= 0:
        return None
    a = arrivals - arrivals.mean()
    return float(np.dot(a, finishes - finishes.mean()) / np.dot(a, a))


def sustains(point: dict, slo: Slo, protocol: Protocol) -> bool:
    return (point["achieved"] >= protocol.min_achieved * point["offered_in_window"]
            and point["latency_ms"]["p90"] <= slo.p90_ms)


Measure = Callable[[float], dict]  # offered rate -> point (summarize's dict, plus the system's counters)


def search(measure: Measure, curve: list[dict], is_ok: Callable[[dict], bool], protocol: Protocol) -> dict:
    """The highest sustained rate: the curve's highest sustained rate and the lowest failing rate
    above it bracket it (extended x1.5 up or /2 down where the curve does not), then geometric
    bisection until bracket_high / rate <= resolution or max_search_points are spent."""
    judged = sorted((p["offered_rate"], is_ok(p)) for p in curve)
    passing = [r for r, good in judged if good]
    lo = max(passing) if passing else None
    above = [r for r, good in judged if not good and (lo is None or r > lo)]
    hi = min(above) if above else None
    points = []

    def probe(rate: float) -> bool:
        point = measure(rate)
        points.append(point)
        return is_ok(point)
    while len(points) < protocol.max_search_points:
        if hi is None:
            rate = lo * 1.5
        elif lo is None:
            rate = hi / 2
        elif hi / lo > protocol.resolution:
            rate = math.sqrt(lo * hi)
        else:
            break
        if probe(rate):
            lo = rate
        else:
            hi = rate
    resolved = lo is not None and hi is not None and hi / lo <= protocol.resolution
    failed_below = sorted(p["offered_rate"] for p in curve + points if lo is not None
                          and p["offered_rate"] < lo and not is_ok(p))
    return {"rate": lo or 0.0, "bracket": [lo, hi], "resolved": resolved, "points": points,
            "failed_below": failed_below}


def run_repeats(measures: dict[str, Callable[[float, int], dict]], curve_rates: list[float],
                is_ok: Callable[[dict], bool], protocol: Protocol, on_repeat=None) -> dict:
    """Every system's curve (at the same rates) and its sustainable-throughput search, `repeats`
    times, the systems in a new random order each time. measures[name](rate, repeat) -> point;
    on_repeat(out) after each repeat (a checkpoint)."""
    rng = random.Random(protocol.seed)
    out = {name: {"repeats": []} for name in measures}
    for repeat in range(protocol.repeats):
        order = list(measures)
        rng.shuffle(order)
        print(f"-- repeat {repeat + 1}/{protocol.repeats}: {', '.join(order)}", file=sys.stderr, flush=True)
        for position, name in enumerate(order):
            measure = measures[name]
            curve = [measure(rate, repeat) for rate in sorted(curve_rates)]
            found = search(lambda r: measure(r, repeat), curve, is_ok, protocol)
            out[name]["repeats"].append({"repeat": repeat, "position": position, "curve": curve, "search": found})
        if on_repeat:
            on_repeat({name: {**r, **summarize_system(r["repeats"], is_ok)} for name, r in out.items()})
    for name, record in out.items():
        record.update(summarize_system(record["repeats"], is_ok))
    return out


def summarize_system(repeats: list[dict], is_ok) -> dict:
    """Sustainable throughput and peak under overload over repeats; the curve's spread per rate."""
    rates = sorted({p["offered_rate"] for r in repeats for p in r["curve"]})
    curve = []
    for rate in rates:
        at = [p for r in repeats for p in r["curve"] if p["offered_rate"] == rate]
        curve.append({"offered_rate": rate, "p90_ms": spread([p["latency_ms"]["p90"] for p in at]),
                      "achieved": spread([p["achieved"] for p in at]),
                      "sustained": [bool(is_ok(p)) for p in at]})
    found = [r["search"]["rate"] for r in repeats if r["search"]]
    # peak under overload: the most completions counted in a window (under a backlog the count is
    # the service rate; lumpy by a batch, and secondary anyway)
    peaks = [max(p.get("completions_in_window", p["achieved"]) for p in r["curve"] + (r["search"] or {}).get("points", []))
             for r in repeats]
    return {"sustainable": spread(found) if found else None, "peak_under_overload": spread(peaks), "curve": curve}


def spread(values: list[float]) -> dict:
    v = [float(x) for x in values]
    return {"values": v, "min": min(v), "median": float(np.median(v)), "max": max(v)}


def ratio_range(ours: list[float], theirs: list[float]) -> dict:
    """ours / theirs: the median's ratio and the conservative range over repeats."""
    lo = min(ours) / max(theirs) if max(theirs) > 0 else math.inf
    hi = max(ours) / min(theirs) if min(theirs) > 0 else math.inf
    med = float(np.median(ours)) / float(np.median(theirs)) if np.median(theirs) > 0 else math.inf
    return {"median": med, "min": lo, "max": hi}
