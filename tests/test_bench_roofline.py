"""bench/chat.py's roofline of an iteration trace: max(bytes / bandwidth, FLOPs / peak) per
iteration, and the serial bound (projections' roofline + attention's) that caps the fraction a
mixed iteration can reach when its kernels run one after another."""
import pytest

from batchmaker.cells.decoder_config import PRESETS, num_parameters
from batchmaker.exec.iterations import IterationRecord

chat = pytest.importorskip("bench.chat")


def test_serial_bound_of_decode_prefill_and_mixed_iterations():
    config = PRESETS["llama-2-7b"]
    params = num_parameters(config)
    kv = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2  # bytes per context token (bf16)

    def both(trace):
        return (chat.roofline(trace, config, params, 2, 4e12, 8e14),
                chat.roofline(trace, config, params, 2, 4e12, 8e14, serial=True))
    decode = [IterationRecord(1, 360, 1, True)]  # weights and a little K/V: bound by bytes either way, nothing to add
    assert both(decode)[0] == pytest.approx((params * 2 + 360 * kv) / 4e12)
    assert both(decode)[1] == pytest.approx(both(decode)[0])
    prefill = [IterationRecord(2048, 0, 1, False)]  # FLOPs only
    assert both(prefill)[1] == pytest.approx(both(prefill)[0]) == pytest.approx(2 * params * 2048 / 8e14)
    mixed = [IterationRecord(444, 69 * 1100, 69, False)]  # the saturated chat run's mean iteration: GEMM FLOPs and K/V bytes
    ideal, serial = both(mixed)
    assert serial > ideal and 0.7 < ideal / serial < 0.8
    assert both(decode + mixed) == pytest.approx(tuple(a + b for a, b in zip(both(decode), both(mixed))))


def test_device_time_splits_graphed_from_eager_iterations():
    trace = [IterationRecord(1, 100, 1, True, 0.004), IterationRecord(1, 100, 1, True, 0.006),
             IterationRecord(500, 9000, 20, False, 0.030), IterationRecord(16, 10, 2, True, None)]  # (unfinished)
    floors = {1: 0.003, 500: 0.020}
    split = chat.device_time(trace, wall_s=0.080, floor=lambda r: floors[r.tokens])
    assert split["busy_s"] == pytest.approx(0.040) and split["busy_fraction"] == pytest.approx(0.5)
    assert split["graphed"]["iterations"] == 2 and split["graphed"]["roofline_of_busy"] == pytest.approx(0.6)
    assert split["eager"]["roofline_of_busy"] == pytest.approx(2 / 3) and split["eager"]["mean_tokens"] == 500
    assert chat.device_time([], 1.0, floor=None)["eager"]["roofline_of_busy"] is None


def test_a_cpu_smoke_run_of_the_chat_benchmark_reports_device_time(tmp_path, monkeypatch):
    """bench/chat.py end to end on a tiny model (CPU): the row carries the trace's split."""
    import json
    from bench import common
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    from batchmaker.kernels import attention_work
    default = attention_work.MIN_SEQS
    chat.main(["--device", "cpu", "--preset", "tiny-llama", "--dtype", "fp32", "--requests", "6", "--rates", "inf",
               "--systems", "batchmaker", "--steps", "", "--warm-up", "0", "--mixed-attention-seqs", "3,1000",
               "--prefill-graph-tokens", "0"])
    assert attention_work.MIN_SEQS == default
    (path,) = tmp_path.glob("chat-tiny-llama-*.json")
    rows = json.loads(path.read_text())["rows"]
    assert [r["mixed_attention_seqs"] for r in rows] == [3, 1000]  # (an A/B in one process)
    row = rows[0]
    engine = row["engine"]
    assert row["output_tokens"] > 0 and row["iterations"] == engine["runner_iterations"] == engine["iterations"] > 0
    assert engine["graph_iterations"] == 0 and engine["suspended"] == engine["extra_tokens"] == 0  # (blocks to spare)
    device = row["device"]
    assert device["eager"]["iterations"] == row["iterations"] and device["graphed"]["iterations"] == 0  # (no graphs on a CPU)
    assert 0 < device["busy_s"] <= row["wall_s"] * 1.01
