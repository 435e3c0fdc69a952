"""What the norm fused into a one-token projection costs it (kernels/gemv.py; issue 33): each Llama-2-7B
projection's kernel over 32 distinct weights (none from L2) as one CUDA graph, in four forms with its
configured tile: the norm with the residual add (what qkv and gate | up run in a layer), the norm alone
(layer 0's qkv, the LM head), neither, and neither without PDL; `--maxnreg N`: the first and third again
with registers capped at N a thread (more programs an SM). Two passes; us a call and TB/s.

    python bench/norm_cost.py [--out bench/results/norm-cost-DEVICE-DATE.json]
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchmaker.kernels import gemv  # noqa: E402
from bench.gemv import graph_ms  # noqa: E402

SHAPES = {"qkv": (12288, 4096, False), "gate_up": (11008, 4096, True), "o": (4096, 4096, False),
          "down": (4096, 11008, False)}  # (n_out, k_in, silu): Llama-2-7B's


def capped(form, maxnreg: int):
    """`form` with its kernel launched with Triton's maxnreg (a register cap a thread)."""
    loaded = gemv._load_kernels

    class Kernels:
        class gemv_kernel:  # noqa: N801 (the module attribute's name)
            def __class_getitem__(cls, grid):
                return lambda *args, **kw: loaded().gemv_kernel[grid](*args, maxnreg=maxnreg, **kw)

    def run(w):
        gemv._load_kernels = lambda: Kernels
        try:
            return form(w)
        finally:
            gemv._load_kernels = loaded
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--maxnreg", type=int, nargs="+", default=[],
                    help="the norm + residual and plain forms again with registers capped (Triton's maxnreg): more "
                         "programs an SM")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    rows_out = []
    for name, (n, k, silu) in SHAPES.items():
        rows = 2 * n if silu else n
        ws = [torch.randn(rows, k, device=dev, dtype=dt, generator=g) * 0.02 for _ in range(args.layers)]
        x, r = (torch.randn(1, k, device=dev, dtype=dt, generator=g) for _ in range(2))
        nw = torch.ones(k, device=dev, dtype=dt)
        forms = {"norm+residual": lambda w: gemv._launch(x, r, nw, 1e-5, w, silu=silu, pdl=True),
                 "norm": lambda w: gemv._launch(x, None, nw, 1e-5, w, silu=silu, pdl=True),
                 "plain": lambda w: gemv._launch(x, None, None, 0.0, w, silu=silu, pdl=True),
                 "plain-nopdl": lambda w: gemv._launch(x, None, None, 0.0, w, silu=silu, pdl=False)}
        for cap in args.maxnreg:
            forms[f"norm+residual@{cap}"] = capped(forms["norm+residual"], cap)
            forms[f"plain@{cap}"] = capped(forms["plain"], cap)
        for rep in range(2):
            for form, fn in forms.items():
                ms = graph_ms(lambda: [fn(w) for w in ws], replays=50) / len(ws)
                row = {"projection": name, "form": form, "pass": rep, "us": ms * 1e3, "tb_per_s": rows * k * 2 / ms / 1e9,
                       "config": repr(gemv.pick_config(n, k, silu, dev))}
                rows_out.append(row)
                print(f"{name:8s} {form:14s} {row['us']:7.2f} us  {row['tb_per_s']:5.2f} TB/s  {row['config']}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                              "command": "python " + " ".join(sys.argv), "rows": rows_out}, indent=1))


if __name__ == "__main__":
    main()
