"""DyNet's own autobatching for the TreeLSTM (CPU; optional: `pip install dynet38`).

The paper's outside peer (thesis Fig. 2.14). Like graph batching it takes up to max_trees queued
trees; it builds one DyNet graph holding all of them and lets DyNet's autobatching (`autobatch=1`)
merge same-shaped operations when the values are computed. Weights are copied from the engine's
cells, so the outputs equal the engine's (fp32).
"""
import sys

import numpy as np

from .trees import _TreeServer
from .server import Pending


def import_dynet():
    """dynet with autobatching on, or ImportError. dynet_config must run before the first import."""
    if "dynet" not in sys.modules:
        import dynet_config
        dynet_config.set(autobatch=1, mem=1024, random_seed=1)
    import dynet
    return dynet


class DynetTreeLSTM(_TreeServer):
    name = "dynet-autobatch"

    def __init__(self, model, device="cpu", max_trees: int = 64):
        if str(device) != "cpu":
            raise ValueError("the DyNet peer runs on the CPU only (dynet38 wheels have no CUDA)")
        super().__init__(model, device, max_trees)
        dy = self.dy = import_dynet()
        leaf, internal = model.cells["leaf"], model.cells["internal"]
        self.hidden = internal.gates.in_features // 2
        self.params = dy.ParameterCollection()
        numpy = lambda t: t.detach().float().cpu().numpy().astype(np.float32)  # noqa: E731
        self.embedding = self.params.lookup_parameters_from_numpy(numpy(leaf.embedding.weight))
        self.w_iou = self.params.parameters_from_numpy(numpy(leaf.iou.weight))  # [3h, embed]
        self.b_iou = self.params.parameters_from_numpy(numpy(leaf.iou.bias))
        self.w_gates = self.params.parameters_from_numpy(numpy(internal.gates.weight))  # [5h, 2h]
        self.b_gates = self.params.parameters_from_numpy(numpy(internal.gates.bias))

    def launch(self, batch: list[Pending]) -> list[dict]:
        import torch
        dy = self.dy
        dy.renew_cg()
        roots = [self._tree(*r.parsed) for r in batch]
        dy.forward(roots)  # autobatching happens here, across all trees of the batch
        return [{"h": torch.from_numpy(np.asarray(root.npvalue(), dtype=np.float32))} for root in roots]

    def is_ready(self, outputs) -> bool:
        return True

    def collect(self, outputs: list[dict]) -> list[dict]:
        return outputs

    def _tree(self, num_leaves: int, tokens: np.ndarray, children: np.ndarray):
        """The root's h of one parsed tree (the engine's arrays: leaves 0..n-1 in order, then
        internal nodes whose children index earlier nodes)."""
        nodes = [self._leaf(int(t)) for t in tokens.tolist()]
        for left, right in children.tolist():
            nodes.append(self._internal(nodes[left], nodes[right]))
        return nodes[-1][0]

    def _leaf(self, token: int):
        dy, k = self.dy, self.hidden
        iou = self.w_iou * dy.lookup(self.embedding, token) + self.b_iou
        i, o, u = (dy.pick_range(iou, n * k, (n + 1) * k) for n in range(3))
        c = dy.cmult(dy.logistic(i), dy.tanh(u))
        return dy.cmult(dy.logistic(o), dy.tanh(c)), c

    def _internal(self, left, right):
        dy, k = self.dy, self.hidden
        (h_l, c_l), (h_r, c_r) = left, right
        gates = self.w_gates * dy.concatenate([h_l, h_r]) + self.b_gates
        i, f_l, f_r, o, u = (dy.pick_range(gates, n * k, (n + 1) * k) for n in range(5))
        c = (dy.cmult(dy.logistic(i), dy.tanh(u)) + dy.cmult(dy.logistic(f_l), c_l)
             + dy.cmult(dy.logistic(f_r), c_r))
        return dy.cmult(dy.logistic(o), dy.tanh(c)), c
