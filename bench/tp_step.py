"""The decode step of a tensor-parallel decoder through the engine (issue 31): B sequences decoding
together from context C, each iteration timed on rank 0's stream (events around it; its
collectives wait for every rank, so it spans the group's step), against one rank's floor: the
rank's weight bytes plus the K/V bytes its step reads, over the copy bandwidth measured now.

The steps are the engine's own: requests submitted to an Engine serving the model, iterations
picked from its trace where all B sequences decode and nothing else (graphed, as served). Each
degree runs in its own engine, one after the other, in this one process and command.

    python bench/tp_step.py --preset llama-2-13b --tp 1 2 --batch 1 64 --context 512 --all-reduce auto nccl

A degree above 1 runs once per `--all-reduce` kind: `auto` (exec/one_shot.py picks, per message
size, the one-shot all-reduce or NCCL by measuring both at start-up) and `nccl` (NCCL only).

`--pp 1 2` times pipelines instead (cells/pipeline.py; `--tp` with no degree: none): a pipeline's
iterations are in flight on its stages at once, so no one iteration spans its step; timed is the
round instead, the median gap between request 0's consecutive tokens once all B decode (every
sequence through every stage once: B tokens), against one GPU's floor of the whole model.

    python bench/tp_step.py --preset llama-2-13b --tp --pp 1 2 --batch 1 64 --context 512
"""
import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import write_results  # noqa: E402
from bench.device_limits import measure as measure_limits  # noqa: E402


def step_times(engine, runner, batch: int, context: int, steps: int, vocab: int, seed: int) -> list[float]:
    """Seconds of each decode-only iteration of `batch` sequences (after the first few)."""
    rng = np.random.default_rng(seed)
    runner.trace = []
    futures = [engine.submit("llama", {"tokens": rng.integers(3, vocab, context - 1).tolist(),
                                       "max_new_tokens": steps, "ignore_eos": True}) for _ in range(batch)]
    while not all(f.done() for f in futures):
        engine.step()
    for f in futures:
        f.result(0)
    trace, runner.trace = runner.trace, None
    decodes = [r.seconds for r in trace if r.tokens == batch and r.seqs == batch and r.graphed]
    return decodes[4:]


def round_times(engine, batch: int, context: int, steps: int, vocab: int, seed: int) -> list[float]:
    """Seconds between request 0's consecutive tokens once all `batch` sequences decode (after the
    first few): a pipeline's round."""
    rng = np.random.default_rng(seed)
    stamps: dict[int, list[float]] = {i: [] for i in range(batch)}
    futures = [engine.submit("llama", {"tokens": rng.integers(3, vocab, context - 1).tolist(), "max_new_tokens": steps,
                                       "ignore_eos": True}, on_partial=lambda p, i=i: stamps[i].append(time.perf_counter()))
               for i in range(batch)]
    while not all(f.done() for f in futures):
        engine.step()
    for f in futures:
        f.result(0)
    all_decoding = max(s[0] for s in stamps.values())
    return np.diff([t for t in stamps[0] if t > all_decoding]).tolist()[4:]


def run_pipeline(args, pp: int, bandwidth: float) -> list[dict]:
    from batchmaker import Engine, EngineConfig
    from batchmaker.cells.decoder_config import PRESETS, num_parameters
    from batchmaker.registry import build_model
    start = time.perf_counter()
    model = build_model("llama", preset=args.preset, dtype="bfloat16", device="cuda:0", pipeline_parallel=pp,
                        max_seqs=max(args.batch), max_tokens=args.max_tokens, max_new_tokens=args.steps)
    engine = Engine([model], EngineConfig(devices=("cuda:0",))).start(thread=False)
    print(f"PP={pp}: built and started in {time.perf_counter() - start:.1f} s", flush=True)
    config, rows = PRESETS[args.preset], []
    try:
        runner = next(iter(engine.workers[0].iterations.values()))
        stage_bytes = sum(p.numel() * p.element_size() for p in runner.lm.parameters())  # (stage 0's)
        weight_bytes = num_parameters(config) * 2
        kv_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2
        for batch in args.batch:
            seconds = round_times(engine, batch, args.context, args.steps, config.vocab_size, args.seed)
            floor = (weight_bytes + batch * (args.context + args.steps / 2) * kv_per_token) / bandwidth
            median, q = statistics.median(seconds), np.quantile(seconds, [0.1, 0.9])
            rows.append({"pp": pp, "batch": batch, "context": args.context, "rounds_timed": len(seconds),
                         "round_ms": median * 1e3, "p10_ms": q[0] * 1e3, "p90_ms": q[1] * 1e3,
                         "one_gpu_floor_ms": floor * 1e3, "x_one_gpu_floor": median / floor,
                         "tokens_per_s": batch / median, "stage0_weight_gb": stage_bytes / 1e9,
                         "graph_iterations": runner.num_graph_iterations, "iterations": runner.num_iterations})
            print(f"{args.preset} PP={pp} B={batch} ctx={args.context}: round {median * 1e3:.2f} ms (p10 "
                  f"{q[0] * 1e3:.2f}, p90 {q[1] * 1e3:.2f}, {len(seconds)} rounds); one GPU's floor {floor * 1e3:.2f} ms "
                  f"-> {median / floor:.2f}x; {batch / median:.0f} tok/s", flush=True)
    finally:
        engine.stop()
        del engine, model
        report_freed(f"PP={pp}")
    return rows


