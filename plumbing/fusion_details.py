# Copyright (c) 2026 The authors of this repository. SPDX-License-Identifier: MIT (see LICENSE).
"""fusion.py's details, which a learner can take on trust: guards, recovery, counts.

fusion.py teaches the switch; this file holds what it calls by name. Copy the two together (this
one at plumbing/ beside fusion.py, or change fusion.py's one import line); it imports torch and the
standard library only, never fusion.py (its example aside):
  - the checks of the caller's input, before any collective: check_model (FSDP2, Shard(0) over a
    1-D mesh, an optimizer built after fully_shard), check_owners (the weights held by the actor's
    ranks), check_engine (the engine's parameters, which the gather writes into), check_fits (a
    weight larger than a bucket), check_not_shared (a shared storage cannot be freed);
  - the phase guards: expect_phase (FusedActor._expect), guard_hooks (the engine called in TRAIN;
    optimizer.step() or a backward in ROLLOUT raise, naming the phase, where the call would read
    a freed storage and crash), BackwardCheck, and hold_grads (in ROLLOUT the grads are held off
    their parameters, p.grad is None, so that zero_grad(set_to_none=False) or clipping finds none
    to touch);
  - the recovery: undo_rollout (after a failed to_rollout(), back to TRAIN as it was);
  - the counts: timed and synchronize (switch/*_s), memory_figures and allocated_bytes (mem/*).
The options' paths are FusedActor subclasses in options/, with their own helpers: an engine at any
TP degree through its load_weights (tensor_parallel.py), pipeline stages and HSDP (owners.py), the
shards offloaded too (offload_params.py).

    python -m pytest tests/test_fusion.py   (the guards, the recovery, the bad input)

Using fusion.py elsewhere: this example, the default path on 2 gloo processes, runs in a folder
holding only the two files (tests/test_copy_alone.py runs it there):

    import datetime, os, socket
    import torch, torch.distributed as dist, torch.multiprocessing as mp
    from torch.distributed.fsdp import fully_shard
    from fusion import FusedActor, rollout

    def rank_main(rank, world, port):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        timeout = datetime.timedelta(seconds=60)
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
        torch.manual_seed(0)
        model = fully_shard(torch.nn.Linear(8, 8))  # FSDP2 over every rank
        engine = torch.nn.Linear(8, 8).requires_grad_(False)  # TP 1: the model's names and shapes
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(torch.randn(4, 8)).sum().backward()
        opt.step()  # now there is Adam state to move
        actor = FusedActor(model, opt, engine, bucket_bytes=1024)
        x = torch.randn(2, 8)
        with rollout(actor) as eng:  # Adam state on host, the engine built from the shards
            out = eng(x)
        assert torch.allclose(out, model(x), atol=1e-6)  # back in TRAIN: the model agrees
        offloaded = actor.metrics()["switch/offload_bytes"]
        print(f"rank {rank}: engine == model, {offloaded} bytes offloaded")
        dist.barrier()  # every rank done before any tears down
        dist.destroy_process_group()
        os._exit(0)  # no interpreter teardown, where gloo can abort after the work is done

    if __name__ == "__main__":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(rank_main, args=(2, port), nprocs=2)
"""
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.tensor import DTensor, Shard


# ----------------------------------------------------------------- the checks of the caller's input
def check_model(model, optimizer):
    """What FusedActor needs of this rank's model and optimizer, checked before any collective."""
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise ValueError("the model is in FSDP1 (FullyShardedDataParallel): this needs FSDP2's "
                         "fully_shard(module)")
    for n, p in model.named_parameters():
        if isinstance(p, DTensor) and (p.device_mesh.ndim, tuple(p.placements)) != (1, (Shard(0),)):
            raise ValueError(f"{n}: placements {p.placements} on a {p.device_mesh.ndim}-D mesh "
                             f"{p.device_mesh}; expected Shard(0) over a 1-D mesh (fully_shard"
                             "(module) over all ranks, or over a pipeline stage's ranks)")
    mine = {id(p) for p in model.parameters()}
    foreign = sum(id(p) not in mine for g in optimizer.param_groups for p in g["params"])
    if foreign:  # fully_shard replaces the parameters: an optimizer built before would move nothing
        raise ValueError(f"the optimizer holds {foreign} tensors that are not the model's "
                         "parameters (built before fully_shard?): build it on model.parameters() "
                         "after fully_shard")


def check_engine(meta, eng):
    """FusedActor writes the gather into the engine's parameters eng: the weights meta."""
    if not ({w.name for w in meta} == set(eng) and all(
            tuple(eng[w.name].shape) == w.shape and eng[w.name].dtype == w.dtype
            and eng[w.name].is_contiguous() for w in meta)):
        raise ValueError("FusedActor writes the gather into the engine's parameters: they need "
                         "the model's names, full shapes and dtypes (TP 1), contiguous; for "
                         "another engine, options/tensor_parallel.py's actor_class(FusedActor) "
                         "hands each bucket to its load_weights")


