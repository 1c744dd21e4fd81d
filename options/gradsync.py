# Copyright (c) 2026 The authors of this repository. SPDX-License-Identifier: MIT (the LICENSE file).
"""Hierarchical gradient sync: shard within a node, average the shards across nodes, optionally compressed.

Shapes: N nodes, s ranks per node, n values in a unit's flat shard, k values kept, C = ceil(k / chunk)
chunks, P payload bytes.

HSDP's layout is replicate across N nodes x shard within a node of s ranks. Each node runs FSDP2 on its own
1-D mesh: the backward reduce-scatters every unit's gradients over the node's fast links, leaving each rank
a flat shard of n values, averaged over its node. Rank j of every node holds the same shard of different
nodes' gradients; averaging it over them (the "cross" group j) gives each rank its shard of the gradient
averaged over all N * s ranks. That step crosses the slow links, so this file does it itself, through FSDP2's
public FSDPModule.set_all_reduce_hook, and can compress it: int8 with one fp32 scale per chunk of values, or
the top-k largest values in int8 with their int32 indices, with error feedback (1-bit SGD, Seide et al. 2014;
EF-SGD, Karimireddy et al. 2019; Deep Gradient Compression, Lin et al. 2018): what a step does not send is
kept per rank (the residual) and added to the next step's gradient, so nothing is lost, only late.

Contents, naive first:
  NodeLayout        validated: world, nodes; node n = ranks [n*s, (n+1)*s); cross group j = rank j of each node
  new_groups        every node group and every cross group, created by every rank in one order
  allreduce_mean    the naive sync: ReduceOp.AVG over the nodes, native 2-D HSDP's op on the same ranks (gloo
                    supports it), so compress="none" gives native HSDP's parameters bit for bit
  gather_payloads   the compressed sync: every node's payload; encode, decode; average_payloads, their mean
  GradSync          the hooks on every FSDP unit (or sync(name, buf) on any flat buffer): residuals, overlap,
                    modelled bytes, state, reset, phase switches

FSDP2 (torch 2.13, _fsdp_collectives.foreach_reduce) calls a unit's hook with its flat 1-D buffer (reduce dtype)
of this rank's shard of each of the unit's parameters, each padded on dim 0 to a multiple of s; in fp32 and bf16
it is the node's average (ReduceOp.AVG) and nothing divides it after the hook (fp16: a division after it). The
sharded grads are then as_strided views of it when the reduce dtype is the parameters' (else a cast copy; under
CPU offload a host copy), or it is added to grads that exist. apply() sets the hook on every FSDPModule.

Departures, numbered:
1. Compressed payloads travel by all-gather, not all-reduce: int8 values cannot be summed hop by hop in a
   ring without re-quantising at every hop. GradSync.stats model the bytes of the gradient sync alone (none
   of a run's other collectives) under ring algorithms, not the wire: a dense all-reduce sends 2(N-1)/N x 4n
   bytes a rank (fp32), an all-gather (N-1) P. The ratio, 2(N-1)/N x 4n / ((N-1) P), is about 3.9x for int8
   and 8x for top-10% at 2 nodes; compression wins while N * P < 8n: N < 8 for int8, N < 16 for top-10%
   (HSDP's N is small: the nodes, not the GPUs).
2. Every rank decodes the N payloads and sums them in node order, then divides by N: every replica
   computes the same float operations on the same bytes, so the nodes' parameters stay bit-identical.
3. The residuals are per rank and unit, keyed by the unit's module name ("" the root): rank state, like the
   optimizer's shards, checkpointed per rank. reset() zeroes them, e.g. after a supervised warm-up, so that
   its unsent gradient does not reach the RL optimizer.
4. The residual moves once the average is known: the hook keeps g' - sent pending, and the finish makes it
   the residual only if the unit's average is all finite. A non-finite value in any node's g' makes its
   chunk's scale, so the average, non-finite on every rank of the cross group (they decode the same bytes);
   the trainer skips the step, each rank keeps the residual it had before it, and the step's gradient is
   dropped with the step. A step skipped because another unit's (or shard's) average was not finite still
   loses what this unit sent.
5. overlap=True starts each unit's collective (async_op) in its hook and returns; wait(), once per step
   before clipping and optimizer.step(), writes the averages into the buffers the grads view. The hook
   refuses it where they do not view the buffer or FSDP changes it after the hook (mixed precision, CPU
   offload, fp16), and where grads exist, as FSDP would add the unfinished buffer into them (call
   optimizer.zero_grad(set_to_none=True)). With one unit per block, block i's sync runs while the backward
   of the blocks before it continues; with one unit there is nothing to overlap.
6. apply() calls set_reduce_scatter_unused_params(True) on every unit: a parameter without a grad on one
   node reduces as zeros, so every node's buffer keeps one layout (else that node's would be shorter, or
   absent, while its peers wait in the collective).
7. One node (N = 1): nothing to average, the hook returns at once and nothing is compressed.
The hooks' checks read only what every rank sees alike (settings, layout) and raise before the collective:
all ranks refuse together.

    python -m pytest tests/test_gradsync.py

Using this file elsewhere: torch only (tested with 2.13, gloo on CPU; nccl untested). The model is FSDP2
(fully_shard) over its node's 1-D mesh; every rank calls new_groups together. Example on 2 gloo processes,
2 nodes of 1 rank (tests/test_copy_alone.py runs it in a folder that holds only this file):

    import datetime, os, socket
    import torch, torch.distributed as dist, torch.multiprocessing as mp
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from gradsync import GradSync, NodeLayout, new_groups

    def rank_main(rank, world, port):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
        node_group, cross_group = new_groups(NodeLayout(world, nodes=2), timeout_s=60)
        torch.manual_seed(0)  # the same initial weights on every rank
        model = fully_shard(torch.nn.Linear(256, 8), mesh=DeviceMesh.from_group(node_group, "cpu"))
        sync = GradSync(cross_group, compress="int8")
        sync.apply(model)  # a hook on every FSDP unit of the model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(3):
            model(torch.randn(4, 256) + rank).square().mean().backward()  # different data on each node
            sync.wait()  # nothing pending with overlap=False; call it before clipping and opt.step()
            opt.step()
            opt.zero_grad(set_to_none=True)
        w = model.weight.to_local()
        peers = [torch.empty_like(w) for _ in range(world)]
        dist.all_gather(peers, w)
        assert torch.equal(peers[0], peers[1])  # the nodes' weights are bit-identical
        s = sync.stats
        print(f"rank {rank}: sent {s['gradsync/sent_bytes']:.0f} bytes, dense {s['gradsync/dense_bytes']:.0f}")
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
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

COMPRESS = ("none", "int8", "topk-int8")


@dataclass(frozen=True)
class NodeLayout:
    """world ranks in `nodes` contiguous blocks of node_size: rank = node * node_size + local index."""
    world: int  # ranks in the job
    nodes: int  # nodes (replicas); each holds one copy of the model, sharded over its node_size ranks

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
    """(node_group, cross_group) of this rank. Collective: every rank creates every group, in one order."""
    if not isinstance(layout, NodeLayout):
        raise TypeError(f"layout is a {type(layout).__name__}: expected a NodeLayout")
    if not dist.is_initialized() or layout.world != dist.get_world_size():
        world = dist.get_world_size() if dist.is_initialized() else "not initialized"
        raise ValueError(f"layout.world={layout.world} but the process group's world size is {world}")
    if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s={timeout_s!r} must be a finite number of seconds > 0")
    timeout = datetime.timedelta(seconds=timeout_s)
    nodes = [dist.new_group(layout.node_ranks(n), timeout=timeout, backend=backend) for n in range(layout.nodes)]
    cross = [dist.new_group(layout.cross_ranks(j), timeout=timeout, backend=backend) for j in range(layout.node_size)]
    rank = dist.get_rank()
    return nodes[layout.node_of(rank)], cross[rank % layout.node_size]


def allreduce_mean(buf, group, async_op=False):
    """The naive sync: buf (n,) averaged in place over the group, in full precision; native HSDP's op."""
    return dist.all_reduce(buf, op=dist.ReduceOp.AVG, group=group, async_op=async_op)


