# Copyright (c) 2026 The authors of this repository. SPDX-License-Identifier: MIT (see LICENSE).
"""The run's devices and process group: torchrun's environment, or a world of one.

--device auto takes the accelerator torch finds (CUDA, XPU, or a plugin's device such as Ascend's
NPU) where torch has a process group backend of its own for it (nccl, xccl, hccl), else the CPU with
gloo. Each process takes the device of its LOCAL_RANK; every group gets the run's timeout. On CPU,
keep_freed_memory() keeps what a phase frees for the next, as CUDA's caching allocator does.

    python -m pytest tests/test_config.py
"""
import ctypes
import datetime
import os
import platform
import sys
import types

import torch
import torch.distributed as dist


def _accelerator_api():
    """torch.accelerator (torch >= 2.6: CUDA, XPU, MPS, or a plugin's device such as Ascend's NPU),
    or, in older torch, its calls this file uses taken from torch.cuda (CUDA was the only
    accelerator): the one place this file names torch.cuda."""
    api = getattr(torch, "accelerator", None)
    if api is not None and hasattr(api, "set_device_index"):
        return api
    return types.SimpleNamespace(is_available=torch.cuda.is_available,
                                 device_count=torch.cuda.device_count,
                                 current_accelerator=lambda: torch.device("cuda"),
                                 set_device_index=torch.cuda.set_device)


def accelerator():
    """This machine's accelerator type ("cuda", "xpu", "npu", "mps", ...), or None: a CPU-only
    build, no driver or no device. Asks is_available() first: current_accelerator() names the
    build's accelerator, present or not, in torch >= 2.7 (check_available=True aside), and raises
    where there is none in 2.6."""
    api = _accelerator_api()
    return api.current_accelerator().type if api.is_available() else None


def device_type(choice):
    """The device type that --device <choice> runs on: "cpu", or this machine's accelerator where
    torch has a process group backend of its own for it (nccl, xccl, hccl: backend_for). MPS has
    only gloo, which moves CPU and CUDA tensors: auto runs on the CPU there, as does a CPU-only
    machine. Any other choice: a ValueError naming what the machine has."""
    if choice == "cpu":
        return "cpu"
    found = accelerator()
    backend = _backend_or_none(found) if found is not None else None
    usable = backend not in (None, "gloo")
    if (choice == "auto" or choice == found) and usable:
        return found
    if choice == "auto":
        return "cpu"
    if found is None:
        raise ValueError(f"--device {choice}: this machine has no accelerator "
                         "(torch.accelerator found none); use --device cpu or auto")
    if choice == found and backend is None:
        raise ValueError(f"--device {found}: torch has no process group backend for {found} "
                         "(its plugin not loaded?); use --device cpu or auto")
    if choice == found:
        raise ValueError(f"--device {found}: torch's process group backend for {found} "
                         f"is {backend}, which moves CPU and CUDA tensors only; "
                         "use --device cpu or auto")
    usable_here = f"{found}, " if usable else ""
    raise ValueError(f"--device {choice}: this machine's accelerator is {found} "
                     f"(torch.accelerator); use --device {usable_here}cpu or auto")


def device_errors(choice):
    """--device: auto and cpu always run; an accelerator's type where the machine has it."""
    if choice in ("auto", "cpu"):  # nothing to ask the machine
        return []
    try:
        device_type(choice)
    except ValueError as e:
        return [str(e)]
    return []


def backend_for(device):
    """The process group's backend for a device: torch's default for its type (torch >= 2.6,
    dist.get_default_backend_for_device: cpu gloo, cuda nccl, xpu xccl, mps gloo, a plugin's device
    what the plugin registered, e.g. npu hccl), else the table below (older torch: CUDA or CPU)."""
    if hasattr(dist, "get_default_backend_for_device"):
        return dist.get_default_backend_for_device(device)
    return {"cpu": "gloo", "cuda": "nccl"}[device.type]


def _backend_or_none(kind):
    try:
        return backend_for(torch.device(kind))
    except (ValueError, KeyError, RuntimeError):  # no backend registered for that type
        return None


