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
  StaleConfig       validated knobs: S, groups per step, group size, threshold, decode chunk, the brakes
  StaleSync         the scheduler: slots, admission, decode chunks, cut at threshold, age bound, accounting
  FilterLimitError  the brake on dynamic sampling
  AllReady          colocated, naive: each rank cuts its own share, once every rank is ready (a flag's all-reduce)
  SharedCut         colocated: one cut over every replica's pool, so that one replica's bad luck is not the step's

The rules (v = policy version = optimizer steps taken; k = index of the next batch, trained at version k):
  slots      every group fills a slot: slots are numbered 0, 1, 2, ... in the order they open, and each
             slot ends up with exactly one trained group. A group's prompt and seeds are functions of its
             (slot, attempt): attempt 0 first, one more each time the slot's group is dropped (filtered:
             a new prompt) or restarted (aged out: the same prompt, fresh samples). Where the caller's
             prompt_fn and seed_fn map slots to a global batch, the same slot gets the same prompt and
             samples however the batch is split over replicas;
  admission  a new slot may open only while slots_opened < (S + v + 1) * groups_per_step, so that after
             it opens slots_opened <= (S + v + 1) * groups_per_step (AReaL's capacity) always holds; a
             slot whose group was filtered reopens at once (it is within the capacity already);
  cut        batch k is emitted once groups_per_step groups are complete AND the oldest groups_per_step of
             those that started at a version <= k - S (their last chance to be trained with age <= S: the
             needed ones) are complete; the batch takes the needed groups first, then the lowest-slot complete
             ones. Colocated replicas may apply the rule to the union of their pools (SharedCut): each gives its
             needed groups (more than its groups_per_step where the batch has room), the lowest slots of all
             fill the rest, so a replica's share varies, the batch's not;
  age        a sample's age is k - start_version, start_version being the version of its first token;
             a group that would be older than S at the next batch (a due group that did not fit in batch k)
             is regenerated from scratch with fresh samples, never trained, and counted
             (stale/regenerated). Dropping it instead would lose its prompt: the prompts with long answers
             are the ones that age out. A retry keeps the prompt mix, though for each prompt it still
             favours the attempts that finish in time. With the cut rule above a group ages out only when
             more than groups_per_step groups fall due at once, which needs S >= 2.
  brakes     a row still unfinished at max_len response tokens is the sampler's fault, and more than
             max_filtered groups dropped while one batch is made means the filter refuses nearly every group
             (a policy that solves, or fails, everything): each raises, naming the count, never spins;
  S = 0      capacity admits exactly one batch per version and the cut waits for all of it; the sampler
             is then called with no cut (max_steps=None), once per round (and once per refill of dropped
             groups): the very call sync_rollout makes, so the samples, updates and parameters are those
             of the synchronous path, bit for bit. chunk_s0 decodes it in chunks instead, so that a caller
             can work between them (on_group: stream each group as it completes); a counter-based sampler
             makes the same tokens, its log-probs equal up to the batch shapes' float rounding.

Public relatives: AReaL (admission capacity (S + v + 1) * B, decoupled PPO objective), MindSpeed-RL /
Kimi k1.5 (partial rollout, per-sample age cap), Pangu Embedded (stale-synchronous stages, S = 4).

Departures from the source system (Huawei's RL post-training on CloudMatrix 384) and its kin:
1. Whole groups are the unit of admission, age and regeneration: GRPO's advantage needs every sample of
   a group, and all of a group's samples start together.
2. The scheduler is a plain object driven by the caller (colocated: `rollout(spans, cut)` then `update()`, the
   cut deciding with the peers when batch k is cut and how many groups each gives, so that a rank ready first
   keeps decoding its tail; separated: `admit/decode/ready/take` on the generator and `update(v)` when weights
   arrive); transport of samples and weights is the caller's (a queue, p2p). The only collectives here are
   the cuts' (AllReady, SharedCut).
3. The sampler is a callable step_fn(contexts, seeds, n_done, max_steps) -> (tokens, logprobs, done), and
   optionally per-token fields (out.per_token, see the contract below: each token's experts, say),
   called once per decode chunk on every in-flight row; a stateless sampler re-prefills the prefix each
   chunk, a cached one keeps its KV cache between chunks. Its reset() is called whenever new weights
   arrive (update(): every cached prefix is stale) and at the end of a colocated round (the cache is
   rollout memory, freed before training).
4. Ages are counted in optimizer steps of the trainer (batch index), not wall time.

    python -m pytest tests/test_stalesync.py
    python bench/stalesync.py --lengths lognormal:3,1

Using this file elsewhere: torch only (tested with 2.13; CPU or CUDA); a process group only for the cuts (any backend).
The callables StaleSync takes, checked at each call with an error that names the fix:
  step_fn(contexts, seeds, n_done, max_steps) -> (tokens, logprobs, done), or an object with those three
      attributes. In: contexts, R int64 tensors (a prompt and its response so far); seeds (R,) int64,
      one per sample and the same at every call on it; n_done (R,) int64, response tokens each row
      already has; max_steps, at most this many new tokens per row (None: to the end). Out: tokens and
      logprobs, R sequences (tensors or lists, possibly empty) of the new tokens and their log-probs;
      done, R bools, True once a row has ended; optionally out.per_token, name -> R sequences of one entry
      per new token (say each token's experts, (n, L, K)), kept with the sample like its log-probs and handed
      on in Batch.per_token: a field must come with every call (a sample whose field does not cover each of
      its tokens is refused at take() and state_dict(), naming it). Every call makes a token or ends each row.
      Every row must be done by max_len tokens (StaleConfig.max_len, the response budget, if given).
      Tokens are integers; a padded (R, T) tensor is refused (its pads would become response tokens).
  prompt_fn(slot, attempt) -> the prompt of a group, an int64 tensor (P,) or a list of ints.
  seed_fn(slot, attempt, member) -> int, optional: the sampling seed of member j of that group (default: the
      sample's id, unique in this scheduler).
  reset, state (optional): the sampler's cache reset (see 3. above), and an object with
      state_dict()/load_state_dict() saved in the scheduler's checkpoint. Default: step_fn's, or its
      owner's when step_fn is a bound method: reset() if it has one; itself as the state if it has
      state_dict() and is not an nn.Module (a model's weights do not belong in this checkpoint).
  idle (optional): called by decode() in place of step_fn when no row is in flight. A sampler whose ranks
      decode in lock-step (an expert-parallel engine: every forward meets the peers' in all-to-alls) joins
      its peers' call there with no rows of its own. Default: step_fn's (or its owner's) idle() if it has one.
  What state_dict() does not hold: prompt_fn's and seed_fn's own state. Functions of (slot, attempt) alone,
      or of state the caller restores with its own checkpoint, resume exactly; a prompt_fn that reads an
      unsaved stream serves its prompts again after a resume.
Example (tests/test_copy_alone.py runs it in a folder that holds only this file):

    import torch
    from stalesync import StaleConfig, StaleSync

    def toy_sampler(contexts, seeds, n_done, max_steps):  # row s ends after s % 5 + 1 tokens
        left = [s % 5 + 1 - n for s, n in zip(seeds.tolist(), n_done.tolist())]
        made = [k if max_steps is None else min(k, max_steps) for k in left]
        return [[7] * m for m in made], [[-0.1] * m for m in made], [m == k for m, k in zip(made, left)]

    cfg = StaleConfig(staleness=1, groups_per_step=2, group_size=4, threshold=0.5, chunk_steps=2)
    sched = StaleSync(cfg, toy_sampler, prompt_fn=lambda slot, attempt: torch.tensor([1, 2, 3]))
    for step in range(6):
        batch = sched.rollout()             # 2 complete groups of 4, for the weights of version `step`
        assert max(step - v for v in batch.start_versions) <= cfg.staleness
        sched.update()                      # an optimizer step on `batch` made version step + 1
    print("trained", len(sched.accounting()["trained"]), "samples")

Shapes: B samples in a batch, G group size, T response tokens (n_i per sample), S staleness bound,
v policy version, k batch index, R rows in flight.
"""
import math
import numbers
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


def _prompt(p):
    """prompt_fn's prompt as a 1-D int64 tensor (a list of ints is fine); refuses anything else, naming it."""
    t = torch.as_tensor(p) if isinstance(p, (list, tuple)) else p
    if not (torch.is_tensor(t) and t.dim() == 1 and len(t) > 0 and not t.is_floating_point()):
        raise ValueError(f"prompt_fn() returned {type(p).__name__} {getattr(p, 'shape', '')}: it must return one "
                         f"non-empty prompt, a 1-D integer tensor of token ids (or a list of ints)")
    return t.long()


def _tokens(t, row):
    """One row's new tokens as a 1-D int64 tensor; floats (which a cast would truncate) are refused."""
    t = torch.as_tensor(t)
    if t.numel() and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        raise ValueError(f"row {row}: the sampler returned tokens of dtype {t.dtype}; token ids are integers")
    return t.long().reshape(-1)


def _unpack(out, rows):
    """A sampler's output for `rows` rows: (tokens, logprobs, done), or an object with those attributes
    (a dataclass, say), each of R items; tokens and logprobs as tensors. Refuses anything else, naming
    the contract."""
    tokens, logprobs, done = (out.tokens, out.logprobs, out.done) if hasattr(out, "tokens") else tuple(out)
    if torch.is_tensor(tokens) and tokens.dim() == 2:
        raise ValueError(f"the sampler returned tokens as one {tuple(tokens.shape)} tensor: return one 1-D sequence "
                         "per row (a list of tensors or of lists), or its padding becomes response tokens")
    if not len(tokens) == len(logprobs) == len(done) == rows:
        raise ValueError(f"the sampler returned {len(tokens)} token rows, {len(logprobs)} log-prob rows and "
                         f"{len(done)} done flags for {rows} rows; it must return one of each per row "
                         "(see 'Using this file elsewhere' in stalesync.py)")
    tokens = [_tokens(t, i) for i, t in enumerate(tokens)]
    logprobs = [torch.as_tensor(lp, dtype=torch.float32).reshape(-1) for lp in logprobs]
    bad = [i for i, (t, lp) in enumerate(zip(tokens, logprobs)) if len(t) != len(lp)]
    if bad:
        raise ValueError(f"rows {bad[:8]}: the sampler returned a different number of tokens and log-probs")
    return tokens, logprobs, [bool(d) for d in done]


def _per_token(out, tokens):
    """The sampler's optional per-token fields (out.per_token: name -> one sequence per row, an entry per new
    token, e.g. (n, L, K) experts), as tensors; refuses a row whose length is not its tokens'."""
    fields = getattr(out, "per_token", None) or {}
    fields = {name: [torch.as_tensor(v) for v in rows] for name, rows in fields.items()}
    for name, rows in fields.items():
        bad = [i for i, (v, t) in enumerate(zip(rows, tokens)) if len(v) != len(t)]
        bad = bad if len(rows) == len(tokens) else [-1]
        if bad:
            raise ValueError(f"per_token[{name!r}]: rows {bad[:8]} do not hold one entry per new token "
                             f"({len(rows)} rows for {len(tokens)})")
    return fields


# ----------------------------------------------------------------------------- the naive round
def sync_rollout(step_fn, prompts, group_size, seeds):
    """Naive synchronous round: G responses per prompt in one sampler call that waits for the longest.
    prompts: list of (P_i,); seeds (B,) with B = len(prompts) * G. Returns tokens, logprobs, done (lists)."""
    contexts = [p for p in prompts for _ in range(group_size)]
    return _unpack(step_fn(contexts, seeds, torch.zeros(len(contexts), dtype=torch.long), None), len(contexts))


# ----------------------------------------------------------------------------- the scheduler
@dataclass
class StaleConfig:
    staleness: int = 0               # S: the most versions a trained sample may lag (0: synchronous)
    groups_per_step: int = 2         # prompt groups in one optimizer step's batch (this replica's; SharedCut varies it)
    group_size: int = 8              # G: responses per prompt
    threshold: float = 1.0           # in (0, 1]: the decode pool holds groups_per_step / threshold groups
                                     #   and a round ends when groups_per_step of them are complete
    chunk_steps: int = 8             # decode steps per sampler call between cut checks (S > 0, or chunk_s0)
    max_len: int = None              # the response budget: a row not done at this many tokens raises (None: no check)
    max_filtered: int = None         # keep_group may drop at most this many groups while one batch is made
    chunk_s0: bool = False           # S = 0 decodes in chunks too (the caller works between them: on_group); S > 0
                                     #   always does

    def __post_init__(self):
        if not _is_int(self.staleness) or self.staleness < 0:
            raise ValueError(f"staleness={self.staleness!r} is invalid: it must be an integer >= 0 "
                             "(0 is the synchronous algorithm)")
        if not 0 < self.threshold <= 1:
            raise ValueError(f"threshold={self.threshold!r} is outside the valid range (0, 1]")
        for name in ("groups_per_step", "group_size", "chunk_steps", "max_len", "max_filtered"):
            x = getattr(self, name)
            if not (x is None and name.startswith("max")) and (not _is_int(x) or x < 1):
                raise ValueError(f"{name}={x!r} must be an integer >= 1")

    @property
    def pool_groups(self):
        return math.ceil(self.groups_per_step / self.threshold - 1e-9)


@dataclass
class Batch:
    """One optimizer step's samples, groups contiguous, in slot order (group_advantages-ready)."""
    version: int          # k: the policy version this batch must be trained at
    ids: list             # (B,) sample ids
    slots: list           # (B,) the slot of each sample's group
    seeds: list           # (B,) each sample's sampling seed
    prompts: list         # (B,) of (P_i,) int64
    responses: list       # (B,) of (n_i,) int64
    logprobs: list        # (B,) of (n_i,) float32 behaviour log-probs
    token_versions: list  # (B,) of (n_i,) int64: the policy version that produced each token
    start_versions: list  # (B,) version of each sample's first token
    done: list            # (B,) always True
    metrics: dict         # stale/* counters of this batch
    per_token: dict = field(default_factory=dict)  # name -> (B,) of (n_i, ...): the sampler's per-token fields


class StaleSync:
    """Bounded-staleness scheduler over prompt groups, one per slot (see the rules above).
    prompt_fn(slot, attempt) -> (P,) int64 gives a group's prompt; seed_fn(slot, attempt, member) -> int the
    sampling seed of each of its G samples (default: the sample's id; ids are 0, 1, 2, ... in order).
    keep_group(prompt, responses) -> bool, optional (dynamic sampling): called once on every group as it
    completes; a group it refuses (say, every reward equal: no advantage) is dropped, counted
    (stale/filtered), and its slot reopens for a new prompt. on_group(batch), optional: called once on every group
    that completes and is kept, with a Batch of that group alone (version None, no metrics), during the round: a
    caller that streams groups to a next stage as they complete (one that scores them while the tail decodes)
    puts them there; take() later emits them, each in exactly one batch (regenerated: shown again, new samples)."""

    def __init__(self, cfg: StaleConfig, step_fn, prompt_fn, seed_fn=None, keep_group=None, reset=None, state=None,
                 idle=None, on_group=None):
        self.cfg, self.step_fn, self.prompt_fn, self.seed_fn = cfg, step_fn, prompt_fn, seed_fn
        self.keep_group, self.on_group = keep_group, on_group
        owner = getattr(step_fn, "__self__", step_fn)  # a bound method's object: where reset, idle and state are
        self.reset_fn = reset if reset is not None else getattr(owner, "reset", None)
        self.idle_fn = idle if idle is not None else getattr(owner, "idle", None)
        plain = hasattr(owner, "state_dict") and hasattr(owner, "load_state_dict") and \
            not isinstance(owner, torch.nn.Module)
        self.sampler_state = state if state is not None else (owner if plain else None)
        self.version = 0          # v: weights the sampler uses now
        self.batches_out = 0      # k: batches emitted; the next one is trained at version k
        self.slots_opened = 0     # slots opened so far (a reopened one not counted again)
        self.reopen = []          # (slot, attempt) of filtered groups' slots, to refill first
        self.next_id = 0          # next sample id
        self.pool = []            # groups not yet emitted (in flight or complete), admission order
        self.fate = {}            # sample id -> "trained" | "regenerated" | "filtered"
        self.regenerated = 0      # groups regenerated because they would have aged past S
        self.filtered = 0         # complete groups keep_group dropped
        self.filtered_reported = 0  # of those, reported in a batch's metrics so far (an empty batch reports none)
        self.filtered_at_take = 0   # of those, dropped before the last take(): the brake counts the rest
        self.max_admitted_over = -10**9  # max over time of slots_opened - capacity (tests: <= 0)

    # --- admission
    def capacity(self):
        return (self.cfg.staleness + self.version + 1) * self.cfg.groups_per_step

    def _new_samples(self, g):
        """A fresh attempt's G samples for group g (its slot and attempt set), not yet started."""
        ids = range(self.next_id, self.next_id + self.cfg.group_size)
        self.next_id += self.cfg.group_size
        seeds = list(ids) if self.seed_fn is None else [int(self.seed_fn(g["slot"], g["attempt"], j))
                                                        for j in range(self.cfg.group_size)]
        g.update(start_version=None, samples=[dict(id=i, seed=seed, tokens=[], logprobs=[], versions=[], per_token={},
                                                   done=False)
                                              for i, seed in zip(ids, seeds)])

    def admit(self):
        """Start new groups while capacity and the decode pool allow: reopened slots first (a new prompt for a
        filtered group's slot), then new slots. Returns how many started."""
        n = 0
        while self.in_flight() < self.cfg.pool_groups and (self.reopen or self.slots_opened < self.capacity()):
            if self.reopen:
                slot, attempt = self.reopen.pop(0)
            else:
                slot, attempt = self.slots_opened, 0
                self.slots_opened += 1
            g = dict(slot=slot, attempt=attempt, prompt=_prompt(self.prompt_fn(slot, attempt)))
            self._new_samples(g)
            self.pool.append(g)
            n += 1
            self.max_admitted_over = max(self.max_admitted_over, self.slots_opened - self.capacity())
        return n

    def in_flight(self):
        """Groups admitted and not yet complete: what a decode() call would advance."""
        return sum(not _complete(g) for g in self.pool)

    # --- decoding
    def decode(self):
        """One sampler call on every in-flight row (a chunk of chunk_steps decode steps; S = 0: to the
        end). Appends tokens, behaviour log-probs and the current version. Returns tokens generated."""
        rows = [(g, s) for g in self.pool for s in g["samples"] if not s["done"]]
        if not rows:  # a lock-step engine's rank still takes its part in its peers' call
            if self.idle_fn is not None:
                self.idle_fn()
            return 0
        for g, _ in rows:
            if g["start_version"] is None:  # first token of the group: its age starts now
                g["start_version"] = self.version
        contexts = [torch.cat([g["prompt"], torch.tensor(s["tokens"], dtype=torch.long)]) for g, s in rows]
        seeds = torch.tensor([s["seed"] for _, s in rows], dtype=torch.long)                    # (R,)
        n_done = torch.tensor([len(s["tokens"]) for _, s in rows], dtype=torch.long)            # (R,)
        max_steps = None if self.cfg.staleness == 0 and not self.cfg.chunk_s0 else self.cfg.chunk_steps
        out = self.step_fn(contexts, seeds, n_done, max_steps)
        tokens, logprobs, done = _unpack(out, len(rows))
        extra = _per_token(out, tokens)
        if not any(len(t) for t in tokens) and not any(done):
            raise RuntimeError(f"the sampler made no token and ended no row of the {len(rows)} in flight "
                               f"(max_steps={max_steps}): every call must make a token or end each row")
        n = 0
        for r, ((_, s), t, lp, d) in enumerate(zip(rows, tokens, logprobs, done)):
            for name, values in extra.items():
                s["per_token"].setdefault(name, []).append(values[r])
            s["tokens"] += t.tolist()
            s["logprobs"] += lp.float().tolist()  # float32 values, exact in a Python float
            s["versions"] += [self.version] * len(t)
            s["done"] = bool(d)
            n += len(t)
        touched = list({id(g): g for g, _ in rows}.values())
        self._check_budget(rows)
        self._filter(touched)
        kept = {id(g) for g in self.pool}
        self._show([g for g in touched if _complete(g) and id(g) in kept])  # just completed, not filtered
        return n

    def _show(self, groups):
        """on_group: each group that just completed and was kept, once, as a Batch of it alone."""
        for g in groups if self.on_group is not None else ():
            self.on_group(self._as_batch([g], version=None, metrics={}))

    def _check_budget(self, rows):
        """Brake: a row past the response budget and not done would be decoded forever."""
        over = [s["id"] for _, s in rows if not s["done"] and self.cfg.max_len and len(s["tokens"]) >= self.cfg.max_len]
        if over:
            name = getattr(self.step_fn, "__qualname__", type(self.step_fn).__name__)
            raise RuntimeError(f"the sampler {name} returned samples {over[:8]} with {self.cfg.max_len} or more "
                               f"tokens and not done: it must end every row (done=True) by max_len "
                               f"{self.cfg.max_len}, the response budget")

    def _filter(self, groups):
        """Dynamic sampling: drop the groups that just completed and that keep_group refuses; their slots reopen."""
        if self.keep_group is None:
            return
        for g in [g for g in groups if _complete(g)]:
            if not self.keep_group(g["prompt"], [torch.tensor(s["tokens"], dtype=torch.long) for s in g["samples"]]):
                self.pool = [h for h in self.pool if h is not g]
                for s in g["samples"]:
                    self.fate[s["id"]] = "filtered"
                self.filtered += 1
                self.reopen.append((g["slot"], g["attempt"] + 1))
        self.reopen.sort()
        dropped = self.filtered - self.filtered_at_take
        if self.cfg.max_filtered and dropped > self.cfg.max_filtered:
            raise FilterLimitError(f"dynamic sampling dropped {dropped} groups while making batch {self.batches_out}, "
                               f"past the limit of {self.cfg.max_filtered}: nearly every group's rewards are equal "
                               "(a policy that solves, or fails, nearly every prompt); train or warm up differently, "
                               "or turn the filter off")

    # --- cut at threshold, age bound
    def _due(self):
        """Groups whose last chance is batch k: started at a version <= k - S, oldest first."""
        k, S = self.batches_out, self.cfg.staleness
        return [g for g in self.pool if g["start_version"] is not None and g["start_version"] <= k - S]

    def _needed(self, n=None):
        """The due groups batch k must take, oldest first: n of them (default: up to groups_per_step; a shared cut may
        ask for more). A due group left out ages out at this cut."""
        due = self._due()
        return due[:min(len(due), self.cfg.groups_per_step) if n is None else n]

    def _spare(self, needed):
        """The complete groups batch k may take beyond `needed`, lowest slot first."""
        ids = {id(g) for g in needed}
        return sorted((g for g in self.pool if _complete(g) and id(g) not in ids), key=lambda g: g["slot"])

    def ready(self):
        """True when batch k can be emitted: its needed groups complete, and groups_per_step complete in all."""
        needed = self._needed()
        return all(map(_complete, needed)) and len(needed) + len(self._spare(needed)) >= self.cfg.groups_per_step

    def take(self, n=None, needed=None):
        """Emit batch k of n groups (default groups_per_step): the oldest `needed` due groups (default: up to
        groups_per_step), then the lowest-slot complete ones; regenerate those now too old. A cut's share gives both."""
        k, n = self.batches_out, self.cfg.groups_per_step if n is None else n
        needed = self._needed(needed)
        spare = self._spare(needed)
        if not all(map(_complete, needed)) or not len(needed) <= n <= len(needed) + len(spare):
            raise RuntimeError(f"take({n}) at batch {k}: its {len(needed)} needed groups must be complete, and there "
                               f"are {len(needed) + len(spare)} complete groups (take() before ready(), or a cut's "
                               "share this scheduler cannot give)")
        chosen = sorted(needed + spare[:n - len(needed)], key=lambda g: g["slot"])
        _per_token_names([s for g in chosen for s in g["samples"]])  # each covers its tokens, or raises
        chosen_ids = {id(g) for g in chosen}
        self.pool = [g for g in self.pool if id(g) not in chosen_ids]
        self.batches_out += 1
        self.filtered_at_take = self.filtered
        regenerated_before = self.regenerated
        for g in self.pool:  # trained at >= k + 1 they would be older than S: restart them now
            if g["start_version"] is not None and g["start_version"] <= k - self.cfg.staleness:
                for s in g["samples"]:
                    self.fate[s["id"]] = "regenerated"
                g["attempt"] += 1
                self._new_samples(g)
                self.regenerated += 1
        samples = [(g, s) for g in chosen for s in g["samples"]]
        for _, s in samples:
            self.fate[s["id"]] = "trained"
        return self._as_batch(chosen, k, self._metrics(k, samples, self.regenerated - regenerated_before))

    def offer(self):
        """What this scheduler brings to a shared cut of batch k (SharedCut): its due groups, how many of them, oldest
        first, are complete before the first that is not, its complete groups, and whether it has work left (a group
        in flight, or one it may start)."""
        due = self._due()
        done = next((i for i, g in enumerate(due) if not _complete(g)), len(due))
        work = self.in_flight() > 0 or bool(self.reopen) or self.slots_opened < self.capacity()
        return dict(due=len(due), done=done, complete=sum(map(_complete, self.pool)), work=work)

    def spare_slots(self, needed):
        """The slots of the complete groups beyond the oldest `needed` due ones, lowest first (SharedCut)."""
        return [g["slot"] for g in self._spare(self._needed(needed))]

    def _as_batch(self, groups, version, metrics):
        samples = [(g, s) for g in groups for s in g["samples"]]
        fields = _per_token_names([s for _, s in samples])  # each covers its tokens, or raises
        return Batch(version=version, ids=[s["id"] for _, s in samples], slots=[g["slot"] for g, _ in samples],
                     seeds=[s["seed"] for _, s in samples], prompts=[g["prompt"] for g, _ in samples],
                     responses=[torch.tensor(s["tokens"], dtype=torch.long) for _, s in samples],
                     logprobs=[torch.tensor(s["logprobs"], dtype=torch.float32) for _, s in samples],
                     token_versions=[torch.tensor(s["versions"], dtype=torch.long) for _, s in samples],
                     start_versions=[g["start_version"] for g, _ in samples], done=[True] * len(samples),
                     metrics=metrics, per_token={name: [_joined(s, name) for _, s in samples] for name in fields})

    def _metrics(self, k, samples, regenerated_at_cut):
        """stale/* figures of batch k (samples: its (group, sample) pairs; none: a shared cut's empty share, whose
        dropped groups the next batch reports)."""
        filtered_at_cut = self.filtered - self.filtered_reported if samples else 0
        self.filtered_reported += filtered_at_cut
        ages = [k - g["start_version"] for g, _ in samples]                                        # (B,)
        return {"stale/age_max": max(ages, default=0), "stale/age_mean": sum(ages) / max(len(ages), 1),
                "stale/regenerated": self.regenerated,  # so far; at this cut:
                "stale/regenerated_at_cut": regenerated_at_cut,
                "stale/filtered": self.filtered, "stale/filtered_at_cut": filtered_at_cut,
                # a shared cut: the groups this scheduler gave beyond its groups_per_step, for a held-back peer
                "stale/filled_in_at_cut": max(0, len(samples) // self.cfg.group_size - self.cfg.groups_per_step),
                "stale/partial_continued": sum(len(set(s["versions"])) > 1 for _, s in samples),
                "rollout/response_tokens": sum(len(s["tokens"]) for _, s in samples)}

    def rollout(self, spans=None, cut=None):
        """Colocated round: admit (refilling the pool), decode chunks until batch k = version can be cut, emit it.
        spans(name), optional: a context manager that times the round ("rollout").

        cut(sched) -> (n, needed) or None, optional: the ranks that train together deciding the cut (called exactly
        once per loop turn on every rank): None while batch k is not ready, else this scheduler's share, take()'s
        arguments: n groups, its oldest `needed` due groups among them (None: up to groups_per_step). Default: this
        scheduler alone (cut_alone). AllReady: every rank's own groups_per_step, once every rank is ready; SharedCut:
        one cut over all the replicas' pools. A rank ready before its peers keeps decoding its in-flight long tail
        instead of idling at the gradient all-reduce. S = 0 is unchanged (every open group is needed, so each gives
        groups_per_step). The round ends with the sampler's reset(): what it cached was read under weights that the
        step about to train replaces, and it is rollout memory."""
        if self.batches_out != self.version:
            raise RuntimeError(f"colocated rollout at version {self.version} but {self.batches_out} batches out: "
                               "call update() once after each optimizer step")
        cut = cut or StaleSync.cut_alone
        with (spans("rollout") if spans else nullcontext()):
            while (share := cut(self)) is None:
                self.admit()
                self.decode()
            batch = self.take(*share)
        if self.reset_fn is not None:
            self.reset_fn()
        return batch

    def cut_alone(self):
        """The cut of this scheduler alone: (groups_per_step, None: its needed groups) once ready(), else None (never a
        spin: with no group in flight and none to start, it raises)."""
        if self.ready():
            return self.cfg.groups_per_step, None
        if not self.offer()["work"]:
            raise RuntimeError(f"batch {self.batches_out}: no group in flight, none to start, and no batch ready: "
                               "check the sampler's done flags")
        return None

    def update(self, version=None):
        """New weights reached the sampler: version + 1 (colocated, after the optimizer step on the batch
        rollout() returned), or the version received (separated). A sampler that keeps a KV cache between
        calls drops it here (see `reset`): every in-flight prefix is read again under the new weights."""
        if version is None and self.version >= self.batches_out:
            raise RuntimeError(f"update() at version {self.version} with {self.batches_out} batches out: weights of "
                               "version v + 1 are trained on batch v, so call update() once per batch that "
                               "rollout() returned, after its optimizer step")
        if version is not None and not (_is_int(version) and self.version <= version <= self.batches_out):
            raise ValueError(f"update(version={version!r}): weights of version v are trained on batches < v, so "
                             f"v must be an integer in [{self.version}, {self.batches_out}] (the sampler's version "
                             "up to the batches emitted)")
        self.version = self.version + 1 if version is None else int(version)
        if self.reset_fn is not None:
            self.reset_fn()

    def start_at(self, version):
        """Nothing in flight, at `version`, with as many batches emitted, as if the earlier rounds had run
        here (the slots of those batches opened): a resume that cannot keep the groups in flight (another
        world size) starts the next slots again, their first attempts."""
        if self.batches_out or self.pool:
            raise RuntimeError("start_at() on a scheduler that has already emitted or admitted groups")
        self.version = self.batches_out = version
        self.slots_opened = version * self.cfg.groups_per_step

    # --- accounting and checkpoint
    def accounting(self):
        """Sample ids by fate: trained (emitted in a batch), regenerated or filtered (never trained), in
        flight (pool)."""
        out = {"trained": set(), "regenerated": set(), "filtered": set(), "in_flight": set()}
        for i, f in self.fate.items():
            out[f].add(i)
        out["in_flight"] = {s["id"] for g in self.pool for s in g["samples"]}
        return out

    COUNTERS = ("version", "batches_out", "slots_opened", "next_id", "regenerated", "filtered", "filtered_reported",
                "filtered_at_take", "max_admitted_over")

    def state_dict(self):
        """The groups in flight (partial responses, their versions and log-probs), the slots to reopen, the
        counters and sample fates, and the sampler's state if it has one (see the contract above for what
        it does not hold)."""
        _per_token_names([s for g in self.pool for s in g["samples"]])  # each field covers its samples' tokens
        pool = [dict(slot=g["slot"], attempt=g["attempt"], prompt=g["prompt"].clone(),
                     start_version=g["start_version"],
                     samples=[dict(id=s["id"], seed=s["seed"], done=s["done"],
                                   tokens=torch.tensor(s["tokens"], dtype=torch.long),
                                   logprobs=torch.tensor(s["logprobs"], dtype=torch.float32),
                                   versions=torch.tensor(s["versions"], dtype=torch.long),
                                   per_token={n: _joined(s, n) for n in s["per_token"]})
                              for s in g["samples"]]) for g in self.pool]
        return dict(cfg=vars(self.cfg).copy(), **{k: getattr(self, k) for k in self.COUNTERS},
                    reopen=[list(r) for r in self.reopen], fate=dict(self.fate), pool=pool,
                    sampler=self.sampler_state.state_dict() if self.sampler_state is not None else None)

    def load_state_dict(self, sd):
        brakes = ("max_len", "max_filtered")  # they bound a run, they do not shape its state: free to change
        saved, mine = ({k: v for k, v in c.items() if k not in brakes} for c in (sd["cfg"], vars(self.cfg)))
        if saved != mine:
            raise ValueError(f"checkpoint config {saved} differs from this scheduler's {mine}")
        pool = [dict(slot=g["slot"], attempt=g["attempt"], prompt=g["prompt"].clone(),
                     start_version=g["start_version"],
                     samples=[dict(id=s["id"], seed=s["seed"], done=s["done"], tokens=s["tokens"].tolist(),
                                   logprobs=s["logprobs"].tolist(), versions=s["versions"].tolist(),
                                   per_token={n: [v] for n, v in s.get("per_token", {}).items()})
                              for s in g["samples"]]) for g in sd["pool"]]
        _per_token_names([s for g in pool for s in g["samples"]])  # a sample saved without a field its peers hold
        for key in self.COUNTERS:  # a checkpoint of older code has no filtered_at_take: its filtered_reported
            setattr(self, key, sd.get(key, sd["filtered_reported"]) if key == "filtered_at_take" else sd[key])
        if sd["sampler"] is not None:  # the held rows' KV cache too, if the sampler saves it: bit-exact
            self.sampler_state.load_state_dict(sd["sampler"])
        elif self.reset_fn is not None:  # a cache not checkpointed: the prefixes are read again
            self.reset_fn()
        self.reopen = [tuple(r) for r in sd["reopen"]]
        self.fate = dict(sd["fate"])
        self.pool = pool


class FilterLimitError(RuntimeError):
    """keep_group dropped more than max_filtered groups while one batch was made (StaleConfig)."""


class AllReady:
    """Colocated rounds, the naive cut: each rank gives its own groups_per_step, once every rank that trains together
    is ready (StaleSync.rollout's cut). One all-reduce MIN of a flag per decode chunk on every rank. A rank that is not
    ready knows the answer (the MIN is 0), so it posts its flag without waiting and decodes on; a rank that is ready
    waits for the answer (idle time, spanned "idle") and keeps decoding its in-flight tail while the answer is no.
    One replica's bad luck (a chain of dropped groups) is the whole step's time: SharedCut below."""

    def __init__(self, group=None, device="cpu", spans=None):  # spans: times the waits ("idle"), optional
        self.group, self.device, self.spans = group, device, spans
        self.posted = []  # not-ready flags in flight: (work, tensor)

    def __call__(self, sched):
        mine = sched.cut_alone() is not None
        flag = torch.tensor([float(mine)], device=self.device)
        if not mine:
            self.posted.append((dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group, async_op=True), flag))
            return None
        with (self.spans("idle") if self.spans else nullcontext()):
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
            for work, _ in self.posted:  # paired by now (collectives match in order): surface any error
                work.wait()
        self.posted.clear()
        return (sched.cfg.groups_per_step, None) if flag.item() else None


class SharedCut:
    """Colocated rounds: the replicas that train together cut one batch from all their pools, the cut rule over their
    union (StaleSync.rollout's cut). With R replicas of groups_per_step each, the batch holds R x groups_per_step
    groups. Needed: every replica's oldest due groups, up to its groups_per_step, then, while the batch has room, its
    further due ones (the lower replica first; at S = 1 this is every due group, so none ages out). Batch k is ready
    once every replica's needed groups are complete and, together, the replicas hold as many complete groups as the
    batch; each gives its needed groups, and the lowest (local slot, replica) among all their other complete groups
    fill the rest. A replica held back (its groups dropped again and again) no longer holds the step: its peers'
    complete groups of later slots take its place, so the share a replica gives varies from step to step; the batch
    does not. Every slot is still trained once, within S, and no replica opens a slot beyond its capacity. S = 0:
    each replica's open groups are all needed, so each gives groups_per_step, as under AllReady.

    Per loop turn, one all-gather of a few counts; a rank still missing one of its first groups_per_step due groups
    knows the answer (no) and posts without waiting. At the cut, one all-gather of the spare slots. Replicas of
    several ranks (inference TP): `replica` names this rank's, and one rank of each (`leader`) speaks for it; its
    peers hold the same pool."""

    def __init__(self, group=None, replica=None, leader=True, device="cpu", spans=None):
        self.group, self.device, self.spans = group, device, spans
        self.replica = dist.get_rank(group) if replica is None else replica
        self.leader = leader
        self.posted = []  # gathers in flight from turns this rank knew the answer: (work, tensors)

    def __call__(self, sched):
        offer, gps = sched.offer(), sched.cfg.groups_per_step
        mine = torch.tensor([self.leader, self.replica, offer["due"], offer["done"], offer["complete"], offer["work"],
                             gps], dtype=torch.long, device=self.device)                        # (7,): FACTS
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.group))]
        if offer["done"] < min(offer["due"], gps):  # one of its first needed groups is not complete: not ready
            self.posted.append((dist.all_gather(everyone, mine, group=self.group, async_op=True), everyone))
            return None
        with (self.spans("idle") if self.spans else nullcontext()):
            dist.all_gather(everyone, mine, group=self.group)
            for work, _ in self.posted:  # paired by now (collectives match in order): surface any error
                work.wait()
        self.posted.clear()
        rows = sorted((dict(zip(self.FACTS, r.tolist())) for r in everyone if r[0]), key=lambda r: r["replica"])
        batch = sum(r["gps"] for r in rows)
        needed = self._needed(rows, batch)                                                      # (R,)
        if any(r["done"] < n for r, n in zip(rows, needed)) or sum(r["complete"] for r in rows) < batch:
            if not any(r["work"] for r in rows):
                raise RuntimeError(f"batch {sched.batches_out}: the replicas hold {sum(r['complete'] for r in rows)} "
                                   f"complete groups of {batch} and none has a group in flight or one it may start: "
                                   "check the sampler's done flags")
            return None
        my_needed = needed[[r["replica"] for r in rows].index(self.replica)]
        widest = max(r["complete"] - n for r, n in zip(rows, needed))
        taken = self._spares_taken(sched.spare_slots(my_needed), batch - sum(needed), widest)
        return my_needed + taken, my_needed

    FACTS = ("leader", "replica", "due", "done", "complete", "work", "gps")  # what each rank posts, per turn

    @staticmethod
    def _needed(rows, batch):
        """Each replica's needed groups: its oldest due ones up to its groups_per_step, then more while the batch has
        room, the lower replica first."""
        base = [min(r["due"], r["gps"]) for r in rows]
        room, out = batch - sum(base), []
        for r, b in zip(rows, base):
            more = min(r["due"] - b, room)
            room -= more
            out.append(b + more)
        return out

    def _spares_taken(self, spare, quota, widest):
        """How many of this replica's spare groups the batch takes: the `quota` lowest (slot, replica) of all."""
        width = min(widest, quota)
        mine = torch.full((width + 1,), -1, dtype=torch.long, device=self.device)          # (1 + width,)
        mine[0] = self.replica if self.leader else -1
        mine[1:1 + min(len(spare), width)] = torch.tensor(spare[:width], dtype=torch.long)
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(everyone, mine, group=self.group)
        slots = sorted((slot, int(t[0])) for t in everyone if t[0] >= 0 for slot in t[1:].tolist() if slot >= 0)
        return sum(replica == self.replica for _, replica in slots[:quota])


def _per_token_names(samples):
    """The per-token fields these samples hold, in order; refuses, naming the sample and the field, a sample whose
    field (one that any of them holds) has not one entry per token: a sampler that returned it on some calls only,
    or a resume from a checkpoint saved without it (a sample not started yet holds none, and needs none)."""
    names = list(dict.fromkeys(n for s in samples for n in s["per_token"]))
    for s in samples:
        for name in names:
            n = sum(len(piece) for piece in s["per_token"].get(name, []))
            if n != len(s["tokens"]):
                raise ValueError(f"sample {s['id']}: per_token[{name!r}] holds {n} entries for its {len(s['tokens'])} "
                                 "tokens; the sampler must return the field on every call (a checkpoint saved without "
                                 "it cannot continue samples that need it)")
    return names


def _joined(s, name):
    """A sample's per-token field `name`, its calls' pieces joined: (n_i, ...); a sample with no token may hold no
    piece: (0,)."""
    pieces = s["per_token"].get(name, [])
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def _is_int(x):
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)  # numpy integers too


def _complete(g):
    return all(s["done"] for s in g["samples"])
