# Copyright (c) 2026 The authors of this repository. SPDX-License-Identifier: MIT (see LICENSE).
"""Expert-parallel MoE whose EP degree changes between training and rollout, re-sharded in buckets.

This file implements RL Fusion's zero-redundancy memory switching for MoE layers. Training and
rollout share the devices but want different expert-parallel (EP) degrees. So at each phase change,
the experts move from one EP layout to the other. The naive switch gathers all E experts onto every
rank, and each rank then keeps the experts of its target layout. Here only the experts whose owner
changes move, one bucket at a time. Each source slice is freed after the round of its last send.
So a rank holds only the experts of its target layout and the slices it still has to send.

The default run (train_grpo.py) trains at EP 2 and generates at EP 1. This file, in reading order:
  route, moe_reference      the single-process MoE that the EP layer must match, a slow loop
  all_to_all_rows           an uneven all_to_all_single, whose backward is the reverse all_to_all
  EPLayout                  which rank owns which expert
  reshard_naive, reshard    the naive switch, then the bucketed one (plan_reshard, _Memory)
  every_expert, EPMoE       the decode step at EP 1, then the EP layer (forward, switch)
  sync_expert_grads, clip_with_experts   the experts' grads averaged over all ranks, then clipped
  ExpertParallel            all MoE layers of a model (apply, to_rollout, to_train, clip_grads)
The companion file plumbing/moe_switch_details.py holds the input checks, the process groups, the
ranks' agreement on a switch, the autograd function of the all_to_all, and a usage example.

Departures from the source system (Huawei's RL post-training on CloudMatrix 384):
  1. Each expert slice (name, e) is its own tensor, not a view of a stacked (E, D, H) parameter,
     because a view cannot be freed alone. A bucket is one round of batched isend/irecv. In one
     round, each rank sends at most B bytes and receives at most B bytes, with no staging copy.
  2. The module counts memory itself, as the bytes of the storages a rank holds. A rank holds at
     most max(source, target) + one bucket (stats["peak_bytes"]). The switch first frees what the
     rank neither keeps nor sends. From then on, if the layouts nest, the rank holds at most
     target + one bucket (stats["peak_switch_bytes"]).
  3. The EP dimension is the outer one (see EPLayout), so EP degrees that divide each other nest.
     A switch to a higher degree moves nothing. One to a lower degree moves what each rank lacks.
  4. The switch keeps the Parameter objects and the optimizer states. The grads must be None:
     FusedActor offloads them first. The experts skip FSDP, so clip_grads syncs and clips.
  5. Every token reaches its k experts. There is no capacity factor and no load-balancing loss.

Shapes: N tokens, D model width, H expert hidden width, E experts, k experts per token, P EP degree,
W world size, L local experts (E / P in blocks), M tokens received by this rank, B bucket bytes.
The tests are in tests/test_moe_switch.py. python bench/moe_switch.py measures bytes, memory, time.
Using this file elsewhere needs torch >= 2.6 only. Copy moe_switch.py with its companion (keep the
folder, or change the one import line). Every rank of a layout calls switch() together, with the
same target, or the others raise. The companion's docstring ends with a usage example, which
tests/test_copy_alone.py runs on 2 gloo processes in a folder holding only the two files.
"""
import time
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from plumbing.moe_switch_details import (AllToAll, agree_on_switch, check_bucket, check_dense_layer,
                                         check_ep_group, check_found_layers, check_layers,
                                         check_layout, check_naive_group, check_reshard,
                                         check_switch, empty_engine_layer, group_of_ranks,
                                         held_bytes, new_groups, rank_in, shard_experts,
                                         slice_specs, swap_layers, switch_figures, untie)

EXPERT_NAMES = ("w_gate", "w_up", "w_down")  # (E, D, H), (E, D, H), (E, H, D) in the dense MoE


# ----------------------------------------------------------------------- the MoE, in one process
def route(x, router_weight, top_k, routing=None):
    """A softmax router, then top-k. Maps x (N, D) to gates (N, k), renormalised over the k chosen,
    and experts (N, k). `routing` is a hook for the routing replay option (see the companion)."""
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
    """A single-process MoE, a slow loop over experts. `experts` maps names to (E, ...) tensors."""
    gates, top_e = route(x, router_weight, top_k)                   # (N, k)
    out = torch.zeros_like(x)                                       # (N, D)
    for e in range(router_weight.shape[0]):
        tok, slot = (top_e == e).nonzero(as_tuple=True)             # tokens that chose e
        y = expert_mlp(x[tok], *(experts[n][e] for n in EXPERT_NAMES))  # (n_e, D)
        out = out.index_add(0, tok, y * gates[tok, slot, None].to(x.dtype))
    return out


