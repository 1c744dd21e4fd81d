# Copyright (c) 2026 The authors of this repository. SPDX-License-Identifier: MIT (see LICENSE).
"""StaleSync's details: what a learner of stalesync.py can take on trust. Copied with stalesync.py.

stalesync.py teaches the mechanism (the round, admission, decoding, the cut, the replicas' cuts).
This file holds what its code calls by name, mostly what a learner need not read:
  - the checks of the config and of the calls (rollout, update, take), with their long messages;
  - the brakes that stop a run going nowhere (FilterLimitError: dynamic sampling that drops
    nearly every group; a sampler that makes nothing or never ends a row; a cut that nothing can
    make ready);
  - the sampler's contract in full, and the checks of what the callables return: the sampler's
    (unpack_sampled), prompt_fn's, seed_fn's;
  - Batch, one step's samples as the trainer gets them, its packing (as_batch), its stale/* figures
    (batch_metrics) and the samples' accounting;
  - a cached sampler's reset() and state (sampler_cache), and notes on a separated caller and
    SharedCut's replica and leader (why the cuts are correct is in stalesync.py, before SharedCut);
  - the checkpoint state behind StaleSync.state_dict, load_state_dict and start_at.

It imports torch and the standard library only, never stalesync.py (its example aside). Copy the
two together, this one at plumbing/stalesync_details.py beside stalesync.py (or change
stalesync.py's one import line). A name with a leading underscore is used only in this file.
FilterLimitError is public: a caller catches it (plumbing/runlog.py's hint names the flags).

Using stalesync.py elsewhere: this example needs torch only, and runs in a folder holding only the
two files (tests/test_copy_alone.py runs it there):

    import torch
    from stalesync import StaleConfig, StaleSync

    def toy_sampler(contexts, seeds, n_done, max_steps):  # row s ends after s % 5 + 1 tokens
        left = [s % 5 + 1 - n for s, n in zip(seeds.tolist(), n_done.tolist())]
        made = [k if max_steps is None else min(k, max_steps) for k in left]
        done = [m == k for m, k in zip(made, left)]
        return [[7] * m for m in made], [[-0.1] * m for m in made], done

    cfg = StaleConfig(staleness=1, groups_per_step=2, group_size=4, threshold=0.5,
                      chunk_steps=2)
    sched = StaleSync(cfg, toy_sampler, prompt_fn=lambda slot, attempt: torch.tensor([1, 2, 3]))
    for step in range(6):
        batch = sched.rollout()   # 2 complete groups of 4, for the weights of version `step`
        assert max(step - v for v in batch.start_versions) <= cfg.staleness
        sched.update()            # an optimizer step on `batch` made version step + 1
    print("trained", len(sched.accounting()["trained"]), "samples")
"""
import numbers
from dataclasses import dataclass, field

import torch


# --------------------------------------------------------------- checks of the config and the calls
def settle_config(cfg):
    """StaleConfig's fields, each in its range, and max_filtered's default (None: 128 x
    groups_per_step)."""
    if not _is_int(cfg.staleness) or cfg.staleness < 0:
        raise ValueError(f"staleness={cfg.staleness!r} is invalid: it must be an integer >= 0 "
                         "(0 is the synchronous algorithm)")
    if not 0 < cfg.threshold <= 1:
        raise ValueError(f"threshold={cfg.threshold!r} is outside the valid range (0, 1]")
    for name in ("groups_per_step", "group_size", "chunk_steps", "max_len", "max_filtered"):
        x = getattr(cfg, name)
        if not (x is None and name == "max_filtered") and (not _is_int(x) or x < 1):
            raise ValueError(f"{name}={x!r} must be an integer >= 1")
    if cfg.max_filtered is None:
        cfg.max_filtered = 128 * cfg.groups_per_step


def check_rollout(sched):
    """rollout()'s: one colocated round per version, update() between two."""
    if sched.batches_out != sched.version:
        raise RuntimeError(f"colocated rollout at version {sched.version} but "
                           f"{sched.batches_out} batches out: call update() once after each "
                           "optimizer step")


def check_update(sched, version):
    """update()'s: colocated, once per batch out; separated, a version in range."""
    if version is None and sched.version >= sched.batches_out:
        raise RuntimeError(f"update() at version {sched.version} with {sched.batches_out} "
                           "batches out: training on batch v makes the weights of version "
                           "v + 1, so call update() once per batch that rollout() returned, "
                           "after its optimizer step")
    valid = _is_int(version) and sched.version <= version <= sched.batches_out
    if version is not None and not valid:
        raise ValueError(f"update(version={version!r}): weights of version v are trained on "
                         f"batches < v, so v must be an integer in [{sched.version}, "
                         f"{sched.batches_out}] (the sampler's version up to the batches "
                         "emitted)")