def gather_payloads(payload, group, async_op=False):
    """The compressed sync's exchange: payload (P,) uint8 -> (work, N x (P,) every node's payload, node order)."""
    outs = [torch.empty_like(payload) for _ in range(dist.get_world_size(group))]  # N x (P,)
    return dist.all_gather(outs, payload, group=group, async_op=async_op), outs


def dense_bytes(nbytes, nodes):
    """Modelled bytes a rank sends in a ring all-reduce of nbytes over `nodes` ranks: reduce-scatter, all-gather."""
    return 2 * (nodes - 1) / nodes * nbytes


def quantize_int8(x, chunk):
    """x (n,) fp32 -> (q (n,) int8, scales (C,) fp32): symmetric, one scale per chunk, q * scale ~ x."""
    n = x.numel()
    rows = torch.nn.functional.pad(x, (0, (-n) % chunk)).view(-1, chunk)   # (C, chunk), zero-padded
    scales = rows.abs().amax(dim=1) / 127                                   # (C,); inf or nan: the chunk's too
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))         # an all-zero chunk: q = 0
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
        return torch.cat([scales.view(torch.uint8), q.view(torch.uint8)]), dequantize_int8(q, scales, chunk)
    idx = g.abs().topk(n_kept(g.numel(), compress, topk)).indices              # (k,) largest |g| first, nan first
    q, scales = quantize_int8(g[idx], chunk)                                     # (k,), (C,)
    sent = torch.zeros_like(g).index_put_((idx,), dequantize_int8(q, scales, chunk))  # (n,)
    parts = [scales.view(torch.uint8), idx.to(torch.int32).view(torch.uint8), q.view(torch.uint8)]
    return torch.cat(parts), sent


