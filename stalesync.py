# Copyright (c) 2026 The authors of this repository. SPDX-License-Identifier: MIT (the LICENSE file).
"""StaleSync: bounded-staleness, quasi-asynchronous rollout, with partial rollouts.

Synchronous RL waits, at every step, for the longest sample of the rollout. StaleSync lets generation run
ahead of training as long as no sample is trained on a policy more than S versions newer than the one
that started it (the "staleness threshold"). A rollout round ends as soon as `groups_per_step` complete
prompt groups are ready; those flow on to training at once, and the long-tail sequences still in flight
are kept and continued next round from their prefix, under the new weights (a partial rollout: one
response, tokens from more than one policy version).

Contents, naive first:
  sync_rollout      the naive round: one sampler call that waits for its longest sample
  StaleConfig       validated knobs: S, groups per step, group size, threshold, decode chunk
  StaleSync         the scheduler: admission, decode chunks, cut at threshold, age bound, accounting
  AllReady          colocated: the ranks' "my batch is ready" flags combined, one all-reduce per chunk
  Spans             (name, start, end, args) of every timed phase; perf/tokens_per_s, perf/idle_frac

The rules (v = policy version = optimizer steps taken; k = index of the next batch, trained at version k):
  admission  a group may start only while groups_started < (S + v + 1) * groups_per_step, so that after
             the start groups_started <= (S + v + 1) * groups_per_step (AReaL's capacity) always holds;
  cut        batch k is emitted once groups_per_step groups are complete AND the oldest groups_per_step of
             those that started at a version <= k - S (their last chance to be trained with age <= S) are
             complete; the batch takes those due groups first, then the oldest complete ones;
  age        a sample's age is k - start_version, start_version being the version of its first token;
             a group that would be older than S at the next batch (a due group that did not fit in batch k)
             is regenerated from scratch with fresh samples, never trained, and counted
             (stale/regenerated). Dropping it instead would lose its prompt: the prompts with long answers
             are the ones that age out. A retry keeps the prompt mix, though for each prompt it still
             favours the attempts that finish in time. With the cut rule above a group ages out only when
             more than groups_per_step groups fall due at once, which needs S >= 2.
  S = 0      capacity admits exactly one batch per version and the cut waits for all of it; the sampler
             is then called once per round with no cut (max_steps=None): the very call sync_rollout
             makes, so the samples, updates and parameters are those of the synchronous path, bit for bit.

Public relatives: AReaL (admission capacity (S + v + 1) * B, decoupled PPO objective), MindSpeed-RL /
Kimi k1.5 (partial rollout, per-sample age cap), Pangu Embedded (stale-synchronous stages, S = 4).

Departures from the paper and its relatives:
1. Whole groups are the unit of admission, age and regeneration: GRPO's advantage needs every sample of
   a group, and all of a group's samples start together.
2. The scheduler is a plain object driven by the caller (colocated: `rollout(spans, all_ready)` then `update()`,
   all_ready combining the ranks' ready flags so that a rank ready first keeps decoding its tail;
   separated: `admit/decode/ready/take` on the generator and `update(v)` when weights arrive); transport
   of samples and weights is the caller's (a queue, p2p). The one collective here is AllReady's flag.
3. The sampler is a callable step_fn(contexts, seeds, n_done, max_steps) -> (tokens, logprobs, done),
   called once per decode chunk on every in-flight row; a stateless sampler (model.generate) re-prefills
   the prefix each chunk, a cached one (model.Sampler) keeps its KV cache between chunks, keyed by seed,
   and update() calls its reset(): new weights, so every prefix is read again.
4. Ages are counted in optimizer steps of the trainer (batch index), not wall time.

    python -m pytest tests/test_stalesync.py
    python bench/stalesync.py --lengths lognormal:3,1

Shapes: B samples in a batch, G group size, T response tokens (n_i per sample), S staleness bound,
v policy version, k batch index.
"""
import math
import numbers
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist


