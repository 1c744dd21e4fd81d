"""Benchmark fusion.py: separated vs colocated vs colocated-all GRPO on 2 gloo ranks, and the phase switch.

    python bench/fusion.py                 # the default run, about 2 minutes on 2 CPU cores
    python bench/fusion.py --help          # every knob, grouped

One process tree: 2 spawned ranks, gloo, 1 thread each (2 processes x 1 thread is the best matmul
throughput on 2 cores). Two measurements, in the same run:

1. Throughput. train_grpo.train() runs the same GRPO work in each mode: the same config, seed, prompts
   and number of steps (no supervised warm-up: the policy starts from its seeded init, so every mode
   samples the same responses and trains to the same parameters). tokens_per_s is train_grpo's summary
   figure, response tokens per wall second over the RL steps (held-out evaluation excluded). The modes
   run interleaved (sep, col, col-all, sep, ...) for --repeats rounds and the median is reported, so that
   a neighbour on the cores hits every mode alike.
     separated      rank 0 trains, rank 1 generates the whole batch; weights pushed 0 -> 1 after each step
     colocated      both ranks generate half the batch, then both train (FSDP2), switching via fusion.py
     colocated-all  colocated, plus the reference model, kept on host except while it computes
   The regime, stated: a per-step batch large enough (64 prompts x 8 responses) that both rollout and
   training are compute-bound on 1 thread per rank. Here, decode cost grows about linearly with the
   batch, so halving a rank's rollout batch halves its rollout time, as on the source's NPUs. With a
   small batch decode is overhead-bound (it grows little with the rows: bench/prefill.py's decode
   table): colocation then halves only the training and the ratio caps near 1.5. The limit for two
   balanced phases is 2.0.

2. The switch. FusedActor.to_rollout() + to_train() on a model big enough that bytes, not collective
   latency, dominate (--switch-d-model): FSDP2 built as train_grpo.build does, one AdamW step so the
   optimizer state exists (grads are then None: the offload is the Adam state). switch_round_trip_s is
   the median over --switch-reps round trips of the slower rank, and switch_<part>_s its parts, from the
   actor's own clock (to_rollout: offload, alloc, gather; to_train: free, reload); switch_bytes is the
   actor's switch/bytes (offloaded bytes x2 + gathered bytes, per rank). Two bounds, interleaved with the
   round trips, both ranks at once: memcpy_bound_s, a plain torch copy_ of one buffer of switch_bytes;
   link_bound_s, the same bytes each over the link it needs: the offload, the reload and each rank's own
   shard into place as one memcpy, the rest of the gather as one broadcast of each rank's whole shard
   (here gloo over loopback TCP, several times a memcpy's cost per byte: what the gather cannot beat). round_trip_over_link says what the code adds.

3. The machine's bound (bench_bound): the work of a step without any communication, switch or queue,
   the whole batch in one process alone against half of it in each process at once, --repeats rounds
   (median of the ratios). On separate devices it would be about 2; on 2 cores sharing caches and
   memory bandwidth it is what they allow. colocated_over_separated_over_bound says how close the
   system comes to it.

Targets on 2 CPU cores: colocated_over_separated >= 1.7 (the source: 1.785) and
switch_round_trip_s <= 3 * memcpy_bound_s (and, of the link bound, <= 1.5x). The last line printed is one JSON object. cores_used is the
ranks' CPU-seconds per wall second in each mode: colocation needs both cores at once (ideal near 2.0,
separated near 1.0), so a neighbour process on the cores shows up there and pulls the ratio towards 1.

Shapes: W = 2 ranks, B = prompts_per_step x group_size sequences per step, D d_model, F d_expert.
"""
import argparse
import contextlib
import datetime
import io
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere

MODES = ("separated", "colocated", "colocated-all")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slowest(x):
    """The max of a float over the ranks: a distributed phase lasts as long as its slowest rank."""
    import torch
    import torch.distributed as dist
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def total(x):
    """The sum of a float over the ranks."""
    import torch
    import torch.distributed as dist
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item()


def grpo_config(args, deploy, out):
    from train_grpo import Config
    return Config(d_model=args.d_model, d_expert=args.d_expert, n_layers=args.n_layers, warmup_steps=0,
                  steps=args.steps, prompts_per_step=args.prompts_per_step, group_size=args.group_size,
                  max_new_tokens=args.max_new_tokens, max_digits=args.max_digits, eval_prompts=2,
                  eval_every=10 ** 6, deploy=deploy, bucket_kb=args.bucket_kb, seed=args.seed, out=out,
                  device="cpu", pg_timeout_s=180, staleness=0, filter_groups=False)  # the same work in each mode


