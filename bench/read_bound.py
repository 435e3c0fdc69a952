"""What the device's memory lets any kernel reach at the sizes a decode step reads (issue 33's two
missed targets: the batch-1 step at <= 1.1x its weight floor, decode attention at >= 0.95 of the
read bandwidth at 268-537 MB). Three measurements, each as one CUDA graph of back-to-back calls:

- **reads by size**: a Triton kernel that only reads (each program sums its span into one float:
  the least work a kernel can do per byte), its tiles swept, and torch's reduction, over buffers of
  32 MB to 2 GB (rotating among distinct buffers, so that L2 serves none); each size's best against
  the read bandwidth of a 2 GB reduction, the ceiling `bench/attention.py` divides by;
- **the weight chain**: the same read kernel over a Llama-2-7B-sized model's 128 projection
  matrices in a decode step's order (12.95 GB, every matrix its own launch, as the GEMVs are): the
  least a step that streams its weights matrix by matrix can take, against the weight floor at
  the copy bandwidth the batch-1 profile divides by (`bench/device_limits.py`);
- **a launch in a graph**: a chain of one-element kernels, each waiting for the one before, as a
  decode step's small kernels (attention, combine, RoPE, the cache write) wait: the time each adds
  whatever its bytes.

    python bench/read_bound.py --out bench/results/read-bound-NVIDIA-H100-80GB-HBM3-DATE.json
"""
import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchmaker.cells.decoder_config import PRESETS  # noqa: E402
from batchmaker.kernels.skinny_routes import median_replay_ms  # noqa: E402

