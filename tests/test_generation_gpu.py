"""Decoder serving on a GPU (Triton attention, CUDA-graph decode iterations) against HF transformers
run one request at a time, with random prompt lengths and arrival times.

bf16 rule for near-ties: a request passes if its first 32 tokens equal HF's, or if at the first
difference HF's logit of our token is within NEAR_TIE times the spread (standard deviation) of HF's
logits at that position of HF's best (two bf16 computations of the same logits, rounded
differently, may order such a pair either way); at least 95% must pass, and the identical ones
are reported. fp32 (TF32 off): every token identical to our own unbatched model run densely on the
same GPU (batched equals unbatched), and to HF up to the same rule: on an H200, HF's fp32 CUDA run
and ours differed at gaps of 0.2-1.5% of the logits' spread, unexplained so far, while on the CPU
every token is identical to HF (tests/test_generation.py).
"""
import random
import time
from dataclasses import replace

import pytest
import torch

from helpers import needs_gpu

transformers = pytest.importorskip("transformers")

from batchmaker import Engine, EngineConfig  # noqa: E402
from batchmaker.cells.decoder_config import DecoderConfig, to_hf  # noqa: E402
from batchmaker.registry import build_model  # noqa: E402

pytestmark = [pytest.mark.gpu, needs_gpu]
NEAR_TIE = 0.05  # of the logits' standard deviation
CONFIG = DecoderConfig(family="llama", vocab_size=4096, hidden_size=512, intermediate_size=1024, num_layers=4,
                       num_heads=8, num_kv_heads=4, head_dim=64, max_positions=1024)
HEAD_80 = replace(CONFIG, hidden_size=640, head_dim=80)  # OPT-2.7B's and Phi-2's head size: padded to 128 columns


@pytest.fixture(scope="module", params=[CONFIG, HEAD_80], ids=["head64", "head80"])
def checkpoint(tmp_path_factory, request):
    torch.manual_seed(11)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**to_hf(request.param)))
    with torch.no_grad():
        hf.lm_head.weight.mul_(30)  # logits spread over several units: ties become rare
    path = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(path)
    return str(path), hf


def hf_reference(hf, prompt, n):
    seq, logits_seen = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([seq], device=hf.device)).logits[0, -1].float()
            seq.append(int(logits.argmax()))
            logits_seen.append(logits)
    return seq[len(prompt):], logits_seen


def near_tie_or_equal(tokens, ref, logits, tie) -> tuple[bool, bool]:
    """(identical, identical or diverging first at a near-tie of HF's logits)."""
    if tokens == ref:
        return True, True
    j = next(i for i, (a, b) in enumerate(zip(tokens, ref)) if a != b)
    gap = float(logits[j].max() - logits[j][tokens[j]])
    print(f"  first difference at {j}: HF gap {gap:.4g}, logits std {float(logits[j].std()):.4g}")
    return False, gap < tie * float(logits[j].std())


def own_greedy(lm, prompt, n):
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(lm.dense_logits(torch.tensor(seq, device="cuda"))[-1].argmax()))
    return seq[len(prompt):]


def serve(path, dtype, prompts, n, rng, with_model=False):
    model = build_model("llama", checkpoint=path, dtype=dtype, device="cuda", max_tokens=128, max_seqs=32,
                        num_blocks=512)
    engine = Engine([model], EngineConfig(devices=("cuda:0",))).start(thread=False)
    try:
        futures, pending = [], list(prompts)
        deadline = time.monotonic() + 300
        while pending or not all(f.done() for f in futures):
            assert time.monotonic() < deadline
            while pending and rng.random() < 0.3:
                futures.append(engine.submit("llama", {"tokens": pending.pop(0), "max_new_tokens": n,
                                                       "ignore_eos": True}))
            engine.step()
        runner = next(iter(engine.workers[0].iterations.values()))
        assert runner.num_graph_iterations > 0  # decode iterations replayed CUDA graphs
        outs = [f.result(0).outputs["tokens"] for f in futures]
        return (outs, model.cells["decoder"].lm) if with_model else outs
    finally:
        engine.stop()


