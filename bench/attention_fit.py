"""Paged attention's tiles per head size without a GPU: compile `paged_attention_kernel` for
sm_90a (H100/H200) with Triton on the CPU and read the shared memory each launch needs and the
registers and spills ptxas reports, for every tile the planner reaches (attention_variants'
list, after attention_launch.fit_head). Where attention_launch.HEAD_STEPS comes from.

    python bench/attention_fit.py --out bench/results/attention-fit-sm90.json
    git show REV:kernels/triton_attention.py > /tmp/old_attention.py
    python bench/attention_fit.py --against /tmp/old_attention.py --heads 64 128 --out /tmp/same.json

--against compiles REV's kernel too, at power-of-two heads (at every head where REV pads heads too),
and says whether the PTX is the same (ignoring debug labels): what the padded kernel promises for
them, and the kernel without a window or a cap (`--features none`, the default). `--features
window cap both unified` compile those variants as well (issue 33: whether they still fit; unified:
split launches only); --against also compares combine_splits_kernel's PTX. Needs triton
(with its ptxas), no GPU; compile times are not launch times.

    git show de8754f:kernels/triton_attention.py > /tmp/before_windows.py
    python bench/attention_fit.py --against /tmp/before_windows.py --heads 64 80 128 256 --dtypes bf16 fp32 \
        --features none both --out bench/results/attention-fit-sm90-windows.json
    git show b9fe573:kernels/triton_attention.py > /tmp/before_unified.py
    python bench/attention_fit.py --against /tmp/before_unified.py --heads 64 80 128 256 --dtypes bf16 fp32 \
        --features none unified --out bench/results/attention-fit-sm90-unified.json
    python bench/attention_fit.py --rows 32:4 16:4 32:8 32:4:32 --heads 64 80 128 256 --dtypes bf16 fp32 \
        --out bench/results/attention-fit-sm90-row.json   # the one-row decode loop (issue 33)

Stride arguments are compiled as the runtime specializes them where the head size is a multiple of
16 (divisible by 16: 128-bit loads); before the twenty-fifth session only the pointers were, and
the register counts of the files from then may be off for it.
"""
import argparse
import importlib.util
import itertools
import json
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from batchmaker.kernels import triton_attention
from batchmaker.kernels.attention_launch import COMBINE_MAX_SPLITS, fit_head, head_pad
from batchmaker.kernels.attention_variants import launch_variants

SHARED_LIMIT = 232448  # bytes of shared memory a block may opt into on an H100/H200 (227 KB)
TARGET = GPUTarget("cuda", 90, 32)
FEATURES = {"none": (False, False, False), "window": (True, False, False), "cap": (False, True, False),
            "both": (True, True, False), "unified": (False, False, True)}  # unified: split launches only
POINTERS = {"part_out": "*fp32", "part_lse": "*fp32", "counters": "*i32", "block_tables": "*i32",
            "query_start": "*i32", "context_lens": "*i32", "work": "*i32", "part_flag": "*i8", "flags": "*i8"}
UNIFIED_ARGS = ("phi_log2", "lo_log2", "hi_log2", "part_flag", "flags")  # (None without UNIFIED)


def compile_kernel(kernel, head_dim: int, dtype: str, cfg, split: bool, combine: bool, features: str = "none"):
    """(PTX without debug labels, shared bytes) of one variant (group 1, blocks of 16), with `features`
    (FEATURES: a sliding window, a soft cap) where the kernel has them (an older one: its arguments)."""
    windowed, capped, unified = FEATURES[features]
    consts = {"G": 1, "G_PAD": 1, "D": head_dim, "D_PAD": head_pad(head_dim), "BLOCK_M": cfg.block_m,
              "BLOCK_N": cfg.block_n, "BLOCK_SIZE": 16, "IS_SPLIT": split, "COMBINE": combine, "PRECISION": "tf32",
              "WORK": False, "PDL": False, "WINDOWED": windowed, "CAPPED": capped, "UNIFIED": unified}
    return _compile(kernel, dtype, consts, {"window": windowed, "softcap_log2": capped,
                                            **{n: unified for n in UNIFIED_ARGS}}, cfg.num_warps, cfg.num_stages)


