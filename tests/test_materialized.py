"""Materialized cells (batchmaker/materialized.py): a plain task as one CUDA graph per padded batch.

    python -m pytest -q tests/test_materialized.py          # CPU: the eager twin of the graph path
    python3 -m pytest -q -m gpu tests/test_materialized.py  # on a CUDA device: the graphs themselves

The twin runs the graph's body (gather from the padded index, cell on the padded batch, scatter)
without a graph; through the engine it must give exactly the plain eager worker's results. On the
GPU, engines with cuda_graphs=True and False must agree bit for bit. Padded lanes may write only
the pools' scratch rows; every other row that is not an output stays as it was (row 0: zeros).
"""
import dataclasses
import logging

import pytest
import torch

from batchmaker import Cell, Engine, EngineConfig, Signature, TensorSpec
from batchmaker.cells.seq2seq import DecoderCell
from batchmaker.cells.treelstm import TreeInternalCell, TreeLeafCell
from batchmaker.materialized import MaterializedCells, Slices
from batchmaker.model import CellType
from batchmaker.state import StateMemory
from test_gpu import build, idle_stats, requests_for
from test_kernels import needs_gpu, no_tf32  # noqa: F401 (no_tf32: an autouse fixture)

HIDDEN = 16
MODELS = ["treelstm", "seq2seq"]


def run_engine(name: str, device: str = "cpu", graphs: bool = True, twin: bool = False, unpadded: bool = False):
    """Outputs of all requests submitted at once, the idle stats, and the workers' MaterializedCells.
    twin: every worker runs plain tasks through MaterializedCells without graphs.
    unpadded: every batch size up to the largest is a bucket, so no task is padded."""
    model = build(name)
    if unpadded:
        model = dataclasses.replace(model, batch_sizes={c: tuple(range(1, max(sizes) + 1))
                                                        for c, sizes in model.batch_sizes.items()})
    with Engine([model], EngineConfig(devices=(device,), cuda_graphs=graphs)) as engine:
        if twin:
            for w in engine.workers:
                w.materialized = MaterializedCells(w.cells, w.memory, use_graphs=False)
        futures = [engine.submit(name, r) for r in requests_for(name)]
        outputs = [f.result(timeout=120).outputs for f in futures]
        stats = idle_stats(engine)
        return outputs, stats, [w.materialized for w in engine.workers]


def max_difference(name: str, got: list[dict], want: list[dict]) -> float:
    """Max |got - want| over the TreeLSTM's root h; Seq2Seq's tokens must be equal (then 0)."""
    assert len(got) == len(want)
    if name == "seq2seq":
        assert [g["tokens"] for g in got] == [w["tokens"] for w in want]
        return 0.0
    return max(float((g["h"].cpu().float() - w["h"].cpu().float()).abs().max()) for g, w in zip(got, want))


