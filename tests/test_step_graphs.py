"""LSTMStepGraphs (kernels/step_graphs.py): k fused LSTM steps per launch, replayed from CUDA graphs.

    python3 -m pytest -q -m gpu tests/test_step_graphs.py            # on a CUDA device
    TRITON_INTERPRET=1 python -m pytest -q tests/test_step_graphs.py  # the eager path through Triton's CPU interpreter

Each case is a chain group stepping in ping-pong: lane b owns two h rows and two c rows, step j
reads one pair and writes the other, and at step 0 some lanes are fresh (read row 0). The graph
replay must equal the eager launches bit for bit, and `reference_lstm_step` applied step by step
(unpadded) within the tolerance; rows that are no step's output must stay as they were, except
the scratch row, which absorbs the padded lanes' writes.
"""
import pytest
import torch

from batchmaker.kernels.fused_lstm import LSTMWeights, reference_lstm_step
from batchmaker.kernels.step_graphs import LSTMStepGraphs
from test_kernels import interpreter, needs_gpu, no_tf32  # noqa: F401 (no_tf32: an autouse fixture)

VOCAB = 1000
TOLERANCE = {  # (rtol, atol) after up to 8 chained steps: a few ulps of the output dtype near 1
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),
    torch.float32: (1e-4, 1e-4),
}
BATCHES = (1, 3, 64, 200, 512)
NUM_STEPS = (1, 3, 8)

# cases ------------------------------------------------------------------------------------------

class Chain:
    """A chain group of `batch` lanes over a pool of 4B + 3 rows: row 0 zeros, rows 1..4B the
    lanes' ping-pong pairs, row 4B + 1 the scratch row (NaN), row 4B + 2 never touched."""

    def __init__(self, batch: int, hidden: int, dtype, device, g: torch.Generator):
        self.batch, self.g = batch, g
        self.scratch_row = 4 * batch + 1
        self.pool = (torch.randn(4 * batch + 3, hidden, generator=g) * 0.5).to(device, dtype)
        self.pool[0] = 0
        self.pool[self.scratch_row] = float("nan")
        rows = (torch.randperm(4 * batch, generator=g) + 1).view(4, batch)
        self.pairs = [(rows[0], rows[1]), (rows[2], rows[3])]  # (h, c) rows of set 0 and set 1
        self.fresh = torch.rand(batch, generator=g) < 0.3  # lanes with no state yet: read row 0
        self.pool[torch.cat(self.pairs[1])] = float("nan")  # step 0's outputs: unwritten shows as NaN
        self.num_steps = 0

    def index(self, num_steps: int) -> torch.Tensor:
        """The next `num_steps` steps: pinned int64 [num_steps, 5, batch]."""
        index = torch.empty(num_steps, 5, self.batch, dtype=torch.int64)
        for j in range(num_steps):
            step = self.num_steps + j
            (h, c), (h_out, c_out) = self.pairs[step % 2], self.pairs[(step + 1) % 2]
            if step == 0:
                h, c = h.masked_fill(self.fresh, 0), c.masked_fill(self.fresh, 0)
            index[j] = torch.stack([torch.randint(0, VOCAB, (self.batch,), generator=self.g), h, c, h_out, c_out])
        self.num_steps += num_steps
        return index.pin_memory() if torch.cuda.is_available() else index

    @property
    def output_rows(self) -> torch.Tensor:
        return torch.cat(self.pairs[1] + (self.pairs[0] if self.num_steps > 1 else ()))


def random_weights(hidden: int, dtype, g, device) -> LSTMWeights:
    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)
    return LSTMWeights(rand(VOCAB, hidden).to(dtype), rand(4 * hidden, hidden, scale=hidden ** -0.5).to(dtype),
                       rand(4 * hidden, hidden, scale=hidden ** -0.5).to(dtype), rand(4 * hidden, scale=0.1))


def reference_steps(weights: LSTMWeights, pool: torch.Tensor, index: torch.Tensor) -> None:
    for step in index.to(pool.device):
        reference_lstm_step(weights, *step, pool)


def check_pool(got: torch.Tensor, want: torch.Tensor, before: torch.Tensor, chain: Chain, dtype,
               padded: bool) -> None:
    """got (launch) against want (reference) and before (the pool at the start)."""
    rtol, atol = TOLERANCE[dtype]
    out = chain.output_rows.to(got.device)
    torch.testing.assert_close(got[out].float(), want[out].float(), rtol=rtol, atol=atol)  # NaN fails
    error = (got[out].float() - want[out].float()).norm() / want[out].float().norm()
    assert float(error) < rtol
    untouched = torch.ones(got.shape[0], dtype=torch.bool, device=got.device)
    untouched[out] = untouched[chain.scratch_row] = False
    assert torch.equal(got[untouched], before[untouched])  # row 0 and the spare row included
    scratch = got[chain.scratch_row]
    assert bool(scratch.isfinite().all()) if padded else bool(scratch.isnan().all())


# CPU --------------------------------------------------------------------------------------------

