"""What 4-bit group-wise compression (kernels/compress4.py: asymmetric min-max, group 64) does to a
decoder's outputs (issue 34: "on a tiny model, the logits' relative error and the greedy
agreement with bf16 are reported"), on the CPU in fp32 against the same model uncompressed:

- **weights**: every decoder layer's matrix round-tripped through its codes (what the offloading
  executor computes with, bit for bit: tests/test_offload_resident4.py); the logits of whole
  prompts (teacher-forced), their relative error ||l4 - l|| / ||l|| per prompt, and how often the
  two argmaxes agree per position, beside the uncompressed model's top-1 margin (random weights
  give near-flat logits, where any perturbation flips ties: the margin says how flat);
- **greedy tokens**: the offloading executor generating with `compress` = "weights", "kv" (its KV
  cache on the host as codes) and "both" against it uncompressed: the share of tokens equal and of
  prompts equal to their last token (a sequence diverges for good at its first flip).

    python bench/compress_quality.py                       # tiny-llama, tiny-opt and a 4-layer h=512 Llama
"""
import argparse
import random
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchmaker.cells.decoder import build_decoder  # noqa: E402
from batchmaker.cells.decoder_config import PRESETS  # noqa: E402
from batchmaker.core.zigzag import Placement  # noqa: E402
from batchmaker.exec.offload import OffloadConfig, OffloadExecutor  # noqa: E402
from batchmaker.exec.offload_resident import round_tripped  # noqa: E402
from bench.common import write_results  # noqa: E402

MODELS = {"tiny-llama": PRESETS["tiny-llama"], "tiny-opt": PRESETS["tiny-opt"],
          "llama-h512": replace(PRESETS["tiny-llama"], hidden_size=512, intermediate_size=1376, num_layers=4,
                                num_heads=8, num_kv_heads=8, head_dim=64, vocab_size=2048)}
CACHE_ON_HOST = Placement(False, True, False)  # (a 4-bit KV cache lives on the host: compress="kv" needs it there)


def logits_error(config, seed: int, prompts: list[list[int]]) -> dict:
    dense, coded = build_decoder(config, seed=seed), round_tripped(build_decoder(config, seed=seed))
    errors, agree, margins = [], [], []
    with torch.no_grad():
        for p in prompts:
            tokens = torch.tensor(p)
            a, b = dense.dense_logits(tokens), coded.dense_logits(tokens)
            errors.append(float((b - a).norm() / a.norm()))
            agree += (a.argmax(-1) == b.argmax(-1)).tolist()
            top2 = a.topk(2, dim=-1).values
            margins += ((top2[:, 0] - top2[:, 1]) / a.std(-1)).tolist()
    errors.sort()
    margins.sort()
    return {"relative_error_median": errors[len(errors) // 2], "relative_error_max": errors[-1],
            "top1_agreement": sum(agree) / len(agree), "positions": len(agree),
            "top1_margin_in_stds_median": margins[len(margins) // 2]}


def greedy_agreement(config, seed: int, prompts: list[list[int]], new: int) -> dict:
    def generate(compress_what):
        placement = CACHE_ON_HOST if compress_what in ("kv", "both") else Placement(False, False, False)
        executor = OffloadExecutor(build_decoder(config, seed=seed), "cpu", OffloadConfig(2, 2, placement,
                                                                                           compress=compress_what))
        return executor.generate(prompts, new)

    dense = generate(None)
    out = {}
    for what in ("weights", "kv", "both"):
        got = generate(what)
        same = [x == y for a, b in zip(dense, got) for x, y in zip(a, b)]
        first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), new) for a, b in zip(dense, got)]
        out[what] = {"tokens": sum(same) / len(same), "whole_prompts": sum(a == b for a, b in zip(dense, got)) / len(got),
                     "first_flip_median": sorted(first)[len(first) // 2]}
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--length", type=int, default=48)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    record = {"group": 64, "dtype": "fp32", "prompts": args.prompts, "length": args.length, "new": args.new,
              "models": {}}
    for name in args.models:
        config = MODELS[name]
        rng = random.Random(args.seed)
        prompts = [[rng.randrange(config.vocab_size) for _ in range(rng.randint(args.length // 2, args.length))]
                   for _ in range(args.prompts)]
        row = {"hidden": config.hidden_size, "layers": config.num_layers, "vocab": config.vocab_size,
               "logits": logits_error(config, args.seed, prompts),
               "greedy": greedy_agreement(config, args.seed, prompts, args.new)}
        record["models"][name] = row
        lg = row["logits"]
        print(f"{name}: logits relative error {lg['relative_error_median']:.4f} (max {lg['relative_error_max']:.4f}), "
              f"top-1 agreement {lg['top1_agreement']:.3f} (margin {lg['top1_margin_in_stds_median']:.2f} stds); "
              + ", ".join(f"greedy {k}: {v['tokens']:.3f} of tokens, {v['whole_prompts']:.2f} of prompts"
                          for k, v in row["greedy"].items()), flush=True)
    if not args.no_write:
        print("wrote", write_results("compress-quality", "cpu", record))
    return record


if __name__ == "__main__":
    main()
