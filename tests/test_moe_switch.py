"""moe_switch.py against a single-process reference: EP exactness, round trips, training, memory, bad input.

Most checks run inside one 4-rank gloo spawn (each spawn costs seconds of imports)."""
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe_switch import EPLayout, EPMoE, ExpertParallel, moe_reference, reshard, reshard_naive, shard_experts
from options.dense_moe import DenseMoE
from plumbing.checkpoint import dense_state_dict
from plumbing.moe_switch_details import new_groups
from tests.distributed import run_distributed

E, D, H, K, W = 8, 16, 24, 2, 4
NAMES = ("w_gate", "w_up", "w_down")
SLICE = D * H * 4            # bytes of one expert's w_gate (= w_up = w_down) in float32
BUCKET = 2 * SLICE           # forces several rounds per switch


def _dense(seed=0):
    g = torch.Generator().manual_seed(seed)
    full = dict(w_gate=torch.randn(E, D, H, generator=g) / D ** 0.5, w_up=torch.randn(E, D, H, generator=g) / D ** 0.5,
                w_down=torch.randn(E, H, D, generator=g) / H ** 0.5)
    return torch.randn(E, D, generator=g), full


def _tokens(rank, step=0):
    g = torch.Generator().manual_seed(100 * step + rank)
    n = 5 + 3 * rank                                          # uneven token counts across ranks
    return torch.randn(n, D, generator=g), torch.randn(n, D, generator=g)  # tokens, loss weights


def _layer(P, router, full, groups):
    moe = types.SimpleNamespace(router=types.SimpleNamespace(weight=router), top_k=K, **full)
    return EPMoE.from_dense(moe, EPLayout(P, W, E), groups[P][0])