# ----------------------------------------------------------------------- communication primitive
def all_to_all_rows(x, out_splits, in_splits, group):
    """An all_to_all_single with uneven splits. x's rows go out in rank order, in_splits[j] of them
    to group rank j, and out_splits[j] rows come back from it. The backward (AllToAll, in the
    companion) sends each grad row back the way its row came. In a group of 1, it returns x."""
    return x if len(in_splits) == 1 else AllToAll.apply(x, out_splits, in_splits, group)


# ----------------------------------------------------------------------- layouts
@dataclass(frozen=True)
class EPLayout:
    """Says which rank owns which expert. The ranks form the grid arange(W).view(P, W // P). Row p
    owns expert block p, which is slots p * L to p * L + L - 1. The W // P ranks of a row are
    data-parallel replicas of each other. An EP group takes one rank from each row."""
    ep: int              # P, the EP degree: the experts split into P blocks of L = E / P
    world_size: int      # W ranks, each holding one block
    n_experts: int       # E
    ranks: tuple = None  # the global rank of each layout rank, or None if they are the same

    def __post_init__(self):
        check_layout(self)  # checks that P divides E and W, and that ranks are distinct and sorted

    def global_rank(self, r):
        return r if self.ranks is None else self.ranks[r]

    @property
    def dp(self):
        return self.world_size // self.ep  # replicas of each expert block

    @property
    def slots(self):
        """The number of experts each rank holds, L = E / P."""
        return self.n_experts // self.ep

    def owned(self, rank):
        """The global expert ids that `rank` holds, in slot order. They are its row's block of L."""
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
        """Map (n,) expert ids to (n,) slots. Slot p * L + j is row p's j-th expert, so with blocks
        a slot equals its expert id. `rank` (the sender) matters only if an expert has copies."""
        return experts


# ----------------------------------------------------------------------- re-sharding, naive first
def reshard_naive(experts, src, dst, group=None):
    """The naive switch. Each expert is all_reduced onto every rank from one of its holders, and
    each rank keeps its target's experts. So every rank briefly holds all E experts of each name."""
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
        dist.all_reduce(full, group=group)                              # x + 0 + ... is exactly x
        new[n] = {e: full[e].clone() for e in dst.owned(rank)}
        stats["bytes_moved"] += full.nbytes
        stats["peak_bytes"] = max(stats["peak_bytes"], held_bytes(experts, new) + full.nbytes)
        del experts[n], full
    return new, stats


def plan_reshard(src, dst, slice_bytes, bucket_bytes):
    """The rounds of a switch from src to dst. A round is a list of transfers (name, e, s, r).
    In each, rank s sends slice `name` of expert e to rank r, which owns e in dst but not in src.
    The sender is the holder of e with the fewest bytes to send so far. Transfers are packed
    first-fit into rounds. In a round, each rank sends at most bucket_bytes, receives at most
    bucket_bytes, and stays within _Memory's bound. Every rank computes the same plan locally.
    Example: EP 2 -> 1 at world size 2, with 4 experts of 3 slices of b bytes each. Rank 0 owns
    experts 0 and 1 and receives 2 and 3 from rank 1, which receives 0 and 1 from it. That makes
    12 transfers. With bucket_bytes = 3 * b, round 1 moves expert 2 to rank 0 and expert 0 to rank
    1, and round 2 moves experts 3 and 1. With bucket_bytes = b, it takes 6 rounds."""
    W = src.world_size
    check_bucket(slice_bytes, bucket_bytes)  # a bucket must hold at least one expert slice
    load, todo = [0] * W, []  # the bytes each rank sends in total, and the transfers in order
    for r in range(W):
        for e in dst.owned(r):
            if e in src.owned(r):
                continue  # kept in place, so it never moves
            s = min(src.holders(e), key=lambda h: (load[h], (h - r) % W))  # least-loaded replica
            for n, nb in slice_bytes.items():
                load[s] += nb
                todo.append((n, e, s, r))
    memory = _Memory(src, dst, slice_bytes, bucket_bytes, todo)
    rounds = []
    while todo:  # each round takes, in order, every transfer that has room at both ends
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
        assert rnd, "no transfer fits"  # _Memory's docstring shows that this never happens
        memory.done(rnd)
        rounds.append(rnd)
        todo = rest
    return rounds