def compile_combine(kernel, head_dim: int, dtype: str, splits_pad: int, unified: bool = False):
    """(PTX without debug labels, shared bytes) of `combine_splits_kernel` (one warp, as launched)."""
    consts = {"D": head_dim, "D_PAD": head_pad(head_dim), "SPLITS_PAD": splits_pad, "PDL": False, "UNIFIED": unified}
    return _compile(kernel, dtype, consts, {"phi_log2": unified, "part_flag": unified, "flags": unified}, 1, 1)


def _compile(kernel, dtype: str, consts: dict, optional: dict, num_warps: int, num_stages: int):
    # optional: arguments passed as None (no parameter) where False
    names = kernel.arg_names
    consts = {n: v for n, v in consts.items() if n in names}
    consts |= {n: None for n, on in optional.items() if n in names and not on}
    types = {n: "constexpr" if n in consts else POINTERS.get(n, f"*{dtype}" if n in ("q", "k_cache", "v_cache", "out")
                                                                     else "fp32" if n.endswith("_log2")
                                                                     else "i32")
             for n in names}
    strided = consts.get("D", 1) % 16 == 0  # (the runtime's: the strides are multiples of the head size)
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
               if types[n].startswith("*") or (strided and n.startswith("stride"))}
    compiled = triton.compile(ASTSource(kernel, types, consts, aligned), target=TARGET,
                              options={"num_warps": num_warps, "num_stages": num_stages})
    ptx = re.sub(r"\.section\s+\.debug.*", "", compiled.asm["ptx"], flags=re.DOTALL)
    ptx = re.sub(r"^\s*(\.loc|\.file|//|\$L__tmp\d+:).*\n", "", ptx, flags=re.MULTILINE)
    return ptx, compiled.metadata.shared


def compile_row(head_dim: int, dtype: str, tile, split: bool, merge_pad: int):
    """(PTX, shared bytes) of the one-row decode loop (kernels/triton_decode_row.py) with `tile`
    (decode_row.RowTile; its positions a step as launch_rows fits them to the head), split or not,
    merging `merge_pad` (padded) slices in the kernel (0: the combine launch merges them)."""
    from batchmaker.kernels import decode_row, triton_decode_row
    block_n = decode_row.step_positions(tile, head_dim, 4 if dtype == "fp32" else 2)
    consts = {"D": head_dim, "D_PAD": head_pad(head_dim), "BLOCK_N": block_n, "BLOCK_SIZE": 16, "IS_SPLIT": split,
              "COMBINE": merge_pad > 0, "SPLITS_PAD": max(merge_pad, 1), "BF16": dtype == "bf16", "PDL": True,
              "PRELOAD": tile.preload}
    return _compile(triton_decode_row.decode_row_kernel, dtype, consts, {}, tile.num_warps, 1)


def registers(ptx: str) -> tuple[int, int]:
    """(registers a thread, spill store bytes) from ptxas -v."""
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "k.ptx").write_text(ptx)
        done = subprocess.run([str(ptxas), "-v", "--gpu-name=sm_90a", f"{tmp}/k.ptx", "-o", f"{tmp}/k.o"],
                              capture_output=True, text=True, check=True)
    return (int(re.search(r"Used (\d+) registers", done.stderr).group(1)),
            int(re.search(r"(\d+) bytes spill stores", done.stderr).group(1)))


