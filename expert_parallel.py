# Copyright (c) 2026 The authors of this repository. SPDX-License-Identifier: MIT (the LICENSE file).
"""A whole model's MoE layers made expert-parallel, with one EP degree in training and another in rollout.

moe_switch.py is the mechanism: one EP layer (EPMoE) and its bucketed re-shard between EP degrees. This
file is the model-wide wiring around it: every dense MoE layer of the trained model becomes an EPMoE of
the training layout, every one of the rollout engine's an EPMoE of the inference layout, and at each
phase change the experts move from one to the other, layer by layer, the engine's experts aliasing the
moved tensors (no copy). The naive alternative, and this repo's default (train_grpo.py --train-ep 0),
leaves the experts in FSDP like every weight: each switch gathers all E experts onto every rank.

Contents, the helpers first:
  is_dense_moe, swap_layers   find a model's dense MoE layers (moe_switch.py's layout, by attributes)
                              and replace each by a layer made from it
  ExpertParallel              apply(model, engine); to_rollout() / to_train(), the phase-change mover
                              (fusion.FusedActor's "movers"); sync_grads, clip_grads; shard(a frozen copy)
  optimizer_groups            FSDP2 shards and the EP experts (plain tensors) in two optimizer groups
  dense_state_dict            the whole model in the dense model's names, order and values, on every rank

Departures, besides moe_switch.py's:
  1. to_rollout moves only the experts. The engine's other weights, its routers included, are the
     caller's to load after each training phase (fusion.py does it in this repo). apply() gives the
     engine's new EP layers the router of the dense engine layer each replaces, so an engine never
     holds uninitialised routers; but they are the training's routers only once the caller loads them.
  2. The experts stay out of FSDP (the caller passes params(model) as ignored_params): an owned
     expert's grad is summed over its replicas by sync_grads, and clip_grads takes the norm over the
     FSDP shards and the experts together, each expert counted once.

Run: python -m pytest tests/test_moe_switch.py   (with moe_switch.py's tests: a whole model, dense state)

Using this file elsewhere: copy it together with moe_switch.py, which it imports (torch + the standard
library otherwise). Example, on 2 gloo processes (tests/test_copy_alone.py runs it in a folder that holds
only these two files):

    import copy, datetime, os, socket
    import torch, torch.distributed as dist, torch.multiprocessing as mp
    from expert_parallel import ExpertParallel, dense_state_dict
    from moe_switch import DenseMoE

    def moe_layer(E=4, D=8, H=16):  # stacks in x @ w orientation: (E, D, H), (E, D, H), (E, H, D)
        w = [torch.randn(E, D, H) / 4, torch.randn(E, D, H) / 4, torch.randn(E, H, D) / 4]
        return DenseMoE(torch.randn(E, D), *w, top_k=2, orientation="x @ w")

    def rank_main(rank, world, port):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
        torch.manual_seed(0)  # the same dense model on every rank: two MoE layers
        dense = torch.nn.Sequential(moe_layer(), moe_layer())
        model, engine = copy.deepcopy(dense), copy.deepcopy(dense).requires_grad_(False)  # trained; generates
        ep = ExpertParallel(train_ep=2, infer_ep=1, world_size=world, n_experts=4, bucket_bytes=1 << 16)
        ep.apply(model, engine)  # model: EP 2, 2 experts a rank; engine: EP 1, its own routers, experts empty
        x = torch.randn(5 + rank, 8)  # this rank's tokens
        with torch.no_grad():
            want = dense(x)
            assert torch.allclose(model(x), want, atol=1e-5)  # tokens crossed ranks to their experts and back
            ep.to_rollout()  # every rank, together: the experts re-sharded to EP 1, the engine's alias them
            assert torch.allclose(engine(x), want, atol=1e-5)
            ep.to_train()  # back to EP 2, bit for bit
        full = dense_state_dict(model)  # collective: the dense model's names and values, on every rank
        assert all(torch.equal(full[k], v) for k, v in dense.state_dict().items())
        print(f"rank {rank}: EP 2 -> 1 -> 2, {ep.stats['ep/to_rollout_bytes_moved']} bytes moved to roll out")
        dist.barrier()  # every rank done before any tears down
        dist.destroy_process_group()

    if __name__ == "__main__":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(rank_main, args=(2, port), nprocs=2)

Shapes: E experts, D model width, H expert hidden width, P EP degree, W world size.
"""
import datetime
import time

import torch
import torch.distributed as dist

from moe_switch import EXPERT_NAMES, EPLayout, EPMoE, new_groups