def assert_bf16_near_ties(path: str, hf, tokens: tuple, max_len: int, label: str) -> None:
    """40 mixed prompts served in bf16: the first 32 tokens identical to HF's (bf16, one request at
    a time) for >= 95% of them, or differing first where HF's top two were within NEAR_TIE."""
    hf = hf.to("cuda", torch.bfloat16).eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(*tokens) for _ in range(rng.randint(1, max_len))] for _ in range(40)]
    ours = serve(path, "bf16", prompts, 32, rng)
    results = [near_tie_or_equal(tokens, *hf_reference(hf, prompt, 32), NEAR_TIE) for prompt, tokens in zip(prompts, ours)]
    identical, passed = sum(r[0] for r in results), sum(r[1] for r in results)
    print(f"{label}: {identical}/{len(prompts)} identical, {passed}/{len(prompts)} identical or near-tie")
    assert passed >= 0.95 * len(prompts)


def test_bf16_greedy_matches_hf_up_to_near_ties(checkpoint, no_tf32):
    path, hf = checkpoint
    assert_bf16_near_ties(path, hf, (1, 4096), 300, "bf16")


def test_fp32_greedy_equals_unbatched_and_hf(checkpoint, no_tf32):
    path, hf = checkpoint
    hf = hf.to("cuda", torch.float32).eval()
    rng = random.Random(1)
    prompts = [[rng.randrange(1, 4096) for _ in range(rng.randint(1, 200))] for _ in range(16)]
    ours, lm = serve(path, "fp32", prompts, 24, rng, with_model=True)
    with torch.no_grad():
        alone = [own_greedy(lm, prompt, 24) for prompt in prompts]
    results = [near_tie_or_equal(tokens, *hf_reference(hf, prompt, 24), NEAR_TIE) for prompt, tokens in zip(prompts, ours)]
    print(f"fp32: {sum(a == b for a, b in zip(ours, alone))}/{len(prompts)} equal to our dense run, "
          f"{sum(r[0] for r in results)} identical to HF, {sum(r[1] for r in results)} identical or near-tie")
    assert ours == alone
    assert all(r[1] for r in results)


_NO_COMPILE_SCRIPT = """
import json, random
import torch
from triton import knobs
from batchmaker import Engine, EngineConfig
from batchmaker.registry import build_model
compiled = []
knobs.runtime.jit_post_compile_hook = lambda *a, **kw: compiled.append(str(kw.get("repr", "?"))[:120])
model = build_model("llama", preset="tiny-llama", dtype="bf16", device="cuda", max_tokens=256, max_seqs=32,
                    num_blocks=1024, seed=0)
engine = Engine([model], EngineConfig(devices=("cuda:0",))).start(thread=False)
at_start = len(compiled)
rng = random.Random(2)
pending = [[rng.randrange(1, 500) for _ in range(rng.choice([1, 5, 40, 120, 200]))] for _ in range(64)]
futures = []
while pending or not all(f.done() for f in futures):
    while pending and rng.random() < 0.5:
        futures.append(engine.submit("llama", {"tokens": pending.pop(0), "max_new_tokens": rng.randint(1, 40),
                                               "ignore_eos": True}))
    engine.step()
assert all(len(f.result(0).outputs["tokens"]) > 0 for f in futures)
engine.stop()
print(json.dumps({"start": compiled[:at_start], "serving": compiled[at_start:]}))
"""


def test_serving_compiles_no_attention_kernel_after_start():
    """The engine compiles every paged-attention variant when it starts (kernels/attention_variants.py)
    and its index arrays start 16-byte aligned whatever the batch's shape, so mixed batches of
    every shape (decodes, prompt chunks, work lists from 16 sequences, graphs and eager) compile
    none while serving; a compile mid-serving stalled every request for 1-3 s (H200). In a fresh
    process: kernels compiled by other tests would hide a miss."""
    import json
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", _NO_COMPILE_SCRIPT], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = json.loads(done.stdout.strip().splitlines()[-1])
    assert any("paged_attention_kernel" in name for name in compiled["start"])  # (compiled at start, this process)
    assert [name for name in compiled["serving"] if "attention" in name or "combine" in name] == []