def variants(head_dim: int, element_size: int) -> list[tuple]:
    """The distinct (tile, split, combine) launches of a model with this head (32 heads of group 1, 32K
    positions, 132 SMs)."""
    wide = head_pad(head_dim) * element_size <= 256  # (attention_launch.wide_prompt on Hopper)
    seen = {(fit_head(cfg, head_pad(head_dim), element_size), splits > 1, 1 < splits <= COMBINE_MAX_SPLITS)
            for cfg, splits, _ in launch_variants(1, 32, 32768, 132, wide)}
    return sorted(seen, key=lambda v: (v[0].block_m, v[0].block_n, v[0].num_warps, v[0].num_stages, v[1], v[2]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, nargs="+", default=[64, 80, 96, 128, 256])
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"])
    parser.add_argument("--features", nargs="+", default=["none"], choices=list(FEATURES),
                        help="compile with a sliding window and/or a soft cap too")
    parser.add_argument("--against", help="an older kernels/triton_attention.py: compare PTX at power-of-two heads "
                                           "(features none only)")
    parser.add_argument("--rows", nargs="+", default=None, metavar="BLOCK_N:WARPS[:MERGE_MAX]",
                        help="instead: the one-row decode loop's tiles (kernels/decode_row.py), unsplit, split with "
                             "the combine launch, and merging MERGE_MAX slices in the kernel")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.rows:
        return write(args, fit_rows(args))
    old = None
    if args.against:
        spec = importlib.util.spec_from_file_location("old_attention", args.against)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
    rows = []
    for head_dim, dtype, features in itertools.product(args.heads, args.dtypes, args.features):
        for cfg, split, combine in variants(head_dim, 4 if dtype == "fp32" else 2):
            if FEATURES[features][2] and not split:
                continue  # (the unified maximum runs in split launches only)
            ptx, shared = compile_kernel(triton_attention.paged_attention_kernel, head_dim, dtype, cfg, split,
                                         combine, features)
            regs, spills = registers(ptx)
            row = {"head_dim": head_dim, "dtype": dtype, "features": features, "block_m": cfg.block_m,
                   "block_n": cfg.block_n, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages, "split": split,
                   "combine": combine, "shared_bytes": shared, "fits": shared <= SHARED_LIMIT, "registers": regs,
                   "spill_bytes": spills}
            if old is not None and features == "none" and (head_pad(head_dim) == head_dim or "D_PAD" in
                                                           old.paged_attention_kernel.arg_names):
                row["same_ptx_as_against"] = compile_kernel(old.paged_attention_kernel, head_dim, dtype, cfg,
                                                            split, combine)[0] == ptx
            rows.append(row)
            print(row, flush=True)
        if old is not None and features == "none" and "D_PAD" in old.combine_splits_kernel.arg_names:
            for splits_pad in (8, 16, 32):  # the combine launch's slice counts, padded
                row = {"kernel": "combine_splits_kernel", "head_dim": head_dim, "dtype": dtype, "splits_pad": splits_pad,
                       "same_ptx_as_against": compile_combine(old.combine_splits_kernel, head_dim, dtype, splits_pad)[0]
                       == compile_combine(triton_attention.combine_splits_kernel, head_dim, dtype, splits_pad)[0]}
                rows.append(row)
                print(row, flush=True)
    write(args, rows)


def fit_rows(args) -> list[dict]:
    """--rows: each tile's registers, spills and shared memory per head and dtype, and the programs
    an SM holds by its registers (65,536 a multiprocessor, allocated 8 a thread at a time)."""
    from batchmaker.kernels.decode_row import parse_tile
    rows = []
    for head_dim, dtype, spec in itertools.product(args.heads, args.dtypes, args.rows):
        tile = parse_tile(spec)
        for split, merge_pad in ((False, 0), (True, 0), (True, 1 << (tile.merge_max - 1).bit_length())):
            ptx, shared = compile_row(head_dim, dtype, tile, split, merge_pad)
            regs, spills = registers(ptx)
            row = {"kernel": "decode_row_kernel", "head_dim": head_dim, "dtype": dtype, "tile": spec,
                   "split": split, "merge_in_kernel": merge_pad, "registers": regs, "spill_bytes": spills,
                   "shared_bytes": shared, "programs_per_sm": 65536 // (-(-regs // 8) * 8 * 32 * tile.num_warps)}
            rows.append(row)
            print(row, flush=True)
    return rows


def write(args, rows: list[dict]) -> None:
    Path(args.out).write_text(json.dumps({"command": "python bench/attention_fit.py " + " ".join(
        f"--{k} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in vars(args).items() if v),
        "triton": triton.__version__, "target": "sm_90a (compiled on the CPU)", "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