class _Memory:
    """plan_reshard's count of the bytes each rank holds: the slices it keeps, the source slices it
    still has to send, and the slices it has received. A round gives a rank a receive only if its
    holding stays within its bound, max(source, target) + bucket_bytes. Some transfer always fits:
      1. A rank's target is what it keeps plus everything it receives. Its bound is at least that
         plus one bucket. So if a rank's next receive does not fit, the rank holds more bytes
         still to send than it has left to receive.
      2. Every byte still to send is a receive left for some rank. So some rank with receives left
         is not in that state, and a new round takes its first transfer or an earlier one."""

    def __init__(self, src, dst, slice_bytes, bucket_bytes, todo):
        W, per_expert = src.world_size, sum(slice_bytes.values())
        self.sizes, self.dst = slice_bytes, dst
        self.sends = Counter((n, e, s) for n, e, s, _ in todo)  # sends left per source slice
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
                self.held[s] -= self.sizes[n]  # its last send, so the slice is freed


def reshard(experts, src, dst, bucket_bytes, group=None):
    """Move this rank's expert slices from layout src to dst, in plan_reshard's rounds. `experts`
    maps name -> {global expert id: tensor} for exactly src.owned(rank). The switch consumes it.
    Hold no other reference, or freed slices stay alive. Returns (name -> {e: tensor}, stats)."""
    rank = rank_in(group, src)
    check_reshard(experts, src, dst, rank, group)
    meta, slice_bytes, peer = slice_specs(experts, group, src)  # slice shapes, peers' ranks
    rounds = plan_reshard(src, dst, slice_bytes, bucket_bytes)  # raises before any collective
    per_expert, need, have = sum(slice_bytes.values()), set(dst.owned(rank)), set(src.owned(rank))
    stats = dict(bytes_moved=0, bytes_min=len(need - have) * per_expert, rounds=len(rounds),
                 from_bytes=len(have) * per_expert, to_bytes=len(need) * per_expert,
                 peak_bytes=held_bytes(experts), bucket_bytes=bucket_bytes)
    pending = Counter((n, e) for rnd in rounds for n, e, s, _ in rnd if s == rank)  # sends left
    new = {n: {e: s.pop(e) for e in sorted(need & have)} for n, s in experts.items()}  # no copy
    for n, s in experts.items():  # free at once what this rank neither keeps nor sends
        for e in [e for e in s if not pending[(n, e)]]:
            del s[e]
    stats["peak_switch_bytes"] = held_bytes(experts, new)  # now at most target + a bucket (note 2)
    for rnd in rounds:  # one round moves one bucket (plan_reshard)
        ops, sent = [], []
        for tag, (n, e, s, r) in enumerate(rnd):
            if s == rank:  # straight from the source storage, no staging copy
                t = experts[n][e] if e in experts[n] else new[n][e]  # a kept slice sits in new
                ops.append(dist.P2POp(dist.isend, t.contiguous(), peer[r], group, tag))
                sent.append((n, e))
            elif r == rank:  # straight into its final storage, its own tensor (note 1 above)
                new[n][e] = torch.empty(**meta[n])
                ops.append(dist.P2POp(dist.irecv, new[n][e], peer[s], group, tag))
                stats["bytes_moved"] += slice_bytes[n]
        held = held_bytes(experts, new)  # the round's receives allocated, its sends not yet freed
        stats["peak_bytes"] = max(stats["peak_bytes"], held)
        stats["peak_switch_bytes"] = max(stats["peak_switch_bytes"], held)
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        ops = t = work = None  # they hold the sent slices: drop them so the dels below free them
        for n, e in sent:
            pending[(n, e)] -= 1
            if not pending[(n, e)] and e not in need:
                del experts[n][e]  # its last send from this rank, so free it now
    assert not any(experts.values()), "a source slice outlived the switch"
    new = {n: dict(sorted(s.items())) for n, s in new.items()}
    stats["peak_extra_bytes"] = stats["peak_bytes"] - max(stats["from_bytes"], stats["to_bytes"])
    return new, stats


EVERY_EXPERT_WORK = 3 * 2 ** 18  # EP 1 runs every expert on every token while N x D x H <= this


