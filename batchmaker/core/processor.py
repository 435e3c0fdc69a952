"""Request processor of the general path (thesis §2.4.2): unfold requests into cell graphs, hand
subgraphs whose inputs are satisfied to their cell types' queues, apply completed tasks, resume
dynamic unfolding, finish requests. (Structured forms skip all of this: batchmaker/core/chains.py
and trees.py admit and finish their requests in bulk.)

Runs on the engine's manager thread only. Worker memory is reached through two callbacks:
`read(ref)` (a synchronous fetch, used only when an unfolder asks for a value that was not marked
for fetching before its task ran) and `release(node)` (free the node's rows).
"""
import time
from collections.abc import Callable
from types import GeneratorType
from typing import Any

from batchmaker.core.cell_type import CellType
from batchmaker.core.graph import GraphBuilder, Node, Ref, partition
from batchmaker.core.task import NodeTask
from batchmaker.errors import BadRequestError, BatchMakerError, CellError
from batchmaker.core.request import Request, Result, refs_in, resolve


class RequestProcessor:
    def __init__(self, queues: dict, read: Callable[[Ref], Any], release: Callable[[Node], None],
                 on_finished: Callable[[Request], None] = lambda request: None):
        self.queues = queues  # id(cell type) -> its NodeQueue
        self._read = read
        self._release = release
        self._on_finished = on_finished  # called just before a request's future resolves
        self.requests: dict[int, Request] = {}  # live: unfinished, or finished with nodes in flight

    def admit(self, request: Request, model, cell_types: dict[str, CellType]) -> None:
        self.requests[request.id] = request
        try:
            result = model.unfold(request.inputs, GraphBuilder(request, cell_types))
        except Exception as e:  # the unfolder rejected the request (or has a bug)
            self.fail(request, _as_request_error(e))
            return
        if isinstance(result, GeneratorType):
            request.unfolder = result
            self._advance(request, None)
        else:
            self._grow(request)
            self._unfold_done(request, result)

    def on_submit(self, task: NodeTask) -> None:
        now = time.perf_counter()
        for node in task.nodes:
            request = node.request
            request.num_in_flight += 1
            if request.timing.first_cell is None:
                request.timing.first_cell = now

    def complete(self, task: NodeTask) -> None:
        """Apply a finished task: satisfy dependents, resume unfolders, finish requests."""
        if task.error is not None:
            error = CellError(f"cell {task.cell_type.name} failed: {task.error!r}")
            for request in {id(n.request): n.request for n in task.nodes}.values():
                self.fail(request, error)
        touched: dict[int, Request] = {}
        for node in task.nodes:
            node.is_done = True
            request = node.request
            request.num_in_flight -= 1
            request.num_nodes_left -= 1
            touched[request.id] = request
            if request.is_finished:
                continue
            for succ in node.external_successors:
                succ.num_pending -= 1
                sg = succ.subgraph
                sg.num_external_pending -= 1
                if sg.num_external_pending == 0:
                    self.queues[id(sg.cell_type)].enqueue(sg)
        for request in touched.values():
            if request.is_finished:
                self._release_if_idle(request)
            elif request.awaiting is not None and all(r.node.is_done for r in refs_in(request.awaiting)):
                self._advance(request, self._values(request.awaiting))
            else:
                self._finish_if_done(request)

    def fail(self, request: Request, error: BaseException) -> None:
        """Fail one request; its queued subgraphs are dropped and its rows freed once idle."""
        if request.is_finished:
            return
        request.error = error
        if request.unfolder is not None:
            request.unfolder.close()
            request.unfolder = None
        for sg in {id(n.subgraph): n.subgraph for n in request.nodes if n.subgraph}.values():
            self.queues[id(sg.cell_type)].drop(sg)
        request.timing.finish = time.perf_counter()
        request.is_finished = True
        self._on_finished(request)
        request.future.set_exception(error)
        self._release_if_idle(request)

    @property
    def num_live_nodes(self) -> int:
        return sum(len(r.nodes) for r in list(self.requests.values()))  # list(): safe off-thread

    def _advance(self, request: Request, value: Any) -> None:
        """Run the unfolder until it waits for a value not yet computed, or returns."""
        while True:
            request.awaiting = None
            try:
                awaited = request.unfolder.send(value)
            except StopIteration as stop:
                request.unfolder = None
                self._grow(request)
                self._unfold_done(request, stop.value)
                return
            except Exception as e:
                request.unfolder = None
                self.fail(request, _as_request_error(e))
                return
            self._grow(request)
            refs = refs_in(awaited)
            if not refs or any(not isinstance(a, Ref) for a in _flat(awaited)):
                self.fail(request, TypeError("an unfolder must yield a Ref or a list of Refs"))
                return
            if not all(r.node.is_done for r in refs):
                for r in refs:
                    r.node.mark_fetch(r.output)
                request.awaiting = awaited
                return
            value = self._values(awaited)

    def _grow(self, request: Request) -> None:
        """Partition the nodes the unfolder just added and queue the subgraphs that are ready."""
        new_nodes = request.nodes[request.num_partitioned:]
        request.num_partitioned = len(request.nodes)
        request.num_nodes_left += len(new_nodes)
        for sg in partition(new_nodes):
            if sg.num_external_pending == 0:
                self.queues[id(sg.cell_type)].enqueue(sg)

    def _unfold_done(self, request: Request, outputs: Any) -> None:
        request.outputs = outputs
        request.output_refs = refs_in(outputs)
        for r in request.output_refs:
            r.node.mark_fetch(r.output)
        self._finish_if_done(request)

    def _finish_if_done(self, request: Request) -> None:
        if request.is_unfolding or request.num_nodes_left or request.is_finished:
            return
        try:
            for r in request.output_refs:
                self._ensure_fetched(r)
            outputs = resolve(request.outputs)
        except Exception as e:
            self.fail(request, _as_request_error(e))
            return
        request.timing.finish = time.perf_counter()
        request.is_finished = True
        self._on_finished(request)
        request.future.set_result(Result(outputs, request.timing))
        self._release_if_idle(request)

    def _values(self, awaited):
        for r in refs_in(awaited):
            self._ensure_fetched(r)
        return resolve(awaited)

    def _ensure_fetched(self, ref: Ref) -> None:
        if not ref.node.has_host_output(ref.output):
            ref.node.set_host_output(ref.output, self._read(ref))

    def _release_if_idle(self, request: Request) -> None:
        if request.num_in_flight == 0 and self.requests.pop(request.id, None) is not None:
            for node in request.nodes:
                if node.rows:
                    self._release(node)


def _flat(value):
    return value if isinstance(value, (list, tuple)) else [value]


def _as_request_error(e: Exception) -> BatchMakerError:
    if isinstance(e, BatchMakerError):
        return e
    if isinstance(e, (ValueError, TypeError, KeyError, IndexError)):
        return BadRequestError(f"{type(e).__name__}: {e}")
    return BatchMakerError(f"unfolder failed: {type(e).__name__}: {e}")
