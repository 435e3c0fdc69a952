"""An offloaded decoder served online on a GPU (batchmaker/offloaded.py, block_worker.py; issue 34):
a tiny Llama checkpoint in fp32 with its weights, KV cache and hidden states in pinned host memory,
blocks of 2 x 2 on cuda:0 beside an LSTM on the same device, gives the tokens of the offloading
executor run directly on the same prompts (`generate_block`, the same schedule) for at least 5 of 6
requests (a block's padded width changes the matmuls' shapes, and cuBLAS may then round a near tie of
a random model the other way), and every request of both models is answered. Greedy against the engine's own decoder is not compared here: its attention kernels
differ from the executor's reference attention in fp32 rounding."""
import pytest
import torch

from helpers import needs_gpu

from batchmaker.engine import Engine
from batchmaker.serving.cli_models import load_models
from test_offload_serving import checkpoint  # noqa: F401  (the tiny checkpoint fixture)

pytestmark = [pytest.mark.gpu, needs_gpu]
OFFLOAD = ["llama.offload=weights+cache+hidden", "llama.gpu_batch=2", "llama.num_batches=2"]
PROMPTS = [[5, 6, 7], [9], [40, 41, 42, 43, 44, 45, 46, 47, 48], [3, 200], [77] * 20, [301, 302, 303, 304]]


def test_served_blocks_give_the_executors_tokens_beside_an_lstm(checkpoint):
    models = load_models(["llama", "lstm"], [f"llama.checkpoint={checkpoint}", "llama.dtype=float32", *OFFLOAD],
                         devices=("cuda:0",))
    llama = models[0]
    assert llama.executor.is_cuda and llama.block == 4
    with Engine(models) as engine:
        lstm = [engine.submit("lstm", {"tokens": [1 + i % 50] * (5 + i % 7)}) for i in range(64)]
        futures = [engine.submit("llama", {"tokens": p, "max_new_tokens": 4, "ignore_eos": True}) for p in PROMPTS]
        served = [f.result(300).outputs["tokens"] for f in futures]
        assert all(f.result(120).outputs for f in lstm)
        stats = engine.stats()["offloaded"]["llama"]
    with torch.inference_mode():
        direct = [row for start in range(0, len(PROMPTS), 4)
                  for row in llama.executor.generate_block(PROMPTS[start:start + 4], 4)[0]]
    same = sum(a == b[:4] for a, b in zip(served, direct))
    assert same >= 5, (same, served, direct)
    assert stats["num_blocks"] >= 2 and stats["num_finished"] >= len(PROMPTS)
