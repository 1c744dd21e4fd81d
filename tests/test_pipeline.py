"""pipeline.py against one process: a stage split computes the policy's logits; a GRPO update, a warm-up step and the
log-prob recompute through torch's schedule give one process's parameters and log-probs; bad layouts are refused. At
2 pipelines of 2 stages, every rank of a stage pads to one shape, and pipeline_run's read serves every pipeline."""
import copy

import pytest
import torch

import grpo
from options import pipeline
from model import ModelConfig, Policy
from tests.distributed import run_distributed

CFG = ModelConfig(vocab_size=14, d_model=32, n_heads=4, d_expert=32, n_layers=2, max_seq_len=40)
T = 24  # every row padded to this


def _policy():
    torch.manual_seed(0)
    return Policy(CFG)


def _samples(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, 14, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g) for _ in range(n)]
    responses = [torch.randint(1, 14, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g) for _ in range(n)]
    old = [-torch.rand(len(r), generator=g) for r in responses]
    return grpo.Samples(prompts, responses, old, torch.randn(n, generator=g))


def test_stages_compute_the_policys_logits_under_its_names():
    policy = _policy()
    layout = pipeline.PPLayout(2, 2, CFG.n_layers)
    first, last = pipeline.split(policy, layout, 0), pipeline.split(policy, layout, 1)
    tokens = torch.randint(0, 14, (3, 10))
    torch.testing.assert_close(last(first(tokens)), policy(tokens), rtol=0, atol=0)
    names = set(first.state_dict()) | set(last.state_dict())
    assert names == set(policy.state_dict()) and not set(first.state_dict()) & set(last.state_dict())


@pytest.mark.parametrize("pp, world, layers, what", [(2, 3, 2, "divide the world size 3"), (2, 2, 3, "3 blocks"),
                                                     (0, 2, 2, "0 pipeline stages")])
def test_a_layout_that_does_not_split_is_refused(pp, world, layers, what):
    with pytest.raises(ValueError, match=what):
        pipeline.PPLayout(pp, world, layers)


def _pipeline_rank(rank, world_size, updates, recompute):
    """The same GRPO update, a warm-up step and the log-prob recompute, through a 2-stage pipeline (this rank's
    stage) and in one process (every rank computes it), with the same optimizer: the parameters after."""
    layout = pipeline.PPLayout(2, world_size, CFG.n_layers)
    _, pipe_group = pipeline.new_groups(layout, timeout_s=60)
    whole, cut = _policy(), _policy()
    stage = pipeline.split(cut, layout, rank)
    pipe = pipeline.Pipeline(stage, layout, rank, pipe_group, micro_batches=2, length=T, device="cpu")
    s, cfg = _samples(), grpo.GRPOConfig(micro_batches=2, updates_per_batch=updates, decoupled=recompute)
    opt_whole = torch.optim.SGD(whole.parameters(), lr=1.0)  # SGD: a gradient of the wrong scale shows
    opt_stage = torch.optim.SGD(stage.parameters(), lr=1.0)
    want = grpo.grpo_update(whole, opt_whole, s, cfg, "cpu")
    got = pipeline.grpo_update(pipe, stage, opt_stage, s, cfg, "cpu", None, None,
                               lambda m, c: pipeline.clip_grads(m, c, group=pipe_group))
    prompts, answers = s.prompts[:4], s.responses[:4]
    grpo.supervised_step(whole, opt_whole, prompts, answers, "cpu", 1.0)
    pipeline.supervised_step(pipe, stage, opt_stage, prompts, answers, "cpu", 1.0, None,
                             lambda m, c: pipeline.clip_grads(m, c, group=pipe_group))
    lp_whole, lp_pipe = grpo.chunk_logprobs(whole, s, cfg, "cpu"), pipeline.logprobs(pipe, s, cfg)
    theirs = dict(whole.named_parameters())
    diff = max(float((p - theirs[n]).detach().abs().max()) for n, p in stage.named_parameters())
    return diff, (grpo.batch_means(want), grpo.batch_means(got) if pipe.last else None), lp_whole, lp_pipe


@pytest.mark.parametrize("updates, recompute", [(1, False), (2, True)])
def test_updates_through_the_schedule_equal_one_process(updates, recompute):
    """Up to float summation order (the micro-batches are padded to one length and summed in another order):
    after SGD steps of lr 1 (so that a gradient of another scale or sample shows as it is), every weight within
    1e-5; the figures and log-probs alike."""
    out = run_distributed(_pipeline_rank, world_size=2, args=(updates, recompute), timeout_s=120)
    for rank, (diff, _, _, _) in enumerate(out):
        assert diff < 1e-5, f"stage {rank}: a weight differs by {diff:.2e}"
    want, got = out[1][1]
    for key in ("loss", "clip_frac", "ratio_mean", "entropy", "rollout/logprob_gap_mean"):
        assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
    _, _, lp_whole, lp_pipe = out[1]
    assert all(lp is None for lp in out[0][3])  # the first stage has no logits
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(lp_pipe, lp_whole))


