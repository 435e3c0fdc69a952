"""bench/row_report.py: the one-row decode loop's A/B summarized per shape (names of the tiles as
bench/attention.py records them, best against the tiled kernel) and the batch-1 step per form."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.row_report import attention, split_curves, step, tile_name  # noqa: E402

from batchmaker.kernels.decode_row import RowTile  # noqa: E402


def decode_row(us: float, tile) -> dict:
    return {"batch": 1, "context": 16384, "us": us, "of_read": 268.4 / us / 3.11, "row_tile": repr(tile)}


def test_each_shape_names_its_tiles_and_the_best_against_the_tiled_kernel():
    record = {"device": "GPU", "read_GBps": 3110.0,
              "decode": [decode_row(96.0, None), decode_row(90.0, RowTile(32, 4)), decode_row(92.0, RowTile(16, 4, 8))],
              "sweep": [{"batch": 2, "context": 8192, "us": 50.0, "of_read": 0.9, "config": ["row", 16, 4],
                         "num_splits": 32},
                        {"batch": 2, "context": 8192, "us": 55.0, "of_read": 0.8, "config": [16, 64, 4, 2],
                         "num_splits": 16},
                        {"batch": 2, "context": 8192, "us": 56.0, "of_read": 0.8, "auto": True}]}
    lines = attention(record)
    assert lines[1].startswith("  1 x  16384: 32:4:4 90.0us") and "off 96.0us" in lines[1]
    assert lines[1].endswith(f"best/base {90 / 96:.3f}")
    assert "row:16:4/32 50.0us" in lines[2] and "tiled:64:4:2/16 55.0us" in lines[2]
    assert lines[2].endswith(f"best/base {50 / 56:.3f}")  # (the automatic plan where no 'off' row)
    assert tile_name({"row_tile": "None"}) == "off"
    assert tile_name({"row_tile": "RowTile(block_n=32, num_warps=4, merge_max=4, preload=True)"}) == "32:4:4:1"
    assert tile_name({"row_tile": "RowTile(block_n=32, num_warps=4, merge_max=4, preload=False)"}) == "32:4:4"


def test_the_step_lists_forms_fastest_first():
    record = {"device": "GPU", "preset": "llama-2-7b", "floor_ms": 4.4,
              "forms": {"configs@row-off": {"graph_step_ms_median": 4.8, "vs_floor": 4.8 / 4.4,
                                            "rounds_ms": [4.8, 4.81], "row_tile": "None"},
                        "configs@row-32:4": {"graph_step_ms_median": 4.7, "vs_floor": 4.7 / 4.4,
                                             "rounds_ms": [4.69, 4.7], "row_tile": repr(RowTile(32, 4))}}}
    lines = step(record)
    assert "configs@row-32:4" in lines[1] and "configs@row-off" in lines[2] and "1.0682x" in lines[1]


def test_split_curves_gather_each_shapes_slices_of_one_tile_and_the_automatic_plan():
    def sweep_row(splits, of_read, config=(16, 64, 4, 2), **extra):
        return {"batch": 1, "context": 8192, "us": 1.0, "of_read": of_read, "config": list(config),
                "num_splits": splits, **extra}
    first = {"decode": [], "sweep": [sweep_row(16, 0.80), sweep_row(32, 0.75), sweep_row(16, 0.70, (16, 128, 4, 2)),
                                     sweep_row(32, 0.74, auto=True)]}
    second = {"decode": [], "sweep": [sweep_row(16, 0.81)]}
    points, auto = split_curves({"a": first, "b": second}, "64:4:2")
    assert points == {(1, 8192): {16: 0.81, 32: 0.75}}  # (128-position steps left out; the later file's 16)
    assert auto[(1, 8192)]["num_splits"] == 32
