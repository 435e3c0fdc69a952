"""The host copy of an offloaded decoder's layers (exec/offload.py) and how one layer reaches a
device weight buffer.

Each layer's tensors are kept in registration order, pinned beside a GPU. With `compress`, each
matrix is kept as FlexGen's 4-bit group-wise codes (kernels/compress4.py: groups of 64 along the
output channels; 1-D tensors, norms and biases, stay as they are, as in FlexGen), compressed on
the executor's device where it is a GPU (the same codes as on the CPU, faster): the codes and the
groups' (scale, min) cross the link into device staging tensors on the load stream. So a
compressed load moves about 0.28x the bytes of fp16 (0.14x of fp32). What the compute then sees
is the round-tripped weights, by one of three `DEQUANTS`:
    reference  the PyTorch twin expands the staging into the dense weight buffer (the CPU's way)
    expand     the Triton kernel (`compress4.expand`) does, on a GPU; then the layer's own matmuls
    fused      no dense weight on the device: each projection of the buffer is a `Linear4`, which
               runs `compress4.gemv4` for a few rows (decode steps) and `compress4.linear4` for
               more, both expanding tiles of the codes in registers just before their products
`default_dequant` picks expand on a GPU and the reference elsewhere; fused is an option until a GPU
measurement chooses it (bench/offload.py times both on a 13B layer's shapes). Layers resident on
the device keep their codes there too, as `Linear4`s (exec/offload_resident.py).
"""
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from batchmaker.kernels.cell_launch import is_interpreting
from batchmaker.kernels.compress4 import GEMV4_MAX_ROWS, Compressed, compress, decompress, expand, gemv4, linear4
from batchmaker.exec.pinned_arena import pin_in_place

GROUP = 64  # FlexGen's group size
DEQUANTS = ("reference", "expand", "fused")


def default_dequant(device) -> str:
    return "expand" if torch.device(device).type == "cuda" else "reference"


def layer_tensors(module: nn.Module) -> list[Tensor]:
    """A layer's parameters and buffers, in registration order (the same order in every copy)."""
    return [*module.parameters(), *module.buffers()]


class Linear4(nn.Module):
    """A projection whose weight stays 4-bit on the device: x W^T + b by `gemv4` for a few rows
    (<= GEMV4_MAX_ROWS: decode steps) and, for more, by `expand` into `scratch` then F.linear (a
    resident layer's: exec/offload_resident.py) or by `linear4` (a weight buffer's staging, which
    each load refills: `dequant="fused"`). Off the kernels (the CPU) or with `reference`, the twin
    F.linear(x, decompress(codes), b): bit for bit the round-tripped model's projection."""

    def __init__(self, codes: Compressed, bias: Tensor | None, scratch: Tensor | None = None, reference: bool = False):
        super().__init__()
        self.codes = codes  # (not registered: codes are no parameters, and no NaN fits a uint8)
        self.bias, self.scratch, self.reference = bias, scratch, reference

    def forward(self, x: Tensor) -> Tensor:
        if self.reference or not (x.is_cuda or is_interpreting()):
            return F.linear(x, decompress(self.codes), self.bias)
        n, k = self.codes.shape
        if x.numel() <= GEMV4_MAX_ROWS * k:
            out = gemv4(x, self.codes)
        elif self.scratch is not None:  # (one dense matrix at a time: the executor runs one layer at a time)
            return F.linear(x, expand(self.codes, self.scratch[:n * k].view(n, k)), self.bias)
        else:
            out = linear4(x, self.codes)
        return out if self.bias is None else out + self.bias


class HostWeights:
    def __init__(self, layers: nn.ModuleList, buffers: list[nn.Module], is_compressed: bool,
                 dequant: str = "reference"):
        """`buffers`: the device weight buffers (copies of a layer); with `dequant="fused"` their
        compressed projections become `Linear4`s over the staging (and their dense weights go)."""
        if dequant not in DEQUANTS:
            raise ValueError(f"dequant={dequant!r}: one of {', '.join(DEQUANTS)}")
        self.dequant = dequant
        self.buffers = [layer_tensors(b) for b in buffers]
        self.device = self.buffers[0][0].device
        pin = self.device.type == "cuda"
        tensors = [layer_tensors(layer) for layer in layers]
        if pin and not is_compressed:  # (one arena, as exec/offload_memory.py counts them; 4-bit codes: per tensor)
            self.arena = pin_in_place([t for layer in tensors for t in layer])
        self.layers = [[self._kept(t, pin, is_compressed) for t in layer] for layer in tensors]
        self.staging = [[_staging(kept, self.device) for kept in self.layers[0]] for _ in buffers]
        if dequant == "fused":
            for module, tensors, staging in zip(buffers, self.buffers, self.staging):
                to_linear4(module, {id(t): stage for t, stage in zip(tensors, staging) if stage is not None})

    def _kept(self, t: Tensor, pin: bool, is_compressed: bool) -> Tensor | Compressed:
        """What the host keeps of the model's tensor `t`; `t` itself gives up its memory to it."""
        if is_compressed and t.dim() == 2:
            kept = compress(t.detach().to(self.device), GROUP, dim=0)
            t.data = t.data.new_empty(0)  # (the host keeps the codes only)
            codes, scale, low = (_host(x, pin) for x in (kept.codes, kept.scale, kept.low))
            return Compressed(codes, scale, low, kept.shape, kept.dim, kept.group)
        if pin and not t.is_pinned():
            t.data = t.data.pin_memory()
        return t.detach()

    def load(self, layer: int, slot: int) -> int:
        """Copy (and expand) `layer` into weight buffer `slot`, on the current stream; the bytes moved."""
        moved = 0
        for dst, src, stage in zip(self.buffers[slot], self.layers[layer], self.staging[slot]):
            if isinstance(src, Compressed):
                for name in ("codes", "scale", "low"):
                    getattr(stage, name).copy_(getattr(src, name), non_blocking=True)
                if self.dequant == "expand":
                    expand(stage, dst)
                elif self.dequant == "reference":
                    dst.copy_(decompress(stage))
                moved += src.nbytes
            else:
                dst.copy_(src, non_blocking=True)
                moved += src.numel() * src.element_size()
        return moved


def _host(x: Tensor, pin: bool) -> Tensor:
    x = x.cpu()
    return x.pin_memory() if pin else x


def _staging(kept: Tensor | Compressed, device) -> Compressed | None:
    if not isinstance(kept, Compressed):
        return None
    return Compressed(torch.empty_like(kept.codes, device=device), torch.empty_like(kept.scale, device=device),
                      torch.empty_like(kept.low, device=device), kept.shape, kept.dim, kept.group)


def to_linear4(module: nn.Module, codes: dict[int, Compressed], scratch: Tensor | None = None,
               reference: bool = False) -> None:
    """Each nn.Linear of `module` whose weight's id is in `codes` becomes a Linear4 over those codes
    (its dense weight goes); Llama's fused one-token path, which reads dense weights, is turned off."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and id(child.weight) in codes:
                setattr(parent, name, Linear4(codes[id(child.weight)], child.bias, scratch, reference))
                child.weight.data = child.weight.data.new_empty(0)  # (no dense copy on the device)
    if hasattr(module, "one_token"):  # (the general path instead)
        module.one_token = None
