"""Built-in models; importing this package registers "lstm", "seq2seq" and "treelstm"."""
from batchmaker.unfolders import lstm, seq2seq, treelstm  # noqa: F401  (register_model side effects)
