"""Benchmark expert load balancing (options/eplb.py) through the switch: a skewed router, placed by load.

    python bench/eplb.py                 # 4 gloo processes, inference EP 2 and 4 (about 5 minutes)

The model: 4 residual MoE layers (x + moe(x)) of 16 experts, top-2, D = 64, H = 128 (train_grpo.py's default
widths), trained at EP 2 and switched to inference EP P = 2 and 4, as eplb.BalancedExperts does in the run. The
router is skewed on purpose: the router rows of experts 0 to 3 are scaled by 2, and the tokens lean their way (a
shared direction added to each), so the blocks, which put experts 0 to 3 on one rank, give that rank most of the
rows. Each decode step is a forward of the engine's 4 layers on 32 fresh tokens a rank (the same tokens in every
mode).

Per P, rounds alternate between four balancers (options/eplb.py), their order reversed every other cycle: the
blocks (by_load=False: measured, never moved); by load, the run's default (up to one redundant slot a rank, the
fewest whose predicted balancedness reaches 0.95); by load with no copies (--eplb-redundant 0); and by load with one
copy a rank always (the target out of reach).
The first rollout of each by-load one, in blocks, gives it its loads (a warm-up).
Each round is a switch to rollout, --steps decode steps, a switch back. Reported, per mode:
  - balancedness: mean over max of the rows each EP rank receives, mean over layers (all ranks' rows summed);
  - busiest_rows_per_step: the busiest rank's rows per decode step, summed over layers;
  - decode_step_s: the median over rounds of the median step time (barrier to the slowest rank), and
    decode_over_blocks, the median over the pairs of rounds of by load's over the blocks';
  - by load only: the switch's bytes moved (received, every rank's over the 4 layers) against the minimum for the
    placement, and its peak extra memory (the largest rank's, one layer at a time) against one bucket.
Every round checks the engine's output against the dense layers (to 1e-5 of the largest value), and the experts
after the switch back against the dense ones, bit for bit; a mismatch stops the run. The last line is one JSON object.
"""
import argparse
import copy
import datetime
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from options import eplb  # noqa: E402
from options.dense_moe import DenseMoE  # noqa: E402
from plumbing import checkpoint  # noqa: E402

E, D, H, K, LAYERS, HOT, W = 16, 64, 128, 2, 4, 4, 4
BY_LOAD = ("by_load", "no_copies", "copies")  # the run's default; no copy; always one a rank


class Residual(torch.nn.Module):
    """x + moe(x): a block's MoE half, so that every layer sees the tokens' lean."""

    def __init__(self, moe):
        super().__init__()
        self.moe = moe

    def forward(self, x):
        return x + self.moe(x)


def skewed_layers():
    """The dense MoE blocks (the same on every rank) and the tokens' shared direction."""
    g = torch.Generator().manual_seed(0)
    layers, lean = [], torch.zeros(D)
    for _ in range(LAYERS):
        router = torch.randn(E, D, generator=g) / D ** 0.5
        router[:HOT] *= 2
        lean += router[:HOT].sum(0)
        w = [torch.randn(E, D, H, generator=g) / D ** 0.5, torch.randn(E, D, H, generator=g) / D ** 0.5,
             torch.randn(E, H, D, generator=g) / H ** 0.5]
        layers.append(Residual(DenseMoE(router, *w, top_k=K, orientation="x @ w")))
    return torch.nn.Sequential(*layers), lean / lean.norm() * D ** 0.5


def tokens(step, rank, lean, n):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, D, generator=g) + lean                                  # (n, D)


def one_round(ep, engine, dense, balancer, lean, args, rank):
    """A switch to rollout, the decode steps, a switch back: the round's figures."""
    ep.balancer = balancer
    ep.to_rollout()
    times = []
    for step in range(args.steps):
        x = tokens(step, rank, lean, args.tokens)
        dist.barrier()
        t0 = time.perf_counter()
        y = engine(x)
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        times.append(dt.item())
        if step == 0:  # once a round: float rounding through 4 layers, no more
            want = dense(x)
            if (y - want).abs().max() > 1e-5 * want.abs().max():
                raise AssertionError(f"the engine's output differs from the dense layers' by "
                                     f"{(y - want).abs().max():.2e} (of values up to {want.abs().max():.1f})")
    moved = {k: ep.stats[f"ep/to_rollout_{k}"] for k in ("bytes_moved", "bytes_min", "peak_extra_bytes")}
    for k, op in (("bytes_moved", dist.ReduceOp.SUM), ("bytes_min", dist.ReduceOp.SUM),
                  ("peak_extra_bytes", dist.ReduceOp.MAX)):  # every rank's bytes, the largest peak
        t = torch.tensor([moved[k]], dtype=torch.float64)
        dist.all_reduce(t, op=op)
        moved[k] = int(t.item())
    ep.to_train()
    return dict(balancedness=ep.stats["moe/rollout_balancedness"],
                busiest_rows_per_step=ep.stats["moe/rollout_busiest_rows"] / args.steps,
                decode_step_s=statistics.median(times), **moved)


