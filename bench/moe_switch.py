"""Benchmark the EP switch of moe_switch.py: bytes moved vs the minimum, peak memory, time vs a plain send;
and the rollout engine's decode at each inference EP degree.

    python bench/moe_switch.py            # 2 gloo processes, EP 2 -> 1 (rollout wants all experts local)
    python bench/moe_switch.py --pairs    # 4 gloo processes, every switch between EP 1, 2 and 4 (about 20 s)
    python bench/moe_switch.py --decode   # 4 gloo processes, the same rollout at EP 1, 2 and 4 (about 10 s)

Default mode: 8 experts of 3 x 1024 x 1024 fp32, 16 MiB buckets. Each rank starts with its train-layout slices,
then `reshard` moves them to the inference layout. Timed from a barrier to the last rank done; the median of
--repeats. For scale, the same run times one point-to-point send of bytes_moved bytes (p2p_bound_s) right after
each switch, and the naive all-reduce-everything switch. The last line printed is one JSON object. Targets:
bytes_moved == bytes_min, peak_extra_bytes <= bucket_bytes, switch_over_bound (the median over the repeats of
switch time / bound time, each pair a moment apart) <= 2.

Pairs mode (--pairs, world 4 unless --world says otherwise): 8 experts of 3 x 512 x 512 fp32 (3 MiB each, the
dense MoE 24 MiB), 4 MiB buckets, every ordered pair of EP degrees that divide the world and E (at world 4:
1->2, 2->1, 1->4, 4->1, 2->4, 4->2). Per pair: bytes moved (received; the largest rank's and the sum) against
the minimum (stats['bytes_min']: only the experts whose owner changes), the largest rank's bytes sent, peak
extra memory (stats['peak_extra_bytes'], largest rank) against one bucket, rounds, and the switch time (barrier
to slowest rank, median of --repeats) against its bound, switch_over_bound the median of the repeats' ratios.
  The bound replays the switch's own transfers: a warm-up records every (peer, bytes) of its batch_isend_irecv
  calls, and the bound sends the same bytes between the same pairs of ranks as one batch_isend_irecv, one
  message per (src, dst): the switch without buckets and per-slice messages, all at once. Not one p2p send of
  the largest rank's bytes: at world 4 several pairs move at once and a receiver takes from more than one
  sender, and on 2 cores all of them share the CPU that copies loopback bytes; a lone send would charge the
  switch for contention that its transfer pattern itself implies.
  A switch that moves nothing is timed as is, its bound "none moved". Every switch is checked: each rank's
  slices torch.equal the dense experts the target layout gives it, and so after the way back (a bit-identical
  round trip); a mismatch stops the run. Each layout's expert bytes per rank are printed too: what EP buys.
  Each repeat runs both directions of a pair, then both bounds. The last line printed is one JSON object: one
  entry per pair ("4->1": {...}), "layouts" and "settings".

What the EP-outer rank order implies. EPLayout's rank grid is arange(W).view(P, W // P): rank r owns expert
block r // (W // P), a block's replicas are adjacent. With degrees that divide each other, a rank's block at the
higher degree lies inside its block at the lower one. So a switch to a higher degree nests and moves nothing:
each rank keeps part of what it holds and frees the rest. A switch to a lower degree only receives, into the
target: each rank keeps its whole block and receives the rest of its new one; what it sends are slices it keeps,
so it frees nothing. At peak a rank holds
the larger of its two layouts: going up, the source on entry (the first step frees it down to the target);
going down, the target, as the receives land in their final storage and no sent slice waits to be freed. So
the peak extra should be 0 for all six pairs, within the one bucket that reshard allows.

Decode mode (--decode, world 4 unless --world says otherwise, 1 thread per process): the rollout engine,
model.Policy at train_grpo.py's default sizes (vocab 14, D 64, 2 layers, 4 heads, E 4, top-2, expert width 128,
96 positions), built from one seed on every rank, samples the same work under each expert layout: 64 prompts
(task.make_prompts(np.random.default_rng(0), 64, 32), 16 per rank), prompt i with counter seed 1000 + i,
temperature 1, at most 40 new tokens, stopping at task.EOS; one Sampler(keep=False) call per rank. Engines: the
dense model.MoE (the baseline), and moe_switch.EPMoE (EPMoE.from_dense under EPLayout(P, W, E), EP group from
new_groups) at P = 1 (routed, no all-to-all), 2 and 4; above 1 the EP group's ranks decode in lock-step
(options/lockstep.py's LockStep(group, "cpu", every=8)). Per engine:
  - wall time of the call, prefill + decode, barrier to the slowest rank, median of --repeats (3), the engines
    interleaved; response tokens (all ranks) and tokens per second;
  - per rank: decode forwards (Sampler.steps), dummy forwards of zero rows and agreements (LockStep's counts);
  - the tokens against the dense engine's: the rows that differ (the math is the same, but the dense engine runs
    every expert on every token and EPMoE routes, so rounding differs and could flip a rare sample) and the
    largest log-prob difference on the rows that agree; and whether every timed call repeated its tokens;
  - all_to_all_single bytes per decode forward of a rank (dummies included), from a first, untimed call that
    wraps dist.all_to_all_single (as pairs mode wraps batch_isend_irecv): what each rank sends to OTHER ranks,
    the counts exchange (int64) apart from the payload (rows), against the minimum counted from the routing:
    each (token, expert) assignment whose expert another rank owns, its row there and back (and, for scale,
    one row per (token, other rank), which a dispatch that summed a token's experts at their owner would send);
  - each rank's expert bytes during rollout, against EP 1's.
Decode at EP > 1 is slower here, by design of the setting: every MoE layer of every forward runs three
all-to-alls (counts, rows out, rows back) of a few KiB between processes that share 2 cores, and a rank out of
rows still runs dummy forwards until the next agreement. What EP buys is memory (each rank holds E / P experts),
not speed on 2 cores. The last line printed is one JSON object: one entry per engine ("dense", "ep1", "ep2",
"ep4"), "tokens_match" and "settings".

Shapes: W ranks, P EP degree, E experts, D d_model, H d_hidden; expert slices (D, H), (D, H), (H, D).
"""
import argparse
import contextlib
import copy
import datetime
import itertools
import json
import math
import multiprocessing as mp
import os
import queue
import socket
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere: moe_switch is one level up
import task  # noqa: E402
from model import ModelConfig, Policy, Sampler  # noqa: E402
from options.lockstep import LockStep, sampler_class  # noqa: E402
from moe_switch import EXPERT_NAMES, EPLayout, EPMoE, reshard, reshard_naive, route, shard_experts  # noqa: E402
from plumbing.moe_switch_details import new_groups  # noqa: E402

