"""bench/accelerate_offload.py, the Accelerate anchor for a model larger than the host (issue 34's
70B): a parameter goes where its longest module prefix in `device_map` says, and on the CPU a tiny
model runs through `generate` and prints the probe's line, which bench/offload_anchor.py parses."""
import pytest

from bench import accelerate_offload
from bench.offload_anchor import PROBE_LINE


def test_a_parameter_goes_where_its_longest_module_prefix_is_mapped():
    dmap = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": "cpu", "model.norm": 0, "lm_head": 0}
    assert accelerate_offload._place(dmap, "model.layers.1.self_attn.q_proj.weight") == "cpu"
    assert accelerate_offload._place(dmap, "model.layers.0.mlp.up_proj.weight") == 0
    assert accelerate_offload._place({"": "cpu"}, "lm_head.weight") == "cpu"  # (one entry for the whole model)
    with pytest.raises(KeyError):
        accelerate_offload._place({"model": 0}, "lm_head.weight")


def test_a_tiny_model_generates_and_prints_the_probe_line(capsys):
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    accelerate_offload.main(["--preset", "tiny-llama", "--device", "cpu", "--batches", "2,3", "--prompt", "8",
                             "--new", "3", "--gpu-gib", "1"])
    lines = [m for m in PROBE_LINE.finditer(capsys.readouterr().out)]
    assert [int(m[2]) for m in lines] == [2, 3] and all(float(m[6]) > 0 for m in lines)
