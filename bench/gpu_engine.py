"""The engine's LSTM throughput at saturation against the GPU-bound limit of the same cell.

    python bench/gpu_engine.py                      # h=1024, embed 1024, vocab 30000, fp16, b_max 512
    python bench/gpu_engine.py --device cpu --hidden 64 --embed 64 --vocab 1000 --dtype fp32 --requests 300

(a) limit: torch.nn.LSTMCell (the model's own weights) at batch b_max, `--graph-steps` chained
    steps captured in one CUDA graph and replayed back to back; cell-steps/s = b_max / step time.
    Also the whole cell (embedding + LSTMCell), and both with index_select/index_copy_
    gather/scatter of h and c around the cell, eager (c) and in a graph.
(b) engine: `--requests` WMT-like sentences (batchmaker.data) submitted at once to an Engine with
    one worker; cell-steps/s = total tokens / (last result - first submit). The engine's manager
    loop is instrumented with timers (inclusive wall time per stage) and one smaller run is
    profiled with torch.profiler to see CUDA API calls and GPU busy time.
"""
import argparse
import copy
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import replay_windows, write_results  # noqa: E402

from batchmaker import Engine, EngineConfig, build_model  # noqa: E402
from batchmaker.data import wmt_sentences  # noqa: E402
from batchmaker.unfolders.common import as_dtype  # noqa: E402


# (a), (c): the cell alone ------------------------------------------------------------------------

class StepLoop:
    """`steps` consecutive cell steps at batch b on static buffers; optional gather/scatter."""

    def __init__(self, cell, batch: int, steps: int, gather: bool, lstm_only: bool, device):
        hidden = cell.lstm.hidden_size
        g = torch.Generator(device="cpu").manual_seed(0)
        self.cell, self.steps, self.gather, self.lstm_only = cell, steps, gather, lstm_only
        self.tokens = torch.randint(3, cell.embedding.num_embeddings, (batch,), generator=g).to(device)
        self.x = cell.embedding(self.tokens)  # [B, embed]
        dtype = self.x.dtype
        num_rows = 4 * batch + 1  # a state pool as the engine keeps one: rows scattered in it
        self.pool_h = (torch.randn(num_rows, hidden, generator=g) * 0.1).to(device, dtype)
        self.pool_c = (torch.randn(num_rows, hidden, generator=g) * 0.1).to(device, dtype)
        perm = torch.randperm(num_rows - 1, generator=g) + 1
        self.index_in, self.index_out = perm[:batch].to(device), perm[batch:2 * batch].to(device)
        self.h, self.c = self.pool_h[:batch].clone(), self.pool_c[:batch].clone()

    def run(self):
        h, c = self.h, self.c
        for _ in range(self.steps):
            if self.gather:
                h, c = self.pool_h.index_select(0, self.index_in), self.pool_c.index_select(0, self.index_in)
            if self.lstm_only:
                h, c = self.cell.lstm(self.x, (h, c))
            else:
                out = self.cell(token=self.tokens, h=h, c=c)
                h, c = out["h"], out["c"]
            if self.gather:
                self.pool_h.index_copy_(0, self.index_out, h)
                self.pool_c.index_copy_(0, self.index_out, c)
        return h


