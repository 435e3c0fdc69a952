"""Soak: a `batchmaker serve` subprocess under an open-loop Poisson load at a fraction of its
measured peak for a long time; every request must come back, and the server's resident memory
must stop growing after warm-up.

    python bench/soak.py                          # peak (closed loop), then 10 min at 80% of it
    python bench/soak.py --duration 60 --warmup 20  # a quick check

1. Peak: `--concurrency` requests kept outstanding for `--peak-seconds` (closed loop); peak =
   completions per second.
2. Soak: Poisson arrivals at `--load` x peak for `--duration` seconds, the three built-in models
   mixed as in `batchmaker demo`; the server's VmRSS sampled every `--sample-every` seconds.
Reported: requests sent / answered / failed (by code), resident memory at the end of warm-up and
at the end with the growth between, latency percentiles per minute.
"""
import argparse
import importlib.util
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402

from batchmaker.serving.client import Client  # noqa: E402
from batchmaker.serving.demo import DEMO_SIZES, MODELS, demo_requests  # noqa: E402


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def start_server(address: str) -> subprocess.Popen:
    sizes = [arg for k, v in DEMO_SIZES.items() for arg in ("--set", f"{k}={v}")]
    return subprocess.Popen([sys.executable, "-m", "batchmaker.serving.cli", "--log-level", "warning", "serve",
                             "--address", address, "--models", ",".join(MODELS), *sizes])


class Load:
    """Keeps the tallies; callbacks run on the client's I/O thread."""

    def __init__(self):
        self.lock = threading.Lock()
        self.sent = 0
        self.answered = 0
        self.errors: Counter = Counter()
        self.latencies: list[tuple[float, float]] = []  # (finish time, latency s)

    def submit(self, client: Client, name: str, inputs: dict, on_done=None) -> None:
        with self.lock:
            self.sent += 1
        future = client.submit(name, inputs)
        future.add_done_callback(lambda f: self._done(f, on_done))

    def _done(self, future, on_done) -> None:
        error = future.exception()
        with self.lock:
            self.answered += 1
            if error is not None:
                self.errors[getattr(error, "code", type(error).__name__)] += 1
            else:
                self.latencies.append((time.perf_counter(), future.result().timing.latency))
        if on_done is not None:
            on_done()


def measure_peak(client: Client, requests: dict, seconds: float, concurrency: int, seed: int) -> float:
    load, rng, names = Load(), random.Random(seed), list(requests)
    stop = time.perf_counter() + seconds

    def next_request():
        if time.perf_counter() < stop:
            name = rng.choice(names)
            load.submit(client, name, rng.choice(requests[name]), next_request)

    start = time.perf_counter()
    for _ in range(concurrency):
        next_request()
    while load.answered < load.sent or time.perf_counter() < stop:
        time.sleep(0.05)
    done = sum(1 for t, _ in load.latencies if t <= stop)
    return done / (stop - start)


