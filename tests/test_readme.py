"""Every ```python block of README.md and docs/protocol.md runs as written, each in a fresh
interpreter. A block that names the default server address gets a server (the built-in models,
small, and the tiny Llama, in this process) and the address is swapped for the test server's.

A block that cannot run in CI is preceded by a line `<!-- not run by tests: REASON -->`.
"""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "docs/protocol.md")
SERVER_ADDRESS = "tcp://127.0.0.1:5555"  # what the snippets connect to, as `batchmaker serve` binds
NOT_RUN = re.compile(r"<!-- not run by tests: (.*) -->")
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def snippets():
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        for block in BLOCK.finditer(text):
            line = text.count("\n", 0, block.start()) + 1
            previous = text[:block.start()].rstrip("\n").rpartition("\n")[2]
            skip = NOT_RUN.fullmatch(previous.strip())
            marks = [pytest.mark.skip(reason=skip.group(1))] if skip else []
            yield pytest.param(block.group(1), id=f"{doc}:{line}", marks=marks)


@pytest.fixture(scope="module")
def server_address():
    pytest.importorskip("zmq")
    from batchmaker import Engine, Server, ServerConfig, build_model

    small = dict(embed=16, hidden=16)  # the snippets' token ids need the default vocab
    models = [build_model(name, **small) for name in ("lstm", "seq2seq", "treelstm")]
    models.append(build_model("llama", num_blocks=64, max_tokens=32))  # tiny-llama, as `serve --models llama`
    with Engine(models) as engine, Server(engine, ServerConfig("tcp://127.0.0.1:*")) as server:
        yield server.address


def test_the_docs_have_snippets_and_some_need_a_server():
    codes = [param.values[0] for param in snippets()]
    assert len(codes) >= 4 and sum(SERVER_ADDRESS in code for code in codes) >= 2


@pytest.mark.parametrize("code", list(snippets()))
def test_snippet_runs_as_written(code, request, tmp_path):
    if SERVER_ADDRESS in code:
        code = code.replace(SERVER_ADDRESS, request.getfixturevalue("server_address"))
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"stdout:\n{run.stdout}\nstderr:\n{run.stderr}"
