"""One token's projections (kernels/gemv.py) against cuBLAS: each Llama-2-7B projection over
`layers` distinct weights (so that none is served from L2), as one CUDA graph, for a sweep of
block shapes; then a layer's four projections in a chain of `layers` layers, with and without
programmatic dependent launch, against the cuBLAS path with the fused norm and SiLU kernels
between its GEMVs (what a Llama layer ran before), and with o and down writing their partial sums of
squares for the next norms (`squares_pdl_ms@CAP`, q | k | v's and gate | up's registers capped at CAP).
Bandwidth = weight bytes / time. `--sweep none`: the chains only, with this device's configs.

    python bench/gemv.py --out bench/results/gemv-NVIDIA-H200-DATE.json
"""
import argparse
import itertools
import json
from dataclasses import replace
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchmaker.cells.decoder_config import PRESETS  # noqa: E402
from batchmaker.kernels import gemv  # noqa: E402
from batchmaker.kernels.fused_decoder import add_rms_norm, silu_mul  # noqa: E402
from batchmaker.kernels.skinny_routes import median_replay_ms  # noqa: E402


def projections(config) -> dict[str, tuple[int, int, bool]]:
    """A Llama layer's one-token products and the LM head's, by name: their kernels/gemv.py CONFIGS keys
    (n_out, k_in, silu; gate | up's n_out is the intermediate size, its weight twice as many rows)."""
    h, i = config.hidden_size, config.intermediate_size
    return {"qkv": ((config.num_heads + 2 * config.num_kv_heads) * config.head_dim, h, False), "o": (h, h, False),
            "gate_up": (i, h, True), "down": (h, i, False), "head": (config.vocab_size, h, False)}


def best_configs(path) -> dict[tuple[int, int, bool], "gemv.GemvConfig"]:
    """The fastest config per CONFIGS key in a JSON this script wrote (its "best")."""
    best = json.loads(Path(path).read_text())["best"]
    return {(n, k, bool(silu)): gemv.GemvConfig(*shape)
            for (n, k, silu), shape in ((tuple(map(int, key.split(","))), shape) for key, shape in best.items())}


