# Copyright (c) 2026 The authors of this repository. SPDX-License-Identifier: MIT (see LICENSE).
"""moe_switch.py's details, which a learner can take on trust: the checks of the caller's input, the
ranks' agreement on a switch, the bytes a rank holds, the process groups, a layout over part of the
job, the model's layers swapped and the figures of a switch.

Copied together with moe_switch.py, which imports it by name (`from plumbing.moe_switch_details
import ...`: keep the folder, or change that one line). It imports only torch and the standard
library, never moe_switch.py (its example aside): a layout is any EPLayout, an EP layer any EPMoE,
and what a check needs of moe_switch.py (EXPERT_NAMES, moe_reference) is passed in. The code of
moe_switch.py calls these by name; in order:
  rank_in, held_bytes          this process's rank; the bytes a rank's experts hold
  shard_experts                a dense MoE's stacks -> this rank's slices of them
  check_*                      the checks, each a ValueError before any collective (check_dense is
                               options/dense_moe.py's too)
  agree_on_switch, digest      every rank of a layout says which switch it makes, in one all_gather
  layout_rank, group_of_ranks  a layout over part of the job (ranks=)
  new_groups, swap_layers      building: the EP and DP groups; a model's dense MoE layers replaced
  untie                        an EP layer's expert Parameters emptied, before a switch
  slice_specs                  a switch's slice shapes and bytes, and the peers' ranks
  switch_figures               ExpertParallel.stats of a switch
  AllToAll                     all_to_all_rows' autograd: the reverse all_to_all in backward
  empty_engine_layer           an engine's EP layer, its experts aliased at each to_rollout

Two hooks stay in moe_switch.py for options. route(..., routing) and EPMoE.routing: a hook (N, k)
-> (N, k) on the experts chosen that records or replaces them (options/routing_replay.py, which
sets it on model.py's dense MoE layers too); the gates are then the router's probabilities of the
experts it returns, renormalised. ranks= (EPLayout, ExpertParallel), group= (reshard) and
world_group= (EPMoE.switch): a layout over part of the job (the hybrid deployment's actor),
switched over the group of its ranks. Expert load balancing (options/eplb.py) subclasses
EPLayout, EPMoE and ExpertParallel at their seams: slots, owned and slot_of; _rows_per_slot;
layer and _rollout_layouts.

Using moe_switch.py elsewhere: this example runs on 2 gloo processes in a folder holding only the
two files (tests/test_copy_alone.py runs it there):

    import copy, datetime, os, socket
    import torch, torch.distributed as dist, torch.multiprocessing as mp
    from moe_switch import EXPERT_NAMES, ExpertParallel, moe_reference

    class MoE(torch.nn.Module):  # a dense MoE (SwiGLU, no biases), found by its attributes:
        def __init__(self, E=4, D=8, H=16):  # router (E, D), top_k, stacks in x @ w orientation
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
"""
import datetime
import time
import zlib

import torch
import torch.distributed as dist


# ------------------------------------------------- helpers of the re-shard: rank, the memory count
def rank_in(group, layout):
    """This process's rank: in `group` if given, else in the layout's own numbering."""
    if not dist.is_initialized():
        return 0
    return dist.get_rank(group) if group is not None else layout_rank(layout, dist.get_rank())


def held_bytes(*dicts):
    """Bytes of the distinct storages behind the tensors of the given name -> {e: tensor} dicts."""
    seen = {}
    for d in dicts:
        for slices in d.values():
            for t in slices.values():
                s = t.untyped_storage()
                seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def shard_experts(full, layout, rank):
    """A dense MoE's stacks (name -> (E, ...)) -> this rank's slices: name -> {e: (...)}, copies."""
    return {n: {e: t[e].detach().clone() for e in layout.owned(rank)} for n, t in full.items()}


# --------------------------------------------------------------------- checks of the caller's input
def check_layout(layout):
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


