"""The manager's data model: cell queues, request groups as arrays, Algorithm 1, and the general
path's node graphs. Plain Python and numpy only: importable and testable without torch."""