def worker(rank, args, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=W, timeout=datetime.timedelta(seconds=120))
    dense, lean = skewed_layers()
    result = {}
    with torch.no_grad():
        for P in (2, 4):
            model, engine = copy.deepcopy(dense), copy.deepcopy(dense).requires_grad_(False)
            modes = {"blocks": eplb.Balancer(0, by_load=False), "by_load": eplb.Balancer(P),
                     "no_copies": eplb.Balancer(0), "copies": eplb.Balancer(P, target=2.0)}
            ep = eplb.BalancedExperts(2, P, W, E, bucket_bytes=args.bucket_kb * 1024, timeout_s=120,
                                      balancer=modes["blocks"])  # each round sets its own
            ep.apply(model, engine)
            for m in BY_LOAD:  # their loads: a first rollout's, in blocks
                one_round(ep, engine, dense, modes[m], lean, args, rank)
            rounds = {m: [] for m in modes}
            # the order reversed every other cycle: a drift within a cycle weighs on every mode alike
            for cycle in range(args.rounds):
                order = list(modes.items())
                for m, balancer in (order[::-1] if cycle % 2 else order):
                    rounds[m].append(one_round(ep, engine, dense, balancer, lean, args, rank))
            state = checkpoint.dense_state_dict(model)
            if not all(torch.equal(state[k], v) for k, v in dense.state_dict().items()):
                raise AssertionError("the experts after the switch back differ from the dense ones")
            result[P] = {m: summary(r) for m, r in rounds.items()}
            for m in BY_LOAD:  # each pair of rounds a moment apart
                ratios = [b["decode_step_s"] / a["decode_step_s"] for a, b in zip(rounds["blocks"], rounds[m])]
                result[P][m]["decode_over_blocks"] = statistics.median(ratios)
    if rank == 0:
        out.put(result)
    dist.barrier()
    dist.destroy_process_group()


def summary(rounds):
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    med["peak_extra_bytes"] = max(r["peak_extra_bytes"] for r in rounds)
    return med


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--bucket-kb", type=int, default=256)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.get_context("spawn").Queue()
    mp.spawn(worker, args=(args, port, out), nprocs=W)
    result = out.get()
    for P, modes in result.items():
        a = modes["blocks"]
        for m in BY_LOAD:
            b = modes[m]
            b["rows_down"] = a["busiest_rows_per_step"] / b["busiest_rows_per_step"]
            print(f"EP {P}, {m}: balancedness {a['balancedness']:.3f} -> {b['balancedness']:.3f} | busiest rank's "
                  f"rows per step {a['busiest_rows_per_step']:.0f} -> {b['busiest_rows_per_step']:.0f} | decode step "
                  f"{a['decode_step_s'] * 1e3:.2f} -> {b['decode_step_s'] * 1e3:.2f} ms (ratio "
                  f"{b['decode_over_blocks']:.3f}) | switch moved {b['bytes_moved']} B of minimum {b['bytes_min']} B, "
                  f"peak extra {b['peak_extra_bytes']} B (bucket {args.bucket_kb * 1024} B)")
    print(json.dumps(dict(
        {f"ep{P}": modes for P, modes in result.items()},
        balancedness_before={f"ep{P}": m["blocks"]["balancedness"] for P, m in result.items()},
        balancedness_after={f"ep{P}": m["by_load"]["balancedness"] for P, m in result.items()},
        settings=dict(experts=E, d_model=D, d_hidden=H, top_k=K, layers=LAYERS, world=W, train_ep=2,
                      **vars(args)))))


if __name__ == "__main__":
    main()