def local_gpu(env, n_gpus):
    """The accelerator device of this process: LOCAL_RANK, its index on its node, as torchrun sets
    it (n_gpus: the node's devices, torch.accelerator.device_count()). A launcher that sets RANK for
    several processes but no LOCAL_RANK would put every one on device 0: refused, as is an index the
    node does not have."""
    if "LOCAL_RANK" not in env:
        if int(env.get("WORLD_SIZE", "1")) > 1:
            raise ValueError(f"RANK {env.get('RANK')} of WORLD_SIZE {env['WORLD_SIZE']} "
                             "and no LOCAL_RANK: set LOCAL_RANK to this process's index "
                             "on its node (torchrun does), or every rank takes device 0")
        return 0
    index = int(env["LOCAL_RANK"])
    if not 0 <= index < n_gpus:
        raise ValueError(f"LOCAL_RANK {index}, but this node has {n_gpus} GPUs "
                         "(accelerator devices): start at most one process per device")
    return index


def setup_distributed(cfg):
    """torchrun's environment, or a world of one. Returns rank, world size, device (device_type:
    --device auto takes the accelerator if there is one, else the CPU); on an accelerator, each
    process the device of its LOCAL_RANK."""
    kind = device_type(cfg.device)  # a ValueError: validate() refuses it first, with the others
    device = torch.device("cpu")
    if kind != "cpu":
        api = _accelerator_api()
        device = torch.device(kind, local_gpu(os.environ, api.device_count()))
        api.set_device_index(device)  # before init_process_group
    timeout = datetime.timedelta(seconds=cfg.pg_timeout_s)
    # plain `python train_grpo.py`, no RANK: a world of one, no rendezvous
    if not dist.is_initialized():
        where = {} if "RANK" in os.environ else dict(store=dist.HashStore(), rank=0, world_size=1)
        # torchrun's own store outlives a restart
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                  is_master=False, timeout=timeout)
            # the group's keys under this attempt's prefix, never a dead one's
            attempt = f"attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}"
            where = dict(store=dist.PrefixStore(attempt, agent),
                         rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
        dist.init_process_group(backend_for(device), timeout=timeout, **where)
    return dist.get_rank(), dist.get_world_size(), device


def host_group(device, timeout_s):
    """A gloo group over every rank for host tensors (the queue's), or None on CPU: the default
    group is gloo already."""
    if device.type == "cpu":
        return None
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def exit_now():
    """End a run whose work is done, and whose process group is destroyed, without the
    interpreter's teardown. There torch's C++ state can abort the process (SIGABRT, "terminate
    called without an active exception") and fail a finished run, as seen now and then with
    --shm-transport 1 on CPU ranks. Output is flushed first."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def world_size():
    """The job's world size: the process group's once it exists, else torchrun's WORLD_SIZE or 1."""
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def keep_freed_memory():
    """Make this process keep the host memory it frees for its next tensors, as CUDA's caching
    allocator keeps device memory. On CPU a tensor's memory is glibc malloc's, which decides by the
    history of block sizes whether a freed block stays with the process or goes back to the OS; when
    it goes, the next phase faults it back in 4 KiB at a time, and a switch (which frees one phase's
    memory for the other) costs that every time. Fixed thresholds decide instead: the main thread's
    blocks below 1 GiB come from its heap, trimmed only above 2 GiB free. The cost is the caching
    allocator's: resident memory stays at its peak, holes included (the first switches grow the
    heap; later ones reuse it). Process-wide: call it once, when a CPU run is built. glibc malloc
    only: returns False where it is not the allocator (musl, or jemalloc or tcmalloc preloaded) or
    refuses the setting."""
    if platform.libc_ver()[0] != "glibc":
        return False
    libc, process = ctypes.CDLL("libc.so.6"), ctypes.CDLL(None)
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None or ctypes.cast(process.malloc, ctypes.c_void_p).value != \
            ctypes.cast(libc.malloc, ctypes.c_void_p).value:  # another malloc is interposed
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    trim = bool(mallopt(m_trim_threshold, 2 ** 31 - 1))
    # older glibc: 32 MiB
    mapped = bool(mallopt(m_mmap_threshold, 1 << 30) or mallopt(m_mmap_threshold, 32 << 20))
    return trim and mapped
