"""Gemma, Gemma 2 and Gemma 3 text (issue 33), loaded from the checkpoints transformers saves and
served by the one `llama` model: tiny random configs with every weight perturbed, sliding windows
shorter than the prompts, soft caps that bind, a query_pre_attn_scalar that is not the head size,
Gemma 3's local RoPE base beside a scaled global RoPE. Logits and greedy tokens equal transformers'
own (fp32, CPU), requests arriving apart or all at once, also split over two ranks and two
stages; built for a GPU too (its attention kernels take windows and caps: tests/test_attention_window_kernel.py,
and tests/test_gemma_gpu.py serves Gemma 2 on one)."""
import dataclasses
import random

import pytest
import torch
from helpers import passes_gpu_checks, save_perturbed
from test_generation import assert_sent_at_once_equal_hf, hf_greedy
from test_tensor_parallel_engine import serve

from batchmaker.cells.checkpoint import load_checkpoint
from batchmaker.cells.decoder import build_decoder, empty_decoder, materialize
from batchmaker.cells.decoder_config import from_hf, layer_windows, num_parameters
from batchmaker.registry import build_model

transformers = pytest.importorskip("transformers")

TINY = {"vocab_size": 512, "hidden_size": 96, "intermediate_size": 160, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 256,
        "bos_token_id": 1, "eos_token_id": [2, 3], "pad_token_id": 0}
WINDOW = 16  # (the prompts run to 70 tokens)
FAMILIES = {
    "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM, {}),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
               {"sliding_window": WINDOW, "attn_logit_softcapping": 0.5, "final_logit_softcapping": 2.0,
                "query_pre_attn_scalar": 24}),
    "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
                    {"sliding_window": WINDOW, "final_logit_softcapping": 2.0, "query_pre_attn_scalar": 24,
                     "sliding_window_pattern": 2, "rope_theta": 100000.0, "rope_local_base_freq": 500.0,
                     "rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
}


def save(family: str, path) -> torch.nn.Module:
    """A tiny model of `family` with every weight perturbed (norms too), saved as users have it."""
    config_class, model_class, extra = {**FAMILIES, **HEAD_256}[family]
    return save_perturbed(config_class, model_class, {**TINY, **extra}, path)


def prompts(seed: int, count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (length,), generator=generator) for length in (1, 7, 40, 70)[:count]]


GEMMA3 = dict(TINY, model_type="gemma3_text", num_hidden_layers=7, sliding_window=8)  # (a config.json dict)
HEAD_256 = {"gemma2-head-256": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM,  # (the real models' size)
                                {**FAMILIES["gemma2"][2], "head_dim": 256, "query_pre_attn_scalar": 256})}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_equal_transformers(family, tmp_path):
    hf = save(family, tmp_path)
    model = load_checkpoint(tmp_path)
    c = model.config
    assert c.model_type == family and c.eos_token_ids == (2, 3) and c.tie_word_embeddings
    assert c.attention_windows == ({"gemma": (), "gemma2": (16, 0, 16, 0), "gemma3_text": (16, 0, 16, 0)}[family])
    assert num_parameters(c) == sum(p.numel() for p in hf.parameters())
    for tokens in prompts(2, 4):
        with torch.no_grad():
            expected = hf(tokens[None]).logits[0]
        torch.testing.assert_close(model.dense_logits(tokens), expected, atol=1e-4, rtol=1e-4)


def test_seeded_gemma_norms_scale_by_one():
    config = from_hf(dict(GEMMA3, num_hidden_layers=2))
    model = build_decoder(config, seed=3)
    norms = [p for name, p in model.named_parameters() if name.rsplit(".", 1)[0].endswith("norm")]
    assert len(norms) == 2 * 6 + 1 and not any(p.any() for p in norms)  # (4 + q, k norms a layer, the final)
    tokens = torch.arange(20)
    assert torch.equal(model.dense_logits(tokens), build_decoder(config, seed=3).dense_logits(tokens))


@pytest.mark.parametrize("family, off", [("gemma2", {"layer_windows": ()}), ("gemma2", {"attn_softcap": None}),
                                         ("gemma2", {"final_softcap": None}),
                                         ("gemma2", {"query_pre_attn_scalar": None}),
                                         ("gemma3_text", {"layer_windows": ()}),
                                         ("gemma3_text", {"local_rope_theta": None}),
                                         ("gemma3_text", {"rope_scaling": None})])
