"""The open-loop load generator shared by bench/wmt.py and bench/treebank.py.

Requests arrive as a Poisson process at a given rate, whatever the system under test does (open
loop: a slow system builds a queue, it does not slow the arrivals). Each request goes through a
`submit(model, inputs) -> Future[Result]` callable, so the engine, a baseline server or a ZeroMQ
client plug in alike. Per request we keep:
- the system's own queueing and computation times (`Result.timing`, the server's clock);
- the latency seen by the submitter: the request's *scheduled* arrival -> future done, on this
  process's clock (over the wire the server's clock differs, and this one includes the
  transport). Counting from the scheduled instant, not from the submit call, keeps a system that
  holds the GIL (delaying this thread's sends) from hiding the delay (coordinated omission);
  `send_lag_ms` says how late the sends were.

    point = run_rate(engine.submit, requests, rate=500, duration=5)   # one offered load
    points = sweep(engine.submit, requests, rates=[250, 500, 1000])  # up to saturation
"""
import gc
import random
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

Submit = Callable[[str, dict], Future]
Request = tuple[str, dict]  # (model name, inputs)
CDF_POINTS = 101  # quantiles kept per run for CDF plots (0%, 1%, ..., 100%)


@dataclass(frozen=True)
class LoadConfig:
    duration: float = 5.0  # seconds of arrivals per offered rate
    min_requests: int = 200  # at low rates, arrivals continue until this many were sent
    max_requests: int = 200_000
    drain_timeout: float = 60.0  # after the last arrival, wait at most this long for results
    saturated_below: float = 0.8  # achieved < 0.8 x offered, or an unfinished drain: saturated
    seed: int = 0
    progress: bool = True


@dataclass
class RatePoint:
    """What one offered rate gave: percentiles in ms, throughput in requests/s."""

    offered_rate: float
    num_sent: int
    num_done: int
    num_failed: int
    throughput: float
    is_saturated: bool
    sent_rate: float  # what the generator managed to send: below the offered rate, it was the limit
    latency_ms: dict  # submitter's clock: scheduled arrival -> future done
    server_latency_ms: dict
    queueing_ms: dict
    computation_ms: dict
    send_lag_ms: dict = field(default_factory=dict)  # scheduled arrival -> submit call
    cdf_ms: dict = field(default_factory=dict)  # name -> CDF_POINTS quantiles
    extra: dict = field(default_factory=dict)  # the system's own counters (batch sizes, ...)

    @property
    def p90_ms(self) -> float:
        return self.latency_ms["p90"]


def poisson_arrivals(rate: float, num: int, seed: int) -> np.ndarray:
    """num arrival offsets (s) from 0, exponential gaps of mean 1/rate."""
    gaps = np.random.default_rng([seed, int(rate * 1000)]).exponential(1.0 / rate, size=num)
    return np.cumsum(gaps) - gaps[0]


def run_rate(submit: Submit, requests: Sequence[Request], rate: float, config: LoadConfig = LoadConfig(),
             label: str = "") -> RatePoint:
    """Offer `rate` requests/s for config.duration seconds, requests drawn from `requests` at random."""
    num = int(min(max(rate * config.duration, config.min_requests), config.max_requests))
    arrivals = poisson_arrivals(rate, num, config.seed)
    picks = random.Random(config.seed).choices(range(len(requests)), k=num)
    record = _Record(num)
    bar = Progress(num, f"{label} {rate:g}/s", config.progress)
    gc.collect()
    gc.disable()  # no collector pauses inside a point, whatever the system (they hit every thread)
    try:
        start = time.perf_counter()
        sent_rate = _send(submit, requests, start, arrivals, picks, record, bar)
        last_arrival = time.perf_counter()
        while not record.all_done.wait(0.2) and time.perf_counter() - last_arrival < config.drain_timeout:
            bar.update(num, record.num_done)
    finally:
        gc.enable()
    bar.close(record.num_done)
    return _summarize(rate, start + arrivals, record.sent_at, record.done_at, record.futures, config, sent_rate)


class _Record:
    """When each request was sent and done; `done` is every future's callback (kept tiny: it runs
    on the system's thread)."""

    def __init__(self, num: int):
        self.sent_at = np.zeros(num)
        self.done_at = np.full(num, np.nan)
        self.futures: list[Future] = []
        self.num_done = 0
        self.num = num
        self.all_done = threading.Event()
        self._index = {}  # id(future) -> its request's position

    def done(self, future) -> None:
        self.done_at[self._index[id(future)]] = time.perf_counter()
        self.num_done += 1  # (one resolving thread per system: the manager, or the baseline's loop)
        if self.num_done == self.num:
            self.all_done.set()


def _send(submit, requests, start, arrivals, picks, record: _Record, bar) -> float:
    """Send every request whose arrival instant has come, in one burst per wake-up (a late
    sender still sends at once; arrivals stay Poisson; latency counts from each arrival)."""
    num, i = len(arrivals), 0
    futures, index, sent_at, done, clock = record.futures, record._index, record.sent_at, record.done, time.perf_counter
    while i < num:
        now = clock() - start
        if arrivals[i] > now:
            time.sleep(arrivals[i] - now)
            now = clock() - start
        due = int(np.searchsorted(arrivals, now, side="right"))
        for k in range(i, max(due, i + 1)):
            model, inputs = requests[picks[k]]
            sent_at[k] = clock()
            future = submit(model, inputs)
            index[id(future)] = k
            futures.append(future)
            future.add_done_callback(done)
        i = max(due, i + 1)
        bar.update(i, record.num_done)
    elapsed = clock() - start
    return num / elapsed if elapsed > 0 else float(num)


