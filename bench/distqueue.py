"""Benchmark DistQueue: packed vs padded bytes, and flat vs hierarchical queue reads.

    python bench/distqueue.py --lengths lognormal:5,1.2      # also uniform:A,B and fixed:N

Spawns --world gloo processes on this machine. Every rank puts --rows rows per step (response tokens
int64 + log-probs float32 of a length drawn from --lengths, plus a float32 reward); then
  flat:          every rank is a DP rank and reads its token-balanced share of the global batch;
  hierarchical:  ranks form model-parallel groups of --group; only each group's leader reads, then
                 broadcasts inside its group.
bytes_packed is what the queue actually sent point-to-point (header + payload); bytes_padded is what the
same transfers would have sent padded to the step's longest sample; bytes_true is recomputed here from
the received rows (lengths x element size + one int64 length per cell). Last line: one JSON object.
"""
import argparse
import datetime
import json
import math
import os
import socket
import sys
import time
import traceback

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import distqueue as dq  # noqa: E402
from options.selective_queue import SelectiveQueue  # noqa: E402  (get(group=): the hierarchical read; drain())
from plumbing.distqueue_details import pack  # noqa: E402

COLS = {"response": "int64", "logp": "float32", "reward": "float32"}


def sample_lengths(spec, n, rng):
    kind, _, params = spec.partition(":")
    p = [float(x) for x in params.split(",") if x]
    if kind == "lognormal" and len(p) == 2:
        x = np.ceil(rng.lognormal(p[0], p[1], n))
    elif kind == "uniform" and len(p) == 2:
        x = rng.integers(int(p[0]), int(p[1]) + 1, n)
    elif kind == "fixed" and len(p) == 1:
        x = np.full(n, p[0])
    else:
        raise ValueError(f"--lengths {spec!r}: use lognormal:MU,SIGMA, uniform:A,B or fixed:N")
    return np.clip(x, 1, 65536).astype(np.int64).tolist()


def readers(world, group_size):
    """Ranks that talk to the queue: the first rank of each model-parallel group (all ranks if 1)."""
    return [r for r in range(world) if r % group_size == 0]


