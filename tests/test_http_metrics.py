"""/metrics of a server with an RNN model beside the tiny decoder: the cell queues of the LSTM
(ready rows and running tasks, read between the manager's turns, which this test drives), its
rows per task, and the HTTP requests by model and outcome (one naming the LSTM: served over
ZeroMQ only, a bad request)."""
import threading
import time
from contextlib import contextmanager

import pytest

pytest.importorskip("openai")
pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")
pytest.importorskip("transformers")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from test_http_api import LONG, Served, post  # noqa: E402
from tiny_checkpoint import save_tiny_chat_model  # noqa: E402

from batchmaker import Engine, build_model  # noqa: E402
from batchmaker.serving.http import HttpFront  # noqa: E402
from batchmaker.serving.http_config import HttpConfig  # noqa: E402

LSTM_ROWS = 8  # the LSTM's max_batch: 50 requests wait for several tasks


def samples(front: HttpFront, name: str) -> dict[tuple, float]:
    """The samples of one metric on /metrics, by their labels' values (sorted by label name)."""
    import urllib.request
    text = urllib.request.urlopen(f"{front.url}/metrics", timeout=10).read().decode()
    return {tuple(v for _, v in sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples if s.name == name}


@contextmanager
def turning(engine: Engine):
    """The manager's turns on a thread of this test's while the block runs."""
    stop = threading.Event()

    def turn():
        while not stop.is_set():
            if not engine.step():
                time.sleep(0.001)

    thread = threading.Thread(target=turn)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def test_the_lstms_queues_and_requests_by_model_and_outcome(tmp_path):
    checkpoint = save_tiny_chat_model(tmp_path)
    models = [build_model("llama", checkpoint=str(checkpoint), num_blocks=64),
              build_model("lstm", vocab=100, embed=32, hidden=32, max_batch=LSTM_ROWS)]
    engine = Engine(models).start(thread=False)  # (this test turns the manager: queues are read between turns)
    try:
        with HttpFront(engine, HttpConfig(port=0)) as front:
            served = Served(engine, front, checkpoint)
            with turning(engine):
                for _ in range(2):
                    served.client().completions.create(model="llama", prompt="Cellular", max_tokens=3, extra_body=LONG)
                status, _ = post(f"{front.url}/v1/completions", b'{"model": "lstm", "prompt": "hi"}')
            assert status == 400
            requests = samples(front, "batchmaker_http_requests_total")  # (labels: model, outcome, route)
            assert requests == {("llama", "success", "/v1/completions"): 2,
                                ("lstm", "bad_request", "/v1/completions"): 1}

            lengths = [1 + i % 7 for i in range(50)]
            futures = [engine.submit("lstm", {"tokens": list(range(1, 1 + n))}) for n in lengths]
            engine.step()  # admitted, and a task of LSTM_ROWS rows launched
            ready = samples(front, "batchmaker_cell_queue_ready")
            assert ready == {("lstm/lstm",): 50 - LSTM_ROWS, ("llama/decoder",): 0}
            assert samples(front, "batchmaker_cell_queue_running_tasks")[("lstm/lstm",)] == 1
            while not all(f.done() for f in futures):
                engine.step()
            assert samples(front, "batchmaker_cell_queue_ready")[("lstm/lstm",)] == 0
            assert samples(front, "batchmaker_cell_queue_running_tasks")[("lstm/lstm",)] == 0
            rows = samples(front, "batchmaker_task_rows_sum")[("lstm/lstm",)]
            tasks = samples(front, "batchmaker_task_rows_count")[("lstm/lstm",)]
            assert tasks >= 50 / LSTM_ROWS and sum(lengths) <= rows <= tasks * LSTM_ROWS  # (rows: lanes x steps)
            assert all(f.result().outputs for f in futures)
    finally:
        engine.stop()
