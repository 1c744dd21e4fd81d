"""options/eplb.py and moe_switch.py's placements: the packing, exactness at world 4, the switch's bytes, a run."""
import copy
import json
import types

import numpy as np
import pytest
import torch

from moe_switch import EPLayout, EPMoE, moe_reference, reshard, shard_experts
from options import eplb
from options.dense_moe import DenseMoE
from plumbing.checkpoint import dense_state_dict
from plumbing.moe_switch_details import new_groups
from tests.distributed import run_distributed

E, D, H, K, W = 8, 16, 24, 2, 4
NAMES = ("w_gate", "w_up", "w_down")
SLICE = D * H * 4            # bytes of one expert's w_gate (= w_up = w_down) in float32
BUCKET = 2 * SLICE           # several rounds per switch


def test_the_packing_holds_every_expert_on_distinct_rows_and_balances_a_skewed_load():
    rng = np.random.default_rng(0)
    for trial in range(300):
        P = int(rng.choice([2, 4, 8]))
        n_experts = P * int(rng.choice([1, 2, 4]))
        slots = n_experts // P + int(rng.integers(0, n_experts - n_experts // P + 1))
        load = rng.lognormal(0, float(rng.choice([0.5, 2.0])), n_experts) * (rng.random(n_experts) > 0.2)
        rows = eplb.placement_by_load(load, P, slots)
        copies = eplb.replicate(load, P, slots)
        assert len(rows) == P and all(len(r) == slots and len(set(r)) == slots for r in rows), (trial, rows)
        assert all(sum(e in r for r in rows) == copies[e] for e in range(n_experts)), (trial, rows, copies)
        eplb.PlacedLayout(P, P, n_experts, placement=rows)  # the layout's own checks take it
    load = np.array([100, 90, 80, 70] + [5] * 12)  # 16 experts, 4 hot: blocks put them all on rank 0
    for P in (2, 4):
        blocks = load.reshape(P, -1).sum(1)
        rows = eplb.placement_by_load(load, P, 16 // P + 1)
        copies = eplb.replicate(load, P, 16 // P + 1)
        packed = [sum(load[e] / copies[e] for e in r) for r in rows]
        assert eplb.balancedness(blocks) < 0.6 and eplb.balancedness(packed) > 0.9, (P, blocks, packed)
    # the fewest copies that reach the target: none where packing alone does, else up to the redundant slots
    assert [len(r) for r in eplb.fewest_copies(load, 2, 8, 2, 0.95)] == [8, 8]
    assert [len(r) for r in eplb.fewest_copies(load, 4, 4, 8, 0.95)] == [5, 5, 5, 5]
    assert [len(r) for r in eplb.fewest_copies(load, 4, 4, 4, 2.0)] == [5, 5, 5, 5]  # out of reach: the most
    assert list(eplb.replicate([1, 9, 3, 9], 2, 3)) == [1, 2, 1, 2]  # the extra slots go to the hottest
    with pytest.raises(ValueError, match="at most once a row"):
        eplb.replicate([1, 2], 2, 3)  # 6 slots, 2 experts: some row would hold an expert twice


def test_bad_placements_are_refused_by_the_layout():
    for bad in (((0, 1), (2, 3)), ((0, 1, 2, 3), (4, 5, 6, 6)), ((0, 1, 2), (3, 4, 5, 6, 7)), [(0, 1, 2, 3)] * 2,
                ((0, 1, 2, 3),), ((0, 1, 2, 3, 4), (4, 5, 6, 7, 7)), ((1, 0, 2, 3), (4, 5, 6, 7))):
        with pytest.raises(ValueError, match="placement"):
            eplb.PlacedLayout(2, 4, E, placement=bad)


def test_copies_share_their_experts_rows_and_each_rank_starts_at_another():
    layout = eplb.PlacedLayout(2, 2, 4, placement=((0, 1, 2), (0, 2, 3)))  # experts 0 and 2 copied: slots 0, 3 and 2, 4
    rows = torch.tensor([0] * 7 + [2] * 4 + [1, 3])
    for rank, want in ((0, [4, 1, 2, 3, 2, 1]), (1, [3, 1, 2, 4, 2, 1])):
        assert torch.bincount(layout.slot_of(rows, rank), minlength=6).tolist() == want
    assert torch.equal(EPLayout(2, 2, 4).slot_of(rows), rows)  # the blocks: a slot is its expert


def _dense(seed=0):
    g = torch.Generator().manual_seed(seed)
    full = {n: torch.randn(E, *s, generator=g) / s[0] ** 0.5 for n, s in zip(NAMES, ((D, H), (D, H), (H, D)))}
    return torch.randn(E, D, generator=g), full


def _placement(P, slots, seed):
    load = np.random.default_rng(seed).lognormal(0, 2, E)
    return eplb.placement_by_load(load, P, slots)


def _exact_under_placements(rank, router, full):
    """Every placement, copies included, computes the dense MoE's output (forward, no grads)."""
    moe = types.SimpleNamespace(router=types.SimpleNamespace(weight=router), top_k=K, **full)
    for P, slots in ((2, 4), (2, 5), (4, 2), (4, 3), (4, 4)):
        layout = eplb.PlacedLayout(P, W, E, placement=_placement(P, slots, seed=P * 10 + slots))
        group = new_groups(layout, timeout_s=60)[0]
        layer = EPMoE.from_dense(moe, layout, group)
        x = torch.randn(7 + 5 * rank, D, generator=torch.Generator().manual_seed(rank))
        with torch.no_grad():
            torch.testing.assert_close(layer(x), moe_reference(x, router, full, K), atol=1e-5, rtol=1e-5)


def _switch_through_placements(rank, full):
    """Blocks -> a placement with copies -> another -> blocks: exact bytes, the minimum moved, and at most
    max(source, target) + one bucket held."""
    train, wide = EPLayout(2, W, E), EPLayout(4, W, E)
    first = eplb.PlacedLayout(4, W, E, placement=_placement(4, 3, seed=1))
    second = eplb.PlacedLayout(4, W, E, placement=_placement(4, 3, seed=2))
    more = eplb.PlacedLayout(2, W, E, placement=_placement(2, 6, seed=3))  # more experts a rank than training's 2
    experts, stats = shard_experts(full, train, rank), []
    for src, dst in ((train, first), (first, second), (second, train), (train, wide), (wide, more), (more, wide)):
        experts, st = reshard(experts, src, dst, BUCKET)
        assert all(list(experts[n]) == sorted(dst.owned(rank)) for n in NAMES)
        assert all(torch.equal(experts[n][e], full[n][e]) for n in NAMES for e in experts[n])
        assert st["bytes_moved"] == st["bytes_min"] == len(set(dst.owned(rank)) - set(src.owned(rank))) * 3 * SLICE
        assert st["peak_extra_bytes"] <= BUCKET  # max(source, target) + one bucket, placements or blocks
        stats.append(st["bytes_moved"])
    return stats


def _skewed_stack(seed=0, layers=2):
    """DenseMoE layers whose routers favour experts 0 and 1 (their rows scaled up): blocks give rank 0 the most."""
    torch.manual_seed(seed)
    out = []
    for _ in range(layers):
        router = torch.randn(E, D)
        router[:2] *= 8
        w = [torch.randn(E, D, H) / 4, torch.randn(E, D, H) / 4, torch.randn(E, H, D) / 4]
        out.append(DenseMoE(router, *w, top_k=K, orientation="x @ w"))
    return torch.nn.Sequential(*out)


def _balanced_rollouts(rank):
    """BalancedExperts (ExpertParallel with a Balancer): the first rollout in blocks, the next by load; the engine
    computes the dense model's output under both, the balance rises, and the switch back restores the experts bit
    for bit."""
    dense = _skewed_stack()
    model, engine = copy.deepcopy(dense), copy.deepcopy(dense).requires_grad_(False)
    ep = eplb.BalancedExperts(train_ep=2, infer_ep=4, world_size=W, n_experts=E, bucket_bytes=BUCKET, timeout_s=60,
                              balancer=eplb.Balancer(redundant=4))
    ep.apply(model, engine)
    figures = []
    with torch.no_grad():
        for turn in range(3):
            ep.to_rollout()
            x = torch.randn(64, D, generator=torch.Generator().manual_seed(10 * turn + rank))
            torch.testing.assert_close(engine(x), dense(x), atol=1e-5, rtol=1e-5)
            ep.to_train()
            placed = getattr(ep.engine_layers[0].layout, "placement", None)  # None: the blocks, an EPLayout
            figures.append((ep.stats["moe/rollout_balancedness"], placed,
                            ep.stats["ep/to_rollout_bytes_moved"] == ep.stats["ep/to_rollout_bytes_min"]))
    state = dense_state_dict(model)
    assert all(torch.equal(state[k], v) for k, v in dense.state_dict().items())
    return figures


def _disagreeing_placements(rank, router, full):
    """Ranks that ask for different placements of one EP degree all raise, naming them, and nothing moves."""
    moe = types.SimpleNamespace(router=types.SimpleNamespace(weight=router), top_k=K, **full)
    two = EPLayout(2, W, E)
    group = new_groups(two, timeout_s=60)[0]
    layer = EPMoE.from_dense(moe, two, group)
    rows = ((0, 2, 4, 6), (1, 3, 5, 7)) if rank % 2 else ((0, 1, 2, 7), (3, 4, 5, 6))
    mine = eplb.PlacedLayout(2, W, E, placement=rows)
    with pytest.raises(ValueError, match=r"disagree on the switch .*\(placements 0 -> \d+\)"):
        layer.switch(mine, group, BUCKET)
    assert layer.layout == two and all(layer.w_up[e].numel() for e in two.owned(rank))


def _all(rank, world_size):
    router, full = _dense()
    _disagreeing_placements(rank, router, full)
    _exact_under_placements(rank, router, full)
    return _switch_through_placements(rank, full), _balanced_rollouts(rank)


def test_placements_compute_the_dense_moe_switch_exactly_and_balance_a_skewed_router():
    out = run_distributed(_all, world_size=W, timeout_s=180)
    for moved, figures in out:
        assert figures == out[0][1]  # every rank: the same loads, the same placement
    (before, blocks, _), (after, placed, _), _ = out[0][1]
    assert blocks is None and placed is not None and all(same for *_, same in out[0][1])
    assert before < 0.6 and after > 0.85, (before, after)
    assert sum(m[0] for m, _ in out) > 0  # the blocks -> placement switch moved experts


def test_eplb_flags_are_checked_before_any_process_group():
    from plumbing.config import Config, validate
    for flags, text in ((dict(eplb=True, train_ep=2, infer_ep=1), "--infer-ep >= 2"),
                        (dict(eplb_redundant=2, train_ep=2, infer_ep=2), "needs --eplb 1"),
                        (dict(eplb=True, train_ep=2, infer_ep=2, eplb_redundant=3), "multiple of --infer-ep 2")):
        with pytest.raises(ValueError, match=text):
            validate(Config(device="cpu", **flags), 2)


def _train(rank, world_size, out_dir, overrides):
    from tests.test_train_grpo import _train_tiny
    return _train_tiny(rank, world_size, out_dir, overrides)


def test_a_run_with_balancing_trains_as_one_without_it(tmp_path, world_of_one):
    """World 2, EP 2 in training and in rollout, S = 0: the placement by load (an extra slot a rank) changes where
    the experts run, not what is trained; the figures reach the log."""
    from tests.test_train_grpo import assert_same_training
    p_one = world_of_one.params  # TINY's defaults at world 1 (tests/conftest.py)
    out = run_distributed(_train, world_size=2, timeout_s=240, args=(str(tmp_path / "eplb"), dict(
        train_ep=2, infer_ep=2, eplb=True)))
    assert torch.equal(out[0][1], out[1][1])
    assert_same_training(out[0][1], p_one, "EP 2 with --eplb 1")
    lines = [json.loads(l) for l in open(tmp_path / "eplb" / "metrics.jsonl")][1:]
    # step 1 places by the warm-up evaluation's loads; a record's training figures are the step before's
    assert all(l["ep/to_rollout_bytes_moved"] == l["ep/to_rollout_bytes_min"] > 0 for l in lines)
    assert all(0 < l["moe/rollout_balancedness"] <= 1 and sum(l["moe/rollout_expert_rows"]) > 0 for l in lines)
    assert all(0 < l["moe/train_balancedness"] <= 1 and sum(l["moe/train_expert_rows"]) > 0 for l in lines[1:])
