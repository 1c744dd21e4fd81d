# Copyright (c) 2026 The authors of this repository. SPDX-License-Identifier: MIT (the LICENSE file).
"""RL Fusion: the actor's training and its rollout share every device, one phase at a time.

  TRAIN    FSDP2 parameter shards over all W ranks (or within each node, whole copies across nodes: HSDP's
           layout; or pipeline stages: below), their grads and the AdamW states, on the device.
  ROLLOUT  the inference layout, TP degree t and W/t replicas: each rank holds its TP piece of every
           weight, built from the shards, and the engine's KV cache; grads and AdamW states wait on host.
to_rollout() copies the grads and AdamW states into the actor's host buffers and frees their device
storages (offload: the tensors stay in the optimizer, their storages resized to 0), then builds the
engine's weights from the training layout bucket by bucket, holding at most one bucket more. to_train()
frees them and copies the host buffers back into the same storages (reload), bit for bit. State that
changes layout too (the experts of expert_parallel.py, re-sharded by moe_switch.py) rides along as a "mover".

The training layout may be pipeline stages: stage s's layers on its own ranks (FSDP2 over a 1-D mesh of
them, or whole on one rank), its module carrying the whole model's names for its parameters. The actor
learns at construction which ranks hold each weight (union_meta: one all_gather_object; the same list of
Weights, in the same order, on every rank) and builds every weight on every rank from its owners: they copy
their rows into place, one broadcast per owner's piece brings them to the others (a non-owner receives
the whole weight); the engine is the whole model on every rank, TP x DP over all W, as without stages.

A switch's path is two choices; FusedActor.path names it, and train_grpo.py prints it once at start.
  The engine's weights (inplace=; FusedActor._fill)
    in place      TP 1, the engine's parameters are the model's: the gather writes straight into them.
    load_weights  any TP: a bucket of full weights handed to engine.load_weights (vLLM's interface), which
                  cuts its TP piece, fuses, renames and copies.
  The bytes' way to every rank (transport=; the seam: Broadcasts); the training layout may be pipeline stages
    Broadcasts    this file, any backend and hosts: for each weight, each owner copies its own rows into place,
                  then one in-place broadcast per owner's piece (W under FSDP2 over all ranks, a node's ranks
                  within each node, a stage's ranks under PP, none for a weight every rank holds whole) brings
                  them to the others (gather_into).
    SharedMemory  shm_transport.py, the ranks of one host on CPU: each copies its peers' rows out of their
                  shared memory, one copy per byte, as verl and NeMo-RL read a GPU node's through CUDA IPC.
                  Shards over all W ranks only: under pipeline stages its connect() returns None (Broadcasts).
  train_grpo.py: in place at TP 1, else load_weights; on CPU on one host SharedMemory (Broadcasts where it
  cannot connect); on GPUs, one node or several, Broadcasts over nccl (not yet run with over one rank).

Departures from the source system (Huawei's RL post-training on CloudMatrix 384):
  1. FSDP (ZeRO-3) to train, or PP stages (each FSDP2 over its ranks, or whole on one); TP to generate (every
     rank gathers every weight, the engine is not pipelined); EP in expert_parallel.py (not yet under PP).
  2. The training shards stay on the device in ROLLOUT (1/W of the model); offload_params=True moves them.
  3. The actor frees the engine's weights in TRAIN (vLLM's sleep mode would); the KV cache is the engine's.
The calls that would read a freed storage, and crash the process, raise instead, naming the phase: the
engine in TRAIN, optimizer.step() or a backward in ROLLOUT, the model in ROLLOUT under offload_params.
(Other reads of the grads or states in ROLLOUT, zero_grad(set_to_none=False) or clipping, are not guarded.)

Run: python -m pytest tests/test_fusion.py   (exactness W 1/2 x t 1/2, bit-identical training, memory, PP 2 stages
     at W 2; W 4, PP 2 x FSDP 2 among them: -m slow)

Using this file elsewhere: torch >= 2.6, gloo or nccl, a model and an engine as FusedActor says. Example, a
vLLM-shaped engine on 2 gloo processes (tests/test_copy_alone.py runs it in a folder holding only this file):

    import datetime, os, socket
    import torch, torch.distributed as dist, torch.multiprocessing as mp
    from torch.distributed.fsdp import fully_shard
    from fusion import FusedActor, rollout

    class Engine(torch.nn.Module):  # the rollout engine, vLLM-shaped: the model's weight and bias fused, renamed
        def __init__(self):
            super().__init__()
            self.fused = torch.nn.Parameter(torch.zeros(8, 9), requires_grad=False)  # [weight | bias]

        def forward(self, x):
            return torch.nn.functional.linear(x, self.fused[:, :8], self.fused[:, 8])

        def load_weights(self, weights):  # maps the model's names onto its own, returns the names it loaded
            for name, w in weights:  # "weight" (8, 8) into fused[:, :8], "bias" (8,) into fused[:, 8]
                self.fused[:, slice(8) if name == "weight" else 8] = w
            return {"fused"}

    def rank_main(rank, world, port):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
        torch.manual_seed(0)
        model, engine = fully_shard(torch.nn.Linear(8, 8)), Engine()  # the trained model: FSDP2 over every rank
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(torch.randn(4, 8)).sum().backward()
        opt.step()  # now there is Adam state to move
        actor = FusedActor(model, opt, engine, bucket_bytes=1024)
        x = torch.randn(2, 8)
        with rollout(actor) as eng:  # Adam state on host, the engine's weights built from the shards
            out = eng(x)
        assert torch.allclose(out, model(x), atol=1e-6)  # back in TRAIN: the model computes the same
        print(f"rank {rank}: engine == model, {actor.metrics()['switch/offload_bytes']} bytes offloaded")
        dist.barrier()  # every rank done before any tears down
        dist.destroy_process_group()
        os._exit(0)  # no interpreter teardown: there torch 2.13 + gloo aborted about 1 exit in 12 here, work done

    if __name__ == "__main__":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(rank_main, args=(2, port), nprocs=2)

Shapes: W world size, t TP degree, W/t DP replicas, B bucket bytes, d a weight's owners (W under FSDP2 over all
ranks, a stage's ranks under PP), c = ceil(rows / d) rows per shard.
"""
import time
from contextlib import contextmanager, suppress
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.tensor import DTensor, Shard

