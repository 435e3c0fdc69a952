"""bench/chat.py's roofline of an iteration trace (bench/chat_roofline.py): max(bytes / bandwidth, FLOPs / peak) per
iteration, and the serial bound (projections' roofline + attention's) that caps the fraction a
mixed iteration can reach when its kernels run one after another."""
import numpy as np
import pytest

from batchmaker.cells.decoder_config import PRESETS, num_parameters
from batchmaker.exec.iterations import IterationRecord

chat = pytest.importorskip("bench.chat")
from bench import chat_roofline  # noqa: E402 (after the skip: bench/ needs numpy, torch)


def test_serial_bound_of_decode_prefill_and_mixed_iterations():
    config = PRESETS["llama-2-7b"]
    params = num_parameters(config)
    kv = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2  # bytes per context token (bf16)

    def both(trace):
        return (chat_roofline.roofline(trace, config, params, 2, 4e12, 8e14),
                chat_roofline.roofline(trace, config, params, 2, 4e12, 8e14, serial=True))
    table = config.vocab_size * config.hidden_size  # the untied embedding's, and the LM head's
    decode = [IterationRecord(1, 360, 1, True)]  # weights and a little K/V: bound by bytes either way, nothing to add
    assert both(decode)[0] == pytest.approx(((params - table) * 2 + 360 * kv) / 4e12)
    assert both(decode)[1] == pytest.approx(both(decode)[0])
    prefill = [IterationRecord(2048, 0, 1, False, samples=1)]  # FLOPs only
    assert both(prefill)[1] == pytest.approx(both(prefill)[0]) == \
        pytest.approx(2 * ((params - 2 * table) * 2048 + table) / 8e14)
    mixed = [IterationRecord(444, 69 * 1100, 69, False)]  # the saturated chat run's mean iteration: GEMM FLOPs and K/V bytes
    ideal, serial = both(mixed)
    assert serial > ideal and 0.7 < ideal / serial < 0.8
    assert both(decode + mixed) == pytest.approx(tuple(a + b for a, b in zip(both(decode), both(mixed))))


def test_device_time_splits_graphed_from_eager_iterations():
    trace = [IterationRecord(1, 100, 1, True, 0.004), IterationRecord(1, 100, 1, True, 0.006),
             IterationRecord(500, 9000, 20, False, 0.030), IterationRecord(16, 10, 2, True, None)]  # (unfinished)
    floors = {1: 0.003, 500: 0.020}
    split = chat_roofline.device_time(trace, wall_s=0.080, floor=lambda r: floors[r.tokens])
    assert split["busy_s"] == pytest.approx(0.040) and split["busy_fraction"] == pytest.approx(0.5)
    assert split["graphed"]["iterations"] == 2 and split["graphed"]["roofline_of_busy"] == pytest.approx(0.6)
    assert split["eager"]["roofline_of_busy"] == pytest.approx(2 / 3) and split["eager"]["mean_tokens"] == 500
    assert chat_roofline.device_time([], 1.0, floor=None)["eager"]["roofline_of_busy"] is None


def test_a_cpu_smoke_run_of_the_chat_benchmark_reports_device_time(tmp_path, monkeypatch):
    """bench/chat.py end to end on a tiny model (CPU): the row carries the trace's split."""
    import json
    from bench import common
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    chat.main(["--device", "cpu", "--preset", "tiny-llama", "--dtype", "fp32", "--requests", "6", "--rates", "inf,50",
               "--systems", "batchmaker", "--steps", "", "--warm-up", "0", "--prefill-graph-tokens", "0",
               "--profile-seconds", "0.2"])
    (path,) = tmp_path.glob("chat-tiny-llama-*.json")
    rows = json.loads(path.read_text())["rows"]
    assert [r["rate"] for r in rows] == [float("inf"), 50.0]
    row = rows[0]
    trace = row["trace"]  # per iteration; a prompt's first iteration attends q (q + 1) / 2 pairs, a decode its context
    assert len(trace["ms"]) == row["iterations"] and trace["pairs"][0] > trace["context"][0]
    assert all(p == c for p, c, t, s in zip(trace["pairs"], trace["context"], trace["tokens"], trace["seqs"]) if t == s)
    engine = row["engine"]
    assert row["output_tokens"] > 0 and row["iterations"] == engine["runner_iterations"] == engine["iterations"] > 0
    assert engine["graph_iterations"] == 0 and engine["suspended"] == engine["extra_tokens"] == 0  # (blocks to spare)
    device = row["device"]
    assert device["eager"]["iterations"] == row["iterations"] and device["graphed"]["iterations"] == 0  # (no graphs on a CPU)
    assert 0 < device["busy_s"] <= row["wall_s"] * 1.01
    profile = json.loads(path.read_text())["profile"]  # (a CPU has no kernels to list: the window's iterations)
    assert profile["kernels_by_name"] == [] and profile["graphed_iterations"]["count"] == 0
    assert profile["eager_iterations"]["count"] > 0 and profile["eager_iterations"]["tokens"] > 0


