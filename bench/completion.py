"""How soon, and how cheaply, the host learns that a GPU task finished (thesis §2.5).

    python bench/completion.py [--trials 300] [--sleep-us 50] [--polls 1000000]

Methods: the signal counter (a kernel increments an int64 in pinned host memory; the host reads
it), torch.cuda.Event.query() polling, Event.synchronize() (default and blocking-sync events),
and a host function enqueued with cuLaunchHostFunc / cudaLaunchHostFunc through ctypes.

Detection latency, measured two ways (both written into the JSON under "method"):
- release: a one-thread kernel spins on a flag in pinned host memory; the method's completion
  marker is enqueued behind it. Once the kernel is seen spinning, the host stamps t0 and sets the
  flag; the task "completes" when the GPU sees the flag. Latency = (detection - t0) - d1, where
  d1, the host-store-to-GPU-load delay, is estimated as half the round trip of the same kernel
  acknowledging the flag through host memory (ping-pong). Launch cost is excluded: everything is
  enqueued before t0. Needs CuPy (to compile the spin kernel); skipped with the reason if absent.
- launch: stamp the host clock, enqueue torch.cuda._sleep (~sleep_us, bracketed by events) and
  the marker, wait; latency <= (detection - launch stamp) - the sleep's event-measured duration.
  An upper bound: it also holds the launch latency of the sleep kernel and of the marker.
Poll cost: N reads in a tight Python loop divided by N (the loop's own cost reported beside).
"""
import argparse
import ctypes
import glob
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402

from batchmaker.kernels.signal import SignalCounter  # noqa: E402

TARGET_DETECTION_US = 5.0
TARGET_POLL_US = 0.2
SPIN_TIMEOUT_S = 1.0
ns = time.perf_counter_ns


# completion markers: arm() enqueues on the current stream, wait() returns once it has run -------

class CounterMethod:
    name = "signal_counter"

    def __init__(self, device):
        self.counter = SignalCounter(device)
        self.expected = 0

    def arm(self):
        self.expected += 1
        self.counter.signal()

    def wait(self):
        deadline = ns() + SPIN_TIMEOUT_S * 1e9
        while self.counter.read() < self.expected:
            if ns() > deadline:
                raise TimeoutError("signal counter never advanced")


class EventQueryMethod:
    name = "event_query"

    def arm(self):
        self.event = torch.cuda.Event()
        self.event.record()

    def wait(self):
        while not self.event.query():
            pass


class EventSyncMethod:
    def __init__(self, blocking: bool):
        self.blocking = blocking
        self.name = "event_synchronize_blocking" if blocking else "event_synchronize"

    def arm(self):
        self.event = torch.cuda.Event(blocking=self.blocking)
        self.event.record()

    def wait(self):
        self.event.synchronize()


class HostFuncMethod:
    """cuLaunchHostFunc: the driver runs a Python callback on its own thread after earlier work."""

    name = "host_func"

    def __init__(self, launch):
        self.launch = launch  # launch(stream_handle, fn, user_data) -> error code
        self.done = threading.Event()
        self.callback_ns = 0
        self._fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(self._callback)  # kept alive here

    def _callback(self, _):
        self.callback_ns = ns()
        self.done.set()

    def arm(self):
        self.done.clear()
        err = self.launch(ctypes.c_void_p(torch.cuda.current_stream().cuda_stream), self._fn, None)
        if err != 0:
            raise RuntimeError(f"LaunchHostFunc returned error {err}")

    def wait(self):
        if not self.done.wait(SPIN_TIMEOUT_S):
            raise TimeoutError("host function never ran")


