"""The OpenAI-compatible HTTP front (batchmaker/serving/http.py) driven by the official `openai`
client: a tiny HF Llama saved by transformers, with a byte-level BPE tokenizer trained on the
README and a chat template (bench/tiny_checkpoint.py), served by an in-process engine.

Completions and chat, whole and streamed (the same text for the same seed), their logprobs (one
process's and two pipeline stages'), n choices, stop strings across token boundaries, 64
concurrent streams, the chat prompt of transformers' apply_chat_template, bad requests in OpenAI's
error format, the API key, a client that leaves mid-stream (its sequence freed, seen through
/metrics), draining, and `batchmaker serve --http`; each against a server without and with automatic
prefix caching (the default of `serve --http`).
"""
import asyncio
import json
import math
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")
transformers = pytest.importorskip("transformers")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from batchmaker import Engine, build_model  # noqa: E402
from batchmaker.serving.http import HttpFront  # noqa: E402
from batchmaker.serving.http_config import HttpConfig  # noqa: E402
from helpers import wait_until  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from tiny_checkpoint import save_tiny_chat_model  # noqa: E402

AS_CONSOLE_SCRIPT = "import sys; sys.path.remove(''); from batchmaker.serving.cli import main; sys.exit(main())"
MESSAGES = [{"role": "system", "content": "You serve batches."}, {"role": "user", "content": "What is a cell?"}]
LONG = {"ignore_eos": True}  # (random weights sample EOS early otherwise)


@dataclass
class Served:
    engine: Engine
    front: HttpFront
    checkpoint: Path

    @property
    def tokenizer(self):
        return self.front.models["llama"].tokenizer

    def client(self, **options) -> "openai.OpenAI":
        return openai.OpenAI(base_url=f"{self.front.url}/v1", api_key="unused", max_retries=0, timeout=60, **options)

    def metric(self, name: str, **labels) -> float:
        return metric_at(self.front.url, name, **labels)

    def is_idle(self) -> bool:
        """No sequence runs or waits, and the only KV blocks in use are idle contexts' (prefix caching's)."""
        return (self.metric("batchmaker_running_sequences", model="llama") == 0
                and self.metric("batchmaker_waiting_sequences", model="llama") == 0
                and self.metric("batchmaker_kv_blocks_used", model="llama")
                == self.metric("batchmaker_kv_blocks_cached", model="llama"))