MIB = 2 ** 20
PG_TIMEOUT = datetime.timedelta(seconds=120)  # every process group's: a hung rank fails the run, not the machine
# decode mode: train_grpo.py's default model and task sizes (max_seq_len = 32 digits + 2 + 40 new tokens)
DECODE_MODEL = dict(vocab_size=task.VOCAB, d_model=64, n_layers=2, n_heads=4, n_experts=4, top_k=2, d_expert=128,
                    max_seq_len=96)
DECODE_MAX_DIGITS = 32
LOCKSTEP_EVERY = 8  # decode forwards between a lock-step group's agreements (train_grpo.py's --chunk-steps)
SEED0 = 1000  # prompt i samples with counter seed SEED0 + i, whichever rank and engine decode it


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed(fn, group=None):
    """Run fn on every rank after a barrier; seconds until the slowest rank is done, and fn's result."""
    dist.barrier(group)
    t0 = time.perf_counter()
    out = fn()
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=group)
    return dt.item(), out


def reduced(x, op=dist.ReduceOp.SUM):
    """A number all-reduced over the world (sum or max), as an int."""
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return int(t.item())


def dense_moe(args):
    """The dense MoE's expert tensors, the same on every rank: the reference every layout is checked against."""
    E, D, H = args.experts, args.d_model, args.d_hidden
    g = torch.Generator().manual_seed(0)
    return dict(w_gate=torch.randn(E, D, H, generator=g), w_up=torch.randn(E, D, H, generator=g),
                w_down=torch.randn(E, H, D, generator=g))  # (E, D, H), (E, D, H), (E, H, D)


