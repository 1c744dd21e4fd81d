# Copyright (c) 2026 The authors of this repository. SPDX-License-Identifier: MIT (see LICENSE).
"""Expert-parallel MoE whose EP degree changes between training and rollout, re-sharded in buckets.

RL Fusion's zero-redundancy memory switching for MoE. Training and rollout share the devices but
want different expert-parallel (EP) degrees, so at each phase change the experts move from one EP
layout to the other. The naive switch gathers all E experts onto every rank and keeps the target's.
Here only the experts whose owner changes move, one bucket at a time, each source slice freed once
sent: no rank holds a copy of an expert that its target layout does not ask for.

The default run (train_grpo.py) trains at EP 2 and generates at EP 1. Above the marker "A learner
can stop here" (in ExpertParallel) is that path, in reading order:
  route, moe_reference      the single-process MoE the EP layer must match, a slow loop
  all_to_all_rows           uneven all_to_all_single; its backward is the reverse all_to_all
  EPLayout                  which rank owns which expert (its groups: new_groups, below)
  reshard_naive, reshard    the naive switch, then the bucketed one (plan_reshard packs its rounds)
  EPMoE                     route, send counts then packed tokens, local experts, combine; switch()
  ExpertParallel            a model's MoE layers: apply, to_rollout, to_train, clip_grads
Below it: the checks, agree_on_switch, the options' hooks, a layout over part of the job. Other
codebases' experts convert with options/dense_moe.py; dense_state_dict: plumbing/checkpoint.py.

Departures from the source system (Huawei's RL post-training on CloudMatrix 384):
  1. Each expert slice (name, e) is its own tensor, not a view of a stacked (E, D, H) parameter: a
     view cannot be freed alone. A bucket is one round of batched isend/irecv, at most B bytes out
     and B in per rank, from the source storage straight into the final one.
  2. Memory is the module's own count of the storages it holds. Once a switch has freed what it
     neither keeps nor sends, it holds at most target + one bucket for layouts that nest
     (stats["peak_switch_bytes"]). Counting the entry, the peak is max(source, target) + one bucket.
  3. Ranks are laid out EP-outer, grid arange(W).view(P, W // P), so degrees that divide each other
     nest: a switch to a higher degree moves nothing, one to a lower degree what each rank lacks.
  4. Grads and optimizer states stay outside: the caller clears grads before a switch, and the
     Parameter objects survive it. The experts stay out of FSDP: clip_grads syncs and clips them.
  5. No capacity factor, token dropping or load-balancing loss: every token reaches its k experts.

Run: python -m pytest tests/test_moe_switch.py; python bench/moe_switch.py (bytes, memory, time).
Using this file elsewhere: torch only. A dense MoE layer is found by attributes: router (E, D),
w_gate and w_up (E, D, H), w_down (E, H, D) in x @ w orientation, and top_k (SwiGLU experts, no
biases). Every rank of a layout calls switch() together, with the same target, or the others
raise. On 2 gloo processes (tests/test_copy_alone.py runs it in a folder holding only this file):

    import copy, datetime, os, socket
    import torch, torch.distributed as dist, torch.multiprocessing as mp
    from moe_switch import EXPERT_NAMES, ExpertParallel, moe_reference

    class MoE(torch.nn.Module):  # a dense MoE, found by its attributes: router, top_k, stacks
        def __init__(self, E=4, D=8, H=16):  # x @ w orientation: (E, D, H), (E, D, H), (E, H, D)
            super().__init__()
            self.router, self.top_k = torch.nn.Linear(D, E, bias=False), 2
            for n, shape in zip(EXPERT_NAMES, [(E, D, H), (E, D, H), (E, H, D)]):
                setattr(self, n, torch.nn.Parameter(torch.randn(shape) / 4))

        def forward(self, x):  # (N, D) -> (N, D): the slow loop that the EP layer must match
            experts = {n: getattr(self, n) for n in EXPERT_NAMES}
            return moe_reference(x, self.router.weight, experts, self.top_k)

    def rank_main(rank, world, port):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        timeout = datetime.timedelta(seconds=60)
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
        torch.manual_seed(0)  # the same dense model on every rank: two MoE layers
        dense = torch.nn.Sequential(MoE(), MoE())
        model = copy.deepcopy(dense)  # trained, at EP 2: two experts a rank
        engine = copy.deepcopy(dense).requires_grad_(False)  # generates, at EP 1: every expert
        ep = ExpertParallel(train_ep=2, infer_ep=1, world_size=world, n_experts=4,
                            bucket_bytes=1 << 16)
        ep.apply(model, engine)  # their dense MoE layers become EPMoE layers
        x = torch.randn(5 + rank, 8)  # this rank's tokens
        with torch.no_grad():  # one layer: the tokens cross ranks to their experts and come back
            assert torch.allclose(model[0](x), dense[0](x), atol=1e-5)
            ep.to_rollout()  # every rank, together: EP 2 -> 1; the engine's experts alias the moved
            assert torch.allclose(engine(x), dense(x), atol=1e-5)
            ep.to_train()  # EP 1 -> 2
        for layer, like in zip(model, dense):  # this rank's experts, back: bit for bit
            for n, mine in layer.local_experts().items():  # name -> {e: tensor}
                assert all(torch.equal(t, getattr(like, n)[e]) for e, t in mine.items())
        moved = ep.stats["ep/to_rollout_bytes_moved"]
        print(f"rank {rank}: EP 2 -> 1 -> 2, {moved} bytes moved to roll out")
        dist.barrier()  # every rank done before any tears down
        dist.destroy_process_group()

    if __name__ == "__main__":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(rank_main, args=(2, port), nprocs=2)

Shapes: N tokens, D model width, H expert hidden width, E experts, k experts per token, P EP degree,
W world size, L local experts (E / P in blocks), M tokens received by this rank, B bucket bytes.
"""
import datetime
import functools
import time
import zlib
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

EXPERT_NAMES = ("w_gate", "w_up", "w_down")  # (E, D, H), (E, D, H), (E, H, D) in the dense MoE
# EP 1 runs every expert on every token while tokens x D x H stays within this (see EPMoE.forward)
EVERY_EXPERT_WORK = 3 * 2 ** 18


