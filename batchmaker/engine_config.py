"""EngineConfig: the engine's one frozen config. Its workers (devices, CUDA graphs, the inline CPU
worker), the scheduler's config, the admission bound, the latencies kept for stats, and what the
engine changes in the process while it runs (torch's CPU threads, the collector's threshold;
`Engine.stop()` restores both).
"""
import os
from dataclasses import dataclass, field

from batchmaker.core.scheduler import SchedulerConfig


@dataclass(frozen=True)
class EngineConfig:
    devices: tuple[str, ...] = ("cpu",)  # one worker per entry; "cpu" twice gives two CPU workers
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # Admission bound: requests accepted and not yet finished. Beyond it `submit` answers
    # OverloadedError at once, so a flood costs a reply, not memory.
    max_requests: int = 4096
    num_latencies_kept: int = 4096  # per model, for the latency percentiles in stats()
    # CUDA workers: run tasks as CUDA graphs (per cell type and padded batch bucket, captured at
    # start-up); False runs every task with eager launches.
    cuda_graphs: bool = True
    # torch's CPU threads while the engine runs: None lets the engine choose (choose_cpu_threads:
    # 1 for an inline CPU worker or on 2 cores or fewer; else the cores, split among the CPU
    # workers; no CPU worker: unchanged); a number sets it. stop() restores the old count.
    cpu_threads: int | None = None
    # A CPU worker runs its tasks on the manager thread (no hand-off, no GIL contention between
    # the two: batchmaker/exec/worker.py): None lets the engine choose (when it is the only worker).
    # False gives it a thread of its own, so that the manager admits and cancels while a task runs.
    cpu_inline: bool | None = None
    # The collector's young-generation threshold while the engine runs (Python's default: 700).
    # Every request allocates a few tracked objects (its future, inputs, result); at 700 a
    # collection runs every ~200 requests and walks the live ones: 2.7 µs per LSTM request on the
    # manager at saturation, 0.3 µs at 10,000. None leaves it; stop() restores the old value.
    gc_young_threshold: int | None = 10_000


def choose_cpu_threads(num_cores: int, num_cpu_workers: int, inline: bool, override: int | None) -> int | None:
    """torch's CPU threads for an engine (None: leave them). An op on n threads waits at its
    barrier for the slowest one. When they share the cores with the manager, the server's I/O
    threads or another process, one is often descheduled and a ~1 ms round takes 10-100x longer
    (an LSTM request beside other work on 2 cores: p50 723 ms with 2 threads, 4.1 ms with 1). So 1
    thread when the worker runs inline on the manager thread, or on 2 cores or fewer; else the
    cores, split among the CPU workers. The price: on an otherwise idle 2-core machine a backlog
    was served 1.36x (LSTM) and 1.5x (TreeLSTM) faster with 2 threads; `cpu_threads=2` buys it."""
    if override is not None:
        if override < 1:
            raise ValueError(f"EngineConfig.cpu_threads must be at least 1, got {override}")
        return override
    if not num_cpu_workers:
        return None
    if inline or num_cores <= 2:
        return 1
    return max(1, num_cores // num_cpu_workers)


def engine_cpu_threads(config: EngineConfig, inline: bool) -> int | None:
    """`choose_cpu_threads` for an engine of `config` on this machine's cores (its affinity)."""
    num_cpu = sum(str(d).partition(":")[0] == "cpu" for d in config.devices)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return choose_cpu_threads(cores, num_cpu, inline, config.cpu_threads)


def runs_inline(config: EngineConfig, cell_types) -> bool:
    """Whether a CPU worker runs its tasks on the manager thread (`cpu_inline`; None: with one device,
    unless a pipeline's first stage would, which runs while the manager waits for its tokens)."""
    if config.cpu_inline is None:
        return len(config.devices) == 1 and not any(getattr(ct.cell, "pipeline_parallel", 1) > 1 for ct in cell_types)
    return config.cpu_inline
