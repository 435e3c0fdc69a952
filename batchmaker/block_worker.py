"""The block worker of an offloaded model (offloaded.py): one thread that gathers the model's
waiting requests into blocks and runs each through FlexGen's schedule (`generate_block`), beside
the engine's cellular models and outside their scheduler: a block is not cell-level work.

    Engine.submit -> BlockWorkers.submit -> BlockWorker.submit: checked at once, then waiting
    worker thread: wait for a request -> gather `gather_s` -> wait while the device is busy
                   -> take a block -> executor.generate_block -> cut each reply -> resolve

- **Blocks.** A block takes up to the executor's block size (gpu_batch x num_batches) of the
  waiting requests, higher priority first, then oldest first, and runs for the largest of their
  counts (each request's max_new_tokens, cut at the model's positions); each reply is cut after
  its first stop id. Requests that arrive while a block runs wait for the next one.
- **Low priority on the device.** A gathered block starts only while the engine's cellular models
  are idle there: no task in flight on a worker of its device and no ready cell in the engine's
  scheduler (of any device: a conservative reading); it looks again every `poll_s`. A block that
  has started is not preempted: the engine's work arriving during it shares the device with it
  (on a GPU their kernels interleave on their own streams). Under a continuous load of the other
  models a waiting block waits; that is the contract of a background, throughput-oriented model.
- **Cancel.** A waiting request is removed and fails with CancelledError at once; a request in
  the running block finishes with its block (the executor's block is one call).
- **Deadlines.** A waiting request past its deadline fails with DeadlineExceededError when the
  worker looks (every `poll_s` at most while requests wait, and when a running block ends); a
  request whose block ends after its deadline fails too.
- **Stop.** Waiting requests fail with EngineStoppedError, the running block ends (its requests
  answered) and the thread is joined.
- **Streaming.** A request with `on_partial` gets one partial, its reply's tokens (and text),
  from the worker thread just before its result.
"""
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable

import torch

from batchmaker.core.request import Result
from batchmaker.errors import (BadRequestError, BatchMakerError, CancelledError, CellError, DeadlineExceededError,
                               EngineStoppedError, OverloadedError)
from batchmaker.offloaded import Ask, OffloadedModel, answer, check
from batchmaker.stats import percentiles

log = logging.getLogger("batchmaker")
NUM_LATENCIES_KEPT = 1000


