"""The one CUDA-graph capture helper that every runner of a worker uses (thesis §2.6: materialize
each cell per supported batch size at start-up, reuse it for every step).

A *body* is a function that launches a task's work reading only static buffers (index buffers
the runner fills with one copy before each run) and returns its static outputs. `run(key, body,
pools)` runs it eagerly the first time (its warm-up: Triton compiles, lazy modules load),
captures it when it comes again (`capture_after`), and replays it from then on: a shape that
comes once costs no capture (as torch.compile's CUDA-graph trees warm up before recording). A
graph bakes in the addresses of the pools it touches: when one moved (it grew), the body runs
eagerly once more and is captured again. A body that cannot be captured (a host sync inside,
say) runs eagerly from then on, with one warning; but a `strict` one (a rank of a decoder split
over processes) raises GraphCaptureError: the ranks capture the same graphs so that their captured
collectives pair up, and one rank running eagerly where the others replay would leave them waiting
in collectives nothing pairs with. Graphs share one memory pool (they never run concurrently: one
stream) and are captured on a side stream.

A new shape's capture does not wait for the device: its eager run is queued on the worker's
stream, and the host records the graph while the GPU executes that run (a capture launches
nothing), so the GPU idles only for what the capture takes beyond the work queued ahead of it.
A re-capture does wait: the graph it replaces may still be replaying.
"""
import contextlib
import logging
import time
from collections.abc import Callable, Hashable

import torch

log = logging.getLogger("batchmaker")


class GraphCaptureError(RuntimeError):
    """A strict body (a rank of a split decoder) could not be captured."""


CAPTURE_AFTER = 2  # a body is captured at its run number `capture_after` (eager before): a Llama-2-7B
# iteration's capture takes the host ~20 ms, ~25 ms of GPU time each at 24 requests/s (H200, bench/chat.py;
# about half of those shapes came once in the run)


class Graphs:
    def __init__(self, device: torch.device, enabled: bool = True, capture_after: int = CAPTURE_AFTER):
        self.device = device
        self.enabled = enabled and device.type == "cuda"
        self.capture_after = capture_after
        self.num_captures = 0  # re-captures after a pool moved included
        self.num_replays = 0
        self.capture_s = 0.0  # wall time spent capturing (device syncs and warm-up runs included)
        self._graphs: dict[Hashable, tuple] = {}  # key -> (graph, static outputs, pool addresses)
        self._eager: set[Hashable] = set()  # cell types (key[1]) whose bodies cannot be captured
        self._runs: dict[Hashable, int] = {}  # key -> eager runs so far, until it is captured
        self._pool = None
        self._stream: torch.cuda.Stream | None = None
        self._tainted = False  # a failed capture did not leave capture mode: its pool is not reused

    def run(self, key: Hashable, body: Callable[[], object], pools: list, strict: bool = False) -> object:
        """The body's outputs: a replay (static outputs, valid until the next replay of `key`),
        or an eager run (this one's work; once captured, the graph serves the next runs)."""
        if not self.enabled or key[1] in self._eager:
            return body()
        entry = self._graphs.get(key)
        if entry is not None and entry[2] == _addresses(pools):
            entry[0].replay()
            self.num_replays += 1
            return entry[1]
        out = body()
        runs = self._runs[key] = self._runs.get(key, 0) + 1
        if entry is not None or runs >= self.capture_after:  # (a graph whose pools moved: again at once)
            self.capture(key, body, pools, strict=strict)
        return out

    def capture(self, key: Hashable, body: Callable[[], object], pools: list, warm: bool = False,
                strict: bool = False) -> bool:
        """(Re-)capture `body` on the pools as they are now; with `warm`, run it once first (at
        start-up: with every lane padding, it writes only scratch rows). False if it cannot be
        (`strict`: raises GraphCaptureError instead)."""
        if not self.enabled or key[1] in self._eager:
            return False
        start = time.perf_counter()
        if key in self._graphs or warm:
            # the graph dropped below may still be replaying; a warm-up run on the side stream
            # reads buffers the worker's stream filled
            torch.cuda.synchronize(self.device)
            self._graphs.pop(key, None)  # its memory returns to the shared pool
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(self.device)
        try:
            try:
                graph, static = self._record(body, warm)
            except torch.OutOfMemoryError:
                # the blocks eager runs left cached outside the graphs' pool may be what it lacks:
                # back to the device with them, and once more (on the same pool where its capture
                # ended cleanly: graphs in several pools cannot share their memory)
                if self._tainted:
                    self._stream, self._pool = torch.cuda.Stream(self.device), torch.cuda.graph_pool_handle()
                    self._tainted = False
                torch.cuda.synchronize(self.device)
                torch.cuda.empty_cache()
                graph, static = self._record(body, warm)
        except Exception as e:
            if strict:
                self._stream, self._pool = torch.cuda.Stream(self.device), torch.cuda.graph_pool_handle()
                raise GraphCaptureError(f"{key[1]}: a rank of a split decoder could not capture its CUDA graph "
                                        f"{key[2:]} ({type(e).__name__}: {e})") from e
            log.warning("%s: not captured as a CUDA graph, running eagerly from now on (%s: %s)", key[1],
                        type(e).__name__, e)
            self._eager.add(key[1])  # the cell type: its other keys would fail alike
            # the failed capture's stream and memory pool are left behind (the allocator may still
            # be recording into that pool): later captures take new ones
            self._stream, self._pool = torch.cuda.Stream(self.device), torch.cuda.graph_pool_handle()
            return False
        self._graphs[key] = (graph, static, _addresses(pools))
        self._runs.pop(key, None)
        self.num_captures += 1
        self.capture_s += time.perf_counter() - start
        return True

    def _record(self, body: Callable[[], object], warm: bool) -> tuple:
        """A graph of `body` on the side stream and the shared pool, and its static outputs."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self._stream):
            if warm:
                body()
                torch.cuda.current_stream().synchronize()
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                static = body()
            except Exception:
                self._tainted = True  # (until capture mode is left: the allocator may still record into the pool)
                with contextlib.suppress(Exception):
                    graph.capture_end()  # leave capture mode; the capture itself has failed
                    self._tainted = False
                raise
            graph.capture_end()
        return graph, static

    def drop(self) -> None:
        """Destroy every graph (the device must be done with them): a communicator whose collectives
        a graph captured is freed only after that graph (exec/tensor_group.py)."""
        if self._graphs:
            torch.cuda.synchronize(self.device)
        self._graphs.clear()
        self._runs.clear()

    def graph(self, key: Hashable) -> "torch.cuda.CUDAGraph | None":
        """The captured graph of `key`, if any (benchmarks replay it by itself)."""
        entry = self._graphs.get(key)
        return entry[0] if entry is not None else None


def _addresses(pools: list) -> tuple:
    return tuple((p.tensor.data_ptr(), p.tensor.shape[0]) for p in pools)