def check_take(k, n, needed, spare, complete):
    """take()'s: the needed groups complete (`complete`, as stalesync.py judges them), and n within
    what this scheduler holds."""
    if not complete or not len(needed) <= n <= len(needed) + len(spare):
        raise RuntimeError(f"take({n}) at batch {k}: its {len(needed)} needed groups must be "
                           f"complete, and there are {len(needed) + len(spare)} complete "
                           "groups (take() before ready(), or a cut's share this scheduler "
                           "cannot give)")


# --------------------------------------------------------------------------------------- the brakes
class FilterLimitError(RuntimeError):
    """keep_group dropped more than max_filtered groups while one batch was made (StaleConfig)."""


def check_progress(tokens, done, rows, max_steps):
    """A sampler call must make a token or end a row, or the round would never end."""
    if not any(len(t) for t in tokens) and not any(done):
        raise RuntimeError(f"the sampler made no token and ended no row of the {rows} in "
                           f"flight (max_steps={max_steps}): every call must make a token or "
                           "end each row")


def check_budget(sched, rows):
    """Brake: a row still not done at max_len tokens is the sampler's fault. Raise max_len for
    longer outputs: the default is past the response budgets in use."""
    max_len = sched.cfg.max_len
    if not max_len:
        return
    over = [s["id"] for _, s in rows if not s["done"] and len(s["tokens"]) >= max_len]
    if over:
        name = getattr(sched.step_fn, "__qualname__", type(sched.step_fn).__name__)
        raise RuntimeError(f"the sampler {name} returned samples {over[:8]} with {max_len} or "
                           f"more tokens and not done: it must end every row (done=True) by "
                           f"max_len {max_len}, the response budget")


def check_filter_limit(sched):
    """Brake: more than max_filtered groups dropped while one batch is made means that the filter
    refuses nearly every group."""
    dropped = sched.filtered - sched.filtered_at_take
    if sched.cfg.max_filtered and dropped > sched.cfg.max_filtered:
        raise FilterLimitError(f"dynamic sampling dropped {dropped} groups while making batch "
                               f"{sched.batches_out}, past the limit of "
                               f"{sched.cfg.max_filtered}: nearly every group's rewards are "
                               "equal (a policy that solves, or fails, nearly every prompt); "
                               "train or warm up differently, or turn the filter off")


def check_not_stuck(sched):
    """cut_alone's brake: no batch ready, and nothing left that could make one."""
    if not sched.offer()["work"]:
        raise RuntimeError(f"batch {sched.batches_out}: no group in flight, none to start, and "
                           "no batch ready: check the sampler's done flags")


def check_replicas_not_stuck(sched, replicas, complete, batch):
    """SharedCut's brake: no batch ready, and no replica has anything left that could make one."""
    if not any(r["work"] for r in replicas):
        raise RuntimeError(f"batch {sched.batches_out}: the replicas hold {complete} "
                           f"complete groups of {batch} and none has a group in flight or "
                           "one it may start: check the sampler's done flags")


# --------------------------------------------------------------------------- checking the callables
# The sampler's contract: step_fn(contexts, seeds, n_done, max_steps) -> (tokens, logprobs, done),
# or an object with those attributes, called once per decode chunk on every row in flight.
#   contexts   R int64 tensors, a prompt and its response so far
#   seeds      (R,) int64, one per sample, the same at every call on it
#   n_done     (R,) int64, the response tokens each row already has
#   max_steps  at most this many new tokens per row (None: to the end)
#   tokens     R sequences (tensors or lists, possibly empty) of new token ids; not a padded
#              (R, T) tensor, whose pads would become response tokens
#   logprobs   R sequences, the log-prob of each new token
#   done       R bools, True once a row has ended
# Every call makes a token or ends each row, and every row ends by StaleConfig.max_len tokens.
# A cached sampler keeps its KV cache between chunks: StaleSync calls its reset() when it is stale,
# and saves its state_dict() with its own (sampler_cache, below). unpack_sampled checks each call.
def unpack_sampled(out, rows):
    """A sampler's output for `rows` rows: R of (n,) int64 tokens, R of (n,) float32, R bools."""
    if hasattr(out, "tokens"):
        out = out.tokens, out.logprobs, out.done
    tokens, logprobs, done = out
    if torch.is_tensor(tokens) and tokens.dim() == 2:
        raise ValueError(f"the sampler returned tokens as one {tuple(tokens.shape)} tensor: return "
                         "one 1-D sequence per row (a list of tensors or of lists), or its padding "
                         "becomes response tokens")
    if not len(tokens) == len(logprobs) == len(done) == rows:
        raise ValueError(f"the sampler returned {len(tokens)} token rows, {len(logprobs)} log-prob "
                         f"rows and {len(done)} done flags for {rows} rows; it must return one of "
                         "each per row (see the sampler's contract in stalesync.py)")
    tokens = [torch.as_tensor(t) for t in tokens]
    for row, t in enumerate(tokens):  # a cast would truncate floats
        if t.numel() and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
            raise ValueError(f"row {row}: the sampler returned tokens of dtype {t.dtype}; token "
                             "ids are integers")
    tokens = [t.long().reshape(-1) for t in tokens]
    logprobs = [torch.as_tensor(lp, dtype=torch.float32).reshape(-1) for lp in logprobs]
    bad = [i for i, (t, lp) in enumerate(zip(tokens, logprobs)) if len(t) != len(lp)]
    if bad:
        raise ValueError(f"rows {bad[:8]}: the sampler returned a different number of tokens and "
                         "log-probs")
    return tokens, logprobs, [bool(d) for d in done]