TRAIN, ROLLOUT = "TRAIN", "ROLLOUT"


# ----------------------------------------------------------------------------- host offload
def storages(tensors, device=None):
    """The distinct allocated storages behind tensors (a DTensor: its local shard), on `device` if given."""
    stores = [(t._local_tensor if isinstance(t, DTensor) else t).untyped_storage() for t in tensors]
    return list({s.data_ptr(): s for s in stores if s.nbytes() and device in (None, s.device)}.values())


def held_bytes(tensors, device=None):
    """The module's memory accounting: bytes of the distinct storages still allocated behind tensors."""
    return sum(s.nbytes() for s in storages(tensors, device))


def _as_bytes(s):
    return torch.empty(0, dtype=torch.uint8, device=s.device).set_(s)  # (nbytes,) uint8 view of a storage


def _synchronize(device):
    """Wait for the work queued on the device's current stream: an accelerator's, through torch.accelerator (torch
    >= 2.6, this file's floor); nothing on CPU, whose work is done when its call returns."""
    if device.type != "cpu":
        torch.accelerator.current_stream(device).synchronize()


def _allocated(device):
    """Bytes of tensors the device's allocator holds: torch.accelerator.memory_allocated (torch >= 2.8), else the
    device's own module's (torch 2.6, 2.7: torch.cuda, torch.xpu, a plugin's torch.npu). None on CPU, or where the
    accelerator keeps no such count (MPS: torch.accelerator's memory calls do not cover it)."""
    if device.type == "cpu":
        return None
    try:
        if hasattr(torch.accelerator, "memory_allocated"):
            return torch.accelerator.memory_allocated(device)
        return getattr(torch, device.type).memory_allocated(device)
    except (AttributeError, RuntimeError):
        return None


