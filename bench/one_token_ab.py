"""The batch-1 decode step (forward + head + argmax over a paged cache, one CUDA graph) in several
forms of the one-token projections, captured in one process and replayed in interleaved rounds, so
that the comparison does not ride on which machine or minute each form ran (the graph step's median
moved 3.86-4.18 ms between leases of one H200 kind for the same code).

A form: which gate | up and down kernels run (kernels/gemv.py CONFIGS). Floor: weight bytes / copy
bandwidth.

    python bench/one_token_ab.py --out bench/results/one-token-ab-NVIDIA-H200-DATE.json
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchmaker.cells.decoder import build_decoder  # noqa: E402
from batchmaker.cells.decoder_config import PRESETS, num_parameters  # noqa: E402
from batchmaker.cells.llama import OneTokenConfig  # noqa: E402
from batchmaker.kernels import gemv  # noqa: E402
from batchmaker.kernels.paged_attention import PagedAttend  # noqa: E402
from bench.decode_profile import decode_inputs  # noqa: E402

DOWN_DOT = gemv.GemvConfig(32, 256, 4, 6, dot=True)
PLAIN = gemv.GemvConfig(8, 1024, 4, 1)
FORMS = {  # name -> (gate | up config, down config)
    "pairs+down-dot": (PLAIN, DOWN_DOT),
    "pairs+down-plain": (PLAIN, PLAIN),
    "pairs16+down-dot": (gemv.GemvConfig(16, 512, 4, 1), DOWN_DOT),
    "pairs-dot+down-dot": (gemv.GemvConfig(32, 128, 4, 3, dot=True), DOWN_DOT),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-2-7b")
    ap.add_argument("--context", type=int, default=360)
    ap.add_argument("--bandwidth", type=float, default=4.23e12)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--replays", type=int, default=50, help="graph replays per form per round")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    config, dev = PRESETS[args.preset], torch.device("cuda")
    h, i = config.hidden_size, config.intermediate_size
    lm = build_decoder(config, dtype=torch.bfloat16, device=dev)
    kc, vc, tables, query_start, context, positions, slots, tokens = decode_inputs(config, 1, args.context, dev)
    attend = PagedAttend(kc, vc, slots, tables, query_start, context, 1, config.head_dim ** -0.5,
                         max_context_len=args.context)
    graphs, outputs = {}, {}
    with torch.inference_mode():
        lm.set_one_token(OneTokenConfig())
        for name, (gate_up, down) in FORMS.items():
            gemv.CONFIGS[(i, h, True)] = gate_up  # gate | up (pairs of rows)
            gemv.CONFIGS[(h, i, False)] = down
            for _ in range(3):
                lm.head(lm(tokens, positions, attend))
            torch.cuda.synchronize()
            graphs[name] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[name]):
                outputs[name] = lm.head(lm(tokens, positions, attend)).argmax(-1)
        times = {name: [] for name in FORMS}
        for _ in range(args.rounds):
            for name, graph in graphs.items():
                graph.replay()  # (one untimed: the previous form's tail)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(args.replays):
                    graph.replay()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end) / args.replays)
    floor_ms = num_parameters(config) * 2 / args.bandwidth * 1e3
    report = {"device": torch.cuda.get_device_name(), "preset": args.preset, "context": args.context,
              "floor_ms": floor_ms, "command": "python " + " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"),
              "same_token": len({int(t) for t in outputs.values()}) == 1, "forms": {}}
    for name, ms in times.items():
        gate_up, down = FORMS[name]
        median = statistics.median(ms)
        report["forms"][name] = {"gate_up": repr(gate_up), "down": repr(down),
                                 "graph_step_ms_median": median, "vs_floor": median / floor_ms,
                                 "rounds_ms": ms}
        print(f"{name:18s} {median:.4f} ms  {median / floor_ms:.4f}x floor  (rounds {min(ms):.4f}-{max(ms):.4f})",
              flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
