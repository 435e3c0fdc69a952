"""Pipeline and tensor parallelism on CPU processes (issue 31): the same requests served by one
process, by two pipeline stages (ORCA's pipeline: two iterations in flight on disjoint sequences)
and by two tensor-parallel ranks, each process on one torch thread, repeats interleaved. Tokens/s
of the whole batch (all requests at once), with the tokens checked equal to one process's.

    python bench/parallel_cpu.py --requests 48 --prompt 48 --new 32 --repeats 3
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import write_results  # noqa: E402

SYSTEMS = {"one process": {}, "pipeline 2": {"pipeline_parallel": 2}, "tensor 2": {"tensor_parallel": 2}}


def run(system: str, args, requests: list) -> tuple[float, list]:
    from batchmaker import Engine, EngineConfig
    from batchmaker.registry import build_model
    model = build_model("llama", preset=args.preset, seed=0, max_tokens=args.max_tokens, max_seqs=args.requests,
                        **SYSTEMS[system])
    engine = Engine([model], EngineConfig(cpu_threads=1)).start()
    try:
        engine.submit("llama", {"tokens": [1, 2, 3], "max_new_tokens": 2}).result(120)  # (warm)
        start = time.perf_counter()
        futures = [engine.submit("llama", r) for r in requests]
        tokens = [f.result(600).outputs["tokens"] for f in futures]
        return time.perf_counter() - start, tokens
    finally:
        engine.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small-llama")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--prompt", type=int, default=48)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    requests = [{"tokens": rng.integers(3, 4000, args.prompt).tolist(), "max_new_tokens": args.new,
                 "ignore_eos": True} for _ in range(args.requests)]
    seconds = {s: [] for s in SYSTEMS}
    reference = None
    for repeat in range(args.repeats):
        order = list(SYSTEMS) if repeat % 2 == 0 else list(reversed(SYSTEMS))
        for system in order:
            wall, tokens = run(system, args, requests)
            reference = reference or (tokens if system == "one process" else None)
            if reference is not None and tokens != reference:
                print(f"{system}: tokens differ from one process's", flush=True)
            seconds[system].append(wall)
            print(f"repeat {repeat} {system}: {wall:.2f} s, {args.requests * args.new / wall:.0f} tok/s", flush=True)
    generated = args.requests * args.new
    rows = [{"system": s, "seconds": w, "tokens_per_s": [generated / x for x in w],
             "median_tokens_per_s": generated / statistics.median(w)} for s, w in seconds.items()]
    base = rows[0]["median_tokens_per_s"]
    for r in rows:
        r["vs_one_process"] = r["median_tokens_per_s"] / base
        print(f"{r['system']}: {r['median_tokens_per_s']:.0f} tok/s (median of {len(r['seconds'])}; "
              f"{min(r['tokens_per_s']):.0f}-{max(r['tokens_per_s']):.0f}), {r['vs_one_process']:.2f}x one process")

    def plot(fig):
        ax = fig.add_subplot(111)
        ax.bar([r["system"] for r in rows], [r["median_tokens_per_s"] for r in rows],
               yerr=[[r["median_tokens_per_s"] - min(r["tokens_per_s"]) for r in rows],
                     [max(r["tokens_per_s"]) - r["median_tokens_per_s"] for r in rows]])
        ax.set_ylabel("generated tokens/s (all requests at once)")
        ax.set_title(f"{args.preset} on CPU processes of one thread each")
    print(write_results("parallel-cpu", "cpu", {"preset": args.preset, "requests": args.requests,
                                                 "prompt": args.prompt, "new_tokens": args.new, "rows": rows}, plot))


if __name__ == "__main__":
    main()