def worker(rank, args, port, results):
    """Default mode: one switch, --from-ep -> --to-ep, its p2p bound and the naive switch."""
    torch.set_num_threads(1)  # processes x threads <= cores
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.world, timeout=PG_TIMEOUT)
    try:
        E, D, H, W = args.experts, args.d_model, args.d_hidden, args.world
        src, dst = EPLayout(args.from_ep, W, E), EPLayout(args.to_ep, W, E)
        bucket = int(args.bucket_mb * MIB)
        full = dense_moe(args)
        experts = shard_experts(full, src, rank)

        experts, stats = reshard(experts, src, dst, bucket)  # warm-up pair, and the size of the p2p bound
        experts, _ = reshard(experts, dst, src, bucket)
        payload = torch.empty(max(reduced(stats["bytes_moved"]), 1), dtype=torch.uint8)  # bytes_moved, one send

        def p2p():
            return dist.send(payload, 1) if rank == 0 else dist.recv(payload, 0) if rank == 1 else None

        sw, back, bound = [], [], []
        for _ in range(args.repeats):  # interleaved, so that the machine's noise hits both alike
            dt, (experts, stats) = timed(lambda: reshard(experts, src, dst, bucket))
            db, (experts, back_stats) = timed(lambda: reshard(experts, dst, src, bucket))
            sw.append(dt), back.append(db), bound.append(timed(p2p)[0])
        assert all(torch.equal(experts[n][e], full[n][e]) for n in full for e in experts[n]), "round trip changed"
        moved, least = reduced(stats["bytes_moved"]), reduced(stats["bytes_min"])
        peak_extra = reduced(stats["peak_extra_bytes"], dist.ReduceOp.MAX)
        assert payload.numel() == moved
        del payload

        dn, (naive, nst) = timed(lambda: reshard_naive(shard_experts(full, src, rank), src, dst))
        del naive
        naive_moved = reduced(nst["bytes_moved"])
        if rank == 0:
            results.put(dict(
                bytes_moved=moved, bytes_min=least, peak_extra_bytes=peak_extra, bucket_bytes=bucket,
                switch_s=round(statistics.median(sw), 4), p2p_bound_s=round(statistics.median(bound), 4),
                switch_back_s=round(statistics.median(back), 4), rounds=stats["rounds"],
                # within each repeat, the switch and its bound ran a moment apart: the host's drift cancels
                switch_over_bound=round(statistics.median(a / b for a, b in zip(sw, bound)), 3),
                from_bytes=stats["from_bytes"], to_bytes=stats["to_bytes"], peak_bytes=stats["peak_bytes"],
                peak_switch_bytes=stats["peak_switch_bytes"], back_to_bytes=back_stats["to_bytes"],
                back_peak_switch_bytes=back_stats["peak_switch_bytes"],
                naive_bytes_moved=naive_moved, naive_peak_bytes=nst["peak_bytes"],
                naive_switch_s=round(dn, 4), world=W, from_ep=args.from_ep, to_ep=args.to_ep,
                experts=E, d_model=D, d_hidden=H))
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- pairs mode: primitives
@contextlib.contextmanager
def recorded_p2p(log):
    """While open, every batch_isend_irecv call appends ("send" or "recv", global peer, bytes) per op to log.
    moe_switch calls it as dist.batch_isend_irecv, so this sees the switch's transfers as made."""
    real = dist.batch_isend_irecv

    def spy(ops):
        log.extend(("send" if op.op is dist.isend else "recv", op.peer, op.tensor.nbytes) for op in ops)
        return real(ops)

    dist.batch_isend_irecv = spy
    try:
        yield log
    finally:
        dist.batch_isend_irecv = real


def bound_buffers(log):
    """A switch's recorded transfers -> the bound's messages: one uint8 buffer per (peer, direction)."""
    out, inn = Counter(), Counter()  # peer -> bytes this rank sends it / receives from it
    for kind, peer, nb in log:
        (out if kind == "send" else inn)[peer] += nb
    return ({p: torch.zeros(nb, dtype=torch.uint8) for p, nb in out.items()},   # (bytes,) per peer
            {p: torch.empty(nb, dtype=torch.uint8) for p, nb in inn.items()})


def plain_send(out, inn):
    """The bound: the same bytes between the same ranks, one message per (src, dst), one batch."""
    ops = [dist.P2POp(dist.isend, buf, p) for p, buf in out.items()]
    ops += [dist.P2POp(dist.irecv, buf, p) for p, buf in inn.items()]
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()


def check_exact(experts, full, layout, rank, what):
    """Every rank's slices must be exactly the dense experts `layout` gives it; raises on every rank if not."""
    want = list(layout.owned(rank))
    ok = all(list(experts[n]) == want and all(torch.equal(experts[n][e], full[n][e]) for e in want) for n in full)
    bad = torch.tensor([0 if ok else 1 << rank], dtype=torch.int64)  # a bit per failing rank
    dist.all_reduce(bad)
    if bad.item():
        failed = [r for r in range(dist.get_world_size()) if bad.item() >> r & 1]
        raise AssertionError(f"{what}: ranks {failed} do not hold exactly the dense experts of {layout}")


# ----------------------------------------------------------------------------- pairs mode: the measurement
def summarize(stats, log, times, bucket):
    """One leg's row (collective: every rank calls it, in the same order)."""
    sw, bound = times  # seconds per repeat: the switch, its bound
    recv = sum(nb for kind, _, nb in log if kind == "recv")
    if recv != stats["bytes_moved"]:
        raise AssertionError(f"recorded {recv} bytes received, reshard says {stats['bytes_moved']}: the "
                             "recording missed the switch's transfers, so the bound would be wrong")
    row = dict(
        bytes_moved_max=reduced(recv, dist.ReduceOp.MAX), bytes_moved_total=reduced(recv),
        bytes_min_max=reduced(stats["bytes_min"], dist.ReduceOp.MAX), bytes_min_total=reduced(stats["bytes_min"]),
        bytes_sent_max=reduced(sum(nb for kind, _, nb in log if kind == "send"), dist.ReduceOp.MAX),
        peak_extra_bytes=reduced(stats["peak_extra_bytes"], dist.ReduceOp.MAX),
        peak_bytes=reduced(stats["peak_bytes"], dist.ReduceOp.MAX), bucket_bytes=bucket, rounds=stats["rounds"],
        from_bytes=stats["from_bytes"], to_bytes=stats["to_bytes"], switch_s=round(statistics.median(sw), 4))
    if row["bytes_moved_total"]:
        row.update(bound_s=round(statistics.median(bound), 4),
                   switch_over_bound=round(statistics.median(a / b for a, b in zip(sw, bound)), 3))
    else:
        row.update(bound_s="none moved", switch_over_bound=None)
    return row


