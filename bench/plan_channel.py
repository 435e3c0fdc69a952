"""What the tensor-parallel control channel costs per iteration (exec/tensor_group.py): rank 0
packs the iteration's plan into bytes and writes it down one pipe per other rank; each rank reads
it and unpacks it. Timed on the host alone (the channel never touches a device), for plans shaped
like decode iterations and a mixed one of a Llama-2-7B-sized model (4,096 positions, 16-position
blocks: block tables 256 wide, sent as far as their last block).

    python bench/plan_channel.py --ranks 1 3 --iterations 2000
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from batchmaker.core.iteration_plan import IterationPlan  # noqa: E402
from bench.common import write_results  # noqa: E402


def plan_of(seqs: int, tokens: int, longest: int, width: int = 256) -> IterationPlan:
    """`seqs` sequences of contexts up to `longest` positions: decodes, the last one a prompt chunk
    that brings the tokens to `tokens`; block tables filled as far as each context's blocks."""
    rng = np.random.default_rng(0)
    counts = np.ones(seqs, dtype=np.int64)
    counts[-1] += tokens - seqs
    starts = np.concatenate([[0], np.cumsum(counts)])
    context = rng.integers(counts, longest + 1)
    tables = rng.integers(1, 1 << 16, (seqs, width)) * (np.arange(width)[None, :] < -(-context // 16)[:, None])
    return IterationPlan.of(
        tokens=rng.integers(0, 32000, tokens), positions=rng.integers(0, longest, tokens),
        kv_slots=rng.integers(0, 1 << 20, tokens), token_slots=np.repeat(np.arange(seqs), counts), query_start=starts,
        context_lens=context, block_tables=tables,
        sample_token=starts[1:] - 1, sample_slots=np.arange(seqs), seeds=np.arange(seqs), counters=np.arange(seqs),
        top_k=np.zeros(seqs), temperature=np.zeros(seqs), top_p=np.ones(seqs), max_query_len=int(counts.max()))


def reader(pipe, done) -> None:
    count = 0
    while True:
        message = pipe.recv_bytes()
        if not message:
            break
        IterationPlan.from_bytes(message)
        count += 1
    done.send(count)


def time_pipes(plan: IterationPlan, ranks: int, iterations: int) -> dict:
    import multiprocessing as mp
    context = mp.get_context("spawn")
    pipes, acks, procs = [], [], []
    for _ in range(ranks):
        receive, send = context.Pipe(duplex=False)
        ack_receive, ack_send = context.Pipe(duplex=False)
        proc = context.Process(target=reader, args=(receive, ack_send), daemon=True)
        proc.start()
        pipes.append(send)
        acks.append(ack_receive)
        procs.append(proc)
    for _ in range(50):  # warm up
        for pipe in pipes:
            pipe.send_bytes(plan.to_bytes())
    samples = []
    for _ in range(iterations):
        start = time.perf_counter()
        message = plan.to_bytes()
        for pipe in pipes:
            pipe.send_bytes(message)
        samples.append((time.perf_counter() - start) * 1e6)
    start = time.perf_counter()
    for pipe in pipes:
        pipe.send_bytes(b"")
    received = [a.recv() for a in acks]
    drain = time.perf_counter() - start
    for proc in procs:
        proc.join()
    assert all(r == iterations + 50 for r in received)
    return {"send_us_p50": statistics.median(samples), "send_us_p90": float(np.percentile(samples, 90)),
            "drain_after_s": drain}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--iterations", type=int, default=2000)
    args = ap.parse_args()
    rows = []
    shapes = {"decode-1 at 4096": (1, 1, 4096), "decode-64 at 1024": (64, 64, 1024),
              "decode-256 at 1024": (256, 256, 1024), "mixed-64+1984 at 4096": (64, 2048, 4096)}
    for name, (seqs, tokens, longest) in shapes.items():
        plan = plan_of(seqs, tokens, longest)
        data = plan.to_bytes()
        pack = min(_timed(plan.to_bytes) for _ in range(5))
        unpack = min(_timed(lambda: IterationPlan.from_bytes(data)) for _ in range(5))
        for ranks in args.ranks:
            row = {"plan": name, "bytes": len(data), "pack_us": pack, "unpack_us": unpack, "other_ranks": ranks,
                   **time_pipes(plan, ranks, args.iterations)}
            rows.append(row)
            print(row, flush=True)
    print(write_results("plan-channel", "cpu", {"rows": rows}, plot=lambda fig: _plot(fig, rows)))


def _plot(fig, rows: list) -> None:
    ax = fig.add_subplot(111)
    plans = list(dict.fromkeys(r["plan"] for r in rows))
    for i, ranks in enumerate(sorted({r["other_ranks"] for r in rows})):
        values = [next(r["send_us_p50"] for r in rows if r["plan"] == p and r["other_ranks"] == ranks) for p in plans]
        ax.bar(np.arange(len(plans)) + 0.4 * i, values, 0.4, label=f"pack + send to {ranks} rank(s), p50")
    ax.set_xticks(np.arange(len(plans)) + 0.2, [f"{p}\n{next(r['bytes'] for r in rows if r['plan'] == p):,} B"
                                                 for p in plans], fontsize=7)
    ax.set_ylabel("µs per iteration (rank 0's host)")
    ax.legend(fontsize=8)


def _timed(fn, n: int = 200) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


if __name__ == "__main__":
    main()
