"""The cyclic collector while a manager loop runs (the engine's, the replicas' front): the
long-lived objects there are when it starts (torch, models) leave the collector's view, so that
full collections do not walk them while many requests are live, and young collections may be
rarer (every request allocates a few tracked objects). Stopping undoes both, so that a dropped
engine's cycles can be collected again.
"""
import gc


def freeze(young_threshold: int | None) -> tuple:
    """Freeze what exists now and set the young generation's threshold (None: keep it); returns
    the thresholds to give back to `thaw`."""
    gc.freeze()
    before = gc.get_threshold()
    if young_threshold is not None:
        gc.set_threshold(young_threshold, *before[1:])
    return before


def thaw(before: tuple) -> None:
    gc.unfreeze()
    gc.set_threshold(*before)
