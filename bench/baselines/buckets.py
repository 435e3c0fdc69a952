"""Requests queued by length, and which bucket the next batch comes from.

Bucket i holds lengths in (width*i, width*(i+1)]. A batch is up to max_batch requests of one
bucket, in arrival order. The pick:
- "oldest": the bucket whose first request arrived first. No request waits behind younger ones of
  another bucket; this is the pick that bounds queueing, and the one the strong baseline uses
  unless a tuning run says otherwise.
- "fullest": the bucket with the most queued requests (ties: the oldest). Bigger batches, but a
  rare length waits until its bucket is the fullest.
- "round-robin": the paper's MXNet/TensorFlow setup: buckets in turn, a bucket holding three long
  sentences gets a full turn.
"""
from collections import deque

PICKS = ("oldest", "fullest", "round-robin")


class Buckets:
    def __init__(self, width: int, max_batch: int, pick: str = "oldest"):
        if pick not in PICKS:
            raise ValueError(f"unknown bucket pick {pick!r}; known: {PICKS}")
        self.width, self.max_batch, self.pick = width, max_batch, pick
        self.queues: dict[int, deque] = {}
        self.next_key = 0  # round robin: the first non-empty bucket at or after this one

    def add(self, length: int, item) -> None:
        """File `item` (anything with an `arrival` instant, for the "oldest" pick) by its length."""
        key = (length - 1) // self.width
        q = self.queues.get(key)
        if q is None:
            q = self.queues[key] = deque()
        q.append(item)

    @property
    def num_queued(self) -> int:
        return sum(map(len, self.queues.values()))

    def next_batch(self) -> list:
        keys = [k for k, q in self.queues.items() if q]
        if not keys:
            return []
        queues = self.queues
        if self.pick == "oldest":
            key = min(keys, key=lambda k: queues[k][0].arrival)
        elif self.pick == "fullest":
            key = max(keys, key=lambda k: (len(queues[k]), -queues[k][0].arrival))
        else:
            keys.sort()
            key = next((k for k in keys if k >= self.next_key), keys[0])
            self.next_key = key + 1
        q = queues[key]
        return [q.popleft() for _ in range(min(len(q), self.max_batch))]
