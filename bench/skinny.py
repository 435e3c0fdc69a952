"""A few tokens' projections (kernels/skinny.py) against cuBLAS: each Llama-2-7B projection at M
rows over `layers` distinct weights (none served from L2), as one CUDA graph; per accumulator height
(block_m: 16, 32, 64, 128) a sweep of block shapes at the bucket's largest M, then the best at
every M. Bandwidth = weight bytes / time (the products are bound by reading the weights up to
M ~ 200 on an H200). Also the largest error against F.linear in fp32, relative to the outputs' scale.

    python bench/skinny.py --rows 2 4 8 16 32 64 128
"""
import argparse
import itertools
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchmaker.cells.decoder_config import PRESETS  # noqa: E402
from batchmaker.kernels import skinny  # noqa: E402
from bench.common import write_results  # noqa: E402
from bench.gemv import graph_ms  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-2-7b")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rows", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64, 128])
    ap.add_argument("--device", default="cuda:0")
    args = ap.parse_args()
    c, dev, dt = PRESETS[args.preset], torch.device(args.device), torch.bfloat16
    h, i = c.hidden_size, c.intermediate_size
    shapes = {"qkv": ((c.num_heads + 2 * c.num_kv_heads) * c.head_dim, h), "o": (h, h), "gate_up": (2 * i, h),
              "down": (h, i)}
    g = torch.Generator(device=dev).manual_seed(0)
    w = {name: [torch.randn(n, k, device=dev, dtype=dt, generator=g) * k ** -0.5 for _ in range(args.layers)]
         for name, (n, k) in shapes.items()}
    candidates = [skinny.SkinnyConfig(bn, bk, 4, st) for bn, bk, st in itertools.product((16, 32, 64), (128, 256), (3, 4, 6))]
    rows, best = [], {}
    t0 = time.perf_counter()
    for m in sorted(args.rows):
        block_m = skinny.block_rows(m)
        for name, (n, k) in shapes.items():
            x = torch.randn(m, k, device=dev, dtype=dt, generator=g)
            nbytes = n * k * 2
            row = {"rows": m, "block_m": block_m, "projection": name, "n": n, "k": k,
                   "cublas_ms": graph_ms(lambda: [F.linear(x, wl) for wl in w[name]]) / args.layers}
            key = (n, k, block_m)
            if key not in best or m == max(r for r in args.rows if skinny.block_rows(r) == block_m):
                sweep = []
                for cfg in candidates:
                    if n % cfg.block_n:
                        continue
                    try:
                        ms = graph_ms(lambda: [skinny.skinny_linear(x, wl, config=cfg) for wl in w[name]]) / args.layers
                    except Exception as e:  # a config the compiler refuses (shared memory)
                        sweep.append({"config": repr(cfg), "error": f"{type(e).__name__}: {e}"[:160]})
                        continue
                    sweep.append({"config": repr(cfg), "ms": ms})
                    if key not in best or ms < best[key][1]:
                        best[key] = (cfg, ms)
                row["sweep"] = sweep
            cfg = best[key][0]
            row["ours_ms"] = graph_ms(lambda: [skinny.skinny_linear(x, wl, config=cfg) for wl in w[name]]) / args.layers
            want = F.linear(x.float(), w[name][0].float())
            got = skinny.skinny_linear(x, w[name][0], config=cfg).float()
            row.update(config=repr(cfg), cublas_tb_per_s=nbytes / row["cublas_ms"] / 1e9,
                       ours_tb_per_s=nbytes / row["ours_ms"] / 1e9, speedup=row["cublas_ms"] / row["ours_ms"],
                       max_error=((got - want).abs().max() / want.abs().max()).item())
            rows.append(row)
            print({k_: (round(v, 3) if isinstance(v, float) else v) for k_, v in row.items() if k_ != "sweep"},
                  f"{time.perf_counter() - t0:.0f} s", flush=True)

    def plot(fig):
        ax = fig.add_subplot(1, 1, 1)
        for name in shapes:
            pts = [r for r in rows if r["projection"] == name]
            ax.plot([r["rows"] for r in pts], [r["ours_tb_per_s"] for r in pts], marker="o", label=f"{name} skinny")
            ax.plot([r["rows"] for r in pts], [r["cublas_tb_per_s"] for r in pts], marker="x", ls="--",
                    label=f"{name} cuBLAS")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("rows (tokens)")
        ax.set_ylabel("weight TB/s")
        ax.legend(fontsize=7)
        ax.set_title(f"{args.preset} projections, bf16, {args.layers} distinct weights")
    print(write_results("skinny", args.device, {"preset": args.preset, "layers": args.layers, "rows": rows,
                                                "best": {str(k): repr(v[0]) for k, v in best.items()}}, plot),
          flush=True)


if __name__ == "__main__":
    main()
