"""--deploy separated: half the ranks train, half generate, each half idle while the other works.

    torchrun --standalone --nproc_per_node=2 train_grpo.py --deploy separated

Ranks [0, W/2) train (FSDP2 over them), ranks [W/2, W) generate. A generator decodes chunks while
the trainers train; new weights come in between two chunks (the samples in flight continue under
them: a partial rollout), and each batch StaleSync's cut releases goes into the queue at once.
S = 0: one chunk is a whole round, and the next waits for the batch's weights. A trainer reads its
share of a batch, trains, and pushes the new weights to the generators bucket by bucket
(options/push.py).
Evaluations run on the generators, which post their counts to the store for trainer 0.

The same samples and the same parameters as the colocated run: every group's prompt and seeds are
functions of its global slot and attempt, and a writer's rows of a batch have known ids.

    python -m pytest tests/test_train_grpo.py -k separated
"""
import datetime
import json
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import grpo
import train_grpo as T
from options.push import push_weights, wait_for, warm_up_or_wait
from options.selective_queue import SelectiveQueue
from plumbing import checkpoint
from plumbing.evaluation import eval_figures, held_out_correct, is_eval_step
from plumbing.run import Run, start
from plumbing.runlog import RunLog, share_figures


def errors(cfg, world):
    """What this deployment needs, checked before any process group."""
    out = []
    if world < 2 or world % 2 or cfg.infer_tp != 1:
        out.append(f"--deploy separated needs an even world size >= 2 (got {world}) "
                   f"and --infer-tp 1 (got {cfg.infer_tp})")
    if cfg.reward_model:
        out.append("--reward-model 1 with --deploy separated is not supported (the reward model is "
                   "trained on the policy's samples and scores on the ranks that generate: a "
                   "colocated deployment)")
    return out


@dataclass
class SeparatedRun(Run):
    push_group: object = None     # trainer 0 and the generators: the new weights go out on it


def train(cfg, out_dir=None):
    run = build(cfg, out_dir)
    loop = trainer_loop if run.rank in run.roles.trainers else generator_loop
    return T.run_loop(run, loop, warm=warm_up_or_wait)


def build(cfg, out_dir=None):
    """FSDP2 over the trainers; the engine, the sampler and StaleSync on the generators."""
    run = start(cfg, out_dir, cls=SeparatedRun)
    cfg = run.cfg  # --train-ep auto resolved
    T.build_queue(run, cls=SelectiveQueue)  # a trainer reads the batch named (get(only=))
    roles, timeout = run.roles, datetime.timedelta(seconds=cfg.pg_timeout_s)
    run.train_group = dist.new_group(roles.trainers, timeout=timeout)
    run.push_group = dist.new_group([0] + roles.generators, timeout=timeout)
    run.rollout_group = dist.new_group(roles.generators, timeout=timeout)
    mesh = DeviceMesh.from_group(run.train_group, run.device.type) if run.rank in roles.trainers \
        else None
    T.build_policy(run, mesh)
    if run.rank in roles.generators:
        T.build_rollout(run)
    run.log = RunLog(run, start=run.resume_from[1]["step"] + 1 if run.resume_from else 1)
    if cfg.routing_replay:  # the trainers replay the recorded experts; moe/* in the log
        from options import routing_replay
        routing_replay.apply(run)
    return run


def trainer_loop(run):
    """A trainer: read a batch, train, push the new weights to the generators."""
    spans = run.spans
    send(run, run.log.start - 1)
    if run.resume_from is None:
        run.log.warmed_up(collect_eval(run, 0))
    for step in run.log.progress():
        mark = run.log.mark(step=step, version=step - 1)
        # 4. a token-balanced share of batch step - 1, as the generators put it; the reference's
        per_step = run.cfg.prompts_per_step * run.cfg.group_size
        with spans("queue"):
            rows = run.queue.get("train", per_step, dp_group=run.train_group,
                                 only=set(batch_rows(run, step)))
        samples, rows = T.read_share(run, rows)
        ref_logprobs = T.reference_logprobs(run, samples)
        # 5. GRPO updates over length-sorted micro-batches, data parallel over the trainers (FSDP2)
        with spans("train"):
            sums = grpo.grpo_update(run.model, run.optimizer, samples, run.algo, run.device,
                                    run.train_group, ref_logprobs, run.clip_grads)
        done = run.log.done(step, mark)
        # 6. push version `step`: the generators take it at their next decode-chunk boundary
        send(run, step, last=done >= 1)
        record = run.log.figures(step, mark, sums | share_figures(step, rows), {})
        T.anneal_lr(run, done)
        if is_eval_step(run.cfg, step) or done >= 1:  # the generators score version `step`
            record.update(collect_eval(run, step))
        run.log.write(record)
        checkpoint.save(run, step)  # the generators save theirs as they receive version `step`
        if done >= 1:
            break


