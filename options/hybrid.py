r"""--deploy hybrid --aux-ranks K: the actor colocated on ranks [0, W-K), the frozen reference (and
the reward model) on ranks [W-K, W) as a queue stage between rollout and training.

    torchrun --standalone --nproc_per_node=3 train_grpo.py --deploy hybrid --reward-model 1

The actor runs the colocated step (actor_loop), with three changes: it puts each group into the
queue the moment it completes (put_group, options/streaming.py; at S = 0 the round decodes in chunks
too), answering the queue's requests between decode forwards; the batch StaleSync cuts is then only
named (announce_batch); and the update reads each micro-batch's reference log-probs as it reaches
them (AuxColumns), the micro-batches in the order the rows were put. With a reward model (on the
auxiliary ranks), each group's rewards are asked of them as it completes (RemoteScore), so that
dynamic sampling and the curriculum judge it as the colocated run does. The auxiliary ranks
(aux_loop) take their share of the groups as they come, whole groups, and add those columns in
pieces of a micro-batch's groups, while the actor still decodes the round's tail
(options/hybrid_aux.py: the auxiliary stage and the notices it waits on).

At S >= 2 a group put as it completed can be left out of every batch and regenerated (more groups
fell due at once than a batch holds). Its writer then reads its rows and their columns and lets
them go (discard_dropped): no row stays in the queue unread.

The actor takes the colocated run's layouts: the engine tensor-parallel over groups of its ranks
(--infer-tp), or the experts expert-parallel over them (--train-ep 2; auto leaves EP off here).
It trains to colocated-all's parameters (the reference on host, computed on the actor; under EP up
to float order, the auxiliary reference being dense), and resumes from its checkpoints bit for bit
(quiesce: the auxiliary ranks finish what they read, then save).
Every rank beats from a thread: a peer gone is named within --liveness-s (options/liveness.py).

    python -m pytest tests/test_train_grpo.py -k hybrid
"""
import datetime
import json
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import fusion
import grpo
import stalesync
import task
import train_grpo as T
from plumbing.config import model_config
from model import Policy
from options.hybrid_aux import (RemoteScore, aux_done_key, aux_loop, final_key, inbox_key,
                                notify, ready_key)
from options import selective_queue, streaming, tensor_parallel
from options.liveness import PeerLost, Watchdog
from options.push import Inbox, dense_twin, push_weights, wait_for, warm_up_or_wait
from plumbing.run import Run, start
from plumbing.runlog import RunLog, cut_facts, share_figures, stale_facts


def errors(cfg, world):
    """--deploy hybrid and --aux-ranks, checked before any process group."""
    aux = 1 if cfg.aux_ranks is None else cfg.aux_ranks
    if not 1 <= aux < world:
        return [f"--aux-ranks {aux} must be in [1, world size {world}): "
                "the actor keeps at least one rank"]
    out = []
    if cfg.prompts_per_step < aux:
        out.append(f"--prompts-per-step {cfg.prompts_per_step} must be at least --aux-ranks {aux}: "
                   "each auxiliary rank serves whole groups, a batch's groups round robin")
    if (world - aux) % cfg.infer_tp:
        out.append(f"--infer-tp {cfg.infer_tp} must divide the actor's {world - aux} ranks "
                   f"(world size {world}, --aux-ranks {aux}): the engine is cut over them")
    unsupported = {  # why each cannot work here (yet)
        f"--train-pp {cfg.train_pp}": (cfg.train_pp > 1, "the pipeline trains in a loop of its "
                                       "own (options/pipeline_run.py), the hybrid's actor in "
                                       "another"),
        f"--nodes {cfg.nodes}": (cfg.nodes > 1, "the nodes split the whole world into FSDP2 "
                                 "meshes, and the auxiliary ranks train nothing"),
        "--eplb 1": (cfg.eplb, "the hybrid's build does not place its rollout's experts by load")}
    for what, (bad, why) in unsupported.items():
        if bad:
            out.append(f"--deploy hybrid with {what} is not supported: {why}")
    if cfg.kl_coef == 0 and not cfg.reward_model:
        out.append("--deploy hybrid with --kl-coef 0 and no --reward-model leaves the auxiliary "
                   "ranks nothing to compute (they hold the KL term's reference and the reward "
                   "model): use --deploy colocated")
    return out


