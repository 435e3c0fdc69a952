"""What a user would run instead of BatchMaker, as servers the same load generator drives.

- server.py: the batch-at-a-time loop they share (bulk admission, light futures, batches in flight);
- bucketing.py (buckets.py, decoder_graphs.py): padding + bucketing with cuDNN's nn.LSTM (LSTM,
  Seq2Seq), the MXNet/TF setup, and the paper's variant of it;
- trees.py (tree_plan.py, tree_steps.py): graph batching of trees level by level, and the
  fixed-tree ideal;
- request_level.py: the ablation, the engine itself with cellular batching turned off;
- dynet_treelstm.py: DyNet's autobatching (CPU, optional `dynet38`), imported on demand;
- null.py: the null system (the load generator's ceiling);
- cell_rows.py: the rows x steps each one's launches compute (bench/policy_bound.py reads them).
"""
from .buckets import PICKS, Buckets
from .bucketing import BucketingLSTM, BucketingSeq2Seq
from .server import BatchServer, Pending
from .tree_plan import LevelPlan
from .trees import FixedTreeIdeal, GraphBatchingTreeLSTM, complete_leaves

__all__ = ["PICKS", "BatchServer", "Buckets", "BucketingLSTM", "BucketingSeq2Seq", "FixedTreeIdeal",
           "GraphBatchingTreeLSTM", "LevelPlan", "Pending", "complete_leaves"]
