# Copyright (c) 2026 The authors of this repository. SPDX-License-Identifier: MIT (the LICENSE file).
"""RL Fusion: the actor's training and its rollout share every device, one phase at a time.

The colocated deployment, with layout switching and zero-redundancy memory switching:
  TRAIN    the training layout: FSDP2 parameter shards over all W ranks, their grads and optimizer states.
  ROLLOUT  the inference layout, TP degree t and W/t data-parallel replicas: each rank holds its TP piece
           of every weight, built from the training shards, plus the engine's KV cache. The optimizer
           states and grads are offloaded to host memory, leaving the device to the inference state.
to_rollout() offloads, then builds the inference weights bucket by bucket: all-gather a bucket of shards,
hand (name, full tensor) pairs to the engine's load_weights (vLLM's shape), free the bucket. No rank ever
holds more than its final inference weights plus one bucket.
to_train() frees them and brings the rest back.
Other state that changes layout between the phases (moe_switch.py's experts) rides along as a "mover":
any object with to_rollout() and to_train(), called inside the same switch.

Contents, primitives first:
  Layout             validated layout: world size, TP degree (rest data-parallel), FSDP or not; new_groups()
  offload / reload   copy storages to host buffers and free them on the device / re-allocate and copy back
  keep_freed_memory  on CPU: the memory a switch frees stays with the process, as CUDA's caching allocator
  gather_full_naive  every full weight at once: the baseline, a whole extra model on every rank
  plan_buckets       (name, full shape, dtype) grouped into buckets of at most B gathered bytes
  gather_into        one weight's FSDP2 shards into a full-size destination: own rows copied, W broadcasts
  gather_bucket      gather_into for a bucket of weights, into one flat buffer; (name, full view) pairs
  HostExchange       ranks on one host (CPU): each reads its peers' shards from shared memory, not broadcasts
  push_weights       separated deployment: trainers gather a bucket, trainer `src` broadcasts it to generators
  FusedActor         the two phases: to_rollout(), to_train(), metrics(), state_dict(), close(); `with rollout(...)`
  HostOffloaded      a frozen module (the reference model) kept on host except inside `with ref.on_device()`

Departures from the source system (Huawei's RL post-training on CloudMatrix 384):
  1. Training is FSDP (ZeRO-3) over all ranks, inference is TP; the EP change lives in moe_switch.py, and
     pipeline parallelism is left out.
  2. The engine cuts its TP piece itself inside load_weights, as vLLM's weight loaders do: fusion hands it
     full weights that are views into the gathered bucket. Every rank gathers every weight: under FSDP
     its shards sit on all ranks anyway. When the engine's weights are the full weights (TP 1) and this
     module manages their storage, the gather writes straight into them instead (`inplace`): no
     load_weights copy and no bucket buffer.
  3. Across hosts (and on CUDA, over nccl) the gather is W in-place broadcasts per weight, each owner's
     c rows straight into their place in the destination. One all-gather per weight (this file's first
     version) moves the same bytes, but gloo's all-gather runs well below its broadcast's bandwidth on
     CPU (bench/RESULTS.md). When every rank is on one host and the tensors are on CPU, the shards live
     in shared memory and each rank copies its peers' rows straight out of it (HostExchange): one copy
     per byte at memory speed, where loopback TCP costs several times a copy per byte. The GPU
     counterpart, peer reads through CUDA IPC handles between the processes of one node, is left out.
  4. The training parameter shards stay on the device during ROLLOUT by default: they are 1/W of the
     model and needed first thing back in TRAIN. `offload_params=True` offloads them too.
  5. The engine's weight storages are freed in TRAIN (resized to 0) and re-allocated bucket by bucket;
     an engine with its own sleep mode (vLLM) takes manage_engine=False. The KV cache is the engine's
     (allocated per call by this repository's sampler) and is not in mem/rollout_bytes.
  6. Memory is the module's own count of the storages it manages (shards, grads, optimizer states,
     engine weights, buckets); on CUDA, mem/{train,rollout}_bytes are torch.cuda.memory_allocated.

Run: python -m pytest tests/test_fusion.py   (exactness W 1/2/4 x t 1/2/4, bit-identical training, memory)

Using this file elsewhere: torch >= 2.6 (FSDP2's fully_shard; FSDP1 is refused, naming the fix), gloo
on CPU or nccl on CUDA. The model: FSDP2 over a 1-D mesh of all ranks (or plain); its optimizer built
on model.parameters(). The engine: an nn.Module whose load_weights(pairs of (model name, full
tensor)) loads them into its own parameters (cutting its TP piece, fusing q/k/v, renaming) and
returns the names of its own parameters it loaded, as vLLM's loaders do. On CPU, call keep_freed_memory()
once per process, or glibc may hand each switch's freed memory back to the OS. Example, a vLLM-shaped engine
with a fused qkv on 2 gloo processes (tests/test_copy_alone.py runs it in a folder holding only this file):

    import datetime, os, socket
    import torch, torch.distributed as dist, torch.multiprocessing as mp
    from torch.distributed.fsdp import fully_shard
    from fusion import FusedActor, Layout, rollout

    class Trained(torch.nn.Module):  # the trained model: separate q, k, v
        def __init__(self, d=8):
            super().__init__()
            self.q, self.k, self.v = (torch.nn.Linear(d, d, bias=False) for _ in range(3))

        def forward(self, x):
            return self.q(x) + self.k(x) * self.v(x)

    class Engine(torch.nn.Module):  # the rollout engine, vLLM-shaped: one fused qkv weight
        def __init__(self, d=8):
            super().__init__()
            self.qkv = torch.nn.Linear(d, 3 * d, bias=False)

        def forward(self, x):
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            return q + k * v

        @torch.no_grad()
        def load_weights(self, weights):  # maps the model's names onto its own, returns what it loaded
            for name, w in weights:
                i = "qkv".index(name[0])
                self.qkv.weight[i * w.shape[0]:(i + 1) * w.shape[0]] = w
            return {"qkv.weight"}

    def rank_main(rank, world, port):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
        torch.manual_seed(0)
        model, engine = fully_shard(Trained()), Engine().requires_grad_(False)  # FSDP2 over every rank
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(torch.randn(4, 8)).sum().backward()
        opt.step()  # now there is Adam state to move
        actor = FusedActor(model, opt, engine, Layout(world, fsdp=True), Layout(world), bucket_bytes=1024)
        x = torch.randn(2, 8)
        with rollout(actor) as eng:  # Adam state on host, the engine's weights built from the shards
            out = eng(x)
        assert torch.allclose(out, model(x), atol=1e-6)  # back in TRAIN: the model computes the same
        print(f"rank {rank}: engine == model, {actor.metrics()['switch/offload_bytes']} bytes offloaded")
        dist.barrier()  # every rank done before any tears down
        dist.destroy_process_group()

    if __name__ == "__main__":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(rank_main, args=(2, port), nprocs=2)

Shapes: W world size, t TP degree, W/t DP replicas, B bucket bytes, c = ceil(rows / W) rows per shard.
"""
import ctypes
import datetime
import os
import platform
import resource
import select
import shutil
import tempfile
import time
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.tensor import DTensor, Shard

