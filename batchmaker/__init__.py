"""BatchMaker: cellular batching for serving recurrent, tree and decoder models.

Names load on first use, so that `batchmaker.core` (the scheduler and the request arrays) and the
command line's client side import without torch, and the engine without pyzmq.
"""
import importlib

_EXPORTS = {
    "Cell": "batchmaker.cell", "Engine": "batchmaker.engine", "EngineConfig": "batchmaker.engine_config",
    "BadRequestError": "batchmaker.errors", "BatchMakerError": "batchmaker.errors",
    "CancelledError": "batchmaker.errors", "CellError": "batchmaker.errors",
    "DeadlineExceededError": "batchmaker.errors", "EngineStoppedError": "batchmaker.errors",
    "OverloadedError": "batchmaker.errors", "ServerUnavailableError": "batchmaker.errors",
    "UnknownModelError": "batchmaker.errors", "Chain": "batchmaker.forms", "DecodeLoop": "batchmaker.forms",
    "Tree": "batchmaker.forms", "RequestFuture": "batchmaker.future", "GraphBuilder": "batchmaker.core.graph",
    "Ref": "batchmaker.core.graph", "Model": "batchmaker.model", "OffloadedModel": "batchmaker.offloaded",
    "build_model": "batchmaker.registry",
    "register_model": "batchmaker.registry", "registered_models": "batchmaker.registry",
    "Result": "batchmaker.core.request", "RequestTiming": "batchmaker.core.request",
    "SchedulerConfig": "batchmaker.core.scheduler", "Signature": "batchmaker.signature",
    "TensorSpec": "batchmaker.signature", "Client": "batchmaker.serving.client", "Server": "batchmaker.serving.server",
    "ServerConfig": "batchmaker.serving.server",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'batchmaker' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return __all__
