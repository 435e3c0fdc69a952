"""An offloaded decoder over the OpenAI HTTP routes (serving/offloaded_api.py, text_model.py): the
tiny chat checkpoint of tests/test_http_api.py served offloaded (weights, cache and hidden states
in the host's pools, blocks of 2 x 2) beside the same checkpoint served by the engine, each behind
its own front, driven by the official `openai` client.

Completions and chat, whole and streamed, give the engine's greedy text (with an absent
temperature or 0; a seed changes nothing); stop strings and stop ids cut the text as they do for
the engine's decoder; an absent chat max_tokens is the model's max_new_tokens; what samples
(temperature > 0, top_p, top_k, logprobs, n > 1) is a 400 in OpenAI's format naming the parameter;
/v1/models lists the model; a client that leaves while its request waits for a block cancels it;
/metrics counts its requests; `batchmaker serve --http` serves it.
"""
import json
import socket
import sys
import tempfile
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")
pytest.importorskip("transformers")

from batchmaker import Engine, build_model  # noqa: E402
from batchmaker.serving.cli_models import load_models  # noqa: E402
from batchmaker.serving.http import HttpFront  # noqa: E402
from batchmaker.serving.http_config import HttpConfig  # noqa: E402
from helpers import wait_until  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from tiny_checkpoint import save_tiny_chat_model  # noqa: E402
from test_http_api import MESSAGES, create, metric_at, serve_http, text_of  # noqa: E402  (the normal front tests' requests)

OFFLOAD = ["llama.offload=weights+cache+hidden", "llama.gpu_batch=2", "llama.num_batches=2"]
LONG = {"ignore_eos": True}  # (random weights meet EOS early otherwise)


@dataclass
class Front:
    engine: Engine
    front: HttpFront

    def client(self) -> "openai.OpenAI":
        return openai.OpenAI(base_url=f"{self.front.url}/v1", api_key="unused", max_retries=0, timeout=60)

    def metric(self, name: str, **labels) -> float:
        return metric_at(self.front.url, name, **labels)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat-offloaded"))


@pytest.fixture(scope="module")
def fronts(checkpoint):
    """(the checkpoint offloaded behind a front, the same checkpoint in the engine behind another)."""
    offloaded = Engine(load_models(["llama"], [f"llama.checkpoint={checkpoint}", *OFFLOAD], http=True))
    normal = Engine([build_model("llama", checkpoint=str(checkpoint), num_blocks=256)])
    with offloaded, normal, HttpFront(offloaded, HttpConfig(port=0)) as a, HttpFront(normal, HttpConfig(port=0)) as b:
        yield Front(offloaded, a), Front(normal, b)


def whole(client, kind: str, **options) -> tuple[str, str, tuple[int, int]]:
    reply = create(client, kind, **options)
    return text_of(reply.choices[0]), reply.choices[0].finish_reason, \
        (reply.usage.prompt_tokens, reply.usage.completion_tokens)


