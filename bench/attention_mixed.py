"""Paged attention over a mixed batch (decodes beside prompt chunks, one iteration's layer):
one launch over every sequence against the work lists' two launches (kernels/attention_work.py),
the work lists with each chunk's tiles in ascending order (before: the longest last) against the
default (the longest first), and the decodes and the chunks each alone. Floor: the K/V bytes read
over the copy bandwidth.

    python bench/attention_mixed.py --device cuda:0     # Llama-2-7B heads, bf16, block size 16

Each variant runs 10 calls captured in one CUDA graph; µs per call = the median of 5 replays.
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from batchmaker.kernels.attention_work import capacity, work_lists  # noqa: E402
from batchmaker.kernels.paged_attention import paged_attention  # noqa: E402
from bench.common import captured, write_results  # noqa: E402

CASES = [  # decodes, their context, chunks, chunk tokens, the chunks' context
    (128, 1024, 1, 300, 800), (128, 1024, 1, 1500, 1500), (200, 1000, 1, 440, 600), (64, 1500, 2, 512, 1024),
    (256, 600, 1, 200, 400), (32, 1000, 1, 1900, 1900), (200, 1000, 1, 16, 1000), (100, 2000, 3, 100, 2000),
    (8, 1024, 1, 64, 64), (16, 500, 1, 2000, 2000), (64, 1000, 2, 1000, 1500), (180, 900, 1, 1850, 1850)]


def graph_us(call, calls: int = 10) -> float:
    graph = captured(call, calls)
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[2]


def case(decodes, decode_ctx, chunks, chunk, chunk_ctx, args) -> dict:
    device, dtype, heads, dim, bs = args.device, torch.bfloat16, args.heads, args.head_dim, args.block_size
    lens, ctxs = [1] * decodes + [chunk] * chunks, [decode_ctx] * decodes + [chunk_ctx] * chunks
    widths = [-(-c // bs) for c in ctxs]
    k_cache = torch.randn(1 + sum(widths), bs, heads, dim, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    order = (torch.randperm(sum(widths), device=device) + 1).int()
    tables = torch.zeros(len(lens), max(widths), dtype=torch.int32, device=device)
    for s, first in enumerate(torch.tensor([0] + widths).cumsum(0)[:-1].tolist()):
        tables[s, :widths[s]] = order[first:first + widths[s]]
    num_tokens = sum(lens)
    q = torch.randn(num_tokens, heads, dim, dtype=dtype, device=device)
    out = torch.empty_like(q)
    starts = torch.tensor([0] + lens).cumsum(0)
    query_start, context_lens = starts.int().to(device), torch.tensor(ctxs, dtype=torch.int32, device=device)
    bound, scale = max(ctxs), dim ** -0.5
    graphed = capacity(num_tokens, len(lens), 1, chunk)
    lists = {name: tuple(torch.from_numpy(x).to(device) for x in work_lists(starts.numpy(), num_tokens, 1, chunk, sizes))
             for name, sizes in (("exact", None), ("padded", graphed))}
    d = decodes

    def run(q, tables, query_start, context_lens, n, bound, work=None, out=out):
        return lambda: paged_attention(q, k_cache, v_cache, tables, query_start, context_lens, n, scale, out,
                                       max_context_len=bound, work=work)
    small, large = lists["exact"]
    ascending = (small, large.sort().values)  # (each sequence's tiles from its first: the order before)
    variants = {"one_launch": run(q, tables, query_start, context_lens, chunk, bound),
                "work_lists": run(q, tables, query_start, context_lens, chunk, bound, lists["exact"]),
                "work_lists_ascending": run(q, tables, query_start, context_lens, chunk, bound, ascending),
                "work_lists_padded": run(q, tables, query_start, context_lens, chunk, bound, lists["padded"]),
                "decodes_alone": run(q[:d], tables[:d], query_start[:d + 1], context_lens[:d], 1, decode_ctx, out=out[:d]),
                "chunks_alone": run(q[d:], tables[d:], query_start[d:] - d, context_lens[d:], chunk, chunk_ctx,
                                    out=out[d:])}
    variants["one_launch"]()
    want = out.clone()
    variants["work_lists_padded"]()
    record = {"decodes": decodes, "decode_context": decode_ctx, "chunks": chunks, "chunk_tokens": chunk,
              "chunk_context": chunk_ctx, "max_abs_diff": float((out.float() - want.float()).abs().max()),
              "floor_us": sum(ctxs) * heads * dim * 2 * dtype.itemsize / args.bandwidth * 1e6}
    record.update({f"{name}_us": graph_us(call) for name, call in variants.items()})
    record["speedup"] = record["one_launch_us"] / record["work_lists_us"]
    record["longest_first_speedup"] = record["work_lists_ascending_us"] / record["work_lists_us"]
    return record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--bandwidth", type=float, default=4.23e12, help="copy bandwidth (bytes/s) for the floor")
    args = ap.parse_args()
    rows = []
    for c in CASES:
        rows.append(case(*c, args))
        print({k: round(v, 1) if isinstance(v, float) else v for k, v in rows[-1].items()}, flush=True)

    def plot(fig):
        ax = fig.add_subplot(1, 1, 1)
        x = range(len(rows))
        for name in ("one_launch", "work_lists", "floor"):
            ax.plot(x, [r[f"{name}_us"] for r in rows], marker="o", label=name)
        ax.set_xticks(list(x), [f"{r['decodes']}x{r['decode_context']}+{r['chunks']}x{r['chunk_tokens']}" for r in rows],
                      rotation=45, fontsize=7)
        ax.set_ylabel("µs per layer")
        ax.legend()
        ax.set_title("mixed batch attention: decodes + prompt chunks (bf16)")
    print(write_results("attention-mixed", args.device, {"rows": rows}, plot), flush=True)


if __name__ == "__main__":
    main()