def test_each_feature_binds_at_these_lengths(family, off, tmp_path):
    """Without any one of the features the logits differ from transformers': the tests above test it."""
    hf = save(family, tmp_path)
    model = load_checkpoint(tmp_path)
    crippled = materialize(empty_decoder(dataclasses.replace(model.config, **off)), model.state_dict(), "cpu")
    tokens = prompts(2, 3)[-1]
    with torch.no_grad():
        expected = hf(tokens[None]).logits[0]
    assert (crippled.dense_logits(tokens) - expected).abs().max() > 1e-3


@pytest.mark.parametrize("family, tp, pp", [("gemma", 1, 1), ("gemma2", 1, 1), ("gemma3_text", 1, 1),
                                            ("gemma2", 2, 1), ("gemma3_text", 1, 2), ("gemma2-head-256", 1, 1)])
def test_served_tokens_equal_transformers(family, tp, pp, tmp_path):
    hf = save(family, tmp_path)
    rng = random.Random(3)
    requests = [("llama", {"tokens": [rng.randrange(4, 512) for _ in range(rng.randint(1, 70))],
                           "max_new_tokens": rng.randint(1, 10), "ignore_eos": True}) for _ in range(6)]
    model = build_model("llama", checkpoint=str(tmp_path), max_tokens=48, tensor_parallel=tp, pipeline_parallel=pp)
    got = serve(model, requests, seed=1)
    for tokens, (_, inputs) in zip(got, requests):
        assert tokens == hf_greedy(hf, inputs["tokens"], inputs["max_new_tokens"])


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_requests_sent_at_once(family, tmp_path):
    """Mixed prompt lengths submitted together: iterations of several prompt chunks and decodes."""
    assert_sent_at_once_equal_hf(save(family, tmp_path), tmp_path)


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_built_for_a_gpu(family, tmp_path):
    """Windows that bind and capped scores are no longer refused for a GPU (issue 33)."""
    save(family, tmp_path)
    passes_gpu_checks(str(tmp_path))


@pytest.mark.parametrize("config, windows", [
    (dict(GEMMA3), (8, 8, 8, 8, 8, 0, 8)),  # (five local layers to one global by default)
    (dict(GEMMA3, sliding_window_pattern=3), (8, 8, 0, 8, 8, 0, 8)),
    (dict(GEMMA3, layer_types=["full_attention"] * 6 + ["sliding_attention"]), (0,) * 6 + (8,)),
    (dict(GEMMA3, model_type="gemma2"), (8, 0, 8, 0, 8, 0, 8)),
    (dict(GEMMA3, model_type="qwen2", max_window_layers=5), ()),  # (Qwen's need use_sliding_window)
    (dict(GEMMA3, model_type="qwen2", max_window_layers=5, use_sliding_window=True), (0,) * 5 + (8, 8)),
    (dict(GEMMA3, model_type="mistral"), (8,) * 7),
    (dict(GEMMA3, model_type="llama"), ()),
])
def test_layer_windows_as_transformers_reads_them(config, windows):
    assert layer_windows(config) == windows


def test_gemma3_legacy_rope_keys_and_refusals():
    legacy = dict(GEMMA3, rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
                  hidden_activation="gelu_pytorch_tanh")
    c = from_hf(legacy)
    assert (c.rope_theta, c.local_rope_theta, c.rope_scaling_dict) == (1e6, 1e4, {"factor": 8.0, "rope_type": "linear"})
    assert c.post_norms and c.qk_norm and c.attention_scale == 256 ** -0.5  # (transformers' default scalar)
    assert (c.attn_softcap, c.final_softcap) == (None, None)
    for change, message in [({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping 50.0 on gemma3_text"),
                            ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
                            ({"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
                            ({"layer_types": ["sliding_attention"] * 6 + ["chunked_attention"]}, "layer_types")]:
        with pytest.raises(ValueError, match=message):
            from_hf(dict(legacy, **change))
    with pytest.raises(ValueError, match="only the text model is supported"):
        from_hf(dict(legacy, model_type="gemma3"))


def test_gemma2_keys_left_out_take_transformers_defaults():
    c = from_hf(dict(TINY, model_type="gemma2"))
    assert (c.attn_softcap, c.final_softcap, c.attention_scale) == (50.0, 30.0, 256 ** -0.5)
    assert c.layer_windows == (4096, 0, 4096, 0) and c.attention_windows == ()  # (4096 never binds at 256)
