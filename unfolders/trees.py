"""Trees of the TreeLSTM's requests: parsing lives in batchmaker/core/tree_input.py (the engine
admits trees there); this module keeps the names unfolders and users import, and the SST sample."""
from pathlib import Path

from batchmaker.core.tree_input import (FIRST_WORD_ID, MAX_DEPTH, Tree, TreeArrays, num_leaves, parse_bracketed,
                                        parse_tree, parse_trees, word_id)

__all__ = ["FIRST_WORD_ID", "MAX_DEPTH", "Tree", "TreeArrays", "load_sst_sample", "num_leaves", "parse_bracketed",
           "parse_tree", "parse_trees", "word_id"]


def load_sst_sample() -> list[str]:
    """The first 200 trees of the SST dev split, one bracket string each (see data/README.md)."""
    path = Path(__file__).parent / "data" / "sst_dev_sample.txt"
    return path.read_text(encoding="utf-8").splitlines()
