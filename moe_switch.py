# Copyright (c) 2026 The authors of this repository. SPDX-License-Identifier: MIT (the LICENSE file).
"""Expert-parallel MoE whose EP degree changes between training and rollout, re-sharded in buckets.

RL Fusion's zero-redundancy memory switching for MoE: training and inference share
the devices but want different expert-parallel (EP) degrees, so at each phase change the expert weights
move from one EP layout to the other. Parameters are managed in buckets and no rank ever holds a
redundant copy of an expert: only the experts whose owner changes move, one bucket at a time, and each
source slice is freed as soon as it has been sent.

Contents, primitives first:
  moe_reference      the single-process MoE (router, top-k, experts): the math the EP layer must match
  DenseMoE           the dense layout converted from, stacks in x @ w orientation (orientation= says so);
                     DenseMoE.from_linear takes per-expert nn.Linear layers (no biases: this MoE has none)
  all_to_all_rows    all_to_all_single with uneven splits; backward is the reverse all_to_all
  EPLayout           validated layout: EP degree, world size, which experts each rank owns; new_groups()
  reshard_naive      naive switch: materialise every expert on every rank, keep what the target needs
  reshard            the switch: move only changed-owner slices, bucket by bucket, free each once sent
  EPMoE              EP layer: route, dispatch (counts, then packed tokens), local experts, combine; switch(),
                     collective over the layout's ranks: they first agree on the target (agree_on_switch, once
                     per layer: a model of L MoE layers agrees L times at each phase change)
A whole model's MoE layers made EP (the phase-change mover, grads, dense_state_dict) is expert_parallel.py,
which imports this file; this file needs nothing else.

Departures from the source system (Huawei's RL post-training on CloudMatrix 384):
  1. Each expert slice (name, e) is its own tensor, not a view of a stacked (E, D, H) parameter (the
     dense MoE's layout, model.py's: EPMoE.from_dense cuts the stack): a slice of a stacked tensor cannot
     be freed alone, which would make the memory bound impossible. A bucket is one round of batched
     isend/irecv, at most B bytes out and B in per rank, going straight from the source storage into the
     final one: no staging copy, not a persistent flat parameter bucket.
  2. Memory is the module's own accounting of the storages it holds (and, on 2+ GPUs, a test with
     torch.cuda.max_memory_allocated). On entry a rank holds its source layout: the previous phase's
     own memory, more than the target when the EP degree goes up. The switch's first step frees what it
     neither keeps nor sends; from then on it holds at most target + one bucket for nesting layouts
     (note 3: every pair of degrees in {1, 2, 4}), stats["peak_switch_bytes"]. Counting the entry too,
     the peak is max(source, target) + one bucket (peak_bytes, peak_extra_bytes); for layouts that do
     not nest it is reported, not guaranteed.
  3. Ranks are laid out EP-outer, rank grid arange(W).view(P, W // P): a block's replicas are adjacent.
     Layouts whose degrees divide each other then nest: a switch to a higher degree moves nothing, one to
     a lower degree only receives. (EP-inner, a 4 -> 2 switch would move half the experts.)
  4. Optimizer states and gradients stay outside: the caller offloads them and clears grads before a
     switch. The Parameter objects survive every switch, so an optimizer built on them keeps its state.
  5. No capacity factor, token dropping or load-balancing loss: every token reaches its k experts.

Run: python -m pytest tests/test_moe_switch.py   (exactness, round trips, training, memory, bad input)
     python bench/moe_switch.py                  (bytes moved vs minimum, peak memory, switch time)

Using this file elsewhere: torch (tested with 2.13; gloo on CPU, nccl on CUDA; all_to_all_single with uneven splits and
batched isend/irecv). The dense MoE it converts from, by attributes: router (an nn.Linear, weight
(E, D)), w_gate and w_up (E, D, H), w_down (E, H, D), in x @ w orientation (nn.Linear's transposed):
SwiGLU experts y = (silu(x @ w_gate) * (x @ w_up)) @ w_down, no biases, combined by the softmax top_k
gates renormalised over the chosen k. Per-expert nn.Linear layers (Llama, Qwen, Mixtral style:
gate_proj/up_proj/down_proj or w1/w3/w2, weights (H, D), (H, D), (D, H)) convert with DenseMoE.from_linear;
stacks of their weights, (E, H, D), (E, H, D), (E, D, H), with DenseMoE(..., orientation="nn.Linear").
A layout spans ranks 0..W-1 of the job, or any list of them (ranks=), a subgroup of a larger job; every
rank of the job calls new_groups, and every rank of a layout calls switch() together, with the same
target (a rank left out would hang the next forward: the others raise instead). Example, on 2 gloo processes
(tests/test_copy_alone.py runs it in a folder that holds only this file):

    import datetime, os, socket
    import torch, torch.distributed as dist, torch.multiprocessing as mp
    from moe_switch import DenseMoE, EPLayout, EPMoE, moe_reference, new_groups

    class Expert(torch.nn.Module):  # the common per-expert format
        def __init__(self, d, h):
            super().__init__()
            self.gate_proj, self.up_proj = torch.nn.Linear(d, h, bias=False), torch.nn.Linear(d, h, bias=False)
            self.down_proj = torch.nn.Linear(h, d, bias=False)

    def rank_main(rank, world, port):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
        torch.manual_seed(0)  # the same dense weights on every rank
        dense = DenseMoE.from_linear(torch.nn.Linear(8, 4, bias=False), [Expert(8, 16) for _ in range(4)], top_k=2)
        train, infer = EPLayout(2, world, 4), EPLayout(1, world, 4)  # EP 2 to train, EP 1 to generate
        train_group, infer_group = new_groups(train)[0], new_groups(infer)[0]
        moe = EPMoE.from_dense(dense, train, train_group)  # each rank holds 2 of the 4 experts
        x = torch.randn(5 + rank, 8)  # this rank's tokens
        want = moe_reference(x, dense.router.weight, {n: getattr(dense, n) for n in ("w_gate", "w_up", "w_down")}, 2)
        assert torch.allclose(moe(x), want, atol=1e-5)  # tokens crossed ranks to their experts and back
        stats = moe.switch(infer, infer_group, bucket_bytes=1 << 16)  # now every rank holds all 4
        assert torch.allclose(moe(x), want, atol=1e-5)
        print(f"rank {rank}: EP 2 -> 1 moved {stats['bytes_moved']} bytes, the minimum {stats['bytes_min']}")
        dist.barrier()  # every rank done before any tears down
        dist.destroy_process_group()

    if __name__ == "__main__":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(rank_main, args=(2, port), nprocs=2)

Shapes: N tokens, D model width, H expert hidden width, E experts, k experts per token, P EP degree,
W world size, L = E / P local experts, M tokens received by this rank, B bucket bytes.
"""
import datetime
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