def bench_modes(args, rank, store):
    """Each mode `repeats` times, interleaved. Returns {mode: [(tokens_per_s, rollout_s, train_s, switch_s)]}."""
    import train_grpo
    import torch.distributed as dist
    runs = {m: [] for m in MODES}
    tmp = os.path.join(tempfile.gettempdir(), f"bench_fusion_{os.getppid()}")  # the same folder on both ranks
    os.makedirs(tmp, exist_ok=True)
    for rep in range(args.repeats):
        for mode in MODES:
            # A fresh process group over a fresh key prefix per run: each run starts as a new job would.
            dist.destroy_process_group()
            dist.init_process_group("gloo", store=dist.PrefixStore(f"{mode}/{rep}/", store), rank=rank,
                                    world_size=2, timeout=datetime.timedelta(seconds=600))
            out = os.path.join(tmp, f"{mode}_{rep}")
            c0, w0 = time.process_time(), time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                summary, _ = train_grpo.train(grpo_config(args, mode, out), out)
            cores = total(time.process_time() - c0) / (time.perf_counter() - w0)  # CPU-seconds per second, 2 ranks
            spans = [json.loads(line) for line in open(os.path.join(out, f"spans_rank{rank}.jsonl"))]
            phases = ({"rollout"}, {"train", "reference"}, {"switch_to_rollout", "switch_to_train", "push", "recv"})
            per = [slowest(sum(s["end"] - s["start"] for s in spans if s["name"] in names) / args.steps)
                   for names in phases]  # per step, the busier rank
            runs[mode].append((summary["tokens_per_s"], *per, cores))
            if rank == 0:
                print(f"  round {rep + 1}/{args.repeats} {mode:13s} {summary['tokens_per_s']:7.0f} tok/s | "
                      f"per step: rollout {per[0]:.2f}s train {per[1]:.2f}s switch/push {per[2]:.3f}s | "
                      f"cores used {cores:.2f}", flush=True)
    return runs