def _unpack(out):
    """A sampler's output: (tokens, logprobs, done) or an object with those attributes (model.Generation)."""
    return (out.tokens, out.logprobs, out.done) if hasattr(out, "tokens") else tuple(out)


# ----------------------------------------------------------------------------- the naive round
def sync_rollout(step_fn, prompts, group_size, seeds):
    """Naive synchronous round: G responses per prompt in one sampler call that waits for the longest.
    prompts: list of (P_i,); seeds (B,) with B = len(prompts) * G. Returns tokens, logprobs, done (lists)."""
    contexts = [p for p in prompts for _ in range(group_size)]
    return _unpack(step_fn(contexts, seeds, torch.zeros(len(contexts), dtype=torch.long), None))


# ----------------------------------------------------------------------------- the scheduler
@dataclass
class StaleConfig:
    staleness: int = 0               # S: the most versions a trained sample may lag (0: synchronous)
    groups_per_step: int = 2         # prompt groups in one optimizer step's batch (this rank's share)
    group_size: int = 8              # G: responses per prompt
    threshold: float = 1.0           # in (0, 1]: the decode pool holds groups_per_step / threshold groups
                                     #   and a round ends when groups_per_step of them are complete
    chunk_steps: int = 8             # decode steps per sampler call between cut checks (S > 0 only)

    def __post_init__(self):
        if not _is_int(self.staleness) or self.staleness < 0:
            raise ValueError(f"staleness={self.staleness!r} is invalid: it must be an integer >= 0 "
                             "(0 is the synchronous algorithm)")
        if not 0 < self.threshold <= 1:
            raise ValueError(f"threshold={self.threshold!r} is outside the valid range (0, 1]")
        for name in ("groups_per_step", "group_size", "chunk_steps"):
            x = getattr(self, name)
            if not _is_int(x) or x < 1:
                raise ValueError(f"{name}={x!r} must be an integer >= 1")

    @property
    def pool_groups(self):
        return math.ceil(self.groups_per_step / self.threshold - 1e-9)


@dataclass
class Batch:
    """One optimizer step's samples, groups contiguous, in admission order (group_advantages-ready)."""
    version: int          # k: the policy version this batch must be trained at
    ids: list             # (B,) sample ids
    prompts: list         # (B,) of (P_i,) int64
    responses: list       # (B,) of (n_i,) int64
    logprobs: list        # (B,) of (n_i,) float32 behaviour log-probs
    token_versions: list  # (B,) of (n_i,) int64: the policy version that produced each token
    start_versions: list  # (B,) version of each sample's first token
    done: list            # (B,) always True
    metrics: dict         # stale/* counters of this batch


