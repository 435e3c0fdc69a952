"""What bench/wmt.py and bench/treebank.py share: flags, numerics, the systems' lifetimes, the
side-by-side sweep, the target checks and the plots (Fig. 2.7: p90 latency vs throughput, one line
per system; Fig. 2.9: CDFs of queueing and computation time at one common load).
"""
import argparse
import contextlib
import importlib.util
import cProfile
import io
import pstats
import sys
import time
from dataclasses import asdict

import torch

from batchmaker import Engine, EngineConfig, SchedulerConfig
from loadgen import LoadConfig, geometric_rates, p90_at, peak, sweep

ENGINE = "batchmaker"


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--devices", default=None, help="engine workers, comma-separated (default: --device); "
                                                        "baselines run on --device")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "fp16"])
    parser.add_argument("--tf32", default="off", choices=["on", "off"],
                        help="TF32 for matmul and cuDNN alike, for every system")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--embed", type=int, default=None, help="default: --hidden")
    parser.add_argument("--vocab", type=int, default=30000)
    parser.add_argument("--rates", type=float, nargs="+", default=None, help="offered rates (req/s)")
    parser.add_argument("--sweep", default="100:64000:2", help="START:STOP:FACTOR, used without --rates")
    parser.add_argument("--null-sweep", default="4000:4096000:2", help="START:STOP:FACTOR of the null system")
    parser.add_argument("--duration", type=float, default=3.0, help="seconds of arrivals per rate")
    parser.add_argument("--min-requests", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=200, help="requests sent at once before each sweep")
    parser.add_argument("--mode", default="inproc", choices=["inproc", "zmq"])
    parser.add_argument("--address", default="tcp://127.0.0.1:5555", help="--mode zmq: where the server binds")
    parser.add_argument("--cprofile", action="store_true", help="cProfile the engine's manager thread")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (torch.set_num_threads)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--round-steps", type=int, default=SchedulerConfig.max_round_steps,
                        help="the engine's steps per chain or decode round (SchedulerConfig.max_round_steps)")
    parser.add_argument("--tag", default="", help="appended to the result name")


def numerics(args) -> dict:
    """One numeric policy for all systems: the same dtype, TF32 on or off for matmul and cuDNN."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.tf32 == "on"
    if args.threads:
        torch.set_num_threads(args.threads)
    return {"dtype": args.dtype, "torch_cpu_threads": torch.get_num_threads(), "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
            "tf32_cudnn": torch.backends.cudnn.allow_tf32}


def rates(args) -> list[float]:
    if args.rates:
        return sorted(args.rates)
    start, stop, factor = (float(x) for x in args.sweep.split(":"))
    return geometric_rates(start, stop, factor)


def load_config(args) -> LoadConfig:
    return LoadConfig(duration=args.duration, min_requests=args.min_requests, seed=args.seed)


@contextlib.contextmanager
def engine_system(models, args):
    """Yields (submit, extra): an engine in process, or behind a ZeroMQ server on loopback."""
    devices = tuple((args.devices or args.device).split(","))
    engine = Engine(models, EngineConfig(devices=devices, max_requests=1 << 20,  # open loop: no admission bound
                                         scheduler=SchedulerConfig(max_round_steps=args.round_steps)))
    profiler = cProfile.Profile() if args.cprofile else None
    if profiler:
        loop = engine._loop  # the manager thread's body, looked up when the thread starts

        def profiled_loop():
            profiler.runcall(loop)
        engine._loop = profiled_loop
    engine.start()
    extra = lambda: {"time_s": time.perf_counter(), **_engine_counters(engine)}  # noqa: E731
    try:
        with submitter(engine, args) as submit:
            yield submit, extra
    finally:
        engine.stop()
        if profiler:
            args.profile_out = _top_functions(profiler)


@contextlib.contextmanager
def submitter(system, args):
    """`system.submit` in process, or a Client's submit to a Server in front of `system`."""
    if args.mode == "inproc":
        yield system.submit
    else:
        with zmq_client(system, args) as submit:
            yield submit


