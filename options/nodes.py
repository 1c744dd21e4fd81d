"""--nodes N: FSDP2 within each of N nodes, the gradients averaged across nodes (HSDP's layout) by
options/gradsync.py, in full precision or compressed with error feedback.

    torchrun --standalone --nproc_per_node=2 train_grpo.py --nodes 2 --grad-compress topk-int8

Applied where the run is built: the training mesh becomes this rank's node, a hook on each FSDP2
unit averages its reduce-scattered shard across the nodes, the clip waits for those averages first,
and the sync is a mover of the phase switch (its error-feedback residual goes to host with the Adam
state). --fsdp-units block gives each transformer block a unit of its own, so that --grad-overlap 1
can start a block's sync while the blocks before it compute their backward.

    python -m pytest tests/test_gradsync.py tests/test_train_grpo.py -k nodes
"""
import functools

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from options import gradsync, owners


def errors(cfg, world):
    """--nodes and the cross-node gradient sync, checked before any process group."""
    out = []
    if cfg.nodes < 1 or world % cfg.nodes:
        out.append(f"--nodes {cfg.nodes} must divide the world size {world} "
                   "(nodes of world / nodes ranks)")
    unsupported = {"--deploy separated": cfg.deploy == "separated",
                   f"--train-pp {cfg.train_pp}": cfg.train_pp > 1,
                   f"--train-ep {cfg.train_ep}": cfg.train_ep not in (0, "auto")}
    for what, bad in unsupported.items():
        if bad:  # the experts' own gradient sync (moe_switch.py) does not go through gradsync.py
            out.append(f"--nodes {cfg.nodes} with {what} is not supported (colocated, FSDP2 within "
                       "each node, without PP and without EP)")
    return out


def apply(run):
    """The ranks as nodes of world / nodes (gradsync.py's groups); the gradient sync across them and
    the clip that waits for it. Returns this rank's node's mesh, for FSDP2."""
    cfg = run.cfg
    layout = gradsync.NodeLayout(run.roles.world, cfg.nodes)
    node_group, cross_group = gradsync.new_groups(layout, cfg.pg_timeout_s)
    run.grad_sync = gradsync.GradSync(cross_group, cfg.grad_compress, cfg.grad_topk,
                                      overlap=cfg.grad_overlap, timer=run.spans)
    run.clip_grads = functools.partial(synced_clip, run.grad_sync, run.clip_grads)
    run.actor_class = owners.actor_class(run.actor_class)  # each node's replica: owners agreed
    return DeviceMesh.from_group(node_group, run.device.type)


def synced_clip(sync, clip, model, max_norm):
    """The update's clip under --nodes: the cross-node averages land first (what is still in flight:
    every one with --grad-overlap), then the norm (clip: the run's own; None: clip_grad_norm_)."""
    sync.wait()
    if clip is not None:
        return clip(model, max_norm)
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def shard_blocks(model, mesh, ignored):
    """--fsdp-units block: an FSDP2 unit per transformer block (the caller shards the rest as one
    more): a gather and a reduce-scatter per block, each block's gather issued while the one before
    computes (forward prefetch; backward prefetch is FSDP2's default), each block's reduce-scatter
    (and cross-node sync) as soon as its backward is done: overlap where a device has streams to
    spare."""
    blocks = [fully_shard(b, mesh=mesh, ignored_params=ignored, reshard_after_forward=False)
              for b in model.blocks.children()]
    for block, after in zip(blocks, blocks[1:]):
        block.set_modules_to_forward_prefetch([after])
