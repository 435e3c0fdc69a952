"""The replicas' front process, per request, as bench/loadgen.py drives it in process: the
per-request path (`submit` each request) against the bulk paths (`submit_many` a burst, a future
each; `submit_burst`, a burst kept as columns), and the tree before them, interleaved in one
command (issue 31: the front must carry 4 GPUs of LSTM requests, ~256K/s).

What a front process pays per request is everything on its side of the pipe: reading the
generator's bursts, submitting them, the front thread (routing, turns, reports, resolving), and
reading the completions after the point. It is measured as this process's CPU time (not wall:
the replicas share the 2 cores) over each point, per request, with two null-round CPU replicas
(bench/front_cost.py: null_lstm; the engine's bookkeeping, no cell compute):
- `serving_us`: CPU per request from the point's start until every request is done (the
  generator's bursts read and submitted, the front thread, the replies), the part that bounds
  the rate a front carries on a core of its own;
- `collect_us`: the generator's reading of the completions after the point (`loadgen._collect`
  or `_collect_bursts`, timed by wrapping them); `process_us`: everything, the cyclic collector's
  pass after the point included;
- `front_thread_us`: the front thread alone (/proc).
Points: all at once (`--burst` requests released in 50 ms), over capacity (`--over` requests/s for
1 s: the caller falls behind, as a saturated front does), and paced Poisson rates (`--rates`)
judged sustained when achieved >= 0.95 x offered and p90 <= `--slo-ms`.

    git archive <commit> | tar -x -C /tmp/base   # the tree before (+ its batchmaker/cells links)
    python bench/front_bulk_ab.py --base /tmp/base --repeats 3

Each arm of each repeat is a fresh process (`--worker`) with its tree's batchmaker and bench
(bench/loadgen.py, bench/front_cost.py); arms run in turn, base, base_burst (where the tree
before has submit_burst: its burst path), each, bulk, burst, each repeat.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ARMS = {"base": "each", "each": "each", "bulk": "bulk", "burst": "burst"}  # arm -> submit path (base: the tree before)
BASE_BURST = {"base_burst": "burst"}  # an arm more where the tree before has submit_burst: its burst path


def worker(args) -> dict:
    """One arm: its tree's loadgen, replicas and null rounds; every point's CPU per request."""
    sys.path.insert(0, str(args.tree / "bench"))
    import loadgen
    from front_cost import CpuClock
    from protocol import summarize

    from batchmaker import EngineConfig
    from batchmaker.data import wmt_sentences
    from batchmaker.replicas import Replicas, ReplicasConfig

    collect_at = [0.0, 0.0]  # process CPU instants: the point's completions read from, to

    def timed(collect):
        def timed_collect(*args):
            collect_at[0] = time.process_time()
            try:
                return collect(*args)
            finally:
                collect_at[1] = time.process_time()
        return timed_collect
    for name in ("_collect", "_collect_bursts"):  # (run_point calls them by name once the point is done)
        if hasattr(loadgen, name):
            setattr(loadgen, name, timed(getattr(loadgen, name)))

    pool = [("lstm", {"tokens": s}) for s in wmt_sentences(20000, 1000, seed=0)]
    config = ReplicasConfig(devices=("cpu",) * args.replicas, engine=EngineConfig(max_requests=1 << 22))
    out = {}
    with loadgen.LoadGenerator("inproc") as gen, Replicas(["front_cost:null_lstm"], config) as replicas:
        bursts = [0]

        def counted(model, inputs):
            bursts[0] += 1
            return (replicas.submit_many if args.path == "bulk" else replicas.submit_burst)(model, inputs)
        bulk = {"bulk": {"submit_many": counted}, "burst": {"submit_burst": counted}}.get(args.path, {})
        clock = CpuClock("batchmaker-replicas", [h.process.pid for h in replicas.replicas])

        def point(label: str, rate: float, duration: float, seed: int) -> dict:
            bursts[0] = 0
            process0, thread0, replicas0 = clock.read()
            trace = gen.run_point(replicas.submit, pool, rate, duration, seed=seed, drain_timeout=60, **bulk)
            gen.settle()
            process, thread, replica_s = clock.read()
            n = len(trace.arrivals)
            summary = summarize(trace, min(0.25, duration / 4))
            wall = float(max(trace.done_at[trace.ok]) - trace.start) if trace.ok.any() else float("nan")
            row = {"offered": rate, "requests": n, "ok": int(trace.ok.sum()),
                   "process_us": (process - process0) / n * 1e6, "serving_us": (collect_at[0] - process0) / n * 1e6,
                   "collect_us": (collect_at[1] - collect_at[0]) / n * 1e6,
                   "front_thread_us": (thread - thread0) / n * 1e6,
                   "replica_processes_us": (replica_s - replicas0) / n * 1e6,
                   "rate_to_last_done": n / wall, "achieved": summary["achieved"],
                   "latency_ms": summary["latency_ms"], "send_lag_ms": summary["send_lag_ms"],
                   "requests_per_submit_call": n / bursts[0] if bursts[0] else 1.0}
            row["sustained"] = bool(row["achieved"] >= 0.95 * summary["offered_in_window"]
                                    and row["latency_ms"]["p90"] <= args.slo_ms)
            shown = {k: v for k, v in row.items() if k != "latency_ms"}
            print(f"  {args.tree.name}, {args.path}: {label}: {json.dumps(shown)}", file=sys.stderr, flush=True)
            return row

        point("warm-up", 20000, 0.5, 97)
        out["all_at_once"] = point("all at once", args.burst / 0.05, 0.05, 1)
        out["over_capacity"] = point("over capacity", args.over, 1.0, 2)
        out["paced"] = [point(f"paced {rate:g}", rate, args.duration, 3 + k) for k, rate in enumerate(args.rates)]
    return out


def run_arm(tree: Path, path: str, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "arm.json"
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--tree", str(tree), "--path", path,
                   "--json", str(out), "--replicas", str(args.replicas), "--burst", str(args.burst),
                   "--over", str(args.over), "--duration", str(args.duration), "--slo-ms", str(args.slo_ms),
                   "--rates", *map(str, args.rates)]
        subprocess.run(command, check=True, env=dict(os.environ, PYTHONPATH=str(tree)))
        return json.loads(out.read_text())


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def table(runs: list[dict]) -> dict:
    """Per point: each measure's median and min-max over the repeats; per paced rate, how many
    repeats sustained it."""
    keys = ("process_us", "serving_us", "collect_us", "front_thread_us", "replica_processes_us", "rate_to_last_done",
            "requests_per_submit_call")
    out = {p: {k: spread([r[p][k] for r in runs]) for k in keys} for p in ("all_at_once", "over_capacity")}
    for i, p in enumerate(runs[0]["paced"]):
        at = [r["paced"][i] for r in runs]
        out[f"paced {p['offered']:g}"] = {**{k: spread([x[k] for x in at]) for k in keys},
                                          "p90_ms": spread([x["latency_ms"]["p90"] for x in at]),
                                          "sustained": [x["sustained"] for x in at]}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", type=Path, help="the tree before (its batchmaker and bench)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=2, help="CPU null-round replica processes")
    parser.add_argument("--burst", type=int, default=60000, help="requests of the all-at-once point")
    parser.add_argument("--over", type=float, default=150000, help="requests/s of the over-capacity point (1 s)")
    parser.add_argument("--rates", type=float, nargs="+", default=[20000, 40000, 60000])
    parser.add_argument("--duration", type=float, default=2.0, help="seconds of each paced point")
    parser.add_argument("--slo-ms", type=float, default=100.0, help="p90 a paced point must keep to be sustained")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tree", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--path", choices=["each", "bulk", "burst"], help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        args.json.write_text(json.dumps(worker(args)))
        return 0
    sys.path.insert(0, str(HERE))
    from common import write_results
    from front_cost import machine

    trees = {"base": args.base.resolve(), "base_burst": args.base.resolve(), "each": HERE.parent, "bulk": HERE.parent,
             "burst": HERE.parent}
    arms = {"base": "each", **(BASE_BURST if (args.base / "batchmaker" / "burst.py").exists() else {}), **ARMS}
    runs: dict[str, list] = {arm: [] for arm in arms}
    for repeat in range(args.repeats):
        for arm, path in arms.items():  # in turn: the machine's drift spreads over every arm alike
            print(f"repeat {repeat}: {arm}", file=sys.stderr, flush=True)
            runs[arm].append(run_arm(trees[arm], path, args))
    commits = {arm: subprocess.run(["git", "-C", str(tree), "describe", "--always", "--dirty", "--abbrev=12"],
                                   capture_output=True, text=True).stdout.strip() or "(not a git tree)"
               for arm, tree in trees.items() if arm in arms}
    record = {"machine": machine(), "arms": {arm: {"tree": commits[arm], "submit": arms[arm]} for arm in arms},
              "settings": {k: v for k, v in vars(args).items() if k in ("repeats", "replicas", "burst", "over", "rates",
                                                                          "duration", "slo_ms")},
              "tables": {arm: table(r) for arm, r in runs.items()}, "runs": runs}
    for arm in arms:
        t = record["tables"][arm]
        print(f"{arm:10s} " + "  ".join(f"{p}: serving {t[p]['serving_us']['median']:.2f} "
                                       f"[{t[p]['serving_us']['min']:.2f}-{t[p]['serving_us']['max']:.2f}] µs"
                                       for p in ("all_at_once", "over_capacity")))
    print(f"wrote {write_results('front-bulk-ab', 'cpu', record)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
