"""The limits of the machine at hand, measured at the start of a run: copy bandwidth and matmul peak.

A roofline or a floor computed from a datasheet (or from another card's numbers) means different
things on an H100 and an H200; one computed from what this device does today means the same thing
on both. `measure()` takes about a second on a GPU and returns a frozen record that a benchmark
writes into its JSON (`asdict(limits)`) and passes to whatever computes a floor:

    limits = device_limits.measure("cuda:0", dtype=torch.bfloat16)
    floor_s = weight_bytes / limits.copy_bytes_per_s          # a batch-1 decode step's floor
    bound_s = max(bytes / limits.copy_bytes_per_s, flops / limits.matmul_flops_per_s)

Copy bandwidth counts the bytes read plus the bytes written by a device-to-device copy of a tensor
much larger than the L2 cache (the way STREAM's copy and KINDS.md count it); the matmul peak is a
square product in the run's dtype on random data. Both are the median of several timed windows
after warm-up (CUDA events on a GPU, the host clock on a CPU).
"""
import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class DeviceLimits:
    device: str  # torch.cuda.get_device_name, or "cpu"
    copy_bytes_per_s: float  # read + written, device-to-device copy
    matmul_flops_per_s: float  # 2 * n^3 per product
    matmul_dtype: str
    copy_bytes: int  # size of the copied tensor
    matmul_n: int
    samples: dict  # the timed windows behind each median, for the record

    def as_dict(self) -> dict:
        return asdict(self)


def measure(device: str = "cuda:0", dtype: torch.dtype = torch.bfloat16, copy_mib: int | None = None,
            matmul_n: int | None = None, windows: int = 5) -> DeviceLimits:
    """Copy bandwidth and matmul peak of `device` now (CPU: fp32 matmul, whatever `dtype` says)."""
    dev = torch.device(device)
    is_cuda = dev.type == "cuda"
    if not is_cuda:
        dtype = torch.float32  # (CPU half-precision matmuls are emulated: no peak worth quoting)
    copy_mib = copy_mib or (1024 if is_cuda else 128)
    matmul_n = matmul_n or (8192 if is_cuda else 1024)
    copy_s = _copy_seconds(copy_mib << 20, dev, windows, repeat=10 if is_cuda else 3)
    gen = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(matmul_n, matmul_n, device=dev, dtype=dtype, generator=gen)
    b = torch.randn(matmul_n, matmul_n, device=dev, dtype=dtype, generator=gen)
    matmul_s = _time(lambda: torch.mm(a, b), dev, windows, repeat=10 if is_cuda else 2)
    copied = 2 * (copy_mib << 20)
    flops = 2.0 * matmul_n ** 3
    return DeviceLimits(
        device=torch.cuda.get_device_name(dev) if is_cuda else "cpu",
        copy_bytes_per_s=copied / statistics.median(copy_s), matmul_flops_per_s=flops / statistics.median(matmul_s),
        matmul_dtype=str(dtype).removeprefix("torch."), copy_bytes=copy_mib << 20, matmul_n=matmul_n,
        samples={"copy_s": copy_s, "matmul_s": matmul_s})


def _copy_seconds(num_bytes: int, dev: torch.device, windows: int, repeat: int) -> list[float]:
    src = torch.empty(num_bytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    return _time(lambda: dst.copy_(src), dev, windows, repeat)


def _time(fn, dev: torch.device, windows: int, repeat: int) -> list[float]:
    """Seconds per call in `windows` timed windows of `repeat` calls each, after two warm-up calls."""
    for _ in range(2):
        fn()
    out = []
    for _ in range(windows):
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeat):
                fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3 / repeat)
        else:
            t0 = time.perf_counter()
            for _ in range(repeat):
                fn()
            out.append((time.perf_counter() - t0) / repeat)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="measure this device's copy bandwidth and matmul peak")
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    args = parser.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    print(json.dumps(measure(args.device, dtype).as_dict(), indent=2))
