"""Benchmark stalesync.py: synchronous vs bounded-staleness rollout, colocated and separated, on 2 gloo ranks.

    python bench/stalesync.py --lengths lognormal:2.5,1.2   # also uniform:A,B  pareto:ALPHA,MIN  fixed:N

Measured figures, with the commands and the machine that produced them, live in bench/RESULTS.md: this
docstring says what is measured, in which regime and why, not what it came to.

What runs (real work, forced lengths): responses are decoded by the real policy (model.Sampler: a KV cache
kept between the decode chunks of a round, counter-seeded sampling) until each sample's drawn length, a
stand-in for a long tail of EOS positions; each step is a real forward/backward (grpo.grpo_loss, the GRPO
clipped surrogate, token-mean over the step's tokens) and AdamW step of the policy on the batch.
  colocated  both ranks generate their half of the batch, then train on it (gradients all-reduced); a
             round ends when every rank is ready (stalesync.AllReady: one all-reduce of a flag per decode
             chunk; a rank not ready posts its flag and decodes on without waiting for the answer, which
             can only be no), and a rank ready first keeps decoding its in-flight tail meanwhile
             (--no-collective: it waits);
  separated  rank 0 generates, rank 1 trains; batches go 0 -> 1, weights 1 -> 0 (gloo p2p), the new
             weights reach the generator between its decode chunks, so at S >= 1 it keeps generating
             while the trainer trains.
S = 0 is the synchronous algorithm (stalesync.py reduces to it); S >= 1 (--staleness) cut at the threshold.

Regime (the flags' defaults; the header line prints them, with the length law's mean and max/mean): a
heavy-tailed length law (--lengths, clipped to --max-len) with max/mean above the targets' bound below;
--steps optimizer steps of --groups-per-step x --group-size samples, enough that the first rounds and the
pool still in flight at the end stay transients (too few steps understate the steady state); a decode pool
of (S + 1) x groups_per_step groups, the admission capacity (threshold 1 / (S + 1): a fixed pool would give
a larger S a later deadline but no more rows); --chunk decode steps between cut checks; the KV cache kept
across the chunks of a round and re-prefilled once per round under the new weights (as AReaL does; stale KV
would not be "the new weights"); training packs each micro-batch into one row of at most --pack tokens
(block-diagonal mask: the loss of padded rows up to float rounding, with no FLOP spent on padding), so
decode steps rather than padding dominate a step. Configurations run interleaved, the order rotated per
repeat, --repeats times; tokens_per_s are medians, and every ratio is the median over repeats of the ratio
within one repeat (a shared host drifts).

Why it is fair: every configuration trains the same number of steps of the same global batch size; a
sample has the same global id, so the same seed and length, in every deployment (colocated rank r's
local group g is global group (g // gps) * 2 gps + r gps + g % gps); regenerated groups take fresh ids,
so a run that regenerates trains a slightly different set of lengths; regenerated work counts in the wall
time; tokens_per_s counts trained response tokens only, over the slowest rank's wall time, so the long
tail a stale run still holds in flight at its end is not credited to it (a conservative bias).

Targets, on a length law with max/mean >= 4, both at S = 1: stale_over_sync_colocated >= 1.5 and
colocated_stale_over_separated_sync >= 2.5. The second cannot be reached with 2 ranks (the argument under
its field below); the JSON carries the figures that say where each lands and why.

The JSON object (the last line printed), field by field:
  tokens_per_s  per configuration ("colocated_S0", "separated_S1", ...): trained response tokens per second
      of the slowest rank's wall time, the median over repeats. The raw speeds the ratios are built from.
  lengths, max_over_mean  the length law and its max/mean over a fixed sample of draws: the tail the targets
      are stated for (a gain from staleness needs a tail to cut).
  stale_over_sync_colocated, stale_over_sync_separated  S = 1 over S = 0 in one deployment: what staleness
      alone gains, the first target.
  colocated_stale_over_separated_sync  colocated S = 1 over separated S = 0, the second target: the gain
      over the usual deployment. It is < 2 at S = 1 on 2 ranks, on any device whose decode step costs
      a + b x rows (a: the fixed cost, the weight read on a GPU; b: the cost of one more row). Per optimizer
      step, with D critical-path decode steps, N tokens decoded per rank, T one rank's training and C the
      separated weight transfer: colocated sync costs a D + b N + T; separated sync a D + 2 b N + 2 T + C
      (one rank decodes, one trains, the whole batch each); colocated S = 1 at least a D / x + b N + T, x < 2
      the decode-step gain (decode_steps_sync_over_stale_colocated). Staleness divides only the a D term
      and separation doubles only the others, so the ratio is < max(x, 2) + C / (b N + T) = 2 + C / (b N + T)
      for any a, b, D, N, T, and C is small next to a step's training: 2.5 at S = 1 is out of reach with
      2 ranks. Its x = 1 case, colocated sync over separated sync, says where a device stands: near 1 when a D dominates
      (latency-bound), toward 2 when b N + T do (compute-bound, bench/fusion.py).
  best_stale_over_sync_colocated  the S among --staleness with the largest colocated gain, and that gain.
  stale_over_sync_colocated_by_S, colocated_over_separated_sync_by_S  the two target ratios at every S
      given: x grows with S, the wall clock far less. A larger S with its pool at capacity cuts more
      critical-path decode steps, but training is a fixed share of every step, and each critical-path step
      costs more, since the pool keeps (S + 1) x the rows alive (wider KV caches too) and re-prefills every
      in-flight prefix under the new weights each round (in length buckets: model._prefill).
  decode_steps_sync_over_stale_colocated  x by S, the mechanism in device-independent units (critical-path
      decode steps d_k, per round k the max over ranks). At S = 1 every group has at most 2 rounds (batch k
      must take the groups started at version k - 1), so d_(k-1) + d_k >= the longest sample started in
      round k - 1 and x < 2; it nears 2 only slowly as --steps grows (as a simulation of this scheduler shows).
  stale_over_sync_colocated_ceiling_by_S  what x alone would give: the sync step with its rollout divided by
      x and its training unchanged; the gap to the measured ratio is the stale pool's extra cost per step,
      its re-prefills and its waits.
  rollout_over_train_sync_colocated  rank 0's rollout time over its training time, colocated S = 0: the
      share of a step that staleness can act on (it shortens only the rollout).
  idle_frac  per configuration, each rank's share of the wall time spent waiting (spans named "idle").
  repeats  how many interleaved repeats each median and ratio is over.
  concurrent_decode_slowdown  how much slower a rank decodes while its peer decodes too, probed before and
      after the runs (it drifts with the host's load). CPU cores sharing a host are not independent devices:
      a synchronous rank's idle time partly speeds up its busy peer, so every idle-removal gain of StaleSync
      shrinks by up to that factor; on separate accelerators it is 1.
  Not in the JSON, but behind the last two fields: on CPU cores a decode step's cost grows little with the
  rows and more with the KV width, and a stale pool keeps more rows, and longer ones, alive than a
  synchronous tail does.
"""
import argparse
import datetime
import functools
import json
import multiprocessing as mp
import os
import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere
from grpo import grpo_loss, pad_responses, token_logprobs  # noqa: E402
from model import KVCache, ModelConfig, Policy, Sampler  # noqa: E402
from stalesync import AllReady, StaleConfig, StaleSync  # noqa: E402
from plumbing.stalesync_details import Batch  # noqa: E402
from plumbing.timeline import Spans  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def length_law(spec, max_len, salt=1234):
    """'lognormal:MU,SIGMA' | 'uniform:A,B' | 'pareto:ALPHA,MIN' | 'fixed:N' -> seed -> length in [1, max_len]."""
    kind, _, params = spec.partition(":")
    a = [float(x) for x in params.split(",")]
    draw = {"lognormal": lambda r: r.lognormal(a[0], a[1]), "uniform": lambda r: r.uniform(a[0], a[1]),
            "pareto": lambda r: a[1] * (1 + r.pareto(a[0])), "fixed": lambda r: a[0]}[kind]
    return lambda seed: int(np.clip(round(draw(np.random.default_rng([salt, int(seed)]))), 1, max_len))