def metric_at(url: str, name: str, **labels) -> float:
    """A sample's value on the front at `url`'s /metrics (0 when absent)."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "prefix-caching"])
def served(checkpoint, request):
    """The tiny model behind the front, without and with automatic prefix caching (`serve --http`'s default)."""
    model = build_model("llama", checkpoint=str(checkpoint), num_blocks=256, prefix_caching=request.param)
    with Engine([model]) as engine, HttpFront(engine, HttpConfig(port=0)) as front:
        yield Served(engine, front, checkpoint)


def post(url: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def streamed(chunks) -> tuple[dict[int, str], dict[int, str], object]:
    """(text by choice, finish reason by choice, usage) of a stream of chunks."""
    texts, reasons, usage = {}, {}, None
    for chunk in chunks:
        usage = chunk.usage or usage
        for c in chunk.choices:
            piece = c.delta.content if hasattr(c, "delta") else c.text
            texts[c.index] = texts.get(c.index, "") + (piece or "")
            if c.finish_reason is not None:
                reasons[c.index] = c.finish_reason
    return texts, reasons, usage


def create(client, kind: str, **options):
    if kind == "chat":
        return client.chat.completions.create(model="llama", messages=MESSAGES, **options)
    return client.completions.create(model="llama", prompt="Cellular batching", **options)


def text_of(choice) -> str:
    return choice.message.content if hasattr(choice, "message") else choice.text


# routes ---------------------------------------------------------------------------------------
def test_models_health_metrics_and_unknown_routes(served):
    models = served.client().models.list().data
    assert [m.id for m in models] == ["llama"] and models[0].max_model_len == 256
    assert served.client().models.retrieve("llama").id == "llama"
    health = urllib.request.urlopen(f"{served.front.url}/health", timeout=10)
    assert health.status == 200 and json.loads(health.read()) == {"status": "serving", "models": ["llama"]}
    metrics = urllib.request.urlopen(f"{served.front.url}/metrics", timeout=10)
    assert metrics.headers["Content-Type"].startswith("text/plain")
    assert served.metric("batchmaker_kv_blocks_free", model="llama", worker="0") == 255
    assert served.metric("batchmaker_cell_queue_ready", cell_type="llama/decoder") == 0
    with pytest.raises(OSError, match="cannot bind"):
        HttpFront(served.engine, HttpConfig(port=served.front.port)).start()  # (in use)
    status, body = post(f"{served.front.url}/v1/embeddings", b"{}")
    assert status == 404 and body["error"]["type"] == "invalid_request_error" and "no route" in body["error"]["message"]
    try:
        urllib.request.urlopen(f"{served.front.url}/v1/completions", timeout=10)
    except urllib.error.HTTPError as e:
        assert e.code == 405 and set(json.loads(e.read())["error"]) == {"message", "type", "param", "code"}


def test_a_completion_is_the_engines_tokens_decoded(served):
    ids = served.tokenizer.encode("Cellular batching").ids
    want = served.engine.infer("llama", {"tokens": ids, "max_new_tokens": 12, **LONG}, timeout=30)
    for prompt in ("Cellular batching", ids):
        reply = served.client().completions.create(model="llama", prompt=prompt, max_tokens=12, temperature=0,
                                                   extra_body=LONG)
        assert reply.object == "text_completion" and reply.id.startswith("cmpl-")
        assert reply.choices[0].text == served.tokenizer.decode(want["tokens"])
        assert reply.choices[0].finish_reason == "length"
        assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(ids), 12)


def test_the_chat_prompt_is_transformers_apply_chat_template(served):
    hf = transformers.AutoTokenizer.from_pretrained(served.checkpoint)
    ids = list(hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False))
    want = served.engine.infer("llama", {"tokens": ids, "max_new_tokens": 10, **LONG}, timeout=30)
    reply = create(served.client(), "chat", max_completion_tokens=10, temperature=0, extra_body=LONG)
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == served.tokenizer.decode(want["tokens"])


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_streamed_text_equals_the_whole_reply_and_n_choices_differ(served, kind):
    options = dict(max_tokens=16, temperature=1.0, seed=1234, extra_body=LONG)
    client = served.client()
    whole = create(client, kind, n=2, **options)
    texts, reasons, usage = streamed(create(client, kind, n=2, stream=True, stream_options={"include_usage": True},
                                            **options))
    assert texts == {c.index: text_of(c) for c in whole.choices}
    assert reasons == {0: "length", 1: "length"}
    assert usage.model_dump() == whole.usage.model_dump() and usage.completion_tokens == 32
    assert texts[0] != texts[1]  # distinct per-choice seeds
    assert text_of(create(client, kind, **options).choices[0]) == texts[0]  # choice 0 keeps the seed
    if kind == "chat":
        first = next(iter(create(client, kind, stream=True, **options)))
        assert first.choices[0].delta.role == "assistant" and first.object == "chat.completion.chunk"


def test_every_request_is_timed_streamed_or_not(served):
    """TTFT once per choice and an inter-token gap per later token, whether the tokens streamed
    (timed as they reach the front) or came in one reply (the engine's first-token instant and mean gap)."""
    def histogram(name: str) -> tuple[float, float]:
        return served.metric(f"{name}_count", model="llama"), served.metric(f"{name}_sum", model="llama")

    ttft, itl = histogram("batchmaker_time_to_first_token_seconds"), histogram("batchmaker_inter_token_latency_seconds")
    options = dict(max_tokens=6, temperature=0, extra_body=LONG)
    started = time.perf_counter()
    create(served.client(), "completion", **options)
    assert histogram("batchmaker_time_to_first_token_seconds")[0] == ttft[0] + 1  # (the whole reply's)
    assert histogram("batchmaker_inter_token_latency_seconds")[0] == itl[0] + 5
    streamed(create(served.client(), "chat", stream=True, **options))
    elapsed = time.perf_counter() - started
    (ttft_count, ttft_sum), (itl_count, itl_sum) = (histogram("batchmaker_time_to_first_token_seconds"),
                                                    histogram("batchmaker_inter_token_latency_seconds"))
    assert (ttft_count, itl_count) == (ttft[0] + 2, itl[0] + 2 * 5)
    assert 0 < ttft_sum - ttft[1] < elapsed and 0 < itl_sum - itl[1] < elapsed


