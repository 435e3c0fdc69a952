"""Decoder-only models (Llama, OPT): equal to HF transformers' logits when loaded from a checkpoint
that transformers saved; token-wise forward over packed sequences equals each sequence alone, also
over a paged KV cache (prefill, then decode); seeded builds, presets, config round trips, loader
errors and the tokenizer file."""
import json
from dataclasses import replace

import pytest
import torch

from batchmaker.cells.checkpoint import load_checkpoint, load_tokenizer
from batchmaker.cells.decoder import build_decoder, causal_attend, repeat_kv
from batchmaker.cells.decoder_config import (PRESETS, DecoderConfig, from_hf, num_parameters, scaling_tuple,
                                             to_hf)
from batchmaker.kernels.paged_attention import PagedAttend

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

TINY_LLAMA, TINY_OPT = PRESETS["tiny-llama"], PRESETS["tiny-opt"]
LLAMA3_ROPE = scaling_tuple({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
VARIANTS = {
    "llama-gqa": TINY_LLAMA,
    "llama-bias-tied-wide-heads": replace(TINY_LLAMA, num_kv_heads=4, head_dim=32, attention_bias=True,
                                          mlp_bias=True, tie_word_embeddings=True),
    "llama-rope-linear": replace(TINY_LLAMA, rope_scaling=(("factor", 2.0), ("rope_type", "linear"))),
    "llama-rope-llama3": replace(TINY_LLAMA, rope_scaling=LLAMA3_ROPE, rope_theta=500000.0),
    "opt-relu": TINY_OPT,
    "opt-gelu-untied-no-bias": replace(TINY_OPT, activation="gelu", tie_word_embeddings=False,
                                       enable_bias=False),
}


def hf_model(config: DecoderConfig):
    """The transformers model of `config`, fp32, eval, every weight perturbed (biases and norms too)."""
    torch.manual_seed(0)
    if config.family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**to_hf(config)))
    else:
        model = transformers.OPTForCausalLM(transformers.OPTConfig(**to_hf(config)))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    return model.float().eval()


def save_hf(config: DecoderConfig, path, sharded=False):
    model = hf_model(config)
    model.save_pretrained(path, max_shard_size="40KB") if sharded else model.save_pretrained(path)
    return model


@pytest.mark.parametrize("name", VARIANTS)
def test_checkpoint_logits_equal_transformers(name, tmp_path):
    config = VARIANTS[name]
    sharded = name in ("llama-gqa", "opt-relu")
    hf = save_hf(config, tmp_path, sharded)
    assert (tmp_path / "model.safetensors.index.json").is_file() == sharded
    model = load_checkpoint(tmp_path)
    assert model.config == config
    generator = torch.Generator().manual_seed(2)
    for length in (1, 5, 48):
        tokens = torch.randint(0, config.vocab_size, (length,), generator=generator)
        with torch.no_grad():
            expected = hf(tokens[None]).logits[0]
        torch.testing.assert_close(model.dense_logits(tokens), expected, atol=1e-4, rtol=1e-4)


