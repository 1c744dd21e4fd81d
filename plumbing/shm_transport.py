# Copyright (c) 2026 The authors of this repository. SPDX-License-Identifier: MIT (the LICENSE file).
"""A transport for fusion.py: the ranks of one host gather the weights by reading each other's shards from
shared memory, not through the network. Optional: fusion.py works without it, on any backend.

fusion.FusedActor builds the engine's weights from the FSDP2 shards of every rank. Its portable transport,
fusion.Broadcasts, sends each owner's rows to the others through the process group: on CPU, gloo over
loopback TCP, several times the cost of a copy per byte. When every rank is on one host and the tensors
are on CPU, SharedMemory.connect() moves each rank's shard storages into shared memory in place (torch's
own sharing, as torch.multiprocessing does it: the parameters, FSDP2 and the optimizer keep their tensors,
now backed by a shared file) and maps every peer's. A gather then copies each owner's rows straight out of
its memory: one copy per gathered byte, at memory speed. This is the CPU counterpart of what GPU systems
do with CUDA IPC handles (verl's and NeMo-RL's colocated weight refit): one transport among others, behind
fusion.py's seam (keeps_shards, gathering, fill, close; fusion.Broadcasts says what each does).

    transport = shm_transport.SharedMemory.connect(model, timeout_s=300) or fusion.Broadcasts()  # collective
    actor = fusion.FusedActor(model, optimizer, engine, inplace=True, transport=transport)  # TP 1, as build() does

No peer may change its shards while others read them: gathering() brackets a switch's gather with two
barriers, entering (every rank is done with its optimizer step) and leaving (every rank has read; each
brings its ok flag, so that an error on one rank raises on all). They go through named pipes, not the
process group: a pipe per ordered pair of ranks; each rank writes a byte into the pipe to each peer and
reads one from the pipe from each, tens of microseconds where gloo's barrier over loopback TCP takes
several hundred; a pipe's write and read order the memory writes before them.

Safety rules:
  1. File modes. Rank 0 makes the pipes in a new folder under /dev/shm, mode 0700 (mkdtemp), each pipe
     0600, and removes the folder once every rank has opened its pipes or given up. The shards' files are
     torch's own, unlinked at creation: reached only through a file descriptor their process holds open.
  2. Identity. A peer's shard is opened through /proc/<pid>/fd/<fd> and used only if that file's (device,
     inode) is the one the peer announced: a process of that pid in another PID namespace fails it. Before
     each gather, every rank checks that its shards are still the storages it shared: a parameter replaced
     since (load_state_dict(assign=True), say) would leave the peers reading stale memory, so then every
     rank raises ValueError.
  3. One node. A rank of another node is never assumed to share this one's memory. Every rank reports its
     hostname and torchrun's node index (GROUP_RANK, None without torchrun), and connect() goes on only if
     every report is the same. torchrun can run two agents on one host (--nnodes 2 --rdzv-endpoint
     127.0.0.1:PORT), each rank its own node: their ranks decline, though /proc would let them map each
     other. Without torchrun (mp.spawn, another launcher) the hostnames must agree, and rule 2 decides.
  4. Shards stay shared. A storage in shared memory must never be freed and grown back (torch crashes the
     process), so keeps_shards is True: FusedActor refuses offload_params, fusion.offload a shared storage.
  5. Fallbacks. connect() returns None on every rank together where any rank cannot connect (tensors not
     on CPU, one rank, shards not over all W ranks (pipeline stages), another node, no /dev/shm, too little
     room there, too few file descriptors, a peer's file that cannot be opened or is not the one
     announced); the caller then takes fusion.Broadcasts. A peer missing at a barrier for timeout_s raises
     TimeoutError; one that exited, RuntimeError at once.
Costs: /dev/shm holds the whole model (the shards of every rank), and each shard storage keeps a file
descriptor open, for the life of the process.

Pipeline stages (fusion.py's training layout may be stages, each FSDP2 over its own ranks or whole on one):
connect() returns None on every rank (rule 5), and fusion.Broadcasts gathers each weight from its owners.
Reading a stage's rows out of its owners' memory would need every rank's pieces shared with every rank, not
only with its mesh: not done here.

keep_freed_memory(), the other piece of CPU-host engineering a switch needs, makes the process keep the host
memory a phase frees for the next phase, as CUDA's caching allocator keeps device memory.

Run: python -m pytest tests/test_shm_transport.py   (exact gathers, barriers, every fallback, one node)
     python bench/fusion.py --switch-only          (a switch through shared memory against broadcasts)

Using this file elsewhere: torch and the standard library; Linux (/dev/shm, /proc, named pipes); glibc's
malloc for keep_freed_memory. The model: FSDP2 as fusion.py wants it (Shard(0) over a 1-D mesh), on CPU.
Shapes: W ranks in the shards' group, c = ceil(rows / W) rows per shard.
"""
import ctypes
import math
import os
import platform
import resource
import select
import shutil
import socket
import tempfile
import time
from contextlib import contextmanager, suppress

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor


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