EXPERT_NAMES = ("w_gate", "w_up", "w_down")  # (E, D, H), (E, D, H), (E, H, D) in the dense MoE


# ----------------------------------------------------------------------------- the MoE math
def route(x, router_weight, top_k, routing=None):
    """Softmax router and top-k: (N, D) -> gates (N, k) renormalised over the k chosen, experts (N, k).
    routing, optional: a hook experts (N, k) -> experts (N, k) that may record the choice or replace it (routing
    replay: the experts an earlier forward chose); the gates are then this router's probabilities of those."""
    probs = F.linear(x, router_weight).float().softmax(-1)                    # (N, E)
    top_p, top_e = probs.topk(top_k, dim=-1)                                  # (N, k), (N, k)
    if routing is not None:
        top_e = routing(top_e)
        top_p = probs.gather(-1, top_e)                                       # (N, k)
    return top_p / top_p.sum(-1, keepdim=True), top_e


def expert_mlp(x, w_gate, w_up, w_down):
    """One SwiGLU expert on its tokens: (n, D) -> (n, D)."""
    return (F.silu(x @ w_gate) * (x @ w_up)) @ w_down


def moe_reference(x, router_weight, experts, top_k):
    """Single-process MoE, slow loop over experts. experts: name -> stacked (E, ...) tensor."""
    gates, top_e = route(x, router_weight, top_k)                             # (N, k)
    out = torch.zeros_like(x)                                                 # (N, D)
    for e in range(router_weight.shape[0]):
        tok, slot = (top_e == e).nonzero(as_tuple=True)                       # tokens that chose e
        y = expert_mlp(x[tok], *(experts[n][e] for n in EXPERT_NAMES))        # (n_e, D)
        out = out.index_add(0, tok, y * gates[tok, slot, None].to(x.dtype))
    return out