def streamed(client, kind: str, **options) -> tuple[str, str, tuple[int, int]]:
    text, reason, usage = "", None, None
    for chunk in create(client, kind, stream=True, stream_options={"include_usage": True}, **options):
        usage = chunk.usage or usage
        for c in chunk.choices:
            text += (c.delta.content if hasattr(c, "delta") else c.text) or ""
            reason = c.finish_reason or reason
    return text, reason, (usage.prompt_tokens, usage.completion_tokens)


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_models_lists_the_offloaded_model(fronts):
    offloaded, _ = fronts
    models = offloaded.client().models.list().data
    assert [m.id for m in models] == ["llama"] and models[0].max_model_len == 256
    health = json.loads(urllib.request.urlopen(f"{offloaded.front.url}/health", timeout=10).read())
    assert health == {"status": "serving", "models": ["llama"]}


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_the_text_is_the_engines_greedy_text_whole_and_streamed(fronts, kind):
    offloaded, normal = fronts
    want = whole(normal.client(), kind, max_tokens=12, temperature=0, extra_body=LONG)
    assert want[1] == "length" and want[2][1] == 12
    client = offloaded.client()
    assert whole(client, kind, max_tokens=12, extra_body=LONG) == want  # (no temperature: greedy)
    assert whole(client, kind, max_tokens=12, temperature=0, seed=7, extra_body=LONG) == want
    assert streamed(client, kind, max_tokens=12, extra_body=LONG) == want
    eos = whole(normal.client(), kind, max_tokens=40, temperature=0)  # (EOS may end it: "stop")
    assert whole(client, kind, max_tokens=40) == eos == streamed(client, kind, max_tokens=40)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_stop_strings_and_stop_ids_cut_as_for_the_engines_decoder(fronts, stream):
    offloaded, normal = fronts
    text = whole(normal.client(), "completion", max_tokens=20, temperature=0, extra_body=LONG)[0]
    stop = text[len(text) // 2:len(text) // 2 + 2]  # (after a token boundary or inside a token: either way)
    ids = normal.engine.infer("llama", {"tokens": normal.front.models["llama"].encode("Cellular batching", True),
                                        "max_new_tokens": 20, "ignore_eos": True}, timeout=60)["tokens"]
    run = streamed if stream else whole
    for options in ({"stop": [stop]}, {"extra_body": {"stop_token_ids": [ids[6]], **LONG}}):
        options.setdefault("extra_body", LONG)
        want = whole(normal.client(), "completion", max_tokens=20, temperature=0, **options)
        assert want[1] == "stop"
        assert run(offloaded.client(), "completion", max_tokens=20, **options) == want


def test_several_prompts_share_the_greedy_path(fronts):
    offloaded, normal = fronts
    prompts = ["Cellular batching", "A cell", "The scheduler"]
    options = dict(model="llama", prompt=prompts, max_tokens=8, extra_body=LONG)
    want = normal.client().completions.create(temperature=0, **options)
    got = offloaded.client().completions.create(**options)
    assert [c.text for c in got.choices] == [c.text for c in want.choices]


def test_an_absent_chat_max_tokens_is_the_models_max_new_tokens(fronts):
    offloaded, _ = fronts
    assert whole(offloaded.client(), "chat", extra_body=LONG)[2][1] == 64  # (the llama factory's default)


@pytest.mark.parametrize("route, options, param", [
    ("completions", {"temperature": 0.7}, "temperature"),
    ("chat/completions", {"temperature": 1}, "temperature"),
    ("completions", {"n": 2}, "n"),
    ("chat/completions", {"n": 2}, "n"),
    ("completions", {"logprobs": 0}, "logprobs"),
    ("chat/completions", {"logprobs": True, "top_logprobs": 2}, "logprobs"),
    ("completions", {"top_p": 0.9}, "top_p"),
    ("chat/completions", {"top_k": 5}, "top_k"),
])
def test_sampling_is_a_400_naming_the_parameter(fronts, route, options, param):
    offloaded, _ = fronts
    requests = offloaded.metric("batchmaker_http_requests_total", route=f"/v1/{route}", model="llama",
                                outcome="bad_request")
    body = {"model": "llama", **({"messages": MESSAGES} if route.startswith("chat") else {"prompt": "hi"}), **options}
    status, reply = post(f"{offloaded.front.url}/v1/{route}", body)
    assert status == 400 and set(reply) == {"error"}
    error = reply["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, "unsupported_parameter")
    assert error["message"].startswith(f"{param}: ") and "served greedily (offloaded)" in error["message"]
    assert offloaded.metric("batchmaker_http_requests_total", route=f"/v1/{route}", model="llama",
                            outcome="bad_request") == requests + 1


def test_the_openai_client_raises_bad_request(fronts):
    offloaded, _ = fronts
    with pytest.raises(openai.BadRequestError, match="greedily") as caught:
        create(offloaded.client(), "chat", temperature=0.7, max_tokens=4)
    assert caught.value.param == "temperature"


def test_a_client_that_leaves_while_waiting_cancels_its_request(fronts):
    offloaded, _ = fronts
    worker = offloaded.engine.blocks.by_model["llama"]
    waiting = lambda: offloaded.engine.stats()["offloaded"]["llama"]["waiting"]  # noqa: E731
    cancelled = offloaded.metric("batchmaker_generations_total", model="llama", finish_reason="cancelled")
    left = offloaded.metric("batchmaker_http_requests_total", route="/v1/completions", model="llama",
                            outcome="cancelled")
    busy, was_busy = threading.Event(), worker.is_busy
    busy.set()
    worker.is_busy = busy.is_set  # (the device "busy": the request waits for its block)
    try:
        body = json.dumps({"model": "llama", "prompt": "Wait:", "max_tokens": 8, "stream": True})
        with socket.create_connection((offloaded.front.config.host, offloaded.front.port), timeout=30) as sock:
            sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
            wait_until(lambda: waiting() == 1)
        wait_until(lambda: waiting() == 0)  # (cancelled while waiting: no block ran it)
        wait_until(lambda: offloaded.metric("batchmaker_http_requests_total", route="/v1/completions", model="llama",
                                            outcome="cancelled") == left + 1)
        assert offloaded.metric("batchmaker_generations_total", model="llama", finish_reason="cancelled") == \
            cancelled + 1
    finally:
        worker.is_busy = was_busy
    assert whole(offloaded.client(), "completion", max_tokens=2)[2][1] >= 1  # (still serving)


def test_metrics_count_the_offloaded_models_requests(fronts):
    offloaded, _ = fronts
    success = offloaded.metric("batchmaker_http_requests_total", route="/v1/completions", model="llama",
                               outcome="success")
    tokens = offloaded.metric("batchmaker_generation_tokens_total", model="llama")
    whole(offloaded.client(), "completion", max_tokens=5, extra_body=LONG)
    assert offloaded.metric("batchmaker_http_requests_total", route="/v1/completions", model="llama",
                            outcome="success") == success + 1
    assert offloaded.metric("batchmaker_generation_tokens_total", model="llama") == tokens + 5
    assert offloaded.metric("batchmaker_time_to_first_token_seconds_count", model="llama") > 0
    assert offloaded.metric("batchmaker_running_sequences", model="llama") == 0


def test_batchmaker_serve_http_serves_it(checkpoint, fronts):
    _, normal = fronts
    want = whole(normal.client(), "completion", max_tokens=6, temperature=0, extra_body=LONG)[0]
    settings = [x for item in [f"llama.checkpoint={checkpoint}", *OFFLOAD] for x in ("--set", item)]
    proc, url = serve_http(f"ipc://{tempfile.mkdtemp(prefix='bm-')}/s", settings)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        assert whole(client, "completion", max_tokens=6, extra_body=LONG)[0] == want
        proc.terminate()
        assert proc.wait(30) == 0
    finally:
        proc.kill()
