"""Conversations over ZeroMQ (a tiny seeded Llama on a loopback server): the client's
Conversation helper and `batchmaker client chat`. A turn's tokens are those of a stateless
request whose prompt is the whole history; an ended conversation is unknown; a cancelled turn
leaves the conversation as it was; the command line reads one turn per line of stdin."""
import io
import json
import re

import pytest

zmq = pytest.importorskip("zmq")  # the GPU machine has no pyzmq: skip there, do not fail collection

from batchmaker import Engine, build_model  # noqa: E402
from batchmaker.errors import BadRequestError, CancelledError, UnknownConversationError  # noqa: E402
from batchmaker.serving.cli import main  # noqa: E402
from batchmaker.serving.client import Client  # noqa: E402
from batchmaker.serving.server import Server, ServerConfig  # noqa: E402

GREEDY = {"max_new_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def served():
    """The tiny Llama (preset tiny-llama, seed 0) on a loopback server: its address."""
    model = build_model("llama", num_blocks=64, max_tokens=32)
    with Engine([model]) as engine, Server(engine, ServerConfig("tcp://127.0.0.1:*")) as server:
        yield server.address


@pytest.fixture
def client(served):
    with Client(served, timeout=60) as client:
        yield client


def stateless(client, history: list[int], prompt: list[int]) -> list[int]:
    """The reply to `prompt` after `history`, from a request that sends it all as one prompt."""
    return client.infer("llama", {"tokens": history + prompt, **GREEDY})["tokens"]


def assert_no_conversations_left(client) -> None:
    assert client.stats()["conversations"]["llama"]["conversations"] == 0


def test_each_turn_gives_the_tokens_of_the_whole_history_sent_as_one_prompt(client):
    history = []
    with client.conversation("llama", **GREEDY) as chat:
        assert chat.id is None
        first = chat.send([5, 17, 42])
        assert re.fullmatch(r"[0-9a-f]{16}", chat.id) and first["conversation"] == chat.id
        assert first["context"] == {"cached": 0, "swapped_in": 0, "recomputed": 0}
        assert first["tokens"] == stateless(client, [], [5, 17, 42]) and first["finish_reason"] == "length"
        history += [5, 17, 42] + first["tokens"]

        second = chat.send([7, 8])
        assert second["tokens"] == stateless(client, history, [7, 8]) and second["conversation"] == chat.id
        # every position of the history but the last reply token (never fed to the model) was kept
        assert len(history) - 1 <= sum(second["context"].values()) <= len(history)
        history += [7, 8] + second["tokens"]

        stream = chat.stream([9], max_new_tokens=4)  # a turn's own settings override the conversation's
        streamed = [t for partial in stream for t in partial["tokens"]]
        third = stream.result().outputs
        assert streamed == third["tokens"] == stateless(client, history, [9])[:4]
        assert third["conversation"] == chat.id

        assert chat.end() == {"conversation": chat.id, "ended": True, "turns": 3}
        with pytest.raises(UnknownConversationError) as error:
            chat.send([10])
        assert isinstance(error.value, BadRequestError) and error.value.code == "unknown_conversation"
        assert "start a new one with the whole history" in str(error.value)
    assert_no_conversations_left(client)


def test_leaving_the_block_ends_the_conversation(client):
    with client.conversation("llama", **GREEDY) as chat:
        chat.send([3, 4])
    with pytest.raises(UnknownConversationError):
        client.infer("llama", {"tokens": [5], "conversation": chat.id, **GREEDY})
    with client.conversation("llama") as unused:  # no turn: nothing to end
        assert unused.end() is None
    with pytest.raises(ZeroDivisionError):  # the block's error is the one raised, after ending it
        with client.conversation("llama", **GREEDY) as chat:
            chat.send([3, 4])
            1 / 0
    assert_no_conversations_left(client)


def test_a_turn_needs_tokens_or_a_prompt(client):
    chat = client.conversation("llama")
    with pytest.raises(TypeError, match="tokens or a prompt"):
        chat.send()
    with pytest.raises(TypeError, match="tokens or a prompt"):
        chat.send([1], prompt="hello")


def test_a_cancelled_turn_leaves_the_conversation_as_it_was(client):
    history = []
    with client.conversation("llama", **GREEDY) as chat:
        history += [5, 6] + chat.send([5, 6])["tokens"]
        stream = chat.stream([7], max_new_tokens=200)
        next(iter(stream))
        stream.cancel()
        try:
            history += [7] + stream.result().outputs["tokens"]  # it finished before the cancel came
        except CancelledError:
            pass
        assert chat.send([8])["tokens"] == stateless(client, history, [8])
    assert_no_conversations_left(client)


# the command line --------------------------------------------------------------------------------
def chat(monkeypatch, capsys, address: str, lines: str, *flags: str) -> tuple[int, list[dict], list[dict]]:
    """`batchmaker client chat llama` with `lines` on stdin: (exit status, stdout's JSON lines,
    stderr's JSON lines)."""
    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    status = main(["client", "chat", "llama", json.dumps(GREEDY), "--address", address, "--timeout", "60", *flags])
    out, err = capsys.readouterr()
    return status, [json.loads(line) for line in out.splitlines()], [json.loads(line) for line in err.splitlines()]


@pytest.mark.parametrize("flags", [(), ("--stream",)])
def test_chat_sends_a_turn_per_line_and_ends_the_conversation_at_eof(served, client, monkeypatch, capsys, flags):
    status, out, err = chat(monkeypatch, capsys, served, "5 17 42\n\n7, 8\n[9]\n", *flags)
    assert status == 0 and err == []
    replies = [line["outputs"] for line in out if "outputs" in line]
    history = []
    for prompt, reply in zip([[5, 17, 42], [7, 8], [9]], replies, strict=True):
        assert reply["tokens"] == stateless(client, history, prompt)
        history += prompt + reply["tokens"]
    partials = [p["partial"]["tokens"][0] for p in out if "partial" in p]
    assert partials == (history[3:9] + history[11:17] + history[18:] if flags else [])
    id = replies[0]["conversation"]
    assert out[-1] == {"conversation": id, "ended": True, "turns": 3}
    assert_no_conversations_left(client)


def test_chat_reports_a_bad_turn_and_goes_on(served, client, monkeypatch, capsys):
    status, out, err = chat(monkeypatch, capsys, served, "5 17 42\nfive\n600\n7 8\n")
    assert status == 1
    assert [e["error"] for e in err] == ["bad_request", "bad_request"]
    assert "expected token ids" in err[0]["message"] and "600" in err[1]["message"]
    first, second = (line["outputs"] for line in out[:2])
    assert second["tokens"] == stateless(client, [5, 17, 42] + first["tokens"], [7, 8])
    assert out[2] == {"conversation": first["conversation"], "ended": True, "turns": 2}
    assert_no_conversations_left(client)


@pytest.mark.parametrize("argv, message", [
    (["client", "chat"], "chat needs MODEL"),
    (["client", "chat", "llama", "[1, 2]"], "the settings must be a JSON object"),
])
def test_chat_mistakes_print_one_line(served, capsys, argv, message):
    assert main([*argv, "--address", served]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_chat_with_text_on_a_model_with_a_tokenizer(client, tmp_path, monkeypatch, capsys):
    pytest.importorskip("safetensors")
    pytest.importorskip("tokenizers")
    from test_serving_decoders import save_checkpoint

    save_checkpoint(tmp_path)  # the weights of the served tiny Llama; word i is "w{i}"
    model = build_model("llama", checkpoint=str(tmp_path), num_blocks=32, max_tokens=32)
    with Engine([model]) as engine, Server(engine, ServerConfig("tcp://127.0.0.1:*")) as server:
        status, out, err = chat(monkeypatch, capsys, server.address, "w5 w17 w42\nw7 w8\n", "--text")
    assert status == 0 and err == []
    first, second = (line["outputs"] for line in out[:2])
    assert first["tokens"] == stateless(client, [], [5, 17, 42])
    assert second["tokens"] == stateless(client, [5, 17, 42] + first["tokens"], [7, 8])
    assert second["text"] == " ".join(f"w{t}" for t in second["tokens"])