def check_dense(router_weight, w_gate, w_up, w_down, top_k):
    """Refuse a dense MoE not in this file's layout, naming the shapes it needs."""
    E, D, H = w_gate.shape if w_gate.dim() == 3 else (0, 0, 0)
    want = {"router.weight": (E, D), "w_gate": (E, D, H), "w_up": (E, D, H), "w_down": (E, H, D)}
    got = {"router.weight": router_weight, "w_gate": w_gate, "w_up": w_up, "w_down": w_down}
    bad = {n: tuple(t.shape) for n, t in got.items() if tuple(t.shape) != want[n]}
    if bad or E == 0 or not 1 <= top_k <= E:
        raise ValueError(f"a dense MoE needs, in x @ w orientation, router.weight (E, D), w_gate and w_up "
                         f"(E, D, H), w_down (E, H, D) and 1 <= top_k <= E (E, D, H = {E}, {D}, {H} from w_gate); "
                         f"got shapes {bad or None}, top_k {top_k} (per-expert nn.Linear layers: "
                         f"DenseMoE.from_linear; stacks of nn.Linear weights: DenseMoE(..., orientation='nn.Linear'))")


ORIENTATIONS = ("x @ w", "nn.Linear")  # w_gate (E, D, H) used as x @ w; or nn.Linear's (E, H, D), x @ w.T


class DenseMoE(nn.Module):
    """The dense layout this file converts from (see 'Using this file elsewhere'), as a module: router
    (E, D), w_gate and w_up (E, D, H), w_down (E, H, D), in x @ w orientation. No biases."""

    def __init__(self, router_weight, w_gate, w_up, w_down, top_k, *, orientation):
        """orientation, required: "x @ w" takes the stacks as they are, (E, D, H), (E, D, H), (E, H, D);
        "nn.Linear" takes stacks of nn.Linear weights, (out, in): (E, H, D), (E, H, D), (E, D, H), and
        transposes them (a copy). A square stack (H == D) fits both, so no default could catch the wrong one."""
        super().__init__()
        if orientation not in ORIENTATIONS:
            raise ValueError(f"orientation {orientation!r} must be one of {ORIENTATIONS}: 'x @ w' for w_gate, w_up "
                             "(E, D, H) and w_down (E, H, D); 'nn.Linear' for stacks of nn.Linear weights (out, in)")
        if orientation == "nn.Linear":  # (E, out, in) -> (E, in, out)
            w_gate, w_up, w_down = (w.transpose(1, 2).contiguous() for w in (w_gate, w_up, w_down))
        check_dense(router_weight, w_gate, w_up, w_down, top_k)
        E, D = router_weight.shape
        self.router = nn.Linear(D, E, bias=False)
        self.router.weight = nn.Parameter(router_weight)                      # (E, D)
        self.w_gate, self.w_up, self.w_down = nn.Parameter(w_gate), nn.Parameter(w_up), nn.Parameter(w_down)
        self.top_k = top_k

    @classmethod
    def from_linear(cls, router, experts, top_k, names=("gate_proj", "up_proj", "down_proj")):
        """router: nn.Linear(D, E); experts: E modules holding nn.Linear gate (D -> H), up (D -> H) and
        down (H -> D) under `names` (Mixtral: ("w1", "w3", "w2")), all without bias: this MoE has none, so a
        bias is refused (ValueError naming it) rather than dropped. Copies: (E, D, H) x2, (E, H, D)."""
        biased = [f"experts[{e}].{n}" for e, m in enumerate(experts) for n in names if getattr(m, n).bias is not None]
        biased = ["router"] * (getattr(router, "bias", None) is not None) + biased
        if biased:
            raise ValueError(f"{biased[0]} has a bias; this file's MoE has no biases, it would drop them and compute "
                             f"something else ({len(biased)} biased Linear layers in all): build them with "
                             "bias=False, or keep this MoE out of a model that has them")
        gate, up, down = (torch.stack([getattr(m, n).weight.detach() for m in experts]) for n in names)  # (E, out, in)
        return cls(router.weight.detach().clone(), gate, up, down, top_k, orientation="nn.Linear")

    def forward(self, x):
        experts = {n: getattr(self, n) for n in EXPERT_NAMES}
        return moe_reference(x.reshape(-1, x.shape[-1]), self.router.weight, experts, self.top_k).view_as(x)


