"""GRPO post-training of a tiny MoE policy, end to end: the four mechanisms wired together.

    torchrun --standalone --nproc_per_node=2 train_grpo.py     # 2 ranks (gloo on CPU, nccl on GPUs)
    python train_grpo.py                                       # a world of one
    python train_grpo.py --help                                # every flag, grouped

One RL step, numbered as in the README's diagram:
  1. generate    G responses per prompt; stalesync.py schedules the round (S = 0: wait for every one);
                 each group's prompt is drawn for its slot of the global batch, its length where groups
                 have been informative (curriculum.py); a group whose rewards are all equal is dropped
                 and its slot drawn again (dynamic sampling)
  2. score       the task's rule (task.score), or a learned reward model (--reward-model), on the rank that
                 generated the group
  3. advantages  group-normalised (grpo.group_advantages); the rows go into distqueue.py
  4. reference   a trainer reads a token-balanced, packed share of the batch; the frozen initial
                 policy's log-probs of it, when kl_coef > 0 or under --deploy colocated-all
  5. train       GRPO updates, data parallel with FSDP2 (grpo.grpo_update); the learning rate falls along
                 a cosine over the share of the run behind (--lr-decay)
  6. switch      colocated: TRAIN -> ROLLOUT before 1 and back after it (fusion.py, and the experts'
                 EP re-shard of moe_switch.py); separated: the new weights pushed to the generators
One loop per deployment: `colocated_loop` (any S, inference TP, EP, the reference on host), and
`trainer_loop` with `generator_loop` (separated: half the ranks train, half generate); hybrid: the actor's
ranks run `actor_loop` (`colocated_loop`, each group put into the queue as it completes), the auxiliary
ranks `aux_loop` (the reference, and the reward model, a queue stage between 3 and 4). Options are
applied when the run is built (`build`), never as branches inside a loop.

Counting: a version v is a count of optimizer steps. RL step k (1 .. steps) trains batch k - 1, which
StaleSync emitted for version k - 1 (every sample of it started at a version >= k - 1 - S), and makes
version k. The task (task.py) is to reverse a digit string; the held-out set is never trained on. A
short supervised warm-up comes first; its held-out accuracy is the "before" figure.

Departures from the source system, on purpose:
1. Scoring is a rule on the generating rank, so reward and advantage travel through the queue with
   the sample; the reference runs on the trainer that reads the sample, where it lives (hybrid: on the
   auxiliary ranks, which add its log-probs, and a reward model's rewards, to the rows as columns).
2. Sampling randomness is counter-based per sample (model.py), and a group's prompt and seeds are
   functions of its global slot and attempt: every deployment and world size generates, keeps and
   replaces the same groups from the same weights, so every mode trains to the same parameters.
What a run prints and writes in --out: runlog.py. Checkpoints (--save-every, --resume): checkpoint.py.
"""
import datetime
import functools
import gc
import json
import math
import os
import time
import uuid
from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.distributed as dist

from plumbing import checkpoint
import curriculum
import distqueue
import expert_parallel
import fusion
from options import gradsync
import grpo
from options import pipeline
from options import push, reward_model
from plumbing import shm_transport
import stalesync
import task
from plumbing import timeline
from config import Config, Roles, grpo_config, model_config, parse_args, setup_distributed, validate
from model import LockStep, Policy, Sampler, TPLayout, generate
from plumbing.runlog import RunLog, all_sum


# ----------------------------------------------------------------------------- the run: one loop per deployment
def train(cfg, out_dir=None):
    """Warm-up (or --resume), then GRPO, this rank's part of the deployment. Returns (summary, trained
    model or None). An error names the phase this rank was in: a dead peer surfaces as a failed collective."""
    run = build(cfg, out_dir)
    if run.resume_from is None:
        warm_up(run)
    attach_reference(run)
    attach_reward_model(run)  # --reward-model: trained on the warmed-up policy's samples (resumed: the checkpoint's)
    checkpoint.resume(run)  # --resume: the checkpoint's state (nothing without one)
    resume_lr(run)  # --resume: the learning rate where the checkpoint's run was
    loop = {"colocated": colocated_loop, "trainer": trainer_loop, "generator": generator_loop,
            "actor": actor_loop, "aux": aux_loop}[run.roles.role(run.rank)]
    # What setup made (torch's modules, the model, the queue) lives as long as the loop: frozen, a full collection
    # skips it and pauses a rank (its peers waiting) far less. A caller's own frozen objects stay the caller's.
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.collect()
        gc.freeze()
    try:
        loop(run)
    except Exception as e:
        where, args = run.spans.failed_in or ("the loop", run.spans.args)
        raise RuntimeError(f"rank {run.rank} stopped in {where} ({args}): {type(e).__name__}: {e}{hint(cfg, e)}") from e
    finally:
        if freeze:
            gc.unfreeze()
    return run.log.close(), run.model


def hint(cfg, e):
    """What a brake's error means in this script's flags."""
    if isinstance(e, stalesync.FilterLimitError):
        return (f" (--filter-groups 1: dynamic sampling; --filter-limit {cfg.filter_limit} groups dropped per prompt "
                "trained stops the run; --filter-groups 0 turns it off)")
    return ""


def colocated_loop(run):
    """Every rank generates, then trains, switching phases through fusion.py (one replica per TP group)."""
    cfg, spans, sched, actor = run.cfg, run.spans, run.sched, run.actor
    if run.resume_from is None:
        run.log.warmed_up(evaluate_colocated(run) | run.reward_model_figures)
    for step in run.log.progress():
        mark = run.log.mark(step=step, version=step - 1)
        # 6. switch to ROLLOUT: grads and optimizer state to host, inference weights built in buckets
        with spans("switch_to_rollout"):
            actor.to_rollout()
        # 1. generate: one StaleSync round (S > 0: it ends once the ranks together hold the batch; the tail goes on)
        batch = sched.rollout(spans, run.cut)
        # 6. switch back to TRAIN (scoring needs no engine, so its memory is freed first)
        with spans("switch_to_train"):
            actor.to_train()
        # 2-3. score, group advantages, into the queue (hybrid: each group went in as it completed; the batch's ids)
        with spans("score"):
            run.enqueue(run, batch)
        # 4. a token-balanced share of the whole batch; the reference's log-probs of it (hybrid: they arrive in 5)
        samples, rows, queued = read_share(run, step)
        ref_logprobs = reference_logprobs(run, samples, queued)
        # 5. GRPO updates over sorted micro-batches, data parallel (FSDP2); hybrid: in the order the rows were put,
        #    each waiting for its rows' columns from the auxiliary stage, which works on the last groups meanwhile
        with spans("train"):
            sums = run.update(run.model, run.optimizer, samples, run.algo, run.device,
                              run.train_group, ref_logprobs, run.clip_grads, arrive=queued)
        figures = share_figures(run, step, rows)
        sched.update()  # the sampler now has the weights of version `step`
        learn_curriculum(run)  # the next prompts are drawn where this round's groups were informative
        done = share_done(run, step, mark)  # of the run: --steps or --rl-seconds, whichever binds first
        last = out_of_time(run, step, done)
        record = run.log.figures(step, mark, sums | figures, actor.metrics())
        anneal_lr(run, done)  # the next step's learning rate (the record holds this one's)
        if is_eval_step(cfg, step) or last:  # after the step's figures: the evaluation's switch is not the step's
            record.update(evaluate_colocated(run))
        run.log.write(record)
        checkpoint.save(run, step)  # every --save-every steps: the whole run at version `step`
        if last:
            break


def evaluate_colocated(run):
    """Held-out greedy accuracy of the current weights, each rollout replica scoring its slice."""
    with run.spans("eval"), fusion.rollout(run.actor):
        correct = held_out_correct(run)
    learned = {"curriculum/informative_by_digits": by_digits(run.curriculum.informative()),
               "curriculum/pass_rate_by_digits": by_digits(run.curriculum.pass_rate())} if run.cfg.curriculum else {}
    return eval_figures(run, all_sum(correct, run.device, run.rollout_group)) | learned


def by_digits(values):
    """A per-key array (key k: k + 1 digits) as {digits: value}, for metrics.jsonl."""
    return {str(k + 1): round(float(v), 3) for k, v in enumerate(values)}


