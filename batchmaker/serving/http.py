"""The OpenAI-compatible HTTP front: aiohttp routes in front of the in-process Engine, beside the
ZeroMQ socket (`batchmaker serve --http 127.0.0.1:8000`).

    POST /v1/completions, POST /v1/chat/completions   (JSON, or server-sent events with "stream")
    GET  /v1/models, /v1/models/{id}, /health, /metrics

The front runs its own asyncio loop on its own thread. A request is checked and tokenized there
(openai_api.py), its choices are submitted to the engine (completion.py), and their tokens come
back from the manager thread through a LoopBridge. A client that goes away cancels its choices at
once (aiohttp's handler cancellation), and the engine frees their sequences. An offloaded model
(batchmaker/offloaded.py) is served greedily, its tokens in one burst per block (offloaded_api.py).

    with Engine([build_model("llama", checkpoint=DIR)]) as engine, HttpFront(engine, HttpConfig(port=8000)):
        ...   # serve until the block ends (stop lets running requests finish for drain_timeout)
"""
import asyncio
import functools
import hmac
import json
import logging
import threading

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from batchmaker.serving.completion import Completion
from batchmaker.serving.http_config import HttpConfig
from batchmaker.serving.loop_bridge import LoopBridge
from batchmaker.serving.metrics import Metrics
from batchmaker.serving.offloaded_api import greedy_request
from batchmaker.serving.openai_api import ApiError, GenerationRequest, parse_request
from batchmaker.serving.openai_replies import DONE, Replies
from batchmaker.serving.sse_writer import SseWriter
from batchmaker.serving.text_model import text_models

log = logging.getLogger("batchmaker.http")
_dumps = functools.partial(json.dumps, ensure_ascii=False)


