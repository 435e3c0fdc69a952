"""RoPE beyond Llama 2's (issue 33): Phi-3.5's and Phi-4-mini's rotary embeddings over part of each
head (`partial_rotary_factor`, as a layout of q's and k's rows: cells/rotary_layout.py) and longrope
(short factors before `original_max_position_embeddings`, long ones from it, cos and sin scaled),
and YaRN (Qwen2.5's long contexts; cells/rope.py), loaded from the checkpoints transformers saves:
logits and greedy tokens equal to transformers' (fp32, CPU; longrope against its generation with a
KV cache, one request at a time), also split over two ranks; configs the engine cannot run refused
when built."""
import inspect
import json
import random

import pytest
import torch

from batchmaker.cells.checkpoint import load_checkpoint
from batchmaker.cells.rotary_layout import rotary_permutation, to_rotary_layout
from batchmaker.registry import build_model
from helpers import needs_gpu, save_perturbed
from test_generation import hf_greedy
from test_tensor_parallel_engine import serve

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=512, hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=[2, 3],
            rope_theta=10000.0, pad_token_id=0)  # (heads of 24)
ORIGINAL = 32  # longrope's original_max_position_embeddings: the tests' generations cross it
PARTIAL = {"partial-0.5": dict(partial_rotary_factor=0.5),
           "partial-longrope": dict(partial_rotary_factor=0.75, original_max_position_embeddings=ORIGINAL,
                                    rope_scaling={"type": "longrope", "short_factor": [1.0 + i / 8 for i in range(9)],
                                                  "long_factor": [2.0 + i for i in range(9)]}),
           "longrope": dict(original_max_position_embeddings=ORIGINAL,
                            rope_scaling={"type": "longrope", "short_factor": [1.0 + i / 4 for i in range(12)],
                                          "long_factor": [3.0 + i for i in range(12)]})}


YARN = {"qwen2-yarn": dict(rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
        "llama-yarn": dict(rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
                                         "beta_fast": 16, "beta_slow": 2})}
