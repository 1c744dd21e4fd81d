"""Benchmark fusion.py: separated vs colocated vs colocated-all GRPO on 2 gloo ranks, against the machine's
bound, and the phase switch.

    python bench/fusion.py                 # the default run, about 150 s on 2 CPU cores
    python bench/fusion.py --help          # every knob, grouped

One process tree: 2 spawned ranks, gloo, 1 thread each (2 processes x 1 thread is the best matmul
throughput on 2 cores). Three measurements, in the same run:

1. Throughput. train_grpo.train() runs the same GRPO work in each mode: the same config, seed, prompts
   and number of steps (no supervised warm-up: the policy starts from its seeded init, so every mode
   samples the same responses and trains to the same parameters). tokens_per_s is train_grpo's summary
   figure, response tokens per wall second over the RL steps (held-out evaluation excluded).
     separated      rank 0 trains, rank 1 generates the whole batch; weights pushed 0 -> 1 after each step
     colocated      both ranks generate half the batch, then both train (FSDP2), switching via fusion.py
     colocated-all  colocated, plus the reference model, kept on host except while it computes
   The regime, stated: a per-step batch large enough (64 prompts x 8 responses) that both rollout and
   training are compute-bound on 1 thread per rank. Here, decode cost grows about linearly with the
   batch, so halving a rank's rollout batch halves its rollout time, as on the source's NPUs. With a
   small batch decode is overhead-bound (it grows little with the rows: bench/prefill.py's decode
   table): colocation then halves only the training and the ratio caps near 1.5.

2. The machine's bound (bound_part): the work of a step without any communication, switch or queue,
   the whole batch in one process alone against half of it in each process at once. The work is the
   runs' first step itself: its prompts, sampling seeds and initial weights, so the same responses, and
   each process trains the token-balanced share the queue would give it; it is repeated --steps times,
   as many as a run has steps. On separate devices the bound would be about 2; on 2 cores sharing caches
   and memory bandwidth it is what they allow.

   Each of --repeats rounds runs, in turn: separated, between passes of the whole batch alone (half of
   them before it, half after, the odd one before); colocated, between passes of half the batch on each
   rank at once; colocated-all. On a shared host the speed drifts over seconds: a ratio of neighbours
   feels little of it, and bracketing the mode cancels a drift that is steady over its run. One warm-up
   round before them is not counted (--warmup-rounds): a process's first runs are slower, the bound's
   first whole batch most of all (git log -p bench/RESULTS.md). The medians over the rounds are
   reported, and each round's colocated / separated over that round's own bound
   (colocated_over_separated_over_bound: their median) says how close the system comes to what the
   machine allows.

3. The switch. FusedActor.to_rollout() + to_train() on a model big enough that bytes, not latency,
   dominate (--switch-d-model): FSDP2, the engine and the actor built as train_grpo.build does, one
   AdamW step so that the optimizer state exists (grads are then None: the offload is the Adam state).
   switch_round_trip_s is the median over --switch-reps round trips of the slower rank, switch_<part>_s
   its parts from the actor's own clock (to_rollout: offload, alloc, gather; to_train: free, reload),
   switch_bytes the bytes it moves per rank (offloaded bytes x2 + gathered bytes). Interleaved with it,
   both ranks at once: memcpy_bound_s, a plain torch copy_ of switch_bytes in one buffer; and the same
   switch with the gather by broadcasts (transport=fusion.Broadcasts()), what it costs without shared
   memory. Through shared memory (shm_transport.py) a rank copies each gathered byte once, from its own
   shard or a peer's.

   The PP -> TP switch (pp_*), interleaved with them: the same model cut by hand into 2 pipeline stages,
   stage r (half the blocks; embed on stage 0, norm and head on stage 1) on rank r, plain, one AdamW step;
   the same engine, the whole model on each rank. SharedMemory.connect() declines stages, so the actor
   gathers by broadcasts from each weight's owner: each rank receives exactly the other stage's bytes
   (pp_switch_received_bytes, against pp_switch_received_min_bytes, per rank). pp_switch_round_trip_s
   against pp_memcpy_bound_s, a plain copy of each rank's pp_switch_bytes (both ranks at once); its gather
   against pp_send_bound_s, one message each way at once carrying the bytes each rank receives.

Targets on 2 CPU cores: colocated_over_separated_over_bound >= 0.95 and switch_round_trip_s <= 1.5 *
memcpy_bound_s (targets_met); the PP switch has none yet. The last line printed is one JSON object.
cores_used is the ranks' CPU-seconds per wall second in each mode: colocation needs both cores at once
(ideal near 2.0, separated near 1.0), so a neighbour process on the cores shows up there.

Shapes: W = 2 ranks, B = prompts_per_step x group_size sequences per step, D d_model, F d_expert.
"""
import argparse
import contextlib
import copy
import datetime
import gc
import io
import json
import multiprocessing as mp
import os
import queue
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere

