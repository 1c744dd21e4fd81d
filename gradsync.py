# Copyright (c) 2026 The authors of this repository. SPDX-License-Identifier: MIT (the LICENSE file).
"""Hierarchical gradient sync: shard within a node, average the shards across nodes, optionally compressed.

HSDP's layout is replicate across N nodes x shard within a node of s ranks. Each node runs FSDP2 on its own
1-D mesh: the backward reduce-scatters every unit's gradients over the node's fast links, leaving each rank
a flat shard of n values, averaged over its node. The ranks with the same local index j in every node hold
the same shard of different nodes' gradients; averaging it over them (the "cross" group, one per j) gives
each rank its shard of the gradient averaged over all N * s ranks. That cross-node step crosses the slow
links, so this file does it itself, through FSDP2's public FSDPModule.set_all_reduce_hook, and can compress
it: int8 with one fp32 scale per chunk of values (about 3.9x fewer bytes), or the top-k largest values in
int8 with their int32 indices (k = 10%: about 8x at 2 nodes), with error feedback (1-bit SGD, Seide et al.
2014; EF-SGD, Karimireddy et al. 2019; Deep Gradient Compression, Lin et al. 2018): what a step does not
send is kept per rank (the residual) and added to the next step's gradient, so nothing is lost, only late.

Contents, naive first:
  NodeLayout        validated: world, nodes; node n = ranks [n*s, (n+1)*s); cross group j = rank j of each node
  new_groups        every node group and every cross group, created by every rank in one order
  allreduce_mean    the naive sync: a full-precision all-reduce (ReduceOp.AVG) of the flat shard over the nodes
  encode, decode    one flat buffer's compressed payload (one uint8 tensor); average_payloads, the nodes' mean
  GradSync          the hooks on every FSDP unit (or sync(name, buf) on any flat buffer): residuals, overlap,
                    bytes, state, phase switches

What FSDP2 (torch 2.13) does around the hook, read in _fsdp_collectives.foreach_reduce:
  - the hook gets reduce_output, the unit's flat 1-D buffer (reduce dtype: fp32 here) of this rank's shard of
    each of the unit's parameters that has a grad, each padded on dim 0 to a multiple of s;
  - for fp32 the reduce-scatter uses ReduceOp.AVG and nothing divides after the hook; FSDP then makes the
    sharded grads as_strided views of that buffer (or adds the buffer to grads that exist: accumulation);
  - set_all_reduce_hook sets the hook of that unit's own parameter group only: GradSync.apply sets it on
    every FSDPModule in model.modules();
  - native 2-D HSDP all-reduces with ReduceOp.AVG, which gloo supports: allreduce_mean uses the same op on
    the same ranks, so compress="none" gives native HSDP's parameters bit for bit.

Departures, numbered:
1. Compressed payloads travel by all-gather, not all-reduce: int8 values cannot be summed hop by hop in a
   ring without re-quantising at every hop. A rank sends (N-1) payloads of P bytes, a dense ring all-reduce
   2(N-1)/N * 4n: compression wins while N * P < 8n, N < 8 for int8 and N < 16 for top-10% (HSDP's N is
   small: the nodes, not the GPUs).
2. Every rank decodes the N payloads and sums them in node order, then divides by N: every replica
   computes the same float operations on the same bytes, so the nodes' parameters stay bit-identical.
3. The residuals are per rank and unit, keyed by the unit's module name ("" the root): rank state, like the
   optimizer's shards, checkpointed per rank.
4. overlap=True starts each unit's collective (async_op) in its hook and returns; wait(), once per step
   before clipping and optimizer.step(), finishes them and writes the averages into the buffers the grads
   view. FSDP would add an unfinished buffer into grads that exist, so the grads must be None before the
   backward that syncs (optimizer.zero_grad(set_to_none=True)): the hook checks and raises. With one FSDP
   unit the hook fires at the end of the backward and there is nothing to overlap; with one unit per block
   block i's sync runs while the backward of the blocks before it continues.
5. A parameter with no grad in a step drops out of FSDP's buffer and would shift the residuals: the hook
   refuses a buffer of another size (set_reduce_scatter_unused_params(True) keeps such parameters, as zeros).
6. One node (N = 1): nothing to average, the hook returns at once and nothing is compressed.

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
        node_group, cross_group = new_groups(NodeLayout(world, nodes=2), rank, timeout_s=60)
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

Shapes: N nodes, s ranks per node, n values in a unit's flat shard, k values kept, C = ceil(k / chunk)
chunks, P payload bytes.
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


def new_groups(layout, rank, timeout_s, backend=None):
    """(node_group, cross_group) of this rank. Collective: every rank creates every group, in one order."""
    if not isinstance(layout, NodeLayout):
        raise TypeError(f"layout is a {type(layout).__name__}: expected a NodeLayout")
    if not dist.is_initialized() or layout.world != dist.get_world_size():
        world = dist.get_world_size() if dist.is_initialized() else "not initialized"
        raise ValueError(f"layout.world={layout.world} but the process group's world size is {world}")
    if rank != dist.get_rank():
        raise ValueError(f"rank={rank} but this process is rank {dist.get_rank()} of {layout.world}")
    if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s={timeout_s!r} must be a finite number of seconds > 0")
    timeout = datetime.timedelta(seconds=timeout_s)
    nodes = [dist.new_group(layout.node_ranks(n), timeout=timeout, backend=backend) for n in range(layout.nodes)]
    cross = [dist.new_group(layout.cross_ranks(j), timeout=timeout, backend=backend) for j in range(layout.node_size)]
    return nodes[layout.node_of(rank)], cross[rank % layout.node_size]


def allreduce_mean(buf, group, async_op=False):
    """The naive sync: buf (n,) averaged in place over the group, in full precision; native HSDP's op."""
    return dist.all_reduce(buf, op=dist.ReduceOp.AVG, group=group, async_op=async_op)