def test_buckets_and_bad_arguments():
    w = LSTMWeights(torch.zeros(10, 16), torch.zeros(64, 16), torch.zeros(64, 16), torch.zeros(64))
    steps = LSTMStepGraphs(w, buckets=(4, 1, 16), max_steps=2, use_graphs=False)
    assert [steps.bucket(b) for b in (1, 2, 4, 5, 16)] == [1, 4, 4, 16, 16] and steps.max_batch == 16
    pool = torch.zeros(8, 16)
    index = torch.zeros(2, 5, 3, dtype=torch.int64)
    for bad in (dict(num_steps=3, batch=3), dict(num_steps=2, batch=17), dict(num_steps=1, batch=3),
                dict(num_steps=2, batch=2), dict(num_steps=0, batch=3)):
        with pytest.raises(ValueError):
            steps.launch(pool, index, scratch_row=7, **bad)
    with pytest.raises(ValueError):
        steps.launch(pool, index.int(), 2, 3, 7)


@interpreter
@torch.inference_mode()
def test_eager_steps_with_padding_in_the_interpreter():
    g = torch.Generator().manual_seed(0)
    weights = random_weights(32, torch.float32, g, "cpu")
    steps = LSTMStepGraphs(weights, buckets=(4, 8), max_steps=3, use_graphs=False)
    for batch, num_steps in ((3, 3), (4, 2), (5, 1)):
        chain = Chain(batch, 32, torch.float32, "cpu", g)
        before = chain.pool.clone()
        index = chain.index(num_steps)
        got, want = chain.pool.clone(), chain.pool.clone()
        steps.launch(got, index, num_steps, batch, chain.scratch_row)
        reference_steps(weights, want, index)
        check_pool(got, want, before, chain, torch.float32, padded=batch != steps.bucket(batch))


# GPU --------------------------------------------------------------------------------------------

@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("hidden", [256, 1024])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@torch.inference_mode()
def test_graph_replay_equals_eager_and_reference(dtype, hidden):
    device = torch.device("cuda")
    g = torch.Generator().manual_seed(hidden)
    weights = random_weights(hidden, dtype, g, device)
    graphs, eager = LSTMStepGraphs(weights), LSTMStepGraphs(weights, use_graphs=False)
    for batch in BATCHES:
        for num_steps in NUM_STEPS:
            chain = Chain(batch, hidden, dtype, device, g)
            before = chain.pool.clone()
            index = chain.index(num_steps)
            got, by_eager, want = before.clone(), before.clone(), before.clone()
            captures = graphs.num_captures
            graphs.launch(got, index, num_steps, batch, chain.scratch_row)  # eager, then captured
            got.copy_(before)  # in place: the graph stays valid
            graphs.launch(got, index, num_steps, batch, chain.scratch_row)  # replayed
            assert graphs.num_captures == captures + 1
            eager.launch(by_eager, index, num_steps, batch, chain.scratch_row)
            reference_steps(weights, want, index)
            torch.cuda.synchronize()
            padded = batch != graphs.bucket(batch)
            check_pool(got, want, before, chain, dtype, padded)
            rows = torch.arange(got.shape[0], device=device) != chain.scratch_row
            assert torch.equal(got[rows], by_eager[rows]), (batch, num_steps)


@pytest.mark.gpu
@needs_gpu
@torch.inference_mode()
def test_consecutive_launches_chain_like_one_and_pool_growth_recaptures():
    device, dtype, hidden, batch = torch.device("cuda"), torch.float16, 256, 200
    g = torch.Generator().manual_seed(1)
    weights = random_weights(hidden, dtype, g, device)
    graphs = LSTMStepGraphs(weights)
    chain = Chain(batch, hidden, dtype, device, g)
    before = chain.pool.clone()
    got, want = before.clone(), before.clone()
    # 6 launches back to back, each from its own pinned buffer, more than the staging ring holds
    for num_steps in (3, 1, 1, 2, 1, 3):
        index = chain.index(num_steps)
        graphs.launch(got, index, num_steps, batch, chain.scratch_row, stream=torch.cuda.current_stream())
        reference_steps(weights, want, index)
    torch.cuda.synchronize()
    check_pool(got, want, before, chain, dtype, padded=True)
    assert graphs.num_captures == 3  # (256, 3), (256, 1), (256, 2)

    # the engine grows a pool by reallocating: graphs on the old one must be captured again
    old = got
    grown = torch.full((old.shape[0] + 64, hidden), float("nan"), dtype=dtype, device=device)
    grown[:old.shape[0]] = old
    old_snapshot = old.clone()
    before, want = grown.clone(), grown.clone()
    for num_steps in (3, 3):
        index = chain.index(num_steps)
        graphs.launch(grown, index, num_steps, batch, chain.scratch_row)
        reference_steps(weights, want, index)
    torch.cuda.synchronize()
    assert graphs.num_captures == 4  # (256, 3) once more, then replayed
    assert torch.equal(old, old_snapshot)  # nothing went to the old pool
    out = chain.output_rows.to(device)
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(grown[out].float(), want[out].float(), rtol=rtol, atol=atol)
    untouched = torch.ones(grown.shape[0], dtype=torch.bool, device=device)
    untouched[out] = untouched[chain.scratch_row] = False
    assert torch.equal(grown[untouched].isnan(), before[untouched].isnan())
    assert torch.equal(grown[untouched].nan_to_num(), before[untouched].nan_to_num())