def as_prompt(p):
    """prompt_fn's prompt as (P,) int64 (a list of ints is fine); anything else is refused."""
    t = torch.as_tensor(p) if isinstance(p, (list, tuple)) else p
    if not (torch.is_tensor(t) and t.dim() == 1 and len(t) > 0 and not t.is_floating_point()):
        raise ValueError(f"prompt_fn() returned {type(p).__name__} {getattr(p, 'shape', '')}: it "
                         "must return one non-empty prompt, a 1-D integer tensor of token ids (or "
                         "a list of ints)")
    return t.long()


def _is_int(x):
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)  # numpy integers too


def as_seed(x):
    """seed_fn's seed as an int; a float (int() would truncate it: members sharing a seed) or any
    other non-integer is refused."""
    whole = torch.is_tensor(x) and x.numel() == 1 and not (x.is_floating_point() or x.is_complex())
    if not (_is_int(x) or whole and x.dtype != torch.bool):
        raise TypeError(f"seed_fn() returned {x!r} ({type(x).__name__}): it must return an integer "
                        "seed (a float would be truncated, and group members could share a seed)")
    return int(x)


# -------------------------------------------------------- dynamic sampling, a batch and its figures
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
    # name -> (B,) of (n_i, ...): an option's per-token outputs (StaleSync._per_token)
    per_token: dict = field(default_factory=dict)


def as_batch(groups, version, metrics, per_token):
    """The groups' samples as a Batch, each group's contiguous."""
    pairs = [(g, s) for g in groups for s in g["samples"]]
    samples = [s for _, s in pairs]

    def as_tensors(key, dtype):  # (B,) of (n_i,)
        return [torch.tensor(s[key], dtype=dtype) for s in samples]
    return Batch(version=version, ids=[s["id"] for s in samples],
                 slots=[g["slot"] for g, _ in pairs], seeds=[s["seed"] for s in samples],
                 prompts=[g["prompt"] for g, _ in pairs],
                 responses=as_tensors("tokens", torch.long),
                 logprobs=as_tensors("logprobs", torch.float32),
                 token_versions=as_tensors("versions", torch.long),
                 start_versions=[g["start_version"] for g, _ in pairs],
                 done=[True] * len(samples), metrics=metrics, per_token=per_token)


def batch_metrics(sched, k, samples, regenerated_at_cut):
    """The stale/* figures of batch k. An empty share (a shared cut's) reports no dropped
    groups: the next batch with samples does."""
    filtered_at_cut = sched.filtered - sched.filtered_reported if samples else 0
    sched.filtered_reported += filtered_at_cut
    ages = [k - g["start_version"] for g, _ in samples]                                # (B,)
    groups = len(samples) // sched.cfg.group_size
    return {"stale/age_max": max(ages, default=0),
            "stale/age_mean": sum(ages) / max(len(ages), 1),
            "stale/regenerated": sched.regenerated,  # so far; at this cut:
            "stale/regenerated_at_cut": regenerated_at_cut,
            "stale/filtered": sched.filtered, "stale/filtered_at_cut": filtered_at_cut,
            # a shared cut: the groups given beyond groups_per_step, for a held-back peer
            "stale/filled_in_at_cut": max(0, groups - sched.cfg.groups_per_step),
            "stale/partial_continued": sum(len(set(s["versions"])) > 1 for _, s in samples),
            "rollout/response_tokens": sum(len(s["tokens"]) for _, s in samples)}


def accounting_of(sched):
    """StaleSync.accounting: sample ids by fate: trained, regenerated, filtered, in flight."""
    out = {"trained": set(), "regenerated": set(), "filtered": set(), "in_flight": set()}
    for i, f in sched.fate.items():
        out[f].add(i)
    out["in_flight"] = {s["id"] for g in sched.pool for s in g["samples"]}
    return out