def every_expert(layer, x, gates, top_e):
    """EPMoE.forward at EP 1 on a few tokens, as in a decode step. Each token runs through every
    expert, weighted by its gate (0 if not chosen). This is E/k times the work but needs no
    indexing, so it is faster than sorting by expert. x (N, D), gates and top_e (N, k) -> (N, D)."""
    dense_gates = torch.zeros(x.shape[0], layer.layout.n_experts, device=x.device)
    dense_gates = dense_gates.scatter(-1, top_e, gates).to(x.dtype)  # (N, E)
    out = torch.zeros_like(x)                                       # (N, D)
    for e in range(layer.layout.n_experts):
        y = expert_mlp(x, *(getattr(layer, n)[e] for n in EXPERT_NAMES))  # (N, D)
        out = out + dense_gates[:, e, None] * y
    return out


# ----------------------------------------------------------------------- the EP layer
class EPMoE(nn.Module):
    """An MoE whose experts are split over an EP group, a drop-in for a dense MoE (from_dense).
    w_gate, w_up and w_down hold one Parameter per global expert, empty (numel 0) where this rank
    does not own the expert. So the Parameter set, and an optimizer built on it, is the same under
    every layout. FSDP averages the router's grad. sync_expert_grads averages the experts' grads."""

    def __init__(self, d_model, d_hidden, n_experts, top_k, layout, group=None):
        """Leaves the weights uninitialised and the global RNG untouched. from_dense fills them."""
        super().__init__()
        self.top_k, self.layout, self.group = top_k, layout, group
        self.world_group = None  # the layout's ranks (set by ExpertParallel), or None for all ranks
        self.rank = rank_in(None, layout)
        self.routing = None  # the routing replay hook of route()
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
        """Copy a dense MoE (router, w_gate, w_up, w_down, top_k, used as x @ w) to an EP layer."""
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
        flat_e = self.layout.slot_of(top_e.reshape(-1), self.rank)      # (N*k,) each row's slot
        order = flat_e.argsort(stable=True)                             # (N*k,) by slot, so by rank
        x_sorted = x[order // k]                                        # (N*k, D)
        counts = self._rows_per_slot(flat_e)                            # (P*L,) rows to each slot
        # step 1 sends the counts, so each rank knows its rows per (source, local expert)
        counts_in = all_to_all_rows(counts, [L] * P, [L] * P, self.group)  # (P*L,)
        # .tolist() syncs device and host, because all_to_all needs the split sizes on the host
        in_splits = counts.view(P, L).sum(1).tolist()
        out_splits = counts_in.view(P, L).sum(1).tolist()
        # step 2 sends the rows themselves, in uneven splits
        x_in = all_to_all_rows(x_sorted, out_splits, in_splits, self.group)  # (M, D) by source
        local_e = torch.arange(L, device=x.device).repeat(P).repeat_interleave(counts_in)  # (M,)
        perm = local_e.argsort(stable=True)                             # (M,) by local expert
        ws = [[getattr(self, n)[e] for n in EXPERT_NAMES] for e in self.layout.owned(self.rank)]
        segs = x_in[perm].split(counts_in.view(P, L).sum(0).tolist())  # L x (m_e, D)
        y_in = torch.cat([expert_mlp(s, *w) for s, w in zip(segs, ws)])[perm.argsort()]  # (M, D)
        y = all_to_all_rows(y_in, in_splits, out_splits, self.group)    # (N*k, D) back at source
        y = y[order.argsort()].view(-1, k, shape[-1])                   # (N, k, D)
        return (y * gates.unsqueeze(-1).to(x.dtype)).sum(1).reshape(shape)

    def _rows_per_slot(self, slots):
        """(N*k,) slot of each row -> (P*L,) rows to each slot (options/eplb.py sums them too)."""
        return torch.bincount(slots, minlength=self.layout.ep * self.layout.slots)

    def switch(self, layout, group, bucket_bytes, world_group=None):
        """Re-shard the experts in place to `layout`, whose EP group is `group`. Grads must be None.
        Every rank of world_group calls it together. Local checks raise a ValueError before
        anything moves. Then the ranks agree (agree_on_switch) and move the experts (reshard)."""
        taken = self.local_experts()  # name -> {e: tensor}, the Parameters' data
        check_switch(self, taken, layout, group, bucket_bytes, world_group)
        agree_on_switch(self.layout, layout, world_group, self.router.weight.device)
        untie(self, EXPERT_NAMES)  # the switch must hold the only references, or nothing is freed
        new, stats = reshard(taken, self.layout, layout, bucket_bytes, world_group)
        self._put(new)
        self.layout, self.group = layout, group
        return stats

    def local_experts(self):
        """name -> {e: tensor} for the experts this rank owns: the Parameters' data, not a copy."""
        own = self.layout.owned(self.rank)
        return {n: {e: getattr(self, n)[e].data for e in own} for n in EXPERT_NAMES}

    def _put(self, experts):
        for n, slices in experts.items():
            for e, t in slices.items():
                getattr(self, n)[e].data = t


# ------------------------------------------------------------------------ the experts' gradients
def sync_expert_grads(grads, world, replicas_group):
    """After backward, an owned expert's grad sums over its EP group's tokens only. It is summed
    over the expert's replicas (replicas_group, the layout's dp group, or None if there are none)
    and divided by the world size. It is then the mean over all ranks, as FSDP's grads are."""
    flat = torch.cat([g.flatten() for g in grads]) / world
    if replicas_group is not None:
        dist.all_reduce(flat, group=replicas_group)
    for g, f in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(f.view_as(g))


def clip_with_experts(model, expert_params, max_norm, replicas, group):
    """clip_grad_norm_ over the FSDP shards and the owned experts together. torch computes the
    dense grads' norm, over the whole mesh for a DTensor. The experts' squared norms are summed
    over `group`, which counts each expert once per replica. Returns the total norm."""
    experts = set(map(id, expert_params))
    dense = [p.grad for p in model.parameters() if id(p) not in experts and p.grad is not None]
    norm = torch.nn.utils.get_total_norm(dense)
    sq = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).double() ** 2
    squares = [p.grad.double().pow(2).sum() for p in expert_params if p.numel()]
    own = sum(squares).reshape(1)  # this rank's experts' squared norm
    dist.all_reduce(own, group=group)
    total = (sq + own[0] / replicas).sqrt()
    coef = min(1.0, max_norm / (float(total) + 1e-6))
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(coef)
    return total