def time_graph(loop: StepLoop, replays: int) -> dict:
    """GPU time per step of the loop captured in a CUDA graph, replayed back to back."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            loop.run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loop.run()
    samples = replay_windows(graph, loop.steps, replays)
    step_us = float(np.median(samples))
    return {"step_us": step_us, "step_us_windows": samples, "steps_per_graph": loop.steps}


def time_eager(loop: StepLoop, iters: int, device) -> dict:
    """Host wall time per step of eager launches (the GPU time per step beside it)."""
    for _ in range(3):
        loop.run()
    _sync(device)
    start = torch.cuda.Event(enable_timing=True) if device.type == "cuda" else None
    end = torch.cuda.Event(enable_timing=True) if device.type == "cuda" else None
    if start:
        start.record()
    t0 = time.perf_counter()
    for _ in range(iters):
        loop.run()
    host_launch = time.perf_counter() - t0
    if end:
        end.record()
    _sync(device)
    wall = time.perf_counter() - t0
    n = iters * loop.steps
    out = {"step_us": wall * 1e6 / n, "host_launch_us_per_step": host_launch * 1e6 / n}
    if start:
        out["gpu_span_us_per_step"] = start.elapsed_time(end) * 1e3 / n
    return out


def cell_limits(model, args, device) -> dict:
    cell = copy.deepcopy(model.cells["lstm"]).to(device).eval()
    b = args.max_batch
    out = {}
    with torch.inference_mode():
        variants = {
            "lstmcell": dict(gather=False, lstm_only=True),
            "cell_with_embedding": dict(gather=False, lstm_only=False),
            "cell_with_gather_scatter": dict(gather=True, lstm_only=False),
        }
        for name, kw in variants.items():
            entry = {}
            if device.type == "cuda":
                torch.cuda.synchronize()
                entry["graph"] = time_graph(StepLoop(cell, b, args.graph_steps, device=device, **kw), args.replays)
            entry["eager"] = time_eager(StepLoop(cell, b, 1, device=device, **kw), args.eager_iters, device)
            for mode in list(entry):
                entry[mode]["cell_steps_per_s"] = b / (entry[mode]["step_us"] * 1e-6)
            out[name] = entry
            print(f"{name:26s} " + ", ".join(f"{m}: {e['step_us']:.1f} µs/step, {e['cell_steps_per_s']:.3g} "
                                            f"cell-steps/s" for m, e in entry.items()), flush=True)
    return out


# (b): the engine ---------------------------------------------------------------------------

class Timers:
    """Inclusive wall time and calls per wrapped method (instance attributes shadow the class's)."""

    def __init__(self):
        self.ns, self.calls = Counter(), Counter()

    def wrap(self, obj, attr: str, key: str) -> None:
        fn = getattr(obj, attr, None)
        if fn is None:  # the engine moved on: measure what still exists
            print(f"(no {type(obj).__name__}.{attr} to time)")
            return
        clock, ns, calls = time.perf_counter_ns, self.ns, self.calls

        def timed(*args, **kwargs):
            t = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                ns[key] += clock() - t
                calls[key] += 1

        setattr(obj, attr, timed)

    def reset(self) -> None:
        self.ns.clear()
        self.calls.clear()

    def report(self, wall_s: float) -> dict:
        return {key: {"total_ms": self.ns[key] / 1e6, "share_of_wall": self.ns[key] / 1e9 / wall_s,
                      "calls": self.calls[key], "us_per_call": self.ns[key] / 1e3 / max(self.calls[key], 1)}
                for key in sorted(self.ns, key=self.ns.get, reverse=True)}


def instrument(engine: Engine) -> Timers:
    timers = Timers()
    timers.wrap(engine, "_admit", "loop.admit (unfold + partition)")
    timers.wrap(engine, "_complete", "loop.complete (poll + finish + processor)")
    timers.wrap(engine, "_schedule", "loop.schedule (Algorithm 1 + plan + launch)")
    timers.wrap(engine, "_is_spinning", "loop.iterations")
    timers.wrap(engine.scheduler, "schedule", "scheduler.schedule")
    timers.wrap(engine.processor, "complete", "processor.complete")
    timers.wrap(engine.processor, "on_submit", "processor.on_submit")
    for worker in engine.workers:
        if getattr(worker, "rounds", None) is not None:
            timers.wrap(worker.rounds, "launch", "rounds.launch (fused chain rounds)")
        timers.wrap(worker, "plan", "worker.plan")
        timers.wrap(worker, "execute", "worker.execute (launch)")
        timers.wrap(worker, "poll", "worker.poll")
        timers.wrap(worker, "finish", "worker.finish")
    return timers


def run_requests(engine: Engine, sentences: list[list[int]]) -> dict:
    t0 = time.perf_counter()
    futures = [engine.submit("lstm", {"tokens": s}) for s in sentences]
    t_submitted = time.perf_counter()
    results = [f.result(timeout=240) for f in futures]
    wall = time.perf_counter() - t0
    latency = np.array([r.timing.latency for r in results]) * 1e3
    return {"wall_s": wall, "submit_s": t_submitted - t0, "results": results,
            "latency_ms": {"p50": float(np.percentile(latency, 50)), "p90": float(np.percentile(latency, 90)),
                           "p99": float(np.percentile(latency, 99))}}


def batch_histogram(before: dict, after: dict) -> dict[int, int]:
    hist = Counter()
    for key, count in after["batch_sizes"].items():
        hist[int(key.rsplit(":", 1)[1])] += count - before["batch_sizes"].get(key, 0)
    return {rows: n for rows, n in sorted(hist.items()) if n}


@torch.inference_mode()
def check_against_unbatched(model, device, sentences, results) -> float:
    """Max |engine h - the cell run alone at batch 1 on the same device| over a few requests."""
    cell = copy.deepcopy(model.cells["lstm"]).to(device).eval()
    worst = 0.0
    for tokens, result in zip(sentences, results):
        hidden = cell.lstm.hidden_size
        h = c = torch.zeros(1, hidden, dtype=cell.lstm.weight_ih.dtype, device=device)
        for t in tokens:
            out = cell(token=torch.tensor([t], device=device), h=h, c=c)
            h, c = out["h"], out["c"]
        worst = max(worst, float((h[0].float().cpu() - result.outputs["h"].float()).abs().max()))
    return worst


def profile_run(engine: Engine, sentences, device) -> dict:
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    try:  # the engine runs on its manager thread: record ops from every thread (torch >= 2.6)
        config = {"experimental_config": torch._C._profiler._ExperimentalConfig(profile_all_threads=True)}
    except (AttributeError, TypeError):
        config = {}
    with profile(activities=activities, **config) as prof:
        run = run_requests(engine, sentences)
    averages = prof.key_averages()
    rows = []
    for e in averages:
        device_us = getattr(e, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(e, "self_cuda_time_total", 0)
        on_gpu = str(getattr(e, "device_type", "")).endswith("CUDA")  # kernels and memcpys themselves
        rows.append({"name": e.key, "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
                     "self_device_ms": device_us / 1e3, "on_gpu": on_gpu})
    rows.sort(key=lambda r: r["self_cpu_ms"], reverse=True)
    gpu_busy_ms = sum(r["self_device_ms"] for r in rows if r["on_gpu"])  # CPU ops' device time repeats these
    api = {r["name"]: r for r in rows if not r["on_gpu"] and r["name"].startswith(("cuda", "cu"))}
    top_gpu = sorted((r for r in rows if r["on_gpu"]), key=lambda r: r["self_device_ms"], reverse=True)[:15]
    return {"wall_s": run["wall_s"], "num_requests": len(sentences),
            "gpu_kernel_time_ms": gpu_busy_ms, "gpu_busy_share": gpu_busy_ms / 1e3 / run["wall_s"],
            "cuda_api": api, "top_self_cpu": [r for r in rows if not r["on_gpu"]][:30], "top_gpu": top_gpu}


def sentences_for(args, n: int, seed: int) -> list[list[int]]:
    """WMT-like lengths, or all of --fixed-length (long chains amortize the per-request work)."""
    if not args.fixed_length:
        return wmt_sentences(n, args.vocab, seed=seed)
    rng = np.random.default_rng(seed)
    return rng.integers(3, args.vocab, size=(n, args.fixed_length)).tolist()


def engine_throughput(model, args, device, graphs: bool) -> dict:
    engine = Engine([model], EngineConfig(devices=(str(device),), max_requests=1 << 20, cuda_graphs=graphs)).start()
    try:
        warm = sentences_for(args, args.warmup, seed=args.seed + 1)
        run_requests(engine, warm)
        timers = instrument(engine)
        sentences = sentences_for(args, args.requests, seed=args.seed)
        before = engine.stats()
        timers.reset()
        run = run_requests(engine, sentences)
        after = engine.stats()
        tokens = sum(len(s) for s in sentences)
        hist = batch_histogram(before, after)
        num_tasks = sum(hist.values())
        out = {
            "num_requests": len(sentences), "num_tokens": tokens, "wall_s": run["wall_s"],
            "submit_s": run["submit_s"], "cell_steps_per_s": tokens / run["wall_s"],
            "requests_per_s": len(sentences) / run["wall_s"], "latency_ms_all_at_once": run["latency_ms"],
            "num_tasks": num_tasks, "mean_batch": tokens / num_tasks, "batch_histogram": hist,
            "num_gathers_skipped": after["num_gathers_skipped"] - before["num_gathers_skipped"],
            "time_in_stages": timers.report(run["wall_s"]),
            "max_abs_diff_vs_unbatched_8_requests": check_against_unbatched(
                model, device, sentences[:8], run["results"][:8]),
        }
        rounds = getattr(engine.workers[0], "rounds", None)
        out["num_fused_rounds"] = rounds.num_rounds if rounds is not None else 0
        print(f"engine (graphs {'on' if graphs else 'off'}, {out['num_fused_rounds']} fused rounds): {tokens} tokens in {run['wall_s']:.2f} s = {out['cell_steps_per_s']:.3g} cell-steps/s, "
              f"{num_tasks} tasks, mean batch {out['mean_batch']:.1f}", flush=True)
        for key, t in out["time_in_stages"].items():
            print(f"  {key:45s} {t['total_ms']:9.1f} ms  {t['share_of_wall']:6.1%}  {t['calls']:7d} calls  "
                  f"{t['us_per_call']:8.1f} µs/call")
        if args.profile_requests:
            try:
                out["profiled_run"] = p = profile_run(engine, sentences[:args.profile_requests], device)
            except Exception as e:
                out["profiled_run"] = {"error": f"{type(e).__name__}: {e}"}
                print("profiled run failed:", out["profiled_run"]["error"])
                return out
            print(f"profiled run ({args.profile_requests} requests): GPU kernels busy {p['gpu_busy_share']:.1%} of "
                  f"{p['wall_s']:.2f} s; CUDA API: " + ", ".join(f"{k} x{v['calls']} {v['self_cpu_ms']:.0f} ms"
                                                             for k, v in list(p["cuda_api"].items())[:6]))
        assert engine.stats()["num_tasks_in_flight"] == [0]
        return out
    finally:
        engine.stop()


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--embed", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=30000)
    parser.add_argument("--dtype", default="fp16")
    parser.add_argument("--max-batch", type=int, default=512)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--warmup", type=int, default=512)
    parser.add_argument("--profile-requests", type=int, default=500)
    parser.add_argument("--graph-steps", type=int, default=16)
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--eager-iters", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fixed-length", type=int, default=0,
                        help="every request this many tokens instead of WMT-like lengths (0: WMT-like)")
    parser.add_argument("--tag", default="", help="appended to the result name")
    parser.add_argument("--graphs", choices=("both", "on", "off"), default="both",
                        help="EngineConfig.cuda_graphs for the engine run(s); both: on, then off, in one run")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_engine.py: no CUDA device here (try --device cpu with small sizes)", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # one numeric policy
    dtype = as_dtype(args.dtype)
    model = build_model("lstm", hidden=args.hidden, embed=args.embed, vocab=args.vocab, seed=args.seed,
                        dtype=dtype, max_batch=args.max_batch)
    settings = {**vars(args), "dtype": str(dtype), "tf32": False}
    limits = cell_limits(model, args, device)
    name = "gpu_engine" + args.tag
    write_results(name, str(device), {"settings": settings, "cell_limits": limits, "engine": "not run yet"})
    runs = {}
    for graphs in {"both": (True, False), "on": (True,), "off": (False,)}[args.graphs]:
        key = "graphs_on" if graphs else "graphs_off"
        try:
            runs[key] = engine_throughput(model, args, device, graphs)
        except Exception as e:  # keep what was already measured
            runs[key] = {"error": f"{type(e).__name__}: {e}"}
            write_results(name, str(device), {"settings": settings, "cell_limits": limits, "engine": runs})
            raise
    engine = runs[next(iter(runs))]  # the first configuration run (graphs on, unless --graphs off)
    mode = "graph" if device.type == "cuda" else "eager"
    limit = limits["lstmcell"][mode]["cell_steps_per_s"]
    payload = {
        "settings": settings,
        "cell_limits": limits,
        "engine": engine,
        "engine_runs": runs,
        "ratios": {
            "engine_over_lstmcell": engine["cell_steps_per_s"] / limit,
            "engine_over_cell_with_embedding":
                engine["cell_steps_per_s"] / limits["cell_with_embedding"][mode]["cell_steps_per_s"],
            "engine_over_eager_gather_scatter":
                engine["cell_steps_per_s"] / limits["cell_with_gather_scatter"]["eager"]["cell_steps_per_s"],
            **{f"{key}_over_lstmcell": run["cell_steps_per_s"] / limit for key, run in runs.items()},
        },
        "limit_mode": mode,
    }
    print("ratios:", {k: round(v, 3) for k, v in payload["ratios"].items()})
    path = write_results(name, str(device), payload, plot=lambda fig: _plot(fig, limits, engine, mode))
    print(f"wrote {path}")
    return 0


def _plot(fig, limits: dict, engine: dict, mode: str) -> None:
    left, right = fig.subplots(1, 2)
    bars = {f"{name}\n{m}": e["cell_steps_per_s"] for name, entry in limits.items() for m, e in entry.items()}
    bars["engine\n(WMT-like)"] = engine["cell_steps_per_s"]
    left.barh(range(len(bars)), list(bars.values()), color=["C0"] * (len(bars) - 1) + ["C3"])
    left.set_yticks(range(len(bars)), [k.replace("_", " ") for k in bars], fontsize=7)
    left.set_xscale("log")
    left.set_xlabel("cell-steps/s")
    left.set_title(f"engine / LSTMCell {mode} = {engine['cell_steps_per_s'] / limits['lstmcell'][mode]['cell_steps_per_s']:.3f}",
                   fontsize=9)
    hist = engine["batch_histogram"]
    right.bar(list(hist), list(hist.values()), width=4)
    right.set_xlabel("task batch size (rows)")
    right.set_ylabel("tasks")
    right.set_title(f"mean batch {engine['mean_batch']:.1f}, {engine['num_tasks']} tasks", fontsize=9)


if __name__ == "__main__":
    sys.exit(main())