def switch_pair(experts, full, a, b, rank, args):
    """Both legs between EP degrees a and b, starting from layout a's `experts`: a warm-up round trip that
    records each leg's transfers, then --repeats of (a -> b, b -> a, bound a -> b, bound b -> a).
    Returns (layout a's experts again, {(a, b): row, (b, a): row})."""
    lay, bucket = {p: EPLayout(p, args.world, args.experts) for p in (a, b)}, int(args.bucket_mb * MIB)
    legs = [(a, b), (b, a)]
    logs, stats, bufs = {leg: [] for leg in legs}, {}, {}
    for s, d in legs:  # warm-up
        with recorded_p2p(logs[(s, d)]):
            experts, stats[(s, d)] = reshard(experts, lay[s], lay[d], bucket)
        check_exact(experts, full, lay[d], rank, f"warm-up EP {s} -> {d}")
        bufs[(s, d)] = bound_buffers(logs[(s, d)])
        plain_send(*bufs[(s, d)])  # the bound's warm-up
    times = {leg: ([], []) for leg in legs}  # leg -> (switch seconds, bound seconds), one per repeat
    for _ in range(args.repeats):  # interleaved, so that the machine's noise hits the switch and bound alike
        for s, d in legs:
            dt, (experts, stats[(s, d)]) = timed(lambda: reshard(experts, lay[s], lay[d], bucket))
            check_exact(experts, full, lay[d], rank, f"EP {s} -> {d}" + (" (round trip)" if s == b else ""))
            times[(s, d)][0].append(dt)
        for leg in legs:
            times[leg][1].append(timed(lambda: plain_send(*bufs[leg]))[0])
    return experts, {leg: summarize(stats[leg], logs[leg], times[leg], bucket) for leg in legs}


