"""gradsync.py: compress="none" gives native 2-D HSDP's parameters bit for bit (world 4 = 2 nodes x 2, world 2 =
2 nodes x 1; one FSDP unit and one per block; overlap on and off), error feedback loses nothing and the nodes
stay bit-identical (int8, top-k int8, 2 and 3 nodes), a non-finite gradient leaves the residuals as they were,
reset(), the bytes, bad settings, the state round trips; mixed precision (overlap refused, overlap=False as
native HSDP), a mesh that is not the node's refused, a parameter unused on one node, ignored parameters.

The multi-rank checks run in a few gloo spawns: each spawn costs seconds of imports."""
import math

import pytest
import torch
import torch.distributed as dist

from options.gradsync import (GradSync, NodeLayout, average_payloads, decode, dense_bytes, encode, new_groups,
                      quantize_int8)
from tests.distributed import run_distributed

D, STEPS = 12, 3  # model width (12 rows: a head of 5 rows pads to 6 on 2 ranks), AdamW steps


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(D, D) for _ in range(2))
        self.head = torch.nn.Linear(D, 5)

    def forward(self, x, skip=()):             # x (B, D); skip: indices of blocks this forward leaves out
        for i, block in enumerate(self.blocks):
            if i not in skip:
                x = torch.tanh(block(x))
        return self.head(x)                    # (B, 5)


def _model(mesh, per_block, **kwargs):
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)  # the same initial weights on every rank
    model = Net()
    if per_block:
        for block in model.blocks:
            fully_shard(block, mesh=mesh, **kwargs)
    return fully_shard(model, mesh=mesh, **kwargs)


def _applied(sync, model):
    """The model with sync's hooks on it (apply returns the GradSync, for `sync = GradSync(...).apply(m)`)."""
    assert sync.apply(model) is sync
    return model