# ----------------------------------------------------------------------- the MoE, in one process
def route(x, router_weight, top_k, routing=None):
    """Softmax router and top-k: (N, D) -> gates (N, k) renormalised over the k chosen, experts
    (N, k). routing: a hook for an option (routing replay), see below the marker."""
    probs = F.linear(x, router_weight).float().softmax(-1)          # (N, E)
    top_p, top_e = probs.topk(top_k, dim=-1)                        # (N, k), (N, k)
    if routing is not None:
        top_e = routing(top_e)
        top_p = probs.gather(-1, top_e)                             # (N, k)
    return top_p / top_p.sum(-1, keepdim=True), top_e


def expert_mlp(x, w_gate, w_up, w_down):
    """One SwiGLU expert on its tokens: (n, D) -> (n, D)."""
    return (F.silu(x @ w_gate) * (x @ w_up)) @ w_down


def moe_reference(x, router_weight, experts, top_k):
    """Single-process MoE, slow loop over experts. experts: name -> stacked (E, ...) tensor."""
    gates, top_e = route(x, router_weight, top_k)                   # (N, k)
    out = torch.zeros_like(x)                                       # (N, D)
    for e in range(router_weight.shape[0]):
        tok, slot = (top_e == e).nonzero(as_tuple=True)             # tokens that chose e
        y = expert_mlp(x[tok], *(experts[n][e] for n in EXPERT_NAMES))  # (n_e, D)
        out = out.index_add(0, tok, y * gates[tok, slot, None].to(x.dtype))
    return out


