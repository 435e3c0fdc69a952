"""What bench/wmt.py and bench/treebank.py share: flags, numerics, the systems' lifetimes, the
protocol's run (bench/protocol.py) through the load generator process (bench/loadgen.py), the
baselines' tuning runs, the ratios against the targets and the load generator's own ceiling.

A run measures the device's limits (bench/device_limits.py), starts the generator process and
every system at once (idle ones wait on a queue), warms each up, optionally tunes a baseline
(each candidate gets one curve and search; the best sustainable throughput wins, every run is
kept), runs the repeats, then the p90 at half of each baseline's sustainable throughput (measured
there, every system of the pair, in each repeat), then the null system's ceiling.
"""
import argparse
import contextlib
import math
import random
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

import device_limits
from loadgen import LoadGenerator
from protocol import Protocol, Slo, ratio_range, run_repeats, search, spread, summarize, sustains

ENGINE = "batchmaker"
ABLATION = "request-level"


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--devices", default=None, help="engine workers, comma-separated (default: --device)")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "fp16"])
    parser.add_argument("--tf32", default="off", choices=["on", "off"], help="TF32 for matmul and cuDNN alike")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--embed", type=int, default=None, help="default: --hidden")
    parser.add_argument("--vocab", type=int, default=30000)
    parser.add_argument("--rates", type=float, nargs="+", required=True,
                        help="the curve's offered rates (req/s), the same for every system")
    parser.add_argument("--duration", type=float, default=Protocol.duration, help="seconds of arrivals per point")
    parser.add_argument("--warm", type=float, default=Protocol.warm, help="seconds of each point not measured")
    parser.add_argument("--min-window-requests", type=int, default=Protocol.min_window_requests)
    parser.add_argument("--repeats", type=int, default=Protocol.repeats)
    parser.add_argument("--resolution", type=float, default=Protocol.resolution)
    parser.add_argument("--max-search-points", type=int, default=Protocol.max_search_points)
    parser.add_argument("--drain-timeout", type=float, default=Protocol.drain_timeout)
    parser.add_argument("--slo-ms", type=float, default=None, help="p90 SLO (default: the workload's)")
    parser.add_argument("--warmup", type=int, default=1000, help="requests sent at once to each system first")
    parser.add_argument("--warm-points", type=int, default=2, choices=[0, 1, 2],
                        help="discarded points per system before measuring (the curve's lowest and middle rates)")
    parser.add_argument("--tune", action="store_true", help="tune the baselines first (their candidates)")
    parser.add_argument("--tune-search-points", type=int, default=2, help="search points per tuning candidate")
    parser.add_argument("--mode", default="inproc", choices=["inproc", "zmq"])
    parser.add_argument("--submit", default=None, choices=["bulk", "many", "each"],
                        help="in process: each burst through a system's submit_burst, else its submit_many (bulk); "
                             "submit_many only (many); submit per request for every system (each). Default: bulk "
                             "with --replicas (the front is what they measure), else each (the baselines have no "
                             "bulk path: the engine and they pay submit alike)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (torch.set_num_threads)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--round-steps", type=int, default=None, help="the engine's steps per chain round")
    parser.add_argument("--replicas", type=int, nargs="+", default=None, metavar="N",
                        help="the engine as data-parallel replicas (a process each) over the first N of --devices, "
                             "one system per N (batchmaker-rN, in place of batchmaker), each compared with r1")
    parser.add_argument("--tag", default="", help="appended to the result name")


