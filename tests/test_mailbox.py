"""The Mailbox wakes its owner for every put: an owner that drains only when the wake byte is
there (the replicas' front does) never misses an item, whatever the producers' interleaving."""
import random
import select
import threading

from batchmaker.serving.mailbox import Mailbox


def test_an_owner_that_drains_only_when_woken_gets_every_item():
    mailbox, num_threads, num_items = Mailbox(), 4, 3000
    got: list = []

    def produce(k: int) -> None:
        rng = random.Random(k)
        for i in range(num_items):
            mailbox.put((k, i))
            if rng.random() < 0.05:
                threading.Event().wait(rng.random() * 1e-4)
    producers = [threading.Thread(target=produce, args=(k,)) for k in range(num_threads)]
    for t in producers:
        t.start()
    while len(got) < num_threads * num_items:
        readable, _, _ = select.select([mailbox.fileno()], [], [], 2.0)
        assert readable, f"no wake-up with {num_threads * num_items - len(got)} items put and not drained"
        got += mailbox.drain()
    for t in producers:
        t.join()
    assert sorted(got) == sorted((k, i) for k in range(num_threads) for i in range(num_items))
    mailbox.close()
