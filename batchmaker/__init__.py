"""BatchMaker: cellular batching for serving recurrent, tree and decoder models."""
from batchmaker.cell import Cell
from batchmaker.engine import Engine, EngineConfig
from batchmaker.errors import (BadRequestError, BatchMakerError, CancelledError, CellError, DeadlineExceededError,
                               EngineStoppedError, OverloadedError, ServerUnavailableError, UnknownModelError)
from batchmaker.graph import GraphBuilder, Ref
from batchmaker.model import Model
from batchmaker.registry import build_model, register_model, registered_models
from batchmaker.request import Result, RequestTiming
from batchmaker.scheduler import SchedulerConfig
from batchmaker.signature import Signature, TensorSpec

__all__ = [
    "BadRequestError", "BatchMakerError", "CancelledError", "Cell", "CellError", "Client", "DeadlineExceededError",
    "Engine", "EngineConfig", "EngineStoppedError", "GraphBuilder", "Model", "OverloadedError", "Ref",
    "RequestTiming", "Result", "SchedulerConfig", "Server", "ServerConfig", "ServerUnavailableError", "Signature",
    "TensorSpec", "UnknownModelError", "build_model", "register_model", "registered_models",
]


def __getattr__(name: str):
    """Client and Server load pyzmq on first use, so the engine alone imports without it."""
    if name == "Client":
        from batchmaker.serving.client import Client
        return Client
    if name in ("Server", "ServerConfig"):
        from batchmaker.serving import server
        return getattr(server, name)
    raise AttributeError(f"module 'batchmaker' has no attribute {name!r}")