class StaleSync:
    """Bounded-staleness scheduler over prompt groups. prompt_fn() -> (P,) int64 gives the next prompt;
    seed_fn(sample_id) -> int gives the sampling seed of a sample (ids are 0, 1, 2, ... in order)."""

    def __init__(self, cfg: StaleConfig, step_fn, prompt_fn, seed_fn=lambda sid: sid):
        self.cfg, self.step_fn, self.prompt_fn, self.seed_fn = cfg, step_fn, prompt_fn, seed_fn
        self.version = 0          # v: weights the sampler uses now
        self.batches_out = 0      # k: batches emitted; the next one is trained at version k
        self.groups_started = 0   # admitted prompt groups (regenerations not counted)
        self.next_id = 0          # next sample id
        self.pool = []            # groups not yet emitted (in flight or complete), admission order
        self.fate = {}            # sample id -> "trained" | "regenerated"
        self.regenerated = 0      # groups regenerated because they would have aged past S
        self.max_admitted_over = -10**9  # max over time of groups_started - capacity (tests: <= 0)

    # --- admission
    def capacity(self):
        return (self.cfg.staleness + self.version + 1) * self.cfg.groups_per_step

    def _new_samples(self, g):
        ids = range(self.next_id, self.next_id + self.cfg.group_size)
        self.next_id += self.cfg.group_size
        g.update(start_version=None, samples=[dict(id=i, seed=int(self.seed_fn(i)), tokens=[], logprobs=[],
                                                   versions=[], done=False) for i in ids])

    def admit(self):
        """Start new groups while capacity and the decode pool allow. Returns how many started."""
        n = 0
        while self.groups_started < self.capacity() and self.in_flight() < self.cfg.pool_groups:
            g = dict(gid=self.groups_started, prompt=self.prompt_fn())
            self._new_samples(g)
            self.pool.append(g)
            self.groups_started += 1
            n += 1
            self.max_admitted_over = max(self.max_admitted_over, self.groups_started - self.capacity())
        return n

    def in_flight(self):
        """Groups admitted and not yet complete: what a decode() call would advance."""
        return sum(not _complete(g) for g in self.pool)

    # --- decoding
    def decode(self):
        """One sampler call on every in-flight row (a chunk of chunk_steps decode steps; S = 0: to the
        end). Appends tokens, behaviour log-probs and the current version. Returns tokens generated."""
        rows = [(g, s) for g in self.pool for s in g["samples"] if not s["done"]]
        if not rows:
            return 0
        for g, _ in rows:
            if g["start_version"] is None:  # first token of the group: its age starts now
                g["start_version"] = self.version
        contexts = [torch.cat([g["prompt"], torch.tensor(s["tokens"], dtype=torch.long)]) for g, s in rows]
        seeds = torch.tensor([s["seed"] for _, s in rows], dtype=torch.long)                    # (R,)
        n_done = torch.tensor([len(s["tokens"]) for _, s in rows], dtype=torch.long)            # (R,)
        max_steps = None if self.cfg.staleness == 0 else self.cfg.chunk_steps
        tokens, logprobs, done = _unpack(self.step_fn(contexts, seeds, n_done, max_steps))
        n = 0
        for (_, s), t, lp, d in zip(rows, tokens, logprobs, done):
            s["tokens"] += t.tolist()
            s["logprobs"] += lp.float().tolist()  # float32 values, exact in a Python float
            s["versions"] += [self.version] * len(t)
            s["done"] = bool(d)
            n += len(t)
        return n

    # --- cut at threshold, age bound
    def _due(self):
        """Groups whose last chance is batch k: started at a version <= k - S, oldest first."""
        k, S = self.batches_out, self.cfg.staleness
        return [g for g in self.pool if g["start_version"] is not None and g["start_version"] <= k - S]

    def ready(self):
        """True when batch k can be emitted: groups_per_step complete groups, and the oldest due ones done."""
        need = self._due()[:self.cfg.groups_per_step]
        return sum(map(_complete, self.pool)) >= self.cfg.groups_per_step and all(map(_complete, need))

    def take(self):
        """Emit batch k: due groups first, then the oldest complete ones; regenerate those now too old."""
        if not self.ready():
            raise RuntimeError("take() before ready(): not enough complete groups")
        gps, k = self.cfg.groups_per_step, self.batches_out
        due = [g for g in self._due()[:gps] if _complete(g)]  # all of them, as ready() checked
        rest = [g for g in self.pool if _complete(g) and all(g is not d for d in due)]
        chosen = sorted(due + rest[:gps - len(due)], key=lambda g: g["gid"])
        chosen_ids = {id(g) for g in chosen}
        self.pool = [g for g in self.pool if id(g) not in chosen_ids]
        self.batches_out += 1
        regenerated_before = self.regenerated
        for g in self.pool:  # trained at >= k + 1 they would be older than S: restart them now
            if g["start_version"] is not None and g["start_version"] <= k - self.cfg.staleness:
                for s in g["samples"]:
                    self.fate[s["id"]] = "regenerated"
                self._new_samples(g)
                self.regenerated += 1
        samples = [(g, s) for g in chosen for s in g["samples"]]
        for _, s in samples:
            self.fate[s["id"]] = "trained"
        ages = [k - g["start_version"] for g, _ in samples]                                        # (B,)
        metrics = {"stale/age_max": max(ages), "stale/age_mean": sum(ages) / len(ages),
                   "stale/regenerated": self.regenerated,  # so far; at this cut:
                   "stale/regenerated_at_cut": self.regenerated - regenerated_before,
                   "stale/partial_continued": sum(len(set(s["versions"])) > 1 for _, s in samples),
                   "rollout/response_tokens": sum(len(s["tokens"]) for _, s in samples)}
        return Batch(version=k, ids=[s["id"] for _, s in samples], prompts=[g["prompt"] for g, _ in samples],
                     responses=[torch.tensor(s["tokens"], dtype=torch.long) for _, s in samples],
                     logprobs=[torch.tensor(s["logprobs"], dtype=torch.float32) for _, s in samples],
                     token_versions=[torch.tensor(s["versions"], dtype=torch.long) for _, s in samples],
                     start_versions=[g["start_version"] for g, _ in samples], done=[True] * len(samples),
                     metrics=metrics)

    def rollout(self, spans=None, all_ready=None):
        """Colocated round: admit (refilling the pool), decode chunks until ready, emit batch k = version.

        all_ready(mine: bool) -> bool, optional: this rank's readiness combined over the ranks that train
        together (an all-reduce MIN of one flag, called exactly once per loop turn on every rank; a rank
        that is not ready knows the answer and may post its flag without waiting for it). A rank that is
        ready before its peers keeps decoding its in-flight long tail instead of idling at the gradient
        all-reduce; with nothing in flight it only waits. S = 0 is unchanged (nothing is ever in flight
        once this rank's batch is complete)."""
        if self.batches_out != self.version:
            raise RuntimeError(f"colocated rollout at version {self.version} but {self.batches_out} batches out: "
                               "call update() after each optimizer step")
        with (spans("rollout") if spans else nullcontext()):
            while not (self.ready() if all_ready is None else all_ready(self.ready())):
                self.admit()
                if self.decode() == 0 and not self.ready():
                    raise RuntimeError("no sample in flight and no batch ready: check the sampler's done flags")
            return self.take()

    def update(self, version=None):
        """New weights reached the sampler: version + 1 (colocated), or the version received (separated).
        A sampler that keeps a KV cache between calls (one with a reset() method, model.Sampler) drops
        it here: every in-flight prefix must be read again under the new weights."""
        if version is not None and not (_is_int(version) and self.version <= version <= self.batches_out):
            raise ValueError(f"update(version={version!r}): weights of version v are trained on batches < v, so "
                             f"v must be an integer in [{self.version}, {self.batches_out}] (the sampler's version "
                             "up to the batches emitted)")
        self.version = self.version + 1 if version is None else int(version)
        if hasattr(self.step_fn, "reset"):
            self.step_fn.reset()

    # --- accounting and checkpoint
    def accounting(self):
        """Sample ids by fate: trained (emitted in a batch), regenerated (never trained), in flight (pool)."""
        out = {"trained": set(), "regenerated": set(), "in_flight": set()}
        for i, f in self.fate.items():
            out[f].add(i)
        out["in_flight"] = {s["id"] for g in self.pool for s in g["samples"]}
        return out

    def state_dict(self):
        pool = [dict(gid=g["gid"], prompt=g["prompt"].clone(), start_version=g["start_version"],
                     samples=[dict(id=s["id"], seed=s["seed"], done=s["done"],
                                   tokens=torch.tensor(s["tokens"], dtype=torch.long),
                                   logprobs=torch.tensor(s["logprobs"], dtype=torch.float32),
                                   versions=torch.tensor(s["versions"], dtype=torch.long))
                              for s in g["samples"]]) for g in self.pool]
        return dict(cfg=vars(self.cfg).copy(), version=self.version, batches_out=self.batches_out,
                    groups_started=self.groups_started, next_id=self.next_id, regenerated=self.regenerated,
                    max_admitted_over=self.max_admitted_over, fate=dict(self.fate), pool=pool,
                    sampler=self.step_fn.state_dict() if hasattr(self.step_fn, "state_dict") else None)

    def load_state_dict(self, sd):
        if sd["cfg"] != vars(self.cfg):
            raise ValueError(f"checkpoint config {sd['cfg']} differs from this scheduler's {vars(self.cfg)}")
        for key in ("version", "batches_out", "groups_started", "next_id", "regenerated", "max_admitted_over"):
            setattr(self, key, sd[key])
        if sd["sampler"] is not None:  # the held rows' KV cache too (model.Sampler): a bit-exact resume
            self.step_fn.load_state_dict(sd["sampler"])
        elif hasattr(self.step_fn, "reset"):  # a cache not checkpointed: the prefixes are read again
            self.step_fn.reset()
        self.fate = dict(sd["fate"])
        self.pool = [dict(gid=g["gid"], prompt=g["prompt"].clone(), start_version=g["start_version"],
                          samples=[dict(id=s["id"], seed=s["seed"], done=s["done"], tokens=s["tokens"].tolist(),
                                        logprobs=s["logprobs"].tolist(), versions=s["versions"].tolist())
                                   for s in g["samples"]]) for g in sd["pool"]]