class ForcedLengths(Sampler):
    """model.Sampler (the KV cache kept between a round's decode chunks, reset() with new weights) whose
    rows run, EOS or not, to a length drawn per seed: a stand-in for a long tail of EOS positions."""

    def __init__(self, model, length_of):
        super().__init__(model, max_new_tokens=None, eos_id=None)
        # cached per run: a draw seeds a fresh numpy Generator, and a stale run asks for each row's length
        # at every chunk
        self.length_of = functools.lru_cache(maxsize=None)(length_of)

    def budget(self, seeds, n_done):
        return torch.tensor([self.length_of(s) for s in seeds.tolist()]) - n_done


# ----------------------------------------------------------------------------- training
def packed_forward(model, batch, rows, adv):
    """The micro-batch `rows` as one packed row (1, N): sample b occupies [s_b, s_b + L_b), a block-diagonal
    causal mask, positions restarting per sample, so no FLOP goes to padding. Returns log-probs, behaviour
    log-probs, advantages and mask with one grpo_loss row per predicted token (each token carries its
    sample's advantage): (N-1, 1), (N-1, 1), (N-1,), (N-1, 1)."""
    seqs = [torch.cat([batch.prompts[i], batch.responses[i]]) for i in rows]
    tokens = torch.cat(seqs)[None]                                                   # (1, N)
    doc = torch.cat([torch.full((len(x),), b) for b, x in enumerate(seqs)])          # (N,)
    pos = torch.cat([torch.arange(len(x)) for x in seqs])[None]                      # (1, N)
    attn = (doc[:, None] == doc[None]) & (pos[0][:, None] >= pos[0][None])           # (N, N)
    logits = model(tokens, pos, attn[None, None])[0, :-1]                            # (N-1, V)
    lp = token_logprobs(logits[None], tokens[:, 1:])[0]                              # (N-1,)
    mask = torch.zeros(len(lp))                                                      # (N-1,)
    old = torch.zeros(len(lp))                                                       # (N-1,)
    a = torch.zeros(len(lp))                                                         # (N-1,)
    s0 = 0
    for i in rows:  # response token t of the sample starting at s0 is predicted at s0 + P - 1 + t
        P, R = len(batch.prompts[i]), len(batch.responses[i])
        span = slice(s0 + P - 1, s0 + P + R - 1)
        mask[span] = 1
        old[span] = batch.logprobs[i]
        a[span] = adv[i]
        s0 += P + R
    return lp[:, None], old[:, None], a, mask[:, None]


