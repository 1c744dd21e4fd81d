# Copyright (c) 2026 The authors of this repository. SPDX-License-Identifier: MIT (see LICENSE).
"""A transport for fusion.py: the ranks of one host gather the weights by reading each other's
shards from shared memory (optional, --shm-transport 1: fusion.py works without it).

Shapes: W ranks in the shards' group, c = ceil(rows / W) rows per shard.

fusion.py's portable transport, fusion.Broadcasts, sends each owner's rows of the FSDP2 shards
through the process group: on CPU, gloo over loopback TCP, several times the cost of a copy. On one
host, SharedMemory.connect() moves each rank's shard storages into shared memory in place (torch's
own sharing: the parameters, FSDP2 and the optimizer keep their tensors) and maps every peer's: a
gather copies each owner's rows out of its memory, as GPU systems do with CUDA IPC handles:

    transport = shm_transport.SharedMemory.connect(model, timeout_s=300) or fusion.Broadcasts()
    actor = fusion.FusedActor(model, optimizer, engine, transport=transport)

No peer may change its shards while others read them: gathering() brackets a gather with two
barriers, entering and leaving, where each rank brings an ok flag so that an error on one raises on
all. A barrier is a byte through a named pipe per ordered pair of ranks (tens of microseconds,
gloo's several hundred); a pipe's write and read order the memory writes before them.

Safety rules:
  1. File modes. The pipes live in a new folder under /dev/shm (0700, each pipe 0600), removed once
     every rank has opened them. The shards' files are torch's own, unlinked at creation.
  2. Identity. A peer's shard, opened through /proc/<pid>/fd/<fd>, is used only if its (device,
     inode) is the one announced. Each gather checks that the shards are still the ones shared.
  3. One node. connect() goes on only if every rank reports the same hostname and torchrun node
     index (GROUP_RANK): two torchrun agents on one host decline, though /proc would let them map.
  4. Shards stay shared (one freed and grown back crashes torch): offload_params is refused.
  5. Fallbacks. connect() returns None on every rank together where any rank cannot connect (not
     on CPU, one rank, pipeline stages, another node, no room in /dev/shm or for file descriptors, a
     peer's file not the one announced): the caller takes fusion.Broadcasts. A peer missing at a
     barrier for timeout_s raises TimeoutError; one that exited, RuntimeError at once.
Costs: /dev/shm holds every FSDP2 shard (all but EP's experts), one file descriptor per storage.

    python -m pytest tests/test_shm_transport.py
    python bench/fusion.py --switch-only  # a switch through shared memory against broadcasts

Using this file elsewhere: torch and the standard library; Linux (/dev/shm, /proc, named pipes);
FSDP2 on CPU as fusion.py wants it (Shard(0), 1-D mesh).
"""
import math
import os
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


