"""The paged KV cache of one decoder runner (exec/iterations.py): K and V blocks of every layer
it runs (a pipeline stage's layers, a tensor-parallel rank's kv heads)."""
import torch


class KVCache:
    """K and V blocks of every layer: [layers, blocks, block_size, kv heads, head dim] each."""

    def __init__(self, config, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device):
        shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks, self.block_size = num_blocks, block_size

    def release(self) -> None:
        """Give the blocks' memory back now (the runner stopped), whatever still refers to the
        tensors: a stopped engine's objects form cycles that the collector may free much later."""
        for t in (self.k, self.v):
            t.untyped_storage().resize_(0)