# ------------------------------------------------------------------------------ the sampler's cache
def sampler_cache(step_fn):
    """A cached sampler's reset() and the state that StaleSync.state_dict saves: step_fn's own, or
    its owner's for a bound method (None where it has none). reset() drops its KV cache, at a
    round's end and in update(). The state is the sampler itself if it has state_dict() and
    load_state_dict(), but a model's weights stay out of it."""
    owner = getattr(step_fn, "__self__", step_fn)  # a bound method's object
    stateful = hasattr(owner, "state_dict") and hasattr(owner, "load_state_dict")
    plain = stateful and not isinstance(owner, torch.nn.Module)
    return getattr(owner, "reset", None), owner if plain else None


# Notes on the options, which stalesync.py points to ("see the companion").
#
# A separated caller drives the scheduler on its generator itself: admit(), decode(), and take()
# while ready(); update(v) as the weights of version v arrive (v in [version, batches_out]).
#
# SharedCut's replica and leader: a replica of several ranks (inference TP) is named by `replica`
# on each of them, and one of them, the `leader`, speaks for it: the others hold the same pool.
# Why every one of them posts, and only the leader's part counts: SharedCut's docstring, and the
# argument above post_or_wait (stalesync.py).


# -------------------------------------------------------------------------- the checkpoint state
_COUNTERS = ("version", "batches_out", "slots_opened", "next_id", "regenerated", "filtered",
             "filtered_reported", "filtered_at_take", "max_admitted_over")
_SAMPLE = ("id", "seed", "tokens", "logprobs", "versions", "done")  # a subclass saves its own keys


def scheduler_state(sched):
    """StaleSync.state_dict: the groups in flight (their samples' _SAMPLE keys, lists as tensors),
    the slots to reopen, the counters (_COUNTERS), the fates, the sampler's state. Not prompt_fn's
    or seed_fn's: a function of (slot, attempt) alone, or of state the caller restores, resumes
    exactly; one that reads an unsaved stream serves it again."""
    def saved(s):  # a sample, its lists as tensors
        return {k: s[k] for k in _SAMPLE} | dict(
            tokens=torch.tensor(s["tokens"], dtype=torch.long),
            logprobs=torch.tensor(s["logprobs"], dtype=torch.float32),
            versions=torch.tensor(s["versions"], dtype=torch.long))
    pool = [dict(g, prompt=g["prompt"].clone(), samples=[saved(s) for s in g["samples"]])
            for g in sched.pool]
    sampler = sched.sampler_state.state_dict() if sched.sampler_state is not None else None
    return dict(cfg=vars(sched.cfg).copy(), **{k: getattr(sched, k) for k in _COUNTERS},
                reopen=[list(r) for r in sched.reopen], fate=dict(sched.fate), pool=pool,
                sampler=sampler)


def load_scheduler_state(sched, sd):
    """StaleSync.load_state_dict: refuses another config (the brakes aside). An older checkpoint's
    chunk_s0 (now options/streaming.py's, a deployment's: checkpoint.py checks that) is not read."""
    brakes = ("max_len", "max_filtered")  # they bound a run, not its state: free to change
    saved, mine = ({k: v for k, v in c.items() if k not in brakes + ("chunk_s0",)}
                   for c in (sd["cfg"], vars(sched.cfg)))
    if saved != mine:
        raise ValueError(f"checkpoint config {saved} differs from this scheduler's {mine}")

    def loaded(s):  # a saved sample's _SAMPLE keys (older checkpoints: per_token too), as lists
        return {k: s[k] for k in _SAMPLE} | dict(
            tokens=s["tokens"].tolist(), logprobs=s["logprobs"].tolist(),
            versions=s["versions"].tolist())
    pool = [dict(g, prompt=g["prompt"].clone(), samples=[loaded(s) for s in g["samples"]])
            for g in sd["pool"]]
    for key in _COUNTERS:  # older checkpoints have no filtered_at_take
        fallback = sd["filtered_reported"] if key == "filtered_at_take" else sd[key]
        setattr(sched, key, sd.get(key, fallback))
    if sd["sampler"] is not None:  # the held rows' KV cache too, if it saves it: bit-exact
        sched.sampler_state.load_state_dict(sd["sampler"])
    elif sched.reset_fn is not None:  # a cache not checkpointed: the prefixes are read again
        sched.reset_fn()
    sched.reopen = [tuple(r) for r in sd["reopen"]]
    sched.fate = dict(sd["fate"])
    sched.pool = pool


def start_scheduler_at(sched, version):
    """StaleSync.start_at: empty, at `version` with as many batches out, on a scheduler that has
    done nothing yet: a resume that cannot keep the groups in flight (another world size) opens the
    next slots again, their first attempts."""
    if sched.batches_out or sched.pool:
        raise RuntimeError("start_at() on a scheduler that has already emitted or admitted "
                           "groups")
    sched.version = sched.batches_out = version
    sched.slots_opened = version * sched.cfg.groups_per_step
