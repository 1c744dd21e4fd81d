"""Benchmark stalesync.py: synchronous vs bounded-staleness rollout, colocated and separated, on 2 gloo ranks.

    python bench/stalesync.py --lengths lognormal:2.5,1.2   # also uniform:A,B  pareto:ALPHA,MIN  fixed:N

Real work, forced lengths: responses are decoded by the real policy (model.Sampler: a KV cache kept
between the decode chunks of a round, counter-seeded sampling) until each sample's drawn length, a
stand-in for a long tail of EOS positions; each step is a real forward/backward and AdamW step of the
policy on the batch.
  colocated  both ranks generate their half of the batch, then train on it (gradients all-reduced); a
             round ends when every rank is ready (one all-reduce of a flag per decode chunk; a rank not
             ready posts its flag and decodes on without waiting for the answer, which can only be no), and
             a rank ready first keeps decoding its in-flight tail meanwhile (--no-collective: it waits);
  separated  rank 0 generates, rank 1 trains; batches go 0 -> 1, weights 1 -> 0 (gloo p2p), the new
             weights reach the generator between its decode chunks, so at S >= 1 it keeps generating
             while the trainer trains.
S = 0 is the synchronous algorithm (stalesync.py reduces to it); S = 1, 2, 4 cut at the threshold.

Regime (the defaults; printed in the header): lognormal(2.5, 1.2) lengths clipped to 256 (mean 24, max/mean
10.7); 48 steps x 4 groups x 4 samples (the first rounds, and the pool still in flight at the end, are
transients: 24 steps understate the steady state); a decode pool of (S + 1) x groups_per_step groups, the
admission capacity (threshold 1 / (S + 1): a fixed pool would give a larger S a later deadline but no more
rows); chunks of 16 decode steps; the KV cache kept across the chunks of a round and
re-prefilled once per round under the new weights (as AReaL does; stale KV would not be "the new weights");
training packs each micro-batch into one row of <= 512 tokens (block-diagonal mask: the same loss as
padded rows, measured to 3e-8 in the parameters, ~40% less time), so decode steps rather than padding
dominate a step. Configurations run interleaved, the order rotated per repeat, 3 repeats; tokens_per_s are
medians, and every ratio is the median over repeats of the ratio within one repeat (a shared host drifts).

Why it is fair: every configuration trains the same number of steps of the same global batch size; a
sample has the same global id, so the same seed and length, in every deployment (colocated rank r's
local group g is global group (g // gps) * 2 gps + r gps + g % gps); regenerated groups take fresh ids,
so a run that regenerates trains a slightly different set of lengths; regenerated work counts in the wall
time; tokens_per_s counts trained response tokens only, over the slowest rank's wall time, so the long
tail a stale run still holds in flight at its end is not credited to it (a conservative bias).

Targets on a tail with max/mean >= 4: stale_over_sync_colocated >= 1.5 and
colocated_stale_over_separated_sync >= 2.5 (both at S = 1). Measured on this 2-vCPU machine (README) the
first lands at 1.37 to 1.5 from run to run, against a ceiling of about 1.61, and the second at 1.55 to
1.68 (2.4 to 2.5 at S = 4; at S = 1 it is < 2 by construction, below); the JSON carries the figures that say why:
  decode_steps_sync_over_stale_colocated  the mechanism in device-independent units (critical-path decode
      steps, per round the max over ranks). At S = 1 every group has at most 2 rounds (batch k must take
      the groups started at version k - 1), so d_(k-1) + d_k >= the longest sample started in round k - 1
      and the gain is < 2 (simulating this scheduler: 1.58 at 16 steps, 1.64 at 32, 1.77 at 64).
  colocated_stale_over_separated_sync  < 2 at S = 1 on 2 ranks, on any device whose decode step costs
      a + b x rows (a: the fixed cost, ~0.9 ms here, the weight read on a GPU; b ~0.02 to 0.04 ms here).
      Per optimizer step, with D critical-path decode steps, N tokens decoded per rank and T one rank's
      training: colocated sync costs a D + b N + T; separated sync a D + 2 b N + 2 T (one rank decodes,
      one trains, the whole batch each); colocated S = 1 at least a D / x + b N + T, x < 2 the decode-step
      gain. Staleness divides only the a D term and separation doubles only the others, so the ratio is
      < max(x, 2) = 2 for any a, b, D, N, T, plus the separated weight transfer over a stale step (~0.5 ms
      over ~120 ms here): 2.5 at S = 1 cannot be reached with 2 ranks. Its x = 1 case, separated sync over
      colocated sync, is 1.09 to 1.14 here (latency-bound) and 1.8 in bench/fusion.py (compute-bound).
      colocated_over_separated_sync_by_S gives S = 2, 4 too: x grows with S, but see the next point.
  stale_over_sync_colocated_by_S  a larger S with its pool at capacity cuts critical-path decode steps
      2.5x (S = 2) to 4x (S = 4), the wall clock far less: training is a fixed share of every step, and
      each critical-path step costs more, since the pool keeps (S + 1) x the rows alive (wider KV caches
      too) and re-prefills every in-flight prefix under the new weights each round (in length buckets:
      model._prefill).
  stale_over_sync_colocated_ceiling_by_S  what the decode-step gain alone would give: the sync step with its
      rollout divided by that gain and its training unchanged; the gap to the measured ratio is the stale
      pool's extra cost per step, its re-prefills and its waits.
  concurrent_decode_slowdown  how much slower a rank decodes while the other rank is busy (x0.9 to x1.5 here,
      depending on the day; x1.0 on 2026-11-30):
      the two vCPUs are not independent devices, so a synchronous rank's idle time partly speeds up its
      busy peer, and every idle-removal gain of StaleSync is shrunk by up to that factor.
  Also: decode is nearly flat in the batch on these cores, less so in the KV width (2 rows x 32 columns
  0.8 ms per step, 8 x 272 1.1 ms, 40 x 64 1.4 ms, 40 x 272 2.1 ms), and a stale pool keeps more rows, and
  longer ones, alive than a synchronous tail does.
The last line printed is one JSON object.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere
from model import Sampler  # noqa: E402


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
        # cached per run: a draw costs ~20 us, and a stale run asks for each row's length at every chunk
        self.length_of = functools.lru_cache(maxsize=None)(length_of)

    def budget(self, seeds, n_done):
        return torch.tensor([self.length_of(s) for s in seeds.tolist()]) - n_done


def train_step(model, opt, batch, group, micro_rows, pack_tokens=0):
    """One GRPO-shaped optimizer step on a batch: forward/backward in length-sorted micro-batches,
    gradients all-reduced over `group` (None: no peers). pack_tokens > 0: each micro-batch is instead
    one packed row of up to pack_tokens tokens (block-diagonal causal mask, positions restart per
    sample), so no FLOP goes to padding; the loss is the same."""
    import torch.distributed as dist
    from model import token_logprobs
    order = sorted(range(len(batch.ids)), key=lambda i: len(batch.prompts[i]) + len(batch.responses[i]))
    n_tok = sum(len(r) for r in batch.responses)
    adv = torch.randn(len(batch.ids), generator=torch.Generator().manual_seed(batch.version))
    micro, cur, used = [], [], 0
    for i in order:  # micro-batches: micro_rows rows, or rows packed up to pack_tokens tokens
        n = len(batch.prompts[i]) + len(batch.responses[i])
        if cur and (len(cur) == micro_rows if pack_tokens <= 0 else used + n > pack_tokens):
            micro, cur, used = micro + [cur], [], 0
        cur, used = cur + [i], used + n
    for mb in micro + [cur]:
        seqs = [torch.cat([batch.prompts[i], batch.responses[i]]) for i in mb]
        if pack_tokens > 0:  # one row (1, N): sample b occupies [s_b, s_b + T_b)
            tokens = torch.cat(seqs)[None]                                                   # (1, N)
            doc = torch.cat([torch.full((len(x),), b) for b, x in enumerate(seqs)])          # (N,)
            pos = torch.cat([torch.arange(len(x)) for x in seqs])[None]                      # (1, N)
            attn = (doc[:, None] == doc[None]) & (pos[0][:, None] >= pos[0][None])           # (N, N)
            logits = model(tokens, pos, attn[None, None])[0, :-1]                            # (N-1, V)
            lp = token_logprobs(logits[None], tokens[:, 1:])[0]                              # (N-1,)
            mask, old, a = torch.zeros(len(lp)), torch.zeros(len(lp)), torch.zeros(len(lp))
            s0 = 0
            for b, i in enumerate(mb):  # response token t of sample b is predicted at s_b + P_b - 1 + t
                P, R = len(batch.prompts[i]), len(batch.responses[i])
                mask[s0 + P - 1:s0 + P + R - 1], old[s0 + P - 1:s0 + P + R - 1], a[s0 + P - 1:s0 + P + R - 1] = 1, batch.logprobs[i], adv[i]
                s0 += P + R
        else:              # padded rows (b, T)
            T = max(len(x) for x in seqs)
            tokens, mask, old = torch.zeros(len(mb), T, dtype=torch.long), torch.zeros(len(mb), T - 1), torch.zeros(len(mb), T - 1)
            for b, (i, x) in enumerate(zip(mb, seqs)):
                P, R = len(batch.prompts[i]), len(batch.responses[i])
                tokens[b, :P + R] = x
                mask[b, P - 1:P + R - 1], old[b, P - 1:P + R - 1] = 1, batch.logprobs[i]
            lp = token_logprobs(model(tokens[:, :-1]), tokens[:, 1:])                            # (b, T-1)
            a = adv[mb, None]
        ratio = torch.exp(torch.clamp(lp - old, -20, 20))
        (-(torch.min(ratio * a, ratio.clamp(0.8, 1.2) * a) * mask).sum() / n_tok).backward()
    if group is not None:  # one flat all-reduce of the gradients
        grads = [p.grad for p in model.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        torch.nn.utils.vector_to_parameters(flat / dist.get_world_size(group), grads)
    opt.step()
    opt.zero_grad(set_to_none=False)


def run_config(rank, args, S, deploy, length_of):
    import torch.distributed as dist
    from model import ModelConfig, Policy
    from stalesync import Spans, StaleConfig, StaleSync
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

    def global_id(i):  # this rank's sample i -> its id in the global batch sequence: the same sample (so the
        g, j = divmod(i, args.group_size)  # same length) in every deployment; regenerated groups take new ids
        return ((g // gps) * gps * W + rank * gps + g % gps) * args.group_size + j

    sched = StaleSync(cfg, decoder, lambda: torch.as_tensor(rng.integers(4, 14, args.prompt_len)), seed_fn=global_id)
    spans, tokens, ages, round_steps = Spans(), 0, [], []
    dist.barrier()
    t0 = time.perf_counter()
    flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    if deploy == "colocated":
        posted = []  # the not-ready flags still in flight: (work, tensor)

        def all_ready(mine):  # the round ends when every rank is ready; until then a ready rank keeps decoding
            flag = torch.tensor([float(mine)])
            if not mine:  # the MIN is 0 whatever the peers say: post the flag and go on decoding, no wait
                posted.append((dist.all_reduce(flag, op=dist.ReduceOp.MIN, async_op=True), flag))
                return False
            with spans("idle"):  # a ready rank waits for the answer: idle (nested in "rollout")
                dist.all_reduce(flag, op=dist.ReduceOp.MIN)
                for work, _ in posted:  # matched by now (collectives pair up in order): surface any error
                    work.wait()
            posted.clear()
            return bool(flag.item())

        for _ in range(args.steps):
            s0 = decoder.steps
            b = sched.rollout(spans, all_ready if args.collective else None)
            round_steps.append(decoder.steps - s0)
            with spans("idle"):
                dist.barrier()
            with spans("train"):
                train_step(model, opt, b, None if dist.get_world_size() == 1 else dist.group.WORLD, args.micro, args.pack)
            sched.update()  # drops the sampler's KV cache too
            tokens, ages = tokens + b.metrics["rollout/response_tokens"], ages + [b.metrics]
    elif rank == 0:  # separated: the generator
        got, pending, n_sent = threading.Event(), [], 0

        def listen(v):  # gloo's is_completed() does not poll: a thread waits and flags
            dist.irecv(flat, 1, tag=2 * v + 1).wait()
            got.set()

        def new_weights():  # between decode chunks: load, drop the KV cache, version + 1
            waiter.join(), got.clear()
            torch.nn.utils.vector_to_parameters(flat.clone(), model.parameters())  # flat is the recv buffer
            sched.update()  # drops the sampler's KV cache too
            return start_listen(sched.version + 1)

        def start_listen(v):
            t = threading.Thread(target=listen, args=(v,))
            if v < args.steps:  # the trainer sends versions 1 .. steps - 1
                t.start()
            return t

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
            [w.wait() for w in works]
    else:  # separated: the trainer
        from stalesync import Batch
        B = gps * args.group_size
        for v in range(args.steps):
            head = torch.zeros(B, 2, dtype=torch.long)
            with spans("idle"):
                dist.recv(head, 0, tag=2 * v)
                payload, lps = torch.zeros(int(head.sum()), dtype=torch.long), torch.zeros(int(head[:, 1].sum()))
                dist.recv(payload, 0, tag=2 * v), dist.recv(lps, 0, tag=2 * v)
            seqs, lp = payload.split(head.sum(1).tolist()), lps.split(head[:, 1].tolist())
            b = Batch(v, list(range(B)), [s[:p] for s, (p, _) in zip(seqs, head.tolist())],
                      [s[p:] for s, (p, _) in zip(seqs, head.tolist())], list(lp), [], [], [], {})
            with spans("train"):
                train_step(model, opt, b, None, args.micro, args.pack)
            tokens += int(head[:, 1].sum())
            if v + 1 < args.steps:
                flat.copy_(torch.nn.utils.parameters_to_vector(model.parameters()).detach())
                dist.send(flat, 0, tag=2 * (v + 1) + 1)
    wall = torch.tensor([time.perf_counter() - t0, tokens], dtype=torch.float64)
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


def concurrency_probe(rank, n_steps=150, rows=8):
    """ms per decode step of `rows` rows when this rank decodes alone (the peer blocked in a recv) and when
    both ranks decode at once. Real devices do not slow each other; CPU cores sharing a host can, and then
    a synchronous rank's idle time is partly recovered by its busy peer, which shrinks every idle-removal gain."""
    import torch.distributed as dist
    from model import KVCache, ModelConfig, Policy
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
    import torch.distributed as dist
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


def main():
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
