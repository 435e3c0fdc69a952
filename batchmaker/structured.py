"""Models declared with forms (batchmaker/forms.py), as the engine runs them: their stages'
queues, their admission in one vectorized pass per batch of arrivals, and the resolution of their
requests once their last stage hands back outputs.

Admission checks every request of the batch with numpy (batchmaker/core/admission.py; trees:
core/tree_input.py), answers the bad ones with their own BadRequestError, and appends the good
ones to the first stage's waiting queue as one chunk of arrays. Nothing per request survives
admission but its future and its rows in those arrays.
"""
import logging
import time
from collections import deque

import numpy as np
import torch

from batchmaker.core.admission import check_keys, check_limit, check_token_lists
from batchmaker.core.chains import ChainQueue, Stage
from batchmaker.core.tree_input import MAX_DEPTH, parse_trees
from batchmaker.core.trees import Forest, TreeSpec
from batchmaker.core.waiting import Chunk
from batchmaker.errors import BadRequestError
from batchmaker.forms import Chain, DecodeLoop, Tree
from batchmaker.future import resolve_rows
from batchmaker.core.request import ResultRows


class Accounting:
    """What the engine counts as requests finish (manager thread; read from any thread)."""

    def __init__(self, models, num_latencies_kept: int):
        self.num_finished = 0
        self.latencies = {name: deque(maxlen=num_latencies_kept) for name in models}
        self.live: dict[int, object] = {}  # request id -> future, accepted and not finished
        self.cancel_epoch = 0  # moved when requests fail or are cancelled: queues purge their rows

    def finished(self, future, latency: float | None) -> None:
        self.num_finished += 1
        self.live.pop(future.request_id, None)
        if latency is not None:
            self.latencies[future.model].append(latency)


class Finisher:
    """What every form model does with its requests' futures: fail them, stream to them."""

    def __init__(self, model, accounting: Accounting):
        self.model = model
        self.name = model.name
        self.accounting = accounting

    def fail(self, owners: list, error: BaseException) -> None:
        now = time.perf_counter()
        for owner in owners:
            if not owner._done:
                owner.set_exception(error)
                self.accounting.finished(owner, now - owner.arrival)
        self.accounting.cancel_epoch += 1

    def stream(self, owner, partial: dict) -> None:
        callback = owner.on_partial
        if callback is not None and not owner._done:
            try:
                callback(partial)
            except Exception:  # a consumer's bug must not fail the request or the engine
                logging.getLogger("batchmaker").exception("on_partial callback failed for request %s",
                                                          owner.request_id)


