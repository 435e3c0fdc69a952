"""`linear(layer, x)`: `layer(x)`, and on the CPU in fp32 inference through oneDNN with the weight
packed once.

torch's fp32 `F.linear` on the CPU calls MKL's sgemm, which repacks the weight on every call. At
the few rows a tree frontier holds (1-16), that repacking is most of the cost: on a 2-core AMD
EPYC, the TreeLSTM's internal gates (512 -> 1280) take 160 / 360 / 365 µs at 2 / 4 / 8 rows
with sgemm, 116 / 156 / 221 µs with the packed weight, and no longer at 512 rows (9.1 against
10.6 ms). A single row, and elsewhere (CUDA, half precision, autograd), it is `F.linear`.
"""
import weakref

import torch
import torch.nn.functional as F
from torch import nn

# id(weight) -> (the weight's version and storage when packed, the packed weight); an entry dies
# with its weight (tensors compare by value, so they cannot key a WeakKeyDictionary)
_packed: dict[int, tuple] = {}
_PACK_ROWS = 64  # oneDNN's layout hint; any batch size runs on the packed weight


def linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """layer(x) for x: [B, in]."""
    weight = layer.weight
    if not _can_pack(weight, x):
        return F.linear(x, weight, layer.bias)
    key = (None if weight.is_inference() else weight._version, weight.data_ptr())  # (no counter on inference tensors)
    entry = _packed.get(id(weight))
    if entry is None or entry[0] != key:
        if entry is None:
            weakref.finalize(weight, _packed.pop, id(weight), None)
        entry = _packed[id(weight)] = (key, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_ROWS))
    return torch.ops.mkldnn._linear_pointwise(x, entry[1], layer.bias, "none", [], "")


def _can_pack(weight: torch.Tensor, x: torch.Tensor) -> bool:
    # (one row: sgemm takes its matrix-vector path, which does not repack, and beats oneDNN's
    # fixed cost of ~60 µs a call)
    return (_AVAILABLE and x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.shape[0] > 1
            and weight.dtype == torch.float32 and not (torch.is_grad_enabled() and weight.requires_grad))


_AVAILABLE = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
