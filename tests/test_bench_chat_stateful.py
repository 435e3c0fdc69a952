"""bench/chat_stateful.py's first-token split: turns back to a history held in GPU blocks against
turns with some of it copied in from the host tier (the swap-in target, under the run's load)."""
import pytest

chat_stateful = pytest.importorskip("bench.chat_stateful")


def turn(sent, ttft, history=100, **context):
    return {"sent": sent, "ttft": ttft, "history": history, **context}


def test_first_token_compares_gpu_hits_with_swapped_in_turns_sent_in_the_window():
    records = [turn(1.0, 0.010, cached=100), turn(2.0, 0.020, cached=60), turn(3.0, 0.030, cached=100),
               turn(4.0, 0.045, cached=40, swapped_in=60), turn(5.0, 0.055, swapped_in=100),
               turn(6.0, 0.5, cached=50, swapped_in=20, recomputed=30),  # partly recomputed: neither
               turn(7.0, 0.001, history=0),  # a first turn: no history
               {"sent": 8.0, "history": 100, "unfinished": True, "cached": 100},  # cancelled: no first token
               turn(50.0, 9.0, cached=100)]  # sent after the window
    split = chat_stateful.first_token(records, (0.5, 10.0))
    assert (split["gpu_hit_turns"], split["swapped_in_turns"]) == (3, 2)
    assert split["gpu_hit_p50_ms"] == pytest.approx(20.0) and split["swapped_in_p50_ms"] == pytest.approx(50.0)
    assert split["swapped_in_over_hit"] == pytest.approx(2.5)
    assert split["swapped_in_over_hit_prefill"] == pytest.approx(2.5)  # (nothing queued: the same)
    queued = [dict(r, queued=0.030) if r.get("swapped_in") and not r.get("recomputed") else r for r in records]
    split = chat_stateful.first_token(queued, (0.5, 10.0))  # swapped-in turns waited 30 ms for blocks
    assert split["swapped_in_p50_ms"] == pytest.approx(50.0) and split["swapped_in_prefill_p50_ms"] == pytest.approx(20.0)
    assert split["swapped_in_over_hit_prefill"] == pytest.approx(1.0)
    none = chat_stateful.first_token(records[:3], (0.5, 10.0))
    assert none["swapped_in_turns"] == 0 and none["swapped_in_over_hit"] is None


def test_triton_compiles_are_counted_through_the_runtime_hooks():
    from bench.common import TritonCompiles
    counter = TritonCompiles()
    try:
        if counter.available:  # (Triton >= 3.4 installed: the hooks are ours now)
            from triton import knobs
            assert knobs.runtime.jit_cache_hook == counter._before
        assert counter._before(key="k", repr="kernel") is False  # (never skips a compile)
        counter._after(key="k", repr="kernel[num_warps=4](x: *bf16:16, n: i32)", fn=None,
                       compile={"constants": {(2,): 64}}, is_manual_warmup=False, already_compiled=False)  # (Triton 3.9)
        counter._after(key="k")  # (a post hook without its cache hook: counted, not timed)
        assert counter.count == 2 and counter.seconds >= 0
        assert counter.kernels == ["kernel[num_warps=4](x: *bf16:16, n: i32) {(2,): 64}", "?"]  # (what each built)
    finally:
        if counter.available:
            from triton import knobs
            knobs.runtime.jit_cache_hook = knobs.runtime.jit_post_compile_hook = None