def graph_ms(fn, replays: int = 20) -> float:
    """Median ms of one replay of `fn` captured as a CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_replay_ms(graph, replays)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-2-7b")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--sweep", choices=("all", "dot", "plain", "prefetch", "none"), default="all",
                    help="dot: only the tensor-core kernel's block shapes (and the current CONFIGS); plain: only the "
                         "CUDA-core kernel's; prefetch: the CUDA-core kernel's with the next tile loaded ahead (and "
                         "the current CONFIGS); none: only the chains, with this device's configs")
    ap.add_argument("--squares-maxnreg", type=int, nargs="+", default=[128],
                    help="the chain with partial sums of squares again with q | k | v's and gate | up's registers "
                         "capped at each (0: uncapped)")
    ap.add_argument("--head", action="store_true", help="also sweep the LM head's product (not in the chain)")
    ap.add_argument("--only", nargs="+", choices=("qkv", "o", "gate_up", "down", "head"), default=None,
                    help="sweep these projections only (the chain uses CONFIGS for the others)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import triton
    if args.sweep != "none":
        gemv.DEVICE_CONFIGS.clear()  # (the sweep sets CONFIGS: no device's table stands before them)
    c, dev, dt = PRESETS[args.preset], torch.device("cuda"), torch.bfloat16
    h = c.hidden_size
    g = torch.Generator(device=dev).manual_seed(0)

    def weights(n, k, count):
        return [torch.randn(n, k, device=dev, dtype=dt, generator=g) * 0.02 for _ in range(count)]

    shapes = projections(c)
    if not args.head:  # (with it: 4 copies of the LM head, 1 GB and more, none from L2)
        del shapes["head"]
    w = {name: weights(2 * n if silu else n, k, 4 if name == "head" else args.layers)
         for name, (n, k, silu) in shapes.items()}
    x = {name: torch.randn(1, k, device=dev, dtype=dt, generator=g) for name, (n, k, silu) in shapes.items()}
    res = {name: torch.randn(1, k, device=dev, dtype=dt, generator=g) for name, (n, k, silu) in shapes.items()}
    nw = torch.ones(h, device=dev, dtype=dt)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "preset": args.preset, "layers": args.layers, "command": "python " + " ".join(sys.argv),
              "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "shapes": {}, "chain": {}}

    def ours(name):
        n, k, silu = shapes[name]
        if name == "qkv":
            return lambda: [gemv.norm_linear(x[name], res[name], nw, 1e-5, wl) for wl in w[name]]
        if name == "gate_up":
            return lambda: [gemv.norm_gate_up(x[name], res[name], nw, 1e-5, wl) for wl in w[name]]
        if name == "head":  # (the final norm, no residual)
            return lambda: [gemv.norm_linear(x[name], None, nw, 1e-5, wl) for wl in w[name]]
        return lambda: [gemv.linear(x[name], wl) for wl in w[name]]

    def cublas(name):
        if name == "qkv":
            return lambda: [torch.nn.functional.linear(add_rms_norm(x[name], res[name], nw, 1e-5)[1], wl) for wl in w[name]]
        if name == "gate_up":
            return lambda: [silu_mul(torch.nn.functional.linear(add_rms_norm(x[name], res[name], nw, 1e-5)[1], wl))
                            for wl in w[name]]
        return lambda: [torch.nn.functional.linear(x[name], wl) for wl in w[name]]

    candidates = [gemv.GemvConfig(bn, bk, nwarps, st) for bn, bk, nwarps, st in
                  itertools.product((8, 16, 32), (256, 512, 1024), (4, 8), (1, 3))]
    dot = [gemv.GemvConfig(bn, bk, 4, st, dot=True) for bn, bk, st in
           itertools.product((16, 32, 64), (64, 128, 256), (3, 4, 6))]
    if args.sweep == "dot":  # also 2 or 5 stages, with 4 or 8 warps
        dot += [gemv.GemvConfig(bn, bk, nw, st, dot=True) for bn, bk, nw, st in
                itertools.product((16, 32, 64), (64, 128, 256), (4, 8), (2, 5))]
    current = list(dict.fromkeys(gemv.CONFIGS.values()))
    plain = [gemv.GemvConfig(bn, bk, nwarps, 1) for bn, bk, nwarps in itertools.product((4, 8, 16), (512, 1024), (4, 8))]
    prefetch = [gemv.GemvConfig(bn, bk, nwarps, 1, prefetch=1) for bn, bk, nwarps in
                ((8, 512, 8), (8, 1024, 4), (4, 1024, 4), (16, 512, 8))]  # (the first H100 sweep's best four)
    prefetch += [gemv.GemvConfig(bn, bk, nwarps, 1, prefetch=2) for bn, bk, nwarps in
                 ((8, 256, 4), (8, 256, 8), (8, 512, 4), (8, 512, 8), (4, 512, 4), (4, 512, 8), (4, 1024, 8),
                  (16, 256, 8), (16, 512, 8), (2, 1024, 4), (2, 2048, 8))]
    prefetch += [gemv.GemvConfig(bn, bk, nwarps, 1, prefetch=depth) for bn, bk, nwarps, depth in  # (long rows a
                 ((1, 1024, 4, 2), (1, 2048, 4, 2), (1, 2048, 8, 2), (1, 4096, 8, 1), (2, 4096, 8, 1),  # program: down)
                  (2, 2048, 4, 2), (2, 2048, 8, 1), (2, 1024, 8, 2), (4, 2048, 8, 2), (8, 1024, 8, 2), (4, 1024, 4, 2))]
    candidates = {"all": candidates + dot + prefetch, "dot": current + dot, "plain": current + plain,
                  "prefetch": current + prefetch, "none": []}[args.sweep]
    best = {}
    for name, (n, k, silu) in shapes.items():
        if (args.only and name not in args.only) or not candidates:
            continue
        nbytes = w[name][0].numel() * 2
        row = {"n": n, "k": k, "silu": silu, "cublas_ms": graph_ms(cublas(name)) / len(w[name]), "sweep": []}
        for cfg in candidates:
            if (2 * n if silu else n) % cfg.block_n or (name == "qkv" and cfg.block_n % 2):  # (gate | up: pairs of
                continue  # rows; q | k | v: RoPE's pairs)
            gemv.CONFIGS[(n, k, silu)] = cfg
            try:
                ms = graph_ms(ours(name)) / len(w[name])
            except Exception as e:  # a config the compiler refuses (registers, shared memory)
                row["sweep"].append({"config": cfg.__repr__(), "error": f"{type(e).__name__}: {e}"[:200]})
                continue
            row["sweep"].append({"config": repr(cfg), "ms": ms, "tb_per_s": nbytes / ms / 1e9})
            if (n, k, silu) not in best or ms < best[(n, k, silu)][1]:
                best[(n, k, silu)] = (cfg, ms)
        cfg, ms = best[(n, k, silu)]
        gemv.CONFIGS[(n, k, silu)] = cfg
        row.update(best=repr(cfg), best_ms=ms, best_tb_per_s=nbytes / ms / 1e9,
                   cublas_tb_per_s=nbytes / row["cublas_ms"] / 1e9, weight_bytes=nbytes)
        report["shapes"][name] = row
        print(f"{name:8s} n={n} k={k}: cuBLAS{' + small kernels' if name in ('qkv', 'gate_up') else ''} "
              f"{row['cublas_ms'] * 1e3:.1f} us ({row['cublas_tb_per_s']:.2f} TB/s), ours {ms * 1e3:.1f} us "
              f"({row['best_tb_per_s']:.2f} TB/s) with {cfg}", flush=True)

    # what decode_profile.py --gemv-configs reads
    report["best"] = {",".join(map(str, map(int, key))): [c.block_n, c.block_k, c.num_warps, c.num_stages, c.dot,
                                                          c.prefetch]
                      for key, (c, _) in best.items()}
    layer_bytes = sum(w[name][0].numel() * 2 for name in shapes if name != "head")

    def chain_ours(pdl: bool):
        hidden, residual = x["qkv"], res["qkv"]
        for layer in range(args.layers):
            residual, qkv = gemv.norm_linear(hidden, residual, nw, 1e-5, w["qkv"][layer], pdl=pdl)
            out = gemv.linear(qkv[:, :h].contiguous(), w["o"][layer], pdl=pdl)
            residual, act = gemv.norm_gate_up(out, residual, nw, 1e-5, w["gate_up"][layer], pdl=pdl)
            hidden = gemv.linear(act, w["down"][layer], pdl=pdl)

    def chain_squares(pdl: bool):  # o and down add the residual and write their partial sums of squares, which
        hidden, residual = x["qkv"], res["qkv"]  # the next norms take instead of a pass over their input
        squares = None
        for layer in range(args.layers):
            if squares is None:
                residual, qkv = gemv.norm_linear(hidden, residual, nw, 1e-5, w["qkv"][layer], pdl=pdl)
            else:
                residual, qkv = gemv.norm_linear(hidden, None, nw, 1e-5, w["qkv"][layer], pdl=pdl, squares=squares)
            residual, squares = gemv.linear_residual(qkv[:, :h].contiguous(), w["o"][layer], residual, pdl=pdl)
            act = gemv.norm_gate_up(residual, None, nw, 1e-5, w["gate_up"][layer], pdl=pdl, squares=squares)[1]
            hidden, squares = gemv.linear_residual(act, w["down"][layer], residual, pdl=pdl)

    def chain_cublas():
        hidden, residual = x["qkv"], res["qkv"]
        lin = torch.nn.functional.linear
        for layer in range(args.layers):
            residual, normed = add_rms_norm(hidden, residual, nw, 1e-5)
            qkv = lin(normed, w["qkv"][layer])
            out = lin(qkv[:, :h].contiguous(), w["o"][layer])
            residual, normed = add_rms_norm(out, residual, nw, 1e-5)
            hidden = lin(silu_mul(lin(normed, w["gate_up"][layer])), w["down"][layer])

    chain = {"cublas_ms": graph_ms(chain_cublas)}
    for pdl in (False, True):
        try:
            chain["pdl_ms" if pdl else "ours_ms"] = graph_ms(lambda: chain_ours(pdl))
        except Exception as e:
            chain["pdl_error" if pdl else "ours_error"] = f"{type(e).__name__}: {e}"[:300]
    picked = {key: gemv.pick_config(*key, device=dev) for key in shapes.values()}  # (as the chains above ran)
    gemv.DEVICE_CONFIGS.clear()
    gemv.CONFIGS.update(picked)
    for cap in args.squares_maxnreg:  # (q | k | v's and gate | up's tiles capped; o's and down's as configured)
        for key in (shapes["qkv"], shapes["gate_up"]):
            gemv.CONFIGS[key] = replace(picked[key], maxnreg=cap or None)
        try:
            chain[f"squares_pdl_ms@{cap}"] = graph_ms(lambda: chain_squares(True))
        except Exception as e:
            chain[f"squares_error@{cap}"] = f"{type(e).__name__}: {e}"[:300]
        gemv.CONFIGS.update(picked)
    chain["bytes"] = layer_bytes * args.layers
    chain["floor_ms"] = chain["bytes"] / 4.23e12 * 1e3
    report["chain"] = chain
    print("chain of", args.layers, "layers (4 projections each; no RoPE or attention):",
          {k: round(v, 4) if isinstance(v, float) else v for k, v in chain.items()}, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
