"""Automatic prefix caching on the CPU (issue 32), served with `prefix_caching` on and off, the same
clients and seeds, repeats alternating; tokens are checked equal. Two workloads:

  chat           stateless clients that resend their whole history every turn (their earlier
                 prompts and replies, then a new prompt): each continues its own cached context
  system-prompt  clients that send independent questions after one shared system prompt: they
                 share its whole blocks (core/block_index.py)

Reports request latency (turns 2+ for chat, every request for system-prompt), the positions
served from the cache, and prompt positions read from blocks other requests computed.

    python bench/prefix_cpu.py --clients 8 --turns 4 --repeats 3
    python bench/prefix_cpu.py --workload system-prompt --system 512 --clients 8 --turns 4 --repeats 3
"""
import argparse
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import write_results  # noqa: E402


def client(engine, seed: int, turns: int, system: list, out: list) -> None:
    rng, history, tokens, latencies = random.Random(seed), list(system), [], []
    for _ in range(turns):
        history += [rng.randrange(3, 4000) for _ in range(rng.randint(16, 64))]
        start = time.perf_counter()
        reply = engine.submit("llama", {"tokens": history, "max_new_tokens": 16, "ignore_eos": True}).result(600)
        latencies.append(time.perf_counter() - start)
        tokens.append(reply.outputs["tokens"])
        history += reply.outputs["tokens"]
    out.append((seed, tokens, latencies))


def asker(engine, seed: int, turns: int, system: list, out: list) -> None:
    """Independent questions after the shared system prompt (a client that keeps no history)."""
    rng, tokens, latencies = random.Random(seed), [], []
    for _ in range(turns):
        prompt = system + [rng.randrange(3, 4000) for _ in range(rng.randint(16, 64))]
        start = time.perf_counter()
        reply = engine.submit("llama", {"tokens": prompt, "max_new_tokens": 16, "ignore_eos": True}).result(600)
        latencies.append(time.perf_counter() - start)
        tokens.append(reply.outputs["tokens"])
    out.append((seed, tokens, latencies))


def run(args, prefix_caching: bool) -> dict:
    from batchmaker import Engine, EngineConfig
    from batchmaker.registry import build_model
    model = build_model("llama", preset=args.preset, seed=0, max_tokens=256, prefix_caching=prefix_caching)
    engine = Engine([model], EngineConfig(cpu_threads=1)).start()
    try:
        engine.submit("llama", {"tokens": [1, 2, 3], "max_new_tokens": 2}).result(60)
        system = [random.Random(1).randrange(3, 4000) for _ in range(args.system)]
        results: list = []
        target = client if args.workload == "chat" else asker
        threads = [threading.Thread(target=target, args=(engine, c, args.turns, system, results))
                   for c in range(args.clients)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
        stats = engine.stats()["conversations"]["llama"]
        results.sort()
        later = [lat for _, _, lats in results for lat in lats[1 if args.workload == "chat" else 0:]]
        return {"wall_s": wall, "tokens": [t for _, t, _ in results], "first_turn_s": [lats[0] for _, _, lats in results],
                "later_turn_median_s": statistics.median(later), "gpu_hit_tokens": stats["gpu_hit_tokens"],
                "host_hit_tokens": stats["host_hit_tokens"], "recomputed_tokens": stats["recomputed_tokens"],
                "prefix_hit_tokens": stats["prefix_hit_tokens"]}
    finally:
        engine.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=("chat", "system-prompt"), default="chat")
    ap.add_argument("--preset", default="small-llama")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system", type=int, default=96, help="tokens of a system prompt every client starts with")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--name", help="the results' file name (default: prefix-cpu, prefix-cpu-system)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    runs = {"off": [], "on": []}
    for repeat in range(args.repeats):
        for setting in (("off", "on") if repeat % 2 == 0 else ("on", "off")):
            runs[setting].append(run(args, setting == "on"))
            r = runs[setting][-1]
            print(f"repeat {repeat} prefix caching {setting}: {r['wall_s']:.2f} s, latency "
                  f"{r['later_turn_median_s'] * 1e3:.0f} ms median, cached positions {r['gpu_hit_tokens']}, "
                  f"prefix hits {r['prefix_hit_tokens']}", flush=True)
    same = all(r["tokens"] == runs["off"][0]["tokens"] for rs in runs.values() for r in rs)
    rows = [{"prefix_caching": s, "wall_s": [r["wall_s"] for r in rs],
             "later_turn_median_ms": [r["later_turn_median_s"] * 1e3 for r in rs],
             "gpu_hit_tokens": [r["gpu_hit_tokens"] for r in rs],
             "prefix_hit_tokens": [r["prefix_hit_tokens"] for r in rs]} for s, rs in runs.items()]
    speedup = statistics.median(rows[0]["wall_s"]) / statistics.median(rows[1]["wall_s"])
    print(f"tokens equal: {same}; wall, off / on: {speedup:.2f}x")

    def plot(fig):
        ax = fig.add_subplot(111)
        ax.bar([f"prefix caching {r['prefix_caching']}" for r in rows],
               [statistics.median(r["later_turn_median_ms"]) for r in rows])
        ax.set_ylabel("median latency of turns 2+ (ms)" if args.workload == "chat" else "median request latency (ms)")
        ax.set_title(f"{args.workload}: {args.clients} stateless clients x {args.turns} requests, {args.preset}, CPU")
    name = args.name or ("prefix-cpu" if args.workload == "chat" else "prefix-cpu-system")
    print(write_results(name, "cpu", {"args": vars(args), "tokens_equal": same, "wall_off_over_on": speedup,
                                              "rows": rows}, plot))


if __name__ == "__main__":
    main()
