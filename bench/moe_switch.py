"""Benchmark the EP switch of moe_switch.py: bytes moved vs the minimum, peak memory, time vs a plain send.

    python bench/moe_switch.py            # 2 gloo processes, EP 2 -> 1 (rollout wants all experts local)
    python bench/moe_switch.py --pairs    # 4 gloo processes, every switch between EP 1, 2 and 4 (about 20 s)

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

Shapes: W ranks, P EP degree, E experts, D d_model, H d_hidden; expert slices (D, H), (D, H), (H, D).
"""
import argparse
import contextlib
import datetime
import itertools
import json
import multiprocessing as mp
import os
import queue
import socket
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere: moe_switch is one level up
from moe_switch import EPLayout, reshard, reshard_naive, shard_experts  # noqa: E402

MIB = 2 ** 20
PG_TIMEOUT = datetime.timedelta(seconds=120)  # every process group's: a hung rank fails the run, not the machine


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
    p.add_argument("--pairs", action="store_true", help="every ordered pair of EP degrees (default world 4)")
    # model: the expert tensors that move
    p.add_argument("--experts", type=int, default=8, help="number of experts E")
    p.add_argument("--d-model", type=int, default=None, help="model width D (default 1024; 512 with --pairs)")
    p.add_argument("--d-hidden", type=int, default=None, help="expert hidden width H (default 1024; 512 with --pairs)")
    # switch
    p.add_argument("--world", type=int, default=None, help="gloo processes (default 2; 4 with --pairs)")
    p.add_argument("--from-ep", type=int, default=2, help="EP degree before the switch (training; not --pairs)")
    p.add_argument("--to-ep", type=int, default=1, help="EP degree after the switch (rollout; not --pairs)")
    p.add_argument("--bucket-mb", type=float, default=None, help="bucket size in MiB (default 16; 4 with --pairs)")
    p.add_argument("--repeats", type=int, default=7, help="timed repeats, median reported")
    args = p.parse_args()
    mode = dict(world=4, d_model=512, d_hidden=512, bucket_mb=4) if args.pairs else \
        dict(world=2, d_model=1024, d_hidden=1024, bucket_mb=16)
    for k, v in mode.items():
        if getattr(args, k) is None:
            setattr(args, k, v)

    res = spawn(pairs_worker if args.pairs else worker, args)
    (print_pairs if args.pairs else print_one)(res)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
