"""RoPE from tables (cells/rotary.py): the rows a forward reads from its device's cos | sin table are
the values the model's per-position code computes (on the GPU bit for bit: the same kernels on the
same inputs; on the CPU within an ulp, where vectorized and scalar cos may round apart), for Llama's
plain, longrope (short factors, then long ones, scaled) and YaRN rotations and Gemma 3's local and
global ones; positions past the table read its last row; one table a device and dtype; no table
where the code computes per forward (the CPU, a capture before the table exists).

    python -m pytest -q tests/test_rotary.py          # CPU
    python -m pytest -q -m gpu tests/test_rotary.py   # bit for bit on a CUDA device
"""

import pytest
import torch

from batchmaker.cells import rotary
from batchmaker.cells.decoder import build_decoder
from batchmaker.cells.decoder_config import PRESETS, from_hf
from helpers import needs_gpu

PHI3 = dict(vocab_size=512, hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0, model_type="phi3")
CONFIGS = {
    "llama": PRESETS["tiny-llama"],
    "longrope": from_hf(dict(PHI3, original_max_position_embeddings=32, rope_scaling={
        "type": "longrope", "short_factor": [1.0 + i / 4 for i in range(12)],
        "long_factor": [3.0 + i for i in range(12)]})),
    "yarn": from_hf(dict(PHI3, model_type="llama", rope_scaling={"rope_type": "yarn", "factor": 8.0,
                                                                 "original_max_position_embeddings": 32})),
    "gemma3": from_hf(dict(PHI3, model_type="gemma3_text", head_dim=24, sliding_window=8, num_hidden_layers=3,
                           query_pre_attn_scalar=24, rope_local_base_freq=10.0)),
}


def rotations(model, positions):
    """(table's, per position's) cos and sin of each of the model's rotations at `positions`."""
    dtype = model.embed_tokens.weight.dtype
    if hasattr(model, "rope_angles"):
        yield model.rotary(positions), [t.to(dtype) for t in model.rope_angles(positions)]
        return
    for local in (False, True):  # (Gemma 3: the global layers', then the local ones')
        inv_freq = model.local_inv_freq if local else model.inv_freq
        freqs = positions[:, None].float() * inv_freq[None, :]
        yield model._rotary(local, positions), [freqs.cos().to(dtype), freqs.sin().to(dtype)]


def check(name, device, exact):
    config = CONFIGS[name]
    model = build_decoder(config, dtype=torch.bfloat16, device=device)
    last = config.max_positions - 1
    positions = torch.tensor([0, 1, 31, 32, 33, 100, last], device=device)
    for got, (cos, sin) in rotations(model, positions):
        assert got.table is not None and got.table.shape == (config.max_positions, config.head_dim)
        for a, b in ((got.cos, cos), (got.sin, sin)):
            assert a.shape == b.shape and a.dtype == b.dtype
            if exact:
                assert torch.equal(a, b), name
            else:  # (one bf16 ulp where the fp32 cos rounds apart)
                torch.testing.assert_close(a, b, rtol=8e-3, atol=8e-3)
    past = torch.tensor([last + 5, last], device=device)
    for got, _ in rotations(model, past):
        assert torch.equal(got.cos[0], got.cos[1]) and torch.equal(got.sin[0], got.sin[1])  # (the last row)
    tables = {id(r.table) for r, _ in rotations(model, positions)}
    assert tables == {id(r.table) for r, _ in rotations(model, positions[:1])}  # (built once)


@pytest.mark.parametrize("name", CONFIGS)
def test_table_rows_are_the_per_position_values(name, monkeypatch):
    monkeypatch.setattr(rotary, "builds_table", lambda positions: True)
    check(name, "cpu", exact=False)


def test_the_kv_sizing_knows_what_the_tables_hold(monkeypatch):
    monkeypatch.setattr(rotary, "builds_table", lambda positions: True)
    for name in ("llama", "gemma3"):
        model = build_decoder(CONFIGS[name], dtype=torch.bfloat16)
        held = {id(r.table): r.table.nbytes for r, _ in rotations(model, torch.tensor([3]))}
        assert rotary.tables_bytes(model, torch.bfloat16) == sum(held.values()) > 0, name
    assert rotary.tables_bytes(build_decoder(PRESETS["tiny-opt"]), torch.float32) == 0  # (no rotary embeddings)


def test_the_cpu_computes_per_forward():
    model = build_decoder(PRESETS["tiny-llama"])
    positions = torch.tensor([3, 9])
    got = model.rotary(positions)
    assert got.table is None and got.table_rows() is None
    cos, sin = model.rope_angles(positions)
    assert torch.equal(got.cos, cos) and torch.equal(got.sin, sin)


def test_a_rotation_from_a_table_gathers_once_and_hands_kernels_its_views():
    table = torch.arange(40.0).view(5, 8)
    r = rotary.Rotary.rows(table, torch.tensor([2, 9]))
    assert torch.equal(r.cos, torch.stack([table[2, :4], table[4, :4]])) and torch.equal(r.sin[1], table[4, 4:])
    assert r.cos is r.cos  # (gathered once)
    cos, sin, rows = r.table_rows()
    assert cos.data_ptr() == table.data_ptr() and sin.stride() == (8, 1) and rows is r.positions


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("name", CONFIGS)
def test_table_rows_are_the_per_position_values_bit_for_bit_on_the_gpu(name):
    check(name, "cuda", exact=True)
