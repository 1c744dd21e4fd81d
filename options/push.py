# Copyright (c) 2026 The authors of this repository. SPDX-License-Identifier: MIT (see LICENSE).
"""What the deployments of two roles share (separated: trainers and generators; hybrid: the actor
and its auxiliary ranks): the weight push, and waits on the store that never hang.

push_weights: after each step, the trainers' new weights go to the generators, bucket by bucket (the
hybrid sends its auxiliary ranks the frozen reference the same way, once). Every trainer gathers a
bucket of full weights from its FSDP2 shards (fusion.py's gather), trainer `src` broadcasts it over
a group of itself and the generators, and each generator hands it to its engine's load_weights, as
vLLM's weight update does. No rank holds more than one bucket beyond its own weights.
wait_for: a rank of one role waits for the other's post in the store, serving the queue meanwhile,
and times out naming what it waited for; warm_up_or_wait: a rank that does not train waits out the
trainers' warm-up on a heartbeat, not in a collective that a long warm-up would time out.
Inbox: a rank's notices in order, which it blocks on (store.wait) instead of polling.

    python -m pytest tests/test_fusion.py -k distributed  # world 4: two trainers, two TP generators
"""
import datetime
import itertools
import time

import torch
import torch.distributed as dist

import grpo
from fusion import Broadcasts, plan_buckets, reshard_all, weight_meta
from model import Policy
from options.tensor_parallel import bucket_views
from plumbing import checkpoint
from plumbing.config import model_config


@torch.no_grad()
def push_weights(model, engine, src, group, bucket_bytes):
    """After a step of the separated deployment (and once, the hybrid's reference): every trainer
    (model given) gathers each bucket over its FSDP mesh, trainer `src` (a global rank) broadcasts
    it over `group` (src and the generators), and each generator (engine given) hands it to
    engine.load_weights. Every trainer and generator calls it. Returns bytes sent."""
    in_group = group is None or dist.get_rank(group) >= 0  # outside: a placeholder for the group
    members = dist.get_process_group_ranks(group) if group is not None and in_group else [src]
    if in_group and src not in members:
        raise ValueError(f"push_weights: src rank {src} is not in the group's ranks {members}")
    if model is not None:
        reshard_all(model)
    box = [weight_meta(model) if model is not None else None]  # the names and full shapes, from src
    if in_group:
        dist.broadcast_object_list(box, src=src, group=group)
    device = next((model if model is not None else engine).parameters()).device
    params, sent = dict(model.named_parameters()) if model is not None else {}, 0
    for bucket in plan_buckets(box[0], bucket_bytes):
        flat, pairs = bucket_views(bucket, device)
        if model is not None:
            Broadcasts().fill(params, pairs)
        if in_group and len(members) > 1:
            dist.broadcast(flat, src=src, group=group)
            sent += flat.nbytes
        if engine is not None:
            engine.load_weights(pairs)
        del flat, pairs  # the bucket is freed before the next one is allocated
    return sent


def dense_twin(run):
    """The policy as one dense model, gathered over the trainers (collective over them): on rank
    0, for push_weights where the experts are expert-parallel, not in FSDP2; None elsewhere."""
    full = checkpoint.dense_state_dict(run.model)
    if run.rank != 0:
        return None
    twin = Policy(model_config(run.cfg)).to(run.device)
    twin.load_state_dict(full)
    return twin


def wait_for(run, keys, what, moving=None, poll_s=0.001):
    """Poll the store every poll_s until every key exists, serving the queue all along. Times out
    where a peer posts nothing for pg_timeout_s (or leaves `moving`, a key it updates as it works,
    unchanged). A wait with nothing to serve (a warm-up's) polls seldom: it leaves the CPU alone."""
    seen, deadline = None, time.monotonic() + run.cfg.pg_timeout_s
    while not run.store.check(keys):
        run.queue.serve()
        now = run.store.get(moving) if moving and run.store.check([moving]) else None
        if now != seen:  # progress: the deadline moves
            seen, deadline = now, time.monotonic() + run.cfg.pg_timeout_s
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {run.rank}: no {what} after {run.cfg.pg_timeout_s}s "
                               f"(keys {keys}, last progress {seen!r}): is the peer alive?")
        time.sleep(poll_s)


def warm_up_or_wait(run):
    """The supervised warm-up on the trainers (train_grpo.warm_up), trainer 0 counting its steps in
    the store; a rank that does not train waits on that heartbeat."""
    import train_grpo
    heartbeat, done = f"w:{run.key}/warmup_steps", f"w:{run.key}/warmup_done"
    if run.rank not in run.roles.trainers:
        return wait_for(run, [done], "end of trainer 0's warm-up", moving=heartbeat, poll_s=0.05)
    count = itertools.count()

    def counted(*args):  # one supervised step, its count posted first
        if run.rank == 0:
            run.store.set(heartbeat, str(next(count)))
        return grpo.supervised_step(*args)
    train_grpo.warm_up(run, supervised=counted)
    if run.rank == 0:
        run.store.set(done, "1")


class Inbox:
    """A rank's notices, in the order posted: the n-th under key/<n>, their count under key/n. Any
    rank posts; the owner takes them one by one, blocking in the store until the next is posted."""

    def __init__(self, store, key):
        self.store, self.key, self.taken = store, key, 0

    def post(self, notice):
        n = int(self.store.add(f"{self.key}/n", 1))
        self.store.set(f"{self.key}/{n}", notice)

    def wake(self, store, notice):
        """Post `notice` from another thread, on its own store connection (a watchdog's), and
        write it too in any slot counted but never written (its poster died between the two), so
        that a take() blocked on that slot returns."""
        n = int(store.add(f"{self.key}/n", 1))
        for i in range(self.taken + 1, n + 1):
            if not store.check([f"{self.key}/{i}"]):
                store.set(f"{self.key}/{i}", notice)

    def take(self, timeout_s):
        """The next notice, once it is posted; None after timeout_s (0: at once)."""
        key = f"{self.key}/{self.taken + 1}"
        if timeout_s <= 0 and not self.store.check([key]):
            return None
        if timeout_s > 0:
            try:
                self.store.wait([key], datetime.timedelta(seconds=timeout_s))
            except dist.DistStoreError:  # the timeout
                return None
        self.taken += 1
        notice = self.store.get(key).decode()
        self.store.delete_key(key)
        return notice