class AllReady:
    """Colocated rounds: this rank's `ready()` combined over the ranks that train together, the
    all_ready of StaleSync.rollout. One all-reduce MIN of a flag per decode chunk on every rank. A rank
    that is not ready knows the answer (the MIN is 0), so it posts its flag without waiting and decodes
    on; a rank that is ready waits for the answer (idle time, spanned "idle") and keeps decoding its
    in-flight tail while the answer is no."""

    def __init__(self, group=None, device="cpu", spans=None):
        self.group, self.device, self.spans = group, device, spans
        self.posted = []  # not-ready flags in flight: (work, tensor)

    def __call__(self, mine):
        flag = torch.tensor([float(mine)], device=self.device)
        if not mine:
            self.posted.append((dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group, async_op=True), flag))
            return False
        with (self.spans("idle") if self.spans else nullcontext()):
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
            for work, _ in self.posted:  # paired by now (collectives match in order): surface any error
                work.wait()
        self.posted.clear()
        return bool(flag.item())


def _is_int(x):
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)  # numpy integers too


def _complete(g):
    return all(s["done"] for s in g["samples"])


# ----------------------------------------------------------------------------- timing
class Spans:
    """Records every timed phase as (name, start, end, args); spans named in `idle` count as waiting.
    args: a copy of `self.args` when the span began (the caller sets e.g. the step and policy version
    there), so that a timeline can say what each span belonged to. device: on CUDA, a span ends only
    once the device's queued work has (the times are then real)."""

    def __init__(self, idle=("idle",), device=None):
        self.spans, self.idle, self.t0, self.args = [], set(idle), time.perf_counter(), {}
        self.cuda = device if device is not None and torch.device(device).type == "cuda" else None

    @contextmanager
    def __call__(self, name):
        t0, args = time.perf_counter(), dict(self.args)
        try:
            yield
        finally:
            if self.cuda is not None:
                torch.cuda.synchronize(self.cuda)
            self.spans.append((name, t0, time.perf_counter(), args))

    def total(self, names, since=0):
        """Seconds spent in spans called `names` (a name or a tuple of names), over the spans since index `since`."""
        names = (names,) if isinstance(names, str) else tuple(names)
        return sum(t1 - t0 for n, t0, t1, _ in self.spans[since:] if n in names)

    def perf(self, tokens, since_t=None):
        """perf/tokens_per_s and perf/idle_frac over the wall time since since_t (default: creation)."""
        t0 = self.t0 if since_t is None else since_t
        wall = max(time.perf_counter() - t0, 1e-9)
        idle = sum(min(b, time.perf_counter()) - max(a, t0) for n, a, b, _ in self.spans if n in self.idle and b > t0)
        return {"perf/tokens_per_s": tokens / wall, "perf/idle_frac": idle / wall}
