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
from dataclasses import replace

import pytest
import torch

from test_pipeline_parallel_gpu import assert_parallel_gives_one_gpus_tokens
from test_tensor_parallel_gpu import assert_a_dead_rank_fails_the_requests

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
    assert_parallel_gives_one_gpus_tokens(one_kv_head, "bfloat16", "TP=2 x PP=2 bf16", **GRID)


def test_a_rank_of_the_last_stage_that_dies_on_a_gpu_fails_the_requests_and_nothing_is_left_behind():
    assert_a_dead_rank_fails_the_requests(rank=3, **GRID)
