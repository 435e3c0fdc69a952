"""The one-row decode loop's A/B in a few lines a shape (kernels/decode_row.py; issue 33): reads what
`bench/gpu.sh row-ab row-long row-step` wrote and prints, per decode shape, each tile's time and
fraction of the read bandwidth beside the tiled kernel's, and the batch-1 step per tile against
its floor. What a merge of `ROW_DECODE` is decided on. `--plot OUT.png`: per file of --row-tiles A/Bs,
each decode shape's time with the row loop over the time without it (batch x context; below 1: faster).
`--splits-plot OUT.png`: the --long-sweep files' fraction of the read bandwidth against the split count.
`--step-plot OUT.png`: the bench/one_token_ab.py files' forms against the floor, and a traced middle layer.

    python bench/row_report.py bench/results/attention-row-ab-*.json bench/results/attention-row-long-*.json \
        bench/results/attention-row-short-*.json bench/results/one-token-row-*.json
"""
import argparse
import json
from collections import defaultdict
from pathlib import Path


def tile_name(row: dict) -> str:
    """A decode row's kernel: 'off' (the tiled kernel, automatic), the row tile's spec, or a swept tile."""
    if "row_tile" in row:  # (--row-tiles: the automatic plan with ROW_DECODE set or None)
        tile = row["row_tile"]
        if tile == "None":
            return "off"
        fields = dict(part.split("=") for part in tile[tile.index("(") + 1:-1].split(", "))
        preload = ":1" if fields.get("preload") == "True" else ""  # (RowTile.preload)
        return f"{fields['block_n']}:{fields['num_warps']}:{fields['merge_max']}{preload}"
    if row.get("auto"):
        return "auto"
    config = row["config"]
    return ("row:" + ":".join(map(str, config[1:])) if config[0] == "row" else
            "tiled:" + ":".join(map(str, config[1:]))) + f"/{row['num_splits']}"


def shapes_of(record: dict) -> dict:
    """{(batch, context): {tile_name: decode row}} of an attention record."""
    shapes = defaultdict(dict)
    for row in record["decode"] + record.get("sweep", []):
        shapes[(row["batch"], row["context"])][tile_name(row)] = row
    return shapes


def attention(record: dict) -> list[str]:
    lines = [f"{record['device']}: read {record['read_GBps']:.0f} GB/s"]
    shapes = shapes_of(record)
    for (batch, context), rows in sorted(shapes.items()):
        base = rows.get("off") or rows.get("auto")
        best = min(rows.items(), key=lambda kv: kv[1]["us"])
        cells = "  ".join(f"{name} {r['us']:.1f}us {r['of_read']:.3f}" for name, r in
                          sorted(rows.items(), key=lambda kv: kv[1]["us"])[:6])
        ratio = f"  best/base {best[1]['us'] / base['us']:.3f}" if base else ""
        lines.append(f"{batch:3d} x {context:6d}: {cells}{ratio}")
    return lines


def step(record: dict) -> list[str]:
    lines = [f"{record['device']}: {record['preset']} batch-1 step, floor {record['floor_ms']:.3f} ms"]
    for name, form in sorted(record["forms"].items(), key=lambda kv: kv[1]["graph_step_ms_median"]):
        ms = form["rounds_ms"]
        lines.append(f"  {name:24s} {form['graph_step_ms_median']:.4f} ms  {form['vs_floor']:.4f}x  "
                     f"(rounds {min(ms):.4f}-{max(ms):.4f}) {form.get('row_tile', '')}")
    return lines