def _train(model, rank, sync=None):
    """STEPS AdamW steps on this rank's own data; the local shards after them."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        x = torch.randn(4, D, generator=torch.Generator().manual_seed(100 * step + rank))   # (4, D)
        model(x).square().mean().backward()
        if sync is not None and sync.overlap:
            _check_aliasing(model, sync)
        if sync is not None:
            sync.wait()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.to_local().clone() for n, p in model.named_parameters()}


def _check_aliasing(model, sync):
    """After the backward, before wait(): every sharded grad is a view of a buffer whose sync is pending."""
    pending = {buf.untyped_storage().data_ptr() for _, buf, *_ in sync.pending}
    assert len(sync.pending) == len([u for u in sync.params.values() if u])  # one started sync per unit
    assert all(p.grad.to_local().untyped_storage().data_ptr() in pending for p in model.parameters())


def _hsdp_ranks(rank, world, nodes):
    """This rank's shards after training: native 2-D HSDP, then FSDP within the node + GradSync (each unit
    layout, overlap off and on), then top-k int8; the residuals' names; the accumulation guard's message."""
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    layout = NodeLayout(world, nodes)
    node_group, cross_group = new_groups(layout, timeout_s=60)
    native_mesh = init_device_mesh("cpu", (nodes, layout.node_size), mesh_dim_names=("replicate", "shard"))
    node_mesh = DeviceMesh.from_group(node_group, "cpu")
    out = {}
    for per_block in (False, True):
        out["native", per_block] = _train(_model(native_mesh, per_block), rank)
        for overlap in (False, True):
            sync = GradSync(cross_group, overlap=overlap)
            out["gradsync", per_block, overlap] = _train(_applied(sync, _model(node_mesh, per_block)), rank, sync)
    sync = GradSync(cross_group, compress="topk-int8", overlap=True)
    out["topk"] = _train(_applied(sync, _model(node_mesh, per_block=True)), rank, sync)
    out["residuals"] = sorted(sync.state_dict())
    out["guard"] = _accumulate(node_mesh, GradSync(cross_group, overlap=True))
    return out


def _accumulate(mesh, sync):
    """overlap=True refuses a backward into grads that exist: FSDP would add the buffer before wait() filled it."""
    model = _applied(sync, _model(mesh, per_block=True))
    x = torch.ones(2, D)  # (2, D)
    model(x).sum().backward()
    sync.wait()
    try:
        model(x).sum().backward()  # no zero_grad(set_to_none=True) in between
    except RuntimeError as e:
        return str(e)


@pytest.mark.parametrize("world,nodes", [(4, 2), (2, 2)])
def test_sync_is_native_hsdp_bit_for_bit_and_nodes_agree(world, nodes):
    outs = run_distributed(_hsdp_ranks, world_size=world, args=(nodes,))
    for out in outs:
        guard, residuals = out.pop("guard"), out.pop("residuals")
        assert "unit 'blocks.1'" in guard and "zero_grad(set_to_none=True)" in guard
        assert residuals == ["", "blocks.0", "blocks.1"]  # keyed by unit name, "" the root
        for key, params in out.items():
            if key[0] == "gradsync":
                native = out["native", key[1]]
                assert all(torch.equal(params[n], native[n]) for n in native), key
    size = world // nodes
    for rank in range(size):  # rank j of node 0 against rank j of node 1: the same shard, bit-identical
        for key in outs[rank]:
            assert all(torch.equal(outs[rank][key][n], outs[rank + size][key][n]) for n in outs[rank][key])


def _grads(rank, step, numel=1280):
    g = torch.randn(numel, generator=torch.Generator().manual_seed(1000 * rank + step))  # (n,)
    return g * torch.linspace(0.01, 3.0, numel)  # a range of magnitudes, as real gradients have


INF_STEP = 2  # node 0's gradient holds an inf at this step: the average is not finite, the trainer skips the step


def _feedback_ranks(rank, world, compress, overlap):
    torch.set_num_threads(1)
    sync = GradSync(dist.group.WORLD, compress=compress, overlap=overlap)  # 1 rank a node: WORLD crosses them
    applied, true = torch.zeros(1280), torch.zeros(1280)
    for step in range(6):
        g = _grads(rank, step)
        if step == INF_STEP and rank == 0:
            g[7] = float("inf")
        before = sync.residuals["unit"].clone() if step else None
        buf = g.clone()
        sync.sync("unit", buf)
        sync.wait()
        if step == INF_STEP:  # skipped as the trainer's finite check skips it: neither applied nor owed
            residual = sync.residuals["unit"]
            kept = not torch.isfinite(buf).all() and torch.equal(residual, before) and torch.isfinite(residual).all()
            continue
        true += g
        applied += buf
    return {"applied": applied, "true": true, "residual": sync.state_dict()["unit"], "stats": dict(sync.stats),
            "kept": kept, "round_trips": _state_round_trips(sync, rank), "reset": _reset_forgets(sync, rank)}


def _state_round_trips(sync, rank):
    """A fresh GradSync loaded from the state syncs the next step exactly as the original; rollout round trip."""
    other = GradSync(sync.group, compress=sync.compress, overlap=sync.overlap)
    other.load_state_dict(sync.state_dict())
    bufs = [_grads(rank, 99) for _ in range(2)]
    for s, buf in zip((sync, other), bufs):
        s.sync("unit", buf)
        s.wait()
    before = sync.residuals["unit"].clone()
    sync.to_rollout()
    freed = sync.residuals["unit"].untyped_storage().nbytes() == 0
    sync.to_train()
    return (torch.equal(bufs[0], bufs[1]) and torch.equal(sync.residuals["unit"], other.residuals["unit"])
            and freed and torch.equal(sync.residuals["unit"], before))


def _reset_forgets(sync, rank):
    """reset() in ROLLOUT (the host buffer of the last switch reused) and in TRAIN: the residual zero, and the next
    sync is a fresh GradSync's, bit for bit."""
    host = sync._host["unit"]
    sync.to_rollout()
    sync.reset()
    sync.to_train()
    reused = sync._host["unit"] is host
    zero = not sync.residuals["unit"].any()
    fresh = GradSync(sync.group, compress=sync.compress, overlap=sync.overlap)
    bufs = [_grads(rank, 7) for _ in range(2)]
    for s, buf in zip((sync, fresh), bufs):
        s.sync("unit", buf)
        s.wait()
    same = torch.equal(bufs[0], bufs[1]) and torch.equal(sync.residuals["unit"], fresh.residuals["unit"])
    sync.reset()
    return reused and zero and same and not sync.residuals["unit"].any()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("compress,overlap", [("int8", False), ("topk-int8", True)])