TRAIN, ROLLOUT = "TRAIN", "ROLLOUT"


# ----------------------------------------------------------------------------- layouts
@dataclass(frozen=True)
class Layout:
    """How W ranks split. Rank grid arange(W).view(W // tp, tp): a TP group is tp adjacent ranks, a DP
    group takes one rank of each. The training layout is Layout(W, fsdp=True): FSDP over all ranks."""
    world_size: int     # W
    tp: int = 1         # t, the tensor-parallel degree: 1, 2 or 4
    fsdp: bool = False  # parameters, grads and optimizer states sharded over all W ranks (training)
    n_heads: int = 0    # attention heads, which t must divide (0: not checked)

    def __post_init__(self):
        errors = []
        if self.world_size < 1:
            errors.append("the world size must be >= 1")
        if self.tp not in (1, 2, 4):
            errors.append(f"TP degree {self.tp} must be 1, 2 or 4")
        elif self.world_size % self.tp:
            errors.append(f"TP degree {self.tp} does not divide the world size {self.world_size}")
        if self.n_heads and self.n_heads % self.tp:
            errors.append(f"TP degree {self.tp} does not divide n_heads {self.n_heads}")
        if self.fsdp and self.tp != 1:
            errors.append(f"an FSDP layout here has TP degree 1, not {self.tp}")
        if errors:
            raise ValueError(f"bad layout (world size {self.world_size}, tp {self.tp}, n_heads {self.n_heads}, "
                             f"fsdp {self.fsdp}): " + "; ".join(errors))

    @property
    def dp(self):
        return self.world_size // self.tp  # data-parallel replicas

    def dp_rank(self, rank):
        return rank // self.tp  # the replica: the TP ranks of one replica must be given the same prompts

    def tp_group_ranks(self, rank):
        return list(range(rank - rank % self.tp, rank - rank % self.tp + self.tp))

    def dp_group_ranks(self, rank):
        return list(range(rank % self.tp, self.world_size, self.tp))

    def new_groups(self, timeout_s=300.0):
        """(TP group, DP group) of this rank, None for a group of one rank. Collective: every rank calls it."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world != self.world_size:
            raise ValueError(f"layout world size {self.world_size} != process group size {world}")
        if world == 1:
            return None, None
        rank, timeout, mine = dist.get_rank(), datetime.timedelta(seconds=timeout_s), [None, None]
        for kind, ranks_of in enumerate((self.tp_group_ranks, self.dp_group_ranks)):
            for ranks in sorted({tuple(ranks_of(r)) for r in range(world)}):
                if len(ranks) > 1:  # every rank creates every group, in the same order
                    g = dist.new_group(list(ranks), timeout=timeout)
                    if rank in ranks:
                        mine[kind] = g
        return tuple(mine)


# ----------------------------------------------------------------------------- host offload
def _local(t):
    return t._local_tensor if isinstance(t, DTensor) else t


def storages(tensors, device=None):
    """The distinct allocated storages behind tensors (a DTensor: its local shard), on `device` if given."""
    seen = {}
    for t in tensors:
        s = _local(t).untyped_storage()
        if s.nbytes() and (device is None or s.device == device):
            seen.setdefault(s.data_ptr(), s)
    return list(seen.values())


def held_bytes(tensors, device=None):
    """The module's memory accounting: bytes of the distinct storages still allocated behind tensors."""
    return sum(s.nbytes() for s in storages(tensors, device))


def _as_bytes(s):
    return torch.empty(0, dtype=torch.uint8, device=s.device).set_(s)  # (nbytes,) uint8 view of a storage


def offload(stores, hosts=()):
    """Copy each device storage into a host buffer, then free it in place (resize to 0): every tensor that
    views it stays a valid object and gets its bytes back from reload(). Host buffers are reused when the
    sizes match; on CUDA they are pinned and the copy is non-blocking (the free is stream-ordered after it)."""
    out = []
    for i, s in enumerate(stores):
        cuda = s.device.type == "cuda"
        h = hosts[i] if i < len(hosts) and hosts[i].numel() == s.nbytes() else \
            torch.empty(s.nbytes(), dtype=torch.uint8, pin_memory=cuda)
        h.copy_(_as_bytes(s), non_blocking=cuda)
        s.resize_(0)
        out.append(h)
    return out


def reload(stores, hosts):
    """Re-allocate each freed storage and copy its bytes back from its host buffer."""
    for s, h in zip(stores, hosts):
        s.resize_(h.numel())
        _as_bytes(s).copy_(h, non_blocking=s.device.type == "cuda")


