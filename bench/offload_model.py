"""The host model of bench/offload.py: a decoder with random bf16 weights kept in pinned host
memory beside a GPU (no checkpoint on disk), and the host memory it leaves a block."""
import torch

from batchmaker.cells.decoder import INIT_STD, DecoderLM, empty_decoder, materialize
from batchmaker.exec.offload_auto import host_bytes
from batchmaker.exec.offload_memory import ModelBytes
from batchmaker.exec.pinned_arena import arena_bytes, holding

DTYPE = torch.bfloat16
HOST_RESERVE = 0.06  # of the host's memory, for what the search does not count: the OS, Python, torch, the prompts


def is_cuda(device: str) -> bool:
    return torch.device(device).type == "cuda"


def _matrices(lm: DecoderLM) -> dict[str, torch.Size]:
    """The layers' matrices' shapes by name, largest first: the order they take their arena's views in,
    so that a chunk's tail is at most the next matrix (13B's 23.6 GiB take 6 chunks, in registration
    order 7)."""
    shapes = {name: p.shape for name, p in lm.named_parameters() if name.startswith("layers.") and p.dim() == 2}
    return dict(sorted(shapes.items(), key=lambda item: -item[1].numel()))


def random_model(config, device: str, seed: int = 0, resident: int = 0) -> DecoderLM:
    """The model on the host: normal(0, INIT_STD) weights drawn on the device a tensor at a time,
    norms at 1 (biases 0). Seconds for 13B, where drawing on the CPU takes minutes. The layers'
    matrices are views of a pinned arena's chunks beside a GPU (exec/pinned_arena.py: torch's host
    allocator rounds each pinned allocation up to a power of two, so 160 matrices of 13B would take
    46 GB and one pool of 25 GB 32 GiB; the arena's 4 GiB chunks take 24 GiB); the rest is small.
    `resident`: the first layers are drawn on the device and stay there, never on the host (a model
    larger than the host: 70B's 138 GB beside 128 GiB; the executor takes them with `adopt`)."""
    lm = empty_decoder(config)
    generator = torch.Generator(device=device).manual_seed(seed)
    kept = tuple(f"layers.{i}." for i in range(resident))
    shapes = {name: shape for name, shape in _matrices(lm).items() if not name.startswith(kept)}
    _, matrices = holding(is_cuda(device), lambda empty: {name: empty(shape, DTYPE) for name, shape in shapes.items()})
    state, on_device = {}, {}
    for name, p in lm.named_parameters():
        if name.startswith(kept):
            host = on_device[name] = torch.empty(p.shape, dtype=DTYPE, device=device)
        else:
            host = state[name] = matrices[name] if name in matrices else torch.empty(p.shape, dtype=DTYPE)
        module_name, kind = name.rsplit(".", 1)
        if module_name.endswith("norm"):
            host.fill_(1.0 if kind == "weight" else 0.0)
        else:
            host.copy_(torch.randn(p.shape, generator=generator, device=device, dtype=DTYPE).mul_(INIT_STD))
    lm = materialize(lm, state, "cpu")  # (the resident layers' parameters empty until their own)
    for name, t in on_device.items():
        module_name, kind = name.rsplit(".", 1)
        setattr(lm.get_submodule(module_name), kind, torch.nn.Parameter(t, requires_grad=False))
    return lm


def host_budget(config, device: str, streamed_only: bool = False) -> float:
    """The host memory the search may give a block: the machine's, less what random_model's arena of
    the layers' matrices holds (`arena_bytes`; with `streamed_only` none: the search counts the
    streamed layers' arena itself, `host_weights=None`), the rest of the model and `HOST_RESERVE`."""
    lm = empty_decoder(config)
    shapes = _matrices(lm)
    size = DTYPE.itemsize
    held = 0 if streamed_only else \
        int(arena_bytes([(1, shape.numel() * size) for shape in shapes.values()], is_cuda(device)))
    rest = sum(p.numel() for p in lm.parameters()) - sum(shape.numel() for shape in shapes.values())
    return host_bytes() * (1 - HOST_RESERVE) - held - rest * size


def fits_host(config, device: str) -> bool:
    """Whether the whole model's host copy leaves a block at least a tenth of the host (else only
    the streamed layers live there: `random_model`'s `resident`)."""
    return host_budget(config, device) >= 0.1 * host_bytes()


def weight_floor(config, rates, resident: int, compressed: bool, dtype=DTYPE) -> float:
    """A decode step's floor from its weights alone (what a batch-1 step approaches): the resident
    layers read once from device memory, the streamed ones across the host link, each at its
    4-bit codes' size where compressed, and the head's matrix read once."""
    model = ModelBytes.of(config, dtype)
    layer = model.layer4 if compressed else model.layer
    head = config.vocab_size * config.hidden_size * dtype.itemsize
    return (resident * layer + head) / rates.device_memory + (config.num_layers - resident) * layer / rates.ctog
