"""FlexGen's offloading executor on the CPU (issue 34): tokens/s of one block generated with
everything resident, with the weights offloaded, and with weights, KV cache and hidden states all
offloaded (two CPU memory pools: every move a real copy), against the engine on the same prompts;
the tokens are checked equal. The cost model's prediction for each placement (the machine's rates
measured at the start, exec/offload_auto.py) is recorded beside the measured block time.

    python bench/offload_cpu.py --preset small-llama --prompt 64 --new 16 --gpu-batch 8 --num-batches 4 --repeats 3 --threads 1
"""
import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import write_results  # noqa: E402
from batchmaker.cells.decoder import build_decoder  # noqa: E402
from batchmaker.cells.decoder_config import PRESETS  # noqa: E402
from batchmaker.core.zigzag import Placement  # noqa: E402
from batchmaker.exec.offload import OffloadConfig, OffloadExecutor  # noqa: E402
from batchmaker.exec.offload_auto import measure, predict  # noqa: E402

PLACEMENTS = {"resident": Placement(False, False, False), "weights": Placement(True, False, False),
              "all": Placement(True, True, True)}


def run_engine(preset: str, prompts: list, new: int) -> tuple[float, list]:
    from batchmaker import Engine, build_model
    with Engine([build_model("llama", preset=preset, seed=0, max_seqs=len(prompts))]) as engine:
        engine.submit("llama", {"tokens": prompts[0], "max_new_tokens": 2, "ignore_eos": True}).result(600)  # warm-up
        start = time.perf_counter()
        futures = [engine.submit("llama", {"tokens": p, "max_new_tokens": new, "ignore_eos": True}) for p in prompts]
        tokens = [f.result(600).outputs["tokens"] for f in futures]
        return time.perf_counter() - start, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small-llama")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens (every prompt)")
    ap.add_argument("--new", type=int, default=16, help="tokens generated per prompt")
    ap.add_argument("--gpu-batch", type=int, default=8)
    ap.add_argument("--num-batches", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the executor's runs (the engine "
                                                           "picks its own: 1 on 2 cores, engine_config.py)")
    args = ap.parse_args()
    config = PRESETS[args.preset]
    rng = random.Random(0)
    block = args.gpu_batch * args.num_batches
    prompts = [[rng.randrange(3, config.vocab_size) for _ in range(args.prompt)] for _ in range(block)]
    torch.set_num_threads(args.threads)
    rates = measure("cpu", torch.float32, config=config)
    seconds = {name: [] for name in [*PLACEMENTS, "engine"]}
    tokens = {}
    for _ in range(args.repeats):
        for name, placement in PLACEMENTS.items():
            torch.set_num_threads(args.threads)
            executor = OffloadExecutor(build_decoder(config, seed=0), "cpu",
                                       OffloadConfig(args.gpu_batch, args.num_batches, placement))
            start = time.perf_counter()
            tokens[name] = executor.generate(prompts, args.new)
            seconds[name].append(time.perf_counter() - start)
        elapsed, tokens["engine"] = run_engine(args.preset, prompts, args.new)
        seconds["engine"].append(elapsed)
    equal = all(t == tokens["engine"] for t in tokens.values())
    rows = {}
    for name, times in seconds.items():
        median = statistics.median(times)
        rows[name] = {"seconds": times, "tokens_per_s": block * args.new / median}
        if name in PLACEMENTS:
            rows[name]["predicted_seconds"] = predict(config, torch.float32, rates, PLACEMENTS[name], args.gpu_batch,
                                                      args.num_batches, args.prompt, args.new).block_seconds
        print(f"{name:9s} {rows[name]['tokens_per_s']:8.1f} tokens/s (median of {len(times)}: {median:.2f} s"
              + (f", predicted {rows[name]['predicted_seconds']:.2f} s)" if name in PLACEMENTS else ")"))
    print(f"tokens equal: {equal}")
    path = write_results("offload-cpu", "cpu", {
        "preset": args.preset, "prompt": args.prompt, "new": args.new, "gpu_batch": args.gpu_batch,
        "num_batches": args.num_batches, "dtype": "float32", "threads": args.threads,
        "rates": rates.__dict__, "tokens_equal": equal, "systems": rows})
    print(path)


if __name__ == "__main__":
    main()