@dataclass
class HybridRun(Run):
    push_group: object = None     # rank 0 and the auxiliary ranks: the reference goes out on it
    rows_ahead: dict = field(default_factory=dict)  # sample id -> row id, put, not yet in a batch
    dropped: set = None  # a writer's row ids put, then regenerated: to let go (None: nobody's)
    at_cut: tuple = (0, 0, 0)     # this rank's last cut's facts (not in the rows: put before it)
    groups_put: int = 0           # a writer's groups put so far (m: the m-th goes to an aux rank)
    inbox: Inbox = None           # an auxiliary rank's notices: a group put, a read, the end
    watchdog: Watchdog = None     # liveness: a lost peer named within --liveness-s
    idle: dict = field(default_factory=lambda: {"gets": 0, "cpu_s": 0.0})  # an aux rank's waits
    readers: int = 0              # an aux rank: the trainers' reads of its columns now open
    aux_seen: dict = field(default_factory=dict)  # an aux rank: writer -> its groups done, in order
    aux_done: set = field(default_factory=set)  # (writer, k): its k-th group, done out of order

    def own_state(self):
        """The loop's own state at a checkpoint: an actor rank's groups put ahead of their batch,
        an auxiliary rank's progress through the groups and the models it holds."""
        if self.rank not in self.roles.auxiliaries:
            return {"rows_ahead": dict(self.rows_ahead), "groups_put": self.groups_put,
                    "at_cut": tuple(self.at_cut)}
        held = {}
        for name in ("reference", "reward_model"):
            if getattr(self, name) is not None:
                with getattr(self, name).on_device() as m:
                    held[name] = {k: v.detach().to("cpu", copy=True)
                                  for k, v in m.state_dict().items()}
        return {"seen": dict(self.aux_seen), "done": sorted(self.aux_done),
                "idle": dict(self.idle), **held}

    def load_own_state(self, state):
        if self.rank not in self.roles.auxiliaries:
            self.rows_ahead, self.groups_put = dict(state["rows_ahead"]), state["groups_put"]
            self.at_cut = tuple(state["at_cut"])
            return
        self.aux_seen, self.aux_done = dict(state["seen"]), {tuple(g) for g in state["done"]}
        self.idle = dict(state["idle"])
        for name in ("reference", "reward_model"):
            if getattr(self, name) is not None:
                with getattr(self, name).on_device() as m:
                    m.load_state_dict(state[name])

    def saved_models(self):  # on the auxiliary ranks, in their own files
        return {"reference": self.cfg.kl_coef > 0, "reward_model": self.cfg.reward_model}


def train(cfg, out_dir=None):
    run = build(cfg, out_dir)
    loop = aux_loop if run.rank in run.roles.auxiliaries else actor_loop
    run.watchdog = watchdog(run)
    try:
        out = T.run_loop(run, loop, warm=warm_up_or_wait, attach=send_reference)
    except Exception as e:
        lost = run.watchdog.explain(e)  # a broken collective or wait: which peer is gone?
        named = isinstance(e, PeerLost) or isinstance(e.__cause__, PeerLost)
        if lost is not None and not named:
            e = PeerLost(f"rank {run.rank}: {lost} ({type(e).__name__}: {e})").with_traceback(
                e.__traceback__)
        run.watchdog.close(error=f"{type(e).__name__}: {e}")  # its peers name it at once
        raise e
    run.watchdog.close()
    if run.rank == 0:
        idle_figures(run, out[0])
    return out


def watchdog(run):
    """Liveness: this rank beats, and watches every other rank (options/liveness.py). A loss also
    wakes this rank's inbox, where an auxiliary rank may be blocked."""
    peers = {r: "auxiliary" if r in run.roles.auxiliaries else "actor"
             for r in range(run.roles.world) if r != run.rank}
    return Watchdog(f"w:{run.key}", run.rank, peers, run.spans, run.cfg.liveness_s,
                    wake=lambda store: run.inbox.wake(store, "lost"))


