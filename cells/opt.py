"""OPT: learned positions (offset by 2), LayerNorm before each block, a ReLU/GELU MLP with biases.

Only the pre-norm variant (every OPT size but 350m) without embedding projection is supported;
DecoderConfig rejects the others. The LM head is tied to the token embedding by default.
"""
import torch.nn.functional as F
from torch import Tensor, nn

from batchmaker.cells.decoder import Attention, DecoderLayer, DecoderLM, reduced
from batchmaker.cells.decoder_config import OPT_POSITION_OFFSET, DecoderConfig

ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu}  # HF's "gelu" is the exact (erf) one, as F.gelu


class MLP(nn.Module):
    """fc2(act(fc1(x)))."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.has_mlp_bias
        self.fc1 = nn.Linear(h, i, bias=bias)
        self.fc2 = nn.Linear(i, h, bias=bias)
        self.act = ACTIVATIONS[config.activation]
        self.reduce = None  # tensor parallel: fc2's partial sums (cells/tensor_parallel.py)

    def forward(self, x: Tensor) -> Tensor:
        return reduced(self, self.fc2(self.act(self.fc1(x))))


class OPTLM(DecoderLM):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        assert config.family == "opt"
        self.config = config
        c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.embed_positions = nn.Embedding(c.max_positions + OPT_POSITION_OFFSET, c.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(nn.LayerNorm(c.hidden_size, c.norm_eps), Attention(c, i),
                         nn.LayerNorm(c.hidden_size, c.norm_eps), MLP(c))
            for i in range(c.num_layers))
        self.norm = nn.LayerNorm(c.hidden_size, c.norm_eps)
        self.lm_head = None if c.tie_word_embeddings else nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    def embed(self, tokens: Tensor, positions: Tensor) -> Tensor:
        return self.tokens(tokens) + self.embed_positions(positions + OPT_POSITION_OFFSET)