def trainer_loop(run):
    """Separated, a trainer: read a batch, train, push the new weights to the generators."""
    cfg, spans = run.cfg, run.spans
    push_weights(run, run.log.start - 1)
    if run.resume_from is None:
        run.log.warmed_up(collect_eval(run, 0))
    for step in run.log.progress():
        mark = run.log.mark(step=step, version=step - 1)
        # 4. a token-balanced share of batch step - 1, as the generators put it; the reference's log-probs
        samples, rows, _ = read_share(run, step)
        ref_logprobs = reference_logprobs(run, samples)
        # 5. GRPO updates over length-sorted micro-batches, data parallel over the trainers (FSDP2)
        with spans("train"):
            sums = run.update(run.model, run.optimizer, samples, run.algo, run.device,
                              run.train_group, ref_logprobs, run.clip_grads)
        figures = share_figures(run, step, rows)
        done = share_done(run, step, mark)  # of the run: --steps or --rl-seconds, whichever binds first
        last = out_of_time(run, step, done)
        # 6. push version `step` to the generators: they take it at their next decode-chunk boundary
        push_weights(run, step, last)
        record = run.log.figures(step, mark, sums | figures, {})
        anneal_lr(run, done)  # the next step's learning rate (the record holds this one's)
        if is_eval_step(cfg, step) or last:  # the generators score version `step` and post it to the store
            record.update(collect_eval(run, step))
        run.log.write(record)
        checkpoint.save(run, step)  # the generators save theirs as they receive version `step`
        if last:
            break


def generator_loop(run):
    """Separated, a generator: decode chunks while the trainers train; new weights come in between two chunks
    (the samples in flight continue under them: a partial rollout); each batch StaleSync's cut releases goes
    into the queue at once. S = 0: one chunk is a whole round; the next waits for the batch's weights."""
    cfg, sched, spans = run.cfg, run.sched, run.spans
    receive_weights(run, run.log.start - 1, evaluate=run.resume_from is None)
    while sched.version < final_version(run):
        spans.args = {"step": sched.batches_out + 1, "version": sched.version}
        # 6. new weights: version + 1 arrives between two decode chunks; the next prompts follow what was scored
        if run.store.check([weights_key(run, sched.version + 1)]):
            receive_weights(run, sched.version + 1)
            learn_curriculum(run)
            checkpoint.save(run, sched.version)  # before serving any read of the batches made ahead
            continue
        # 1. generate: admit groups within the staleness bound, decode one chunk
        n_tokens = 0
        if sched.batches_out < cfg.steps:
            sched.admit()
            if sched.in_flight():
                with spans("rollout"):
                    n_tokens = sched.decode()
            # 2-3. every batch the cut releases: score, group advantages, into the queue
            while sched.ready() and sched.batches_out < cfg.steps:
                with spans("score"):
                    score_and_enqueue(run, sched.take())
        run.queue.serve()
        if n_tokens == 0:  # nothing admissible in flight: wait for the next version (the bound S)
            with spans("idle"):
                wait_for(run, [weights_key(run, sched.version + 1)], f"weights of version {sched.version + 1}")
    if sched.version == cfg.steps:  # every row put has reached the trainers (after an early stop, the
        run.queue.drain()           # batches made ahead of it are left unread: in flight at the end)


def actor_loop(run):
    """Hybrid, an actor rank: the colocated loop; then it answers the auxiliary ranks' last pulls (a group they claimed
    after its last queue call) until each says it is done, so that none waits on it."""
    colocated_loop(run)
    wait_for(run, [aux_done_key(run, r) for r in run.roles.auxiliaries], "the auxiliary ranks' end")


def aux_done_key(run, rank):
    return f"w:{run.key}/aux_done/{rank}"


def aux_loop(run):
    """Hybrid, an auxiliary rank: the queue stage between rollout and training. The actor puts each group the moment
    it completes (put_group); this rank takes its share of them as they come, whole groups, while the actor still
    decodes the round's tail, and adds their columns (aux_columns) in pieces of a micro-batch's groups, the earliest
    put first: the trainers read each micro-batch's columns as their update reaches it (AuxColumns), and each put
    serves the queue, so that a trainer waits on this rank for at most a piece. Runs until trainer 0 says the last
    batch has been read."""
    seen = dict.fromkeys(run.roles.writers(), 0)  # per writer: this rank's groups of it done so far, in order
    done = set()                                  # (writer, k): this rank's k-th group of that writer, done out of order
    piece = aux_piece(run)                        # rows per piece of work
    while True:
        pending = aux_groups(run, seen, done)
        with run.spans("idle"):
            rows = wait_for_groups(run, pending)
        if rows is None:  # the run is over: every batch it trains has been read
            break
        got = set(rows.ids)
        groups = [g for g in sorted(pending, key=lambda g: g[::-1]) if set(pending[g]) <= got]  # (k, writer): put order
        ids = [r for g in groups for r in pending[g]]  # group by group
        if len(ids) != len(rows.ids):  # a put publishes a whole group: a part of one would be a bug, not a wait
            raise RuntimeError(f"rank {run.rank}: read rows {sorted(set(rows.ids) - set(ids))} without the rest of "
                               "their group")
        for j in range(0, len(ids), piece):
            aux_columns(run, rows, ids[j:j + piece])
        done.update(groups)
        for w in seen:
            while (w, seen[w]) in done:
                done.discard((w, seen[w]))
                seen[w] += 1
    run.queue.serve()  # retire the transfers the trainers acknowledged
    run.store.set(aux_done_key(run, run.rank), "1")


def aux_piece(run):
    """Rows per piece of an auxiliary rank's work: its share of one micro-batch of the update, in whole groups."""
    cfg = run.cfg
    per_micro_batch = cfg.prompts_per_step // (cfg.micro_batches * cfg.updates_per_batch * len(run.roles.auxiliaries))
    return max(1, per_micro_batch) * cfg.group_size


def aux_columns(run, rows, ids):
    """4 (and 2-3 with a reward model), on an auxiliary rank: the frozen reference's log-probs of rows `ids` (whole
    groups, in order; one forward), and the reward model's rewards and group advantages, put back as columns of the
    same rows."""
    cfg = run.cfg
    run.spans.args = {"rows": len(ids)}
    where = {r: i for i, r in enumerate(rows.ids)}  # the queue returns ids ascending: back in group order
    prompts, responses = ([rows.cols[c][where[r]] for r in ids] for c in ("prompt", "response"))
    one_forward = replace(run.algo, micro_batches=1)
    columns = {"ref_logprobs": reference_logprobs(run, grpo.Samples(prompts, responses, None, None), algo=one_forward)}
    run.queue.serve()  # between the two models: a trainer may be waiting for columns this rank put before
    if run.reward_model is not None:
        rewards = model_rewards(run, prompts, responses)                                          # (B,)
        advantages = grpo.group_advantages(rewards, cfg.group_size, cfg.adv_estimator)
        columns |= {"reward": rewards.tolist(), "advantage": advantages.tolist()}
    run.queue.put(columns, ids=ids)


def aux_groups(run, seen, done):
    """This auxiliary rank's next groups of each writer, (writer, k) -> the G row ids of its k-th, not yet done: as
    many as StaleSync lets a replica complete ahead of training (S + 1 batches' share; more than this rank's share of
    them; a replica that the shared cut lets run further ahead has its later groups served at a later call).
    Round robin: the m-th group a writer puts (its rows m * G ... m * G + G - 1) goes to auxiliary rank
    (m + the writer's index) % aux_ranks."""
    cfg, G, aux = run.cfg, run.cfg.group_size, run.roles.auxiliaries
    ahead = (cfg.staleness + 1) * cfg.prompts_per_step // run.roles.replicas
    out = {}
    for i, (w, k0) in enumerate(seen.items()):
        first = (aux.index(run.rank) - i) % len(aux)  # this rank's first m of writer w; then every len(aux)-th
        for k in range(k0, k0 + ahead):
            m = first + k * len(aux)
            if (w, k) not in done:
                out[(w, k)] = [run.queue.row_id(m * G + j, w) for j in range(G)]
    return out


