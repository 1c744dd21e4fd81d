"""fusion.py against a single-process reference: exactness of the inference layout, nothing lost across
switches, memory bounds, the separated push, bad input, the guards; the same from pipeline stages (PP 2 at
world 2, PP 2 x FSDP 2 at world 4). Here through the portable transport, Broadcasts;
tests/test_shm_transport.py runs the same checks through shared memory.

The multi-rank checks run in one gloo spawn per world size (1, 2, 4), and one per world size (2, 4) for the
pipeline stages: each spawn costs seconds of imports."""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fusion
from fusion import (ROLLOUT, TRAIN, FusedActor, HostOffloaded, held_bytes, plan_buckets,
                    rollout, weight_meta)
from model import ModelConfig, Policy, generate
from options import tensor_parallel
from options.offload_params import ShardsOffloaded
from options.tensor_parallel import TPLayout, engine as tp_engine
from options.push import push_weights
from tests.distributed import run_distributed

CFG = ModelConfig(vocab_size=14, d_model=32, n_layers=2, n_heads=4, n_experts=4, top_k=2, d_expert=32,
                  max_seq_len=48)
BUCKET = 20_000  # bytes: the largest weight, (4, 32, 32) float32, is 16 KiB; the model is ~136 KB
EOS = 1
LoadWeights = tensor_parallel.actor_class(FusedActor)  # each bucket to engine.load_weights (any TP)


