"""How the HTTP front streams (batchmaker/serving/http.py, loop_bridge.py, sse_writer.py): a
turn's tokens wake its loop once whatever the number of streams, and the chunks written from the
drain are the same text as the whole replies, through the openai async client.
"""
import asyncio
import sys
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("aiohttp")
pytest.importorskip("transformers")

from batchmaker import Engine, build_model  # noqa: E402
from batchmaker.serving.http import HttpFront  # noqa: E402
from batchmaker.serving.http_config import HttpConfig  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from tiny_checkpoint import save_tiny_chat_model  # noqa: E402

NUM_STREAMS, NUM_TOKENS = 24, 32


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    checkpoint = save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))
    model = build_model("llama", checkpoint=str(checkpoint), num_blocks=256)
    with Engine([model]) as engine, HttpFront(engine, HttpConfig(port=0)) as front:
        yield front


async def both(front: HttpFront, **options) -> tuple[list[str], list[str], list[int]]:
    """Each seed's streamed text, whole text and number of text chunks."""
    client = openai.AsyncOpenAI(base_url=f"{front.url}/v1", api_key="unused", max_retries=0, timeout=120)
    body = dict(model="llama", prompt="Cellular batching", max_tokens=NUM_TOKENS, temperature=1.0,
                extra_body={"ignore_eos": True}, **options)

    async def stream(seed: int) -> list[str]:
        return [c.choices[0].text async for c in await client.completions.create(seed=seed, stream=True, **body)
                if c.choices]

    async def whole(seed: int) -> str:
        return (await client.completions.create(seed=seed, **body)).choices[0].text

    try:
        streams = await asyncio.gather(*(stream(s) for s in range(NUM_STREAMS)))
        wholes = await asyncio.gather(*(whole(s) for s in range(NUM_STREAMS)))
    finally:
        await client.close()
    return ["".join(s) for s in streams], wholes, [len(s) for s in streams]


def test_a_turn_of_many_streams_wakes_the_loop_once(front):
    engine = front.engine
    wakeups, tasks = front.num_loop_wakeups, engine.num_tasks
    streamed, whole, num_chunks = asyncio.run(both(front))
    assert streamed == whole and len(set(streamed)) > NUM_STREAMS // 2
    assert min(num_chunks) >= NUM_TOKENS // 2  # (a chunk a token, but for tokens ending inside a character)
    wakeups, tasks = front.num_loop_wakeups - wakeups, engine.num_tasks - tasks
    # per turn one wake-up for every stream's token (a wake-up per token would be ~24x as many),
    # and per request at most one more: its end
    assert wakeups <= tasks + 2 * NUM_STREAMS, (wakeups, tasks)
    assert wakeups < NUM_STREAMS * NUM_TOKENS / 4


def test_stop_strings_and_usage_through_the_drain_written_stream(front):
    async def run():
        client = openai.AsyncOpenAI(base_url=f"{front.url}/v1", api_key="unused", max_retries=0, timeout=60)
        try:
            full = (await client.completions.create(model="llama", prompt="Cells", max_tokens=24, seed=3,
                                                    extra_body={"ignore_eos": True})).choices[0].text
            stop = full[len(full) // 2:len(full) // 2 + 2]
            chunks = [c async for c in await client.completions.create(
                model="llama", prompt="Cells", max_tokens=24, seed=3, stop=stop, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})]
        finally:
            await client.close()
        return full, stop, chunks

    full, stop, chunks = asyncio.run(run())
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full[:full.index(stop)]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1  # (the usage chunk, last)
