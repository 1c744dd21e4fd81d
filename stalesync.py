# Copyright (c) 2026 The authors of this repository. SPDX-License-Identifier: MIT (see LICENSE).
"""StaleSync: bounded-staleness rollout, with partial rollouts.

The problem. A synchronous round (sync_rollout) samples all of a step's responses in one sampler
call. So every step waits for its longest sample, although the other rows finished long before.

The idea. StaleSync decodes in chunks. It ends a round as soon as enough prompt groups are complete,
and those groups go to training at once. The responses still in flight continue in the next round,
under the new weights. Such a response is a partial rollout: its tokens come from several policy
versions. StaleSync keeps a staleness bound S. No trained sample started more than S versions before
the version that trains on it. To keep this bound, each batch first takes the groups for which it
is the last chance, as many as it holds, and the round is cut only once those are complete. A group
that would grow older than S is restarted, never trained stale. Admission limits how far ahead new
groups may start. The table before class StaleSync lists these invariants and who keeps each.

The file starts with the naive version, sync_rollout. Then come StaleConfig, StaleSync, and two cuts
for several replicas, the naive AllReady and SharedCut. The checks, the brakes, the Batch format and
the checkpoint state are in the companion file, plumbing/stalesync_details.py.

Notation. G is the group size, and B is the number of samples in a batch. n_i is the number of
tokens in sample i. R is the number of rows in flight, or in SharedCut the number of replicas. v is
the policy version, which is the number of batches trained so far.

Related systems. AReaL limits admission as capacity() does here. MindSpeed-RL and Kimi k1.5 use
partial rollouts with an age limit per sample. Pangu Embedded runs stale-synchronous stages with
S = 4. This file differs in three ways from the source system (Huawei's RL post-training on
CloudMatrix 384) and from its relatives. First, the whole group is the unit of admission, of age and
of regeneration. GRPO's advantage needs every sample of a group, and a group's samples start
together. Second, the scheduler is a plain object that the caller drives. A colocated caller calls
rollout(spans, cut) and then update(). The companion describes a separated caller. The caller moves
the samples and the weights, and the only collectives in this file are the cuts'. Third, ages count
policy versions (batch indices), not wall time. Benchmark it with
`python bench/stalesync.py --lengths lognormal:3,1`.

To use this file elsewhere, copy it with its companion. Keep the folder, or change the one import
line. It needs torch, and a process group only for the cuts. The companion's docstring ends with a
usage example, which tests/test_copy_alone.py runs in a folder that holds only the two files.
"""
import functools
import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from plumbing.stalesync_details import (
    accounting_of, as_batch, as_prompt, as_seed, batch_metrics, check_budget, check_not_stuck,
    check_progress, check_replicas_not_stuck, check_rollout, check_take, check_update,
    check_filter_limit, load_scheduler_state, sampler_cache, scheduler_state, settle_config,
    start_scheduler_at, unpack_sampled)


# ---------------------------------------------------------------------------------- the naive round
def sync_rollout(step_fn, prompts, group_size, seeds):
    """Sample G responses per prompt in one sampler call that runs every row to its end. So it
    returns when the longest is done. prompts holds (P_i,) tensors, and seeds is (B,)."""
    contexts = [p for p in prompts for _ in range(group_size)]
    n_done = torch.zeros(len(contexts), dtype=torch.long)                             # (B,)
    return unpack_sampled(step_fn(contexts, seeds, n_done, None), len(contexts))


# -------------------------------------------------------------------------------------- the sampler
# The sampler is step_fn(contexts, seeds, n_done, max_steps) -> (tokens, logprobs, done).
# StaleSync calls it once per decode chunk, on the rows in flight. For each row it passes the
# prompt and the response so far, the row's seed (the same at every call) and the response length.
# A row gets at most max_steps new tokens, or runs to its end if max_steps is None. A cached
# sampler keeps its KV cache between chunks, and its reset() frees that cache at the end of each
# round and in update(). The companion has the full contract.


