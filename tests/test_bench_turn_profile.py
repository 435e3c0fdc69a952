"""bench/turn_profile.py's reduction of a chrome trace: the device's busy time is the union of its
kernel and copy intervals (overlaps counted once), idle gaps are the holes over the threshold
between its first and last work, host launch time sums the runtime/driver launch calls, and
labelled ranges keep their durations in order."""
import pytest

turn_profile = pytest.importorskip("bench.turn_profile")


def ev(cat, name, ts, dur, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}


def test_busy_is_the_union_of_device_intervals_and_gaps_are_the_holes():
    events = [
        ev("user_annotation", "engine.step", 0, 900), ev("user_annotation", "engine.step", 950, 40),
        ev("cpu_op", "aten::linear", 10, 30), ev("cuda_runtime", "cudaLaunchKernel", 15, 5),
        ev("cuda_driver", "cuLaunchKernelEx", 50, 7), ev("cuda_runtime", "cudaEventRecord", 60, 100),
        ev("kernel", "gemm", 100, 100),                      # 100-200
        ev("gpu_memcpy", "HtoD", 150, 100, bytes=4096),      # 150-250: overlaps the gemm by 50
        ev("kernel", "norm", 260, 10),                       # 260-270: a 10 us hole (under the threshold)
        ev("kernel", "attention", 400, 50),                  # 400-450: a 130 us hole
        ev("kernel", "inside", 410, 20),                     # within the attention: adds nothing
        {"ph": "i", "name": "marker", "ts": 5},              # not a complete event: ignored
    ]
    s = turn_profile.summarize(events, wall_ms=1.0)
    assert s["gpu_busy_ms"] == pytest.approx((150 + 10 + 50) / 1e3)
    assert s["kernel_ms"] == pytest.approx(180 / 1e3) and s["kernels"] == 4
    assert (s["copy_ms"], s["copies"], s["copy_bytes"]) == (pytest.approx(0.1), 1, 4096)
    assert s["idle_gaps"] == {"count": 1, "ms": pytest.approx(0.13), "largest_ms": pytest.approx(0.13)}
    assert s["gpu_first_ms"] == pytest.approx(0.1) and s["gpu_last_ms"] == pytest.approx(0.45)
    assert s["launch_ms"] == pytest.approx(12 / 1e3)  # the two launches, not the event record
    assert s["ranges_ms"] == {"engine.step": [0.9, 0.04]}
    assert list(s["top_host_ops"])[0] == "engine.step"  # inclusive: the ranges hold the rest
    assert s["top_host_ops"]["engine.step"] == pytest.approx(0.94)


def test_a_trace_without_device_work_reports_the_wall_time_alone():
    assert turn_profile.summarize([], wall_ms=2.5) == {"wall_ms": 2.5}
    s = turn_profile.summarize([ev("cpu_op", "aten::add", 0, 3)], wall_ms=2.5)
    assert s["gpu_busy_ms"] == 0 and s["gpu_first_ms"] is None and s["idle_gaps"]["count"] == 0
