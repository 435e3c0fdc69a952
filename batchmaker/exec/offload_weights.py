"""The host copy of an offloaded decoder's layers (exec/offload.py) and how one layer reaches a
device weight buffer.

Each layer's tensors are kept in registration order, pinned beside a GPU. With `compress`, each
matrix is kept as FlexGen's 4-bit group-wise codes (kernels/compress4.py: groups of 64 along the
output channels; 1-D tensors, norms and biases, stay as they are, as in FlexGen): the codes and
the groups' (scale, min) cross the link into device staging tensors, and the weight buffer gets
their expansion, on the load stream. So a compressed load moves about 0.28x the bytes of fp16
(0.14x of fp32) and the compute sees the round-tripped weights.
"""
import torch
from torch import Tensor, nn

from batchmaker.kernels.compress4 import Compressed, compress, decompress

GROUP = 64  # FlexGen's group size


def layer_tensors(module: nn.Module) -> list[Tensor]:
    """A layer's parameters and buffers, in registration order (the same order in every copy)."""
    return [*module.parameters(), *module.buffers()]


class HostWeights:
    def __init__(self, layers: nn.ModuleList, buffers: list[nn.Module], pin: bool, is_compressed: bool):
        self.layers = [[self._kept(t, pin, is_compressed) for t in layer_tensors(layer)] for layer in layers]
        self.buffers = [layer_tensors(b) for b in buffers]
        device = self.buffers[0][0].device
        self.staging = [[_staging(kept, device) for kept in self.layers[0]] for _ in buffers]

    @staticmethod
    def _kept(t: Tensor, pin: bool, is_compressed: bool) -> Tensor | Compressed:
        """What the host keeps of the model's tensor `t`; `t` itself gives up its memory to it."""
        if is_compressed and t.dim() == 2:
            kept = compress(t.detach(), GROUP, dim=0)
            t.data = t.data.new_empty(0)  # (the host keeps the codes only)
            if pin:
                kept = Compressed(kept.codes.pin_memory(), kept.scale.pin_memory(), kept.low.pin_memory(),
                                  kept.shape, kept.dim, kept.group)
            return kept
        if pin:
            t.data = t.data.pin_memory()
        return t.detach()

    def load(self, layer: int, slot: int) -> int:
        """Copy (and expand) `layer` into weight buffer `slot`, on the current stream; the bytes moved."""
        moved = 0
        for dst, src, stage in zip(self.buffers[slot], self.layers[layer], self.staging[slot]):
            if isinstance(src, Compressed):
                for name in ("codes", "scale", "low"):
                    getattr(stage, name).copy_(getattr(src, name), non_blocking=True)
                dst.copy_(decompress(stage))
                moved += src.nbytes
            else:
                dst.copy_(src, non_blocking=True)
                moved += src.numel() * src.element_size()
        return moved


def _staging(kept: Tensor | Compressed, device) -> Compressed | None:
    if not isinstance(kept, Compressed):
        return None
    return Compressed(torch.empty_like(kept.codes, device=device), torch.empty_like(kept.scale, device=device),
                      torch.empty_like(kept.low, device=device), kept.shape, kept.dim, kept.group)
