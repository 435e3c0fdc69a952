"""The HTTP front is optional: without aiohttp, jinja2 and prometheus-client (the `http` extra),
`batchmaker serve` serves over ZeroMQ as before, and `--http` is refused with what to install."""
import subprocess
import sys
import tempfile

import pytest

pytest.importorskip("zmq")

# the console script, in a process where the http extra's modules cannot be imported
WITHOUT_HTTP = ("import sys; sys.path.remove('')\n"
                "for name in ('aiohttp', 'jinja2', 'prometheus_client', 'openai'): sys.modules[name] = None\n"
                "from batchmaker.serving.cli import main; sys.exit(main())")


def test_serve_without_the_http_extra_still_serves_zeromq():
    from batchmaker.serving.client import Client

    address = f"ipc://{tempfile.mkdtemp(prefix='bm-')}/s"
    proc = subprocess.Popen([sys.executable, "-c", WITHOUT_HTTP, "serve", "--models", "lstm", "--set", "hidden=8",
                             "--set", "embed=8", "--address", address], stderr=subprocess.PIPE, text=True)
    try:
        with Client(address, timeout=60) as client:
            assert client.infer("lstm", {"tokens": [5, 6]})["h"].shape == (8,)
        proc.terminate()
        assert proc.wait(30) == 0
    finally:
        proc.kill()
    refused = subprocess.run([sys.executable, "-c", WITHOUT_HTTP, "serve", "--models", "lstm", "--http",
                              "127.0.0.1:8000"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2
    assert "--http needs aiohttp, jinja2, prometheus_client: pip install 'batchmaker[http]'" in refused.stderr
