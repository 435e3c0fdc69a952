"""bench/graph_trace.py: a traced graph's kernels summed by name as start-to-next-start intervals (what a
kernel adds to a chain whose launches overlap), the last of several equal replays kept."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.graph_trace import last_run, layer_positions, shares, short_name, step_us, timeline  # noqa: E402


def test_shares_are_start_to_next_start_and_overlaps_are_counted():
    spans = [("gemv_kernel_0d1d", 0, 10_000), ("attention<128, true>(float*)", 9_000, 12_000),
             ("gemv_kernel_0d1d", 12_500, 20_000)]
    rows = {r["kernel"]: r for r in shares(spans)}
    assert rows["gemv_kernel"]["count"] == 2
    assert rows["gemv_kernel"]["share_us"] == pytest.approx(9.0 + 7.5)  # (the last one: to its end)
    assert rows["gemv_kernel"]["overlap_us"] == pytest.approx(1.0)  # (attention started 1 us before it ended)
    assert rows["attention"]["share_us"] == pytest.approx(3.5) and rows["attention"]["mean_us"] == pytest.approx(3.0)
    assert [r["kernel"] for r in shares(spans)] == ["gemv_kernel", "attention"]
    assert sum(r["share_us"] for r in rows.values()) == pytest.approx(step_us(spans))


def test_the_last_of_equal_runs_and_unequal_runs_refused():
    run = [("a", 0, 1), ("b", 1, 2)]
    later = [("a", 10, 11), ("b", 11, 12)]
    assert last_run(run + later, 2) == later
    with pytest.raises(ValueError, match="3 kernels"):
        last_run(run + later[:1], 2)


def test_short_names_drop_arguments_and_specializations():
    assert short_name("gemv_kernel_0d1d2d3c") == "gemv_kernel"
    assert short_name("decode_row_kernel_0d_1d") == "decode_row_kernel"
    assert short_name("at::native::vectorized_elementwise_kernel<4, float>(int, float)") == \
        "at::native::vectorized_elementwise_kernel"


def test_layer_positions_name_each_launch_by_its_place_in_a_layer():
    layer = [("gemv_kernel", 0, 1), ("decode_row_kernel", 1, 2), ("gemv_kernel", 2, 3)]
    spans = [("embedding", 0, 1)] + [(n, a + 10 * i, b + 10 * i) for i in range(2) for n, a, b in layer]
    spans += [("gemv_kernel", 30, 31)]
    names = [name for name, _, _ in layer_positions(spans, 2)]
    assert names == ["embedding", "gemv_kernel#0", "decode_row_kernel#0", "gemv_kernel#1", "gemv_kernel#0",
                     "decode_row_kernel#0", "gemv_kernel#1", "gemv_kernel#tail"]
    assert timeline(layer_positions(spans, 2), "gemv_kernel#0", 1) == [
        ("gemv_kernel#0", 0.0, 0.001), ("decode_row_kernel#0", 0.001, 0.002), ("gemv_kernel#1", 0.002, 0.003),
        ("gemv_kernel#tail", 0.02, 0.021)]  # (the last layer runs to the end)