@contextlib.contextmanager
def zmq_client(engine, args):
    """The lead's Server (issue 3) in front of `engine` (or a baseline: it only needs submit and
    cancel) on loopback, and a Client's submit."""
    try:
        from batchmaker.serving.client import Client
        from batchmaker.serving.server import Server, ServerConfig
    except ImportError as e:
        raise SystemExit(f"--mode zmq needs batchmaker.serving (pyzmq): {e}")
    server = Server(engine, ServerConfig(address=args.address))
    server.start()
    client = Client(args.address)
    try:
        yield client.submit
    finally:
        client.close()
        server.stop(drain_timeout=5.0)


@contextlib.contextmanager
def baseline_system(server, args):
    """Yields (submit, extra) for a baseline server, in process or behind the same ZeroMQ server."""
    server.start()
    extra = lambda: {"time_s": time.perf_counter(), **server.stats()}  # noqa: E731
    try:
        with submitter(server, args) as submit:
            yield submit, extra
    finally:
        server.stop()


def run_system(name: str, system, requests, args) -> dict:
    """Warm up, then sweep the offered rates (the null system: `--null-sweep`, to its own
    saturation); returns the points and peak throughput."""
    print(f"== {name}", file=sys.stderr, flush=True)
    offered = rates(args) if name != "null" else geometric_rates(*(float(x) for x in args.null_sweep.split(":")))
    with system as (submit, extra):
        warm = [submit(*requests[i % len(requests)]) for i in range(args.warmup)]
        for f in warm:
            f.result(timeout=300)
        points = sweep(submit, requests, offered, load_config(args), label=name, extra=extra)
    out = {"peak_throughput": peak(points), "points": [asdict(p) for p in points]}
    if getattr(args, "profile_out", None):
        out["cprofile_manager_thread"] = args.profile_out
        args.profile_out = None
    return out


def null_system(args):
    """The null system behind the same load path (bench/baselines/null.py)."""
    from baselines.null import NullSystem
    return baseline_system(NullSystem(), args)


def headroom(results: dict) -> dict | None:
    """The load generator is not the ceiling: the null system's peak over the best measured
    system's (issue 10 asks for >= 1.5; a system that never saturated has only a lower bound)."""
    if "null" not in results:
        return None
    others = {k: r["peak_throughput"] for k, r in results.items() if k != "null" and "peak_throughput" in r}
    best = max(others.values(), default=0.0)
    ratio = results["null"]["peak_throughput"] / best if best else None
    return {"null_peak": results["null"]["peak_throughput"], "best_system_peak": best, "ratio": ratio,
            "target": 1.5, "met": ratio is not None and ratio >= 1.5}


def compare(results: dict, baseline: str, peak_target: float | None, load_fraction: float,
            p90_target: float | None) -> dict:
    """The issue's two ratios against `baseline`: peak throughput, and p90 at a fraction of the
    baseline's peak (None where the engine never reached that load). A system that never
    saturated has a peak that is only a lower bound (`saturated` says which did)."""
    from loadgen import RatePoint
    points = {name: [RatePoint(**p) for p in r["points"]] for name, r in results.items()}
    base_peak = results[baseline]["peak_throughput"]
    load = load_fraction * base_peak
    ours, theirs = p90_at(points[ENGINE], load), p90_at(points[baseline], load)
    peak_ratio = results[ENGINE]["peak_throughput"] / base_peak if base_peak else None
    p90_ratio = ours / theirs if ours is not None and theirs else None
    return {
        "baseline": baseline,
        "peak_ratio": peak_ratio, "peak_target": peak_target,
        "peak_met": None if peak_target is None else peak_ratio is not None and peak_ratio >= peak_target,
        "saturated": {name: any(p.is_saturated for p in pts) for name, pts in points.items()},
        "load_for_p90": load, "p90_ms": {ENGINE: ours, baseline: theirs},
        "p90_ratio": p90_ratio, "p90_target": p90_target,
        "p90_met": None if p90_target is None else p90_ratio is not None and p90_ratio <= p90_target,
    }


