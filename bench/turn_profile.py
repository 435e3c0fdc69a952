"""Where one call's wall time goes on a CUDA device: torch.profiler around it, reduced to a few
numbers (the whole trace would not fit a benchmark's JSON).

  wall_ms          the call, host clock
  gpu_busy_ms      the union of every kernel and copy interval on the device
  kernel_ms, kernels, copy_ms, copies, copy_bytes
  gpu_first_ms     from the call's start to the device's first work; gpu_last_ms: to its last end
  idle_gaps        device gaps over 50 us between its first and last work: count and ms
  launch_ms        host time inside cudaLaunchKernel / cuLaunchKernel(Ex) / memcpy-async calls
  ranges_ms        each labelled range's durations (torch.profiler.record_function), ms
  top_host_ops     the host ops, labelled ranges and runtime calls of most total time (inclusive:
                   a range counts its children too), ms

  kernels_by_name  (kernels=True) the device's kernels grouped by name: count, total ms, mean us

Used by bench/chat_stateful.py (`--tier-profile`): one turn per tier, after the timed ones; and by
bench/chat.py (`--profile-seconds`, `profile_window`): the first seconds of a saturated run.
"""
import gzip
import json
import os
import tempfile
import time

_LAUNCH = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaMemcpyAsync",
           "cuMemcpyHtoDAsync_v2", "cuMemcpy2DAsync_v2", "cudaGraphLaunch")


def profiled(fn, trace_path: str | None = None, kernels: bool = False):
    """(fn(), summary dict) with fn run under torch.profiler (CPU and CUDA activity); the whole
    trace also gzipped to `trace_path` if given (chrome://tracing, Perfetto)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        start_ns = time.perf_counter_ns()
        result = fn()
        wall = (time.perf_counter_ns() - start_ns) / 1e6
        sync()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            text = f.read()
        events = json.loads(text)["traceEvents"]
        if trace_path is not None:
            with gzip.open(trace_path, "wt") as f:
                f.write(text)
    finally:
        os.unlink(path)
    summary = summarize(events, wall)
    if kernels:
        summary["kernels_by_name"] = kernel_table(events)
    return result, summary


def kernel_table(events: list, top: int = 30) -> list[dict]:
    """The device's kernels grouped by name, most total time first: name (cut to 90 characters),
    count, total ms, mean us."""
    total: dict[str, list] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "kernel":
            entry = total.setdefault(e["name"][:90], [0, 0.0])
            entry[0] += 1
            entry[1] += e["dur"]
    rows = sorted(total.items(), key=lambda kv: -kv[1][1])[:top]
    return [{"name": name, "count": n, "total_ms": round(us / 1e3, 3), "mean_us": round(us / n, 2)}
            for name, (n, us) in rows]


def summarize(events: list, wall_ms: float, gap_us: float = 50.0) -> dict:
    """The numbers above from a chrome trace's complete events (ts and dur in microseconds)."""
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    if not complete:
        return {"wall_ms": wall_ms}
    host = ("cpu_op", "user_annotation", "python_function", "cuda_runtime", "cuda_driver")
    host_start = min((e["ts"] for e in complete if e.get("cat") in host), default=min(e["ts"] for e in complete))
    device = sorted((e for e in complete if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                    key=lambda e: e["ts"])
    busy, gaps, end = 0.0, [], None
    for e in device:
        s, t = e["ts"], e["ts"] + e["dur"]
        if end is None or s > end:
            if end is not None and s - end > gap_us:
                gaps.append(s - end)
            busy += e["dur"]
            end = t
        elif t > end:
            busy += t - end
            end = t
    kernels = [e for e in device if e["cat"] == "kernel"]
    copies = [e for e in device if e["cat"] == "gpu_memcpy"]
    launch = sum(e["dur"] for e in complete if e.get("name") in _LAUNCH)
    total: dict[str, float] = {}
    for e in complete:
        if e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver"):
            total[e["name"]] = total.get(e["name"], 0.0) + e["dur"]
    top = sorted(total.items(), key=lambda kv: -kv[1])[:20]
    ranges: dict[str, list] = {}
    for e in sorted(complete, key=lambda e: e["ts"]):
        if e.get("cat") == "user_annotation":
            ranges.setdefault(e["name"], []).append(round(e["dur"] / 1e3, 3))
    return {
        "wall_ms": wall_ms,
        "gpu_busy_ms": busy / 1e3,
        "kernel_ms": sum(e["dur"] for e in kernels) / 1e3, "kernels": len(kernels),
        "copy_ms": sum(e["dur"] for e in copies) / 1e3, "copies": len(copies),
        "copy_bytes": int(sum(e.get("args", {}).get("bytes", 0) for e in copies)),
        "gpu_first_ms": (device[0]["ts"] - host_start) / 1e3 if device else None,
        "gpu_last_ms": (max(e["ts"] + e["dur"] for e in device) - host_start) / 1e3 if device else None,
        "idle_gaps": {"count": len(gaps), "ms": sum(gaps) / 1e3, "largest_ms": max(gaps, default=0.0) / 1e3},
        "launch_ms": launch / 1e3,
        "ranges_ms": {name: durations[:40] for name, durations in ranges.items()},
        "top_host_ops": {name: round(us / 1e3, 3) for name, us in top},
    }


def profile_window(engine, work, prompts, seconds: float) -> dict:
    """bench/chat.py's requests (`work`: (prompt, output) lengths, `prompts`: token ids) all at
    once to a llama engine, the first `seconds` under the profiler: the device's kernels by name
    and the iterations the window held (graphed, eager)."""
    runner = next(iter(engine.workers[0].iterations.values()))
    runner.trace, futures = [], []

    def window() -> int:
        for (_, o), prompt in zip(work, prompts):
            futures.append(engine.submit("llama", {"tokens": prompt, "max_new_tokens": o, "ignore_eos": True}))
        time.sleep(seconds)
        return len(runner.trace)

    held, summary = profiled(window, kernels=True)
    for f in futures:  # (the rest of the run is not measured: cancelled)
        engine.cancel(f.request_id)
    for f in futures:
        try:
            f.result(600)
        except Exception:  # (cancelled)
            pass
    trace, runner.trace = runner.trace[:held], None
    for graphed, name in ((True, "graphed"), (False, "eager")):
        part = [r for r in trace if r.graphed == graphed]
        summary[f"{name}_iterations"] = {"count": len(part), "tokens": sum(r.tokens for r in part),
                                         "seconds": sum(r.seconds or 0.0 for r in part)}
    return {k: v for k, v in summary.items() if k not in ("ranges_ms",)}