def wait_for_groups(run, groups):
    """The rows of whichever of `groups` ((writer, k) -> row ids) the actor has put, once there is one; None once
    trainer 0 has said the run is over. A put publishes a group's rows together, so the rows come as whole groups.
    An actor that puts nothing for pg_timeout_s times out, naming the groups waited for."""
    only = {r for ids in groups.values() for r in ids}
    deadline = time.monotonic() + run.cfg.pg_timeout_s
    while not run.store.check([weights_key(run, "final")]):
        rows = run.queue.get("aux", len(only), min_rows=0, only=only)  # takes what there is (serves while it looks)
        if rows.ids:
            return rows
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {run.rank}: the actor put none of groups {sorted(groups)[:8]} (writer, index) in "
                               f"{run.cfg.pg_timeout_s}s: is the actor alive?")
        time.sleep(run.queue.spec.poll_s)
    return None


# ----------------------------------------------------------------------------- the RL step's stages
AT_CUT = ("regenerated", "filtered", "filled_in")  # a batch's facts of its cut (stalesync's stale/*_at_cut)
STALE_FACTS = ("sample_id", "start_version", "versions", *AT_CUT)  # a row's "stale" (build_queue); AT_CUT: first row


def score_and_enqueue(run, batch):
    """2-3. Score each response, normalise the rewards within each group (a group never spans replicas),
    and put the rows into the queue: one writer per TP group, its peers hold the same samples. Returns the rows'
    ids on a writer, else None."""
    return put_rows(run, batch, cut_facts(batch))


def score_and_announce(run, batch):
    """Colocated: score_and_enqueue, then the batch's row ids gathered from every writer (announce_rows): the shared
    cut's shares vary from step to step, so a writer's rows of a batch are named, not counted. Collective."""
    announce_rows(run, score_and_enqueue(run, batch))


def cut_facts(batch):
    """The batch's AT_CUT facts: groups regenerated, dropped, and given for a held-back peer at its cut."""
    return [batch.metrics[f"stale/{name}_at_cut"] for name in AT_CUT]


def put_rows(run, batch, at_cut=(0, 0, 0)):
    """Put batch's rows (or one group's) into the queue with their rule rewards, rewards and advantages (hybrid with a
    reward model: run.score is None, the auxiliary stage adds them), "stale" facts (at_cut on the first row) and
    routes. Returns the rows' ids on a writer, else None."""
    rule = rule_rewards(run, batch.prompts, batch.responses)  # what the task's rule says, logged beside
    scored = {}
    if run.score is not None:
        rewards = run.score(run, batch.prompts, batch.responses)                                   # (B,)
        advantages = grpo.group_advantages(rewards, run.cfg.group_size, run.cfg.adv_estimator)
        scored = {"reward": rewards.tolist(), "advantage": advantages.tolist()}
    if run.rank not in run.roles.writers():
        return None
    stale = [torch.tensor([i, start, len(set(v.tolist())), *(at_cut if j == 0 else [0] * len(AT_CUT))])  # STALE_FACTS
             for j, (i, start, v) in enumerate(zip(batch.ids, batch.start_versions, batch.token_versions))]
    routes = [r.flatten().int() for r in batch.per_token.get("routes", [])]  # (n_i, L, K) -> packed; an empty share: []
    return run.queue.put({"prompt": batch.prompts, "response": batch.responses, "old_logprobs": batch.logprobs,
                          "rule_reward": rule.tolist(), "stale": stale, "routes": routes} | scored)


def put_group(run, group):
    """Hybrid, StaleSync's on_group: a group into the queue the moment it completes (and is kept), for the auxiliary
    ranks to work on while the round decodes on; its rows' ids wait for the batch that takes it (announce_batch)."""
    ids = put_rows(run, group)
    run.rows_ahead.update(zip(group.ids, ids or [None] * len(group.ids)))


def serve_then(queue, cut, sched):
    """Hybrid: StaleSync's cut, which a round calls once per decode chunk, answering the queue's requests first:
    a group put in one chunk is pulled by an auxiliary rank during the next, not at the round's end."""
    queue.serve()
    return cut(sched)


def announce_batch(run, batch):
    """Hybrid: the batch StaleSync cut is already in the queue, group by group; its row ids, gathered from every writer
    (announce_rows), are what the trainers read, and its cut's facts count in this rank's figures. Collective."""
    announce_rows(run, [run.rows_ahead.pop(i) for i in batch.ids])
    run.at_cut = cut_facts(batch)


def announce_rows(run, mine):
    """The row ids of the batch this step trains (read_share), every writer's (`mine`: this rank's) gathered over the
    trainers into run.batch_ids. Collective."""
    everyone = [None] * dist.get_world_size(run.train_group)
    dist.all_gather_object(everyone, mine if run.rank in run.roles.writers() else [], group=run.train_group)
    run.batch_ids = {r for part in everyone for r in part}


def batch_rows(run, step):
    """Separated: the row ids of the batch trained at RL step `step`, writer by writer: each generator cuts its own
    share, n_local rows per batch, in order, so its j-th row of that batch has a known id, however far ahead it runs."""
    n_local = run.cfg.prompts_per_step * run.cfg.group_size // run.roles.replicas
    return [run.queue.row_id(j, w) for w in run.roles.writers() for j in range((step - 1) * n_local, step * n_local)]


