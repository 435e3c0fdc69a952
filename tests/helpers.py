"""What several test files share: waiting for an idle engine, concurrent submitters, small model
settings, the Seq2Seq weights that make decoding vary, and the GPU/Triton markers (fixtures live
in conftest.py)."""
import atexit
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from batchmaker import build_model

try:
    import triton  # noqa: F401
    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

PRODUCT_TOLERANCE = {  # (rtol, atol) of a projection kernel against its twin, outputs of O(1): fp32 sums in
    # another order, 1 ulp of the output (tests/test_gemv.py, tests/test_skinny.py)
    torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
needs_gpu = pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs a CUDA device and triton")
interpreter = pytest.mark.skipif(not (HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"),
                                 reason="set TRITON_INTERPRET=1 (with triton installed) to run kernels on the CPU")


def _index_one_element_tensors() -> None:
    """Triton's interpreter (3.5 too) turns a scalar into a Python int with int() of its 1-element
    array, which NumPy 2 refuses: loops bounded by loaded values (paged attention's) fail. Tests
    only: take the element instead."""
    from triton.runtime import interpreter as interp
    patch = interp._patch_lang_tensor

    def patch_lang_tensor(tensor):
        patch(tensor)
        tensor.__index__ = lambda self: int(self.handle.data.reshape(-1)[0])
    interp._patch_lang_tensor = patch_lang_tensor


if HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1":
    _index_one_element_tensors()


def run_interpreted(test_file: str, name: str, timeout: float) -> str:
    """Run test `name` of `test_file` in a subprocess under TRITON_INTERPRET=1 (it must be set
    before triton is imported), on machines with triton but no GPU; returns pytest's output."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("interpreting already: the kernel test runs in this process")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the GPU tests run the kernels themselves")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-k", name],
                          capture_output=True, text=True, env=env, cwd=Path(test_file).parent.parent, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def passes_gpu_checks(checkpoint: str) -> None:
    """Building `checkpoint` for a GPU passes every check of the model (unfolders/decoders.py): it
    builds where a CUDA device is, else only the device check, the last, refuses it."""
    if torch.cuda.is_available():
        build_model("llama", checkpoint=checkpoint, device="cuda")
        return
    with pytest.raises(ValueError, match="ranks need cuda.*CUDA devices"):
        build_model("llama", checkpoint=checkpoint, device="cuda")


def wait_idle(engine, timeout=10.0):
    """Accounting is checked once the engine is idle: no live nodes, no rows held."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.stats()
        if s["num_live_nodes"] == 0 and not any(s["num_rows_used"]) and not any(s["num_tasks_in_flight"]):
            return s
        time.sleep(0.01)
    raise AssertionError(f"engine not idle: {engine.stats()}")


def wait_until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.002)


def is_running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for whoever reaps orphans here)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def submit_concurrently(engine, model_name, inputs_list, seed, num_threads=4):
    """Submit from several threads with random gaps so requests join running work mid-flight."""
    futures: list = [None] * len(inputs_list)

    def run(k):
        rng = random.Random(seed * 100 + k)
        for i in range(k, len(inputs_list), num_threads):
            time.sleep(rng.random() * 0.002)
            futures[i] = engine.submit(model_name, inputs_list[i])

    threads = [threading.Thread(target=run, args=(k,)) for k in range(num_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return futures


def assert_rows_unique(engine) -> None:
    """After stop: every row of every pool can be handed out exactly once (no double free that a
    leak elsewhere would hide from num_rows_used)."""
    for worker in engine.workers:
        for pool in worker.memory.pools.values():
            rows = [pool.alloc() for _ in range(pool.capacity - 1 - (pool._scratch is not None))]
            assert len(set(rows)) == len(rows) and 0 not in rows and pool._scratch not in rows


def sharp_seq2seq(seed: int, structured: bool = True, scale: float = 20.0):
    """uniform(-0.1, 0.1) weights decode one repeated token; x20 makes decoding vary and hit EOS."""
    model = build_model("seq2seq", vocab=8, embed=12, hidden=16, seed=seed, max_len=20, structured=structured)
    with torch.no_grad():
        for cell in model.cells.values():
            for p in cell.parameters():
                p.mul_(scale)
    return model


def ipc_address() -> str:
    """A ZeroMQ ipc address in a folder of its own, removed when the test run ends (ipc paths must
    stay under ~100 bytes: pytest's tmp_path can be longer)."""
    folder = tempfile.mkdtemp(prefix="bm-")
    atexit.register(shutil.rmtree, folder, True)
    return f"ipc://{folder}/s"


def save_perturbed(config_class, model_class, config: dict, path) -> torch.nn.Module:
    """A tiny HF model with every weight perturbed (biases and norms too), in fp32, saved with
    `save_pretrained` as users have it; returns it (eval mode)."""
    torch.manual_seed(0)
    hf = model_class(config_class(**config))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    hf = hf.float().eval()
    hf.save_pretrained(path)
    return hf
