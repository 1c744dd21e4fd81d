# Copyright (c) 2026 The authors of this repository. SPDX-License-Identifier: MIT (the LICENSE file).
"""The separated deployment's weight push: after each step, the trainers' new weights go to the generators,
bucket by bucket (the hybrid deployment sends its auxiliary ranks the frozen reference the same way, once).

Every trainer gathers a bucket of full weights from its FSDP2 shards (fusion.py's gather), trainer `src`
broadcasts it over a group of itself and the generators, and each generator hands it to its engine's
load_weights, as vLLM's weight update does. No rank holds more than one bucket beyond its own weights.

    python -m pytest tests/test_fusion.py -k distributed  (world 4: two trainers push to two TP generators)
"""
import torch
import torch.distributed as dist

from fusion import Broadcasts, bucket_views, plan_buckets, reshard_all, weight_meta


@torch.no_grad()
def push_weights(model, engine, src, group, bucket_bytes):
    """Separated deployment, after a step: every trainer (model given) gathers each bucket over its FSDP mesh,
    trainer `src` (a global rank) broadcasts it over `group` (src and the generators), and each generator
    (engine given) hands it to engine.load_weights. Every trainer and generator calls it. Returns bytes sent."""
    in_group = group is None or dist.get_rank(group) >= 0  # a rank outside the group holds a placeholder for it
    members = dist.get_process_group_ranks(group) if group is not None and in_group else [src]
    if in_group and src not in members:
        raise ValueError(f"push_weights: src rank {src} is not in the group's ranks {members}")
    if model is not None:
        reshard_all(model)
    box = [weight_meta(model) if model is not None else None]  # the names and full shapes, from src
    if in_group:
        dist.broadcast_object_list(box, src=src, group=group)
    device = next((model if model is not None else engine).parameters()).device
    params, sent = dict(model.named_parameters()) if model is not None else {}, 0
    for bucket in plan_buckets(box[0], bucket_bytes):
        flat, pairs = bucket_views(bucket, device)
        if model is not None:
            Broadcasts().fill(params, pairs)
        if in_group and len(members) > 1:
            dist.broadcast(flat, src=src, group=group)
            sent += flat.nbytes
        if engine is not None:
            engine.load_weights(pairs)
        del flat, pairs  # the bucket is freed before the next one is allocated
    return sent