def plot(records: dict, out: str) -> None:
    """One panel a file: each row tile's time over 'off' per shape, bars grouped by batch."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(records), 1, figsize=(11, 3.2 * len(records)), squeeze=False)
    for ax, (path, record) in zip(axes[:, 0], records.items()):
        shapes = sorted((shape, rows) for shape, rows in shapes_of(record).items() if "off" in rows)
        tiles = sorted({name for _, rows in shapes for name in rows if name != "off"})
        width = 0.8 / max(1, len(tiles))
        for i, name in enumerate(tiles):
            ax.bar([x + i * width for x in range(len(shapes))],
                   [rows[name]["us"] / rows["off"]["us"] if name in rows else 0 for _, rows in shapes], width,
                   label=f"row {name}")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(shapes))],
                      [f"{b}x{c}" for (b, c), _ in shapes], rotation=60, fontsize=7)
        ax.set_ylabel("time / tiled kernel's")
        ax.set_title(f"{record['device']}: {Path(path).name}", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def step_plot(records: dict, out: str) -> None:
    """Per bench/one_token_ab.py file: each form's step over the weight floor (left), and where traced (--trace),
    the middle layer's kernels in time for the slowest and the fastest form (right: start to end, µs from the
    layer's first kernel; under PDL a kernel starts before its predecessor ends)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(records), 2, figsize=(13, 0.35 * max(len(r["forms"]) for r in records.values()) + 3),
                             squeeze=False)
    for (left, right), (path, record) in zip(axes, records.items()):
        forms = sorted(record["forms"].items(), key=lambda kv: -kv[1]["graph_step_ms_median"])
        left.barh(range(len(forms)), [form["vs_floor"] for _, form in forms], color="tab:blue")
        left.set_yticks(range(len(forms)), [name for name, _ in forms], fontsize=7)
        left.axvline(1.1, color="red", linewidth=0.8, label="1.1x the floor")
        left.set_xlim(1.0, max(1.15, max(form["vs_floor"] for _, form in forms) + 0.01))
        left.set_xlabel(f"graphed step / weight floor ({record['floor_ms']:.3f} ms)")
        left.set_title(f"{record['device']}: {Path(path).name}", fontsize=8)
        left.legend(fontsize=7)
        traced = [(name, form) for name, form in forms if "trace" in form]
        shown = traced[:1] + traced[-1:] if len(traced) > 1 else traced  # (the slowest and the fastest)
        for row, (name, form) in enumerate(shown):
            for i, (kernel, start, end) in enumerate(form["trace"]["middle_layer"]):
                y = row + 0.4 * (i % 2) - 0.2  # (neighbours on alternate lanes: under PDL they overlap)
                right.barh(y, end - start, left=start, height=0.35, color=plt.cm.tab10(i % 10))
                right.text(start, y, kernel.replace("_kernel", ""), fontsize=6, va="center")
        right.set_yticks(range(len(shown)), [name for name, _ in shown], fontsize=7)
        right.set_xlabel("µs from the middle layer's first kernel (q | k | v's GEMV)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def split_curves(records: dict, tile: str) -> tuple[dict, dict]:
    """({(batch, context): {splits: of_read}} of the tiled kernel's `tile`, {(batch, context): the automatic
    plan's row}) over --long-sweep records (a shape in several: the last record's)."""
    points, auto = defaultdict(dict), {}
    for record in records.values():
        for shape, rows in shapes_of(record).items():
            for name, row in rows.items():
                if name.startswith(f"tiled:{tile}/"):
                    points[shape][row["num_splits"]] = row["of_read"]
                elif name == "auto":
                    auto[shape] = row
    return points, auto


def splits_plot(records: dict, tile: str, out: str) -> None:
    """Each decode shape's fraction of the read bandwidth against its split count, for one tiled kernel's
    tile ("BLOCK_N:WARPS:STAGES") over every --long-sweep file given (a shape in several: the last file's),
    the automatic plan's point marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    points, auto = split_curves(records, tile)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (shape, curve) in enumerate(sorted(points.items())):
        splits = sorted(curve)
        ax.plot(splits, [curve[n] for n in splits], marker="o", color=plt.cm.tab20(i % 20), label=f"batch {shape[0]} x {shape[1]}")
        if shape in auto:
            ax.plot(auto[shape]["num_splits"], auto[shape]["of_read"], marker="x", markersize=10, color=plt.cm.tab20(i % 20))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("slices a sequence's context is split into (x: the automatic plan's, as the file was run)")
    ax.set_ylabel("of the read bandwidth")
    ax.set_title(f"{next(iter(records.values()))['device']}: split-KV decode, tile {tile}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--plot", default=None, help="a PNG of the --row-tiles A/Bs among the files")
    parser.add_argument("--splits-plot", default=None, help="a PNG of the --long-sweep files' split counts")
    parser.add_argument("--tile", default="64:4:2", help="--splits-plot's tiled kernel tile")
    parser.add_argument("--step-plot", default=None, help="a PNG of the bench/one_token_ab.py files' forms")
    args = parser.parse_args()
    records = {path: json.loads(Path(path).read_text()) for path in args.files}
    for path, record in records.items():
        print(f"== {path}")
        print("\n".join(step(record) if "forms" in record else attention(record)))
    ab = {path: record for path, record in records.items()
          if "forms" not in record and any("row_tile" in row for row in record["decode"])}
    if args.plot and ab:
        plot(ab, args.plot)
    steps = {path: record for path, record in records.items() if "forms" in record}
    if args.step_plot and steps:
        step_plot(steps, args.step_plot)
    sweeps = {path: record for path, record in records.items() if record.get("sweep")}
    if args.splits_plot and sweeps:
        splits_plot(sweeps, args.tile, args.splits_plot)


if __name__ == "__main__":
    main()