def _two_pipelines_rank(rank, world_size):
    """Two pipelines of two stages, each stage FSDP2 over its 2 ranks (as at --train-pp 2 on 4 ranks): two warm-up
    steps whose rows are longer in pipeline 1 at the first, in both at the second. Returns this rank's shapes."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    layout = pipeline.PPLayout(2, world_size, CFG.n_layers)
    stage_group, pipe_group = pipeline.new_groups(layout, timeout_s=20)
    stage = pipeline.split(_policy(), layout, rank)
    fully_shard(stage, mesh=DeviceMesh.from_group(stage_group, "cpu"), reshard_after_forward=False)
    pipe = pipeline.Pipeline(stage, layout, rank, pipe_group, micro_batches=2, length=T, device="cpu",
                             stage_group=stage_group)
    opt = torch.optim.SGD(stage.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank % layout.dp)  # the pipeline's rows, the same on its stages
    for long in (rank % layout.dp == 1, True):  # 10 tokens (T 16) or 20 (T 24)
        prompts = [torch.randint(4, 14, (8 if long else 5,), generator=g) for _ in range(4)]
        targets = [torch.randint(1, 14, (12 if long else 5,), generator=g) for _ in range(4)]
        pipeline.supervised_step(pipe, stage, opt, prompts, targets, "cpu", 1.0, None,
                                 lambda m, c: pipeline.clip_grads(m, c, group=pipe_group))
    return sorted(pipe.schedules)


@pytest.mark.slow  # world 4 on 2 cores: the wider matrix
def test_every_pipeline_pads_to_one_shape():
    """A schedule's first step runs its stage once to learn the shapes, FSDP's collectives included: the pipelines
    pad each step to one T (the longest over the stage's ranks), so that every rank of a stage builds its
    schedules at the same steps. Pipeline 0 meeting T 24 a step after pipeline 1 hung until the timeout."""
    out = run_distributed(_two_pipelines_rank, world_size=4, timeout_s=120, pg_timeout_s=20)
    assert out == [[((4, T), True)]] * 4, out


def _read_rows_rank(rank, world_size):
    """pipeline_run.read_rows at 2 pipelines of 2 stages: rank r puts (1, 2, 2, 1)[r] rows, ids j x 4 + r, so
    pipeline 1 (ranks 1, 3) reads rows 1, 3, 6 (rank 0's none) and pipeline 0 reads rows 0, 2, 5 (rank 1's 5).
    Pipeline 0's reader starts late; each rank then blocks in a collective, as the update does. Its rows' ids."""
    import contextlib
    import time
    from types import SimpleNamespace
    import torch.distributed as dist
    import distqueue
    from options import pipeline_run
    from options.selective_queue import SelectiveQueue
    layout = pipeline.PPLayout(2, world_size, CFG.n_layers)
    _, pipe_group = pipeline.new_groups(layout, timeout_s=20)
    spec = distqueue.QueueSpec(columns={"x": "int64"}, stages={"train": ("x",)}, timeout_s=10)
    queue = SelectiveQueue(spec, distqueue.default_store(), rank, world_size, dist.group.WORLD)  # as the run's
    queue.put({"x": [torch.arange(3)] * (1, 2, 2, 1)[rank]})
    run = SimpleNamespace(queue=queue, batch_ids={0, 1, 2, 3, 5, 6}, data_index=rank % layout.dp,
                          data_size=layout.dp, pipe_group=pipe_group,
                          spans=lambda name: contextlib.nullcontext())
    if rank == 0:
        time.sleep(1.0)  # pipeline 1 has its rows by now
    rows = pipeline_run.read_rows(run)
    dist.all_reduce(torch.zeros(1))  # a collective, which serves no queue
    return rows.ids


@pytest.mark.slow  # world 4 on 2 cores: the wider matrix
def test_a_pipeline_that_has_its_rows_serves_the_others_first():
    """The pipelines read the queue apart: a rank whose pipeline has its rows keeps serving its cells until every
    pipeline has read them. It went on to the update's collectives, and another pipeline's reader waited for its
    cells until the queue's timeout."""
    out = run_distributed(_read_rows_rank, world_size=4, timeout_s=120, pg_timeout_s=20)
    assert out == [[0, 2, 5], [1, 3, 6]] * 2, out