def _tokens(seed, B=3, T=10):
    return torch.randint(2, CFG.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


def _train_model(world, lr=1e-2):
    """The same initial weights on every rank, FSDP2 over all ranks like train_grpo.py; AdamW."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = Policy(CFG)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def _backward(model, rank, step):
    tok = _tokens(100 * step + rank, B=2, T=12)                                  # (2, 12) this rank's batch
    logits = model(tok[:, :-1])                                                  # (2, 11, V)
    F.cross_entropy(logits.reshape(-1, CFG.vocab_size), tok[:, 1:].reshape(-1)).backward()


def _reference(model):
    """A plain single-process Policy holding the full current weights."""
    ref = Policy(CFG).eval()
    ref.load_state_dict({n: p.full_tensor() for n, p in model.named_parameters()}, strict=False)
    return ref


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _snapshot(model, opt):
    ps = list(model.parameters())
    return [_local(p).clone() for p in ps] + [_local(v).clone() for p in ps for _, v in sorted(opt.state[p].items())]


def _check_exact_and_memory(rank, world, model, opt, ref, connect=None):
    """Every TP degree that divides the world: inference logits == training logits, samples identical,
    no train-only bytes resident in ROLLOUT, peak extra <= one bucket (the naive switch exceeds it).
    connect(model): the transport of each actor (None: Broadcasts)."""
    tok, contexts = _tokens(7), [_tokens(8 + i, B=1, T=2 + 3 * i)[0] for i in range(4)]
    with torch.no_grad():
        want, train_logits = ref(tok), model(tok)                                # (3, 10, V)
    torch.testing.assert_close(train_logits, want, atol=1e-5, rtol=0)
    ref_gen = generate(ref, contexts, torch.arange(4) + 11, 12, EOS)
    out = {}
    for tp in [t for t in (1, 2, 4) if world % t == 0]:
        layout = TPLayout(world, tp, n_heads=CFG.n_heads)
        tp_group, _ = layout.new_groups(timeout_s=60)
        # TP 1: gathered in place into the engine, through buckets + load_weights, and all at once (the naive
        # switch: one bucket as large as the model, so that the bound's check has teeth); TP > 1: buckets +
        # load_weights, which cuts the TP pieces
        for kind in ("inplace", "bucket", "naive") if tp == 1 else ("bucket",):
            transport = connect(model) if connect else None
            cls = FusedActor if kind == "inplace" else LoadWeights
            actor = cls(model, opt, tp_engine(CFG, tp_group), bucket_bytes=1 << 30 if kind == "naive" else BUCKET,
                        transport=transport)
            assert actor.path == f"{'in place' if kind == 'inplace' else 'load_weights'}, " \
                                 f"{type(transport or fusion.Broadcasts()).__name__}"
            assert held_bytes(actor.engine.parameters()) == 0                   # TRAIN: no inference weights
            with rollout(actor) as engine:
                assert actor.phase == ROLLOUT
                torch.testing.assert_close(engine(tok), want, atol=1e-5, rtol=0)
                gen = generate(engine, contexts, torch.arange(4) + 11, 12, EOS)
                assert [t.tolist() for t in gen.tokens] == [t.tolist() for t in ref_gen.tokens]
                for a, b in zip(gen.logprobs, ref_gen.logprobs):
                    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
                # nothing train-only is resident: by the accounting, and by the storages themselves
                m = actor.metrics()
                assert m["mem/rollout_optim_bytes"] == 0 and m["mem/rollout_grads_bytes"] == 0
                assert all(_local(v).untyped_storage().nbytes() == 0
                           for st in opt.state.values() for v in st.values())
                assert m["mem/rollout_infer_bytes"] > 0
            assert actor.phase == TRAIN
            m = actor.metrics()
            assert m["mem/train_optim_bytes"] > 0 and m["mem/train_infer_bytes"] == 0
            out[(tp, kind)] = m["switch/peak_extra_bytes"]
            actor.close()  # its guards removed, its transport closed
    assert all(peak <= BUCKET for (_, kind), peak in out.items() if kind != "naive"), out
    assert out[(1, "inplace")] == 0, out  # no staging buffer beyond those counted
    assert out[(1, "naive")] > BUCKET, out  # the whole model gathered at once: the check has teeth
    model.reshard()
    return out


def _check_bit_identical(rank, world, offload_params, round_trips, connect=None):
    """TRAIN -> ROLLOUT -> TRAIN with grads set (before the step) and without (after it) changes nothing."""
    a, opt_a = _train_model(world)
    b, opt_b = _train_model(world)
    layout = TPLayout(world, 2 if world > 1 else 1, n_heads=CFG.n_heads)
    tp_group, _ = layout.new_groups(timeout_s=60)
    cls = tensor_parallel.actor_class(ShardsOffloaded if offload_params else FusedActor)  # options/offload_params.py
    actor = cls(a, opt_a, tp_engine(CFG, tp_group), bucket_bytes=BUCKET, transport=connect(a) if connect else None)
    for step in range(3):
        for model, opt in ((a, opt_a), (b, opt_b)):
            _backward(model, rank, step)
            if model is a:
                with rollout(actor):
                    if offload_params:
                        assert actor.metrics()["mem/rollout_params_bytes"] == 0
                    assert actor.metrics()["mem/rollout_grads_bytes"] == 0
                    # the rollout reuses the freed memory (a KV cache would): same sizes, filled with junk
                    junk = [torch.full((h.numel(),), 7, dtype=torch.uint8) for h in actor._hosts]
                    del junk
            opt.step()
            opt.zero_grad(set_to_none=True)
            if model is a:
                with rollout(actor):
                    pass
    for x, y in zip(_snapshot(a, opt_a), _snapshot(b, opt_b)):
        assert torch.equal(x, y)
    # many round trips: the same resident bytes as after the first ones, and no new host buffers
    after_one = {k: v for k, v in actor.metrics().items() if k.startswith("mem/")}
    hosts = [h.data_ptr() for h in actor._hosts]
    for _ in range(round_trips):
        with rollout(actor):
            pass
    assert {k: v for k, v in actor.metrics().items() if k.startswith("mem/")} == after_one
    assert [h.data_ptr() for h in actor._hosts] == hosts and actor.round_trips == 6 + round_trips
    return actor.metrics()


def _check_separated(rank, world):
    """Ranks 0, 1 train (FSDP over the two), ranks 2, 3 generate with TP 2: push_weights, bucket by bucket."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    trainers, gens = dist.new_group([0, 1]), dist.new_group([2, 3])
    push_group = dist.new_group([0, 2, 3])
    torch.manual_seed(0)
    ref, model, engine = Policy(CFG).eval(), None, None
    if rank < 2:
        model = copy.deepcopy(ref)
        mesh = DeviceMesh.from_group(trainers, "cpu")
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        engine = tp_engine(CFG, gens)
        for p in engine.parameters():
            p.data.zero_()
    sent = push_weights(model, engine, 0, push_group, BUCKET)  # meta: sent by trainer 0
    if engine is not None:
        tok = _tokens(7)
        with torch.no_grad():
            torch.testing.assert_close(engine(tok), ref(tok), atol=1e-5, rtol=0)
    return sent


def _check_one_rank_fails(rank, world, model, opt, connect=None):
    """engine.load_weights raises on rank 1 only, at its second bucket: rank 1 goes on joining the gather,
    the ranks agree on an ok flag at its end, and every rank raises (rank 1 its own error, the others
    RuntimeError) and is back in TRAIN, as it was, without waiting out a timeout; then a switch works."""
    actor = LoadWeights(model, opt, Policy(CFG), bucket_bytes=BUCKET, transport=connect(model) if connect else None)
    before, load, calls = _snapshot(model, opt), actor.engine.load_weights, []

    def failing(pairs):
        calls.append(1)
        if rank == 1 and len(calls) == 2:
            raise RuntimeError("engine out of memory")
        return load(pairs)
    actor.engine.load_weights = failing
    with pytest.raises(RuntimeError, match="engine out of memory" if rank == 1 else "another rank failed"):
        actor.to_rollout()
    assert actor.phase == TRAIN and held_bytes(actor.engine.parameters()) == 0
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(model, opt), before))
    actor.engine.load_weights = load
    with rollout(actor) as engine, torch.no_grad():
        torch.testing.assert_close(engine(_tokens(7)), _reference(model)(_tokens(7)), atol=1e-5, rtol=0)
    actor.close()


