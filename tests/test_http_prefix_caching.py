"""Automatic prefix caching through the OpenAI-compatible front, driven by the official `openai`
client: a chat client that resends its history (rendered again by the template, so that its
tokens differ from the cached context's after some point) and clients that share a system prompt
read the cached blocks of their common prefix; the text is that of a server without prefix
caching; the hits show on /metrics."""
import pytest

pytest.importorskip("openai")
pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")
pytest.importorskip("transformers")
from test_http_api import LONG, Served
from tiny_checkpoint import save_tiny_chat_model

from batchmaker import Engine, build_model
from batchmaker.serving.http import HttpFront
from batchmaker.serving.http_config import HttpConfig

SYSTEM = {"role": "system", "content": "You serve batches of cells for many clients at once, quickly. " * 3}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Two servers on one tiny checkpoint: prefix caching on, and off (the reference)."""
    checkpoint = save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))
    served = []
    for on in (True, False):
        engine = Engine([build_model("llama", checkpoint=str(checkpoint), num_blocks=256, prefix_caching=on)])
        front = HttpFront(engine, HttpConfig(port=0))
        engine.start()
        front.start()
        served.append(Served(engine, front, checkpoint))
    yield served
    for s in served:
        s.front.stop()
        s.engine.stop()


def chat(served: Served, messages: list) -> str:
    reply = served.client().chat.completions.create(model="llama", messages=messages, max_completion_tokens=12,
                                                    temperature=0, extra_body=LONG)
    return reply.choices[0].message.content


def test_a_chat_client_resending_its_history_and_clients_sharing_a_system_prompt_read_cached_blocks(pair):
    cached, reference = pair
    hits = 0
    history = [SYSTEM, {"role": "user", "content": "What is a cell?"}]
    for question in ("And a subgraph?", "Who pins it to a worker?"):
        text = chat(cached, history)
        assert text == chat(reference, history)
        history += [{"role": "assistant", "content": text}, {"role": "user", "content": question}]
        now = cached.metric("batchmaker_prefix_cache_hit_tokens_total", model="llama")
        assert now >= hits + (16 if len(history) > 4 else 0)  # (a later turn reads at least a block of its history)
        hits = now
    for question in ("Hello?", "Why batch?", "What is a worker?"):  # (other clients, the same system prompt)
        messages = [SYSTEM, {"role": "user", "content": question}]
        assert chat(cached, messages) == chat(reference, messages)
    assert cached.metric("batchmaker_prefix_cache_hit_tokens_total", model="llama") >= hits + 3 * 32
    assert reference.metric("batchmaker_prefix_cache_hit_tokens_total", model="llama") == 0
