"""Where a decode step's GPU time goes: the decoder's forward + head + argmax for B sequences at a
fixed context, as one CUDA graph (timed) and eagerly under the profiler (kernels by name), against
the weight-bytes floor (parameters x bytes / copy bandwidth), and the kernels one step launches
(per step, per layer, by name). Three ways to attend (--attend), all through PagedAttend
(kernels/paged_attention.py; a Llama layer writes K/V in its RoPE step, at batch 1 inside the q | k |
v projection): `engine` bounded as the engine's decode graphs are (core/iteration_shapes.py
GraphShapes.of: SHORT_CONTEXT_LEN for contexts up to it, else the block table's width,
max_positions): what exec/iterations.py replays; `fused` bounded by the step's own context; and
`separate`, K/V written and RoPE applied by kernels of their own, bounded by max_positions (what this
script called `engine` until the twenty-fourth session: not what the engine runs).

    python bench/decode_profile.py --preset llama-2-7b --batch 1 64 --context 360
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def decode_inputs(config, batch: int, context: int, device, block_size: int = 16) -> tuple:
    """One decode step of `batch` sequences at `context` positions over a random bf16 paged cache:
    (k cache, v cache, block tables, query_start, context_lens, positions, K/V slots, tokens)."""
    per_seq = -(-context // block_size)
    shape = (config.num_layers, batch * per_seq + 1, block_size, config.num_kv_heads, config.head_dim)
    kc, vc = (torch.randn(shape, dtype=torch.bfloat16, device=device) for _ in range(2))
    tables = (1 + torch.arange(batch * per_seq, device=device, dtype=torch.int32)).view(batch, per_seq)
    query_start = torch.arange(batch + 1, device=device, dtype=torch.int32)
    context_lens = torch.full((batch,), context, device=device, dtype=torch.int32)
    positions = torch.full((batch,), context - 1, device=device)
    slots = tables[:, -1].long() * block_size + (context - 1) % block_size
    tokens = torch.randint(1, config.vocab_size, (batch,), device=device)
    return kc, vc, tables, query_start, context_lens, positions, slots, tokens


def engine_bound(config, context: int) -> int:
    """The attention bound of the engine's decode graph at this context (core/iteration_shapes.py
    GraphShapes.of: SHORT_CONTEXT_LEN up to it, else the block table's width, max_positions)."""
    from batchmaker.kernels.paged_attention import SHORT_CONTEXT_LEN
    return SHORT_CONTEXT_LEN if context <= SHORT_CONTEXT_LEN else config.max_positions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-2-7b")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--context", type=int, default=360)
    ap.add_argument("--bandwidth", type=float, default=4.23e12)
    ap.add_argument("--attend", nargs="+", choices=("fused", "engine", "separate"), default=["engine"])
    ap.add_argument("--engine-window", type=float, default=0.0,
                    help="also profile the engine decoding one request for this many seconds: GPU busy fraction")
    ap.add_argument("--gemv-configs", default=None,
                    help="a bench/gemv.py JSON: its fastest block shapes for the one-token projections")
    ap.add_argument("--one-token", choices=("gemv", "gemv-rope", "cublas"), default="gemv-rope",
                    help="batch-1 projections: fused matrix-vector products (gemv-rope, the engine's default: RoPE and "
                         "the K/V write inside q | k | v), or cuBLAS with the small kernels (cells/llama.py "
                         "OneTokenConfig)")
    ap.add_argument("--no-pdl", action="store_true", help="the matrix-vector products without PDL")
    ap.add_argument("--eager-only", action="store_true",
                    help="run each step eagerly 4 times and stop (for a kernel profiler such as ncu: no graph, no "
                         "torch profiler)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.gemv_configs:
        from batchmaker.kernels import gemv
        from bench.gemv import best_configs
        gemv.DEVICE_CONFIGS.clear()  # (the file's configs run on any device)
        gemv.CONFIGS.update(best_configs(args.gemv_configs))
    from batchmaker.cells.decoder import build_decoder
    from batchmaker.cells.decoder_config import PRESETS, num_parameters
    from batchmaker.kernels.paged_attention import PagedAttend, paged_attention, write_kv
    config, dev = PRESETS[args.preset], torch.device("cuda")
    lm = build_decoder(config, dtype=torch.bfloat16, device=dev)
    if hasattr(lm, "set_one_token"):
        from batchmaker.cells.llama import OneTokenConfig
        lm.set_one_token(None if args.one_token == "cublas" else
                         OneTokenConfig(pdl=not args.no_pdl, rope_in_qkv=args.one_token == "gemv-rope"))
    from bench.chat_roofline import head_parameters
    read = num_parameters(config) - head_parameters(config)[1]  # (an untied embedding: one row a token, not read)
    floor_ms = read * 2 / args.bandwidth * 1e3
    report = {"preset": args.preset, "context": args.context, "floor_ms": floor_ms, "device": torch.cuda.get_device_name(),
              "command": "python " + " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"),
              "one_token": args.one_token, "pdl": not args.no_pdl, "rows": []}
    for batch, how in ((b, a) for b in args.batch for a in args.attend):
        kc, vc, tables, query_start, context, positions, slots, tokens = decode_inputs(config, batch, args.context,
                                                                                       dev)
        scale = config.head_dim ** -0.5
        if how in ("fused", "engine"):
            bound = args.context if how == "fused" else engine_bound(config, args.context)
            attend = PagedAttend(kc, vc, slots, tables, query_start, context, 1, scale, max_context_len=bound)
        else:
            def attend(layer, q, k, v):
                write_kv(k, v, kc[layer], vc[layer], slots)
                return paged_attention(q, kc[layer], vc[layer], tables, query_start, context, 1, scale,
                                       max_context_len=config.max_positions)

        def step():
            return lm.head(lm(tokens, positions, attend)).argmax(-1)

        with torch.inference_mode():
            for _ in range(4 if args.eager_only else 3):
                step()
            torch.cuda.synchronize()
            if args.eager_only:
                continue
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            graph.replay()
            start.record()
            for _ in range(20):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            graph_ms = start.elapsed_time(end) / 20
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
        kernels = {}  # name (cut at 90 characters) -> (launches, ms)
        for e in prof.key_averages():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                count, ms = kernels.get(e.key[:90], (0, 0.0))
                kernels[e.key[:90]] = (count + e.count, ms + e.device_time_total / 1e3)
        total = sum(ms for _, ms in kernels.values())
        top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:12]
        num_kernels = sum(c for c, _ in kernels.values())
        per_layer = {k: c // config.num_layers for k, (c, _) in kernels.items() if c >= config.num_layers}
        row = {"batch": batch, "attend": how, "graph_step_ms": graph_ms, "vs_floor": graph_ms / floor_ms,
               "kernels_per_step": num_kernels, "kernels_per_layer": sum(per_layer.values()),
               "kernels_outside_layers": num_kernels - config.num_layers * sum(per_layer.values()),
               "kernel_ms_eager": total, "top_kernels": [{"name": k, "count": c, "ms": ms} for k, (c, ms) in top],
               "layer_kernels": dict(sorted(per_layer.items(), key=lambda kv: -kv[1]))}
        report["rows"].append(row)
        print(json.dumps(row, indent=1), flush=True)
    if args.engine_window:
        report["engine"] = engine_busy(args, lm)
        print(json.dumps(report["engine"]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


def engine_busy(args, lm) -> dict:
    """One request decoding in the engine: tokens/s and how much of a profiled window the GPU ran
    kernels (the rest is the device waiting for the host)."""
    import threading
    import time

    from batchmaker import Engine, EngineConfig
    from batchmaker.cells.decoder_cell import DecoderCell, KVSettings
    from batchmaker.forms import Generate
    from batchmaker.model import Model
    cell = DecoderCell(lm, KVSettings(max_seqs=8, num_blocks=4096))
    model = Model("llama", {"decoder": cell}, Generate("decoder"), batch_sizes={"decoder": (1, 2, 4, 8)})
    stamps, started = [], threading.Event()
    with Engine([model], EngineConfig(devices=("cuda:0",))) as engine:
        future = engine.submit("llama", {"tokens": list(range(1, args.context)), "max_new_tokens": 2000,
                                         "ignore_eos": True},
                               on_partial=lambda p: (stamps.append(time.perf_counter()), started.set()))
        started.wait(60)
        time.sleep(0.5)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            time.sleep(args.engine_window)
        engine.cancel(future.request_id)
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, end = 0.0, None
    for a, b in spans:  # the union of kernel intervals (µs)
        if end is None or a > end:
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    window = spans[-1][1] - spans[0][0]
    gaps = [b - a for a, b in zip(stamps, stamps[1:])][5:]
    return {"token_ms_median": 1e3 * sorted(gaps)[len(gaps) // 2], "gpu_busy_fraction": busy / window,
            "window_ms": window / 1e3}


if __name__ == "__main__":
    main()
