# Copyright (c) 2026 The authors of this repository. SPDX-License-Identifier: MIT (see LICENSE).
"""Expert-parallel MoE whose EP degree changes between training and rollout, re-sharded in buckets.

RL Fusion's zero-redundancy memory switching for MoE. Training and rollout share the devices but
want different expert-parallel (EP) degrees. So at each phase change the experts move from one EP
layout to the other. The naive switch gathers all E experts onto every rank and keeps the target's.
Here only the experts whose owner changes move, one bucket at a time. Each source slice is freed
once sent, so a rank holds only its target's experts and the slices it still has to send.

The default run (train_grpo.py) trains at EP 2 and generates at EP 1. This file, in reading order:
  route, moe_reference      the single-process MoE that the EP layer must match, a slow loop
  all_to_all_rows           an uneven all_to_all_single, whose backward is the reverse all_to_all
  EPLayout                  which rank owns which expert
  reshard_naive, reshard    the naive switch, then the bucketed one (plan_reshard, _Memory)
  every_expert, EPMoE       EP 1's decode step, then the EP layer: forward, switch()
  sync_expert_grads, clip_with_experts   the experts' grads made the mean of all ranks, then clipped
  ExpertParallel            a model's MoE layers: apply, to_rollout, to_train, clip_grads
The companion plumbing/moe_switch_details.py holds the checks, the groups, the switch's agreement,
the all_to_all's autograd and a usage example.

Departures from the source system (Huawei's RL post-training on CloudMatrix 384):
  1. Each expert slice (name, e) is its own tensor, not a view of a stacked (E, D, H) parameter,
     because a view cannot be freed alone. A bucket is one round of batched isend/irecv. In it
     each rank sends at most B bytes and receives at most B, with no staging copy.
  2. Memory is the module's own count of a rank's storages: at most max(source, target) + one
     bucket (stats["peak_bytes"]). For layouts that nest, once the switch has freed what it neither
     keeps nor sends, it is at most target + one bucket (stats["peak_switch_bytes"]).
  3. Ranks are laid out EP-outer, in the grid arange(W).view(P, W // P), so degrees that divide
     each other nest. A switch to a higher degree moves nothing; to a lower, what each rank lacks.
  4. The switch leaves grads and optimizer states alone, and the Parameter objects survive it.
     FusedActor offloads the grads before it. The experts skip FSDP: clip_grads syncs and clips.
  5. No capacity factor, token dropping or load-balancing loss: every token reaches its k experts.

Tests: tests/test_moe_switch.py. Bytes, memory and time: python bench/moe_switch.py.
Using this file elsewhere needs torch only. Copy moe_switch.py with its companion (keep the folder,
or change the one import line). Every rank of a layout calls switch() together, with the same
target, or the others raise. The companion's docstring ends with a usage example, which
tests/test_copy_alone.py runs on 2 gloo processes in a folder holding only the two files.

Shapes: N tokens, D model width, H expert hidden width, E experts, k experts per token, P EP degree,
W world size, L local experts (E / P in blocks), M tokens received by this rank, B bucket bytes.
"""
import time
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from plumbing.moe_switch_details import (AllToAll, agree_on_switch, check_bucket,
                                         check_dense_layer, check_ep_group, check_found_layers,
                                         check_layout, check_naive_group, check_reshard,
                                         check_switch, empty_engine_layer, group_of_ranks,
                                         held_bytes, new_groups, rank_in, shard_experts,
                                         slice_specs, swap_layers, switch_figures, untie)

EXPERT_NAMES = ("w_gate", "w_up", "w_down")  # (E, D, H), (E, D, H), (E, H, D) in the dense MoE


# ----------------------------------------------------------------------- the MoE, in one process
def route(x, router_weight, top_k, routing=None):
    """Softmax router, then top-k: x (N, D) -> gates (N, k), renormalised over the k chosen, and
    experts (N, k). `routing` is a hook for an option (routing replay): see the companion."""
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
def all_to_all_rows(x, out_splits, in_splits, group):
    """An uneven all_to_all_single: rows x[sum(in_splits[:j]):...] go to group rank j, and
    out_splits[j] rows come from it. The backward (AllToAll, in the companion) is the reverse
    all_to_all: each grad row goes back the way its row came. In a group of 1, it returns x."""
    return x if len(in_splits) == 1 else AllToAll.apply(x, out_splits, in_splits, group)


