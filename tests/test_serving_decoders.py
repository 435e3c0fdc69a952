"""Decoder Transformers over ZeroMQ (a tiny seeded Llama on a loopback server): generation options,
streaming, typed bad requests with their ids, cancel and deadline mid-stream, the models reply,
numpy inputs, and `batchmaker serve` on a HF-style checkpoint with a tokenizer (text prompts)."""
import json
import subprocess
import sys
import time

import msgpack
import numpy as np
import pytest

zmq = pytest.importorskip("zmq")  # the GPU machine has no pyzmq: skip there, do not fail collection

from batchmaker import Engine, Model, build_model  # noqa: E402
from batchmaker.cells.checkpoint import hf_names  # noqa: E402
from batchmaker.cells.decoder import build_decoder  # noqa: E402
from batchmaker.cells.decoder_config import PRESETS, to_hf  # noqa: E402
from batchmaker.errors import BadRequestError, CancelledError, DeadlineExceededError  # noqa: E402
from batchmaker.serving.cli import main  # noqa: E402
from batchmaker.serving.client import Client  # noqa: E402
from batchmaker.serving.server import Server, ServerConfig  # noqa: E402
from helpers import ipc_address, wait_idle, wait_until  # noqa: E402

MAX_LEN = PRESETS["tiny-llama"].max_positions  # 256
GREEDY = {"max_new_tokens": 12, "ignore_eos": True}
SAMPLED = {"max_new_tokens": 12, "temperature": 0.9, "top_k": 40, "top_p": 0.9, "seed": 1234, "ignore_eos": True}
AS_CONSOLE_SCRIPT = "import sys; sys.path.remove(''); from batchmaker.serving.cli import main; sys.exit(main())"


@pytest.fixture(scope="module")
def served():
    """(engine, server address): the tiny Llama (preset tiny-llama, seed 0) on a loopback server."""
    model = build_model("llama", num_blocks=64, max_tokens=32)
    with Engine([model]) as engine, Server(engine, ServerConfig("tcp://127.0.0.1:*")) as server:
        yield engine, server.address


def blocks_in_use(engine) -> int:
    return sum(q.blocks.num_used for q in engine.structured["llama"].queue.sequences.values())


def test_generation_options_over_the_wire_give_the_in_process_tokens(served):
    engine, address = served
    prompt = [5, 17, 42, 99]
    with Client(address, timeout=30) as client:
        for options in (GREEDY, SAMPLED):
            request = {"tokens": prompt, **options}
            got = client.infer("llama", request)
            assert got == engine.infer("llama", request, timeout=30)
            assert got["finish_reason"] == "length" and len(got["tokens"]) == 12
            assert all(type(t) is int for t in got["tokens"])
        greedy = client.infer("llama", {"tokens": prompt, **GREEDY})["tokens"]
        stop = greedy[2]
        cut = client.infer("llama", {"tokens": prompt, **GREEDY, "stop_token_ids": [stop]})
        assert cut == {"tokens": greedy[:greedy.index(stop) + 1], "finish_reason": "stop"}
        assert client.infer("llama", {"tokens": prompt, "max_new_tokens": 0}) == {"tokens": [],
                                                                                  "finish_reason": "length"}
        # numpy values: an int64 array travels as a tensor, numpy scalars as ints
        as_numpy = {"tokens": np.array(prompt), **SAMPLED, "seed": np.int64(1234), "top_k": np.int32(40)}
        assert client.infer("llama", as_numpy) == engine.infer("llama", {"tokens": prompt, **SAMPLED})


def test_streamed_tokens_come_one_per_partial_before_the_result_and_make_it_up(served):
    _, address = served
    events = []
    with Client(address, timeout=30) as client:
        future = client.submit("llama", {"tokens": [7, 8, 9], **SAMPLED}, on_partial=events.append)
        future.add_done_callback(lambda f: events.append("done"))
        tokens = future.result().outputs["tokens"]
        wait_until(lambda: events and events[-1] == "done")
        assert events[-1] == "done" and all(len(p["tokens"]) == 1 for p in events[:-1])
        assert [p["tokens"][0] for p in events[:-1]] == tokens
        stream = client.stream("llama", {"tokens": [7, 8, 9], **SAMPLED})
        assert [t for p in stream for t in p["tokens"]] == stream.result().outputs["tokens"] == tokens


