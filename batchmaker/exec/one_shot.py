"""The small-message all-reduce of a tensor-parallel group on one host (issue 31): one-shot over
NVLink peer memory (kernels/triton_allreduce.py, exec/peer_memory.py) where it measures faster
than NCCL, NCCL for the rest.

Which messages go which way is measured when the group starts, on the machine at hand: for each
candidate size, 16 all-reduces of each kind captured in one CUDA graph and replayed, each after a
kernel that writes its input (as in a decoder layer, where the projection before it does); the ranks
take the slowest rank's times (one NCCL all-reduce of the table), so every rank makes the same
choice for every message, as the pairing of their collectives requires. A message takes the way
that won at the smallest measured size at or above its own (on four H100s NCCL won at 4 and 16 KB,
one-shot at 64 and 256 KB).
"""
import bisect
import logging

import torch
import torch.distributed as dist

from batchmaker.exec.peer_memory import PeerMemory, one_host

log = logging.getLogger("batchmaker")

HALF_BYTES = 1 << 20  # the largest one-shot message (a batch of 64 rows of 8192 bf16 is 1 MiB)
FLAG_BYTES = 256  # one int64 flag per rank (at most 32 ranks), then the two halves
SIZES = (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20)  # the sizes measured at start-up
CALLS = 16  # all-reduces per measured graph