# ----------------------------------------------------------------------- layouts
@dataclass(frozen=True)
class EPLayout:
    """Which rank owns which expert. The ranks form the grid arange(W).view(P, W // P). Row p owns
    expert block p (slots p * L to p * L + L - 1). Its W // P ranks are data-parallel replicas. An
    EP group takes one rank from each row. `ranks` maps layout ranks 0 .. W-1 to global ranks."""
    ep: int              # P, the EP degree: the experts split into P blocks of L = E / P
    world_size: int      # W ranks, each holding one block
    n_experts: int       # E
    ranks: tuple = None  # the global rank of each layout rank (None: the same numbers)

    def __post_init__(self):
        check_layout(self)  # in the companion: P divides E and W; ranks distinct, in order

    def global_rank(self, r):
        return r if self.ranks is None else self.ranks[r]

    @property
    def dp(self):
        return self.world_size // self.ep  # replicas of each expert block

    @property
    def slots(self):
        """The experts each rank holds: L = E / P."""
        return self.n_experts // self.ep

    def owned(self, rank):
        """The global expert ids that `rank` holds, in slot order: its block, a range of L."""
        L, p = self.slots, rank // self.dp
        return range(p * L, (p + 1) * L)

    def holders(self, e):
        rows = [p for p in range(self.ep) if e in self.owned(p * self.dp)]
        return [p * self.dp + i for p in rows for i in range(self.dp)]

    def ep_group_ranks(self, rank):
        return [p * self.dp + rank % self.dp for p in range(self.ep)]  # group rank p owns block p

    def dp_group_ranks(self, rank):
        p = rank // self.dp
        return list(range(p * self.dp, (p + 1) * self.dp))

    def slot_of(self, experts, rank=0):
        """(n,) expert ids -> (n,) slots, where slot p * L + j is row p's j-th expert: with blocks,
        the expert id itself. `rank`, the rows' sender, matters only where an expert has copies."""
        return experts


# ----------------------------------------------------------------------- re-sharding, naive first
def reshard_naive(experts, src, dst, group=None):
    """The naive switch. It all_reduces every expert onto every rank, one rank contributing each,
    and keeps the target's. So every rank receives and briefly holds all E experts of each name."""
    check_naive_group(src, group)
    rank = rank_in(group, src)
    check_reshard(experts, src, dst, rank, group)
    stats = dict(bytes_moved=0, peak_bytes=held_bytes(experts))
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
        stats["peak_bytes"] = max(stats["peak_bytes"], held_bytes(experts, new) + full.nbytes)
        del experts[n], full
    return new, stats


def plan_reshard(src, dst, slice_bytes, bucket_bytes):
    """The rounds of a switch from src to dst, each a list of transfers (name, e, s, r): rank s
    sends slice `name` of expert e to rank r, which owns e in dst but not in src. The sender is the
    replica of e with the fewest bytes to send so far. Transfers go first-fit into rounds, in which
    each rank sends at most bucket_bytes, receives at most bucket_bytes, and holds at most
    max(source, target) + bucket_bytes (_Memory). Every rank computes the same plan: no counts move.
    Example: EP 2 -> 1 at world 2, 4 experts, 3 slices of b bytes. Rank 0 owns experts 0 and 1 and
    gets 2 and 3 from rank 1, which gets 0 and 1 from it: 12 transfers. With bucket_bytes = 3 * b,
    round 1 moves expert 2 to rank 0 and 0 to rank 1, round 2 moves 3 and 1. With b: 6 rounds."""
    W = src.world_size
    check_bucket(slice_bytes, bucket_bytes)  # a bucket holds one expert slice at least
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
        assert rnd, "no transfer fits"  # never happens: see _Memory
        memory.done(rnd)
        rounds.append(rnd)
        todo = rest
    return rounds


class _Memory:
    """plan_reshard's count of the bytes each rank holds: the slices it keeps, the source slices it
    still has to send, and those it has received. A round gives a rank a receive only while its
    holding stays within its bound, max(source, target) + bucket. Some transfer always fits:
      1. A rank's target is what it keeps plus all its receives, and its bound is at least that
         plus a bucket. So a rank whose next receive does not fit holds more bytes still to send
         than it has left to receive.
      2. Every byte still to send is a receive left of some rank. So some rank with receives left
         is not in that state, and a new round takes the first transfer to it, or an earlier one."""

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


