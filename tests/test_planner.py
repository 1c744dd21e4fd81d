"""The layout planner (options/planner.py): its byte counts equal the run's own, its machine checks, its refusals,
its command line alone in a folder, the separated and hybrid deployments' pricing, and --layout auto end to end."""
import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from options import layout_auto, planner
from plumbing.planner_details import ep_bytes, response_length, response_lengths, round_shape, switch_bytes
from plumbing.config import Config, resolve, validate
from tests.distributed import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H100 = os.path.join(ROOT, "bench", "machines", "h100x8.json")


def _one_step(rank, world_size, out_dir, overrides):
    from tests.test_train_grpo import _train_tiny
    overrides = dict(overrides, warmup_steps=0, steps=2, eval_every=1000, filter_groups=False)
    _train_tiny(rank, world_size, out_dir, overrides)  # at step 2's switch the Adam state exists


def _check_counts(tmp_path, world, overrides):
    """One RL step at `world` in this layout: the run's mem/* and switch byte counts (rank 0's) equal the
    planner's, which recomputes them from the shapes alone."""
    out = tmp_path / "run"
    run_distributed(_one_step, world_size=world, timeout_s=240, args=(str(out), overrides))
    rec = [json.loads(line) for line in open(out / "metrics.jsonl")][-1]
    from tests.test_train_grpo import TINY
    cfg = resolve(Config(**dict(TINY, **overrides)), world)
    model, lay, machine = layout_auto.model_of(cfg), layout_auto.layout_of(cfg), layout_auto._nominal(world)
    mem = planner.memory(model, machine, layout_auto.workload_of(cfg), lay)
    expected = {"switch/received_min_bytes": switch_bytes(model, machine, lay),
                "mem/train_params_bytes": mem["params"], "mem/train_optim_bytes": mem["optim"],
                "mem/rollout_params_bytes": mem["rollout_params"], "mem/rollout_infer_bytes": mem["infer"],
                "switch/peak_extra_bytes": mem["bucket"]}
    if lay.train_ep:
        expected["ep/to_rollout_bytes_moved"] = ep_bytes(model, machine, lay)
    assert {k: rec[k] for k in expected} == expected


def test_byte_counts_equal_the_runs_ep(tmp_path):
    """World 2, EP 2 in training and 1 in rollout (the default): the gather's least bytes, the experts moved, the
    shards, the Adam state and the engine's weights."""
    _check_counts(tmp_path, 2, dict(train_ep=2, infer_ep=1))


@pytest.mark.slow
@pytest.mark.parametrize("world, overrides", [
    (2, dict(train_ep=0, infer_tp=2)), (2, dict(train_ep=0, train_pp=2, micro_batches=2)),
    (4, dict(train_ep=2, infer_ep=4)), (4, dict(train_ep=4, infer_ep=1)), (4, dict(train_ep=0, infer_tp=4))],
    ids=["w2-tp2", "w2-pp2", "w4-ep2to4", "w4-ep4to1", "w4-tp4"])
def test_byte_counts_equal_the_runs(tmp_path, world, overrides):
    _check_counts(tmp_path, world, overrides)


def _machine(**changes):
    raw = json.load(open(H100))
    return planner.Machine.load(raw, **changes)


def test_bad_machines_are_refused():
    raw = json.load(open(H100))
    with pytest.raises(ValueError, match="bandwidth -1"):
        planner.Machine.load({**raw, "intra": {"latency_s": 1e-6, "bandwidth": -1}})
    with pytest.raises(ValueError, match="devices 12 must be .* a multiple of devices_per_node 8"):
        _machine(devices=12)
    with pytest.raises(ValueError, match="unknown machine fields"):
        planner.Machine.load({**raw, "speed": 2})
    with pytest.raises(ValueError, match=r"missing \['queue_s'\]"):  # a file older than the queue's stage
        planner.Machine.load({k: v for k, v in raw.items() if k != "queue_s"})
    with pytest.raises(ValueError, match="cores -1 must be an int >= 0"):
        _machine(cores=-1)
    with pytest.raises(ValueError, match="flops nan"):
        _machine(flops=float("nan"))
    model = planner.Model(14, 64, 2, 4, 4, 2, 128)
    work = planner.Workload(16, 8, 18.0, 18.0, 40)
    with pytest.raises(ValueError, match="no layout of 3 devices"):  # 16 prompts over 3 replicas: none divides
        planner.plan(model, _machine(devices=3, devices_per_node=3), work)
    with pytest.raises(ValueError, match="no layout fits: .* more than the 0.0 MiB"):
        planner.plan(model, _machine(memory_bytes=1000), work)