CLASSES = {"qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM)}


def save(name: str, path) -> torch.nn.Module:
    config_class, model_class = CLASSES.get(name.split("-")[0], (transformers.Phi3Config, transformers.Phi3ForCausalLM))
    return save_perturbed(config_class, model_class, {**TINY, **PARTIAL.get(name, YARN.get(name))}, path)


def hf_cached_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy tokens one request at a time with its KV cache (as `generate` runs:
    longrope picks its factors per forward, by its longest position)."""
    return hf_cached_reference(hf, prompt, n)[0]


def test_the_layout_pairs_the_rotated_dims_as_transformers_does_and_inverts():
    perm = rotary_permutation(24, 18)
    assert sorted(perm.tolist()) == list(range(24))
    assert [(int(perm[j]), int(perm[j + 12])) for j in range(9)] == [(i, i + 9) for i in range(9)]  # (rotated)
    assert set(perm[9:12].tolist()) | set(perm[21:].tolist()) == set(range(18, 24))  # (passed through)
    config = load_checkpoint_config(dict(TINY, partial_rotary_factor=0.75))
    qkv = torch.randn((4 + 2 + 2) * 24, 96)
    moved = to_rotary_layout(config, "layers.1.attn.qkv_proj.weight", qkv)
    assert torch.equal(moved[:24], qkv[:24][perm]) and torch.equal(moved[-48:], qkv[-48:])  # (v's rows kept)
    assert torch.equal(to_rotary_layout(config, "layers.1.attn.qkv_proj.weight", moved, inverse=True), qkv)
    assert to_rotary_layout(config, "layers.1.attn.o_proj.weight", qkv) is qkv


def load_checkpoint_config(hf_config: dict):
    from batchmaker.cells.decoder_config import from_hf
    return from_hf(dict(hf_config, model_type="phi3"))


@pytest.mark.parametrize("name", [*PARTIAL, *YARN])
def test_logits_equal_transformers(name, tmp_path):
    hf = save(name, tmp_path)
    model = load_checkpoint(tmp_path)
    assert model.config.rotary_dim == {"partial-0.5": 12, "partial-longrope": 18}.get(name)
    generator = torch.Generator().manual_seed(2)
    for length in (1, 7, ORIGINAL) if "longrope" in name else (1, 7, 100):  # (longrope: within the original
        # positions, the short factors; yarn's frequencies are the same at every length)
        tokens = torch.randint(0, 512, (length,), generator=generator)
        with torch.no_grad():
            expected = hf(tokens[None]).logits[0]
        torch.testing.assert_close(model.dense_logits(tokens), expected, atol=1e-4, rtol=1e-4)
    if name in PARTIAL:
        ours = model.layers[1].attn.qkv_proj.weight  # (bench/chat.hf_model's way back to transformers' rows)
        back = to_rotary_layout(model.config, "layers.1.attn.qkv_proj.weight", ours, inverse=True)
        assert torch.equal(back, hf.model.layers[1].self_attn.qkv_proj.weight)


@pytest.mark.parametrize("name, tp", [("partial-0.5", 1), ("partial-0.5", 2), ("partial-longrope", 1),
                                      ("partial-longrope", 2), ("longrope", 1), ("qwen2-yarn", 2)])
def test_served_tokens_equal_transformers(name, tp, tmp_path):
    """All requests at once, mixed lengths; longrope's prompts within its original positions and their
    generations past them (each new token from there on rotated by the long factors)."""
    hf = save(name, tmp_path)
    rng = random.Random(3)
    longest = ORIGINAL if "longrope" in name else 70
    requests = [("llama", {"tokens": [rng.randrange(4, 512) for _ in range(rng.randint(1, longest))],
                           "max_new_tokens": rng.randint(8, 40), "ignore_eos": True}) for _ in range(6)]
    got = serve(build_model("llama", checkpoint=str(tmp_path), max_tokens=48, tensor_parallel=tp), requests, seed=1)
    reference = hf_cached_greedy if "longrope" in name else hf_greedy
    for tokens, (_, inputs) in zip(got, requests):
        assert tokens == reference(hf, inputs["tokens"], inputs["max_new_tokens"])


def test_su_is_longrope():
    from batchmaker.cells.decoder_config import from_hf
    hf = {**TINY, **PARTIAL["longrope"], "model_type": "phi3"}
    su = dict(hf, rope_scaling=dict(hf["rope_scaling"], type="su"))
    assert from_hf(su) == from_hf(hf) and dict(from_hf(su).rope_scaling)["rope_type"] == "longrope"


def test_configs_the_engine_cannot_run_are_refused_when_built(tmp_path):
    save("partial-0.5", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    rope = config.get("rope_parameters") or {}
    qwen2 = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}
    for change, message in [(qwen2, "supported for model_type phi3"),
                            ({"rope_parameters": dict(rope, rope_type="longrope", short_factor=[1.0] * 5,
                                                      long_factor=[2.0] * 6, original_max_position_embeddings=32)},
                             "short_factor: 6 factors"),
                            ({"rope_parameters": dict(rope, rope_type="longrope", short_factor=[1.0] * 6,
                                                      long_factor=[2.0] * 6, original_max_position_embeddings=None)},
                             "original_max_position_embeddings"),
                            ({"rope_parameters": dict(rope, partial_rotary_factor=0.3)}, "rotary_dim 7")]:
        (tmp_path / "config.json").write_text(json.dumps(dict(config, **change)))
        with pytest.raises(ValueError, match=message):
            build_model("llama", checkpoint=str(tmp_path))


@pytest.mark.gpu
@needs_gpu
def test_bf16_on_the_gpu_matches_transformers_up_to_near_ties(tmp_path, no_tf32):
    """Partial rotary and longrope through the GPU paths (the fused RoPE kernels, the one-token
    chain's RoPE, CUDA-graph decode): 40 mixed prompts within the original positions, 32 new tokens
    each (crossing it), against transformers in bf16 one request at a time with its cache, under
    tests/test_generation_gpu.py's near-tie rule."""
    gpu = pytest.importorskip("test_generation_gpu")
    config = dict(TINY, vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                  partial_rotary_factor=0.75, original_max_position_embeddings=64,
                  rope_scaling={"type": "longrope", "short_factor": [1.0 + i / 32 for i in range(24)],
                                "long_factor": [2.0 + i / 4 for i in range(24)]})
    torch.manual_seed(11)
    hf = transformers.Phi3ForCausalLM(transformers.Phi3Config(**config))
    with torch.no_grad():
        hf.lm_head.weight.mul_(30)  # (logits spread over several units: ties become rare)
    hf.save_pretrained(tmp_path)
    hf = hf.to("cuda", torch.bfloat16).eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 4096) for _ in range(rng.randint(1, 64))] for _ in range(40)]
    ours = gpu.serve(str(tmp_path), "bf16", prompts, 32, rng)
    results = [gpu.near_tie_or_equal(tokens, *hf_cached_reference(hf, prompt, 32), gpu.NEAR_TIE)
               for prompt, tokens in zip(prompts, ours)]
    print(f"{sum(r[0] for r in results)}/40 identical, {sum(r[1] for r in results)}/40 identical or near-tie")
    assert sum(r[1] for r in results) >= 0.95 * len(prompts)


def hf_cached_reference(hf, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """hf_cached_greedy's tokens on hf's device, with each step's logits (the near-tie rule's)."""
    key = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    out, seen = [], []
    with torch.no_grad():
        step = hf(torch.tensor([prompt], device=hf.device), use_cache=True)
        for _ in range(n):
            seen.append(step.logits[0, -1].float())
            out.append(int(seen[-1].argmax()))
            step = hf(torch.tensor([[out[-1]]], device=hf.device), use_cache=True, **{key: step[key]})
    return out, seen
