"""The batch-1 decode step (forward + head + greedy argmax over a paged cache, one CUDA graph) in several
forms of the one-token projections, captured in one process and replayed in interleaved rounds, so
that the comparison does not ride on which machine or minute each form ran (the graph step's median
moved 3.86-4.18 ms between leases of one H200 kind for the same code).

A form: which kernels the projections run (kernels/gemv.py CONFIGS, by projection; the head's too).
Attention bounded as the engine's decode graphs bound it. Floor: the weight bytes a step reads (an
untied embedding's one row a token left out, as bench/decode_profile.py) / the copy bandwidth.

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
from batchmaker.cells.rotary import Rotary  # noqa: E402
from batchmaker.kernels import decode_row, gemv  # noqa: E402
from batchmaker.kernels.greedy import greedy  # noqa: E402
from batchmaker.kernels.paged_attention import PagedAttend  # noqa: E402
from bench import graph_trace  # noqa: E402
from bench.chat_roofline import head_parameters  # noqa: E402
from bench.decode_profile import decode_inputs, engine_bound  # noqa: E402
from bench.device_limits import measure  # noqa: E402
from bench.gemv import best_configs, projections  # noqa: E402

H200_TABLE = {name: gemv.GemvConfig(8, 1024, 4, 1) for name in ("qkv", "o", "gate_up", "down", "head")}
# name -> its configs by projection, over H200_TABLE (kernels/gemv.py CONFIGS before the twenty-fourth session, the
# head's the default): the H100 prefetch sweeps' best per projection (`bench/gemv.py --sweep prefetch --head`, two
# runs; sweep-a became CONFIGS), and mixes. "configs": CONFIGS as they are.
FORMS = {
    "configs": None,
    "h200-table": {},
    "sweep-a": {"o": gemv.GemvConfig(8, 512, 8, 1, prefetch=2), "gate_up": gemv.GemvConfig(8, 1024, 4, 1, prefetch=1),
                "down": gemv.GemvConfig(2, 2048, 8, 1, prefetch=2), "head": gemv.GemvConfig(4, 1024, 4, 1, prefetch=1)},
    "sweep-b": {"qkv": gemv.GemvConfig(4, 2048, 8, 1, prefetch=2), "o": gemv.GemvConfig(2, 1024, 4, 1, prefetch=2),
                "gate_up": gemv.GemvConfig(2, 2048, 4, 1, prefetch=2), "down": gemv.GemvConfig(1, 4096, 8, 1, prefetch=1),
                "head": gemv.GemvConfig(2, 2048, 8, 1, prefetch=1)},
    "a-down-b": {"o": gemv.GemvConfig(8, 512, 8, 1, prefetch=2), "gate_up": gemv.GemvConfig(8, 1024, 4, 1, prefetch=1),
                 "down": gemv.GemvConfig(1, 4096, 8, 1, prefetch=1), "head": gemv.GemvConfig(4, 1024, 4, 1, prefetch=1)},
    "prefetch-8": {name: gemv.GemvConfig(8, 512, 8, 1, prefetch=2) for name in ("o", "down", "head")},
    "down-only": {"down": gemv.GemvConfig(2, 2048, 8, 1, prefetch=2)},
}


class NoAttention:
    """A paged attend without attention: the q | k | v kernel writes the cache as before; its q is the output."""

    def __init__(self, paged: PagedAttend):
        self.kv_cache = paged.kv_cache

    def attend_cached(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        return q


def outside(lm, before: bool) -> tuple:
    """(head, pick) of a step, and its rotation installed: the engine's (cos | sin tables, float32 logits out of
    the head's kernel, kernels/greedy.py), or `before` the twenty-ninth session's launches outside the layers."""
    vars(lm).pop("rotary", None)
    if not before:
        return lm.head, greedy
    dtype = lm.embed_tokens.weight.dtype
    lm.rotary = lambda positions: Rotary(*(t.to(dtype) for t in lm.rope_angles(positions)))  # (6 launches a step)
    weight = lm.embed_tokens.weight if lm.lm_head is None else lm.lm_head.weight
    return (lambda hidden: gemv.norm_linear(hidden, None, lm.norm.weight, lm.norm.eps, weight)[1].float(),
            lambda logits: logits.argmax(-1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-2-7b")
    ap.add_argument("--context", type=int, default=360)
    ap.add_argument("--bandwidth", type=float, default=None, help="bytes/s (default: the copy bandwidth measured now)")
    ap.add_argument("--forms", nargs="+", choices=tuple(FORMS), default=list(FORMS))
    ap.add_argument("--gemv-configs", default=None,
                    help="a bench/gemv.py JSON: its best configs as one more form, `file` (over H200_TABLE)")
    ap.add_argument("--override", nargs="+", default=[], metavar="PROJ=BLOCK_N:BLOCK_K:WARPS:PREFETCH[:MAXNREG]",
                    help="one more form each: this device's configs with one projection's replaced (CUDA cores, 1 "
                         "stage; PROJ may be a comma-separated list; several such parts joined by '/' in one form)")
    ap.add_argument("--squares", nargs="?", const="both", choices=("both", "only"), default=None,
                    help="each form again with the norms' partial sums of squares passed on "
                         "(OneTokenConfig.norm_squares); 'only': each form with them only")
    ap.add_argument("--row-tiles", nargs="+", default=None, metavar="BLOCK_N:WARPS",
                    help="each form again with each of these row-loop tiles ('off': the tiled kernel; "
                         "kernels/decode_row.py); default: ROW_DECODE as it is")
    ap.add_argument("--row-max-splits", type=int, nargs="+", default=None,
                    help="each form again with the row loop's slices capped at each of these (decode_row's "
                         "SHORT_MAX_SPLITS) instead of as it is")
    ap.add_argument("--no-attention", action="store_true",
                    help="each form again without attention: q | k | v still writes the cache, o reads q (a bound: what "
                         "the projections' chain costs alone)")
    ap.add_argument("--outside-before", action="store_true",
                    help="each form again with the launches outside the layers as before the twenty-ninth session: "
                         "cos and sin computed each step (6 launches), the head's bf16 logits cast, torch.argmax")
    ap.add_argument("--trace", action="store_true",
                    help="each form's graph replayed under torch.profiler: its kernels' start-to-start shares by name "
                         "(bench/graph_trace.py)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--replays", type=int, default=50, help="graph replays per form per round")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    config, dev = PRESETS[args.preset], torch.device("cuda")
    keys = projections(config)
    configs = {name: gemv.pick_config(*key, device=dev) for name, key in keys.items()}  # (this device's)
    gemv.DEVICE_CONFIGS.clear()  # (each form sets CONFIGS)
    forms = {name: configs if FORMS[name] is None else {**H200_TABLE, **FORMS[name]} for name in args.forms}
    if args.gemv_configs:
        names = {key: name for name, key in keys.items()}
        forms["file"] = {**H200_TABLE, **{names[key]: cfg for key, cfg in best_configs(args.gemv_configs).items()
                                          if key in names}}
    for spec in args.override:  # (over this device's configs, not H200_TABLE)
        forms[spec] = dict(configs)
        for part in spec.split("/"):
            names, shape = part.split("=")
            block_n, block_k, warps, prefetch, *cap = map(int, shape.split(":"))
            cfg = gemv.GemvConfig(block_n, block_k, warps, 1, prefetch=prefetch, maxnreg=cap[0] if cap else None)
            forms[spec].update({name: cfg for name in names.split(",")})
    rows = {"": decode_row.ROW_DECODE} if not args.row_tiles else {f"@row-{t}": decode_row.parse_tile(t)
                                                                    for t in args.row_tiles}
    caps = {"": decode_row.SHORT_MAX_SPLITS} if not args.row_max_splits else {f"/{n}": n for n in args.row_max_splits}
    tails = {None: (("", False),), "both": (("", False), ("+squares", True)), "only": (("+squares", True),)}
    outsides = (("", False), ("+outside-before", True)) if args.outside_before else (("", False),)
    attentions = (("", True), ("+no-attention", False)) if args.no_attention else (("", True),)
    forms = {name + suffix + cap_name + tail + out_name + at_name: (table, tile, cap, squares, before, attends)
             for name, table in forms.items() for suffix, tile in rows.items() for cap_name, cap in caps.items()
             for tail, squares in tails[args.squares] for out_name, before in outsides
             for at_name, attends in attentions}
    lm = build_decoder(config, dtype=torch.bfloat16, device=dev)
    kc, vc, tables, query_start, context, positions, slots, tokens = decode_inputs(config, 1, args.context, dev)
    bound = engine_bound(config, args.context)
    paged = PagedAttend(kc, vc, slots, tables, query_start, context, 1, config.head_dim ** -0.5,
                        max_context_len=bound)
    graphs, outputs = {}, {}
    with torch.inference_mode():
        for name, (table, tile, cap, squares, before, attends) in forms.items():
            attend = paged if attends else NoAttention(paged)
            lm.set_one_token(OneTokenConfig(norm_squares=squares))
            head, pick = outside(lm, before)
            decode_row.ROW_DECODE, decode_row.SHORT_MAX_SPLITS = tile, cap  # (what the graph captures)
            for projection, cfg in table.items():
                gemv.CONFIGS[keys[projection]] = cfg
            for _ in range(3):
                pick(head(lm(tokens, positions, attend)))
            torch.cuda.synchronize()
            graphs[name] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[name]):
                outputs[name] = pick(head(lm(tokens, positions, attend)))
        times = {name: [] for name in forms}
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
        traces = {name: graph_trace.trace(graph.replay) for name, graph in graphs.items()} if args.trace else {}
    bandwidth = args.bandwidth or measure("cuda:0").copy_bytes_per_s
    read = num_parameters(config) - head_parameters(config)[1]  # (as decode_profile.py: an untied embedding's rows)
    floor_ms = read * 2 / bandwidth * 1e3
    report = {"device": torch.cuda.get_device_name(), "preset": args.preset, "context": args.context,
              "attention_bound": bound, "bandwidth": bandwidth, "floor_ms": floor_ms,
              "command": "python " + " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"),
              "same_token": len({int(t) for n, t in outputs.items() if forms[n][5]}) == 1, "forms": {}}  # (attending)
    for name, ms in times.items():
        median = statistics.median(ms)
        report["forms"][name] = {"configs": {k: repr(v) for k, v in forms[name][0].items()},
                                 "row_tile": repr(forms[name][1]), "row_max_splits": forms[name][2],
                                 "norm_squares": forms[name][3], "outside_before": forms[name][4],
                                 "attention": forms[name][5],
                                 "graph_step_ms_median": median, "vs_floor": median / floor_ms, "rounds_ms": ms}
        print(f"{name:18s} {median:.4f} ms  {median / floor_ms:.4f}x floor  (rounds {min(ms):.4f}-{max(ms):.4f})",
              flush=True)
        if name in traces:
            labelled = graph_trace.layer_positions(traces[name], config.num_layers)
            rows = graph_trace.shares(labelled)
            middle = graph_trace.timeline(labelled, "gemv_kernel#0", config.num_layers // 2)
            report["forms"][name]["trace"] = {"step_us": graph_trace.step_us(traces[name]), "kernels": rows,
                                              "middle_layer": middle}
            print(f"  traced {graph_trace.step_us(traces[name]):.1f} us:", "; ".join(
                f"{r['kernel']} x{r['count']} {r['share_us']:.1f} (mean {r['mean_us']:.2f})" for r in rows[:14]))
            print("  middle layer:", "; ".join(f"{k} {a:.2f}-{b:.2f}" for k, a, b in middle))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