def sweep(submit: Submit, requests: Sequence[Request], rates: Sequence[float], config: LoadConfig = LoadConfig(),
          label: str = "", extra: Callable[[], dict] | None = None) -> list[RatePoint]:
    """run_rate for each rate in increasing order; stops after the first saturated point.

    `extra()` (if given) is called before and after each point; numeric leaves of its dicts are
    differenced, e.g. a batch-size histogram per point.
    """
    points = []
    for rate in sorted(rates):
        before = extra() if extra else {}
        point = run_rate(submit, requests, rate, config, label)
        if extra:
            point.extra = _difference(extra(), before)
        points.append(point)
        print(f"  {label} offered {rate:8.1f}/s  achieved {point.throughput:8.1f}/s  p50/p90/p99 "
              f"{point.latency_ms['p50']:8.2f} {point.latency_ms['p90']:8.2f} {point.latency_ms['p99']:8.2f} ms"
              f"  queue p90 {point.queueing_ms['p90']:7.2f}  compute p90 {point.computation_ms['p90']:7.2f}"
              f"  send lag p99 {point.send_lag_ms['p99']:6.2f}"
              f"{'  SATURATED' if point.is_saturated else ''}"
              f"{'  (generator sent only %.0f/s)' % point.sent_rate if point.sent_rate < 0.9 * rate else ''}",
              file=sys.stderr, flush=True)
        if point.is_saturated:
            break
    return points


def geometric_rates(start: float, stop: float, factor: float = 2.0) -> list[float]:
    rates, rate = [], start
    while rate <= stop * 1.0001:
        rates.append(round(rate, 3))
        rate *= factor
    return rates


def peak(points: Sequence[RatePoint]) -> float:
    return max((p.throughput for p in points), default=0.0)


def p90_at(points: Sequence[RatePoint], throughput: float) -> float | None:
    """p90 latency (ms) at `throughput`, interpolated linearly between the unsaturated points
    (a saturated point's latency grows with the run's duration); None where the system did not
    reach that throughput unsaturated."""
    steady = [p for p in points if not p.is_saturated]
    xs = [p.throughput for p in steady]
    ys = [p.p90_ms for p in steady]
    if not xs or throughput > max(xs):
        return None
    if throughput <= xs[0]:
        return ys[0]  # below the lowest load measured: the lowest load's p90 (a lower bound)
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x0 <= throughput <= x1 and x1 > x0:
            return y0 + (y1 - y0) * (throughput - x0) / (x1 - x0)
    return ys[int(np.argmax(xs))]


def percentiles(values_s: np.ndarray) -> dict:
    if len(values_s) == 0:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan"), "mean": float("nan")}
    ms = np.asarray(values_s) * 1e3
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(ms.mean())}


def _summarize(rate, scheduled, sent_at, done_at, futures, config: LoadConfig, sent_rate: float) -> RatePoint:
    finished = ~np.isnan(done_at)
    ok, queueing, computation, server = [], [], [], []
    for i, future in enumerate(futures):
        if not finished[i] or future.exception() is not None:
            continue
        timing = future.result().timing
        ok.append(i)
        queueing.append(timing.queueing)
        computation.append(timing.computation)
        server.append(timing.latency)
    ok = np.asarray(ok, dtype=np.int64)
    latency = done_at[ok] - scheduled[ok]
    span = (np.nanmax(done_at) if finished.any() else time.perf_counter()) - scheduled[0]
    throughput = float(len(ok) / span) if span > 0 else 0.0
    num_failed = int(finished.sum()) - len(ok)
    is_saturated = bool(throughput < config.saturated_below * rate or not finished.all())
    quantiles = np.linspace(0, 100, CDF_POINTS)
    cdf = {name: (np.percentile(np.asarray(v) * 1e3, quantiles).tolist() if len(v) else [])
           for name, v in (("latency", latency), ("queueing", queueing), ("computation", computation))}
    return RatePoint(offered_rate=rate, num_sent=len(futures), num_done=len(ok), num_failed=num_failed,
                     throughput=throughput, is_saturated=is_saturated, sent_rate=float(sent_rate), latency_ms=percentiles(latency),
                     server_latency_ms=percentiles(server), queueing_ms=percentiles(queueing),
                     computation_ms=percentiles(computation), send_lag_ms=percentiles(sent_at - scheduled),
                     cdf_ms=cdf)


def _difference(after, before):
    if isinstance(after, dict):
        out = {k: _difference(v, before.get(k, 0) if isinstance(before, dict) else 0) for k, v in after.items()}
        return {k: v for k, v in out.items() if v != 0 and v != {}}
    if isinstance(after, (int, float)) and isinstance(before, (int, float)):
        return after - before
    return after


class Progress:
    """A one-line progress bar on stderr: sent and done out of the total."""

    def __init__(self, total: int, label: str, enabled: bool = True):
        self.total, self.label, self.enabled = total, label, enabled and sys.stderr.isatty()
        self.last = 0.0

    def update(self, sent: int, done: int) -> None:
        now = time.perf_counter()
        if not self.enabled or now - self.last < 0.1:
            return
        self.last = now
        width = 30
        filled = width * done // self.total
        print(f"\r  {self.label:28s} [{'#' * filled:{width}}] sent {sent}/{self.total} done {done}",
              end="", file=sys.stderr, flush=True)

    def close(self, done: int) -> None:
        if self.enabled:
            self.last = 0.0
            self.update(self.total, done)
            print(file=sys.stderr, flush=True)
