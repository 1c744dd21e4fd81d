"""--train-pp 2: the colocated run with its training as pipeline stages (options/pipeline.py), its
own build and loop.

    torchrun --standalone --nproc_per_node=2 train_grpo.py --train-pp 2

The policy is cut into stages before FSDP2 (each stage FSDP2 over its own ranks); the switch gathers
the engine's weights from the stages (options/owners.py agrees which ranks hold each); a pipeline
reads its rows once, through SelectiveQueue's model-parallel group, and every stage of it sees the
same micro-batches; the reference is stages too, with its own schedules. Trains to a world of one's
parameters.

    python -m pytest tests/test_train_grpo.py -k pipeline
"""
import functools
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import fusion
import grpo
import train_grpo as T
from plumbing.config import model_config
from model import Policy
from options.pipeline import (Pipeline, PPLayout, clip_grads, full_state_dict, grpo_update,
                              logprobs, new_groups, split, supervised_step)
from options import owners, tensor_parallel
from options.selective_queue import SelectiveQueue, announce_rows
from plumbing.run import Run, start
from plumbing.runlog import RunLog, share_figures


def errors(cfg, world):
    """--train-pp: what this file supports, checked before any process group."""
    pp = cfg.train_pp
    if pp < 1 or world % pp or cfg.n_layers % pp:
        return [f"--train-pp {pp} must divide the world size {world} and --n-layers {cfg.n_layers}"]
    if pp > 2:
        return [f"--train-pp {pp}: 1 or 2 "
                "(a stage in the middle of a pipeline, neither first nor last, is untested)"]
    out, dp = [], world // pp
    unsupported = {"--deploy separated": cfg.deploy == "separated",
                   f"--train-ep {cfg.train_ep}": cfg.train_ep not in (0, "auto"),
                   "--routing-replay 1": cfg.routing_replay}
    for what, bad in unsupported.items():
        if bad:
            out.append(f"--train-pp {pp} with {what} is not supported yet "
                       "(colocated, without EP and without routing replay)")
    if cfg.micro_batches < pp:
        out.append(f"--micro-batches {cfg.micro_batches} must be at least --train-pp {pp}: "
                   "a pipeline schedule needs a micro-batch per stage")
    rows = cfg.prompts_per_step * cfg.group_size
    per_pipe, chunks = rows // dp, cfg.micro_batches * cfg.updates_per_batch
    if rows % dp or per_pipe % chunks:
        out.append(f"--train-pp {pp}: each of the {dp} pipelines trains "
                   f"prompts_per_step x group_size / {dp} = {per_pipe} rows, "
                   "which must split into --micro-batches x --updates-per-batch = "
                   f"{chunks} micro-batches of one size (a stage's shapes are fixed)")
    per_pipe_warmup = cfg.warmup_batch // dp
    if cfg.warmup_steps and (cfg.warmup_batch % dp or per_pipe_warmup % cfg.micro_batches):
        out.append(f"--train-pp {pp}: --warmup-batch {cfg.warmup_batch} must split "
                   f"over {dp} pipelines into --micro-batches {cfg.micro_batches} "
                   "micro-batches of one size")
    return out


@dataclass
class PipelineRun(Run):
    pipe: Pipeline = None         # this rank's stage of the pipeline and its schedules
    pipe_group: object = None     # this rank's pipeline (one rank per stage): it reads rows once
    stage_group: object = None    # this rank's stage (one rank per pipeline)
    ref_pipe: Pipeline = None     # the frozen reference's stage, its own schedules


def train(cfg, out_dir=None):
    """The colocated run with its training as pipeline stages: its own build and loop."""
    run = build(cfg, out_dir)
    supervised = functools.partial(supervised_step, run.pipe)
    return T.run_loop(run, pipeline_loop, warm=lambda run: T.warm_up(run, supervised),
                      attach=attach_reference)


