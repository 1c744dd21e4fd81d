# Copyright (c) 2026 The authors of this repository. SPDX-License-Identifier: MIT (see LICENSE).
"""RL Fusion: the actor trains and generates on the same devices, one phase at a time.

A separated deployment trains on some devices and generates on the others: each half idles while
the other works. Fused, every rank trains (TRAIN), then generates (ROLLOUT). The naive switch
gathers the whole model for the engine and keeps the training state: a whole extra model on every
rank, beside grads and AdamW states that ROLLOUT never reads. The fix, to_rollout():
  1. offload: copy the AdamW states (and any grads) to host, then free their device storages in
     place (resized to 0, the optimizer keeps its tensors); to_train() copies them back exactly;
  2. allocate the engine's weights, then fill them from the training shards bucket by bucket. A
     bucket bounds the broadcasts in flight, and a transport that stages holds at most one bucket
     more (none here: the gather writes straight into the engine's own parameters);
  3. call the movers, the state that changes layout too (the experts, re-sharded by moe_switch.py).
to_train() undoes the three, in reverse.

This file is the default run's path (train_grpo.py): FSDP2 over all W ranks (the experts aside:
moe_switch.py's, a mover); the engine is the whole model at TP 1, and the gather writes straight
into its parameters. The bytes move through a transport (the seam: Broadcasts's docstring says
what one must do): Broadcasts, the plain way and the default run's (gloo; nccl on GPUs, untested
past one rank), or on one CPU host plumbing/shm_transport.py's SharedMemory (--shm-transport 1).
The other paths are FusedActor subclasses in options/ (tensor_parallel.py: an engine at any TP
degree, through its load_weights; owners.py: pipeline stages, HSDP; offload_params.py: the shards
offloaded too). The companion, plumbing/fusion_details.py, holds what a learner can take on trust
(the input checks, the guards, the recovery, the counts) and a usage example.

Departures from the source system (Huawei's RL post-training on CloudMatrix 384):
  1. FSDP2 (weights sharded between updates) or PP stages to train, TP to generate; the engine is
     not pipelined.
  2. The FSDP2 shards stay on the device in ROLLOUT (1/W of those weights), unless offloaded too.
  3. The engine's weights are freed in TRAIN (vLLM's sleep mode would); its KV cache is its own.
  4. On CPU the host is the device: the offload saves nothing there, and its host buffers, kept
     for the next switch, hold a second copy of the optimizer state (not in the mem/* figures).
A call that would read a freed storage, and crash, raises instead, naming the phase (the guards).

Run: python -m pytest tests/test_fusion.py   (W 1, 2 x TP 1, 2; W 4: -m slow; PP, HSDP: test_owners)

Using this file elsewhere: torch >= 2.6, gloo or nccl; copy fusion.py together with its companion
plumbing/fusion_details.py (keep the folder, or change the one import line). The companion's
docstring ends with a usage example of the default path on 2 gloo processes, which
tests/test_copy_alone.py runs in a folder holding only the two files.

Shapes: W world size, B bucket bytes, d a weight's owners (W under FSDP2), c = ceil(rows / d) rows
per shard.
"""
import time
from contextlib import contextmanager, suppress
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from plumbing.fusion_details import (check_engine, check_fits, check_model, check_not_shared,
                                     check_owners, expect_phase, guard_hooks, hold_grads,
                                     memory_figures, synchronize, timed, undo_rollout)

TRAIN, ROLLOUT = "TRAIN", "ROLLOUT"


# ------------------------------------------------------------------------------------ host offload
def storages(tensors, device=None):
    """The distinct allocated storages behind tensors (a DTensor's shard's), on device if given."""
    stores = [(t._local_tensor if isinstance(t, DTensor) else t).untyped_storage() for t in tensors]
    alive = {s.data_ptr(): s for s in stores if s.nbytes() and device in (None, s.device)}
    return list(alive.values())


def held_bytes(tensors, device=None):
    """The memory accounting: bytes of the distinct storages still allocated behind tensors."""
    return sum(s.nbytes() for s in storages(tensors, device))


def _as_bytes(s):
    return torch.empty(0, dtype=torch.uint8, device=s.device).set_(s)  # (nbytes,) uint8 view


