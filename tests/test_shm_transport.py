"""shm_transport.py: the shared-memory transport against the full tensors and, through FusedActor, against
tests/test_fusion.py's single-process references (the same checks as its Broadcasts ones); its barriers,
timeouts and fallbacks; the one-node rule; keep_freed_memory.

The multi-rank checks run in one gloo spawn per world size (2, 4): each spawn costs seconds of imports."""
import os
import platform
import resource
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import fusion
from plumbing import shm_transport
from fusion import TRAIN, FusedActor, rollout
from model import Policy
from options.offload_params import ShardsOffloaded
from plumbing.shm_transport import SharedMemory
from tests.distributed import run_distributed
from tests.test_fusion import (CFG, _backward, _check_bit_identical, _check_exact_and_memory, _check_one_rank_fails,
                               _local, _reference, _tokens, _train_model)

SHM = os.path.isdir("/dev/shm")  # where SharedMemory can work (Linux)


def _connected(model):
    """SharedMemory.connect(model), which must connect here (every rank on this host, on CPU)."""
    transport = SharedMemory.connect(model, timeout_s=60.0)
    assert transport is not None
    return transport


def _params(world):
    """Uneven rows, an empty shard (b: rank 1's), a plain tensor (c, whole on every rank): the module, the full
    tensors, and its parameters by name."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    fulls = {"a": torch.randn(5, 3), "b": torch.randn(1), "c": torch.randn(4, 2)}
    module = torch.nn.Module()
    for name, t in fulls.items():
        p = distribute_tensor(t.clone(), mesh, [Shard(0)]) if name != "c" else t.clone()
        module.register_parameter(name, torch.nn.Parameter(p, requires_grad=False))
    return module, mesh, fulls, dict(module.named_parameters())


def _transport(rank, world):
    """SharedMemory against the full tensors, the shards changed in place before every gather (read from the
    peer's memory, never a stale copy). A shard replaced on one rank makes every rank raise; an error inside
    a gather on one rank makes every rank raise, and the barrier counts agree after both. A peer that does
    not come to a barrier makes it raise TimeoutError, one that closed its pipes RuntimeError at once: no
    hang. Then the fallbacks."""
    module, mesh, fulls, params = _params(world)
    transport = SharedMemory.connect(module, timeout_s=1.0)
    assert transport is not None and params["a"]._local_tensor.is_shared() and transport.keeps_shards
    for step in range(20):
        for name, p in params.items():  # new values: the same change on every rank's rows and the full copy
            (p._local_tensor if name != "c" else p).add_(1.0)
            fulls[name] += 1.0
        with transport.gathering(params):
            for name, full in fulls.items():
                out = torch.full_like(full, float("nan"))
                transport.fill(params, [(name, out)])
                assert torch.equal(out, full), (step, name)
    from torch.distributed.tensor import Shard, distribute_tensor
    kept, replaced = params["a"], distribute_tensor(fulls["a"].clone(), mesh, [Shard(0)])  # (collective)
    if rank == 1:  # a replaced parameter: its peers would read the old storage
        params["a"] = replaced
    with pytest.raises(ValueError, match="no longer the storages"):  # on every rank, not only rank 1
        with transport.gathering(params):
            pass
    params["a"] = kept
    with transport.gathering(params):  # the ranks' barrier counts still agree
        pass
    with pytest.raises(ZeroDivisionError if rank == 1 else RuntimeError, match="division" if rank else "another"):
        with transport.gathering(params):  # one rank fails inside a gather: every rank raises as it leaves
            if rank == 1:
                1 / 0
    with transport.gathering(params):  # and the counts still agree
        pass
    timed_out = False
    if rank == 0:  # rank 1 does not come to this barrier
        try:
            transport.barrier()
        except TimeoutError:
            timed_out = True
        with pytest.raises(RuntimeError, match="closed"):  # the counts no longer agree: no later gather
            with transport.gathering(params):
                pass
    dist.barrier()
    transport.close()
    gone = SharedMemory.connect(module, timeout_s=60.0)
    if rank == 1:  # as a rank that exited: its pipes closed
        gone.close()
    dist.barrier()
    if rank == 0:  # an error at once, not a wait for the timeout
        with pytest.raises(RuntimeError, match="exited"):
            gone.barrier()
    return timed_out, _fallbacks(rank, module)


def _fallbacks(rank, module):
    """connect() where one rank cannot share its shards (/dev/shm full), where one cannot map its peer's (another
    host), and where rank 0's announced file is not the one the peer opens (another PID namespace): None on
    every rank, no rank left waiting. Returns the folders made."""
    made, make, share = [], shm_transport._make_pipes_folder, shm_transport._share_shards
    from_file = torch.UntypedStorage.from_file

    def recorded(world):
        made.append(make(world))
        return made[-1]

    def no_mapping(*args, **kwargs):
        raise RuntimeError("no mapping here")

    def other_file(ps):  # rank 0 announces other inodes than the files behind /proc/<pid>/fd/<fd>
        public, shared = share(ps)
        return {n: m and dict(m, file=(m["file"][0], m["file"][1] + 1)) for n, m in public.items()}, shared

    shm_transport._make_pipes_folder = recorded
    try:
        if rank == 1:  # /dev/shm full there
            shm_transport._share_shards = lambda ps: None
        assert SharedMemory.connect(module) is None
        shm_transport._share_shards = share
        if rank == 1:  # as on another host
            torch.UntypedStorage.from_file = no_mapping
        assert SharedMemory.connect(module) is None
        torch.UntypedStorage.from_file = from_file
        if rank == 0:  # as in another PID namespace
            shm_transport._share_shards = other_file
        assert SharedMemory.connect(module) is None
    finally:
        shm_transport._share_shards, torch.UntypedStorage.from_file = share, from_file
        shm_transport._make_pipes_folder = make
    return made


def _one_node(rank, world):
    """A rank of another node never shares this one's memory. Two torchrun agents on one host (GROUP_RANK 0 and
    1, as `torchrun --nnodes 2 --nproc_per_node 1` gives them), torchrun's variables on one rank only, or
    two hostnames without torchrun: every rank declines together, before it makes or shares anything, and
    the actor gathers by broadcasts, exactly. One agent (GROUP_RANK 0 on every rank): it connects."""
    made, make, hostname = [], shm_transport._make_pipes_folder, shm_transport.socket.gethostname
    shm_transport._make_pipes_folder = lambda w: made.append(1) or make(w)
    model, opt = _train_model(world)
    try:
        for group_rank, host in ((str(rank), None), ("0" if rank == 0 else None, None), (None, f"host{rank}")):
            os.environ.pop("GROUP_RANK", None)
            os.environ.update({"GROUP_RANK": group_rank} if group_rank is not None else {})
            shm_transport.socket.gethostname = (lambda: host) if host else hostname
            assert SharedMemory.connect(model) is None and not made, (group_rank, host)
            assert not any(_local(p).is_shared() for p in model.parameters())  # nothing moved
        shm_transport.socket.gethostname = hostname
        os.environ["GROUP_RANK"] = str(rank)
        actor = FusedActor(model, opt, Policy(CFG), transport=SharedMemory.connect(model) or fusion.Broadcasts())
        assert actor.path == "in place, Broadcasts"
        with rollout(actor) as engine, torch.no_grad():
            torch.testing.assert_close(engine(_tokens(7)), _reference(model)(_tokens(7)), atol=1e-5, rtol=0)
        actor.close()
        os.environ["GROUP_RANK"] = "0"
        assert SharedMemory.connect(model) is not None and bool(made) == (rank == 0)  # rank 0 makes the pipes
    finally:
        shm_transport._make_pipes_folder, shm_transport.socket.gethostname = make, hostname
        os.environ.pop("GROUP_RANK", None)


def _through_fused_actor(rank, world):
    """FusedActor with SharedMemory: tests/test_fusion.py's checks (exactness at every TP degree, memory,
    bit-identical training over many round trips, one rank's failing load_weights), and offload_params refused:
    when the actor is built with SharedMemory, and at to_rollout for an actor built before the shards moved."""
    model, opt = _train_model(world)
    _backward(model, rank, 0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    early = ShardsOffloaded(model, opt, Policy(CFG))
    peaks = _check_exact_and_memory(rank, world, model, opt, _reference(model), connect=_connected)
    assert all(_local(p).is_shared() for p in model.parameters() if _local(p).numel())
    if world > 2:
        return peaks
    with pytest.raises(ValueError, match="which SharedMemory keeps in place"):
        ShardsOffloaded(model, opt, Policy(CFG), transport=_connected(model))
    with pytest.raises(ValueError, match="in shared memory"):  # refused before anything moves
        early.to_rollout()
    assert early.phase == TRAIN
    early.close()
    _check_one_rank_fails(rank, world, model, opt, connect=_connected)
    return _check_bit_identical(rank, world, offload_params=False, round_trips=20, connect=_connected)


def _shared_memory(rank, world):
    out = {"fused": _through_fused_actor(rank, world)}
    if world == 2:
        out["transport"] = _transport(rank, world)
        _one_node(rank, world)
    return out


@pytest.mark.skipif(not SHM, reason="no /dev/shm here: the gather broadcasts")
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_shared_memory(world):
    results = run_distributed(_shared_memory, world_size=world, timeout_s=300)
    if world == 2:
        m = results[0]["fused"]
        assert m["switch/bytes"] > 0 and m["switch/buckets"] > 1
        (timed_out, made), _ = results[0]["transport"], results[1]["transport"]
        assert timed_out
        assert len(made) == 3 and all(f.startswith("/dev/shm/") and not os.path.exists(f) for f in made)


FREE_THEN_REUSE = """
import resource, torch
from plumbing.distributed import keep_freed_memory
def cycles(stores, nbytes, k):  # a switch's pattern: free every storage, then allocate and write them again
    faults = []
    for _ in range(k):
        for s in stores:
            s.resize_(0)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for s in stores:
            s.resize_(nbytes)
            torch.empty(0, dtype=torch.uint8).set_(s).fill_(2)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return faults