# ----------------------------------------------------------------------- a whole model
class ExpertParallel:
    """Makes every MoE layer of a model expert-parallel, at EP degree train_ep in training and
    infer_ep in rollout. apply(model, engine) shards the model (see shard). Leave params(model) out
    of FSDP. The engine's MoE layers become EPMoE layers of the inference layout. They keep the
    routers they replace and hold no experts yet. The caller loads the engine's other weights, all
    but the experts (`names`). to_rollout() re-shards the model's experts, and the engine's layers
    alias them without a copy. to_train() moves them back. fusion.FusedActor calls both as a
    mover, on every rank together, with the expert grads and optimizer states off the device."""
    layer = EPMoE  # the class of the EP layers it makes (options/eplb.py's also counts rows)

    def __init__(self, train_ep, infer_ep, world_size, n_experts, bucket_bytes, timeout_s=300.0,
                 ranks=None):
        self.train_layout = EPLayout(train_ep, world_size, n_experts, ranks)
        self.infer_layout = EPLayout(infer_ep, world_size, n_experts, ranks)
        self.train_groups = new_groups(self.train_layout, timeout_s)  # (EP, DP) groups, collective
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
        layouts = self._rollout_layouts()  # one per layer
        check_layers(self, layouts, ep_group)  # every layer, before any moves
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
            untie(e, EXPERT_NAMES)  # the switch must hold the only references, or nothing is freed
            moved.append(m.switch(self.train_layout, ep_group, self.bucket_bytes, self.group))
        self.stats.update(switch_figures("to_train", t0, moved))

    def clip_grads(self, model, max_norm):
        """Call after backward. sync_expert_grads makes each owned expert's grad the mean over all
        ranks. Then clip_with_experts clips all grads by one total norm, which is returned."""
        replicas = self.train_groups[1] if self.train_layout.dp > 1 else None
        sync_expert_grads([p.grad for p in self.params(model) if p.numel()], self.world, replicas)
        return clip_with_experts(model, self.params(model), max_norm, self.train_layout.dp,
                                 self.group)

    def shard(self, module):
        """Replace module's dense MoE layers with EPMoE layers of the training layout, keeping their
        weights. It also serves a frozen copy, the reference, which then runs the policy's own EP
        forward and matches the policy bit for bit. A dense forward would round differently."""
        group = self.train_groups[0]
        layers = swap_layers(module, lambda m: self.layer.from_dense(m, self.train_layout, group),
                             EXPERT_NAMES, EPMoE)
        for layer in layers:  # the group for whole-model gathers, as for a checkpoint or dense copy
            layer.world_group = self.group
        return layers

    def params(self, model):
        """The model's expert Parameters, one per global expert (see EPMoE)."""
        return [p for n, p in model.named_parameters() if n in self.names]

    def _rollout_layouts(self):
        """Each layer's rollout layout: the inference layout (options/eplb.py places by load)."""
        return [self.infer_layout] * len(self.model_layers)
