"""EngineConfig: the engine's one frozen config. Its workers (devices, CUDA graphs, the inline CPU
worker), the scheduler's config, the admission bound, the latencies kept for stats, and what the
engine changes in the process while it runs (torch's CPU threads, the collector's threshold;
`Engine.stop()` restores both).
"""
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
    # torch's CPU threads while the engine runs: None lets the engine choose (CPU workers: the
    # cores, split among them; else unchanged); a number sets it. stop() restores the old count.
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
