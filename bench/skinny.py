"""A few tokens' projections against cuBLAS: each projection shape of the named presets (the shapes
`project` routes: kernels/skinny_routes.projection_weights, a rank's shards with --tensor-parallel;
a shape shared by presets once) at each row count, over `layers` distinct weights (none served from
L2), as one CUDA graph. Per accumulator height a sweep of every block shape of the skinny kernel
(kernels/skinny.py) and the flat GEMM (kernels/flat_gemm.py) at the bucket's largest M, then the
best at every M. Bandwidth = weight bytes / time (bound by reading the weights up to M ~ 200 on an
H200). Also the largest error against F.linear in fp32, relative to the outputs' scale.

    python bench/skinny.py --rows 2 4 8 16 32 64 128
    python bench/skinny.py --route --presets llama-2-7b qwen2.5-7b mistral-7b phi-3-mini gemma-2-9b

--route (row buckets 8-64 only) also runs the start-up router (kernels/skinny_routes.measure, its
few candidates, its own timing) on the same weights and prints, per (shape, rows), its pick beside
the sweep's best, the static table's and cuBLAS's, each timed here: `router_over_best` (>= 1; the
router's loss) is what the lead's GPU run checks (bench/gpu.sh skinny-route).
"""
import argparse
import itertools
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchmaker.cells.decoder import empty_decoder  # noqa: E402
from batchmaker.cells.decoder_config import PRESETS  # noqa: E402
from batchmaker.cells.tensor_parallel import TensorCut  # noqa: E402
from batchmaker.kernels import skinny, skinny_routes  # noqa: E402
from batchmaker.kernels.flat_gemm import FlatConfig  # noqa: E402
from bench.common import write_results  # noqa: E402
from bench.gemv import graph_ms  # noqa: E402

SWEEP = ([skinny.SkinnyConfig(bn, bk, 4, st) for bn, bk, st in itertools.product((16, 32, 64), (128, 256), (3, 4, 6))]
         + [FlatConfig(bn, bk, 4, st) for bn, bk, st in itertools.product((64, 128), (128, 256), (2, 4))])


def preset_shapes(presets: list[str], tensor_parallel: int) -> dict[tuple[int, int], str]:
    """(n, k) -> 'preset projection' of every shape the presets' projections route (rank 0's shards)."""
    shapes = {}
    for preset in presets:
        config = PRESETS[preset] if tensor_parallel == 1 else TensorCut(0, tensor_parallel).config(PRESETS[preset])
        lm = empty_decoder(config)  # (meta tensors: shapes only)
        names = {tuple(m.weight.shape): name.rsplit(".", 1)[-1] for name, m in lm.named_modules()
                 if name.rsplit(".", 1)[-1] in skinny_routes.PROJECTIONS}
        for shape in skinny_routes.projection_weights(lm):
            shapes.setdefault(shape, f"{preset} {names[shape]}")
    return shapes


