"""Chain groups' rounds (batchmaker/core/chain_group.py) run symbolically on a fake worker: each
write tags its row with (request, cell, step, output); each read must find the tag its request's
previous step left there, or at a chain's first step row 0 or the final rows the previous stage
handed on. Lanes past their last step write only scratch rows and read row 0; a decode stops where
the worker's values say (values past a lane's last step are ignored); fetched rows are each
request's own last write; rows held by slots across occupants never clobber a live request's;
every row is back in its pool once the engine is idle."""
import random

import numpy as np
import pytest
import torch

from batchmaker import Engine, EngineConfig, SchedulerConfig, build_model
from batchmaker.exec.rounds import RoundRunner

BOS, EOS = 1, 2


def token_at(request_id: int, step: int, stop: int) -> int:
    """The fake decoder's output at a step: EOS at `stop`, else an ordinary id."""
    return EOS if step == stop else 3 + (7 * request_id + step) % 40


class SymbolicRounds:
    """RoundRunner.execute's stand-in: runs a round's index on tags, not tensors."""

    def __init__(self, tokens: dict, stops: dict, first_reads: dict):
        self.tokens, self.stops = tokens, stops  # request id -> its step values; -> its decode's EOS step
        self.first_reads = first_reads  # cell -> carried input -> None (row 0) or (previous cell, output)
        self.tags: dict[tuple, tuple] = {}  # (pool, row) -> (request id, cell, step, output)
        self.steps: dict[tuple, int] = {}  # (request id, cell) -> steps run
        self.num_padded = 0

    def execute(self, runner: RoundRunner, task) -> None:
        cell = runner.cells[id(task.cell_type)]
        layout, name, pools = cell.layout, task.cell_type.name, cell.pools
        k, _, b = task.index.shape
        ids = [o.request_id for o in task.owners]
        recorded = {out: np.full((k, b), EOS, dtype=np.int64) for out in task.record}  # (EOS where padded)
        for j in range(k):
            column = task.index[j]
            active = int(task.num_active[j])
            for lane in range(active, b):  # past their last step
                self.num_padded += 1
                for out, slot in layout.writes.items():
                    assert column[slot, lane] == pools[out].scratch_row
                assert not column[list(layout.reads.values()) + list(layout.values.values()), lane].any()
            writes = []
            for lane in range(active):
                rid = ids[lane]
                step = self.steps.get((rid, name), 0)
                for x, out in task.carry.items():
                    row = int(column[layout.reads[x], lane])
                    if step:
                        assert self.tags.get((id(pools[x]), row)) == (rid, name, step - 1, out), (name, x, rid, step)
                    elif self.first_reads[name][x] is None:
                        assert row == 0
                    else:
                        previous, handed = self.first_reads[name][x]
                        assert self.tags.get((id(pools[x]), row)) == (rid, previous, self.steps[(rid, previous)] - 1, handed)
                for x, slot in layout.values.items():  # the encoder's tokens; the decoder's start value
                    want = (BOS if step == 0 else 0) if name.endswith("decoder") else self.tokens[rid][step]
                    assert column[slot, lane] == want, (name, x, rid, step)
                for out, slot in layout.writes.items():
                    row = int(column[slot, lane])
                    if out in task.saved:
                        assert row not in (0, pools[out].scratch_row)
                        writes.append(((id(pools[out]), row), (rid, name, step, out)))
                    else:
                        assert row == pools[out].scratch_row
                for out in task.record:
                    recorded[out][j, lane] = token_at(rid, step, self.stops[rid])
                self.steps[(rid, name)] = step + 1
            assert len({key for key, _ in writes}) == len(writes)  # no two lanes write one row
            self.tags.update(writes)
        task.recorded = recorded
        task.fetched = {}
        for out, rows in task.fetch.items():  # each row: its request's last write (its id read back)
            tags = [self.tags[(id(pools[out]), int(r))] for r in rows]
            assert all(t[1] == name and t[2] == self.steps[(t[0], name)] - 1 and t[3] == out for t in tags)
            task.fetched[out] = torch.tensor([[float(t[0])] * 4 for t in tags])


@pytest.mark.parametrize("model_name", ["seq2seq", "lstm"])
@pytest.mark.parametrize("per_turn,steps,seed", [(3, 3, 0), (40, 4, 1), (200, 2, 2)])
def test_rounds_read_what_their_requests_wrote_and_give_every_row_back(monkeypatch, model_name, per_turn, steps, seed):
    rng = random.Random(seed)
    sources = [[rng.randrange(3, 100) for _ in range(rng.choice([1, 2, 5, rng.randint(1, 30)]))] for _ in range(300)]
    limits = [rng.randint(1, 12) for _ in sources]
    if model_name == "seq2seq":
        model = build_model("seq2seq", hidden=4, embed=4, vocab=100, max_len=12, max_batch_encoder=16, max_batch_decoder=8)
        inputs = [{"tokens": s, "max_len": m} for s, m in zip(sources, limits)]
        first_reads = {"seq2seq/encoder": {"h": None, "c": None},
                       "seq2seq/decoder": {"token": None, "h": ("seq2seq/encoder", "h"), "c": ("seq2seq/encoder", "c")}}
    else:
        model = build_model("lstm", hidden=4, embed=4, vocab=100, max_batch=16)
        inputs = [{"tokens": s} for s in sources]
        first_reads = {"lstm/lstm": {"h": None, "c": None}}
    engine = Engine([model], EngineConfig(devices=("cpu",), scheduler=SchedulerConfig(max_round_steps=steps)))
    tokens, stops = {}, {}
    fake = SymbolicRounds(tokens, stops, first_reads)
    monkeypatch.setattr(RoundRunner, "execute", lambda runner, task: fake.execute(runner, task))
    engine.start(thread=False)
    futures = []
    try:
        with torch.inference_mode():
            for a in range(0, len(inputs), per_turn):
                for inp in inputs[a:a + per_turn]:
                    f = engine.submit(model_name, inp)
                    tokens[f.request_id], stops[f.request_id] = inp["tokens"], rng.choice([0, 3, 20, 100])
                    futures.append(f)
                engine.step()
            for f in futures:
                while not f.done():
                    engine.step()
            for inp, f in zip(inputs, futures):
                out = f.result(0).outputs
                if model_name == "seq2seq":
                    limit, stop = inp["max_len"], stops[f.request_id]
                    assert out["tokens"] == [token_at(f.request_id, s, stop) for s in range(min(stop + 1, limit))]
                else:
                    assert out["h"][0].item() == f.request_id
            stats = engine.stats()
    finally:
        engine.stop()
    assert not any(stats["num_rows_used"])  # the groups emptied: their slots' rows went back
    assert fake.num_padded  # (the cases above do pad lanes)
