# Copyright (c) 2026 The authors of this repository. SPDX-License-Identifier: MIT (see LICENSE).
"""RL Fusion: the actor trains and generates on the same devices, one phase at a time.

A separated deployment trains on some devices and generates on the others, so each half idles
while the other works. In a fused deployment, every rank trains (the TRAIN phase) and then
generates (the ROLLOUT phase). A naive switch gathers the whole model for the inference engine and
keeps the training state. Every rank then holds a whole extra model, beside the grads and AdamW
states that ROLLOUT never reads. to_rollout() avoids this in three steps:
  1. It copies the AdamW states and any grads to the host. Then it frees their device storages
     in place (resized to 0), so the optimizer keeps its tensors. to_train() restores them exactly.
  2. It allocates the engine's weights and fills them from the training shards, bucket by bucket.
     A bucket bounds the broadcasts in flight. A transport that stages data holds at most one
     bucket more. Here it holds none, because the gather writes into the engine's parameters.
  3. It calls the movers, which switch the other state whose layout changes, such as the experts.
to_train() undoes the three steps in reverse order.

This file is the path of the default run (train_grpo.py). FSDP2 shards the model over all W ranks,
except the experts, which moe_switch.py re-shards as a mover. The engine is the whole model at
TP 1. The bytes move through a transport, Broadcasts by default. The docstring of Broadcasts says
what a transport must do. The other paths are FusedActor subclasses in options/. In
tensor_parallel.py, the engine runs at TP 2 or 4 and takes the weights through its load_weights.
owners.py handles pipeline stages and HSDP, and offload_params.py offloads the shards too. The
companion file, plumbing/fusion_details.py, holds what a learner can take on trust: the input
checks, the guards, the recovery and the counts. It also holds a usage example.

How this file departs from the source system (Huawei's RL post-training on CloudMatrix 384):
  1. It trains with FSDP2 (weights sharded between updates) or pipeline (PP) stages. It generates
     at TP 1 here, at TP 2 or 4 in options/tensor_parallel.py. The engine is not pipelined.
  2. The FSDP2 shards (1/W of the sharded weights) stay on the device in ROLLOUT unless offloaded.
  3. The engine's weights are freed in TRAIN, as vLLM's sleep mode would do. The engine manages
     its own KV cache.
  4. On CPU, the host is the device, so the offload saves nothing. Its host buffers are kept for
     the next switch and hold a second copy of the optimizer state. mem/* does not count it.

Run: python -m pytest tests/test_fusion.py. It tests W 1 and 2 at TP 1 and 2, and W 4 with
-m slow, and PP. tests/test_owners.py tests PP and HSDP.

Shapes: W is the world size, B the bucket size in bytes, d the number of a weight's owners (W
under FSDP2), and c = ceil(rows / d) the number of rows per shard.

Using this file elsewhere: it needs torch >= 2.6 and gloo or nccl. Copy fusion.py together with
its companion plumbing/fusion_details.py. Keep the folder, or change the one import line. The
companion's docstring ends with a usage example of the default path on 2 gloo processes.
tests/test_copy_alone.py runs that example in a folder that holds only these two files.
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
    """Return the distinct allocated storages behind tensors, only those on device if it is given.
    A DTensor counts through the storage of its local shard."""
    stores = [(t._local_tensor if isinstance(t, DTensor) else t).untyped_storage() for t in tensors]
    alive = {s.data_ptr(): s for s in stores if s.nbytes() and device in (None, s.device)}
    return list(alive.values())


def held_bytes(tensors, device=None):
    """Return the bytes still allocated in the distinct storages behind tensors, for mem/*."""
    return sum(s.nbytes() for s in storages(tensors, device))


def _as_bytes(s):
    return torch.empty(0, dtype=torch.uint8, device=s.device).set_(s)  # (nbytes,) uint8 view


def offload(stores, hosts=()):
    """Copy each device storage into a host buffer, then free it in place by resizing it to 0.
    The tensors that view it stay valid, and reload() brings the bytes back. Host buffers of the
    right size are reused. On CUDA they are pinned, the copy is non-blocking, and the stream runs
    the free after the copy. It is all or nothing: a failure reloads the storages already freed."""
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
    """A frozen module, such as the reference or a reward model, kept in host memory. It is on the
    device only inside `with ref.on_device() as module:`. With offload=False it stays on the
    device, and the calls are the same."""

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
    """Reshard every FSDP2 module, since FSDP2 leaves a module unsharded after a no-grad forward."""
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


class Weight(NamedTuple):
    """A weight to build, and where the training layout holds it. owners are global ranks. If the
    weight is sharded, its d owners hold Shard(0) pieces of c rows in that order, and the last
    piece may be shorter or empty. Otherwise each owner holds it whole. Under HSDP, replicas > 1
    disjoint meshes each hold it this way, and owners are the ranks of the first mesh."""
    name: str
    shape: tuple
    dtype: torch.dtype
    owners: tuple
    sharded: bool
    replicas: int = 1


def _rank():
    return dist.get_rank() if dist.is_initialized() else 0


def _group_ranks(group):
    """Return the global ranks of group. None means the default group, or [0] if there is none."""
    if group is not None:
        return dist.get_process_group_ranks(group)
    return list(range(dist.get_world_size())) if dist.is_initialized() else [0]


def _weight(name, p):
    """Return p's Weight on this rank. Its owners are a DTensor's mesh ranks, or else this rank."""
    if isinstance(p, DTensor):
        owners = tuple(p.device_mesh.mesh.flatten().tolist())
        return Weight(name, tuple(p.shape), p.dtype, owners, True)
    return Weight(name, tuple(p.shape), p.dtype, (_rank(),), False)


def _mine(p):
    """Return this rank's rows of p: its Shard(0) piece (<= c, ...), all of p, or None if none."""
    return p._local_tensor if isinstance(p, DTensor) else None if p is None else p.detach()


def weight_meta(module):
    """Return the Weight of each of this rank's parameters, in module order, with no collective."""
    return [_weight(n, p) for n, p in module.named_parameters()]


def full_bytes(w):
    """Return the bytes that each rank gathers for weight w, a Weight or a (name, shape, dtype)."""
    return torch.Size(w[1]).numel() * w[2].itemsize


def plan_buckets(meta, bucket_bytes):
    """Split meta into buckets of consecutive weights of one dtype, each gathering at most B bytes.
    Every rank gets the same buckets. The naive switch is one bucket as large as the model."""
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
    """Fill out (rows, ...), a contiguous full-size tensor, with weight w. mine is this rank's rows
    of w, or None if it holds none. Each owner copies its rows into place. Then each piece that a
    rank of group lacks comes in one async broadcast from its owner, appended to works. Every rank
    of group calls this, and it returns the bytes this rank receives. It avoids one all-gather,
    because gloo's ran well below the broadcasts' bandwidth on CPU (bench/RESULTS.md)."""
    me, members = _rank(), set(_group_ranks(group))
    if w.sharded:  # owner i's rows [i * c, (i + 1) * c)
        c = -(-out.shape[0] // len(w.owners))
        pieces = [(src, {src}, out[i * c:(i + 1) * c]) for i, src in enumerate(w.owners)]
    else:  # each owner holds it whole, and the first one sends it
        pieces = [(w.owners[0], set(w.owners), out)]
    received = 0
    for src, holders, piece in pieces:                   # piece: (<= c, ...) or (rows, ...)
        if me in holders:
            piece.copy_(mine)                            # its own rows, copied into place
        if piece.numel() and not members <= holders:     # a rank of group lacks them
            works.append(dist.broadcast(piece, src=src, group=group, async_op=True))
            received += piece.nbytes if me != src else 0
    return received


def _on_own_meshes(name, p, out, works):
    """Fill out with weight name from p, and return the bytes received. A DTensor is gathered over
    its own mesh (without a layout, or under HSDP over each node's replica). A tensor is copied."""
    if isinstance(p, DTensor):
        mesh_group = p.device_mesh.get_group()
        return gather_into(out, _mine(p), _weight(name, p), works, mesh_group)
    out.copy_(p.detach())  # whole on every rank
    return 0


# ------------------------------------------------------------------------------- the transport seam
@contextmanager
def agreeing(device, group):
    """Make every rank of group leave a switch's gather knowing whether all ranks succeeded. On
    the way out, one all_reduce combines an ok flag. So a rank whose gather failed does not leave
    the others waiting in the next collective, and every rank raises."""
    ok = torch.ones(1, device=device)
    agree = dist.is_initialized() and dist.get_world_size(group) > 1
    try:
        yield
    except BaseException:
        with suppress(Exception):  # if this fails too, the first error is the one raised
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
    one is the plain way and the default. It uses gather_into's broadcasts through the process
    group, on any backend and any hosts: gloo, or nccl on GPUs (untested past one rank). On one
    CPU host, plumbing/shm_transport.py's SharedMemory (--shm-transport 1) meets the same contract
    through shared memory: each rank copies its peers' rows out of their memory.
    The contract is what FusedActor calls of a transport:
      keeps_shards   True if the shards must stay in their storages and never be offloaded.
      gathering(params, layout, group)   a context around a switch's whole gather. On leaving it,
                     the ranks agree on an ok flag, so if one rank raised inside, every rank raises.
      fill(params, outs, layout, group)  a collective: it fills each (name, full-size out) with
                     that weight from its owners, and returns the bytes this rank received. Every
                     rank passes the same names in the same order.
      close()        releases what the transport holds.
    params maps each name to this rank's parameter, and layout is FusedActor's {name: Weight}
    over group. Without a layout (options/push.py), fill gathers each DTensor over its own mesh."""
    keeps_shards = False

    @contextmanager
    def gathering(self, params, layout=None, group=None):
        with agreeing(next(iter(params.values())).device, group):  # one all_reduce, on leaving
            yield

    def fill(self, params, outs, layout=None, group=None):
        works, received = [], 0  # the broadcasts are issued async, then waited for together
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
    """`with rollout(actor) as engine:` switches to ROLLOUT, and back to TRAIN on exit."""
    engine = actor.to_rollout()
    try:
        yield engine
    finally:
        actor.to_train()


class FusedActor:
    """The actor, which runs two phases on the same devices. It starts in TRAIN.
      model, optimizer  this rank's fully_shard model over `group`, and the optimizer built after.
      engine            an nn.Module with the whole model on every rank (TP 1). Its parameters
                        match the model's by name and shape, and the gather writes into them.
                        They are freed in TRAIN.
      bucket_bytes      B, the most bytes of whole weights that a bucket holds.
      movers            objects with to_rollout() and to_train(), called last in to_rollout() and
                        first in to_train(). The weights in their `names` are not built here.
                        Their `stats` join metrics().
      transport         Broadcasts() (the default) or SharedMemory. close() closes it.
      group             the actor's ranks. None means every rank. A hybrid deployment keeps the
                        other ranks for other work.
    The subclasses in options/ override these seams: _weights_to_build (which weights, held by
    which ranks), _check_engine and _fill (how the buckets reach the engine), and _gathered."""
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
        # the weights to build, the same list of Weight on every rank
        weights = self._weights_to_build([w for w in weight_meta(model) if w.name not in self.skip])
        self.layout = {w.name: w for w in weights}
        self.buckets = plan_buckets(weights, bucket_bytes)
        self._check_engine(weights)
        self.phase, self.round_trips, self.stats = TRAIN, 0, {}
        self._off, self._hosts = [], []  # the offloaded storages of grads and states, host copies
        self._held_grads = []  # (parameter, its offloaded grad) in ROLLOUT
        self._free_engine()
        self._hooks = self._guard()
        self.record()

    def _weights_to_build(self, mine):
        """Return mine, this rank's own weights. Under FSDP2 over the actor's ranks, every rank
        reports the same list. A weight held another way, such as by a pipeline stage or a node,
        is refused before any collective. options/owners.py agrees on the owners of such layouts."""
        check_owners(mine, _group_ranks(self.group))
        return list(mine)

    def _check_engine(self, weights):
        """Check, before any switch, that the engine has a contiguous parameter with each weight's
        name, full shape and dtype. The gather writes into these parameters."""
        check_engine(weights, self._engine_weights())

    @torch.no_grad()
    def to_rollout(self):
        """Switch TRAIN -> ROLLOUT and return the engine. If it raises, this actor is back in TRAIN
        as it was. So is a mover that raised before moving anything, as in moe_switch's checks. A
        mover that fails inside its collectives leaves its state partly moved, and the run must
        end. An error in the gather raises on every rank, through the transport's ok flag. An error
        elsewhere raises on its own rank. If it left a broadcast unmatched, that broadcast fails on
        the peers too, or in the group's timeout."""
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
                self._held_grads = hold_grads(params)  # p.grad is None in ROLLOUT (see hold_grads)
            with self._timed("alloc"):  # 2. allocate the engine's weights for this phase
                for p in eng.values():
                    p.untyped_storage().resize_(p.nbytes)
            with self._timed("gather"), self.transport.gathering(params, self.layout, self.group):
                received, extra = self._fill(params, eng)
            self._gathered(params)  # a subclass's hook (options/offload_params.py)
            for m in self.movers:  # 3. other state that changes layout (the experts' EP re-shard)
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
        """Gather every bucket through the transport straight into eng, the engine's weights by
        name, which match the model's names and full shapes. Return the bytes received from other
        ranks, and the most bytes held beyond the engine's weights, which here is 0."""
        received = 0
        for bucket in self.buckets:
            outs = [(name, eng[name].detach()) for name, *_ in bucket]  # [(name, (rows, ...))]
            received += self.transport.fill(params, outs, self.layout, self.group)
        return received, 0

    @torch.no_grad()
    def to_train(self):
        """Return to TRAIN: switch the movers back, free the engine, reload the training state."""
        self._expect(ROLLOUT, "to_train() called")
        t0 = time.perf_counter()
        for m in reversed(self.movers):
            m.to_train()
        with self._timed("free"):
            self._free_engine()
        with self._timed("reload"):
            self._reload()
        self.round_trips += 1
        self._finish(TRAIN, t0)  # frees, then reloads, so memory never exceeds its start or end

    def _reload(self):
        """Copy what the switch offloaded back into its device storages, and give back the grads."""
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
        """Time part as switch/<part>_s. On an accelerator, each part waits for its queued work."""
        return timed(self.stats, part, self.device)

    def _finish(self, phase, t0):
        synchronize(self.device)  # non-blocking copies must land before the time is taken
        self.phase = phase
        name = "to_rollout" if phase == ROLLOUT else "to_train"
        self.stats[f"time/{name}_s"] = time.perf_counter() - t0
        self.record()

    def metrics(self):
        """Return a flat dict for metrics.jsonl: mem/*, time/*, switch/* and the movers' stats.
        Per switch, gather_bytes counts the weights built on this rank, and received_bytes the part
        that came from other ranks. received_min_bytes is the least that could come from them,
        which is gather_bytes less the rows this rank holds."""
        out = dict(self.stats)
        out.update({"switch/round_trips": self.round_trips,
                    "switch/bucket_bytes": self.bucket_bytes, "switch/buckets": len(self.buckets)})
        for m in self.movers:
            out.update(getattr(m, "stats", {}))
        return out

    def _expect(self, phase, what, why=None):
        expect_phase(self.phase, phase, what, why)  # raises, naming both phases, where they differ

    def _guard(self):
        """Install the guards (the companion's guard_hooks). Where a call would read a storage
        freed in this phase and crash, they raise instead and name the phase. They guard the
        engine in TRAIN, and optimizer.step() and a backward in ROLLOUT."""
        return guard_hooks(self, TRAIN, ROLLOUT)

    def close(self):
        """Remove the guards and close the transport, so that another FusedActor can take over."""
        self._expect(TRAIN, "close() called")
        for hook in self._hooks:
            hook.remove()
        self.transport.close()

    def _gathered(self, params):
        """A hook that to_rollout() calls after it builds the engine from params, before the
        movers. It does nothing here. options/offload_params.py frees the training shards in it."""

    # For resuming. Save the model and the optimizer in TRAIN, where their state is on the device.
    def state_dict(self):
        return {"phase": self.phase, "round_trips": self.round_trips}

    def load_state_dict(self, state):
        if state["phase"] != self.phase:  # switches to the saved phase (collective)
            (self.to_rollout if state["phase"] == ROLLOUT else self.to_train)()
        self.round_trips = state["round_trips"]

    # the memory accounting, recorded at the end of each switch
    def record(self):
        """Record the phase's memory figures: the storages this file manages and their total. On
        an accelerator, the total is the allocator's count instead."""
        ps, key = list(self.model.parameters()), self.phase.lower()
        states = [v for st in self.optimizer.state.values() for v in st.values()]
        held = {"params": ps, "grads": [p.grad for p in ps if p.grad is not None],
                "optim": [v for v in states if torch.is_tensor(v)],
                "infer": self._engine_weights().values()}
        held = {cat: held_bytes(ts, self.device) for cat, ts in held.items()}
        self.stats.update(memory_figures(key, held, self.device))
