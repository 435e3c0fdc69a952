"""bench/compress_quality.py (issue 34's report of what 4-bit compression does to a tiny model's
outputs): the round trip perturbs the logits by a nonzero, bounded relative error, an
uncompressed control by none, and the greedy agreements are shares."""
import torch

from bench.compress_quality import MODELS, logits_error, main, round_tripped
from batchmaker.cells.decoder import build_decoder


def test_the_round_trip_changes_every_layer_matrix_and_nothing_else():
    config = MODELS["tiny-llama"]
    dense, coded = build_decoder(config, seed=1), round_tripped(build_decoder(config, seed=1))
    for (name, a), (_, b) in zip(dense.named_parameters(), coded.named_parameters()):
        changed = not torch.equal(a, b)
        assert changed == (name.startswith("layers.") and a.dim() == 2), name
        assert (b - a).abs().max() <= 0.5 * (a.max() - a.min()) / 15  # (half a step of the widest group's range)


def test_the_report_on_a_tiny_model():
    record = main(["--models", "tiny-llama", "--prompts", "2", "--length", "12", "--new", "3", "--no-write"])
    row = record["models"]["tiny-llama"]
    assert 0.0 < row["logits"]["relative_error_median"] <= row["logits"]["relative_error_max"] < 0.5
    assert 0.0 <= row["logits"]["top1_agreement"] <= 1.0 and row["logits"]["positions"] >= 12
    for what in ("weights", "kv", "both"):
        assert 0.0 <= row["greedy"][what]["tokens"] <= 1.0
        assert 0 <= row["greedy"][what]["first_flip_median"] <= 3


def test_an_uncompressed_control_has_no_error():
    config = MODELS["tiny-opt"]
    import bench.compress_quality as q
    saved, q.round_tripped = q.round_tripped, lambda lm: lm
    try:
        row = logits_error(config, 3, [[1, 2, 3, 4, 5]])
    finally:
        q.round_tripped = saved
    assert row["relative_error_max"] == 0.0 and row["top1_agreement"] == 1.0