def padded_forward(model, batch, rows, adv):
    """The micro-batch `rows` as right-padded rows (b, T). Returns log-probs, behaviour log-probs,
    advantages and mask: (b, T-1), (b, T-1), (b,), (b, T-1)."""
    tokens, mask, (old,) = pad_responses([batch.prompts[i] for i in rows], [batch.responses[i] for i in rows],
                                         [batch.logprobs[i] for i in rows])          # (b, T), (b, T-1) x 2
    lp = token_logprobs(model(tokens[:, :-1]), tokens[:, 1:])                        # (b, T-1)
    return lp, old, adv[rows], mask


def train_step(model, opt, batch, group, micro_rows, pack_tokens=0):
    """One GRPO optimizer step on a batch: forward/backward in length-sorted micro-batches, the loss a mean
    over every response token of the batch on this rank, gradients all-reduced over `group` (None: no
    peers). pack_tokens > 0: each micro-batch is instead one packed row of up to pack_tokens tokens
    (packed_forward); the loss is the same."""
    order = sorted(range(len(batch.ids)), key=lambda i: len(batch.prompts[i]) + len(batch.responses[i]))
    n_tok = sum(len(r) for r in batch.responses)  # response tokens of the whole batch on this rank
    adv = torch.randn(len(batch.ids), generator=torch.Generator().manual_seed(batch.version))  # (B,)
    micro, cur, used = [], [], 0
    for i in order:  # micro-batches: micro_rows rows, or rows packed up to pack_tokens tokens
        n = len(batch.prompts[i]) + len(batch.responses[i])
        if cur and (len(cur) == micro_rows if pack_tokens <= 0 else used + n > pack_tokens):
            micro, cur, used = micro + [cur], [], 0
        cur, used = cur + [i], used + n
    for mb in micro + [cur]:
        forward = packed_forward if pack_tokens > 0 else padded_forward
        lp, old, a, mask = forward(model, batch, mb, adv)
        loss, _ = grpo_loss(lp, old, None, a, mask, clip_eps=0.2)  # token-mean over this micro-batch's tokens
        (loss * (mask.sum() / n_tok)).backward()  # rescaled: the token-mean over the batch's n_tok tokens
    if group is not None:  # one flat all-reduce of the gradients
        grads = [p.grad for p in model.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        torch.nn.utils.vector_to_parameters(flat / dist.get_world_size(group), grads)
    opt.step()
    opt.zero_grad(set_to_none=False)


# ----------------------------------------------------------------------------- one configuration
def build(rank, args, S, deploy, length_of):
    """This rank's policy (the same initial weights everywhere), optimizer, sampler and scheduler, whose
    samples take their global ids. Returns (model, opt, decoder, sched, gps), gps = this rank's groups per step."""
    torch.manual_seed(0)
    model = Policy(ModelConfig(vocab_size=14, max_seq_len=args.prompt_len + args.max_len + 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    gps = args.groups_per_step if deploy == "separated" else args.groups_per_step // 2
    threshold = 1 / (S + 1) if args.threshold is None else args.threshold  # default: pool = admission capacity
    cfg = StaleConfig(staleness=S, groups_per_step=gps, group_size=args.group_size, threshold=threshold,
                      chunk_steps=args.chunk)
    rng = np.random.default_rng(rank)
    decoder = ForcedLengths(model, length_of)
    W = dist.get_world_size() if deploy == "colocated" else 1  # generating ranks

    def global_id(slot, attempt, j):  # this rank's slot -> its place in the global batches: the same sample (so the
        g = (slot // gps) * gps * W + rank * gps + slot % gps  # same length) in every deployment; a regenerated
        return (g * args.group_size + j) + attempt * 10**9      # group (attempt > 0) draws new lengths

    prompt_fn = lambda slot, attempt: torch.as_tensor(rng.integers(4, 14, args.prompt_len))  # noqa: E731
    sched = StaleSync(cfg, decoder, prompt_fn, seed_fn=global_id)
    return model, opt, decoder, sched, gps


def run_colocated(args, model, opt, decoder, sched, spans):
    """Every rank generates its share of each batch, then all train on it (gradients all-reduced).
    Returns (response tokens trained here, each batch's metrics, decode steps of each round)."""
    all_ready = AllReady(spans=spans) if args.collective else None  # a round ends when every rank is ready
    group = None if dist.get_world_size() == 1 else dist.group.WORLD
    tokens, ages, round_steps = 0, [], []
    for _ in range(args.steps):
        s0 = decoder.steps
        b = sched.rollout(spans, all_ready)
        round_steps.append(decoder.steps - s0)
        with spans("idle"):
            dist.barrier()
        with spans("train"):
            train_step(model, opt, b, group, args.micro, args.pack)
        sched.update()  # drops the sampler's KV cache too
        tokens += b.metrics["rollout/response_tokens"]
        ages.append(b.metrics)
    return tokens, ages, round_steps


def run_generator(args, model, sched, spans):
    """Separated, rank 0: decode, send each batch to the trainer, load its weights between decode chunks.
    Returns each batch's metrics."""
    flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()  # the weights' recv buffer
    got, pending, ages, n_sent = threading.Event(), [], [], 0

    def listen(v):  # gloo's is_completed() does not poll: a thread waits and flags
        dist.irecv(flat, 1, tag=2 * v + 1).wait()
        got.set()

    def start_listen(v):
        t = threading.Thread(target=listen, args=(v,))
        if v < args.steps:  # the trainer sends versions 1 .. steps - 1
            t.start()
        return t

    def new_weights():  # between decode chunks: load, drop the KV cache, version + 1
        waiter.join()
        got.clear()
        torch.nn.utils.vector_to_parameters(flat.clone(), model.parameters())
        sched.update()  # drops the sampler's KV cache too
        return start_listen(sched.version + 1)

    waiter = start_listen(1)
    while n_sent < args.steps:
        if got.is_set():
            waiter = new_weights()
        sched.admit()
        with spans("rollout"):
            n = sched.decode()
        while sched.ready() and n_sent < args.steps:
            b = sched.take()
            ages.append(b.metrics)
            head = torch.tensor([[len(p), len(r)] for p, r in zip(b.prompts, b.responses)])   # (B, 2)
            bufs = (head, torch.cat([torch.cat([p, r]) for p, r in zip(b.prompts, b.responses)]),
                    torch.cat(b.logprobs))  # counts first, then the packed payload
            pending.append((bufs, [dist.isend(x, 1, tag=2 * b.version) for x in bufs]))
            n_sent += 1
        if n == 0 and not sched.ready() and n_sent < args.steps:
            with spans("idle"):
                got.wait()
    while waiter.is_alive() or got.is_set():  # take every weight message the trainer still sends
        got.wait()
        waiter = new_weights()
    for _, works in pending:
        for w in works:
            w.wait()
    return ages


def run_trainer(args, model, opt, gps, spans):
    """Separated, rank 1: receive each batch, train on it, send the new weights back.
    Returns the response tokens trained."""
    flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()  # the weights' send buffer
    B, tokens = gps * args.group_size, 0
    for v in range(args.steps):
        head = torch.zeros(B, 2, dtype=torch.long)                                   # (B, 2): prompt, response lengths
        with spans("idle"):
            dist.recv(head, 0, tag=2 * v)
            payload = torch.zeros(int(head.sum()), dtype=torch.long)                 # (sum P + R,)
            lps = torch.zeros(int(head[:, 1].sum()))                                 # (sum R,)
            dist.recv(payload, 0, tag=2 * v)
            dist.recv(lps, 0, tag=2 * v)
        seqs, lp = payload.split(head.sum(1).tolist()), lps.split(head[:, 1].tolist())
        b = Batch(version=v, ids=list(range(B)), slots=[], seeds=[],
                  prompts=[s[:p] for s, (p, _) in zip(seqs, head.tolist())],
                  responses=[s[p:] for s, (p, _) in zip(seqs, head.tolist())], logprobs=list(lp),
                  token_versions=[], start_versions=[], done=[], metrics={})
        with spans("train"):
            train_step(model, opt, b, None, args.micro, args.pack)
        tokens += int(head[:, 1].sum())
        if v + 1 < args.steps:
            flat.copy_(torch.nn.utils.parameters_to_vector(model.parameters()).detach())
            dist.send(flat, 0, tag=2 * (v + 1) + 1)
    return tokens


def run_config(rank, args, S, deploy, length_of):
    """One configuration (deploy "colocated" or "separated", staleness S) on this rank: its role from a
    barrier on, then speed, idle share and ages, the wall time the slowest rank's and tokens summed."""
    model, opt, decoder, sched, gps = build(rank, args, S, deploy, length_of)
    spans = Spans()
    dist.barrier()
    t0 = time.perf_counter()
    if deploy == "colocated":
        tokens, ages, round_steps = run_colocated(args, model, opt, decoder, sched, spans)
    elif rank == 0:
        tokens, ages, round_steps = 0, run_generator(args, model, sched, spans), []
    else:
        tokens, ages, round_steps = run_trainer(args, model, opt, gps, spans), [], []
    wall = torch.tensor([time.perf_counter() - t0, tokens], dtype=torch.float64)   # (2,): seconds, tokens
    idle = spans.perf(0, t0)["perf/idle_frac"]
    dist.all_reduce(wall[1:])
    dist.all_reduce(wall[:1], op=dist.ReduceOp.MAX)
    res = dict(tokens_per_s=wall[1].item() / wall[0].item(), wall_s=wall[0].item(), tokens=int(wall[1].item()),
               idle_frac=idle, rollout_s=spans.total("rollout"), train_s=spans.total("train"),
               decode_steps=decoder.steps, round_steps=round_steps)
    if ages:
        res.update(age_max=max(m["stale/age_max"] for m in ages), regenerated=ages[-1]["stale/regenerated"],
                   age_mean=float(np.mean([m["stale/age_mean"] for m in ages])),
                   partial_continued=sum(m["stale/partial_continued"] for m in ages))
    return res


# ----------------------------------------------------------------------------- the two ranks
def concurrency_probe(rank, n_steps=150, rows=8):
    """ms per decode step of `rows` rows when this rank decodes alone (the peer blocked in a recv) and when
    both ranks decode at once. Real devices do not slow each other; CPU cores sharing a host can, and then
    a synchronous rank's idle time is partly recovered by its busy peer, which shrinks every idle-removal gain."""
    torch.manual_seed(0)
    m = Policy(ModelConfig(vocab_size=14, max_seq_len=n_steps + 40))

    def decode():
        cache, tok = KVCache(m.cfg, rows, n_steps + 1, "cpu", torch.float32), torch.zeros(rows, 1, dtype=torch.long)
        t0 = time.perf_counter()
        with torch.no_grad():
            for i in range(n_steps):
                tok = m(tok, torch.full((rows, 1), i), torch.ones(rows, 1, 1, i + 1, dtype=torch.bool), cache)[:, -1:].argmax(-1)
        return (time.perf_counter() - t0) / n_steps * 1e3

    solo, token = [], torch.zeros(1)
    for turn in (0, 1):  # one rank decodes while the other waits in a recv
        if rank == turn:
            solo.append(decode())
            dist.send(token, 1 - turn)
        else:
            dist.recv(token, turn)
    dist.barrier()
    both = decode()
    out = torch.tensor([solo[0], both])
    dist.all_reduce(out)
    return dict(solo_ms=round(out[0].item() / 2, 3), concurrent_ms=round(out[1].item() / 2, 3),
                concurrent_slowdown=round(out[1].item() / out[0].item(), 3))


def worker(rank, args, port, results):
    torch.set_num_threads(1)  # 2 processes x 1 thread on 2 cores
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=300))
    try:
        length_of = length_law(args.lengths, args.max_len)
        configs = [(d, S) for d in ("colocated", "separated") for S in [0] + args.staleness]
        out = {f"{d}_S{S}": [] for d, S in configs}
        run_config(rank, argparse.Namespace(**dict(vars(args), steps=2)), 1, "colocated", length_of)  # warm-up
        probe = concurrency_probe(rank)
        for rep in range(args.repeats):  # interleaved, the order rotated each repeat: contention hits all alike
            for deploy, S in configs[rep % len(configs):] + configs[:rep % len(configs)]:
                res = run_config(rank, args, S, deploy, length_of)
                peer = [None, None]
                dist.all_gather_object(peer, res)
                r = dict(peer[0], idle_frac=[round(p["idle_frac"], 3) for p in peer],
                         decode_steps=[p["decode_steps"] for p in peer],  # critical path: rounds end together
                         wall_decode_steps=sum(map(max, zip(*[p["round_steps"] for p in peer]))) if deploy == "colocated"
                         else peer[0]["decode_steps"])
                r.pop("round_steps")
                agg = [p for p in peer if "age_max" in p]  # ranks that generated
                r.update(age_max=max(p["age_max"] for p in agg), age_mean=float(np.mean([p["age_mean"] for p in agg])),
                         regenerated=sum(p["regenerated"] for p in agg),
                         partial_continued=sum(p["partial_continued"] for p in agg))
                out[f"{deploy}_S{S}"].append(r)
        probe2 = concurrency_probe(rank)  # before and after: contention may change during the run
        if rank == 0:
            results.put(dict(out, probe=[probe, probe2]))
    finally:
        dist.destroy_process_group()


def median_run(runs):
    """The run nearest the median tokens_per_s, tokens_per_s replaced by the median, every repeat's figure kept."""
    med = float(np.median([x["tokens_per_s"] for x in runs]))
    r = min(runs, key=lambda x: abs(x["tokens_per_s"] - med))
    return dict(r, tokens_per_s=med, all_tokens_per_s=[round(x["tokens_per_s"], 1) for x in runs])


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # workload
    p.add_argument("--lengths", default="lognormal:2.5,1.2", help="response length law: lognormal:MU,SIGMA, "
                   "uniform:A,B, pareto:ALPHA,MIN or fixed:N (tokens, clipped to [1, --max-len])")
    p.add_argument("--max-len", type=int, default=256, help="longest response")
    p.add_argument("--prompt-len", type=int, default=16, help="prompt tokens")
    p.add_argument("--steps", type=int, default=48, help="optimizer steps per configuration")
    p.add_argument("--groups-per-step", type=int, default=4, help="global prompt groups per step")
    p.add_argument("--group-size", type=int, default=4, help="responses per prompt")
    p.add_argument("--micro", type=int, default=4, help="rows per padded training micro-batch (length-sorted)")
    p.add_argument("--pack", type=int, default=512, help="tokens per packed training micro-batch (0: padded rows)")
    # staleness
    p.add_argument("--staleness", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4],
                   help="bounds S compared with synchronous (S=0)")
    p.add_argument("--threshold", type=float, default=None, help="decode pool = groups per step / threshold "
                   "(default 1 / (S + 1): the pool is the admission capacity, (S + 1) x groups per step)")
    p.add_argument("--chunk", type=int, default=16, help="decode steps between cut checks")
    p.add_argument("--no-collective", dest="collective", action="store_false",
                   help="colocated: each rank stops decoding once its own batch is ready (default: the round ends "
                        "when every rank is ready, and a ready rank keeps decoding its long tail meanwhile)")
    # measurement
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every configuration; medians reported")
    args = p.parse_args()
    if 1 not in args.staleness or 0 in args.staleness:
        p.error(f"--staleness {args.staleness}: give bounds >= 1 that include 1 (the targets are at S = 1; "
                "S = 0 always runs)")
    return args


def main():
    args = parse_args()
    length_of = length_law(args.lengths, args.max_len)
    draws = np.array([length_of(s) for s in range(20000)])
    pool = f"(S + 1) x {args.groups_per_step}" if args.threshold is None else f"{args.groups_per_step}/{args.threshold}"
    print(f"lengths {args.lengths}: mean {draws.mean():.1f}, max {draws.max()}, max/mean {draws.max() / draws.mean():.1f}"
          f" | {args.steps} steps x {args.groups_per_step} x {args.group_size} samples per configuration"
          f" | pool {pool} groups, chunk {args.chunk}, micro {args.micro}, "
          f"collective cut {args.collective} | median of {args.repeats} interleaved repeats")
    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=worker, args=(r, args, port, results)) for r in range(2)]
    for pr in procs:
        pr.start()
    got = results.get(timeout=900)
    probe = got.pop("probe")
    res = {k: median_run(v) for k, v in got.items()}
    for pr in procs:
        pr.join()
    for name, r in res.items():
        extra = "" if "age_max" not in r else (f" | age max {r['age_max']} mean {r['age_mean']:.2f} | "
                                               f"regenerated {r['regenerated']} | partial {r['partial_continued']}")
        print(f"{name:14s} {r['tokens_per_s']:8.0f} tok/s {r['all_tokens_per_s']} | {r['wall_s']:6.2f} s (rank 0: rollout "
              f"{r['rollout_s']:.2f} s, train {r['train_s']:.2f} s) | decode steps {r['decode_steps']}, critical path "
              f"{r['wall_decode_steps']} | idle "
              f"{r['idle_frac']}{extra}")
    tps = {k: round(v["tokens_per_s"], 1) for k, v in res.items()}
    steps = {k: v["wall_decode_steps"] for k, v in res.items()}

    def ratio(a, b):  # median over repeats of the ratio within a repeat: both ran minutes apart at most
        return round(float(np.median([x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(got[a], got[b])])), 3)

    def ceiling(S):
        """The S run's speed-up if its rollout were the sync rollout divided by the decode-step gain (every step
        as cheap as a sync one, no re-prefill, no extra wait) and the rest of a step unchanged; a wall-time ratio
        for the same work, the median over repeats. Loose: sync's rollout_s (rank 0) includes its prefill and idle."""
        gain = steps["colocated_S0"] / steps[f"colocated_S{S}"]
        return round(float(np.median([r["wall_s"] / (r["rollout_s"] / gain + r["wall_s"] - r["rollout_s"])
                                      for r in got["colocated_S0"]])), 3)

    best = max(args.staleness, key=lambda s: ratio(f"colocated_S{s}", "colocated_S0"))
    out = dict(tokens_per_s=tps, lengths=args.lengths, max_over_mean=round(float(draws.max() / draws.mean()), 2),
               stale_over_sync_colocated=ratio("colocated_S1", "colocated_S0"),
               stale_over_sync_separated=ratio("separated_S1", "separated_S0"),
               colocated_stale_over_separated_sync=ratio("colocated_S1", "separated_S0"),
               best_stale_over_sync_colocated=dict(S=best, ratio=ratio(f"colocated_S{best}", "colocated_S0")),
               stale_over_sync_colocated_by_S={f"S{s}": ratio(f"colocated_S{s}", "colocated_S0")
                                               for s in args.staleness},
               colocated_over_separated_sync_by_S={f"S{s}": ratio(f"colocated_S{s}", "separated_S0")
                                                   for s in args.staleness},
               decode_steps_sync_over_stale_colocated={f"S{s}": round(steps["colocated_S0"] / steps[f"colocated_S{s}"], 3)
                                                       for s in args.staleness},
               stale_over_sync_colocated_ceiling_by_S={f"S{s}": ceiling(s) for s in args.staleness},
               rollout_over_train_sync_colocated=round(res["colocated_S0"]["rollout_s"] / res["colocated_S0"]["train_s"], 2),
               idle_frac={k: v["idle_frac"] for k, v in res.items()}, repeats=args.repeats,
               concurrent_decode_slowdown=[p["concurrent_slowdown"] for p in probe])
    print(f"decode probe (8 rows): alone {probe[0]['solo_ms']} ms/step, both ranks at once {probe[0]['concurrent_ms']} "
          f"ms/step (x{probe[0]['concurrent_slowdown']}); after the run x{probe[1]['concurrent_slowdown']}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