def reshard(experts, src, dst, bucket_bytes, group=None):
    """Move this rank's expert slices from layout src to dst, in plan_reshard's rounds. `experts`
    maps name -> {global expert id: tensor} for exactly src.owned(rank). The switch consumes it:
    hold no other reference, or freed slices stay alive. Returns (name -> {e: tensor}, stats)."""
    rank = rank_in(group, src)
    check_reshard(experts, src, dst, rank, group)
    meta, slice_bytes, peer = slice_specs(experts, group, src)  # a slice's shape; global ranks
    rounds = plan_reshard(src, dst, slice_bytes, bucket_bytes)  # raises before any collective
    per_expert, need, have = sum(slice_bytes.values()), set(dst.owned(rank)), set(src.owned(rank))
    stats = dict(bytes_moved=0, bytes_min=len(need - have) * per_expert, rounds=len(rounds),
                 from_bytes=len(have) * per_expert, to_bytes=len(need) * per_expert,
                 peak_bytes=held_bytes(experts), bucket_bytes=bucket_bytes)
    pending = Counter((n, e) for rnd in rounds for n, e, s, _ in rnd if s == rank)  # sends left
    new = {n: {e: s.pop(e) for e in sorted(need & have)} for n, s in experts.items()}  # no copy
    for n, s in experts.items():  # neither kept nor sent by me: free at once
        for e in [e for e in s if not pending[(n, e)]]:
            del s[e]
    stats["peak_switch_bytes"] = held_bytes(experts, new)  # from here: target + a bucket (note 2)
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
        held = held_bytes(experts, new)  # the round's receives allocated, its sends not yet freed
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


EVERY_EXPERT_WORK = 3 * 2 ** 18  # EP 1 runs every expert on every token while N x D x H <= this


def every_expert(layer, x, gates, top_e):
    """EPMoE.forward at EP 1 on a few tokens (a decode step): nothing is sent, and the tokens run
    faster through every expert, each weighted by its gate (0 where not chosen), than sorted by
    expert: E/k times the work, no indexing. x (N, D), gates and top_e (N, k) -> (N, D)."""
    dense_gates = torch.zeros(x.shape[0], layer.layout.n_experts, device=x.device)
    dense_gates = dense_gates.scatter(-1, top_e, gates).to(x.dtype)  # (N, E)
    out = torch.zeros_like(x)                                       # (N, D)
    for e in range(layer.layout.n_experts):
        y = expert_mlp(x, *(getattr(layer, n)[e] for n in EXPERT_NAMES))  # (N, D)
        out = out + dense_gates[:, e, None] * y
    return out