# ----------------------------------------------------------------------------- finding the MoE layers
def is_dense_moe(m):
    """moe_switch.py's dense MoE, by attributes: router (E, D), stacked w_gate/w_up (E, D, H), w_down (E, H, D)."""
    return all(hasattr(m, a) for a in ("router", "top_k", *EXPERT_NAMES)) and not isinstance(m, EPMoE)


def swap_layers(module, make):
    """Replace every dense MoE submodule m of module by make(m). Returns the new layers, in order."""
    layers = []
    for name, child in list(module.named_modules()):
        if is_dense_moe(child):
            parent, _, attr = name.rpartition(".")
            layers.append(make(child))
            setattr(module.get_submodule(parent), attr, layers[-1])
    return layers


def _untie(moe):
    """Drop an EP layer's references to its experts' tensors (each becomes an empty tensor)."""
    for n in EXPERT_NAMES:
        for p in getattr(moe, n):
            p.data = p.data.new_empty(0)


# ----------------------------------------------------------------------------- the model-wide mover
class ExpertParallel:
    """Every MoE layer of a model expert-parallel, with one EP degree in training and another in rollout.

    apply(model, engine): the model's dense MoE layers become EPMoE layers under the training layout (they
    keep their weights; the caller leaves them out of FSDP), the engine's become EPMoE layers under the
    inference layout, with no experts yet and the router of the dense engine layer each replaces.
    to_rollout() re-shards the model's experts to the inference layout, bucket by bucket, and the engine's
    experts alias the moved tensors (no copy); to_train() moves them back, bit for bit. Every rank of the
    layouts calls them together: each layer's switch first agrees on the target (moe_switch.agree_on_switch,
    one small all_gather per layer, L of them for L MoE layers). Call them after the experts' grads and
    optimizer states have left the device: as a mover of fusion.FusedActor, inside its switch.
    to_rollout moves only the experts: the engine's other weights, routers included, are the caller's to
    load after each training phase (fusion.py does it in this repo; `names` lists the expert parameters
    it must skip). clip_grads(model, max_norm) is the clip of the training step. shard(module) gives
    another copy of the model (the frozen reference) the same training layout."""

    def __init__(self, train_ep, infer_ep, world_size, n_experts, bucket_bytes, timeout_s=300.0, ranks=None):
        self.train_layout = EPLayout(train_ep, world_size, n_experts, ranks)
        self.infer_layout = EPLayout(infer_ep, world_size, n_experts, ranks)
        self.train_groups = new_groups(self.train_layout, timeout_s)  # (EP, DP); collective
        self.infer_groups = new_groups(self.infer_layout, timeout_s)
        self.group = None  # the layout's ranks, when they are part of the job: the norm's all-reduce, switch()
        if ranks is not None and dist.is_initialized():
            self.group = dist.new_group(list(ranks), timeout=datetime.timedelta(seconds=timeout_s))
        self.bucket_bytes, self.world, self.stats = bucket_bytes, world_size, {}
        self.model_layers, self.engine_layers, self.names = [], [], set()

    def apply(self, model, engine=None):
        self.model_layers = self.shard(model)
        if not self.model_layers:
            raise ValueError("the model has no dense MoE layer (a module with router, top_k, w_gate, w_up and "
                             "w_down; see moe_switch.py's 'Using this file elsewhere') to make expert-parallel")
        self.names = {n for n, _ in model.named_parameters() if n.split(".")[-2] in EXPERT_NAMES}
        if engine is not None:
            self.engine_layers = swap_layers(engine, self._empty_like)

    def shard(self, module):
        """module's dense MoE layers -> EPMoE layers of the training layout, keeping their weights (this
        rank's share). Also for a frozen copy of the model (the reference): it then runs the policy's own
        EP forward, the same kernels on the same rows, so it computes what the policy computes, bit for
        bit (a dense forward rounds differently, and Adam magnifies a near-zero KL gradient)."""
        return swap_layers(module, lambda m: EPMoE.from_dense(m, self.train_layout, self.train_groups[0]))

    def _empty_like(self, moe):
        """An engine's EP layer: the dense layer's own router (the Parameter, not a copy: a loader that
        fills the engine by name still finds it), experts empty until to_rollout aliases the moved ones."""
        E, D, H = moe.w_gate.shape
        ep = EPMoE(D, H, E, moe.top_k, self.infer_layout, self.infer_groups[0]).to(moe.router.weight.device)
        ep.router.weight = moe.router.weight                                  # (E, D)
        ep.requires_grad_(False)
        _untie(ep)
        return ep

    def params(self, model):
        """The model's expert parameters (one per global expert; empty where this rank owns none)."""
        return [p for n, p in model.named_parameters() if n in self.names]

    @torch.no_grad()
    def to_rollout(self):
        t0, moved = time.perf_counter(), []
        for m, e in zip(self.model_layers, self.engine_layers):
            moved.append(m.switch(self.infer_layout, self.infer_groups[0], self.bucket_bytes, self.group))
            for n in EXPERT_NAMES:
                for pm, pe in zip(getattr(m, n), getattr(e, n)):
                    pe.data = pm.data  # the engine's experts are the moved tensors themselves
        self._record("to_rollout", t0, moved)

    @torch.no_grad()
    def to_train(self):
        t0, moved = time.perf_counter(), []
        for m, e in zip(self.model_layers, self.engine_layers):
            _untie(e)  # the switch must hold the only reference, or nothing could be freed
            moved.append(m.switch(self.train_layout, self.train_groups[0], self.bucket_bytes, self.group))
        self._record("to_train", t0, moved)

    def _record(self, key, t0, moved):
        self.stats.update({f"time/ep_{key}_s": time.perf_counter() - t0,
                           f"ep/{key}_bytes_moved": sum(s["bytes_moved"] for s in moved),
                           f"ep/{key}_bytes_min": sum(s["bytes_min"] for s in moved),
                           f"ep/{key}_peak_extra_bytes": max(s["peak_extra_bytes"] for s in moved),
                           f"ep/{key}_layer_peak_switch_bytes": max(s["peak_switch_bytes"] for s in moved),
                           f"ep/{key}_layer_target_bytes": moved[0]["to_bytes"]})  # one layer at a time

    def sync_grads(self, model):
        """After backward: an owned expert's grad sums its EP group's tokens; summed over the replicas and
        divided by the world, it is the mean over all ranks (what FSDP gives the dense weights)."""
        grads = [p.grad for p in self.params(model) if p.numel()]
        flat = torch.cat([g.flatten() for g in grads]) / self.world
        if self.train_layout.dp > 1:
            dist.all_reduce(flat, group=self.train_groups[1])
        for g, f in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(f.view_as(g))

    def clip_grads(self, model, max_norm):
        """sync_grads, then clip_grad_norm_ over the FSDP shards and the owned experts together."""
        self.sync_grads(model)
        experts = set(map(id, self.params(model)))
        dense = [p.grad for p in model.parameters() if id(p) not in experts and p.grad is not None]
        norm = torch.nn.utils.get_total_norm(dense)
        sq = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).double() ** 2
        own = sum(p.grad.double().pow(2).sum() for p in self.params(model) if p.numel()).reshape(1)
        dist.all_reduce(own, group=self.group)  # every expert counted once per replica
        total = (sq + own[0] / self.train_layout.dp).sqrt()
        coef = min(1.0, max_norm / (float(total) + 1e-6))
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(coef)
        return total