def plot(fig, results: dict, title: str) -> None:
    """Left: p90 latency vs achieved throughput; middle/right: CDFs at the common load."""
    lat, queue_ax, comp_ax = fig.subplots(1, 3)
    common = common_rate(results)
    for k, (name, r) in enumerate(results.items()):
        pts = r["points"]
        lat.plot([p["throughput"] for p in pts], [p["latency_ms"]["p90"] for p in pts], "o-", color=f"C{k}",
                 label=name, markersize=3)
        at = next((p for p in pts if p["offered_rate"] == common), pts[0])
        for ax, key in ((queue_ax, "queueing"), (comp_ax, "computation")):
            q = at["cdf_ms"][key]
            ax.plot(q, [i / (len(q) - 1) for i in range(len(q))], color=f"C{k}",
                    label=f"{name} @ {at['throughput']:.0f}/s")
    lat.set_xlabel("throughput (req/s)")
    lat.set_ylabel("p90 latency (ms)")
    lat.set_yscale("log")
    lat.set_title(title, fontsize=8)
    lat.legend(fontsize=7)
    for ax, key in ((queue_ax, "queueing"), (comp_ax, "computation")):
        ax.set_xscale("log")
        ax.set_xlabel(f"{key} time (ms)")
        ax.set_ylabel("CDF")
        ax.legend(fontsize=6)
    fig.set_size_inches(13, 4)


def common_rate(results: dict) -> float | None:
    """The highest offered rate every system ran unsaturated (where the CDFs are compared)."""
    ok = [{p["offered_rate"] for p in r["points"] if not p["is_saturated"]} for r in results.values()]
    shared = set.intersection(*ok) if ok else set()
    return max(shared) if shared else None


def plot_or_none(results: dict, title: str):
    """The plot function for write_results, or None where matplotlib is missing (the GPU machine
    may lack it: `python bench/runner.py --replot FILE.json` draws it later from the JSON)."""
    if importlib.util.find_spec("matplotlib") is None:
        print("matplotlib missing: no PNG (replot from the JSON)", file=sys.stderr)
        return None
    return lambda fig: plot(fig, results, title)


def replot(paths: list[str]) -> None:
    import json
    from pathlib import Path

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    for path in map(Path, paths):
        record = json.loads(path.read_text())
        ran = {k: v for k, v in record["systems"].items() if "points" in v}
        fig = plt.figure()
        plot(fig, ran, record.get("title", path.stem))
        fig.tight_layout()
        fig.savefig(path.with_suffix(".png"), dpi=110)
        plt.close(fig)
        print(f"wrote {path.with_suffix('.png')}")


def summary_lines(results: dict) -> list[str]:
    lines = []
    for name, r in results.items():
        lines.append(f"{name:16s} peak {r['peak_throughput']:9.1f} req/s; p90 ms by offered rate: " + ", ".join(
            f"{p['offered_rate']:g}:{p['latency_ms']['p90']:.1f}" for p in r["points"]))
    return lines


def _engine_counters(engine) -> dict:
    stats = engine.stats()
    return {"batch_sizes": stats["batch_sizes"], "num_tasks": stats["num_tasks"], "stage_ms": stats["stage_ms"]}


def _top_functions(profiler: cProfile.Profile, limit: int = 25) -> list[dict]:
    stats = pstats.Stats(profiler, stream=io.StringIO())
    rows = [{"function": f"{path.rsplit('/', 2)[-1] if '/' in path else path}:{line}({fn})", "calls": nc,
             "tottime_s": tt, "cumtime_s": ct} for (path, line, fn), (cc, nc, tt, ct, _) in stats.stats.items()]
    return sorted(rows, key=lambda r: r["tottime_s"], reverse=True)[:limit]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="redraw the PNG of bench/wmt.py or bench/treebank.py results")
    parser.add_argument("--replot", nargs="+", required=True, metavar="JSON")
    replot(parser.parse_args().replot)