def check_owners(mine, ranks):
    """FusedActor's weights mine, each held by the actor's ranks (FSDP2 over them); a weight held
    otherwise (a pipeline stage's, a node's) is refused before any collective."""
    for w in mine:
        if set(w.owners) != set(ranks):
            raise ValueError(f"{w.name} is held by ranks {list(w.owners)}, not by the actor's "
                             f"ranks {ranks}: shard it with fully_shard over the actor's ranks, or "
                             "build options/owners.py's actor_class(FusedActor), which agrees the "
                             "owners (pipeline stages, HSDP)")


def check_fits(name, shape, nb, bucket_bytes):
    if nb > bucket_bytes:
        raise ValueError(f"bucket_bytes {bucket_bytes} is smaller than weight {name} {shape} "
                         f"({nb} bytes gathered); raise bucket_bytes to at least {nb}")


def check_not_shared(stores):
    if any(s.device.type == "cpu" and s.is_shared() for s in stores):  # torch crashes as one grows
        raise ValueError("offload: a storage in shared memory (a SharedMemory transport's shard) "
                         "cannot be freed")


# --------------------------------------------------------------------------------- the phase guards
def expect_phase(now, phase, what, why=None):
    """FusedActor._expect: raises where the phase now is not the phase that what needs."""
    if now != phase:
        where = f", where {why}" if why else ""
        raise RuntimeError(f"{what} in phase {now}{where}; it needs phase {phase}")


def guard_hooks(actor, train, rollout):
    """FusedActor's hooks (actor: its model, optimizer, engine and _expect; train, rollout: its
    phases) that raise where a call would read the storages freed in this phase."""
    def engine(module, args):
        actor._expect(rollout, "the engine was called", "its weights are freed")

    def step(optimizer, args, kwargs):
        why = "the optimizer states are in host memory"
        actor._expect(train, "optimizer.step() was called", why)

    def backward():
        why = "the grads are in host memory (a step forgotten before it?)"
        actor._expect(train, "a backward ran", why)

    def output(module, args, out):  # its backward, the model's first, checks the phase
        checked = torch.is_tensor(out) and out.requires_grad
        return BackwardCheck.apply(backward, out) if checked else out
    return [actor.engine.register_forward_pre_hook(engine),
            actor.optimizer.register_step_pre_hook(step),
            actor.model.register_forward_hook(output)]


class BackwardCheck(torch.autograd.Function):
    """The identity on the model's output; its backward, the model's first, calls check first."""
    @staticmethod
    def forward(ctx, check, x):
        ctx.check = check
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.check()
        return None, grad


def hold_grads(params):
    """The offloaded grads taken off their parameters until to_train: in ROLLOUT p.grad is None,
    so that zero_grad(set_to_none=False), clip_grad_norm_ or any read of a grad finds none, where
    it would touch a freed storage and crash the process."""
    held = [(p, p.grad) for p in params.values() if p.grad is not None]
    for p, _ in held:
        p.grad = None
    return held


# -------------------------------------------------------------------- recovery from a failed switch
def undo_rollout(actor, switched):
    """After a to_rollout() that raised: the movers it switched back (switched), the engine's
    weights freed, the train state reloaded (actor: a FusedActor)."""
    for m in reversed(switched):
        m.to_train()
    actor._free_engine()
    actor._reload()


# --------------------------------------------------------------------- the timing and memory counts
def synchronize(device):
    if device.type != "cpu":  # CPU work is done when its call returns
        torch.accelerator.current_stream(device).synchronize()


@contextmanager
def timed(stats, part, device):
    """stats["switch/<part>_s"] (on an accelerator, each part waits for its queued work)."""
    t0 = time.perf_counter()
    yield
    synchronize(device)
    stats[f"switch/{part}_s"] = time.perf_counter() - t0


def memory_figures(key, held, device):
    """FusedActor.record's figures for phase key: mem/<key>_<cat>_bytes for each {cat: bytes} of
    held, and mem/<key>_bytes, their total (on an accelerator, its allocator's count instead)."""
    out = {f"mem/{key}_{cat}_bytes": nb for cat, nb in held.items()}
    allocated = allocated_bytes(device)
    out[f"mem/{key}_bytes"] = sum(held.values()) if allocated is None else allocated
    return out


def allocated_bytes(device):
    """Bytes the accelerator's allocator holds (torch.cuda's count, torch.xpu's...); None on CPU, or
    where there is no such count (MPS)."""
    if device.type == "cpu":
        return None
    try:
        return getattr(torch, device.type).memory_allocated(device)
    except (AttributeError, RuntimeError):
        return None
