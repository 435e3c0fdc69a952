"""The one-token GEMV kernel (kernels/triton_gemv.py) compiled for sm_90a on the CPU, per form and tile: ptxas's
registers a thread (which set the programs an SM holds), global loads in the PTX and how many come before the PDL
wait, and block-wide barriers. What bench/norm_cost.py's times are read against (issue 33). No GPU, no times.

    python bench/gemv_fit.py --out bench/results/gemv-fit-sm90.json
"""
import argparse
import json
import re
import sys
from pathlib import Path

import triton
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchmaker.kernels import triton_gemv  # noqa: E402
from batchmaker.kernels.gemv import DEVICE_CONFIGS, NORM_K  # noqa: E402
from bench.attention_fit import TARGET, registers  # noqa: E402 (sm_90a; ptxas's registers and spills)

POINTERS = {"x_ptr", "r_ptr", "nw_ptr", "w_ptr", "out_ptr", "sum_ptr", "cos_ptr", "sin_ptr", "k_cache", "v_cache",
            "slots", "b_ptr"}
FORMS = {"norm+residual": (True, True), "norm": (True, False), "plain": (False, False)}  # (NORM, RESIDUAL)
REGISTER_FILE = 65536  # 32-bit registers an SM (H100, H200)


def fit(n_out: int, k_in: int, silu: bool, cfg, norm: bool, residual: bool) -> dict:
    kernel = triton_gemv.gemv_kernel
    consts = dict(NORM=norm, RESIDUAL=residual, SILU=silu, ROPE=False, DOT=cfg.dot, PDL=True,
                  EVEN_K=k_in % cfg.block_k == 0, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                  NORM_K=min(NORM_K, 1 << (k_in - 1).bit_length()), HEAD_DIM=2, CACHE_BLOCK=1, BIAS=False,
                  PREFETCH=0 if cfg.dot else cfg.prefetch, sq_ptr=None, SQUARES_IN=0, SQUARES_OUT=False)
    names = kernel.arg_names
    types = {n: "constexpr" if n in consts else "*bf16" if n in POINTERS else "fp32" if n == "eps" else "i32"
             for n in names}
    # (as the runtime specializes them: pointers 16-byte aligned, and the int arguments, multiples of 16 at these
    # shapes (sizes, strides; the unused RoPE ones 0), divisible by 16, which lets the weight loads vectorize)
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if types[n] != "fp32"
               and types[n] != "constexpr"}
    compiled = triton.compile(ASTSource(kernel, types, consts, aligned), target=TARGET,
                              options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    ptx = compiled.asm["ptx"]
    used = registers(ptx)[0]
    wait = ptx.find("griddepcontrol.wait")
    loads = [m.start() for m in re.finditer(r"ld\.global", ptx)]
    return {"registers": used,
            "programs_per_sm_by_registers": REGISTER_FILE // (used * 32 * cfg.num_warps),
            "global_loads": len(loads), "loads_before_wait": sum(1 for at in loads if 0 <= at < wait),
            "barriers": len(re.findall(r"bar\.sync", ptx))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", default="H200", help="kernels/gemv.py DEVICE_CONFIGS entry whose tiles to compile")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for (n_out, k_in, silu), cfg in DEVICE_CONFIGS[args.table].items():
        for form, (norm, residual) in FORMS.items():
            row = {"n_out": n_out, "k_in": k_in, "silu": silu, "config": repr(cfg), "form": form,
                   **fit(n_out, k_in, silu, cfg, norm, residual)}
            rows.append(row)
            print(f"{n_out:6d} x {k_in:6d}{' silu' if silu else '     '} {form:14s} {row['registers']:4d} registers "
                  f"({row['programs_per_sm_by_registers']} programs an SM), {row['global_loads']} loads "
                  f"({row['loads_before_wait']} before the wait), {row['barriers']} barriers  {cfg}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"target": "sm_90a", "triton": triton.__version__, "rows": rows},
                                             indent=1) + "\n")


if __name__ == "__main__":
    main()