def dense_bytes(nbytes, nodes):
    """Bytes a rank sends in a ring all-reduce of nbytes over `nodes` ranks: reduce-scatter then all-gather."""
    return 2 * (nodes - 1) / nodes * nbytes


def quantize_int8(x, chunk):
    """x (n,) fp32 -> (q (n,) int8, scales (C,) fp32): symmetric, one scale per chunk, q * scale ~ x."""
    n = x.numel()
    rows = torch.nn.functional.pad(x, (0, (-n) % chunk)).view(-1, chunk)   # (C, chunk), zero-padded
    scales = rows.abs().amax(dim=1) / 127                                   # (C,)
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
    idx = g.abs().topk(n_kept(g.numel(), compress, topk)).indices              # (k,) largest |g| first
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
    """The parameters a FSDP unit reduces itself: its own, not those of the FSDP units inside it."""
    inner = {id(p) for m in unit.modules() if m is not unit and isinstance(m, FSDPModule) for p in m.parameters()}
    return [p for p in unit.parameters() if id(p) not in inner and p.requires_grad]


def shard_numel(params):
    """n of the unit's flat buffer: each parameter's dim 0 padded to a multiple of the mesh size, one shard."""
    return sum(math.ceil(p.shape[0] / p.device_mesh.size()) * math.prod(p.shape[1:]) for p in params)


