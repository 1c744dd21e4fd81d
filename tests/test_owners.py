"""options/owners.py: fusion.py's switch from the other training layouts, the weights' owners agreed by
union_meta (its actor_class). Pipeline stages (PP 2 at world 2, PP 2 x FSDP 2 at world 4): the engine built
from the stages exactly, with the minimum bytes, training untouched by the switches; reports the ranks
disagree on refused. HSDP (FSDP2 within each node, a copy per node): the engine built from each node's own
shards. Without union_meta, FusedActor refuses such a model before any collective, naming the weight.

The multi-rank checks run in one gloo spawn per world size and layout: each spawn costs seconds of imports."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from fusion import FusedActor, rollout
from model import Policy
from options import owners, tensor_parallel
from options.tensor_parallel import TPLayout, engine as tp_engine
from tests.distributed import run_distributed
from tests.test_fusion import BUCKET, CFG, _backward, _local, _snapshot, _tokens

FromOwners = owners.actor_class(FusedActor)  # the weights' owners agreed by union_meta
FromOwnersLoadWeights = tensor_parallel.actor_class(FromOwners)  # each bucket to engine.load_weights


# ----------------------------------------------------------------------------- pipeline stages as the training layout
class Stage(Policy):
    """Policy cut by hand into pipeline stage 0 (embed, blocks.0) or 1 (blocks.1, norm, head), each parameter
    under the whole model's name, the other stage's modules replaced (Identity) or deleted (None); after the
    same seed, the same weights as Policy(CFG). forward runs the stage: tokens (B, T) -> (B, T, D) on stage 0,
    (B, T, D) -> logits (B, T, V) on stage 1, as Policy.forward computes them."""

    def __init__(self, stage):
        super().__init__(CFG)
        self.stage = stage
        if stage == 0:
            self.blocks[1], self.norm, self.head = torch.nn.Identity(), None, None
        else:
            self.blocks[0], self.embed = torch.nn.Identity(), None

    def forward(self, x):
        positions = torch.arange(x.shape[1]).expand(x.shape[:2])                # (B, T)
        cos, sin = self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1)
        if self.stage == 0:
            return self.blocks[0](self.embed(x), cos, sin)                       # (B, T, D)
        return self.head(self.norm(self.blocks[1](x, cos, sin))).float()         # (B, T, V)


def _stage_model(rank, world, fsdp):
    """This rank's stage of Policy(CFG) seeded 0, PP 2: stage 0 on the first half of the ranks, stage 1 on the
    second; FSDP2 over a 1-D mesh of the stage's ranks (one rank at world 2) or plain; AdamW. Collective."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    per = world // 2
    groups = [dist.new_group(list(range(s * per, (s + 1) * per))) for s in range(2)]  # every rank makes both
    stage = rank // per
    torch.manual_seed(0)
    model = Stage(stage)
    if fsdp:
        mesh = DeviceMesh.from_group(groups[stage], "cpu")
        fully_shard(model.blocks[stage], mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _pp_backward(model, rank, world, step):
    """A step's backward through the 2 stages: stage 0 sends its activations (2, 11, D) to its peer on stage 1
    (rank + W/2, the same batch), which sends back their grad; FSDP2 reduces each stage's grads over its mesh."""
    per = world // 2
    tok = _tokens(100 * step + rank % per, B=2, T=12)                           # (2, 12) this DP rank's batch
    if rank < per:
        h = model(tok[:, :-1])                                                   # (2, 11, D)
        dist.send(h.detach().contiguous(), rank + per)
        grad = torch.empty_like(h)
        dist.recv(grad, rank + per)
        h.backward(grad)
    else:
        h = torch.empty(2, 11, CFG.d_model)
        dist.recv(h, rank - per)
        h.requires_grad_()
        logits = model(h)                                                        # (2, 11, V)
        F.cross_entropy(logits.reshape(-1, CFG.vocab_size), tok[:, 1:].reshape(-1)).backward()
        dist.send(h.grad, rank - per)


def _full_weights(model):
    """{name: full tensor} of the whole model, from every rank's stage (all_gather_object): the reference."""
    mine = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p.detach()).clone()
            for n, p in model.named_parameters()}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {n: t for d in everyone for n, t in d.items()}


