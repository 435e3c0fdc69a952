"""Greedy decoding's argmax kernel (kernels/greedy.py) against torch.argmax, its twin: random rows,
ties (the first index wins), rows of -inf, NaN of either sign (ranked highest, as torch ranks it),
+inf, a maximum in the last lane of the last block, vocabularies that are not a multiple of the
block, each twice (the kernel resets its per-row slots), in Triton's interpreter (blocks shrunk so
that rows take several programs) and on the GPU (the vocabularies of the families served, also
inside a CUDA graph).

    python -m pytest -q tests/test_greedy.py          # CPU (+ the interpreter, when triton is installed)
    python -m pytest -q -m gpu tests/test_greedy.py   # on a CUDA device
"""
import pytest
import torch

from batchmaker.kernels import greedy as greedy_module
from batchmaker.kernels.greedy import greedy, reference_greedy
from helpers import interpreter, needs_gpu, run_interpreted


def cases(device, vocabs):
    """(name, logits) pairs: float32 [rows, vocab] on `device`."""
    g = torch.Generator(device="cpu").manual_seed(0)
    for vocab in vocabs:
        x = torch.randn(5, vocab, generator=g)
        yield f"random {vocab}", x
        tied = x.clone()
        tied[:, vocab // 3] = tied[:, 2 * vocab // 3] = tied[:, -1] = 50.0  # (three equal maxima a row)
        yield f"ties {vocab}", tied
        edge = x.clone()
        edge[0] = float("-inf")  # (every logit -inf: index 0)
        edge[1, -1] = 1e30  # (the last lane of the last block)
        edge[2, vocab // 2] = float("nan")
        edge[2, 0] = float("inf")  # (NaN ranks above +inf)
        edge[3, vocab // 2] = -float("nan")
        edge[4] = -1e-30  # (all equal: index 0)
        yield f"edges {vocab}", edge
    yield "one row", torch.randn(1, vocabs[-1], generator=g)
    yield "a row stride of twice the vocabulary", torch.randn(4, 2 * vocabs[0], generator=g)[:, :vocabs[0]]


def check(device, vocabs):
    """Each case twice (the kernel must leave its per-row slots as it found them), then the slots themselves."""
    for name, logits in cases(device, vocabs):
        logits = logits.to(device)
        for _ in range(2):
            got, want = greedy(logits), reference_greedy(logits)
            assert got.dtype == torch.int64 and torch.equal(got, want), (name, got, want)
    for best, count in greedy_module._scratch.values():
        assert (best == torch.iinfo(torch.int64).min).all() and (count == 0).all()


def test_the_twin_off_triton_is_torch_argmax():
    x = torch.randn(3, 100)
    assert torch.equal(greedy(x), x.argmax(-1))
    assert torch.equal(greedy(x.double()), x.double().argmax(-1))  # (not float32: the twin)


@interpreter
def test_the_kernel_in_the_interpreter(monkeypatch):
    monkeypatch.setattr(greedy_module, "GREEDY_BLOCK", 64)  # (rows of several programs, the last one masked)
    check("cpu", (7, 64, 100, 1000))
    assert torch.equal(greedy(torch.empty(0, 10)), torch.empty(0, dtype=torch.int64))


def test_the_interpreter_in_a_subprocess():
    assert "1 passed" in run_interpreted(__file__, "test_the_kernel_in_the_interpreter", timeout=120)


@pytest.mark.gpu
@needs_gpu
def test_the_kernel_on_the_gpu():
    check("cuda", (32000, 32064, 128256, 152064, 256000))
    logits = torch.randn(8, 32000, device="cuda")
    out = greedy(logits)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = greedy(logits)
    logits.copy_(torch.randn(8, 32000, device="cuda"))
    graph.replay()
    assert torch.equal(out, logits.argmax(-1))
    other = torch.cuda.Stream()  # (another engine's stream: its own slots, so launches there may overlap)
    with torch.cuda.stream(other):
        assert torch.equal(greedy(logits), logits.argmax(-1))
    assert (logits.device, other.cuda_stream) in greedy_module._scratch