class GradSync:
    """Cross-node gradient sync of a FSDP2 model sharded within nodes: apply(model), wait() each step."""
    names = ()  # a mover of a colocated trainer (fusion.FusedActor's movers): it owns no engine weights

    def __init__(self, cross_group, compress="none", topk=0.1, chunk=128, overlap=False, timer=None):
        if compress not in COMPRESS:
            raise ValueError(f"compress={compress!r}: valid values are {COMPRESS}")
        if not (isinstance(topk, (int, float)) and math.isfinite(topk) and 0 < topk <= 1):
            raise ValueError(f"topk={topk!r} must be a finite fraction in (0, 1]")
        if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
            raise ValueError(f"chunk={chunk!r} must be an int >= 1")
        self.group, self.compress, self.topk, self.chunk, self.overlap = cross_group, compress, topk, chunk, overlap
        # timer(name): a context manager around each stretch a rank is blocked on the sync ("grad_sync" in a hook,
        # "grad_sync_wait" in wait()), e.g. a run's span helper, so that a timeline shows the exposed communication
        self.timer = timer or (lambda name: contextlib.nullcontext())
        self.nodes = dist.get_world_size(cross_group)  # N
        self.params, self.residuals, self.pending, self._host = {}, {}, [], {}
        # cumulative: bytes this rank sent across nodes, and what a dense ring all-reduce of the same buffers
        # would have; seconds blocked on the sync (overlap=False: the collectives too; True: in wait()); syncs
        # started; bytes moved to host by to_rollout()
        self.stats = {"gradsync/sent_bytes": 0.0, "gradsync/dense_bytes": 0.0, "gradsync/wait_s": 0.0,
                      "gradsync/syncs": 0.0, "gradsync/offload_bytes": 0.0}

    def apply(self, model):
        """A hook on every FSDP unit of the model, keyed by its module name. Returns the model."""
        units = {name: m for name, m in model.named_modules() if isinstance(m, FSDPModule)}
        if not units:
            raise ValueError(f"{type(model).__name__} has no FSDP2 unit: fully_shard it over its node's mesh first")
        for name, unit in units.items():
            params = own_params(unit)
            if any(p.device_mesh.ndim != 1 for p in params):
                raise ValueError(f"unit {name!r} is sharded over a {params[0].device_mesh.ndim}-D mesh: native HSDP "
                                 "already syncs across nodes; fully_shard over the node's 1-D mesh instead")
            self.params[name] = params
            if self.compress != "none" and params:
                self.residuals[name] = torch.zeros(shard_numel(params), device=params[0].device)  # (n,) fp32
            unit.set_all_reduce_hook(functools.partial(self.sync, name))  # called with FSDP's flat buffer
        return model

    def sync(self, name, buf):
        """The hook's body: buf (n,) averaged over the nodes in place (overlap: started; wait() ends it).
        Called directly it syncs any flat buffer, the same `name` each step (its residual's key)."""
        if self.nodes == 1:
            return
        if name in self.params:  # a hook of apply(); called directly, any flat fp32 buffer syncs
            self._check(name, buf)
        self.stats["gradsync/dense_bytes"] += dense_bytes(buf.nbytes, self.nodes)
        self.stats["gradsync/syncs"] += 1
        with self.timer("grad_sync"):
            t0 = time.perf_counter()
            if self.compress == "none":
                work, outs = allreduce_mean(buf, self.group, async_op=self.overlap), None
                self.stats["gradsync/sent_bytes"] += dense_bytes(buf.nbytes, self.nodes)
            else:
                payload = self._encode(name, buf)                                     # (P,) uint8
                outs = [torch.empty_like(payload) for _ in range(self.nodes)]         # N x (P,)
                work = dist.all_gather(outs, payload, group=self.group, async_op=self.overlap)
                self.stats["gradsync/sent_bytes"] += (self.nodes - 1) * payload.nbytes
            self.pending.append((name, buf, work, outs))
            if not self.overlap:
                self._finish()
            self.stats["gradsync/wait_s"] += time.perf_counter() - t0

    def _check(self, name, buf):
        numel = shard_numel(self.params[name])
        if buf.numel() != numel:
            raise RuntimeError(f"unit {name!r}: FSDP's gradient buffer has {buf.numel()} values, its parameters "
                               f"{numel}: a parameter had no grad this step (unit.set_reduce_scatter_unused_params"
                               "(True) keeps the layout fixed), or a placement other than Shard(0)")
        if self.overlap and any(n == name for n, *_ in self.pending):
            raise RuntimeError(f"unit {name!r} syncs again before wait() ended its last sync: call wait() once "
                               "per backward, before clipping and optimizer.step()")
        held = [p for p in self.params[name] if p.grad is not None]
        if self.overlap and held:
            raise RuntimeError(f"unit {name!r}: overlap=True needs grads None before the backward that syncs, "
                               f"{len(held)} parameters hold one: optimizer.zero_grad(set_to_none=True)")

    def _encode(self, name, buf):
        """Error feedback: g' = buf + residual is encoded, residual = g' - what the payload decodes to."""
        if name not in self.residuals:  # a buffer synced directly: its residual starts at zero
            self.residuals[name] = torch.zeros(buf.numel(), device=buf.device)
        residual = self.residuals[name]                                           # (n,) fp32
        g = buf.float() + residual                                                # (n,) g'
        payload, sent = encode(g, self.compress, self.topk, self.chunk)
        torch.sub(g, sent, out=residual)                                          # in place: the same storage
        return payload

    def wait(self):
        """Finish every started sync (overlap=True): the averages into their buffers (the sharded grads view them)."""
        if not self.pending:
            return
        with self.timer("grad_sync_wait"):
            t0 = time.perf_counter()
            self._finish()
            self.stats["gradsync/wait_s"] += time.perf_counter() - t0

    def _finish(self):
        for name, buf, work, outs in self.pending:
            if work is not None:
                work.wait()
            if outs is not None:
                buf.copy_(average_payloads(outs, buf.numel(), self.compress, self.topk, self.chunk))
        self.pending = []

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
        """Residuals to host memory, their device storage freed (on CPU: copied and freed all the same)."""
        if self.pending:
            raise RuntimeError(f"{len(self.pending)} syncs are still pending: call wait() before to_rollout()")
        for name, r in self.residuals.items():
            self._host[name] = torch.empty(r.shape, dtype=r.dtype, pin_memory=r.is_cuda).copy_(r)
            self.stats["gradsync/offload_bytes"] += r.nbytes
            r.untyped_storage().resize_(0)

    def to_train(self):
        """Residuals back into their own storages, bit for bit."""
        for name, r in self.residuals.items():
            r.untyped_storage().resize_(r.nbytes)
            r.copy_(self._host.pop(name))