def timed(route, x, weights) -> float | str:
    """ms of one product over `weights` by `route` (cuBLAS: None), or why it failed."""
    try:
        return graph_ms(lambda: [skinny.routed_linear(x, w, route) for w in weights]) / len(weights)
    except Exception as e:  # a config the compiler refuses (shared memory)
        return f"{type(e).__name__}: {e}"[:160]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=["llama-2-7b"], choices=sorted(PRESETS))
    ap.add_argument("--tensor-parallel", type=int, default=1, help="rank 0's shards of a split over this many GPUs")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--rows", type=int, nargs="+", default=None,
                    help="default: 2 4 8 16 32 64 128 (--route: 8 16 32 64)")
    ap.add_argument("--route", action="store_true", help="the start-up router's picks against the sweep's")
    ap.add_argument("--device", default="cuda:0")
    args = ap.parse_args()
    rows_wanted = args.rows or ([8, 16, 32, 64] if args.route else [2, 4, 8, 16, 32, 64, 128])
    dev, dt = torch.device(args.device), torch.bfloat16
    torch.cuda.set_device(dev)
    g = torch.Generator(device=dev).manual_seed(0)
    rows, best, t0 = [], {}, time.perf_counter()
    for (n, k), name in preset_shapes(args.presets, args.tensor_parallel).items():
        w = [torch.randn(n, k, device=dev, dtype=dt, generator=g) * k ** -0.5 for _ in range(args.layers)]
        nbytes = n * k * 2
        for m in sorted(rows_wanted):
            bucket = skinny.row_bucket(m)
            x = torch.randn(m, k, device=dev, dtype=dt, generator=g)
            row = {"rows": m, "bucket": bucket, "projection": name, "n": n, "k": k, "cublas_ms": timed(None, x, w)}
            key = (n, k, bucket)
            if key not in best or m == max(r for r in rows_wanted if skinny.row_bucket(r) == bucket):
                sweep = {cfg: timed(cfg, x, w) for cfg in SWEEP if n % cfg.block_n == 0}
                row["sweep"] = {repr(cfg): ms for cfg, ms in sweep.items()}
                ok = {cfg: ms for cfg, ms in sweep.items() if isinstance(ms, float)}
                best[key] = min(ok, key=ok.get)
            cfg = best[key]
            row["ours_ms"] = timed(cfg, x, w)
            want = F.linear(x.float(), w[0].float())
            got = skinny.routed_linear(x, w[0], cfg).float()
            row.update(config=repr(cfg), cublas_tb_per_s=nbytes / row["cublas_ms"] / 1e9,
                       ours_tb_per_s=nbytes / row["ours_ms"] / 1e9, speedup=row["cublas_ms"] / row["ours_ms"],
                       max_error=((got - want).abs().max() / want.abs().max()).item())
            if args.route and m in skinny_routes.ROW_BUCKETS:
                pick, times = skinny_routes.measure(w, bucket, skinny_routes.time_in_graph)
                static = skinny_routes.static_route(n, k, bucket)
                row.update(router=repr(pick), router_ms=timed(pick, x, w), router_times={repr(r): t for r, t in
                                                                                          times.items()},
                           static=repr(static), static_ms=timed(static, x, w))
                fastest = min(row["ours_ms"], row["cublas_ms"])
                row.update(router_over_best=row["router_ms"] / fastest, static_over_best=row["static_ms"] / fastest)
            rows.append(row)
            print({k_: (round(v, 4) if isinstance(v, float) else v) for k_, v in row.items()
                   if k_ not in ("sweep", "router_times")}, f"{time.perf_counter() - t0:.0f} s", flush=True)
        del w
        torch.cuda.empty_cache()
    if args.route:
        worst = max(rows, key=lambda r: r["router_over_best"])
        print(f"router: within {100 * (worst['router_over_best'] - 1):.1f}% of the sweep's best everywhere "
              f"(worst: {worst['projection']} at {worst['rows']} rows); static table: within "
              f"{100 * (max(r['static_over_best'] for r in rows) - 1):.1f}%", flush=True)

    def plot(fig):
        ax = fig.add_subplot(1, 1, 1)
        for name in dict.fromkeys(r["projection"] for r in rows):
            pts = [r for r in rows if r["projection"] == name]
            line, = ax.plot([r["rows"] for r in pts], [r["ours_tb_per_s"] for r in pts], marker="o", label=f"{name}")
            ax.plot([r["rows"] for r in pts], [r["cublas_tb_per_s"] for r in pts], marker="x", ls="--",
                    color=line.get_color())
        ax.set_xscale("log", base=2)
        ax.set_xlabel("rows (tokens)")
        ax.set_ylabel("weight TB/s (o: best kernel, x: cuBLAS)")
        ax.legend(fontsize=6)
        ax.set_title(f"{' '.join(args.presets)} projections, bf16, {args.layers} distinct weights")
    print(write_results("skinny-route" if args.route else "skinny", args.device,
                        {"presets": args.presets, "tensor_parallel": args.tensor_parallel, "layers": args.layers,
                         "rows": rows, "best": {str(k): repr(v) for k, v in best.items()}}, plot), flush=True)


if __name__ == "__main__":
    main()