def test_error_feedback_loses_nothing_and_nodes_agree(world, compress, overlap):
    outs = run_distributed(_feedback_ranks, world_size=world, args=(compress, overlap))
    applied = outs[0]["applied"]                                       # (n,) the sum of the applied averages
    assert all(torch.equal(o["applied"], applied) for o in outs)      # every node applied the same bits
    mean_true = sum(o["true"] for o in outs) / world                  # (n,) the skipped step left out
    mean_residual = sum(o["residual"] for o in outs) / world          # (n,)
    assert torch.allclose(applied + mean_residual, mean_true, rtol=0, atol=2e-5)
    assert not torch.allclose(applied, mean_true, rtol=0, atol=1e-3)  # something was late: the test has teeth
    assert all(o["kept"] for o in outs)  # the inf step: every residual finite and as it was before it
    assert all(o["round_trips"] for o in outs)  # state_dict and to_rollout/to_train round trips
    assert all(o["reset"] for o in outs)
    if world == 2:  # bytes: 6 syncs of 1280 fp32 values; a ring all-reduce of 2 nodes sends 5120 bytes each
        stats = outs[0]["stats"]
        assert stats["gradsync/dense_bytes"] == 6 * 5120
        payload = 1280 + 4 * 10 if compress == "int8" else 4 * 1 + 4 * 128 + 128  # values, scales, indices
        assert stats["gradsync/sent_bytes"] == 6 * payload
        ratio = stats["gradsync/dense_bytes"] / stats["gradsync/sent_bytes"]
        assert (3.85 < ratio < 3.9) if compress == "int8" else ratio >= 4  # 3.88x; top-k at 10%: 7.95x


def test_codecs_round_trip_and_bound_the_error():
    g = _grads(0, 0, numel=300)
    q, scales = quantize_int8(g, 128)
    assert q.dtype == torch.int8 and scales.shape == (3,)
    for compress in ("int8", "topk-int8"):
        payload, sent = encode(g, compress, 0.1, 128)
        assert torch.equal(decode(payload, 300, compress, 0.1, 128), sent)  # the receiver sees what was sent
        assert torch.equal(average_payloads([payload, payload], 300, compress, 0.1, 128), sent)
    kept = sent != 0
    assert kept.sum() == math.ceil(0.1 * 300) and g.abs()[kept].min() >= g.abs()[~kept].max()  # the largest 30
    assert torch.allclose(encode(g, "int8", 0.1, 128)[1], g, rtol=0, atol=g.abs().max().item() / 254 + 1e-6)
    assert dense_bytes(4000, 2) == 4000 and dense_bytes(4000, 4) == 6000


def test_bad_settings_name_the_value():
    with pytest.raises(ValueError, match="nodes=3 does not divide world=4"):
        NodeLayout(4, 3)
    with pytest.raises(ValueError, match="nodes=0"):
        NodeLayout(4, 0)
    with pytest.raises(ValueError, match="topk=0 "):
        GradSync(None, compress="topk-int8", topk=0)
    with pytest.raises(ValueError, match="topk=nan"):
        GradSync(None, topk=float("nan"))
    with pytest.raises(ValueError, match="compress='fp8'.*'topk-int8'"):
        GradSync(None, compress="fp8")
    with pytest.raises(ValueError, match="chunk=0"):
        GradSync(None, chunk=0)
    layout = NodeLayout(8, 2)
    assert (layout.node_size, layout.node_of(5), layout.node_ranks(1), layout.cross_ranks(2)) == \
        (4, 1, [4, 5, 6, 7], [2, 6])


def _bad_ranks(rank, world):
    torch.set_num_threads(1)
    errors = []
    for args in [(NodeLayout(4, 2), 60), (NodeLayout(2, 2), 0)]:
        try:
            new_groups(*args)
        except ValueError as e:
            errors.append(str(e))
    sync = GradSync(new_groups(NodeLayout(2, 2), 60)[1], compress="int8")
    sync.sync("unit", torch.ones(10))  # the groups work: nothing above started a collective
    try:
        sync.sync("unit", torch.ones(7))  # another size under the same name: refused before the all-gather
    except ValueError as e:
        errors.append(str(e))
    for sd in [{"blocks.9": torch.zeros(10)}, {"unit": torch.zeros(3)}]:
        try:
            sync.load_state_dict(sd)
        except ValueError as e:
            errors.append(str(e))
    sync.sync("unit", torch.ones(10))  # still in step
    return errors


def test_bad_arguments_fail_before_any_collective():
    errors = run_distributed(_bad_ranks, world_size=2)[0]
    assert len(errors) == 5
    assert "layout.world=4" in errors[0] and "world size is 2" in errors[0]
    assert "timeout_s=0" in errors[1]
    assert "'unit'" in errors[2] and "7 values" in errors[2] and "10:" in errors[2]
    assert "blocks.9" in errors[3]
    assert "'unit'" in errors[4] and "(3,)" in errors[4] and "(10,)" in errors[4]


