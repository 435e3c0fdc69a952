"""The TreeLSTM model: leaf cells for the words, internal cells for the constituents (thesis Fig. 2.2).

Request: {"tree": nested pairs or a bracket string, see batchmaker/core/tree_input.py}.
Reply: {"h": tensor [hidden]}, the root's hidden state (a single-leaf tree answers with the leaf's).
Served as a Tree form (batchmaker/forms.py); `structured=False` gives the same model as a
recursive unfolder function, one node per tree node (the general path).
"""
from functools import partial

import torch

from batchmaker.cells.treelstm import TreeInternalCell, TreeLeafCell
from batchmaker.cells.weights import load_weights
from batchmaker.forms import Tree as TreeForm
from batchmaker.model import Model
from batchmaker.registry import register_model
from batchmaker.unfolders.common import as_dtype, check_keys, power_of_two_sizes
from batchmaker.unfolders.trees import FIRST_WORD_ID, MAX_DEPTH, parse_tree

FORM = TreeForm("leaf", "internal", left={"h_l": "h", "c_l": "c"}, right={"h_r": "h", "c_r": "c"}, outputs={"h": "h"})


def unfold(inputs: dict, g, *, vocab: int) -> dict:
    """The general path: children before their parent (an explicit stack: no recursion limit)."""
    check_keys(inputs, required=["tree"])
    tree = parse_tree(inputs["tree"], vocab)  # parse first: nothing is added for a bad tree
    done, stack = [], [(tree, False)]
    while stack:
        node, expanded = stack.pop()
        if isinstance(node, int):
            done.append(g.add("leaf", token=node))
        elif expanded:
            right, left = done.pop(), done.pop()
            done.append(g.add("internal", h_l=left["h"], c_l=left["c"], h_r=right["h"], c_r=right["c"]))
        else:
            stack += [(node, True), (node[1], False), (node[0], False)]
    return {"h": done[0]["h"]}


@register_model("treelstm")
def treelstm_model(vocab: int = 30000, embed: int = 256, hidden: int = 256, seed: int = 0,
                   dtype: torch.dtype | str = torch.float32, max_batch: int = 64, weights: str | None = None,
                   structured: bool = True) -> Model:
    """Leaf and internal weights come from seeds `seed` and `seed + 1`; max batch 64 as in the paper."""
    if vocab <= FIRST_WORD_ID:
        raise ValueError(f"vocab must exceed the reserved ids 0..{FIRST_WORD_ID - 1}, got {vocab}")
    dtype = as_dtype(dtype)
    cells = {"leaf": TreeLeafCell(vocab, embed, hidden, seed=seed, dtype=dtype),
             "internal": TreeInternalCell(hidden, seed=seed + 1, dtype=dtype)}
    if weights is not None:
        load_weights(cells, weights)
    sizes = power_of_two_sizes(max_batch)
    return Model(
        name="treelstm",
        cells=cells,
        unfold=FORM if structured else partial(unfold, vocab=vocab),
        priorities={"internal": 1, "leaf": 0},  # later stage first: finish started trees
        batch_sizes={"leaf": sizes, "internal": sizes},
        input_schema={"tree": f"binary tree: nested pairs of int ids / str words (a 1-element list is its "
                              f"child), or an SST bracket string; at most {MAX_DEPTH} levels"},
    )
