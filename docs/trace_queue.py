"""A worked trace of one DistQueue read: 2 gloo processes each put 2 rows of different lengths,
then both read the 4 rows as one data-parallel group. Every store operation that changes or reads
the protocol's state is noted per rank (the polls that find nothing new are left out).

    python docs/trace_queue.py
"""
import datetime
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from distqueue import DistQueue, QueueSpec  # noqa: E402

NOTED = ("set", "get", "append", "compare_set", "delete_key", "queue_push", "queue_pop",
         "multi_get")


class NotedStore:
    """A store that notes each protocol operation: its name, its key, what it wrote or read."""

    def __init__(self, store, notes):
        self.store, self.notes, self.on = store, notes, False

    def __getattr__(self, op):
        real = getattr(self.store, op)

        def call(*args, **kwargs):
            out = real(*args, **kwargs)
            added = op == "add" and args[1] != 0
            if self.on and (op in NOTED or added):
                self.notes.append(f"  {op:11} {_short(args, out, op)}")
            return out
        return call


def _short(args, out, op):
    """The key (dq/ dropped), then what was written (set, append, add) or read (get, queue_pop)."""
    keys = args[0] if isinstance(args[0], list) else [args[0]]
    key = ", ".join(k.removeprefix("dq/") for k in keys)
    if op == "compare_set":
        value = f"{args[1]!r} -> {args[2]!r}: {out!r}"
    else:
        value = args[1] if op in ("set", "append", "add", "queue_push") else out
    if isinstance(value, list):  # multi_get: the values read
        value = " ".join(v.decode() for v in value)
    text = value.decode() if isinstance(value, bytes) else str(value)
    return f"{key:24} {text[:60]}"


def rank_main(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    notes = []
    store = NotedStore(dist.TCPStore("127.0.0.1", port, is_master=False,
                                     timeout=datetime.timedelta(seconds=60)), notes)
    spec = QueueSpec(columns={"tokens": "int64", "reward": "float32"}, scalars=("reward",),
                     stages={"train": ("tokens", "reward")}, timeout_s=60)
    for maker in range(world):  # in rank order: rank 0's queue is queue 1, rank 1's queue 2
        if rank == maker:
            q = DistQueue(spec, store=store)
        dist.barrier()
    store.on = True
    lengths = [(30, 28), (3, 2)][rank]  # rank 0's rows 0 and 2, rank 1's rows 1 and 3
    for writer in range(world):  # rank 0 puts first, then rank 1: the same trace every time
        if rank == writer:
            ids = q.put({"tokens": [torch.arange(n) for n in lengths], "reward": [1.0, 0.0]})
            notes.append(f" put: rows {ids}, lengths {lengths}")
        dist.barrier()
    rows = q.get("train", 4, dp_group=dist.group.WORLD)
    notes.append(f" got: rows {rows.ids}, lengths {[len(t) for t in rows.cols['tokens']]}")
    while q.inflight:  # an owner serves until its reader acknowledged every transfer it sent
        q.serve()
        time.sleep(spec.poll_s)
    everyone = [None] * world
    dist.all_gather_object(everyone, notes)
    if rank == 0:
        for r, lines in enumerate(everyone):
            print(f"rank {r}:\n" + "\n".join(lines), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(2, port), nprocs=2)