def _check_pp_switch(rank, world, model, opt):
    """The engine built from the stages, at every TP degree that divides the world (TP 1 in place and through
    load_weights): its weights are the whole model's bit for bit (at TP t, the pieces Policy.load_weights cuts
    from them) and it computes the reference's logits; each rank receives exactly the bytes it lacks (the
    whole model less its stage's rows); the peak extra is one bucket at most (none in place); to_train gives
    back every shard and optimizer state bit for bit."""
    full, tok = _full_weights(model), _tokens(7)
    lacks = sum(t.nbytes for t in full.values()) - sum(_local(p).nbytes for p in model.parameters())
    ref, before = Policy(CFG).eval(), _snapshot(model, opt)
    ref.load_weights(full.items())
    for tp in [t for t in (1, 2, 4) if world % t == 0]:
        tp_group, _ = TPLayout(world, tp, n_heads=CFG.n_heads).new_groups(timeout_s=60)
        want = tp_engine(CFG, tp_group)
        want.load_weights(full.items())
        for inplace in (True, False) if tp == 1 else (False,):
            cls = FromOwners if inplace else FromOwnersLoadWeights
            actor = cls(model, opt, tp_engine(CFG, tp_group), bucket_bytes=BUCKET)
            assert [w.name for w in actor.layout.values()] == list(full)  # stage by stage, the model's order
            with rollout(actor) as engine, torch.no_grad():
                for (name, p), q in zip(engine.named_parameters(), want.parameters()):
                    assert torch.equal(p, q), (tp, inplace, name)
                torch.testing.assert_close(engine(tok), ref(tok), atol=1e-5, rtol=0)
            m = actor.metrics()
            assert m["switch/received_bytes"] == m["switch/received_min_bytes"] == lacks > 0, (m, lacks)
            assert m["switch/peak_extra_bytes"] == 0 if inplace else 0 < m["switch/peak_extra_bytes"] <= BUCKET
            assert all(torch.equal(x, y) for x, y in zip(_snapshot(model, opt), before))
            actor.close()
    return lacks


def _check_pp_training(rank, world, fsdp):
    """Train steps through the stages with a switch after each backward (grads offloaded) and after each step,
    the engine checked against the stages' current weights each time: the same shards and optimizer states,
    bit for bit, as the same steps without switches."""
    a, opt_a = _stage_model(rank, world, fsdp)
    b, opt_b = _stage_model(rank, world, fsdp)
    actor = FromOwners(a, opt_a, Policy(CFG), bucket_bytes=BUCKET)
    for step in range(2):
        for model, opt in ((a, opt_a), (b, opt_b)):
            _pp_backward(model, rank, world, step)
            if model is a:
                with rollout(actor):
                    assert actor.metrics()["mem/rollout_grads_bytes"] == 0
            opt.step()
            opt.zero_grad(set_to_none=True)
        full = _full_weights(a)
        with rollout(actor) as engine:
            assert all(torch.equal(p, full[n]) for n, p in engine.named_parameters())
    assert all(torch.equal(x, y) for x, y in zip(_snapshot(a, opt_a), _snapshot(b, opt_b)))
    actor.close()
    return a, opt_a


