"""Paged attention (kernels/paged_attention.py) on the GPU: achieved HBM bandwidth against a
measured copy bandwidth and against torch SDPA on the same contexts stored densely.

    python bench/attention.py --out attention.json            # Llama-2-7B shapes, bf16, block_size 16
    python bench/attention.py --out attention.json --sweep    # also time candidate tile shapes and split counts
    python bench/attention.py --out attention.json --short-sweep  # batch-1 decode at short contexts, swept
    python bench/attention.py --out attention.json --prefill-sweep  # prompt-chunk tiles, swept
    TRITON_INTERPRET=1 python bench/attention.py --device cpu --smoke --out /tmp/a.json
                                         # a smoke run of this script on the CPU (times mean nothing)
    python bench/attention.py --out gemma2.json --heads 16 --kv-heads 8 --head-dim 256 \
        --window 4096 --softcap 50 --contexts 2048 8192  # Gemma 2 9B's local layers (issue 33)
    python bench/attention.py --out fdpp.json --unified-max   # decode: exact against a unified maximum (issue 33)
    python bench/attention.py --out row.json --row-tiles off 32:4 16:4   # each decode shape with the one-row
                                         # loop off and with each tile in turn (kernels/decode_row.py; G = 1)
    python bench/attention.py --out long.json --long-sweep --long-tiles 64:4:2 row:32:4 row:32:4:32
                                         # split counts x tiles, the row loop's as row:BLOCK_N:WARPS[:MERGE_MAX]

--unified-max: decode at batches 1-256 and contexts 256-32K (at most --max-tokens positions in all),
each launch as paged_attention plans it, timed exact, with a unified maximum (--phi, the scores'
units: 0 suits these random scores, all inside its window) and with a phi that every row leaves
(every slice walked twice: the fallback's worst case); `unified` says whether the plan split (the
unified maximum runs in split launches only; unsplit rows are the same launch twice).

Decode: batch B of one new token per sequence, every sequence with the same context length.
Ceilings: a large copy (read + write bytes) and a large sum (read bytes), measured in the same run.
Prefill: chunks of --chunk new tokens at the end of their context. Bytes counted: K and V of every
attended position (read once; with --window, of those the windows reach) plus q and out; split-KV
partials are overhead, not counted. With --window or --softcap there is no SDPA comparison.
Every variant runs `--calls` calls captured in one CUDA graph and replayed; each call reads its own
copy of the cache blocks (rotating block tables, enough copies for > 4x the L2 cache), so small
contexts are not served from L2. µs per call = median over 5 timed windows.
"""
import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from batchmaker.kernels import decode_row
from batchmaker.kernels.attention_launch import fit_head, head_pad, window_bound
from batchmaker.kernels.paged_attention import AttentionConfig, paged_attention, pick_launch, wide_prompt

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import replay_windows  # noqa: E402

L2_BYTES = 64 << 20  # at least the H100's 50 MB and the H200's 60 MB