MODES = ("separated", "colocated", "colocated-all")
BOUND_SIDE = {"separated": "alone", "colocated": "both"}  # bound_part's side that bounds each mode
PARTS = ("offload", "alloc", "gather", "free", "reload")  # a switch's parts, from the actor's own clock


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
    from plumbing.config import Config
    return Config(d_model=args.d_model, d_expert=args.d_expert, n_layers=args.n_layers, warmup_steps=0,
                  steps=args.steps, prompts_per_step=args.prompts_per_step, group_size=args.group_size,
                  max_new_tokens=args.max_new_tokens, max_digits=args.max_digits, eval_prompts=2,
                  eval_every=10 ** 6, deploy=deploy, bucket_kb=args.bucket_kb, seed=args.seed, out=out,
                  device="cpu", pg_timeout_s=180, staleness=0, filter_groups=False,  # the same work in each mode
                  curriculum=False, kl_coef=0.0, lr=5e-4, lr_decay=1.0,  # no reference; the lr its figures had
                  train_ep=0)  # the experts in FSDP2 in every mode: separated has no EP (the switch alone differs)


def fresh_group(store, prefix, rank):
    """A fresh process group over a fresh key prefix: each run starts as a new job would."""
    import torch.distributed as dist
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.PrefixStore(prefix, store), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=600))


def run_mode(args, rank, mode, rep, tmp):
    """One GRPO run in `mode`, its files under the folder tmp. Returns (tokens_per_s, rollout_s, train_s,
    switch_s per step, cores used)."""
    import train_grpo
    out = os.path.join(tmp, f"{mode}_{rep}")
    c0, w0 = time.process_time(), time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        summary, _ = train_grpo.train(grpo_config(args, mode, out), out)
    cores = total(time.process_time() - c0) / (time.perf_counter() - w0)  # CPU-seconds per second, 2 ranks
    spans = [json.loads(line) for line in open(os.path.join(out, f"spans_rank{rank}.jsonl"))]
    phases = ({"rollout"}, {"train", "reference"}, {"switch_to_rollout", "switch_to_train", "push", "recv"})
    per = [slowest(sum(s["end"] - s["start"] for s in spans if s["name"] in names) / args.steps)
           for names in phases]  # per step, the busier rank
    return (summary["tokens_per_s"], *per, cores)