def test_the_wire_format_of_partials_results_and_errors(served):
    """A client of pyzmq and msgpack only (docs/protocol.md)."""
    _, address = served
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)

    def replies(message: dict) -> list[dict]:
        sock.send(msgpack.packb({"v": 1, "op": "infer", "model": "llama", **message}))
        out = []
        while not out or out[-1]["type"] == "partial":
            assert sock.poll(30_000), "no reply in 30 s"
            out.append(msgpack.unpackb(sock.recv()))
        return out

    try:
        got = replies({"id": "gen-1", "inputs": {"tokens": [3, 4], "max_new_tokens": 5, "ignore_eos": True},
                       "stream": True})
        partials, final = got[:-1], got[-1]
        assert all(r["type"] == "partial" and r["id"] == "gen-1" and list(r["value"]) == ["tokens"] for r in partials)
        assert final["type"] == "result" and final["id"] == "gen-1"
        streamed = [t for r in partials for t in r["value"]["tokens"]]
        assert final["value"] == {"tokens": streamed, "finish_reason": "length"}
        assert set(final["timing"]) == {"queueing_ms", "computation_ms", "latency_ms"}
        [error] = replies({"id": 7, "inputs": {"tokens": []}, "stream": True})
        assert error["type"] == "error" and error["id"] == 7 and error["code"] == "bad_request"
        assert "tokens" in error["message"]
    finally:
        sock.close()


@pytest.mark.parametrize("inputs, message", [
    ({"tokens": []}, "tokens: the prompt is empty"),
    ({"tokens": [1] * MAX_LEN}, f"the model's maximum is {MAX_LEN}"),
    ({"tokens": [600]}, "out of range [0, 512)"),
    ({"tokens": "hello"}, "tokens: expected a list of integer ids"),
    ({"tokens": [1, True]}, "tokens[1]"),
    ({"tokens": [1], "max_new_tokens": 2.5}, "max_new_tokens: expected an integer >= 0"),
    ({"tokens": [1], "temperature": "hot"}, "temperature: expected a number"),
    ({"tokens": [1], "top_k": -1}, "top_k: expected an integer >= 0"),
    ({"tokens": [1], "top_p": 0}, "top_p: expected a number in (0, 1]"),
    ({"tokens": [1], "seed": 1.5}, "seed: expected a 64-bit integer"),
    ({"tokens": [1], "ignore_eos": "yes"}, "ignore_eos: expected true or false"),
    ({"tokens": [1], "stop_token_ids": list(range(3, 12))}, "stop_token_ids: at most 7"),
    ({"tokens": [1], "beam_width": 4}, "unexpected input(s) ['beam_width']"),
    ({"prompt": "hello"}, "has no tokenizer"),
])
def test_a_bad_request_is_a_typed_error_and_the_server_goes_on(served, inputs, message):
    _, address = served
    with Client(address, timeout=30) as client:
        future = client.submit("llama", inputs)
        with pytest.raises(BadRequestError) as error:
            future.result()
        assert message in str(error.value)
        assert client.infer("llama", {"tokens": [1, 2], "max_new_tokens": 2, "ignore_eos": True})["tokens"]


def test_cancel_mid_stream_and_a_deadline_free_the_sequence(served):
    engine, address = served
    got = []
    with Client(address, timeout=30) as client:
        stream = client.stream("llama", {"tokens": [3, 4, 5], "max_new_tokens": 200, "ignore_eos": True})
        with pytest.raises(CancelledError):
            for partial in stream:
                got.append(partial)
                if len(got) == 3:
                    assert stream.cancel()
        assert 3 <= len(got) < 200
        late = client.submit("llama", {"tokens": [3, 4, 5], "max_new_tokens": 200, "ignore_eos": True}, deadline=0.05)
        with pytest.raises(DeadlineExceededError):
            late.result()
        assert client.stats()["server"]["num_in_flight"] == 0
    wait_idle(engine)
    wait_until(lambda: blocks_in_use(engine) == 0)


def test_a_client_that_disconnects_mid_generation_frees_its_kv_blocks(served):
    """Streams and plain requests of a client that goes away are cancelled: their sequences
    leave and their blocks (and a conversation turn's) are free again; the server goes on."""
    engine, address = served
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(address)
    long = {"tokens": [3, 4, 5], "max_new_tokens": 200, "ignore_eos": True}
    for i, extra in enumerate([{}, {"conversation": True}, {"tokens": list(range(1, 60))}]):
        sock.send(msgpack.packb({"v": 1, "op": "infer", "id": i, "model": "llama", "inputs": {**long, **extra},
                                 "stream": i == 0}))
    wait_until(lambda: blocks_in_use(engine) >= 3)
    sock.close(linger=0)
    wait_idle(engine)
    wait_until(lambda: blocks_in_use(engine) == 0)
    with Client(address, timeout=30) as client:
        assert client.stats()["server"]["num_in_flight"] == 0
        assert len(client.infer("llama", {"tokens": [1, 2], **GREEDY})["tokens"]) == 12