def pairs_worker(rank, args, port, results):
    """Pairs mode: every ordered pair of EP degrees at args.world, each leg checked exact."""
    torch.set_num_threads(1)  # processes x threads <= cores
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.world, timeout=PG_TIMEOUT)
    try:
        W, E = args.world, args.experts
        degrees = [p for p in range(1, W + 1) if W % p == 0 and E % p == 0]  # at W 4, E 8: 1, 2, 4
        full, rows = dense_moe(args), {}
        for a, b in itertools.combinations(degrees, 2):
            experts = shard_experts(full, EPLayout(a, W, E), rank)
            experts, legs = switch_pair(experts, full, a, b, rank, args)
            del experts
            rows.update({f"{s}->{d}": row for (s, d), row in legs.items()})
        if rank == 0:
            slice_bytes = sum(t[0].nbytes for t in full.values())  # one expert's 3 tensors
            layouts = {f"ep{p}": dict(expert_bytes_per_rank=E // p * slice_bytes) for p in degrees}
            settings = dict(world=W, experts=E, d_model=args.d_model, d_hidden=args.d_hidden,
                            bucket_bytes=int(args.bucket_mb * MIB), repeats=args.repeats, dtype="float32")
            results.put(dict(rows, layouts=layouts, settings=settings))
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- decode mode: primitives
class A2ARecorder:
    """What an engine's forwards send, on this rank. While installed: each all_to_all_single's bytes to OTHER
    ranks of its group (int64 rows: the counts exchange; float rows: the payload, there and back), and per EP
    layer forward the (token, expert) assignments whose expert another rank owns: the minimum, as only those
    rows must cross, there and back. Keys are namespaced by the Policy forward under way, "decode/..." (one
    token per row, or a dummy forward of zero rows) or "prefill/..."; a peer's extra prefill bucket, run here
    as a dummy (0, 1) forward, counts as decode (the default work has none: each rank's 16 prompts make one
    length bucket, prefill_forwards in the JSON)."""

    def __init__(self):
        self.tally, self.phase = Counter(), "prefill"

    def on_forward(self, policy, args):  # Policy forward pre-hook: tokens (B, T)
        self.phase = "decode" if args[0].shape[1] == 1 else "prefill"
        self.tally[f"{self.phase}/forwards"] += 1

    def on_moe(self, moe, args):  # EPMoE forward pre-hook: x (B, T, D); the router again, a tiny (N, E) matmul
        x, L = args[0].reshape(-1, args[0].shape[-1]), moe.layout.n_experts // moe.layout.ep  # (N, D)
        _, top_e = route(x, moe.router.weight, moe.top_k)                    # (N, k) as the layer will choose
        block, mine = top_e // L, moe.layout.owned(moe.rank)[0] // L        # (N, k) owner's block; this rank's
        remote = int((block != mine).sum())                                   # assignments another rank serves
        hit = torch.zeros(len(x), moe.layout.ep, dtype=torch.bool).scatter_(1, block, True)  # (N, P) blocks used
        hit[:, mine] = False
        row = x.shape[1] * x.element_size()
        self.tally[f"{self.phase}/remote_assignments"] += remote
        # this rank's rows go out, its owners send them back: summed over ranks, every crossing both ways
        self.tally[f"{self.phase}/min_payload_bytes"] += 2 * remote * row
        # for scale: one row per (token, other rank), its experts' outputs summed there (not what EPMoE does)
        self.tally[f"{self.phase}/dedup_payload_bytes"] += 2 * int(hit.sum()) * row

    def spy(self, real):
        def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                              async_op=False):
            me, n = dist.get_rank(group), dist.get_world_size(group)
            splits = input_split_sizes or [input.shape[0] // n] * n
            row = input.element_size() * math.prod(input.shape[1:])  # bytes of one row (one count: 8)
            kind = "payload" if input.is_floating_point() else "counts"
            self.tally[f"{self.phase}/{kind}_bytes"] += row * sum(s for j, s in enumerate(splits) if j != me)
            self.tally[f"{self.phase}/{kind}_calls"] += 1
            return real(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
        return all_to_all_single

    @contextlib.contextmanager
    def installed(self, engine):
        """moe_switch calls it as dist.all_to_all_single, so the spy sees the EP layers' all-to-alls as made."""
        real, hooks = dist.all_to_all_single, [engine.register_forward_pre_hook(self.on_forward)]
        hooks += [m.register_forward_pre_hook(self.on_moe) for m in engine.modules() if isinstance(m, EPMoE)]
        dist.all_to_all_single = self.spy(real)
        try:
            yield self.tally
        finally:
            dist.all_to_all_single = real
            for h in hooks:
                h.remove()


def expert_bytes(engine):
    """Bytes of the expert weights this rank holds: a dense MoE's stacks, or an EPMoE's owned slices."""
    names = {f"moe.{x}" for x in EXPERT_NAMES}  # blocks.<i>.moe.w_gate (dense), blocks.<i>.moe.w_gate.<e> (EP)
    return sum(p.nbytes for n, p in engine.named_parameters() if ".".join(n.split(".")[2:4]) in names)


def decode_engines(args):
    """name -> (engine, EP degree, lock-step group or None): the dense engine (model.MoE), then EPMoE at each
    degree that divides the world and E. Every rank builds them from the same seed, in the same order
    (new_groups is collective). A group of one needs no lock-step: nothing waits on a peer."""
    torch.manual_seed(0)  # the same weights on every rank
    dense = Policy(ModelConfig(**DECODE_MODEL)).eval().requires_grad_(False)
    engines, E = {"dense": (dense, 1, None)}, DECODE_MODEL["n_experts"]
    for P in (p for p in range(1, args.world + 1) if args.world % p == 0 and E % p == 0):
        layout = EPLayout(P, args.world, E)
        group = new_groups(layout, PG_TIMEOUT.total_seconds())[0]
        engine = copy.deepcopy(dense)
        for block in engine.blocks:
            block.moe = EPMoE.from_dense(block.moe, layout, group)            # this rank's E / P experts
        engines[f"ep{P}"] = (engine.requires_grad_(False), P, group if P > 1 else None)
    return engines


def decode_runs(engines, contexts, seeds, args):
    """Each engine samples this rank's prompts 1 + --repeats times, the engines interleaved so that the machine's
    noise hits them alike. The first call warms up and is recorded (A2ARecorder); the timed ones run without
    hooks. Collective. Returns name -> this rank's record."""
    recs = {}
    for rep in range(1 + args.repeats):
        for name, (engine, P, group) in engines.items():
            lockstep = None if group is None else LockStep(group, "cpu", every=LOCKSTEP_EVERY)
            make = Sampler if lockstep is None else sampler_class(Sampler, lockstep)
            sampler = make(engine, args.max_new_tokens, task.EOS, task.PAD, temperature=1.0, keep=False)
            recorder = A2ARecorder()
            with recorder.installed(engine) if rep == 0 else contextlib.nullcontext():
                dt, out = timed(lambda: sampler(contexts, seeds))  # prefill + decode, barrier to slowest rank
            tokens = [t.tolist() for t in out.tokens]
            if rep == 0:
                recs[name] = dict(
                    ep=P, tokens=tokens, logprobs=[lp.tolist() for lp in out.logprobs], wall_s=[],
                    steps=sampler.steps, dummy_forwards=lockstep.dummy_forwards if lockstep else 0,
                    agreements=lockstep.agreements if lockstep else 0, tally=dict(recorder.tally),
                    expert_bytes=expert_bytes(engine), same_tokens_each_run=True)
            else:
                recs[name]["wall_s"].append(dt)
                recs[name]["same_tokens_each_run"] &= tokens == recs[name]["tokens"]
    return recs


def decode_worker(rank, args, port, results):
    """Decode mode: the same prompts and seeds, decoded by the dense engine and at each EP degree."""
    torch.set_num_threads(1)  # processes x threads <= cores
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.world, timeout=PG_TIMEOUT)
    try:
        if args.prompts % args.world:
            raise ValueError(f"--prompts {args.prompts} must split evenly over --world {args.world}")
        engines = decode_engines(args)
        prompts = task.make_prompts(np.random.default_rng(0), args.prompts, DECODE_MAX_DIGITS)  # n x (P_i,)
        share = args.prompts // args.world
        mine = range(rank * share, (rank + 1) * share)
        seeds = torch.tensor([SEED0 + i for i in mine])  # counter seeds: sample i's draws hash (SEED0 + i, position)
        recs = decode_runs(engines, [prompts[i] for i in mine], seeds, args)
        every = [None] * args.world
        dist.all_gather_object(every, recs)  # per rank, name -> record
        if rank == 0:
            rows = {name: decode_row(name, [r[name] for r in every], [r["dense"] for r in every]) for name in recs}
            settings = dict(world=args.world, prompts=args.prompts, prompts_per_rank=share,
                            max_digits=DECODE_MAX_DIGITS, max_new_tokens=args.max_new_tokens, temperature=1.0,
                            lockstep_every=LOCKSTEP_EVERY, repeats=args.repeats, model=DECODE_MODEL, baseline="dense",
                            dtype="float32")
            results.put(dict(rows, tokens_match=all(r["rows_differ_vs_dense"] == 0 for r in rows.values()),
                             settings=settings))
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- decode mode: the figures
def a2a_figures(tally, forwards):
    """The summed tally -> per decode forward of one rank (bytes to other ranks), and the prefill's totals."""
    per = {k: round(tally[f"decode/{k}"] / max(forwards, 1), 1) for k in
           ("counts_bytes", "payload_bytes", "min_payload_bytes", "dedup_payload_bytes", "counts_calls",
            "payload_calls")}
    return dict(**{f"a2a_{k}_per_decode_fwd": v for k, v in per.items()},
                payload_is_min=tally["decode/payload_bytes"] == tally["decode/min_payload_bytes"]
                and tally["prefill/payload_bytes"] == tally["prefill/min_payload_bytes"],
                decode_remote_assignments=tally["decode/remote_assignments"],
                prefill_counts_bytes=tally["prefill/counts_bytes"],
                prefill_payload_bytes=tally["prefill/payload_bytes"],
                prefill_min_payload_bytes=tally["prefill/min_payload_bytes"])


def decode_row(name, recs, base):
    """One engine's row from every rank's record (recs, rank order) against the dense engine's (base)."""
    tokens, want = [t for r in recs for t in r["tokens"]], [t for r in base for t in r["tokens"]]  # prompt order
    lps, want_lps = [x for r in recs for x in r["logprobs"]], [x for r in base for x in r["logprobs"]]
    same = [a == b for a, b in zip(tokens, want)]
    lp_diff = max((abs(x - y) for a, b, s in zip(lps, want_lps, same) if s for x, y in zip(a, b)), default=0.0)
    tally = sum((Counter(r["tally"]) for r in recs), Counter())  # over ranks
    forwards = [r["tally"].get("decode/forwards", 0) for r in recs]  # decode forwards run, dummies included
    wall, n_tok = statistics.median(recs[0]["wall_s"]), sum(map(len, tokens))
    return dict(
        ep=recs[0]["ep"], engine="model.MoE (dense, baseline)" if name == "dense" else "moe_switch.EPMoE",
        wall_s=round(wall, 4), wall_s_repeats=[round(w, 4) for w in recs[0]["wall_s"]], response_tokens=n_tok,
        tokens_per_s=round(n_tok / wall, 1), decode_forwards=[r["steps"] for r in recs],
        dummy_forwards=[r["dummy_forwards"] for r in recs], agreements=[r["agreements"] for r in recs],
        lockstep_forwards=forwards, prefill_forwards=[r["tally"].get("prefill/forwards", 0) for r in recs],
        **a2a_figures(tally, sum(forwards)),
        expert_bytes_per_rank=[r["expert_bytes"] for r in recs],
        expert_bytes_vs_ep1=round(max(r["expert_bytes"] for r in recs) / base[0]["expert_bytes"], 3),
        rows_differ_vs_dense=same.count(False), max_logprob_diff_same_rows=lp_diff,
        same_tokens_each_run=all(r["same_tokens_each_run"] for r in recs))


def print_decode(res):
    st, rows = res["settings"], {k: v for k, v in res.items() if isinstance(v, dict) and "ep" in v}
    print(f"decode at world {st['world']} (gloo, 1 thread each): {st['prompts']} prompts ({st['prompts_per_rank']} "
          f"per rank), temperature 1, counter seeds, <= {st['max_new_tokens']} new tokens, median of "
          f"{st['repeats']} repeats; baseline: the dense engine (model.MoE)")
    print(f"{'engine':<7}{'EP':>3}{'wall s':>8}{'tokens':>7}{'tok/s':>8}  {'decode fwd per rank':<20}"
          f"{'dummies':<13}{'agreements':<13}{'rows differ':>11}{'max dlogp':>10}")
    for k, r in rows.items():
        print(f"{k:<7}{r['ep']:>3}{r['wall_s']:>8.3f}{r['response_tokens']:>7}{r['tokens_per_s']:>8.0f}  "
              f"{'/'.join(map(str, r['decode_forwards'])):<20}{'/'.join(map(str, r['dummy_forwards'])):<13}"
              f"{'/'.join(map(str, r['agreements'])):<13}{r['rows_differ_vs_dense']:>11}"
              f"{r['max_logprob_diff_same_rows']:>10.1e}")
    print("all_to_all bytes a rank sends to other ranks per decode forward (dummies included; min: the remote "
          "(token, expert) rows there and back; dedup: one row per (token, rank)), and expert weights")
    print(f"{'engine':<7}{'EP':>3}{'counts B':>10}{'payload B':>11}{'min B':>9}{'= min':>7}{'dedup B':>9}"
          f"{'a2a calls':>10}{'expert KiB/rank':>17}{'vs EP 1':>9}")
    for k, r in rows.items():
        calls = r["a2a_counts_calls_per_decode_fwd"] + r["a2a_payload_calls_per_decode_fwd"]
        print(f"{k:<7}{r['ep']:>3}{r['a2a_counts_bytes_per_decode_fwd']:>10.1f}"
              f"{r['a2a_payload_bytes_per_decode_fwd']:>11.1f}{r['a2a_min_payload_bytes_per_decode_fwd']:>9.1f}"
              f"{str(r['payload_is_min']):>7}{r['a2a_dedup_payload_bytes_per_decode_fwd']:>9.1f}{calls:>10.1f}"
              f"{max(r['expert_bytes_per_rank']) / 1024:>17.0f}"
              f"{r['expert_bytes_vs_ep1']:>9.2f}")
    print(f"tokens the same at every EP degree as the dense engine's: {res['tokens_match']}")


# ----------------------------------------------------------------------------- launch and report
def spawn(target, args):
    """target(rank, args, port, results) on args.world processes; rank 0's result. A failed rank ends the run."""
    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=target, args=(r, args, port, results)) for r in range(args.world)]
    for pr in procs:
        pr.start()
    res, deadline = None, time.monotonic() + 600
    while res is None and all(pr.exitcode in (None, 0) for pr in procs) and time.monotonic() < deadline:
        with contextlib.suppress(queue.Empty):
            res = results.get(timeout=1)
    for pr in procs:
        if res is None and pr.is_alive():  # a rank failed: the others may wait in a collective until the timeout
            pr.terminate()
        pr.join()
    if res is None or any(pr.exitcode for pr in procs):
        raise SystemExit(f"a rank failed: exit codes {[pr.exitcode for pr in procs]} (tracebacks above)")
    return res