def keep_freed_memory():
    """Make this process keep the host memory it frees for its next tensors, as CUDA's caching allocator keeps
    device memory. On CPU a tensor's memory is glibc malloc's, which decides by the history of block sizes
    whether a freed block stays with the process or goes back to the OS; when it goes, the next phase
    faults it back in 4 KiB at a time, and a switch (which frees one phase's memory for the other) costs
    that every time. Fixed thresholds decide instead: the main thread's blocks below 1 GiB come from its
    heap, trimmed only above 2 GiB free. The cost is the caching allocator's: resident memory stays at its
    peak, holes included (the first switches grow the heap; later ones reuse it). Process-wide: call it
    once, when a CPU run is built. glibc malloc only: returns False where it is not the allocator (musl,
    or jemalloc or tcmalloc preloaded) or refuses the setting."""
    if platform.libc_ver()[0] != "glibc":
        return False
    libc, process = ctypes.CDLL("libc.so.6"), ctypes.CDLL(None)
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None or ctypes.cast(process.malloc, ctypes.c_void_p).value != \
            ctypes.cast(libc.malloc, ctypes.c_void_p).value:  # another malloc is interposed
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    trim = bool(mallopt(m_trim_threshold, 2 ** 31 - 1))
    mapped = bool(mallopt(m_mmap_threshold, 1 << 30) or mallopt(m_mmap_threshold, 32 << 20))  # older glibc: 32 MiB
    return trim and mapped


# ----------------------------------------------------------------------------- building the weights
def reshard_all(module):
    """FSDP2 leaves a module unsharded after a no-grad forward (the root, always): its parameters are then
    plain full tensors. Reshard every FSDP module so that named_parameters() are the DTensor shards."""
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def weight_meta(module):
    """[(name, full shape, dtype)] of a module's parameters: a DTensor knows its global shape, so every
    rank computes the same list without communication."""
    return [(n, tuple(p.shape), p.dtype) for n, p in module.named_parameters()]


def _numel(shape):
    return int(torch.Size(shape).numel())


def gather_full_naive(params):
    """Every full weight at once, [(name, tensor)]: the baseline, where each rank briefly holds a whole
    extra copy of the model. The redundancy the bucketed switch removes."""
    return [(n, p.full_tensor() if isinstance(p, DTensor) else p.detach().clone()) for n, p in params.items()]


def plan_buckets(meta, bucket_bytes):
    """Consecutive weights of one dtype, grouped so that each bucket's gathered bytes <= B.
    Pure: every rank makes the same plan. Raises, before any collective, if one weight alone exceeds B."""
    buckets, size = [], 0
    for name, shape, dtype in meta:
        nb = _numel(shape) * dtype.itemsize
        if nb > bucket_bytes:
            raise ValueError(f"bucket_bytes {bucket_bytes} is smaller than weight {name} {shape} "
                             f"({nb} bytes gathered); raise bucket_bytes to at least {nb}")
        if not buckets or size + nb > bucket_bytes or dtype != buckets[-1][0][2]:
            buckets.append([])
            size = 0
        buckets[-1].append((name, shape, dtype))
        size += nb
    return buckets


def bucket_views(bucket, device):
    """One flat buffer for a bucket and, per weight, its full view (rows, ...) into it."""
    numel = sum(_numel(s) for _, s, _ in bucket)
    flat = torch.empty(numel, dtype=bucket[0][2], device=device)
    views, off = [], 0
    for name, shape, _ in bucket:
        views.append((name, flat[off:off + _numel(shape)].view(shape)))
        off += _numel(shape)
    return flat, views