class BlockWorker:
    def __init__(self, model: OffloadedModel):
        self.model, self.config = model, model.worker
        self.is_busy: Callable[[], bool] = lambda: False
        self._cond = threading.Condition()
        self._waiting: dict[int, tuple] = {}  # request id -> (future, Ask), in arrival order
        self._running: set[int] = set()  # the request ids of the block being generated
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.num_blocks = self.num_tokens = self.num_finished = 0
        self.block_sizes: Counter = Counter()  # requests in a block -> blocks
        self.latencies: deque = deque(maxlen=NUM_LATENCIES_KEPT)

    def start(self, is_busy: Callable[[], bool] | None = None) -> "BlockWorker":
        """The worker thread; `is_busy()` says whether the engine's other models use the device now."""
        if is_busy is not None:
            self.is_busy = is_busy
        self._thread = threading.Thread(target=self._run, name=f"batchmaker-blocks-{self.model.name}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            dropped = [future for future, _ in self._waiting.values()]
            self._waiting.clear()
            self._cond.notify_all()
        for future in dropped:
            self._fail(future, EngineStoppedError("the engine stopped"))
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    # any thread -------------------------------------------------------------------------------------
    def submit(self, future):
        """Check the request and queue it for a block; a bad one fails at once, costing nothing else."""
        try:
            ask = check(self.model, future.inputs)
        except BadRequestError as e:
            return self._fail(future, e)
        if ask is None:  # (max_new_tokens 0)
            text = {"text": ""} if "prompt" in future.inputs else {}
            now = time.perf_counter()
            return self._resolve(future, {"tokens": [], "finish_reason": "length", **text}, now, now)
        with self._cond:
            if self._stopping:
                error = EngineStoppedError("the engine is not running")
            elif len(self._waiting) >= self.config.max_waiting:
                error = OverloadedError(f"model {self.model.name!r}: {len(self._waiting)} requests wait for blocks")
            else:
                self._waiting[future.request_id] = (future, ask)
                self._cond.notify()
                return future
        return self._fail(future, error)

    def cancel(self, request_id: int) -> bool:
        """Fail a waiting request with CancelledError; True if the request is this worker's (a
        request in the running block is, and finishes with its block)."""
        with self._cond:
            if request_id in self._running:
                return True
            entry = self._waiting.pop(request_id, None)
        if entry is None:
            return False
        self._fail(entry[0], CancelledError(f"request {request_id} cancelled"))
        return True

    def stats(self) -> dict:
        return {"waiting": len(self._waiting), "running": len(self._running), "block": self.model.block,
                "num_blocks": self.num_blocks, "num_tokens": self.num_tokens, "num_finished": self.num_finished,
                "block_sizes": dict(sorted(self.block_sizes.items())), "latency_ms": percentiles(list(self.latencies))}

    # the worker thread -------------------------------------------------------------------------------
    def _run(self) -> None:
        with torch.inference_mode():
            while (block := self._form()) is not None:
                try:
                    self._generate(block)
                except Exception as e:  # (anything past the block's generation: its unanswered requests fail,
                    # the worker goes on)
                    log.exception("model %s: answering a block failed", self.model.name)
                    for future, _ in block:
                        if not future.done():
                            self._fail(future, CellError(f"model {self.model.name!r}: answering its block failed: {e}"))
                    with self._cond:
                        self._running.clear()

    def _form(self) -> list | None:
        """Wait for requests, gather, wait for an idle device, then take a block (None: stopping)."""
        gathering_since, block = None, None
        while block is None:
            with self._cond:
                if self._stopping:
                    return None
                expired = self._pop_expired()
                now = time.perf_counter()
                if not self._waiting:
                    gathering_since = None
                    if not expired:
                        self._cond.wait()
                elif now < (gathering_since := gathering_since or now) + self.config.gather_s and \
                        len(self._waiting) < self.model.block:
                    self._cond.wait(gathering_since + self.config.gather_s - now)
                elif self.is_busy():
                    self._cond.wait(self.config.poll_s)
                else:
                    block = self._take()
            for future in expired:  # (resolved outside the lock: callbacks may cancel)
                self._fail(future, DeadlineExceededError(f"request {future.request_id} missed its deadline"))
        return block

    def _pop_expired(self) -> list:
        now = time.perf_counter()
        late = [i for i, (f, _) in self._waiting.items() if f.deadline is not None and f.deadline <= now]
        return [self._waiting.pop(i)[0] for i in late]

    def _take(self) -> list:
        """The block: up to `block` waiting requests, higher priority first, then oldest, each taken
        only while the block stays within the model's positions (its longest prompt and its largest
        count together: the cache the policy was sized for); the others wait (under the lock)."""
        limit, width, count, order = self.model.executor.lm.config.max_positions, 0, 0, []
        for i in sorted(self._waiting, key=lambda i: (-self._waiting[i][0].priority, i)):
            ask = self._waiting[i][1]
            if max(width, len(ask.prompt)) + max(count, ask.count) <= limit:
                width, count = max(width, len(ask.prompt)), max(count, ask.count)
                order.append(i)
                if len(order) == self.model.block:
                    break
        block = [self._waiting.pop(i) for i in order]
        self._running.update(order)
        return block

    def _generate(self, block: list) -> None:
        asks: list[Ask] = [ask for _, ask in block]
        start = time.perf_counter()
        try:
            rows, _ = self.model.executor.generate_block([a.prompt for a in asks], [a.count for a in asks])
        except Exception as e:  # (one failed block fails its requests, not the worker)
            log.exception("model %s: a block of %d requests failed", self.model.name, len(block))
            rows, error = None, CellError(f"model {self.model.name!r}: its block failed: {e}")
        end = time.perf_counter()
        with self._cond:
            self._running.clear()
            self.num_blocks += 1
            self.block_sizes[len(block)] += 1
        for i, (future, ask) in enumerate(block):
            if rows is None:
                self._fail(future, error)
            elif future.deadline is not None and future.deadline <= end:
                self._fail(future, DeadlineExceededError(f"request {future.request_id} missed its deadline"))
            else:
                try:  # (one request's answer, e.g. a token its tokenizer cannot decode, fails that request only)
                    outputs = answer(ask, rows[i], self.model.tokenizer)
                except Exception as e:
                    log.exception("model %s: answering request %s failed", self.model.name, future.request_id)
                    self._fail(future, CellError(f"model {self.model.name!r}: its reply failed: {e}"))
                    continue
                self.num_tokens += len(outputs["tokens"])
                self._resolve(future, outputs, start, end)

    # resolving ---------------------------------------------------------------------------------------
    def _resolve(self, future, outputs: dict, start: float, end: float):
        if future.on_partial is not None:
            try:
                future.on_partial({k: v for k, v in outputs.items() if k in ("tokens", "text")})
            except Exception:  # (a consumer's bug must not stop the worker)
                log.exception("on_partial of request %s failed", future.request_id)
        self._count(future, end)
        future.set_result(Result(outputs, None, (future.arrival, start, end, end if outputs["tokens"] else None)))
        return future

    def _fail(self, future, error: BatchMakerError):
        self._count(future, time.perf_counter())
        future.set_exception(error)
        return future

    def _count(self, future, now: float) -> None:
        with self._cond:
            self.num_finished += 1
            self.latencies.append(now - future.arrival)


class BlockWorkers:
    """The engine's block workers by model name (none for an engine without offloaded models)."""

    def __init__(self, models: list[OffloadedModel]):
        self.by_model = {m.name: BlockWorker(m) for m in models}

    def __contains__(self, name: str) -> bool:
        return name in self.by_model

    def start(self, engine) -> None:
        for worker in self.by_model.values():
            worker.start(device_is_busy(engine, worker.model.device))

    def stop(self) -> None:
        for worker in self.by_model.values():
            worker.stop()

    def submit(self, future, deadline: float | None):
        if deadline is not None:
            future.deadline = future.arrival + deadline
        return self.by_model[future.model].submit(future)

    def cancel(self, request_id: int) -> bool:
        return any(worker.cancel(request_id) for worker in self.by_model.values())

    def stats(self) -> dict:
        return {name: worker.stats() for name, worker in self.by_model.items()}


def offloaded_apart(models: dict) -> tuple[BlockWorkers, dict]:
    """(the block workers of the offloaded models among `models`, the others: the cellular ones)."""
    offloaded = [m for m in models.values() if isinstance(m, OffloadedModel)]
    return BlockWorkers(offloaded), {name: m for name, m in models.items() if not isinstance(m, OffloadedModel)}


def device_is_busy(engine, device) -> Callable[[], bool]:
    """Whether the engine's cellular models use `device` now: a task in flight on a worker of it,
    or a ready cell waiting in the scheduler (any device's: the scheduler does not say whose)."""
    def key(d) -> tuple:
        d = torch.device(d)
        return d.type, d.index or 0

    workers = [w for w in engine.workers if key(w.device) == key(device)]
    scheduler = engine.scheduler
    return lambda: scheduler.num_ready > 0 or any(w.num_in_flight for w in workers)