def read_share(run, step):
    """4. This trainer's token-balanced share of batch step - 1: every writer's rows of it (the ids announce_rows
    gathered; separated: batch_rows). Returns (samples, the rows read, for share_figures once they are complete, and the
    reference's log-probs that come with the rows: hybrid, an AuxColumns that brings them during the update (its
    arrive); else None)."""
    with run.spans("queue"):
        rows = read_rows(run, step)
    B = len(rows.ids)
    advantages = rows.stack("advantage") if "advantage" in rows.cols else torch.full((B,), float("nan"))    # (B,)
    routes = [r.long().view(len(t), run.cfg.n_layers, run.cfg.top_k)                         # (n_i, L, K) each
              for r, t in zip(rows.cols["routes"], rows.cols["response"])]
    samples = grpo.Samples(rows.cols["prompt"], rows.cols["response"], rows.cols["old_logprobs"], advantages,
                           truncated=[bool(r[-1] != task.EOS) for r in rows.cols["response"]], routes=routes)
    queued = None
    if run.roles.hybrid:  # micro-batches in the order the rows were put (a row's place in its writer's puts), which
        samples.order = [r // run.queue.world for r in rows.ids]  # is the order the auxiliary stage completes them
        queued = AuxColumns(run, step, rows, samples)
    if queued is not None and "advantage" in queued.names and run.cfg.adv_estimator == "reinforce++":
        queued(range(B))  # batch-normalised below: every row's advantage first (no overlap with the update)
    samples.advantages = grpo.finish_advantages(samples.advantages, run.cfg.adv_estimator, run.device, run.batch_group)
    return samples, rows, queued


def read_rows(run, step):
    """read_share's get: the rows of batch step - 1 with the columns their writers put."""
    cfg = run.cfg
    per_step = cfg.prompts_per_step * cfg.group_size
    ids = set(batch_rows(run, step)) if run.roles.separated else run.batch_ids
    if run.pipe is None:  # a token-balanced share of the batch
        return run.queue.get("train", per_step, dp_group=run.train_group, only=ids)
    # PP: an equal count (fixed micro-batch shapes), read once per pipeline and broadcast to its stages
    mine = set(sorted(ids)[run.data_index::run.data_size])
    return run.queue.get("train", len(mine), group=run.pipe_group, only=mine)


def share_figures(run, step, rows):
    """The step's sums over this trainer's rows (complete: hybrid, after the update brought the auxiliary columns)."""
    width = len(STALE_FACTS)  # a row that older code put (a resumed queue) lacks the last facts: zeros
    facts = [torch.nn.functional.pad(f, (0, width - len(f))) for f in rows.cols["stale"]]
    table = torch.stack(facts) if facts else torch.zeros(0, width, dtype=torch.long)             # (B, STALE_FACTS)
    stale = dict(zip(STALE_FACTS, table.unbind(1)))                                         # name -> (B,)
    ages = (step - 1) - stale["start_version"]                                              # (B,)
    figures = {"reward": float(rows.stack("reward").sum()), "rule_reward": float(rows.stack("rule_reward").sum()),
               "rule_agree": float((rows.stack("reward") == rows.stack("rule_reward")).sum()), "rows": len(rows.ids),
               "prompt_digits": float(sum(len(p) - 2 for p in rows.cols["prompt"])),
               "response_tokens": float(sum(len(r) for r in rows.cols["response"])),
               "age_sum": float(ages.sum()), "age_max": float(ages.max()) if len(ages) else 0.0,
               "partial_continued": float((stale["versions"] > 1).sum()),
               **{name: float(stale[name].sum()) + fact for name, fact in zip(AT_CUT, run.at_cut)},  # hybrid: at_cut
               "rows_ahead": float(len(run.rows_ahead))}
    return {k: v if run.counts_rows else 0.0 for k, v in figures.items()}  # PP: a pipeline's rows counted once


class AuxColumns:
    """Hybrid, a trainer: the auxiliary stage's columns of its rows (the reference's log-probs; with a reward model,
    rewards and advantages), read micro-batch by micro-batch as the update reaches them (grpo_update's arrive). The
    micro-batches follow the order the rows were put (Samples.order): the first hold the groups that completed early
    in the round, which the auxiliary stage worked on while it decoded; it finishes the last groups while those train.
    A row's ref_logprobs still None marks every one of its columns as not yet arrived."""

    def __init__(self, run, step, rows, samples):
        self.run, self.step, self.rows, self.samples = run, step, rows, samples
        self.names = run.queue.spec.stages["from_aux"]
        for name in self.names:  # filled in place as they arrive
            rows.cols[name] = [None] * len(rows.ids)
        self.ref_logprobs = rows.cols["ref_logprobs"]                                       # (B,) of (n_i,)
        self.calls = 0  # arrive calls so far: the same count on every trainer (the barrier's name)

    def __call__(self, which):
        """Rows `which` (indices into the share) complete: their columns read if they are not yet (with those of any
        other row the auxiliary stage has finished), then every trainer waits for its peers' (serving the queue: a
        peer's rows may need this rank's groups pulled first) before the micro-batch's collectives."""
        if any(self.ref_logprobs[i] is None for i in which):
            with self.run.spans("queue"):
                self._take([i for i, lp in enumerate(self.ref_logprobs) if lp is None], at_least=0)
                self._take([i for i in which if self.ref_logprobs[i] is None])
        self.calls += 1
        serve_until_all(self.run, f"{self.step}/{self.calls}")

    def _take(self, idx, at_least=None):
        """Read the columns of these rows (indices into the share): all of them, or what there is (at_least=0)."""
        if not idx:
            return
        got = read_from_aux(self.run, self.step, [self.rows.ids[i] for i in idx], at_least)
        where = {r: j for j, r in enumerate(got.ids)}
        for i in [i for i in idx if self.rows.ids[i] in where]:
            for name in self.names:
                self.rows.cols[name][i] = got.cols[name][where[self.rows.ids[i]]]
            if "advantage" in self.names:
                self.samples.advantages[i] = self.rows.cols["advantage"][i]


def serve_until_all(run, name):
    """A barrier of the trainers, through the store, that serves the queue while it waits. It waits up to 2 x the
    timeout, so that a peer's own wait for the auxiliary stage, which times out first, is the failure raised."""
    n = len(run.roles.trainers)
    if n == 1:
        run.queue.serve()
        return
    key = f"w:{run.key}/arrived/{name}"
    run.store.add(key, 1)
    deadline = time.monotonic() + 2 * run.cfg.pg_timeout_s
    with run.spans("queue"):
        while int(run.store.add(key, 0)) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {run.rank}: a trainer did not reach micro-batch barrier {name} (step/call) "
                                   f"in {2 * run.cfg.pg_timeout_s}s: is it alive?")
            run.queue.serve()
            time.sleep(run.queue.spec.poll_s)


def read_from_aux(run, step, ids, min_rows=None):
    """Hybrid: the auxiliary stage's columns of rows `ids`, once it has put them (at least min_rows of them: default
    all); rows that still lack them past the timeout name that stage, with the rows."""
    try:
        return run.queue.get("from_aux", len(ids), min_rows=min_rows, only=set(ids))
    except TimeoutError as e:
        raise TimeoutError(f"the auxiliary stage (ranks {run.roles.auxiliaries}) did not add its columns (the "
                           f"reference's log-probs; with a reward model, rewards and advantages) to rows {sorted(ids)} "
                           f"of step {step}'s batch in {run.cfg.pg_timeout_s}s: is it alive? ({e})") from e


def rule_rewards(run, prompts, responses):
    """2. The task's rule: 1.0 for an exact answer, else 0.0. (B,)"""
    return torch.tensor([task.score(p, r) for p, r in zip(prompts, responses)])


def model_rewards(run, prompts, responses):
    """2. --reward-model: the learned reward model's verdict, P(correct) >= 0.5 as 1.0, else 0.0. (B,) The rows come
    group by group, and each group is scored as a batch of its own: the same tensors, so the same verdicts, whether
    the filter scores it as it completes or the batch scores it for training."""
    with run.spans("reward_model"), run.reward_model.on_device() as rm:
        return (reward_model.score(rm, prompts, responses, batch_size=run.cfg.group_size) >= 0.5).float()


def reference_logprobs(run, samples, queued=None, algo=None):
    """4. The frozen initial policy's log-probs of the share (under colocated-all it visits the device); hybrid:
    those the auxiliary stage puts (queued: an AuxColumns, which fills them in as they arrive). algo: its micro-batches
    (default: the update's)."""
    if queued is not None:
        return queued.ref_logprobs
    if run.reference is None:
        return None
    with run.spans("reference"), run.reference.on_device() as ref:
        if run.pipe is not None:  # its own stages, through its own schedule (a Pipeline of the frozen stage)
            return pipeline.logprobs(run.ref_pipe, samples, run.algo)
        return grpo.chunk_logprobs(ref, samples, algo or run.algo, run.device)


