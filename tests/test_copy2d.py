"""exec/copy2d.py: one strided copy between the GPU and pinned host memory equals its reference
twin, a `copy_` per row, both ways; the CPU path and bad arguments."""
import pytest
import torch

from batchmaker.exec.copy2d import copy_2d, copy_rows, copy_to_device
from helpers import needs_gpu


def _host_tier(pin: bool) -> torch.Tensor:  # [2, layers, chunks, tokens, heads, dim]: like kv_swap's
    return torch.randn(2, 3, 7, 4, 2, 5, pin_memory=pin)


def test_rows_without_a_stream_are_copied_one_by_one():
    host = _host_tier(False)
    staged = torch.zeros(3, 4, 4, 2, 5)
    copy_2d(staged[:, 1:3], host[1, :, 2:4], None)
    assert torch.equal(staged[:, 1:3], host[1, :, 2:4]) and not staged[:, 0].any() and not staged[:, 3].any()


def test_copy_2d_rejects_mismatched_or_non_contiguous_rows():
    host = _host_tier(False)
    with pytest.raises(ValueError, match="copy_2d"):
        copy_2d(torch.zeros(3, 2, 4, 2, 5), host[0, :, :3], None)
    with pytest.raises(ValueError, match="contiguous"):
        copy_2d(torch.zeros(3, 4, 5, 2), host[0, :, 0].transpose(2, 3), None)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_2d_equals_its_twin_both_ways_on_a_side_stream(dtype):
    host = _host_tier(True).to(dtype).pin_memory()
    want = host.clone()
    stream = torch.cuda.Stream()
    gpu = torch.randn(3, 6, 4, 2, 5, device="cuda").to(dtype)  # a staging buffer: [layers, chunks, ...]
    with torch.cuda.stream(stream):
        copy_2d(host[1, :, 3:5], gpu[:, 2:4], stream)  # out: a run of two chunks, every layer
        copy_rows(want[1, :, 3:5], gpu[:, 2:4])
        back = torch.zeros_like(gpu)
        copy_2d(back[:, 0:3], host[0, :, 1:4], stream)  # in
    stream.synchronize()
    torch.cuda.synchronize()
    assert torch.equal(host, want)
    assert torch.equal(back[:, 0:3].cpu(), host[0, :, 1:4]) and not back[:, 3:].any()
    with pytest.raises(ValueError, match="pinned"):
        copy_2d(torch.zeros(3, 2, 4, 2, 5, dtype=dtype), gpu[:, :2], stream)


@pytest.mark.gpu
@needs_gpu
def test_copy_to_device_moves_the_bytes_it_is_given():
    host = _host_tier(True)
    gpu = torch.zeros(4, 4, 2, 5, device="cuda")
    stream = torch.cuda.Stream()
    size = host[0, 0, 0].numel() * host.element_size()
    copy_to_device(gpu[1].data_ptr(), host[1, 2, 3].data_ptr(), 2 * size, stream.cuda_stream)  # two chunks
    stream.synchronize()
    assert torch.equal(gpu[1:3].cpu(), host[1, 2, 3:5]) and not gpu[0].any() and not gpu[3].any()
