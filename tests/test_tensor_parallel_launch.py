"""A tensor- or pipeline-parallel decoder (or both) over ranks a launcher started: `torchrun
--nproc-per-node 2 -m batchmaker.serving.cli serve ...`, the same command in both processes,
exactly as on several hosts (exec/tensor_launch.py), here on one host with gloo. Rank 0 serves over ZeroMQ and plans;
rank 1 runs its plans. The tokens are those of one rank in one process; stopping torchrun leaves
no process behind. Without a launcher `batchmaker serve` starts the other ranks itself: the same
checks, from the command line."""
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from batchmaker.launch import launched
from batchmaker.registry import build_model
from batchmaker.serving.cli import main
from helpers import ipc_address, is_running, wait_until
from test_generation import hf_greedy
from test_tensor_parallel_engine import save_tiny, serve, workload

pytest.importorskip("zmq")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def processes_naming(text: str) -> list[int]:
    """Pids of live processes whose command line contains `text`."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(entry.name))
        except OSError:
            pass
    return pids


def descendants(pid: int) -> list[int]:
    """Pids of the processes below `pid` (its children, theirs, ...), read from /proc."""
    parents = {}
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit():
                parents[int(entry.name)] = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
        except OSError:
            pass
    found, frontier = [], {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier}
        found += frontier
    return found


def test_serve_starts_the_ranks_itself_and_sigterm_stops_every_one(capsys, tmp_path):
    """One host, no launcher: `batchmaker serve` starts rank 1 itself (CPU ranks, gloo), an LSTM
    served beside; the tokens are HF's for a checkpoint each rank reads its slices of, and SIGTERM
    ends the server and every process it started."""
    hf = save_tiny("llama-one-kv", tmp_path)
    address = ipc_address()
    command = [sys.executable, "-m", "batchmaker.serving.cli", "serve", "--models", "lstm,llama", "--set",
               "lstm.hidden=8", "--set", "lstm.embed=8", "--set", f"llama.checkpoint={tmp_path}", "--set",
               "llama.max_tokens=48", "--set", "llama.tensor_parallel=2", "--devices", "cpu,cpu", "--address", address]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    requests = [r for r in workload(random.Random(4), "llama", n=6) if "temperature" not in r[1]]
    try:
        assert main(["client", "health", "--address", address, "--timeout", "120"]) == 0
        started = descendants(proc.pid)
        assert any(b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes() for pid in started)  # (rank 1)
        capsys.readouterr()
        for _, inputs in requests:
            assert main(["client", "infer", "llama", json.dumps(inputs), "--address", address]) == 0
            tokens = json.loads(capsys.readouterr().out)["outputs"]["tokens"]
            assert tokens == hf_greedy(hf, inputs["tokens"], inputs["max_new_tokens"])
        assert main(["client", "infer", "lstm", '{"tokens": [5, 6]}', "--address", address]) == 0
        assert len(json.loads(capsys.readouterr().out)["outputs"]["h"]) == 8
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert "serving lstm, llama on ipc://" in proc.stderr.read()
    finally:
        proc.kill()
    wait_until(lambda: not any(is_running(pid) for pid in started), timeout=10)


@pytest.mark.parametrize("parallel", [("tensor_parallel",), ("pipeline_parallel",),
                                      ("tensor_parallel", "pipeline_parallel")],  # (2 x 2: four ranks)
                         ids=["tp", "pp", "tp-pp"])
def test_torchrun_ranks_serve_the_tokens_of_one_rank(capsys, parallel):
    address, ranks = ipc_address(), 2 ** len(parallel)
    sets = [arg for key in parallel for arg in ("--set", f"llama.{key}=2")]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr",
               "127.0.0.1", "--master-port", str(free_port()), "-m", "batchmaker.serving.cli", "serve", "--models",
               "llama", "--set", "llama.seed=2", "--set", "llama.max_tokens=48", *sets, "--address", address]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    requests = [r for r in workload(random.Random(7), "llama", n=6)]
    got = []
    try:
        assert main(["client", "health", "--address", address, "--timeout", "120"]) == 0, proc.stdout.read()
        capsys.readouterr()
        for _, inputs in requests:
            assert main(["client", "infer", "llama", json.dumps(inputs), "--address", address]) == 0
            got.append(json.loads(capsys.readouterr().out)["outputs"]["tokens"])
        os.killpg(proc.pid, signal.SIGTERM)
        output = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert f"rank {ranks - 1} of {ranks}: following rank 0" in output, output
    deadline = time.monotonic() + 10
    while processes_naming(address) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not processes_naming(address)
    assert got == serve(build_model("llama", seed=2, max_tokens=48), requests, seed=0)


def test_a_launched_world_is_read_from_the_environment():
    env = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500",
           "TORCHELASTIC_USE_AGENT_STORE": "True"}
    launch = launched(env)
    assert (launch.rank, launch.size, launch.master_addr, launch.master_port, launch.agent_store) == \
        (1, 2, "10.0.0.5", 29500, True)
    assert launch.device("cuda") == "cuda:1" and launch.device("cpu") == "cpu"
    assert launched({"WORLD_SIZE": "1"}) is None and launched({}) is None
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        launched({"WORLD_SIZE": "2", "RANK": "0"})


def test_under_a_launcher_the_group_is_the_world(monkeypatch):
    for key, value in {"WORLD_SIZE": "4", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match="WORLD_SIZE=4"):
        build_model("llama", tensor_parallel=2)
