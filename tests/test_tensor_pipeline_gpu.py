"""Tensor and pipeline parallelism together on four GPUs (cells/stage_shards.py): two stages of two
tensor-parallel shards, stage s on cuda:2s and cuda:2s+1, the shards' all-reduces inside the decode
CUDA graphs (NCCL, or the one-shot all-reduce), the residual stream from each shard to its peer in
the next stage by NCCL send/recv, the tokens back to rank 0 on a side stream. Against one GPU
serving the same checkpoint (4 query heads per kv head, 1 kv head: replicated on both shards of a
stage), under continuous batching with mixed prompt lengths and arrivals and a request cancelled
mid-stream; a rank that dies fails the requests instead of hanging.

The rule (tests/test_generation_gpu.py's, as tests/test_pipeline_parallel_gpu.py applies it to
one GPU's run): a greedy request passes if its first 32 tokens are one GPU's, or if at the first
difference one GPU's logit of our token is within NEAR_TIE times the spread (standard deviation)
of one GPU's logits of its best; at least 95% must pass, and the identical ones are printed.
Seeded requests are printed only (bf16: the shards' partial sums round otherwise).
"""
import multiprocessing
import random
from dataclasses import replace

import pytest
import torch

from batchmaker import Engine, EngineConfig
from batchmaker.errors import BatchMakerError
from batchmaker.registry import build_model
from test_pipeline_parallel_gpu import CANCELLED, NEW_TOKENS, near_tie_or_equal, release, serve, workload
from test_tensor_parallel_engine import kill_a_rank

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs four CUDA devices")]

GRID = dict(tensor_parallel=2, pipeline_parallel=2)


@pytest.fixture(scope="module")
def one_kv_head(tmp_path_factory):
    """tests/test_generation_gpu.py's Llama with one kv head, its head scaled so that logits spread
    over several units, saved as users have it."""
    transformers = pytest.importorskip("transformers")
    from test_generation_gpu import CONFIG
    from batchmaker.cells.decoder_config import to_hf
    torch.manual_seed(12)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**to_hf(replace(CONFIG, num_kv_heads=1))))
    with torch.no_grad():
        hf.lm_head.weight.mul_(30)
    path = tmp_path_factory.mktemp("llama-one-kv")
    hf.save_pretrained(path)
    return str(path)


def test_four_gpus_in_two_stages_of_two_shards_give_the_tokens_of_one(one_kv_head, no_tf32):
    requests = workload(random.Random(1))
    options = dict(checkpoint=one_kv_head, dtype="bfloat16", device="cuda:0", max_tokens=128, max_seqs=32,
                   num_blocks=512)
    model = build_model("llama", **options)
    one, _ = serve(model, requests, random.Random(2))
    four, most = serve(build_model("llama", **GRID, **options), requests, random.Random(3))
    assert not multiprocessing.active_children()
    assert most == 2  # (ORCA's pipeline: an iteration per stage)
    lm = model.cells["decoder"].lm
    greedy = [i for i, r in enumerate(requests) if "temperature" not in r and i != CANCELLED]
    results = [near_tie_or_equal(lm, requests[i]["tokens"], four[i], one[i]) for i in greedy]
    identical, passed = sum(r[0] for r in results), sum(r[1] for r in results)
    seeded = [i for i, r in enumerate(requests) if "temperature" in r]
    print(f"TP=2 x PP=2 bf16: greedy {identical}/{len(greedy)} identical, {passed}/{len(greedy)} identical or "
          f"near-tie; seeded {sum(four[i] == one[i] for i in seeded)}/{len(seeded)} identical")
    assert all(len(four[i]) == NEW_TOKENS for i in greedy + seeded)
    assert passed >= 0.95 * len(greedy)


def test_a_rank_of_the_last_stage_that_dies_on_a_gpu_fails_the_requests_and_nothing_is_left_behind():
    model = build_model("llama", seed=1, dtype="bfloat16", device="cuda:0", **GRID)
    engine = Engine([model], EngineConfig(devices=("cuda:0",))).start()
    try:
        kill_a_rank(engine, warm_timeout=60, settle=0.05, rank=3)  # (every in-flight request fails within 10 s)
        with pytest.raises(BatchMakerError, match="broken"):
            engine.submit("llama", {"tokens": [5, 6], "max_new_tokens": 2}).result(15)
    finally:
        engine.stop()
        release(engine)
    assert not multiprocessing.active_children()