def soak(client: Client, pid: int, requests: dict, rate: float, args) -> dict:
    load, rng, names = Load(), random.Random(args.seed + 1), list(requests)
    samples = []  # (seconds since start, rss bytes)
    start = time.perf_counter()
    next_arrival = next_sample = start
    while (now := time.perf_counter()) < start + args.duration:
        if now >= next_arrival:
            name = rng.choice(names)
            load.submit(client, name, rng.choice(requests[name]))
            next_arrival += rng.expovariate(rate)
        if now >= next_sample:
            samples.append((now - start, rss_bytes(pid)))
            print(f"\r  {now - start:6.0f}/{args.duration:g} s  sent {load.sent}  answered {load.answered}  "
                  f"rss {samples[-1][1] / 2**20:.0f} MiB", end="", file=sys.stderr, flush=True)
            next_sample += args.sample_every
        time.sleep(max(0.0, min(next_arrival, next_sample) - time.perf_counter()))
    deadline = time.perf_counter() + 60
    while load.answered < load.sent and time.perf_counter() < deadline:
        time.sleep(0.05)
    samples.append((time.perf_counter() - start, rss_bytes(pid)))
    print(file=sys.stderr)
    warm = next(rss for t, rss in samples if t >= args.warmup)
    per_minute = {}
    for t, latency in load.latencies:
        per_minute.setdefault(int((t - start) // 60), []).append(latency * 1e3)
    return {
        "rate_offered": rate, "sent": load.sent, "answered": load.answered, "lost": load.sent - load.answered,
        "succeeded": len(load.latencies), "errors": dict(load.errors),
        "throughput": len(load.latencies) / args.duration,
        "rss_after_warmup_mib": warm / 2**20, "rss_end_mib": samples[-1][1] / 2**20,
        "rss_growth_after_warmup": samples[-1][1] / warm - 1,
        "rss_max_after_warmup_mib": max(rss for t, rss in samples if t >= args.warmup) / 2**20,
        "rss_samples": [(round(t, 1), round(rss / 2**20, 1)) for t, rss in samples],
        "latency_ms_per_minute": {m: _percentiles(v) for m, v in sorted(per_minute.items())},
    }


def _percentiles(values: list[float]) -> dict:
    values.sort()
    return {q: round(values[min(len(values) - 1, int(float(q[1:]) / 100 * len(values)))], 2)
            for q in ("p50", "p90", "p99")} | {"count": len(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="soak seconds")
    parser.add_argument("--warmup", type=float, default=120.0, help="seconds before the memory baseline")
    parser.add_argument("--load", type=float, default=0.8, help="fraction of the measured peak")
    parser.add_argument("--peak-seconds", type=float, default=30.0)
    parser.add_argument("--concurrency", type=int, default=256, help="outstanding requests while measuring peak")
    parser.add_argument("--sample-every", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    address = f"ipc://{tempfile.mkdtemp(prefix='bm-soak-')}/s"
    server = start_server(address)
    try:
        with Client(address, timeout=120) as client:
            client.health(timeout=120)
            requests = demo_requests(2000, args.seed)
            peak = measure_peak(client, requests, args.peak_seconds, args.concurrency, args.seed)
            print(f"peak {peak:.1f} requests/s (closed loop, {args.concurrency} outstanding); "
                  f"soaking at {args.load:.0%} = {args.load * peak:.1f}/s for {args.duration:g} s", file=sys.stderr)
            result = soak(client, server.pid, requests, args.load * peak, args)
            stats = client.stats()
        result |= {"peak_throughput": peak, "load": args.load, "duration_s": args.duration, "warmup_s": args.warmup,
                   "models": list(MODELS), "sizes": DEMO_SIZES, "cpu_count": os.cpu_count(),
                   "server_stats": {k: stats[k] for k in ("num_live_requests", "num_live_nodes", "num_rows_used",
                                                          "latency_ms", "server")}}
    finally:
        server.terminate()
        server.wait(60)
    print({k: v for k, v in result.items() if k not in ("rss_samples", "latency_ms_per_minute", "server_stats")})

    def plot(fig):
        ax = fig.add_subplot(111)
        ts, rss = zip(*result["rss_samples"])
        ax.plot(ts, rss)
        ax.axvline(args.warmup, ls="--", c="gray", label="end of warm-up")
        ax.set_xlabel("seconds")
        ax.set_ylabel("server resident memory (MiB)")
        ax.set_title(f"soak at {args.load:.0%} of peak ({result['rate_offered']:.1f} req/s): "
                     f"{result['lost']} lost, growth {result['rss_growth_after_warmup']:+.1%}")
        ax.legend()

    if importlib.util.find_spec("matplotlib") is None:  # a bench extra: the numbers matter more than the plot
        print("matplotlib is not installed (pip install -e '.[bench]'): writing the JSON without the plot",
              file=sys.stderr)
        plot = None
    path = write_results("soak", "cpu", result, plot)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
