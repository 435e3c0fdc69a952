"""Can a mixed iteration's decode attention (bound by reading K/V) hide under its prompt chunk's
projections (bound by FLOPs)? The decoder's layers on Llama-2-7B's shapes, as the engine runs a
mixed batch today against the batch split in two forwards (prompt tokens, decode tokens) run one
after the other, or on two CUDA streams (the decodes' at the same or at a higher priority), or
the prompt on a CUDA green context that leaves N SMs to the decodes (`--green-sms N`; the decodes
on a stream of the whole device): NanoFlow's question, whether K/V reads on a few SMs hide under
projections on the others. (Each green context takes its own split of the device, so two of them
may share SMs: only the prompt's is partitioned. The driver rounds a partition to its granularity,
8 SMs on Hopper: on 132 SMs leave 12, 28 or 44.)
Weights per layer are distinct (as in a model: no L2 reuse); each layer's ops are the four
projections (q|k|v, o, gate|up, down) and paged attention (kernels/paged_attention.py).

    python bench/overlap.py --device cuda:0 --green-sms 12 28 44

Per case: ms per iteration (the median of 5), and the floors: the serial bound (projections at
the matmul peak or weight bytes, plus K/V bytes) and the roofline (the larger of all bytes over
the bandwidth and all FLOPs over the peak).
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from batchmaker.kernels.paged_attention import paged_attention  # noqa: E402
from bench.common import write_results  # noqa: E402

HIDDEN, INTER, HEADS, DIM, BLOCK = 4096, 11008, 32, 128, 16
CASES = [  # decodes, their context, prompt tokens (one chunk), the chunk's context
    (190, 900, 1858, 1858), (100, 1000, 1948, 1948), (180, 1100, 512, 2000), (60, 600, 1988, 1988)]


class Part:
    """One side of the batch: its tokens' activations and its attention over a paged cache."""

    def __init__(self, lens: list[int], ctxs: list[int], device):
        widths = [-(-c // BLOCK) for c in ctxs]
        self.k = torch.randn(1 + sum(widths), BLOCK, HEADS, DIM, dtype=torch.bfloat16, device=device)
        self.v = torch.randn_like(self.k)
        order = (torch.randperm(sum(widths), device=device) + 1).int()
        self.tables = torch.zeros(len(lens), max(widths), dtype=torch.int32, device=device)
        for s, first in enumerate(torch.tensor([0] + widths).cumsum(0)[:-1].tolist()):
            self.tables[s, :widths[s]] = order[first:first + widths[s]]
        self.tokens = sum(lens)
        self.query_start = torch.tensor([0] + lens).cumsum(0).int().to(device)
        self.context_lens = torch.tensor(ctxs, dtype=torch.int32, device=device)
        self.max_query, self.bound = max(lens), max(ctxs)
        self.x = torch.randn(self.tokens, HIDDEN, dtype=torch.bfloat16, device=device)
        self.out = torch.empty(self.tokens, HEADS, DIM, dtype=torch.bfloat16, device=device)

    def attend(self, q):
        paged_attention(q, self.k, self.v, self.tables, self.query_start, self.context_lens, self.max_query,
                        DIM ** -0.5, self.out, max_context_len=self.bound)
        return self.out


def layers(weights, x, parts):
    """The layers over the rows of x; attention per part (rows in order)."""
    for w_qkv, w_o, w_gu, w_d in weights:
        q = (x @ w_qkv.T)[:, :HIDDEN].reshape(-1, HEADS, DIM)
        a, row = [], 0
        for part in parts:
            a.append(part.attend(q[row:row + part.tokens]))
            row += part.tokens
        h = torch.cat(a).reshape(-1, HIDDEN) @ w_o.T
        gu = h @ w_gu.T
        x = (torch.nn.functional.silu(gu[:, :INTER]) * gu[:, INTER:]) @ w_d.T
    return x


def _enter(context) -> None:  # (torch's green-context methods were renamed between releases)
    (context.set_context if hasattr(context, "set_context") else context.make_current)()


def _leave(context) -> None:
    (context.pop_context if hasattr(context, "pop_context") else context.pop_current)()


def timed(fn, repeats: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[repeats // 2]


def case(decodes, decode_ctx, prompt, prompt_ctx, weights, args, green_contexts: dict) -> dict:
    device = args.device
    dec, pre = Part([1] * decodes, [decode_ctx] * decodes, device), Part([prompt], [prompt_ctx], device)
    both = torch.cat([dec.x, pre.x])
    main = torch.cuda.current_stream()
    side = {"same": torch.cuda.Stream(device), "high": torch.cuda.Stream(device, priority=-1)}

    def two_streams(priority):
        def run():
            stream = side[priority]
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                layers(weights, dec.x, [dec])
            layers(weights, pre.x, [pre])
            main.wait_stream(stream)
        return run
    def green(context_stream):
        def run():
            context, stream = context_stream  # the prompt's launches on its green context's stream
            for s in (stream, side["high"]):
                s.wait_stream(main)
            with torch.cuda.stream(side["high"]):
                layers(weights, dec.x, [dec])
            _enter(context)
            try:
                with torch.cuda.stream(stream):
                    layers(weights, pre.x, [pre])
            finally:
                _leave(context)
            for s in (stream, side["high"]):
                main.wait_stream(s)
        return run
    variants = {"one_batch": lambda: layers(weights, both, [dec, pre]),
                "split_serial": lambda: (layers(weights, dec.x, [dec]), layers(weights, pre.x, [pre])),
                "two_streams": two_streams("same"), "two_streams_high": two_streams("high"),
                "decodes_alone": lambda: layers(weights, dec.x, [dec]),
                "prompt_alone": lambda: layers(weights, pre.x, [pre])}
    record = {"decodes": decodes, "decode_context": decode_ctx, "prompt_tokens": prompt, "prompt_context": prompt_ctx}
    record.update({f"{name}_ms": timed(fn) for name, fn in variants.items()})
    for sms, contexts in green_contexts.items():
        try:
            record[f"green_{sms}_ms"] = timed(green(contexts))
        except Exception as e:  # (a torch built without green contexts, a driver that refuses the split)
            record[f"green_{sms}_error"] = f"{type(e).__name__}: {e}"[:200]
    n = len(weights)
    params = n * (HIDDEN * 3 * HIDDEN + HIDDEN * HIDDEN + 2 * INTER * HIDDEN + INTER * HIDDEN)
    kv_bytes = n * decodes * decode_ctx * 2 * HIDDEN * 2
    pairs = prompt * prompt_ctx - prompt * (prompt - 1) // 2
    flops = 2 * params * (decodes + prompt) + 4 * n * HIDDEN * (pairs + decodes * decode_ctx)
    record["roofline_ms"] = max((params * 2 + kv_bytes) / args.bandwidth, flops / args.peak) * 1e3
    record["serial_bound_ms"] = (max(params * 2 / args.bandwidth, 2 * params * (decodes + prompt) / args.peak)
                                 + kv_bytes / args.bandwidth) * 1e3
    return record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--bandwidth", type=float, default=4.23e12)
    ap.add_argument("--peak", type=float, default=805e12)
    ap.add_argument("--green-sms", type=int, nargs="*", default=[],
                    help="also run the prompt on a green context that leaves this many SMs to the decodes")
    args = ap.parse_args()
    torch.manual_seed(0)

    def weight(rows, cols):
        return torch.randn(rows, cols, dtype=torch.bfloat16, device=args.device) * cols ** -0.5
    weights = [(weight(3 * HIDDEN, HIDDEN), weight(HIDDEN, HIDDEN), weight(2 * INTER, HIDDEN), weight(HIDDEN, INTER))
               for _ in range(args.layers)]
    green_contexts, errors = {}, {}
    for sms in args.green_sms:  # sms left to the decodes -> (the prompt's green context, a stream of it)
        try:
            from torch.cuda.green_contexts import GreenContext
            total = torch.cuda.get_device_properties(args.device).multi_processor_count
            context = GreenContext.create(num_sms=total - sms, device_id=torch.device(args.device).index or 0)
            green_contexts[sms] = (context, context.Stream())  # (a torch without it: recorded below)
        except Exception as e:
            errors[sms] = f"{type(e).__name__}: {e}"[:200]
            print(f"no green contexts of {sms} SMs: {errors[sms]}", flush=True)
    rows = []
    for c in CASES:
        rows.append(case(*c, weights, args, green_contexts))
        print({k: round(v, 2) if isinstance(v, float) else v for k, v in rows[-1].items()}, flush=True)

    def plot(fig):
        ax = fig.add_subplot(1, 1, 1)
        x = range(len(rows))
        names = ["one_batch", "split_serial", "two_streams", "two_streams_high", "serial_bound", "roofline"]
        for name in names + [f"green_{sms}" for sms in green_contexts]:
            if all(f"{name}_ms" in r for r in rows):
                ax.plot(x, [r[f"{name}_ms"] for r in rows], marker="o", label=name)
        ax.set_xticks(list(x), [f"{r['decodes']}x{r['decode_context']}+{r['prompt_tokens']}" for r in rows])
        ax.set_ylabel("ms per iteration")
        ax.legend(fontsize=7)
        ax.set_title(f"mixed iteration, {args.layers} layers of Llama-2-7B shapes (bf16)")
    print(write_results("overlap", args.device, {"layers": args.layers, "green_errors": errors, "rows": rows}, plot),
          flush=True)


if __name__ == "__main__":
    main()