def _distributed(rank, world):
    model, opt = _train_model(world)
    _backward(model, rank, 0)
    opt.step()                       # real optimizer state, grads None: the state between two steps
    opt.zero_grad(set_to_none=True)
    out = {"peaks": _check_exact_and_memory(rank, world, model, opt, _reference(model))}
    if world == 2:
        _check_one_rank_fails(rank, world, model, opt)
    # 50 round trips where they are cheapest (2 ranks); the training shards offloaded too on 4
    out["metrics"] = _check_bit_identical(rank, world, offload_params=world == 4, round_trips=50 if world == 2 else 2)
    if world == 4:
        out["sent"] = _check_separated(rank, world)
    return out


def test_fusion_world_of_one():
    """World 1 in this process (a spawn costs seconds of imports): FSDP over one rank, TP 1."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        m = _distributed(0, 1)["metrics"]
    finally:
        dist.destroy_process_group()
    assert m["switch/bytes"] > 0 and m["switch/buckets"] > 1 and m["switch/peak_extra_bytes"] <= BUCKET


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_fusion_distributed(world):
    results = run_distributed(_distributed, world_size=world, timeout_s=300)
    m = results[0]["metrics"]
    assert m["switch/bytes"] > 0 and m["switch/buckets"] > 1 and "time/to_rollout_s" in m
    if world == 4:
        assert results[0]["sent"] > 0 and results[1]["sent"] == 0  # only trainer 0 broadcasts


# ----------------------------------------------------------------------------- single process, no spawn
def _plain_actor(offload_params=False, inplace=False, transport=None):
    """A single-process actor: through load_weights unless inplace (options/tensor_parallel.py's)."""
    torch.manual_seed(0)
    model = Policy(CFG)
    opt = torch.optim.AdamW(model.parameters())
    cls = ShardsOffloaded if offload_params else FusedActor  # options/offload_params.py
    cls = cls if inplace else tensor_parallel.actor_class(cls)
    return cls(model, opt, Policy(CFG), bucket_bytes=BUCKET, transport=transport)


def test_bad_layouts_name_their_sizes():
    with pytest.raises(ValueError, match="TP degree 2 does not divide the world size 3"):
        TPLayout(3, tp=2)
    with pytest.raises(ValueError, match="TP degree 4 does not divide n_heads 6"):
        TPLayout(8, tp=4, n_heads=6)
    with pytest.raises(ValueError, match="TP degree 3 must be 1, 2 or 4"):
        TPLayout(6, tp=3)
    # a layout for 4 ranks in a world of 1: refused before any collective (there is no process group)
    with pytest.raises(ValueError, match="layout world size 4 != process group size 1"):
        TPLayout(4, tp=2).new_groups()
    with pytest.raises(ValueError, match="bucket_bytes 1000 is smaller than weight"):
        plan_buckets(weight_meta(Policy(CFG)), 1000)


def test_wrong_phase_is_named():
    actor = _plain_actor()
    with pytest.raises(RuntimeError, match="to_train\\(\\) called in phase TRAIN"):
        actor.to_train()
    actor.to_rollout()
    with pytest.raises(RuntimeError, match="to_rollout\\(\\) called in phase ROLLOUT"):
        actor.to_rollout()
    state = actor.state_dict()
    actor.to_train()
    fresh = _plain_actor()
    fresh.load_state_dict(state)           # resumes in the saved phase, with the saved counters
    assert fresh.phase == ROLLOUT and fresh.round_trips == 0


class Renamed(torch.nn.Module):
    """An engine whose parameter names are not the model's (vLLM-style): load_weights maps them."""

    def __init__(self, report=True):
        super().__init__()
        self.inner, self.report = Policy(CFG), report

    def forward(self, *args):
        return self.inner(*args)

    def load_weights(self, pairs):
        self.inner.load_weights(pairs)
        return {"inner." + n for n, _ in pairs} if self.report else None


def test_the_engine_outside_rollout_a_custom_load_weights_and_renamed_engines():
    actor = _plain_actor()
    tok = _tokens(0)
    with pytest.raises(RuntimeError, match="the engine was called in phase TRAIN, where its weights are freed"):
        actor.engine(tok)
    calls, load = [], actor.engine.load_weights
    actor.engine.load_weights = lambda pairs: calls.append(1) or load(pairs)
    with rollout(actor) as engine:  # not in place unless asked: a load_weights of its own is always called
        engine(tok)
    assert calls and actor.path.startswith("load_weights")
    second = LoadWeights(actor.model, actor.optimizer, actor.engine, bucket_bytes=BUCKET)
    with pytest.raises(RuntimeError, match="the engine was called in phase TRAIN"):  # the first actor's hook, in TRAIN
        with rollout(second) as engine:
            engine(tok)
    actor.close()  # unhooked: the second actor drives the engine alone
    with rollout(second) as engine:
        torch.testing.assert_close(engine(tok), actor.model(tok))
    torch.manual_seed(0)
    model = Policy(CFG)
    want = model(tok)
    for report in (True, False):
        actor = LoadWeights(model, torch.optim.AdamW(model.parameters()), Renamed(report), bucket_bytes=BUCKET)
        if report:  # the names it loaded are its own: accepted, and it computes what the model does
            with rollout(actor) as engine:
                torch.testing.assert_close(engine(tok), want)
        else:
            with pytest.raises(ValueError, match="return the engine parameter names it loaded"):
                actor.to_rollout()
            assert actor.phase == TRAIN


def test_an_engine_weight_its_load_weights_skips_is_refused():
    """A loader that skips a weight would leave it re-allocated and never filled: to_rollout refuses,
    naming it, and TRAIN is as it was."""
    actor = _plain_actor(inplace=False)
    load = actor.engine.load_weights
    actor.engine.load_weights = lambda pairs: load([(n, t) for n, t in pairs if n != "head.weight"])
    with pytest.raises(ValueError, match=r"\['head.weight'\] were not loaded"):
        actor.to_rollout()
    assert actor.phase == TRAIN and held_bytes(actor.engine.parameters()) == 0


def test_an_fsdp1_model_is_refused_naming_fsdp2():
    """FSDP1 cannot be built on a CPU-only machine (it wants an accelerator): a bare instance of its class
    stands in, which is what the check looks at."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    model = Policy(CFG)
    fsdp1 = FullyShardedDataParallel.__new__(FullyShardedDataParallel)
    torch.nn.Module.__init__(fsdp1)
    model.wrapped = fsdp1
    with pytest.raises(ValueError, match=r"FSDP1 \(FullyShardedDataParallel\).*fully_shard"):
        FusedActor(model, torch.optim.AdamW(model.parameters()), Policy(CFG))


def test_a_failed_switch_leaves_train_intact():
    """load_weights fails midway (an engine out of memory, say): to_rollout raises, and TRAIN is as it was,
    the optimizer states back on the device and no engine weight left; a retry then works."""
    actor = _plain_actor(inplace=False)
    model, opt = actor.model, actor.optimizer
    _backward(model, 0, 0)
    opt.step()
    before = _snapshot(model, opt)
    load, calls = actor.engine.load_weights, []

    def failing(pairs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("engine out of memory")
        return load(pairs)
    actor.engine.load_weights = failing
    with pytest.raises(RuntimeError, match="engine out of memory"):
        actor.to_rollout()
    assert actor.phase == TRAIN and held_bytes(actor.engine.parameters()) == 0
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(model, opt), before))
    with rollout(actor):
        pass
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(model, opt), before))


def test_a_switch_that_fails_in_its_offload_or_a_mover_leaves_train_intact(monkeypatch):
    """A host buffer that cannot be allocated partway through the offload, or a mover that raises after the
    gather: to_rollout raises, and the optimizer states and grads are back on the device, bit for bit (the
    storages freed before the failure included), no engine weight left; the next round trip works."""
    actor = _plain_actor(inplace=False)
    model, opt = actor.model, actor.optimizer
    _backward(model, 0, 0)
    opt.step()
    _backward(model, 0, 1)  # grads too
    before = _snapshot(model, opt) + [p.grad.clone() for p in model.parameters()]
    empty, made = torch.empty, []

    def third_fails(*args, **kwargs):  # the offload's third host buffer
        made.append(1)
        if len(made) == 3:
            raise MemoryError("host buffer")
        return empty(*args, **kwargs)
    monkeypatch.setattr(torch, "empty", third_fails)
    with pytest.raises(MemoryError, match="host buffer"):
        actor.to_rollout()
    monkeypatch.setattr(torch, "empty", empty)
    now = lambda: _snapshot(model, opt) + [p.grad for p in model.parameters()]  # noqa: E731
    assert actor.phase == TRAIN and held_bytes(actor.engine.parameters()) == 0
    assert all(torch.equal(a, b) for a, b in zip(now(), before))

    class Mover:
        names, stats = (), {}

        def __init__(self, fails):
            self.fails, self.calls = fails, []

        def to_rollout(self):
            self.calls.append("to_rollout")
            if self.fails:
                raise RuntimeError("mover failed")

        def to_train(self):
            self.calls.append("to_train")
    first, second = Mover(fails=False), Mover(fails=True)
    actor.movers += [first, second]
    with pytest.raises(RuntimeError, match="mover failed"):
        actor.to_rollout()
    assert actor.phase == TRAIN and held_bytes(actor.engine.parameters()) == 0
    assert all(torch.equal(a, b) for a, b in zip(now(), before))
    assert first.calls == ["to_rollout", "to_train"] and second.calls == ["to_rollout"]  # the switched one back
    del actor.movers[-2:]
    with rollout(actor):
        pass
    assert all(torch.equal(a, b) for a, b in zip(now(), before))


def test_calls_that_would_read_freed_storages_raise_naming_the_phase():
    """In ROLLOUT, optimizer.step() (a forgotten to_train()), a backward (a step forgotten across the switch)
    and, under offload_params, the model's forward would read storages resized to 0: the process dies of
    SIGSEGV, with no error. Each raises instead, before it touches anything, and TRAIN goes on as before.
    zero_grad(set_to_none=False) and clipping find no grads (the actor holds them) and touch nothing."""
    actor = _plain_actor(offload_params=True)
    model, opt = actor.model, actor.optimizer
    _backward(model, 0, 0)
    opt.step()
    _backward(model, 0, 1)  # grads to offload
    tok = _tokens(1, B=2, T=12)
    loss = F.cross_entropy(model(tok[:, :-1]).reshape(-1, CFG.vocab_size), tok[:, 1:].reshape(-1))  # in TRAIN
    before = _snapshot(model, opt) + [p.grad.clone() for p in model.parameters()]
    actor.to_rollout()
    with pytest.raises(RuntimeError, match=r"optimizer.step\(\) was called in phase ROLLOUT, where the optimizer st"):
        opt.step()
    with pytest.raises(RuntimeError, match="a backward ran in phase ROLLOUT, where the grads are in host memory"):
        loss.backward()
    with pytest.raises(RuntimeError, match="the model was called in phase ROLLOUT, where its shards are in host"):
        model(tok)
    assert all(p.grad is None for p in model.parameters())  # held by the actor: nothing freed to touch
    opt.zero_grad(set_to_none=False)  # each crashed the process on the freed grads
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    actor.to_train()
    after = _snapshot(model, opt) + [p.grad.clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    opt.step()  # in TRAIN, all of it works
    model(tok).sum().backward()


def test_an_optimizer_built_before_fully_shard_is_refused():
    """fully_shard replaces the model's parameters: an optimizer built before it holds the old tensors, and the
    switch would move none of its state (nor would its steps train the model), without an error."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = Policy(CFG)
        opt = torch.optim.AdamW(model.parameters())
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        with pytest.raises(ValueError, match=r"the optimizer holds \d+ tensors that are not the model's parameters"):
            FusedActor(model, opt, Policy(CFG))
        FusedActor(model, torch.optim.AdamW(model.parameters()), Policy(CFG))
    finally:
        dist.destroy_process_group()


def test_placements_other_than_shard0_over_a_1d_mesh_are_refused():
    """Shard(0) over any 1-D mesh is a layout the switch builds from (all ranks, or a pipeline stage's); it names
    the weight and the placement of any other: Shard(1) or Replicate over a 1-D mesh, a 2-D mesh (HSDP's)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        one, two = init_device_mesh("cpu", (1,)), init_device_mesh("cpu", (1, 1))
        for mesh, placements in ((one, [Shard(1)]), (one, [Replicate()]), (two, [Replicate(), Shard(0)])):
            model = torch.nn.Linear(4, 4, bias=False)
            model.weight = torch.nn.Parameter(distribute_tensor(model.weight.detach(), mesh, placements))
            with pytest.raises(ValueError, match=rf"weight: placements .* on a {mesh.ndim}-D mesh .* expected Shard"):
                FusedActor(model, torch.optim.AdamW(model.parameters()), torch.nn.Linear(4, 4, bias=False))
    finally:
        dist.destroy_process_group()

def test_shards_a_transport_keeps_in_place_are_never_offloaded():
    """A storage in shared memory cannot be freed and grown back (torch crashes the process as it grows): a
    transport that keeps the shards there rules out offload_params when the actor is built, and offload()
    refuses such a storage before it moves anything."""
    class Keeping(fusion.Broadcasts):
        keeps_shards = True
    with pytest.raises(ValueError, match="offload_params=True frees the shards, which Keeping keeps in place"):
        _plain_actor(offload_params=True, transport=Keeping())
    assert _plain_actor(transport=Keeping()).path == "load_weights, Keeping"
    kept, shared = torch.ones(1000), torch.full((500,), 2.0).share_memory_()
    with pytest.raises(ValueError, match="in shared memory"):
        fusion.offload(fusion.storages([kept, shared]))
    assert kept.untyped_storage().nbytes() == 4000 and shared.untyped_storage().nbytes() == 2000
    assert bool((kept == 1).all()) and bool((shared == 2).all())


def test_a_bucket_is_freed_before_the_next_is_gathered(monkeypatch):
    """The bound "final weights + one bucket" needs every view of bucket k gone when bucket k + 1 is
    allocated; with offload_params the reported peak extra is still at most one bucket."""
    import weakref
    alive, views = [], tensor_parallel.bucket_views

    def tracked(bucket, device):
        assert not [r for r in alive if r() is not None], "a view of the previous bucket is still alive"
        flat, pairs = views(bucket, device)
        alive[:] = [weakref.ref(flat)] + [weakref.ref(t) for _, t in pairs]
        return flat, pairs
    monkeypatch.setattr(tensor_parallel, "bucket_views", tracked)
    for offload_params in (False, True):
        actor = _plain_actor(inplace=False, offload_params=offload_params)
        with rollout(actor):
            assert not [r for r in alive if r() is not None]
        assert len(actor.buckets) > 2 and 0 < actor.metrics()["switch/peak_extra_bytes"] <= BUCKET


def test_reference_model_lives_on_host_between_uses():
    torch.manual_seed(0)
    ref = Policy(CFG).eval()
    tok, want = _tokens(3), None
    with torch.no_grad():
        want = ref(tok)
    off = HostOffloaded(ref)
    assert held_bytes(ref.state_dict().values()) == 0
    for _ in range(3):
        with off.on_device() as module, torch.no_grad():
            assert held_bytes(ref.state_dict().values()) > 0
            assert torch.equal(module(tok), want)
        assert held_bytes(ref.state_dict().values()) == 0


# ----------------------------------------------------------------------------- CUDA (skipped without one)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_memory_allocated_pinned_offload_and_round_trips():
    """World 1 on NCCL: by torch.cuda.memory_allocated, ROLLOUT holds no optimizer state; the host buffers
    are pinned; the switch's peak stays within one bucket of its ends; 50 round trips change neither the
    resident bytes nor one bit of the parameters and optimizer state."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=dev)
    try:
        torch.manual_seed(0)
        model = Policy(CFG).to(dev)
        mesh = init_device_mesh("cuda", (1,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        tok = _tokens(5).to(dev)
        F.cross_entropy(model(tok[:, :-1]).reshape(-1, CFG.vocab_size), tok[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        for kind in ("inplace", "bucket"):
            cls = FusedActor if kind == "inplace" else LoadWeights
            actor = cls(model, opt, Policy(CFG).to(dev), bucket_bytes=BUCKET)
            optim_bytes = sum(v.nbytes for st in opt.state.values() for v in st.values() if torch.is_tensor(v))
            torch.cuda.synchronize()
            train_bytes = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            with rollout(actor) as engine:
                rollout_bytes = torch.cuda.memory_allocated()
                peak = torch.cuda.max_memory_allocated()
                infer_bytes = held_bytes(engine.parameters())
                assert all(h.is_pinned() for h in actor._hosts) and actor._hosts
                with torch.no_grad():
                    torch.testing.assert_close(engine(tok), _reference(model).to(dev)(tok), atol=1e-5, rtol=0)
            # what left the device is the optimizer state (allocator blocks round up to 512 bytes)
            assert abs(rollout_bytes - (train_bytes - optim_bytes + infer_bytes)) <= 512 * 64, \
                (kind, train_bytes, rollout_bytes, optim_bytes, infer_bytes)
            assert actor.metrics()["mem/rollout_optim_bytes"] == 0
            assert peak <= max(train_bytes, rollout_bytes) + BUCKET, (kind, peak, train_bytes, rollout_bytes)
            before = _snapshot(model, opt)
            after_one = torch.cuda.memory_allocated()
            for _ in range(50):
                with rollout(actor):
                    pass
            torch.cuda.synchronize()
            assert torch.cuda.memory_allocated() == after_one
            assert all(torch.equal(x, y) for x, y in zip(before, _snapshot(model, opt)))
    finally:
        dist.destroy_process_group()