class Contexts:
    """`batch` sequences of `ctx` positions with `n` new queries each, in `copies` disjoint sets of
    shuffled cache blocks (call i reads set i % copies), and the same contexts dense for SDPA."""

    def __init__(self, batch, ctx, n, args, device, dense: bool, lens: list[int] | None = None):
        """`lens`: each sequence's own context (decode, no dense copy), `ctx` then only bounds them."""
        self.batch, self.ctx, self.n, self.lens = batch, ctx, n, lens
        heads, kv_heads, dim, bs, dtype = args.heads, args.kv_heads, args.head_dim, args.block_size, args.dtype
        blocks_per_seq = -(-ctx // bs)
        self.window, self.softcap = args.window, args.softcap  # (None: none)
        reach = ctx if args.window is None else min(ctx, args.window + n - 1)  # positions a sequence's tiles read
        self.kv_bytes = 2 * sum(min(c, reach) for c in lens or [ctx] * batch) * kv_heads * dim * dtype.itemsize
        self.copies = max(1, min(args.calls, math.ceil(4 * L2_BYTES / self.kv_bytes)))
        num_blocks = 1 + self.copies * batch * blocks_per_seq
        self.k_cache = torch.empty(num_blocks, bs, kv_heads, dim, dtype=dtype, device=device).normal_()
        self.v_cache = torch.empty_like(self.k_cache).normal_()
        order = torch.randperm(num_blocks - 1, device=device).int() + 1
        self.tables = order.view(self.copies, batch, blocks_per_seq)
        self.q = torch.randn(batch * n, heads, dim, dtype=dtype, device=device)
        self.out = torch.empty_like(self.q)
        self.query_start = torch.arange(0, batch * n + 1, n, dtype=torch.int32, device=device)
        self.context_lens = torch.tensor(lens or [ctx] * batch, dtype=torch.int32, device=device)
        self.scale = dim ** -0.5
        self.dense = None
        if dense:  # [copies, B, Hkv, ctx, D] (as a decoder layer holding its own K/V would have them)
            shape = (self.copies, batch, kv_heads, ctx, dim)
            self.dense = (torch.empty(shape, dtype=dtype, device=device).normal_(),
                          torch.empty(shape, dtype=dtype, device=device).normal_())
            self.dense_q = self.q.view(batch, n, heads, dim).transpose(1, 2)  # [B, H, n, D]

    def paged(self, i: int, **kw) -> None:
        features = {k: v for k, v in (("window", self.window), ("softcap", self.softcap)) if v is not None}
        paged_attention(self.q, self.k_cache, self.v_cache, self.tables[i % self.copies], self.query_start,
                        self.context_lens, self.n, self.scale, self.out, max_context_len=self.ctx, **features, **kw)

    def sdpa(self, i: int) -> None:
        k, v = self.dense[0][i % self.copies], self.dense[1][i % self.copies]
        F.scaled_dot_product_attention(self.dense_q, k, v, attn_mask=self.causal_mask(),
                                       enable_gqa=k.shape[1] != self.dense_q.shape[1])

    def causal_mask(self):
        if self.n == 1:
            return None
        from torch.nn.attention.bias import causal_lower_right
        return causal_lower_right(self.n, self.ctx)  # query i at ctx - n + i

    @property
    def bytes(self) -> int:
        return self.kv_bytes + 2 * self.q.numel() * self.q.itemsize  # each position's K/V once per kv head

    @property
    def flops(self) -> float:
        # 2 dots of 2 * D flops per (query, attended key, head); query i attends ctx - n + i + 1 keys (at
        # most the window's); decode with `lens`: each sequence's one query its own context
        window = self.window or self.ctx
        keys = sum(min(c - self.n + i + 1, window) for c in self.lens or [self.ctx] * self.batch for i in range(self.n))
        return 4 * keys * self.q.shape[1] * self.q.shape[2]


def time_us(call, calls: int, device) -> float:
    """Median µs per call(i), i = 0 .. calls - 1 run back to back in one CUDA graph."""
    if device.type != "cuda":  # smoke runs: eager wall time
        t0 = time.perf_counter()
        for i in range(calls):
            call(i)
        return (time.perf_counter() - t0) * 1e6 / calls
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        for i in range(2):
            call(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(i)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    replays = max(1, math.ceil(5.0 / max(start.elapsed_time(end), 1e-3)))  # ~5 ms windows
    return statistics.median(replay_windows(graph, calls, replays, warm=0))


def copy_bandwidth(device, nbytes: int = 2 << 30) -> float:
    """GB/s of a large device copy (read + write)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / time_us(lambda i: dst.copy_(src), 4, device) / 1e3


def read_bandwidth(device, nbytes: int = 2 << 30) -> float:
    """GB/s of a large device reduction: what a kernel that only reads (as attention does) can reach.
    (On an H200 a copy reached 2.7 TB/s while decode attention read at 4.5.)"""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    return nbytes / time_us(lambda i: src.sum(), 4, device) / 1e3


def measure(ctxs: Contexts, args, device, ceilings: dict, **kw) -> dict:
    us = time_us(lambda i: ctxs.paged(i, **kw), args.calls, device)
    gbps = ctxs.bytes / us / 1e3
    record = {"batch": ctxs.batch, "context": ctxs.ctx, "query_len": ctxs.n, "us": round(us, 2),
              "GBps": round(gbps, 1), "of_copy": round(gbps / ceilings["copy"], 3),
              "of_read": round(gbps / ceilings["read"], 3),
              "TFLOPs": round(ctxs.flops / us / 1e6, 1), "kv_MB": round(ctxs.kv_bytes / 2 ** 20, 1)}
    if ctxs.dense is not None:
        sdpa_us = time_us(ctxs.sdpa, args.calls, device)
        record.update(sdpa_us=round(sdpa_us, 2), sdpa_GBps=round(ctxs.bytes / sdpa_us / 1e3, 1),
                      vs_sdpa=round(sdpa_us / us, 2))
    return record


def auto_choice(ctxs: Contexts, args, device) -> dict:
    """The tile shape and split count paged_attention picks for these contexts (what the record shows)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    wide = wide_prompt(device, head_pad(args.head_dim) * args.dtype.itemsize)  # (as paged_attention picks)
    cfg, num_splits = pick_launch(ctxs.batch, args.kv_heads, args.heads // args.kv_heads, ctxs.n,
                                  window_bound(ctxs.ctx, ctxs.window, ctxs.n), sms, wide=wide)
    cfg = fit_head(cfg, head_pad(args.head_dim), args.dtype.itemsize)
    return {"config": [cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages], "num_splits": num_splits}


def sweep(args, device, ceilings: dict) -> list[dict]:
    """Decode tile shapes (block_n, warps, stages) on few long sequences (split-KV) and many
    medium ones, and split counts on one long sequence."""
    rows = []
    for batch, ctx in ((1, 32768), (8, 32768), (64, 4096)):
        ctxs = Contexts(batch, ctx, 1, args, device, dense=False)
        for block_n, warps, stages in ((32, 4, 3), (64, 4, 3), (64, 2, 3), (128, 4, 3), (128, 4, 4), (128, 8, 3)):
            cfg = AttentionConfig(16, block_n, warps, stages)
            rows.append({**measure(ctxs, args, device, ceilings, config=cfg), **auto_choice(ctxs, args, device),
                         "config": [16, block_n, warps, stages]})
        for splits in (8, 16, 32) if batch == 1 else ():
            rows.append({**measure(ctxs, args, device, ceilings, num_splits=splits), "num_splits": splits})
        del ctxs
    return rows


def short_sweep(args, device, ceilings: dict, shapes=((1, 360), (1, 1024), (1, 2048)),
                splits_swept=(1, 2, 3, 4, 6, 8),
                configs=((32, 4, 3), (64, 4, 3), (64, 2, 3), (128, 4, 3), (128, 8, 3), (64, 4, 2))) -> list[dict]:
    """Batch-1 decode at short contexts (latency-bound: a few µs of K/V per layer), or the `shapes`
    (batch, context) given: every split count and decode tile shape, against the automatic choice and SDPA."""
    rows, default = [], decode_row.ROW_DECODE
    for batch, ctx in shapes:
        ctxs = Contexts(batch, ctx, 1, args, device, dense=True)
        decode_row.ROW_DECODE = default  # (the automatic choice's)
        rows.append({**measure(ctxs, args, device, ceilings), **auto_choice(ctxs, args, device), "auto": True})
        ctxs.dense = None
        for splits in splits_swept:
            for tile in configs:  # (BLOCK_N, WARPS, STAGES) of the tiled kernel, or ("row", BLOCK_N, WARPS)
                if tile[0] == "row":
                    decode_row.ROW_DECODE, kw = decode_row.RowTile(*tile[1:]), {}
                else:
                    kw = {"config": AttentionConfig(16, *tile)}
                rows.append({**measure(ctxs, args, device, ceilings, num_splits=splits, **kw),
                             "config": [16, *tile] if kw else list(tile), "num_splits": splits})
        del ctxs
    return rows


def ragged_sweep(args, device, ceilings: dict) -> list[dict]:
    """Decode batches whose contexts differ, as a chat run's do (log-normal around 800 positions,
    32-4,000), under the bound a long-context decode graph is captured with (4,096): split counts and
    unsplit tiles against the automatic choice. Bytes count each sequence's own positions."""
    import numpy as np
    rows = []
    for batch in (8, 16, 32, 64, 128):
        draw = np.random.default_rng(batch).lognormal(np.log(800), 0.8, batch)
        lens = [int(x) for x in np.clip(draw, 32, 4000)]
        ctxs = Contexts(batch, 4096, 1, args, device, dense=False, lens=lens)
        shape = {"mean_context": round(sum(lens) / batch), "max_context": max(lens)}
        rows.append({**measure(ctxs, args, device, ceilings), **auto_choice(ctxs, args, device), **shape, "auto": True})
        for splits in (1, 2, 3, 4, 6, 8):
            for block_n, warps, stages in ((64, 2, 3), (128, 4, 3), (64, 4, 2), (64, 4, 3)):
                cfg = AttentionConfig(16, block_n, warps, stages)
                rows.append({**measure(ctxs, args, device, ceilings, config=cfg, num_splits=splits), **shape,
                             "config": [16, block_n, warps, stages], "num_splits": splits})
        del ctxs
    return rows


UNIFIED_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
UNIFIED_CONTEXTS = (256, 1024, 4096, 16384, 32768)
FAR_PHI = 1000.0  # every row's scores far below it: every slice flagged and walked again


def unified_ab(args, device, ceilings: dict) -> list[dict]:
    """Decode with the exact split-KV merge against FlashDecoding++'s unified maximum (issue 33):
    us of each, exact_us / unified_us, and the all-flagged worst case, per (batch, context)."""
    from batchmaker.kernels.unified_max import runs_unified
    rows = []
    batches, contexts = (args.batches, args.contexts) if args.smoke else (UNIFIED_BATCHES, UNIFIED_CONTEXTS)
    for batch in batches:
        for ctx in contexts:
            if batch * ctx > args.max_tokens:
                continue
            ctxs = Contexts(batch, ctx, 1, args, device, dense=False)
            choice = auto_choice(ctxs, args, device)
            exact = measure(ctxs, args, device, ceilings)
            unified = measure(ctxs, args, device, ceilings, unified_max=args.phi)
            flagged = measure(ctxs, args, device, ceilings, unified_max=FAR_PHI)
            rows.append({**exact, **choice, "unified": runs_unified(args.phi, 1, choice["num_splits"], None),
                         "unified_us": unified["us"], "unified_GBps": unified["GBps"],
                         "exact_over_unified": round(exact["us"] / unified["us"], 3),
                         "all_flagged_us": flagged["us"]})
            print("unified", rows[-1], flush=True)
            del ctxs
    return rows


LONG_SHAPES = ((1, 16384), (1, 32768), (2, 16384), (2, 32768), (4, 8192), (4, 32768), (8, 16384))  # issue 33: decode
# at 8K-32K read 0.90-0.94 of the read bandwidth at batches 1-4 (8 programs an SM: 32, 17 and 9 slices) and
# 0.95-0.985 at 8-16 (more programs an SM; H100, attention-fdpp-…): slices past MAX_SPLITS, swept
LONG_SPLITS = (8, 16, 32, 48, 64, 96, 128)
MID_SHAPES = ((2, 1024), (4, 512), (4, 2048), (8, 512), (8, 1024), (8, 4096), (8, 16384), (16, 512), (16, 1024),
              (16, 4096), (32, 512), (32, 1024), (64, 1024), (64, 4096))  # a chat run's decode batches


PREFILL_CONFIGS = ((64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 4), (128, 32, 8, 3),
                   (64, 128, 4, 3), (128, 128, 8, 2), (64, 64, 4, 4))


def prefill_sweep(args, device, ceilings: dict) -> list[dict]:
    """Prompt-chunk tiles (block_m, block_n, warps, stages) on the chunks a saturated chat run
    prefills (a 2,048-token iteration: prefill attention took ~25% of its GPU time at ~200
    TFLOP/s, H200), against the automatic choice: TFLOP/s of each."""
    rows = []
    shapes = ((1, 64, 48), (2, 40, 24)) if args.smoke else ((1, 2048, 2048), (4, 2048, 512), (1, 4096, 1024))
    for batch, ctx, chunk in shapes:
        ctxs = Contexts(batch, ctx, chunk, args, device, dense=False)
        rows.append({**measure(ctxs, args, device, ceilings), **auto_choice(ctxs, args, device), "auto": True})
        for block_m, block_n, warps, stages in PREFILL_CONFIGS[:2] if args.smoke else PREFILL_CONFIGS:
            cfg = AttentionConfig(block_m, block_n, warps, stages)
            rows.append({**measure(ctxs, args, device, ceilings, config=cfg, num_splits=1),
                         "config": [block_m, block_n, warps, stages]})
        del ctxs
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    parser.add_argument("--max-tokens", type=int, default=1 << 19, help="skip decode shapes with batch x context above")
    parser.add_argument("--chunk", type=int, default=512, help="new tokens per sequence of a prefill chunk")
    parser.add_argument("--prefill", nargs="+", default=["1:512", "1:4096", "1:16384", "4:4096"],
                        help="batch:context of the prefill chunks")
    parser.add_argument("--calls", type=int, default=16, help="calls per captured graph")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--short-sweep", action="store_true", help="only batch-1 decode at short contexts, swept")
    parser.add_argument("--prefill-sweep", action="store_true", help="only prompt-chunk tiles, swept")
    parser.add_argument("--mid-sweep", action="store_true", help="only decode batches of 2-64 at 512-16,384 positions, swept")
    parser.add_argument("--ragged-sweep", action="store_true", help="only decode batches of differing contexts, swept")
    parser.add_argument("--long-sweep", action="store_true", help="only decode batches of 1-8 at 8K-32K positions, "
                                                                  "split 8-128 ways (LONG_SPLITS)")
    parser.add_argument("--long-shapes", nargs="+", default=None, metavar="BATCH:CONTEXT",
                        help="--long-sweep over these shapes (default LONG_SHAPES)")
    parser.add_argument("--long-splits", type=int, nargs="+", default=None, help="--long-sweep's split counts")
    parser.add_argument("--long-tiles", nargs="+", default=None, metavar="BLOCK_N:WARPS:STAGES",
                        help="--long-sweep's decode tiles (default 64:4:2 64:4:3 128:4:3; row:BLOCK_N:WARPS: the "
                             "one-row loop's, kernels/decode_row.py)")
    parser.add_argument("--row-tiles", nargs="+", default=None, metavar="BLOCK_N:WARPS",
                        help="decode shapes with each of these one-row loop tiles in turn ('off': the tiled kernel; "
                             "kernels/decode_row.py; the row loop runs where G = 1)")
    parser.add_argument("--window", type=int, help="a sliding window (issue 33); no SDPA comparison then")
    parser.add_argument("--softcap", type=float, help="soft-capped scores (issue 33); no SDPA comparison then")
    parser.add_argument("--unified-max", action="store_true",
                        help="only decode, exact against a unified maximum (issue 33), batches 1-256 x 256-32K")
    parser.add_argument("--phi", type=float, default=0.0, help="--unified-max's phi (the scores' units)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter check of this script)")
    args = parser.parse_args(argv)
    args.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    device = torch.device(args.device)
    if args.smoke:
        args.heads, args.kv_heads, args.head_dim, args.batches, args.contexts = 4, 2, 32, [1, 3], [40, 70]
        args.chunk, args.prefill, args.calls = 16, ["1:16", "2:50"], 2
    torch.manual_seed(0)
    nbytes = 1 << 20 if args.smoke else 2 << 30
    ceilings = {"copy": copy_bandwidth(device, nbytes), "read": read_bandwidth(device, nbytes)}
    print(f"copy: {ceilings['copy']:.0f} GB/s, read: {ceilings['read']:.0f} GB/s", flush=True)
    decode, prefill = [], []
    plain = args.window is None and args.softcap is None  # (SDPA has neither: compared without them only)
    if args.short_sweep or args.prefill_sweep or args.mid_sweep or args.ragged_sweep or args.unified_max or \
            args.long_sweep:
        args.batches, args.prefill = ([1, 3], []) if args.smoke and args.unified_max else ([], [])
    for batch in args.batches:
        for ctx in args.contexts:
            if batch * ctx > args.max_tokens:
                continue
            ctxs = Contexts(batch, ctx, 1, args, device, dense=plain)
            for tile in args.row_tiles or [None]:  # (interleaved: the same contexts, one after the other)
                if tile is not None:
                    decode_row.ROW_DECODE = decode_row.parse_tile(tile)
                decode.append({**measure(ctxs, args, device, ceilings), **auto_choice(ctxs, args, device),
                               "row_tile": repr(decode_row.ROW_DECODE)})
                print("decode", decode[-1], flush=True)
                ctxs.dense = None  # (SDPA once a shape)
            del ctxs
    for spec in args.prefill:
        batch, ctx = map(int, spec.split(":"))
        ctxs = Contexts(batch, ctx, args.chunk, args, device, dense=plain)
        prefill.append({**measure(ctxs, args, device, ceilings), **auto_choice(ctxs, args, device)})
        print("prefill", prefill[-1], flush=True)
        del ctxs
    record = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "command": " ".join(sys.argv), "dtype": str(args.dtype),
              "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
              "block_size": args.block_size, "window": args.window, "softcap": args.softcap, "copy_GBps": round(ceilings["copy"], 1),
              "read_GBps": round(ceilings["read"], 1), "decode": decode, "prefill": prefill}
    if args.unified_max:
        record["phi"] = args.phi
        record["sweep"] = unified_ab(args, device, ceilings)
    elif args.mid_sweep:
        record["sweep"] = short_sweep(args, device, ceilings, MID_SHAPES, (1, 2, 4, 8))
    elif args.ragged_sweep:
        record["sweep"] = ragged_sweep(args, device, ceilings)
    elif args.long_sweep:
        shapes = [tuple(map(int, x.split(":"))) for x in args.long_shapes] if args.long_shapes else LONG_SHAPES
        tiles = [tuple(int(v) if v.isdigit() else v for v in x.split(":")) for x in args.long_tiles] \
            if args.long_tiles else \
            ((64, 4, 2), (64, 4, 3), (128, 4, 3))
        record["sweep"] = short_sweep(args, device, ceilings, shapes, args.long_splits or LONG_SPLITS, tiles)
    elif args.sweep or args.short_sweep or args.prefill_sweep:
        record["sweep"] = (short_sweep if args.short_sweep else prefill_sweep if args.prefill_sweep else sweep)(
            args, device, ceilings)
    for row in record.get("sweep", []):
        print("sweep", row, flush=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
