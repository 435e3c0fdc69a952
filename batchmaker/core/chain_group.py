"""ChainGroup: the running requests of one stage on one worker, as slots of aligned arrays: their
positions, lengths, step values and state rows (the queue and the stages: core/chains.py).

A round of k <= MaxTasksToSubmit steps is formed at once with numpy over those arrays: waiting
requests join at its start, chains that end inside it drop out of its later steps, and its index
says, per step and lane, which rows to read and write (every kept output has two rows per request,
written on even and odd steps, so that a step never writes what it reads).

A chain's end is known when its round is formed: its final rows are handed to the next stage (on
the same worker) or fetched to the host in the same launch, so the next stage may start in the
very next round. A decode loop's end (its `stop` value) is learned when a round completes, from
the values it recorded: one numpy pass over [k, batch]. Rounds formed meanwhile carry the lane
along and their results for it are dropped (a slot's serial tells a new occupant from an old one).

A slot's R rows outlive its occupant: the next one to join reuses them (launches run in the order
they were formed, so its writes come after every write of the one before), and they go back to
their pools when the group empties. Joins and ends thus allocate and free rows only for the rows a
chain hands on to the next stage.
"""
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from batchmaker.core.decode_values import CollectedRows, DecodeLanes, first_stops
from batchmaker.core.rows import RowAllocator
from batchmaker.core.task import RoundTask
from batchmaker.core.waiting import Chunk, Waiting
from batchmaker.errors import CellError

if TYPE_CHECKING:
    from batchmaker.core.chains import Finisher, Stage


