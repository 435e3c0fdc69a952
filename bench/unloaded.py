"""One request at a time through the engine against a plain PyTorch loop of the same cells.

The issue-10 CPU target: an unloaded request costs at most 1.5x the plain loop. Both sides use the
model's own cell objects (the same weights), one request in flight, the engine driven by its
manager thread as in serving. Prints and writes JSON: median, p90 per system and their ratio.

    python bench/unloaded.py --device cpu --hidden 256 --tokens 24 --requests 200
"""
import argparse
import statistics
import time

import torch

from batchmaker import Engine, EngineConfig
from batchmaker.registry import build_model
from common import write_results


def plain_lstm(cell, tokens: torch.Tensor) -> torch.Tensor:
    hidden = cell.lstm.hidden_size
    h = torch.zeros(1, hidden, dtype=cell.lstm.weight_ih.dtype, device=tokens.device)
    c = torch.zeros_like(h)
    for t in range(tokens.numel()):
        out = cell(token=tokens[t:t + 1], h=h, c=c)
        h, c = out["h"], out["c"]
    return h[0]


def summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {"p50_ms": statistics.median(ordered), "p90_ms": ordered[int(0.9 * (len(ordered) - 1))]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--round-steps", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: the engine chooses)")
    args = p.parse_args()

    model = build_model("lstm", hidden=args.hidden, embed=args.hidden)
    tokens = torch.randint(1, 1000, (args.tokens,), generator=torch.Generator().manual_seed(0))
    config = EngineConfig(devices=(args.device,), cpu_threads=args.threads)
    if args.round_steps is not None:
        from dataclasses import replace
        config = replace(config, scheduler=replace(config.scheduler, max_round_steps=args.round_steps))
    with Engine([model], config) as engine:
        request = {"tokens": tokens.tolist()}
        cell = engine.models["lstm"].cells["lstm"]
        device_tokens = tokens.to(args.device)
        times = {"batchmaker": [], "plain": []}
        with torch.inference_mode():
            torch.testing.assert_close(engine.infer("lstm", request)["h"].cpu(),
                                       plain_lstm(cell, device_tokens).cpu(), rtol=1e-4, atol=1e-5)
            for i in range(args.requests + 20):
                for name, run in (("batchmaker", lambda: engine.infer("lstm", request)),
                                  ("plain", lambda: plain_lstm(cell, device_tokens))):
                    start = time.perf_counter()
                    run()
                    if i >= 20:  # warm-up
                        times[name].append((time.perf_counter() - start) * 1e3)
        threads = torch.get_num_threads()
        stage_ms = engine.stats()["stage_ms"]
    results = {name: summary(t) for name, t in times.items()}
    ratio = results["batchmaker"]["p50_ms"] / results["plain"]["p50_ms"]
    for name, r in results.items():
        print(f"{name:11s} p50 {r['p50_ms']:7.3f} ms  p90 {r['p90_ms']:7.3f} ms")
    print(f"ratio (p50) {ratio:.2f}  target <= 1.5  torch threads {threads}")
    path = write_results(f"unloaded-h{args.hidden}", args.device, {
        "settings": vars(args), "torch_threads": threads, "systems": results,
        "engine_stage_ms_per_request": {k: v / (args.requests + 21) for k, v in stage_ms.items()},
        "comparison": {"p50_ratio": ratio, "target": 1.5, "met": ratio <= 1.5},
    }, plot=lambda fig: _plot(fig, results))
    print("wrote", path)


def _plot(fig, results: dict) -> None:
    ax = fig.add_subplot()
    names = list(results)
    ax.bar([f"{n} p50" for n in names], [results[n]["p50_ms"] for n in names])
    ax.bar([f"{n} p90" for n in names], [results[n]["p90_ms"] for n in names])
    ax.set_ylabel("ms per request, one at a time")


if __name__ == "__main__":
    main()
