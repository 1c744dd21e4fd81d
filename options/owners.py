# Copyright (c) 2026 The authors of this repository. SPDX-License-Identifier: MIT (see LICENSE).
"""--train-pp, --nodes: which ranks hold each weight, agreed by the ranks before fusion.py's switch.

Under FSDP2 over all ranks (the default run) every rank reports the same weights, each Shard(0)
over every rank: fusion.FusedActor takes this rank's own list. The other training layouts report
different lists. A pipeline stage holds only its own weights, under the whole model's names: FSDP2
over the stage's ranks, or whole on one rank. Under HSDP each node shards the whole model on a mesh
of its own, a replica per node. union_meta makes one list of the weights to build from every rank's
report (one all_gather_object), the same on every rank, and checks that the reports agree before
any gather: a weight's owners, shape and dtype. actor_class(FusedActor) builds those weights, each
rank gathering the whole engine from their owners through Broadcasts (SharedMemory needs shards
over all W ranks).

    actor = owners.actor_class(fusion.FusedActor)(stage, optimizer, engine)

    python -m pytest tests/test_owners.py   (PP 2 at world 2; HSDP; PP 2 x FSDP 2 at W 4: -m slow)
"""
import torch.distributed as dist

from fusion import Weight


def actor_class(base):
    """`base` (fusion.FusedActor or a subclass) whose weights to build are union_meta's: for a model
    that is a pipeline stage, or a node's replica (HSDP)."""

    class FromOwners(base):
        def _weights_to_build(self, mine):
            """The weights every rank of the actor's reports agree on, not this rank's own alone."""
            return union_meta(mine, self.group)
    return FromOwners


def union_meta(mine, group=None):
    """The weights to build: the union of every rank's weight_meta over group (None: every rank), by
    one all_gather_object; the same list on every rank, in rank 0's order, then the names each next
    rank adds. A weight held whole by several ranks is held by each. Where two ranks' reports of a
    weight disagree, raises on every rank before any gather."""
    ranks = _ranks(group)
    if len(ranks) == 1:
        return list(mine)
    everyone = [None] * len(ranks)
    plain = [tuple(w) for w in mine]  # plain tuples: a receiver needs no class
    dist.all_gather_object(everyone, plain, group=group)
    reports = {}  # name -> [(rank, Weight)], in first-seen order
    for rank, weights in zip(ranks, everyone):
        for w in map(Weight._make, weights):
            reports.setdefault(w.name, []).append((rank, w))
    return [_agreed(name, said, len(ranks)) for name, said in reports.items()]


def _ranks(group):
    """The global ranks of group (None: the default group; a single process without one: [0])."""
    if group is not None:
        return dist.get_process_group_ranks(group)
    return list(range(dist.get_world_size())) if dist.is_initialized() else [0]


def _held_as(w):
    how = "Shard(0) over" if w.sharded else "whole on"
    return f"{how} ranks {list(w.owners)}, {w.shape} {w.dtype}"


def _compatible(w, w0):
    """Two ranks' reports of one weight agree: shape, dtype and sharded alike; sharded on one mesh,
    or on disjoint meshes of one size (replicas)."""
    alike = (w.shape, w.dtype, w.sharded) == (w0.shape, w0.dtype, w0.sharded)
    if not alike or not w.sharded or w.owners == w0.owners:
        return alike
    return not set(w.owners) & set(w0.owners) and len(w.owners) == len(w0.owners)


def _agreed(name, said, n_ranks):
    """One Weight from its holders' reports said, [(rank, Weight)], of n_ranks ranks; a ValueError
    naming it where two disagree."""
    (r0, w0), holders = said[0], tuple(rank for rank, _ in said)
    for rank, w in said[1:]:
        if not _compatible(w, w0):
            raise ValueError(f"{name}: rank {r0} holds it {_held_as(w0)}; rank {rank} "
                             f"{_held_as(w)}: the ranks that hold a weight must agree on its "
                             "owners, shape and dtype (a pipeline stage's parameters sharded over "
                             "that stage's one mesh, or over disjoint meshes of one size, or "
                             "whole)")
    if not w0.sharded:
        return w0._replace(owners=holders)
    meshes = list(dict.fromkeys(w.owners for _, w in said))  # one, or one per node: its replicas
    ranks = [r for owners in meshes for r in owners]
    if len(set(ranks)) != len(ranks):  # each report was checked against the first only
        raise ValueError(f"{name}: sharded on meshes {meshes} that overlap: a weight's meshes "
                         "must be one, or disjoint")
    if set(holders) != set(ranks) or any(rank not in w.owners for rank, w in said):
        raise ValueError(f"{name}: {_held_as(w0)}, but ranks {list(holders)} hold it: every rank "
                         "of its mesh must")
    if len(meshes) > 1 and len(holders) != n_ranks:  # each rank gathers from its own replica
        raise ValueError(f"{name}: sharded on {len(meshes)} meshes {meshes}, but ranks "
                         f"{list(holders)} hold it: a weight sharded in replicas must be held by "
                         "every rank")
    return w0._replace(replicas=len(meshes))