def check_fits_the_job(layout):
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


def check_reshard(experts, src, dst, rank, group):
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


def check_naive_group(src, group):
    """reshard_naive's check: a layout over part of the job all-reduces over its ranks' group."""
    if src.ranks is not None and group is None:
        raise ValueError(f"a layout over ranks {list(src.ranks)} needs the group of those ranks "
                         "(the naive switch all-reduces over it)")


def check_bucket(slice_bytes, bucket_bytes):
    """plan_reshard's check: a bucket holds at least the biggest expert slice."""
    biggest = max(slice_bytes.values())
    if biggest > bucket_bytes:
        raise ValueError(f"bucket_bytes {bucket_bytes} is smaller than one expert slice "
                         f"({biggest} bytes)")


def check_ep_group(layout, group, rank):
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


def check_layers(ep, layouts, group):
    """ExpertParallel.to_rollout's checks of every layer's switch, before any layer moves. A layer
    refused after another had moved would leave the model part-switched, where FusedActor's undo
    takes a mover that raised for one that moved nothing. (Each EPMoE.switch checks again.)"""
    for layer, layout in zip(ep.model_layers, layouts):
        check_switch(layer, layer.local_experts(), layout, group, ep.bucket_bytes, ep.group)


def check_switch(layer, taken, layout, group, bucket_bytes, world_group):
    """EPMoE.switch's local checks, a ValueError with nothing moved: the target's EP group, no
    grads, the group of a layout over part of the job, the experts held (taken), the bucket."""
    check_ep_group(layout, group, layer.rank)
    own = layer.layout.owned(layer.rank)
    if any(getattr(layer, n)[e].grad is not None for n in taken for e in own):
        raise ValueError("expert grads are set: set them to None before a switch (zero_grad())")
    if world_group is None and layer.layout.ranks is not None and dist.is_initialized():
        raise ValueError(f"a layout over ranks {list(layer.layout.ranks)} needs world_group, "
                         "the group of those ranks: the switch's agreement collective runs "
                         "over it")
    check_reshard(taken, layer.layout, layout, rank_in(world_group, layer.layout), world_group)
    slice_bytes = {n: s[own[0]].nbytes for n, s in taken.items()}
    check_bucket(slice_bytes, bucket_bytes)  # plan_reshard's check: a bucket too small raises


def check_found_layers(layers):
    """ExpertParallel.apply's check: the model has a dense MoE layer to make expert-parallel."""
    if not layers:
        raise ValueError("the model has no dense MoE layer (a module with router, top_k, "
                         "w_gate, w_up and w_down; see moe_switch.py's 'Using this file "
                         "elsewhere') to make expert-parallel")


def check_dense(router_weight, w_gate, w_up, w_down, top_k):
    """Refuse a dense MoE not in moe_switch.py's layout, naming the shapes it needs."""
    E, D, H = w_gate.shape if w_gate.dim() == 3 else (0, 0, 0)
    want = {"router.weight": (E, D), "w_gate": (E, D, H), "w_up": (E, D, H), "w_down": (E, H, D)}
    got = {"router.weight": router_weight, "w_gate": w_gate, "w_up": w_up, "w_down": w_down}
    bad = {n: tuple(t.shape) for n, t in got.items() if tuple(t.shape) != want[n]}
    if bad and w_gate.dim() == 3 and fits_transposed(router_weight, w_gate, w_up, w_down):
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


def fits_transposed(router_weight, w_gate, w_up, w_down):
    """Whether the stacks, each transposed, are in moe_switch.py's layout: stacks of nn.Linear
    weights given as x @ w (a square stack fits both ways, and is not caught here)."""
    E, H, D = w_gate.shape
    want = {"router": (E, D), "w_gate": (E, H, D), "w_up": (E, H, D), "w_down": (E, D, H)}
    got = {"router": router_weight, "w_gate": w_gate, "w_up": w_up, "w_down": w_down}
    return all(tuple(got[n].shape) == shape for n, shape in want.items())


