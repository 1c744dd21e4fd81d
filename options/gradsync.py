# Copyright (c) 2026 The authors of this repository. SPDX-License-Identifier: MIT (see LICENSE).
"""Hierarchical gradient sync: shard within a node, average the shards across nodes, compressed.

Shapes: N nodes, s ranks a node, n values a shard, k kept, C = ceil(k / chunk) chunks, P bytes.

HSDP replicates the model over N nodes and shards it within each. Each node runs FSDP2 on its own
1-D mesh: the backward reduce-scatters a unit's gradients over the node's fast links, leaving each
rank a flat shard of n values averaged over its node. Averaging that shard over rank j of every
node (the "cross" group j) crosses the slow links, so this file does it itself, in FSDP2's
FSDPModule.set_all_reduce_hook, and can compress it: int8 with one fp32 scale per chunk, or the
top-k values in int8 with their int32 indices. Error feedback (1-bit SGD, Seide et al. 2014; Deep
Gradient Compression, Lin et al. 2018) adds what a step did not send (the residual) to the next
step's gradient: it arrives late, not never (unless a step is skipped for a non-finite average).

Contents, naive first: NodeLayout, new_groups (the node and cross groups); allreduce_mean (the naive
sync, native HSDP's op); gather_payloads, encode, decode, average_payloads (the compressed sync);
GradSync (the hooks on every FSDP unit, or sync(name, buf) on any flat buffer).

Departures, numbered:
1. Compressed payloads travel by all-gather: int8 values cannot be summed hop by hop in a ring.
   GradSync.stats model the ring bytes a rank sends: 2(N-1)/N x 4n for a dense all-reduce, (N-1) P
   for an all-gather. Compression wins while N * P < 8n: N < 8 for int8, N < 16 for top-10%.
2. Every rank sums the N decoded payloads in node order: the nodes' parameters stay bit-identical.
3. The residuals are rank state, per unit (keyed by module name), checkpointed per rank like the
   optimizer's shards. reset() zeroes them, e.g. after a supervised warm-up.
4. A unit's residual moves only if its average is all finite. A non-finite value on any node makes
   that average non-finite on every rank of the cross group, and the trainer skips the step. A unit
   whose average was finite still moves its residual, so a skipped step loses what it sent.
5. overlap=True starts each unit's collective in its hook; wait(), before clipping and
   optimizer.step(), finishes them (a step before it raises). The grads must view the hook's
   buffer, so it is refused under mixed precision, CPU offload or fp16 (FSDP divides after the
   hook), and where grads exist.
6. apply() sets set_reduce_scatter_unused_params(True): every node's buffer keeps one layout.
7. One node (N = 1): nothing to average, the hook returns at once.
Every check reads what all ranks see alike and raises before the collective: all refuse together.
The first sync checks, by one all-gather, that every node compresses alike.

    python -m pytest tests/test_gradsync.py

Using this file elsewhere: torch only (tested with 2.13, gloo on CPU; nccl untested). The model is
FSDP2 over its node's 1-D mesh; every rank calls new_groups together. Example on 2 gloo processes,
2 nodes of 1 rank (tests/test_copy_alone.py runs it in a folder that holds only this file):

    import datetime, os, socket
    import torch, torch.distributed as dist, torch.multiprocessing as mp
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from gradsync import GradSync, NodeLayout, new_groups

    def rank_main(rank, world, port):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        timeout = datetime.timedelta(seconds=60)
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
        node_group, cross_group = new_groups(NodeLayout(world, nodes=2), timeout_s=60)
        torch.manual_seed(0)  # the same initial weights on every rank
        model = fully_shard(torch.nn.Linear(256, 8), mesh=DeviceMesh.from_group(node_group, "cpu"))
        sync = GradSync(cross_group, compress="int8")
        sync.apply(model)  # a hook on every FSDP unit of the model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(3):
            x = torch.randn(4, 256) + rank  # different data on each node
            model(x).square().mean().backward()
            sync.wait()  # nothing pending with overlap=False; call it before clipping, opt.step()
            opt.step()
            opt.zero_grad(set_to_none=True)
        w = model.weight.to_local()
        peers = [torch.empty_like(w) for _ in range(world)]
        dist.all_gather(peers, w)
        assert torch.equal(peers[0], peers[1])  # the nodes' weights are bit-identical
        s = sync.stats
        sent, dense = s["gradsync/sent_bytes"], s["gradsync/dense_bytes"]
        print(f"rank {rank}: sent {sent:.0f} bytes, dense {dense:.0f}")
        dist.destroy_process_group()

    if __name__ == "__main__":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(rank_main, args=(2, port), nprocs=2)
"""
import contextlib
import datetime
import functools
import math
import time
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

