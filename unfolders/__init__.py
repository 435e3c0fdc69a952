"""Built-in models; importing this package registers "lstm", "seq2seq", "treelstm", "llama" and "opt"."""
from batchmaker.unfolders import decoders, lstm, seq2seq, treelstm  # noqa: F401  (register_model side effects)
