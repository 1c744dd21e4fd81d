"""GRPO post-training of a tiny MoE policy: the default run, colocated, with all four mechanisms.

    torchrun --standalone --nproc_per_node=2 train_grpo.py     # 2 ranks (gloo on CPU, nccl on GPUs)
    python train_grpo.py                                       # a world of one
    python train_grpo.py --help                                # every flag, grouped

Every rank both trains and generates, one phase at a time. colocated_loop runs one RL step in
this order, with the README's stage numbers:
  6. switch    TRAIN -> ROLLOUT (fusion.py). The Adam state moves to host, the FSDP2 shards build
               the inference weights, and the experts go from EP 2 to EP 1 (moe_switch.py).
  1. generate  One StaleSync round (stalesync.py), cut once the ranks hold a batch with the due
               groups. The rest decode on in later rounds, at most S versions behind.
  6. switch    ROLLOUT -> TRAIN.
  2. score     The task's rule (task.py) scores every response.
  3. queue     The rows, with each group's advantages (grpo.py), go into DistQueue (distqueue.py).
  4. read      Each rank reads a packed share, balanced by length. The frozen reference scores it.
  5. train     GRPO updates, data parallel (FSDP2). The experts train expert-parallel.
Stage 1 also scores each group as soon as it completes (observe_group). Dynamic sampling
(--filter-groups) drops a group whose rewards are all equal and draws its slot again. The
curriculum (curriculum.py) learns which prompt lengths give informative groups.

The version v of the weights counts the batches trained so far. RL step k trains batch k - 1,
which StaleSync cut for version k - 1, and makes version k. Its samples all started at version
k - 1 - S or later. RL follows a supervised warm-up, whose held-out accuracy is the "before" figure.

Two departures from the source system are deliberate:
1. Scoring is a rule on the generating rank, so the reward and advantage travel with the sample.
2. Sampling is counter-based (model.py). A group's prompt and seeds follow from its global slot,
   its attempt and the shared curriculum. So at S = 0 a layout trains to a world of one's weights.

Off-by-default options live in options/. Flags, log, checkpoints and devices live in plumbing/.
"""
import torch
import torch.distributed as dist

import distqueue
import fusion
import grpo
import moe_switch
import stalesync
import task
from plumbing.config import model_config, parse_args, validate
from model import Policy, Sampler
from plumbing import checkpoint
from plumbing.distributed import exit_now, host_group, setup_distributed, world_size
from plumbing.run import optimizer_groups, planned, say_layout, start, warm_up_target
from plumbing.evaluation import curriculum_figures, eval_figures, held_out_correct, is_eval_step
from plumbing.runlog import RunLog, all_sum, cut_facts, run_guarded, share_figures, stale_facts


# ----------------------------------------------------------------------------- the run
def train(cfg, out_dir=None):
    """Run this rank's part of the job: the warm-up (or a --resume), then GRPO. Returns (summary,
    trained model). The separated, hybrid and pipeline runs have loops of their own in options/."""
    if cfg.deploy == "separated":
        from options import separated
        return separated.train(cfg, out_dir)
    if cfg.deploy == "hybrid":
        from options import hybrid
        return hybrid.train(cfg, out_dir)
    if cfg.train_pp > 1:  # --train-pp: training runs as pipeline stages
        from options import pipeline_run
        return pipeline_run.train(cfg, out_dir)
    return run_loop(build(cfg, out_dir), colocated_loop)


def run_loop(run, loop, warm=None, attach=None):
    """Run the warm-up (a fresh run) or load the checkpoint (a resumed run), then `loop`. Returns
    (summary, model). `warm` and `attach` are hooks for a deployment's own warm-up and reference,
    None in the default run."""
    if run.resume_from is None:
        (warm or warm_up)(run)
    (attach or attach_reference)(run)
    if run.cfg.reward_model:  # fitted on the warmed-up policy's samples, or loaded on resume
        from options import learned_reward
        learned_reward.attach(run)
    checkpoint.resume(run)
    if run.resume_from is not None:  # resume the learning rate where the run stopped
        anneal_lr(run, run.log.share(run.log.start - 1, run.log.seconds))
    return run_guarded(run, loop)


