"""Multi-step fused LSTM launches (kernels/step_graphs.py): GPU time per step and host time per
launch of k-step CUDA graph replays, against the GPU-bound limit (issue 5).

    python bench/step_graphs.py           # h = embed = 1024, fp16, batches 512 64 200, k = 1 4 8
    python bench/step_graphs.py --quick   # fewer windows

Per (batch, k), each launch = padding on the host (batch 200 -> bucket 256), one pinned H2D copy
of the [k, 5, batch] index, one graph replay of k fused steps over a ping-pong pool:
  gpu_us_per_step   GPU time: a sleep kernel holds the stream while the host queues --launches
                    launches, then events around them / (launches * k) (no host gaps)
  sustained_us_per_step   the same launches queued back to back with no sleep: what one thread
                    reaches, max(host, GPU)
  host_us_per_launch      time.perf_counter around each launch() call, no sync, summed over a
                    window of --window launches (synced between windows, outside the timing);
                    median over windows
  eager_*           the same for use_graphs=False (k fused_lstm_step launches through Triton)
  limit_us_per_step nn.LSTMCell on a static input, 16 steps in a graph replayed back to back
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402
from fused_cell import graph_us  # noqa: E402

from batchmaker.cells.lstm import LSTMCell  # noqa: E402
from batchmaker.kernels.fused_lstm import LSTMWeights, reference_lstm_step  # noqa: E402
from batchmaker.kernels.step_graphs import LSTMStepGraphs  # noqa: E402

CLOCK_HZ = 2.0e9  # for torch.cuda._sleep's cycle count; only needs to be roughly right


def ping_pong_index(batch: int, num_steps: int, vocab: int, g: torch.Generator) -> tuple[torch.Tensor, int]:
    """Pinned [k, 5, batch]: step j reads row set j % 2 and writes the other; and a pool size."""
    rows = (torch.randperm(4 * batch, generator=g) + 1).view(2, 2, batch)  # [set, h/c, batch]
    index = torch.empty(num_steps, 5, batch, dtype=torch.int64)
    for j in range(num_steps):
        index[j, 0] = torch.randint(0, vocab, (batch,), generator=g)
        index[j, 1:3], index[j, 3:5] = rows[j % 2], rows[(j + 1) % 2]
    return index.pin_memory(), 4 * batch + 2  # row 4B + 1: the scratch row


def host_us(launch, window: int, windows: int) -> float:
    """Median over windows of the mean host time of one launch() call (no sync inside a window)."""
    samples = []
    for _ in range(windows):
        torch.cuda.synchronize()
        total = 0.0
        for _ in range(window):
            t0 = time.perf_counter()
            launch()
            total += time.perf_counter() - t0
        samples.append(total * 1e6 / window)
    torch.cuda.synchronize()
    return statistics.median(samples)


def gpu_us(launch, launches: int, repeats: int, hold_us: float) -> float:
    """Median µs of GPU time per launch: the stream held by a sleep kernel while the host queues
    (hold_us > 0), or launched back to back (hold_us = 0)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        if hold_us:
            torch.cuda._sleep(int(hold_us * 1e-6 * CLOCK_HZ))
        start.record()
        for _ in range(launches):
            launch()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / launches)
    return statistics.median(samples)