def test_checkpoint_dtype_conversion(tmp_path):
    save_hf(TINY_LLAMA, tmp_path)
    model = load_checkpoint(tmp_path, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.inv_freq.dtype == torch.float32  # rope frequencies stay exact
    logits = model.dense_logits(torch.tensor([1, 2, 3]))
    assert logits.dtype == torch.float32 and logits.shape == (3, TINY_LLAMA.vocab_size)
    assert load_checkpoint(tmp_path).embed_tokens.weight.dtype == torch.float32  # config.json's dtype


def packed_attend(seq_ids: torch.Tensor, positions: torch.Tensor, calls: list):
    """Attention over a flat batch of several sequences: a token sees its own sequence's earlier tokens."""
    visible = (seq_ids[:, None] == seq_ids[None, :]) & (positions[None, :] <= positions[:, None])  # [T, T]

    def attend(layer_index, q, k, v):
        calls.append((layer_index, q.shape, k.shape, v.shape))
        k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
        scores = torch.einsum("thd,shd->hts", q, k) * q.shape[-1] ** -0.5
        weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        return torch.einsum("hts,shd->thd", weights, v)
    return attend


@pytest.mark.parametrize("config", [TINY_LLAMA, TINY_OPT], ids=["llama", "opt"])
def test_packed_forward_equals_each_sequence_alone(config):
    model = build_decoder(config, seed=3)
    first, second = torch.randint(0, config.vocab_size, (11,)), torch.randint(0, config.vocab_size, (7,))
    tokens = torch.cat([first, second])
    positions = torch.cat([torch.arange(11), torch.arange(7)])
    seq_ids = torch.cat([torch.zeros(11, dtype=torch.long), torch.ones(7, dtype=torch.long)])
    calls = []
    with torch.no_grad():
        packed = model(tokens, positions, packed_attend(seq_ids, positions, calls))
        alone = [model(s, torch.arange(len(s)), causal_attend) for s in (first, second)]
    torch.testing.assert_close(packed, torch.cat(alone), atol=1e-5, rtol=1e-5)
    last_of_first = model.head(packed[10:11])
    torch.testing.assert_close(last_of_first, model.dense_logits(first)[-1:], atol=1e-5, rtol=1e-5)
    q_shape = (18, config.num_heads, config.head_dim)
    kv_shape = (18, config.num_kv_heads, config.head_dim)
    assert calls == [(i, q_shape, kv_shape, kv_shape) for i in range(config.num_layers)]


@pytest.mark.parametrize("config", [TINY_LLAMA, TINY_OPT], ids=["llama", "opt"])
def test_paged_prefill_then_decode_equals_each_sequence_alone(config, monkeypatch):
    """Through PagedAttend (the CPU twins): Llama writes K/V with its rotation (kv_cache, then
    attend_cached), OPT through attend(layer, q, k, v). Two sequences prefill all but their last
    token in one iteration, then decode it in the next."""
    if config.family == "llama":
        monkeypatch.setattr(PagedAttend, "__call__", lambda *a: pytest.fail("Llama writes K/V itself"))
    model = build_decoder(config, seed=5)
    block_size = 4
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=torch.Generator().manual_seed(n)) for n in (10, 6)]
    tables = torch.tensor([[1, 2, 3], [4, 5, 0]], dtype=torch.int32)
    shape = (config.num_layers, 6, block_size, config.num_kv_heads, config.head_dim)
    k_cache, v_cache = torch.full(shape, float("nan")), torch.full(shape, float("nan"))  # block 0 too: unread

    def iteration(chunks):  # [(sequence, first position, tokens)] -> logits of each chunk's last token
        positions = torch.cat([torch.arange(first, first + len(t)) for _, first, t in chunks])
        seq_ids = torch.cat([torch.full((len(t),), s) for s, _, t in chunks])
        lens = torch.tensor([len(t) for _, _, t in chunks])
        query_start = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).int()
        context_lens = torch.tensor([first + len(t) for _, first, t in chunks], dtype=torch.int32)
        slots = tables[seq_ids, positions // block_size].long() * block_size + positions % block_size
        seen = []
        attend = PagedAttend(k_cache, v_cache, slots, tables, query_start, context_lens, int(lens.max()),
                             config.head_dim ** -0.5, before_layer=seen.append)
        with torch.no_grad():
            hidden = model(torch.cat([t for _, _, t in chunks]), positions, attend)
            assert seen == list(range(config.num_layers))
            return model.head(hidden[query_start[1:].long() - 1])
    prefill = iteration([(s, 0, t[:-1]) for s, t in enumerate(seqs)])
    decode = iteration([(s, len(t) - 1, t[-1:]) for s, t in enumerate(seqs)])
    for s, t in enumerate(seqs):
        dense = model.dense_logits(t)
        torch.testing.assert_close(prefill[s], dense[-2], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(decode[s], dense[-1], atol=1e-5, rtol=1e-5)


def test_build_decoder_is_seeded():
    a, b, c = (build_decoder(TINY_LLAMA, seed=s).state_dict() for s in (0, 0, 1))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.attn.qkv_proj.weight"], c["layers.0.attn.qkv_proj.weight"])
    assert torch.equal(a["norm.weight"], torch.ones(TINY_LLAMA.hidden_size))
    assert build_decoder(TINY_OPT, dtype=torch.float16).embed_tokens.weight.dtype == torch.float16


def test_random_model_activations_stay_order_one():
    model = build_decoder(TINY_LLAMA)
    logits = model.dense_logits(torch.arange(32))
    assert torch.isfinite(logits).all() and 1e-3 < logits.std() < 10


@pytest.mark.parametrize("config", list(VARIANTS.values()), ids=list(VARIANTS))
def test_num_parameters_counts_the_built_model(config):
    assert num_parameters(config) == sum(p.numel() for p in build_decoder(config).parameters())


def test_presets():
    llama7, llama13, opt13 = PRESETS["llama-2-7b"], PRESETS["llama-2-13b"], PRESETS["opt-13b"]
    assert num_parameters(llama7) == 6_738_415_616
    assert num_parameters(llama13) == 13_015_864_320
    assert abs(num_parameters(opt13) - 12.85e9) < 0.01e9
    sizes = lambda c: (c.vocab_size, c.max_positions, c.num_layers, c.hidden_size, c.num_heads)  # noqa: E731
    assert sizes(llama7) == (32000, 4096, 32, 4096, 32)
    assert sizes(llama13) == (32000, 4096, 40, 5120, 40)
    assert sizes(opt13) == (50272, 2048, 40, 5120, 40)
    assert opt13.tie_word_embeddings and opt13.activation == "relu"
    for name, config in PRESETS.items():
        assert from_hf(to_hf(config)) == config, name
        hash(config)


FAMILY_SIZES = {"qwen2.5-7b": ("Qwen2ForCausalLM", 7.62e9), "mistral-7b": ("MistralForCausalLM", 7.25e9),
                "phi-3-mini": ("Phi3ForCausalLM", 3.82e9), "gemma-2-9b": ("Gemma2ForCausalLM", 9.24e9),
                "llama-3-8b": ("LlamaForCausalLM", 8.03e9)}  # (the published counts)


@pytest.mark.parametrize("name", list(FAMILY_SIZES))
def test_family_presets_count_the_parameters_of_transformers_models(name):
    """Each family-sized preset's count equals that of transformers' own model of its config.json
    (built on the meta device: nothing allocated), within 1% of the published count."""
    config, (architecture, published) = PRESETS[name], FAMILY_SIZES[name]
    hf_config = transformers.AutoConfig.for_model(**to_hf(config))
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_config)
    assert type(hf).__name__ == architecture and config.attention_windows == ()  # (Gemma's 4,096: never binds)
    assert num_parameters(config) == sum(p.numel() for p in hf.parameters())
    assert abs(num_parameters(config) / published - 1) < 0.01


def test_config_rejects_unsupported():
    with pytest.raises(ValueError, match="dynamic"):  # (dynamic NTK: frequencies that move with the length)
        from_hf({**to_hf(TINY_LLAMA), "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    with pytest.raises(ValueError, match="do_layer_norm_before"):
        from_hf({**to_hf(TINY_OPT), "do_layer_norm_before": False})
    with pytest.raises(ValueError, match="word_embed_proj_dim"):
        from_hf({**to_hf(TINY_OPT), "word_embed_proj_dim": 32})
    with pytest.raises(ValueError, match="gpt2"):
        from_hf({"model_type": "gpt2"})
    legacy = from_hf({**to_hf(TINY_LLAMA), "rope_scaling": {"type": "linear", "factor": 4}})
    assert legacy.rope_scaling_dict == {"factor": 4, "rope_type": "linear"}


def test_loader_errors(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="config.json.*unsupported model_type 'gpt2'"):
        load_checkpoint(tmp_path)

    save_hf(TINY_LLAMA, tmp_path)
    weights = safetensors_torch.load_file(tmp_path / "model.safetensors")
    missing = "model.layers.1.self_attn.k_proj.weight"
    kept = {k: v for k, v in weights.items() if k != missing}
    safetensors_torch.save_file(kept, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=f"model.safetensors.*missing tensor '{missing}'"):
        load_checkpoint(tmp_path)

    safetensors_torch.save_file(weights, tmp_path / "model.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(ValueError, match="unexpected shape.*mlp.gate_proj.weight"):
        load_checkpoint(tmp_path)


def test_load_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    assert load_tokenizer(tmp_path) is None
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    assert load_tokenizer(tmp_path).encode("hello there world").ids == [1, 0, 2]


def test_a_head_size_the_gpu_kernels_lack_is_refused_when_built(tmp_path):
    """A head size past the GPU kernels' largest (256) would fail in the engine's warm-up on a GPU:
    refused when the model is built, naming the field; the CPU path runs any head size."""
    from batchmaker.cells.decoder_config import to_hf
    from batchmaker.registry import build_model
    config = replace(TINY_LLAMA, hidden_size=2 * 272, num_heads=2, num_kv_heads=2, head_dim=272)
    (tmp_path / "config.json").write_text(json.dumps(to_hf(config)))
    with pytest.raises(ValueError, match="head_dim 272 .*head sizes up to 256"):
        build_model("llama", checkpoint=str(tmp_path), device="cuda:0")
    config = replace(config, hidden_size=2 * 80, head_dim=80)  # OPT-2.7B's: taken (it fails later here: no
    (tmp_path / "config.json").write_text(json.dumps(to_hf(config)))  # GPU, or no weights)
    with pytest.raises(ValueError) as later:
        build_model("llama", checkpoint=str(tmp_path), device="cuda:0")
    assert "head_dim" not in str(later.value)


def test_a_decoder_off_the_cpu_is_refused_by_a_cpu_worker():
    """A decoder built on a GPU and an engine whose devices say cpu: a clear error at start, not a
    device mismatch inside the first iteration (its weights here on the meta device, as a GPU's)."""
    from batchmaker.cells.decoder import empty_decoder
    from batchmaker.cells.decoder_cell import DecoderCell
    from batchmaker.exec.worker import place_cell
    with pytest.raises(ValueError, match="cannot run on a CPU worker"):
        place_cell(DecoderCell(empty_decoder(TINY_LLAMA)), torch.device("cpu"))
