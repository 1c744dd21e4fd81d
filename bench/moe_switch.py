"""Benchmark the EP switch of moe_switch.py: bytes moved vs the minimum, peak memory, time vs one p2p send.

    python bench/moe_switch.py            # 2 gloo processes, EP 2 -> 1 (rollout wants all experts local)

Each rank starts with its train-layout slices, then `reshard` moves them to the inference layout. Timed
from a barrier to the last rank done; the median of --repeats. For scale, the same run times one
point-to-point send of bytes_moved bytes (p2p_bound_s) right after each switch, and the naive
all-reduce-everything switch. The last line printed is one JSON object. Targets: bytes_moved ==
bytes_min, peak_extra_bytes <= bucket_bytes, switch_over_bound (the median over the repeats of switch
time / bound time, each pair a moment apart) <= 2.
"""
import argparse
import datetime
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere: moe_switch is one level up


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed(fn, group=None):
    """Run fn on every rank after a barrier; seconds until the slowest rank is done, and fn's result."""
    import torch
    import torch.distributed as dist
    dist.barrier(group)
    t0 = time.perf_counter()
    out = fn()
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=group)
    return dt.item(), out


def worker(rank, args, port, results):
    import torch
    import torch.distributed as dist
    from moe_switch import EPLayout, reshard, reshard_naive, shard_experts

    torch.set_num_threads(1)  # processes x threads <= cores
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.world, timeout=datetime.timedelta(seconds=120))
    try:
        E, D, H, W = args.experts, args.d_model, args.d_hidden, args.world
        src, dst = EPLayout(args.from_ep, W, E), EPLayout(args.to_ep, W, E)
        bucket = int(args.bucket_mb * 2 ** 20)
        g = torch.Generator().manual_seed(0)
        full = dict(w_gate=torch.randn(E, D, H, generator=g), w_up=torch.randn(E, D, H, generator=g),
                    w_down=torch.randn(E, H, D, generator=g))  # (E, D, H), (E, D, H), (E, H, D): the dense MoE
        experts = shard_experts(full, src, rank)

        def total(x, op=dist.ReduceOp.SUM):
            t = torch.tensor([x], dtype=torch.float64)
            dist.all_reduce(t, op=op)
            return int(t.item())

        experts, stats = reshard(experts, src, dst, bucket)  # warm-up pair, and the size of the p2p bound
        experts, _ = reshard(experts, dst, src, bucket)
        payload = torch.empty(max(total(stats["bytes_moved"]), 1), dtype=torch.uint8)  # bytes_moved, one send

        def p2p():
            return dist.send(payload, 1) if rank == 0 else dist.recv(payload, 0) if rank == 1 else None

        sw, back, bound = [], [], []
        for _ in range(args.repeats):  # interleaved, so that the machine's noise hits both alike
            dt, (experts, stats) = timed(lambda: reshard(experts, src, dst, bucket))
            db, (experts, back_stats) = timed(lambda: reshard(experts, dst, src, bucket))
            sw.append(dt), back.append(db), bound.append(timed(p2p)[0])
        assert all(torch.equal(experts[n][e], full[n][e]) for n in full for e in experts[n]), "round trip changed"
        moved, least = total(stats["bytes_moved"]), total(stats["bytes_min"])
        peak_extra = total(stats["peak_extra_bytes"], dist.ReduceOp.MAX)
        assert payload.numel() == moved
        del payload

        dn, (naive, nst) = timed(lambda: reshard_naive(shard_experts(full, src, rank), src, dst))
        del naive
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
                naive_bytes_moved=total(nst["bytes_moved"]), naive_peak_bytes=nst["peak_bytes"],
                naive_switch_s=round(dn, 4), world=W, from_ep=args.from_ep, to_ep=args.to_ep,
                experts=E, d_model=D, d_hidden=H))
        else:
            total(nst["bytes_moved"])
    finally:
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # model: the expert tensors that move
    p.add_argument("--experts", type=int, default=8, help="number of experts E")
    p.add_argument("--d-model", type=int, default=1024, help="model width D")
    p.add_argument("--d-hidden", type=int, default=1024, help="expert hidden width H")
    # switch
    p.add_argument("--world", type=int, default=2, help="gloo processes (the CI machine has 2 cores)")
    p.add_argument("--from-ep", type=int, default=2, help="EP degree before the switch (training)")
    p.add_argument("--to-ep", type=int, default=1, help="EP degree after the switch (rollout)")
    p.add_argument("--bucket-mb", type=float, default=16, help="bucket size in MiB")
    p.add_argument("--repeats", type=int, default=7, help="timed repeats, median reported")
    args = p.parse_args()

    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=worker, args=(r, args, port, results)) for r in range(args.world)]
    for pr in procs:
        pr.start()
    res = results.get(timeout=600)
    for pr in procs:
        pr.join()
    mib = 2 ** 20
    print(f"EP {res['from_ep']} -> {res['to_ep']} on {res['world']} gloo ranks, {res['experts']} experts of "
          f"3 x {res['d_model']} x {res['d_hidden']} fp32 ({3 * res['d_model'] * res['d_hidden'] * 4 / mib:.0f} MiB each)")
    print(f"bucketed : moved {res['bytes_moved'] / mib:8.1f} MiB (min {res['bytes_min'] / mib:.1f}) | "
          f"peak {res['peak_bytes'] / mib:.1f} MiB/rank (source {res['from_bytes'] / mib:.1f}, target "
          f"{res['to_bytes'] / mib:.1f}, +{res['peak_extra_bytes'] / mib:.1f} <= bucket {res['bucket_bytes'] / mib:.1f}) | "
          f"{res['rounds']} rounds | {res['switch_s']:.3f} s (back {res['switch_back_s']:.3f} s)")
    print(f"naive    : moved {res['naive_bytes_moved'] / mib:8.1f} MiB | peak {res['naive_peak_bytes'] / mib:.1f} "
          f"MiB/rank | {res['naive_switch_s']:.3f} s")
    print(f"p2p bound: one send of {res['bytes_moved'] / mib:.1f} MiB in {res['p2p_bound_s']:.3f} s "
          f"-> switch / bound = {res['switch_over_bound']:.2f}, the median of the repeats' ratios (target <= 2)")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