# ------------------------------------------------------------------------------------ the scheduler
@dataclass
class StaleConfig:
    staleness: int = 0          # S: the most versions a trained sample may lag (0: synchronous)
    groups_per_step: int = 2    # groups in a step's batch (this replica's; SharedCut varies it)
    group_size: int = 8         # G: responses per prompt
    threshold: float = 1.0      # in (0, 1]. A batch is this share of the pool. The pool decodes
                                #   groups_per_step / threshold groups at once (pool_groups).
    chunk_steps: int = 8        # decode steps per sampler call (at S > 0)
    max_len: int = 1 << 17      # brake: a row not done at this many tokens raises (check_budget)
    max_filtered: int = None    # brake: keep_group may drop at most this many groups while one
                                #   batch is made. None means 128 x groups_per_step.

    def __post_init__(self):
        settle_config(self)  # checks each field's range and sets max_filtered's default

    @property
    def pool_groups(self):  # the - 1e-9 is there because 21 / 0.7 is 30.000000000000004 in floats
        return math.ceil(self.groups_per_step / self.threshold - 1e-9)


def _complete(g):
    return all(s["done"] for s in g["samples"])


# The invariants, and the functions that keep each. Batch k is trained at version k.
#   staleness   batch k's groups started at versions >= k - S    decode, _due, a cut, take
#   admission   slots_opened <= capacity() at every version      admit
#   one a slot  each slot ends with exactly one trained group    admit, _keep_completed, take
#   accounted   each sample is in exactly one state: trained,    _new_samples, _keep_completed,
#               regenerated, filtered or in flight               take (accounting() lists them)
#   S = 0       the synchronous path, bit for bit                decode (max_steps None), _due
#   one turn    every rank cuts batch k at the same loop turn    post_or_wait, AllReady, SharedCut
class StaleSync:
    """The scheduler. Its unit is the group, the G samples of one prompt. Each group fills a slot.

    Slots are numbered 0, 1, 2, ... as they open, and each ends up with exactly one trained group.
    A slot's attempt starts at 0. It goes up by one when the filter drops the slot's group, and a
    new prompt is drawn. It also goes up by one when the group restarts because of its age. Then
    the prompt stays and the seeds are new. prompt_fn(slot, attempt) returns a group's prompt, as a
    (P,) int64 tensor or a list of ints. The optional seed_fn(slot, attempt, member) returns the
    seed of one sample as an int. Without seed_fn, a sample's seed is its id (0, 1, 2, ... in the
    order the samples are made). If prompt_fn and seed_fn map slots into one global batch, a slot
    gets the same prompt and samples however the batch is split over the replicas. The optional
    keep_group(prompt, responses) returns a bool, and _keep_completed uses it for dynamic sampling.

    Options subclass StaleSync and override the methods that do the default thing here: decode
    (options/lockstep.py), _keep_completed (streaming.py, which sets max_steps too), and
    _keep_per_token and _per_token (routing_replay.py)."""

    def __init__(self, cfg: StaleConfig, step_fn, prompt_fn, seed_fn=None, keep_group=None):
        self.cfg, self.step_fn, self.prompt_fn, self.seed_fn = cfg, step_fn, prompt_fn, seed_fn
        self.keep_group = keep_group
        self.reset_fn, self.sampler_state = sampler_cache(step_fn)  # None if it has none
        self.max_steps = None if cfg.staleness == 0 else cfg.chunk_steps  # see "the sampler"
        self.version = 0          # v: the weights the sampler uses now
        self.batches_out = 0      # k: batches emitted. The next one is trained at version k.
        self.slots_opened = 0     # slots opened so far (a reopened one is not counted again)
        self.reopen = []          # (slot, attempt) of filtered groups' slots, to refill first
        self.next_id = 0          # the next sample id
        self.pool = []            # groups not yet emitted, in flight or complete, in admission
                                  #   order. Each is a dict of slot, attempt, prompt,
                                  #   start_version and samples.
        self.fate = {}            # sample id -> "trained" | "regenerated" | "filtered"
        self.regenerated = 0      # groups restarted because they would have aged past S
        self.filtered = 0         # complete groups that keep_group dropped
        self.filtered_reported = 0  # of those, reported in a batch's metrics so far
        self.filtered_at_take = 0   # of those, dropped before the last take()
        self.max_admitted_over = -10**9  # the largest slots_opened - capacity() seen (<= 0)

    # --- the rounds and the weights: what a colocated caller calls
    def rollout(self, spans=None, cut=None):
        """Run one colocated round, and return batch k, where k is the current version. Each loop
        turn calls cut(self) on every rank. While the cut returns None, the turn admits groups and
        decodes one chunk. Once batch k is ready, the cut returns this scheduler's share as take()'s
        arguments. The default cut is cut_alone. spans, if given, times it as "rollout"."""
        check_rollout(self)
        cut = cut or StaleSync.cut_alone
        with (spans("rollout") if spans else nullcontext()):
            while (share := cut(self)) is None:
                self.admit()
                self.decode()
            batch = self.take(*share)
        if self.reset_fn is not None:
            self.reset_fn()
        return batch

    def update(self, version=None):
        """Record new weights after an optimizer step. The version becomes version + 1, or a
        separated caller's `version` (see the companion). Tokens decoded from now on carry it."""
        check_update(self, version)
        self.version = self.version + 1 if version is None else int(version)
        if self.reset_fn is not None:
            self.reset_fn()

    # --- admission
    def capacity(self):
        """By version v, at most (S + v + 1) * groups_per_step slots may open (AReaL's bound)."""
        return (self.cfg.staleness + self.version + 1) * self.cfg.groups_per_step

    def admit(self):
        """Start groups while fewer than pool_groups are in flight, and return how many started.
        Reopened slots come first, since they already count within capacity(). A new slot opens
        only while slots_opened < capacity(). At S = 0 that opens one batch's slots per version."""
        started = 0
        while self.in_flight() < self.cfg.pool_groups:
            if self.reopen:
                slot, attempt = self.reopen.pop(0)
            elif self.slots_opened < self.capacity():
                slot, attempt = self.slots_opened, 0
                self.slots_opened += 1
            else:
                break
            g = dict(slot=slot, attempt=attempt, prompt=as_prompt(self.prompt_fn(slot, attempt)))
            self._new_samples(g)
            self.pool.append(g)
            started += 1
            over = self.slots_opened - self.capacity()
            self.max_admitted_over = max(self.max_admitted_over, over)
        return started

    def in_flight(self):
        """The number of groups admitted and not yet complete. decode() advances these groups."""
        return sum(not _complete(g) for g in self.pool)

    def _new_samples(self, g):
        """Give group g's current attempt G fresh samples. Its age starts at its first token."""
        ids = range(self.next_id, self.next_id + self.cfg.group_size)
        self.next_id += self.cfg.group_size
        seeds = [i if self.seed_fn is None else as_seed(self.seed_fn(g["slot"], g["attempt"], j))
                 for j, i in enumerate(ids)]
        g["start_version"] = None
        g["samples"] = [dict(id=i, seed=seed, tokens=[], logprobs=[], versions=[], done=False)
                        for i, seed in zip(ids, seeds)]

    # --- decoding
    def decode(self):
        """Make one sampler call on the rows in flight, and return the number of new tokens. Each
        row gets up to chunk_steps of them, kept with their log-probs and the version. At S = 0 rows
        run to their end (max_steps=None), as in sync_rollout, in one call per round plus one per
        refill of dropped groups. So samples, updates and parameters match that path bit for bit."""
        rows = [(g, s) for g in self.pool for s in g["samples"] if not s["done"]]
        if not rows:  # nothing to decode on this rank
            return 0
        for g, _ in rows:
            if g["start_version"] is None:  # the group's first token, so its age starts now
                g["start_version"] = self.version
        contexts = [torch.cat([g["prompt"], torch.tensor(s["tokens"], dtype=torch.long)])
                    for g, s in rows]                                          # R of (P + n,)
        seeds = torch.tensor([s["seed"] for _, s in rows], dtype=torch.long)             # (R,)
        n_done = torch.tensor([len(s["tokens"]) for _, s in rows], dtype=torch.long)     # (R,)
        out = self.step_fn(contexts, seeds, n_done, self.max_steps)
        tokens, logprobs, done = unpack_sampled(out, len(rows))
        self._keep_per_token([s for _, s in rows], out, tokens)
        check_progress(tokens, done, len(rows), self.max_steps)
        for (_, s), t, lp, d in zip(rows, tokens, logprobs, done):
            s["tokens"] += t.tolist()
            s["logprobs"] += lp.tolist()  # float32 values, exact in a Python float
            s["versions"] += [self.version] * len(t)
            s["done"] = d
        check_budget(self, rows)
        completed = [g for g in {id(g): g for g, _ in rows}.values() if _complete(g)]
        self._keep_completed(completed)
        return sum(len(t) for t in tokens)

    def _keep_per_token(self, samples, out, tokens):
        """Keep the call's extra per-token outputs (in `out`) with the samples. By default, none."""

    def _keep_completed(self, groups):
        """Do dynamic sampling, and return the kept groups. keep_group (for example "not every
        reward is equal") may drop some of the groups that a call completed. A dropped group
        leaves the pool, and its samples are counted as filtered. Its slot reopens with the next
        attempt, and admit() draws a new prompt for it before it opens new slots."""
        if self.keep_group is None:
            return groups
        kept = []
        for g in groups:
            responses = [torch.tensor(s["tokens"], dtype=torch.long) for s in g["samples"]]
            if self.keep_group(g["prompt"], responses):
                kept.append(g)
                continue
            self.pool = [h for h in self.pool if h is not g]
            for s in g["samples"]:
                self.fate[s["id"]] = "filtered"
            self.filtered += 1
            self.reopen.append((g["slot"], g["attempt"] + 1))
        self.reopen.sort()
        check_filter_limit(self)  # a brake: a filter that drops nearly every group raises
        return kept

    # --- the cut of batch k, trained at version k
    # A group's start_version is the version of its first token. At batch k its age is
    # k - start_version, and the cut sorts the groups in the pool into three kinds:
    #   due     It started at version k - S or before. Batch k is its last chance within S.
    #   needed  It is among the first groups_per_step due ones, by admission. Batch k takes it.
    #   spare   It is complete and not needed. The spare groups fill the batch, lowest slot first.
    # Batch k is ready once its needed groups are complete, and groups_per_step groups are
    # complete in all. At S = 0 every started group is due, so the cut waits for all of them.
    # A due group is left out when more groups fall due at once than a batch holds. That needs
    # S >= 2 (B before SharedCut). The group is then regenerated. It restarts with fresh samples,
    # it is counted in stale/regenerated, and its old samples are never trained. Dropping the group
    # would lose its prompt, and the prompts with long answers are the ones that age out. A retry
    # keeps the mix of prompts, but for each prompt it still favours the attempts that end in time.
    # An example: S = 1 and groups_per_step = 2. At batch 3 the due groups started by version 2.
    #   slot 6  started at v2, complete   due, and needed
    #   slot 7  started at v3, decoding   not due
    #   slot 8  started at v3, complete   spare
    #   slot 9  started at v3, complete   spare
    # Batch 3 is ready: slot 6 is complete, and 3 groups in all. It takes slot 6 and slot 8, the
    # lowest spare. Slot 7 decodes on. If slot 6 were still decoding, the cut would wait for it.
    def _due(self):
        """The due groups of batch k, in admission order."""
        last = self.batches_out - self.cfg.staleness  # a group started by then is due
        started = [g for g in self.pool if g["start_version"] is not None]
        return [g for g in started if g["start_version"] <= last]

    def _needed(self, n=None):  # a shared cut may ask for more than groups_per_step
        return self._due()[:self.cfg.groups_per_step if n is None else n]

    def _spare(self, needed):
        """The complete groups other than the `needed` ones, lowest slot first."""
        return sorted((g for g in self.pool if _complete(g) and all(g is not h for h in needed)),
                      key=lambda g: g["slot"])

    def ready(self):
        """Whether this scheduler alone can cut batch k."""
        needed_complete = all(map(_complete, self._needed()))
        return needed_complete and sum(map(_complete, self.pool)) >= self.cfg.groups_per_step

    def cut_alone(self):
        """Return (groups_per_step, None) once ready(), else None. It raises rather than spin."""
        if self.ready():
            return self.cfg.groups_per_step, None
        check_not_stuck(self)
        return None

    def take(self, n=None, needed=None):
        """Emit batch k of n groups: the first `needed` due groups, then the spare groups with the
        lowest slots. Both default to groups_per_step. Due groups left out are regenerated."""
        k, n = self.batches_out, self.cfg.groups_per_step if n is None else n
        needed = self._needed(needed)  # from now on, the list of needed groups
        spare = self._spare(needed)
        check_take(k, n, needed, spare, all(map(_complete, needed)))
        chosen = sorted(needed + spare[:n - len(needed)], key=lambda g: g["slot"])
        per_token = self._per_token(chosen)  # it may raise, so it runs before any change
        too_old = [g for g in self._due() if all(g is not c for c in chosen)]
        self.pool = [g for g in self.pool if all(g is not c for c in chosen)]
        self.batches_out += 1
        self.filtered_at_take = self.filtered  # the filter's brake counts drops from here
        for g in too_old:
            for s in g["samples"]:
                self.fate[s["id"]] = "regenerated"
            g["attempt"] += 1
            self._new_samples(g)
        self.regenerated += len(too_old)
        samples = [(g, s) for g in chosen for s in g["samples"]]
        for _, s in samples:
            self.fate[s["id"]] = "trained"
        metrics = batch_metrics(self, k, samples, len(too_old))  # in the companion
        return as_batch(chosen, k, metrics, per_token)

    def _per_token(self, groups):
        """Return Batch.per_token for these groups. By default it is empty."""
        return {}

    # --- what SharedCut (below) asks of each replica's scheduler
    def offer(self):
        """This scheduler's counts at batch k, for SharedCut. `due` counts the due groups. `done`
        counts the due groups that are complete before the first one that is not. `complete`
        counts all complete groups. `work` says whether a group is in flight or may start."""
        due = self._due()
        done = next((i for i, g in enumerate(due) if not _complete(g)), len(due))
        work = self.in_flight() > 0 or bool(self.reopen) or self.slots_opened < self.capacity()
        return dict(due=len(due), done=done, complete=sum(map(_complete, self.pool)), work=work)

    def spare_slots(self, n_needed):
        """The slots of the complete groups beyond the first n_needed due ones, lowest first."""
        return [g["slot"] for g in self._spare(self._needed(n_needed))]

    # --- off the default path: the accounting, checkpoint and resume (documented in the companion)
    def accounting(self):
        """Sample ids by fate: trained, regenerated, filtered, in flight."""
        return accounting_of(self)

    def state_dict(self):  # scheduler_state says what is saved and what is not
        return scheduler_state(self)

    def load_state_dict(self, sd):
        load_scheduler_state(self, sd)

    def start_at(self, version):  # start empty at `version`, to resume at another world size
        start_scheduler_at(self, version)