class StructuredModel(Finisher):
    def __init__(self, model, cell_types: dict, accounting: Accounting):
        super().__init__(model, accounting)
        self.forms = model.forms
        self.cell_types = cell_types  # cell name -> CellType
        first = self.forms[0]
        if isinstance(first, Tree):
            self.required = [first.input]
            self.optional = []
        else:
            self.required = list(first.steps.values()) if isinstance(first, Chain) else []
            last = self.forms[-1]
            self.optional = [last.max_len_input] if isinstance(last, DecodeLoop) and last.max_len_input else []
        # the key sets a request's inputs may have: the required keys and any of the optional ones
        self._keysets = [frozenset(self.required) | frozenset(extra) for extra in _subsets(self.optional)]
        self.queues: list = []
        self.forest: Forest | None = None
        self.first: ChainQueue | None = None

    # start-up -------------------------------------------------------------------------------
    def facts_from(self, worker) -> dict[str, dict]:
        """What this model's queues need of a started worker: its cells' pools (cell name -> input
        or output name -> rows)."""
        return {cell: worker.cells[id(ct)].pools for cell, ct in self.cell_types.items()}

    def build(self, pools: dict[int, dict[str, dict]]) -> list:
        """The scheduler's queues, given each worker's pools: worker -> cell name -> name -> rows."""
        if isinstance(self.forms[0], Tree):
            form = self.forms[0]
            spec = TreeSpec(self.cell_types[form.leaf], self.cell_types[form.internal], form.token, form.left,
                            form.right, form.outputs, finisher=self)
            joint = {w: {**by_cell[form.leaf], **by_cell[form.internal]} for w, by_cell in pools.items()}
            self.forest = Forest(spec, joint)
            self.queues = list(self.forest.queues)
            return self.queues
        queues, previous = [], None
        for position, form in enumerate(self.forms):
            stage = Stage(self.cell_types[form.cell], position, dict(form.carry), init=dict(form.init))
            if isinstance(form, Chain):
                stage.step_inputs, stage.outputs = tuple(form.steps), dict(form.outputs)
            else:
                stage.start, stage.stop, stage.collect = dict(form.start), tuple(form.stop), dict(form.collect)
            queue = ChainQueue(stage, {w: by_cell[form.cell] for w, by_cell in pools.items()})
            if previous is not None:
                previous.stage.next = queue
            queues.append(queue)
            previous = queue
        previous.stage.finisher = self
        self.first = queues[0]
        self.queues = queues
        return queues

    def warm_list(self) -> list:
        """What CUDA workers capture at start: ("step", cell type) or ("round", cell type, ...)."""
        if isinstance(self.forms[0], Tree):
            return [("step", self.cell_types[self.forms[0].leaf]), ("step", self.cell_types[self.forms[0].internal])]
        warm = []
        for i, form in enumerate(self.forms):
            nxt = self.forms[i + 1] if i + 1 < len(self.forms) else None
            saved = [*form.carry.values(), *(getattr(form, "outputs", {}) or {}).values(),
                     *(nxt.init.values() if nxt is not None else ())]
            record = tuple(form.collect.values()) if isinstance(form, DecodeLoop) else ()
            warm.append(("round", self.cell_types[form.cell], record, tuple(dict.fromkeys(saved)), dict(form.carry)))
        return warm

    # admission ------------------------------------------------------------------------------
    def admit(self, futures: list) -> None:
        """Check a batch of arrivals at once; queue the good ones as one chunk, fail the others."""
        errors: dict[int, BaseException] = {}
        keysets = self._keysets
        odd = [i for i, f in enumerate(futures) if type(f.inputs) is not dict or f.inputs.keys() not in keysets]
        for i in odd:  # (the rare case: each gets its own error)
            try:
                check_keys(futures[i].inputs, self.required, self.optional)
            except BadRequestError as e:
                errors[i] = e
        good = [f for i, f in enumerate(futures) if i not in errors] if errors else futures
        if isinstance(self.forms[0], Tree):
            chunk, good = self._trees(good, errors, futures)
        else:
            chunk, good = self._chains(good, errors, futures)
        for i, error in errors.items():
            self.fail([futures[i]], error)
        if good:
            priorities = np.fromiter([f.priority for f in good], dtype=np.int64, count=len(good))
            chunk.columns["priority"] = priorities
            chunk.columns["first_cell"] = np.full(len(good), np.nan)
            chunk.columns["streams"] = np.fromiter([f.on_partial is not None for f in good], dtype=bool, count=len(good))
            (self.forest or self.first).add(priorities, chunk)

    def _chains(self, good: list, errors: dict, futures: list) -> tuple[Chunk | None, list]:
        """Step values and decode lengths of every good request; the bad ones move to `errors`."""
        position = {id(f): i for i, f in enumerate(futures)}
        while good:
            bad, result = self._check_chains(good)
            if not bad:
                return result
            for j, error in bad.items():
                errors[position[id(good[j])]] = error
            good = [f for j, f in enumerate(good) if j not in bad]
        return None, []

    def _check_chains(self, good: list) -> tuple[dict, tuple]:
        forms, bad = self.forms, {}
        first, last = forms[0], forms[-1]
        steps, lengths = [], np.zeros(0, dtype=np.int64)
        if isinstance(first, Chain):
            for name, key in first.steps.items():
                high = self.cell_types[first.cell].cell.signature.inputs[name].high
                flat, lens, errors = check_token_lists([f.inputs[key] for f in good], high, key)
                if errors:
                    return errors, None
                if steps and not np.array_equal(lens, lengths):
                    return {j: BadRequestError(f"step inputs {sorted(first.steps.values())} differ in length")
                            for j in np.flatnonzero(lens != lengths).tolist()}, None
                steps.append(flat)
                lengths = lens
        n = len(good)
        stage_lengths = np.zeros((n, len(forms)), dtype=np.int64)
        stage_lengths[:, 0] = lengths if len(lengths) else 0
        if isinstance(last, DecodeLoop):
            stage_lengths[:, -1] = last.max_len
            if last.max_len_input:
                bad = self._decode_limits(good, stage_lengths[:, -1])
        if bad:
            return bad, None
        owners = np.fromiter(good, dtype=object, count=n)  # (several times faster than assigning the list)
        columns = {"lengths": stage_lengths}
        chunk = Chunk.of(owners, columns, np.stack(steps, axis=1), lengths) if steps else Chunk.of(owners, columns)
        return {}, (chunk, good)

    def _decode_limits(self, good: list, limits: np.ndarray) -> dict:
        """Each request's optional decode limit into `limits` (left as is where absent) -> the bad ones."""
        key, most = self.forms[-1].max_len_input, self.forms[-1].max_len
        given = [f.inputs.get(key) for f in good]
        if all(type(v) is int and 1 <= v <= most for v in given):  # (the common case: no call per request)
            limits[:] = given
            return {}
        if all(v is None for v in given):
            return {}
        bad = {}
        for j, value in enumerate(given):
            if value is not None:
                try:
                    limits[j] = check_limit(value, most, key)
                except BadRequestError as e:
                    bad[j] = e
        return bad

    def _trees(self, good: list, errors: dict, futures: list) -> tuple[Chunk | None, list]:
        form = self.forms[0]
        high = self.cell_types[form.leaf].cell.signature.inputs[form.token].high
        arrays, ok, bad = parse_trees([f.inputs[form.input] for f in good], high, MAX_DEPTH)
        if bad:
            position = {id(f): i for i, f in enumerate(futures)}
            for j, error in bad.items():
                errors[position[id(good[j])]] = error
            good = [good[j] for j in ok]
        if not good:
            return None, []
        n = arrays.num_leaves
        sizes = 2 * n - 1
        nodes = np.full((len(arrays.tokens) + len(arrays.children), 3), -1, dtype=np.int64)
        # tree t starts at (leaves before it) + (internal nodes before it): its leaves follow, then its internal nodes
        leaves_through, inner_through = np.cumsum(n), np.cumsum(n - 1)
        nodes[np.arange(len(arrays.tokens)) + np.repeat(inner_through - n + 1, n), 0] = arrays.tokens
        inner = np.arange(len(arrays.children)) + np.repeat(leaves_through, n - 1)
        nodes[inner, 1], nodes[inner, 2] = arrays.children[:, 0], arrays.children[:, 1]  # (column by column: 1.3x)
        owners = np.fromiter(good, dtype=object, count=len(good))
        return Chunk.of(owners, {"leaves": n}, nodes, sizes), good

    # the Finisher side (manager thread) --------------------------------------------------------
    def resolve(self, owners, outputs: dict, first_cell: np.ndarray) -> None:
        """The requests of `owners` finished with `outputs` (key -> a tensor [n, ...] or n values)."""
        now = time.perf_counter()
        owners = owners.tolist() if isinstance(owners, np.ndarray) else list(owners)
        if any(o._done for o in owners):  # cancelled or expired meanwhile
            live = [i for i, o in enumerate(owners) if not o._done]
            owners, first_cell = [owners[i] for i in live], first_cell[live]
            outputs = {key: v[live] if isinstance(v, torch.Tensor) else [v[i] for i in live] for key, v in outputs.items()}
        if not owners:
            return
        arrivals = [o.arrival for o in owners]
        accounting = self.accounting
        accounting.num_finished += len(owners)  # counted before the futures resolve (a waiter may read stats at once)
        live = accounting.live
        for o in owners:
            live.pop(o.request_id, None)
        accounting.latencies[self.name].extend([now - a for a in arrivals])
        resolve_rows(owners, ResultRows(outputs, arrivals, first_cell, now))


def _subsets(items: list) -> list[tuple]:
    subsets = [()]
    for item in items:
        subsets += [(*s, item) for s in subsets]
    return subsets