def idle_figures(run, summary):
    """The auxiliary ranks' idle reads of the queue and CPU seconds, summed, in summary.json."""
    idle = [json.loads(run.store.get(aux_done_key(run, r))) for r in run.roles.auxiliaries]
    summary.update({f"aux_idle_{k}": sum(i[k] for i in idle) for k in ("gets", "cpu_s")})
    with open(os.path.join(run.out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)


def build(cfg, out_dir=None):
    """FSDP2 over the actor's ranks, the queue with the auxiliary stage's columns, the actor's
    scheduler streaming each group as it completes."""
    run = start(cfg, out_dir, cls=HybridRun)
    cfg = run.cfg  # --train-ep auto resolved
    roles = run.roles
    run.inbox = Inbox(run.store, inbox_key(run, run.rank))  # an auxiliary rank's notices
    added = aux_added(cfg)
    columns = {"ref_logprobs": "float32"} if "ref_logprobs" in added else {}  # (n_i,)
    names = ("prompt", "response", "old_logprobs", "reward", "rule_reward", "advantage", "stale",
             *run.per_token, *columns)
    stages = {"train": tuple(c for c in names if c not in added)}
    if added:  # the actor puts; the auxiliary ranks read "aux", add "from_aux"
        stages.update({"aux": ("prompt", "response"), "from_aux": added})
    T.build_queue(run, columns, stages, poll_s=0.0005,  # each step waits on its round trips
                  cls=selective_queue.SelectiveQueue)  # get(only=, min_rows=), put(ids=)
    timeout = datetime.timedelta(seconds=cfg.pg_timeout_s)
    run.train_group = run.rollout_group = dist.new_group(roles.trainers, timeout=timeout)
    run.push_group = dist.new_group([0] + roles.auxiliaries, timeout=timeout)
    actor = run.rank in roles.trainers
    T.build_policy(run, DeviceMesh.from_group(run.train_group, run.device.type) if actor else None)
    if cfg.infer_tp > 1:  # the engine tensor-parallel over groups of infer_tp of the actor's ranks
        group = tp_group(run)  # every rank makes every group
        if actor:
            tensor_parallel.apply(run.engine, group)
            run.actor_class = tensor_parallel.actor_class(run.actor_class)  # via load_weights
    if actor and cfg.reward_model and judged(cfg):  # the model is on the auxiliary ranks
        run.score = RemoteScore(run)
    if actor:  # the queue served between decode forwards: a group put is pulled within a forward
        T.build_rollout(run, lambda base: serving(base, run.queue),
                        lambda base: streaming.scheduler_class(base, lambda g: put_group(run, g)))
        run.actor = run.actor_class(run.model, run.optimizer, run.engine,
                                    bucket_bytes=cfg.bucket_kb * 1024,
                                    movers=[run.experts] if run.experts else [],
                                    group=run.rollout_group)
        cut = serving_cut(stalesync.SharedCut, run.queue)(
            run.rollout_group, replica=roles.replica(run.rank), leader=run.rank in roles.writers(),
            device=run.device, spans=run.spans) if cfg.shared_cut else \
            serving_cut(stalesync.AllReady, run.queue)(run.rollout_group, device=run.device,
                                                       spans=run.spans)
        run.cut = lambda sched: serve_then(run.queue, cut, sched)
        if run.rank == 0:
            experts = "in FSDP2 (EP off: --train-ep auto leaves it off here; 2 turns it on)"
            if run.experts:
                experts = f"EP {cfg.train_ep} -> {cfg.infer_ep} over the actor's ranks"
            print(f"switch: {run.actor.path} | experts: {experts}", flush=True)
    run.log = RunLog(run, start=run.resume_from[1]["step"] + 1 if run.resume_from else 1)
    if cfg.routing_replay:  # the trainers replay the recorded experts; moe/* in the log
        from options import routing_replay
        routing_replay.apply(run)
    return run


def tp_group(run):
    """This rank's tensor-parallel group: infer_tp adjacent ranks of the actor, one rollout replica
    (None on an auxiliary rank). Every rank makes every group, as new_group needs."""
    timeout, mine = datetime.timedelta(seconds=run.cfg.pg_timeout_s), None
    for first in range(0, len(run.roles.generators), run.cfg.infer_tp):
        ranks = run.roles.generators[first:first + run.cfg.infer_tp]
        group = dist.new_group(ranks, timeout=timeout)
        mine = group if run.rank in ranks else mine
    return mine


def aux_added(cfg):
    """The columns the auxiliary stage adds: the reference's log-probs where the KL term reads
    them; a reward model's rewards and advantages where no rule judges a group as it completes
    (else they come back to the actor then: RemoteScore)."""
    reference = ("ref_logprobs",) if cfg.kl_coef > 0 else ()
    return reference + (("reward", "advantage") if cfg.reward_model and not judged(cfg) else ())


def judged(cfg):
    """Whether a rule judges each group by its rewards as it completes: dynamic sampling, the
    curriculum."""
    return bool(cfg.filter_groups or cfg.curriculum)


def serving(base, queue):
    """`base`, a Sampler class, that answers the queue's requests before each decode forward."""
    class ServingSampler(base):
        def _decode_forward(self, tok, pos, valid, cache, rows):
            queue.serve()
            return super()._decode_forward(tok, pos, valid, cache, rows)
    return ServingSampler


def serving_cut(base, queue):
    """`base`, a StaleSync cut, whose rank serves the queue while it waits for its peers' answer:
    a peer may be waiting on an auxiliary rank (RemoteScore) that waits on this rank's groups."""
    class ServingCut(base):
        def wait(self, work):
            while not work.is_completed():
                queue.serve()
                time.sleep(queue.spec.poll_s)
            work.wait()  # its error, if it failed
    return ServingCut


def send_reference(run):
    """The warmed-up policy, gathered over the actor's ranks and broadcast by rank 0 to the
    auxiliary ranks, which keep it as the frozen reference on their device. Collective. None
    where the KL term is off: nothing would read it."""
    if run.cfg.kl_coef == 0:
        return
    ref = Policy(model_config(run.cfg)).to(run.device).eval() if run.model is None else None
    if run.resume_from is None:  # resumed: the auxiliary ranks' checkpoint files hold it
        source = run.model
        if run.experts:  # EP: the experts are not FSDP2's; rank 0 pushes the dense model gathered
            source = dense_twin(run) if run.model is not None else None
        if source is not None or ref is not None:
            push_weights(source, ref, 0, run.push_group, run.cfg.bucket_kb * 1024)
    if ref is not None:
        run.reference = fusion.HostOffloaded(ref.requires_grad_(False), offload=False)


# ----------------------------------------------------------------------------- the actor
def actor_loop(run):
    """An actor rank: the colocated step, each group put as it completes; then it answers the
    auxiliary ranks' last pulls until each says it is done, so that none waits on it."""
    spans, sched, actor = run.spans, run.sched, run.actor
    if run.resume_from is None:
        run.log.warmed_up(T.evaluate(run) | run.step0)
    for step in run.log.progress():
        mark = run.log.mark(step=step, version=step - 1)
        # 6. switch to ROLLOUT
        with spans("switch_to_rollout"):
            actor.to_rollout()
        # 1. generate: each group goes into the queue as it completes (put_group)
        batch = sched.rollout(spans, run.cut)
        # 6. switch back to TRAIN
        with spans("switch_to_train"):
            actor.to_train()
        # 2-3. the batch is already in the queue, group by group: its row ids, from every writer
        with spans("score"):
            announce_batch(run, batch)
        # 4. this rank's share; its reference columns (and rewards) arrive during the update
        samples, rows, queued = read_share(run, step)
        # 5. GRPO updates, micro-batches in put order, each waiting for its rows' columns
        with spans("train"):
            sums = grpo.grpo_update(run.model, run.optimizer, samples, run.algo, run.device,
                                    run.train_group, queued.ref_logprobs(), run.clip_grads,
                                    arrive=queued)
        sched.update()
        T.learn_curriculum(run)
        # S >= 2: the rows of groups put as they completed, then regenerated, read and let go
        dropped = len(discard_dropped(run, step))
        figures = share_figures(step, rows)
        figures.update({name: figures[name] + fact for name, fact in zip(
            ("regenerated", "filtered", "filled_in"), run.at_cut)}, rows_ahead=len(run.rows_ahead),
            rows_dropped=dropped)
        quiesce(run, step)  # a checkpoint at this step: the auxiliary ranks join it, quiet
        last = T.end_step(run, step, mark, sums | figures, actor.metrics())
        if last and run.rank == 0:  # the auxiliary ranks serve until the last batch has been read
            run.store.set(final_key(run), str(step))
            notify(run, run.roles.auxiliaries, "final")
        if last:
            break
    wait_for(run, [aux_done_key(run, r) for r in run.roles.auxiliaries], "the auxiliary ranks' end")


def quiesce(run, step):
    """Before a step's checkpoint (end_step saves every --save-every): rank 0 asks the auxiliary
    ranks to save; each first finishes the groups it has read, then says it is ready and
    joins the save. The actor's ranks serve the queue until then: the snapshot of their queue
    then holds no read half done."""
    aux = run.roles.auxiliaries
    if not run.cfg.save_every or step % run.cfg.save_every:
        return
    if run.rank == 0:
        notify(run, aux, f"save:{step}")
    wait_for(run, [ready_key(run, step, r) for r in aux], f"the auxiliary ranks' readiness to "
             f"save step {step}")


def put_group(run, group):
    """streaming's on_group: a group into the queue the moment it completes (and is kept), for the
    auxiliary ranks to work on while the round decodes on; its rows' ids wait for the batch that
    takes it (announce_batch). Its rewards and advantages go in with it (a reward model's: the
    verdict a rule asked for, kept by RemoteScore), unless the auxiliary stage adds them."""
    rule = task.rewards(group.prompts, group.responses)
    scored = {}
    if "reward" not in aux_added(run.cfg):
        rewards = run.score(group.prompts, group.responses)  # (G,)
        advantages = grpo.group_advantages(rewards, run.cfg.group_size, run.cfg.adv_estimator)
        scored = {"reward": rewards.tolist(), "advantage": advantages.tolist()}
    ids = [None] * len(group.ids)
    if run.rank in run.roles.writers():
        ids = run.queue.put({"prompt": group.prompts, "response": group.responses,
                             "old_logprobs": group.logprobs, "rule_reward": rule.tolist(),
                             "stale": stale_facts(group, (0, 0, 0)), **T.per_token(run, group)}
                            | scored)
        aux, writer = run.roles.auxiliaries, run.roles.writers().index(run.rank)
        if "aux" in run.queue.spec.stages:  # a reference to compute (the KL term on)
            notify(run, [aux[(run.groups_put + writer) % len(aux)]], "group")  # aux_groups' rule
        run.groups_put += 1
    run.rows_ahead.update(zip(group.ids, ids))


def serve_then(queue, cut, sched):
    """StaleSync's cut, which a round calls once per decode chunk, answering the queue's requests
    first: an auxiliary rank pulls a group put in one chunk during the next, not at round's end."""
    queue.serve()
    return cut(sched)


def announce_batch(run, batch):
    """The batch StaleSync cut is in the queue already, group by group; its row ids, gathered from
    every writer, are what the trainers read; its cut's facts count in this rank's figures
    (collective). The rows of groups put and then regenerated (S >= 2) wait to be let go."""
    run.batch_ids = selective_queue.announce_rows(run, [run.rows_ahead.pop(i) for i in batch.ids])
    if run.cfg.staleness >= 2:  # (at S <= 1 the cut takes every due group: none is regenerated)
        gone = [i for i in run.rows_ahead if run.sched.fate.get(i) == "regenerated"]
        mine = [r for r in (run.rows_ahead.pop(i) for i in gone) if r is not None]
        anyone = selective_queue.announce_rows(run, mine)  # any writer has some: all read
        run.dropped = set(mine) if anyone else None
    run.at_cut = cut_facts(batch)


def discard_dropped(run, step):
    """The rows of groups put as they completed and then regenerated (S >= 2: they aged out of every
    batch), read by their writer with their auxiliary columns, and let go: none stays in the queue
    unread. Every trainer reads (the others find nothing), so that their reads stay counted alike.
    Returns the row ids this trainer read."""
    dropped, run.dropped = run.dropped, None
    if dropped is None:
        return []
    with run.spans("queue"):
        rows = run.queue.get("train", max(len(dropped), 1), min_rows=len(dropped), only=dropped)
        if rows.ids and "from_aux" in run.queue.spec.stages:
            read_from_aux(run, step, rows.ids)
    # no trainer goes on to the step's collectives while a peer still waits on an auxiliary rank,
    # which may be pulling rows from it
    serve_until_all(run, f"{step}/dropped")
    return rows.ids


def read_share(run, step):
    """4. This trainer's share, the micro-batches in the order the rows were put (a row's place in
    its writer's puts), which is the order the auxiliary stage completes them; the columns from the
    auxiliary stage come through an AuxColumns, during the update."""
    per_step = run.cfg.prompts_per_step * run.cfg.group_size
    with run.spans("queue"):
        rows = run.queue.get("train", per_step, dp_group=run.train_group, only=run.batch_ids)
    if "advantage" not in rows.cols:  # the reward model's: filled in as the columns arrive
        rows.cols["advantage"] = [torch.full((1,), float("nan"))] * len(rows.ids)
    samples = T.samples_of(run, rows)
    samples.order = [r // run.queue.world for r in rows.ids]
    queued = AuxColumns(run, step, rows, samples)
    if "advantage" in queued.names and run.cfg.adv_estimator == "reinforce++":
        queued(range(len(rows.ids)))  # batch-normalised below: every row's advantage first
    samples.advantages = grpo.finish_advantages(samples.advantages, run.cfg.adv_estimator,
                                                run.device, run.train_group)
    return samples, rows, queued


class AuxColumns:
    """A trainer: the auxiliary stage's columns of its rows (aux_added: the reference's
    log-probs; a reward model's rewards and advantages), read micro-batch by micro-batch as the
    update reaches them (grpo_update's arrive). A row whose first column is still None has not had
    its columns yet."""

    def __init__(self, run, step, rows, samples):
        self.run, self.step, self.rows, self.samples = run, step, rows, samples
        self.names = run.queue.spec.stages.get("from_aux", ())  # none: the KL term off
        for name in self.names:  # filled in place as they arrive
            rows.cols[name] = [None] * len(rows.ids)
        self.first = rows.cols[self.names[0]] if self.names else [0] * len(rows.ids)  # (B,):
        # None until a row's columns arrive (with the KL term off there are none to wait for)
        self.calls = 0  # arrive calls so far: the same count on every trainer (the barrier's name)

    def ref_logprobs(self):
        """(B,) of (n_i,), filled in as they arrive; None where the KL term is off."""
        return self.rows.cols.get("ref_logprobs")

    def __call__(self, which):
        """Rows `which` complete: their columns read if they are not yet (with those of any other
        row the auxiliary stage has finished), then every trainer waits for its peers' (serving the
        queue: a peer's rows may need this rank's groups pulled first) before the micro-batch's
        collectives."""
        if any(self.first[i] is None for i in which):
            with self.run.spans("queue"):
                self._take([i for i, c in enumerate(self.first) if c is None], at_least=0)
                self._take([i for i in which if self.first[i] is None])
        self.calls += 1
        serve_until_all(self.run, f"{self.step}/{self.calls}")

    def _take(self, idx, at_least=None):
        """Read the columns of these rows (indices into the share): all, or what there is."""
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
    """A barrier of the trainers, through the store, that serves the queue while it waits, up to
    2 x the timeout: the failure raised is then a peer's own wait for the auxiliary stage."""
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
                raise TimeoutError(f"rank {run.rank}: a trainer did not reach "
                                   f"micro-batch barrier {name} (step/call) "
                                   f"in {2 * run.cfg.pg_timeout_s}s: is it alive?")
            run.queue.serve()
            time.sleep(run.queue.spec.poll_s)


def read_from_aux(run, step, ids, min_rows=None):
    """The auxiliary stage's columns of rows `ids`, once it has put them (at least min_rows: default
    all); rows that still lack them past the timeout name that stage, with the rows. The
    auxiliary ranks hold the columns: told that a read is open, they serve until it closes."""
    notify(run, run.roles.auxiliaries, "open")
    try:
        return run.queue.get("from_aux", len(ids), min_rows=min_rows, only=set(ids))
    except TimeoutError as e:
        raise TimeoutError(f"the auxiliary stage (ranks {run.roles.auxiliaries}) did not add its "
                           f"columns {list(aux_added(run.cfg))} to rows {sorted(ids)} of step "
                           f"{step}'s batch in {run.cfg.pg_timeout_s}s: is it alive? ({e})") from e
    finally:
        notify(run, run.roles.auxiliaries, "close")
