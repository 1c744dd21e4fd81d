"""Benchmark checkpoint.py: saving and loading an FSDP2 policy with its AdamW state, against the disk's own speed.

    python bench/checkpoint.py                # the default run, 2 gloo ranks, under 2 minutes on 2 CPU cores
    python bench/checkpoint.py --help         # every knob

One process tree: 2 spawned ranks, gloo, 1 thread each. The policy (model.Policy, at least 10M parameters)
is sharded with FSDP2 as train_grpo.build_policy does (each block, then the root, over both ranks) with AdamW
over optimizer_groups (plumbing/run.py); one forward/backward/step on random tokens makes
the Adam state exist. Then, --repeats rounds, each:

  save_s        get_state_dict(model, optimizer) + checkpoint.write(...): DCP shards, each rank's own file,
                meta.json, the rename; timed on every rank from a barrier, the slowest rank's time
  disk_bound_s  a plain write of the same bytes: each rank writes its share of the checkpoint folder (its DCP
                shard file and rank_<r>.pt; rank 0 also .metadata and meta.json) as one buffer, one f.write,
                flush and os.fsync, into the same filesystem folder, both ranks at once; the slowest rank
  load_s        into a fresh FSDP2 model and optimizer: get_state_dict (the target structure),
                checkpoint.read_dcp, set_state_dict; the slowest rank. The files were just written, so they
                are read from the page cache, as a resume right after a save would read them

The save and the plain write alternate which goes first, each after an untimed os.sync(), so that a
neighbour on the cores or the disk hits both alike and neither writes back the other's dirty pages;
each figure is the median over the rounds, and save_over_disk_bound is save_s / disk_bound_s, the
target's own terms (paired_ratio_median, the median of the rounds' own ratios, is printed beside it).
Every load is checked: the gathered parameters (checkpoint.dense_state_dict) and this rank's
optimizer shards must hash to the saved ones, or the run fails. bytes is the size of the step_<N> folder.
One untimed save and load first warms the imports and DCP's first calls. The checkpoints go to a temporary
folder under --dir (default: the system's temporary folder), removed at the end.

Target: save_s <= 2 * disk_bound_s. The last line printed is one JSON object.

Shapes: W = 2 ranks; D d_model, F d_expert, E experts, L blocks.
"""
import argparse
import contextlib
import datetime
import hashlib
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

MIN_PARAMS = 10_000_000
TARGET_RATIO = 2.0  # save_s <= TARGET_RATIO * disk_bound_s
LR, BETAS = 7e-4, (0.9, 0.98)  # train_grpo's AdamW, weight decay 0 (the bytes and times do not depend on them)
FILL = 7  # the plain write's byte value


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


def timed(fn):
    """fn() on every rank after a sync and a barrier: (the slowest rank's seconds, fn's result). The sync
    (untimed) writes back what earlier writes left dirty, so that no write pays for another's."""
    import torch.distributed as dist
    os.sync()
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    return slowest(time.perf_counter() - t0), out


def policy_config(args):
    from plumbing.config import Config
    return Config(d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads, n_experts=args.n_experts,
                  d_expert=args.d_expert, seed=args.seed, device="cpu")


def build(args, seed):
    """The policy sharded as train_grpo.build_policy shards it, and its AdamW (no state yet)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from plumbing.config import model_config
    from plumbing.run import optimizer_groups
    from model import Policy
    torch.manual_seed(seed)  # the same initial weights on every rank
    model = Policy(model_config(policy_config(args)))
    mesh = init_device_mesh("cpu", (2,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(optimizer_groups(model), lr=LR, betas=BETAS, weight_decay=0.0)
    return model, opt


def train_step(args, model, opt):
    """One forward/backward/step on random tokens: the Adam state (exp_avg, exp_avg_sq, step) exists."""
    import torch
    from task import VOCAB
    tokens = torch.randint(0, VOCAB, (args.batch, args.seq_len))                        # (B, T)
    model(tokens).logsumexp(-1).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def optim_sha256(opt):
    """A hash of this rank's optimizer state: every state tensor's local shard, in parameter order."""
    import torch
    h = hashlib.sha256()
    for group in opt.param_groups:
        for p in group["params"]:
            for key, v in sorted(opt.state[p].items()):
                t = (v.to_local() if hasattr(v, "to_local") else v).detach().contiguous()
                h.update(f"{key}:{tuple(t.shape)}:{t.dtype};".encode())
                h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def fingerprint(model, opt):
    """(hash of the whole gathered model, hash of this rank's optimizer shards): collective."""
    from plumbing import checkpoint
    return checkpoint.params_sha256(checkpoint.dense_state_dict(model)), optim_sha256(opt)


def own_state():
    import torch
    return {"rng": {"torch": torch.get_rng_state()}}


def save(args, out, step, rank, model, opt):
    """What checkpoint.save does for a trainer: get_state_dict, then checkpoint.write. Returns the folder."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from plumbing import checkpoint
    m, o = get_state_dict(model, opt)  # DCP gets tensors only; the param_groups go to the rank file
    meta = {"world": 2, "config": vars(args)}
    own = dict(own_state(), optim_groups=o["param_groups"])
    return checkpoint.write(out, step, rank, own, meta, {"model": m, "optim": {"state": o["state"]}}, dcp_group=None,
                            keep_last=args.keep_last, group=None)


def load(path, model, opt):
    """What checkpoint.resume does for a trainer's DCP state."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from plumbing import checkpoint
    m, o = get_state_dict(model, opt)
    state = {"model": m, "optim": {"state": o["state"]}}  # this run's param_groups, as checkpoint.resume does
    checkpoint.read_dcp(path, state)
    set_state_dict(model, opt, model_state_dict=state["model"],
                   optim_state_dict=dict(state["optim"], param_groups=o["param_groups"]))


def share(path, rank):
    """This rank's bytes of a checkpoint folder: its DCP shard file(s) and own file; rank 0 also the rest."""
    mine = {f"rank_{rank}.pt"}
    names = os.listdir(path)
    ranked = {n for n in names if (n.startswith("__") and n.endswith(".distcp")) or n.startswith("rank_")}
    return sum(os.path.getsize(os.path.join(path, n)) for n in names
               if n in mine or n.startswith(f"__{rank}_") or (rank == 0 and n not in ranked))


def folder_bytes(path):
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))