class SharedMemory:
    """fusion.py's transport for the ranks of one host on CPU: each reads its peers' FSDP2 shards from shared
    memory. Built by SharedMemory.connect(model)."""
    keeps_shards = True  # rule 4: a shared storage is never freed (FusedActor refuses offload_params)

    def __init__(self, group, peer_rows, shared, readers, writers, timeout_s):
        self.rank, self.world, self.timeout_s = dist.get_rank(group), dist.get_world_size(group), timeout_s
        self.peer_rows = peer_rows  # {name: {peer rank: its rows (<= c, ...) mapped from its memory, or None}}
        self.shared = shared        # {name: (storage, offset)}: this rank's shards as it shared them (held)
        self.readers, self.writers = readers, writers  # the pipes from and to the W-1 peers (file descriptors)

    @classmethod
    def connect(cls, model, timeout_s=300.0):
        """A SharedMemory for the FSDP2 shards among model's parameters, or None where it cannot work (rule 5),
        or where they are not over all W ranks (pipeline stages: fusion.Broadcasts gathers from the owners).
        Collective over the shards' group, and every rank gets the same answer, whichever rank fails where.
        Where it fails after the ranks began sharing, their shards stay in shared memory."""
        for m in model.modules():  # the shards, not the full weights FSDP2 leaves after a no-grad forward
            if isinstance(m, FSDPModule):
                m.reshard()
        params = dict(model.named_parameters())
        shard = next((p for p in params.values() if isinstance(p, DTensor)), None)
        group = shard.device_mesh.get_group() if shard is not None else None
        if group is None or dist.get_world_size(group) < 2 or any(p.device.type != "cpu" for p in params.values()):
            return None
        if dist.get_world_size(group) != dist.get_world_size():  # pipeline stages: the same answer on every rank
            return None
        if not _one_node(group):  # rule 3, before anything is made
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
        and to its peers into (connect() closes them unless a transport is returned)."""
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

    @contextmanager
    def gathering(self, params, layout=None, group=None):
        """Around a switch's gather of params ({name: parameter}): enter when every rank has come, its shards
        still the storages it shared (else ValueError on every rank); leave when every rank has read, where
        one raised inside, with a RuntimeError on every other. layout, group: fusion's, not needed (connect() made
        sure that every rank holds every weight: Shard(0) over all W ranks, or whole)."""
        moved = self._moved(params)
        if not self.barrier(ok=not moved):
            raise ValueError(f"the shards {moved[:4] or '(of another rank)'} are no longer the storages "
                             "SharedMemory.connect() shared (a parameter was replaced, e.g. by "
                             "load_state_dict(assign=True)): the peers would read stale memory; close() the "
                             "FusedActor and build a new one, with a new transport, after replacing parameters")
        try:
            yield
        except BaseException:
            with suppress(Exception):  # the peers learn of it; where this barrier fails too, the first error stands
                self.barrier(ok=False)
            raise
        if not self.barrier(ok=True):
            raise RuntimeError("another rank failed in this switch (its error is in its output); back in TRAIN")

    def fill(self, params, outs, layout=None, group=None):
        """Fill each (name, full-size destination (rows, ...)) with the full weight of params[name]: each owner's
        rows of its FSDP2 shard (Shard(0), c = ceil(rows / W) rows each, as fusion.gather_into lays them)
        copied from its memory, this rank's from its own; a plain tensor copied. Inside gathering(). Returns
        the bytes read from the peers' memory (layout, group: as in gathering())."""
        received = 0
        for name, out in outs:
            p = params[name]
            if not isinstance(p, DTensor):
                out.copy_(p.detach())
                continue
            if name not in self.peer_rows:
                raise KeyError(f"{name}: not among the parameters SharedMemory.connect() shared")
            c = -(-out.shape[0] // self.world)
            for owner in range(self.world):
                rows = p._local_tensor if owner == self.rank else self.peer_rows[name][owner]   # (<= c, ...)
                if rows is not None and rows.numel():
                    out[owner * c:owner * c + rows.shape[0]].copy_(rows)
                    received += rows.nbytes if owner != self.rank else 0
        return received

    def _moved(self, params):
        """Names of this rank's shards that are no longer the storages it shared."""
        moved = []
        for name, (storage, offset) in self.shared.items():
            p = params.get(name)
            local = p._local_tensor if isinstance(p, DTensor) else p
            if local is None or local.untyped_storage().data_ptr() != storage.data_ptr() or \
                    local.storage_offset() != offset:  # the storage is held: its address is not reused
                moved.append(name)
        return sorted(moved)

    def barrier(self, ok=True):
        """Return when every rank of the group has called barrier() as often as this one: True if every rank
        passed ok=True. A byte into the pipe to each peer, then one out of the pipe from each. A failed
        barrier closes the transport (the ranks' counts no longer agree): later calls raise."""
        if not self.readers:
            raise RuntimeError("SharedMemory is closed (close() was called, or a barrier failed)")
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
                    raise TimeoutError(f"SharedMemory: a peer did not reach the barrier within {self.timeout_s} s")
                for fd, _ in ready:
                    byte = os.read(fd, 1)
                    if not byte:
                        raise RuntimeError("SharedMemory: a peer closed its pipe (exited)")
                    all_ok = all_ok and byte == b"\1"
                    waiting.discard(fd)
            return all_ok
        except BrokenPipeError:
            self.close()
            raise RuntimeError("SharedMemory: a peer closed its pipe (exited)") from None
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


def _one_node(group):
    """Whether every rank of group is on this node (rule 3): the same hostname and torchrun's GROUP_RANK
    (None without torchrun) everywhere. Collective; the same answer on every rank."""
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (socket.gethostname(), os.environ.get("GROUP_RANK")), group=group)
    return all(node == everyone[0] for node in everyone)


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
    nbytes = sum(-(-p.shape[0] // world) * world * math.prod(p.shape[1:]) * p.element_size() for p in shards)
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
    (the very file the peer holds open, checked by its identity: rule 2), or None where any cannot be opened."""
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
