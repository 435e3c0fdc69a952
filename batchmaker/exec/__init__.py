"""Execution: workers (a thin queue per device) and one runner per kind of task (torch)."""