# ----------------------------------------------------------------------- communication primitive
def _a2a(x, out_splits, in_splits, group):
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """Uneven all_to_all_single of rows in forward, the reverse all_to_all_single in backward."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _a2a(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _a2a(grad, in_splits, out_splits, ctx.group), None, None, None


def all_to_all_rows(x, out_splits, in_splits, group):
    """Send rows x[sum(in_splits[:j]):...] to group rank j; differentiable; in a group of 1, x."""
    return x if len(in_splits) == 1 else _AllToAll.apply(x, out_splits, in_splits, group)


# ----------------------------------------------------------------------- layouts
@dataclass(frozen=True)
class EPLayout:
    """Who owns which expert. Rank grid arange(W).view(P, W // P): row p owns expert block p, and
    the W // P ranks of a row are its data-parallel replicas. An EP group takes one rank from each
    row. Ranks here are the layout's own, 0 .. W-1: `ranks` names the global ranks they are.
    A row holds L experts, its slots p * L .. p * L + L - 1: the block's, or under a placement
    (an option, load balancing: below the marker) any L, an expert held by several rows copied."""
    ep: int              # P, the EP degree: the experts split into P blocks of L = E / P
    world_size: int      # W ranks, each holding one block
    n_experts: int       # E
    ranks: tuple = None  # the global rank of each layout rank (None: the same numbers)
    placement: tuple = None  # each row's experts, increasing (None: the blocks)

    def __post_init__(self):
        _check_layout(self)  # below the marker: P divides E and W; ranks distinct, in order;
        # a placement's rows the same length, of distinct experts, holding every expert

    def global_rank(self, r):
        return r if self.ranks is None else self.ranks[r]

    @property
    def dp(self):
        return self.world_size // self.ep  # replicas of each expert block

    @property
    def slots(self):
        """The experts each rank holds: L = E / P (more under a placement with copies)."""
        return self.n_experts // self.ep if self.placement is None else len(self.placement[0])

    def owned(self, rank):
        """The global expert ids that `rank` holds, in slot order: its block, a range of L."""
        L, p = self.slots, rank // self.dp
        return range(p * L, (p + 1) * L) if self.placement is None else self.placement[p]

    def holders(self, e):
        rows = [p for p in range(self.ep) if e in self.owned(p * self.dp)]
        return [p * self.dp + i for p in rows for i in range(self.dp)]

    def ep_group_ranks(self, rank):
        return [p * self.dp + rank % self.dp for p in range(self.ep)]  # group rank p owns block p

    def dp_group_ranks(self, rank):
        p = rank // self.dp
        return list(range(p * self.dp, (p + 1) * self.dp))

    def slot_of(self, experts, rank=0):
        """(n,) expert ids -> (n,) slots, p * L + j for row p's j-th expert: the expert id itself
        for the blocks (a placement's, where `rank` spreads the copies: below the marker)."""
        return experts if self.placement is None else _spread_over_copies(self, experts, rank)

    def local_rank(self, global_rank):  # a layout over part of the job (ranks=): below the marker
        return _local_rank(self, global_rank)


def shard_experts(full, layout, rank):
    """A dense MoE's stacks (name -> (E, ...)) -> this rank's slices: name -> {e: (...)}."""
    return {n: {e: t[e].detach().clone() for e in layout.owned(rank)} for n, t in full.items()}


# ----------------------------------------------------------------------- re-sharding, naive first
# _rank: this process's rank; _held_bytes: the memory count (both below the marker)
def reshard_naive(experts, src, dst, group=None):
    """The naive switch: all_reduce every expert onto every rank (one contributor each), keep the
    target's. It moves and briefly holds all E experts per name on every rank."""
    _check_naive_group(src, group)
    rank = _rank(group, src)
    _check(experts, src, dst, rank, group)
    stats = dict(bytes_moved=0, peak_bytes=_held_bytes(experts))
    new = {}
    for n in list(experts):
        like = next(iter(experts[n].values()))
        full = like.new_zeros((src.n_experts,) + tuple(like.shape))    # (E, ...) every expert
        for e, t in experts[n].items():
            if src.holders(e)[0] == rank:
                full[e] = t
        dist.all_reduce(full, group=group)                              # x + 0 + ... == x exactly
        new[n] = {e: full[e].clone() for e in dst.owned(rank)}
        stats["bytes_moved"] += full.nbytes
        stats["peak_bytes"] = max(stats["peak_bytes"], _held_bytes(experts, new) + full.nbytes)
        del experts[n], full
    return new, stats


def plan_reshard(src, dst, slice_bytes, bucket_bytes):
    """Transfers (name, e, from rank, to rank) of every slice a rank needs and lacks, packed
    first-fit into rounds where each rank sends at most bucket_bytes and receives at most
    bucket_bytes, and holds at most max(source, target) + bucket_bytes (_Memory). Pure: every rank
    computes the same plan, so no counts are exchanged."""
    W = src.world_size
    _check_bucket(slice_bytes, bucket_bytes)  # a bucket holds one expert slice at least
    load, todo = [0] * W, []  # bytes each rank sends in all; the transfers, in order
    for r in range(W):
        for e in dst.owned(r):
            if e in src.owned(r):
                continue  # kept in place: never moves
            s = min(src.holders(e), key=lambda h: (load[h], (h - r) % W))  # least-loaded replica
            for n, nb in slice_bytes.items():
                load[s] += nb
                todo.append((n, e, s, r))
    memory = _Memory(src, dst, slice_bytes, bucket_bytes, todo)
    rounds = []
    while todo:  # a round takes, in order, every transfer with room at both ends
        out, inn, rnd, rest = [0] * W, [0] * W, [], []
        for n, e, s, r in todo:
            nb = slice_bytes[n]
            room = max(out[s], inn[r]) + nb <= bucket_bytes
            if room and memory.fits(r, inn[r] + nb):
                rnd.append((n, e, s, r))
                out[s] += nb
                inn[r] += nb
            else:
                rest.append((n, e, s, r))
        assert rnd, "no transfer fits"  # never: a rank over its bound has sends pending (_Memory)
        memory.done(rnd)
        rounds.append(rnd)
        todo = rest
    return rounds


def reshard(experts, src, dst, bucket_bytes, group=None):
    """Move this rank's expert slices from layout src to dst, one bucket-sized round at a time.
    experts: name -> {global expert id: tensor}, exactly src.owned(rank). It is consumed: hold no
    other reference, or freed slices stay alive. Returns (name -> {e: tensor} for dst, stats)."""
    rank = _rank(group, src)
    _check(experts, src, dst, rank, group)
    like = {n: next(iter(s.values())) for n, s in experts.items()}  # one slice per name
    meta = {n: dict(size=t.shape, dtype=t.dtype, device=t.device) for n, t in like.items()}
    slice_bytes = {n: t.nbytes for n, t in like.items()}
    del like  # no reference may outlive the slice it points to
    rounds = plan_reshard(src, dst, slice_bytes, bucket_bytes)  # raises before any collective
    peer = [src.global_rank(r) if group is None else dist.get_global_rank(group, r)
            for r in range(src.world_size)]  # P2POp wants global ranks
    per_expert, need, have = sum(slice_bytes.values()), set(dst.owned(rank)), set(src.owned(rank))
    stats = dict(bytes_moved=0, bytes_min=len(need - have) * per_expert, rounds=len(rounds),
                 from_bytes=len(have) * per_expert, to_bytes=len(need) * per_expert,
                 peak_bytes=_held_bytes(experts), bucket_bytes=bucket_bytes)
    pending = Counter((n, e) for rnd in rounds for n, e, s, _ in rnd if s == rank)  # sends left
    new = {n: {e: s.pop(e) for e in sorted(need & have)} for n, s in experts.items()}  # no copy
    for n, s in experts.items():  # neither kept nor sent by me: free at once
        for e in [e for e in s if not pending[(n, e)]]:
            del s[e]
    stats["peak_switch_bytes"] = _held_bytes(experts, new)  # from here: target + a bucket (note 2)
    for rnd in rounds:  # one bucket: <= bucket_bytes out and <= bucket_bytes in per rank
        ops, sent = [], []
        for tag, (n, e, s, r) in enumerate(rnd):
            if s == rank:  # straight from the source storage, no staging copy
                t = experts[n][e] if e in experts[n] else new[n][e]  # a kept slice sits in new
                ops.append(dist.P2POp(dist.isend, t.contiguous(), peer[r], group, tag))
                sent.append((n, e))
            elif r == rank:  # straight into its final storage, a tensor per slice: freeable alone
                new[n][e] = torch.empty(**meta[n])
                ops.append(dist.P2POp(dist.irecv, new[n][e], peer[s], group, tag))
                stats["bytes_moved"] += slice_bytes[n]
        held = _held_bytes(experts, new)  # the round's receives allocated, its sends not yet freed
        stats["peak_bytes"] = max(stats["peak_bytes"], held)
        stats["peak_switch_bytes"] = max(stats["peak_switch_bytes"], held)
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        ops = t = work = None  # they hold the round's sent slices: let the frees below free them
        for n, e in sent:
            pending[(n, e)] -= 1
            if not pending[(n, e)] and e not in need:
                del experts[n][e]  # sent to everyone who needed it from me: free now
    assert not any(experts.values()), "a source slice outlived the switch"
    new = {n: dict(sorted(s.items())) for n, s in new.items()}
    stats["peak_extra_bytes"] = stats["peak_bytes"] - max(stats["from_bytes"], stats["to_bytes"])
    return new, stats


# ----------------------------------------------------------------------- the EP layer
def _untie(moe):
    """Make every expert Parameter of an EP layer an empty tensor, dropping its reference."""
    for n in EXPERT_NAMES:
        for p in getattr(moe, n):
            p.data = p.data.new_empty(0)


class EPMoE(nn.Module):
    """The MoE with its experts split over an EP group: a drop-in for a dense MoE (from_dense).
    w_gate, w_up and w_down hold one Parameter per global expert, empty (numel 0) where this rank
    does not own it, so the Parameter set, and an optimizer built on it, is the same under every
    layout. An owned expert's grad sums over its EP group's tokens: sum it over the replicas
    (layout.dp_group_ranks), and the replicated router's grad over the world."""

    def __init__(self, d_model, d_hidden, n_experts, top_k, layout, group=None):
        """Uninitialised, the global RNG untouched: fill it with load_dense, or use from_dense."""
        super().__init__()
        self.top_k, self.layout, self.group = top_k, layout, group
        self.world_group = None  # exactly the layout's ranks where part of the job (ExpertParallel)
        self.rank = _rank(None, layout)
        self.routing = None  # a hook for an option (routing replay): see below the marker
        self.load = None  # (P * L,) rows per slot, summed, where an option sets it: below too
        self.every_expert_below = EVERY_EXPERT_WORK / (d_model * d_hidden)  # tokens
        _check_ep_group(layout, group, self.rank)
        self.router = nn.utils.skip_init(nn.Linear, d_model, n_experts, bias=False)  # (E, D)
        own = set(layout.owned(self.rank))
        shapes = dict(w_gate=(d_model, d_hidden), w_up=(d_model, d_hidden),
                      w_down=(d_hidden, d_model))
        for n, shape in shapes.items():  # (D, H), (D, H), (H, D) per owned expert, (0,) per other
            experts = [torch.empty(shape if e in own else (0,)) for e in range(n_experts)]
            setattr(self, n, nn.ParameterList(nn.Parameter(t) for t in experts))

    @classmethod
    def from_dense(cls, moe, layout, group=None):
        """Copy a dense MoE (router, w_gate, w_up, w_down, top_k; x @ w) into an EP layer."""
        _check_dense_layer(moe)  # the shapes, top_k, and a router without a bias
        _check_computes_alike(moe)  # its own forward, if it has one, computes this file's MoE
        E, D, H = moe.w_gate.shape
        ep = cls(D, H, E, moe.top_k, layout, group).to(moe.w_gate.device, moe.w_gate.dtype)
        ep.load_dense(moe.router.weight, {n: getattr(moe, n) for n in EXPERT_NAMES})
        return ep

    def forward(self, x):
        shape, P, k = x.shape, self.layout.ep, self.top_k
        L, x = self.layout.slots, x.reshape(-1, shape[-1])              # (N, D)
        gates, top_e = route(x, self.router.weight, k, self.routing)    # (N, k)
        if P == 1 and x.shape[0] <= self.every_expert_below:  # EP 1, a decode step's few tokens
            return self._every_expert(x, gates, top_e).reshape(shape)
        flat_e = self.layout.slot_of(top_e.reshape(-1), self.rank)      # (N*k,) slot: expert
        order = flat_e.argsort(stable=True)                             # (N*k,) by slot = rank
        x_sorted = x[order // k]                                        # (N*k, D)
        counts = torch.bincount(flat_e, minlength=P * L)                # (P*L,) rows to each slot
        if self.load is not None:  # a hook for an option (load balancing): see below the marker
            self.load += counts
        # step 1: the counts, so every rank knows how many rows it gets per (source, local expert)
        counts_in = all_to_all_rows(counts, [L] * P, [L] * P, self.group)  # (P*L,)
        # .tolist() is a device-to-host sync: the payload's split sizes must live on the host
        in_splits = counts.view(P, L).sum(1).tolist()
        out_splits = counts_in.view(P, L).sum(1).tolist()
        # step 2: the packed rows, uneven splits
        x_in = all_to_all_rows(x_sorted, out_splits, in_splits, self.group)  # (M, D) by source
        local_e = torch.arange(L, device=x.device).repeat(P).repeat_interleave(counts_in)  # (M,)
        perm = local_e.argsort(stable=True)                             # (M,) by local expert
        ws = [[getattr(self, n)[e] for n in EXPERT_NAMES] for e in self.layout.owned(self.rank)]
        segs = x_in[perm].split(counts_in.view(P, L).sum(0).tolist())  # L x (m_e, D)
        y_in = torch.cat([expert_mlp(s, *w) for s, w in zip(segs, ws)])[perm.argsort()]  # (M, D)
        y = all_to_all_rows(y_in, in_splits, out_splits, self.group)    # (N*k, D) back home
        y = y[order.argsort()].view(-1, k, shape[-1])                   # (N, k, D)
        return (y * gates.unsqueeze(-1).to(x.dtype)).sum(1).reshape(shape)

    def _every_expert(self, x, gates, top_e):
        """EP 1 sends nothing, and a few tokens run faster through every expert, each weighted by
        its gate (0 where not chosen), than sorted by expert: E/k times the work, no indexing."""
        dense_gates = torch.zeros(x.shape[0], self.layout.n_experts, device=x.device)
        dense_gates = dense_gates.scatter(-1, top_e, gates).to(x.dtype)  # (N, E)
        out = torch.zeros_like(x)                                       # (N, D)
        for e in range(self.layout.n_experts):
            y = expert_mlp(x, *(getattr(self, n)[e] for n in EXPERT_NAMES))  # (N, D)
            out = out + dense_gates[:, e, None] * y
        return out

    def switch(self, layout, group, bucket_bytes, world_group=None):
        """Re-shard the experts in place to `layout`, EP group `group`. Grads must be None.
        Collective over world_group, the group of exactly the layout's ranks (None: the whole job).
        First the local checks (a ValueError, nothing moved), then agree_on_switch, then reshard."""
        taken = self.local_experts()  # name -> {e: tensor}, the Parameters' data
        _check_switch(self, taken, layout, group, bucket_bytes, world_group)
        agree_on_switch(self.layout, layout, world_group, self.router.weight.device)
        _untie(self)  # the switch must own the only reference, or nothing could be freed
        new, stats = reshard(taken, self.layout, layout, bucket_bytes, world_group)
        self._put(new)
        self.layout, self.group = layout, group
        return stats

    # helpers of from_dense and switch
    @torch.no_grad()
    def load_dense(self, router_weight, full):
        self.router.weight.copy_(router_weight)
        self._put(shard_experts(full, self.layout, self.rank))

    def local_experts(self):
        """name -> {e: tensor} of the experts this rank owns (the Parameters' data, no copy)."""
        own = self.layout.owned(self.rank)
        return {n: {e: getattr(self, n)[e].data for e in own} for n in EXPERT_NAMES}

    def _put(self, experts):
        for n, slices in experts.items():
            for e, t in slices.items():
                getattr(self, n)[e].data = t


# ----------------------------------------------------------------------- a whole model
class ExpertParallel:
    """Every MoE layer of a model expert-parallel: EP train_ep in training, infer_ep in rollout.
    apply(model, engine) makes the model's dense MoE layers EPMoE layers of the training layout,
    keeping their weights: leave params(model) out of FSDP. The engine's become layers of the
    inference layout, with the router of the layer each replaces and no experts yet.
    to_rollout() re-shards the model's experts, and the engine's alias them (no copy). to_train()
    moves them back. Every rank calls them together, once the experts' grads and optimizer states
    are off the device: as a mover of fusion.FusedActor. to_rollout moves only the experts: the
    engine's other weights are the caller's to load (`names`: the expert parameters to skip)."""

    def __init__(self, train_ep, infer_ep, world_size, n_experts, bucket_bytes, timeout_s=300.0,
                 ranks=None):
        self.train_layout = EPLayout(train_ep, world_size, n_experts, ranks)
        self.infer_layout = EPLayout(infer_ep, world_size, n_experts, ranks)
        self.train_groups = new_groups(self.train_layout, timeout_s)  # (EP, DP); collective
        self.infer_groups = new_groups(self.infer_layout, timeout_s)
        # the layout's ranks, when part of the job: switch(), the norm's sum (None: the whole job)
        self.group = _group_of_ranks(ranks, timeout_s)
        self.bucket_bytes, self.world, self.stats = bucket_bytes, world_size, {}
        self.model_layers, self.engine_layers, self.names = [], [], set()
        self.balancer = None  # an object passed in, for an option (load balancing): see below

    def apply(self, model, engine=None):
        self.model_layers = self.shard(model)
        _check_found_layers(self.model_layers)
        self.names = {n for n, _ in model.named_parameters() if n.split(".")[-2] in EXPERT_NAMES}
        if engine is not None:
            self.engine_layers = swap_layers(engine, self._empty_like)

    @torch.no_grad()
    def to_rollout(self):
        t0, moved, ep_group = time.perf_counter(), [], self.infer_groups[0]
        layouts = [self.infer_layout] * len(self.model_layers)  # one a layer
        if self.balancer is not None:
            layouts = self.balancer.place(self)
        for m, e, layout in zip(self.model_layers, self.engine_layers, layouts):
            moved.append(m.switch(layout, ep_group, self.bucket_bytes, self.group))
            e.layout = layout  # the engine's layer routes to where the experts now are
            for n in EXPERT_NAMES:
                for pm, pe in zip(getattr(m, n), getattr(e, n)):
                    pe.data = pm.data  # the engine's experts are the moved tensors themselves
        self._record("to_rollout", t0, moved)

    @torch.no_grad()
    def to_train(self):
        t0, moved, ep_group = time.perf_counter(), [], self.train_groups[0]
        for m, e in zip(self.model_layers, self.engine_layers):
            _untie(e)  # the switch must hold the only reference, or nothing could be freed
            moved.append(m.switch(self.train_layout, ep_group, self.bucket_bytes, self.group))
        if self.balancer is not None:
            self.balancer.rollout_done(self)
        self._record("to_train", t0, moved)

    def clip_grads(self, model, max_norm):
        """sync_grads, then clip_grad_norm_ over the FSDP shards and the owned experts together."""
        self.sync_grads(model)
        experts = set(map(id, self.params(model)))
        dense = [p.grad for p in model.parameters() if id(p) not in experts and p.grad is not None]
        norm = torch.nn.utils.get_total_norm(dense)
        sq = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).double() ** 2
        squares = [p.grad.double().pow(2).sum() for p in self.params(model) if p.numel()]
        own = sum(squares).reshape(1)  # this rank's experts' squared norm
        dist.all_reduce(own, group=self.group)  # every expert counted once per replica
        total = (sq + own[0] / self.train_layout.dp).sqrt()
        coef = min(1.0, max_norm / (float(total) + 1e-6))
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(coef)
        return total

    def sync_grads(self, model):
        """After backward: an owned expert's grad sums its EP group's tokens. Summed over the
        replicas and divided by the world, it is the mean over all ranks, as FSDP's grads are."""
        grads = [p.grad for p in self.params(model) if p.numel()]
        flat = torch.cat([g.flatten() for g in grads]) / self.world
        if self.train_layout.dp > 1:
            dist.all_reduce(flat, group=self.train_groups[1])
        for g, f in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(f.view_as(g))

    # ==============================================================================================
    # What follows: the rest of ExpertParallel (shard, params, the engine's empty layers, the
    # figures), optimizer_groups, new_groups, the re-shard's memory count and bound (_Memory), the
    # checks of the caller's input (each raises before any collective), the ranks' agreement on a
    # switch, and the layouts over part of the job.
    # The code above calls them by name, and the default run builds with some of them (shard,
    # optimizer_groups, new_groups): wiring, to take on trust. One is part of the concept: _Memory,
    # the bound that each round of plan_reshard keeps (at most max(source, target) + one bucket).
    # A learner can stop here.
    # ==============================================================================================
    # The options' hooks: route(..., routing) and EPMoE.routing, a hook (N, k) -> (N, k) on the
    # experts chosen that records or replaces them (options/routing_replay.py); the gates are then
    # the router's probabilities of the experts it returns, renormalised. Load balancing
    # (options/eplb.py): EPLayout's placement puts any experts on any row, an expert on several
    # rows holding copies, and each copy takes its share of the expert's rows (slot_of). A
    # placement with copies is for inference: no grad sums over the copies. EPMoE.load, a (P * L,)
    # tensor, sums the rows each slot is sent (none on the EP 1 path that runs every expert).
    # ExpertParallel.balancer, an object passed in: place(ep) gives each layer's rollout layout at
    # the switch to rollout, and rollout_done(ep) reads the rollout's loads at the end of the switch
    # back. A placement need not nest with the training layout: the switch then holds up to
    # max(source, target) + one bucket (plan_reshard's memory bound), not target + one bucket.
    # ranks= (EPLayout, ExpertParallel), group= (reshard) and world_group= (EPMoE.switch): a layout
    # over part of the job, switched over the group of its ranks.

    def shard(self, module):
        """module's dense MoE layers -> EPMoE layers of the training layout, keeping their weights.
        Also for a frozen copy (the reference): it then runs the policy's own EP forward and
        computes what the policy does, bit for bit (a dense forward rounds differently)."""
        group = self.train_groups[0]
        layers = swap_layers(module, lambda m: EPMoE.from_dense(m, self.train_layout, group))
        for layer in layers:  # the group of a whole-model gather (a checkpoint's, a dense copy's)
            layer.world_group = self.group
        return layers

    def params(self, model):
        """The model's expert Parameters: one per global expert, empty where this rank owns none."""
        return [p for n, p in model.named_parameters() if n in self.names]

    # helpers of apply, to_rollout and to_train
    def _empty_like(self, moe):
        """An engine's EP layer: the dense layer's router Parameter itself (a loader filling the
        engine by name still finds it), and no experts until to_rollout aliases the moved ones."""
        E, D, H = moe.w_gate.shape
        ep = EPMoE(D, H, E, moe.top_k, self.infer_layout, self.infer_groups[0])
        ep = ep.to(moe.router.weight.device)
        ep.router.weight = moe.router.weight                            # (E, D)
        ep.requires_grad_(False)
        _untie(ep)
        return ep

    def _record(self, key, t0, moved):
        self.stats.update({
            f"time/ep_{key}_s": time.perf_counter() - t0,
            f"ep/{key}_bytes_moved": sum(s["bytes_moved"] for s in moved),
            f"ep/{key}_bytes_min": sum(s["bytes_min"] for s in moved),
            f"ep/{key}_peak_extra_bytes": max(s["peak_extra_bytes"] for s in moved),
            f"ep/{key}_layer_peak_switch_bytes": max(s["peak_switch_bytes"] for s in moved),
            f"ep/{key}_layer_target_bytes": max(s["to_bytes"] for s in moved)})  # a layer at a time


def optimizer_groups(model):
    """The parameters in two groups, FSDP2 shards (DTensors) and plain tensors (the EP experts):
    a multi-tensor (foreach) optimizer step, CUDA's default, refuses to mix the two kinds."""
    from torch.distributed.tensor import DTensor
    params = list(model.parameters())
    shards = [p for p in params if isinstance(p, DTensor)]
    plain = [p for p in params if not isinstance(p, DTensor)]
    return [{"params": g} for g in (shards, plain) if g]


# ----------------------------------------------- building: the process groups, a model's MoE layers
def new_groups(layout, timeout_s=60.0):
    """(EP group, DP group) of this rank, None for a rank outside the layout. Every rank of the job
    calls it, in the same order: new_group is collective."""
    _check_fits_the_job(layout)
    if not dist.is_initialized():  # a world of one
        return None, None
    rank, timeout, mine = dist.get_rank(), datetime.timedelta(seconds=timeout_s), [None, None]
    for kind, ranks_of in enumerate((layout.ep_group_ranks, layout.dp_group_ranks)):
        for local in sorted({tuple(ranks_of(r)) for r in range(layout.world_size)}):
            ranks = [layout.global_rank(r) for r in local]
            g = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                mine[kind] = g
    return tuple(mine)


def is_dense_moe(m):
    """A dense MoE layer, by attributes: router, top_k, w_gate, w_up and w_down; not an EPMoE."""
    has_all = all(hasattr(m, a) for a in ("router", "top_k", *EXPERT_NAMES))
    return has_all and not isinstance(m, EPMoE)


def swap_layers(module, make):
    """Replace each dense MoE submodule m of module by make(m): returns the new layers, in order."""
    layers = []
    for name, child in list(module.named_modules()):
        if is_dense_moe(child):
            parent, _, attr = name.rpartition(".")
            layers.append(make(child))
            setattr(module.get_submodule(parent), attr, layers[-1])
    return layers


# -------------------------------------------------------------------------- helpers of the re-shard
def _rank(group, layout):
    """This process's rank: in `group` if given, else in the layout's own numbering."""
    if not dist.is_initialized():
        return 0
    return dist.get_rank(group) if group is not None else layout.local_rank(dist.get_rank())


def _held_bytes(*dicts):
    """Bytes of the distinct storages behind the tensors of the given name -> {e: tensor} dicts."""
    seen = {}
    for d in dicts:
        for slices in d.values():
            for t in slices.values():
                s = t.untyped_storage()
                seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


# --------------------------------------------------------------------- checks of the caller's input
def _check_layout(layout):
    """EPLayout's checks: P divides the experts and the world; the ranks are distinct, sorted."""
    sizes = (("n_experts", layout.n_experts), ("world size", layout.world_size))
    bad = [f"{name} {n}" for name, n in sizes if layout.ep < 1 or n % layout.ep]
    if bad:
        raise ValueError(f"EP degree {layout.ep} does not divide {' or '.join(bad)}; it must "
                         f"divide both n_experts {layout.n_experts} and world size "
                         f"{layout.world_size}")
    ranks = layout.ranks
    if ranks is not None and (len(ranks) != layout.world_size or min(ranks) < 0
                              or list(ranks) != sorted(set(ranks))):
        raise ValueError(f"ranks {ranks} must be {layout.world_size} distinct global ranks in "
                         "increasing order (torch.distributed.new_group orders a group's "
                         "ranks so)")
    if layout.placement is not None:
        _check_placement(layout)


def _check_fits_the_job(layout):
    """new_groups' check: the layout fits the process group; with none, it is a world of one."""
    if not dist.is_initialized():
        if layout.world_size != 1:
            raise ValueError(f"layout has world size {layout.world_size} but no process group is "
                             "initialised")
        return
    spans = list(range(layout.world_size)) if layout.ranks is None else list(layout.ranks)
    world = dist.get_world_size()
    if max(spans) >= world or (layout.ranks is None and world != layout.world_size):
        raise ValueError(f"layout world size {layout.world_size} (ranks {spans}) does not fit the "
                         f"process group of {world} ranks; pass ranks= to span part of it")


def _check(experts, src, dst, rank, group):
    """Refuse layouts, a group or experts that do not fit together, before any collective."""
    if (src.world_size, src.n_experts, src.ranks) != (dst.world_size, dst.n_experts, dst.ranks):
        raise ValueError(f"layouts differ in world size ({src.world_size} vs {dst.world_size}), "
                         f"n_experts ({src.n_experts} vs {dst.n_experts}) or ranks ({src.ranks} "
                         f"vs {dst.ranks})")
    if dist.is_initialized():
        size = dist.get_world_size(group)  # group None: the whole job
        if group is not None and size != src.world_size:
            raise ValueError(f"layout world size {src.world_size} != group size {size}")
        if group is None and src.ranks is None and size != src.world_size:
            raise ValueError(f"layout world size {src.world_size} != process group size {size}; "
                             "a layout over part of the job names its ranks (EPLayout(..., "
                             "ranks=...))")
    for n, s in experts.items():
        if sorted(s) != list(src.owned(rank)):
            raise ValueError(f"rank {rank} holds experts {sorted(s)} of {n}, layout says "
                             f"{list(src.owned(rank))}")


def _check_naive_group(src, group):
    """reshard_naive's check: a layout over part of the job all-reduces over its ranks' group."""
    if src.ranks is not None and group is None:
        raise ValueError(f"a layout over ranks {list(src.ranks)} needs the group of those ranks "
                         "(the naive switch all-reduces over it)")


def _check_bucket(slice_bytes, bucket_bytes):
    """plan_reshard's check: a bucket holds at least the biggest expert slice."""
    biggest = max(slice_bytes.values())
    if biggest > bucket_bytes:
        raise ValueError(f"bucket_bytes {bucket_bytes} is smaller than one expert slice "
                         f"({biggest} bytes)")


def _check_ep_group(layout, group, rank):
    """The group of an EP layer's all-to-alls must be this rank's EP group of the layout: another
    group of the same size (the DP group, say) would route rows to the wrong experts, silently."""
    if layout.ep == 1:  # no all-to-all
        return
    world = dist.get_world_size() if dist.is_initialized() else 1
    have = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    want = [layout.global_rank(r) for r in layout.ep_group_ranks(rank)]
    if have != want:
        raise ValueError(f"EP group ranks {have} are not rank {layout.global_rank(rank)}'s EP "
                         f"group {want} under {layout}; pass the first group new_groups(layout) "
                         "returns")


def _check_switch(layer, taken, layout, group, bucket_bytes, world_group):
    """EPMoE.switch's local checks, a ValueError with nothing moved: the target's EP group, no
    grads, the group of a layout over part of the job, the experts held (taken), the bucket."""
    _check_ep_group(layout, group, layer.rank)
    own = layer.layout.owned(layer.rank)
    if any(getattr(layer, n)[e].grad is not None for n in EXPERT_NAMES for e in own):
        raise ValueError("expert grads are set: set them to None before a switch (zero_grad())")
    if world_group is None and layer.layout.ranks is not None and dist.is_initialized():
        raise ValueError(f"a layout over ranks {list(layer.layout.ranks)} needs world_group, "
                         "the group of those ranks: the switch's agreement collective runs "
                         "over it")
    _check(taken, layer.layout, layout, _rank(world_group, layer.layout), world_group)
    slice_bytes = {n: s[own[0]].nbytes for n, s in taken.items()}
    plan_reshard(layer.layout, layout, slice_bytes, bucket_bytes)  # raises on a bucket too small


def _check_found_layers(layers):
    """ExpertParallel.apply's check: the model has a dense MoE layer to make expert-parallel."""
    if not layers:
        raise ValueError("the model has no dense MoE layer (a module with router, top_k, "
                         "w_gate, w_up and w_down; see moe_switch.py's 'Using this file "
                         "elsewhere') to make expert-parallel")


def check_dense(router_weight, w_gate, w_up, w_down, top_k):
    """Refuse a dense MoE not in this file's layout, naming the shapes it needs."""
    E, D, H = w_gate.shape if w_gate.dim() == 3 else (0, 0, 0)
    want = {"router.weight": (E, D), "w_gate": (E, D, H), "w_up": (E, D, H), "w_down": (E, H, D)}
    got = {"router.weight": router_weight, "w_gate": w_gate, "w_up": w_up, "w_down": w_down}
    bad = {n: tuple(t.shape) for n, t in got.items() if tuple(t.shape) != want[n]}
    if bad and w_gate.dim() == 3 and _fits_transposed(router_weight, w_gate, w_up, w_down):
        raise ValueError(f"the expert stacks are in nn.Linear orientation (E, out, in): w_gate "
                         f"{tuple(w_gate.shape)}, w_down {tuple(w_down.shape)} for router.weight "
                         f"{tuple(router_weight.shape)}; pass orientation='nn.Linear' to "
                         "DenseMoE (options/dense_moe.py), which transposes them")
    if bad or E == 0 or not 1 <= top_k <= E:
        raise ValueError(f"a dense MoE needs, in x @ w orientation, router.weight (E, D), w_gate "
                         f"and w_up (E, D, H), w_down (E, H, D) and 1 <= top_k <= E (E, D, H = "
                         f"{E}, {D}, {H} from w_gate); got shapes {bad or None}, top_k {top_k} "
                         "(per-expert nn.Linear layers: DenseMoE.from_linear in "
                         "options/dense_moe.py; stacks of nn.Linear weights: DenseMoE(..., "
                         "orientation='nn.Linear'))")


def _fits_transposed(router_weight, w_gate, w_up, w_down):
    """Whether the stacks, each transposed, are in this file's layout: stacks of nn.Linear weights
    given as x @ w (a square stack fits both ways, and is not caught here)."""
    E, H, D = w_gate.shape
    want = {"router": (E, D), "w_gate": (E, H, D), "w_up": (E, H, D), "w_down": (E, D, H)}
    got = {"router": router_weight, "w_gate": w_gate, "w_up": w_up, "w_down": w_down}
    return all(tuple(got[n].shape) == shape for n, shape in want.items())


@torch.no_grad()
def _check_computes_alike(moe, tokens=4):
    """A layer found by its attributes, with a forward of its own, must compute what this file's MoE
    computes from them: a probe of a few tokens through both. It catches what shapes cannot: a
    square stack (H == D) in nn.Linear orientation, another gate rule, another activation. Skipped
    where the forward does not take (1, T, D) to (1, T, D) (or a tuple that starts with it), and
    where the weights are not materialised."""
    D = moe.w_gate.shape[1]
    experts = {n: getattr(moe, n) for n in EXPERT_NAMES}
    if any(w.is_meta for w in [moe.router.weight, *experts.values()]):
        return
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, tokens, D, generator=gen)                                     # (1, T, D)
    x = x.to(moe.w_gate.device, moe.w_gate.dtype)
    try:
        theirs = moe(x)
    except Exception:  # noqa: BLE001 - a forward of another signature: nothing to compare
        return
    theirs = theirs[0] if isinstance(theirs, (tuple, list)) else theirs
    if not torch.is_tensor(theirs) or theirs.shape != x.shape:
        return
    ours = moe_reference(x[0], moe.router.weight, experts, moe.top_k)                # (T, D)
    scale = theirs.abs().max().item() + 1e-6
    if not torch.allclose(ours.float(), theirs[0].float(), rtol=1e-2, atol=1e-2 * scale):
        gap = (ours.float() - theirs[0].float()).abs().max().item()
        raise ValueError(f"{type(moe).__name__}'s own forward and this file's MoE of its weights "
                         f"differ by up to {gap:.3g} (outputs up to {scale:.3g}) on a probe of "
                         f"{tokens} tokens: this file computes softmax top-{moe.top_k} gates "
                         "renormalised, SwiGLU experts, stacks in x @ w orientation (w_gate (E, D, "
                         "H)); stacks of nn.Linear weights (E, out, in) need DenseMoE(..., "
                         "orientation='nn.Linear') (options/dense_moe.py)")


def _check_dense_layer(moe):
    """EPMoE.from_dense's check: the shapes and top_k of check_dense, and a router with no bias."""
    check_dense(moe.router.weight, moe.w_gate, moe.w_up, moe.w_down, moe.top_k)
    if getattr(moe.router, "bias", None) is not None:
        raise ValueError("router has a bias; this file's MoE has no biases: it would drop it "
                         "and compute something else")


# ----------------------------------------------------------------------- the ranks' agreement
def agree_on_switch(src, dst, group=None, device="cpu"):
    """Every rank of the layout says which switch it makes, (source EP, target EP), in one
    all_gather over `group` (the layout's ranks; None: the default group). Ranks that disagree all
    raise, naming every rank's. A rank that never calls makes the others raise at the timeout,
    not return alone: on nesting layouts a rank may move no bytes."""
    if not dist.is_initialized() or src.world_size == 1:
        return
    mine = torch.tensor([src.ep, dst.ep, _digest(src), _digest(dst)], device=device)  # (4,)
    every = [torch.empty_like(mine) for _ in range(src.world_size)]     # W x (4,)
    ranks = [src.global_rank(r) for r in range(src.world_size)]
    try:
        dist.all_gather(every, mine, group=group)
    except RuntimeError as err:  # gloo and nccl report a timeout as a RuntimeError
        raise RuntimeError(f"EP switch {src.ep} -> {dst.ep}: the ranks' agreement collective "
                           f"failed; every rank of the layout (ranks {ranks}) must call switch() "
                           f"together, with the same target layout ({err})") from err
    asked = [tuple(t.tolist()) for t in every]  # .tolist(): a device-to-host sync, once per layer
    if len(set(asked)) > 1:  # a placement is named by its digest (0: the blocks)
        placed = [f" (placements {c} -> {d})" if c or d else "" for _, _, c, d in asked]
        said = ", ".join(f"rank {g}: EP {a} -> {b}{p}"
                         for g, (a, b, _, _), p in zip(ranks, asked, placed))
        raise ValueError(f"the ranks of the layout disagree on the switch ({said}); every rank of "
                         "the layout must call switch() together, with the same target layout")


def _digest(layout):
    """A placement's digest, the same in every process (0: the blocks)."""
    return 0 if layout.placement is None else zlib.crc32(repr(layout.placement).encode()) + 1


# ----------------------------------------------------------- a placement: experts anywhere, copies
def _spread_over_copies(layout, experts, rank):
    """EPLayout.slot_of under a placement: the i-th token row (in order) of an expert with c copies
    goes to copy (i + rank) mod c: each copy gets its share of the expert's rows, to within one on
    each rank, and the ranks start at different copies."""
    E = layout.n_experts
    table, n_copies = _copies(layout, experts.device)                      # (E, P), (E,)
    if len(layout.placement[0]) * layout.ep == E:  # no copies: each expert's one slot
        return table[experts, 0]
    order = experts.argsort(stable=True)                                   # (n,) by expert
    counts = torch.bincount(experts, minlength=E)                          # (E,)
    first = counts.cumsum(0) - counts                                      # (E,) of each expert
    nth = torch.empty_like(experts)                                        # (n,) i: row's rank
    nth[order] = torch.arange(len(experts), device=experts.device) - first[experts[order]]
    return table[experts, (nth + rank) % n_copies[experts]]


@functools.lru_cache(maxsize=256)
def _copies(layout, device):
    """A placement's slots of each expert, (E, P) padded with its first, and their counts (E,)."""
    L, P = layout.slots, layout.ep
    copies = [[p * L + j for p in range(P) for j, x in enumerate(layout.placement[p]) if x == e]
              for e in range(layout.n_experts)]
    return (torch.tensor([c + c[:1] * (P - len(c)) for c in copies], device=device),
            torch.tensor([len(c) for c in copies], device=device))


class _Memory:
    """plan_reshard's count of the bytes each rank holds between rounds: what it keeps, the slices
    it still has to send, and those it received. A round may add to a rank's holding while it
    stays within max(source, target) + bucket; a source slice is freed after its last send.
    Some transfer always fits: a rank whose next receive would pass its bound holds more bytes
    still to send than it has still to receive, and every byte still to send is some rank's
    receive, so not every rank with receives left can be at its bound."""

    def __init__(self, src, dst, slice_bytes, bucket_bytes, todo):
        W, per_expert = src.world_size, sum(slice_bytes.values())
        self.sizes, self.dst = slice_bytes, dst
        self.sends = Counter((n, e, s) for n, e, s, _ in todo)  # sends left of each source slice
        have = [set(src.owned(r)) for r in range(W)]
        need = [set(dst.owned(r)) for r in range(W)]
        self.held = [len(have[r] & need[r]) * per_expert for r in range(W)]  # kept, then the sent
        for n, e, s in self.sends:
            self.held[s] += slice_bytes[n] * (e not in need[s])
        self.cap = [max(len(have[r]), len(need[r])) * per_expert + bucket_bytes for r in range(W)]

    def fits(self, r, received):
        return self.held[r] + received <= self.cap[r]

    def done(self, rnd):
        for n, e, s, r in rnd:
            self.held[r] += self.sizes[n]
            self.sends[(n, e, s)] -= 1
            if not self.sends[(n, e, s)] and e not in self.dst.owned(s):
                self.held[s] -= self.sizes[n]  # its last send: freed


def _check_placement(layout):
    """EPLayout's checks of a placement: P rows of L expert ids each, increasing (so distinct), and
    every expert held."""
    rows, E = layout.placement, layout.n_experts
    lengths = {len(r) for r in rows}
    held = {e for r in rows for e in r}
    bad = (not isinstance(rows, tuple) or not all(isinstance(r, tuple) for r in rows)
           or len(rows) != layout.ep or len(lengths) != 1 or held != set(range(E))
           or any(list(r) != sorted(set(r)) for r in rows)
           or any(not isinstance(e, int) for r in rows for e in r))
    if bad:
        raise ValueError(f"placement {rows} must be a tuple of P = {layout.ep} tuples of the same "
                         f"length, each of int expert ids in increasing order, holding all of "
                         f"0 .. {E - 1}")


# -------------------------------------------------------------------- a layout over part of the job
def _local_rank(layout, global_rank):
    """EPLayout.local_rank: this process's rank in the layout; ValueError if the layout does not
    span it."""
    if layout.ranks is None:
        return global_rank
    if global_rank not in layout.ranks:
        raise ValueError(f"rank {global_rank} is not one of the layout's ranks "
                         f"{list(layout.ranks)}")
    return layout.ranks.index(global_rank)


def _group_of_ranks(ranks, timeout_s):
    """ExpertParallel's group of a layout over part of the job: new_group of its ranks, collective
    over the job. None for a layout over the whole job, or with no process group."""
    if ranks is None or not dist.is_initialized():
        return None
    return dist.new_group(list(ranks), timeout=datetime.timedelta(seconds=timeout_s))