def build(cfg, out_dir=None):
    """train_grpo.build with the policy cut into stages before FSDP2 (each over its stage's ranks):
    this rank's Stage, the pipeline's schedules, the batch slice of its pipeline. Collective."""
    run = start(cfg, out_dir, cls=PipelineRun)
    cfg = run.cfg  # --train-ep auto resolved
    T.build_queue(run, cls=SelectiveQueue)  # a pipeline reads once (get(group=))
    run.train_group = run.rollout_group = dist.group.WORLD
    layout = PPLayout(cfg.train_pp, run.roles.world, cfg.n_layers)
    stage_group, pipe_group = new_groups(layout, cfg.pg_timeout_s)
    run.pipe_group = pipe_group if run.device.type == "cpu" else new_groups(  # the queue's: gloo
        layout, cfg.pg_timeout_s, backend="gloo")[1]
    run.stage_group = stage_group  # one rank per pipeline: reinforce++'s batch counts each row once

    def cut(model):  # this rank's stage, FSDP2 over its stage's ranks
        stage = split(model, layout, run.rank)
        length = model.cfg.max_seq_len  # the longest row: the longest prompt + the response budget
        run.pipe = Pipeline(stage, layout, run.rank, pipe_group, cfg.micro_batches, length,
                            run.device, stage_group)
        return stage, DeviceMesh.from_group(stage_group, run.device.type)
    T.build_policy(run, None, split=cut)
    run.clip_grads = functools.partial(clip_grads, group=pipe_group)
    run.data_index, run.data_size = run.rank % layout.dp, layout.dp
    T.build_rollout(run)
    run.actor_class = owners.actor_class(run.actor_class)  # the weights from the stages
    if cfg.infer_tp > 1:  # the engine handed full weights through its load_weights
        run.actor_class = tensor_parallel.actor_class(run.actor_class)
    run.actor = run.actor_class(run.model, run.optimizer, run.engine,
                                bucket_bytes=cfg.bucket_kb * 1024, transport=fusion.Broadcasts())
    run.cut = T.build_cut(run)
    if run.rank == 0:
        print(f"switch: {run.actor.path}", flush=True)
    run.log = RunLog(run, start=run.resume_from[1]["step"] + 1 if run.resume_from else 1,
                     gather=full_state_dict)
    return run


def attach_reference(run):
    """The frozen reference as stages too, each the copy of its policy stage, run through a pipeline
    of its own (kept on host between uses under colocated-all)."""
    if not (run.cfg.kl_coef > 0 or run.cfg.deploy == "colocated-all"):
        return
    ref = split(Policy(model_config(run.cfg)).to(run.device).eval(), run.pipe.layout, run.rank)
    ref.load_state_dict({k: v.full_tensor() if hasattr(v, "full_tensor") else v
                         for k, v in run.model.state_dict().items()})
    run.ref_pipe = Pipeline(ref, run.pipe.layout, run.rank, run.pipe.group, run.cfg.micro_batches,
                            run.pipe.length, run.device, run.stage_group)
    offload = run.cfg.deploy == "colocated-all"
    run.reference = fusion.HostOffloaded(ref.requires_grad_(False), offload=offload)


def read_rows(run):
    """4. This pipeline's rows of the batch (run.batch_ids): an equal count per pipeline (fixed
    micro-batch shapes), read once per pipeline (SelectiveQueue's get(group=)) and broadcast
    to its stages. The pipelines read apart, no DP group waiting for all, so each rank then serves
    its cells until every pipeline has read them: a rank gone on to a collective (the update's)
    would leave another pipeline's reader waiting for them. Every rank calls it."""
    mine = set(sorted(run.batch_ids)[run.data_index::run.data_size])
    with run.spans("queue"):
        rows = run.queue.get("train", len(mine), group=run.pipe_group, only=mine)
        run.queue.drain()
    return rows


def pipeline_loop(run):
    """train_grpo.colocated_loop: the batch read once per pipeline, trained through the schedule."""
    spans, sched, actor, cfg = run.spans, run.sched, run.actor, run.cfg
    if run.resume_from is None:
        run.log.warmed_up(T.evaluate(run) | run.step0)
    for step in run.log.progress():
        mark = run.log.mark(step=step, version=step - 1)
        # 6. switch to ROLLOUT: the engine's weights gathered from the stages
        with spans("switch_to_rollout"):
            actor.to_rollout()
        # 1. generate
        batch = sched.rollout(spans, run.cut)
        # 6. switch back to TRAIN
        with spans("switch_to_train"):
            actor.to_train()
        # 2-3. score, advantages, into the queue
        with spans("score"):
            run.batch_ids = announce_rows(run, T.score_and_enqueue(run, batch))
        # 4. this pipeline's rows, read once per pipeline; the reference through its own pipeline
        rows = read_rows(run)
        samples = T.samples_of(run, rows)
        samples.advantages = grpo.finish_advantages(samples.advantages, cfg.adv_estimator,
                                                    run.device, run.stage_group)
        ref_logprobs = None
        if run.reference is not None:
            with spans("reference"), run.reference.on_device():
                ref_logprobs = logprobs(run.ref_pipe, samples, run.algo)
        # 5. GRPO updates through the pipeline's schedule, data parallel within each stage
        with spans("train"):
            sums = grpo_update(run.pipe, run.model, run.optimizer, samples, run.algo, run.device,
                               run.train_group, ref_logprobs, run.clip_grads)
        sched.update()
        T.learn_curriculum(run)
        figures = share_figures(step, rows)
        # a pipeline's rows, once
        figures = {k: v if run.pipe.last else 0.0 for k, v in figures.items()}
        if T.end_step(run, step, mark, sums | figures, actor.metrics()):
            break
