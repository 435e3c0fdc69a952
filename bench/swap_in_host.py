"""Host time to issue one turn's layer-by-layer swap-in (exec/kv_swap.py `_SwapIn`: its
construction and every layer's `before_attention`, no forward around it), and the wall time until
its copies have landed. A small iteration is host-bound (bench/launch_costs.py), so what the
swap-in costs the host adds to a restored turn's latency one for one.

`--modules` compares versions of kv_swap.py in one process, interleaved (e.g. an older one from
`git show REV:batchmaker/exec/kv_swap.py > old_kv_swap.py`). CUDA only.

    python bench/swap_in_host.py --contexts 1024 2048 --modules old_kv_swap.py
"""
import argparse
import importlib.util
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import write_results  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-2-7b")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--modules", nargs="*", default=[], help="other kv_swap.py files to compare with this one")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    from batchmaker.cells.decoder_config import PRESETS
    from batchmaker.exec import kv_swap
    from batchmaker.exec.kv_cache import KVCache
    modules = {"current": kv_swap}
    for path in args.modules:
        spec = importlib.util.spec_from_file_location(f"kv_swap_{Path(path).stem}", path)
        modules[Path(path).stem] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    config, dev, chunk = PRESETS[args.preset], torch.device("cuda"), 32
    most = max(args.contexts) // chunk
    cache = KVCache(config, 2 * most * chunk // 16 + 2, 16, torch.bfloat16, dev)
    tiers = {name: m.HostTier(cache, most, chunk, 2 * most, 32) for name, m in modules.items()}
    compute = torch.cuda.current_stream()
    rows = []
    with torch.inference_mode():
        for context in args.contexts:
            n = context // chunk
            plan = SimpleNamespace(swap_in_host=np.arange(n),
                                   swap_in_blocks=np.arange(1, 1 + 2 * n).reshape(n, chunk // 16))
            times = {name: [] for name in modules}
            for _ in range(args.repeats):
                for name, m in modules.items():
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    swap = m._SwapIn(tiers[name], plan, compute)
                    for layer in range(config.num_layers):
                        swap.before_attention(layer)
                    host = time.perf_counter() - start
                    torch.cuda.synchronize()
                    times[name].append((host * 1e3, (time.perf_counter() - start) * 1e3))
            for name in modules:
                t = np.array(times[name][3:])  # (the first few warm up)
                rows.append({"context": context, "module": name, "host_ms_median": float(np.median(t[:, 0])),
                             "host_ms_min": float(t[:, 0].min()), "host_us_per_layer": float(np.median(t[:, 0]))
                             * 1e3 / config.num_layers, "wall_ms_median": float(np.median(t[:, 1]))})
                print(rows[-1], flush=True)

    def plot(fig):
        ax = fig.add_subplot(1, 1, 1)
        for name in modules:
            pts = [(r["context"], r["host_ms_median"]) for r in rows if r["module"] == name]
            ax.plot(*zip(*pts), marker="o", label=f"{name}: host")
        pts = [(r["context"], r["wall_ms_median"]) for r in rows if r["module"] == "current"]
        ax.plot(*zip(*pts), marker="s", linestyle="--", label="copies landed (wall)")
        ax.set_xlabel("context (positions swapped in)")
        ax.set_ylabel("ms")
        ax.set_title(f"{args.preset}: issuing a layer-by-layer swap-in")
        ax.legend()
    print(write_results(f"swap-in-host-{args.preset}", "cuda", {"preset": args.preset, "rows": rows}, plot))


if __name__ == "__main__":
    main()