# ----------------------------------------------------------------------------- communication primitive
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
    """Send rows x[sum(in_splits[:j]) : ...] to group rank j; differentiable; a group of one is a no-op."""
    return x if len(in_splits) == 1 else _AllToAll.apply(x, out_splits, in_splits, group)


# ----------------------------------------------------------------------------- layouts
@dataclass(frozen=True)
class EPLayout:
    """Who owns which expert. Rank grid arange(W).view(P, W // P): row p owns expert block p, and the
    W // P ranks of a row are data-parallel replicas. An EP group takes one rank from each row. Ranks here
    are the layout's own, 0 .. W-1; `ranks` names the process group ranks they are (default 0 .. W-1),
    so that a layout can span part of a larger job."""
    ep: int            # P, the expert-parallel degree: the experts split into P blocks of L = E / P
    world_size: int    # W ranks, each holding one block
    n_experts: int     # E
    ranks: tuple = None  # the global rank of each layout rank (None: the same numbers)

    def __post_init__(self):
        bad = [f"{name} {n}" for name, n in (("n_experts", self.n_experts), ("world size", self.world_size))
               if self.ep < 1 or n % self.ep]
        if bad:
            raise ValueError(f"EP degree {self.ep} does not divide {' or '.join(bad)}; it must divide both "
                             f"n_experts {self.n_experts} and world size {self.world_size}")
        if self.ranks is not None and (len(self.ranks) != self.world_size or min(self.ranks) < 0
                                       or list(self.ranks) != sorted(set(self.ranks))):
            raise ValueError(f"ranks {self.ranks} must be {self.world_size} distinct global ranks in increasing "
                             f"order (torch.distributed.new_group orders a group's ranks so)")

    def global_rank(self, r):
        return r if self.ranks is None else self.ranks[r]

    def local_rank(self, global_rank):
        """This process's rank in the layout; ValueError if the layout does not span it."""
        if self.ranks is None:
            return global_rank
        if global_rank not in self.ranks:
            raise ValueError(f"rank {global_rank} is not one of the layout's ranks {list(self.ranks)}")
        return self.ranks.index(global_rank)

    @property
    def dp(self):
        return self.world_size // self.ep  # replicas of each expert block

    def owned(self, rank):
        """The global expert ids that `rank` holds: a contiguous range of L."""
        L, p = self.n_experts // self.ep, rank // self.dp
        return range(p * L, (p + 1) * L)

    def holders(self, e):
        p = e // (self.n_experts // self.ep)
        return list(range(p * self.dp, (p + 1) * self.dp))

    def ep_group_ranks(self, rank):
        return [p * self.dp + rank % self.dp for p in range(self.ep)]  # group rank p owns block p

    def dp_group_ranks(self, rank):
        return self.holders(self.owned(rank)[0])


def new_groups(layout, timeout_s=60.0):
    """(EP group, DP group) of this rank, None for a rank outside the layout; every rank of the job must
    call it (new_group is collective), in the same order."""
    if not dist.is_initialized():
        if layout.world_size != 1:
            raise ValueError(f"layout has world size {layout.world_size} but no process group is initialised")
        return None, None
    spans = list(range(layout.world_size)) if layout.ranks is None else list(layout.ranks)
    if max(spans) >= dist.get_world_size() or (layout.ranks is None and dist.get_world_size() != layout.world_size):
        raise ValueError(f"layout world size {layout.world_size} (ranks {spans}) does not fit the process group "
                         f"of {dist.get_world_size()} ranks; pass ranks= to span part of it")
    rank, timeout, mine = dist.get_rank(), datetime.timedelta(seconds=timeout_s), [None, None]
    for kind, ranks_of in enumerate((layout.ep_group_ranks, layout.dp_group_ranks)):
        for local in sorted({tuple(ranks_of(r)) for r in range(layout.world_size)}):
            ranks = [layout.global_rank(r) for r in local]
            g = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                mine[kind] = g
    return tuple(mine)