def gather_into(p, out, works=None):
    """Fill out (rows, ...), a contiguous full-size tensor, with the full weight of p, FSDP2 shards (Shard(0)
    on a 1-D mesh of W ranks, c = ceil(rows / W) rows each, the last ones shorter or empty) or a plain
    tensor. Each rank copies its own rows into place, then W in-place broadcasts, one per owner, fill the
    rest: no staging buffer, and every byte lands where it will be read. works: a list to append the
    broadcasts to, issued asynchronously (the caller waits on them); None: wait here."""
    if not isinstance(p, DTensor):
        out.copy_(p.detach())
        return
    mesh, local = p.device_mesh, p._local_tensor                          # (<= c, ...) this rank's rows
    w, rows = mesh.size(), out.shape[0]
    r, c = mesh.get_local_rank(), -(-rows // w)
    out[r * c:r * c + local.shape[0]].copy_(local)
    if w > 1:
        g = mesh.get_group()
        for src in range(w):
            piece = out[src * c:min((src + 1) * c, rows)]                # (<= c, ...) owner src's rows
            if piece.numel():
                work = dist.broadcast(piece, src=dist.get_global_rank(g, src), group=g, async_op=True)
                work.wait() if works is None else works.append(work)


def gather_bucket(params, bucket, device):
    """All-gather one bucket of weights into one flat buffer. Returns (flat buffer, [(name, full weight)]),
    the weights being views into the buffer: what an engine's load_weights takes."""
    flat, views = bucket_views(bucket, device)
    for name, full in views:
        gather_into(params[name], full)
    return flat, views


class HostExchange:
    """Ranks on one host gather by reading each other's shards from shared memory, not through the network.
    connect() moves each rank's FSDP2 shard storages into shared memory in place (torch's own sharing, as
    torch.multiprocessing does it: the parameters, FSDP2 and the optimizer keep their tensors, now backed
    by a shared file) and maps every peer's. gather_into() then fills a full weight from each owner's rows
    straight out of its memory: one copy per gathered byte at memory speed, where gather_into's broadcasts
    move the same bytes through the loopback network stack (gloo on CPU, several times slower per byte),
    and a staging buffer that each rank writes its rows into would copy every byte one and a half times.
    The CPU counterpart of the CUDA IPC handles through which the GPUs of one node read each other's memory.
    No peer may change its shards while others read them: reading() brackets a gather with two barriers,
    entering (every rank is done with its optimizer step) and leaving (every rank has read). They go
    through named pipes, not the process group: a pipe per ordered pair of ranks; each rank writes a byte
    into the pipe to each peer and reads one from the pipe from each, tens of microseconds where gloo's
    barrier over loopback TCP takes several hundred; a pipe's write and read order the memory writes
    before them. The entering byte also says whether the rank's shards are still the storages it shared:
    a parameter replaced since (e.g. by load_state_dict(assign=True)) would leave its peers reading stale
    memory, so then every rank raises. A peer missing for timeout_s raises TimeoutError, one that exited
    RuntimeError.
    Costs: /dev/shm holds the whole model (the shards of every rank), and each shard storage keeps a file
    descriptor open. The shards stay in shared memory for the life of the process, where a storage must
    never be resized again: torch crashes the process when one grows back. FusedActor therefore refuses
    offload_params on such a model. Built by HostExchange.connect()."""

    def __init__(self, group, peer_rows, shared, readers, writers, timeout_s):
        self.rank, self.world, self.timeout_s = dist.get_rank(group), dist.get_world_size(group), timeout_s
        self.peer_rows = peer_rows  # {name: {peer rank: its rows (<= c, ...) mapped from its memory, or None}}
        self.shared = shared        # {name: (storage, offset)}: this rank's shards as it shared them (held)
        self.readers, self.writers = readers, writers  # the pipes from and to the W-1 peers (file descriptors)

    @classmethod
    def connect(cls, group, params, timeout_s=300.0):
        """A HostExchange for the FSDP2 shards among params ({name: parameter}) over group, or None where it
        cannot work: tensors not on CPU, one rank, too little room in /dev/shm or too few file descriptors,
        or ranks that cannot open what the others shared (other hosts, other PID namespaces). Collective over
        group, and every rank gets the same answer, whichever rank fails where. Where it fails after the
        ranks began sharing, their shards stay in shared memory."""
        if group is None or dist.get_world_size(group) < 2 or any(p.device.type != "cpu" for p in params.values()):
            return None
        made = _make_pipes_folder(dist.get_world_size(group)) if dist.get_rank(group) == 0 else None
        box, pipes, exchange = [made], ([], []), None
        try:
            dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
            if box[0] is not None:
                exchange = cls._connect(group, params, box[0], pipes, timeout_s)
        finally:
            if made is not None:
                shutil.rmtree(made, ignore_errors=True)  # every rank has opened or given up: the names go
            if exchange is None:
                _close_all(pipes[0] + pipes[1])
        return exchange

    @classmethod
    def _connect(cls, group, params, folder, pipes, timeout_s):
        """connect() once rank 0 has made the pipes' folder. pipes: two lists to open this rank's pipes from
        and to its peers into (connect() closes them unless an exchange is returned)."""
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        readers, writers, peers = pipes[0], pipes[1], [q for q in range(world) if q != rank]
        with suppress(OSError):  # a rank that cannot open them: another host's /dev/shm
            for q in peers:
                readers.append(os.open(os.path.join(folder, f"{q}to{rank}"), os.O_RDONLY | os.O_NONBLOCK))
        if not _all_ranks(len(readers) == world - 1 and _room_for(params, world), group):
            return None
        mine = _share_shards(params)  # (what a peer needs to map them, {name: (storage, offset)}), or None
        everyone = [None] * world
        dist.all_gather_object(everyone, (os.getpid(), mine and mine[0]), group=group)
        peer_rows = _map_peers(everyone, rank)
        if not _all_ranks(peer_rows is not None, group):
            return None
        with suppress(OSError):  # every pipe has its reader: the peers can open them
            for q in peers:
                writers.append(os.open(os.path.join(folder, f"{rank}to{q}"), os.O_WRONLY | os.O_NONBLOCK))
        if not _all_ranks(len(writers) == world - 1, group):
            return None
        return cls(group, peer_rows, mine[1], readers, writers, timeout_s)

    def gather_into(self, name, p, out):
        """Fill out (rows, ...), a contiguous full-size tensor, with the full weight of p: each owner's rows
        of its FSDP2 shard (Shard(0), c = ceil(rows / W) rows each, as the module's gather_into lays them)
        copied from its memory, this rank's from its own; a plain tensor copied. Inside reading()."""
        if not isinstance(p, DTensor):
            out.copy_(p.detach())
            return
        if name not in self.peer_rows:
            raise KeyError(f"{name}: not among the parameters HostExchange.connect() shared")
        c = -(-out.shape[0] // self.world)
        for owner in range(self.world):
            rows = p._local_tensor if owner == self.rank else self.peer_rows[name][owner]   # (<= c, ...)
            if rows is not None and rows.numel():
                out[owner * c:owner * c + rows.shape[0]].copy_(rows)

    @contextmanager
    def reading(self, params):
        """Around a gather of params ({name: parameter}): enter when every rank has come, its shards still the
        storages it shared (else ValueError on every rank); leave when every rank has read."""
        moved = self._moved(params)
        if not self.barrier(ok=not moved):
            raise ValueError(f"the shards {moved[:4] or '(of another rank)'} are no longer the storages "
                             "HostExchange.connect() shared (a parameter was replaced, e.g. by "
                             "load_state_dict(assign=True)): the peers would read stale memory; close() the "
                             "FusedActor and build a new one after replacing parameters")
        try:
            yield
        finally:
            if self.readers:  # not after a failed barrier: its error stands
                self.barrier()

    def _moved(self, params):
        """Names of this rank's shards that are no longer the storages it shared."""
        moved = []
        for name, (storage, offset) in self.shared.items():
            local = _local(params[name]) if name in params else None
            if local is None or local.untyped_storage().data_ptr() != storage.data_ptr() or \
                    local.storage_offset() != offset:  # the storage is held: its address is not reused
                moved.append(name)
        return sorted(moved)

    def barrier(self, ok=True):
        """Return when every rank of the group has called barrier() as often as this one: True if every rank
        passed ok=True. A byte into the pipe to each peer, then one out of the pipe from each. A failed
        barrier closes the exchange (the ranks' counts no longer agree): later calls raise."""
        if not self.readers:
            raise RuntimeError("HostExchange is closed (close() was called, or a barrier failed)")
        deadline, all_ok, waiting = time.monotonic() + self.timeout_s, bool(ok), set(self.readers)
        try:
            for fd in self.writers:
                os.write(fd, bytes([all_ok]))
            while waiting:  # one byte from each peer's pipe: a fast peer's next byte waits there for the next call
                poller = select.poll()  # poll, not select: file descriptors above 1024 are fine
                for fd in waiting:
                    poller.register(fd, select.POLLIN)
                ready = poller.poll(max(0.0, deadline - time.monotonic()) * 1000)
                if not ready:
                    raise TimeoutError(f"HostExchange: a peer did not reach the barrier within {self.timeout_s} s")
                for fd, _ in ready:
                    byte = os.read(fd, 1)
                    if not byte:
                        raise RuntimeError("HostExchange: a peer closed its pipe (exited)")
                    all_ok = all_ok and byte == b"\1"
                    waiting.discard(fd)
            return all_ok
        except BrokenPipeError:
            self.close()
            raise RuntimeError("HostExchange: a peer closed its pipe (exited)") from None
        except BaseException:
            self.close()
            raise

    def close(self):
        """Close this rank's pipes and drop its mappings of the peers' shards (its own stay shared)."""
        _close_all(self.readers + self.writers)
        self.readers, self.writers, self.peer_rows = [], [], {}

    def __del__(self):
        self.close()


def _close_all(fds):
    for fd in fds:
        os.close(fd)


def _make_pipes_folder(world):
    """A new folder in /dev/shm, readable by this user only, holding a named pipe per ordered pair of ranks
    ("0to1": from rank 0 to rank 1). Its path, or None if it could not be made."""
    try:
        folder = tempfile.mkdtemp(prefix="fusion_exchange_", dir="/dev/shm")  # mode 0700
    except OSError:  # no /dev/shm (not Linux)
        return None
    try:
        for src in range(world):
            for dst in (r for r in range(world) if r != src):
                os.mkfifo(os.path.join(folder, f"{src}to{dst}"), 0o600)
        return folder
    except OSError:
        shutil.rmtree(folder, ignore_errors=True)
        return None


def _room_for(params, world):
    """Whether /dev/shm can take every rank's FSDP2 shards of params (the whole model, padded to W shards) and
    this process has a file descriptor to spare for each of its own."""
    shards = [p for p in params.values() if isinstance(p, DTensor)]
    nbytes = sum(-(-p.shape[0] // world) * world * _numel(p.shape[1:]) * p.element_size() for p in shards)
    shm = os.statvfs("/dev/shm")
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    spare = soft == resource.RLIM_INFINITY or len(os.listdir("/proc/self/fd")) + len(shards) + 64 <= soft
    return shm.f_bavail * shm.f_frsize >= nbytes and spare


def _share_shards(params):
    """Move this rank's non-empty FSDP2 shards into shared memory, in place. Returns (what a peer needs to map
    them: {name: dict, or None for an empty shard}, {name: (storage, offset)}), or None if /dev/shm ran out
    of room (torch reserves the bytes before it copies, and refuses cleanly)."""
    public, shared = {}, {}
    try:
        for name, p in params.items():
            local = p._local_tensor if isinstance(p, DTensor) else None                  # (<= c, ...) my rows
            if local is None:
                continue
            if not local.numel():  # nothing to read: a peer skips it
                public[name] = None
                continue
            storage = local.untyped_storage()
            fd, nbytes = storage._share_fd_cpu_()  # every tensor on this storage now views a shared file
            file = os.fstat(fd)
            public[name] = {"fd": fd, "file": (file.st_dev, file.st_ino), "nbytes": nbytes, "dtype": local.dtype,
                            "offset": local.storage_offset(), "shape": tuple(local.shape), "stride": local.stride()}
            shared[name] = (storage, local.storage_offset())
    except RuntimeError:
        return None
    return public, shared


def _map_peers(everyone, rank):
    """{name: {peer rank: its rows, or None}} mapped from every peer's shared shards through /proc/<pid>/fd/<fd>
    (the very file the peer holds open, checked by its identity), or None where any cannot be opened."""
    publics = [public for _, public in everyone]
    if None in publics or any(set(public) != set(publics[0]) for public in publics):
        return None  # a rank without room in /dev/shm, or ranks that disagree on the shards
    rows, files = {name: {} for name in publics[rank]}, {}
    try:
        for owner, (pid, public) in enumerate(everyone):
            if owner == rank:
                continue
            for name, m in public.items():
                if m is None:
                    rows[name][owner] = None
                    continue
                if (owner, m["fd"]) not in files:
                    path = f"/proc/{pid}/fd/{m['fd']}"
                    file = os.stat(path)
                    if (file.st_dev, file.st_ino) != m["file"]:
                        return None  # another process's file: the peer is in another PID namespace
                    files[owner, m["fd"]] = torch.UntypedStorage.from_file(path, True, m["nbytes"])
                view = torch.empty(0, dtype=m["dtype"])
                rows[name][owner] = view.set_(files[owner, m["fd"]], m["offset"], m["shape"], m["stride"])
    except (OSError, RuntimeError):
        return None
    return rows


def _all_ranks(ok, group):
    """True on every rank when ok is true on every rank of group (one MIN all-reduce)."""
    flag = torch.tensor([int(bool(ok))])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


@torch.no_grad()
def push_weights(model, engine, src, group, bucket_bytes, meta=None, device=None):
    """Separated deployment: ship the trainers' weights to the generators, bucket by bucket, after a step.
    Every trainer (model given) all-gathers each bucket over its FSDP mesh; trainer `src` (a global rank)
    broadcasts it over `group` (src and every generator); a generator (engine given) receives it into a
    bucket buffer and hands the views to engine.load_weights, which cuts its TP piece. Every trainer and
    generator calls this. meta: weight_meta(model) (src sends it when None). Returns the bytes broadcast."""
    members = dist.get_process_group_ranks(group) if group is not None else [src]
    if src not in members:
        raise ValueError(f"push_weights: src rank {src} is not in the group's ranks {members}")
    in_group = dist.get_rank() in members
    if model is not None:
        reshard_all(model)
    if meta is None:
        box = [weight_meta(model) if model is not None else None]
        if in_group:
            dist.broadcast_object_list(box, src=src, group=group)
        meta = box[0]
    owner = model if model is not None else engine
    device = device or next(owner.parameters()).device
    params, sent = dict(model.named_parameters()) if model is not None else {}, 0
    for bucket in plan_buckets(meta, bucket_bytes):
        if model is not None:
            flat, pairs = gather_bucket(params, bucket, device)
        else:
            flat, pairs = bucket_views(bucket, device)
        if in_group and len(members) > 1:
            dist.broadcast(flat, src=src, group=group)
            sent += flat.nbytes
        if engine is not None:
            engine.load_weights(pairs)
        del flat, pairs  # the bucket is freed before the next one is allocated
    return sent


# ----------------------------------------------------------------------------- the two phases
def _check_model(model, train_layout, infer_layout):
    """Everything FusedActor needs of the model and layouts, checked before any collective."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if not train_layout.fsdp or infer_layout.fsdp or train_layout.world_size != infer_layout.world_size:
        raise ValueError(f"train layout {train_layout} must be FSDP and inference layout {infer_layout} "
                         "not, over the same world size")
    if world != train_layout.world_size:
        raise ValueError(f"layout world size {train_layout.world_size} != process group size {world}")
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise ValueError("the model is wrapped in FSDP1 (FullyShardedDataParallel), whose flat parameters cannot "
                         "be gathered by name: this needs FSDP2, torch.distributed.fsdp.fully_shard(module)")
    for n, p in model.named_parameters():
        if isinstance(p, DTensor) and (p.device_mesh.ndim != 1 or p.device_mesh.size() != world
                                       or tuple(p.placements) != (Shard(0),)):
            raise ValueError(f"{n}: placements {p.placements} on mesh {p.device_mesh}; expected Shard(0) "
                             f"over a 1-D mesh of all {world} ranks (fully_shard(module) with the default mesh)")


class FusedActor:
    """The actor in two phases on the same devices. model: FSDP2-sharded (fully_shard over a 1-D mesh of
    all W ranks) or plain; optimizer: built on model.parameters(); engine: a module with
    load_weights(iterable of (name, tensor)) -> the engine parameter names it loaded (vLLM's shape; the
    names are the model's, each tensor the full weight: the engine cuts its TP piece and maps names to
    its own parameters, e.g. q, k, v into a fused qkv; the tensors are valid during the call only, so
    it copies what it keeps). Starts in TRAIN: the engine's weight storages
    are freed here (manage_engine=True, the default; an engine with its own sleep mode, vLLM's, takes
    manage_engine=False), and using the engine outside ROLLOUT raises. inplace=True (engines whose
    parameters are the model's, same names and full shapes, TP 1): the gather writes straight into the
    engine's weights and load_weights is never called. skip: names of weights that someone else moves
    between the phases (moe_switch.py's experts): not built, freed, offloaded (offload_params) or
    counted as inference weights here; their grads and optimizer states are still offloaded. movers:
    objects with to_rollout() and to_train() (and optionally a `stats` dict for metrics()), called at
    the end of to_rollout() and at the start of to_train(), in reverse order: one switch moves all.
    host_exchange=True: where every rank is on this host and the model on CPU, the ranks read each other's
    shards from shared memory (HostExchange: it moves the shards there when the actor is built), else the
    gather broadcasts; offload_params and naive always broadcast. timeout_s: how long the exchange waits
    for a peer before raising (the broadcasts wait as long as the group allows)."""

    def __init__(self, model, optimizer, engine, train_layout, infer_layout, bucket_bytes=1 << 20,
                 offload_params=False, naive=False, manage_engine=True, inplace=False, skip=(), movers=(),
                 host_exchange=True, timeout_s=300.0):
        _check_model(model, train_layout, infer_layout)
        self.model, self.optimizer, self.engine = model, optimizer, engine
        self.train_layout, self.infer_layout, self.bucket_bytes = train_layout, infer_layout, bucket_bytes
        self.offload_params, self.naive, self.manage_engine = offload_params, naive, manage_engine
        self.device, self.skip, self.movers = next(model.parameters()).device, set(skip), list(movers)
        reshard_all(model)
        meta = [m for m in weight_meta(model) if m[0] not in self.skip]
        self.buckets = plan_buckets(meta, bucket_bytes)
        eng = self._engine_weights()
        same = {n for n, *_ in meta} == set(eng) and all(
            tuple(eng[n].shape) == shape and eng[n].dtype == dtype and eng[n].is_contiguous()
            for n, shape, dtype in meta)
        if inplace and not (manage_engine and same and not naive):
            raise ValueError("inplace=True needs manage_engine=True, naive=False and engine parameters with the "
                             "model's names, full shapes and dtypes (TP 1); use inplace=False (load_weights)")
        self.inplace = inplace
        self._check_offloadable()
        shareable = host_exchange and not naive and not offload_params and self.buckets
        self.exchange = self._exchange(model, timeout_s) if shareable else None
        self.phase, self.round_trips, self._hosts, self._param_hosts = TRAIN, 0, [], []
        self._off, self._param_off, self.stats, self._hook = [], [], {}, None
        if manage_engine:
            for s in storages(eng.values()):
                s.resize_(0)
            self._hook = engine.register_forward_pre_hook(self._check_engine_use)
        self.record()

    def _check_offloadable(self):
        """offload_params frees the shards' storages and grows them back; one that a HostExchange moved into shared
        memory would crash the process as it grows: refuse, before anything moves."""
        if not self.offload_params:
            return
        shared = [n for n, p in self.model.named_parameters()
                  if n not in self.skip and _local(p).untyped_storage().is_shared()]
        if shared:
            raise ValueError(f"offload_params=True, but the shards {shared[:4]} are in shared memory for good (an "
                             "actor built with host_exchange=True on this model put them there): build this one "
                             "with offload_params=False")

    def _exchange(self, model, timeout_s):
        """A HostExchange of the gathered weights' shards when every rank of the FSDP mesh is on this host
        (CPU), else None: the gather then broadcasts. Collective."""
        group = next((p.device_mesh.get_group() for p in model.parameters() if isinstance(p, DTensor)), None)
        params = {n: p for n, p in model.named_parameters() if n not in self.skip}
        return HostExchange.connect(group, params, timeout_s)

    def _check_engine_use(self, module, args):
        if self.phase != ROLLOUT:
            raise RuntimeError("the engine was called in TRAIN, where its weights are freed (manage_engine=True): "
                               "use it between to_rollout() and to_train(), or inside `with fusion.rollout(actor)`")

    # -- accounting
    def resident(self):
        """Device-resident bytes by category, from the storages this module manages."""
        ps = list(self.model.parameters())
        optim = [v for st in self.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
        return {"params": held_bytes(ps, self.device),
                "grads": held_bytes([p.grad for p in ps if p.grad is not None], self.device),
                "optim": held_bytes(optim, self.device),
                "infer": held_bytes(self._engine_weights().values(), self.device)}

    def _engine_weights(self):
        return {n: p for n, p in self.engine.named_parameters() if n not in self.skip}

    def resident_bytes(self):
        return sum(self.resident().values())

    def record(self):
        """Take the memory figures of the current phase (again, if the caller has since moved weights of
        its own, e.g. the experts)."""
        key, held = self.phase.lower(), self.resident()
        for cat, nb in held.items():
            self.stats[f"mem/{key}_{cat}_bytes"] = nb
        self.stats[f"mem/{key}_bytes"] = torch.cuda.memory_allocated(self.device) \
            if self.device.type == "cuda" else sum(held.values())

    def metrics(self):
        """Flat dict for metrics.jsonl: mem/*, time/to_rollout_s, time/to_train_s, switch/*, the movers' stats."""
        out = dict(self.stats, **{"switch/round_trips": self.round_trips, "switch/bucket_bytes": self.bucket_bytes,
                                  "switch/buckets": len(self.buckets),
                                  "switch/host_exchange": self.exchange is not None})
        for m in self.movers:
            out.update(getattr(m, "stats", {}))
        return out

    def _expect(self, phase, call):
        if self.phase != phase:
            raise RuntimeError(f"{call}() called in phase {self.phase}; it needs phase {phase}")

    def _train_only(self):
        """Grads and optimizer states on the device, in a fixed order (so host buffers are reused)."""
        ps = list(self.model.parameters())
        opt = [v for p in ps for _, v in sorted(self.optimizer.state.get(p, {}).items()) if torch.is_tensor(v)]
        return storages([p.grad for p in ps if p.grad is not None] + opt, self.device)

    # -- the switches
    @torch.no_grad()
    def to_rollout(self):
        """TRAIN -> ROLLOUT: offload grads and optimizer states, build the inference weights bucket by bucket.
        Returns the engine."""
        self._expect(TRAIN, "to_rollout")
        self._check_offloadable()
        t0 = time.perf_counter()
        reshard_all(self.model)
        # 1. the train-only state to host
        with self._timed("offload"):
            self._off = self._train_only()
            self.stats["switch/offload_bytes"] = sum(s.nbytes() for s in self._off)
            self._hosts = offload(self._off, self._hosts)
        # 2. the inference weights: gather a bucket, (re-)allocate its engine weights, load, free the bucket
        params, eng = dict(self.model.named_parameters()), self._engine_weights()
        try:
            extra, gathered = self._build(params, eng)
        except BaseException:  # back to TRAIN as it was: no engine weights, the train-only state on the device
            if self.manage_engine:
                for s in storages(eng.values()):
                    s.resize_(0)
            reload(self._off, self._hosts)
            self._off = []
            raise
        self.stats["switch/peak_extra_bytes"] = extra  # over the weights built
        # 3. the training shards too, if asked (they are 1/W of the model and needed first thing back)
        if self.offload_params:
            self._param_off = storages([p for n, p in self.model.named_parameters() if n not in self.skip],
                                       self.device)
            self._param_hosts = offload(self._param_off, self._param_hosts)
        # 4. whatever else changes layout (the experts' EP re-shard)
        for m in self.movers:
            m.to_rollout()
        self._finish(ROLLOUT, t0)
        self.stats["switch/gather_bytes"] = gathered
        self.stats["switch/bytes"] = 2 * self.stats["switch/offload_bytes"] + gathered  # moved per round trip
        return self.engine

    def _build(self, params, eng):
        """The inference weights, bucket by bucket. Returns (most bytes held beyond them, bytes gathered)."""
        if self.manage_engine:  # the engine's final weights: allocated once, then filled bucket by bucket
            with self._timed("alloc"):
                for p in eng.values():
                    p.untyped_storage().resize_(p.nbytes)
        with self._timed("gather"), self._reading(params):
            return self._fill(params, eng)

    def _reading(self, params):
        """On one host, the span in which the ranks read each other's shards; elsewhere nothing."""
        return self.exchange.reading(params) if self.exchange is not None else nullcontext()

    def _fill(self, params, eng):
        """Gather every bucket and load it into the engine. Returns (the largest bucket held beyond the engine's
        weights, bytes gathered)."""
        extra, gathered, loaded = 0, 0, set()
        for bucket in [sum(self.buckets, [])] if self.naive else self.buckets:
            if self.inplace:  # the engine's weights are the model's, by name and full shape: gathered into them
                self._gather_into(params, [(name, eng[name].detach()) for name, *_ in bucket])
                gathered += sum(eng[n].nbytes for n, *_ in bucket)
                loaded |= {name for name, *_ in bucket}
                continue
            pairs, held = self._gather(params, bucket)
            extra, gathered = max(extra, held), gathered + sum(t.nbytes for _, t in pairs)
            names = self.engine.load_weights(pairs)
            if names is None and set(n for n, _ in pairs) - set(eng):
                raise ValueError("the engine's parameter names are not the model's, and its load_weights returned "
                                 "nothing: return the engine parameter names it loaded (as vLLM's loaders do)")
            loaded |= set(names if names is not None else (n for n, _ in pairs))
            pairs = None  # free the bucket before the next one
        missing = sorted(set(eng) - loaded)
        if missing:  # re-allocated (or, with its own sleep mode, last version's) and never filled: refuse
            raise ValueError(f"the engine's weights {missing[:8]} were not loaded: its load_weights must load every "
                             f"engine parameter (or name it in skip=) and return the names it loaded")
        return extra, gathered

    def _gather(self, params, bucket):
        """One bucket's [(name, full weight)] and the bytes it holds beyond the resident ones."""
        if self.naive:
            pairs = gather_full_naive({n: p for n, p in params.items() if n not in self.skip})
            return pairs, sum(t.nbytes for _, t in pairs)
        flat, pairs = bucket_views(bucket, self.device)
        self._gather_into(params, pairs)
        return pairs, flat.nbytes

    def _gather_into(self, params, outs):
        """Fill each (name, full-size destination) with its full weight: read from the peers' shards on one host,
        else by broadcasts."""
        works = []
        for name, out in outs:
            if self.exchange is not None:
                self.exchange.gather_into(name, params[name], out)
            else:
                gather_into(params[name], out, works)
        for work in works:
            work.wait()

    @torch.no_grad()
    def to_train(self):
        """ROLLOUT -> TRAIN: free the inference weights, bring the training state back."""
        self._expect(ROLLOUT, "to_train")
        t0 = time.perf_counter()
        for m in reversed(self.movers):
            m.to_train()
        with self._timed("free"):
            if self.manage_engine:
                for s in storages(self._engine_weights().values()):
                    s.resize_(0)
        with self._timed("reload"):
            reload(self._param_off, self._param_hosts)
            reload(self._off, self._hosts)
        self._off, self._param_off = [], []
        self.round_trips += 1
        self._finish(TRAIN, t0)  # frees first, then re-allocates: never above its start or end bytes

    @contextmanager
    def _timed(self, part):
        """switch/<part>_s: a part of the switch (offload, alloc, gather; free, reload), for the benchmark's
        breakdown. On CUDA the device's queued work is waited for, so that each part owns its time."""
        t0 = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.stats[f"switch/{part}_s"] = time.perf_counter() - t0

    def _finish(self, phase, t0):
        if self.device.type == "cuda":  # non-blocking copies must land before the time is taken
            torch.cuda.current_stream(self.device).synchronize()
        self.phase = phase
        key = "to_rollout" if phase == ROLLOUT else "to_train"
        self.stats[f"time/{key}_s"] = time.perf_counter() - t0
        self.record()

    def close(self):
        """Unhook the engine and close the host exchange, so that another FusedActor can drive the same engine
        (after parameters were replaced, say). In TRAIN."""
        self._expect(TRAIN, "close")
        if self._hook is not None:
            self._hook.remove()
        if self.exchange is not None:
            self.exchange.close()

    # -- resume
    def state_dict(self):
        """The phase and counters. Save the model and optimizer themselves in TRAIN: in ROLLOUT their grads
        and optimizer states live in this module's host buffers, their device storages freed."""
        return {"phase": self.phase, "round_trips": self.round_trips}

    def load_state_dict(self, state):
        """Restore the counters and, if the saved phase differs, switch to it (collective)."""
        if state["phase"] != self.phase:
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
    """Fully colocated: a frozen module (the reference model) whose parameters and buffers live in host
    memory, and on the device only inside `with ref.on_device() as module:`. Starts offloaded.
    offload=False keeps it on the device: the same interface, nothing moves."""

    def __init__(self, module, offload=True):
        self.module, self.enabled, self._stores, self._hosts, self.on_host = module, offload, [], [], False
        self.offload()

    def offload(self):
        if self.enabled and not self.on_host:
            ts = list(self.module.parameters()) + list(self.module.buffers())
            self._stores = storages(ts, next(iter(ts)).device)
            self._hosts, self.on_host = offload(self._stores, self._hosts), True

    def load(self):
        if self.on_host:
            reload(self._stores, self._hosts)
            self.on_host = False

    def resident_bytes(self):
        return held_bytes(list(self.module.parameters()) + list(self.module.buffers()))

    @contextmanager
    def on_device(self):
        self.load()
        try:
            yield self.module
        finally:
            self.offload()
