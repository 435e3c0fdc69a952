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


def eleventh_decode_rules() -> None:
    """Put back the eleventh session's decode-attention launch rules (an A/B against the current ones,
    in one process): unsplit tiles of 64 positions on 4 warps, split tiles of 64 (128 for slices over
    128 positions) 3 stages deep, and no splitting once the programs fill the SMs twice over."""
    from batchmaker.kernels import attention_launch as pa
    from batchmaker.kernels import attention_variants
    current = pa.pick_config

    def split_config(max_query_len, group_pad, split_len=None, wide=False):
        if max(max_query_len, 1) * group_pad <= 16 and split_len is not None:
            return pa.AttentionConfig(max(1, 16 // group_pad), 128 if split_len > pa.MIN_SPLIT_LEN else 64, 4, 3)
        return current(max_query_len, group_pad, split_len, wide)
    whole = lambda block_m, programs, sms: pa.AttentionConfig(block_m, 64, 4, 3)  # noqa: E731
    for module in (pa, attention_variants):  # (the variants compiled at start: the same rules')
        module.pick_config, module.decode_whole_config = split_config, whole
    pa.RAGGED_BOUND = 1 << 40


def add_ab_switches(ap) -> None:
    """The switches that put back an earlier way of the engine or its kernels, for an A/B in one
    process (bench/chat.py); `apply_ab_switches` sets them."""
    ap.add_argument("--skinny-rows", type=int, default=None,
                    help="kernels/skinny.py's MAX_ROWS (1: cuBLAS for every projection of more than one token; an A/B)")
    ap.add_argument("--decode-rules", choices=("current", "eleventh"), default="current",
                    help="eleventh: decode attention launched by the eleventh session's rules (bench/common.py; an A/B)")
    ap.add_argument("--no-small-pdl", action="store_true",
                    help="the norm, RoPE and SiLU x up kernels launch without programmatic dependent launch "
                         "(kernels/fused_decoder.py PDL; an A/B)")
    ap.add_argument("--no-attention-pdl", action="store_true",
                    help="paged attention and its combine launch without programmatic dependent launch "
                         "(kernels/paged_attention.py PDL; an A/B)")
    ap.add_argument("--capture-after", type=int, default=None,
                    help="exec/graphs.py Graphs.capture_after (1: a shape is captured the first time it comes; an A/B)")
    ap.add_argument("--capture-wait", action="store_true",
                    help="every CUDA-graph capture waits for the device first (the twelfth session's way; an A/B)")


def apply_ab_switches(args) -> None:
    """Set what `add_ab_switches` parsed; call it before the engine starts (its kernel variants
    compile with these settings)."""
    from batchmaker.exec.graphs import Graphs
    from batchmaker.kernels import fused_decoder, paged_attention, skinny
    if args.skinny_rows is not None:
        skinny.MAX_ROWS = args.skinny_rows
    if args.decode_rules == "eleventh":
        eleventh_decode_rules()
    fused_decoder.PDL = not args.no_small_pdl
    paged_attention.PDL = not args.no_attention_pdl
    Graphs.wait_for_device = args.capture_wait
    if args.capture_after is not None:
        Graphs.capture_after = args.capture_after