def _misuse_ranks(rank, world):
    """World 2 as 2 nodes of 1: nodes whose settings differ, and optimizer.step() before wait()."""
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import DeviceMesh
    node_group, cross_group = new_groups(NodeLayout(world, 2), timeout_s=60)
    errors = {}
    for case, kwargs in {"topk": dict(compress="topk-int8", topk=0.1 + 0.1 * rank),
                         "compress": dict(compress=("none", "int8")[rank])}.items():
        errors[case] = _error(lambda: GradSync(cross_group, **kwargs).sync("u", torch.ones(10)))
    GradSync(cross_group, compress="none", topk=0.5 + 0.1 * rank).sync("u", torch.ones(10))  # topk unused: fine
    sync = GradSync(cross_group, overlap=True)
    model = _applied(sync, _model(DeviceMesh.from_group(node_group, "cpu"), per_block=True))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(2, D)).sum().backward()
    errors["step"] = _error(opt.step)  # the grads are not averaged yet: refused, nothing stepped
    sync.wait()
    opt.step()  # after wait(): fine
    return errors


def test_nodes_with_other_settings_and_a_step_before_wait_are_refused():
    for errors in run_distributed(_misuse_ranks, world_size=2):
        assert "the nodes' GradSync settings differ (node 0: {'compress': 'topk-int8', 'chunk': 128, 'topk': 0.1}; " \
               "node 1: {'compress': 'topk-int8', 'chunk': 128, 'topk': 0.2})" in errors["topk"], errors["topk"]
        assert "node 0: {'compress': 'none'}; node 1: {'compress': 'int8', 'chunk': 128}" in errors["compress"]
        assert "optimizer.step() with 3 gradient syncs pending: call wait()" in errors["step"], errors["step"]


def _error(fn):
    try:
        fn()
    except (RuntimeError, ValueError) as e:
        return str(e)


def _layout_ranks(rank, world):
    """World 2 as 2 nodes of 1: mixed precision (overlap refused by every rank before any collective; overlap=False
    against native HSDP under the same policy), the world mesh refused, blocks.1 unused on node 1, ignored params."""
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    node_group, cross_group = new_groups(NodeLayout(world, 2), timeout_s=60)
    node_mesh = DeviceMesh.from_group(node_group, "cpu")
    native_mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)  # the reduce dtype too: FSDP casts a copy for the grads
    out = {"native": _train(_model(native_mesh, per_block=True, mp_policy=bf16), rank)}
    sync = GradSync(cross_group)
    out["gradsync"] = _train(_applied(sync, _model(node_mesh, per_block=True, mp_policy=bf16)), rank, sync)
    sync = GradSync(cross_group, overlap=True)
    out["overlap"] = _error(lambda: _train(_applied(sync, _model(node_mesh, per_block=True, mp_policy=bf16)), rank, sync))
    world_mesh = init_device_mesh("cpu", (world,))
    out["mesh"] = _error(lambda: GradSync(cross_group).apply(_model(world_mesh, per_block=False)))
    sync = GradSync(cross_group, compress="int8")
    model = _applied(sync, _model(node_mesh, per_block=False))
    model(torch.ones(2, D) + rank, skip=(1,) if rank else ()).square().sum().backward()  # node 1 leaves blocks.1 out
    sync.wait()
    out["unused"] = model.blocks[1].weight.grad.to_local().clone()
    net = Net()
    sync = GradSync(cross_group)
    sync.apply(fully_shard(net, mesh=node_mesh, ignored_params={net.head.bias}))
    out["ignored"] = [p is net.head.bias for p in sync.params[""]]
    return out


def test_mixed_precision_mesh_unused_and_ignored_params():
    outs = run_distributed(_layout_ranks, world_size=2)
    for out in outs:
        assert all(torch.equal(out["gradsync"][n], out["native"][n]) for n in out["native"])  # overlap=False works
        assert "overlap=True" in out["overlap"] and "torch.bfloat16 buffer" in out["overlap"], out["overlap"]
        assert "torch.float32 parameters" in out["overlap"] and "overlap=False" in out["overlap"]
        assert "ranks [0, 1] and the cross group is ranks [0, 1]" in out["mesh"], out["mesh"]
        assert out["ignored"] == [False] * 5  # blocks' and head's weights and biases, not the ignored head.bias
    assert torch.equal(outs[0]["unused"], outs[1]["unused"]) and outs[0]["unused"].abs().sum() > 0
    assert all(torch.equal(outs[0]["gradsync"][n], outs[1]["gradsync"][n]) for n in outs[0]["gradsync"])
