"""The few-row 4-bit projection (kernels/compress4.gemv4) on a preset's projection shapes, against
the fused `linear4`, Triton's expansion into a dense buffer + F.linear, and the dense F.linear of
the same shape (issue 34): every candidate tile of gemv4 (compress4.GEMV4_CONFIGS) and the rule's
pick, at each row count. Each is timed as one CUDA graph of calls over distinct copies of the
weight (together larger than the L2 cache: every call reads DRAM), µs a call. Bandwidth: the
compressed bytes (codes, scales, mins) over the time, as a share of the copy bandwidth measured in
this process (bench/device_limits.py; the dense F.linear: its bf16 bytes). Error: the largest
|out - twin| over the largest |twin|, twin = F.linear(x, decompress(c)) in fp32. Prints the best
tile per shape and row count, and a layer's four matrices against their compressed-bytes floor.

    python bench/gemv4.py                        # llama-2-13b, rows 1 2 4 8 16, on cuda:0
    python bench/gemv4.py --preset llama-2-7b --rows 1 16
    python bench/gemv4.py --smoke --out /tmp/x   # CPU, Triton's interpreter, tiny shapes (CI's check)
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:  # (Triton reads its interpreter switch when a kernel module is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchmaker.cells.decoder_config import PRESETS  # noqa: E402
from batchmaker.kernels.compress4 import (GEMV4_CONFIGS, compress, decompress, expand, gemv4,  # noqa: E402
                                          gemv4_config, linear4)
from bench import common, device_limits  # noqa: E402

L2_BYTES = 100 << 20  # copies of a weight read per graph: at least twice an H100's / H200's 50 MB L2
SMOKE_SHAPES = {"qkv": (192, 64), "o": (64, 64), "gate_up": (320, 64), "down": (64, 160)}


def projection_shapes(preset: str) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of a layer's four matrices (q | k | v and gate | up fused, as the layers hold them)."""
    c = PRESETS[preset]
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {"qkv": (q + 2 * kv, c.hidden_size), "o": (c.hidden_size, q), "gate_up": (2 * c.intermediate_size,
            c.hidden_size), "down": (c.hidden_size, c.intermediate_size)}


def config_name(config) -> str:
    return (f"gemv4 {config.block_n}x{config.block_k} {'dot' if config.dot else 'fma'} "
            f"p{config.min_programs} w{config.num_warps}")


def microseconds(call, copies: int, device: str) -> float:
    """µs of one call (call(i) over copy i): a CUDA graph of all copies' calls, median of 20 replays;
    on a CPU the host clock over one pass."""
    if device.startswith("cuda"):
        from bench.gemv import graph_ms
        return graph_ms(lambda: [call(i) for i in range(copies)]) * 1e3 / copies
    call(0)
    start = time.perf_counter()
    for i in range(copies):
        call(i)
    return (time.perf_counter() - start) * 1e6 / copies


