"""Shared by the benchmark scripts: where results go and how they are written, and a count of the
Triton compiles a run paid for.

Every run writes bench/results/<name>-<device>-<date>.json (numbers, the exact command, the device,
the numeric policy) and, when given a plot function, the matching .png.
"""
import datetime
import functools
import importlib.util
import json
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def captured(call, calls: int) -> "torch.cuda.CUDAGraph":
    """A CUDA graph of `calls` back-to-back calls of `call` (run once first: compiles, allocations)."""
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            call()
    return graph


def replay_windows(graph: "torch.cuda.CUDAGraph", calls_per_graph: int, replays: int, warm: int = 5) -> list[float]:
    """µs per call (graph time / calls_per_graph) in five timed windows of `replays` back-to-back
    replays, after `warm` untimed ones; callers take the median."""
    for _ in range(warm):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(5):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / (replays * calls_per_graph))
    return samples


def device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device)).replace(" ", "-")
    return f"cpu-{platform.machine()}"


def write_results(name: str, device: str, payload: dict, plot=None) -> Path:
    """Write JSON (+ PNG through `plot(fig)`) and return the JSON path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = f"{name}-{device_name(device)}-{datetime.date.today().isoformat()}"
    record = {
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "device": device_name(device),
        "torch": torch.__version__,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        **payload,
    }
    path = RESULTS / f"{stem}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    if plot is not None and importlib.util.find_spec("matplotlib") is None:
        print(f"matplotlib missing: wrote {path.name} without its PNG", file=sys.stderr)
    elif plot is not None:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig = plt.figure(figsize=(7, 4.5))
        plot(fig)
        fig.tight_layout()
        fig.savefig(path.with_suffix(".png"), dpi=110)
        plt.close(fig)
    return path


class TritonCompiles:
    """Kernel specializations Triton built in this process since installed, and the wall time it
    took (its disk cache hits included): the runtime's jit cache and post-compile hooks (Triton >=
    3.4). Where there are none, `available` is False and the counts stay 0."""

    def __init__(self):
        self.count, self.seconds, self._start = 0, 0.0, None
        self.kernels: list[str] = []  # what each compile built: the runtime's repr (name, options, argument types)
        try:
            from triton import knobs
            knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._before, self._after
            self.available = True
        except (ImportError, AttributeError):
            self.available = False

    def _before(self, *args, **kwargs) -> bool:
        self._start = time.perf_counter()
        return False  # (true would skip the compile)

    def _after(self, *args, **kwargs) -> None:
        self.count += 1
        # the runtime's repr (name, options, argument types with their :16 alignment marks) and the
        # constexpr values: what tells one variant of a kernel from another
        constants = (kwargs.get("compile") or {}).get("constants")
        self.kernels.append(str(kwargs.get("repr", "?"))[:1500] + ("" if constants is None else f" {constants}"[:600]))
        if self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self._start = None


@functools.cache
def triton_compiles() -> TritonCompiles:
    """The process's one counter, installed on first use."""
    return TritonCompiles()
