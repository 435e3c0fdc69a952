"""BatchMaker: cellular batching for serving recurrent, tree and decoder models."""
from batchmaker.cell import Cell
from batchmaker.engine import Engine, EngineConfig
from batchmaker.errors import (BadRequestError, BatchMakerError, CancelledError, CellError, EngineStoppedError,
                               UnknownModelError)
from batchmaker.graph import GraphBuilder, Ref
from batchmaker.model import Model
from batchmaker.registry import build_model, register_model, registered_models
from batchmaker.request import Result, RequestTiming
from batchmaker.scheduler import SchedulerConfig
from batchmaker.signature import Signature, TensorSpec

__all__ = [
    "BadRequestError", "BatchMakerError", "CancelledError", "Cell", "CellError", "Engine", "EngineConfig",
    "EngineStoppedError", "GraphBuilder", "Model", "Ref", "RequestTiming", "Result", "SchedulerConfig",
    "Signature", "TensorSpec", "UnknownModelError", "build_model", "register_model", "registered_models",
]