# ----------------------------------------------------------------------------------------- the cuts
# On each loop turn of rollout(), a cut says whether the replicas that train together end the
# round, and how many groups this replica gives. Why the cuts are correct: just before SharedCut.
def post_or_wait(cut, collective, tensors, wait):
    """Start one collective of a cut. Without `wait`, keep its work and tensors in cut.posted until
    it is done. With `wait`, wait for it through cut.wait, where a subclass may do other work. Then
    wait for this rank's earlier posts, which have paired by now, so that their errors surface."""
    if not wait:
        cut.posted.append((collective(async_op=True), tensors))
        return
    with (cut.spans("idle") if cut.spans else nullcontext()):
        cut.wait(collective(async_op=True))
        for work, _ in cut.posted:
            work.wait()
    cut.posted.clear()


class AllReady:
    """The naive colocated cut. Each rank gives its own groups_per_step groups once every rank
    that trains with it is ready, as an all-reduce MIN of a flag tells on each loop turn. So one
    replica's bad luck (a chain of dropped groups) sets the step's time. SharedCut fixes that."""

    def __init__(self, group=None, device="cpu", spans=None):  # spans, if given, times the waits
        self.group, self.device, self.spans = group, device, spans
        self.posted = []  # collectives in flight: (work, tensors)

    def wait(self, work):
        """Wait for the cut's answer. In a hybrid run, the actor serves its queue meanwhile."""
        work.wait()

    def __call__(self, sched):
        mine = sched.cut_alone() is not None
        flag = torch.tensor([float(mine)], device=self.device)                          # (1,)
        all_reduce = functools.partial(dist.all_reduce, flag, op=dist.ReduceOp.MIN,
                                       group=self.group)
        post_or_wait(self, all_reduce, flag, wait=mine)
        return (sched.cfg.groups_per_step, None) if mine and flag.item() else None


