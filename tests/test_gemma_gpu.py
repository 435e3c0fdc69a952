"""Gemma 2 served on a GPU (issue 33): the Triton attention kernels' sliding windows and soft caps
inside the engine (prompt chunks, mixed batches, CUDA-graph decodes) against transformers' own
run of the same checkpoint in bf16, one request at a time, up to tests/test_generation_gpu.py's
near-tie rule. A tiny Gemma 2 whose window (16 positions) is shorter than most prompts and whose
score cap (0.5) binds: without either, transformers' greedy tokens differ for every prompt of a
sample like these (fp32, CPU)."""
import pytest
import torch

from helpers import needs_gpu
from test_gemma import FAMILIES, TINY

transformers = pytest.importorskip("transformers")

from test_generation_gpu import assert_bf16_near_ties  # noqa: E402

pytestmark = [pytest.mark.gpu, needs_gpu]
GEMMA2 = {**TINY, **FAMILIES["gemma2"][2], "final_logit_softcapping": 30.0, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(11)
    hf = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**GEMMA2, attn_implementation="eager"))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in hf.parameters():  # (norms too: Gemma's start at zero)
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
        hf.lm_head.weight.mul_(30)  # logits spread over several units (std ~13): ties become rare
    path = tmp_path_factory.mktemp("gemma2")
    hf.save_pretrained(path)
    return str(path), hf


def test_bf16_greedy_matches_hf_up_to_near_ties(checkpoint, no_tf32):
    path, hf = checkpoint
    assert_bf16_near_ties(path, hf, (4, 512), 200, "gemma2 bf16")