def colocated_loop(run):
    """The default loop. Every rank generates, then trains, and fusion.py switches the phases."""
    spans, sched, actor = run.spans, run.sched, run.actor
    if run.resume_from is None:
        run.log.warmed_up(evaluate(run) | run.step0)
    for step in run.log.progress():
        mark = run.log.mark(step=step, version=step - 1)
        # 6. switch to ROLLOUT. The inference weights are built bucket by bucket.
        with spans("switch_to_rollout"):
            actor.to_rollout()
        # 1. generate one StaleSync round, cut (SharedCut) once the replicas hold a batch
        batch = sched.rollout(spans, run.cut)
        # 6. switch back to TRAIN. Scoring needs no engine, so the engine's memory is freed first.
        with spans("switch_to_train"):
            actor.to_train()
        # 2-3. score, compute the advantages within each group, and put the batch into the queue
        with spans("score"):
            score_and_enqueue(run, batch)
        # 4. read this rank's share, balanced by length, and the reference's log-probs of it
        samples, rows = read_share(run)
        ref_logprobs = reference_logprobs(run, samples)
        # 5. train: GRPO updates over micro-batches sorted by length, data parallel (FSDP2)
        with spans("train"):
            sums = grpo.grpo_update(run.model, run.optimizer, samples, run.algo, run.device,
                                    run.train_group, ref_logprobs, run.clip_grads)
        sched.update()  # the next rollout decodes with these weights, version `step`
        learn_curriculum(run)  # draw the next prompts where this round's groups were informative
        if end_step(run, step, mark, sums | share_figures(step, rows), actor.metrics()):
            break


def end_step(run, step, mark, sums, extra):
    """End a step, in any loop: write its record (sums over every trainer's rows), set the next
    learning rate, evaluate every --eval-every steps and at the end, save every --save-every steps.
    Returns whether this is the last step, by --steps or --rl-seconds, whichever ends first."""
    done = run.log.done(step, mark)
    record = run.log.figures(step, mark, sums, extra)
    anneal_lr(run, done)  # after the record, which holds this step's rate
    if is_eval_step(run.cfg, step) or done >= 1:  # after the figures, so not in the step's time
        record.update(evaluate(run))
    run.log.write(record)
    checkpoint.save(run, step)
    return done >= 1


# ----------------------------------------------------------------------------- the step's stages
def score_and_enqueue(run, batch):
    """2-3. Score the batch, compute each group's advantages, and queue the rows. A group never
    spans replicas. One rank per replica writes the rows, because its TP peers hold the same
    samples. Returns the ids of the rows written, or None on the other ranks."""
    rule = task.rewards(batch.prompts, batch.responses)  # the rule, logged beside a learned reward
    rewards = run.score(batch.prompts, batch.responses)  # (B,), the rule's or a learned model's
    advantages = grpo.group_advantages(rewards, run.cfg.group_size, run.cfg.adv_estimator)  # (B,)
    if run.rank not in run.roles.writers():
        return None
    return run.queue.put({"prompt": batch.prompts, "response": batch.responses,
                          "old_logprobs": batch.logprobs, "rule_reward": rule.tolist(),
                          "reward": rewards.tolist(), "advantage": advantages.tolist(),
                          "stale": stale_facts(batch, cut_facts(batch)), **per_token(run, batch)})


def per_token(run, batch):
    """The sampler's per-token fields, flattened, in their queue columns' dtypes. The default run
    has none. They are an option's hook (routing replay adds its routes)."""
    dtypes = {name: distqueue.DTYPES[run.queue.spec.columns[name]] for name in batch.per_token}
    return {name: [t.reshape(-1).to(dtypes[name]) for t in values]
            for name, values in batch.per_token.items()}


def read_share(run, rows=None):
    """4. Read this trainer's share of the batch, balanced by length. Returns (samples, rows).
    `rows` is an option's hook, None in the default run. A deployment whose queue holds rows ahead
    of the batch reads the batch's rows by name and passes them in (options/separated.py)."""
    if rows is None:
        per_step = run.cfg.prompts_per_step * run.cfg.group_size
        with run.spans("queue"):
            rows = run.queue.get("train", per_step, dp_group=run.train_group)
    samples = samples_of(run, rows)
    samples.advantages = grpo.finish_advantages(samples.advantages, run.cfg.adv_estimator,
                                                run.device, run.train_group)
    return samples, rows


