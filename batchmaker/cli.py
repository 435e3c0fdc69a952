"""Command line: `batchmaker example` runs the built-in models in process on the shipped data."""
import argparse
import random
import statistics
import sys
import time

import torch

from batchmaker.data import wmt_sentences
from batchmaker.engine import Engine, EngineConfig
from batchmaker.registry import build_model
from batchmaker.unfolders.trees import load_sst_sample

# Small enough for a laptop CPU; the paper's sizes are hidden 1024 (bench/ uses them on the GPU).
EXAMPLE_SIZES = dict(vocab=30000, embed=128, hidden=128)


def example_requests(num: int, seed: int) -> dict[str, list[dict]]:
    rng = random.Random(seed)
    sentences = wmt_sentences(2 * num, vocab=EXAMPLE_SIZES["vocab"], seed=seed)
    trees = load_sst_sample()
    return {
        "lstm": [{"tokens": s} for s in sentences[:num]],
        "seq2seq": [{"tokens": s, "max_len": min(len(s), 50)} for s in sentences[num:]],
        "treelstm": [{"tree": rng.choice(trees)} for _ in range(num)],
    }


def run_example(args) -> int:
    device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    models = [build_model(name, **EXAMPLE_SIZES) for name in ("lstm", "seq2seq", "treelstm")]
    requests = example_requests(args.requests, args.seed)
    print(f"batchmaker example: {args.requests} requests per model, arrivals ~{args.rate:g}/s per model, on {device}")
    with Engine(models, EngineConfig(devices=(device,))) as engine:
        rng = random.Random(args.seed)
        pending = []
        start = time.perf_counter()
        for i in range(args.requests):  # Poisson arrivals, the three models interleaved
            for name in requests:
                pending.append((name, engine.submit(name, requests[name][i])))
            time.sleep(rng.expovariate(args.rate))
        results: dict[str, list] = {name: [] for name in requests}
        for n, (name, future) in enumerate(pending, 1):
            results[name].append(future.result())
            if n % 30 == 0 or n == len(pending):
                bar = "#" * (40 * n // len(pending))
                print(f"\r  [{bar:40}] {n}/{len(pending)}", end="", file=sys.stderr)
        elapsed = time.perf_counter() - start
        stats = engine.stats()
    print(file=sys.stderr)
    print(f"{'model':10} {'requests':>8} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'req/s':>8} {'mean batch':>10}")
    for name, rs in results.items():
        lat = sorted(r.timing.latency * 1e3 for r in rs)
        q = statistics.quantiles(lat, n=100)
        sizes = {int(k.rsplit(":", 1)[1]): v for k, v in stats["batch_sizes"].items() if k.startswith(name + "/")}
        mean_batch = sum(s * v for s, v in sizes.items()) / max(1, sum(sizes.values()))
        print(f"{name:10} {len(rs):8d} {q[49]:8.1f} {q[89]:8.1f} {q[98]:8.1f} {len(rs) / elapsed:8.1f} {mean_batch:10.1f}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="batchmaker", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("example", help="run the built-in models in process on the shipped data")
    ex.add_argument("--requests", type=int, default=120, help="requests per model")
    ex.add_argument("--rate", type=float, default=8.0, help="arrivals per second per model")
    ex.add_argument("--device", default=None, help="cpu or cuda:N (default: cuda:0 if present)")
    ex.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    return run_example(args)


if __name__ == "__main__":
    sys.exit(main())
