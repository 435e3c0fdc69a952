"""Where a replayed CUDA graph's time goes, kernel by kernel: its kernels' start and end times under
torch.profiler (CUPTI traces a graph's kernel nodes one by one), each kernel's share of the step the
time from its start to the next kernel's start (under programmatic dependent launch a kernel starts
before its predecessor ends, so durations overlap and do not add up; start-to-start intervals do),
summed by kernel name.

    spans = trace(graph.replay, replays=3)     # [(name, start_ns, end_ns)] of the last replay
    rows = shares(spans)                       # [{"kernel", "count", "share_us", "mean_us", ...}]
    rows = shares(layer_positions(spans, 32))  # the same by place in a layer: gemv_kernel#0 .. #3, #tail
"""
import re
from typing import Callable

Span = tuple[str, int, int]  # (kernel name, start ns, end ns)


def short_name(name: str) -> str:
    """A kernel's name without its template arguments and Triton's specialization suffix."""
    name = re.sub(r"<.*", "", name)
    name = re.sub(r"\(.*", "", name)
    return re.sub(r"(_(\d+[dc])+)+$", "", name)[:60]


def trace(replay: Callable[[], None], replays: int = 3) -> list[Span]:
    """`replay` run `replays` times under torch.profiler; the last run's kernels, by start time."""
    import torch
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            replay()
            torch.cuda.synchronize()
    events = [e for e in prof.profiler.kineto_results.events() if e.device_type() == torch.autograd.DeviceType.CUDA
              and not e.name().startswith(("Memcpy", "Memset"))]
    spans = sorted(((e.name(), e.start_ns(), e.start_ns() + e.duration_ns()) for e in events), key=lambda s: s[1])
    return last_run(spans, replays)


def last_run(spans: list[Span], runs: int) -> list[Span]:
    """The last of `runs` equal runs in `spans` (each run the same kernels in the same order)."""
    if not spans or len(spans) % runs:
        raise ValueError(f"{len(spans)} kernels do not split into {runs} equal runs")
    return spans[-(len(spans) // runs):]


def shares(spans: list[Span]) -> list[dict]:
    """Per kernel name: launches, the sum of start-to-next-start intervals (the last kernel: to its end), the
    mean duration and the mean overlap with the next kernel (its start before this one's end), in µs; the
    names by share, largest first."""
    rows: dict[str, dict] = {}
    for i, (name, start, end) in enumerate(spans):
        following = spans[i + 1][1] if i + 1 < len(spans) else end
        row = rows.setdefault(short_name(name), {"kernel": short_name(name), "count": 0, "share_us": 0.0,
                                                 "busy_us": 0.0, "overlap_us": 0.0})
        row["count"] += 1
        row["share_us"] += (following - start) / 1e3
        row["busy_us"] += (end - start) / 1e3
        row["overlap_us"] += max(0, end - following) / 1e3 if i + 1 < len(spans) else 0.0
    for row in rows.values():
        row["mean_us"] = row["busy_us"] / row["count"]
        row["mean_share_us"] = row["share_us"] / row["count"]
    return sorted(rows.values(), key=lambda r: -r["share_us"])


def layer_positions(spans: list[Span], layers: int) -> list[Span]:
    """Each kernel renamed `name#k`: its launch's place k among its name's launches of one layer, for names
    launched at least once a layer (`#tail`: the launches past layers x per-layer count, such as the LM head's
    GEMV); others keep their names."""
    counts: dict[str, int] = {}
    for name, _, _ in spans:
        counts[short_name(name)] = counts.get(short_name(name), 0) + 1
    seen: dict[str, int] = {}
    out = []
    for name, start, end in spans:
        key = short_name(name)
        i, per = seen.get(key, 0), counts[key] // layers
        seen[key] = i + 1
        label = key if per == 0 else f"{key}#{i % per}" if i < per * layers else f"{key}#tail"
        out.append((label, start, end))
    return out


def timeline(spans: list[Span], first: str, index: int) -> list[tuple[str, float, float]]:
    """The kernels from the index-th launch labelled `first` up to the next one (one layer, with first =
    "gemv_kernel#0" over layer_positions' labels): (label, start, end) in µs from that launch's start."""
    starts = [i for i, (name, _, _) in enumerate(spans) if name == first]
    lo, hi = starts[index], starts[index + 1] if index + 1 < len(starts) else len(spans)
    origin = spans[lo][1]
    return [(name, (start - origin) / 1e3, (end - origin) / 1e3) for name, start, end in spans[lo:hi]]


def step_us(spans: list[Span]) -> float:
    """First kernel's start to the last one's end, µs."""
    return (max(end for _, _, end in spans) - spans[0][1]) / 1e3 if spans else 0.0
