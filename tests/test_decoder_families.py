"""The models built like Llama that people serve (issue 33): Mistral, Qwen2/2.5 (biases on q, k, v
only), Qwen3 (each head of q and k RMS-normed before RoPE, an explicit head size), Phi-3 (q | k | v
and gate | up stored fused; read whole and cut per rank), and Llama 3's
EOS lists, loaded from the checkpoints transformers saves and served by the one `llama` model:
logits and greedy tokens equal to transformers' own (fp32, CPU), also split over two ranks.
A sliding window that binds is served on the CPU (the attention twin's) and built for a GPU (the
Triton kernels take it too: tests/test_attention_window_kernel.py)."""
import json
import random
from dataclasses import replace

import pytest
import torch

from batchmaker.cells.checkpoint import load_checkpoint
from batchmaker.cells.decoder_config import PRESETS, num_parameters
from batchmaker.registry import build_model
from helpers import passes_gpu_checks, save_perturbed
from test_generation import hf_greedy
from test_tensor_parallel_engine import serve

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=512, hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=[2, 3],
            rope_theta=100000.0)
FAMILIES = {
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=None)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=32)),  # (not hidden / heads)
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, dict(pad_token_id=0)),  # (q | k | v stored fused)
}
HEAD_24 = {"qwen3-head-24": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=24))}
WINDOW = {"mistral-window-16": (transformers.MistralConfig, transformers.MistralForCausalLM,
                                {"sliding_window": 16, "head_dim": 32}),
          "qwen2-window-16": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,  # (the second layer's only)
                              {"sliding_window": 16, "use_sliding_window": True, "max_window_layers": 1})}


def save(family: str, path) -> torch.nn.Module:
    """A tiny model of `family` with every weight perturbed (biases and norms too), saved as users have it."""
    config_class, model_class, extra = {**FAMILIES, **HEAD_24, **WINDOW}[family]
    return save_perturbed(config_class, model_class, {**TINY, **extra}, path)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_equal_transformers(family, tmp_path):
    hf = save(family, tmp_path)
    model = load_checkpoint(tmp_path)
    assert model.config.model_type == family and model.config.eos_token_ids == (2, 3)
    assert num_parameters(model.config) == sum(p.numel() for p in hf.parameters())  # (a tied head counted once)
    generator = torch.Generator().manual_seed(2)
    for length in (1, 7, 40):
        tokens = torch.randint(0, 512, (length,), generator=generator)
        with torch.no_grad():
            expected = hf(tokens[None]).logits[0]
        torch.testing.assert_close(model.dense_logits(tokens), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family, tp", [("qwen2", 1), ("qwen3", 1), ("qwen3", 2), ("mistral", 2), ("phi3", 2),
                                        ("qwen3-head-24", 1),  # (a head size not a power of two)
                                        ("qwen2-window-16", 1)])
def test_served_tokens_equal_transformers(family, tp, tmp_path):
    hf = save(family, tmp_path)
    rng = random.Random(3)
    requests = [("llama", {"tokens": [rng.randrange(4, 512) for _ in range(rng.randint(1, 70))],
                           "max_new_tokens": rng.randint(1, 10), "ignore_eos": True}) for _ in range(6)]
    got = serve(build_model("llama", checkpoint=str(tmp_path), max_tokens=48, tensor_parallel=tp), requests, seed=1)
    for tokens, (_, inputs) in zip(got, requests):
        assert tokens == hf_greedy(hf, inputs["tokens"], inputs["max_new_tokens"])


@pytest.mark.parametrize("preset", ["qwen2.5-7b", "mistral-7b", "phi-3-mini", "gemma-2-9b", "llama-3-8b"])
def test_family_presets_shrunk_serve_the_tokens_of_transformers(preset, monkeypatch):
    """A family-sized preset (bench/chat.py's), shrunk to 2 layers, 1/16 of its widths, 256 positions
    and at most 32,768 tokens but its head size and head counts kept, built as bench/chat.py builds it: served
    greedy tokens equal transformers' model of its config.json with the same weights (chat.hf_model)."""
    chat = pytest.importorskip("bench.chat")
    c = PRESETS[preset]
    small = replace(c, num_layers=2, vocab_size=min(c.vocab_size, 32768), hidden_size=c.hidden_size // 16,
                    intermediate_size=c.intermediate_size // 16, layer_windows=c.layer_windows[:2], bos_token_id=1,
                    eos_token_ids=(2,), max_positions=256)  # (the vocabulary holds Phi-3's pad token, 32,000)
    monkeypatch.setitem(PRESETS, "shrunk", small)
    model = build_model("llama", preset="shrunk", dtype="fp32", device="cpu", seed=3, max_tokens=48)
    hf = chat.hf_model(model.cells["decoder"].lm, small)
    rng = random.Random(5)
    requests = [("llama", {"tokens": [rng.randrange(4, 512) for _ in range(rng.randint(1, 40))],
                           "max_new_tokens": 6, "ignore_eos": True}) for _ in range(4)]
    for tokens, (_, inputs) in zip(serve(model, requests, seed=1), requests):
        assert tokens == hf_greedy(hf, inputs["tokens"], inputs["max_new_tokens"])


def test_a_sliding_window_that_binds_is_served_on_the_cpu_and_built_for_the_gpu(tmp_path):
    hf = save("mistral-window-16", tmp_path)  # (shorter than most prompts: every layer attends to 16 positions)
    rng = random.Random(4)
    requests = [("llama", {"tokens": [rng.randrange(4, 512) for _ in range(rng.randint(1, 70))],
                           "max_new_tokens": rng.randint(1, 10), "ignore_eos": True}) for _ in range(6)]
    got = serve(build_model("llama", checkpoint=str(tmp_path), max_tokens=48), requests, seed=1)
    for tokens, (_, inputs) in zip(got, requests):
        assert tokens == hf_greedy(hf, inputs["tokens"], inputs["max_new_tokens"])
    passes_gpu_checks(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, sliding_window=4096)))  # (never binds)
    assert build_model("llama", checkpoint=str(tmp_path)).cells["decoder"].config.attention_windows == ()