def test_bad_workloads_are_refused():
    for bad, match in [(dict(threshold=0), "threshold 0 must be in"), (dict(staleness=-1), "staleness -1 must be"),
                       (dict(staleness=True), "staleness True must be an int"),
                       (dict(chunk_steps=0), "chunk_steps 0 must be"),
                       (dict(lengths=(0, 3)), "lengths .* must be ints"),
                       (dict(lengths=(41,)), "in 1 .. max_new_tokens 40"),
                       (dict(deploy="split"),
                        "deploy 'split' must be one of colocated, colocated-all, separated, hybrid"),
                       (dict(deploy="hybrid", aux_ranks=0), "aux_ranks 0 must be an int >= 1"),
                       (dict(aux_ranks=1.5), "aux_ranks 1.5 must be an int")]:
        with pytest.raises(ValueError, match=match):
            planner.Workload(16, 8, 18.0, 18.0, 40, **bad)
    assert planner.Workload(16, 8, 18.0, 18.0, 40, lengths=[3, 5]).lengths == (3, 5)  # a list is kept as a tuple
    model = planner.Model(14, 64, 2, 4, 4, 2, 128)  # a deployment the machine cannot hold, by name
    with pytest.raises(ValueError, match=r"deploy separated needs an even number of devices \(got 3\)"):
        planner.plan(model, _machine(devices=3, devices_per_node=3), _work(deploy="separated"))
    with pytest.raises(ValueError, match=r"deploy hybrid needs more devices than aux_ranks 8 \(got 8\)"):
        planner.plan(model, _machine(), _work(deploy="hybrid", aux_ranks=8))


def test_the_plan_prices_the_pair():
    """The choice fits and is the fastest; every stage is priced; a wider machine is planned across its nodes."""
    model = planner.Model(14, 64, 2, 4, 4, 2, 128)
    work = planner.Workload(16, 8, 18.0, 18.0, 40)
    rows = planner.plan(model, _machine(), work)
    steps = [t["step"] for _, t, _, over in rows if over is None]
    assert rows[0][1]["step"] == min(steps) and rows[0][3] is None
    assert set(rows[0][1]) == {"rollout", "switch", "score", "queue", "reference", "train", "grad_sync", "step"}
    two_nodes = planner.plan(model, _machine(devices=16), work)
    assert any(lay.nodes == 2 for lay, *_ in two_nodes)  # HSDP across the 2 nodes is a candidate


def test_layout_flags_are_checked_before_any_process_group():
    validate(Config(layout="auto", deploy="separated"), 2)  # --layout auto keeps the deployment given
    validate(Config(layout="auto", deploy="hybrid", aux_ranks=1), 3)
    work = layout_auto.workload_of(Config(deploy="hybrid", aux_ranks=2))
    assert (work.deploy, work.aux_ranks) == ("hybrid", 2)
    assert layout_auto.workload_of(Config(deploy="hybrid")).aux_ranks == 1  # --aux-ranks's default
    with pytest.raises(ValueError, match="--device-memory-gib 0.0001: .* needs .* MiB a rank"):
        validate(Config(deploy="separated", device_memory_gib=0.0001), 2)
    with pytest.raises(ValueError, match="--device-memory-gib 0.0001: .* needs .* MiB a rank .*optim"):
        validate(Config(device_memory_gib=0.0001), 2)
    with pytest.raises(ValueError, match="--device-memory-gib -1.0 must be > 0"):
        validate(Config(device_memory_gib=-1.0), 2)
    validate(Config(device_memory_gib=1.0), 2)  # the default run fits in a GiB