def shard_experts(full, layout, rank):
    """A dense MoE's stacked tensors (name -> (E, ...)) -> this rank's slices: name -> {e: (...)}."""
    return {n: {e: t[e].detach().clone() for e in layout.owned(rank)} for n, t in full.items()}


def stack_local(experts):
    """name -> {e: (...)} -> name -> (L, ...) in expert order (a copy, for checks and export)."""
    return {n: torch.stack([s[e] for e in sorted(s)]) for n, s in experts.items()}


# ----------------------------------------------------------------------------- re-sharding
def _rank(group, layout=None):
    """This process's rank: in `group` if given, else in the layout (its own numbering), else global."""
    if not dist.is_initialized():
        return 0
    if group is not None:
        return dist.get_rank(group)
    return dist.get_rank() if layout is None else layout.local_rank(dist.get_rank())


def _check_ep_group(layout, group, rank):
    """The group an EP layer's all-to-alls run on must be this rank's EP group of the layout: another group of
    the same size (the DP group, say) would route rows to the wrong experts, silently. None: the world."""
    if layout.ep == 1:  # no all-to-all
        return
    world = dist.get_world_size() if dist.is_initialized() else 1
    have = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    want = [layout.global_rank(r) for r in layout.ep_group_ranks(rank)]
    if have != want:
        raise ValueError(f"EP group ranks {have} are not rank {layout.global_rank(rank)}'s EP group {want} "
                         f"under {layout}; pass the first group new_groups(layout) returns")


def _held_bytes(*dicts):
    """Bytes of the distinct storages behind the tensors of the given name -> {e: tensor} dicts."""
    seen = {}
    for d in dicts:
        for slices in d.values():
            for t in slices.values():
                s = t.untyped_storage()
                seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _check(experts, src, dst, rank, group):
    if (src.world_size, src.n_experts, src.ranks) != (dst.world_size, dst.n_experts, dst.ranks):
        raise ValueError(f"layouts differ in world size ({src.world_size} vs {dst.world_size}), n_experts "
                         f"({src.n_experts} vs {dst.n_experts}) or ranks ({src.ranks} vs {dst.ranks})")
    if dist.is_initialized() and group is not None and dist.get_world_size(group) != src.world_size:
        raise ValueError(f"layout world size {src.world_size} != group size {dist.get_world_size(group)}")
    if dist.is_initialized() and group is None and src.ranks is None and dist.get_world_size() != src.world_size:
        raise ValueError(f"layout world size {src.world_size} != process group size {dist.get_world_size()}; "
                         "a layout over part of the job names its ranks (EPLayout(..., ranks=...))")
    for n, s in experts.items():
        if sorted(s) != list(src.owned(rank)):
            raise ValueError(f"rank {rank} holds experts {sorted(s)} of {n}, layout says {list(src.owned(rank))}")


def reshard_naive(experts, src, dst, group=None):
    """Naive switch: all_reduce every expert onto every rank (one contributor each), keep the target's.
    Moves and briefly holds all E experts per name on every rank: the redundancy the source removes."""
    if src.ranks is not None and group is None:
        raise ValueError(f"a layout over ranks {list(src.ranks)} needs the group of those ranks (the naive "
                         "switch all-reduces over it)")
    rank = _rank(group, src)
    _check(experts, src, dst, rank, group)
    stats = dict(bytes_moved=0, peak_bytes=_held_bytes(experts))
    new = {}
    for n in list(experts):
        like = next(iter(experts[n].values()))
        full = like.new_zeros((src.n_experts,) + tuple(like.shape))            # (E, ...) every expert
        for e, t in experts[n].items():
            if src.holders(e)[0] == rank:
                full[e] = t
        dist.all_reduce(full, group=group)                                    # x + 0 + ... + 0 == x exactly
        new[n] = {e: full[e].clone() for e in dst.owned(rank)}
        stats["bytes_moved"] += full.nbytes
        stats["peak_bytes"] = max(stats["peak_bytes"], _held_bytes(experts, new) + full.nbytes)
        del experts[n], full
    return new, stats


