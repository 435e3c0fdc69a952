"""What a user would run instead of BatchMaker, as servers the same load generator drives.

- bucketing.py: padding + bucketing with cuDNN's nn.LSTM (LSTM, Seq2Seq), the MXNet/TF setup;
- trees.py: graph batching of up to 64 trees level by level, and the fixed-tree ideal;
- dynet_treelstm.py: DyNet's autobatching (CPU, optional `dynet38`), imported on demand.
"""
from .bucketing import Buckets, BucketingLSTM, BucketingSeq2Seq
from .server import BatchServer, Pending
from .trees import FixedTreeIdeal, GraphBatchingTreeLSTM, LevelPlan, complete_leaves

__all__ = ["BatchServer", "Buckets", "BucketingLSTM", "BucketingSeq2Seq", "FixedTreeIdeal",
           "GraphBatchingTreeLSTM", "LevelPlan", "Pending", "complete_leaves"]