def offload(stores, hosts=()):
    """Copy each device storage into a host buffer, then free it in place (resize to 0): the tensors
    that view it stay valid, and reload() brings the bytes back. Host buffers of the right size are
    reused; on CUDA they are pinned and the copy is non-blocking (the free is stream-ordered after
    it). All or nothing: on a failure, the storages already freed are reloaded."""
    check_not_shared(stores)
    out = []
    try:
        for i, s in enumerate(stores):
            cuda = s.device.type == "cuda"
            reuse = i < len(hosts) and hosts[i].numel() == s.nbytes()
            h = hosts[i] if reuse else torch.empty(s.nbytes(), dtype=torch.uint8, pin_memory=cuda)
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


class HostOffloaded:
    """A frozen module (the reference model; a reward model) kept in host memory, on the device only
    inside `with ref.on_device() as module:`. offload=False keeps it on the device (same calls)."""

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


# ---------------------------------------------------------------------------- building the weights
def reshard_all(module):
    """FSDP2 leaves a module unsharded after a no-grad forward: back to its shards."""
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


class Weight(NamedTuple):
    """A weight to build, and where the training layout holds it: sharded, its d owners (global
    ranks) hold Shard(0) pieces of c rows in that order, the last shorter or empty; else each owner
    holds it whole. replicas > 1 (HSDP): as many disjoint meshes hold it so; owners is the first."""
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
    """p's Weight on this rank: a DTensor's owners are its mesh's ranks, a tensor's this rank."""
    if isinstance(p, DTensor):
        owners = tuple(p.device_mesh.mesh.flatten().tolist())
        return Weight(name, tuple(p.shape), p.dtype, owners, True)
    return Weight(name, tuple(p.shape), p.dtype, (_rank(),), False)


def _mine(p):
    """This rank's rows of p: its Shard(0) piece (<= c, ...), the whole, or None (not held)."""
    return p._local_tensor if isinstance(p, DTensor) else None if p is None else p.detach()


def weight_meta(module):
    """[Weight] of this rank's parameters, in the module's order, without communication."""
    return [_weight(n, p) for n, p in module.named_parameters()]


def full_bytes(w):
    """The bytes of weight w (a Weight, or (name, shape, dtype)) whole: what each rank gathers."""
    return torch.Size(w[1]).numel() * w[2].itemsize


def plan_buckets(meta, bucket_bytes):
    """Consecutive weights of one dtype, each bucket's gathered bytes <= B; the same on every rank.
    The naive switch is one bucket as large as the model."""
    buckets, size = [], 0
    for w in meta:  # Weight, or (name, shape, dtype)
        name, shape, dtype = w[:3]
        nb = full_bytes(w)
        check_fits(name, shape, nb, bucket_bytes)
        if not buckets or size + nb > bucket_bytes or dtype != buckets[-1][0][2]:
            buckets.append([])
            size = 0
        buckets[-1].append(w)
        size += nb
    return buckets


