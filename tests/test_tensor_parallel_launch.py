"""A tensor- or pipeline-parallel decoder (or both) over ranks a launcher started: `torchrun
--nproc-per-node 2 -m batchmaker.serving.cli serve ...`, the same command in both processes,
exactly as on several hosts (exec/tensor_launch.py), here on one host with gloo. Rank 0 serves over ZeroMQ and plans;
rank 1 runs its plans. The tokens are those of one rank in one process; stopping torchrun leaves
no process behind."""
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
from helpers import ipc_address
from test_tensor_parallel_engine import serve, workload

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