def measure(args, steps: LSTMStepGraphs, batch: int, num_steps: int, g) -> dict:
    index, num_rows = ping_pong_index(batch, num_steps, args.vocab, g)
    pool = (torch.randn(num_rows, args.hidden, generator=g) * 0.5).to("cuda", torch.float16)
    pool[0] = 0

    def launch():
        steps.launch(pool, index, num_steps, batch, num_rows - 1)

    launch()  # capture (graphs) or compile (eager)
    host = host_us(launch, args.window, args.windows)
    launches = args.launches if steps.use_graphs else max(4, args.launches // num_steps)
    return {"host_us_per_launch": host, "host_us_per_step": host / num_steps,
            "gpu_us_per_step": gpu_us(launch, launches, args.repeats, 2 * launches * host + 200) / num_steps,
            "sustained_us_per_step": gpu_us(launch, launches, args.repeats, 0) / num_steps}


def rel_error(steps: LSTMStepGraphs, weights: LSTMWeights, batch: int, num_steps: int, args, g) -> float:
    index, num_rows = ping_pong_index(batch, num_steps, args.vocab, g)
    pool = (torch.randn(num_rows, args.hidden, generator=g) * 0.5).to("cuda", torch.float16)
    pool[0] = 0
    got, want = pool.clone(), pool.clone()
    steps.launch(got, index, num_steps, batch, num_rows - 1)
    for step in index.cuda():
        reference_lstm_step(weights, *step, want)
    out = index[:, 3:].flatten().unique().cuda()
    return float((got[out].float() - want[out].float()).norm() / want[out].float().norm())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=30000)
    parser.add_argument("--batches", type=int, nargs="+", default=[512, 64, 200])
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 4, 8], help="k: steps per launch")
    parser.add_argument("--launches", type=int, default=64, help="launches per GPU-time sample")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--window", type=int, default=32, help="launches per host-time window")
    parser.add_argument("--windows", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="fewer samples")
    args = parser.parse_args(argv)
    if args.quick:
        args.launches, args.repeats, args.window, args.windows = 16, 3, 16, 5
    if not torch.cuda.is_available():
        print("step_graphs.py: needs a CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    cell = LSTMCell(args.vocab, args.hidden, args.hidden, seed=0, dtype=torch.float16).cuda().eval()
    weights = LSTMWeights.from_cell(cell)
    graphs, eager = LSTMStepGraphs(weights), LSTMStepGraphs(weights, use_graphs=False)
    results = {}
    with torch.inference_mode():
        for batch in args.batches:
            g = torch.Generator().manual_seed(batch)
            x = torch.randn(batch, args.hidden, generator=g).to("cuda", torch.float16)
            hc = [x.clone(), x.clone()]

            def limit():
                hc[:] = cell.lstm(x, tuple(hc))

            r = {"bucket": graphs.bucket(batch), "limit_us_per_step": graph_us(limit, 16, args.launches, x.device),
                 "rel_error_vs_reference_k8": rel_error(graphs, weights, batch, 8, args, g)}
            for k in args.steps:
                r[f"k{k}"] = measure(args, graphs, batch, k, g)
                r[f"k{k}"]["gpu_over_limit"] = r[f"k{k}"]["gpu_us_per_step"] / r["limit_us_per_step"]
                r[f"eager_k{k}"] = measure(args, eager, batch, k, g)
                print(f"B={batch:4d} k={k}  " + _row(r, k), flush=True)
            results[str(batch)] = r
    payload = {"settings": {**vars(args), "dtype": "fp16", "tf32": False}, "results": results}
    path = write_results("step_graphs", "cuda:0", payload, plot=lambda fig: _plot(fig, results, args))
    print(f"wrote {path}")
    _table(results, args)
    return 0


def _row(r: dict, k: int) -> str:
    g, e = r[f"k{k}"], r[f"eager_k{k}"]
    return (f"limit {r['limit_us_per_step']:6.2f} | graph gpu {g['gpu_us_per_step']:6.2f} µs/step "
            f"({g['gpu_over_limit']:.2f}x) sustained {g['sustained_us_per_step']:6.2f} | host/launch graph "
            f"{g['host_us_per_launch']:6.1f} eager {e['host_us_per_launch']:7.1f} µs | eager sustained "
            f"{e['sustained_us_per_step']:6.2f} µs/step")


def _table(results: dict, args) -> None:
    print("\n| B (bucket) | k | limit µs/step | graph GPU µs/step | / limit | sustained µs/step | "
          "host µs/launch (per step) | eager host µs/launch (per step) | eager sustained µs/step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for b, r in results.items():
        for k in args.steps:
            g, e = r[f"k{k}"], r[f"eager_k{k}"]
            print(f"| {b} ({r['bucket']}) | {k} | {r['limit_us_per_step']:.2f} | {g['gpu_us_per_step']:.2f} | "
                  f"{g['gpu_over_limit']:.2f} | {g['sustained_us_per_step']:.2f} | {g['host_us_per_launch']:.1f} "
                  f"({g['host_us_per_step']:.1f}) | {e['host_us_per_launch']:.1f} ({e['host_us_per_step']:.1f}) | "
                  f"{e['sustained_us_per_step']:.2f} |")


def _plot(fig, results: dict, args) -> None:
    left, right = fig.subplots(1, 2)
    for i, (b, r) in enumerate(results.items()):
        ks = args.steps
        left.plot(ks, [r[f"k{k}"]["gpu_us_per_step"] for k in ks], f"C{i}-o", label=f"B={b} graph GPU")
        left.plot(ks, [r[f"k{k}"]["sustained_us_per_step"] for k in ks], f"C{i}:x", label=f"B={b} sustained")
        left.axhline(r["limit_us_per_step"], color=f"C{i}", ls="--", lw=0.8)
        right.plot(ks, [r[f"k{k}"]["host_us_per_step"] for k in ks], f"C{i}-o", label=f"B={b} graphs")
        right.plot(ks, [r[f"eager_k{k}"]["host_us_per_step"] for k in ks], f"C{i}:s", label=f"B={b} eager")
    left.set(xlabel="steps per launch (k)", ylabel="µs per step", title="GPU per step (dashed: LSTMCell limit)")
    right.set(xlabel="steps per launch (k)", ylabel="host µs per step", yscale="log", title="host time per step")
    left.legend(fontsize=6)
    right.legend(fontsize=6)
    fig.suptitle(f"fused LSTM, k-step graphs, h={args.hidden} fp16", fontsize=9)


if __name__ == "__main__":
    sys.exit(main())