def plain_write(path, buf):
    """One buffer, one write, flush, fsync: the disk's own time for these bytes. Returns (write s, fsync s)."""
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        f.write(buf.numpy())
        f.flush()
        t1 = time.perf_counter()
        os.fsync(f.fileno())
    return t1 - t0, time.perf_counter() - t1


def clear(out, rank):
    """Untimed, before each save: the previous checkpoints removed (rank 0), so no save times a deletion."""
    import torch.distributed as dist
    if rank == 0:
        shutil.rmtree(os.path.join(out, "checkpoints"), ignore_errors=True)
    dist.barrier()


def one_round(args, out, rep, rank, model, opt, buf):
    """A save and a plain write (alternating which first), then a load into a fresh pair, checked. Returns
    this round's figures (the slowest rank's)."""
    from plumbing import checkpoint
    fig = {}
    plain_path = os.path.join(out, f"plain_{rank}.bin")
    for what in (("save", "plain") if rep % 2 == 0 else ("plain", "save")):
        if what == "save":
            clear(out, rank)
            fig["save_s"], path = timed(lambda: save(args, out, rep + 1, rank, model, opt))
        else:
            with contextlib.suppress(FileNotFoundError):
                os.remove(plain_path)  # untimed: a fresh file, as the save's are
            fig["disk_bound_s"], (w, s) = timed(lambda: plain_write(plain_path, buf))
            fig["plain_write_s"], fig["plain_fsync_s"] = slowest(w), slowest(s)
    fig["bytes"] = folder_bytes(path)
    checkpoint.read_meta(path)  # every file there, of the size meta.json lists
    fresh, fresh_opt = build(args, args.seed + 1000 + rep)  # other weights than the saved ones, no Adam state
    fig["load_s"], _ = timed(lambda: load(path, fresh, fresh_opt))
    fig["match"] = fingerprint(fresh, fresh_opt)
    return fig


def worker(rank, args, out, port, results):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)  # 2 processes x 1 thread on 2 cores
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=args.pg_timeout_s))
    try:
        model, opt = build(args, args.seed)
        params = sum(p.numel() for p in model.parameters())  # DTensors: numel is the full parameter's
        assert params >= MIN_PARAMS, f"the policy has {params} parameters, fewer than {MIN_PARAMS}: raise --d-expert"
        train_step(args, model, opt)
        saved = fingerprint(model, opt)
        path = save(args, out, 0, rank, model, opt)  # warm: imports and DCP's first calls, untimed
        mine, theirs = share(path, rank), share(path, 1 - rank)
        assert folder_bytes(path) == mine + theirs, "the ranks' shares miss a file of the checkpoint"
        warm, warm_opt = build(args, args.seed + 1)
        load(path, warm, warm_opt)
        del warm, warm_opt
        buf = torch.full((mine,), FILL, dtype=torch.uint8)
        rounds = []
        for rep in range(args.repeats):
            rounds.append(one_round(args, out, rep, rank, model, opt, buf))
            if slowest(float(rounds[-1]["match"] != saved)):  # every rank fails if one does
                raise AssertionError(f"round {rep + 1}: the loaded state differs from the saved one on a rank "
                                     f"(rank {rank}: params/optimizer hashes {rounds[-1]['match']}, saved {saved})")
            if rank == 0:
                r = rounds[-1]
                print(f"  round {rep + 1}/{args.repeats}: save {r['save_s']:.3f} s | plain write "
                      f"{r['disk_bound_s']:.3f} s | load {r['load_s']:.3f} s | {r['bytes'] / 2 ** 20:.1f} MiB | "
                      f"loaded state matches", flush=True)
        if rank == 0:
            results.put({"params": params, "rounds": rounds, "hash": saved[0],
                         "shares": [mine, theirs]})
    finally:
        dist.destroy_process_group()