# ----------------------------------------------------------------------- the EP layer
class EPMoE(nn.Module):
    """The MoE with its experts split over an EP group, a drop-in for a dense MoE (from_dense).
    w_gate, w_up and w_down hold one Parameter per global expert, empty (numel 0) where this rank
    does not own it. So the Parameter set, and an optimizer built on it, is the same under every
    layout. An owned expert's grad covers its EP group's tokens only. clip_grads makes it the mean
    over all ranks (summed over layout.dp_group_ranks). FSDP averages the router's grad likewise."""

    def __init__(self, d_model, d_hidden, n_experts, top_k, layout, group=None):
        """Uninitialised, the global RNG untouched: use from_dense for a layer with weights."""
        super().__init__()
        self.top_k, self.layout, self.group = top_k, layout, group
        self.world_group = None  # exactly the layout's ranks where part of the job (ExpertParallel)
        self.rank = rank_in(None, layout)
        self.routing = None  # a hook for an option (routing replay): see the companion
        self.every_expert_below = EVERY_EXPERT_WORK / (d_model * d_hidden)  # tokens
        check_ep_group(layout, group, self.rank)
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
        check_dense_layer(moe, EXPERT_NAMES, moe_reference)
        E, D, H = moe.w_gate.shape
        ep = cls(D, H, E, moe.top_k, layout, group).to(moe.w_gate.device, moe.w_gate.dtype)
        with torch.no_grad():
            ep.router.weight.copy_(moe.router.weight)
        full = {n: getattr(moe, n) for n in EXPERT_NAMES}  # name -> (E, ...)
        ep._put(shard_experts(full, layout, ep.rank))  # this rank's slices: name -> {e: (...)}
        return ep

    def forward(self, x):
        shape, P, k = x.shape, self.layout.ep, self.top_k
        L, x = self.layout.slots, x.reshape(-1, shape[-1])              # (N, D)
        gates, top_e = route(x, self.router.weight, k, self.routing)    # (N, k)
        if P == 1 and x.shape[0] <= self.every_expert_below:  # EP 1, a decode step's few tokens
            return every_expert(self, x, gates, top_e).reshape(shape)  # no sort, no send
        flat_e = self.layout.slot_of(top_e.reshape(-1), self.rank)      # (N*k,) slot: expert
        order = flat_e.argsort(stable=True)                             # (N*k,) by slot = rank
        x_sorted = x[order // k]                                        # (N*k, D)
        counts = self._rows_per_slot(flat_e)                            # (P*L,) rows to each slot
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

    def _rows_per_slot(self, slots):
        """(N*k,) slot of each row -> (P*L,) rows to each slot (options/eplb.py sums them too)."""
        return torch.bincount(slots, minlength=self.layout.ep * self.layout.slots)

    def switch(self, layout, group, bucket_bytes, world_group=None):
        """Re-shard the experts in place to `layout`, whose EP group is `group`. Grads must be None.
        It is collective over world_group, exactly the layout's ranks (None: the whole job). Local
        checks raise a ValueError before anything moves. Then agree_on_switch, then reshard."""
        taken = self.local_experts()  # name -> {e: tensor}, the Parameters' data
        check_switch(self, taken, layout, group, bucket_bytes, world_group)
        agree_on_switch(self.layout, layout, world_group, self.router.weight.device)
        untie(self, EXPERT_NAMES)  # the switch must own the only reference, or none is freed
        new, stats = reshard(taken, self.layout, layout, bucket_bytes, world_group)
        self._put(new)
        self.layout, self.group = layout, group
        return stats

    # helpers of from_dense and switch
    def local_experts(self):
        """name -> {e: tensor} of the experts this rank owns (the Parameters' data, no copy)."""
        own = self.layout.owned(self.rank)
        return {n: {e: getattr(self, n)[e].data for e in own} for n in EXPERT_NAMES}

    def _put(self, experts):
        for n, slices in experts.items():
            for e, t in slices.items():
                getattr(self, n)[e].data = t


# ------------------------------------------------------------------------ the experts' gradients
def sync_expert_grads(grads, world, replicas_group):
    """After backward an owned expert's grad sums its EP group's tokens. Summed over the expert's
    replicas (replicas_group; None: it has none) and divided by the world size, it is the mean over
    all ranks, as FSDP's grads are."""
    flat = torch.cat([g.flatten() for g in grads]) / world
    if replicas_group is not None:
        dist.all_reduce(flat, group=replicas_group)
    for g, f in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(f.view_as(g))


def clip_with_experts(model, expert_params, max_norm, replicas, group):
    """clip_grad_norm_ over the FSDP shards and the owned experts together. The dense grads' norm
    comes from torch (a DTensor's over its mesh); the experts' squares are summed over `group`,
    where each expert is counted once per replica. Returns the total norm."""
    experts = set(map(id, expert_params))
    dense = [p.grad for p in model.parameters() if id(p) not in experts and p.grad is not None]
    norm = torch.nn.utils.get_total_norm(dense)
    sq = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).double() ** 2
    squares = [p.grad.double().pow(2).sum() for p in expert_params if p.numel()]
    own = sum(squares).reshape(1)  # this rank's experts' squared norm
    dist.all_reduce(own, group=group)  # every expert counted once per replica
    total = (sq + own[0] / replicas).sqrt()
    coef = min(1.0, max_norm / (float(total) + 1e-6))
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(coef)
    return total