def find_launch_host_func():
    """(launch function, where it came from), or (None, why not)."""
    candidates = []
    for line in open("/proc/self/maps"):
        if "libcudart.so" in line:
            candidates.append((line.split()[-1], "cudaLaunchHostFunc"))
    candidates += [(p, "cudaLaunchHostFunc") for p in glob.glob(os.path.join(
        os.path.dirname(torch.__file__), "..", "nvidia", "*", "lib", "libcudart.so*"))]
    candidates += [("libcudart.so", "cudaLaunchHostFunc"), ("libcuda.so.1", "cuLaunchHostFunc")]
    errors = []
    for path, symbol in candidates:
        try:
            fn = getattr(ctypes.CDLL(path), symbol)
        except (OSError, AttributeError) as e:
            errors.append(f"{path}: {e}")
            continue
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        return fn, f"{symbol} from {path}"
    return None, "; ".join(errors)


# the spin kernel for the release measurement -------------------------------------------------

SPIN_SRC = r"""
extern "C" __global__ void spin_until_released(volatile long long* flag, volatile long long* ack,
                                               long long max_iters) {
    ack[0] = 1;  // "spinning": lets the host know the kernel started
    __threadfence_system();
    long long i = 0;
    while (flag[0] == 0 && i < max_iters) { ++i; }
    ack[1] = i + 1;  // "released" (ping-pong); > max_iters means it timed out
    __threadfence_system();
}
"""


class SpinKernel:
    """One thread spinning on a pinned host word, launched on torch's current stream via CuPy."""

    MAX_ITERS = 2_000_000  # each load crosses PCIe (~1 µs): gives up after ~2 s instead of hanging

    def __init__(self):
        import cupy
        self.cupy = cupy
        self.kernel = cupy.RawKernel(SPIN_SRC, "spin_until_released")
        self.flag = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        self.ack = torch.zeros(2, dtype=torch.int64, pin_memory=True)
        self.flag_np, self.ack_np = self.flag.numpy(), self.ack.numpy()

    def launch(self):
        self.flag_np[0] = 0
        self.ack_np[:] = 0
        with self.cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            self.kernel((1,), (1,), (np.uint64(self.flag.data_ptr()), np.uint64(self.ack.data_ptr()),
                                     np.int64(self.MAX_ITERS)))

    def wait_spinning(self):
        deadline = ns() + SPIN_TIMEOUT_S * 1e9
        while self.ack_np[0] == 0:
            if ns() > deadline:
                raise TimeoutError("spin kernel never started")

    def release(self) -> int:
        t0 = ns()
        self.flag_np[0] = 1
        return t0


# measurements ------------------------------------------------------------------------------

def summary_us(samples_ns) -> dict:
    us = np.asarray(samples_ns, dtype=np.float64) / 1e3
    return {"median": float(np.median(us)), "mean": float(us.mean()), "p10": float(np.percentile(us, 10)),
            "p90": float(np.percentile(us, 90)), "p99": float(np.percentile(us, 99)), "n": int(us.size)}


def measure_ping_pong(spin: SpinKernel, stream, trials: int) -> list[int]:
    """Host sets the flag -> GPU sees it, writes ack -> host sees the ack: the round trip."""
    samples = []
    for _ in range(trials):
        with torch.cuda.stream(stream):
            spin.launch()
        spin.wait_spinning()
        t0 = spin.release()
        deadline = t0 + SPIN_TIMEOUT_S * 1e9
        while spin.ack_np[1] == 0:
            if ns() > deadline:
                raise TimeoutError("no ack from the spin kernel")
        samples.append(ns() - t0)
        stream.synchronize()
    return samples


def measure_release(method, spin: SpinKernel, stream, trials: int, one_way_ns: float) -> dict:
    samples, callback = [], []
    for _ in range(trials):
        with torch.cuda.stream(stream):
            spin.launch()
            method.arm()
        spin.wait_spinning()
        t0 = spin.release()
        method.wait()
        samples.append(ns() - t0 - one_way_ns)
        if isinstance(method, HostFuncMethod):
            callback.append(method.callback_ns - t0 - one_way_ns)
        stream.synchronize()
        assert spin.ack_np[1] <= SpinKernel.MAX_ITERS, "spin kernel timed out instead of being released"
    out = {"detection_us": summary_us(samples)}
    if callback:
        out["callback_ran_us"] = summary_us(callback)
    return out