def decode(payload, numel, compress, topk, chunk):
    """payload (P,) uint8 -> (n,) fp32, the dense values it carries (zeros where top-k sent nothing)."""
    k = n_kept(numel, compress, topk)
    c = math.ceil(k / chunk)
    scales = payload[:4 * c].view(torch.float32)                                 # (C,); offsets are multiples of 4
    if compress == "int8":
        return dequantize_int8(payload[4 * c:].view(torch.int8), scales, chunk)
    idx = payload[4 * c:4 * c + 4 * k].view(torch.int32).long()                  # (k,)
    values = dequantize_int8(payload[4 * c + 4 * k:].view(torch.int8), scales, chunk)  # (k,)
    return torch.zeros(numel, device=payload.device).index_put_((idx,), values)


def average_payloads(payloads, numel, compress, topk, chunk):
    """N payloads, node order -> (n,) fp32 their mean: summed in node order, the same on every rank."""
    total = decode(payloads[0], numel, compress, topk, chunk)
    for payload in payloads[1:]:
        total += decode(payload, numel, compress, topk, chunk)
    return total / len(payloads)


def own_params(unit):
    """The parameters a FSDP unit reduces itself: its own sharded ones (DTensors: ignored_params stay plain),
    not those of the FSDP units inside it."""
    inner = {id(p) for m in unit.modules() if m is not unit and isinstance(m, FSDPModule) for p in m.parameters()}
    return [p for p in unit.parameters() if id(p) not in inner and p.requires_grad and isinstance(p, DTensor)]


def shard_numel(params):
    """n of the unit's flat buffer: each parameter's dim 0 padded to a multiple of the mesh size, one shard."""
    return sum(math.ceil(p.shape[0] / p.device_mesh.size()) * math.prod(p.shape[1:]) for p in params)


