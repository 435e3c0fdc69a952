"""The command line: one-line errors, --set checked against the models' factories, help texts,
module:attribute from the current directory, start-up without torch, and the demo's progress."""
import io
import json
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

zmq = pytest.importorskip("zmq")  # the GPU machine has no pyzmq: skip there, do not fail collection

from batchmaker.serving.cli import UsageError, main  # noqa: E402
from helpers import ipc_address  # noqa: E402

TESTS = Path(__file__).resolve().parent
# The console script's view: unlike `python -m` or `-c`, the current directory is not on sys.path.
AS_CONSOLE_SCRIPT = "import sys; sys.path.remove(''); from batchmaker.serving.cli import main; sys.exit(main())"


@pytest.mark.parametrize("argv, message", [
    (["serve", "--models", "lstm,nope"], "unknown model 'nope'; registered: llama, lstm, opt, seq2seq, treelstm"),
    (["serve", "--set", "hidden=abc"], "--set hidden: expected an integer, got 'abc'"),
    (["serve", "--set", "hiden=64"], "--set hiden: unknown key for lstm, seq2seq, treelstm; valid keys: dtype, embed"),
    (["serve", "--models", "lstm", "--set", "max_len=5"], "--set max_len: unknown key for lstm"),
    (["serve", "--set", "dtype=int7"], "--set dtype: expected a floating dtype"),
    (["serve", "--set", "hidden"], "--set expects KEY=VALUE"),
    (["serve", "--models", "no_such_module_here:model"], "cannot load model 'no_such_module_here:model'"),
    (["serve", "--address", "127.0.0.1:5555"], "did you mean tcp://127.0.0.1:5555?"),
    (["serve", "--devices", "cpu,cuda:99"], "--devices cuda:99: "),
    (["serve", "--devices", "tpu"], "--devices tpu: expected cpu or cuda:N"),
    (["serve", "--replicas", "--http", "127.0.0.1:0"], "--http serves decoders, --replicas the RNN"),
    (["serve", "--models", "lstm,llama", "--replicas"], "--replicas: llama is a decoder; replicas serve the RNN"),
    (["serve", "--models", "lstm", "--replicas", "--set", "hiden=8"], "--set hiden: unknown key for lstm"),
    (["serve", "--curve-secret-key", "/no/such.key", "--curve-clients", "/no/a.pub"], "/no/such.key: No such file"),
    (["serve", "--curve-secret-key", "/no/such.key"], "needs both --curve-secret-key and --curve-clients"),
    (["demo", "--device", "cuda:99"], "--device cuda:99: "),
    (["client", "health", "--address", "localhost:5555"], "did you mean tcp://localhost:5555?"),
    (["client", "infer", "lstm"], "infer needs MODEL and INPUTS"),
    (["client", "health", "--curve-server-key", "/no/server.pub"], "needs both --curve-server-key"),
])
def test_mistakes_print_one_line_and_exit_non_zero(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and err.startswith(f"batchmaker {argv[0]}: error: ")


def test_debug_or_the_debug_log_level_raise_with_the_traceback():
    with pytest.raises(UsageError, match="unknown model"):
        main(["--debug", "serve", "--models", "nope"])
    with pytest.raises(UsageError, match="--set hidden"):
        main(["serve", "--log-level", "debug", "--set", "hidden=x"])


def test_a_port_in_use_is_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run([sys.executable, "-c", AS_CONSOLE_SCRIPT, "serve", "--models", "lstm", "--set", "hidden=8",
                              "--address", f"tcp://127.0.0.1:{port}"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert run.stderr.count("\n") == 1 and "Address already in use" in run.stderr and "Traceback" not in run.stderr


def test_help_shows_defaults_model_options_and_a_text_for_every_option(capsys):
    with pytest.raises(SystemExit) as done:
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal's width
    assert done.value.code == 0
    assert "lstm: vocab=30000 embed=256 hidden=256 seed=0 dtype=float32 max_batch=512" in out
    assert "max_len=50" in out and "(default: tcp://127.0.0.1:5555)" in out and "(default: 4096)" in out
    for argv, texts in ((["client", "--help"], ["server's tcp://", "higher runs first", "deadline_exceeded",
                                                "(default: 30.0)"]),
                        (["demo", "--help"], ["seed of the arrivals", "(default: 20.0)", "(default: 10.0)"])):
        with pytest.raises(SystemExit):
            main(argv)
        out = " ".join(capsys.readouterr().out.split())
        assert all(text in out for text in texts), out


def test_help_and_client_queries_start_without_torch():
    """A subprocess so that nothing is imported yet: the package, the CLI and the client's
    queries need no torch (batchmaker/__init__ loads its names on first use)."""
    code = """
import sys
from batchmaker.serving.cli import main
try:
    main(["--help"])
except SystemExit:
    pass
main(["client", "health", "--address", "tcp://127.0.0.1:9", "--timeout", "0.2"])  # nobody there
print(sorted(m for m in ("torch", "numpy") if m in sys.modules))
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.stdout.splitlines()[-1] == "[]", run.stdout + run.stderr
    assert "CurveZMQ" in json.loads(run.stderr.splitlines()[-1])["message"]  # "never connected: ... CurveZMQ key?"


def test_serve_finds_module_attribute_in_the_current_directory_and_stops_on_sigterm(capsys):
    address = ipc_address()
    proc = subprocess.Popen([sys.executable, "-c", AS_CONSOLE_SCRIPT, "serve", "--address", address,
                             "--models", "lstm,toy:toy_model", "--set", "hidden=8", "--set", "embed=8",
                             "--set", "vocab=50"], cwd=TESTS, stderr=subprocess.PIPE, text=True)
    try:
        assert main(["client", "health", "--address", address, "--timeout", "60"]) == 0
        assert json.loads(capsys.readouterr().out)["models"] == ["lstm", "toy"]
        assert main(["client", "infer", "toy", '{"xs": [1, 2]}', "--address", address, "--stream"]) == 0
        lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert [p["partial"]["ys"][0] for p in lines[:-1]] == lines[-1]["outputs"]["ys"]
        assert main(["client", "infer", "lstm", '{"tokens": [99]}', "--address", address]) == 1
        assert json.loads(capsys.readouterr().err)["error"] == "bad_request"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert "serving lstm, toy on ipc://" in proc.stderr.read()
    finally:
        proc.kill()


def test_demo_runs_drains_and_prints_plain_progress_lines_when_not_on_a_terminal(capsys):
    from batchmaker.serving.demo import run_demo

    assert run_demo(duration=1.5, rate=4, device="cpu", seed=0) == 0
    captured = capsys.readouterr()
    for model in ("lstm", "seq2seq", "treelstm", "llama"):
        assert any(line.split()[:1] == [model] for line in captured.out.splitlines())
    assert "tokens generated" in captured.out
    assert "p90 ms" in captured.out
    progress = captured.err.splitlines()
    assert "\r" not in captured.err and progress  # a file or a pipe gets plain lines
    done, sent = progress[-1].split()[-2].split("/")
    assert "drained" in progress[-1] and done == sent
    assert sum("drained" in line for line in progress) == 1  # (said once)


def test_progress_redraws_one_line_on_a_terminal_and_shows_the_drain():
    from concurrent.futures import Future

    from batchmaker.serving.demo import Progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    finished, running = Future(), Future()
    finished.set_result(None)
    progress = Progress(duration=1.0, stream=Terminal())
    progress.show(0.5, [("m", finished), ("m", running)])
    progress.show(1.2, [("m", finished), ("m", running)], final=True)  # final: shown even within the interval
    text = progress.stream.getvalue()
    assert text.count("\r") == 2 and text.endswith("\n")
    assert "0.5/1 s  1/2 done" in text and "draining at 1.2 s  1/2 done" in text


def test_a_tensor_parallel_decoders_ranks_must_be_in_devices():
    from batchmaker.serving.cli_models import UsageError, check_rank_devices
    with pytest.raises(UsageError, match="--devices lacks cuda:1"):
        check_rank_devices("llama", "cuda:0", 2, ("cuda:0",))
    with pytest.raises(UsageError, match="cuda:2 to cuda:5; --devices lacks cuda:4, cuda:5"):
        check_rank_devices("llama", "cuda:2", 4, ("cuda:2", "cuda:3"))
    check_rank_devices("llama", "cuda:0", 2, ("cuda:0", "cuda:1"))
    check_rank_devices("llama", "cpu", 2, ("cpu",))  # (CPU ranks: processes beside the worker)
    with pytest.raises(UsageError, match="tensor_parallel=2 pipeline_parallel=2: .* cuda:0 to cuda:3; "
                                         "--devices lacks cuda:2, cuda:3"):
        check_rank_devices("llama", "cuda:0", 2, ("cuda:0", "cuda:1"), 2)


@pytest.mark.parametrize("http, items, want", [
    (True, [], True),  # served over HTTP: OpenAI clients resend their history
    (True, ["llama.prefix_caching=false"], False),  # told otherwise
    (True, ["prefix_caching=false"], False),
    (False, [], False),  # ZeroMQ only: the factory's default
])
def test_decoders_served_over_http_get_prefix_caching_unless_told_otherwise(http, items, want):
    from batchmaker.serving.cli_models import load_models
    models = load_models(["llama", "lstm"], items, ("cpu",), http=http)
    assert [c.kv.prefix_caching for m in models for c in m.cells.values() if hasattr(c, "kv")] == [want]