def plan_reshard(src, dst, slice_bytes, bucket_bytes):
    """Transfers (name, e, from rank, to rank) of every slice a rank needs and lacks, packed first-fit into
    rounds where each rank sends at most bucket_bytes and receives at most bucket_bytes.
    Pure: every rank computes the same plan, so no counts need to be exchanged."""
    W, biggest = src.world_size, max(slice_bytes.values())
    if biggest > bucket_bytes:
        raise ValueError(f"bucket_bytes {bucket_bytes} is smaller than one expert slice ({biggest} bytes)")
    load, rounds, out, inn = [0] * W, [], [], []  # bytes each rank sends; per round: transfers, bytes out/in
    for r in range(W):
        for e in dst.owned(r):
            if e in src.owned(r):
                continue  # kept in place: never moves
            s = min(src.holders(e), key=lambda h: (load[h], (h - r) % W))  # least-loaded replica sends
            for n, nb in slice_bytes.items():
                load[s] += nb
                i = next((i for i in range(len(rounds)) if max(out[i][s], inn[i][r]) + nb <= bucket_bytes),
                         len(rounds))
                if i == len(rounds):
                    rounds.append([]), out.append([0] * W), inn.append([0] * W)
                rounds[i].append((n, e, s, r))
                out[i][s] += nb
                inn[i][r] += nb
    return rounds


def _peer(group, r, layout):
    """Layout rank r's global rank: P2POp wants global ranks."""
    return layout.global_rank(r) if group is None else dist.get_global_rank(group, r)


def reshard(experts, src, dst, bucket_bytes, group=None):
    """Move this rank's expert slices from layout src to layout dst, one bucket-sized round at a time.
    experts: name -> {global expert id: tensor}, exactly src.owned(rank); it is consumed (the caller must
    hold no other reference, or freed slices stay alive). Returns (name -> {e: tensor} for dst, stats)."""
    rank = _rank(group, src)
    _check(experts, src, dst, rank, group)
    meta = {n: (t.shape, t.dtype, t.device, t.nbytes) for n, s in experts.items() for t in [next(iter(s.values()))]}
    slice_bytes = {n: m[3] for n, m in meta.items()}
    rounds = plan_reshard(src, dst, slice_bytes, bucket_bytes)  # raises before any collective
    per_expert, need, have = sum(slice_bytes.values()), set(dst.owned(rank)), set(src.owned(rank))
    stats = dict(bytes_moved=0, bytes_min=len(need - have) * per_expert, rounds=len(rounds),
                 from_bytes=len(have) * per_expert, to_bytes=len(need) * per_expert,
                 peak_bytes=_held_bytes(experts), bucket_bytes=bucket_bytes)
    pending = Counter((n, e) for rnd in rounds for n, e, s, _ in rnd if s == rank)  # sends left per slice
    new = {n: {e: s.pop(e) for e in sorted(need & have)} for n, s in experts.items()}  # kept: no copy
    for n, s in experts.items():  # neither kept nor sent by me: free at once
        for e in [e for e in s if not pending[(n, e)]]:
            del s[e]
    stats["peak_switch_bytes"] = _held_bytes(experts, new)  # from here on: target + one bucket (note 2)
    for rnd in rounds:  # one bucket: <= bucket_bytes out and <= bucket_bytes in per rank
        ops, sent = [], []
        for tag, (n, e, s, r) in enumerate(rnd):
            if s == rank:  # straight from the source storage, no staging copy
                t = experts[n][e] if e in experts[n] else new[n][e]  # a kept slice already sits in new
                ops.append(dist.P2POp(dist.isend, t.contiguous(), _peer(group, r, src), group, tag))
                sent.append((n, e))
            elif r == rank:  # straight into its final storage, one tensor per slice: freeable alone
                shape, dtype, device, nb = meta[n]
                new[n][e] = torch.empty(shape, dtype=dtype, device=device)
                ops.append(dist.P2POp(dist.irecv, new[n][e], _peer(group, s, src), group, tag))
                stats["bytes_moved"] += nb
        held = _held_bytes(experts, new)  # the round's receives allocated, its sends not yet freed
        stats["peak_bytes"], stats["peak_switch_bytes"] = max(stats["peak_bytes"], held), \
            max(stats["peak_switch_bytes"], held)
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