def test_a_stop_string_across_a_token_boundary_ends_the_choice_and_frees_it(served):
    client = served.client()
    options = dict(max_tokens=120, temperature=1.0, seed=99, extra_body=LONG)
    pieces = [c.choices[0].text for c in create(client, "completion", stream=True, **options) if c.choices[0].text]
    full = "".join(pieces)
    stop, cut = None, 0
    for k in range(len(pieces) - 1):  # the first boundary where tail+head occurs first right there
        cut += len(pieces[k])
        candidate = pieces[k][-2:] + pieces[k + 1][:2]
        if full.find(candidate) == cut - len(pieces[k][-2:]):
            stop, cut = candidate, cut - len(pieces[k][-2:])
            break
    assert stop is not None, pieces
    stopped_before = served.metric("batchmaker_generations_total", model="llama", finish_reason="stop")
    computed = served.metric("batchmaker_iteration_tokens_sum", model="llama")
    whole = create(client, "completion", stop=[stop, "never-generated"], **options)
    assert whole.choices[0].text == full[:cut] and whole.choices[0].finish_reason == "stop"
    assert whole.usage.completion_tokens < 100
    wait_until(served.is_idle)
    # the engine stopped computing once the stop string was seen (the prompt + about that many tokens, not 120)
    usage = whole.usage
    assert served.metric("batchmaker_iteration_tokens_sum", model="llama") - computed < usage.total_tokens + 10
    texts, reasons, _ = streamed(create(client, "completion", stop=stop, stream=True, **options))
    assert texts == {0: full[:cut]} and reasons == {0: "stop"}
    wait_until(served.is_idle)  # cancelled in the engine at the match: the sequences are gone
    assert served.metric("batchmaker_generations_total", model="llama", finish_reason="stop") == stopped_before + 2


def test_64_concurrent_streams_equal_their_whole_replies(served):
    async def run():
        client = openai.AsyncOpenAI(base_url=f"{served.front.url}/v1", api_key="unused", max_retries=0, timeout=120)

        async def stream(seed: int) -> str:
            chunks = await client.completions.create(model="llama", prompt=f"Request {seed}:", max_tokens=8,
                                                     temperature=1.0, seed=seed, stream=True, extra_body=LONG)
            return "".join([c.choices[0].text async for c in chunks])

        async def whole(seed: int) -> str:
            reply = await client.completions.create(model="llama", prompt=f"Request {seed}:", max_tokens=8,
                                                    temperature=1.0, seed=seed, extra_body=LONG)
            return reply.choices[0].text

        streams = await asyncio.gather(*(stream(s) for s in range(64)))
        wholes = await asyncio.gather(*(whole(s) for s in range(64)))
        await client.close()
        return streams, wholes

    streams, wholes = asyncio.run(run())
    assert streams == wholes and len(set(streams)) > 32
    wait_until(served.is_idle)


# mistakes ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("route, body, status, param, code", [
    ("chat/completions", b'{"model": "llama", "messages": [', 400, None, "invalid_json"),
    ("chat/completions", b'["not", "an", "object"]', 400, None, None),
    ("chat/completions", b'{"model": "llama"}', 400, "messages", None),
    ("chat/completions", b'{"model": "llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}',
     400, "max_tokens", None),
    ("completions", b'{"model": "gpt-4o", "prompt": "hi"}', 404, "model", "model_not_found"),
    ("completions", b'{"model": ["llama"], "prompt": "hi"}', 400, "model", None),
    ("completions", json.dumps({"model": "llama", "prompt": [5] * 300}).encode(), 400, "prompt",
     "context_length_exceeded"),
    ("completions", b'{"model": "llama", "prompt": "hi", "frequency_penalty": 2}', 400, "frequency_penalty",
     "unsupported_parameter"),
    ("completions", b'{"model": "llama", "prompt": "hi", "beam_width": 2}', 400, "beam_width", None),
    ("chat/completions", b'{"model": "llama", "messages": [{"role": "user", "content": "hi", "bogus": 1}]}', 400,
     "messages[0].bogus", None),
    ("chat/completions", b'{"model": "llama", "messages": [{"role": "tool", "content": "1", "tool_call_id": "c"}]}',
     400, "messages[0].tool_call_id", "unsupported_parameter"),
])
def test_a_bad_request_gets_its_status_and_an_openai_error(served, route, body, status, param, code):
    got, reply = post(f"{served.front.url}/v1/{route}", body)
    assert got == status and set(reply) == {"error"}
    error = reply["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)
    if param == "frequency_penalty":
        assert "not supported yet" in error["message"]


def test_the_openai_client_raises_its_typed_errors(served):
    with pytest.raises(openai.NotFoundError) as caught:
        served.client().completions.create(model="gpt-4o", prompt="hi")
    assert caught.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="not supported yet"):
        create(served.client(), "chat", presence_penalty=0.5)