def offload(stores, hosts=()):
    """Copy each device storage into a host buffer, then free it in place (resize to 0): every tensor that
    views it stays a valid object and gets its bytes back from reload(). Host buffers are reused when the
    sizes match; on CUDA they are pinned and the copy is non-blocking (the free is stream-ordered after it)."""
    if any(s.device.type == "cpu" and s.is_shared() for s in stores):  # torch crashes as one grows back
        raise ValueError("offload: a storage in shared memory (a SharedMemory transport's shard) cannot be freed")
    out = []
    try:  # all or nothing: a failure (a host buffer not allocated) gives back what was freed
        for i, s in enumerate(stores):
            cuda = s.device.type == "cuda"
            h = hosts[i] if i < len(hosts) and hosts[i].numel() == s.nbytes() else \
                torch.empty(s.nbytes(), dtype=torch.uint8, pin_memory=cuda)
            h.copy_(_as_bytes(s), non_blocking=cuda)
            s.resize_(0)
            out.append(h)
    except BaseException:
        reload(stores[:len(out)], out)
        raise
    return out


def reload(stores, hosts):
    """Re-allocate each freed storage and copy its bytes back from its host buffer."""
    for s, h in zip(stores, hosts):
        s.resize_(h.numel())
        _as_bytes(s).copy_(h, non_blocking=s.device.type == "cuda")


# ----------------------------------------------------------------------------- building the weights
def reshard_all(module):
    """FSDP2 leaves a module unsharded after a no-grad forward: reshard it, named_parameters() the shards."""
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


class Weight(NamedTuple):
    """A weight to build, and where the training layout holds it. owners (global ranks) hold Shard(0) pieces of it
    in that order (sharded: c = ceil(rows / d) rows each over the d owners, the last shorter or empty: FSDP2 over
    all W ranks, or over a pipeline stage's), or each holds it whole (a plain stage, or a plain model).
    replicas > 1: the weight is sharded so on each of that many disjoint meshes of d ranks (FSDP2 within each node,
    HSDP's layout: gradsync.py averages across them); owners names the first, and each rank gathers from its own."""
    name: str
    shape: tuple
    dtype: torch.dtype
    owners: tuple
    sharded: bool
    replicas: int = 1


def _rank():
    return dist.get_rank() if dist.is_initialized() else 0


def _group_ranks(group):
    """The global ranks of group (None: the default group; a single process without one: [0])."""
    if group is not None:
        return dist.get_process_group_ranks(group)
    return list(range(dist.get_world_size())) if dist.is_initialized() else [0]


def _weight(name, p):
    """p's Weight as this rank sees it: a DTensor's owners are its mesh's global ranks; a plain tensor's, this rank."""
    if isinstance(p, DTensor):
        return Weight(name, tuple(p.shape), p.dtype, tuple(p.device_mesh.mesh.flatten().tolist()), True)
    return Weight(name, tuple(p.shape), p.dtype, (_rank(),), False)


def _mine(p):
    """This rank's rows of parameter p: its Shard(0) piece (<= c, ...), the whole tensor, or None (not held)."""
    return p._local_tensor if isinstance(p, DTensor) else None if p is None else p.detach()


def weight_meta(module):
    """[Weight] of this rank's parameters, in the module's order, without communication (which other ranks
    hold a plain one too, union_meta finds out)."""
    return [_weight(n, p) for n, p in module.named_parameters()]


def union_meta(mine, group=None):
    """The weights to build: the union over ranks of each rank's weight_meta (one all_gather_object), the same
    list in the same order on every rank: rank 0's, then the names each next rank adds (pipeline stages on
    ascending ranks: stage by stage). A weight held whole by several ranks is held by each (a plain model: by
    every rank, which then copies its own). Raises on every rank, before any gather, where two ranks' reports
    of a weight disagree. group: the ranks that share the weights (None: every rank)."""
    ranks = _group_ranks(group)
    if len(ranks) == 1:
        return list(mine)
    everyone = [None] * len(ranks)
    dist.all_gather_object(everyone, [tuple(w) for w in mine], group=group)  # plain tuples: a receiver needs no class
    reports = {}  # name -> [(rank, Weight)], in first-seen order
    for rank, weights in zip(ranks, everyone):
        for w in map(Weight._make, weights):
            reports.setdefault(w.name, []).append((rank, w))
    return [_agreed(name, said, len(ranks)) for name, said in reports.items()]


def _held_as(w):
    return f"{'Shard(0) over' if w.sharded else 'whole on'} ranks {list(w.owners)}, {w.shape} {w.dtype}"


