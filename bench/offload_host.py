"""The offloading executor's host cost per (GPU batch, layer) unit of a decode step (issue 34): a
decoder shrunk until its compute is negligible (hidden 64), weights, cache and hidden states
offloaded (half the layers resident), many GPU batches of a few rows; µs per unit of a decode step
(two token counts differenced: the prompt step and set-up cancel), then each operation's share
(every `BlockRun.do` timed) and the aten calls each makes (a dispatch mode counts them). `--tree`
imports the executor from another checkout (the same API since issue 34's first slice): before
and after in one command.

    python bench/offload_host.py --gpu-batch 1 2 4 --num-batches 32 --threads 1
    python bench/offload_host.py --tree ../base --label before   # (a checkout of the base commit)
"""
import argparse
import collections
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def block_seconds(executor, prompts, count: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        executor.generate_block(prompts, count)
        best = min(best, time.perf_counter() - start)
    return best


def per_operation(offload, executor, prompts, count: int) -> tuple[dict, dict]:
    """(µs of host time, aten calls) per kind of operation over decode steps, each per operation."""
    from torch.utils._python_dispatch import TorchDispatchMode
    seconds, ops, calls = collections.Counter(), collections.Counter(), collections.Counter()
    kind, step = [None], [0]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if kind[0] is not None:
                calls[kind[0]] += 1
            return func(*args, **(kwargs or {}))

    do = offload.BlockRun.do

    def timed(run, op):
        step[0] = step[0] if op.kind == "sync" else op.step  # (a sync closes a slot of the step before it)
        if step[0] < 1 or kind[0] is not None:  # (decode steps; an operation inside a compute counts in it)
            return do(run, op)
        kind[0], start = op.kind, time.perf_counter()
        do(run, op)
        seconds[op.kind] += time.perf_counter() - start
        ops[op.kind] += 1
        kind[0] = None

    offload.BlockRun.do = timed
    try:
        executor.generate_block(prompts, count)
        timing = dict(seconds)
        seconds.clear(), ops.clear()
        with Count():
            executor.generate_block(prompts, count)
    finally:
        offload.BlockRun.do = do
    return ({k: timing[k] / ops[k] * 1e6 for k in ops}, {k: calls[k] / ops[k] for k in ops}), dict(ops)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny-llama")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--gpu-batch", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--num-batches", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--tokens", type=int, nargs=2, default=[2, 10], help="the two counts differenced")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--weights-gpu", type=float, default=0.5)
    ap.add_argument("--tree", default=str(ROOT), help="the checkout whose executor runs")
    ap.add_argument("--label", default="after", help="names the record: offload-host-LABEL-…")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from bench.common import write_results
    sys.path.insert(0, str(Path(args.tree).resolve()))
    for name in [m for m in sys.modules if m == "batchmaker" or m.startswith("batchmaker.")]:
        del sys.modules[name]
    import torch
    from batchmaker.exec import offload
    from batchmaker.cells.decoder import build_decoder
    from batchmaker.cells.decoder_config import PRESETS
    from batchmaker.core.zigzag import Placement
    torch.set_num_threads(args.threads)
    config = replace(PRESETS[args.preset], num_layers=args.layers)
    placement = Placement(True, True, True, weights_gpu=args.weights_gpu)
    rows = {}
    for gbs in args.gpu_batch:
        rng = random.Random(0)
        prompts = [[rng.randrange(config.vocab_size) for _ in range(args.prompt)] for _ in range(gbs * args.num_batches)]
        executor = offload.OffloadExecutor(build_decoder(config, seed=0), args.device,
                                           offload.OffloadConfig(gbs, args.num_batches, placement))
        executor.generate_block(prompts, args.tokens[0])  # (warm-up)
        first, second = (block_seconds(executor, prompts, n, args.repeats) for n in args.tokens)
        units = (args.tokens[1] - args.tokens[0]) * args.layers * args.num_batches
        (us, calls), count = per_operation(offload, executor, prompts, args.tokens[1])
        decode_units = (args.tokens[1] - 1) * args.layers * args.num_batches
        rows[gbs] = {"us_per_unit": (second - first) / units * 1e6, "us_per_op": us, "aten_calls_per_op": calls,
                     "ops_per_unit": {k: n / decode_units for k, n in count.items()}}
        print(f"gpu_batch {gbs}: {rows[gbs]['us_per_unit']:.1f} µs per unit of a decode step ({args.label})")
        for kind in us:
            print(f"    {kind:14s} {us[kind]:7.1f} µs x {count[kind] / decode_units:.2f} a unit, "
                  f"{calls[kind]:6.1f} aten calls each")
    path = write_results(f"offload-host-{args.label}", args.device, {
        "label": args.label, "preset": args.preset, "layers": args.layers, "num_batches": args.num_batches,
        "prompt": args.prompt, "tokens": args.tokens, "threads": args.threads, "weights_gpu": args.weights_gpu,
        "gpu_batches": rows})
    print(path)


if __name__ == "__main__":
    main()
