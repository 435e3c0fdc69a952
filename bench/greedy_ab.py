"""Greedy decoding's argmax: torch.argmax (with the cast of bf16 logits the LM head's kernel used to
leave) against kernels/greedy.py's launch, each in a CUDA graph of `--launches` calls replayed in
interleaved rounds, per rows x vocabulary and per block shape; the GPU's times, µs a call.

    python bench/greedy_ab.py --out bench/results/greedy-ab-DEVICE-DATE.json
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchmaker.kernels import greedy as greedy_module  # noqa: E402
from bench.common import captured  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--vocabs", type=int, nargs="+", default=[32000, 128256, 152064, 256000])
    ap.add_argument("--tiles", nargs="+", default=["4096:4", "2048:4", "8192:8", "4096:8", "16384:16"],
                    metavar="BLOCK:WARPS")
    ap.add_argument("--launches", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    report = {"device": torch.cuda.get_device_name(), "command": "python " + " ".join(sys.argv),
              "date": time.strftime("%Y-%m-%d"), "launches": args.launches, "cases": []}
    for vocab in args.vocabs:
        for rows in args.rows:
            bf16 = torch.randn(rows, vocab, device="cuda").to(torch.bfloat16)
            logits = bf16.float()
            want = logits.argmax(-1)
            forms = {"torch-cast-argmax": lambda: bf16.float().argmax(-1), "torch-argmax": lambda: logits.argmax(-1)}
            for tile in args.tiles:
                block, warps = map(int, tile.split(":"))

                def run(block=block, warps=warps):
                    greedy_module.GREEDY_BLOCK, greedy_module.GREEDY_WARPS = block, warps
                    return greedy_module.greedy(logits)
                assert torch.equal(run(), want), tile
                forms[f"greedy-{tile}"] = run
            graphs = {}
            for name, fn in forms.items():
                graphs[name] = captured(fn, args.launches)  # (each captures its own block shape)
            times = {name: [] for name in forms}
            for _ in range(args.rounds):
                for name, graph in graphs.items():
                    graph.replay()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    graph.replay()
                    end.record()
                    end.synchronize()
                    times[name].append(start.elapsed_time(end) * 1e3 / args.launches)
            row = {"rows": rows, "vocab": vocab, "us": {k: statistics.median(v) for k, v in times.items()},
                   "spread_us": {k: [min(v), max(v)] for k, v in times.items()}}
            report["cases"].append(row)
            print(f"{rows:4d} x {vocab:6d}: " + "  ".join(f"{k} {v:.2f}" for k, v in row["us"].items()), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