# ----------------------------------------------------------------------------- optimizer and checkpoint
def optimizer_groups(model):
    """The parameters in two groups: FSDP2 shards (DTensors) and plain tensors (the EP experts, outside
    FSDP); a multi-tensor (foreach) optimizer step, CUDA's default, refuses to mix the two kinds."""
    from torch.distributed.tensor import DTensor
    params = list(model.parameters())
    groups = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
    return [{"params": g} for g in groups if g]


def dense_state_dict(model, group=None):
    """The whole model on every rank (collective over `group`: the ranks of the EP layout, default all),
    in the dense model's names and order: FSDP2 shards gathered; EP experts (one tensor per expert, on
    their owners) broadcast by their first holder and stacked (E, ...). What a checkpoint or a dense
    reference model loads."""
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    ep = {name: m for name, m in model.named_modules() if isinstance(m, EPMoE)}
    out = {}
    for k, v in full.items():
        name = k.rsplit(".", 2)[0]
        if name in ep and f"{name}.w_gate" not in out:  # the dense MoE's order: its own parameters
            m = ep[name]                                    # (w_gate, w_up, w_down) before router.weight
            for n in EXPERT_NAMES:
                like = getattr(m, n)[m.layout.owned(m.rank)[0]]
                experts = [p.detach().clone() if p.numel() else torch.empty_like(like) for p in getattr(m, n)]
                for e, t in enumerate(experts):
                    dist.broadcast(t, src=m.layout.global_rank(m.layout.holders(e)[0]), group=group)
                out[f"{name}.{n}"] = torch.stack(experts)                                 # (E, ...)
        if name not in ep or k.endswith(".router.weight"):
            out[k] = v
    return out