def numerics(args) -> dict:
    """One numeric policy for all systems: the same dtype, TF32 on or off for matmul and cuDNN."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.tf32 == "on"
    if args.threads:
        torch.set_num_threads(args.threads)
    return {"dtype": args.dtype, "torch_cpu_threads": torch.get_num_threads(),
            "tf32_matmul": torch.backends.cuda.matmul.allow_tf32, "tf32_cudnn": torch.backends.cudnn.allow_tf32}


def protocol_of(args) -> Protocol:
    return Protocol(duration=args.duration, warm=args.warm, min_window_requests=args.min_window_requests,
                    repeats=args.repeats, resolution=args.resolution, max_search_points=args.max_search_points,
                    drain_timeout=args.drain_timeout, seed=args.seed)


def engine_config(args):
    from batchmaker import EngineConfig, SchedulerConfig
    scheduler = SchedulerConfig() if args.round_steps is None else SchedulerConfig(max_round_steps=args.round_steps)
    return EngineConfig(devices=devices_of(args), scheduler=scheduler, max_requests=1 << 20)  # open loop: no bound


def devices_of(args) -> tuple[str, ...]:
    return tuple((args.devices or args.device).split(","))


@dataclass
class System:
    """A system under test, started: `submit` in process, or `address` of the ZeroMQ server in front."""

    name: str
    submit: Callable | None
    stats: Callable[[], dict]
    config: dict
    address: str | None = None
    bulk: dict = field(default_factory=dict)  # its submit_burst / submit_many, where it has one (--submit bulk)


def submit_path(args) -> str:
    """--submit, or its default: bulk for replica runs, each for the rest."""
    return args.submit or ("bulk" if args.replicas else "each")


@contextlib.contextmanager
def started(name: str, server, config: dict, mode: str, submit: str = "bulk"):
    """Start `server` (anything with start/stop/submit/stats), behind the project's ZeroMQ server
    on a loopback port of its own in --mode zmq. In process the load generator hands each burst
    to the server's `submit_burst`, else its `submit_many`, as `submit` ("bulk", "many", "each")
    allows (bench/README.md says which system takes which)."""
    server.start()
    try:
        if mode == "inproc":
            kinds = {"bulk": ("submit_burst", "submit_many"), "many": ("submit_many",), "each": ()}[submit]
            bulk = {k: getattr(server, k, None) for k in kinds}
            path = "burst" if bulk.get("submit_burst") else "many" if bulk.get("submit_many") else "each"
            yield System(name, server.submit, server.stats, {**config, "submit": path}, bulk=bulk)
            return
        from batchmaker.serving.server import Server, ServerConfig
        front = Server(server, ServerConfig(address="tcp://127.0.0.1:*")).start()
        try:
            yield System(name, None, server.stats, config, front.address)
        finally:
            front.stop(drain_timeout=5.0)
    finally:
        server.stop()


def engine_factory(build_models, args, model_name: str, cellular: bool = True, width: int | None = 10,
                   max_batch: int = 512):
    """The engine (on models of its own: build_models() -> [Model]), or the ablation (the same
    engine behind a request-level gate)."""
    from batchmaker import Engine
    from baselines.request_level import RequestLevelEngine

    def make():
        models = build_models()
        engine = Engine(models, engine_config(args))
        config = {"name": ENGINE, "engine_config": plain(asdict(engine.config)),
                  "max_batch": {m.name: {c: max(s) for c, s in m.batch_sizes.items()} for m in models}}
        if cellular:
            return engine, config
        gate = RequestLevelEngine(engine, model_name, width=width, max_batch=max_batch)
        return gate, {**config, **gate.config()}
    return make


def baseline_factory(cls, *a, **kw):
    def make():
        server = cls(*a, **kw)
        return server, server.config()
    return make


def null_factory():
    from baselines.null import NullSystem
    return lambda: (NullSystem(), {"name": "null", "what": "resolves every request at once"})


def measurer(system: System, gen: LoadGenerator, requests, protocol: Protocol, slo: Slo, needs: dict | None = None):
    """measure(rate, repeat) -> point: one offered rate through the generator, summarized, with the
    system's counters over the point; with `needs` (cell -> int64 [len(requests)]: the cell-rows
    each request needs) also the offered requests' sum per cell (`cell_rows_needed`)."""
    def measure(rate: float, repeat: int) -> dict:
        before = system.stats()
        trace = gen.run_point(system.submit, requests, rate, protocol.duration_at(rate),
                              seed=protocol.seed * 1000 + repeat, drain_timeout=protocol.drain_timeout,
                              address=system.address, **system.bulk)
        settled = gen.settle()
        point = summarize(trace, protocol.warm)
        point.update(counters=counters(before, system.stats()), settled=settled, repeat=repeat)
        if needs is not None:
            point.update(num_offered=len(trace.picks),
                         cell_rows_needed={cell: int(n[trace.picks].sum()) for cell, n in needs.items()})
        point["sustained"] = sustains(point, slo, protocol)
        lat = point["latency_ms"]
        print(f"  {system.name:15s} offered {rate:9.1f}/s achieved {point['achieved']:9.1f}/s  p50/p90/p99 "
              f"{lat['p50']:8.2f} {lat['p90']:8.2f} {lat['p99']:8.2f} ms  queue p90 {point['queueing_ms']['p90']:7.2f}"
              f"  compute p90 {point['computation_ms']['p90']:7.2f}  lag p99 {point['send_lag_ms']['p99']:6.2f}"
              f"  {'ok' if point['sustained'] else 'NOT SUSTAINED'}", file=sys.stderr, flush=True)
        return point
    return measure


