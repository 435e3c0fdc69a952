"""Which kernel runs each few-token projection, measured on the device at hand when an engine starts.

A decode iteration of 2-64 running requests projects through the skinny kernel (kernels/skinny.py),
FlashDecoding++'s flat GEMM (kernels/flat_gemm.py) or cuBLAS, whichever streams the weight fastest
at that shape, row count and GPU: one H200's table of Llama-2-7B's shapes (`skinny.CONFIGS`) is
wrong for most models and devices people serve. `settle_routes` fills `skinny.ROUTES` for the
model's own projections (q | k | v, o, gate | up, down: a rank's shards under tensor parallelism)
at row buckets 8, 16, 32 and 64, before any CUDA graph is captured (a graph bakes the choice in:
IterationRunner.compile_kernels calls it). Per (shape, bucket) it times a few candidates
(`CANDIDATES`, with the static table's pick) and F.linear, each a CUDA graph of one pass over the
layers' own weights (enough of them to stream past L2), the median of a few replays, and keeps the
fastest (cuBLAS on ties). Winners are cached on disk (`cache_path`: one JSON whose entries are keyed
by device name and torch's and Triton's versions), so later starts skip the sweep.

The mode is the decoder's `KVSettings.skinny_routes` (`--set llama.skinny_routes=measure`):
"measure" measures what the cache lacks; "static", the default until a GPU run has checked the
router against the sweep (bench/gpu.sh skinny-route), takes the static table (skinny.CONFIGS,
default_config); "off" gives cuBLAS every projection. BATCHMAKER_CACHE_DIR=DIR names the cache's
folder (default ~/.cache/batchmaker). Nothing is measured on the CPU, where projections are F.linear, nor where the kernels cannot run
(`skinny.can_skinny`: Hopper, 16-bit weights).
"""
import contextlib
import functools
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from batchmaker.kernels import skinny
from batchmaker.kernels.flat_gemm import FlatConfig
from batchmaker.kernels.skinny import Route, SkinnyConfig

log = logging.getLogger("batchmaker")

MODES = ("measure", "static", "off")
ROW_BUCKETS = (8, 16, 32, 64)  # skinny.row_bucket's values up to skinny.MAX_ROWS
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # the nn.Linear names the models project() through
STREAM_BYTES = 256 << 20  # weight bytes a timed pass reads, layers permitting: 5x an H100's or H200's 50 MB of L2
REPEATS = 5  # replays timed per candidate (the median counts)
BUDGET_S = 30.0  # measuring stops past this; the rest take the static table, uncached (the next start measures them)
CACHE_VERSION = 1  # bump when the candidates or the kernels change: older entries are not read
# per row bucket, beside cuBLAS and the static table's pick; every one fits Hopper's 227 KB of shared memory
# (73-196 KB, compiled for sm_90a). The flat GEMM's 8-token tile runs m16n8k16 MMAs, its 16-64 wgmma's m64nT.
CANDIDATES: dict[int, tuple[Route, ...]] = {
    8: (SkinnyConfig(32, 256, 4, 4), FlatConfig(64, 256, 4, 2), FlatConfig(64, 256, 4, 4)),
    16: (SkinnyConfig(32, 256, 4, 4), SkinnyConfig(32, 256, 4, 6), FlatConfig(64, 256, 4, 4)),
    32: (SkinnyConfig(32, 256, 4, 3), SkinnyConfig(32, 256, 4, 6), FlatConfig(64, 256, 4, 3)),
    64: (SkinnyConfig(32, 128, 4, 6), SkinnyConfig(32, 256, 4, 3), FlatConfig(64, 128, 4, 4)),
}

Key = tuple[int, int, int, str]  # (n_out, k_in, row bucket, dtype's name): a route of one device
Timer = Callable[[Route, Callable[[], object]], float]  # (route, one pass over the weights) -> ms a pass


def projection_weights(lm: nn.Module) -> dict[tuple[int, int], list[Tensor]]:
    """The weights `project` may route, by shape (n_out, k_in), a layer's each: PROJECTIONS without a
    bias (a rank's shards under tensor parallelism, a stage's layers under pipeline parallelism)."""
    shapes: dict[tuple[int, int], list[Tensor]] = {}
    for name, module in lm.named_modules():
        if name.rsplit(".", 1)[-1] in PROJECTIONS and isinstance(module, nn.Linear) and module.bias is None:
            shapes.setdefault(tuple(module.weight.shape), []).append(module.weight)
    return {shape: ws for shape, ws in shapes.items() if shape[0] % 16 == 0 and shape[1] % 16 == 0}