def samples_of(run, rows):
    """Turn the rows into grpo.Samples, per-token fields reshaped to (n_i tokens, ...)."""
    responses = rows.cols["response"]
    fields = {name: [v.view(len(r), -1) for v, r in zip(rows.cols[name], responses)]
              for name in run.per_token}
    truncated = [bool(r[-1] != task.EOS) for r in responses]
    return grpo.Samples(rows.cols["prompt"], responses, rows.cols["old_logprobs"],
                        rows.stack("advantage"), truncated=truncated, per_token=fields,
                        around=run.around)


def reference_logprobs(run, samples):
    """4. The frozen initial policy's log-probs of the share, or None without a reference."""
    if run.reference is None:
        return None
    with run.spans("reference"), run.reference.on_device() as ref:
        return grpo.chunk_logprobs(ref, samples, run.algo, run.device)


def observe_group(run, prompt, responses):
    """StaleSync's keep_group, which scores each group as it completes (see stage 1 at the top)."""
    rewards = run.score([prompt] * len(responses), responses).tolist()
    run.curriculum.observe(task.difficulty(prompt), rewards)
    return not run.cfg.filter_groups or len(set(rewards)) > 1


def learn_curriculum(run):
    """At a step boundary, add the groups that the replicas scored since the last boundary to the
    curriculum's decayed counts, each replica's groups once. Every rank calls this collective."""
    mine = 1.0 if run.rank in run.roles.writers() else 0.0

    def reduce(new):
        t = torch.tensor(new * mine, dtype=torch.float64, device=run.device)
        dist.all_reduce(t, group=run.rollout_group)
        return t.cpu().numpy()
    run.curriculum.step(reduce)


def evaluate(run):
    """Held-out greedy accuracy (each replica scores its slice), plus run.watch()'s figures."""
    with run.spans("eval"), fusion.rollout(run.actor):
        correct = held_out_correct(run)
    figures = eval_figures(run, all_sum(correct, run.device, run.rollout_group)) | run.watch()
    return figures | (curriculum_figures(run.curriculum) if run.cfg.curriculum else {})


def anneal_lr(run, done):
    """Set the cosine learning rate, --lr to --lr x --lr-decay, for the share `done` of the run."""
    if run.optimizer is not None:
        grpo.cosine_lr(run.optimizer, run.cfg.lr, run.cfg.lr_decay, done)


def warm_up(run, supervised=grpo.supervised_step):
    """The supervised warm-up on the trainers: data-parallel cross-entropy on the task's answers.
    Under EP, a dense twin of the policy warms up and is loaded into the EP layout, so every
    layout starts RL from the same weights. `supervised` is an option's hook."""
    cfg = run.cfg
    model, clip = warm_up_target(run)
    optimizer = torch.optim.AdamW(optimizer_groups(model), lr=cfg.warmup_lr,
                                  betas=(0.9, 0.98), weight_decay=0.0, foreach=True)
    me, n = run.data_index, cfg.warmup_batch // run.data_size  # this rank's slice of each batch
    with run.spans("warmup"):
        for _ in range(cfg.warmup_steps):
            prompts = run.warm_stream.next(cfg.warmup_batch)[me * n:(me + 1) * n]
            supervised(model, optimizer, prompts, [task.answer(p) for p in prompts], run.device,
                       cfg.grad_clip, run.train_group, clip)
    if model is not run.model:  # EP's twin: gather it whole, load each rank's part
        checkpoint.load_dense_state_dict(run.model, checkpoint.dense_state_dict(model))
    if run.grad_sync is not None:  # --nodes: RL must not apply the warm-up's unsent gradient
        run.grad_sync.reset()


def attach_reference(run):
    """Build the reference, a frozen copy of the warmed-up policy, kept on host between uses under
    colocated-all. Under EP it runs the EP forward, so step 1's log-probs match bit for bit."""
    if run.model is None or not (run.cfg.kl_coef > 0 or run.cfg.deploy == "colocated-all"):
        return
    ref = Policy(model_config(run.cfg)).to(run.device).eval()
    ref.load_state_dict(checkpoint.dense_state_dict(run.model))
    if run.experts:
        run.experts.shard(ref)
    ref.requires_grad_(False)
    run.reference = fusion.HostOffloaded(ref, offload=run.cfg.deploy == "colocated-all")


