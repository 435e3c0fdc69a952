"""What the tensor-parallel control channel costs per iteration (exec/tensor_group.py), over each
channel of bench/plan_channels.py (a pipe per rank, as the engine's, with a 64 KiB and a 1 MiB
buffer; a loopback TCP connection per rank, torchrun's; ZeroMQ PUB/SUB; a shared-memory ring the
ranks poll; a gloo broadcast): rank 0 packs the iteration's plan into bytes and sends it; each
rank receives it and unpacks it. Timed on the host alone (the channel never touches a device),
for plans shaped like decode iterations and a mixed one of a Llama-2-7B-sized model (4,096
positions, 16-position blocks: block tables 256 wide, sent as far as their last block).

Rank 0 sends a plan every `--gap-us` (sleeping between: a rank waits for its next plan blocked,
as it does while rank 0's iteration runs, so its wake-up is paid). Per iteration: rank 0's pack +
send time; the latency from rank 0 starting to pack to the last rank having the plan unpacked
(one-way, on CLOCK_MONOTONIC, which every process shares), and to its bytes arriving; each rank's
unpack time; the CPU time per iteration of rank 0's process and of a rank's (its wait included:
a rank that polls burns its core). Arms interleave within each of `--repeats` rounds, so the
machine's noise shows as the spread across rounds.

    python bench/plan_channel.py --ranks 1 3 --iterations 1000 --repeats 5
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from batchmaker.core.iteration_plan import IterationPlan  # noqa: E402
from bench.plan_channels import ARMS, PING, PLAN, STOP, WARM, clock, follow  # noqa: E402

SHAPES = {"decode-1 at 4096": (1, 1, 4096), "decode-64 at 1024": (64, 64, 1024),
          "decode-256 at 1024": (256, 256, 1024), "mixed-64+1984 at 4096": (64, 2048, 4096)}  # seqs, tokens, longest
WARM_UP = 50  # untimed plans before each shape's timed ones


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


def session(arm: str, ranks: int, plans: dict, iterations: int, gap_s: float) -> list[dict]:
    """Start `ranks` receiving ranks on `arm`, send each plan `iterations` times (after WARM_UP
    untimed ones), one every `gap_s`; one row per plan."""
    import multiprocessing as mp
    from multiprocessing.connection import wait
    context = mp.get_context("spawn")
    sender = ARMS[arm][0](ranks, 1 + max(len(p.to_bytes()) for p in plans.values()))
    outs, procs = [], []
    for rank in range(1, ranks + 1):
        out, back = context.Pipe(duplex=False)
        proc = context.Process(target=follow, args=(arm, sender.endpoint(rank), rank, ranks + 1, back), daemon=True)
        proc.start()
        back.close()
        outs.append(out)
        procs.append(proc)
    sender.start()
    waiting = set(outs)  # (a PUB socket drops what it sends before a rank's subscription reaches it)
    while waiting:
        sender.send(PING)
        for out in wait(list(waiting), timeout=0.01):
            out.recv_bytes()
            waiting.discard(out)
    timed = []
    for plan in plans.values():
        for _ in range(WARM_UP):
            sender.send(WARM + plan.to_bytes())
            time.sleep(gap_s)
        starts, sends = np.zeros(iterations, dtype=np.int64), np.zeros(iterations, dtype=np.int64)
        cpu = time.process_time_ns()
        for i in range(iterations):
            starts[i] = start = clock()
            sender.send(PLAN + plan.to_bytes())  # (as TensorGroup.send: a kind byte, then the plan)
            sends[i] = clock() - start
            time.sleep(gap_s)
        timed.append((starts, sends, time.process_time_ns() - cpu))
    sender.send(STOP)
    received = [out.recv() for out in outs]  # per rank: arrived, ready, cpu (ns), every timed plan in order
    for proc in procs:
        proc.join(30)
    sender.close()
    rows = []
    for k, (name, (starts, sends, cpu)) in enumerate(zip(plans, timed)):
        part = slice(k * iterations, (k + 1) * iterations)
        arrived = np.stack([r[0][part] for r in received]) - starts  # [ranks, iterations]
        ready = np.stack([r[1][part] for r in received]) - starts
        rank_cpu = [(r[2][part][-1] - r[2][part][0]) / (iterations - 1) for r in received]
        rows.append({"arm": arm, "plan": name, "other_ranks": ranks,
                     **_percentiles("send_us", sends / 1e3, (50, 90)),
                     **_percentiles("latency_us", ready.max(axis=0) / 1e3, (50, 90, 99)),
                     **_percentiles("arrival_us", arrived.max(axis=0) / 1e3, (50, 90, 99)),
                     "unpack_us_p50_per_rank": [float(np.median(x)) for x in (ready - arrived) / 1e3],
                     "cpu_us_per_iteration_rank0": cpu / iterations / 1e3,
                     "cpu_us_per_iteration_per_rank": [float(c) / 1e3 for c in rank_cpu]})
    return rows


def _percentiles(name: str, values: np.ndarray, ps: tuple) -> dict:
    return {f"{name}_p{p}": float(np.percentile(values, p)) for p in ps}


METRICS = ("send_us_p50", "send_us_p90", "latency_us_p50", "latency_us_p90", "latency_us_p99", "arrival_us_p50",
           "cpu_us_per_iteration_rank0")


def summarize(rows: list[dict]) -> list[dict]:
    """Per arm, plan and rank count: the median over repeats of each metric, with its range."""
    groups: dict = {}
    for row in rows:
        groups.setdefault((row["arm"], row["plan"], row["other_ranks"]), []).append(row)
    summary = []
    for (arm, plan, ranks), group in groups.items():
        entry = {"arm": arm, "plan": plan, "other_ranks": ranks, "repeats": len(group)}
        for metric in METRICS:
            values = [r[metric] for r in group]
            entry[metric] = statistics.median(values)
            entry[metric + "_range"] = [min(values), max(values)]
        entry["unpack_us_p50"] = statistics.median(u for r in group for u in r["unpack_us_p50_per_rank"])
        entry["cpu_us_per_iteration_rank"] = statistics.median(
            c for r in group for c in r["cpu_us_per_iteration_per_rank"])
        summary.append(entry)
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--iterations", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--gap-us", type=float, default=1000.0, help="between rank 0's sends")
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    args = ap.parse_args()
    from bench.common import write_results  # (here: the ranks' processes import this file, and need no torch)
    plans = {name: plan_of(*shape) for name, shape in SHAPES.items()}
    sizes = {}
    for name, plan in plans.items():
        data = plan.to_bytes()
        sizes[name] = {"bytes": len(data), "pack_us": min(_timed(plan.to_bytes) for _ in range(5)),
                       "unpack_us": min(_timed(lambda: IterationPlan.from_bytes(data)) for _ in range(5))}
        print(name, sizes[name], flush=True)
    rows = []
    for repeat in range(args.repeats):
        for arm in args.arms:
            for ranks in args.ranks:
                for row in session(arm, ranks, plans, args.iterations, args.gap_us / 1e6):
                    rows.append({**row, "repeat": repeat})
                    print({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    summary = summarize(rows)
    print(write_results("plan-channel", "cpu", {"plans": sizes, "gap_us": args.gap_us, "iterations": args.iterations,
                                                "summary": summary, "rows": rows},
                        plot=lambda fig: _plot(fig, summary, list(plans))))


def _plot(fig, summary: list, plans: list) -> None:
    arms = list(dict.fromkeys(s["arm"] for s in summary))
    counts = sorted({s["other_ranks"] for s in summary})
    for j, ranks in enumerate(counts):
        ax = fig.add_subplot(1, len(counts), j + 1)
        for i, arm in enumerate(arms):
            cells = [next(s for s in summary if (s["arm"], s["plan"], s["other_ranks"]) == (arm, p, ranks))
                     for p in plans]
            p50 = np.array([c["latency_us_p50"] for c in cells])
            spread = np.array([c["latency_us_p50_range"] for c in cells]).T
            ax.bar(np.arange(len(plans)) + i / (len(arms) + 1), p50, 1 / (len(arms) + 1), label=arm,
                   yerr=np.abs(spread - p50), capsize=1)
        ax.set_yscale("log")
        ax.set_xticks(np.arange(len(plans)) + 0.4, [p.split(" at")[0] for p in plans], fontsize=6)
        ax.set_title(f"to the last of {ranks} rank(s)", fontsize=8)
        ax.set_ylabel("µs, plan packed -> unpacked there (p50; bars: range of repeats)", fontsize=6)
        ax.set_ylim(top=ax.get_ylim()[1] * 8)  # (room for the legend)
        ax.legend(fontsize=5, ncol=3, loc="upper left")


def _timed(fn, n: int = 200) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


if __name__ == "__main__":
    main()