def measure_shape(n: int, k: int, rows: int, dtype, device: str, copies: int) -> dict:
    """Each method's µs, bytes/s and error on x [rows, K] and W [N, K]."""
    generator = torch.Generator(device=device).manual_seed(n * 7 + k)
    dense = [torch.randn(n, k, device=device, dtype=dtype, generator=generator) * 0.02 for _ in range(copies)]
    codes = [compress(w, 64, 0) for w in dense]
    x = torch.randn(rows, k, device=device, dtype=dtype, generator=generator)
    twin = F.linear(x.float(), decompress(codes[0]).float())
    buffer = torch.empty(n, k, device=device, dtype=dtype)
    methods = {config_name(cfg): (lambda i, cfg=cfg: gemv4(x, codes[i], cfg)) for cfg in GEMV4_CONFIGS}
    methods.update({"linear4": lambda i: linear4(x, codes[i]),
                    "expand+F.linear": lambda i: F.linear(x, expand(codes[i], buffer)),
                    "dense F.linear": lambda i: F.linear(x, dense[i])})
    out = {}
    for name, call in methods.items():
        try:
            us = microseconds(call, copies, device)
        except Exception as e:  # (a tile the compiler refuses: shared memory, registers)
            out[name] = {"failed": f"{type(e).__name__}: {e}"[:160]}
            continue
        moved = dense[0].nbytes if name == "dense F.linear" else codes[0].nbytes
        error = (call(0).float() - twin).abs().max().item() / max(twin.abs().max().item(), 1e-30)
        out[name] = {"us": us, "bytes_per_s": moved / (us * 1e-6), "error": error}
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-2-13b", choices=sorted(PRESETS))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton's interpreter, tiny shapes, rows 1 and 3")
    ap.add_argument("--out", default=None, help="folder of the JSON (default: bench/results)")
    args = ap.parse_args(argv)
    if args.out:
        common.RESULTS = Path(args.out)
    device = "cpu" if args.smoke else args.device
    dtype = torch.float32 if args.smoke else torch.bfloat16  # (the interpreter's bf16 dot is wrong)
    shapes = SMOKE_SHAPES if args.smoke else projection_shapes(args.preset)
    rows_list = [1, 3] if args.smoke else args.rows
    limits = device_limits.measure(device, dtype, copy_mib=8 if args.smoke else None,
                                   matmul_n=64 if args.smoke else None)
    bandwidth = limits.copy_bytes_per_s
    print(f"{limits.device}: copy {bandwidth / 1e12:.3f} TB/s; {args.preset if not args.smoke else 'smoke'} "
          f"{dtype}", flush=True)
    results, layers = [], {}
    for name, (n, k) in shapes.items():
        compressed = compress(torch.zeros(n, k, dtype=dtype), 64, 0).nbytes
        copies = 1 if args.smoke else max(2, -(-L2_BYTES // compressed))
        for rows in rows_list:
            timed = measure_shape(n, k, rows, dtype, device, copies)
            for method in timed.values():
                if "us" in method:
                    method["of_copy_bandwidth"] = method["bytes_per_s"] / bandwidth
            tiles = {m: v for m, v in timed.items() if m.startswith("gemv4") and "us" in v}
            best = min(tiles, key=lambda m: tiles[m]["us"]) if tiles else None
            rule = config_name(gemv4_config(rows, n, k))
            floor_us = compressed / bandwidth * 1e6
            results.append({"matrix": name, "n": n, "k": k, "rows": rows, "compressed_bytes": compressed,
                            "floor_us": floor_us, "copies": copies, "best": best, "rule": rule, "methods": timed})
            layers.setdefault(rows, []).append((floor_us, timed.get(best, {}).get("us"), timed.get(rule, {}).get("us")))
            line = "  ".join(f"{m.split(' ')[0] if m.startswith('gemv4') else m} {v['us']:.1f}"
                             for m, v in timed.items() if "us" in v and not (m.startswith("gemv4") and m != best))
            print(f"{name:8s} [{n}, {k}] rows {rows:2d}: best {best} {tiles[best]['us']:.1f} µs "
                  f"({tiles[best]['of_copy_bandwidth']:.2f} of copy bw, floor {floor_us:.1f} µs; rule {rule}); {line}",
                  flush=True)
    summary = {}
    for rows, parts in layers.items():
        floor, best, rule = (sum(p[i] or float("nan") for p in parts) for i in range(3))
        summary[rows] = {"floor_us": floor, "best_us": best, "rule_us": rule, "best_over_floor": best / floor}
        print(f"a layer's four matrices, {rows} rows: best tiles {best:.1f} µs, the rule's {rule:.1f} µs, "
              f"floor {floor:.1f} µs ({best / floor:.2f}x)")
    payload = {"preset": "smoke" if args.smoke else args.preset, "dtype": str(dtype), "limits": limits.as_dict(),
               "configs": [config_name(c) for c in GEMV4_CONFIGS], "results": results, "layer": summary,
               "median_error": statistics.median(v["error"] for r in results for v in r["methods"].values()
                                                 if "error" in v)}
    path = common.write_results(f"gemv4-{payload['preset']}", device, payload)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