def report(args, res):
    """The table and the target; returns the JSON summary."""
    rounds = res["rounds"]
    med = {k: statistics.median(r[k] for r in rounds) for k in ("save_s", "disk_bound_s", "load_s",
                                                                "plain_write_s", "plain_fsync_s")}
    ratio = med["save_s"] / med["disk_bound_s"]  # the target's own terms
    paired = statistics.median(r["save_s"] / r["disk_bound_s"] for r in rounds)
    nbytes = rounds[-1]["bytes"]
    mib = 2 ** 20
    print(f"policy: {res['params']:,} parameters (D {args.d_model}, L {args.n_layers}, E {args.n_experts}, "
          f"F {args.d_expert}), FSDP2 over 2 gloo ranks, AdamW state | checkpoint {nbytes / mib:.1f} MiB "
          f"(rank 0 {res['shares'][0] / mib:.1f} MiB, rank 1 {res['shares'][1] / mib:.1f} MiB)")
    print(f"{'figure':14s} | {'median s':>9s} | {'MiB/s':>7s} | rounds (s)")
    for k in ("save_s", "disk_bound_s", "load_s"):
        runs = " ".join(f"{r[k]:.3f}" for r in rounds)
        print(f"{k:14s} | {med[k]:9.3f} | {nbytes / mib / med[k]:7.0f} | {runs}")
    print(f"plain write: {med['plain_write_s']:.3f} s into the page cache + {med['plain_fsync_s']:.3f} s of fsync")
    met = ratio <= TARGET_RATIO
    print(f"save_over_disk_bound {ratio:.2f} (the median rounds' own ratios: {paired:.2f}); target save_s <= "
          f"{TARGET_RATIO:g} x disk_bound_s: {'met' if met else 'NOT met'}")
    out = {"save_s": round(med["save_s"], 4), "load_s": round(med["load_s"], 4), "bytes": nbytes,
           "disk_bound_s": round(med["disk_bound_s"], 4), "save_over_disk_bound": round(ratio, 3),
           "paired_ratio_median": round(paired, 3),
           "target_met": met, "params": res["params"], "repeats": args.repeats,
           "plain_write_s": round(med["plain_write_s"], 4), "plain_fsync_s": round(med["plain_fsync_s"], 4),
           "rank_bytes": res["shares"], "params_sha256": res["hash"][:16]}
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("policy (at least 10M parameters)")
    g.add_argument("--d-model", type=int, default=384, help="model width D")
    g.add_argument("--n-layers", type=int, default=4, help="transformer blocks L")
    g.add_argument("--n-heads", type=int, default=4, help="attention heads")
    g.add_argument("--n-experts", type=int, default=8, help="experts per MoE layer E")
    g.add_argument("--d-expert", type=int, default=768, help="hidden width of one expert F")
    g.add_argument("--batch", type=int, default=4, help="sequences of the one training step")
    g.add_argument("--seq-len", type=int, default=32, help="tokens per sequence of the one training step")
    g.add_argument("--seed", type=int, default=0, help="seed of the initial weights")
    g = p.add_argument_group("measurement")
    g.add_argument("--repeats", type=int, default=11, help="rounds of save, plain write and load (median)")
    g.add_argument("--keep-last", type=int, default=1, help="checkpoint.write's keep_last")
    g.add_argument("--dir", default=tempfile.gettempdir(), help="where the temporary checkpoint folder goes")
    g.add_argument("--pg-timeout-s", type=int, default=300, help="timeout of the process group")
    args = p.parse_args(argv)
    out = tempfile.mkdtemp(prefix="bench_checkpoint_", dir=args.dir)
    runs = Path(__file__).resolve().parent.parent / "runs"
    same_fs = os.stat(out).st_dev == os.stat(runs if runs.exists() else runs.parent).st_dev
    print(f"bench/checkpoint.py: 2 gloo ranks x 1 thread; checkpoints in {out} (same filesystem as runs/: "
          f"{'yes' if same_fs else 'no'})", flush=True)
    print("config: " + json.dumps(vars(args)), flush=True)
    try:
        ctx = mp.get_context("spawn")
        results, port = ctx.Queue(), free_port()
        procs = [ctx.Process(target=worker, args=(r, args, out, port, results)) for r in range(2)]
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
        if res is None or any(pr.exitcode for pr in procs):
            raise SystemExit(f"a rank failed: exit codes {[pr.exitcode for pr in procs]}")
    finally:
        shutil.rmtree(out, ignore_errors=True)
    print(json.dumps(report(args, res)), flush=True)


if __name__ == "__main__":
    main()
