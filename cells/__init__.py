"""Built-in cells: LSTM step, Seq2Seq decoder step, TreeLSTM leaf and internal nodes."""
from batchmaker.cells.lstm import LSTMCell
from batchmaker.cells.seq2seq import EncoderCell, Seq2SeqDecoderCell
from batchmaker.cells.treelstm import TreeInternalCell, TreeLeafCell
from batchmaker.cells.weights import init_uniform, load_weights, save_weights

__all__ = ["LSTMCell", "EncoderCell", "Seq2SeqDecoderCell", "TreeLeafCell", "TreeInternalCell",
           "init_uniform", "load_weights", "save_weights"]