def _check_exact(rank, router, full, groups):
    for P in (1, 2, 4):
        layer = _layer(P, router, full, groups)
        x, wt = _tokens(rank)
        x.requires_grad_(True)
        (layer(x) * wt).sum().backward()
        xr = x.detach().clone().requires_grad_(True)
        y_ref = moe_reference(xr, router, full, K)
        (y_ref * wt).sum().backward()
        torch.testing.assert_close(layer(x.detach()), y_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(x.grad, xr.grad, atol=1e-5, rtol=1e-5)
        # an owned expert's grad sums over the tokens of the whole EP group: compare with the reference on them
        ref = {n: t.clone().requires_grad_(True) for n, t in full.items()}
        for q in layer.layout.ep_group_ranks(rank):
            xq, wq = _tokens(q)
            (moe_reference(xq, router, ref, K) * wq).sum().backward()
        for n in NAMES:
            for e in layer.layout.owned(rank):
                torch.testing.assert_close(getattr(layer, n)[e].grad, ref[n].grad[e], atol=1e-5, rtol=1e-5)
            assert all(getattr(layer, n)[e].numel() == 0 for e in set(range(E)) - set(layer.layout.owned(rank)))


def _check_round_trips(rank, full):
    out = []
    for a in (1, 2, 4):
        for b in (1, 2, 4):
            if a == b:
                continue
            la, lb = EPLayout(a, W, E), EPLayout(b, W, E)
            src = shard_experts(full, la, rank)
            new, st = reshard(src, la, lb, BUCKET)
            assert not any(src.values()), "source slices must be consumed"
            for n in NAMES:
                assert list(new[n]) == list(lb.owned(rank))
                assert all(torch.equal(new[n][e], full[n][e]) for e in new[n])
            assert st["bytes_moved"] == st["bytes_min"] == len(set(lb.owned(rank)) - set(la.owned(rank))) * 3 * SLICE
            assert st["peak_bytes"] <= max(st["from_bytes"], st["to_bytes"]) + BUCKET
            # once the switch has freed what it neither keeps nor sends: target + one bucket, both ways
            assert st["peak_switch_bytes"] <= st["to_bytes"] + BUCKET
            if b < a:  # growing: target + one bucket from the entry on
                assert st["peak_bytes"] <= st["to_bytes"] + BUCKET
            back, _ = reshard(new, lb, la, BUCKET)
            ref = shard_experts(full, la, rank)
            assert all(torch.equal(back[n][e], ref[n][e]) for n in NAMES for e in ref[n])
            # the naive switch ends the same, but moves more and holds a redundant full copy
            naive, nst = reshard_naive(shard_experts(full, la, rank), la, lb)
            assert all(torch.equal(naive[n][e], new[n][e]) for n in NAMES for e in new[n])
            assert nst["bytes_moved"] > st["bytes_moved"]
            if b < a:
                assert nst["peak_bytes"] > st["to_bytes"] + BUCKET
            out.append((a, b, st["bytes_moved"], st["rounds"]))
    return out


def _train(rank, router, full, groups, switch):
    layer = _layer(2, router, full, groups)
    dp_group = groups[2][1]
    params = list(layer.parameters())
    opt = torch.optim.Adam(params, lr=1e-2)
    for step in range(3):
        x, wt = _tokens(rank, step)
        (layer(x) * wt).sum().backward()
        dist.all_reduce(layer.router.weight.grad)             # replicated router: sum over the world
        for p in params[1:]:
            if p.grad is not None:
                dist.all_reduce(p.grad, group=dp_group)       # experts: sum over the block's replicas
        opt.step()
        opt.zero_grad(set_to_none=True)
        if switch:
            train_layout, P = layer.layout, (4, 1, 4)[step]
            with torch.no_grad():
                y_train = layer(x)
                layer.switch(EPLayout(P, W, E), groups[P][0], BUCKET)
                torch.testing.assert_close(layer(x), y_train, atol=1e-5, rtol=1e-5)  # rollout layout
                layer.switch(train_layout, groups[2][0], BUCKET)
    assert [id(p) for p in layer.parameters()] == [id(p) for p in params]
    return {k: v.clone() for k, v in layer.state_dict().items()}


def _check_dense_state(rank):
    """dense_state_dict of a whole model made expert-parallel (and FSDP2-sharded, experts left out, as
    train_grpo builds it) is the dense model's state_dict, names, order and bits, under every training EP
    degree a world of 4 takes, in the training layout and in the rollout layout after a switch."""
    import copy
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from model import ModelConfig, Policy
    torch.manual_seed(0)
    dense = Policy(ModelConfig(d_model=16, n_heads=2, n_experts=4, d_expert=8, max_seq_len=16))
    want = dense.state_dict()
    mesh = init_device_mesh("cpu", (W,))
    for P in (1, 2, 4):
        model, engine = copy.deepcopy(dense), copy.deepcopy(dense).requires_grad_(False)
        ep = ExpertParallel(P, 1, W, 4, bucket_bytes=BUCKET, timeout_s=60)
        ep.apply(model, engine)
        ignored = set(ep.params(model))
        for block in model.blocks:
            fully_shard(block, mesh=mesh, ignored_params=ignored)
        fully_shard(model, mesh=mesh, ignored_params=ignored)
        _same_state(dense_state_dict(model), want, f"EP {P}, training layout")
        ep.to_rollout()
        _same_state(dense_state_dict(model), want, f"EP {P}, rollout layout")
        ep.to_train()
        _same_state(dense_state_dict(model), want, f"EP {P}, training layout again")


def _same_state(got, want, where):
    assert list(got) == list(want), f"{where}: names or order differ: {list(got)}"
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differ, f"{where}: {differ} differ from the dense model's"


def _check_a_layout_over_part_of_the_job(rank):
    """EP 2 -> 1 over ranks [1, 3] of 4 (a subgroup of a larger job): exact against the reference, and
    ranks 0 and 2 take no part beyond creating the groups (new_group is collective)."""
    router, full = _dense(3)
    two, one = EPLayout(2, 2, E, ranks=(1, 3)), EPLayout(1, 2, E, ranks=(1, 3))
    g2, (g1, both) = new_groups(two, timeout_s=60)[0], new_groups(one, timeout_s=60)  # EP 1's DP group: [1, 3]
    if rank not in (1, 3):
        assert g2 is None and g1 is None
        return
    moe = types.SimpleNamespace(router=types.SimpleNamespace(weight=router), top_k=K, **full)
    layer = EPMoE.from_dense(moe, two, g2)
    assert list(layer.layout.owned(layer.rank)) == list(range(4 * (rank // 2), 4 * (rank // 2) + 4))
    x, _ = _tokens(rank)
    want = moe_reference(x, router, full, K)
    torch.testing.assert_close(layer(x), want, atol=1e-5, rtol=1e-5)
    try:  # the agreement collective needs the group of the layout's ranks: refused before any collective
        layer.switch(one, g1, BUCKET)
        raise AssertionError("a switch over part of the job without world_group was accepted")
    except ValueError as e:
        assert "needs world_group" in str(e) and layer.layout.ep == 2
    layer.switch(one, g1, BUCKET, world_group=both)
    torch.testing.assert_close(layer(x), want, atol=1e-5, rtol=1e-5)
    assert all(torch.equal(layer.w_up[e], full["w_up"][e]) for e in range(E))  # every expert, moved exactly


def _all_checks(rank, world_size):
    router, full = _dense()
    groups = {P: new_groups(EPLayout(P, W, E), timeout_s=60) for P in (1, 2, 4)}
    _check_a_layout_over_part_of_the_job(rank)
    _check_dense_state(rank)
    _check_exact(rank, router, full, groups)
    trips = _check_round_trips(rank, full)
    plain, switched = _train(rank, router, full, groups, False), _train(rank, router, full, groups, True)
    assert plain.keys() == switched.keys()
    assert all(torch.equal(plain[k], switched[k]) for k in plain)
    e0 = EPLayout(2, W, E).owned(rank)[0]
    assert not torch.equal(plain[f"w_gate.{e0}"], full["w_gate"][e0])  # training did move the experts
    moe = types.SimpleNamespace(router=types.SimpleNamespace(weight=router), top_k=K, **full)
    for wrong in (groups[2][1], None):  # EP 2's DP group has the EP group's size; None is the world (4)
        try:  # refused before any collective: it would route rows to the wrong experts, silently
            EPMoE.from_dense(moe, EPLayout(2, W, E), wrong)
            raise AssertionError("a wrong EP group was accepted")
        except ValueError as e:
            assert f"not rank {rank}'s EP group {EPLayout(2, W, E).ep_group_ranks(rank)}" in str(e)
    layer = _layer(2, router, full, groups)
    try:
        layer.switch(EPLayout(4, W, E), groups[2][0], BUCKET)
        raise AssertionError("switch() accepted the old layout's group")
    except ValueError as e:
        assert "EP group" in str(e) and layer.layout.ep == 2  # nothing moved
    return trips


def test_ep_exact_round_trips_and_training_with_switches():
    trips = run_distributed(_all_checks, world_size=W, timeout_s=180)
    # 4 -> 1: every rank receives the 6 experts it lacks; 1 -> 4 moves nothing (layouts nest)
    per_pair = {(a, b): sum(rank_trips[i][2] for rank_trips in trips) for i, (a, b, _, _) in enumerate(trips[0])}
    assert per_pair[(4, 1)] == W * 6 * 3 * SLICE and per_pair[(1, 4)] == 0
    assert per_pair[(2, 1)] == W * 4 * 3 * SLICE and per_pair[(4, 2)] == W * 2 * 3 * SLICE


class _FusedLinearMoE(torch.nn.Module):
    """A codebase's own fused MoE, its stacks in nn.Linear orientation (E, out, in), square (H == D)."""

    def __init__(self, e, d):
        super().__init__()
        self.router, self.top_k = torch.nn.Linear(d, e, bias=False), K
        self.w_gate, self.w_up, self.w_down = (torch.nn.Parameter(torch.randn(e, d, d) / d ** 0.5) for _ in range(3))

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])                                                      # (N, D)
        top_p, top_e = torch.softmax(self.router(flat), -1).topk(self.top_k, -1)
        top_p = top_p / top_p.sum(-1, keepdim=True)
        out = torch.zeros_like(flat)
        for n in range(len(flat)):
            for p, e in zip(top_p[n], top_e[n].tolist()):
                h = F.silu(F.linear(flat[n], self.w_gate[e])) * F.linear(flat[n], self.w_up[e])
                out[n] += p * F.linear(h, self.w_down[e])
        return out.view_as(x)


def test_a_layer_whose_own_forward_computes_otherwise_is_refused():
    """Found by its attributes, a square stack in nn.Linear orientation fits every shape check, and the EP layer
    would compute something else (off by tens). A probe through its own forward refuses it, naming the gap."""
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="_FusedLinearMoE's own forward and moe_switch.py's MoE of its weights differ by"):
        EPMoE.from_dense(_FusedLinearMoE(E, D), EPLayout(1, 1, E))
    fused = _FusedLinearMoE(E, D)
    dense = DenseMoE(fused.router.weight.detach(), fused.w_gate.detach(), fused.w_up.detach(), fused.w_down.detach(),
                     top_k=K, orientation="nn.Linear")
    x = torch.randn(5, D)
    torch.testing.assert_close(EPMoE.from_dense(dense, EPLayout(1, 1, E))(x), fused(x), atol=1e-5, rtol=1e-5)


def test_an_engine_made_expert_parallel_keeps_its_routers():
    """ExpertParallel.apply alone, with no fusion.py to load the engine's weights: the engine's EP layers
    take the routers of the dense layers they replace (they used to be left uninitialised), so after
    to_rollout the engine computes what the dense model does."""
    import copy
    layers = (DenseMoE(r, *f.values(), top_k=K, orientation="x @ w") for r, f in (_dense(1), _dense(2)))
    dense = torch.nn.Sequential(*layers)
    model, engine = copy.deepcopy(dense), copy.deepcopy(dense).requires_grad_(False)
    routers = [m.router.weight for m in engine]
    ep = ExpertParallel(1, 1, 1, E, bucket_bytes=1 << 20)
    ep.apply(model, engine)
    assert all(isinstance(m, EPMoE) and m.router.weight is r for m, r in zip(engine, routers))
    x, _ = _tokens(0)
    with torch.no_grad():
        ep.to_rollout()
        torch.testing.assert_close(engine(x), dense(x), atol=1e-5, rtol=1e-5)
        ep.to_train()
        torch.testing.assert_close(model(x), dense(x), atol=1e-5, rtol=1e-5)


def test_a_layer_refused_at_to_rollout_leaves_every_layer_unswitched():
    """ExpertParallel.to_rollout checks every layer before any moves. The second layer's expert slices are larger
    than the bucket, the first's fit: the switch raises, and the first layer is not switched either (the engine's
    experts still empty), as FusedActor's undo assumes of a mover that raised."""
    import copy
    g = torch.Generator().manual_seed(0)
    randn = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    layers = [DenseMoE(randn(E, D), randn(E, D, h), randn(E, D, h), randn(E, h, D), top_k=K, orientation="x @ w")
              for h in (H, 2 * H)]
    model = torch.nn.Sequential(*layers)
    engine = copy.deepcopy(model).requires_grad_(False)
    ep = ExpertParallel(1, 1, 1, E, bucket_bytes=SLICE)  # the first layer's slice, not the second's
    ep.apply(model, engine)
    with pytest.raises(ValueError, match="bucket"):
        ep.to_rollout()
    assert all(p.numel() == 0 for m in ep.engine_layers for n in NAMES for p in getattr(m, n))
    assert all(p.numel() > 0 for m in ep.model_layers for n in NAMES for p in getattr(m, n))


def _disagree_then_leave(rank, world_size):
    """Rank 0 asks EP 2 -> 1, rank 1 EP 2 -> 2: both raise, nothing moved, the next forward runs. Then rank 1
    leaves and rank 0 alone switches a layer EP 1 -> 2 (which moves no bytes): it raises, not returns."""
    router, full = _dense(4)
    groups = {P: new_groups(EPLayout(P, 2, E), timeout_s=5) for P in (1, 2)}
    moe = types.SimpleNamespace(router=types.SimpleNamespace(weight=router), top_k=K, **full)
    layer = EPMoE.from_dense(moe, EPLayout(2, 2, E), groups[2][0])
    P = (1, 2)[rank]
    try:
        layer.switch(EPLayout(P, 2, E), groups[P][0], BUCKET)
        raise AssertionError("ranks asking for different targets were let through")
    except ValueError as e:
        disagreement = str(e)
    assert layer.layout.ep == 2 and all(torch.equal(layer.w_up[e], full["w_up"][e]) for e in layer.layout.owned(rank))
    x, _ = _tokens(rank)
    torch.testing.assert_close(layer(x), moe_reference(x, router, full, K), atol=1e-5, rtol=1e-5)
    if rank == 1:
        return disagreement, None  # never calls the next switch
    alone = EPMoE.from_dense(moe, EPLayout(1, 2, E), groups[1][0])
    try:
        alone.switch(EPLayout(2, 2, E), groups[2][0], BUCKET)
        raise AssertionError("a switch called on one rank of two returned")
    except RuntimeError as e:
        return disagreement, str(e)


def test_ranks_that_disagree_on_the_target_raise_and_a_rank_left_out_makes_the_other_raise():
    (said0, left_out), (said1, _) = run_distributed(_disagree_then_leave, world_size=2, timeout_s=90, pg_timeout_s=5)
    for said in (said0, said1):
        assert "disagree on the switch (rank 0: EP 2 -> 1, rank 1: EP 2 -> 2)" in said, said
    assert "every rank of the layout (ranks [0, 1]) must call switch() together" in left_out, left_out


def test_single_process_world_of_one_matches_reference():
    router, full = _dense(1)
    x, _ = _tokens(0)
    layer = EPMoE.from_dense(types.SimpleNamespace(router=types.SimpleNamespace(weight=router), top_k=K, **full),
                             EPLayout(1, 1, E))
    torch.testing.assert_close(layer(x.view(1, -1, D)), moe_reference(x, router, full, K).view(1, -1, D),
                               atol=1e-5, rtol=1e-5)


def test_bad_layouts_and_buckets_fail_before_any_collective():
    assert not dist.is_initialized()  # so any collective attempted would raise a different error
    with pytest.raises(ValueError, match=r"EP degree 3 .*n_experts 8"):
        EPLayout(3, 6, 8)
    with pytest.raises(ValueError, match=r"EP degree 4 .*world size 6"):
        EPLayout(4, 6, 8)
    with pytest.raises(ValueError, match="world size 4"):
        new_groups(EPLayout(2, 4, 8))
    router, full = _dense()
    layer = EPMoE.from_dense(types.SimpleNamespace(router=types.SimpleNamespace(weight=router), top_k=K, **full),
                             EPLayout(1, 1, E))
    with pytest.raises(ValueError, match=f"bucket_bytes 100 is smaller than one expert slice \\({SLICE}"):
        layer.switch(EPLayout(1, 1, E), None, bucket_bytes=100)
    assert all(torch.equal(layer.w_up[e], full["w_up"][e]) for e in range(E))  # nothing lost on failure
    with pytest.raises(ValueError, match=r"ranks \(3, 1\) must be 2 distinct global ranks in increasing order"):
        EPLayout(2, 2, E, ranks=(3, 1))


def test_a_dense_moe_not_in_this_layout_is_refused_by_name():
    """A transposed w_down, a top_k above E, or a model without dense MoE layers: a ValueError naming the
    layout wanted, before anything is built."""
    router, full = _dense()
    dense = dict(router=types.SimpleNamespace(weight=router), top_k=K, **full)
    with pytest.raises(ValueError, match=r"w_down \(E, H, D\).*'w_down': \(8, 16, 24\)") as err:
        EPMoE.from_dense(types.SimpleNamespace(**{**dense, "w_down": full["w_down"].transpose(1, 2)}),
                         EPLayout(1, 1, E))
    assert "from_linear" in str(err.value)
    with pytest.raises(ValueError, match="top_k 9"):
        DenseMoE(router, *full.values(), top_k=9, orientation="x @ w")
    with pytest.raises(ValueError, match="no dense MoE layer"):
        ExpertParallel(1, 1, 1, E, 1 << 20).apply(torch.nn.Linear(2, 2))


def _cuda_peak(rank, world_size):
    import datetime
    torch.cuda.set_device(rank)
    nccl = dist.new_group(backend="nccl", timeout=datetime.timedelta(seconds=60))  # gloo p2p is CPU-only
    big = 64 * 1024                                            # bytes per slice: whole allocator blocks
    full = {n: torch.randn(E, big // 4, device="cuda") for n in NAMES}
    la, lb = EPLayout(2, 2, E), EPLayout(1, 2, E)
    src = shard_experts(full, la, rank)
    del full
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated() - 3 * (E // 2) * big  # everything but the source slices
    torch.cuda.reset_peak_memory_stats()
    new, st = reshard(src, la, lb, bucket_bytes=4 * big, group=nccl)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, st


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL p2p between distinct devices)")
def test_cuda_peak_memory_within_target_plus_bucket():
    for peak, st in run_distributed(_cuda_peak, world_size=2):
        assert peak <= st["to_bytes"] + st["bucket_bytes"], (peak, st)
