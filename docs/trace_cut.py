"""A worked trace of StaleSync's shared cut: 2 replicas (gloo processes), S = 1, 2 groups of 2 each
a step, a pool of 4 groups, 4 decode steps a sampler call, response lengths fixed per slot. Each
loop turn prints a replica's counts (offer()) and what the cut decided.

    python docs/trace_cut.py
"""
import datetime
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from stalesync import SharedCut, StaleConfig, StaleSync  # noqa: E402

LENGTHS = [3, 14, 5, 6, 2, 9, 4, 3, 7, 3, 12, 4, 5, 2, 3, 6]  # a group's response length, by slot


class Sampler:
    """Every sample of slot s is LENGTHS[s % 16] tokens long (the prompt's first token is s)."""

    def __call__(self, contexts, seeds, n_done, max_steps):
        toks, lps, done = [], [], []
        for ctx, n0 in zip(contexts, n_done.tolist()):
            left = LENGTHS[int(ctx[0]) % 16] - n0
            n = min(left, max_steps)
            toks.append(torch.full((n,), 5))
            lps.append(torch.zeros(n))
            done.append(n == left)
        return toks, lps, done


class Traced(SharedCut):
    """SharedCut, each loop turn noted: the pool (slot: tokens made / length, the version its
    first token came at), offer()'s counts, and the answer. A rank whose own part says no posts
    and decodes on. A rank that waits reads every replica's part, noted on a second line."""

    def __init__(self):
        super().__init__()
        self.notes, self.turn, self.seen = [], 0, None

    def __call__(self, sched):
        o = sched.offer()
        self.seen = None
        share = super().__call__(sched)
        pool = " ".join(_state(g) for g in sched.pool)
        said = "decode on" if share is None else f"give {share[0]}, {share[1]} needed"
        how = "posts" if self.seen is None else "waits"
        self.notes.append(f"  {self.turn} [{pool}] due {o['due']} done {o['done']} "
                          f"complete {o['complete']}: {how}, {said}")
        if self.seen is not None:
            self.notes.append(f"      read {self.seen}")
        self.turn += 1
        return share

    def _needed_per_replica(self, replicas, batch):
        needed = SharedCut._needed_per_replica(replicas, batch)
        parts = ", ".join(f"r{r['replica']} due {r['due']} done {r['done']} complete "
                          f"{r['complete']}" for r in replicas)
        self.seen = f"{parts}: needed {needed}"
        return needed


def _state(g):
    """A group as slot:tokens made/its length@the version of its first token."""
    made, length = len(g["samples"][0]["tokens"]), LENGTHS[int(g["prompt"][0]) % 16]
    return f"{g['slot']}:{made}/{length}@v{g['start_version']}"


def rank_main(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    cfg = StaleConfig(staleness=1, groups_per_step=2, group_size=2, threshold=0.5, chunk_steps=4)
    slot_prompt = lambda slot, attempt: [2 * slot + rank, 3]  # replica r owns slots 2s + r
    sched = StaleSync(cfg, Sampler(), slot_prompt)
    cut = Traced()
    for _ in range(3):
        cut.notes, cut.turn = [], 0
        batch = sched.rollout(cut=cut)
        ages = sorted(set(batch.version - v for v in batch.start_versions))
        cut.notes.append(f"  batch {batch.version}: slots {sorted(set(batch.slots))}, ages {ages}")
        sched.update()
        everyone = [None] * world
        dist.all_gather_object(everyone, cut.notes)
        if rank == 0:
            for r, notes in enumerate(everyone):
                print(f"replica {r}, round {batch.version}:\n" + "\n".join(notes), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(2, port), nprocs=2)