class GradSync:
    """Cross-node gradient sync of a FSDP2 model sharded within nodes: apply(model), wait() each step."""
    # the phase-switch protocol a colocated trainer calls: to_rollout/to_train; names: engine weights this
    # object builds itself, none
    names = ()

    def __init__(self, cross_group, compress="none", topk=0.1, chunk=128, overlap=False, timer=None):
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
        # timer(name): a context manager around each stretch a rank is blocked on the sync ("grad_sync" in a hook,
        # "grad_sync_wait" in wait()), e.g. a run's span helper, so that a timeline shows the exposed communication
        self.timer = timer or (lambda name: contextlib.nullcontext())
        self.nodes = dist.get_world_size(cross_group)  # N
        self.params = {}        # unit name -> its own parameters (apply)
        self.residuals = {}     # name -> (n,) fp32, this rank's unsent gradient
        self.pending = []       # started syncs (name, buf, work, outs, late), finished by wait() (see _start)
        self._host = {}         # name -> (n,) host copy for to_rollout(), allocated once
        self._on_host = False
        # cumulative, of the gradient sync only (not the run's other collectives), and modelled under ring
        # algorithms, not measured on the wire: sent_bytes, what this rank sends across nodes (none: a ring
        # all-reduce, 2(N-1)/N x the buffer's bytes; compressed: a ring all-gather, (N-1) x P); dense_bytes,
        # what a ring all-reduce of the same buffers would send; wait_s, host seconds blocked in the hooks and
        # in wait(); syncs started; offload_bytes moved to host by to_rollout()
        self.stats = {"gradsync/sent_bytes": 0.0, "gradsync/dense_bytes": 0.0, "gradsync/wait_s": 0.0,
                      "gradsync/syncs": 0.0, "gradsync/offload_bytes": 0.0}

    def apply(self, model):
        """A hook on every FSDP unit of the model, keyed by its module name. Returns the model."""
        units = {name: m for name, m in model.named_modules() if isinstance(m, FSDPModule)}
        if not units:
            raise ValueError(f"{type(model).__name__} has no FSDP2 unit: fully_shard it over its node's mesh first")
        for name, unit in units.items():
            params = own_params(unit)
            if params:
                self._check_mesh(name, params[0].device_mesh)
            self.params[name] = params
            if self.compress != "none" and params:
                self.residuals[name] = torch.zeros(shard_numel(params), dtype=torch.float32, device=params[0].device)
            unit.set_reduce_scatter_unused_params(True, recurse=False)  # departure 6: the buffer's layout fixed
            unit.set_all_reduce_hook(functools.partial(self.sync, name))  # called with FSDP's flat buffer
        return model

    def _check_mesh(self, name, mesh):
        """The unit's mesh is this rank's node: it meets the cross group in this rank alone; N of them, the world."""
        if mesh.ndim != 1:
            raise ValueError(f"unit {name!r} is sharded over a {mesh.ndim}-D mesh: native HSDP already syncs "
                             "across nodes; fully_shard over the node's 1-D mesh instead")
        ranks = set(mesh.mesh.flatten().tolist())
        cross = set(dist.get_process_group_ranks(self.group))
        world = dist.get_world_size()
        if ranks & cross != {dist.get_rank()} or len(ranks) * self.nodes != world:
            raise ValueError(f"unit {name!r} is sharded over ranks {sorted(ranks)} and the cross group is ranks "
                             f"{sorted(cross)}: a node's mesh must share exactly this rank ({dist.get_rank()}) with "
                             f"the cross group, and its size x {self.nodes} nodes must be the world size {world}: "
                             "fully_shard over new_groups' node group")

    def sync(self, name, buf):
        """The hook's body: buf (n,) averaged over the nodes in place (overlap: started; wait() ends it).
        Called directly it syncs any flat buffer, the same `name` each step (its residual's key)."""
        if self.nodes == 1:
            return
        self._check(name, buf)
        with self.timer("grad_sync"):
            t0 = time.perf_counter()
            self.pending.append(self._start(name, buf))
            if not self.overlap:
                self._finish()
            self.stats["gradsync/wait_s"] += time.perf_counter() - t0

    def _start(self, name, buf):
        self.stats["gradsync/dense_bytes"] += dense_bytes(buf.nbytes, self.nodes)
        self.stats["gradsync/syncs"] += 1
        if self.compress == "none":
            self.stats["gradsync/sent_bytes"] += dense_bytes(buf.nbytes, self.nodes)
            return name, buf, allreduce_mean(buf, self.group, async_op=self.overlap), None, None
        if name not in self.residuals:  # a buffer synced directly: its residual starts at zero
            self.residuals[name] = torch.zeros(buf.numel(), dtype=torch.float32, device=buf.device)
        g = buf.float() + self.residuals[name]                                   # (n,) g', error feedback
        payload, sent = encode(g, self.compress, self.topk, self.chunk)          # (P,) uint8, (n,)
        work, outs = gather_payloads(payload, self.group, async_op=self.overlap)
        self.stats["gradsync/sent_bytes"] += (self.nodes - 1) * payload.nbytes
        return name, buf, work, outs, g.sub_(sent)  # late: g' - sent in g's storage, kept if the average is finite

    def _check(self, name, buf):
        if name in self.params:
            self._check_unit(name, buf)
        elif name in self.residuals and buf.numel() != self.residuals[name].numel():
            raise ValueError(f"sync({name!r}, buf): buf has {buf.numel()} values, the residual of {name!r} "
                             f"{self.residuals[name].numel()}: one name per flat buffer, of one size every step")
        if self.overlap and any(n == name for n, *_ in self.pending):
            raise RuntimeError(f"{name!r} syncs again before wait() ended its last sync: call wait() once "
                               "per backward, before clipping and optimizer.step()")

    def _check_unit(self, name, buf):
        params = self.params[name]
        numel = shard_numel(params)
        if buf.numel() != numel:  # internal: apply()'s set_reduce_scatter_unused_params(True) fixes the size
            raise RuntimeError(f"unit {name!r}: FSDP's gradient buffer has {buf.numel()} values, its parameters' "
                               f"shards {numel}: a placement other than Shard(0), or unused params not reduced")
        if not self.overlap:
            return
        dtype, device = params[0].dtype, params[0].device
        if buf.dtype != dtype or buf.device != device or buf.dtype not in (torch.float32, torch.bfloat16):
            raise RuntimeError(f"unit {name!r}: overlap=True needs FSDP's grads to view the hook's buffer, in "
                               f"float32 or bfloat16, of the parameters' dtype and device; found a {buf.dtype} "
                               f"buffer on {buf.device} for {dtype} parameters on {device}: use overlap=False, "
                               "or no mixed precision (reduce dtype = parameter dtype) and no CPU offload")
        held = [p for p in params if p.grad is not None]
        if held:
            raise RuntimeError(f"unit {name!r}: overlap=True needs grads None before the backward that syncs, "
                               f"{len(held)} parameters hold one: optimizer.zero_grad(set_to_none=True)")

    def wait(self):
        """Finish every started sync (overlap=True): the averages into their buffers (the sharded grads view them)."""
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
                avg = average_payloads(outs, buf.numel(), self.compress, self.topk, self.chunk)  # (n,) fp32
                finite = torch.isfinite(avg).all()  # 0-d: no host sync; the cross group agrees (departure 4)
                residual = self.residuals[name]
                torch.where(finite, late, residual, out=residual)  # else the residual as it was before this step
                buf.copy_(avg)
        self.pending = []

    def reset(self):
        """Every residual to zero: nothing late carried over (e.g. from a supervised warm-up to RL)."""
        if self.pending:
            raise RuntimeError(f"{len(self.pending)} syncs are still pending: call wait() before reset()")
        for name, r in self.residuals.items():
            (self._host[name] if self._on_host else r).zero_()

    def state_dict(self):
        """{unit name: (n,) residual} of this rank (copies): a per-rank checkpoint, like optimizer shards."""
        return {name: r.detach().clone() for name, r in self.residuals.items()}

    def load_state_dict(self, sd):
        """Residuals back, by unit name and shape; a GradSync used without apply() takes the names it is given."""
        mine, given = set(self.residuals), set(sd)
        if (self.params or mine) and given != mine:
            raise ValueError(f"residuals for units {sorted(given)}, this model's are {sorted(mine)}: missing "
                             f"{sorted(mine - given)}, unknown {sorted(given - mine)}")
        for name, r in self.residuals.items():
            if sd[name].shape != r.shape:
                raise ValueError(f"unit {name!r}: residual of shape {tuple(sd[name].shape)}, expected {tuple(r.shape)}")
        for name, t in sd.items():
            self.residuals.setdefault(name, torch.empty_like(t, dtype=torch.float32)).copy_(t)

    def to_rollout(self):
        """Residuals to host buffers (allocated once), their device storage freed (on CPU: copied and freed too)."""
        if self.pending:
            raise RuntimeError(f"{len(self.pending)} syncs are still pending: call wait() before to_rollout()")
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