def warm_up(system: System, gen: LoadGenerator, requests, num: int, rates=()) -> None:
    """`num` requests at once (CUDA graphs captured, kernels compiled, pools grown), then a
    discarded point at each of `rates`: on the H100 the first system measured in a process ran
    cold (lazily loaded kernels, block configurations compiled on first use) when only the burst
    preceded it, which sank the first tuning candidate in 3 of 5 tunings."""
    if num:
        gen.run_point(system.submit, requests, rate=num / 0.05, duration=0.05, seed=99, drain_timeout=300,
                      address=system.address, **system.bulk)
        gen.settle()
    for rate in rates:
        gen.run_point(system.submit, requests, rate=rate, duration=0.5, seed=98, drain_timeout=60,
                      address=system.address, **system.bulk)
        gen.settle()


def warm_rates(args) -> list[float]:
    """The discarded warm-up points: the curve's lowest and middle rates (--warm-points 0: none)."""
    rates = sorted(args.rates)
    return [rates[0], rates[len(rates) // 2]][:args.warm_points]


def run_benchmark(args, requests, factories: dict, comparisons: dict, slo: Slo, tuning: dict | None = None,
                  checkpoint=None) -> dict:
    """The whole protocol (module docstring). factories: name -> make() -> (server, config);
    comparisons: baseline (or a label with "baseline" inside) -> {"ours": ENGINE, "sustainable": target, "p90":
    target, "half_load": bool}; tuning:
    baseline -> {candidate label: make}; checkpoint(partial record) after each repeat (what a
    killed run leaves)."""
    protocol = protocol_of(args)
    is_ok = lambda p: p["sustained"]  # noqa: E731
    limits = device_limits.measure(args.device, torch.float16 if args.dtype == "fp16" else torch.float32)
    print(f"device limits: {limits.copy_bytes_per_s / 1e9:.0f} GB/s copy, "
          f"{limits.matmul_flops_per_s / 1e12:.1f} TFLOP/s {limits.matmul_dtype}", file=sys.stderr)
    out = {"device_limits": limits.as_dict(), "protocol": asdict(protocol), "slo": asdict(slo),
           "curve_rates": sorted(args.rates), "tuning": {}}
    with LoadGenerator(args.mode, requests) as gen:
        for baseline, candidates in (tuning or {}).items() if args.tune else ():
            out["tuning"][baseline] = tune(candidates, gen, requests, protocol, slo, args)
            best = max(out["tuning"][baseline], key=lambda c: out["tuning"][baseline][c]["sustainable"]["median"])
            factories[baseline] = candidates[best]
            out["tuning"][baseline] = {"chosen": best, "candidates": out["tuning"][baseline]}
        with contextlib.ExitStack() as stack:
            systems = {}
            for name, make in factories.items():
                try:
                    server, config = make()
                except (ImportError, ValueError) as e:  # DyNet absent, or not on this device
                    print(f"skipping {name}: {e}", file=sys.stderr)
                    out.setdefault("skipped", {})[name] = str(e)
                    continue
                systems[name] = stack.enter_context(started(name, server, config, args.mode, submit_path(args)))
                warm_up(systems[name], gen, requests, args.warmup, warm_rates(args))
            measures = {n: measurer(s, gen, requests, protocol, slo) for n, s in systems.items() if n != "null"}
            save = (lambda partial: checkpoint({**out, "partial": True, "systems": partial})) if checkpoint else None
            results = run_repeats(measures, args.rates, is_ok, protocol, on_repeat=save)
            for name, s in systems.items():
                if name in results:
                    results[name]["config"] = s.config
            out["half_load"] = half_load(comparisons, results, measures, protocol)
            if "null" in systems:
                out["generator"] = null_ceiling(measurer(systems["null"], gen, requests, protocol, slo), results,
                                                is_ok, protocol)
    out["systems"] = results
    out["comparisons"] = compare(comparisons, results, out["half_load"])
    return out


def run_and_write(args, name: str, about: dict, title: str, policy: dict, requests, factories: dict,
                  comparisons: dict, slo: Slo, tuning: dict | None = None) -> int:
    """`run_benchmark`, writing its JSON after each repeat (a run cut short keeps them) and with its
    plot at the end; prints the summary. The record holds the settings, numerics and data."""
    import plots
    from common import write_results

    def save(record: dict, final: bool = False):
        record = {"title": title, "settings": vars(args), "numerics": policy, "data": about, **finite(record)}
        return write_results(name, args.device, record, plot=plots.plotter(record) if final else None), record
    path, record = save(run_benchmark(args, requests, factories, comparisons, slo, tuning, checkpoint=save), final=True)
    for line in summary_lines(record):
        print(line)
    print(f"wrote {path}")
    return 0


def tune(candidates: dict, gen, requests, protocol: Protocol, slo: Slo, args) -> dict:
    """One curve and search per candidate configuration of a baseline (the tuning runs, kept)."""
    once = Protocol(**{**asdict(protocol), "repeats": 1, "max_search_points": args.tune_search_points})
    runs = {}
    for label, make in candidates.items():
        print(f"== tuning: {label}", file=sys.stderr, flush=True)
        server, config = make()
        with started(label, server, config, args.mode, submit_path(args)) as system:
            warm_up(system, gen, requests, args.warmup, warm_rates(args))
            runs[label] = run_repeats({label: measurer(system, gen, requests, once, slo)}, args.rates,
                                      lambda p: p["sustained"], once)[label]
            runs[label]["config"] = config
    return runs


def half_load(comparisons: dict, results: dict, measures: dict, protocol: Protocol) -> dict:
    """Both systems of each pair marked `half_load` at half the baseline's median sustainable
    throughput, once per repeat, in a random order each time (measured there, not interpolated)."""
    rng = random.Random(protocol.seed + 1)
    out = {}
    for key, spec in comparisons.items():
        baseline = spec.get("baseline", key)
        if (not spec.get("half_load") or baseline not in results or spec["ours"] not in results
                or not results[baseline]["sustainable"]):
            continue
        rate = 0.5 * results[baseline]["sustainable"]["median"]
        if rate <= 0:
            continue
        pair = [spec["ours"], baseline]
        points = {name: [] for name in pair}
        for repeat in range(protocol.repeats):
            rng.shuffle(pair)
            for name in pair:
                points[name].append(measures[name](rate, repeat))
        out[key] = {"rate": rate, "points": points}
    return out


def null_ceiling(measure, results: dict, is_ok, protocol: Protocol) -> dict:
    """The null system's sustainable throughput (once): the generator and the submit path alone.
    It must be >= 1.5x the best system's, or the generator is the ceiling."""
    best = max((r["sustainable"]["max"] for r in results.values() if r.get("sustainable")), default=0.0) or 1000.0
    curve = [measure(best * k, 0) for k in (1, 2, 4)]
    found = search(lambda r: measure(r, 0), curve, is_ok, protocol)
    ratio = found["rate"] / best
    return {"null_sustainable": found["rate"], "bracket": found["bracket"], "best_system_sustainable": best,
            "ratio": ratio, "target": 1.5, "met": ratio >= 1.5, "points": curve + found["points"]}


def compare(comparisons: dict, results: dict, half: dict) -> dict:
    """Per baseline: sustainable throughput ratio (median, conservative range; met when its lower end
    reaches the target), p90 ratio at half the baseline's sustainable throughput (met when the upper
    end is within the target), p90 ratios at the curve's offered rates, and peak under overload."""
    out = {}
    for key, spec in comparisons.items():
        ours, baseline = spec["ours"], spec.get("baseline", key)
        if baseline not in results or ours not in results or not results[baseline]["sustainable"]:
            continue
        a, b = results[ours], results[baseline]
        row = {"ours": ours, "baseline": baseline}
        s = ratio_range(a["sustainable"]["values"], b["sustainable"]["values"])
        row["sustainable"] = {**s, "target": spec.get("sustainable"),
                              "met": None if spec.get("sustainable") is None else s["min"] >= spec["sustainable"]}
        if key in half:
            p90 = {n: [p["latency_ms"]["p90"] for p in pts] for n, pts in half[key]["points"].items()}
            r = ratio_range(p90[ours], p90[baseline])
            row["p90_at_half"] = {"rate": half[key]["rate"], "p90_ms": {n: spread(v) for n, v in p90.items()},
                                  **r, "target": spec.get("p90"),
                                  "met": None if spec.get("p90") is None else r["max"] <= spec["p90"]}
        row["p90_at_offered"] = [
            {"offered_rate": pa["offered_rate"], **ratio_range(pa["p90_ms"]["values"], pb["p90_ms"]["values"])}
            for pa, pb in zip(a["curve"], b["curve"])]
        row["peak_under_overload"] = ratio_range(a["peak_under_overload"]["values"], b["peak_under_overload"]["values"])
        out[key] = row
    return out


def counters(before: dict, after: dict) -> dict:
    """The system's counters over one point: batches and mean batch per cell (or per batch), cell-rows
    per cell (bench/baselines/cell_rows.py), and the other numeric counters' differences (stage
    timers, host and wait seconds)."""
    diff = _difference(after, before)
    sizes = diff.pop("batch_sizes", {}) or {}
    engine = diff.get("engine")
    if isinstance(engine, dict):  # the ablation: its engine's counters inside
        sizes = engine.pop("batch_sizes", {}) or {}
        diff.update({f"engine_{k}": v for k, v in engine.items() if k == "stage_ms"})
        diff["cell_rows"] = engine.get("cell_rows", {})
        diff.pop("engine")
    by_cell: dict[str, list] = {}
    for key, count in sizes.items():
        cell, _, rows = key.rpartition(":")
        by_cell.setdefault(cell or "batch", []).append((int(rows), count))
    diff["batches"] = {cell: {"num": sum(c for _, c in v), "mean_size": sum(r * c for r, c in v) / max(1, sum(c for _, c in v))}
                       for cell, v in by_cell.items()}
    return {k: v for k, v in diff.items() if k in ("batches", "cell_rows", "stage_ms", "engine_stage_ms", "admit_s",
                                                  "host_s", "wait_s", "num_batches", "num_tasks")}


def _difference(after, before):
    if isinstance(after, dict):
        out = {k: _difference(v, before.get(k, 0) if isinstance(before, dict) else 0) for k, v in after.items()}
        return {k: v for k, v in out.items() if v != 0 and v != {}}
    if isinstance(after, (int, float)) and isinstance(before, (int, float)):
        return after - before
    return None


def plain(value):
    """Dataclass dicts with tuples and nested configs made JSON-friendly."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value if isinstance(value, (int, float, str, bool, type(None))) else str(value)


def finite(value):
    """inf and nan as None (strict JSON); everything else unchanged."""
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def summary_lines(record: dict) -> list[str]:
    lines = []
    for name, r in record["systems"].items():
        s = r["sustainable"]
        lines.append(f"{name:16s} sustainable {s['median']:9.1f} req/s (min {s['min']:.1f}, max {s['max']:.1f});"
                     f" peak under overload {r['peak_under_overload']['median']:.1f}")
    for c in record["comparisons"].values():
        s = c["sustainable"]
        line = (f"{c['ours']} vs {c['baseline']}: sustainable {s['median']:.2f}x (range {s['min']:.2f}-{s['max']:.2f},"
                f" target {s['target']}, met {s['met']})")
        if "p90_at_half" in c:
            p = c["p90_at_half"]
            line += (f"; p90 at {p['rate']:.0f}/s {p['median']:.3f}x (range {p['min']:.3f}-{p['max']:.3f},"
                     f" target {p['target']}, met {p['met']})")
        lines.append(line)
    if record.get("generator"):
        g = record["generator"]
        lines.append(f"generator: null sustains {g['null_sustainable']:.0f}/s = {g['ratio']:.1f}x the best system "
                     f"(target 1.5, met {g['met']})")
    return lines