def _check_pp_refusals(rank, world):
    """Layouts the ranks disagree on are refused as the actor is built, on every rank, naming the weight, before
    any gather (the ranks go on together): FSDP2 over a mesh of rank 0 alone on rank 0 and over both ranks on
    rank 1 (owners [0] and [0, 1] overlap); whole on rank 0, Shard(0) on rank 1. The whole model plain on every
    rank (every rank an owner) is accepted: each rank copies its own, receiving nothing. Without union_meta
    (FusedActor's own _weights_to_build, the default) a weight not sharded over every rank is refused on its
    own rank, naming it."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    alone = [dist.new_group([r]) for r in range(world)][rank]
    both = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    said = {(0, 1): r"embed.weight: rank 0 holds it Shard\(0\) over ranks \[0\].*; rank 1 Shard\(0\) over ranks \[0, 1\]",
            (1,): r"embed.weight: rank 0 holds it whole on ranks \[0\].*; rank 1 Shard\(0\) over ranks \[1\]"}
    for sharded_on, match in said.items():
        torch.manual_seed(0)
        model = Policy(CFG)
        if rank in sharded_on:
            fully_shard(model, mesh=both if len(sharded_on) == 2 and rank == 1 else DeviceMesh.from_group(alone, "cpu"))
        with pytest.raises(ValueError, match=match):
            FromOwnersLoadWeights(model, torch.optim.AdamW(model.parameters()), Policy(CFG), bucket_bytes=BUCKET)
    torch.manual_seed(0)
    model = Policy(CFG)
    with pytest.raises(ValueError, match=rf"embed.weight is held by ranks \[{rank}\], not by the actor's ranks"):
        FusedActor(model, torch.optim.AdamW(model.parameters()), Policy(CFG), bucket_bytes=BUCKET)
    actor = FromOwners(model, torch.optim.AdamW(model.parameters()), Policy(CFG), bucket_bytes=BUCKET)
    assert all(w.owners == tuple(range(world)) and not w.sharded for w in actor.layout.values())
    with rollout(actor) as engine:
        assert all(torch.equal(p, q) for p, q in zip(engine.parameters(), model.parameters()))
    assert actor.metrics()["switch/received_bytes"] == actor.metrics()["switch/received_min_bytes"] == 0


def _pipeline(rank, world):
    out = {}
    for fsdp in (False, True) if world == 2 else (True,):  # world 2: a stage per rank, plain or FSDP2 over one
        model, opt = _check_pp_training(rank, world, fsdp)
        out[fsdp] = _check_pp_switch(rank, world, model, opt)
    if world == 2:
        _check_pp_refusals(rank, world)
    return out


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_fusion_builds_the_engine_from_pipeline_stages(world):
    """PP 2 at world 2 (a stage per rank) and PP 2 x FSDP 2 at world 4: the engine, the whole model on every
    rank, is built from the stages exactly, with the minimum bytes; training is untouched by the switches."""
    results = run_distributed(_pipeline, world_size=world, timeout_s=120)
    assert all(lacks > 0 for r in results for lacks in r.values())


# ----------------------------------------------------------------------------- sharded within each node
def _nodes(rank, world):
    """FSDP2 within each node (nodes of W/2 ranks: a rank alone at world 2), every node a copy of the model (HSDP's
    layout): the layout has 2 replicas; at TP 1 (in place) and TP W (load_weights) the engine is built from this
    rank's own node, its weights the whole model's bit for bit, each rank receiving exactly what its node's peers
    hold and nothing across nodes; to_train gives back every shard and optimizer state bit for bit."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    per = world // 2
    mesh = DeviceMesh.from_group([dist.new_group(list(range(n * per, (n + 1) * per))) for n in range(2)][rank // per],
                                 "cpu")
    torch.manual_seed(0)
    model = Policy(CFG)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _backward(model, rank % per, 0)  # the nodes' copies stay equal (as a cross-node gradient sync keeps them)
    opt.step()
    opt.zero_grad(set_to_none=True)
    full, before = {n: p.full_tensor() for n, p in model.named_parameters()}, _snapshot(model, opt)
    lacks = sum(t.nbytes for t in full.values()) - sum(_local(p).nbytes for p in model.parameters())
    for tp in (1, world):
        tp_group, _ = TPLayout(world, tp, n_heads=CFG.n_heads).new_groups(timeout_s=60)
        want = tp_engine(CFG, tp_group)
        want.load_weights(full.items())
        cls = FromOwners if tp == 1 else FromOwnersLoadWeights
        actor = cls(model, opt, tp_engine(CFG, tp_group), bucket_bytes=BUCKET)
        assert all(w.replicas == 2 and len(w.owners) == per for w in actor.layout.values())
        with rollout(actor) as engine:
            assert all(torch.equal(p, q) for p, q in zip(engine.parameters(), want.parameters())), tp
        m = actor.metrics()
        assert m["switch/received_bytes"] == m["switch/received_min_bytes"] == lacks, (m, lacks)
        assert all(torch.equal(x, y) for x, y in zip(_snapshot(model, opt), before))
        actor.close()
    return lacks


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_fusion_builds_the_engine_from_each_nodes_own_shards(world):
    """2 nodes: of 1 rank at world 2 (each holds the model whole, receives nothing), of 2 at world 4."""
    lacks = run_distributed(_nodes, world_size=world, timeout_s=120)
    assert lacks == [0, 0] if world == 2 else all(x > 0 for x in lacks)
