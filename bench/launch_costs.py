"""What each step of a prefill layer costs the host, against what it costs the GPU: a small
iteration (one sequence's T new tokens over a paged context) is host-bound when the first is
larger, and then the turn's latency is the sum of the host costs, not of the kernels.

For each step of a Llama layer (the path exec/iterations.py runs for prompt chunks: fused norm,
cuBLAS q|k|v, RoPE + K/V write, paged attention, o_proj, norm, gate|up, SiLU x up, down) and for
the whole layer: host microseconds per call (N calls queued back to back, timed before the
synchronize: launches only, as long as the GPU's queue does not fill) and GPU microseconds per
call (CUDA events around N calls); and the layer replayed as one CUDA graph. CUDA only.

    python bench/launch_costs.py --preset llama-2-7b --tokens 64 --context 1024
"""
import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import write_results  # noqa: E402


def per_call(fn, calls: int) -> tuple[float, float]:
    """(host us, GPU us) per call of fn."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    host = (time.perf_counter() - t0) / calls * 1e6
    end.synchronize()
    return host, start.elapsed_time(end) / calls * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-2-7b")
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--context", type=int, default=1024, help="positions before the new tokens")
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    from batchmaker.cells.decoder import build_decoder
    from batchmaker.cells.decoder_config import PRESETS
    from batchmaker.kernels.fused_decoder import silu_mul
    from batchmaker.kernels.paged_attention import PagedAttend, paged_attention
    dev, bs = torch.device("cuda"), 16
    config = dataclasses.replace(PRESETS[args.preset], num_layers=1)
    lm = build_decoder(config, dtype=torch.bfloat16, device=dev)
    layer = lm.layers[0]
    attn, mlp = layer.attn, layer.mlp
    rows = []
    with torch.inference_mode():
        for tokens in args.tokens:
            total = args.context + tokens
            blocks = -(-total // bs)
            shape = (1, blocks + 1, bs, config.num_kv_heads, config.head_dim)
            k_cache = torch.randn(shape, dtype=torch.bfloat16, device=dev)
            v_cache = torch.randn(shape, dtype=torch.bfloat16, device=dev)
            positions = torch.arange(args.context, total, device=dev)
            table = torch.arange(1, blocks + 1, dtype=torch.int32, device=dev)[None]
            slots = (table[0].long()[positions // bs]) * bs + positions % bs
            query_start = torch.tensor([0, tokens], dtype=torch.int32, device=dev)
            context_lens = torch.tensor([total], dtype=torch.int32, device=dev)
            attend = PagedAttend(k_cache, v_cache, slots, table, query_start, context_lens, tokens,
                                 config.head_dim ** -0.5, max_context_len=total, attention=paged_attention)
            x = torch.randn(tokens, config.hidden_size, dtype=torch.bfloat16, device=dev)
            rotate = lm.rotary(positions)
            qkv = attn.qkv_proj(x)
            q, k, v = (t.view(tokens, -1, config.head_dim) for t in qkv.split(attn.sizes, dim=-1))
            q_rot = rotate.write_kv(q, k, v, *attend.kv_cache(0))
            mixed = attend.attend_cached(0, q_rot).reshape(tokens, -1)
            gate_up = mlp.gate_up_proj(x)
            act = torch.nn.functional.silu(gate_up[:, :config.intermediate_size]) * gate_up[:, config.intermediate_size:]
            steps = {
                "add_rms_norm": lambda: layer.attn_norm.add_forward(x, x),
                "qkv_proj": lambda: attn.qkv_proj(x),
                "rope_write_kv": lambda: rotate.write_kv(q, k, v, *attend.kv_cache(0)),
                "paged_attention": lambda: attend.attend_cached(0, q_rot),
                "o_proj": lambda: attn.o_proj(mixed),
                "gate_up_proj": lambda: mlp.gate_up_proj(x),
                "silu_mul": lambda: silu_mul(gate_up),
                "down_proj": lambda: mlp.down_proj(act),
                "layer": lambda: layer(x, x, rotate, attend),
            }
            row = {"tokens": tokens, "context": args.context, "steps": {}}
            for name, fn in steps.items():
                host, gpu = per_call(fn, args.calls)
                row["steps"][name] = {"host_us": host, "gpu_us": gpu}
                print(tokens, name, f"host {host:.1f} us, GPU {gpu:.1f} us", flush=True)
            try:  # the same layer as one CUDA graph: what a graphed prefill would cost the host
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    layer(x, x, rotate, attend)
                host, gpu = per_call(graph.replay, args.calls)
                row["layer_graph"] = {"host_us": host, "gpu_us": gpu}
                print(tokens, "layer as a CUDA graph", f"host {host:.1f} us, GPU {gpu:.1f} us", flush=True)
            except Exception as e:  # (a step that cannot be captured: say which)
                row["layer_graph"] = {"error": f"{type(e).__name__}: {e}"}
            parts = [v for k, v in row["steps"].items() if k != "layer"]
            row["sum_host_us"] = sum(p["host_us"] for p in parts)
            row["sum_gpu_us"] = sum(p["gpu_us"] for p in parts)
            rows.append(row)
    payload = {"preset": args.preset, "calls": args.calls, "rows": rows}

    def plot(fig):
        ax = fig.add_subplot(1, 1, 1)
        names = [k for k in rows[0]["steps"] if k != "layer"]
        width = 0.8 / (2 * len(rows))
        for i, row in enumerate(rows):
            for j, key in enumerate(("host_us", "gpu_us")):
                xs = [n + (2 * i + j) * width for n in range(len(names))]
                ax.bar(xs, [row["steps"][n][key] for n in names], width,
                       label=f"T={row['tokens']} {key.split('_')[0]}")
        ax.set_xticks([n + 0.4 for n in range(len(names))], names, rotation=30, ha="right")
        ax.set_ylabel("us per call")
        ax.set_title(f"{args.preset} prefill layer, context {args.context}: host vs GPU per step")
        ax.legend(fontsize=7)
    print(write_results(f"launch-costs-{args.preset}", "cuda", payload, plot), flush=True)


if __name__ == "__main__":
    main()