class SharedMemory:
    """fusion.py's transport for the ranks of one host on CPU: each reads its peers' FSDP2 shards
    from shared memory. The contract is fusion.Broadcasts's (its docstring says what each member
    must do): keeps_shards, gathering(), fill(), close(). Built by SharedMemory.connect(model)."""
    # rule 4: a shared storage is never freed (options/offload_params.py refuses this transport)
    keeps_shards = True

    def __init__(self, group, peer_rows, shared, readers, writers, timeout_s):
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.timeout_s = timeout_s
        # {name: {peer rank: its rows (<= c, ...) mapped from its memory, or None}}
        self.peer_rows = peer_rows
        # {name: (storage, offset)}: this rank's shards as it shared them (held)
        self.shared = shared
        # the pipes from and to the W-1 peers (file descriptors)
        self.readers, self.writers = readers, writers

    @classmethod
    def connect(cls, model, timeout_s=300.0):
        """A SharedMemory for the FSDP2 shards among model's parameters, or None where it cannot
        work (rule 5), or where they are not over all W ranks (pipeline stages: fusion.Broadcasts
        gathers from the owners). Collective over the shards' group, and every rank gets the same
        answer, whichever rank fails where. Where it fails after the ranks began sharing, their
        shards stay in shared memory."""
        # the shards, not the full weights FSDP2 leaves after a no-grad forward
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()
        params = dict(model.named_parameters())
        shard = next((p for p in params.values() if isinstance(p, DTensor)), None)
        group = shard.device_mesh.get_group() if shard is not None else None
        on_cpu = all(p.device.type == "cpu" for p in params.values())
        if group is None or dist.get_world_size(group) < 2 or not on_cpu:
            return None
        # pipeline stages: the same answer on every rank
        if dist.get_world_size(group) != dist.get_world_size():
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
                # every rank has opened or given up: the names go
                shutil.rmtree(made, ignore_errors=True)
            if exchange is None:
                _close_all(pipes[0] + pipes[1])
        return exchange

    @classmethod
    def _connect(cls, group, params, folder, pipes, timeout_s):
        """connect() once rank 0 has made the pipes' folder. pipes: two lists to open this rank's
        pipes from and to its peers into (connect() closes them unless a transport is returned)."""
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        readers, writers, peers = pipes[0], pipes[1], [q for q in range(world) if q != rank]
        with suppress(OSError):  # a rank that cannot open them: another host's /dev/shm
            for q in peers:
                path = os.path.join(folder, f"{q}to{rank}")
                readers.append(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
        if not _all_ranks(len(readers) == world - 1 and _room_for(params, world), group):
            return None
        # (what a peer needs to map them, {name: (storage, offset)}), or None
        mine = _share_shards(params)
        everyone = [None] * world
        dist.all_gather_object(everyone, (os.getpid(), mine and mine[0]), group=group)
        peer_rows = _map_peers(everyone, rank)
        if not _all_ranks(peer_rows is not None, group):
            return None
        with suppress(OSError):  # every pipe has its reader: the peers can open them
            for q in peers:
                path = os.path.join(folder, f"{rank}to{q}")
                writers.append(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        if not _all_ranks(len(writers) == world - 1, group):
            return None
        return cls(group, peer_rows, mine[1], readers, writers, timeout_s)

    @contextmanager
    def gathering(self, params, layout=None, group=None):
        """Around a switch's gather of params ({name: parameter}): enter when every rank has come,
        its shards still the storages it shared (else ValueError on every rank); leave when every
        rank has read, where one raised inside, with a RuntimeError on every other. layout, group:
        fusion's, not needed (connect() made sure that every rank holds every weight: Shard(0) over
        all W ranks, or whole)."""
        moved = self._moved(params)
        if not self.barrier(ok=not moved):
            raise ValueError(f"the shards {moved[:4] or '(of another rank)'} "
                             "are no longer the storages SharedMemory.connect() shared "
                             "(a parameter was replaced, e.g. by load_state_dict(assign=True)): "
                             "the peers would read stale memory; close() the FusedActor "
                             "and build a new one, with a new transport, "
                             "after replacing parameters")
        try:
            yield
        except BaseException:
            # the peers learn of it; where this barrier fails too, the first error stands
            with suppress(Exception):
                self.barrier(ok=False)
            raise
        if not self.barrier(ok=True):
            raise RuntimeError("another rank failed in this switch (its error is in its output); "
                               "back in TRAIN")

    def fill(self, params, outs, layout=None, group=None):
        """Fill each (name, full-size destination (rows, ...)) with the full weight of params[name]:
        each owner's rows of its FSDP2 shard (Shard(0), c = ceil(rows / W) rows each, as
        fusion.gather_into lays them) copied from its memory, this rank's from its own; a plain
        tensor copied. Inside gathering(). Returns the bytes read from the peers' memory (layout,
        group: as in gathering())."""
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
                # (<= c, ...) the owner's rows
                rows = p._local_tensor if owner == self.rank else self.peer_rows[name][owner]
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
            # the storage is held: its address is not reused
            if local is None or local.untyped_storage().data_ptr() != storage.data_ptr() or \
                    local.storage_offset() != offset:
                moved.append(name)
        return sorted(moved)

    def barrier(self, ok=True):
        """Return when every rank of the group has called barrier() as often as this one: True if
        every rank passed ok=True. A byte into the pipe to each peer, then one out of the pipe from
        each. A failed barrier closes the transport (the ranks' counts no longer agree), so that
        later calls raise."""
        if not self.readers:
            raise RuntimeError("SharedMemory is closed (close() was called, or a barrier failed)")
        deadline, all_ok, waiting = time.monotonic() + self.timeout_s, bool(ok), set(self.readers)
        try:
            for fd in self.writers:
                os.write(fd, bytes([all_ok]))
            # one byte from each peer's pipe: a fast peer's next byte waits there for the next call
            while waiting:
                poller = select.poll()  # poll, not select: file descriptors above 1024 are fine
                for fd in waiting:
                    poller.register(fd, select.POLLIN)
                ready = poller.poll(max(0.0, deadline - time.monotonic()) * 1000)
                if not ready:
                    raise TimeoutError("SharedMemory: a peer did not reach the barrier "
                                       f"within {self.timeout_s} s")
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
        """Close this rank's pipes and unmap the peers' shards (its own stay shared)."""
        _close_all(self.readers + self.writers)
        self.readers, self.writers, self.peer_rows = [], [], {}

    def __del__(self):
        self.close()


def _close_all(fds):
    for fd in fds:
        os.close(fd)


def _one_node(group):
    """Whether every rank of group is on this node (rule 3): the same hostname and torchrun's
    GROUP_RANK (None without torchrun) everywhere. Collective; the same answer on every rank."""
    everyone = [None] * dist.get_world_size(group)
    mine = (socket.gethostname(), os.environ.get("GROUP_RANK"))
    dist.all_gather_object(everyone, mine, group=group)
    return all(node == everyone[0] for node in everyone)


def _make_pipes_folder(world):
    """A new folder in /dev/shm, readable by this user only, holding a named pipe per ordered pair
    of ranks ("0to1": from rank 0 to rank 1). Its path, or None if it could not be made."""
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
    """Whether /dev/shm can take every rank's FSDP2 shards of params (the whole model, padded to W
    shards) and this process has a file descriptor to spare for each of its own."""
    shards = [p for p in params.values() if isinstance(p, DTensor)]
    nbytes = sum(-(-p.shape[0] // world) * world * math.prod(p.shape[1:]) * p.element_size()
                 for p in shards)
    shm = os.statvfs("/dev/shm")
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = len(os.listdir("/proc/self/fd")) + len(shards) + 64
    spare = soft == resource.RLIM_INFINITY or needed <= soft
    return shm.f_bavail * shm.f_frsize >= nbytes and spare


def _share_shards(params):
    """Move this rank's non-empty FSDP2 shards into shared memory, in place. Returns (what a peer
    needs to map them: {name: dict, or None for an empty shard}, {name: (storage, offset)}), or None
    if /dev/shm ran out of room (torch reserves the bytes before it copies, and refuses cleanly)."""
    public, shared = {}, {}
    try:
        for name, p in params.items():
            local = p._local_tensor if isinstance(p, DTensor) else None  # (<= c, ...) my rows
            if local is None:
                continue
            if not local.numel():  # nothing to read: a peer skips it
                public[name] = None
                continue
            storage = local.untyped_storage()
            # every tensor on this storage now views a shared file
            fd, nbytes = storage._share_fd_cpu_()
            file = os.fstat(fd)
            public[name] = {"fd": fd, "file": (file.st_dev, file.st_ino), "nbytes": nbytes,
                            "dtype": local.dtype, "offset": local.storage_offset(),
                            "shape": tuple(local.shape), "stride": local.stride()}
            shared[name] = (storage, local.storage_offset())
    except RuntimeError:
        return None
    return public, shared


def _map_peers(everyone, rank):
    """{name: {peer rank: its rows, or None}} mapped from every peer's shared shards through
    /proc/<pid>/fd/<fd> (the very file the peer holds open, checked by its identity: rule 2), or
    None where any cannot be opened."""
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
                storage = files[owner, m["fd"]]
                rows[name][owner] = view.set_(storage, m["offset"], m["shape"], m["stride"])
    except (OSError, RuntimeError):
        return None
    return rows


def _all_ranks(ok, group):
    """True on every rank when ok is true on every rank of group (one MIN all-reduce)."""
    flag = torch.tensor([int(bool(ok))])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