def bench_switch(args, rank):
    """Median FusedActor round trip, part by part, against two bounds measured interleaved with it: a
    memcpy of the switch's bytes, and the same bytes each over the link it needs (the offload and the
    reload as memcpys, the gather as one broadcast of each rank's whole shard). Returns a dict."""
    import torch
    import torch.distributed as dist
    import train_grpo
    from task import VOCAB
    cfg = train_grpo.Config(d_model=args.switch_d_model, d_expert=args.switch_d_expert, n_layers=args.n_layers,
                            deploy="colocated", bucket_kb=args.switch_bucket_kb, seed=args.seed, device="cpu",
                            warmup_steps=0, eval_prompts=2)
    out = os.path.join(tempfile.gettempdir(), f"bench_fusion_switch_{os.getppid()}")
    run = train_grpo.build(cfg, out)  # FSDP2, the engine and the FusedActor exactly as a training run has them
    model, opt, actor, engine = run.model, run.optimizer, run.actor, run.engine
    tokens = torch.randint(0, VOCAB, (4, 16))                                              # (B, T)
    model(tokens).logsumexp(-1).mean().backward()  # one step: the Adam state (exp_avg, exp_avg_sq) exists
    opt.step()
    opt.zero_grad(set_to_none=True)
    actor.to_rollout()
    actor.to_train()  # warm: host buffers allocated once, reused after
    nbytes, off = actor.stats["switch/bytes"], actor.stats["switch/offload_bytes"]
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    shards = [torch.ones(actor.stats["switch/gather_bytes"] // 2, dtype=torch.uint8) for _ in range(2)]
    dst.copy_(src)
    parts = ("offload", "alloc", "gather", "free", "reload")
    laps = {k: [] for k in ("trip", "memcpy", "link") + parts}
    for _ in range(args.switch_reps):  # interleaved: round trip, memcpy, the bytes over their links, ...
        dist.barrier()
        t0 = time.perf_counter()
        actor.to_rollout()
        actor.to_train()
        laps["trip"].append(slowest(time.perf_counter() - t0))
        for part in parts:
            laps[part].append(slowest(actor.stats[f"switch/{part}_s"]))
        dist.barrier()
        t0 = time.perf_counter()
        dst.copy_(src)
        laps["memcpy"].append(slowest(time.perf_counter() - t0))
        dist.barrier()
        t0 = time.perf_counter()
        local = 2 * off + shards[rank].numel()  # the offload, the reload, and this rank's shard into place
        dst[:local].copy_(src[:local])
        for r in range(2):  # the rest of the gather: each rank's shard to the other, one broadcast each
            dist.broadcast(shards[r], src=r)
        laps["link"].append(slowest(time.perf_counter() - t0))
    med = {k: statistics.median(v) for k, v in laps.items()}
    return {"switch_round_trip_s": med["trip"], "switch_bytes": nbytes, "memcpy_bound_s": med["memcpy"],
            "link_bound_s": med["link"], **{f"switch_{k}_s": med[k] for k in parts},
            "switch_to_rollout_s": actor.stats["time/to_rollout_s"], "switch_to_train_s": actor.stats["time/to_train_s"],
            "switch_offload_bytes": off, "switch_gather_bytes": actor.stats["switch/gather_bytes"],
            "switch_model_params": sum(p.numel() for p in engine.parameters()), "switch_buckets": len(actor.buckets)}


def bench_bound(args, rank):
    """The machine's bound on colocated / separated. Each round, interleaved: the whole batch's rollout
    and GRPO update in rank 0 alone (rank 1 waits at a barrier): what a separated step costs without
    its push; then half the batch on each rank, both at once, no collective: what a colocated step
    costs without its switch, FSDP's collectives and the queue. Their ratio is the most colocation can
    gain on these cores, contention included. Returns a dict of medians."""
    import torch
    import torch.distributed as dist
    import grpo
    import task
    from config import grpo_config as algo_config, model_config
    from model import Policy, generate
    cfg = grpo_config(args, "colocated", None)
    B = args.prompts_per_step * args.group_size
    _, _, stream = task.prompt_streams(args.seed, args.max_digits, 2)
    prompts = [p for p in stream.next(args.prompts_per_step) for _ in range(args.group_size)]  # B of (P_i,)
    alone_group = [dist.new_group([r]) for r in range(2)][rank]  # grpo's sums over this rank only

    def work(lo, hi):  # rows [lo, hi), whole groups: (rollout s, update s)
        torch.manual_seed(args.seed)
        model = Policy(model_config(cfg))
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        t0 = time.perf_counter()
        with torch.no_grad():
            gen = generate(model, prompts[lo:hi], torch.arange(lo, hi), cfg.max_new_tokens, task.EOS, task.PAD,
                           cfg.temperature, cfg.top_p)
        t1 = time.perf_counter()
        rewards = torch.tensor([task.score(p, r) for p, r in zip(prompts[lo:hi], gen.tokens)])  # (b,)
        samples = grpo.Samples(prompts[lo:hi], gen.tokens, gen.logprobs, grpo.group_advantages(rewards, cfg.group_size))
        grpo.grpo_update(model, opt, samples, algo_config(cfg), "cpu", alone_group)
        return t1 - t0, time.perf_counter() - t1

    work(rank * args.group_size, (rank + 1) * args.group_size)  # warm: one group each, not timed
    alone, both = [], []  # per round: (rollout s, update s), the slower rank's
    for _ in range(args.repeats):
        dist.barrier()
        alone.append([slowest(t) for t in (work(0, B) if rank == 0 else (0.0, 0.0))])
        dist.barrier()
        both.append([slowest(t) for t in work(rank * B // 2, (rank + 1) * B // 2)])
    med = lambda rows, i: statistics.median(r[i] for r in rows)  # noqa: E731
    return {"bound_alone_rollout_s": med(alone, 0), "bound_alone_update_s": med(alone, 1),
            "bound_both_rollout_s": med(both, 0), "bound_both_update_s": med(both, 1),
            "bound": statistics.median(sum(a) / sum(b) for a, b in zip(alone, both))}


def worker(rank, args, port, results):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)  # 2 processes x 1 thread on 2 cores
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=600))
    dist.init_process_group("gloo", store=dist.PrefixStore("switch/", store), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=600))
    try:
        switch = bench_switch(args, rank)
        if rank == 0:
            print_switch(switch)
        bound = bench_bound(args, rank) if not args.switch_only else {}
        if rank == 0 and bound:
            print(f"bound: whole batch alone, rollout {bound['bound_alone_rollout_s']:.2f} s + update "
                  f"{bound['bound_alone_update_s']:.2f} s | half each at once, rollout "
                  f"{bound['bound_both_rollout_s']:.2f} s + update {bound['bound_both_update_s']:.2f} s | "
                  f"colocation can gain at most x{bound['bound']:.2f}", flush=True)
        runs = bench_modes(args, rank, store) if not args.switch_only else {m: [] for m in MODES}
        if rank == 0:
            results.put((switch | bound, runs))
    finally:
        dist.destroy_process_group()


def switch_ratios(switch):
    trip = switch["switch_round_trip_s"]
    return {"round_trip_over_memcpy": round(trip / switch["memcpy_bound_s"], 2),
            "round_trip_over_link": round(trip / switch["link_bound_s"], 2)}


def print_switch(switch):
    ms = {k: switch[f"switch_{k}_s"] * 1e3 for k in ("offload", "alloc", "gather", "free", "reload")}
    ratios = switch_ratios(switch)
    print(f"switch: round trip {switch['switch_round_trip_s'] * 1e3:.1f} ms for {switch['switch_bytes'] / 2 ** 20:.1f} "
          f"MiB = to_rollout (offload {ms['offload']:.1f} + alloc {ms['alloc']:.1f} + gather {ms['gather']:.1f} ms) "
          f"+ to_train (free {ms['free']:.1f} + reload {ms['reload']:.1f} ms) | memcpy "
          f"{switch['memcpy_bound_s'] * 1e3:.1f} ms (x{ratios['round_trip_over_memcpy']:.2f}) | over the links "
          f"{switch['link_bound_s'] * 1e3:.1f} ms (x{ratios['round_trip_over_link']:.2f})", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("GRPO work, the same in every mode")
    g.add_argument("--steps", type=int, default=2, help="GRPO steps per run")
    g.add_argument("--repeats", type=int, default=3, help="interleaved rounds over the three modes (median)")
    g.add_argument("--prompts-per-step", type=int, default=64, help="global prompts per step")
    g.add_argument("--group-size", type=int, default=8, help="responses per prompt")
    g.add_argument("--max-new-tokens", type=int, default=33, help="response budget in tokens")
    g.add_argument("--max-digits", type=int, default=32, help="longest digit string")
    g.add_argument("--d-model", type=int, default=128, help="model width")
    g.add_argument("--d-expert", type=int, default=256, help="hidden width of one expert")
    g.add_argument("--n-layers", type=int, default=2, help="transformer blocks")
    g.add_argument("--bucket-kb", type=int, default=1024, help="bucket of the re-sharding and the pushes, KiB")
    g.add_argument("--seed", type=int, default=0, help="seed of prompts, init and sampling")
    g = p.add_argument_group("switch")
    g.add_argument("--switch-d-model", type=int, default=512, help="model width of the switch measurement")
    g.add_argument("--switch-d-expert", type=int, default=1024, help="expert width of the switch measurement")
    g.add_argument("--switch-bucket-kb", type=int, default=16384, help="bucket of the switch measurement, KiB")
    g.add_argument("--switch-reps", type=int, default=9, help="round trips timed (median)")
    g.add_argument("--switch-only", action="store_true", help="measure the switch only, not the three modes")
    args = p.parse_args(argv)
    print("bench/fusion.py: 2 gloo ranks x 1 thread; regime: compute-bound rollout and training "
          f"({args.prompts_per_step} prompts x {args.group_size} responses per step)", flush=True)
    print("config: " + json.dumps(vars(args)), flush=True)
    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=worker, args=(r, args, port, results)) for r in range(2)]
    [pr.start() for pr in procs]
    switch, runs = results.get(timeout=3600)
    [pr.join() for pr in procs]
    if args.switch_only:
        print(json.dumps(switch | switch_ratios(switch)), flush=True)
        return
    med = {m: {k: statistics.median(r[i] for r in runs[m]) for i, k in
               enumerate(("tokens_per_s", "rollout_s", "train_s", "switch_s", "cores"))} for m in MODES}
    for m in MODES:
        print(f"{m:13s} | {med[m]['tokens_per_s']:7.0f} tok/s | per step: rollout {med[m]['rollout_s']:.2f}s "
              f"train {med[m]['train_s']:.2f}s switch/push {med[m]['switch_s']:.3f}s | "
              f"cores used {med[m]['cores']:.2f} (median of {args.repeats})", flush=True)
    res = {"tokens_per_s": {m: round(med[m]["tokens_per_s"], 1) for m in MODES},
           "colocated_over_separated": round(med["colocated"]["tokens_per_s"] / med["separated"]["tokens_per_s"], 3),
           "colocated_all_over_separated": round(med["colocated-all"]["tokens_per_s"]
                                                 / med["separated"]["tokens_per_s"], 3),
           **{k: (round(v, 5) if isinstance(v, float) else v) for k, v in switch.items()},
           **switch_ratios(switch),
           "cores_used": {m: round(med[m]["cores"], 2) for m in MODES},
           "runs_tokens_per_s": {m: [round(r[0], 1) for r in runs[m]] for m in MODES}}
    res["colocated_over_separated_over_bound"] = round(res["colocated_over_separated"] / switch["bound"], 3)
    print(f"colocated / separated {res['colocated_over_separated']:.3f} = "
          f"{res['colocated_over_separated_over_bound']:.2f} of the machine's bound {switch['bound']:.3f}", flush=True)
    res["targets_met"] = {"colocated_over_separated>=1.7": res["colocated_over_separated"] >= 1.7,
                          "switch_round_trip_s<=3*memcpy_bound_s": res["round_trip_over_memcpy"] <= 3,
                          "switch_round_trip_s<=1.5*link_bound_s": res["round_trip_over_link"] <= 1.5}
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
