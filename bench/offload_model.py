"""The host model of bench/offload.py: a decoder with random bf16 weights kept in pinned host
memory beside a GPU (no checkpoint on disk), and the host memory it leaves a block."""
import torch

from batchmaker.cells.decoder import INIT_STD, DecoderLM, empty_decoder, materialize
from batchmaker.exec.offload_auto import host_bytes
from batchmaker.exec.offload_memory import pinned_size

DTYPE = torch.bfloat16
HOST_RESERVE = 0.06  # of the host's memory, for what the search does not count: the OS, Python, torch, the prompts


def is_cuda(device: str) -> bool:
    return torch.device(device).type == "cuda"


def _matrices(lm: DecoderLM) -> dict[str, bool]:
    return {name: name.startswith("layers.") and p.dim() == 2 for name, p in lm.named_parameters()}


def random_model(config, device: str, seed: int = 0) -> DecoderLM:
    """The model on the host: normal(0, INIT_STD) weights drawn on the device a tensor at a time,
    norms at 1 (biases 0). Seconds for 13B, where drawing on the CPU takes minutes. The layers'
    matrices are views of one pinned allocation beside a GPU (torch's host allocator rounds each
    pinned allocation up to a power of two: for 13B, 25 GB in one allocation, not 160 that round
    to 46 GB); the rest is small."""
    lm = empty_decoder(config)
    generator = torch.Generator(device=device).manual_seed(seed)
    is_matrix = _matrices(lm)
    pool = torch.empty(sum(p.numel() for name, p in lm.named_parameters() if is_matrix[name]), dtype=DTYPE,
                       pin_memory=is_cuda(device))
    offset, state = 0, {}
    for name, p in lm.named_parameters():
        if is_matrix[name]:
            host, offset = pool[offset:offset + p.numel()].view(p.shape), offset + p.numel()
        else:
            host = torch.empty(p.shape, dtype=DTYPE)
        module_name, kind = name.rsplit(".", 1)
        if module_name.endswith("norm"):
            host.fill_(1.0 if kind == "weight" else 0.0)
        else:
            host.copy_(torch.randn(p.shape, generator=generator, device=device, dtype=DTYPE).mul_(INIT_STD))
        state[name] = host
    return materialize(lm, state, "cpu")


def host_budget(config, device: str) -> float:
    """The host memory the search may give a block: the machine's, less random_model's pool of the
    layers' matrices as pinned (rounded up), the rest of the model and `HOST_RESERVE`."""
    lm = empty_decoder(config)
    is_matrix = _matrices(lm)
    matrices = sum(p.numel() for name, p in lm.named_parameters() if is_matrix[name])
    rest = sum(p.numel() for p in lm.parameters()) - matrices
    size = DTYPE.itemsize
    return host_bytes() * (1 - HOST_RESERVE) - pinned_size(matrices * size, is_cuda(device)) - rest * size