def bench_rounds(args, rank, store, tmp):
    """--warmup-rounds rounds, not counted, then --repeats rounds. A round: separated, bracketed by passes of
    the whole batch alone; colocated, bracketed by passes of half a batch on each rank at once; colocated-all.
    The host's speed drifts over seconds on a shared machine: a mode and the side of the bound that bounds
    it are neighbours, and with half the passes before it and half after, a drift that is steady over
    the mode's run cancels out of their ratio. Returns (bounds, {mode: [run_mode()]}) of the counted rounds."""
    bounds, runs = [], {m: [] for m in MODES}
    for rep in range(-args.warmup_rounds, args.repeats):  # rep < 0: a process's first runs are cold
        name = f"round {rep + 1}/{args.repeats}" if rep >= 0 else "warm-up round (not counted)"
        b = {}
        for mode in MODES:
            part = BOUND_SIDE.get(mode)  # the side of the bound that brackets this mode: half before, half after
            timed = bound_side(args, rank, store, part, f"{rep}/before", (args.steps + 1) // 2)
            fresh_group(store, f"{mode}/{rep}/", rank)
            tok, *per, cores = run = run_mode(args, rank, mode, rep, tmp)
            timed += bound_side(args, rank, store, part, f"{rep}/after", args.steps // 2)
            if part:
                b[f"{part}_rollout_s"], b[f"{part}_update_s"] = (statistics.fmean(x) for x in zip(*timed))
            if rank == 0:
                print(f"  {name} {mode:13s} {tok:7.0f} tok/s | per step: rollout {per[0]:.2f}s train "
                      f"{per[1]:.2f}s switch/push {per[2]:.3f}s | cores used {cores:.2f}", flush=True)
            if rep >= 0:
                runs[mode].append(run)
        b["bound"] = (b["alone_rollout_s"] + b["alone_update_s"]) / (b["both_rollout_s"] + b["both_update_s"])
        if rank == 0:
            print(f"  {name} bound: whole batch alone, rollout {b['alone_rollout_s']:.2f} s + update "
                  f"{b['alone_update_s']:.2f} s | half each at once, rollout {b['both_rollout_s']:.2f} s + "
                  f"update {b['both_update_s']:.2f} s | x{b['bound']:.3f}", flush=True)
        if rep >= 0:
            bounds.append(b)
    return bounds, runs


def bound_side(args, rank, store, part, when, passes):
    """`passes` passes of one side of the bound (none for a mode without one), in a fresh group."""
    if part is None or passes == 0:
        return []
    fresh_group(store, f"bound/{part}/{when}/", rank)
    return bound_part(args, rank, part, passes)


def per_rank(x):
    """[x of rank 0, x of rank 1]."""
    import torch.distributed as dist
    out = [None, None]
    dist.all_gather_object(out, x)
    return out


def pipeline_stage(model, stage):
    """Cut a Policy by hand, in place, into pipeline stage 0 (embed, the first half of the blocks) or 1 (the
    other half, norm, head): the other stage's blocks become Identity, its other modules None, so that every
    parameter left keeps the whole model's name."""
    import torch
    half = len(model.blocks) // 2
    for i in range(half, len(model.blocks)) if stage == 0 else range(half):
        model.blocks[i] = torch.nn.Identity()
    if stage == 0:
        model.norm = model.head = None
    else:
        model.embed = None
    return model


def pp_actor(engine, opt, bucket_bytes, actor_class, rank):
    """The PP -> TP switch's actor: this rank's stage of a Policy like the engine (plain, one rank per stage),
    an AdamW like opt after one step (the Adam state exists), a fresh whole-model engine of the same
    kind, filled as actor_class (the run's switch) fills it. The transport as train_grpo.build picks it:
    SharedMemory declines stages, so Broadcasts."""
    import torch
    import fusion
    from plumbing import shm_transport
    from model import Policy
    torch.manual_seed(rank)
    stage = pipeline_stage(Policy(engine.cfg), rank)
    stage_opt = torch.optim.AdamW(stage.parameters(), **{k: opt.defaults[k] for k in ("lr", "betas", "eps",
                                                                                       "weight_decay", "foreach")})
    sum(p.square().sum() for p in stage.parameters()).backward()
    stage_opt.step()
    stage_opt.zero_grad(set_to_none=True)
    from options.tensor_parallel import apply as tensor_parallel
    pp_engine = tensor_parallel(Policy(engine.cfg), getattr(engine, "tp_group", None))
    pp_engine.eval().requires_grad_(False)
    transport = shm_transport.SharedMemory.connect(stage) or fusion.Broadcasts()
    from options import owners
    return owners.actor_class(actor_class)(stage, stage_opt, pp_engine, bucket_bytes=bucket_bytes,
                                           transport=transport)


def bench_switch(args, rank, tmp):
    """Median FusedActor round trip, part by part, against a memcpy of the same bytes and against the same
    switch gathering by broadcasts (transport=fusion.Broadcasts()); the PP -> TP switch against a memcpy of
    its bytes and one send each way of what each rank receives; interleaved. Returns a dict."""
    import torch
    import torch.distributed as dist
    import fusion
    from plumbing import shm_transport
    import train_grpo
    from task import VOCAB
    from plumbing.config import Config
    cfg = Config(d_model=args.switch_d_model, d_expert=args.switch_d_expert, n_layers=args.n_layers,
                 deploy="colocated", bucket_kb=args.switch_bucket_kb, seed=args.seed, device="cpu",
                 warmup_steps=0, eval_prompts=2, train_ep=0)  # every weight through the gather, no mover
    with contextlib.redirect_stdout(io.StringIO()):  # FSDP2, the engine and the actor as a run has them
        run = train_grpo.build(cfg, os.path.join(tmp, "switch"))
    model, opt, actor, engine = run.model, run.optimizer, run.actor, run.engine
    by_broadcast = type(actor)(model, opt, engine, bucket_bytes=actor.bucket_bytes, movers=actor.movers,
                               transport=fusion.Broadcasts())
    tokens = torch.randint(0, VOCAB, (4, 16))                                              # (B, T)
    model(tokens).logsumexp(-1).mean().backward()  # one step: the Adam state (exp_avg, exp_avg_sq) exists
    opt.step()
    opt.zero_grad(set_to_none=True)
    pp = pp_actor(engine, opt, actor.bucket_bytes, type(actor), rank)
    for a in (actor, by_broadcast, pp):  # warm: host buffers allocated once, reused after
        round_trip(a)
    nbytes, off = actor.stats["switch/bytes"], actor.stats["switch/offload_bytes"]
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)
    pp_src, pp_dst = (torch.ones(pp.stats["switch/bytes"], dtype=torch.uint8) for _ in range(2))
    sends = per_rank(pp.stats["switch/received_bytes"])  # what each rank receives, from the other
    outbox, inbox = torch.ones(sends[1 - rank], dtype=torch.uint8), torch.empty(sends[rank], dtype=torch.uint8)

    def exchange():  # one message each way, at once
        for work in (dist.isend(outbox, 1 - rank), dist.irecv(inbox, 1 - rank)):
            work.wait()

    timed = {"trip": lambda: round_trip(actor), "memcpy": lambda: dst.copy_(src),
             "broadcast": lambda: round_trip(by_broadcast), "pp_trip": lambda: round_trip(pp),
             "pp_memcpy": lambda: pp_dst.copy_(pp_src), "pp_send": exchange}
    med = interleaved(timed, {"": actor, "pp_": pp}, args.switch_reps)
    shared = isinstance(actor.transport, shm_transport.SharedMemory)
    return {"switch_round_trip_s": med["trip"], "switch_bytes": nbytes, "memcpy_bound_s": med["memcpy"],
            "switch_broadcast_round_trip_s": med["broadcast"], "switch_host_exchange": shared,
            **{f"switch_{k}_s": med[k] for k in PARTS},
            "switch_offload_bytes": off, "switch_gather_bytes": actor.stats["switch/gather_bytes"],
            "switch_model_params": sum(p.numel() for p in engine.parameters()), "switch_buckets": len(actor.buckets),
            **pp_results(pp, med, sends)}


def round_trip(actor):
    actor.to_rollout()
    actor.to_train()


def interleaved(timed, actors, reps):
    """Medians over reps rounds of the slower rank's seconds: each round runs every timed call in turn, each
    after a barrier (round trip, memcpy, round trip by broadcasts, PP's, ...); and the parts of each actor's
    last round trip, keyed prefix + part ({prefix: actor})."""
    import torch.distributed as dist
    laps = {k: [] for k in timed} | {pre + part: [] for pre in actors for part in PARTS}
    for _ in range(reps):
        for key, run_it in timed.items():
            dist.barrier()
            t0 = time.perf_counter()
            run_it()
            laps[key].append(slowest(time.perf_counter() - t0))
        for pre, actor in actors.items():
            for part in PARTS:
                laps[pre + part].append(slowest(actor.stats[f"switch/{part}_s"]))
    return {k: statistics.median(v) for k, v in laps.items()}


def pp_results(pp, med, sends):
    """The PP -> TP switch's figures: medians of the slower rank; bytes per rank ([rank 0, rank 1])."""
    from plumbing import shm_transport
    return {"pp_switch_round_trip_s": med["pp_trip"], "pp_memcpy_bound_s": med["pp_memcpy"],
            "pp_send_bound_s": med["pp_send"], **{f"pp_switch_{k}_s": med[f"pp_{k}"] for k in PARTS},
            "pp_switch_bytes": per_rank(pp.stats["switch/bytes"]),
            "pp_switch_offload_bytes": per_rank(pp.stats["switch/offload_bytes"]),
            "pp_switch_gather_bytes": per_rank(pp.stats["switch/gather_bytes"]),
            "pp_switch_received_bytes": sends,
            "pp_switch_received_min_bytes": per_rank(pp.stats["switch/received_min_bytes"]),
            "pp_switch_host_exchange": isinstance(pp.transport, shm_transport.SharedMemory),
            "pp_switch_path": pp.path, "pp_switch_buckets": len(pp.buckets)}


def bound_part(args, rank, part, passes):
    """One side of the machine's bound on colocated / separated: the runs' first step, the same prompts,
    sampling seeds and initial weights, so the same responses, run `passes` times from those weights.
    part "alone": the whole batch's rollout and GRPO update in rank 0 alone (rank 1 waits),
    what a separated step costs without its queue and push; "both": half the batch's rollout on each rank
    at once, then the update of a token-balanced share, split as the queue splits (exchanged untimed), with
    no collective while timed: what a colocated step costs without its switch, FSDP's collectives and the
    queue. alone / both is the most colocation can gain on these cores, contention included.
    Returns [(rollout s, update s)] of each pass, the slower rank's."""
    import torch
    import torch.distributed as dist
    import grpo
    import task
    from plumbing.config import grpo_config as algo_config, model_config
    from model import Policy
    from task import sample_seed
    cfg = grpo_config(args, "colocated", None)
    _, _, slot_prompts = task.prompt_streams(args.seed, args.max_digits, 2)  # the runs' first step's draws
    prompts = [slot_prompts(g, 0) for g in range(args.prompts_per_step) for _ in range(args.group_size)]  # B of (P_i,)
    seeds = torch.tensor([sample_seed(args.seed, g, 0, j) for g in range(args.prompts_per_step)
                          for j in range(args.group_size)])                                        # (B,)
    alone_group = [dist.new_group([r]) for r in range(2)][rank]  # grpo's sums over this rank only
    torch.manual_seed(args.seed)
    model = Policy(model_config(cfg))
    init = copy.deepcopy(model.state_dict())
    gc.collect()  # as train_grpo.train does before its loop: no full collection pauses the timed work
    gc.freeze()
    try:
        timed = []
        for _ in range(passes):  # each pass lasts as long as its slower rank, as a run's step does
            model.load_state_dict(init)
            opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=0.0,
                                    foreach=True)  # the runs' AdamW
            dist.barrier()
            mine = (0.0, 0.0)
            if part == "both" or rank == 0:
                pass_rollout_s, samples, score_s = bound_rollout(cfg, rank, part, model, prompts, seeds)
                t0 = time.perf_counter()
                grpo.grpo_update(model, opt, samples, algo_config(cfg), "cpu", alone_group)
                mine = (pass_rollout_s, score_s + time.perf_counter() - t0)
            timed.append((slowest(mine[0]), slowest(mine[1])))
        return timed
    finally:
        gc.unfreeze()