n = 40 << 20  # above glibc's largest dynamic mmap threshold (32 MiB): unmapped at free by default
default = cycles([torch.ones(n, dtype=torch.uint8).untyped_storage() for _ in range(4)], n, 3)
kept = keep_freed_memory()
after = cycles([torch.ones(n, dtype=torch.uint8).untyped_storage() for _ in range(4)], n, 8)
print(min(default), kept, max(after[-3:]))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc")
def test_freed_host_memory_stays_with_the_process():
    """keep_freed_memory(): 4 storages of 40 MiB freed and allocated again, as a switch does, are the same
    memory once the heap has grown to hold them (the first cycles may grow it): no page faults. By default
    glibc unmaps them at free and every 4 KiB page faults in again."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD" and k != "GLIBC_TUNABLES"
           and not k.startswith("MALLOC_")}  # glibc's own malloc, its defaults
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    run = subprocess.run([sys.executable, "-c", FREE_THEN_REUSE], cwd=root, capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr
    default, kept, after = run.stdout.split()
    default, kept, after = int(default), kept == "True", int(after)
    pages = 4 * (40 << 20) // resource.getpagesize()
    if default < 0.9 * pages:
        pytest.skip(f"this host faults {default} pages of {pages} by default (huge pages?): nothing to compare")
    assert kept and after <= 0.02 * pages, (default, kept, after)