def _compatible(w, w0):
    """Two ranks' reports of one weight agree: shape, dtype and sharded alike; sharded on one mesh, or on disjoint meshes
    of one size (replicas)."""
    alike = (w.shape, w.dtype, w.sharded) == (w0.shape, w0.dtype, w0.sharded)
    if not alike or not w.sharded or w.owners == w0.owners:
        return alike
    return not set(w.owners) & set(w0.owners) and len(w.owners) == len(w0.owners)


def _agreed(name, said, n_ranks):
    """One Weight from every holder's report of it [(rank, Weight)] of n_ranks, or a ValueError naming it where two
    disagree."""
    (r0, w0), holders = said[0], tuple(rank for rank, _ in said)
    for rank, w in said[1:]:
        if not _compatible(w, w0):
            raise ValueError(f"{name}: rank {r0} holds it {_held_as(w0)}; rank {rank} {_held_as(w)}: the ranks that "
                             "hold a weight must agree on its owners, shape and dtype (a pipeline stage's parameters "
                             "sharded over that stage's one mesh, or over disjoint meshes of one size, or whole)")
    if not w0.sharded:
        return w0._replace(owners=holders)
    meshes = list(dict.fromkeys(w.owners for _, w in said))  # one, or one per node: its replicas
    ranks = [r for owners in meshes for r in owners]
    if len(set(ranks)) != len(ranks):  # each report was checked against the first only
        raise ValueError(f"{name}: sharded on meshes {meshes} that overlap: a weight's meshes must be one, or disjoint")
    if set(holders) != set(ranks) or any(rank not in w.owners for rank, w in said):
        raise ValueError(f"{name}: {_held_as(w0)}, but ranks {list(holders)} hold it: every rank of its mesh must")
    if len(meshes) > 1 and len(holders) != n_ranks:  # each rank gathers from its own replica
        raise ValueError(f"{name}: sharded on {len(meshes)} meshes {meshes}, but ranks {list(holders)} hold it: a "
                         "weight sharded in replicas must be held by every rank")
    return w0._replace(replicas=len(meshes))


def plan_buckets(meta, bucket_bytes):
    """Consecutive weights of one dtype, grouped so that each bucket's gathered bytes <= B; the same plan on
    every rank. The naive switch is a B as large as the model: a whole extra model on every rank."""
    buckets, size = [], 0
    for w in meta:  # Weight, or (name, shape, dtype)
        name, shape, dtype = w[:3]
        nb = torch.Size(shape).numel() * dtype.itemsize
        if nb > bucket_bytes:
            raise ValueError(f"bucket_bytes {bucket_bytes} is smaller than weight {name} {shape} "
                             f"({nb} bytes gathered); raise bucket_bytes to at least {nb}")
        if not buckets or size + nb > bucket_bytes or dtype != buckets[-1][0][2]:
            buckets.append([])
            size = 0
        buckets[-1].append(w)
        size += nb
    return buckets


def bucket_views(bucket, device):
    """One flat buffer for a bucket and, per weight, its full view (rows, ...) into it."""
    sizes = [torch.Size(w[1]).numel() for w in bucket]
    flat = torch.empty(sum(sizes), dtype=bucket[0][2], device=device)
    return flat, [(w[0], v.view(w[1])) for w, v in zip(bucket, flat.split(sizes))]