def test_the_models_reply_documents_the_decoder_inputs(served):
    _, address = served
    with Client(address, timeout=30) as client:
        llama = client.models()["llama"]
    assert set(llama["input_schema"]) == {"tokens", "max_new_tokens", "temperature", "top_k", "top_p", "seed",
                                          "stop_token_ids", "ignore_eos", "conversation", "end"}
    assert "prompt" in llama["input_schema"]["tokens"] and llama["streamed_outputs"] == ["tokens"]
    assert llama["cells"] == ["decoder"] and llama["batch_sizes"]["decoder"][-1] == 32


# the command line -------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--models", "llama", "--set", "opt.preset=tiny-opt"], "--set opt.preset: 'opt' is not a served registered model"),
    (["--models", "llama,lstm", "--set", "lstm.preset=x"], "--set lstm.preset: unknown key for lstm; valid keys:"),
    (["--models", "llama", "--set", "device=cuda:0"], "model llama would be built on cuda:0, but it is served on cpu"),
    (["--models", "llama", "--set", "llama.checkpoint=/no/such/dir"], "cannot build model llama with checkpoint="),
    (["--models", "llama", "--set", "preset=llama-3"], "unknown preset 'llama-3'"),
])
def test_decoder_options_on_the_command_line_are_checked(capsys, argv, message):
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def save_checkpoint(path, seed: int = 0) -> None:
    """tiny-llama with the weights of `build_model("llama", seed=seed)` as a HF-style directory:
    config.json, model.safetensors (q/k/v and gate/up split back into HF's tensors), and a
    word-level tokenizer.json whose id i is the word "w{i}"."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = PRESETS["tiny-llama"]
    lm = build_decoder(config, seed=seed)
    widths = {"q_proj": config.num_heads * config.head_dim, "k_proj": config.num_kv_heads * config.head_dim,
              "v_proj": config.num_kv_heads * config.head_dim, "gate_proj": config.intermediate_size,
              "up_proj": config.intermediate_size}
    tensors = {}
    for name, value in lm.state_dict().items():
        names = hf_names(config, name)
        parts = [value] if len(names) == 1 else value.split([widths[n.split(".")[-2]] for n in names])
        tensors.update({n: p.contiguous() for n, p in zip(names, parts)})
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({**to_hf(config), "torch_dtype": "float32"}))
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(config.vocab_size)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))


def test_serve_a_hf_checkpoint_and_stream_text(served, tmp_path, capsys):
    pytest.importorskip("safetensors")
    pytest.importorskip("tokenizers")
    engine, _ = served
    save_checkpoint(tmp_path)
    address = ipc_address()
    proc = subprocess.Popen([sys.executable, "-c", AS_CONSOLE_SCRIPT, "serve", "--address", address,
                             "--models", "llama", "--set", f"llama.checkpoint={tmp_path}", "--set", "num_blocks=32"],
                            stderr=subprocess.PIPE, text=True)
    try:
        assert main(["client", "health", "--address", address, "--timeout", "60"]) == 0
        capsys.readouterr()
        request = json.dumps({"prompt": "w5 w17 w42", **GREEDY})
        assert main(["client", "infer", "llama", request, "--address", address, "--stream"]) == 0
        lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        partials, outputs = [line["partial"] for line in lines[:-1]], lines[-1]["outputs"]
        want = engine.infer("llama", {"tokens": [5, 17, 42], **GREEDY}, timeout=30)["tokens"]  # the same weights
        assert outputs["tokens"] == [p["tokens"][0] for p in partials] == want
        assert outputs["text"] == "".join(p["text"] for p in partials) == " ".join(f"w{t}" for t in want)
        started = time.monotonic()
        proc.terminate()
        assert proc.wait(30) == 0 and time.monotonic() - started < 30
        assert "serving llama on ipc://" in proc.stderr.read()
    finally:
        proc.kill()


def test_a_partial_that_msgpack_cannot_carry_is_dropped_and_the_server_goes_on():
    from toy import EncCell

    def unfold(inputs, g):
        h = g.add("enc", x=inputs["x"], h=None)["h"]
        yield h
        g.stream({"bad": {1, 2}})  # a set: msgpack has no such type
        return {"h": h}

    model = Model("sets", {"enc": EncCell()}, unfold, batch_sizes={"enc": (1, 2)}, streamed_outputs=("bad",))
    with Engine([model]) as engine, Server(engine, ServerConfig("tcp://127.0.0.1:*")) as server, \
            Client(server.address, timeout=30) as client:
        partials = []
        assert client.submit("sets", {"x": 3}, on_partial=partials.append).result().outputs["h"].shape == (4,)
        assert partials == [] and client.health()["status"] == "serving"