def gather_into(out, mine, w, works, group=None):
    """Fill out (rows, ...), contiguous and full-size, with weight w; mine: this rank's rows of it
    (None if it holds none). Each owner copies its rows into place, then each piece that a rank of
    group lacks comes in one async broadcast from its owner (appended to works). Every rank of
    group calls it; returns the bytes this rank receives. Not one all-gather: gloo's ran well below
    the broadcasts' bandwidth on CPU (bench/RESULTS.md)."""
    me, members = _rank(), set(_group_ranks(group))
    if w.sharded:  # owner i's rows [i * c, (i + 1) * c)
        c = -(-out.shape[0] // len(w.owners))
        pieces = [(src, {src}, out[i * c:(i + 1) * c]) for i, src in enumerate(w.owners)]
    else:  # whole on each owner: the first sends it
        pieces = [(w.owners[0], set(w.owners), out)]
    received = 0
    for src, holders, piece in pieces:                   # piece: (<= c, ...) or (rows, ...)
        if me in holders:
            piece.copy_(mine)                            # its own rows, into place
        if piece.numel() and not members <= holders:     # a rank of group lacks them
            works.append(dist.broadcast(piece, src=src, group=group, async_op=True))
            received += piece.nbytes if me != src else 0
    return received


def _on_own_meshes(name, p, out, works):
    """Fills out with weight name from p: a DTensor gathered over its own mesh (no layout, or
    HSDP: each node's replica), a plain tensor copied. Returns the bytes received."""
    if isinstance(p, DTensor):
        mesh_group = p.device_mesh.get_group()
        return gather_into(out, _mine(p), _weight(name, p), works, mesh_group)
    out.copy_(p.detach())  # whole on every rank
    return 0


# ------------------------------------------------------------------------------- the transport seam
@contextmanager
def agreeing(device, group):
    """Every rank of group leaves a switch's gather knowing whether all succeeded: one all_reduce
    of a flag on the way out, so that a rank whose gather failed does not leave the others waiting
    in the next collective, and each raises."""
    ok = torch.ones(1, device=device)
    agree = dist.is_initialized() and dist.get_world_size(group) > 1
    try:
        yield
    except BaseException:
        with suppress(Exception):  # may fail where a collective did: the first error stands
            if agree:
                dist.all_reduce(ok.zero_(), op=dist.ReduceOp.MIN, group=group)
        raise
    if agree:
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if not ok.item():
        raise RuntimeError("another rank failed in this switch (its error is in its output); "
                           "back in TRAIN")


class Broadcasts:
    """A transport moves each weight from its owners into a full-size tensor on every rank. This
    one is the plain way: gather_into's broadcasts through the process group, any backend, any
    hosts. plumbing/shm_transport.py's SharedMemory is the same contract done through shared
    memory on one host (each rank copies its peers' rows out of their memory): --shm-transport 1.
    The contract, what FusedActor calls of a transport:
      keeps_shards   True where the shards must stay in their storages (never offloaded).
      gathering(params, layout, group)   a context around a switch's whole gather; leaving it, the
                     ranks agree on an ok flag: where one raised inside, every rank raises.
      fill(params, outs, layout, group)  fills each (name, full-size out) with that weight from its
                     owners (collective: the same names in the same order on every rank); returns
                     the bytes this rank received.
      close()        releases what the transport holds.
    params: {name: this rank's parameter}; layout: FusedActor's {name: Weight} over group (None:
    every rank). fill without a layout (options/push.py) gathers each DTensor over its own mesh."""
    keeps_shards = False

    @contextmanager
    def gathering(self, params, layout=None, group=None):
        with agreeing(next(iter(params.values())).device, group):  # one all_reduce, on leaving
            yield

    def fill(self, params, outs, layout=None, group=None):
        works, received = [], 0  # issued asynchronously, waited for together
        for name, out in outs:
            p = params.get(name)
            if layout is not None and layout[name].replicas == 1:  # over the actor's ranks
                received += gather_into(out, _mine(p), layout[name], works, group)
            else:  # no layout (options/push.py), or HSDP
                received += _on_own_meshes(name, p, out, works)
        for work in works:
            work.wait()
        return received

    def close(self):
        pass


# ----------------------------------------------------------------------------------- the two phases
@contextmanager
def rollout(actor):
    """with rollout(actor) as engine: ...  (TRAIN -> ROLLOUT, and back to TRAIN on exit)."""
    engine = actor.to_rollout()
    try:
        yield engine
    finally:
        actor.to_train()


class FusedActor:
    """The actor in two phases on the same devices; starts in TRAIN.
      model, optimizer  this rank's: FSDP2 (fully_shard) over `group`; the optimizer built after.
      engine            an nn.Module, the whole model on every rank (TP 1), its parameters the
                        model's by name and shape: the gather writes into them. Freed in TRAIN.
      bucket_bytes      B, the most bytes of full weights a bucket holds.
      movers            objects with to_rollout() and to_train(), called last in to_rollout() and
                        first in to_train(); their `names` are not built here, their `stats` join
                        metrics().
      transport         Broadcasts() (the default) or SharedMemory; close() closes it.
      group             the actor's ranks (None: every rank; a hybrid deployment keeps others).
    The options' subclasses (options/) override the seams: _weights_to_build (which weights, held
    by which ranks), _check_engine and _fill (how the buckets reach the engine), _gathered."""
    fills = "in place"  # how the engine gets its weights, as `path` names it

    def __init__(self, model, optimizer, engine, bucket_bytes=1 << 20, movers=(), transport=None,
                 group=None):
        reshard_all(model)  # the parameters are the shards again
        check_model(model, optimizer)
        self.transport = transport if transport is not None else Broadcasts()
        self.model, self.optimizer, self.engine = model, optimizer, engine
        self.movers, self.group, self.bucket_bytes = list(movers), group, bucket_bytes
        self.device = next(model.parameters()).device
        self.skip = {n for m in self.movers for n in getattr(m, "names", ())}  # the movers' weights
        self.path = f"{self.fills}, {type(self.transport).__name__}"  # as the run prints it
        # the weights to build, the same [Weight] on every rank
        weights = self._weights_to_build([w for w in weight_meta(model) if w.name not in self.skip])
        self.layout = {w.name: w for w in weights}
        self.buckets = plan_buckets(weights, bucket_bytes)
        self._check_engine(weights)
        self.phase, self.round_trips, self.stats = TRAIN, 0, {}
        self._off, self._hosts = [], []              # grads' and states' storages, host copies
        self._held_grads = []  # (parameter, its offloaded grad) in ROLLOUT
        self._free_engine()
        self._hooks = self._guard()
        self.record()

    def _weights_to_build(self, mine):
        """This rank's own weights, mine: under FSDP2 over the actor's ranks every rank reports the
        same list. A weight held otherwise (a pipeline stage's, a node's) is refused before any
        collective (options/owners.py agrees the owners of such layouts)."""
        check_owners(mine, _group_ranks(self.group))
        return list(mine)

    def _check_engine(self, weights):
        """The gather writes into the engine's parameters: the weights' names, full shapes and
        dtypes, contiguous (checked here, before any switch)."""
        check_engine(weights, self._engine_weights())

    @torch.no_grad()
    def to_rollout(self):
        """TRAIN -> ROLLOUT; returns the engine. If it raises, this actor is back in TRAIN as it was
        and so is a mover that raised before moving anything (moe_switch's checks). A mover that
        fails inside its collectives leaves its state part-moved: the run must end. An error in the
        gather raises on every rank (the transport's ok flag), one elsewhere on its own rank; a
        broadcast it left unmatched fails on the peers too, or in the group's timeout."""
        self._expect(TRAIN, "to_rollout() called")
        t0 = time.perf_counter()
        reshard_all(self.model)
        params, eng, switched = dict(self.model.named_parameters()), self._engine_weights(), []
        try:
            with self._timed("offload"):  # 1. grads and optimizer states to host, in a fixed order
                grads = [p.grad for p in params.values() if p.grad is not None]
                states = [v for p in params.values()
                          for _, v in sorted(self.optimizer.state.get(p, {}).items())]
                off = storages(grads + [v for v in states if torch.is_tensor(v)], self.device)
                self.stats["switch/offload_bytes"] = sum(s.nbytes() for s in off)
                self._hosts, self._off = offload(off, self._hosts), off  # all or nothing
                self._held_grads = hold_grads(params)  # p.grad None in ROLLOUT (see hold_grads)
            with self._timed("alloc"):  # 2. the engine's weights, allocated for this phase
                for p in eng.values():
                    p.untyped_storage().resize_(p.nbytes)
            with self._timed("gather"), self.transport.gathering(params, self.layout, self.group):
                received, extra = self._fill(params, eng)
            self._gathered(params)  # a subclass's hook (options/offload_params.py)
            for m in self.movers:  # 3. whatever else changes layout (the experts' EP re-shard)
                m.to_rollout()
                switched.append(m)
        except BaseException:  # back to TRAIN as it was: no engine weights, train state on device
            undo_rollout(self, switched)
            raise
        self._finish(ROLLOUT, t0)
        gathered = sum(full_bytes(w) for w in self.layout.values())  # the weights built here
        held = sum(_mine(params[n]).nbytes for n in self.layout if n in params)  # its own rows
        least = gathered - held  # the least it could receive
        moved = 2 * self.stats["switch/offload_bytes"] + gathered  # per round trip
        self.stats.update({"switch/peak_extra_bytes": extra, "switch/gather_bytes": gathered,
                           "switch/bytes": moved, "switch/received_bytes": received,
                           "switch/received_min_bytes": least})
        return self.engine

    def _fill(self, params, eng):
        """Every bucket gathered straight into the engine's weights eng ({name: parameter}, the
        model's by name and full shape), through the transport. Returns the bytes received from
        other ranks, and the most held beyond the engine's weights: none."""
        received = 0
        for bucket in self.buckets:
            outs = [(name, eng[name].detach()) for name, *_ in bucket]  # [(name, (rows, ...))]
            received += self.transport.fill(params, outs, self.layout, self.group)
        return received, 0

    @torch.no_grad()
    def to_train(self):
        """ROLLOUT -> TRAIN: the movers back, the engine's weights freed, the train state back."""
        self._expect(ROLLOUT, "to_train() called")
        t0 = time.perf_counter()
        for m in reversed(self.movers):
            m.to_train()
        with self._timed("free"):
            self._free_engine()
        with self._timed("reload"):
            self._reload()
        self.round_trips += 1
        self._finish(TRAIN, t0)  # frees first, then re-allocates: never above its start or end

    def _reload(self):
        """What the switch offloaded, back into its device storages."""
        reload(self._off, self._hosts)
        self._off = []
        for p, grad in self._held_grads:
            p.grad = grad
        self._held_grads = []

    def _engine_weights(self):
        return {n: p for n, p in self.engine.named_parameters() if n not in self.skip}

    def _free_engine(self):
        for s in storages(self._engine_weights().values()):
            s.resize_(0)

    def _timed(self, part):
        """switch/<part>_s (on an accelerator, each part waits for its queued work)."""
        return timed(self.stats, part, self.device)

    def _finish(self, phase, t0):
        synchronize(self.device)  # non-blocking copies must land before the time is taken
        self.phase = phase
        name = "to_rollout" if phase == ROLLOUT else "to_train"
        self.stats[f"time/{name}_s"] = time.perf_counter() - t0
        self.record()

    def metrics(self):
        """Flat dict for metrics.jsonl: mem/*, time/*, switch/*, the movers' stats. Per switch:
        gather_bytes, the weights built on this rank; received_bytes, those that came from other
        ranks; received_min_bytes, the least that could (less the rows this rank holds)."""
        out = dict(self.stats)
        out.update({"switch/round_trips": self.round_trips,
                    "switch/bucket_bytes": self.bucket_bytes, "switch/buckets": len(self.buckets)})
        for m in self.movers:
            out.update(getattr(m, "stats", {}))
        return out

    def _expect(self, phase, what, why=None):
        expect_phase(self.phase, phase, what, why)  # raises, naming both phases, where they differ

    def _guard(self):
        """Hooks that raise where a call would read the storages freed in this phase: the engine
        in TRAIN; optimizer.step() and a backward in ROLLOUT (the companion's guard_hooks)."""
        return guard_hooks(self, TRAIN, ROLLOUT)

    def close(self):
        """Remove the guards and close the transport: another FusedActor may then take over."""
        self._expect(TRAIN, "close() called")
        for hook in self._hooks:
            hook.remove()
        self.transport.close()

    def _gathered(self, params):
        """Called in to_rollout() once the engine is built from params, before the movers: nothing
        here; options/offload_params.py's subclass frees the training shards."""

    # resume: the phase and counters (save the model and optimizer in TRAIN, their state on device)
    def state_dict(self):
        return {"phase": self.phase, "round_trips": self.round_trips}

    def load_state_dict(self, state):
        if state["phase"] != self.phase:  # switches to the saved phase (collective)
            (self.to_rollout if state["phase"] == ROLLOUT else self.to_train)()
        self.round_trips = state["round_trips"]

    # the memory accounting, recorded at the end of each switch
    def record(self):
        """The phase's memory figures: the storages this module manages, and their total (on an
        accelerator, its allocator's count instead)."""
        ps, key = list(self.model.parameters()), self.phase.lower()
        states = [v for st in self.optimizer.state.values() for v in st.values()]
        held = {"params": ps, "grads": [p.grad for p in ps if p.grad is not None],
                "optim": [v for v in states if torch.is_tensor(v)],
                "infer": self._engine_weights().values()}
        held = {cat: held_bytes(ts, self.device) for cat, ts in held.items()}
        self.stats.update(memory_figures(key, held, self.device))