def test_layout_auto_names_a_faster_deployment_but_keeps_its_own():
    """--layout auto plans the --deploy given, and names each other deployment this world runs that is predicted
    faster, with its best step; the fastest deployment names none; a deployment the world cannot run (the hybrid:
    16 prompts over 3 actor ranks) is never named."""
    machine = _machine(devices=4, devices_per_node=4)
    best = {}
    for deploy in ("colocated", "separated", "hybrid"):
        cfg = Config(layout="auto", deploy=deploy, aux_ranks=1 if deploy == "hybrid" else None)
        try:
            validate(dataclasses.replace(cfg, layout="manual"), 4)
        except ValueError:
            continue
        rows = planner.plan(layout_auto.model_of(cfg), machine, layout_auto.workload_of(cfg),
                            layout_auto.runnable(cfg, 4))
        best[deploy] = (cfg, rows[0][1]["step"])
    assert set(best) == {"colocated", "separated"}
    for deploy, (cfg, step) in best.items():
        named = layout_auto.faster_deployments(cfg, machine, step)
        assert named == [(d, s) for d, (_, s) in best.items() if s < step]  # the fastest: none
    assert len({s for _, s in best.values()}) == 2  # one of the two is named by the other


def test_the_planner_runs_alone(tmp_path):
    """Copied into a folder with nothing else but its companion (under plumbing/ there), its command line plans an
    8-GPU pair of nodes and prints the table and a JSON line."""
    shutil.copy(os.path.join(ROOT, "options", "planner.py"), tmp_path)
    (tmp_path / "plumbing").mkdir()
    shutil.copy(os.path.join(ROOT, "plumbing", "planner_details.py"), tmp_path / "plumbing")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the folder alone, not this repository
    done = subprocess.run([sys.executable, "planner.py", "--machine", H100, "--devices", "16", "--nodes", "2"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    last = json.loads(done.stdout.splitlines()[-1])
    assert last["candidates"] > 10 and "chosen" in done.stdout.splitlines()[2]


SMALL = planner.Model(14, 64, 2, 4, 4, 2, 128)
# priced alike on a deployment's ranks and on a colocated world of as many
SIDES = ("rollout", "score", "queue", "train", "grad_sync")


def _work(**changes):
    return planner.Workload(16, 8, 18.0, 18.0, 40, **changes)


@pytest.mark.parametrize("deploy, world, aux", [("separated", 4, None), ("separated", 8, None), ("hybrid", 3, 1),
                                                ("hybrid", 6, 2)])
def test_a_deployments_candidates_are_its_runs(deploy, world, aux):
    """The planner's own candidates for a deployment (no runnable filter) are layouts its run takes, by the run's own
    checks: separated, TP 1 and EP off (and neither PP nor HSDP); hybrid, TP and EP over the actor's ranks."""
    cfg = Config(deploy=deploy, aux_ranks=aux, warmup_batch=60)
    machine = _machine(devices=world, devices_per_node=world)
    lays = planner.candidates(layout_auto.model_of(cfg), machine, layout_auto.workload_of(cfg))
    check = layout_auto.runnable(cfg, world)
    assert lays and [lay for lay in lays if not check(lay)] == []
    assert all(lay.train_pp == 1 and lay.nodes == 1 for lay in lays)
    if deploy == "separated":
        assert {(lay.infer_tp, lay.train_ep) for lay in lays} == {(1, 0)}
    else:  # the engine cut and the experts spread over the actor's ranks, not the world's
        assert {lay.infer_tp for lay in lays} == {1, 2} | ({4} if world - aux == 4 else set())
        assert max(lay.train_ep for lay in lays) == world - aux


@pytest.mark.parametrize("S", [0, 1])
def test_separated_prices_each_side_on_its_ranks_and_overlaps_them_when_stale(S):
    """Separated at W = 8: each side's stages are a colocated world of 4's, the switch is the push. At S = 0 the
    step is the sum of the stages; at S = 1 the push and the slower side, so that while the generators are the slower
    a costlier training layout (more micro-batches) leaves the step as it is."""
    machine, four, work = _machine(), _machine(devices=4, devices_per_node=4), _work(staleness=S, deploy="separated")
    for lay in planner.candidates(SMALL, machine, work):
        t, c = planner.stages(SMALL, machine, work, lay), planner.stages(SMALL, four, _work(staleness=S), lay)
        assert {k: t[k] for k in SIDES + ("reference",)} == {k: c[k] for k in SIDES + ("reference",)}
        assert 0 < t["switch"] != c["switch"]  # no offload: the push
        parts = sum(v for k, v in t.items() if k != "step")
        generate, train = t["rollout"] + t["score"], t["queue"] + t["reference"] + t["train"] + t["grad_sync"]
        assert t["step"] == pytest.approx(parts if S == 0 else t["switch"] + max(generate, train))
        assert (t["step"] < parts - 1e-12) == (S > 0)
    one, eight = (planner.stages(SMALL, machine, work, planner.Layout(micro_batches=m)) for m in (1, 8))
    assert eight["train"] > one["train"] and eight["train"] + eight["reference"] < eight["rollout"]
    assert (eight["step"] == pytest.approx(one["step"])) == (S > 0)


def test_ranks_sharing_a_cpus_cores_compute_faster_while_the_other_side_waits():
    """4 ranks on 2 cores, measured all busy: separated at S = 0 runs a side of 2 at a time, so each of its ranks
    computes twice as fast (a core each); at S = 1 both sides compute at once, and with cores 0 (a device computes
    alone) nothing changes."""
    cpu = _machine(devices=4, devices_per_node=4, cores=2)
    for S, cores, faster in [(0, 2, 2.0), (1, 2, 1.0), (0, 0, 1.0)]:
        side = planner.actor_ranks(dataclasses.replace(cpu, cores=cores), _work(deploy="separated", staleness=S))
        assert side.devices == 2
        assert side.flops == pytest.approx(cpu.flops * faster) and side.step_s == pytest.approx(cpu.step_s / faster)
    assert planner.actor_ranks(cpu, _work()) == cpu  # colocated: every rank busy, as measured


def test_the_hybrid_actor_waits_for_its_reference_instead_of_computing_it():
    """Hybrid, K auxiliary ranks: the actor's stages are a colocated world of W - K's, less the reference forward.
    Its "reference" is the wait for the auxiliary ranks' columns: hidden behind the rollout at W = 8, K = 4 (less
    than the forward it replaces); where one auxiliary rank computes a long-prompt batch's reference for 4 actor
    ranks behind a 1-token rollout (a model large enough to be compute-bound), longer than an actor rank's forward."""
    big = planner.Model(32000, 2048, 16, 16, 16, 2, 2048)
    for model, world, aux, work in [(SMALL, 8, 4, _work(deploy="hybrid", aux_ranks=4)),
                                    (big, 5, 1, planner.Workload(16, 8, 2000.0, 1.0, 1, deploy="hybrid"))]:
        machine = _machine(devices=world, devices_per_node=world)
        actor = _machine(devices=world - aux, devices_per_node=world - aux)
        colocated = dataclasses.replace(work, deploy="colocated")
        for lay in planner.candidates(model, machine, work):
            t, c = planner.stages(model, machine, work, lay), planner.stages(model, actor, colocated, lay)
            assert {k: t[k] for k in SIDES + ("switch",)} == {k: c[k] for k in SIDES + ("switch",)}
            assert t["step"] == pytest.approx(c["step"] - c["reference"] + t["reference"])
            if world == 8:
                assert t["reference"] == 0 < c["reference"]  # hidden behind the rollout
        off = dataclasses.replace(work, reference=False)  # the KL term off: nothing to wait for
        assert planner.stages(model, machine, off, lay)["reference"] == 0
    lay = planner.Layout()  # TP 1, EP off, 4 micro-batches: 4 pieces on the auxiliary rank, its 16 groups
    t, c = planner.stages(big, machine, work, lay), planner.stages(big, actor, colocated, lay)
    assert t["reference"] > c["reference"] and t["reference"] > t["rollout"]


def _auto(rank, world_size, out_dir, deploy):
    from tests.test_train_grpo import TINY
    import train_grpo as T
    from plumbing.run import planned
    cfg = planned(Config(**dict(TINY, layout="auto", warmup_steps=0, steps=2, filter_groups=False,
                                out=out_dir, deploy=deploy)))
    T.train(cfg, out_dir=out_dir)
    return {f: getattr(cfg, f) for f in layout_auto.FIELDS} | {"layout": cfg.layout}


@pytest.mark.slow
@pytest.mark.parametrize("deploy", ["colocated", "separated"])
def test_layout_auto_runs_its_choice(tmp_path, deploy):
    """World 2: every rank measures, every rank makes the same choice, and the run trains in it (separated: one
    trainer, one generator)."""
    out = run_distributed(_auto, world_size=2, timeout_s=300, args=(str(tmp_path / "auto"), deploy))
    assert out[0] == out[1] and out[0]["layout"] == "manual"
    assert len([line for line in open(tmp_path / "auto" / "metrics.jsonl")]) >= 2


@pytest.mark.parametrize("S, threshold", [(0, 0.5), (1, 0.5), (2, 0.5), (2, 0.3), (1, 1.0)])
def test_the_round_replay_counts_what_stalesync_decodes(S, threshold):
    """round_shape (the planner's companion) replays StaleSync's rounds: per round, the same decode forwards, live
    rows, prefilling calls, rows and tokens prefilled as the scheduler itself counts with a sampler whose responses
    have the planner's lengths (sample id j: response_length(lengths, j) tokens) and which keeps its cache within a
    round."""
    from stalesync import StaleConfig, StaleSync
    work = planner.Workload(16, 8, 18.0, 12.3, 40, staleness=S, chunk_steps=8, threshold=threshold)
    lengths = response_lengths(work)
    rounds, held = [], set()

    def step_fn(contexts, seeds, n_done, max_steps):
        left = [response_length(lengths, int(s)) - int(n) for s, n in zip(seeds, n_done)]
        steps = max(left) if max_steps is None else min(max_steps, max(left))
        made = [min(x, steps) for x in left]
        new = [i for i, s in enumerate(seeds) if int(s) not in held]
        count = rounds[-1]
        count["forwards"] += steps
        count["row_steps"] += sum(made)
        count["prefills"] += bool(new)
        count["prefill_rows"] += len(new)
        count["prefill_tokens"] += sum(len(contexts[i]) for i in new)
        held.update(int(s) for s in seeds)
        return ([torch.ones(m, dtype=torch.long) for m in made], [torch.zeros(m) for m in made],
                [m == x for m, x in zip(made, left)])

    cfg = StaleConfig(staleness=S, groups_per_step=2, group_size=8, chunk_steps=8, threshold=threshold)
    step_fn.reset = held.clear  # a cached sampler's reset(), which StaleSync calls as the weights change
    sched = StaleSync(cfg, step_fn, lambda slot, attempt: [1] * 18)
    for _ in range(S + 1 + 12):
        rounds.append(dict.fromkeys(("forwards", "row_steps", "prefills", "prefill_rows", "prefill_tokens"), 0))
        sched.rollout()
        sched.update()
    want = {k: sum(r[k] for r in rounds[S + 1:]) / 12 for k in rounds[0]}
    assert round_shape(work, 2) == want
    if S == 0:  # a round decodes its 16 samples whole: samples 16 to 207 over the 12 rounds counted
        assert want["row_steps"] == sum(response_length(lengths, j) for j in range(16, 208)) / 12
