"""Run a probe script under a process-wide GPU memory cap (issue 34: both systems under the same
cap): `torch.cuda.set_per_process_memory_fraction(cap / total)` before the probe allocates anything,
then the probe as `__main__` with its own arguments. The probe is not edited: it is run as is.

    python bench/capped_probe.py --cap-gib 16 .probes/offload_probe.py --preset 13b --gpu-gib 6 --batches 16

Out of memory under the cap is the probe's failure, not a crash: one line `out of memory under the
cap of C GiB: ...` and exit status OOM_STATUS. Either way the last line gives the device's peak,
`peak allocated A GiB reserved R GiB`, or says that no GPU applied the cap (a CPU test).
"""
import argparse
import os
import runpy
import sys

import torch

GIB = 1 << 30
OOM_STATUS = 3


ALLOCATOR = "expandable_segments:True"  # both sides under a cap: a 70B run of ours failed with 2.5 GiB reserved
# but unallocated under 72 GiB (2026-11-27), as fragments of the default segments


def apply_cap(cap_gib: float, device: int = 0) -> bool:
    """The cap on `device`'s caching allocator (what it reserves), before any allocation, with
    expandable segments (`ALLOCATOR`, unless PYTORCH_CUDA_ALLOC_CONF says otherwise: read when the
    allocator starts, which setting the fraction does); False without a GPU."""
    if not torch.cuda.is_available():
        return False
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOCATOR)
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * GIB / total), device)
    return True


def peak_line(is_capped: bool, device: int = 0) -> str:
    if not is_capped:
        return "peak: no GPU, the cap was not applied"
    return (f"allocator {os.environ.get('PYTORCH_CUDA_ALLOC_CONF')}; peak allocated {torch.cuda.max_memory_allocated(device) / GIB:.2f} GiB reserved "
            f"{torch.cuda.max_memory_reserved(device) / GIB:.2f} GiB")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cap-gib", type=float, required=True)
    ap.add_argument("probe")
    ap.add_argument("probe_args", nargs=argparse.REMAINDER, help="the probe's own arguments, passed as they are")
    args = ap.parse_args(argv)
    is_capped = apply_cap(args.cap_gib)
    saved, sys.argv = sys.argv, [args.probe, *args.probe_args]
    try:
        runpy.run_path(args.probe, run_name="__main__")
        status = 0
    except torch.OutOfMemoryError as e:
        print(f"out of memory under the cap of {args.cap_gib:g} GiB: {str(e).splitlines()[0]}", flush=True)
        status = OOM_STATUS
    except SystemExit as e:  # (a probe that exits: its status)
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved
    print(peak_line(is_capped), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