class OneShot:
    """A group's one-shot all-reduce: `fits(x)` says whether it takes `x`, calling it reduces `x`
    in place over the ranks."""

    def __init__(self, store, rank: int, size: int, device: torch.device):
        from batchmaker.kernels.triton_allreduce import one_shot_all_reduce
        self._reduce, self.rank, self.size, self.device = one_shot_all_reduce, rank, size, device
        self.memory = PeerMemory(store, rank, size, device, FLAG_BYTES + 2 * HALF_BYTES)
        pointers = torch.tensor(self.memory.pointers, dtype=torch.int64)
        self._flags = pointers.to(device)
        self._buffers = (pointers + FLAG_BYTES).to(device)
        self._epoch = torch.zeros(1, dtype=torch.int64, device=device)
        self._stop = torch.zeros(1, dtype=torch.int32, pin_memory=True)  # (`stop`; the kernels read it in place)
        self._stop_at = torch.tensor([self._stop.data_ptr()], dtype=torch.int64, device=device)
        self.wins = (True,) * len(SIZES)  # at each of SIZES: whether one-shot takes it (`choose` measures)
        self.table: dict = {}  # bytes -> (one-shot µs, NCCL µs), as measured by `choose`

    @property
    def max_bytes(self) -> int:
        """The largest measured size one-shot takes (0: none)."""
        return max((n for n, win in zip(SIZES, self.wins) if win), default=0)

    def fits(self, x: torch.Tensor) -> bool:
        at = bisect.bisect_left(SIZES, x.numel() * x.element_size())
        return at < len(SIZES) and self.wins[at] and x.is_contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() * x.element_size() > HALF_BYTES:
            raise ValueError(f"{x.numel() * x.element_size()} bytes: the one-shot all-reduce takes {HALF_BYTES} at most")
        return self._reduce(x, self._buffers, self._flags, self._epoch, self._stop_at,
                            HALF_BYTES // x.element_size(), self.rank, self.size)

    def stop(self) -> None:
        """The group broke: every wait of this rank's all-reduces, running or to come, gives up at
        once (with garbage, which the broken group's iterations never return), so that its stream
        drains and the group's teardown does not wait behind seconds of polls per all-reduce."""
        self._stop[0] = 1

    def check(self, dtype: torch.dtype) -> None:
        """Start-up self-test (compiles the kernels): rank r's r + 1 must sum to the same total on
        every rank. Raises RuntimeError otherwise (the group then uses NCCL: `agree`)."""
        x = torch.full((3 * 1024 + 5,), float(self.rank + 1), dtype=dtype, device=self.device)
        total = self.size * (self.size + 1) // 2
        got = self(x).float()
        if not bool((got == total).all()):
            raise RuntimeError(f"the one-shot all-reduce's self-test summed to {got.unique().tolist()}, not {total}")

    def choose(self, group, dtype: torch.dtype) -> dict:
        """Measure both kinds at each of SIZES; one-shot takes the sizes it won."""
        times = torch.tensor([[_graphed(kind, group, self, n, dtype, self.device) for n in SIZES]
                              for kind in ("one-shot", "nccl")], device=self.device)
        _max_over(group, times)
        self.wins = tuple(a < b for a, b in zip(times[0].tolist(), times[1].tolist()))
        self.table = table = {n: (a, b) for n, a, b in zip(SIZES, times[0].tolist(), times[1].tolist())}
        log.info("all-reduce per message (µs, one-shot vs NCCL): %s; one-shot at %s bytes",
                 {n: (round(a, 1), round(b, 1)) for n, (a, b) in table.items()},
                 [n for n, win in zip(SIZES, self.wins) if win])
        return table

    def close(self) -> None:
        self.memory.close()


def _max_over(group, times: torch.Tensor) -> None:
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MAX
    group.allreduce([times], options).wait()
    torch.cuda.synchronize(times.device)


def _graphed(kind: str, group, one_shot: OneShot, nbytes: int, dtype, device) -> float:
    """µs per all-reduce of `nbytes`, CALLS of them in one replayed CUDA graph."""
    x = torch.zeros(nbytes // dtype.itemsize, dtype=dtype, device=device)
    reduce = one_shot if kind == "one-shot" else (lambda t: group.allreduce([t]).wait())
    stream = torch.cuda.Stream(device)
    with torch.cuda.device(device), torch.cuda.stream(stream):
        reduce(x)  # (a kernel's first launch compiles it; NCCL's first registers the stream)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(CALLS):
                x.mul_(0.5)
                reduce(x)
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for _ in range(5):
            graph.replay()
        end.record(stream)
        end.synchronize()
    return start.elapsed_time(end) * 1000 / (5 * CALLS)


def agree(store, rank: int, size: int, build):
    """`build()` on every rank; its result where it succeeded on every rank, else None everywhere
    (and what was built is closed): a rank whose IPC fails must not leave the others waiting in a
    kernel it never runs."""
    try:
        built, failure = build(), ""
    except Exception as e:  # noqa: BLE001 (any failure, CUDA IPC refused or a kernel that does not compile: NCCL)
        built, failure = None, f"rank {rank}: {type(e).__name__}: {e}"
    store.set(f"peer-failure-{rank}", failure)
    failures = [store.get(f"peer-failure-{r}").decode() for r in range(size)]
    if any(failures):
        log.warning("the one-shot all-reduce is off, NCCL takes every message: %s", "; ".join(f for f in failures if f))
        if built is not None:
            built.close()
        return None
    return built


def join(store, rank: int, size: int, device: torch.device, group, dtype: torch.dtype, enabled: bool = True):
    """This rank's OneShot for `group`, or None where it cannot run (a CPU group, ranks on several
    hosts, more than 32 ranks, not `enabled`: KVSettings.one_shot), fails its self-test on any rank, or never
    wins; every rank of the group gets the same answer."""
    if (device.type != "cuda" or not 2 <= size <= FLAG_BYTES // 8
            or not enabled):
        return None
    store = dist.PrefixStore("batchmaker-one-shot", store)
    if not one_host(store, rank, size):
        return None

    def build():
        built = OneShot(store, rank, size, device)
        try:
            built.check(dtype)
        except BaseException:
            built.close()
            raise
        return built
    one_shot = agree(store, rank, size, build)
    if one_shot is None:
        return None
    one_shot.choose(group, dtype)
    if one_shot.max_bytes == 0:
        one_shot.close()
        return None
    return one_shot
