"""4-bit weights on one layer's four matrices (bench/offload.py): Triton's expansion + matmul against
the fused `linear4` at a few row counts (what would choose `dequant=fused`, exec/offload_weights.py)."""
import statistics
import time

import torch
import torch.nn.functional as F

from batchmaker.cells.decoder import INIT_STD
from batchmaker.kernels.compress4 import compress, expand, linear4

DTYPE = torch.bfloat16


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def device_ms(fn, device: str, repeats: int = 5) -> float:
    fn()  # (compile, warm-up)
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def time_dequant(config, rows_list: list[int], device: str) -> dict:
    """ms per call on one layer's four matrices: expand into a dense buffer then F.linear, or
    linear4 (the codes expanded tile by tile in registers); the sum over the four per row count."""
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    shapes = {"qkv": ((config.num_heads + 2 * config.num_kv_heads) * d, h), "o": (h, config.num_heads * d),
              "gate_up": (2 * i, h), "down": (h, i)}
    out = {}
    for rows in rows_list:
        per = {}
        for name, (n, k) in shapes.items():
            c = compress(torch.randn(n, k, device=device, dtype=DTYPE) * INIT_STD, 64, 0)
            dense, x = torch.empty(n, k, device=device, dtype=DTYPE), torch.randn(rows, k, device=device, dtype=DTYPE)
            per[name] = {"expand_matmul_ms": device_ms(lambda: F.linear(x, expand(c, dense)), device),
                         "fused_ms": device_ms(lambda: linear4(x, c), device)}
        total = {key: sum(v[key] for v in per.values()) for key in ("expand_matmul_ms", "fused_ms")}
        out[rows] = {"matrices": per, **total, "faster": min(total, key=total.get).removesuffix("_ms")}
        print(f"  {rows:6d} rows: expand + matmul {total['expand_matmul_ms']:.3f} ms, fused {total['fused_ms']:.3f} ms "
              "(a layer's four matrices)", flush=True)
    return out