def static_route(n_out: int, k_in: int, bucket: int) -> Route:
    """What the static table says (kernels/skinny.py `pick_config`; the skinny kernel pads 8 rows to 16)."""
    return skinny.pick_config(n_out, k_in, max(16, bucket))


def candidates(n_out: int, k_in: int, bucket: int) -> list[Route]:
    """cuBLAS (None), this bucket's CANDIDATES and the static pick, those whose columns divide N."""
    found = dict.fromkeys([None, *CANDIDATES[bucket], static_route(n_out, k_in, bucket)])
    return [route for route in found if route is None or n_out % route.block_n == 0]


def measure(weights: list[Tensor], bucket: int, timer: Timer) -> tuple[Route, dict[Route, float]]:
    """The fastest route of x [bucket, K] W^T over `weights` (one pass reads enough of them to stream
    STREAM_BYTES) and each candidate's ms a pass; a candidate that fails (a compile refused) is left out."""
    n_out, k_in = weights[0].shape
    layers = weights[:max(1, -(-STREAM_BYTES // (weights[0].numel() * weights[0].element_size())))]
    x = torch.randn(bucket, k_in, dtype=weights[0].dtype, device=weights[0].device)
    times: dict[Route, float] = {}
    for route in candidates(n_out, k_in, bucket):
        try:
            times[route] = timer(route, functools.partial(_one_pass, x, layers, route))
        except Exception as e:  # noqa: BLE001 (a config the compiler or the device refuses)
            log.debug("skinny route %s at (%d, %d, %d) failed: %s: %s", route, n_out, k_in, bucket, type(e).__name__, e)
    if not times:
        return static_route(n_out, k_in, bucket), times
    return min(times, key=times.get), times  # (ties: the first, cuBLAS)


def _one_pass(x: Tensor, layers: list[Tensor], route: Route) -> list[Tensor]:
    return [skinny.routed_linear(x, w, route) for w in layers]


def time_in_graph(route: Route, one_pass: Callable[[], object]) -> float:
    """Median ms of a replay of `one_pass` captured as a CUDA graph (after an eager run that compiles),
    over REPEATS replays timed with CUDA events. (No torch.cuda.graph: its gc.collect and empty_cache
    per capture would cost more than the timing.)"""
    one_pass()
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            one_pass()
        finally:
            graph.capture_end()
    torch.cuda.synchronize()
    return median_replay_ms(graph, REPEATS)


def median_replay_ms(graph: "torch.cuda.CUDAGraph", repeats: int) -> float:
    """Median ms of `repeats` replays of a captured graph, each timed with CUDA events."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def cache_path() -> Path:
    """The routes' cache: BATCHMAKER_CACHE_DIR/skinny-routes.json, else under ~/.cache/batchmaker."""
    folder = os.environ.get("BATCHMAKER_CACHE_DIR") or Path.home() / ".cache" / "batchmaker"
    return Path(folder) / "skinny-routes.json"


def cache_entry(device_name: str) -> str:
    """The cache's key for routes measured on `device_name` with this torch and Triton."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    return f"{device_name} | torch {torch.__version__} | triton {triton_version} | routes {CACHE_VERSION}"


def load_routes(path: Path, entry: str) -> dict[Key, Route]:
    """The routes `path` holds under `entry` (none where the file is missing or unreadable)."""
    try:
        stored = json.loads(path.read_text()).get(entry, {})
        return {_key_of(text): _route_of(value) for text, value in stored.items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return {}


def save_routes(path: Path, entry: str, routes: dict[Key, Route]) -> None:
    """Merge `routes` into `path` under `entry`, replacing the file at once (ranks may write it together)."""
    try:
        everything = json.loads(path.read_text())
        everything = everything if isinstance(everything, dict) else {}
    except (OSError, ValueError):
        everything = {}
    everything.setdefault(entry, {}).update({_text_of(key): _json_of(route) for key, route in routes.items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_suffix(f".{os.getpid()}.tmp")
    scratch.write_text(json.dumps(everything, indent=1, sort_keys=True) + "\n")
    os.replace(scratch, path)


def _text_of(key: Key) -> str:
    return ",".join(map(str, key))


def _key_of(text: str) -> Key:
    n_out, k_in, bucket, dtype = text.split(",")
    return int(n_out), int(k_in), int(bucket), dtype


def _json_of(route: Route) -> dict | None:
    if route is None:
        return None
    return {"kernel": "flat" if type(route) is FlatConfig else "skinny", "block_n": route.block_n,
            "block_k": route.block_k, "num_warps": route.num_warps, "num_stages": route.num_stages}


def _route_of(value: dict | None) -> Route:
    if value is None:
        return None
    kind = {"flat": FlatConfig, "skinny": SkinnyConfig}[value["kernel"]]
    return kind(value["block_n"], value["block_k"], value["num_warps"], value["num_stages"])


def settle_routes(lm: nn.Module, device: torch.device, mode: str = "static", timer: Timer = time_in_graph,
                  path: Path | None = None) -> dict[Key, Route]:
    """Install the routes of `lm`'s projections on `device` into skinny.ROUTES, by `mode` (MODES),
    and return them: measured where the cache at `path`
    (default `cache_path()`) lacks them, in at most about BUDGET_S, and cached. On a CPU or where the
    kernels cannot run: nothing measured, nothing installed ({})."""
    if mode not in MODES:
        raise ValueError(f"skinny routes {mode!r}: one of {', '.join(MODES)} expected")
    with torch.inference_mode():  # (the weights are parameters: can_skinny refuses products autograd records)
        shapes = projection_weights(lm)
        if not shapes or not skinny.can_skinny(torch.empty(2, 16, dtype=next(iter(shapes.values()))[0].dtype,
                                                           device=device), next(iter(shapes.values()))[0]):
            return {}
        return _settle(shapes, device, mode, timer, path)


def _settle(shapes: dict, device: torch.device, mode: str, timer: Timer, path: Path | None) -> dict[Key, Route]:
    dtype = next(iter(shapes.values()))[0].dtype
    keys = [(n, k, bucket, str(dtype).removeprefix("torch.")) for n, k in shapes for bucket in ROW_BUCKETS]
    start = time.perf_counter()
    if mode == "off":
        routes = dict.fromkeys(keys)
    elif mode == "static":
        routes = {key: static_route(*key[:3]) for key in keys}
    else:
        routes = _measured(shapes, keys, device, timer, path or cache_path())
    cuda = device.type == "cuda"  # (x.get_device() is -1 on the CPU: tests route there with a fake timer)
    index = device.index if device.index is not None else torch.cuda.current_device() if cuda else -1
    skinny.ROUTES.update({(n, k, bucket, dtype, index): route for (n, k, bucket, _), route in routes.items()})
    kinds = [("cuBLAS" if r is None else "flat" if type(r) is FlatConfig else "skinny") for r in routes.values()]
    log.info("skinny routes on %s (%s): %d (shape, rows) settled in %.2f s: %s", device, mode,
             len(routes), time.perf_counter() - start, ", ".join(f"{kinds.count(k)} {k}" for k in sorted(set(kinds))))
    return routes


def _measured(shapes: dict, keys: list[Key], device: torch.device, timer: Timer, path: Path) -> dict[Key, Route]:
    """The cached routes of `keys` on this device; those missing measured, the new ones cached."""
    cuda = device.type == "cuda"
    entry = cache_entry(torch.cuda.get_device_name(device) if cuda else str(device))
    routes = {key: route for key, route in load_routes(path, entry).items() if key in keys}
    measured, start = {}, time.perf_counter()
    with torch.cuda.device(device) if cuda else contextlib.nullcontext():
        for key in keys:
            if key in routes:
                continue
            if measured and time.perf_counter() - start > BUDGET_S:  # (the rest: static, measured at a later start)
                routes[key] = static_route(*key[:3])
                continue
            routes[key] = measured[key] = measure(shapes[key[:2]], key[2], timer)[0]
    if measured:
        with contextlib.suppress(OSError):  # (a read-only home: measured again next time)
            save_routes(path, entry, measured)
    log.info("skinny routes: %d measured in %.2f s, %d from %s", len(measured), time.perf_counter() - start,
             len(keys) - len(measured), path)
    return {key: routes[key] for key in keys}


__all__ = ["BUDGET_S", "CANDIDATES", "MODES", "ROW_BUCKETS", "cache_entry", "cache_path", "candidates",
           "load_routes", "measure", "projection_weights", "save_routes", "settle_routes", "static_route",
           "time_in_graph"]