def measure_launch(method, stream, trials: int, sleep_cycles: int) -> dict:
    samples, gpu = [], []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = ns()
        with torch.cuda.stream(stream):
            start.record()
            torch.cuda._sleep(sleep_cycles)
            end.record()
            method.arm()
        method.wait()
        t1 = ns()
        stream.synchronize()
        gpu_ns = start.elapsed_time(end) * 1e6
        samples.append(t1 - t0 - gpu_ns)
        gpu.append(gpu_ns)
    return {"detection_upper_bound_us": summary_us(samples), "sleep_gpu_us": summary_us(gpu)}


def per_call_ns(fn, n: int) -> float:
    t0 = ns()
    for _ in range(n):
        fn()
    return (ns() - t0) / n


def measure_poll_costs(device, stream, n: int, cycles_per_us: float) -> dict:
    counter = SignalCounter(device)
    view = counter._view  # the raw pinned word, to separate the method call from the load
    done = torch.cuda.Event()
    done.record(stream)
    stream.synchronize()
    out = {
        "empty_loop_ns": per_call_ns(lambda: None, n),
        "signal_counter_read_ns": per_call_ns(counter.read, n),
        "pinned_word_load_ns": per_call_ns(lambda: view[0], n),
        "event_query_completed_ns": per_call_ns(done.query, n),
    }
    # a pending event: poll while a long sleep runs (n / 10 polls of ~1 µs fit easily in 0.5 s)
    pending = torch.cuda.Event()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(int(5e5 * cycles_per_us))
        pending.record()
    out["event_query_pending_ns"] = per_call_ns(pending.query, n // 10)
    out["event_query_pending_was_pending"] = not pending.query()
    stream.synchronize()
    return out


def calibrate_sleep(stream) -> float:
    """GPU clock cycles per µs, as torch.cuda._sleep counts them."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        with torch.cuda.stream(stream):
            start.record()
            torch.cuda._sleep(10_000_000)
            end.record()
        stream.synchronize()
    return 10_000_000 / (start.elapsed_time(end) * 1e3)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=300)
    parser.add_argument("--sleep-us", type=float, default=50.0)
    parser.add_argument("--polls", type=int, default=1_000_000)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("completion.py: no CUDA device here; nothing to measure", file=sys.stderr)
        return 2
    device = torch.device("cuda:0")
    torch.cuda.init()
    stream = torch.cuda.Stream(device)
    cycles_per_us = calibrate_sleep(stream)
    sleep_cycles = int(args.sleep_us * cycles_per_us)

    methods = [CounterMethod(device), EventQueryMethod(), EventSyncMethod(False), EventSyncMethod(True)]
    launch_fn, host_func_source = find_launch_host_func()
    if launch_fn is not None:
        methods.append(HostFuncMethod(launch_fn))
    try:
        spin = SpinKernel()
        with torch.cuda.stream(stream):
            spin.launch()
        spin.wait_spinning()
        spin.release()
        stream.synchronize()
        if not 0 < spin.ack_np[1] <= SpinKernel.MAX_ITERS:
            raise RuntimeError(f"the spin kernel did not see the host's flag (ack {spin.ack_np[1]})")
        spin_error = None
    except Exception as e:  # no CuPy, or NVRTC missing: the launch-based bound still runs
        spin, spin_error = None, f"{type(e).__name__}: {e}"
        torch.cuda.synchronize()  # a spin kernel that never saw the flag gives up within ~2 s

    results: dict = {}
    ping = None
    if spin is not None:
        measure_ping_pong(spin, stream, 20)  # warm-up
        ping = summary_us(measure_ping_pong(spin, stream, args.trials))
    one_way_ns = ping["median"] * 1e3 / 2 if ping else 0.0
    for method in methods:
        try:
            measure_launch(method, stream, 20, sleep_cycles)  # warm-up
            entry = {"launch": measure_launch(method, stream, args.trials, sleep_cycles)}
            if spin is not None:
                measure_release(method, spin, stream, 20, one_way_ns)
                entry["release"] = measure_release(method, spin, stream, args.trials, one_way_ns)
        except Exception as e:
            entry = {"error": f"{type(e).__name__}: {e}"}
            torch.cuda.synchronize()
        results[method.name] = entry
        print(f"{method.name:28s} {_headline(entry)}", flush=True)

    polls = measure_poll_costs(device, stream, args.polls, cycles_per_us)
    print("poll cost (ns/call):", {k: round(v, 1) if isinstance(v, float) else v for k, v in polls.items()})
    counter = results.get("signal_counter", {})
    detection = (counter.get("release") or {}).get("detection_us", {}).get("median")
    payload = {
        "method": __doc__,
        "settings": {"trials": args.trials, "sleep_us": args.sleep_us, "polls": args.polls,
                     "gpu_cycles_per_us": cycles_per_us},
        "ping_pong_round_trip_us": ping,
        "one_way_estimate_us": one_way_ns / 1e3,
        "release_method": "ok" if spin is not None else f"not run: {spin_error}",
        "host_func": host_func_source if launch_fn is not None else f"not reachable: {host_func_source}",
        "results": results,
        "poll_cost_ns": polls,
        "targets": {"detection_us": TARGET_DETECTION_US, "poll_us": TARGET_POLL_US},
        "signal_counter_meets_targets": {
            "detection": None if detection is None else detection <= TARGET_DETECTION_US,
            "poll": polls["signal_counter_read_ns"] / 1e3 <= TARGET_POLL_US,
        },
    }
    path = write_results("completion", "cuda:0", payload, plot=lambda fig: _plot(fig, results, polls))
    print(f"wrote {path}")
    return 0


def _headline(entry: dict) -> str:
    if "error" in entry:
        return entry["error"]
    parts = [f"launch-bound median {entry['launch']['detection_upper_bound_us']['median']:.2f} µs"]
    if "release" in entry:
        parts.append(f"release median {entry['release']['detection_us']['median']:.2f} µs "
                     f"(p90 {entry['release']['detection_us']['p90']:.2f})")
    return ", ".join(parts)


def _plot(fig, results: dict, polls: dict) -> None:
    left, right = fig.subplots(1, 2)
    names = [n for n, e in results.items() if "error" not in e]
    for offset, key, label in ((-0.2, "release", "after GPU completion"), (0.2, "launch", "upper bound, incl. launch")):
        meds, lo, hi = [], [], []
        for n in names:
            s = results[n].get(key, {})
            s = s.get("detection_us") or s.get("detection_upper_bound_us")
            meds.append(s["median"] if s else np.nan)
            lo.append(s["median"] - s["p10"] if s else 0)
            hi.append(s["p90"] - s["median"] if s else 0)
        left.bar(np.arange(len(names)) + offset, meds, 0.4, yerr=[lo, hi], label=label, capsize=3)
    left.axhline(TARGET_DETECTION_US, color="k", ls="--", lw=1, label="target 5 µs")
    left.set_xticks(range(len(names)), [n.replace("_", "\n") for n in names], fontsize=7)
    left.set_ylabel("detection latency (µs, median, p10-p90)")
    left.set_yscale("log")
    left.legend(fontsize=7)
    keys = ["pinned_word_load_ns", "signal_counter_read_ns", "event_query_completed_ns", "event_query_pending_ns"]
    right.bar(range(len(keys)), [polls[k] / 1e3 for k in keys])
    right.axhline(TARGET_POLL_US, color="k", ls="--", lw=1, label="target 0.2 µs")
    right.set_xticks(range(len(keys)), [k.removesuffix("_ns").replace("_", "\n") for k in keys], fontsize=7)
    right.set_ylabel("host cost per poll (µs)")
    right.legend(fontsize=7)


if __name__ == "__main__":
    sys.exit(main())