def test_a_prompt_chunk_counts_its_causal_attention_pairs():
    """A chunk of q new tokens at the end of a context of c positions attends q * c - q (q - 1) / 2
    (query, position) pairs: the attention FLOPs that a prompt adds to the roofline."""
    config = PRESETS["llama-2-7b"]
    params = num_parameters(config)
    flops_per_pair = 4 * config.num_layers * config.num_heads * config.head_dim
    bare, chunk = IterationRecord(2048, 2048, 1, False), IterationRecord(2048, 2048, 1, False, None, 2048 * 2049 // 2)
    gemm = 2 * (params - config.vocab_size * config.hidden_size) * 2048 / 8e14  # (each token sampled: no record says)
    assert chat_roofline.iteration_floor(bare, config, params, 2, 4e12, 8e14) == pytest.approx(gemm + 2048 * flops_per_pair / 8e14)
    assert chat_roofline.iteration_floor(chunk, config, params, 2, 4e12, 8e14) == \
        pytest.approx(gemm + 2048 * 2049 // 2 * flops_per_pair / 8e14)


@pytest.mark.parametrize("preset", ["qwen2.5-7b", "gemma-2-9b"])
def test_the_weights_read_count_a_tied_head_once_and_no_untied_embedding(preset):
    """A decode iteration reads every weight but an untied embedding table (a row per token); a tied
    one is read once, as the LM head. A prompt chunk multiplies by the head only the rows it samples."""
    config = PRESETS[preset]
    params, table = num_parameters(config), config.vocab_size * config.hidden_size
    layers = params - table * (1 if config.tie_word_embeddings else 2)
    decode = IterationRecord(1, 0, 1, True, samples=1)
    assert chat_roofline.iteration_floor(decode, config, params, 2, 4e12, 1e30) == pytest.approx((layers + table) * 2 / 4e12)
    chunk = IterationRecord(512, 0, 1, False, samples=1)
    assert chat_roofline.iteration_floor(chunk, config, params, 2, 1e30, 8e14) == \
        pytest.approx(2 * (layers * 512 + table) / 8e14)


def test_kernel_table_groups_kernels_by_name():
    from bench.turn_profile import kernel_table
    events = [{"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 30.0},
              {"ph": "X", "cat": "kernel", "name": "attn", "ts": 30, "dur": 10.0},
              {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 40, "dur": 50.0},
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 99.0}]
    assert kernel_table(events) == [{"name": "gemm", "count": 2, "total_ms": 0.08, "mean_us": 40.0},
                                    {"name": "attn", "count": 1, "total_ms": 0.01, "mean_us": 10.0}]


def test_saturated_window_counts_sampled_tokens_while_requests_arrive():
    def record(tokens, samples, at):
        return IterationRecord(tokens, 0, samples, True, samples=samples, at=at)
    start = 100.0
    # all at once: prompts until t = 8 s, then a drain of lone decodes that the window leaves out
    trace = [record(512, 4, start + t) for t in range(0, 9)] + [record(1, 1, start + 9 + t / 10) for t in range(50)]
    work = [(500, 20)] * 10
    window = chat_roofline.saturated_window(trace, start, chat.poisson(10, float("inf"), 0), float("inf"), work)
    assert window["end_s"] == pytest.approx(8) and window["begin_s"] == pytest.approx(2)
    assert window["tokens"] == 6 * 4 and window["tokens_per_s"] == pytest.approx(4.0) and window["saturated"]
    # Poisson: the span ends at the last arrival; 40 requests of 20 tokens in 4 s: 200 offered/s
    arrivals = np.arange(40) / 10
    steady = [record(1, 10, start + t / 10) for t in range(200)]  # 100 tokens/s for 20 s
    work = [(5, 20)] * 40
    growing = 1.0 + np.arange(40)  # each later request waited longer: a queue
    window = chat_roofline.saturated_window(steady, start, arrivals, 10.0, work, growing)
    assert window["begin_s"] == pytest.approx(0.975) and window["end_s"] == pytest.approx(3.9)
    assert window["tokens_per_s"] == pytest.approx(100.0, rel=0.05) and window["latency_growth"] > 1.5
    assert window["offered_tokens_per_s"] == pytest.approx(29 * 20 / 2.925) and window["saturated"]
    flat = np.ones(40)  # behind on tokens only because they had not finished yet: not saturated
    assert not chat_roofline.saturated_window(steady, start, arrivals, 10.0, work, flat)["saturated"]