@torch.no_grad()
def check_computes_alike(moe, names, reference, tokens=4):
    """A layer found by its attributes, with a forward of its own, must compute what moe_switch.py's
    MoE computes from them (`reference`: its moe_reference; `names`: its EXPERT_NAMES): a probe of
    a few tokens through both. It catches what shapes cannot: a square stack (H == D) in nn.Linear
    orientation, another gate rule, another activation. Skipped where the forward does not take
    (1, T, D) to (1, T, D) (or a tuple that starts with it), and where the weights are not
    materialised."""
    D = moe.w_gate.shape[1]
    experts = {n: getattr(moe, n) for n in names}
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
    ours = reference(x[0], moe.router.weight, experts, moe.top_k)                    # (T, D)
    scale = theirs.abs().max().item() + 1e-6
    if not torch.allclose(ours.float(), theirs[0].float(), rtol=1e-2, atol=1e-2 * scale):
        gap = (ours.float() - theirs[0].float()).abs().max().item()
        raise ValueError(f"{type(moe).__name__}'s own forward and moe_switch.py's MoE of its "
                         f"weights differ by up to {gap:.3g} (outputs up to {scale:.3g}) on a "
                         f"probe of {tokens} tokens: moe_switch.py computes softmax "
                         f"top-{moe.top_k} gates renormalised, SwiGLU experts, stacks in x @ w "
                         "orientation (w_gate (E, D, H)); stacks of nn.Linear weights (E, out, in) "
                         "need DenseMoE(..., orientation='nn.Linear') (options/dense_moe.py)")


def check_dense_layer(moe, names, reference):
    """EPMoE.from_dense's check: the shapes and top_k of check_dense, a router with no bias, and
    its own forward, if it has one, computing moe_switch.py's MoE (check_computes_alike)."""
    check_dense(moe.router.weight, moe.w_gate, moe.w_up, moe.w_down, moe.top_k)
    if getattr(moe.router, "bias", None) is not None:
        raise ValueError("router has a bias; moe_switch.py's MoE has no biases: it would drop it "
                         "and compute something else")
    check_computes_alike(moe, names, reference)


def slice_specs(experts, group, src):
    """reshard's view of a rank's slices, holding no reference to them: per name the size, dtype
    and device of a slice and its bytes; and the global rank of each layout rank (P2POp's)."""
    like = {n: next(iter(s.values())) for n, s in experts.items()}  # one slice per name
    meta = {n: dict(size=t.shape, dtype=t.dtype, device=t.device) for n, t in like.items()}
    slice_bytes = {n: t.nbytes for n, t in like.items()}
    peer = [src.global_rank(r) if group is None else dist.get_global_rank(group, r)
            for r in range(src.world_size)]
    return meta, slice_bytes, peer


# ----------------------------------------------------------------------- the ranks' agreement
def agree_on_switch(src, dst, group=None, device="cpu"):
    """Every rank of the layout says which switch it makes, (source EP, target EP), in one
    all_gather over `group` (the layout's ranks; None: the default group). Ranks that disagree all
    raise, naming every rank's. A rank that never calls makes the others raise at the timeout,
    not return alone: on nesting layouts a rank may move no bytes."""
    if not dist.is_initialized() or src.world_size == 1:
        return
    mine = torch.tensor([src.ep, dst.ep, digest(src), digest(dst)], device=device)  # (4,)
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


def digest(layout):
    """Which experts each row holds, as a number the same in every process (0: the blocks; any
    other placement, options/eplb.py's, its crc32 + 1)."""
    rows = tuple(tuple(layout.owned(p * layout.dp)) for p in range(layout.ep))
    blocks = tuple(tuple(range(p * len(r), (p + 1) * len(r))) for p, r in enumerate(rows))
    return 0 if rows == blocks else zlib.crc32(repr(rows).encode()) + 1


