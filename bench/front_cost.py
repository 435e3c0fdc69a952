"""The replicas' front (batchmaker/replicas.py): its host cost per request, and the wire's encoding.

The point of replicas is throughput, so the front (submit, routing, one message per replica a
turn, the reports, resolving) must cost little per request: at 2 GPUs it must carry ~2x60K LSTM
requests/s. The front's cost is measured as CPU time, not wall time, so that the replicas beside
it on the same cores do not blur it: the caller's time inside submit (thread CPU time), the front
thread's (/proc/self/task/TID/stat), and the whole front process's, per request finished.

The replicas run the LSTM with null rounds (the engine's whole bookkeeping, no cell compute; as
bench/manager.py) so that a 2-core machine has CPU left for the front. Load comes in two ways:
all requests at once (the largest turns), and open-loop Poisson arrivals at fixed rates through
bench/loadgen.py (small turns: per-turn costs show). For scale, the same load on one engine in
this process (the manager thread in place of the front thread; no replica process).

    python bench/front_cost.py                          # 1 and 2 CPU replicas, and one engine
    python bench/front_cost.py --replicas 2 --requests 100000 --rates 5000 10000 20000
    python bench/front_cost.py --only-encodings          # the wire's encodings alone
"""
import argparse
import json
import os
import pickle
import platform
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import msgpack
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402
from loadgen import LoadGenerator  # noqa: E402

from batchmaker import Engine, EngineConfig, build_model  # noqa: E402
from batchmaker.data import wmt_sentences  # noqa: E402
from batchmaker.replicas import Replicas, ReplicasConfig  # noqa: E402
from batchmaker.serving import arrays  # noqa: E402


def null_lstm():
    """The LSTM whose rounds compute nothing (a replica imports this module: front_cost:null_lstm)."""
    from batchmaker.exec.rounds import RoundRunner

    def execute(self, task) -> None:
        task.recorded = {name: np.zeros((task.num_steps, task.batch), dtype=np.int64) for name in task.record}
        task.fetched = {name: torch.zeros(len(rows), 8) for name, rows in task.fetch.items()}
    RoundRunner.execute = execute
    return build_model("lstm", vocab=1000, embed=8, hidden=8)


class CpuClock:
    """CPU seconds of this whole process, of its thread named `thread_name` (the front thread of
    the replicas, or an engine's manager thread), and of the replica processes `pids` together,
    read from /proc (Linux, 10 ms ticks)."""

    def __init__(self, thread_name: str, pids=()):
        thread = next(t for t in threading.enumerate() if t.name == thread_name)
        self.path = f"/proc/self/task/{thread.native_id}/stat"
        self.replica_paths = [f"/proc/{pid}/stat" for pid in pids]
        self.tick = os.sysconf("SC_CLK_TCK")

    def read(self) -> tuple[float, float, float]:
        return time.process_time(), self._ticks(self.path), sum(self._ticks(p) for p in self.replica_paths)

    def _ticks(self, path: str) -> float:
        with open(path) as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / self.tick  # utime + stime


def burst(system, requests: list, clock: CpuClock) -> dict:
    """Every request submitted at once; CPU per request finished."""
    process0, thread0, replicas0 = clock.read()
    wall0, submit0 = time.perf_counter(), time.thread_time()
    futures = [system.submit("lstm", inputs) for inputs in requests]
    submit_s = time.thread_time() - submit0
    for f in futures:
        f.result(600)
    wall = time.perf_counter() - wall0
    process, thread, replicas = clock.read()
    n = len(requests)
    return {"requests": n, "wall_s": wall, "rate": n / wall, "submit_us": submit_s / n * 1e6,
            "thread_us": (thread - thread0) / n * 1e6, "process_us": (process - process0) / n * 1e6,
            "replica_processes_us": (replicas - replicas0) / n * 1e6}


def paced(system, requests: list, rate: float, duration: float, gen: LoadGenerator, clock: CpuClock) -> dict:
    """Open-loop Poisson arrivals at `rate` (bench/loadgen.py, in process: the caller submits)."""
    pool = [("lstm", inputs) for inputs in requests]
    process0, thread0, replicas0 = clock.read()
    trace = gen.run_point(system.submit, pool, rate, duration, seed=int(rate))
    gen.settle()
    process, thread, replicas = clock.read()
    n, ok = len(trace.arrivals), int(trace.ok.sum())
    latency = (trace.done_at[trace.ok] - (trace.start + trace.arrivals[trace.ok])) * 1e3
    return {"offered": rate, "requests": n, "ok": ok, "thread_us": (thread - thread0) / n * 1e6,
            "process_us": (process - process0) / n * 1e6, "replica_processes_us": (replicas - replicas0) / n * 1e6,
            "latency_ms": {q: float(np.percentile(latency, q)) for q in (50, 90, 99)} if ok else None}