MB = 1e6
SIZES_MB = (32, 64, 134, 268, 537, 1074, 2147)  # (268 and 537: decode attention's batch 1 x 16K and 32K reads)
TILES = [(block, iters, warps) for block in (2048, 4096, 8192) for iters in (1, 4, 16) for warps in (4, 8)]


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def read(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        start = tl.program_id(0) * BLOCK * ITERS
        acc = tl.zeros([BLOCK], tl.float32)
        for i in range(ITERS):
            offs = start + i * BLOCK + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        tl.store(out_ptr + tl.program_id(0), tl.sum(acc, 0))

    @triton.jit
    def touch(x_ptr):
        tl.store(x_ptr, tl.load(x_ptr) + 1.0)

    return read, touch


def read(x: torch.Tensor, out: torch.Tensor, tile: tuple[int, int, int]) -> torch.Tensor:
    """Each program's sum of its BLOCK x ITERS span of `x` (flat) into `out` (its twin: `span_sums`)."""
    block, iters, warps = tile
    grid = (-(-x.numel() // (block * iters)),)
    _kernels()[0][grid](x, out, x.numel(), BLOCK=block, ITERS=iters, num_warps=warps)
    return out[:grid[0]]


def span_sums(x: torch.Tensor, tile: tuple[int, int, int]) -> torch.Tensor:
    span = tile[0] * tile[1]
    flat = x.reshape(-1).float()
    return torch.nn.functional.pad(flat, (0, -flat.numel() % span)).view(-1, span).sum(1)


def graph_us(calls: list, replays: int = 10) -> float:
    """Median µs per call of `calls` run back to back in one CUDA graph."""
    for call in calls[:2]:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    return median_replay_ms(graph, replays) * 1e3 / len(calls)


def by_size(dev, read_gbps: float) -> list[dict]:
    rows = []
    for size in SIZES_MB:
        n = int(size * MB) // 2
        copies = max(2, -(-400 // size))  # (at least 400 MB in rotation: none of it from L2)
        bufs = [torch.randn(n, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
        out = torch.empty(-(-n // 2048), device=dev, dtype=torch.float32)
        calls = max(copies, min(64, int(8000 // size)))
        tiles = {}
        for tile in TILES:
            tiles[str(tile)] = graph_us([lambda b=bufs[i % copies], t=tile: read(b, out, t) for i in range(calls)])
        torch_us = graph_us([lambda b=bufs[i % copies]: b.sum(dtype=torch.float32) for i in range(calls)])
        best = min(tiles, key=tiles.get)
        gbps = size * MB / tiles[best] / 1e3
        rows.append({"MB": size, "best_tile": best, "us": round(tiles[best], 2), "GBps": round(gbps, 1),
                     "of_read": round(gbps / read_gbps, 3), "torch_sum_us": round(torch_us, 2),
                     "torch_sum_of_read": round(size * MB / torch_us / 1e3 / read_gbps, 3),
                     "tiles_us": {k: round(v, 2) for k, v in tiles.items()}})
        print(f"{size:5d} MB: best read {tiles[best]:8.1f} µs = {gbps:6.0f} GB/s ({gbps / read_gbps:.3f} of the read "
              f"bandwidth) tile {best}; torch.sum {torch_us:8.1f} µs", flush=True)
        del bufs
    return rows


def weight_chain(dev, preset: str, copy_gbps: float) -> dict:
    c, shapes = PRESETS[preset], layer_shapes(preset)
    mats = [(name, torch.randn(n, k, device=dev, dtype=torch.bfloat16)) for _ in range(c.num_layers)
            for name, (n, k) in shapes.items()]
    out = torch.empty(-(-max(m.numel() for _, m in mats) // 2048), device=dev, dtype=torch.float32)
    nbytes = sum(m.numel() * 2 for _, m in mats)
    best, per_tile = None, {}
    for tile in TILES:
        us = graph_us([lambda m=m, t=tile: read(m, out, t) for _, m in mats], replays=5) * len(mats)
        per_tile[str(tile)] = round(us, 1)
        best = tile if best is None or us < per_tile[str(best)] else best
    mixed = {}  # each shape's own best tile
    for name in shapes:
        subset = [m for n, m in mats if n == name]
        mixed[name] = min(TILES, key=lambda t: graph_us([lambda m=m, t=t: read(m, out, t) for m in subset], 5))
    us_mixed = graph_us([lambda m=m, t=mixed[n]: read(m, out, t) for n, m in mats], replays=5) * len(mats)
    floor_us = nbytes / copy_gbps / 1e3
    record = {"preset": preset, "matrices": len(mats), "bytes": nbytes, "best_tile": str(best),
              "read_ms": round(per_tile[str(best)] / 1e3, 4), "per_shape_tiles": {k: str(v) for k, v in mixed.items()},
              "read_ms_per_shape_tiles": round(us_mixed / 1e3, 4), "floor_ms_at_copy": round(floor_us / 1e3, 4),
              "tiles_ms": {k: round(v / 1e3, 4) for k, v in per_tile.items()}}
    fastest = min(per_tile[str(best)], us_mixed)
    record["read_over_floor"] = round(fastest / floor_us, 4)
    print(f"{preset}'s {len(mats)} matrices, {nbytes / 1e9:.2f} GB, one read launch each: {fastest / 1e3:.3f} ms = "
          f"{fastest / floor_us:.3f}x the floor at the copy bandwidth ({floor_us / 1e3:.3f} ms)", flush=True)
    del mats
    return record


def layer_shapes(preset: str) -> dict[str, tuple[int, int]]:
    """A decoder layer's projection matrices [N, K] by name, in a step's order."""
    from bench.gemv import projections
    return {name: (2 * n if silu else n, k) for name, (n, k, silu) in projections(PRESETS[preset]).items()
            if name != "head"}


def eager_layer(dev, preset: str, tile: tuple[int, int, int] = (4096, 1, 8)) -> None:
    """One layer's four matrices read eagerly three times each (a kernel profiler's target)."""
    mats = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for n, k in layer_shapes(preset).values()]
    out = torch.empty(-(-max(m.numel() for m in mats) // tile[0]), device=dev, dtype=torch.float32)
    for _ in range(3):
        for m in mats:
            read(m, out, tile)
    torch.cuda.synchronize()


def launch_chain(dev, count: int = 256) -> dict:
    x = torch.zeros(1, device=dev, dtype=torch.float32)
    touch = _kernels()[1]
    us = graph_us([lambda: touch[(1,)](x) for _ in range(count)], replays=10)
    print(f"a dependent one-element launch in a graph: {us:.2f} µs", flush=True)
    return {"launches": count, "us_per_launch": round(us, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-2-7b")
    ap.add_argument("--out", default=None)
    ap.add_argument("--eager-only", action="store_true",
                    help="read one layer's four matrices with the best tile, 3 times eagerly, and stop (for ncu)")
    args = ap.parse_args()
    if args.eager_only:
        return eager_layer(torch.device("cuda"), args.preset)
    from bench.attention import read_bandwidth
    from bench.device_limits import measure
    dev = torch.device("cuda")
    limits = measure("cuda:0")
    copy_gbps, read_gbps = limits.copy_bytes_per_s / 1e9, read_bandwidth(dev)
    print(f"{torch.cuda.get_device_name(0)}: copy {copy_gbps:.0f} GB/s, a 2 GB reduction reads {read_gbps:.0f} GB/s",
          flush=True)
    record = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "command": "python " + " ".join(sys.argv), "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "copy_GBps": round(copy_gbps, 1), "read_GBps": round(read_gbps, 1), "limits": limits.as_dict(),
              "launch": launch_chain(dev), "sizes": by_size(dev, read_gbps),
              "chain": weight_chain(dev, args.preset, copy_gbps)}
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1))
        print("wrote", args.out)


if __name__ == "__main__":
    main()