# ----------------------------------------------------------------------------- building the run
def build(cfg, out_dir=None):
    """Build the colocated run: the queue, the policy in its training layout (EP, then FSDP2), the
    engine, its scheduler and the phase switch. A block guarded by a flag applies an option."""
    run = start(cfg, out_dir)
    cfg = run.cfg  # with --train-ep auto resolved
    build_queue(run)
    run.train_group = run.rollout_group = dist.group.WORLD
    mesh = torch.distributed.device_mesh.init_device_mesh(run.device.type, (run.roles.world,))
    if cfg.nodes > 1:  # FSDP2 within each node, gradients averaged across nodes (gradsync.py)
        from options import nodes
        mesh = nodes.apply(run)
    build_policy(run, mesh)
    if cfg.infer_tp > 1:  # the engine runs tensor-parallel over groups of infer_tp ranks
        from options import tensor_parallel
        tensor_parallel.apply_to_run(run)
    build_rollout(run)
    # the actor's gather broadcasts in place, or reads one host's shared memory (--shm-transport 1)
    transport = fusion.Broadcasts()
    if cfg.shm_transport:
        from plumbing import shm_transport
        transport = shm_transport.SharedMemory.connect(run.model, cfg.pg_timeout_s) or transport
    movers = [m for m in (run.experts, run.grad_sync) if m is not None]
    run.actor = run.actor_class(run.model, run.optimizer, run.engine,  # FusedActor, by default
                                bucket_bytes=cfg.bucket_kb * 1024, movers=movers,
                                transport=transport)
    run.cut = build_cut(run)
    run.log = RunLog(run, start=run.resume_from[1]["step"] + 1 if run.resume_from else 1)
    say_layout(run)  # print how the phases switch and how the experts are laid out
    if cfg.routing_replay:  # training replays the recorded experts (moe/* in the log)
        from options import routing_replay
        routing_replay.apply(run)
    return run


def build_cut(run):
    """How the replicas cut each batch. SharedCut cuts once over all their pools, so that a replica
    held back by its dropped groups does not hold back the step. `replica` and `leader` matter under
    inference TP. In the default run, every rank is its own replica and leads it."""
    if not run.cfg.shared_cut:
        return stalesync.AllReady(run.rollout_group, device=run.device, spans=run.spans)
    return stalesync.SharedCut(run.rollout_group, replica=run.roles.replica(run.rank),
                               leader=run.rank in run.roles.writers(), device=run.device,
                               spans=run.spans)


def build_queue(run, columns=(), stages=None, poll_s=0.002, cls=distqueue.DistQueue):
    """The queue between rollout and training, with one row per sample and its keys in the process
    group's store. `columns`, `stages` (the hybrid's) and `cls` (a DistQueue subclass, as in
    options/selective_queue.py) are a deployment's hooks, unused by the default run."""
    columns = {"prompt": "int64", "response": "int64", "old_logprobs": "float32",
               "reward": "float32", "rule_reward": "float32", "advantage": "float32",
               "stale": "int64", **run.per_token, **dict(columns)}
    spec = distqueue.QueueSpec(columns=columns, scalars=("reward", "rule_reward", "advantage"),
                               stages=stages or {"train": tuple(columns)}, poll_s=poll_s,
                               timeout_s=run.cfg.pg_timeout_s, name=f"dq:{run.key}")
    pg = host_group(run.device, run.cfg.pg_timeout_s)  # the queue moves host tensors, over gloo
    run.queue = cls(spec, run.store, run.rank, run.roles.world, pg)