def agree_on_switch(src, dst, group=None, device="cpu"):
    """Every rank of the layout says which switch it makes, (source EP, target EP), in one all_gather over
    `group` (the layout's ranks; None: the default group). Ranks that disagree all raise a ValueError naming
    every rank's; a rank that never calls makes the others raise at the group's timeout, not return alone
    (on nesting layouts a rank may move no bytes, and would otherwise leave the rest hanging). EPMoE.switch calls
    it for its own layer: once per layer at each phase change, not once per switch of the model."""
    if not dist.is_initialized() or src.world_size == 1:
        return
    mine = torch.tensor([src.ep, dst.ep], device=device)                      # (2,)
    every = [torch.empty_like(mine) for _ in range(src.world_size)]           # W x (2,)
    try:
        dist.all_gather(every, mine, group=group)
    except RuntimeError as err:  # gloo and nccl report a timeout as a RuntimeError (DistBackendError)
        raise RuntimeError(f"EP switch {src.ep} -> {dst.ep}: the ranks' agreement collective failed; every rank "
                           f"of the layout (ranks {[src.global_rank(r) for r in range(src.world_size)]}) must call "
                           f"switch() together, with the same target layout ({err})") from err
    asked = [tuple(t.tolist()) for t in every]  # .tolist(): a device-to-host sync, once per layer's switch
    if len(set(asked)) > 1:
        said = ", ".join(f"rank {src.global_rank(r)}: EP {a} -> {b}" for r, (a, b) in enumerate(asked))
        raise ValueError(f"the ranks of the layout disagree on the switch ({said}); every rank of the layout must "
                         "call switch() together, with the same target layout")