def held_out_correct(run):
    """Greedy decoding of this replica's slice of the held-out set: {digits: how many of those prompts it answers
    exactly} (only the writer of each TP group counts, so that a sum over ranks counts each prompt once)."""
    i, n = run.roles.replica(run.rank), run.roles.replicas  # replica i of n
    mine = run.eval_prompts[i * len(run.eval_prompts) // n:(i + 1) * len(run.eval_prompts) // n]
    gen = generate(run.engine, mine, torch.zeros(len(mine), dtype=torch.long), run.cfg.max_new_tokens,
                   task.EOS, task.PAD, temperature=0, lockstep=run.sampler.lockstep)
    correct = dict.fromkeys(range(1, run.cfg.max_digits + 1), 0.0)
    for p, r in zip(mine, gen.tokens):
        correct[len(p) - 2] += task.score(p, r) if run.rank in run.roles.writers() else 0.0
    return correct


def eval_figures(run, correct):
    """The held-out accuracy, overall and by digit count, from {digits: correct answers} of every replica."""
    asked = dict.fromkeys(correct, 0)
    for p in run.eval_prompts:
        asked[len(p) - 2] += 1
    return {"eval/accuracy": sum(correct.values()) / len(run.eval_prompts),
            "eval/accuracy_by_digits": {str(k): correct[k] / asked[k] for k in correct if asked[k]}}


def is_eval_step(cfg, step):
    return step <= 1 or step % cfg.eval_every == 0 or step == cfg.steps


def share_done(run, step, mark):
    """The share of the run behind after `step` (RunLog.share), on rank 0's clock: every trainer agrees (one MAX
    all-reduce, only while the steps alone leave the run unfinished and --rl-seconds is set)."""
    if not run.cfg.rl_seconds or step >= run.cfg.steps:
        return run.log.share(step, 0.0)
    seconds = run.log.rl_seconds(mark) if run.rank == 0 else 0.0
    return run.log.share(step, all_sum({"s": seconds}, run.device, run.train_group, dist.ReduceOp.MAX)["s"])


def out_of_time(run, step, done):
    """Whether this step is the last (its share of the run has reached 1). Trainer 0 tells the generators of a
    separated run (the store key of final_version), and the auxiliary ranks of a hybrid one, which serve until
    the last batch has been read (this step's)."""
    last = done >= 1
    if last and run.rank == 0 and run.roles.hybrid:
        run.store.set(weights_key(run, "final"), str(step))
    return last


def anneal_lr(run, done):
    """Sets every param group's learning rate for `done` of the run behind (0 to 1): a cosine from --lr down to
    --lr x --lr-decay, so that the policy settles as the run ends rather than stopping mid-swing."""
    cosine = 0.5 * (1 + math.cos(math.pi * min(done, 1.0)))  # 1 at the start, 0 at the end
    for group in run.optimizer.param_groups:
        group["lr"] = run.cfg.lr * (run.cfg.lr_decay + (1 - run.cfg.lr_decay) * cosine)


def resume_lr(run):
    """Resumed, a trainer: the learning rate where the run stopped (the checkpoint applies this run's --lr), from
    the steps and RL seconds it saved. Exact when the steps bind; on the clock, the saved seconds include the
    step's last milliseconds (its record, a separated push) that its own share_done did not."""
    if run.resume_from is not None and run.optimizer is not None:
        anneal_lr(run, run.log.share(run.log.start - 1, run.log.seconds))


def final_version(run):
    """The version the run ends at: --steps, or the step --rl-seconds stopped at (separated generators)."""
    key = weights_key(run, "final")
    return int(run.store.get(key)) if run.store.check([key]) else run.cfg.steps


# ----------------------------------------------------------------------------- separated: weights and waits
def weights_key(run, version):
    return f"w:{run.key}/{version}"


def push_weights(run, version, last=False):
    """6. A trainer's side: announce `version` (and, if it is the last, that it is), then gather it bucket
    by bucket; trainer 0 broadcasts, and its push ends once every generator has the weights (a broadcast's
    sender may return before its receivers do)."""
    if run.rank == 0:
        if last:
            run.store.set(weights_key(run, "final"), str(version))
        run.store.set(weights_key(run, version), "1")
    with run.spans("push"):
        push.push_weights(run.model, None, 0, run.push_group, run.cfg.bucket_kb * 1024)
        if run.rank == 0:
            received = [f"{weights_key(run, version)}/got/{i}" for i in range(run.roles.replicas)]
            wait_for(run, received, f"the generators' receipt of version {version}")


def receive_weights(run, version, evaluate=True):
    """6. A generator's side: join the push of `version`, hand it to the scheduler (which drops the
    sampler's KV cache: every in-flight prefix is read again) and, on an evaluation step, post the
    held-out score of this replica to the store for trainer 0."""
    wait_for(run, [weights_key(run, version)], f"weights of version {version}")
    with run.spans("recv"):
        push.push_weights(None, run.engine, 0, run.push_group, run.cfg.bucket_kb * 1024)
    run.store.set(f"{weights_key(run, version)}/got/{run.roles.replica(run.rank)}", "1")
    run.sched.update(version)
    if evaluate and (is_eval_step(run.cfg, version) or version == final_version(run)):
        with run.spans("eval"):
            correct = held_out_correct(run)
        run.store.set(f"{weights_key(run, version)}/eval/{run.roles.replica(run.rank)}", json.dumps(correct))


def collect_eval(run, version):
    """Trainer 0: the held-out accuracy of `version`, summed over the generators' posts."""
    if run.rank != 0:
        return {"eval/accuracy": None}
    keys = [f"{weights_key(run, version)}/eval/{i}" for i in range(run.roles.replicas)]
    with run.spans("idle"):
        wait_for(run, keys, f"held-out accuracy of version {version}")
    posts = [{int(k): v for k, v in json.loads(run.store.get(key)).items()} for key in keys]
    return eval_figures(run, {k: sum(post[k] for post in posts) for k in posts[0]})


def wait_for(run, keys, what, moving=None):
    """Poll the store until every key exists, serving the queue all along. A peer that posts nothing (or,
    with `moving`, a key it updates as it works, leaves it unchanged) for pg_timeout_s times out."""
    seen, deadline = None, time.monotonic() + run.cfg.pg_timeout_s
    while not run.store.check(keys):
        run.queue.serve()
        now = run.store.get(moving) if moving and run.store.check([moving]) else None
        if now != seen:  # progress: the deadline moves
            seen, deadline = now, time.monotonic() + run.cfg.pg_timeout_s
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {run.rank}: no {what} after {run.cfg.pg_timeout_s}s (keys {keys}, "
                               f"last progress {seen!r}): is the peer alive?")
        time.sleep(0.001)


# ----------------------------------------------------------------------------- the supervised warm-up
def warm_up(run):
    """Supervised warm-up on the trainers: cross-entropy on the task's answers, data parallel. Trainer 0 counts
    its steps in the store; a rank that does not train (a separated generator) waits on that heartbeat, not
    in a collective that a long warm-up would time out."""
    cfg, roles = run.cfg, run.roles
    heartbeat, done = f"w:{run.key}/warmup_steps", f"w:{run.key}/warmup_done"
    if run.rank not in roles.trainers:
        return wait_for(run, [done], "end of trainer 0's warm-up", moving=heartbeat)
    optimizer = torch.optim.AdamW(expert_parallel.optimizer_groups(run.model), lr=cfg.warmup_lr, betas=(0.9, 0.98),
                                  weight_decay=0.0, foreach=True)
    me, n = run.data_index, cfg.warmup_batch // run.data_size  # this rank's slice (its pipeline's, under PP)
    with run.spans("warmup"):
        for i in range(cfg.warmup_steps):
            if run.rank == 0:
                run.store.set(heartbeat, str(i))
            prompts = run.warm_stream.next(cfg.warmup_batch)[me * n:(me + 1) * n]
            run.supervised(run.model, optimizer, prompts, [task.answer(p) for p in prompts], run.device,
                           cfg.grad_clip, run.train_group, run.clip_grads)
    if run.grad_sync is not None:  # the warm-up's unsent gradient is not RL's to apply
        run.grad_sync.reset()
    if run.rank == 0:
        run.store.set(done, "1")


# ----------------------------------------------------------------------------- building the run (every option, once)
@dataclass
class Run:
    """Everything the loops use, built once by `build`. Fields a rank's role does not need are None."""
    cfg: Config
    rank: int
    roles: Roles
    device: torch.device
    out_dir: str
    key: str                      # this start's own prefix of store keys (a restarted job reuses the store)
    resume_from: tuple            # (folder, meta) of the checkpoint resumed from, or None
    spans: timeline.Spans         # every timed phase of this rank
    store: object                 # the process group's store: the queue's control plane, announcements
    queue: distqueue.DistQueue    # rollout -> training, packed
    eval_prompts: list            # the held-out set, never trained on
    warm_stream: task.PromptStream
    rl_prompts: task.SlotPrompts  # the RL prompt of a global batch slot and attempt
    curriculum: curriculum.Curriculum  # per prompt length, from every scored group: the RL prompts' weights
    train_group: object = None    # the trainers' group (FSDP's ranks)
    model: torch.nn.Module = None  # the trained policy, FSDP2 over the trainers
    optimizer: torch.optim.Optimizer = None
    algo: grpo.GRPOConfig = None
    clip_grads: object = None     # grpo_update's clip: the experts' own under EP, the stages' under PP, else None
    update: object = grpo.grpo_update  # a batch's GRPO updates; pipeline.grpo_update's partial under PP
    supervised: object = grpo.supervised_step  # a warm-up step; pipeline.supervised_step's partial under PP
    pipe: pipeline.Pipeline = None  # --train-pp: this rank's stage of the pipeline and its schedules
    data_index: int = 0           # this rank's slice of a global batch (its pipeline's under PP), of data_size
    data_size: int = 1
    pipe_group: object = None     # --train-pp: this rank's pipeline (one rank per stage): it reads rows once
    ref_pipe: pipeline.Pipeline = None  # --train-pp with a reference: its stage's pipeline
    counts_rows: bool = True      # this rank's rows count in the step's figures (under PP: the last stage's)
    batch_group: object = None    # ranks that together hold each row of a batch once (the trainers; PP: a stage's)
    experts: expert_parallel.ExpertParallel = None  # --train-ep: the experts' layouts, grads and re-shard
    grad_sync: gradsync.GradSync = None  # --nodes: the gradients' average across nodes (compressed: its residual)
    reference: fusion.HostOffloaded = None  # the frozen initial policy (kl_coef > 0, colocated-all; hybrid: aux ranks)
    score: object = rule_rewards  # (run, prompts, responses) -> (B,) rewards (--reward-model: model_rewards)
    enqueue: object = score_and_enqueue  # (run, batch): the cut's batch into the queue (colocated: score_and_announce)
    rows_ahead: dict = field(default_factory=dict)  # hybrid: sample id -> row id of groups put, not yet in a batch
    batch_ids: set = None         # colocated, hybrid: the row ids of the batch this step trains (every writer's)
    at_cut: tuple = (0, 0, 0)     # hybrid: this rank's last cut's AT_CUT facts (not in the rows)
    reward_model: fusion.HostOffloaded = None  # --reward-model: frozen, on host except while it scores (hybrid: aux)
    reward_model_figures: dict = field(default_factory=dict)  # its training and held-out agreement (rm/*)
    engine: Policy = None         # the rollout engine (generators)
    sampler: Sampler = None       # the engine's sampler; keeps its KV cache between decode chunks
    sched: stalesync.StaleSync = None
    actor: fusion.FusedActor = None  # colocated: the actor's phase switch (its movers: the EP re-shard)
    cut: object = None            # colocated: how replicas cut each batch (SharedCut or AllReady; hybrid: serve_then)
    push_group: object = None     # separated: trainer 0 and the generators; hybrid: rank 0 and the auxiliary ranks
    rollout_group: object = None  # the generators' group (the curriculum's sum over replicas)
    log: "RunLog" = None


def build(cfg, out_dir=None):
    """Process groups, the policy in its training layout, the rollout engine, the queue, the scheduler:
    every deployment option is applied here, once."""
    rank, world, device = setup_distributed(cfg)
    if device.type == "cpu":  # what a phase frees stays with the process for the next, as on CUDA
        shm_transport.keep_freed_memory()
    default = cfg.out or os.path.join("runs", datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    names = [out_dir or default, uuid.uuid4().hex[:12]]  # rank 0 names the folder and the start
    dist.broadcast_object_list(names, src=0)
    out_dir, key = names[0], f"{names[0]}:{names[1]}"
    resume_from = checkpoint.find(cfg, out_dir)  # checked on every rank before anything is written
    os.makedirs(out_dir, exist_ok=True)
    roles = Roles.of(cfg, world)
    store = distqueue.default_store()
    learned = curriculum.Curriculum(cfg.max_digits)
    eval_prompts, warm_stream, rl_prompts = task.prompt_streams(  # --curriculum: RL draws weighted by length
        cfg.seed, cfg.max_digits, cfg.eval_prompts, learned.draw if cfg.curriculum else None)
    run = Run(cfg, rank, roles, device, out_dir, key, resume_from, timeline.Spans(device=device), store,
              build_queue(cfg, key, store, rank, world, device), eval_prompts, warm_stream, rl_prompts, learned)
    build_policy(run)
    if rank in roles.generators:
        build_rollout(run)
    if roles.hybrid:  # each group goes into the queue as it completes (build_rollout's on_group); the cut names them
        run.enqueue = announce_batch
    elif not roles.separated:  # the shared cut's shares vary: each batch's rows are named to the trainers
        run.enqueue = score_and_announce
    if rank in roles.generators and not roles.separated:  # the actor: one phase switch moves everything (shards,
        # optimizer state, experts); the gather reads the peers' shards in shared memory on one CPU host where the
        # actor is every rank, else broadcasts (collective)
        transport = shm_transport.SharedMemory.connect(run.model, cfg.pg_timeout_s) or fusion.Broadcasts()
        run.actor = fusion.FusedActor(
            run.model, run.optimizer, run.engine, bucket_bytes=cfg.bucket_kb * 1024,
            inplace=cfg.infer_tp == 1,  # TP 1: the engine holds full weights, gathered straight into them
            movers=[m for m in (run.experts, run.grad_sync) if m is not None], transport=transport,
            group=run.rollout_group)  # the actor's ranks (hybrid: not the auxiliary ones)
        if rank == 0:
            print(f"switch: {run.actor.path}", flush=True)  # e.g. "in place, SharedMemory"
        # the cut: one over every replica's pool, so that a replica held back by its dropped groups does not hold
        # the step; --shared-cut 0: each replica its own share, once every rank is ready
        run.cut = stalesync.SharedCut(run.rollout_group, replica=roles.replica(rank), leader=rank in roles.writers(),
                                      device=device, spans=run.spans) if cfg.shared_cut else \
            stalesync.AllReady(run.rollout_group, device=device, spans=run.spans)
        if roles.hybrid:  # called once per decode chunk: the auxiliary ranks' pulls are answered between chunks
            run.cut = functools.partial(serve_then, run.queue, run.cut)
    run.log = RunLog(run, start=resume_from[1]["step"] + 1 if resume_from else 1)
    return run


def build_queue(cfg, key, store, rank, world, device):
    """The queue between rollout and training: one row per sample; its keys live in the process group's
    store under this run's own prefix. "stale" holds a row's STALE_FACTS: its sample id in its replica's
    scheduler, the version its generation started at, how many versions its tokens span (> 1: a partial
    rollout), and on a batch's first row its AT_CUT facts (groups regenerated, filtered, given for a held-back
    peer), so that the trainers can log (and count) what they train."""
    columns = {"prompt": "int64", "response": "int64", "old_logprobs": "float32", "reward": "float32",
               "rule_reward": "float32", "advantage": "float32", "stale": "int64",
               "routes": "int32"}  # routes: (n_i * L * K,) experts
    stages = {"train": tuple(columns)}
    if cfg.deploy == "hybrid":  # three stages: the actor puts; the auxiliary ranks read "aux" and add "from_aux"; the
        # trainers read "train" (the actor's columns) at the cut and "from_aux" micro-batch by micro-batch
        columns["ref_logprobs"] = "float32"                                                    # (n_i,)
        added = ("ref_logprobs", "reward", "advantage") if cfg.reward_model else ("ref_logprobs",)
        stages = {"aux": ("prompt", "response"), "train": tuple(c for c in columns if c not in added),
                  "from_aux": added}
    poll_s = 0.0005 if cfg.deploy == "hybrid" else 0.002  # the hybrid's backbone: each step waits on its round trips
    spec = distqueue.QueueSpec(columns=columns, scalars=("reward", "rule_reward", "advantage"), stages=stages,
                               timeout_s=cfg.pg_timeout_s, name=f"dq:{key}", poll_s=poll_s)
    pg = None if device.type == "cpu" else dist.new_group(  # the queue moves host tensors: gloo
        backend="gloo", timeout=datetime.timedelta(seconds=cfg.pg_timeout_s))
    return distqueue.DistQueue(spec, store, rank, world, pg)


def build_policy(run):
    """The trained model (EP applied, then FSDP2 over the trainers), its optimizer, the rollout engine
    (TP over infer_tp ranks) and their process groups, each with the run's timeout."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    cfg, roles, rank, device = run.cfg, run.roles, run.rank, run.device
    timeout = datetime.timedelta(seconds=cfg.pg_timeout_s)
    tp_group, run.algo = None, grpo_config(cfg)
    if roles.hybrid:  # FSDP over the actor's ranks; the auxiliary ranks get the reference through push_group
        run.train_group = run.rollout_group = dist.new_group(roles.trainers, timeout=timeout)
        mesh = DeviceMesh.from_group(run.train_group, device.type) if rank in roles.trainers else None
        run.push_group = dist.new_group([0] + roles.auxiliaries, timeout=timeout)
    elif roles.separated:  # FSDP over the trainers; the generators get the weights through push_group
        run.train_group = dist.new_group(roles.trainers, timeout=timeout)
        mesh = DeviceMesh.from_group(run.train_group, device.type) if rank in roles.trainers else None
        run.push_group = dist.new_group([0] + roles.generators, timeout=timeout)
        run.rollout_group = dist.new_group(roles.generators, timeout=timeout)
    else:  # FSDP over every rank; the engine is tensor-parallel over groups of infer_tp ranks
        run.train_group = run.rollout_group = dist.group.WORLD
        mesh = init_device_mesh(device.type, (roles.world,))
        tp_group = TPLayout(roles.world, cfg.infer_tp, n_heads=cfg.n_heads).new_groups(cfg.pg_timeout_s)[0]
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    model = Policy(model_config(cfg)).to(device)
    if rank in roles.generators:
        run.engine = Policy(model_config(cfg), tp_group).to(device).eval().requires_grad_(False)
    if cfg.train_ep:  # the experts leave FSDP: EP shards them, moe_switch.py re-shards them
        run.experts = expert_parallel.ExpertParallel(cfg.train_ep, cfg.infer_ep, roles.world, cfg.n_experts,
                                                     cfg.bucket_kb * 1024, cfg.pg_timeout_s)
        run.experts.apply(model, run.engine)
        run.clip_grads = run.experts.clip_grads
    if rank not in roles.trainers:
        return
    run.data_index, run.data_size, run.batch_group = roles.trainers.index(rank), len(roles.trainers), run.train_group
    if cfg.train_pp > 1:  # this rank keeps its stage's blocks only, FSDP2 over the stage's ranks
        model, mesh = apply_pipeline_parallel(run, model)
    if cfg.nodes > 1:  # FSDP2 within each node; gradsync.py averages the shards' gradients across nodes
        mesh = apply_nodes(run)
    apply_fsdp(model, mesh, set(run.experts.params(model)) if run.experts else None, cfg.fsdp_units)
    if run.grad_sync is not None:
        run.grad_sync.apply(model)  # a hook on each FSDP unit: its reduce-scattered shard, averaged across nodes
        run.clip_grads = functools.partial(synced_clip, run.grad_sync, run.clip_grads)
    run.model = model
    # foreach: each stage of Adam is one multi-tensor op over every shard, not one op per parameter, each of which
    # DTensor dispatches apart (CPU's default is per parameter; the results are the same, bit for bit)
    run.optimizer = torch.optim.AdamW(expert_parallel.optimizer_groups(model), lr=cfg.lr, betas=(0.9, 0.98),
                                      weight_decay=0.0, foreach=True)


def apply_fsdp(model, mesh, ignored, units):
    """FSDP2 over mesh, parameters kept gathered from an update's first forward to the reduce-scatter after its
    last backward (ZeRO-2's traffic). units "model": one unit, one gather and one reduce-scatter per optimizer
    step, its gradient hook once, after the whole backward. "block": a unit per block and one for the rest: a
    gather and a reduce-scatter per block, each block's gather issued while the one before computes (forward
    prefetch; backward prefetch is FSDP2's default), each block's reduce-scatter (and cross-node sync) as soon as
    its backward is done, while the blocks before it still run: overlap where a device has streams to spare."""
    from torch.distributed.fsdp import fully_shard
    if units == "block":
        blocks = [fully_shard(b, mesh=mesh, ignored_params=ignored, reshard_after_forward=False)
                  for b in model.blocks.children()]
        for block, after in zip(blocks, blocks[1:]):
            block.set_modules_to_forward_prefetch([after])
    fully_shard(model, mesh=mesh, ignored_params=ignored, reshard_after_forward=False)


def apply_nodes(run):
    """--nodes: the ranks as nodes of world / nodes (gradsync.py's groups); the gradient sync across them, which is
    also a mover of the phase switch (its error-feedback residual goes to host with the optimizer's state). Returns
    this rank's node's mesh, for FSDP2."""
    from torch.distributed.device_mesh import DeviceMesh
    cfg = run.cfg
    layout = gradsync.NodeLayout(run.roles.world, cfg.nodes)
    node_group, cross_group = gradsync.new_groups(layout, cfg.pg_timeout_s)
    run.grad_sync = gradsync.GradSync(cross_group, cfg.grad_compress, cfg.grad_topk, overlap=cfg.grad_overlap,
                                      timer=run.spans)  # the spans grad_sync (in a hook) and grad_sync_wait
    return DeviceMesh.from_group(node_group, run.device.type)


def synced_clip(sync, clip, model, max_norm):
    """grpo's clip_grads under --nodes: the cross-node averages land first (what is still in flight: every one with
    --grad-overlap), then the norm (clip: the run's own, None for clip_grad_norm_)."""
    sync.wait()
    if clip is not None:
        return clip(model, max_norm)
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def apply_pipeline_parallel(run, model):
    """--train-pp: the policy cut into stages (pipeline.py); this rank's Stage, the mesh of its stage's ranks (FSDP2's),
    the pipeline's schedules, and the PP update, warm-up step, gradient clip and batch slice. Collective."""
    from torch.distributed.device_mesh import DeviceMesh
    cfg, rank = run.cfg, run.rank
    layout = pipeline.PPLayout(cfg.train_pp, run.roles.world, cfg.n_layers)
    stage_group, pipe_group = pipeline.new_groups(layout, cfg.pg_timeout_s)
    run.pipe_group = pipe_group if run.device.type == "cpu" else pipeline.new_groups(  # the queue's: gloo
        layout, cfg.pg_timeout_s, backend="gloo")[1]
    stage = pipeline.split(model, layout, rank)
    length = model_config(cfg).max_seq_len  # the longest row: the longest prompt + the response budget
    run.pipe = pipeline.Pipeline(stage, layout, rank, pipe_group, cfg.micro_batches, length, run.device)
    run.update = functools.partial(pipeline.grpo_update, run.pipe)
    run.supervised = functools.partial(pipeline.supervised_step, run.pipe)
    run.clip_grads = functools.partial(pipeline.clip_grads, group=pipe_group)
    run.data_index, run.data_size, run.counts_rows = rank % layout.dp, layout.dp, run.pipe.last
    run.batch_group = stage_group  # one rank per pipeline: reinforce++'s whole-batch statistics count each row once
    return stage, DeviceMesh.from_group(stage_group, run.device.type)


def full_state_dict(model):
    """The whole trained policy on every rank, in the dense model's names and order (collective): its stages
    gathered under PP, its FSDP shards and EP experts otherwise. What a checkpoint's hash and the tests compare."""
    if isinstance(model, pipeline.Stage):
        return pipeline.full_state_dict(model)
    return expert_parallel.dense_state_dict(model)


def sample_seed(seed, slot, attempt, member):
    """The sampling seed of member j of the group in global batch slot `slot`, attempt `attempt`: the same
    in every deployment and world size, so every mode samples the same responses."""
    return int(np.random.SeedSequence([seed, slot, attempt, member]).generate_state(1)[0])


def global_slot(local, replica, n_prompts, prompts_per_step):
    """A replica's local StaleSync slot -> its slot in the global batches: replica r makes groups
    [r * n, (r + 1) * n) of every step's prompts_per_step, n = n_prompts of them."""
    step, j = divmod(local, n_prompts)
    return step * prompts_per_step + replica * n_prompts + j


def build_rollout(run):
    """The generator's side: the engine's sampler and StaleSync over this replica's slots of the global batches."""
    cfg, roles = run.cfg, run.roles
    n_prompts = cfg.prompts_per_step // roles.replicas
    to_global = functools.partial(global_slot, replica=roles.replica(run.rank), n_prompts=n_prompts,
                                  prompts_per_step=cfg.prompts_per_step)
    # Decode chunks of a round continue from the engine's KV cache; StaleSync drops it when it is stale.
    lockstep = None  # --infer-ep > 1: every forward meets the EP group's, so its ranks decode in lock-step
    if cfg.infer_ep > 1:
        lockstep = LockStep(run.experts.infer_groups[0], run.device, every=cfg.chunk_steps)
    hybrid = roles.hybrid  # S = 0 in chunks too: each group is put as it completes, while the round decodes on
    run.sampler = Sampler(run.engine, cfg.max_new_tokens, task.EOS, task.PAD, cfg.temperature, cfg.top_p,
                          lockstep=lockstep, routes=True,  # each token's experts: what training compares, or replays
                          on_step=run.queue.serve if hybrid else None)  # the auxiliary ranks pull between forwards
    stale = stalesync.StaleConfig(cfg.staleness, n_prompts, cfg.group_size, cfg.threshold, cfg.chunk_steps,
                                  max_len=cfg.max_new_tokens, max_filtered=cfg.filter_limit * n_prompts, chunk_s0=hybrid)
    run.sched = stalesync.StaleSync(
        stale, run.sampler, prompt_fn=lambda slot, attempt: run.rl_prompts(to_global(slot), attempt),
        seed_fn=lambda slot, attempt, j: sample_seed(cfg.seed, to_global(slot), attempt, j),
        # each group's rewards as it completes, for the filter and the curriculum (neither: nothing to score twice;
        # a hybrid's reward model scores on the auxiliary ranks, which the round does not wait for: hybrid_errors)
        keep_group=functools.partial(observe_group, run) if cfg.filter_groups or cfg.curriculum else None,
        on_group=functools.partial(put_group, run) if hybrid else None)


def observe_group(run, prompt, responses):
    """StaleSync's keep_group, on every group as it completes: the curriculum counts it for its prompt's length
    (informative or not, its mean reward); with --filter-groups, a group whose rewards are all equal is dropped."""
    rewards = run.score(run, [prompt] * len(responses), responses).tolist()
    run.curriculum.observe(task.difficulty(prompt), rewards)
    return not run.cfg.filter_groups or len(set(rewards)) > 1


def learn_curriculum(run):
    """A step boundary: the curriculum's counts of the groups every replica scored since the last one, summed
    over the generators (one rank per TP group counts its replica's), join the decayed old ones. Collective."""
    mine = 1.0 if run.rank in run.roles.writers() else 0.0

    def reduce(new):
        t = torch.tensor(new * mine, dtype=torch.float64, device=run.device)
        dist.all_reduce(t, group=run.rollout_group)
        return t.cpu().numpy()
    run.curriculum.step(reduce)


def attach_reference(run):
    """The frozen initial policy (the warm-up's result), when kl_coef > 0 or under colocated-all, where
    it stays in host memory except while it computes; hybrid: on the auxiliary ranks."""
    if run.roles.hybrid:
        return send_reference(run)
    if run.model is None or not (run.cfg.kl_coef > 0 or run.cfg.deploy == "colocated-all"):
        return
    ref = Policy(model_config(run.cfg)).to(run.device).eval()
    if run.pipe is not None:  # PP: the reference is stages too, each the copy of its policy stage
        ref = pipeline.split(ref, run.pipe.layout, run.rank)
        ref.load_state_dict({k: v.full_tensor() if hasattr(v, "full_tensor") else v
                             for k, v in run.model.state_dict().items()})
        run.ref_pipe = pipeline.Pipeline(ref, run.pipe.layout, run.rank, run.pipe.group, run.cfg.micro_batches,
                                         run.pipe.length, run.device)
    else:
        ref.load_state_dict(expert_parallel.dense_state_dict(run.model))
    if run.experts:  # the policy's own EP layout and forward: the same log-probs, bit for bit, at step 1
        run.experts.shard(ref)
    ref.requires_grad_(False)
    run.reference = fusion.HostOffloaded(ref, offload=run.cfg.deploy == "colocated-all")


def send_reference(run):
    """Hybrid: the warmed-up policy, gathered over the actor's ranks and broadcast by rank 0 to the auxiliary ranks,
    which keep it as the frozen reference, on their device all along (computing it is their job). Collective."""
    ref = Policy(model_config(run.cfg)).to(run.device).eval() if run.model is None else None
    push.push_weights(run.model, ref, 0, run.push_group, run.cfg.bucket_kb * 1024)
    if ref is not None:
        run.reference = fusion.HostOffloaded(ref.requires_grad_(False), offload=False)


def attach_reward_model(run):
    """--reward-model 1: an outcome reward model scores the responses instead of the rule (reward_model.py). Fit here,
    after the warm-up, on the warmed-up policy's own samples labelled by the rule (every rank fits the same one on
    the same samples), then frozen and kept on host except while it scores. Resumed, the checkpoint's weights.
    Hybrid: the actor's ranks fit it, the auxiliary ranks keep it on their device and score with it."""
    cfg = run.cfg
    if not cfg.reward_model:
        return
    with torch.random.fork_rng(devices=[]):  # its initial weights a function of the seed, whatever was built before
        torch.manual_seed(cfg.seed)
        rm = reward_model.RewardModel(rm_config(cfg)).to(run.device)
    if run.resume_from is None:
        if run.rank in run.roles.generators:  # the ranks that sample (hybrid: not the auxiliary ones)
            with run.spans("reward_model_fit"):
                run.reward_model_figures = fit_reward_model(run, rm)  # rm/*: in step 0's record
        for t in rm.state_dict().values():  # rank 0's fit on every rank: a device's kernels need not be deterministic
            dist.broadcast(t, src=0)
    rm.eval().requires_grad_(False)
    if run.roles.hybrid:  # the actor's ranks put unscored rows (run.score None); aux_loop scores them
        run.score = None
        run.reward_model = fusion.HostOffloaded(rm, offload=False) if run.rank in run.roles.auxiliaries else None
        return
    run.reward_model = fusion.HostOffloaded(rm, offload=True)
    run.score = model_rewards


def rm_config(cfg):
    return reward_model.RMConfig(vocab_size=task.VOCAB, max_len=cfg.max_digits + 2 + cfg.max_new_tokens,
                                 pad=task.PAD, steps=cfg.rm_steps, seed=cfg.seed)


def fit_reward_model(run, rm):
    """The reward model trained on rm_samples of the policy's responses to the task's prompts (never held-out ones),
    labelled by the rule; its agreement with the rule on the policy's responses to the held-out prompts. rm/*."""
    cfg = run.cfg
    stream = task.PromptStream(cfg.seed + 1, cfg.max_digits, exclude={tuple(p.tolist()) for p in run.eval_prompts})
    prompts = stream.next(cfg.rm_samples)
    responses = sample_responses(run, prompts, first_seed=0)
    labels = rule_rewards(run, prompts, responses)
    fit = reward_model.train_reward_model(rm, rm_config(cfg), prompts, responses, labels, run.device)
    held = sample_responses(run, run.eval_prompts, first_seed=len(prompts))
    probs = reward_model.score(rm, run.eval_prompts, held)
    agree = reward_model.agreement(probs, rule_rewards(run, run.eval_prompts, held))
    return {**fit, **{f"rm/held_out_{k}": float(v) for k, v in agree.items()}}


def fit_seed(seed, i):
    """The sampling seed of the reward model's i-th sample: a stream of its own (a 3-number key; the RL samples' have
    4: sample_seed)."""
    return int(np.random.SeedSequence([seed, i, 1]).generate_state(1)[0])


def sample_responses(run, prompts, first_seed):
    """The current policy's sampled response to each prompt (seed first_seed + i), every rank getting all of them:
    each rollout replica generates its slice, the writers' slices gathered in order. Collective."""
    i, n = run.roles.replica(run.rank), run.roles.replicas
    lo, hi = i * len(prompts) // n, (i + 1) * len(prompts) // n
    seeds = torch.tensor([fit_seed(run.cfg.seed, first_seed + j) for j in range(lo, hi)])
    with fusion.rollout(run.actor):
        mine = generate(run.engine, prompts[lo:hi], seeds, run.cfg.max_new_tokens, task.EOS, task.PAD,
                        temperature=run.cfg.temperature, top_p=run.cfg.top_p, lockstep=run.sampler.lockstep).tokens
    everyone = [None] * dist.get_world_size(run.rollout_group)
    dist.all_gather_object(everyone, [r.cpu() for r in mine] if run.rank in run.roles.writers() else None,
                           group=run.rollout_group)
    return [r for part in everyone if part is not None for r in part]


# ----------------------------------------------------------------------------- command line
def main(argv=None):
    parser, cfg = parse_args(argv)
    try:
        validate(cfg, int(os.environ.get("WORLD_SIZE", 1)))
    except ValueError as e:
        parser.error(str(e))
    setup_distributed(cfg)
    try:
        train(cfg)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