COMPRESS = ("none", "int8", "topk-int8")


@dataclass(frozen=True)
class NodeLayout:
    """world ranks in `nodes` contiguous blocks of node_size: rank = node * node_size + index."""
    world: int  # ranks in the job
    nodes: int  # replicas; each holds one copy of the model, sharded over its node_size ranks

    def __post_init__(self):
        for name in ("world", "nodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        if self.world % self.nodes:
            raise ValueError(f"nodes={self.nodes} does not divide world={self.world}: "
                             f"valid nodes are the divisors of {self.world}")

    @property
    def node_size(self):
        return self.world // self.nodes

    def node_of(self, rank):
        return rank // self.node_size

    def node_ranks(self, n):
        return list(range(n * self.node_size, (n + 1) * self.node_size))

    def cross_ranks(self, j):
        """The ranks with local index j in every node, in node order."""
        return [n * self.node_size + j for n in range(self.nodes)]


def new_groups(layout, timeout_s, backend=None):
    """(node_group, cross_group) of this rank. Every rank creates every group, in one order."""
    if not isinstance(layout, NodeLayout):
        raise TypeError(f"layout is a {type(layout).__name__}: expected a NodeLayout")
    if not dist.is_initialized() or layout.world != dist.get_world_size():
        world = dist.get_world_size() if dist.is_initialized() else "not initialized"
        raise ValueError(f"layout.world={layout.world} "
                         f"but the process group's world size is {world}")
    if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s={timeout_s!r} must be a finite number of seconds > 0")
    timeout = datetime.timedelta(seconds=timeout_s)
    nodes = [dist.new_group(layout.node_ranks(n), timeout=timeout, backend=backend)
             for n in range(layout.nodes)]
    cross = [dist.new_group(layout.cross_ranks(j), timeout=timeout, backend=backend)
             for j in range(layout.node_size)]
    rank = dist.get_rank()
    return nodes[layout.node_of(rank)], cross[rank % layout.node_size]


def allreduce_mean(buf, group, async_op=False):
    """The naive sync: buf (n,) averaged in place over the group, in full precision (HSDP's op)."""
    return dist.all_reduce(buf, op=dist.ReduceOp.AVG, group=group, async_op=async_op)


def gather_payloads(payload, group, async_op=False):
    """The compressed sync's exchange: payload (P,) uint8 -> (work, N x (P,) in node order)."""
    outs = [torch.empty_like(payload) for _ in range(dist.get_world_size(group))]  # N x (P,)
    return dist.all_gather(outs, payload, group=group, async_op=async_op), outs


def dense_bytes(nbytes, nodes):
    """Modelled bytes a rank sends in a ring all-reduce (reduce-scatter, all-gather) of nbytes."""
    return 2 * (nodes - 1) / nodes * nbytes


def quantize_int8(x, chunk):
    """x (n,) fp32 -> (q (n,) int8, scales (C,) fp32): symmetric, q * scale ~ x in each chunk."""
    n = x.numel()
    rows = torch.nn.functional.pad(x, (0, (-n) % chunk)).view(-1, chunk)   # (C, chunk), zero-padded
    # (C,); inf or nan: the chunk's too
    scales = rows.abs().amax(dim=1) / 127
    # an all-zero chunk: q = 0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(rows / safe[:, None]).clamp(-127, 127).to(torch.int8)   # (C, chunk)
    return q.flatten()[:n], scales


def dequantize_int8(q, scales, chunk):
    """(q (n,) int8, scales (C,)) -> (n,) fp32."""
    n = q.numel()
    rows = torch.nn.functional.pad(q.float(), (0, (-n) % chunk)).view(-1, chunk)  # (C, chunk)
    return (rows * scales[:, None]).flatten()[:n]


def n_kept(numel, compress, topk):
    return math.ceil(topk * numel) if compress == "topk-int8" else numel


def encode(g, compress, topk, chunk):
    """g (n,) fp32 -> (payload (P,) uint8: scales fp32 | indices int32 (top-k only) | values int8,
    sent (n,) fp32: what the payload decodes to, so that g - sent is the residual)."""
    if compress == "int8":
        q, scales = quantize_int8(g, chunk)                                      # (n,), (C,)
        payload = torch.cat([scales.view(torch.uint8), q.view(torch.uint8)])
        return payload, dequantize_int8(q, scales, chunk)
    # (k,) largest |g| first, nan first
    idx = g.abs().topk(n_kept(g.numel(), compress, topk)).indices
    q, scales = quantize_int8(g[idx], chunk)                                     # (k,), (C,)
    sent = torch.zeros_like(g).index_put_((idx,), dequantize_int8(q, scales, chunk))  # (n,)
    parts = [scales.view(torch.uint8), idx.to(torch.int32).view(torch.uint8), q.view(torch.uint8)]
    return torch.cat(parts), sent


def decode(payload, numel, compress, topk, chunk):
    """payload (P,) uint8 -> (n,) fp32, the values it carries (zeros where top-k sent none)."""
    k = n_kept(numel, compress, topk)
    c = math.ceil(k / chunk)
    scales = payload[:4 * c].view(torch.float32)  # (C,); offsets are multiples of 4
    if compress == "int8":
        return dequantize_int8(payload[4 * c:].view(torch.int8), scales, chunk)
    idx = payload[4 * c:4 * c + 4 * k].view(torch.int32).long()                  # (k,)
    values = dequantize_int8(payload[4 * c + 4 * k:].view(torch.int8), scales, chunk)  # (k,)
    return torch.zeros(numel, device=payload.device).index_put_((idx,), values)


def average_payloads(payloads, numel, compress, topk, chunk):
    """N payloads -> (n,) fp32 their mean: summed in node order, the same on every rank."""
    total = decode(payloads[0], numel, compress, topk, chunk)
    for payload in payloads[1:]:
        total += decode(payload, numel, compress, topk, chunk)
    return total / len(payloads)


def _settings(compress, topk, chunk):
    """What must agree across nodes: the codec, with its top-k share and chunk where they act."""
    compress = COMPRESS[int(compress)]
    out = {"compress": compress}
    if compress != "none":
        out["chunk"] = int(chunk)
    if compress == "topk-int8":
        out["topk"] = topk
    return out


def _refuse_pending_step(sync_ref, optimizer, args, kwargs):
    """A step pre-hook on every optimizer: a step over a GradSync's parameters while its syncs are
    pending (overlap=True, wait() not yet called) would step on grads not averaged across nodes."""
    sync = sync_ref()
    if sync is None or not sync.pending:
        return
    mine = {id(p) for params in sync.params.values() for p in params}
    if any(id(p) in mine for group in optimizer.param_groups for p in group["params"]):
        raise RuntimeError(f"optimizer.step() with {len(sync.pending)} gradient syncs pending: "
                           "call wait() after the backward, before clipping and optimizer.step() "
                           "(the grads are not yet averaged across nodes)")


def own_params(unit):
    """The parameters a FSDP unit reduces itself: its own sharded ones (DTensors: ignored_params
    stay plain), not those of the FSDP units inside it."""
    inner_units = [m for m in unit.modules() if m is not unit and isinstance(m, FSDPModule)]
    inner = {id(p) for m in inner_units for p in m.parameters()}
    return [p for p in unit.parameters()
            if id(p) not in inner and p.requires_grad and isinstance(p, DTensor)]


def shard_numel(params):
    """n of the unit's flat buffer: one shard of each parameter, dim 0 padded to the mesh size."""
    return sum(math.ceil(p.shape[0] / p.device_mesh.size()) * math.prod(p.shape[1:])
               for p in params)


class GradSync:
    """Cross-node gradient sync of a FSDP2 model sharded within nodes: apply(model); each step,
    wait()."""
    # the phase-switch protocol a colocated trainer calls: to_rollout/to_train; names: engine
    # weights this object builds itself, none
    names = ()

    def __init__(self, cross_group, compress="none", topk=0.1, chunk=128, overlap=False,
                 timer=None):
        if compress not in COMPRESS:
            raise ValueError(f"compress={compress!r}: valid values are {COMPRESS}")
        if not (isinstance(topk, (int, float)) and math.isfinite(topk) and 0 < topk <= 1):
            raise ValueError(f"topk={topk!r} must be a finite fraction in (0, 1]")
        if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
            raise ValueError(f"chunk={chunk!r} must be an int >= 1")
        self.group = cross_group
        self.compress = compress
        self.topk = topk
        self.chunk = chunk
        self.overlap = overlap
        # timer(name): a context manager around each stretch a rank is blocked on the sync
        # ("grad_sync" in a hook, "grad_sync_wait" in wait()), e.g. a run's span helper, so that a
        # timeline shows the exposed communication
        self.timer = timer or (lambda name: contextlib.nullcontext())
        self.nodes = dist.get_world_size(cross_group)  # N
        self.params = {}        # unit name -> its own parameters (apply)
        self.residuals = {}     # name -> (n,) fp32, this rank's unsent gradient
        # started syncs (name, buf, work, outs, late), finished by wait() (see _start)
        self.pending = []
        self._host = {}         # name -> (n,) host copy for to_rollout(), allocated once
        self._on_host = False
        self._agreed = False    # the nodes' settings checked alike (the first sync, _agree)
        self._step_hook = None  # apply(): optimizer.step() refused while syncs are pending
        # cumulative, of the gradient sync only (not the run's other collectives), and modelled
        # under ring algorithms, not measured on the wire: sent_bytes, what this rank sends across
        # nodes (none: a ring all-reduce, 2(N-1)/N x the buffer's bytes; compressed: a ring
        # all-gather, (N-1) x P); dense_bytes, what a ring all-reduce of the same buffers would
        # send; wait_s, host seconds blocked in the hooks and in wait(); syncs started;
        # offload_bytes moved to host by to_rollout()
        self.stats = {"gradsync/sent_bytes": 0.0, "gradsync/dense_bytes": 0.0,
                      "gradsync/wait_s": 0.0, "gradsync/syncs": 0.0,
                      "gradsync/offload_bytes": 0.0}

    def apply(self, model):
        """A hook on every FSDP unit of the model, keyed by its module name; the model is changed in
        place. Returns this GradSync (`sync = GradSync(...).apply(model)`; sync.wait() each
        step)."""
        units = {name: m for name, m in model.named_modules() if isinstance(m, FSDPModule)}
        if not units:
            raise ValueError(f"{type(model).__name__} has no FSDP2 unit: "
                             "fully_shard it over its node's mesh first")
        for name, unit in units.items():
            params = own_params(unit)
            if params:
                self._check_mesh(name, params[0].device_mesh)
            self.params[name] = params
            if self.compress != "none" and params:
                self.residuals[name] = torch.zeros(shard_numel(params), dtype=torch.float32,
                                                   device=params[0].device)
            # departure 6: the buffer's layout fixed
            unit.set_reduce_scatter_unused_params(True, recurse=False)
            unit.set_all_reduce_hook(functools.partial(self.sync, name))  # FSDP's flat buffer
        if self._step_hook is None:
            self._step_hook = register_optimizer_step_pre_hook(
                functools.partial(_refuse_pending_step, weakref.ref(self)))
        return self

    def _check_mesh(self, name, mesh):
        """The unit's mesh is this rank's node: it meets the cross group in this rank alone, and N
        of them make the world."""
        if mesh.ndim != 1:
            raise ValueError(f"unit {name!r} is sharded over a {mesh.ndim}-D mesh: "
                             "native HSDP already syncs across nodes; "
                             "fully_shard over the node's 1-D mesh instead")
        ranks = set(mesh.mesh.flatten().tolist())
        cross = set(dist.get_process_group_ranks(self.group))
        world = dist.get_world_size()
        if ranks & cross != {dist.get_rank()} or len(ranks) * self.nodes != world:
            raise ValueError(f"unit {name!r} is sharded over ranks {sorted(ranks)} "
                             f"and the cross group is ranks {sorted(cross)}: "
                             f"a node's mesh must share exactly this rank ({dist.get_rank()}) "
                             f"with the cross group, and its size x {self.nodes} nodes "
                             f"must be the world size {world}: "
                             "fully_shard over new_groups' node group")

    def sync(self, name, buf):
        """The hook's body: buf (n,) averaged over the nodes in place (overlap: started; wait() ends
        it). Called directly it syncs any flat buffer, under one `name` (its residual's key) every
        step."""
        if self.nodes == 1:
            return
        self._check(name, buf)
        if not self._agreed:
            self._agree(buf.device)
        with self.timer("grad_sync"):
            t0 = time.perf_counter()
            self.pending.append(self._start(name, buf))
            if not self.overlap:
                self._finish()
            self.stats["gradsync/wait_s"] += time.perf_counter() - t0

    def _agree(self, device):
        """The first sync: every node's settings, by one all-gather over the cross group. Nodes
        that compress differently would pair unlike collectives (a crash, or a wait to the
        timeout): every rank raises instead, naming them."""
        mine = torch.tensor([COMPRESS.index(self.compress), self.topk, self.chunk],
                            dtype=torch.float64, device=device)                           # (3,)
        everyone = [torch.empty_like(mine) for _ in range(self.nodes)]
        dist.all_gather(everyone, mine, group=self.group)
        said = [_settings(*t.tolist()) for t in everyone]
        if any(s != said[0] for s in said):
            nodes = "; ".join(f"node {n}: {s}" for n, s in enumerate(said))
            raise ValueError(f"the nodes' GradSync settings differ ({nodes}): every node must "
                             "pass the same compress, and the same topk and chunk where they act")
        self._agreed = True

    def _start(self, name, buf):
        self.stats["gradsync/dense_bytes"] += dense_bytes(buf.nbytes, self.nodes)
        self.stats["gradsync/syncs"] += 1
        if self.compress == "none":
            self.stats["gradsync/sent_bytes"] += dense_bytes(buf.nbytes, self.nodes)
            return name, buf, allreduce_mean(buf, self.group, async_op=self.overlap), None, None
        if name not in self.residuals:  # a buffer synced directly: its residual starts at zero
            self.residuals[name] = torch.zeros(buf.numel(), dtype=torch.float32, device=buf.device)
        g = buf.float() + self.residuals[name]                           # (n,) g', error feedback
        payload, sent = encode(g, self.compress, self.topk, self.chunk)  # (P,) uint8, (n,)
        work, outs = gather_payloads(payload, self.group, async_op=self.overlap)
        self.stats["gradsync/sent_bytes"] += (self.nodes - 1) * payload.nbytes
        late = g.sub_(sent)  # g' - sent in g's storage, kept if the average is finite
        return name, buf, work, outs, late

    def _check(self, name, buf):
        if name in self.params:
            self._check_unit(name, buf)
        elif name in self.residuals and buf.numel() != self.residuals[name].numel():
            raise ValueError(f"sync({name!r}, buf): buf has {buf.numel()} values, "
                             f"the residual of {name!r} {self.residuals[name].numel()}: "
                             "one name per flat buffer, of one size every step")
        if self.overlap and any(n == name for n, *_ in self.pending):
            raise RuntimeError(f"{name!r} syncs again before wait() ended its last sync: "
                               "call wait() once per backward, "
                               "before clipping and optimizer.step()")

    def _check_unit(self, name, buf):
        params = self.params[name]
        numel = shard_numel(params)
        # internal: apply()'s set_reduce_scatter_unused_params(True) fixes the size
        if buf.numel() != numel:
            raise RuntimeError(f"unit {name!r}: FSDP's gradient buffer has {buf.numel()} values, "
                               f"its parameters' shards {numel}: "
                               "a placement other than Shard(0), or unused params not reduced")
        if not self.overlap:
            return
        dtype, device = params[0].dtype, params[0].device
        viewable = buf.dtype in (torch.float32, torch.bfloat16)
        if buf.dtype != dtype or buf.device != device or not viewable:
            raise RuntimeError(f"unit {name!r}: overlap=True needs FSDP's grads "
                               "to view the hook's buffer, in float32 or bfloat16, "
                               "of the parameters' dtype and device; "
                               f"found a {buf.dtype} buffer on {buf.device} "
                               f"for {dtype} parameters on {device}: use overlap=False, "
                               "or no mixed precision (reduce dtype = parameter dtype) "
                               "and no CPU offload")
        held = [p for p in params if p.grad is not None]
        if held:
            raise RuntimeError(f"unit {name!r}: overlap=True needs grads None "
                               f"before the backward that syncs, {len(held)} parameters hold one: "
                               "optimizer.zero_grad(set_to_none=True)")

    def wait(self):
        """Finish every started sync: the averages into their buffers, which the grads view."""
        if not self.pending:
            return
        with self.timer("grad_sync_wait"):
            t0 = time.perf_counter()
            self._finish()
            self.stats["gradsync/wait_s"] += time.perf_counter() - t0

    def _finish(self):
        for name, buf, work, outs, late in self.pending:
            if work is not None:
                work.wait()
            if outs is not None:
                numel = buf.numel()
                avg = average_payloads(outs, numel, self.compress, self.topk, self.chunk)  # (n,)
                # 0-d: no host sync; the cross group agrees (departure 4)
                finite = torch.isfinite(avg).all()
                residual = self.residuals[name]
                # else the residual as it was before this step. A step skipped for another unit's
                # (or shard's) non-finite average still loses what this unit sent.
                torch.where(finite, late, residual, out=residual)
                buf.copy_(avg)
        self.pending = []

    def reset(self):
        """Every residual to zero: nothing late carried over (e.g. from a supervised warm-up)."""
        if self.pending:
            raise RuntimeError(f"{len(self.pending)} syncs are still pending: "
                               "call wait() before reset()")
        for name, r in self.residuals.items():
            (self._host[name] if self._on_host else r).zero_()

    def state_dict(self):
        """{unit name: (n,) residual} of this rank (copies): a per-rank checkpoint."""
        return {name: r.detach().clone() for name, r in self.residuals.items()}

    def load_state_dict(self, sd):
        """Residuals back, by unit name and shape (without apply(): the names it is given)."""
        mine, given = set(self.residuals), set(sd)
        if (self.params or mine) and given != mine:
            raise ValueError(f"residuals for units {sorted(given)}, "
                             f"this model's are {sorted(mine)}: "
                             f"missing {sorted(mine - given)}, unknown {sorted(given - mine)}")
        for name, r in self.residuals.items():
            if sd[name].shape != r.shape:
                raise ValueError(f"unit {name!r}: residual of shape {tuple(sd[name].shape)}, "
                                 f"expected {tuple(r.shape)}")
        for name, t in sd.items():
            self.residuals.setdefault(name, torch.empty_like(t, dtype=torch.float32)).copy_(t)

    def to_rollout(self):
        """Residuals to host buffers (allocated once), their storage freed (on CPU too)."""
        if self.pending:
            raise RuntimeError(f"{len(self.pending)} syncs are still pending: "
                               "call wait() before to_rollout()")
        for name, r in self.residuals.items():
            if name not in self._host:  # the first switch; every later one reuses it
                self._host[name] = torch.empty(r.shape, dtype=r.dtype, pin_memory=r.is_cuda)
            self._host[name].copy_(r)
            self.stats["gradsync/offload_bytes"] += r.nbytes
            r.untyped_storage().resize_(0)
        self._on_host = True

    def to_train(self):
        """Residuals back into their own storages, bit for bit."""
        for name, r in self.residuals.items():
            r.untyped_storage().resize_(r.nbytes)
            r.copy_(self._host[name])
        self._on_host = False