class HttpFront:
    def __init__(self, engine, config: HttpConfig = HttpConfig()):
        self.engine = engine
        self.config = config
        self.models, self._others = text_models(engine.models, config.chat_template)  # templates compile here
        self.metrics = Metrics(engine)
        self.port: int | None = None  # the bound port (config.port 0 resolved)
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._bind_error: Exception | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._bridge: LoopBridge | None = None
        self._stopping: asyncio.Event | None = None
        self._is_draining = False

    @property
    def url(self) -> str:
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        return f"http://{host}:{self.port}"

    @property
    def num_loop_wakeups(self) -> int:
        """Times the engine's side has woken this front's loop (a turn's tokens: once)."""
        return 0 if self._bridge is None else self._bridge.num_wakeups

    # lifecycle ---------------------------------------------------------------------------------
    def start(self) -> "HttpFront":
        """Bind (an address in use raises OSError here) and serve on a thread of its own."""
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(),), name="batchmaker-http", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._bind_error is not None:
            self._thread.join()
            self._thread = None
            raise OSError(f"cannot bind http://{self.config.host}:{self.config.port}: {self._bind_error}")
        without = sorted(set(self.engine.models) - set(self.models))
        log.info("serving the OpenAI-compatible HTTP API on %s (models: %s%s)%s", self.url,
                 ", ".join(self.models) or "none", "; not over HTTP: " + ", ".join(without) if without else "",
                 "; API key required" if self.config.api_key else "")
        return self

    def stop(self) -> None:
        """Stop accepting; running requests get `drain_timeout` seconds, then are cancelled."""
        if self._thread is None:
            return
        self._loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join()
        self._thread = None

    def __enter__(self) -> "HttpFront":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._bridge = LoopBridge(self._loop)
        self._stopping = asyncio.Event()
        self.engine.add_turn_listener(self._bridge.flush)  # (a turn's partials: one wake-up of this loop)
        try:
            await self._serve_until_stopped()
        finally:
            self.engine.remove_turn_listener(self._bridge.flush)

    async def _serve_until_stopped(self) -> None:
        runner = web.AppRunner(self._app(), handler_cancellation=True, access_log=None,
                               shutdown_timeout=self.config.drain_timeout)
        try:
            await runner.setup()
            await web.TCPSite(runner, self.config.host, self.config.port).start()
            self.port = runner.addresses[0][1]
        except Exception as e:  # (start() waits for _ready: it must be set whatever happens)
            self._bind_error = e
        self._ready.set()
        if self._bind_error is not None:
            await runner.cleanup()
            return
        await self._stopping.wait()
        self._is_draining = True
        await runner.cleanup()  # (waits for running handlers up to shutdown_timeout, then cancels them)

    def _app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors, self._auth], client_max_size=self.config.max_body_bytes)
        app.router.add_post("/v1/completions", functools.partial(self._generate, kind="text_completion"))
        app.router.add_post("/v1/chat/completions", functools.partial(self._generate, kind="chat.completion"))
        app.router.add_get("/v1/models", self._list_models)
        app.router.add_get("/v1/models/{name}", self._get_model)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        return app

    # middlewares -------------------------------------------------------------------------------
    @web.middleware
    async def _errors(self, request: web.Request, handler):
        """Every error in OpenAI's format: ours, aiohttp's (no route, wrong method, body too large)."""
        try:
            return await handler(request)
        except ApiError as e:
            return _error(e)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return _error(ApiError(e.status, _http_message(e, request)))
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            return _error(ApiError(500, "the server failed on this request"))

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        key = self.config.api_key
        if key is not None and request.path.startswith("/v1/"):
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, f"Bearer {key}".encode()):
                raise ApiError(401, "incorrect API key: send 'Authorization: Bearer KEY' with the server's "
                                    "--api-key", code="invalid_api_key")
        return await handler(request)

    # generation --------------------------------------------------------------------------------
    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        """Parse, run, answer; count the outcome (a client that left: cancelled)."""
        model, outcome = "", "error"
        try:
            body = await _json(request)
            name = body.get("model") if isinstance(body, dict) else None
            known = isinstance(name, str) and (name in self.models or name in self._others)
            model = name if known else ""  # (a label: served models' names only)
            gen = parse_request(kind, body, self.models, self._others)
            if gen.model.is_offloaded:  # (greedy, in blocks: serving/offloaded_api.py)
                gen = greedy_request(body, gen)
            response, outcome = await self._run(request, gen)
            return response
        except ApiError as e:
            outcome = "bad_request" if e.status < 500 else "error"
            raise
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            self.metrics.request(request.path, model, outcome)

    async def _run(self, request: web.Request, gen: GenerationRequest) -> tuple[web.StreamResponse, str]:
        completion = Completion(self.engine, self._bridge, gen, self.metrics)
        try:
            completion.start()
            self.metrics.admitted(gen.model.name, completion.prompt_tokens)
            if gen.stream:
                return await self._stream(request, gen, completion)
            return await _whole(gen, completion), "success"
        finally:
            completion.cancel()  # (what is still running: the client left, or a sibling failed)

    async def _stream(self, request: web.Request, gen: GenerationRequest,
                      completion: Completion) -> tuple[web.StreamResponse, str]:
        replies = Replies(gen)
        first = await completion.next_events()  # before the headers: a refusal is still a plain HTTP error
        if first[0].error is not None:
            raise first[0].error
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        writer = SseWriter(response, request.transport, replies, len(completion.choices))
        try:
            await response.prepare(request)
            if replies.is_chat:
                writer.send(b"".join(replies.opening(c.index) for c in completion.choices))
            writer.on_events(first)
            completion.deliver_to(writer.on_events)  # (from here on, drains write: see sse_writer.py)
            outcome = await writer.wait()
            tail = replies.usage_chunk(completion.prompt_tokens, completion.completion_tokens) \
                if outcome == "success" and gen.include_usage else b""
            await response.write_eof(tail + DONE)
        except ConnectionError:  # the client left between two writes (before the handler was cancelled)
            outcome = "cancelled"
        finally:
            completion.deliver_to(None)
        return response, outcome

    # other routes ------------------------------------------------------------------------------
    async def _list_models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [_model_card(m) for m in self.models.values()]})

    async def _get_model(self, request: web.Request) -> web.Response:
        model = self.models.get(request.match_info["name"])
        if model is None:
            raise ApiError(404, f"the model {request.match_info['name']!r} does not exist", "model", "model_not_found")
        return web.json_response(_model_card(model))

    async def _health(self, request: web.Request) -> web.Response:
        broken = self.engine.broken()  # (model -> why: a broken tensor-parallel group; the server exits)
        status = "broken" if broken else "draining" if self._is_draining else "serving"
        body = {"status": status, "models": sorted(self.models)} | ({"broken": broken} if broken else {})
        return web.json_response(body, status=200 if status == "serving" else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _whole(gen: GenerationRequest, completion: Completion) -> web.Response:
    texts: list[list[str]] = [[] for _ in completion.choices]
    reasons: list[str | None] = [None] * len(texts)
    scores: list[list | None] = [[] if gen.logprobs >= 0 else None for _ in texts]
    remaining = len(texts)
    while remaining:
        for e in await completion.next_events():
            if e.error is not None:
                raise e.error
            texts[e.index].append(e.text)
            if e.scores:
                scores[e.index] += e.scores
            if e.finish_reason is not None:
                reasons[e.index] = e.finish_reason
                remaining -= 1
    body = Replies(gen).whole([("".join(t), r, sc) for t, r, sc in zip(texts, reasons, scores)],
                              completion.prompt_tokens, completion.completion_tokens)
    return web.json_response(body, dumps=_dumps)


async def _json(request: web.Request):
    raw = await request.read()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None


def _model_card(model) -> dict:
    return {"id": model.name, "object": "model", "created": model.created, "owned_by": "batchmaker",
            "max_model_len": model.max_positions}


def _http_message(error: web.HTTPException, request: web.Request) -> str:
    if error.status == 404:
        return f"no route {request.method} {request.path} (POST /v1/completions, POST /v1/chat/completions, " \
               "GET /v1/models, /health, /metrics)"
    if error.status == 405:
        return f"{request.method} is not allowed on {request.path}"
    return error.text or error.reason


def _error(error: ApiError) -> web.Response:
    return web.json_response(error.body(), status=error.status)
