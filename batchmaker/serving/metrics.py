"""Prometheus metrics of the HTTP front (GET /metrics): what the front counts as requests pass,
and the engine's own state read from `Engine.stats()` at each scrape. One registry per front, not
prometheus_client's global one, so that two fronts (or two tests) in one process do not collide.

The front counts: HTTP requests by route, model and outcome; finished choices (engine requests)
by finish reason; prompt and generated tokens; time to first token and inter-token latency of
every choice: as its tokens reach the front where they stream (a streamed request, or one with
stop strings), else from the engine's instants (its first token's; the mean gap after it, once
per gap: a whole reply's tokens come at once, and the engine keeps no instant per token). The
engine's state: requests live and queued, decoders'
running and waiting sequences, KV blocks used, free and held by idle conversations, prompt
positions served by prefix caching, tokens per decoder iteration, rows per task and the ready
work of every cell type (the RNN models' queues).
"""
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    def __init__(self, engine):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("batchmaker_http_requests", "HTTP requests by route, model and outcome "
                                "(success, bad_request, cancelled: the client left, error)",
                                ["route", "model", "outcome"], registry=r)
        self.choices = Counter("batchmaker_generations", "Choices (engine requests) finished, by finish reason "
                               "(stop, length, cancelled, error)", ["model", "finish_reason"], registry=r)
        self.prompt_tokens = Counter("batchmaker_prompt_tokens", "Prompt tokens of admitted requests", ["model"],
                                     registry=r)
        self.generation_tokens = Counter("batchmaker_generation_tokens", "Tokens generated", ["model"], registry=r)
        self.ttft = Histogram("batchmaker_time_to_first_token_seconds", "From the request's arrival to its "
                              "first token, per choice: when the token reached the front (streamed, or with stop "
                              "strings), else when the engine sampled it", ["model"], buckets=TTFT_BUCKETS,
                              registry=r)
        self.itl = Histogram("batchmaker_inter_token_latency_seconds", "Between consecutive tokens of a choice: "
                             "each gap as the tokens reached the front (streamed, or with stop strings), else "
                             "the choice's mean gap in the engine (first to last token), once per gap", ["model"],
                             buckets=ITL_BUCKETS, registry=r)
        r.register(EngineCollector(engine))
        self._itl: dict = {}

    def request(self, route: str, model: str, outcome: str) -> None:
        self.requests.labels(route, model, outcome).inc()

    def admitted(self, model: str, prompt_tokens: int) -> None:
        self.prompt_tokens.labels(model).inc(prompt_tokens)

    def first_token(self, model: str, seconds: float) -> None:
        self.ttft.labels(model).observe(seconds)

    def inter_token(self, model: str, seconds: float, times: int = 1) -> None:
        child = self._itl.get(model)  # (per token: labels() costs a few µs, a dict lookup less)
        if child is None:
            child = self._itl[model] = self.itl.labels(model)
        for _ in range(times):
            child.observe(seconds)

    def finished(self, model: str, reason: str, num_tokens: int) -> None:
        self.choices.labels(model, reason).inc()
        self.generation_tokens.labels(model).inc(num_tokens)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class EngineCollector:
    """Gauges and histograms computed from Engine.stats() when scraped."""

    def __init__(self, engine):
        self.engine = engine

    def describe(self):
        return []  # (collect() calls the engine: not at registration)

    def collect(self):
        stats = self.engine.stats()
        yield _gauge("batchmaker_live_requests", "Requests admitted and not finished", stats["num_live_requests"])
        yield _gauge("batchmaker_queued_requests", "Requests accepted and not finished (what max_requests bounds)",
                     stats["num_queued_requests"])
        sequences = stats.get("sequences", {})
        yield _by_model("batchmaker_running_sequences", "Decoder requests running in a slot",
                        {m: s["running"] for m, s in sequences.items()})
        yield _by_model("batchmaker_waiting_sequences", "Decoder requests waiting to join (suspended ones too)",
                        {m: s["waiting"] for m, s in sequences.items()})
        yield _by_worker("batchmaker_kv_blocks_used", "KV-cache blocks in use (idle conversations' included)",
                         stats.get("kv_blocks_used", {}))
        yield _by_worker("batchmaker_kv_blocks_free", "KV-cache blocks free", stats.get("kv_blocks_free", {}))
        yield _by_model("batchmaker_kv_blocks_cached", "KV-cache blocks held by idle conversations",
                        {m: c.get("gpu_blocks_cached", 0) for m, c in stats.get("conversations", {}).items()})
        hits = CounterMetricFamily("batchmaker_prefix_cache_hit_tokens", "Prompt positions read from the cache of "
                                   "other requests instead of computed (automatic prefix caching)", labels=["model"])
        for model, c in stats.get("conversations", {}).items():
            hits.add_metric([model], c.get("prefix_hit_tokens", 0))
        yield hits
        yield from _cell_queues(stats["cell_queues"])
        yield from _batch_histograms(stats["batch_sizes"], set(sequences))


def _gauge(name: str, doc: str, value) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _by_model(name: str, doc: str, values: dict) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=["model"])
    for model, value in values.items():
        family.add_metric([model], value)
    return family


def _by_worker(name: str, doc: str, values: dict) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=["model", "worker"])
    for model, per_worker in values.items():
        for worker, value in enumerate(per_worker):
            family.add_metric([model, str(worker)], value)
    return family


def _cell_queues(queues: dict):
    ready = GaugeMetricFamily("batchmaker_cell_queue_ready", "Ready work per cell type, in its batch unit (rows; "
                              "a decoder: tokens)", labels=["cell_type"])
    running = GaugeMetricFamily("batchmaker_cell_queue_running_tasks", "Tasks in flight per cell type",
                                labels=["cell_type"])
    for cell_type, q in queues.items():
        ready.add_metric([cell_type], q["num_ready"])
        running.add_metric([cell_type], q["num_running_tasks"])
    return ready, running


def _batch_histograms(batch_sizes: dict[str, int], decoders: set[str]):
    """'model/cell:rows' -> tasks: tokens per iteration for decoders, rows per task for the rest."""
    tokens = HistogramMetricFamily("batchmaker_iteration_tokens", "Tokens per decoder iteration (prompt chunks "
                                   "and decodes)", labels=["model"])
    rows = HistogramMetricFamily("batchmaker_task_rows", "Rows (batched cell invocations) per task",
                                 labels=["cell_type"])
    counts: dict[str, dict[int, int]] = {}
    for key, num_tasks in batch_sizes.items():
        cell_type, _, size = key.rpartition(":")
        counts.setdefault(cell_type, {})[int(size)] = num_tasks
    for cell_type, sizes in sorted(counts.items()):
        model = cell_type.partition("/")[0]
        family, label = (tokens, model) if model in decoders else (rows, cell_type)
        family.add_metric([label], _buckets(sizes), sum_value=sum(k * v for k, v in sizes.items()))
    return tokens, rows


def _buckets(sizes: dict[int, int]) -> list[tuple[str, int]]:
    """Cumulative counts at powers of two up to the largest size, then +Inf."""
    bounds, bound = [], 1
    while bound < max(sizes):
        bounds.append(bound)
        bound *= 2
    bounds.append(bound)
    buckets = [(str(b), sum(v for k, v in sizes.items() if k <= b)) for b in bounds]
    return buckets + [("+Inf", sum(sizes.values()))]