def measure(system, thread_name: str, requests: list, args, gen: LoadGenerator) -> dict:
    clock = CpuClock(thread_name, [r.process.pid for r in getattr(system, "replicas", ())])
    burst(system, requests[:2000], clock)  # warm-up
    run = {"burst": burst(system, (requests * 10)[:args.requests], clock),
           "paced": [paced(system, requests, rate, args.duration, gen, clock) for rate in args.rates]}
    print(f"  burst {run['burst']}")
    for point in run["paced"]:
        print(f"  paced {point}")
    return run


def encodings(requests: list, hidden: int, batch: int) -> dict:
    """µs per request to encode + decode a turn of `batch` LSTM requests and a report of their
    results ({"h": fp16 tensor [hidden]}): ours (pickle 5; a turn's requests and a report's
    results as columns, the tensors stacked into one array, split into rows as a reader would),
    pickle 5 with each tensor an array, msgpack (each tensor through the protocol's array maps,
    batchmaker/serving/arrays.py), and torch's own pickling of tensors."""
    from batchmaker.replica_wire import Report, Turn, columns, decode, encode

    turn = Turn(batches=[("lstm", list(range(batch)), requests[:batch], [])])
    h = torch.randn(batch, hidden).to(torch.float16)
    plain_turn = [[k, "lstm", inputs, 0, None, False] for k, inputs in enumerate(requests[:batch])]
    plain_results = [[k, {"h": h[k]}, 1.0] for k in range(batch)]

    def ours():
        outputs = [{"h": h[k]} for k in range(batch)]
        sent = Report(0, results=[("lstm", list(range(batch)), [1.0] * batch, columns(outputs))])
        decode(encode(sent)).results[0][3]["h"].unbind(0)

    def pack(value):
        return msgpack.packb(value, default=arrays.encode, use_bin_type=True)

    def unpack(data):
        return msgpack.unpackb(data, raw=False, object_hook=lambda m: arrays.decode(m) if "dtype" in m else m)
    cases = {"turn, pickle5 columns (ours)": lambda: decode(encode(turn)),
             "turn, pickle5 a tuple per request": lambda: pickle.loads(pickle.dumps(plain_turn, protocol=5)),
             "turn, msgpack": lambda: unpack(pack(plain_turn)),
             "report, pickle5 columns (ours)": ours,
             "report, pickle5 an array per tensor":
                 lambda: decode(encode(Report(0, results=[(k, {"h": h[k].numpy()}, 1.0) for k in range(batch)]))),
             "report, msgpack": lambda: unpack(pack(plain_results)),
             "report, torch's own tensor pickling": lambda: pickle.loads(pickle.dumps(plain_results, protocol=5))}
    return {name: _best_us(fn, 20) / batch for name, fn in cases.items()}


def _best_us(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 platform.processor())
    return {"cpu": model, "cores": len(os.sched_getaffinity(0)), "python": platform.python_version()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2], help="replica counts to measure")
    parser.add_argument("--requests", type=int, default=60000, help="requests of the burst")
    parser.add_argument("--rates", type=float, nargs="+", default=[5000, 10000, 20000])
    parser.add_argument("--duration", type=float, default=3.0, help="seconds of arrivals per rate")
    parser.add_argument("--batch", type=int, default=256, help="requests per turn in the encoding comparison")
    parser.add_argument("--only-replicas", action="store_true",
                        help="no encoding comparison, no engine in process (bench/front_ab.py's runs)")
    parser.add_argument("--only-encodings", action="store_true", help="the encoding comparison alone")
    parser.add_argument("--min-turn", type=float, help="ReplicasConfig.min_turn (default: its default)")
    parser.add_argument("--json", type=Path, help="write the record here (else bench/results/)")
    args = parser.parse_args(argv)
    requests = [{"tokens": s} for s in wmt_sentences(20000, 1000, seed=0)]
    record = {"machine": machine(), "runs": {}}
    if not args.only_replicas:
        record["encodings_us_per_request"] = encodings(requests, 1024, args.batch)
        print("encode + decode, µs per request:", {k: round(v, 3) for k, v in record["encodings_us_per_request"].items()})
    if args.only_encodings:
        print(f"wrote {write_results('front_encodings', 'cpu', record)}")
        return 0
    with LoadGenerator("inproc") as gen:
        for num in args.replicas:
            print(f"{num} replicas (thread: the front's)")
            config = ReplicasConfig(devices=("cpu",) * num, engine=EngineConfig(max_requests=1 << 22))
            if args.min_turn is not None:
                config = replace(config, min_turn=args.min_turn)
            with Replicas(["front_cost:null_lstm"], config) as replicas:
                record["runs"][f"{num} replicas"] = measure(replicas, "batchmaker-replicas", requests, args, gen)
        if not args.only_replicas:
            print("one engine in this process (thread: its manager)")
            with Engine([null_lstm()], EngineConfig(max_requests=1 << 22)) as engine:
                record["runs"]["one engine"] = measure(engine, "batchmaker-manager", requests, args, gen)
    if args.json is not None:
        args.json.write_text(json.dumps(record, indent=2) + "\n")
        return 0
    print(f"wrote {write_results('front_cost', 'cpu', record)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
