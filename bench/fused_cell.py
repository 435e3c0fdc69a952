"""Fused cell kernels (kernels/fused_*.py) against the torch paths and cuDNN, per step (issue 5).

    python bench/fused_cell.py           # h = embed = 1024, fp16 and bf16, batches 1 64 256 512
    python bench/fused_cell.py --sweep   # also time each candidate block shape of the fused kernels (fp16)
    TRITON_INTERPRET=1 python bench/fused_cell.py --device cpu --hidden 32 --embed 48 --batches 3 --dtypes fp32
                                         # a smoke run of this script on the CPU (times mean nothing)

Every variant runs `--steps` chained steps captured in one CUDA graph, replayed back to back;
µs per step = median over 5 windows of `--replays` replays. State lives in a pool of 4B + 1 rows;
gathering variants read one half of the rows and write the other, alternating each step.
LSTM (embedding + nn.LSTMCell, vocab --vocab):
  limit   nn.LSTMCell on a static input [B, embed] (no embedding, no gather): the GPU-bound limit
  torch   index_select h, c + embedding + nn.LSTMCell + index_copy_ h, c
  fused   fused_lstm_step: all of that in one kernel
  cudnn   nn.LSTM over a padded [--seq-len, B] input, µs per time step
TreeLSTM internal cell: limit (Linear(2h, 5h) + gates on static inputs), torch (4 index_select
+ cell + 2 index_copy_), fused. Leaf cell: limit (Linear + gates on a static input), torch
(embedding + cell + 2 index_copy_), fused. Beside the graphs, host wall time per eager step of
torch and fused (what launching costs without a graph).
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import replay_windows, write_results  # noqa: E402

from batchmaker.cells.lstm import LSTMCell  # noqa: E402
from batchmaker.cells.treelstm import TreeInternalCell, TreeLeafCell  # noqa: E402
from batchmaker.kernels.cell_launch import BlockConfig, pick_config  # noqa: E402
from batchmaker.kernels.fused_lstm import LSTMWeights, fused_lstm_step, reference_lstm_step  # noqa: E402
from batchmaker.kernels.fused_treelstm import (TreeInternalWeights, TreeLeafWeights,  # noqa: E402
                                               fused_tree_internal_step, fused_tree_leaf_step,
                                               reference_tree_internal_step, reference_tree_leaf_step)
from batchmaker.unfolders.common import as_dtype  # noqa: E402

TARGET_RATIO_AT_512 = 1.1
SWEEP = {  # largest batch -> candidate block shapes (bm, bn, bk, warps, stages) of the fused kernels
    16: [(16, 16, 128, 4, 4), (16, 32, 128, 4, 4), (16, 32, 64, 4, 6)],
    64: [(32, 32, 64, 4, 4), (64, 16, 128, 4, 4), (64, 32, 64, 4, 4), (64, 16, 64, 4, 6)],
    1 << 62: [(64, 32, 64, 4, 4), (64, 32, 128, 4, 3), (64, 64, 64, 4, 3), (64, 64, 64, 8, 3),
              (64, 64, 32, 4, 5), (128, 32, 64, 4, 3), (128, 64, 64, 8, 3)],
}


# timing ------------------------------------------------------------------------------------------

def graph_us(step, steps: int, replays: int, device) -> float:
    """Median µs per step of `steps` calls of `step` in one CUDA graph replayed back to back."""
    if device.type != "cuda":  # smoke runs: eager wall time
        step()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        return (time.perf_counter() - t0) * 1e6 / steps
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the capture: compile, handles, allocator
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(steps):
            step()
    return statistics.median(replay_windows(graph, steps, replays, warm=3))


def eager_us(step, iters: int, device) -> float:
    """Host wall time per eagerly launched step, the queue drained at the end."""
    for _ in range(3):
        step()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    _sync(device)
    return (time.perf_counter() - t0) * 1e6 / iters


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# state: a pool, two halves of rows, steps alternate between them --------------------------------

class PingPong:
    """Row sets 0 and 1 of a [4B + 1, hidden] pool; step k reads set k % 2 and writes the other."""

    def __init__(self, batch: int, hidden: int, dtype, device, g: torch.Generator):
        self.pool = (torch.randn(4 * batch + 1, hidden, generator=g) * 0.5).to(device, dtype)
        self.pool[0] = 0
        perm = torch.randperm(4 * batch, generator=g) + 1
        self.h = [perm[:batch].to(device), perm[2 * batch:3 * batch].to(device)]
        self.c = [perm[batch:2 * batch].to(device), perm[3 * batch:].to(device)]
        # children of a tree node: rows of the read set, repeats allowed
        self.picks = [torch.randint(0, batch, (batch,), generator=g).to(device) for _ in range(4)]
        self.side = 0

    def flip(self) -> tuple[int, int]:
        s = self.side
        self.side ^= 1
        return s, s ^ 1

    def children(self, s: int):  # h_l, c_l, h_r, c_r rows in set s
        return (self.h[s][self.picks[0]], self.c[s][self.picks[1]], self.h[s][self.picks[2]],
                self.c[s][self.picks[3]])


def rel_error(fused, reference, pool: torch.Tensor, rows: list[torch.Tensor]) -> float:
    """‖fused - reference‖ / ‖reference‖ over the output rows of one step from the same pool."""
    got, want = pool.clone(), pool.clone()
    got[torch.cat(rows)] = float("nan")  # poisoned: an unwritten row shows as NaN
    want[torch.cat(rows)] = float("nan")
    fused(got)
    reference(want)
    index = torch.cat(rows)
    diff = (got[index].float() - want[index].float()).norm() / want[index].float().norm()
    return float(diff)


# variants ---------------------------------------------------------------------------------------

def lstm_variants(args, batch: int, dtype, device, g) -> dict:
    cell = LSTMCell(args.vocab, args.embed, args.hidden, seed=0, dtype=dtype).to(device).eval()
    weights = LSTMWeights.from_cell(cell)
    st = PingPong(batch, args.hidden, dtype, device, g)
    tokens = torch.randint(0, args.vocab, (batch,), generator=g).to(device)
    x = cell.embedding(tokens)
    hc = [st.pool[st.h[0]], st.pool[st.c[0]]]

    def limit():
        hc[:] = cell.lstm(x, tuple(hc))

    def torch_path():
        s, t = st.flip()
        h, c = cell.lstm(cell.embedding(tokens), (st.pool.index_select(0, st.h[s]), st.pool.index_select(0, st.c[s])))
        st.pool.index_copy_(0, st.h[t], h)
        st.pool.index_copy_(0, st.c[t], c)

    def fused(config=None):
        s, t = st.flip()
        fused_lstm_step(weights, tokens, st.h[s], st.c[s], st.h[t], st.c[t], st.pool, config=config)

    out = {"flops_per_step": 2 * batch * (args.embed + args.hidden) * 4 * args.hidden,
           "rel_error_vs_reference": rel_error(
               lambda p: fused_lstm_step(weights, tokens, st.h[0], st.c[0], st.h[1], st.c[1], p),
               lambda p: reference_lstm_step(weights, tokens, st.h[0], st.c[0], st.h[1], st.c[1], p),
               st.pool, [st.h[1], st.c[1]])}
    config = pick_config("lstm", batch, args.hidden, (args.embed, args.hidden), 4, x.element_size())
    out.update(time_variants(args, device, {"limit": limit, "torch": torch_path, "fused": fused}, config))
    if device.type == "cuda":
        out["cudnn"] = cudnn_us(cell, args, batch, device, g)
    out.update(sweep(args, device, batch, dtype, fused))
    return out


def cudnn_us(cell, args, batch: int, device, g) -> float:
    lstm = torch.nn.LSTM(args.embed, args.hidden, device=device, dtype=cell.lstm.weight_ih.dtype).eval()
    for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):  # in place: keeps cuDNN's one flat buffer
        getattr(lstm, f"{name}_l0").copy_(getattr(cell.lstm, name))
    tokens = torch.randint(0, args.vocab, (args.seq_len, batch), generator=g).to(device)
    x = cell.embedding(tokens)  # [T, B, embed]
    zeros = torch.zeros(1, batch, args.hidden, dtype=x.dtype, device=device)
    return graph_us(lambda: lstm(x, (zeros, zeros)), 1, args.replays, device) / args.seq_len


def internal_variants(args, batch: int, dtype, device, g) -> dict:
    cell = TreeInternalCell(args.hidden, seed=0, dtype=dtype).to(device).eval()
    weights = TreeInternalWeights.from_cell(cell)
    st = PingPong(batch, args.hidden, dtype, device, g)
    children = [st.children(0), st.children(1)]  # row lists of each set, made once
    static = [st.pool[r] for r in children[0]]

    def limit():
        cell(*static)

    def torch_path():
        s, t = st.flip()
        out = cell(*(st.pool.index_select(0, r) for r in children[s]))
        st.pool.index_copy_(0, st.h[t], out["h"])
        st.pool.index_copy_(0, st.c[t], out["c"])

    def fused(config=None):
        s, t = st.flip()
        fused_tree_internal_step(weights, *children[s], st.h[t], st.c[t], st.pool, config=config)

    out = {"flops_per_step": 2 * batch * 2 * args.hidden * 5 * args.hidden,
           "rel_error_vs_reference": rel_error(
               lambda p: fused_tree_internal_step(weights, *children[0], st.h[1], st.c[1], p),
               lambda p: reference_tree_internal_step(weights, *children[0], st.h[1], st.c[1], p),
               st.pool, [st.h[1], st.c[1]])}
    config = pick_config("tree", batch, args.hidden, (args.hidden,), 5, st.pool.element_size())
    out.update(time_variants(args, device, {"limit": limit, "torch": torch_path, "fused": fused}, config))
    out.update(sweep(args, device, batch, dtype, fused))
    return out


def leaf_variants(args, batch: int, dtype, device, g) -> dict:
    cell = TreeLeafCell(args.vocab, args.embed, args.hidden, seed=0, dtype=dtype).to(device).eval()
    weights = TreeLeafWeights.from_cell(cell)
    st = PingPong(batch, args.hidden, dtype, device, g)
    tokens = torch.randint(0, args.vocab, (batch,), generator=g).to(device)
    x = cell.embedding(tokens)

    def limit():
        i, o, u = cell.iou(x).chunk(3, dim=-1)
        c = torch.sigmoid(i) * torch.tanh(u)
        return torch.sigmoid(o) * torch.tanh(c)

    def torch_path():
        _, t = st.flip()
        out = cell(tokens)
        st.pool.index_copy_(0, st.h[t], out["h"])
        st.pool.index_copy_(0, st.c[t], out["c"])

    def fused(config=None):
        _, t = st.flip()
        fused_tree_leaf_step(weights, tokens, st.h[t], st.c[t], st.pool, config=config)

    out = {"flops_per_step": 2 * batch * args.embed * 3 * args.hidden,
           "rel_error_vs_reference": rel_error(
               lambda p: fused_tree_leaf_step(weights, tokens, st.h[1], st.c[1], p),
               lambda p: reference_tree_leaf_step(weights, tokens, st.h[1], st.c[1], p),
               st.pool, [st.h[1], st.c[1]])}
    config = pick_config("tree", batch, args.hidden, (args.embed,), 3, st.pool.element_size())
    out.update(time_variants(args, device, {"limit": limit, "torch": torch_path, "fused": fused}, config))
    out.update(sweep(args, device, batch, dtype, fused))
    return out


def time_variants(args, device, steps: dict, config: BlockConfig) -> dict:
    out = {name: graph_us(step, args.steps, args.replays, device) for name, step in steps.items()}
    out["fused_config"] = repr(config)
    out["eager_torch"] = eager_us(steps["torch"], args.eager_iters, device)
    out["eager_fused"] = eager_us(steps["fused"], args.eager_iters, device)
    return out


def sweep(args, device, batch: int, dtype, fused) -> dict:
    if not args.sweep or dtype != torch.float16:
        return {}
    times = {}
    for shape in next(shapes for limit, shapes in SWEEP.items() if batch <= limit):
        cfg = BlockConfig(*shape)
        try:
            times[repr(cfg)] = graph_us(lambda: fused(cfg), args.steps, args.replays, device)
        except Exception as e:  # a shape the compiler refuses (shared memory, registers)
            times[repr(cfg)] = f"{type(e).__name__}: {str(e)[:120]}"
    timed = {c: t for c, t in times.items() if isinstance(t, float)}
    best = min(timed, key=timed.get) if timed else None
    return {"sweep": times, "sweep_best": best, "sweep_best_us": timed.get(best)}


# main -------------------------------------------------------------------------------------------

CELLS = {"lstm": lstm_variants, "tree_internal": internal_variants, "tree_leaf": leaf_variants}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--embed", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=30000)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256, 512])
    parser.add_argument("--dtypes", nargs="+", default=["fp16", "bf16"])
    parser.add_argument("--cells", nargs="+", default=list(CELLS), choices=list(CELLS))
    parser.add_argument("--steps", type=int, default=16, help="steps per CUDA graph")
    parser.add_argument("--replays", type=int, default=40, help="graph replays per timed window")
    parser.add_argument("--eager-iters", type=int, default=200)
    parser.add_argument("--seq-len", type=int, default=32, help="cuDNN: time steps per padded sequence")
    parser.add_argument("--sweep", action="store_true", help="time each candidate block shape (fp16)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("fused_cell.py: no CUDA device here (smoke-run with --device cpu and TRITON_INTERPRET=1)",
              file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # one numeric policy
    results = {}
    with torch.inference_mode():
        for cell in args.cells:
            for dtype_name in args.dtypes:
                for batch in args.batches:
                    g = torch.Generator().manual_seed(batch)
                    r = CELLS[cell](args, batch, as_dtype(dtype_name), device, g)
                    r["fused_over_limit"] = r["fused"] / r["limit"]
                    r["torch_over_limit"] = r["torch"] / r["limit"]
                    results.setdefault(cell, {}).setdefault(dtype_name, {})[str(batch)] = r
                    print(f"{cell:13s} {dtype_name} B={batch:4d}  " + _row(r), flush=True)
            payload = {"settings": {**vars(args), "tf32": False},
                       "target_fused_over_limit_at_512": TARGET_RATIO_AT_512, "results": results}
            write_results("fused_cell", str(device), payload)  # what is done so far, should a later cell fail
    path = write_results("fused_cell", str(device), payload, plot=lambda fig: _plot(fig, results, args))
    print(f"wrote {path}")
    _table(results)
    return 0


def _row(r: dict) -> str:
    cols = [f"{k} {r[k]:7.2f}" for k in ("limit", "torch", "fused", "cudnn") if k in r]
    extra = f"  best sweep {r['sweep_best_us']:.2f} {r['sweep_best']}" if r.get("sweep_best") else ""
    return (" | ".join(cols) + f" µs | fused/limit {r['fused_over_limit']:.2f} | eager torch "
            f"{r['eager_torch']:.1f} fused {r['eager_fused']:.1f} µs | rel err {r['rel_error_vs_reference']:.1e}"
            + extra)


def _table(results: dict) -> None:
    print("\n| cell | dtype | B | limit | torch (gather) | fused | cuDNN | fused / limit | torch / limit |")
    print("|---|---|---|---|---|---|---|---|---|")
    for cell, by_dtype in results.items():
        for dtype, by_batch in by_dtype.items():
            for b, r in by_batch.items():
                cudnn = f"{r['cudnn']:.2f}" if "cudnn" in r else "—"
                print(f"| {cell} | {dtype} | {b} | {r['limit']:.2f} | {r['torch']:.2f} | {r['fused']:.2f} | "
                      f"{cudnn} | {r['fused_over_limit']:.2f} | {r['torch_over_limit']:.2f} |")


def _plot(fig, results: dict, args) -> None:
    cells = list(results)
    axes = fig.subplots(1, len(cells), squeeze=False)[0]
    for ax, cell in zip(axes, cells):
        dtype = next(iter(results[cell]))
        by_batch = results[cell][dtype]
        batches = [int(b) for b in by_batch]
        for key, style in (("limit", "k--"), ("torch", "C1-o"), ("fused", "C0-o"), ("cudnn", "C2-s")):
            if all(key in r for r in by_batch.values()):
                ax.plot(batches, [r[key] for r in by_batch.values()], style, label=key, markersize=4)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch")
        ax.set_ylabel("µs per step (CUDA graph)")
        last = by_batch[str(batches[-1])]
        ax.set_title(f"{cell} h={args.hidden} {dtype}\nfused/limit at B={batches[-1]}: "
                     f"{last['fused_over_limit']:.2f}", fontsize=9)
        ax.legend(fontsize=7)


if __name__ == "__main__":
    sys.exit(main())