def phase(rank, world, args, group_size, name):
    """One phase: args.steps steps of put + global read. Returns per-rank counters."""
    spec = dq.QueueSpec(columns=COLS, scalars=("reward",), stages={"train": tuple(COLS)}, name=name,
                        timeout_s=120)
    q = SelectiveQueue(spec, dq.default_store(), rank, world)
    groups = [dist.new_group(list(range(g, g + group_size))) for g in range(0, world, group_size)]
    mp_group = groups[rank // group_size] if group_size > 1 else None
    dp_groups = [dist.new_group([r for r in range(world) if r % group_size == k]) for k in range(group_size)]
    dp_group = dp_groups[rank % group_size]
    rng = np.random.default_rng(1000 * rank + 7)
    true_bytes, put_lens, reads, t0 = 0, [], [], time.perf_counter()
    for step in range(args.steps):
        lens = sample_lengths(args.lengths, args.rows, rng)
        put_lens.append(lens)
        q.put({"response": [torch.from_numpy(rng.integers(0, 32000, n)) for n in lens],
               "logp": [torch.from_numpy(rng.standard_normal(n).astype(np.float32)) for n in lens],
               "reward": [float(n) for n in lens]})
        before = q.reads("train")
        b = q.get("train", args.rows * world, dp_group=dp_group, group=mp_group)
        if rank in readers(world, group_size):  # what the queue moved to me from other owners
            for i, r in enumerate(b.ids):
                if r % world != rank:  # row ids are local_count * world + owner
                    true_bytes += sum(b.cols[c][i].numel() * b.cols[c][i].element_size() + 8 for c in COLS)
        dist.barrier()
        reads.append(q.reads("train") - before)
        dist.barrier()
    q.drain()
    dist.barrier()  # every rank's sends counted: metrics() are the whole queue's
    return dict(q.metrics(), true=true_bytes, reads=reads, lens=put_lens, s=time.perf_counter() - t0)


def transfer_ms(rank, args, pair):
    """Time a real padded vs packed point-to-point transfer of one global batch, rank 1 -> rank 0 (best of 10)."""
    rng = np.random.default_rng(3)
    seqs = [torch.from_numpy(rng.integers(0, 32000, n)) for n in sample_lengths(args.lengths, args.rows * 4, rng)]
    padded, plens = dq.pad(seqs)  # (B, T)
    flat, lens = pack(seqs)  # (N,)
    out = {}
    for name, tensors in (("padded_ms", [plens, padded]), ("packed_ms", [lens, flat])):
        best = math.inf
        for _ in range(10):
            dist.barrier(group=pair)
            t = time.perf_counter()
            for x in tensors:  # header first, then payload
                dist.send(x, 0) if rank == 1 else dist.recv(torch.empty_like(x), 1)
            best = min(best, (time.perf_counter() - t) * 1e3)
        out[name] = best
    return out if rank == 0 else {}  # the receiver's clock: the transfer is done when recv returns


def worker(rank, world, port, args, results):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    try:
        flat = phase(rank, world, args, 1, "flat")
        hier = phase(rank, world, args, args.group, "hier")
        pair = dist.new_group([0, 1])
        results.put((rank, flat, hier, transfer_ms(rank, args, pair) if rank < 2 else {}))
        dist.barrier()
    except BaseException:
        results.put((rank, traceback.format_exc(), None, None))
        raise
    finally:
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # data
    ap.add_argument("--lengths", default="lognormal:5,1.2", help="lognormal:MU,SIGMA | uniform:A,B | fixed:N")
    ap.add_argument("--rows", type=int, default=32, help="rows each rank puts per step")
    ap.add_argument("--steps", type=int, default=3, help="steps per phase")
    # layout
    ap.add_argument("--world", type=int, default=4, help="gloo processes")
    ap.add_argument("--group", type=int, default=2, help="model-parallel group size in the hierarchical phase")
    args = ap.parse_args()
    if args.world % args.group or args.world < 2:
        raise SystemExit(f"--world {args.world} must be >= 2 and divisible by --group {args.group}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args.world, port, args, results)) for r in range(args.world)]
    for p in procs:
        p.start()
    res = []
    for _ in procs:
        res.append(results.get(timeout=600))
        if res[-1][2] is None:
            [p.kill() for p in procs]
            raise SystemExit(f"rank {res[-1][0]} failed:\n{res[-1][1]}")
    res.sort(key=lambda r: r[0])
    for p in procs:
        p.join()
    flat, hier = [r[1] for r in res], [r[2] for r in res]
    timing = res[0][3] | res[1][3]
    packed = flat[0]["queue/bytes_sent"]  # the whole queue's counts, the same on every rank
    padded = flat[0]["queue/bytes_padded_equiv"]
    true = sum(f["true"] for f in flat)
    steps = [sum((f["lens"][s] for f in flat), []) for s in range(args.steps)]  # each step's global batch
    max_over_mean = min(max(x) / (sum(x) / len(x)) for x in steps)  # the padded baseline pads to max(x)
    rf, rh = flat[0]["reads"][-1], hier[0]["reads"][-1]
    out = {
        "lengths": args.lengths, "world": args.world, "group_size": args.group, "rows_per_step": args.rows * args.world,
        "max_over_mean": round(max_over_mean, 2),
        "bytes_packed": packed, "bytes_padded": padded, "bytes_true": true,
        "reduction": round(1 - packed / padded, 4) if padded else 0.0,
        "packed_vs_true": round(packed / true - 1, 6) if true else float(packed != 0),
        "reads_flat": rf, "reads_hierarchical": rh,
        "reads_model_tp8pp16_flat": len(readers(2048, 1)), "reads_model_tp8pp16": len(readers(2048, 8 * 16)),
        "reads_model_tp8pp16_ratio": len(readers(2048, 128)) / len(readers(2048, 1)),
        "padded_ms": round(timing["padded_ms"], 3), "packed_ms": round(timing["packed_ms"], 3),
        "flat_s": round(max(f["s"] for f in flat), 3), "hier_s": round(max(h["s"] for h in hier), 3),
    }
    out["targets_met"] = bool((out["max_over_mean"] < 5 or out["reduction"] >= 0.8)
                              and abs(out["packed_vs_true"]) <= 0.01 and rh * args.group == rf)
    print(f"lengths {args.lengths} | max/mean {out['max_over_mean']} | world {args.world} | "
          f"{out['rows_per_step']} rows/step x {args.steps} steps")
    print(f"bytes: packed {packed:,} | padded {padded:,} | true {true:,} | reduction {out['reduction']:.1%}")
    if not padded:
        print("no row crossed ranks: the token-balanced split gave every rank its own rows (equal lengths)")
    print(f"p2p one batch: padded {out['padded_ms']:.2f} ms | packed {out['packed_ms']:.2f} ms")
    print(f"queue reads/step: flat {rf} | hierarchical {rh} (group {args.group}) | "
          f"TP8xPP16 on 2048 ranks: {out['reads_model_tp8pp16']}/{out['reads_model_tp8pp16_flat']}"
          f" = 1/{round(1 / out['reads_model_tp8pp16_ratio'])}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