# ----------------------------------------------------------------------- a whole model
class ExpertParallel:
    """Every MoE layer of a model expert-parallel: at EP train_ep in training, infer_ep in rollout.
    apply(model, engine) makes the model's dense MoE layers EPMoE layers of the training layout,
    keeping their weights. Leave params(model) out of FSDP. The engine's become EPMoE layers of the
    inference layout, with the routers they replace and no experts yet. to_rollout() re-shards the
    model's experts, and the engine's alias them (no copy). to_train() moves them back. As a mover
    of fusion.FusedActor, every rank calls both together, with expert grads and optimizer states
    off the device. The caller loads the engine's other weights, all but the experts (`names`)."""
    layer = EPMoE  # the class of the EP layers it makes (options/eplb.py's also counts rows)

    def __init__(self, train_ep, infer_ep, world_size, n_experts, bucket_bytes, timeout_s=300.0,
                 ranks=None):
        self.train_layout = EPLayout(train_ep, world_size, n_experts, ranks)
        self.infer_layout = EPLayout(infer_ep, world_size, n_experts, ranks)
        self.train_groups = new_groups(self.train_layout, timeout_s)  # (EP, DP); collective
        self.infer_groups = new_groups(self.infer_layout, timeout_s)
        self.group = group_of_ranks(ranks, timeout_s)
        self.bucket_bytes, self.world, self.stats = bucket_bytes, world_size, {}
        self.model_layers, self.engine_layers, self.names = [], [], set()

    def apply(self, model, engine=None):
        self.model_layers = self.shard(model)
        check_found_layers(self.model_layers)
        self.names = {n for n, _ in model.named_parameters() if n.split(".")[-2] in EXPERT_NAMES}
        if engine is not None:
            empty = lambda moe: empty_engine_layer(self, moe, EXPERT_NAMES)  # noqa: E731
            self.engine_layers = swap_layers(engine, empty, EXPERT_NAMES, EPMoE)  # no experts yet

    @torch.no_grad()
    def to_rollout(self):
        t0, moved, ep_group = time.perf_counter(), [], self.infer_groups[0]
        layouts = self._rollout_layouts()  # one a layer
        for m, e, layout in zip(self.model_layers, self.engine_layers, layouts):
            moved.append(m.switch(layout, ep_group, self.bucket_bytes, self.group))
            e.layout = layout  # the engine's layer routes to where the experts now are
            for n in EXPERT_NAMES:
                for pm, pe in zip(getattr(m, n), getattr(e, n)):
                    pe.data = pm.data  # the engine's experts are the moved tensors themselves
        self.stats.update(switch_figures("to_rollout", t0, moved))

    @torch.no_grad()
    def to_train(self):
        t0, moved, ep_group = time.perf_counter(), [], self.train_groups[0]
        for m, e in zip(self.model_layers, self.engine_layers):
            untie(e, EXPERT_NAMES)  # the switch must hold the only reference, or none is freed
            moved.append(m.switch(self.train_layout, ep_group, self.bucket_bytes, self.group))
        self.stats.update(switch_figures("to_train", t0, moved))

    def clip_grads(self, model, max_norm):
        """Call after backward. Each owned expert's grad becomes the mean over all ranks, as FSDP's
        grads are (sync_expert_grads). Then all grads are clipped as one norm, with the FSDP shards'
        (clip_with_experts). Returns the total norm."""
        replicas = self.train_groups[1] if self.train_layout.dp > 1 else None
        sync_expert_grads([p.grad for p in self.params(model) if p.numel()], self.world, replicas)
        return clip_with_experts(model, self.params(model), max_norm, self.train_layout.dp,
                                 self.group)

    def shard(self, module):
        """module's dense MoE layers -> EPMoE layers of the training layout, keeping their weights.
        It also serves a frozen copy (the reference), which then runs the policy's own EP forward
        and matches the policy bit for bit. A dense forward would round differently."""
        group = self.train_groups[0]
        layers = swap_layers(module, lambda m: self.layer.from_dense(m, self.train_layout, group),
                             EXPERT_NAMES, EPMoE)
        for layer in layers:  # the group of a whole-model gather (a checkpoint's, a dense copy's)
            layer.world_group = self.group
        return layers

    def params(self, model):
        """The model's expert Parameters: one per global expert, empty where this rank owns none."""
        return [p for n, p in model.named_parameters() if n in self.names]

    def _rollout_layouts(self):
        """Each layer's layout in rollout: the inference layout (options/eplb.py: by load)."""
        return [self.infer_layout] * len(self.model_layers)
