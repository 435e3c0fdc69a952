"""Typed errors. Each carries a stable `code` that the wire protocol reuses."""


class BatchMakerError(Exception):
    code = "internal"


class BadRequestError(BatchMakerError, ValueError):
    """The request's inputs do not fit the model (shape, dtype, range, structure)."""

    code = "bad_request"


class UnknownModelError(BatchMakerError, KeyError):
    code = "unknown_model"

    def __init__(self, name: str, known):
        self.name = name
        self.known = sorted(known)
        super().__init__(f"unknown model {name!r}; registered: {', '.join(self.known) or '(none)'}")

    def __str__(self) -> str:  # KeyError would quote the whole message
        return self.args[0]


class CellError(BatchMakerError, RuntimeError):
    """A cell raised while running a task; every request in that task fails with this."""

    code = "internal"


class CancelledError(BatchMakerError):
    code = "cancelled"


class EngineStoppedError(BatchMakerError, RuntimeError):
    code = "cancelled"
