"""The offloading executor on a GPU (exec/offload.py): pinned host storage, loads and stores on
side streams closed by events. Offloading changes no numerics: with every placement, buffers
poisoned once the schedule is done with them, the tokens equal those of the same model resident
on the GPU, bf16 and fp32, every token. Not run yet (written on a machine without a GPU)."""
import itertools
import random

import pytest
import torch

from helpers import needs_gpu

from batchmaker.cells.decoder import build_decoder
from batchmaker.cells.decoder_config import PRESETS
from batchmaker.core.zigzag import Placement
from batchmaker.exec.offload import OffloadConfig, OffloadExecutor

pytestmark = [pytest.mark.gpu, needs_gpu]
CONFIG = PRESETS["small-llama"]


def prompts(count: int = 12) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, CONFIG.vocab_size) for _ in range(rng.randint(1, 40))] for _ in range(count)]


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def resident(request):
    executor = OffloadExecutor(build_decoder(CONFIG, seed=1, dtype=request.param), "cuda",
                               OffloadConfig(4, 3, Placement(False, False, False)))
    return request.param, executor.generate(prompts(), 12)


@pytest.mark.parametrize("placement", [Placement(*p) for p in itertools.product((True, False), repeat=3)][:-1],
                         ids=lambda p: f"w{int(p.weights)}c{int(p.cache)}h{int(p.hidden)}")
def test_offloaded_tokens_equal_the_resident_model_on_the_gpu(resident, placement):
    dtype, want = resident
    executor = OffloadExecutor(build_decoder(CONFIG, seed=1, dtype=dtype), "cuda",
                               OffloadConfig(4, 3, placement, check_buffers=True))
    assert executor.generate(prompts(), 12) == want
    torch.cuda.synchronize()