def test_an_api_key_is_required_and_checked(served):
    with HttpFront(served.engine, HttpConfig(port=0, api_key="sk-right")) as front:
        def client(key):
            return openai.OpenAI(base_url=f"{front.url}/v1", api_key=key, max_retries=0, timeout=30)

        with pytest.raises(openai.AuthenticationError) as caught:
            client("sk-wrong").models.list()
        assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"
        assert post(f"{front.url}/v1/completions", b'{"model": "llama", "prompt": "hi"}')[0] == 401
        reply = client("sk-right").completions.create(model="llama", prompt="hi", max_tokens=2, extra_body=LONG)
        assert reply.usage.completion_tokens == 2
        assert urllib.request.urlopen(f"{front.url}/health", timeout=10).status == 200  # (probes need no key)
    with pytest.raises(ValueError, match="api-key"):
        HttpConfig("0.0.0.0", 8000)


# leaving -----------------------------------------------------------------------------------------
def test_a_client_that_disconnects_mid_stream_frees_its_sequence(served):
    cancelled = served.metric("batchmaker_generations_total", model="llama", finish_reason="cancelled")
    left = served.metric("batchmaker_http_requests_total", route="/v1/completions", model="llama", outcome="cancelled")
    tokens = served.metric("batchmaker_generation_tokens_total", model="llama")
    computed = served.metric("batchmaker_iteration_tokens_sum", model="llama")
    body = json.dumps({"model": "llama", "prompt": "A long answer:", "max_tokens": 240, "stream": True, **LONG})
    with socket.create_connection((served.front.config.host, served.front.port), timeout=30) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        seen = b""
        while seen.count(b"data: ") < 3:  # a few tokens are out: the sequence is running
            seen += sock.recv(65536)
        assert served.metric("batchmaker_running_sequences", model="llama") == 1
    wait_until(served.is_idle)
    assert served.metric("batchmaker_generations_total", model="llama", finish_reason="cancelled") == cancelled + 1
    assert served.metric("batchmaker_http_requests_total", route="/v1/completions", model="llama",
                         outcome="cancelled") == left + 1
    assert served.metric("batchmaker_generation_tokens_total", model="llama") - tokens < 200
    assert served.metric("batchmaker_iteration_tokens_sum", model="llama") - computed < 200  # the engine stopped


def test_stop_drains_running_streams_then_cancels_them(served):
    import threading

    front = HttpFront(served.engine, HttpConfig(port=0, drain_timeout=30)).start()
    client = openai.OpenAI(base_url=f"{front.url}/v1", api_key="unused", max_retries=0, timeout=30)
    chunks = iter(client.completions.create(model="llama", prompt="Go on:", max_tokens=20, stream=True,
                                            extra_body=LONG))
    first = next(chunks)
    stopping = threading.Thread(target=front.stop)
    stopping.start()
    _, reasons, _ = streamed([first, *chunks])  # the running stream finishes while the front drains
    stopping.join(30)
    assert reasons == {0: "length"} and not stopping.is_alive()

    front = HttpFront(served.engine, HttpConfig(port=0, drain_timeout=0.05)).start()
    client = openai.OpenAI(base_url=f"{front.url}/v1", api_key="unused", max_retries=0, timeout=30)
    stream = client.completions.create(model="llama", prompt="Go on:", max_tokens=240, stream=True, extra_body=LONG)
    computed = served.metric("batchmaker_iteration_tokens_sum", model="llama")
    next(iter(stream))
    started = time.monotonic()
    front.stop()
    assert time.monotonic() - started < 10
    wait_until(served.is_idle)
    assert served.metric("batchmaker_iteration_tokens_sum", model="llama") - computed < 200  # cancelled
    with pytest.raises(openai.APIConnectionError):
        client.models.list()


# the command line ---------------------------------------------------------------------------------
def serve_http(address: str, settings: list[str]) -> tuple[subprocess.Popen, str]:
    """`batchmaker serve --models llama SETTINGS --http 127.0.0.1:0` in a process of its own, and its URL."""
    proc = subprocess.Popen([sys.executable, "-c", AS_CONSOLE_SCRIPT, "serve", "--address", address, "--models",
                             "llama", *settings, "--http", "127.0.0.1:0"], stderr=subprocess.PIPE, text=True)
    url = None
    while url is None:
        line = proc.stderr.readline()
        if not line:
            proc.kill()
            raise AssertionError("the server exited")
        url = (re.search(r"OpenAI-compatible HTTP API on (http://\S+)", line) or [None, None])[1]
    return proc, url