def gather_into(out, mine, w, works, group=None):
    """Fill out (rows, ...), a contiguous full-size tensor, with the weight w (a Weight) from its owners. mine:
    this rank's rows of it (its Shard(0) piece or the whole), None where it holds none. An owner copies its rows
    into place; then one in-place broadcast per piece that a rank of group lacks, from its owner, appended to
    works (async). Every rank of group calls it: the owners and every rank that needs w (a non-owner just
    receives; so does a whole weight's owner other than the first, where a rank lacks it). Returns the bytes
    this rank receives. Not one all-gather: gloo's ran well below its broadcast's bandwidth on CPU (git log -p
    bench/RESULTS.md)."""
    me, members = _rank(), set(_group_ranks(group))
    if w.sharded:  # owner i's rows [i * c, (i + 1) * c)
        c = -(-out.shape[0] // len(w.owners))
        pieces = [(src, {src}, out[i * c:(i + 1) * c]) for i, src in enumerate(w.owners)]    # (<= c, ...) each
    else:  # whole on each owner: the first sends it
        pieces = [(w.owners[0], set(w.owners), out)]
    received = 0
    for src, holders, piece in pieces:
        if me in holders:
            piece.copy_(mine)                                      # its own rows, into place
        if piece.numel() and not members <= holders:               # a rank of group lacks them: one broadcast
            works.append(dist.broadcast(piece, src=src, group=group, async_op=True))
            received += piece.nbytes if me != src else 0
    return received


# ----------------------------------------------------------------------------- the transport seam
class Broadcasts:
    """The portable transport (any backend, any hosts): gather_into's broadcasts. The seam, what FusedActor calls
    of a transport (shm_transport.SharedMemory is the other one):
      keeps_shards        True where the shards must stay in their storages: FusedActor refuses offload_params
      gathering(params, layout, group)
                          a context around a switch's whole gather; leaving it, the ranks agree on an ok flag:
                          where one raised inside, every other raises too, none waiting out a timeout
      fill(params, outs, layout, group)
                          fills each (name, full-size destination) with the full weight of that name, from its
                          owners (collective: every rank passes the same names, in the same order); returns the
                          bytes this rank received
      close()             releases what the transport holds (here, nothing)
    layout: {name: Weight}, FusedActor's (the union over ranks: the training layout may be pipeline stages, a
    rank holding no row of a weight); both run over `group` then (FusedActor's: its ranks; None: the default
    group), as every rank of it needs every weight.
    None (push_weights's trainers): read off params, every rank holds every name, a DTensor gathered over
    its mesh's group, a plain tensor copied."""
    keeps_shards = False

    @contextmanager
    def gathering(self, params, layout=None, group=None):
        mesh = None if layout is not None else next((p.device_mesh for p in params.values() if isinstance(p, DTensor)),
                                                    None)
        group = mesh.get_group() if mesh is not None else group  # a layout's: the actor's ranks (None: every rank)
        ok = torch.ones(1, device=next(iter(params.values())).device)
        agree = dist.is_initialized() and dist.get_world_size(group) > 1
        try:
            yield
        except BaseException:
            with suppress(Exception):  # where a collective failed this one may fail too: the first error stands
                if agree:
                    dist.all_reduce(ok.zero_(), op=dist.ReduceOp.MIN, group=group)
            raise
        if agree:
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
        if not ok.item():
            raise RuntimeError("another rank failed in this switch (its error is in its output); back in TRAIN")

    def fill(self, params, outs, layout=None, group=None):
        works, received = [], 0  # issued asynchronously, waited for together
        for name, out in outs:
            p = params.get(name)
            if layout is not None and layout[name].replicas == 1:  # over the actor's ranks
                received += gather_into(out, _mine(p), layout[name], works, group)
            elif isinstance(p, DTensor):  # no layout, or sharded within each node: from this rank's own mesh
                received += gather_into(out, _mine(p), _weight(name, p), works, p.device_mesh.get_group())
            else:  # whole on every rank
                out.copy_(p.detach())
        for work in works:
            work.wait()
        return received

    def close(self):
        pass


# ----------------------------------------------------------------------------- the two phases
def _check(model, optimizer):
    """Everything FusedActor needs of this rank's model and its optimizer, checked before any collective."""
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise ValueError("the model is in FSDP1 (FullyShardedDataParallel): this needs FSDP2's fully_shard(module)")
    for n, p in model.named_parameters():
        if isinstance(p, DTensor) and (p.device_mesh.ndim, tuple(p.placements)) != (1, (Shard(0),)):
            raise ValueError(f"{n}: placements {p.placements} on a {p.device_mesh.ndim}-D mesh {p.device_mesh}; "
                             "expected Shard(0) over a 1-D mesh (fully_shard(module) over all ranks, or over a "
                             "pipeline stage's ranks)")
    mine = {id(p) for p in model.parameters()}
    foreign = sum(id(p) not in mine for g in optimizer.param_groups for p in g["params"])
    if foreign:  # fully_shard replaces the parameters: an optimizer built before it would move no state
        raise ValueError(f"the optimizer holds {foreign} tensors that are not the model's parameters (built before "
                         "fully_shard?): build it on model.parameters() after fully_shard")


class _BackwardCheck(torch.autograd.Function):
    """The identity on the model's output; its backward, the first of the model's, asks the actor first."""
    @staticmethod
    def forward(ctx, actor, x):
        ctx.actor = actor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.actor._expect(TRAIN, "a backward ran", "the grads are in host memory (a step forgotten before it?)")
        return None, grad


class FusedActor:
    """The actor in two phases on the same devices; starts in TRAIN.
      model, optimizer  this rank's: FSDP2 (not FSDP1) over a 1-D mesh of all W ranks (or of its node's ranks, each
                        node holding a copy: every rank gathers from its own node's), or plain; or, under pipeline
                        parallelism, its stage's module (its parameters under the whole model's names), FSDP2 over
                        a 1-D mesh of the stage's ranks, or plain on one rank. The optimizer built after.
      engine            an nn.Module, its weights freed in TRAIN; load_weights(iterable of (name, full tensor))
                        loads them into its own (cuts its TP piece, fuses, renames, copies: the tensors live for
                        the call only) and returns the names of its parameters it loaded, as vLLM's loaders do.
                        The engine is the whole model on every rank, whatever the stages.
      inplace           True (TP 1): the gather writes into the engine's parameters, the model's by name and shape.
      offload_params    the training shards go to host memory too in ROLLOUT.
      movers            objects with to_rollout() and to_train(), called last in to_rollout() and first in
                        to_train(); their `names` are not built or freed here, their `stats` join metrics().
      transport         Broadcasts() (the default) or shm_transport.SharedMemory; the actor's (close() closes it).
      group             the actor's ranks (None: every rank; a hybrid deployment keeps other ranks for other work)."""

    def __init__(self, model, optimizer, engine, bucket_bytes=1 << 20, inplace=False, offload_params=False, movers=(),
                 transport=None, group=None):
        reshard_all(model)  # the parameters are the shards again
        _check(model, optimizer)
        self.transport = transport if transport is not None else Broadcasts()
        if offload_params and self.transport.keeps_shards:
            raise ValueError(f"offload_params=True frees the shards, which {type(self.transport).__name__} keeps in "
                             "place: use offload_params=False or the Broadcasts transport")
        self.model, self.optimizer, self.engine, self.movers = model, optimizer, engine, list(movers)
        self.bucket_bytes, self.inplace, self.offload_params, self.group = bucket_bytes, inplace, offload_params, group
        self.device = next(model.parameters()).device
        self.skip = {n for m in self.movers for n in getattr(m, "names", ())}
        self.path = f"{'in place' if inplace else 'load_weights'}, {type(self.transport).__name__}"
        # the weights to build: the union of every rank's (collective), [Weight] the same on every rank
        meta = union_meta([w for w in weight_meta(model) if w.name not in self.skip], group)
        eng = self._engine_weights()
        self.layout, self.buckets = {w.name: w for w in meta}, plan_buckets(meta, bucket_bytes)
        if inplace and not ({w.name for w in meta} == set(eng) and all(
                tuple(eng[n].shape) == s and eng[n].dtype == d and eng[n].is_contiguous() for n, s, d, *_ in meta)):
            raise ValueError("inplace=True needs engine parameters with the model's names, full shapes and dtypes "
                             "(TP 1), contiguous; use inplace=False (load_weights)")
        self.phase, self.round_trips, self.stats = TRAIN, 0, {}
        self._off, self._hosts, self._param_off, self._param_hosts = [], [], [], []
        self._free_engine()
        self._hooks = self._guard()
        self.record()

    def _guard(self):
        """Hooks that raise where a call would read storages freed in this phase (a crash, not an error)."""
        def engine(module, args):
            self._expect(ROLLOUT, "the engine was called", "its weights are freed")

        def step(optimizer, args, kwargs):
            self._expect(TRAIN, "optimizer.step() was called", "the optimizer states are in host memory")

        def forward(module, args):
            if self.offload_params:
                self._expect(TRAIN, "the model was called", "its shards are in host memory (offload_params)")

        def output(module, args, out):  # its backward, the first of the model's, checks the phase
            return _BackwardCheck.apply(self, out) if torch.is_tensor(out) and out.requires_grad else out
        return [self.engine.register_forward_pre_hook(engine), self.optimizer.register_step_pre_hook(step),
                self.model.register_forward_pre_hook(forward, prepend=True), self.model.register_forward_hook(output)]

    def _expect(self, phase, what, why=None):
        if self.phase != phase:
            raise RuntimeError(f"{what} in phase {self.phase}{f', where {why}' if why else ''}; it needs phase {phase}")

    def _engine_weights(self):
        return {n: p for n, p in self.engine.named_parameters() if n not in self.skip}

    def _free_engine(self):
        for s in storages(self._engine_weights().values()):
            s.resize_(0)

    def record(self):
        """The phase's memory figures: the storages this module manages (on an accelerator, the total is its
        allocator's, where it counts: _allocated)."""
        ps, key = list(self.model.parameters()), self.phase.lower()
        held = {"params": ps, "grads": [p.grad for p in ps if p.grad is not None],
                "optim": [v for st in self.optimizer.state.values() for v in st.values() if torch.is_tensor(v)],
                "infer": self._engine_weights().values()}
        held = {cat: held_bytes(ts, self.device) for cat, ts in held.items()}
        self.stats.update({f"mem/{key}_{cat}_bytes": nb for cat, nb in held.items()})
        allocated = _allocated(self.device)
        self.stats[f"mem/{key}_bytes"] = sum(held.values()) if allocated is None else allocated

    def metrics(self):
        """Flat dict for metrics.jsonl: mem/*, time/to_rollout_s, time/to_train_s, switch/*, the movers' stats.
        switch/gather_bytes: the weights' bytes built on this rank (its own rows' copies included);
        switch/received_bytes: those it received from other ranks; switch/received_min_bytes: the least it could
        (the weights' bytes less the rows it holds)."""
        out = dict(self.stats, **{"switch/round_trips": self.round_trips, "switch/bucket_bytes": self.bucket_bytes,
                                  "switch/buckets": len(self.buckets)})
        for m in self.movers:
            out.update(getattr(m, "stats", {}))
        return out

    @torch.no_grad()
    def to_rollout(self):
        """TRAIN -> ROLLOUT: grads and optimizer states to host, the engine's weights built bucket by bucket,
        the movers. Returns the engine. If it raises, this actor's state is back in TRAIN as it was (the movers
        already switched too; one that raises leaves its own as it was); an error inside the gather raises on
        every rank (the ok flag), one elsewhere on its own rank."""
        self._expect(TRAIN, "to_rollout() called")
        t0 = time.perf_counter()
        reshard_all(self.model)
        params, eng, switched = dict(self.model.named_parameters()), self._engine_weights(), []
        try:
            with self._timed("offload"):  # 1. grads and optimizer states to host, in a fixed order (buffers reused)
                grads = [p.grad for p in params.values() if p.grad is not None]
                opt = [v for p in params.values() for _, v in sorted(self.optimizer.state.get(p, {}).items())]
                off = storages(grads + [v for v in opt if torch.is_tensor(v)], self.device)
                self.stats["switch/offload_bytes"] = sum(s.nbytes() for s in off)
                self._hosts, self._off = offload(off, self._hosts), off  # all or nothing
            with self._timed("alloc"):  # 2. the inference weights: allocated once, gathered into bucket by bucket
                for p in eng.values():
                    p.untyped_storage().resize_(p.nbytes)
            with self._timed("gather"), self.transport.gathering(params, self.layout, self.group):
                extra, gathered, received, least = self._fill(params, eng)
            if self.offload_params:  # 3. the training shards too (1/W of the model, needed first thing back)
                off = storages([p for n, p in params.items() if n not in self.skip], self.device)
                self._param_hosts, self._param_off = offload(off, self._param_hosts), off
            for m in self.movers:  # 4. whatever else changes layout (the experts' EP re-shard)
                m.to_rollout()
                switched.append(m)
        except BaseException:  # back to TRAIN as it was: no engine weights, the train-only state on the device
            for m in reversed(switched):
                m.to_train()
            self._free_engine()
            reload(self._param_off, self._param_hosts)
            reload(self._off, self._hosts)
            self._off, self._param_off = [], []
            raise
        self._finish(ROLLOUT, t0)
        moved = 2 * self.stats["switch/offload_bytes"] + gathered  # per round trip
        self.stats.update({"switch/peak_extra_bytes": extra, "switch/gather_bytes": gathered, "switch/bytes": moved,
                           "switch/received_bytes": received, "switch/received_min_bytes": least})
        return self.engine

    def _fill(self, params, eng):
        """Every bucket into the engine's weights: in place, or a bucket buffer handed to load_weights, whose error is
        held while this rank gathers on with its peers. Returns (most bytes held beyond them, bytes gathered, bytes
        received from other ranks, the least it could receive: the weights' bytes less the rows it holds)."""
        extra, gathered, received, least, loaded, error = 0, 0, 0, 0, set(), None
        for bucket in self.buckets:
            if self.inplace:  # the engine's weights are the model's, by name and full shape
                flat, outs = None, [(name, eng[name].detach()) for name, *_ in bucket]
            else:
                flat, outs = bucket_views(bucket, self.device)
            received += self.transport.fill(params, outs, self.layout, self.group)
            gathered += sum(t.nbytes for _, t in outs)
            held = sum(_mine(params[n]).nbytes for n, _ in outs if n in params)  # this rank's own rows
            least += sum(t.nbytes for _, t in outs) - held
            if self.inplace:
                loaded |= {name for name, _ in outs}
            elif error is None:
                extra = max(extra, flat.nbytes)
                try:
                    names = self.engine.load_weights(outs)  # None: the model's names, taken as the engine's
                    loaded |= set(names if names is not None else (n for n, _ in outs))
                except Exception as e:  # noqa: BLE001 - held: the peers need this rank in every bucket's gather
                    error = e
            flat = outs = None  # free the bucket before the next one
        missing = sorted(set(eng) - loaded)
        if missing and error is None:  # re-allocated and never filled
            error = ValueError(f"the engine's weights {missing[:8]} were not loaded: its load_weights must load every "
                               "one (or a mover name it) and return the engine parameter names it loaded")
        if error is not None:
            raise error
        return extra, gathered, received, least

    @torch.no_grad()
    def to_train(self):
        """ROLLOUT -> TRAIN: the movers back, the inference weights freed, the training state brought back."""
        self._expect(ROLLOUT, "to_train() called")
        t0 = time.perf_counter()
        for m in reversed(self.movers):
            m.to_train()
        with self._timed("free"):
            self._free_engine()
        with self._timed("reload"):
            reload(self._param_off, self._param_hosts)
            reload(self._off, self._hosts)
        self._off, self._param_off = [], []  # the storages are the device's again (a failed switch reloads none)
        self.round_trips += 1
        self._finish(TRAIN, t0)  # frees first, then re-allocates: never above its start or end bytes

    @contextmanager
    def _timed(self, part):
        """switch/<part>_s, for the benchmark's breakdown (on an accelerator each part waits for its queued work)."""
        t0 = time.perf_counter()
        yield
        _synchronize(self.device)
        self.stats[f"switch/{part}_s"] = time.perf_counter() - t0

    def _finish(self, phase, t0):
        _synchronize(self.device)  # non-blocking copies must land before the time is taken
        self.phase = phase
        self.stats[f"time/{'to_rollout' if phase == ROLLOUT else 'to_train'}_s"] = time.perf_counter() - t0
        self.record()

    def close(self):
        """Remove the guards and close the transport: another FusedActor may then drive the model and engine."""
        self._expect(TRAIN, "close() called")
        for hook in self._hooks:
            hook.remove()
        self.transport.close()

    # -- resume: the phase and counters (save the model and optimizer in TRAIN, their state then on the device)
    def state_dict(self):
        return {"phase": self.phase, "round_trips": self.round_trips}

    def load_state_dict(self, state):
        if state["phase"] != self.phase:  # switches to the saved phase (collective)
            (self.to_rollout if state["phase"] == ROLLOUT else self.to_train)()
        self.round_trips = state["round_trips"]


@contextmanager
def rollout(actor):
    """with rollout(actor) as engine: ...  (TRAIN -> ROLLOUT, and back to TRAIN on exit)."""
    engine = actor.to_rollout()
    try:
        yield engine
    finally:
        actor.to_train()


class HostOffloaded:
    """A frozen module (the reference model; a reward model) kept in host memory, on the device only inside
    `with ref.on_device() as module:`. offload=False keeps it on the device: the same interface."""

    def __init__(self, module, offload=True):
        tensors = list(module.parameters()) + list(module.buffers())
        self.module, self._stores, self._hosts = module, storages(tensors) if offload else [], []
        self._to_host()

    def _to_host(self):
        self._hosts = offload(self._stores, self._hosts)

    @contextmanager
    def on_device(self):
        reload(self._stores, self._hosts)
        try:
            yield self.module
        finally:
            self._to_host()