class ChainGroup:
    """The running requests of one stage on one worker, in slots [0, max_batch). Manager thread only.

    Rows: R[parity, o, slot] is the row the slot's occupant writes output kept[o] to at steps of
    that parity (2 rows per kept output; the slot keeps them for its next occupant while `holds`);
    I[c, slot] the row carried input c reads at its chain's first step (0: zeros).
    """

    def __init__(self, stage: "Stage", worker_id: int, pools: dict[str, RowAllocator]):
        self.stage = stage
        self.worker_id = worker_id
        self.pools = pools  # output -> its pool's rows (a carried input reads its output's pool)
        cap = stage.cell_type.max_batch
        layout, kept = stage.cell_type.layout, stage.kept
        self.serial = np.zeros(cap, dtype=np.int64)  # 0: a free slot
        self.owner = np.empty(cap, dtype=object)
        self.pos = np.zeros(cap, dtype=np.int64)  # steps formed so far
        self.length = np.zeros(cap, dtype=np.int64)  # chain: its steps; decode: at most this many
        self.lengths = np.zeros((cap, 1), dtype=np.int64)  # every stage's length (handed on)
        self.priority = np.zeros(cap, dtype=np.int64)
        self.first_cell = np.zeros(cap)
        self.streams = np.zeros(cap, dtype=bool)
        self.R = np.zeros((2, len(kept), cap), dtype=np.int64)
        self.holds = np.zeros(cap, dtype=bool)  # the slot holds its R rows (kept across occupants until the group empties)
        self.I = np.zeros((len(stage.carry), cap), dtype=np.int64)
        self.base = np.zeros(cap, dtype=np.int64)  # chain: where its step values start in `values`
        self.values = np.zeros((len(stage.step_inputs), 4096), dtype=np.int64)  # [input, :num_values] in use
        self.num_values = 0
        self.collected = CollectedRows(tuple(stage.collect.values()), cap) if stage.is_decode else None
        self.num_stepping = 0  # requests with steps left (kept in step: the scheduler reads it often)
        self._free_slots = np.arange(cap - 1, -1, -1, dtype=np.int64)  # a stack: [:num_free], the top at the end
        self._num_free = cap
        self._next_serial = 1
        self._record = tuple(stage.collect.values())
        self._saved = None  # stage.kept, once the next stage is linked (at the first round: see _link)
        self._step_ix = np.arange(64)[:, None]  # [j, 1]: a round's step numbers (grown for longer rounds)
        self._below: dict[tuple, np.ndarray] = {}  # (k, dtype) -> _short_below
        # where things go in a task's index, and each kept output's pool
        # (slices where the positions are consecutive, as they usually are: views, not fancy indexing)
        self._write_slots = _positions([layout.writes[o] for o in kept])
        self._read_slots = _positions([layout.reads[x] for x in stage.carry])
        self._carried = _positions([kept.index(o) for o in stage.carry.values()])
        self._value_slots = [layout.values[x] for x in stage.step_inputs]
        # slices no other write of _index fills: non-carried reads, values that are neither step
        # inputs nor start values
        self._zero_slices = [i for x, i in layout.reads.items() if x not in stage.carry] + \
                            [i for x, i in layout.values.items() if x not in stage.step_inputs and x not in stage.start]
        self._start_slots = [(layout.values[x], value) for x, value in stage.start.items()]
        self._row_at = np.arange(len(kept)) * cap  # where R[0, o, :] starts in the flat R
        self._pad = np.zeros((layout.num_slices, 1), dtype=np.int64)  # a lane past its last step: reads 0, writes scratch
        for o in [*kept, *(o for o in layout.writes if o not in kept)]:  # (the pools' scratch rows taken in this order)
            self._pad[layout.writes[o]] = pools[o].scratch_row
        self._other_writes = [(layout.writes[o], pools[o].scratch_row) for o in layout.writes if o not in kept]
        by_pool: dict[int, list] = {}
        for o, out in enumerate(kept):
            by_pool.setdefault(id(pools[out]), [pools[out], []])[1].append(o)
        # R[:, ix, slots]: a pool's outputs as a slice where consecutive (one fancy index), else a column
        self._pool_groups = [(pool, _axis_index(ix)) for pool, ix in by_pool.values()]
        self._kept_groups = [(pool, ix) for pool, ix in by_pool.values()]
        self._kept_names = kept
        by_pool = {}  # rows (I) of carried inputs that start from the previous stage, by the pool of the output they read
        for c, (name, out) in enumerate(stage.carry.items()):
            if name in stage.init:
                by_pool.setdefault(id(pools[out]), [pools[out], []])[1].append(c)
        self._init_groups = [(pool, _positions(ix)) for pool, ix in by_pool.values()]
        self._init_rows = [(c, "init:" + name) for c, name in enumerate(stage.carry) if name in stage.init]

    @property
    def num_live(self) -> int:
        return len(self.serial) - self._num_free

    # forming a round ------------------------------------------------------------------------
    def form(self, queues: tuple[Waiting, ...], max_steps: int) -> RoundTask | None:
        for queue in queues:
            if self._num_free and len(queue):
                chunk = queue.take(self._num_free)
                if chunk is not None and len(chunk):
                    self._join(chunk, max_steps)
        if not self.num_stepping:
            return None
        stage = self.stage
        left = self.length - self.pos  # [cap]: steps left (0: a free slot, or a decode waiting for its round)
        k = int(min(max_steps, left.max()))
        short = (k - np.minimum(left, k)).astype(np.int8 if k < 128 else np.int64)  # steps short of k (int8: a radix sort)
        lanes = np.argsort(short, kind="stable")[:self.num_stepping]  # lanes stepping at step j are a prefix
        short = short[lanes]
        num_active = np.searchsorted(short, self._short_below(k, short.dtype), side="right")  # lanes stepping at step j
        steps = k - short.astype(np.int64)
        pos0 = self.pos[lanes]
        first = pos0 == 0  # lanes at their chain's first step
        task = RoundTask(self, stage.cell_type, self.worker_id, len(lanes), index=self._index(lanes, pos0, first, num_active, k),
                         num_active=num_active, last=steps - 1,
                         carry=stage.carry, saved=self._saved or self._link(), record=self._record,
                         owners=self.owner[lanes])
        if stage.init:  # rows handed over by the previous stage: read at this round's first step
            self._free_init(lanes[first])
        if stage.is_decode:
            task.info = DecodeLanes(lanes, self.serial[lanes], pos0, steps)
        end = pos0 + steps
        self.pos[lanes] = end
        ending = np.flatnonzero(end >= self.length[lanes])
        self.num_stepping -= len(ending)
        if len(ending) and not stage.is_decode:
            self._end_chains(task, lanes[ending], self.R[:, :, lanes[ending]], (end[ending] - 1) & 1)
        return task

    def _short_below(self, k: int, dtype) -> np.ndarray:
        """[k]: k - 1 - j for step j (a lane steps at step j if its steps short of k are at most that)."""
        below = self._below.get((k, dtype))
        if below is None:
            below = self._below[(k, dtype)] = np.arange(k - 1, -1, -1).astype(dtype)
        return below

    def _link(self) -> tuple[str, ...]:
        """What depends on the next stage (linked after this group was made): the outputs a round
        saves, and per pool the kept outputs whose final rows a chain's end hands on."""
        stage, kept = self.stage, self._kept_names
        handed = set(stage.next.stage.init.values()) if stage.next is not None else set()
        self._end_groups = [(pool, np.array([o for o in ix if kept[o] in handed], dtype=np.int64)[:, None])
                            for pool, ix in self._kept_groups]
        self._saved = stage.kept
        return self._saved

    def _index(self, lanes: np.ndarray, pos0: np.ndarray, first: np.ndarray, num_active: np.ndarray, k: int) -> np.ndarray:
        """[k, num_slices, B]. A lane's parity alternates, so its writes alternate between two rows
        (`at_even`, `at_odd` steps of the round) and its reads are the previous step's writes:
        a few slice copies, not a pass per step. Lanes past their last step (a suffix: lanes are sorted
        by their steps) are fixed up after, a slice per step."""
        stage, layout = self.stage, self.stage.cell_type.layout
        b = len(lanes)
        if k > len(self._step_ix):
            self._step_ix = np.arange(k)[:, None]
        index = np.empty((k, layout.num_slices, b), dtype=np.int64)  # every slice is written below
        for slot in self._zero_slices:
            index[:, slot] = 0
        # R[pos0 & 1] and R[1 - (pos0 & 1)] at the lanes, as flat takes (a fancy index over the
        # last axis of R is several times slower)
        rows = self._row_at[:, None] + lanes[None, :]  # [O, B]: R[0, o, lane] in the flat R
        parity = (pos0 & 1) * self.R[0].size
        at_even = self.R.reshape(-1).take(rows + parity)  # [O, B]: written at steps 0, 2, ...
        at_odd = self.R.reshape(-1).take(rows + (self.R[0].size - parity))  # and at steps 1, 3, ...
        index[0::2, self._write_slots] = at_even
        index[1::2, self._write_slots] = at_odd
        for slot, scratch in self._other_writes:
            index[:, slot] = scratch
        if stage.carry:  # a step reads the rows the step before wrote; a chain's first step its I rows
            carried = self._carried
            index[0, self._read_slots] = np.where(first, self.I.take(lanes, axis=1), at_odd[carried])
            index[1::2, self._read_slots] = at_even[carried]
            index[2::2, self._read_slots] = at_odd[carried]
        if stage.step_inputs:  # host values per step (tokens)
            at = (self.base[lanes] + pos0) + self._step_ix[:k]  # [k, B]; past a chain's end: clipped, padded below
            for values, slot in zip(self.values[:, :self.num_values], self._value_slots):
                values.take(at, mode="clip", out=index[:, slot])
        for slot, value in self._start_slots:  # decode: the first step's token, 0 after
            np.multiply(first, value, out=index[0, slot])
            index[1:, slot] = 0
        pad = self._pad
        for j, a in enumerate(num_active.tolist()):  # lanes past their last step: a suffix at step j
            if a < b:
                index[j, :, a:] = pad
        return index

    def _join(self, chunk: Chunk, max_steps: int) -> None:
        n, stage = len(chunk), self.stage
        if stage.step_inputs:
            self._append_values(chunk)
        self._num_free -= n
        slots = self._free_slots[self._num_free:self._num_free + n][::-1].copy()
        self.serial[slots] = np.arange(self._next_serial, self._next_serial + n)
        self._next_serial += n
        self.owner[slots] = chunk.owners
        self.pos[slots] = 0
        lengths = chunk.columns["lengths"]
        length = lengths[:, stage.position]
        self.length[slots] = length
        self.num_stepping += n
        if stage.next is not None:  # (what only the next stage needs)
            if self.lengths.shape[1] != lengths.shape[1]:
                self.lengths = np.zeros((len(self.serial), lengths.shape[1]), dtype=np.int64)
            self.lengths[slots] = lengths
            self.priority[slots] = chunk.columns["priority"]
        first = chunk.columns["first_cell"]
        self.first_cell[slots] = np.fmin(first, time.perf_counter())  # (NaN: not started; fmin takes the number)
        self.streams[slots] = chunk.columns["streams"]
        new = slots[~self.holds[slots]]  # (the others' rows served the slot's previous occupant)
        if len(new):
            for pool, ix in self._pool_groups:
                self.R[:, ix, new] = pool.alloc_many(2 * _num(ix) * len(new)).reshape(2, -1, len(new))
            self.holds[new] = True
        for c, column in self._init_rows:  # (other carried inputs' I rows stay 0)
            self.I[c, slots] = chunk.columns[column]
        if stage.step_inputs:
            self.base[slots] = self._next_base
        if self.collected is not None:  # (room for a round past the longest: see CollectedRows)
            self.collected.make_room(int(length.max()) + max_steps)

    def _append_values(self, chunk: Chunk) -> None:
        """The joining chains' step values after those of the others (the live chains). Once the
        buffer is full, the others' values still to run are moved to its front (into a buffer four
        times what is kept, so that a move comes once per several joins); `_next_base`: where each
        new one starts."""
        values = chunk.values.reshape(len(chunk.values), -1).T  # [inputs, n]
        n = values.shape[1]
        if self.num_values + n > self.values.shape[1]:
            others = np.flatnonzero(self.serial > 0)
            left = np.maximum(self.length[others] - self.pos[others], 0)
            used = int(left.sum())
            starts = np.cumsum(left) - left
            kept = self.values[:, np.repeat(self.base[others] + self.pos[others] - starts, left) + np.arange(used)]
            size = max(self.values.shape[1], 4 * (used + n))
            if size > self.values.shape[1]:
                self.values = np.empty((len(values), size), dtype=np.int64)
            self.values[:, :used] = kept
            self.base[others] = starts - self.pos[others]  # (base + pos: the next step's value)
            self.num_values = used
        self._next_base = self.num_values + chunk.bounds[:-1] - chunk.bounds[0]
        self.values[:, self.num_values:self.num_values + n] = values
        self.num_values += n

    def _end_chains(self, task: RoundTask, slots: np.ndarray, rows: np.ndarray, final_parity: np.ndarray) -> None:
        """Chains whose last step is in this round: their final rows go to the next stage (their
        slots get new ones in their place) or to the host (read by this launch; the slots keep them)."""
        stage, kept = self.stage, self._kept_names
        final = np.where(final_parity, rows[1], rows[0])  # [O, E]
        if stage.next is not None:
            priority = self.priority[slots]
            columns = {"lengths": self.lengths[slots], "priority": priority,
                       "first_cell": self.first_cell[slots], "streams": self.streams[slots]}
            for name, out in stage.next.stage.init.items():
                columns["init:" + name] = final[kept.index(out)]
            stage.next.add(priority, Chunk.of(self.owner[slots], columns), self.worker_id)
            task.info = _HANDED_ON
        else:
            task.fetch = {out: final[kept.index(out)] for out in stage.outputs.values()}
            task.info = _Ending(self.owner[slots], self.first_cell[slots])
        for pool, handed in self._end_groups:
            if len(handed):
                self.R[final_parity[None, :], handed, slots[None, :]] = pool.alloc_many(len(handed) * len(slots)).reshape(
                    len(handed), len(slots))
        self._release(slots)

    # completion -----------------------------------------------------------------------------
    def complete(self, task: RoundTask) -> None:
        if task.error is not None:  # every request of the round fails (wherever it went since)
            error = CellError(f"cell {self.stage.cell_type.name} failed: {task.error!r}")
            self.stage_finisher.fail([o for o in task.owners if not o._done], error)
            self.purge()  # (the next stage purges those handed on: the engine's cancel epoch moves)
        elif self.stage.is_decode:
            self._complete_decode(task, task.info)
        elif isinstance(task.info, _Ending) and not task.info.handed_on:
            outputs = {key: task.fetched[out] for key, out in self.stage.outputs.items()}
            self.stage_finisher.resolve(task.info.owners, outputs, task.info.first_cell)

    @property
    def stage_finisher(self) -> "Finisher":
        stage = self.stage
        while stage.next is not None:  # a failure anywhere is reported by the last stage's finisher
            stage = stage.next.stage
        return stage.finisher

    def _complete_decode(self, task: RoundTask, lanes: DecodeLanes) -> None:
        stage, collected = self.stage, self.collected
        current = self.serial[lanes.slots] == lanes.serials  # not dropped or refilled since
        out, value = stage.stop
        stopped, produced = first_stops(task.recorded[out], value, lanes.steps)
        collected.write(task.recorded, lanes, current, produced)
        ends = lanes.pos0 + produced
        if self.streams.any():  # (streams of freed slots are cleared) once per round
            for i in np.flatnonzero(current & self.streams[lanes.slots]).tolist():
                slot, a, b = int(lanes.slots[i]), int(lanes.pos0[i]), int(ends[i])
                stage.finisher.stream(self.owner[slot], {key: collected.values(o, slot, a, b) for key, o in stage.collect.items()})
        done = current & (stopped | (ends >= self.length[lanes.slots]))
        if done.any():
            slots, ends = lanes.slots[done], ends[done]
            outputs = {key: collected.ragged(o, slots, ends) for key, o in stage.collect.items()}
            stage.finisher.resolve(self.owner[slots], outputs, self.first_cell[slots])
            self._drop(slots)

    # dropping -------------------------------------------------------------------------------
    def purge(self) -> None:
        """Drop running requests whose future is done (cancelled, expired or failed)."""
        live = np.flatnonzero(self.serial > 0)
        if len(live):
            done = np.fromiter((o._done for o in self.owner[live]), dtype=bool, count=len(live))
            if done.any():
                self._drop(live[done])

    def free_init(self, chunk: Chunk) -> None:
        """Rows that dropped waiting requests held from the previous stage."""
        for name, out in self.stage.carry.items():
            rows = chunk.columns.get("init:" + name)
            if rows is not None:
                self.pools[out].free_many(rows[rows != 0])

    def _drop(self, slots: np.ndarray) -> None:
        """Free the slots and the I rows they hold (their R rows stay for the next occupants)."""
        if self._init_groups:  # (a lane frees its I rows at its first round: only those not started hold any)
            self._free_init(slots[self.pos[slots] == 0])
        self.num_stepping -= int(np.count_nonzero(self.pos[slots] < self.length[slots]))
        self._release(slots)

    def _free_init(self, slots: np.ndarray) -> None:
        if not len(slots):
            return
        rows = self.I[:, slots]  # [C, n] (left as they are: a slot's I is read only at its first step)
        for pool, ix in self._init_groups:
            pool.free_many(rows[ix].ravel())

    def _release(self, slots: np.ndarray) -> None:
        self.serial[slots] = 0
        self.owner[slots] = None
        self.length[slots] = 0
        self.pos[slots] = 0
        self.streams[slots] = False
        self._free_slots[self._num_free:self._num_free + len(slots)] = slots
        self._num_free += len(slots)
        if self._num_free == len(self.serial):  # the group is empty: every R row goes back to its pool
            held = np.flatnonzero(self.holds)
            for pool, ix in self._pool_groups:
                pool.free_many(self.R[:, ix, held].ravel())
            self.holds[held] = False


def _axis_index(positions: list[int]) -> slice | np.ndarray:
    """Positions on an axis before the last one: a slice if consecutive, else a column [n, 1]
    (which broadcasts against the last axis' index)."""
    at = _positions(positions)
    return at if isinstance(at, slice) else np.array(at, dtype=np.int64)[:, None]


def _num(positions: slice | np.ndarray) -> int:
    return positions.stop - positions.start if isinstance(positions, slice) else len(positions)


def _positions(positions: list[int]) -> slice | list[int]:
    """A slice if the positions are consecutive and ascending (indexing with it gives a view)."""
    if positions and positions == list(range(positions[0], positions[0] + len(positions))):
        return slice(positions[0], positions[0] + len(positions))
    return positions


@dataclass(slots=True)
class _Ending:
    """Chains of the last stage that end in a round: resolved once its fetched rows arrive."""

    owners: np.ndarray
    first_cell: np.ndarray
    handed_on: bool = False  # to the next stage (then nothing to resolve here)


_HANDED_ON = _Ending(None, None, handed_on=True)