def print_one(res):
    print(f"EP {res['from_ep']} -> {res['to_ep']} on {res['world']} gloo ranks, {res['experts']} experts of "
          f"3 x {res['d_model']} x {res['d_hidden']} fp32 ({3 * res['d_model'] * res['d_hidden'] * 4 / MIB:.0f} "
          f"MiB each)")
    print(f"bucketed : moved {res['bytes_moved'] / MIB:8.1f} MiB (min {res['bytes_min'] / MIB:.1f}) | "
          f"peak {res['peak_bytes'] / MIB:.1f} MiB/rank (source {res['from_bytes'] / MIB:.1f}, target "
          f"{res['to_bytes'] / MIB:.1f}, +{res['peak_extra_bytes'] / MIB:.1f} <= bucket "
          f"{res['bucket_bytes'] / MIB:.1f}) | {res['rounds']} rounds | {res['switch_s']:.3f} s "
          f"(back {res['switch_back_s']:.3f} s)")
    print(f"naive    : moved {res['naive_bytes_moved'] / MIB:8.1f} MiB | peak {res['naive_peak_bytes'] / MIB:.1f} "
          f"MiB/rank | {res['naive_switch_s']:.3f} s")
    print(f"p2p bound: one send of {res['bytes_moved'] / MIB:.1f} MiB in {res['p2p_bound_s']:.3f} s "
          f"-> switch / bound = {res['switch_over_bound']:.2f}, the median of the repeats' ratios (target <= 2)")