def build_policy(run, mesh, split=None):
    """Build the trained model (EP, then FSDP2 over `mesh`), its optimizer, and the rollout engine.
    `split` is an option's hook, None in the default run. The pipeline run passes
    split(model) -> (module, mesh), which cuts the model into its stages before FSDP2."""
    from torch.distributed.fsdp import fully_shard
    cfg, roles, rank = run.cfg, run.roles, run.rank
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    model = Policy(model_config(cfg)).to(run.device)
    if rank in roles.generators:
        run.engine = Policy(model_config(cfg)).to(run.device).eval().requires_grad_(False)
    if cfg.train_ep:  # EP shards the experts over the trainers, outside FSDP2, and re-shards them
        experts = moe_switch.ExpertParallel
        if cfg.eplb:  # place the rollout's experts by measured load and copy the hottest
            from options import eplb
            experts = eplb.balanced_experts(cfg)
        run.experts = experts(cfg.train_ep, cfg.infer_ep, len(roles.trainers), cfg.n_experts,
                              cfg.bucket_kb * 1024, cfg.pg_timeout_s, ranks=roles.experts_over)
    if rank not in roles.trainers:  # every rank made EP's groups, but only trainers hold experts
        return
    if run.experts:
        run.experts.apply(model, run.engine)
        run.clip_grads = run.experts.clip_grads
    run.data_index, run.data_size = roles.trainers.index(rank), len(roles.trainers)
    if split is not None:
        model, mesh = split(model)
    ignored = set(run.experts.params(model)) if run.experts else None
    if cfg.fsdp_units == "block":  # one FSDP2 unit per block, with prefetch (options/nodes.py)
        from options import nodes
        nodes.shard_blocks(model, mesh, ignored)
    # FSDP2 shards the weights between updates and gathers them from first forward to last backward
    fully_shard(model, mesh=mesh, ignored_params=ignored, reshard_after_forward=False)
    if run.grad_sync is not None:  # --nodes: a hook averages each FSDP2 unit's shard across nodes
        run.grad_sync.apply(model)
    run.model = model
    # foreach: each Adam stage is one multi-tensor op over all shards, with bit-identical results
    run.optimizer = torch.optim.AdamW(optimizer_groups(model), lr=cfg.lr,
                                      betas=(0.9, 0.98), weight_decay=0.0, foreach=True)


def build_rollout(run, wrap=None, wrap_sched=None):
    """Build the engine's sampler (its KV cache kept between decode chunks) and StaleSync over this
    replica's slots of the global batches. `wrap` and `wrap_sched` are the hybrid's hooks, None in
    the default run: each maps a class (the sampler's, StaleSync's) to the one to use."""
    cfg, roles = run.cfg, run.roles
    n_prompts = cfg.prompts_per_step // roles.replicas
    replica = roles.replica(run.rank)

    def to_global(slot):  # replica r makes groups [r n, (r + 1) n) of every step's prompts_per_step
        step, j = divmod(slot, n_prompts)
        return step * cfg.prompts_per_step + replica * n_prompts + j
    make, scheduler = Sampler, stalesync.StaleSync
    if cfg.infer_ep > 1:  # each forward meets the EP group's, so its ranks decode in lock-step
        from options import lockstep
        make, scheduler = lockstep.rollout_classes(make, scheduler, run)
    if cfg.routing_replay:  # record each token's experts for training to replay
        from options import routing_replay
        make, scheduler = routing_replay.rollout_classes(make, scheduler)
    make = wrap(make) if wrap else make
    scheduler = wrap_sched(scheduler) if wrap_sched else scheduler
    run.sampler = make(run.engine, cfg.max_new_tokens, task.EOS, task.PAD, cfg.temperature,
                       cfg.top_p)
    config = stalesync.StaleConfig(cfg.staleness, n_prompts, cfg.group_size, cfg.threshold,
                                   cfg.chunk_steps, max_len=cfg.max_new_tokens,
                                   max_filtered=cfg.filter_limit * n_prompts)
    observe = cfg.filter_groups or cfg.curriculum  # neither: no group is scored as it completes
    run.sched = scheduler(
        config, run.sampler,
        prompt_fn=lambda slot, attempt: run.rl_prompts(to_global(slot), attempt),
        seed_fn=lambda slot, attempt, j: task.sample_seed(cfg.seed, to_global(slot), attempt, j),
        keep_group=(lambda prompt, responses: observe_group(run, prompt, responses)) if observe
        else None)


# ----------------------------------------------------------------------------- command line
def main(argv=None):
    parser, cfg = parse_args(argv)
    try:
        validate(cfg, world_size())
    except ValueError as e:
        parser.error(str(e))
    setup_distributed(cfg)
    try:
        train(planned(cfg))  # --layout auto: the planner's layout (options/layout_auto.py)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now()  # the work is done, so skip the interpreter's teardown, where torch can abort
