"""Where a saturated chat run's GPU time goes against three bounds, from the per-iteration trace that
bench/chat.py records (tokens, context positions, attention pairs, graphed or not, ms):

- roofline: max(bytes / bandwidth, FLOPs / matmul peak) per iteration (the issue's definition;
  bytes = weights + every context position's K/V, FLOPs = projections + attention pairs);
- ideal serial: the projections at the peak (or the weights at the bandwidth), then the K/V reads at
  the bandwidth, one after the other (nothing overlaps);
- practical serial: the same with each part at the best this GPU measured for it: projections at
  `--matmul` FLOP/s (cuBLAS on prompt chunks) or the weights at `--weights` B/s (the GEMV and skinny
  kernels), K/V at `--kv-fraction` of the bandwidth (paged attention at long contexts), attention
  pairs at `--attention` FLOP/s (the prompt tiles).

    python bench/trace_bounds.py bench/results/chat-llama-2-7b-budget2048-NVIDIA-H200-2026-11-23-twelfth-final.json

Prints per rate, and per kind of iteration (graphed or eager, by tokens), measured seconds against each.
"""
import argparse
import collections
import json

KV_BYTES_PER_POSITION = 32 * 2 * 4096 * 2  # Llama-2-7B, bf16: layers x (K, V) x hidden x bytes
PAIR_FLOPS = 4 * 32 * 4096  # q.k and p.v per (query, position) pair, every layer


def bounds(params: int, tokens: int, context: int, pairs: int, args) -> tuple[float, float, float]:
    """(roofline, ideal serial, practical serial) seconds of one iteration."""
    weights, kv = 2 * params, context * KV_BYTES_PER_POSITION
    flops = 2 * params * tokens
    roofline = max((weights + kv) / args.bandwidth, (flops + PAIR_FLOPS * pairs) / args.peak)
    ideal = max(weights / args.bandwidth, flops / args.peak) + kv / args.bandwidth
    practical = (max(weights / args.weights, flops / args.matmul) + kv / (args.kv_fraction * args.bandwidth)
                 + PAIR_FLOPS * pairs / args.attention)
    return roofline, ideal, practical


def kind(graphed: int, tokens: int) -> str:
    size = next((f"<= {n:4}" for n in (16, 64, 256, 1024) if tokens <= n), ">  1024")
    return f"{'graphed' if graphed else 'eager'} {size} tokens"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("result", help="a bench/chat.py JSON")
    ap.add_argument("--bandwidth", type=float, default=4.23e12, help="copy bandwidth, B/s (the roofline's)")
    ap.add_argument("--peak", type=float, default=805e12, help="bf16 matmul peak, FLOP/s (the roofline's)")
    ap.add_argument("--matmul", type=float, default=705e12, help="cuBLAS on 2,048-token chunks (eleventh profile)")
    ap.add_argument("--weights", type=float, default=3.9e12, help="weight streaming of the one-token and skinny kernels")
    ap.add_argument("--kv-fraction", type=float, default=0.9, help="paged attention's K/V reads, of the bandwidth")
    ap.add_argument("--attention", type=float, default=330e12, help="prompt tiles' attention pairs, FLOP/s")
    args = ap.parse_args()
    record = json.load(open(args.result))
    params = record["parameters"]
    for row in record["rows"]:
        trace = row["trace"]
        per_kind = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0])
        for tokens, context, pairs, graphed, ms in zip(*(trace[k] for k in ("tokens", "context", "pairs", "graphed", "ms"))):
            totals = per_kind[kind(graphed, tokens)]
            totals[0] += 1
            totals[1] += ms / 1e3
            for i, seconds in enumerate(bounds(params, tokens, context, pairs, args)):
                totals[2 + i] += seconds
        run = [sum(t[i] for t in per_kind.values()) for i in range(5)]
        print(f"rate {row['rate']}: {run[0]} iterations, {run[1]:.2f} s on the GPU; roofline {run[2]:.2f} s "
              f"({run[2] / run[1]:.3f} of it), ideal serial {run[3]:.2f} s ({run[2] / run[3]:.3f} of it is the roofline), "
              f"practical serial {run[4]:.2f} s (measured at {run[4] / run[1]:.3f} of it; roofline / practical "
              f"{run[2] / run[4]:.3f})")
        for name, (n, measured, roofline, ideal, practical) in sorted(per_kind.items()):
            print(f"  {name:24} {n:5} iterations {measured:6.2f} s  roofline {roofline:6.2f}  ideal serial {ideal:6.2f}"
                  f"  practical {practical:6.2f}  over practical {1e3 * (measured - practical) / n:5.2f} ms each")


if __name__ == "__main__":
    main()