def test_batchmaker_serve_http_beside_zeromq(checkpoint):
    from batchmaker.serving.cli import main
    from batchmaker.serving.client import Client

    assert main(["serve", "--models", "llama", "--http", "0.0.0.0:8000"]) == 2  # beyond loopback: a key
    address = f"ipc://{tempfile.mkdtemp(prefix='bm-')}/s"
    proc, url = serve_http(address, ["--set", f"llama.checkpoint={checkpoint}", "--set", "num_blocks=64"])
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        reply = client.completions.create(model="llama", prompt="Cellular batching", max_tokens=8, temperature=0,
                                          extra_body=LONG)
        with Client(address, timeout=60) as zmq_client:  # the same engine over ZeroMQ
            got = zmq_client.infer("llama", {"prompt": "Cellular batching", "max_new_tokens": 8, **LONG})
        assert reply.choices[0].text == got["text"]
        proc.terminate()
        assert proc.wait(30) == 0
    finally:
        proc.kill()


def test_the_readme_http_example_runs(served, tmp_path):
    readme = (ROOT / "README.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "http://127.0.0.1:8000/v1" in b]
    assert len(blocks) == 1
    code = blocks[0].replace("http://127.0.0.1:8000", served.front.url)
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip()


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_logprobs_through_the_openai_client_are_the_engines(served, kind):
    """Chat's logprobs.content and completions' token_logprobs: one entry per token of the text,
    each with its k alternatives (most likely first; the engine's values: tests/test_logprobs.py
    checks them against transformers); streamed, the chunks' entries add up to the whole reply's."""
    options = dict(max_tokens=6, seed=3, temperature=0.7, extra_body=LONG)
    options.update(logprobs=True, top_logprobs=2) if kind == "chat" else options.update(logprobs=2)
    reply = create(served.client(), kind, **options)
    logprobs = reply.choices[0].logprobs
    if kind == "chat":
        entries = [(e.token, e.logprob, [(a.token, a.logprob) for a in e.top_logprobs]) for e in logprobs.content]
    else:
        entries = [(t, lp, list(top.items())) for t, lp, top in zip(logprobs.tokens, logprobs.token_logprobs,
                                                                     logprobs.top_logprobs)]
        assert logprobs.text_offset == [sum(len(t) for t, _, _ in entries[:i]) for i in range(len(entries))]
    assert len(entries) == reply.usage.completion_tokens  # (EOS ignored: every token is text)
    assert "".join(t for t, _, _ in entries) == text_of(reply.choices[0])
    for _, lp, top in entries:  # (completions' alternatives are a dict by text: two byte tokens may share "\ufffd")
        assert lp <= 0 and (len(top) == 2 if kind == "chat" else 1 <= len(top) <= 2)
        assert kind != "chat" or top[0][1] >= top[1][1] >= -math.inf and top[0][1] >= lp
    streamed = create(served.client(), kind, stream=True, **options)
    pieces = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs is not None]
    if kind == "chat":
        assert [e.logprob for p in pieces for e in p.content] == [lp for _, lp, _ in entries]
    else:
        assert [lp for p in pieces for lp in p.token_logprobs] == [lp for _, lp, _ in entries]


def test_logprobs_through_a_pipeline_are_one_processes(served):
    """Two pipeline stages behind the front (the last stage sends them back with the tokens):
    the same tokens and alternatives as one process, values within 1e-5."""
    model = build_model("llama", checkpoint=str(served.checkpoint), num_blocks=256, pipeline_parallel=2)
    options = dict(max_tokens=6, seed=3, temperature=0.7, extra_body=LONG, logprobs=True, top_logprobs=2)
    with Engine([model]) as engine, HttpFront(engine, HttpConfig(port=0)) as front:
        piped = create(Served(engine, front, served.checkpoint).client(), "chat", **options).choices[0].logprobs
    one = create(served.client(), "chat", **options).choices[0].logprobs
    assert len(piped.content) == len(one.content) == 6
    for a, b in zip(one.content, piped.content):
        assert a.token == b.token and [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs]
        assert [b.logprob] + [t.logprob for t in b.top_logprobs] == \
            pytest.approx([a.logprob] + [t.logprob for t in a.top_logprobs], abs=1e-5, rel=1e-5)