def print_pairs(res):
    st, pairs = res["settings"], {k: v for k, v in res.items() if "->" in k}
    print(f"every EP switch on {st['world']} gloo ranks, {st['experts']} experts of 3 x {st['d_model']} x "
          f"{st['d_hidden']} fp32, {st['bucket_bytes'] / MIB:g} MiB buckets, median of {st['repeats']} repeats")
    print("expert bytes per rank: " + " | ".join(
        f"EP {k[2:]} {v['expert_bytes_per_rank'] / MIB:.1f} MiB" for k, v in res["layouts"].items()))
    print("MiB: moved = received (max rank, total), min = owner changes, sent = max rank; bound = the same "
          "transfers as one batch")
    print(f"{'pair':<6}{'moved max':>10}{'total':>8}{'min max':>9}{'total':>8}{'sent max':>9}{'peak+':>7}"
          f"{'bucket':>7}{'rounds':>7}{'switch s':>10}{'bound s':>12}{'ratio':>7}")
    for k, r in pairs.items():
        bound = r["bound_s"] if isinstance(r["bound_s"], str) else f"{r['bound_s']:.4f}"
        ratio = "-" if r["switch_over_bound"] is None else f"{r['switch_over_bound']:.2f}"
        print(f"{k:<6}{r['bytes_moved_max'] / MIB:>10.1f}{r['bytes_moved_total'] / MIB:>8.1f}"
              f"{r['bytes_min_max'] / MIB:>9.1f}{r['bytes_min_total'] / MIB:>8.1f}{r['bytes_sent_max'] / MIB:>9.1f}"
              f"{r['peak_extra_bytes'] / MIB:>7.1f}{r['bucket_bytes'] / MIB:>7.1f}{r['rounds']:>7}"
              f"{r['switch_s']:>10.4f}{bound:>12}{ratio:>7}")
    minimal = all(r["bytes_moved_max"] == r["bytes_min_max"] and r["bytes_moved_total"] == r["bytes_min_total"]
                  for r in pairs.values())
    within = all(r["peak_extra_bytes"] <= r["bucket_bytes"] for r in pairs.values())
    print(f"targets: moved == minimum on every pair {minimal}, peak extra <= one bucket on every pair {within}; "
          "every switch and round trip exact")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # mode
    modes = p.add_mutually_exclusive_group()
    modes.add_argument("--pairs", action="store_true", help="every ordered pair of EP degrees (default world 4)")
    modes.add_argument("--decode", action="store_true", help="the rollout engine's decode at every EP degree "
                       "(default world 4; train_grpo.py's model, not --experts/--d-model/--d-hidden)")
    # model: the expert tensors that move
    p.add_argument("--experts", type=int, default=8, help="number of experts E")
    p.add_argument("--d-model", type=int, default=None, help="model width D (default 1024; 512 with --pairs)")
    p.add_argument("--d-hidden", type=int, default=None, help="expert hidden width H (default 1024; 512 with --pairs)")
    # switch
    p.add_argument("--world", type=int, default=None, help="gloo processes (default 2; 4 with --pairs, --decode)")
    p.add_argument("--from-ep", type=int, default=2, help="EP degree before the switch (training; not --pairs)")
    p.add_argument("--to-ep", type=int, default=1, help="EP degree after the switch (rollout; not --pairs)")
    p.add_argument("--bucket-mb", type=float, default=None, help="bucket size in MiB (default 16; 4 with --pairs)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats, median reported (default 7; 3 "
                   "with --decode)")
    # decode
    p.add_argument("--prompts", type=int, default=64, help="--decode: prompts, split evenly over the ranks")
    p.add_argument("--max-new-tokens", type=int, default=40, help="--decode: response budget in tokens")
    args = p.parse_args()
    if args.decode:
        mode = dict(world=4, repeats=3)
    elif args.pairs:
        mode = dict(world=4, d_model=512, d_hidden=512, bucket_mb=4, repeats=7)
    else:
        mode = dict(world=2, d_model=1024, d_hidden=1024, bucket_mb=16, repeats=7)
    for k, v in mode.items():
        if getattr(args, k) is None:
            setattr(args, k, v)

    target, report = (decode_worker, print_decode) if args.decode else (pairs_worker, print_pairs) if args.pairs \
        else (worker, print_one)
    res = spawn(target, args)
    report(res)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