def run_degree(args, tp: int, bandwidth: float, all_reduce: str) -> list[dict]:
    from batchmaker import Engine, EngineConfig
    from batchmaker.exec.one_shot import SIZES
    from batchmaker.registry import build_model
    start = time.perf_counter()
    model = build_model("llama", preset=args.preset, dtype="bfloat16", device="cuda:0", tensor_parallel=tp,
                        max_seqs=max(args.batch), max_tokens=args.max_tokens, max_new_tokens=args.steps,
                        one_shot=all_reduce != "nccl")
    engine = Engine([model], EngineConfig(devices=("cuda:0",))).start(thread=False)
    print(f"TP={tp} ({all_reduce}): built and started in {time.perf_counter() - start:.1f} s", flush=True)
    rows = []
    try:
        runner = next(iter(engine.workers[0].iterations.values()))
        config = runner.lm.config  # (rank 0's shard)
        one_shot = getattr(runner.lm.tp, "one_shot", None) if runner.lm.tp is not None else None
        one_shot_sizes = [n for n, win in zip(SIZES, one_shot.wins) if win] if one_shot else []
        one_shot_table = {str(k): v for k, v in one_shot.table.items()} if one_shot is not None else {}
        weight_bytes = sum(p.numel() * p.element_size() for p in runner.lm.parameters())
        kv_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2
        for batch in args.batch:
            seconds = step_times(engine, runner, batch, args.context, args.steps, model.cells["decoder"].config.vocab_size,
                                 args.seed)
            mean_context = args.context + args.steps / 2
            floor = (weight_bytes + batch * mean_context * kv_per_token) / bandwidth
            median = statistics.median(seconds)
            q = np.quantile(seconds, [0.1, 0.9])
            rows.append({"tp": tp, "all_reduce": all_reduce, "one_shot_sizes": one_shot_sizes,
                         "all_reduce_us_one_shot_vs_nccl": one_shot_table, "batch": batch, "context": args.context,
                         "steps_timed": len(seconds),
                         "step_ms": median * 1e3, "p10_ms": q[0] * 1e3, "p90_ms": q[1] * 1e3,
                         "floor_ms": floor * 1e3, "x_floor": median / floor, "tokens_per_s": batch / median,
                         "rank_weight_gb": weight_bytes / 1e9})
            print(f"{args.preset} TP={tp} {all_reduce} (one-shot at {one_shot_sizes} B) B={batch} ctx={args.context}: step {median * 1e3:.2f} ms "
                  f"(p10 {q[0] * 1e3:.2f}, p90 {q[1] * 1e3:.2f}, {len(seconds)} steps); floor {floor * 1e3:.2f} ms "
                  f"(rank weights {weight_bytes / 1e9:.1f} GB) -> {median / floor:.2f}x; {batch / median:.0f} tok/s",
                  flush=True)
    finally:
        engine.stop()
        del engine, model
        report_freed(f"TP={tp}")
    return rows


def report_freed(label: str) -> None:
    """Collect what the stopped engine left and print what the next engine will find on cuda:0
    (a leak between engines of one process shows here)."""
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(0)
    print(f"{label} stopped: cuda:0 {free / 2**30:.1f} of {total / 2**30:.1f} GiB free, "
          f"{torch.cuda.memory_allocated(0) / 2**30:.2f} GiB still allocated by torch", flush=True)


def plot(rows: list[dict], title: str):
    def draw(fig):
        ax = fig.add_subplot(111)
        labels = [f"TP={r['tp']}\n{r['all_reduce']}\nB={r['batch']}" if "tp" in r else f"PP={r['pp']}\nB={r['batch']}"
                  for r in rows]
        step = [r.get("step_ms", r.get("round_ms")) for r in rows]
        floor = [r.get("floor_ms", r.get("one_gpu_floor_ms")) for r in rows]
        x = np.arange(len(rows))
        ax.bar(x - 0.2, step, 0.4, label="step or pipeline round (median; p10-p90)",
               yerr=[[s - r["p10_ms"] for s, r in zip(step, rows)], [r["p90_ms"] - s for s, r in zip(step, rows)]])
        ax.bar(x + 0.2, floor, 0.4, label="one rank's floor (PP: one GPU's, whole model)")
        for i, (s, f) in enumerate(zip(step, floor)):
            ax.text(i - 0.2, s, f"{s / f:.2f}x", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(x, labels)
        ax.set_ylabel("ms per decode step")
        ax.set_title(title)
        ax.legend()
    return draw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-2-13b")
    ap.add_argument("--tp", type=int, nargs="*", default=[1, 2])
    ap.add_argument("--pp", type=int, nargs="*", default=[], help="pipeline degrees to time (their rounds), after --tp's")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=48, help="tokens each sequence decodes (the first 4 steps untimed)")
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--all-reduce", nargs="+", default=["auto", "nccl"], choices=["auto", "nccl"],
                    help="auto: one-shot for the messages where it measured faster at start-up; nccl: NCCL only")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    limits = measure_limits("cuda:0", torch.bfloat16)
    bandwidth = limits.copy_bytes_per_s
    print(f"{limits.device}: copy {bandwidth / 1e12:.2f} TB/s, {torch.cuda.device_count()} GPUs", flush=True)
    rows = []
    title = f"{args.preset} decode step, context {args.context}, {limits.device}"
    runs = [(tp, kind) for tp in args.tp for kind in (args.all_reduce if tp > 1 else args.all_reduce[:1])]
    runs += [(None, pp) for pp in args.pp]
    name = f"{'tp' if args.tp else 'pp'}-step-{args.preset}"
    for tp, kind in runs:  # (written after each run: a run cut short keeps what it measured)
        rows += run_degree(args, tp, bandwidth, kind) if tp is not None else run_pipeline(args, kind, bandwidth)
        path = write_results(name, "cuda:0",
                             {"preset": args.preset, "context": args.context, "steps": args.steps,
                              "device_limits": limits.as_dict(), "gpus": torch.cuda.device_count(), "rows": rows},
                             plot(rows, title))
        print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
