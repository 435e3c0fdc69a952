"""bench/chat.py's roofline of an iteration trace: max(bytes / bandwidth, FLOPs / peak) per
iteration, and the serial bound (projections' roofline + attention's) that caps the fraction a
mixed iteration can reach when its kernels run one after another."""
import pytest

from batchmaker.cells.decoder_config import PRESETS, num_parameters

chat = pytest.importorskip("bench.chat")


def test_serial_bound_of_decode_prefill_and_mixed_iterations():
    config = PRESETS["llama-2-7b"]
    params = num_parameters(config)
    kv = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2  # bytes per context token (bf16)

    def both(trace):
        return (chat.roofline(trace, config, params, 2, 4e12, 8e14),
                chat.roofline(trace, config, params, 2, 4e12, 8e14, serial=True))
    decode = [(1, 360, 1)]  # weights and a little K/V: bound by bytes either way, nothing to add
    assert both(decode)[0] == pytest.approx((params * 2 + 360 * kv) / 4e12)
    assert both(decode)[1] == pytest.approx(both(decode)[0])
    prefill = [(2048, 0, 1)]  # FLOPs only
    assert both(prefill)[1] == pytest.approx(both(prefill)[0]) == pytest.approx(2 * params * 2048 / 8e14)
    mixed = [(444, 69 * 1100, 69)]  # the saturated chat run's mean iteration: GEMM FLOPs and K/V bytes
    ideal, serial = both(mixed)
    assert serial > ideal and 0.7 < ideal / serial < 0.8
    assert both(decode + mixed) == pytest.approx(tuple(a + b for a, b in zip(both(decode), both(mixed))))
