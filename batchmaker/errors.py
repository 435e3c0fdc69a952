"""Typed errors. Each carries a stable `code` that the wire protocol reuses."""


class BatchMakerError(Exception):
    code = "internal"


class BadRequestError(BatchMakerError, ValueError):
    """The request's inputs do not fit the model (shape, dtype, range, structure)."""

    code = "bad_request"


class UnknownConversationError(BadRequestError):
    """A turn names a conversation the model does not know: never started, ended, or forgotten
    after `conversation_ttl` seconds idle. Start a new one, sending the whole history as its prompt."""

    code = "unknown_conversation"

    def __init__(self, id: str, ttl: float | None = None):
        after = f" (idle for more than {ttl:g} s)" if ttl is not None else ""
        super().__init__(f"unknown conversation {id!r}: never started, ended, or expired{after}; "
                         "start a new one with the whole history as its prompt")


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


class OverloadedError(BatchMakerError):
    """The bounded request queue is full; the request was not queued (retry later)."""

    code = "overloaded"


class DeadlineExceededError(BatchMakerError, TimeoutError):
    """The request's deadline passed before its result was ready; its work was dropped."""

    code = "deadline_exceeded"


class ServerUnavailableError(BatchMakerError, ConnectionError):
    """Client side: the server cannot be reached, the connection was lost, or no reply came in time."""

    code = "unavailable"


class EngineStoppedError(BatchMakerError, RuntimeError):
    code = "cancelled"


class ReplicaFailedError(BatchMakerError, RuntimeError):
    """The replica process serving the request died or stopped answering (batchmaker/replicas.py);
    or, at start, a replica could not build its models."""

    code = "internal"


class RankFailedError(BatchMakerError, RuntimeError):
    """A rank of the model's tensor- or pipeline-parallel group died, hung or failed an iteration
    (exec/tensor_group.py): the group is broken, so the model's requests fail from then on, at
    once (`Engine.broken` says which and why; `batchmaker serve` exits)."""

    code = "internal"


def error_from_code(code: str, message: str, name: str | None = None) -> BatchMakerError:
    """The typed error for a wire error code (the client's side of the protocol); `name`, the
    error's class name where the sender sent it (a replica process), picks among classes of one code."""
    cls = _BY_NAME.get(name) or next((c for c in (BadRequestError, UnknownConversationError, UnknownModelError,
                                                  OverloadedError, CancelledError, DeadlineExceededError)
                                      if c.code == code), BatchMakerError)
    error = cls.__new__(cls)
    BatchMakerError.__init__(error, message)
    return error


_BY_NAME = {c.__name__: c for c in (BatchMakerError, BadRequestError, UnknownConversationError, UnknownModelError,
                                    CellError, CancelledError, OverloadedError, DeadlineExceededError,
                                    EngineStoppedError, ReplicaFailedError, RankFailedError)}
