"""Gradient sync across nodes (gradsync.py): the bytes that cross nodes, what compression costs in accuracy, and
what overlapping the sync with the backward buys, each side by side in one run of this script.

    python bench/gradsync.py                                  # both parts (about 40 min on 2 cores)
    python bench/gradsync.py --part traffic --seeds 0 --steps 20
    python bench/gradsync.py --part overlap

traffic: world 4 as 2 nodes of 2 (`torchrun --nproc_per_node=4 train_grpo.py --nodes 2 --grad-compress C
  --seed S --steps N --rl-seconds 0`), for each compression C and seed S, the warm-up included: the bytes
  rank 0 sent across nodes over the run (values, indices and scales: everything; every rank sends as many),
  against the bytes the full-precision average sent in the same run; and the final held-out accuracy, with
  each compression's mean and spread (max - min) over the seeds.
overlap: the same work (seed 0, a wider model so that the sync weighs: OVERLAP_FLAGS), compressions none and
  topk-int8, three ways: one FSDP unit, a unit per block, a unit per block with --grad-overlap 1: the mean
  RL train step (time/train_s), its ratios (overlap over block: what overlapping buys; block over one unit:
  what a unit per block costs), and the exposed sync time per step from the run's spans (grad_sync inside
  the hooks, grad_sync_wait before the clip), over the RL steps.
Runs go to bench/out/gradsync/; the last line printed is one JSON object.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from plumbing import timeline  # noqa: E402

# the RL config these figures are for, whatever the run's defaults
PINNED = ["--kl-coef", "0", "--lr", "5e-4", "--lr-decay", "1"]
OVERLAP_FLAGS = ["--d-model", "128", "--d-expert", "512", "--n-layers", "4",
                 "--warmup-steps", "20", "--eval-every", "1000", "--eval-prompts", "64", "--bucket-kb", "1024"]


def train(out, flags):
    """One torchrun run of train_grpo.py at world 4; returns (summary, metrics lines)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
           os.path.join(ROOT, "train_grpo.py"), "--nodes", "2", "--rl-seconds", "0", *PINNED, "--out", out, *flags]
    print(" ".join(cmd[2:]), flush=True)
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if r.returncode:
        sys.exit(f"the run failed ({r.returncode}):\n{r.stderr[-4000:]}")
    lines = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return json.load(open(os.path.join(out, "summary.json"))), lines


def traffic(args):
    """Per compression: bytes sent across nodes over the run, the ratio to full precision, accuracy per seed."""
    runs = {}
    for seed in args.seeds:
        for c in args.compress:
            summary, lines = train(os.path.join(args.out, f"{c}_seed{seed}"),
                                   ["--grad-compress", c, "--seed", str(seed), "--steps", str(args.steps),
                                    "--eval-every", str(args.steps)])
            runs[(c, seed)] = {"sent": lines[-1]["gradsync/sent_bytes"], "dense": lines[-1]["gradsync/dense_bytes"],
                               "before": summary["eval_accuracy_before"], "after": summary["eval_accuracy_after"]}
            r = runs[(c, seed)]
            print(f"  {c:10s} seed {seed}: sent {r['sent'] / 2**20:8.1f} MiB across nodes (full precision: "
                  f"{r['dense'] / 2**20:.1f}) | accuracy {r['before']:.3f} -> {r['after']:.3f}", flush=True)
    out = {}
    for c in args.compress:
        mine = [runs[(c, s)] for s in args.seeds]
        after = [r["after"] for r in mine]
        out[c] = {"sent_mib": round(statistics.mean(r["sent"] for r in mine) / 2**20, 2),
                  "fewer_bytes_x": round(statistics.mean(r["dense"] / r["sent"] for r in mine), 2),
                  "accuracy": after, "accuracy_mean": round(statistics.mean(after), 4),
                  "accuracy_spread": round(max(after) - min(after), 4)}
        print(f"{c:10s}: {out[c]['fewer_bytes_x']:.2f}x fewer bytes across nodes than full precision | held-out "
              f"accuracy {out[c]['accuracy_mean']:.4f} (seeds {args.seeds}: {after}, spread "
              f"{out[c]['accuracy_spread']:.3f})", flush=True)
    return out


def exposed_sync_s(out_dir, steps):
    """Rank 0's seconds blocked on the cross-node sync per RL train step: its grad_sync and grad_sync_wait spans
    that lie inside its train spans."""
    spans = [s for s in timeline.load_spans(out_dir) if s["rank"] == 0]
    trains = [(s["start"], s["end"]) for s in spans if s["name"] == "train"]
    inside = [s["end"] - s["start"] for s in spans if s["name"] in ("grad_sync", "grad_sync_wait")
              and any(a <= s["start"] and s["end"] <= b for a, b in trains)]
    return sum(inside) / steps


OVERLAP_RUNS = {"model": ["--fsdp-units", "model", "--grad-overlap", "0"],   # one unit: its sync after the backward
                "block": ["--fsdp-units", "block", "--grad-overlap", "0"],   # a unit per block, each synced in its hook
                "overlap": ["--fsdp-units", "block", "--grad-overlap", "1"]}  # ... started in its hook, waited at the clip


def overlap(args):
    """Per compression, the same work three ways (OVERLAP_RUNS): the mean RL train step and the exposed sync per step;
    overlap over block (what overlapping buys) and block over model (what a unit per block costs), as ratios."""
    out = {}
    for c in ("none", "topk-int8"):
        row = {}
        for name, flags in OVERLAP_RUNS.items():
            run_dir = os.path.join(args.out, f"{name}_{c}")
            _, lines = train(run_dir, [*OVERLAP_FLAGS, *flags, "--grad-compress", c, "--steps", str(args.overlap_steps)])
            rl = lines[1:]
            row[name] = {"train_ms": round(1e3 * statistics.mean(l["time/train_s"] for l in rl), 1),
                         "exposed_ms": round(1e3 * exposed_sync_s(run_dir, len(rl)), 1)}
        out[c] = dict(row, overlap_over_block=round(row["overlap"]["train_ms"] / row["block"]["train_ms"], 3),
                      block_over_model=round(row["block"]["train_ms"] / row["model"]["train_ms"], 3))
        print(f"{c:10s}: train step (exposed sync) per step: " + ", ".join(
            f"{name} {r['train_ms']} ms ({r['exposed_ms']} ms)" for name, r in row.items()) +
              f" | overlap / block {out[c]['overlap_over_block']:.3f}x, block / model {out[c]['block_over_model']:.3f}x",
              flush=True)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=("all", "traffic", "overlap"), default="all")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--compress", nargs="+", default=["none", "int8", "topk-int8"])
    p.add_argument("--steps", type=int, default=150, help="RL steps of each traffic run")
    p.add_argument("--overlap-steps", type=int, default=30, help="RL steps of each overlap run")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "out", "gradsync"))
    args = p.parse_args()
    result = {}
    if args.part in ("all", "traffic"):
        result["traffic"] = traffic(args)
    if args.part in ("all", "overlap"):
        result["overlap"] = overlap(args)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
