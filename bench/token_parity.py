"""The tokens an engine generates for a fixed workload under a fixed schedule, to compare two
versions of the code (a redesign must not change them): every request is submitted before the
first step and the caller drives `Engine.step()`, so iterations are formed the same way on every
run; conversations send their next turn the step after a reply. Greedy and seeded-sampling
requests, prompts of mixed lengths (some longer than the token budget, so they prefill in
chunks), and a few conversations of three turns. Public API only, so the same script runs
against any version.

    python bench/token_parity.py --preset llama-2-7b --dtype bf16 --out tokens.json
    python bench/token_parity.py --compare before.json after.json
"""
import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


def workload(rng: np.random.Generator, n: int, vocab: int, longest: int, positions: int) -> list[dict]:
    """Prompts up to `longest` tokens, every fourth longer (up to 3x, within the model's positions)."""
    requests = []
    for i in range(n):
        length = int(rng.integers(1, longest)) if i % 4 else int(rng.integers(longest, 3 * longest))
        length = min(length, positions - 49)  # (room for max_new_tokens)
        inputs = {"tokens": rng.integers(3, vocab, length).tolist(), "max_new_tokens": int(rng.integers(8, 48)),
                  "ignore_eos": True}
        if i % 2:
            inputs.update(temperature=0.8, top_p=0.9, top_k=int(rng.integers(0, 50)), seed=i)
        requests.append(inputs)
    return requests


def run(args) -> dict:
    import torch

    from batchmaker import Engine, EngineConfig
    from batchmaker.registry import build_model
    torch.backends.cuda.matmul.allow_tf32 = False
    model = build_model("llama", preset=args.preset, dtype=args.dtype, device=args.device, seed=0,
                        max_tokens=args.max_tokens, max_new_tokens=64)
    engine = Engine([model], EngineConfig(devices=(args.device,))).start(thread=False)
    rng = np.random.default_rng(args.seed)
    config = model.cells["decoder"].config
    vocab, turn_len = config.vocab_size, max(5, config.max_positions // 8)
    futures = [engine.submit("llama", r)
               for r in workload(rng, args.requests, vocab, args.max_tokens // 2, config.max_positions)]
    turns = [[{"tokens": rng.integers(3, vocab, int(rng.integers(4, turn_len))).tolist(), "max_new_tokens": 24,
               "ignore_eos": True} for _ in range(3)] for _ in range(args.conversations)]
    talks = [[engine.submit("llama", {**t[0], "conversation": True})] for t in turns]
    start, steps = time.perf_counter(), 0
    while not all(f.done() for f in futures) or any(len(talk) < 3 or not talk[-1].done() for talk in talks):
        engine.step()
        steps += 1
        for talk, script in zip(talks, turns):
            if talk[-1].done() and len(talk) < 3:
                cid = talk[-1].result().outputs["conversation"]
                talk.append(engine.submit("llama", {**script[len(talk)], "conversation": cid}))
    seconds = time.perf_counter() - start
    engine.stop()
    return {"preset": args.preset, "dtype": args.dtype, "steps": steps, "seconds": seconds,
            "requests": [f.result().outputs["tokens"] for f in futures],
            "conversations": [[f.result().outputs["tokens"] for f in talk] for talk in talks]}


def compare(a: dict, b: dict) -> dict:
    if len(a["requests"]) != len(b["requests"]) or len(a["conversations"]) != len(b["conversations"]):
        raise SystemExit("the two runs served different workloads")
    same = [x == y for x, y in zip(a["requests"], b["requests"])]
    turns = [x == y for p, q in zip(a["conversations"], b["conversations"]) for x, y in zip(p, q)]
    return {"requests": len(same), "identical": sum(same), "turns": len(turns), "identical_turns": sum(turns),
            "steps": [a["steps"], b["steps"]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny-llama")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=512, help="the token budget of an iteration")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--compare", nargs=2, default=None, metavar="JSON")
    args = ap.parse_args()
    if args.compare:
        result = compare(*(json.loads(Path(p).read_text()) for p in args.compare))
        print(json.dumps(result))
        sys.exit(0 if result["identical"] == result["requests"] and result["identical_turns"] == result["turns"] else 1)
    result = run(args)
    print(json.dumps({k: v for k, v in result.items() if k not in ("requests", "conversations")}))
    if args.out:
        Path(args.out).write_text(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
