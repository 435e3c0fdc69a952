"""Greedy decoding's choice, the first index of each row's largest logit, as one launch on CUDA
(kernels/triton_greedy.py); `reference_greedy` (torch.argmax) elsewhere and as its twin.

    tokens = greedy(logits)     # float32 [rows, vocab] -> int64 [rows]

Why: torch.argmax over one row of 32,000 took 10 µs of a batch-1 step on an H200, the step's
longest kernel outside its layers (bench/one_token_ab.py --trace, twenty-eighth session); this
kernel takes 3.5 µs there, and 3.7 against torch's 8.3 for a row of 256,000 (bench/greedy_ab.py,
H200, twenty-ninth session; faster at every size measured, 1-256 rows). It
spreads each row over programs of GREEDY_BLOCK logits, which meet in a per-row slot of a scratch
buffer kept per device and stream (`_scratch`: the kernel leaves it as it found it), and launches
with PDL behind the LM head. Launches on one stream run one after another (each waits for the kernel
before it, which under PDL waited for the one before that), so only launches on other streams,
another engine's, could meet in a slot: they get their own.
"""
import torch
from torch import Tensor

from batchmaker.kernels.cell_launch import is_interpreting, load_kernels, pdl_options
from batchmaker.kernels.fused_decoder import HAS_TRITON, _next_power_of_2

GREEDY_BLOCK = 4096  # logits a program reads (a 32,000 vocabulary in 8 programs)
GREEDY_WARPS = 4
_scratch: dict[tuple, tuple[Tensor, Tensor]] = {}  # (device, stream) -> (best int64, count int32), a slot a row
_outgrown: list[tuple[Tensor, Tensor]] = []  # smaller ones, kept: CUDA graphs captured with them still use them


def reference_greedy(logits: Tensor) -> Tensor:
    return logits.argmax(-1)


def greedy(logits: Tensor) -> Tensor:
    """int64 [rows]: each row's first index of its largest logit (NaN ranks highest), as `reference_greedy`;
    the kernel where Triton runs on these logits (float32, CUDA or the interpreter), else the twin."""
    if not (HAS_TRITON and (logits.is_cuda or is_interpreting())) or logits.dtype != torch.float32 \
            or logits.dim() != 2 or logits.shape[1] == 0:
        return reference_greedy(logits)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        block = min(GREEDY_BLOCK, _next_power_of_2(vocab))
        chunks = -(-vocab // block)
        best, count = scratch(logits.device, rows)
        load_kernels("triton_greedy", "the greedy kernel", "reference_greedy").greedy_kernel[(rows, chunks)](
            logits, out, best, count, vocab, logits.stride(0), chunks, BLOCK=block, num_warps=GREEDY_WARPS,
            **pdl_options(logits, True))
    return out


def scratch(device: torch.device, rows: int) -> tuple[Tensor, Tensor]:
    """The current stream's per-row slots on `device` for at least `rows` rows (grown to the next power of two,
    at least 256: new ones are set to what the kernel leaves, so a capture that grows them replays that setting
    too)."""
    key = (device, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    best, count = _scratch.get(key, (None, None))
    if best is None or best.shape[0] < rows:
        if best is not None:
            _outgrown.append((best, count))
        size = max(256, _next_power_of_2(rows))
        best = torch.full((size,), torch.iinfo(torch.int64).min, dtype=torch.int64, device=device)
        count = torch.zeros(size, dtype=torch.int32, device=device)
        _scratch[key] = best, count
    return best, count