# ----------------------------------------------------------------------------- the EP layer
class EPMoE(nn.Module):
    """The MoE with its experts split over an EP group; a drop-in for a dense MoE with router (E, D) and
    stacked w_gate/w_up (E, D, H), w_down (E, H, D): build it with EPMoE.from_dense(moe, layout, group).
    w_gate/w_up/w_down hold one Parameter per global expert, empty (numel 0) where this rank does not own
    it, so the Parameter set, and an optimizer built on it, is the same under every layout.
    Gradients: an owned expert's grad sums over its EP group's tokens; sum it over layout.dp_group_ranks
    (the replicas), and the replicated router's grad over the world."""

    def __init__(self, d_model, d_hidden, n_experts, top_k, layout, group=None):
        """Uninitialised (and the global RNG untouched): fill it with load_dense, or build it with from_dense,
        so that every layout starts from the same weights."""
        super().__init__()
        self.top_k, self.layout, self.group, self.rank = top_k, layout, group, _rank(None, layout)
        self.routing = None  # optional hook on the experts chosen (route()): record them, or replay recorded ones
        _check_ep_group(layout, group, self.rank)
        self.router = nn.utils.skip_init(nn.Linear, d_model, n_experts, bias=False)  # (E, D), replicated
        shapes = dict(w_gate=(d_model, d_hidden), w_up=(d_model, d_hidden), w_down=(d_hidden, d_model))
        own = set(layout.owned(self.rank))
        for n, shape in shapes.items():  # (D, H), (D, H), (H, D) per owned expert, (0,) per other expert
            setattr(self, n, nn.ParameterList(nn.Parameter(torch.empty(shape if e in own else (0,)))
                                              for e in range(n_experts)))

    @classmethod
    def from_dense(cls, moe, layout, group=None):
        """Copy a dense MoE (attributes router, w_gate, w_up, w_down, top_k; x @ w orientation) into an EP layer."""
        check_dense(moe.router.weight, moe.w_gate, moe.w_up, moe.w_down, moe.top_k)
        if getattr(moe.router, "bias", None) is not None:
            raise ValueError("router has a bias; this file's MoE has no biases: it would drop it and compute "
                             "something else")
        E, D, H = moe.w_gate.shape
        ep = cls(D, H, E, moe.top_k, layout, group).to(moe.w_gate.device, moe.w_gate.dtype)
        ep.load_dense(moe.router.weight, {n: getattr(moe, n) for n in EXPERT_NAMES})
        return ep

    @torch.no_grad()
    def load_dense(self, router_weight, full):
        self.router.weight.copy_(router_weight)
        for n, slices in shard_experts(full, self.layout, self.rank).items():
            for e, t in slices.items():
                getattr(self, n)[e].data = t

    def local_experts(self):
        """name -> {e: tensor} of the experts this rank owns (the Parameters' data, no copy)."""
        return {n: {e: getattr(self, n)[e].data for e in self.layout.owned(self.rank)} for n in EXPERT_NAMES}

    def forward(self, x):
        shape, (P, E), k = x.shape, (self.layout.ep, self.layout.n_experts), self.top_k
        L, x = E // P, x.reshape(-1, shape[-1])                                # (N, D)
        gates, top_e = route(x, self.router.weight, k, self.routing)          # (N, k)
        flat_e = top_e.reshape(-1)                                            # (N*k,) expert per assignment
        order = flat_e.argsort(stable=True)                                   # (N*k,) grouped by expert = by EP rank
        x_sorted = x[order // k]                                              # (N*k, D)
        counts = torch.bincount(flat_e, minlength=E)                          # (E,) rows I send to each expert
        # step 1: the counts, so that every rank knows how many rows it receives per (source, local expert)
        counts_in = counts if P == 1 else _a2a(counts, [L] * P, [L] * P, self.group)  # (P*L,)
        # .tolist() is a device-to-host sync: the payload's split sizes must live on the host
        in_splits = counts.view(P, L).sum(1).tolist()
        out_splits = counts_in.view(P, L).sum(1).tolist()
        # step 2: the packed rows, uneven splits
        x_in = all_to_all_rows(x_sorted, out_splits, in_splits, self.group)   # (M, D) by source, then expert
        local_e = torch.arange(L, device=x.device).repeat(P).repeat_interleave(counts_in)  # (M,)
        perm = local_e.argsort(stable=True)                                   # (M,) grouped by local expert
        ws = [[getattr(self, n)[e] for n in EXPERT_NAMES] for e in self.layout.owned(self.rank)]
        segs = x_in[perm].split(counts_in.view(P, L).sum(0).tolist())        # L x (m_e, D)
        y_in = torch.cat([expert_mlp(s, *w) for s, w in zip(segs, ws)])[perm.argsort()]  # (M, D) arrival order
        y = all_to_all_rows(y_in, in_splits, out_splits, self.group)          # (N*k, D) back home, by expert
        y = y[order.argsort()].view(-1, k, shape[-1])                         # (N, k, D) per token and slot
        return (y * gates.unsqueeze(-1).to(x.dtype)).sum(1).reshape(shape)

    def switch(self, layout, group, bucket_bytes, world_group=None):
        """Re-shard the experts in place to `layout` (EP group `group`). Grads must be None.
        Collective: every rank of the layout calls it together, with the same target. world_group is the
        group of exactly the layout's ranks (None: the default group, for a layout over the whole job).
        1. local checks (groups, grads, layouts, bucket): a ValueError before any collective, nothing moved;
        2. agree_on_switch: one all_gather of this layer's (source EP, target EP), so one per layer at each
           phase change; ranks that disagree all raise, naming both, and a rank that does not call makes
           the others raise at the timeout;
        3. reshard."""
        _check_ep_group(layout, group, self.rank)
        own = self.layout.owned(self.rank)
        if any(getattr(self, n)[e].grad is not None for n in EXPERT_NAMES for e in own):
            raise ValueError("expert grads are set: clear or offload them before a switch")
        if world_group is None and self.layout.ranks is not None and dist.is_initialized():
            raise ValueError(f"a layout over ranks {list(self.layout.ranks)} needs world_group, the group of those "
                             "ranks: the switch's agreement collective runs over it")
        taken = self.local_experts()  # name -> {e: tensor}, the Parameters' data
        _check(taken, self.layout, layout, _rank(world_group, self.layout), world_group)
        plan_reshard(self.layout, layout, {n: s[own[0]].nbytes for n, s in taken.items()}, bucket_bytes)
        agree_on_switch(self.layout, layout, world_group, self.router.weight.device)
        for n in EXPERT_NAMES:  # the switch must own the only reference, or nothing could be freed
            for e in own:
                getattr(self, n)[e].data = taken[n][e].new_empty(0)
        new, stats = reshard(taken, self.layout, layout, bucket_bytes, world_group)
        self._put(new)
        self.layout, self.group = layout, group
        return stats

    def _put(self, experts):
        for n, slices in experts.items():
            for e, t in slices.items():
                getattr(self, n)[e].data = t