# Why the cuts are correct, in one place (docs/walkthrough.md traces SharedCut's round 1). Waiting
# on every turn would be correct too. post_or_wait only skips the waits whose answer must be no.
# A. Every rank cuts at the same loop turn. On each turn, every rank makes one collective through
#    post_or_wait: AllReady an all-reduce of a flag, SharedCut an all-gather of offer()'s counts.
#    1. Collectives pair in the order they are made. So on turn n, each rank that waits reads the
#       parts that every rank posted on its own turn n. All of them compute the same yes or no.
#    2. A rank skips the wait only when its own part already says no. Under AllReady its flag is
#       0, so the MIN is 0. Under SharedCut its first needed groups are not complete, and a cut
#       needs every replica's. Such a rank posts and decodes on, and the ranks that wait answer no.
#    So a turn's answer is yes only when every rank waited and read yes. Then every rank cuts, and
#    SharedCut's second all-gather (of the spare slots) pairs too. Else all go on to turn n + 1.
# B. At S = 1 every due group fits in the batch, so SharedCut needs them all and none ages out.
#    Take R replicas that each have gps = groups_per_step, and batch k, trained at version k.
#    1. A group due at batch k started by version k - 1, so its slot opened by then. Admission
#       kept each replica's slots opened by version k - 1 within (k + 1) * gps.
#    2. The k batches out took R * k * gps groups. Batch j's groups started by version j, so
#       they all came from slots opened by version k - 1. Each slot trains once.
#    3. So at most R * (k + 1) * gps - R * k * gps = R * gps of those slots are untrained. Each
#       due group holds one, so the due groups fit, and _needed_per_replica places them all.
#    At S >= 2 earlier batches may also take slots opened after version k - S, so more can fall due.
class SharedCut(AllReady):
    """The real colocated cut. The replicas that train together cut one batch from the union of
    their pools. The batch size is the sum of their groups_per_step. The cut follows this rule:
      1. Needed. Each replica's first due groups, up to its groups_per_step, are needed. While the
         batch has room, the replicas' other due groups are needed too, the lower replica first.
      2. Ready. The batch is ready when every replica's needed groups are complete, and the
         replicas together hold at least as many complete groups as the batch size.
      3. Taken. Each replica gives its needed groups. The spare groups with the lowest
         (slot, replica) over all the replicas fill the rest of the batch.
    So a replica that lags, because its groups are dropped again and again, no longer holds back
    the step. Complete groups of later slots from its peers take its place. At S = 0 each replica
    gives its own groups_per_step groups, as under AllReady. SharedCut keeps AllReady's group,
    spans, posts and wait.

    A replica may span several ranks, for inference tensor parallelism (TP). Each of these ranks
    passes the same `replica` and posts on every turn, so that the collectives pair. Only the
    `leader`'s part counts, because the other ranks hold the same pool."""

    FACTS = ("leader", "replica", "due", "done", "complete", "work", "gps")  # posted per turn

    def __init__(self, group=None, replica=None, leader=True, device="cpu", spans=None):
        super().__init__(group, device, spans)
        self.replica = dist.get_rank(group) if replica is None else replica
        self.leader = leader

    def __call__(self, sched):
        """Run one loop turn. Return None, or this replica's share of batch k as (n, needed)."""
        offer, gps = sched.offer(), sched.cfg.groups_per_step
        facts = dict(offer, leader=self.leader, replica=self.replica, gps=gps)
        mine = torch.tensor([facts[f] for f in self.FACTS], dtype=torch.long,
                            device=self.device)                                    # (7,): FACTS
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.group))]
        all_gather = functools.partial(dist.all_gather, everyone, mine, group=self.group)
        # A replica needs at least min(due, gps) groups. If those are incomplete, the answer is no.
        ready = offer["done"] >= min(offer["due"], gps)  # its first needed groups are complete
        post_or_wait(self, all_gather, everyone, wait=ready)
        if not ready:
            return None
        # The ranks that waited all read the same parts. Keep one per replica, the leader's.
        replicas = [dict(zip(self.FACTS, r.tolist())) for r in everyone if r[0]]  # r[0] is leader
        replicas.sort(key=lambda r: r["replica"])
        batch = sum(r["gps"] for r in replicas)
        needed = self._needed_per_replica(replicas, batch)                                 # (R,)
        complete = sum(r["complete"] for r in replicas)
        if any(r["done"] < n for r, n in zip(replicas, needed)) or complete < batch:
            check_replicas_not_stuck(sched, replicas, complete, batch)
            return None
        # Step 3 of the rule. This replica gives its needed groups, and its spares that win a place.
        my_needed = needed[[r["replica"] for r in replicas].index(self.replica)]
        spare_places = batch - sum(needed)
        my_spares = self._spares_taken(sched.spare_slots(my_needed), spare_places)
        return my_needed + my_spares, my_needed

    @staticmethod
    def _needed_per_replica(replicas, batch):
        """How many groups each replica needs (step 1 of the rule), the lower replica first."""
        base = [min(r["due"], r["gps"]) for r in replicas]
        room, out = batch - sum(base), []
        for r, b in zip(replicas, base):
            more = min(r["due"] - b, room)
            room -= more
            out.append(b + more)
        return out

    def _spares_taken(self, spare, places):
        """How many of this replica's spares are among the `places` lowest (slot, replica). Each
        rank posts its replica (-1 if not the leader) and its `places` lowest spare slots, since no
        more can win, padded with -1. All ranks compute the same `places`, so the sizes match."""
        mine = torch.full((places + 1,), -1, dtype=torch.long, device=self.device)  # (1 + places,)
        mine[0] = self.replica if self.leader else -1
        mine[1:1 + min(len(spare), places)] = torch.tensor(spare[:places], dtype=torch.long)
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(everyone, mine, group=self.group)
        slots = sorted((slot, int(t[0])) for t in everyone if t[0] >= 0
                       for slot in t[1:].tolist() if slot >= 0)
        return sum(replica == self.replica for _, replica in slots[:places])