def generator_loop(run):
    """A generator: decode chunks while the trainers train; take new weights between two chunks."""
    cfg, sched, spans = run.cfg, run.sched, run.spans
    receive(run, run.log.start - 1, evaluate=run.resume_from is None)
    while sched.version < final_version(run):
        spans.args = {"step": sched.batches_out + 1, "version": sched.version}
        # 6. new weights: version + 1 arrives between two decode chunks; the next prompts follow
        if run.store.check([weights_key(run, sched.version + 1)]):
            receive(run, sched.version + 1)
            T.learn_curriculum(run)
            checkpoint.save(run, sched.version)  # before serving any read of the batches made ahead
            continue
        # 1. generate: admit groups within the staleness bound, decode one chunk
        n_tokens = 0
        if sched.batches_out < cfg.steps:
            sched.admit()
            if sched.in_flight():
                with spans("rollout"):
                    n_tokens = sched.decode()
            # 2-3. every batch the cut releases: score, advantages, into the queue
            while sched.ready() and sched.batches_out < cfg.steps:
                with spans("score"):
                    T.score_and_enqueue(run, sched.take())
        run.queue.serve()
        if n_tokens == 0:  # nothing admissible in flight: wait for the next version (the bound S)
            with spans("idle"):
                wait_for(run, [weights_key(run, sched.version + 1)],
                         f"weights of version {sched.version + 1}")
    if sched.version == cfg.steps:  # every row put has reached the trainers (after an early stop,
        run.queue.drain()           # the batches made ahead of it are left unread: in flight)


def batch_rows(run, step):
    """The row ids of the batch trained at RL step `step`, writer by writer: each generator cuts its
    own share, n_local rows per batch, in order, so its j-th row of that batch has a known id,
    however far ahead it runs."""
    n_local = run.cfg.prompts_per_step * run.cfg.group_size // run.roles.replicas
    return [run.queue.row_id(j, w) for w in run.roles.writers()
            for j in range((step - 1) * n_local, step * n_local)]


def weights_key(run, version):
    return f"w:{run.key}/{version}"


def final_version(run):
    """The version the run ends at: --steps, or the step --rl-seconds stopped at."""
    key = weights_key(run, "final")
    return int(run.store.get(key)) if run.store.check([key]) else run.cfg.steps


def send(run, version, last=False):
    """6. A trainer's side: announce `version` (and, if it is the last, that it is), then gather it
    bucket by bucket; trainer 0 broadcasts, and its push ends once every generator has the weights
    (a broadcast's sender may return before its receivers do)."""
    if run.rank == 0:
        if last:
            run.store.set(weights_key(run, "final"), str(version))
        run.store.set(weights_key(run, version), "1")
    with run.spans("push"):
        push_weights(run.model, None, 0, run.push_group, run.cfg.bucket_kb * 1024)
        if run.rank == 0:
            received = [f"{weights_key(run, version)}/got/{i}" for i in range(run.roles.replicas)]
            wait_for(run, received, f"the generators' receipt of version {version}")


def receive(run, version, evaluate=True):
    """6. A generator's side: join the push of `version`, hand it to the scheduler (which drops the
    sampler's KV cache: every in-flight prefix is read again) and, on an evaluation step, post this
    replica's held-out counts to the store for trainer 0."""
    wait_for(run, [weights_key(run, version)], f"weights of version {version}")
    with run.spans("recv"):
        push_weights(None, run.engine, 0, run.push_group, run.cfg.bucket_kb * 1024)
    replica = run.roles.replica(run.rank)
    run.store.set(f"{weights_key(run, version)}/got/{replica}", "1")
    run.sched.update(version)
    if evaluate and (is_eval_step(run.cfg, version) or version == final_version(run)):
        with run.spans("eval"):
            correct = held_out_correct(run)
        run.store.set(f"{weights_key(run, version)}/eval/{replica}", json.dumps(correct))


def collect_eval(run, version):
    """Trainer 0: the held-out accuracy of `version`, summed over the generators' posts."""
    if run.rank != 0:
        return {"eval/accuracy": None}
    keys = [f"{weights_key(run, version)}/eval/{i}" for i in range(run.roles.replicas)]
    with run.spans("idle"):
        wait_for(run, keys, f"held-out accuracy of version {version}")
    posts = [{int(k): v for k, v in json.loads(run.store.get(key)).items()} for key in keys]
    return eval_figures(run, {k: sum(post[k] for post in posts) for k in posts[0]})