class Rows:
    """A padded task on one pool: n lanes of a (bucket)-wide index, inputs from random rows below
    20 (row 0 among them, never the scratch row), outputs to distinct rows from 20 on; the pools'
    other rows hold random values."""

    def __init__(self, cell_type: CellType, memory: StateMemory, n: int, bucket: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        sig = cell_type.cell.signature
        self.slices = s = Slices.of(sig)
        self.index = torch.zeros(s.num_slices, bucket, dtype=torch.int64)
        self.n, self.bucket, self.pools = n, bucket, {}
        for name, spec in {**sig.inputs, **sig.outputs}.items():
            pool = self.pools[name] = memory.pool(spec.shape, spec.dtype)
            pool.ensure_capacity()
            rest = pool.tensor[1:]
            rest.copy_(torch.randn(rest.shape, generator=g) if rest.is_floating_point()
                       else torch.randint(0, 10, rest.shape, generator=g))
        for name in sig.inputs:
            rows = torch.randint(0, 20, (n,), generator=g)
            self.index[s.reads[name], :n] = rows.masked_fill(rows == self.pools[name].scratch_row, 0)
        for name in s.values:  # a token: every other lane a host value (and row 0), the rest a row
            self.index[s.reads[name], :n:2] = 0
            self.index[s.values[name], :n:2] = torch.randint(0, 10, ((n + 1) // 2,), generator=g)
        out = torch.randperm(40, generator=g)[:len(sig.outputs) * n] + 20
        for k, name in enumerate(sig.outputs):
            self.index[s.writes[name], :n] = out[k * n:(k + 1) * n]
            self.index[s.writes[name], n:] = self.pools[name].scratch_row

    def expected(self, cell: Cell) -> dict[str, torch.Tensor]:
        """The cell run eagerly on the n real lanes alone."""
        s, n = self.slices, self.n
        batch = {}
        for name, spec in cell.signature.inputs.items():
            rows = self.index[s.reads[name], :n].to(self.pools[name].tensor.device)
            batch[name] = self.pools[name].tensor[rows]
            if name in s.values:
                batch[name] = batch[name] + self.index[s.values[name], :n].to(rows.device)
        return cell(**batch)

    def check(self, cell: Cell, before: dict[str, torch.Tensor], want: dict[str, torch.Tensor], exact: bool):
        s, n = self.slices, self.n
        written = {}
        for name in cell.signature.outputs:
            pool = self.pools[name].tensor
            rows = self.index[s.writes[name], :n].to(pool.device)
            scratch = torch.tensor([self.pools[name].scratch_row], device=pool.device)
            written.setdefault(id(pool), (pool, [scratch]))[1].append(rows)
            if exact:
                assert torch.equal(pool[rows], want[name]), name
            else:
                torch.testing.assert_close(pool[rows], want[name])
        for pool, rows in written.values():
            untouched = torch.ones(pool.shape[0], dtype=torch.bool, device=pool.device)
            untouched[torch.cat(rows)] = False
            assert torch.equal(pool[untouched], before[id(pool)][untouched])  # row 0 (zeros) included


def load(m: MaterializedCells, cell_type: CellType, bucket: int, index: torch.Tensor) -> None:
    """As the worker does: plan into `host_index`, then `load` it."""
    host = m.host_index(cell_type, bucket)
    host[:] = index.numpy()
    m.load(cell_type, bucket, host)


def small_cell_types(dtype=torch.float32) -> list[CellType]:
    return [CellType("t/leaf", TreeLeafCell(50, HIDDEN, HIDDEN, seed=1, dtype=dtype), 0, (1, 2, 4, 8)),
            CellType("t/internal", TreeInternalCell(HIDDEN, seed=2, dtype=dtype), 1, (1, 2, 4, 8)),
            CellType("s/decoder", DecoderCell(10, HIDDEN, HIDDEN, seed=3, dtype=dtype), 1, (4, 16))]


def launch_padded(cell_type: CellType, device: torch.device, use_graphs: bool, n: int, seed: int, replays: int = 1):
    """Run one padded task through MaterializedCells `replays` times; check it against the cell on
    the real lanes alone (exactly where nothing is padded) and that padding wrote only scratch rows.
    Returns the MaterializedCells and the pools' tensors but their scratch rows (a warm-up capture
    writes them even where this task pads no lane)."""
    cell = cell_type.cell.to(device).eval()
    memory = StateMemory(device)
    m = MaterializedCells({id(cell_type): cell}, memory, use_graphs=use_graphs)
    bucket = m.bucket(cell_type, n)
    rows = Rows(cell_type, memory, n, bucket, seed)
    before = {id(p.tensor): p.tensor.clone() for p in rows.pools.values()}
    with torch.inference_mode():
        want = rows.expected(cell)
        for _ in range(replays):
            load(m, cell_type, bucket, rows.index)
            m.run(cell_type, bucket)
    rows.check(cell, before, want, exact=n == bucket and device.type == "cpu")
    pools = [p for p in rows.pools.values()]
    return m, [p.tensor[torch.arange(len(p.tensor), device=device) != p.scratch_row] for p in pools]


# CPU ---------------------------------------------------------------------------------------------

def test_slices_and_buckets():
    decoder = small_cell_types()[2]
    s = Slices.of(decoder.cell.signature)
    assert (s.reads, s.values, s.writes, s.staged, s.fetch, s.num_slices) == (
        {"token": 0, "h": 1, "c": 2}, {"token": 3}, {"token": 4, "h": 5, "c": 6}, {"h": 7, "c": 8},
        {"token": 9, "h": 10, "c": 11}, 12)
    m = MaterializedCells({}, StateMemory(torch.device("cpu")), use_graphs=False)
    assert [m.bucket(decoder, b) for b in (1, 4, 5, 16, 17)] == [4, 4, 16, 16, 0]  # 0: too big, eager


@pytest.mark.parametrize("n", [1, 3, 4, 8])
@pytest.mark.parametrize("which", [0, 1, 2], ids=["leaf", "internal", "decoder"])
def test_padded_lanes_write_only_scratch_rows_on_cpu(which, n):
    cell_type = small_cell_types()[which]
    if n > cell_type.max_batch:
        pytest.skip("bigger than the largest bucket")
    launch_padded(cell_type, torch.device("cpu"), use_graphs=False, n=n, seed=n)


@pytest.mark.parametrize("name", MODELS)
def test_eager_twin_equals_the_eager_worker(name):
    """Unpadded, the twin launches what the eager worker launches: the same bits."""
    want, _, _ = run_engine(name, unpadded=True)
    got, stats, _ = run_engine(name, twin=True, unpadded=True)
    assert max_difference(name, got, want) == 0.0
    assert stats["num_live_nodes"] == 0 and stats["num_rows_used"] == [0]


@pytest.mark.parametrize("name", MODELS)
def test_padded_eager_twin_is_close_to_the_eager_worker(name):
    """Padded, a matmul over more rows may round the real rows' sums differently (CPU: ~1e-9)."""
    want, _, _ = run_engine(name)
    got, stats, _ = run_engine(name, twin=True)
    assert max_difference(name, got, want) <= 1e-6
    assert stats["num_live_nodes"] == 0 and stats["num_rows_used"] == [0]  # no row kept for padding


# GPU ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "switched-off"])
def test_cuda_engine_graphs_equal_eager(name, graphs):
    want, _stats, _m = run_engine(name, "cuda:0", graphs=False)
    got, stats, (m,) = run_engine(name, "cuda:0", graphs=graphs)
    assert max_difference(name, got, want) == 0.0
    assert stats["num_live_nodes"] == 0 and stats["num_rows_used"] == [0]
    if graphs:
        assert m.num_captures > 0 and m.num_replays > 10
    else:
        assert m is None  # the switch: no graphs, every plain task launched eagerly


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n", [1, 3, 8])
@pytest.mark.parametrize("which", [0, 1, 2], ids=["leaf", "internal", "decoder"])
def test_padded_lanes_write_only_scratch_rows_in_graphs(which, n, dtype):
    device = torch.device("cuda:0")
    cell_type = small_cell_types(dtype)[which]
    m, got = launch_padded(cell_type, device, use_graphs=True, n=n, seed=n, replays=3)  # captured, replayed
    _, want = launch_padded(cell_type, device, use_graphs=False, n=n, seed=n)
    assert m.num_replays == 3 and m.num_captures == len(cell_type.batch_sizes)
    assert all(torch.equal(g, w) for g, w in zip(got, want))  # the same kernels on the same rows


@pytest.mark.gpu
@needs_gpu
@torch.inference_mode()
def test_a_pool_that_grows_is_captured_again():
    device = torch.device("cuda:0")
    cell_type = small_cell_types()[1]
    cell = cell_type.cell.to(device).eval()
    memory = StateMemory(device)
    m = MaterializedCells({id(cell_type): cell}, memory)
    rows = Rows(cell_type, memory, 3, 4, seed=0)
    load(m, cell_type, 4, rows.index)
    m.run(cell_type, 4)
    captures = m.num_captures
    pool = rows.pools["h"]
    old = pool.tensor
    while pool.capacity == old.shape[0]:
        pool.alloc()
    pool.ensure_capacity()  # reallocated: the graphs' baked-in pointer is stale
    old_snapshot = old.clone()
    before = {id(pool.tensor): pool.tensor.clone()}
    want = rows.expected(cell)
    load(m, cell_type, 4, rows.index)
    m.run(cell_type, 4)  # eager, then captured on the new tensor
    load(m, cell_type, 4, rows.index)
    m.run(cell_type, 4)  # replayed on the new tensor
    torch.cuda.synchronize()
    assert m.num_captures == captures + 1
    assert torch.equal(old, old_snapshot)  # nothing went to the old tensor
    rows.check(cell, before, want, exact=False)


class SyncingCell(Cell):
    """Reads a value on the host in forward: cannot be captured in a CUDA graph."""

    def __init__(self):
        super().__init__()
        self.signature = Signature({"h": TensorSpec((4,))}, {"h": TensorSpec((4,))})

    def forward(self, h):
        return {"h": h + float(h.sum().item() * 0 + 1)}


@pytest.mark.gpu
@needs_gpu
@torch.inference_mode()
def test_a_cell_that_cannot_be_captured_runs_eagerly_with_one_warning(caplog):
    device = torch.device("cuda:0")
    cell_type, graphable = CellType("s/sync", SyncingCell(), 0, (2, 4)), small_cell_types()[1]
    memory = StateMemory(device)
    cells = {id(cell_type): cell_type.cell.to(device), id(graphable): graphable.cell.to(device).eval()}
    m = MaterializedCells(cells, memory)
    with caplog.at_level(logging.WARNING, logger="batchmaker"):
        for n in (3, 2, 3):
            rows = Rows(cell_type, memory, n, 4 if n == 3 else 2, seed=n)
            before = {id(p.tensor): p.tensor.clone() for p in rows.pools.values()}
            want = rows.expected(cell_type.cell)
            load(m, cell_type, rows.bucket, rows.index)
            m.run(cell_type, rows.bucket)
            torch.cuda.synchronize()
            rows.check(cell_type.cell, before, want, exact=True)
    assert len([r for r in caplog.records if "s/sync" in r.getMessage()]) == 1
    assert m.bucket(cell_type, 3) == 0  # planned as plain eager tasks from now on
    launch_padded(graphable, device, use_graphs=True, n=3, seed=0)  # graphs still work afterwards