# -------------------------------------------------------------------- a layout over part of the job
def layout_rank(layout, global_rank):
    """A global rank's rank in the layout (rank_in's); ValueError if the layout does not span it."""
    if layout.ranks is None:
        return global_rank
    if global_rank not in layout.ranks:
        raise ValueError(f"rank {global_rank} is not one of the layout's ranks "
                         f"{list(layout.ranks)}")
    return layout.ranks.index(global_rank)


def group_of_ranks(ranks, timeout_s):
    """ExpertParallel's group of a layout over part of the job: new_group of its ranks, collective
    over the job. None for a layout over the whole job, or with no process group."""
    if ranks is None or not dist.is_initialized():
        return None
    return dist.new_group(list(ranks), timeout=datetime.timedelta(seconds=timeout_s))


# ------------------------------------------------------------------------ building: groups, figures
def new_groups(layout, timeout_s=60.0):
    """(EP group, DP group) of this rank, None for a rank outside the layout. Every rank of the job
    calls it, in the same order: new_group is collective."""
    check_fits_the_job(layout)
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


def swap_layers(module, make, names, ep_class):
    """Replace each dense MoE layer m of module by make(m): returns the new layers, in order. A
    dense MoE layer is found by its attributes, router, top_k and the stacks `names`
    (moe_switch.py's EXPERT_NAMES), and is not an EP layer already (ep_class: EPMoE)."""
    layers = []
    for name, child in list(module.named_modules()):
        is_moe = all(hasattr(child, a) for a in ("router", "top_k", *names))
        if is_moe and not isinstance(child, ep_class):
            parent, _, attr = name.rpartition(".")
            layers.append(make(child))
            setattr(module.get_submodule(parent), attr, layers[-1])
    return layers


def untie(layer, names):
    """Make every expert Parameter of an EP layer (its ParameterLists `names`) an empty tensor,
    dropping its reference to the storage."""
    for n in names:
        for p in getattr(layer, n):
            p.data = p.data.new_empty(0)


def switch_figures(key, t0, moved):
    """ExpertParallel's figures of a switch (key: to_rollout or to_train) begun at t0, from each
    layer's reshard stats (moved): the stats it records."""
    return {
        f"time/ep_{key}_s": time.perf_counter() - t0,
        f"ep/{key}_bytes_moved": sum(s["bytes_moved"] for s in moved),
        f"ep/{key}_bytes_min": sum(s["bytes_min"] for s in moved),
        f"ep/{key}_peak_extra_bytes": max(s["peak_extra_bytes"] for s in moved),
        f"ep/{key}_layer_peak_switch_bytes": max(s["peak_switch_bytes"] for s in moved),
        f"ep/{key}_layer_target_bytes": max(s["to_bytes"] for s in moved)}  # a layer at a time


# ------------------------------------------------------- the EP layer's differentiable all_to_all
def _a2a(x, out_splits, in_splits, group):
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class AllToAll(torch.autograd.Function):
    """moe_switch.all_to_all_rows: the uneven all_to_all_single of rows in forward, the reverse
    all_to_all_single in backward."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _a2a(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _a2a(grad, in_splits, out_splits, ctx.group), None, None, None


# ------------------------------------------------------------------- the engine's empty layer
def empty_engine_layer(ep, moe, names):
    """An engine's EP layer for ExpertParallel.apply: the dense layer's router Parameter itself (a
    loader filling the engine by name still finds it), and no experts until to_rollout aliases
    the moved ones."""
    E, D, H = moe.w_gate.shape
    layer = ep.layer(D, H, E, moe.top_k, ep.infer_layout, ep.infer_groups[0])
    layer = layer.to(moe.router.weight.device)
    layer.router.weight = moe.router.weight                         # (E, D)
    layer.requires_grad_(False)
    untie(layer, names)  # no experts until to_rollout
    return layer