def bound_rollout(cfg, rank, part, model, prompts, seeds):
    """The bound's rollout of this rank's rows of the batch (prompts, B of (P_i,); seeds (B,)) and their
    scores (timed), and its share of the batch to train (exchanged untimed, part "both").
    Returns (rollout s, grpo.Samples, scoring s)."""
    import torch
    import torch.distributed as dist
    import distqueue
    import grpo
    import task
    from model import generate
    from plumbing.runlog import STALE_FACTS
    B = len(prompts)
    lo, hi = (0, B) if part == "alone" else (rank * B // 2, (rank + 1) * B // 2)  # this rank's rollout rows
    t0 = time.perf_counter()
    with torch.no_grad():
        gen = generate(model, prompts[lo:hi], seeds[lo:hi], cfg.max_new_tokens, task.EOS, task.PAD,
                       cfg.temperature, cfg.top_p)
    t1 = time.perf_counter()
    rewards = torch.tensor([task.score(p, r) for p, r in zip(prompts[lo:hi], gen.tokens)])  # (b,)
    rows = list(zip(range(lo, hi), gen.tokens, gen.logprobs, grpo.group_advantages(rewards, cfg.group_size)))
    t2 = time.perf_counter()
    if part == "both":  # the queue's token-balanced split of the whole batch (untimed: the queue's work)
        everyone = [None, None]
        dist.all_gather_object(everyone, rows)
        rows = sorted(everyone[0] + everyone[1], key=lambda row: (row[0] % (B // 2), row[0] // (B // 2)))  # queue ids
        sizes = [len(prompts[i]) + 2 * len(tok) + len(STALE_FACTS) for i, tok, _, _ in rows]
        homes = [int(i >= B // 2) for i, *_ in rows]  # the rank that generated the row
        rows = [rows[j] for j in distqueue.balance_split(sizes, 2, homes)[rank]]
    ids, tokens, logprobs, advantages = zip(*rows)
    samples = grpo.Samples([prompts[i] for i in ids], list(tokens), list(logprobs), torch.stack(advantages))
    return t1 - t0, samples, t2 - t1


def worker(rank, args, port, results, tmp):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)  # 2 processes x 1 thread on 2 cores
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=600))
    dist.init_process_group("gloo", store=dist.PrefixStore("switch/", store), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=600))
    try:
        switch = bench_switch(args, rank, tmp)
        if rank == 0:
            print_switch(switch)
        bounds, runs = bench_rounds(args, rank, store, tmp) if not args.switch_only else ([], {})
        if rank == 0:
            results.put((switch, bounds, runs))
    finally:
        dist.destroy_process_group()


def switch_ratios(switch):
    trip = switch["switch_round_trip_s"]
    return {"round_trip_over_memcpy": round(trip / switch["memcpy_bound_s"], 2),
            "broadcast_round_trip_over_memcpy": round(switch["switch_broadcast_round_trip_s"]
                                                      / switch["memcpy_bound_s"], 2),
            "pp_round_trip_over_memcpy": round(switch["pp_switch_round_trip_s"] / switch["pp_memcpy_bound_s"], 2),
            "pp_gather_over_send": round(switch["pp_switch_gather_s"] / switch["pp_send_bound_s"], 2)}


def print_switch(switch):
    ms = {k: switch[f"switch_{k}_s"] * 1e3 for k in PARTS}
    ratios = switch_ratios(switch)
    how = "through shared memory" if switch["switch_host_exchange"] else "by broadcasts"
    print(f"switch: round trip {switch['switch_round_trip_s'] * 1e3:.1f} ms for {switch['switch_bytes'] / 2 ** 20:.1f} "
          f"MiB, gathered {how} = to_rollout (offload {ms['offload']:.1f} + alloc {ms['alloc']:.1f} + gather "
          f"{ms['gather']:.1f} ms) + to_train (free {ms['free']:.1f} + reload {ms['reload']:.1f} ms) | memcpy "
          f"{switch['memcpy_bound_s'] * 1e3:.1f} ms (x{ratios['round_trip_over_memcpy']:.2f}) | the same switch "
          f"gathering by broadcasts {switch['switch_broadcast_round_trip_s'] * 1e3:.1f} ms "
          f"(x{ratios['broadcast_round_trip_over_memcpy']:.2f})", flush=True)
    ms = {k: switch[f"pp_switch_{k}_s"] * 1e3 for k in PARTS}
    mib = {k: "/".join(f"{b / 2 ** 20:.1f}" for b in switch[f"pp_switch_{k}"])
           for k in ("bytes", "received_bytes", "received_min_bytes")}
    print(f"switch PP (2 stages, a rank each) -> TP: round trip {switch['pp_switch_round_trip_s'] * 1e3:.1f} ms for "
          f"{mib['bytes']} MiB (rank 0/1), {switch['pp_switch_path']} = to_rollout (offload {ms['offload']:.1f} + "
          f"alloc {ms['alloc']:.1f} + gather {ms['gather']:.1f} ms) + to_train (free {ms['free']:.1f} + reload "
          f"{ms['reload']:.1f} ms) | memcpy {switch['pp_memcpy_bound_s'] * 1e3:.1f} ms "
          f"(x{ratios['pp_round_trip_over_memcpy']:.2f}) | received {mib['received_bytes']} MiB, the least "
          f"{mib['received_min_bytes']}: one send each way {switch['pp_send_bound_s'] * 1e3:.1f} ms, the gather "
          f"x{ratios['pp_gather_over_send']:.2f} it", flush=True)


def summarise(args, switch, bounds, runs):
    """The JSON object: medians over the rounds, and each round's share of its own bound."""
    med = {m: {k: statistics.median(r[i] for r in runs[m]) for i, k in
               enumerate(("tokens_per_s", "rollout_s", "train_s", "switch_s", "cores"))} for m in MODES}
    for m in MODES:
        print(f"{m:13s} | {med[m]['tokens_per_s']:7.0f} tok/s | per step: rollout {med[m]['rollout_s']:.2f}s "
              f"train {med[m]['train_s']:.2f}s switch/push {med[m]['switch_s']:.3f}s | "
              f"cores used {med[m]['cores']:.2f} (median of {args.repeats})", flush=True)
    ratio = [c[0] / s[0] for c, s in zip(runs["colocated"], runs["separated"])]  # per round
    share = [r / b["bound"] for r, b in zip(ratio, bounds)]
    res = {"tokens_per_s": {m: round(med[m]["tokens_per_s"], 1) for m in MODES},
           "colocated_over_separated": round(med["colocated"]["tokens_per_s"] / med["separated"]["tokens_per_s"], 3),
           "colocated_all_over_separated": round(med["colocated-all"]["tokens_per_s"]
                                                 / med["separated"]["tokens_per_s"], 3),
           "bound": round(statistics.median(b["bound"] for b in bounds), 3),
           "colocated_over_separated_over_bound": round(statistics.median(share), 3),
           "rounds_share_of_bound": [round(x, 3) for x in share],
           **{f"bound_{k}": round(statistics.median(b[k] for b in bounds), 4) for k in bounds[0] if k != "bound"},
           **{k: (round(v, 5) if isinstance(v, float) else v) for k, v in switch.items()},
           **switch_ratios(switch),
           "cores_used": {m: round(med[m]["cores"], 2) for m in MODES},
           "runs_tokens_per_s": {m: [round(r[0], 1) for r in runs[m]] for m in MODES}}
    print(f"colocated / separated {res['colocated_over_separated']:.3f}, the machine's bound {res['bound']:.3f}; "
          f"each round's share of its own bound {', '.join(f'{x:.2f}' for x in share)}: median "
          f"{res['colocated_over_separated_over_bound']:.2f}", flush=True)
    res["targets_met"] = {  # on the unrounded figures
        "colocated_over_separated_over_bound>=0.95": statistics.median(share) >= 0.95,
        "switch_round_trip_s<=1.5*memcpy_bound_s": switch["switch_round_trip_s"] <= 1.5 * switch["memcpy_bound_s"]}
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("GRPO work, the same in every mode")
    g.add_argument("--steps", type=int, default=2, help="GRPO steps per run")
    g.add_argument("--repeats", type=int, default=5, help="interleaved rounds over the three modes (median)")
    g.add_argument("--warmup-rounds", type=int, default=1, help="rounds run first and not counted")
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
    g.add_argument("--switch-reps", type=int, default=25, help="round trips timed (median)")
    g.add_argument("--switch-only", action="store_true", help="measure the switch only, not the three modes")
    args = p.parse_args(argv)
    print("bench/fusion.py: 2 gloo ranks x 1 thread; regime: compute-bound rollout and training "
          f"({args.prompts_per_step} prompts x {args.group_size} responses per step)", flush=True)
    print("config: " + json.dumps(vars(args)), flush=True)
    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    tmp = tempfile.mkdtemp(prefix="bench_fusion_")  # the runs' files, shared by the ranks, removed at the end
    procs = [ctx.Process(target=worker, args=(r, args, port, results, tmp)) for r in range(2)]
    try:
        for pr in procs:
            pr.start()
        res = None
        while res is None and all(pr.exitcode in (None, 0) for pr in procs):
            with contextlib.suppress(queue.Empty):
                res = results.get(timeout=1)
        for pr in procs:
            if res is None and pr.is_alive():  # a rank failed: the other may wait in a collective until its timeout
                pr.terminate()
            pr.join()
    finally:  # also after an interrupt: no rank left running, then no folder
        for pr in procs:
            if pr.is_alive():
                pr.terminate()
                pr.join()
        shutil.rmtree(tmp, ignore_errors=True)
    if res is None:
        raise SystemExit(f"a rank failed (its traceback is above): exit codes {[pr.exitcode for pr in procs]}")
    switch, bounds, runs = res
    if args.switch_only:
        print(json.dumps(switch | switch_ratios(switch)), flush=True)
        return
    print(json.dumps(summarise(args, switch, bounds, runs)), flush=True)


if __name__ == "__main__":
    main()
